//! The keyed safety check: three sidecars serve one family of keyed locks on a real backend,
//! eight workers per sidecar each take random keys out of fifty (a fresh owner per acquisition,
//! as a request id would be), ask about the key while they "work", and release it, while a
//! sidecar is killed, paused or cut from the backend, or the backend restarts, at random.
//!
//! It fails when two owners' claims on one key certainly overlap, when a key's token does not
//! rise from one holder to the next (or two owners get one token), or when a worker is refused
//! a key after waiting through a stretch in which nobody could hold it, with no fault nearby.
//!
//! "Certainly" is as in [`crate::safety`]: a 200 answer means the sidecar claimed for that owner
//! at some instant between the request and the answer, so an owner's claim surely covers
//! [first 200 received, last 200 sent], and two of those that intersect are two holders.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::safety::{
    Backend, CALM_MAX_MS, CALM_MIN_MS, LEASE, RECOVERY_SLACK, RENEW, Slot, TIMING, Target, inject,
    longest_gap, surely_ordered,
};
use crate::{Sidecar, http, unique_lock};

pub const SIDECARS: usize = 3;
pub const WORKERS_PER_SIDECAR: usize = 8;
pub const KEYS: usize = 50;
/// How long a worker waits for a key, and how long it may keep one without extending it.
const WAIT: Duration = Duration::from_secs(3);
const HOLD: Duration = Duration::from_secs(3);
/// How many times a worker asks about its key while it works, and the pause between.
const WORK_POLLS: usize = 4;
const WORK_PAUSE_MS: std::ops::Range<u64> = 2..15;

/// One answer about one owner's hold on one key.
#[derive(Debug, Clone)]
struct Sample {
    key: usize,
    /// `slot/generation/owner`: unique per acquisition.
    owner: String,
    sent: Instant,
    received: Instant,
    token: Option<u64>,
}

/// A worker's acquisition that was refused (409) after its full wait.
#[derive(Debug, Clone, Copy)]
struct Refusal {
    key: usize,
    sent: Instant,
    received: Instant,
}

/// How a holding ended, as its worker saw it.
#[derive(Debug, Clone)]
struct Ending {
    owner: String,
    /// The release was answered 200 at this instant.
    released: Option<Instant>,
}

#[derive(Default)]
struct Log {
    samples: Vec<Sample>,
    refusals: Vec<Refusal>,
    endings: Vec<Ending>,
    /// When each fault began and ended.
    faults: Vec<(Instant, Instant)>,
}

/// The figures of one run.
#[derive(Debug, Default)]
pub struct Report {
    pub target: &'static str,
    pub duration: Duration,
    pub seed: u64,
    pub acquisitions: usize,
    pub refusals: usize,
    pub faults: BTreeMap<&'static str, usize>,
    pub violations: Vec<String>,
}

impl Report {
    pub fn summary(&self) -> String {
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        format!(
            "{:<18} keyed {:>5.0}s  acquisitions {:>5}  refused after waiting {:>4}  faults {:>3} ({})  violations {}  seed {}",
            self.target,
            self.duration.as_secs_f64(),
            self.acquisitions,
            self.refusals,
            self.faults.values().sum::<usize>(),
            faults.join(", "),
            self.violations.len(),
            self.seed,
        )
    }
}

fn token_of(body: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()?
        .get("fencingToken")?
        .as_u64()
}

/// One worker: take a random key, ask about it a few times, release it; again until `stop`.
fn worker(
    slot: usize,
    index: usize,
    family: String,
    addr: Arc<Mutex<(SocketAddr, u32)>>,
    log: Arc<Mutex<Log>>,
    stop: Arc<AtomicBool>,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let key = rng.random_range(0..KEYS);
        let (target, generation) = *addr.lock().unwrap();
        n += 1;
        let owner = format!("s{slot}g{generation}w{index}n{n}");
        let path = format!("/locks/{family}/keys/k{key}");
        let sent = Instant::now();
        let answer = http(
            target,
            "POST",
            &format!(
                "{path}/acquire?owner={owner}&wait={}ms&hold={}ms",
                WAIT.as_millis(),
                HOLD.as_millis()
            ),
        );
        let received = Instant::now();
        let token = match answer {
            Ok(reply) if reply.status == 200 => token_of(&reply.body),
            Ok(reply) if reply.status == 409 => {
                // Only a refusal after the whole wait says the key was never free for us.
                if received - sent >= WAIT {
                    log.lock().unwrap().refusals.push(Refusal {
                        key,
                        sent,
                        received,
                    });
                }
                continue;
            }
            // 503 (cannot tell), or the sidecar killed under us: try again shortly.
            _ => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        let Some(token) = token else { continue };
        log.lock().unwrap().samples.push(Sample {
            key,
            owner: owner.clone(),
            sent,
            received,
            token: Some(token),
        });
        for _ in 0..rng.random_range(1..=WORK_POLLS) {
            std::thread::sleep(Duration::from_millis(rng.random_range(WORK_PAUSE_MS)));
            let sent = Instant::now();
            let Ok(reply) = http(target, "GET", &format!("{path}?owner={owner}")) else {
                break;
            };
            let received = Instant::now();
            let token = (reply.status == 200)
                .then(|| token_of(&reply.body))
                .flatten();
            log.lock().unwrap().samples.push(Sample {
                key,
                owner: owner.clone(),
                sent,
                received,
                token,
            });
            if reply.status == 409 {
                break; // lost it (hold lapsed, lease lost): nothing to release
            }
        }
        let released = http(target, "POST", &format!("{path}/release?owner={owner}"))
            .ok()
            .filter(|r| r.status == 200)
            .map(|_| Instant::now());
        log.lock().unwrap().endings.push(Ending { owner, released });
    }
}

/// Run the keyed check against `target` for `duration`.
pub fn run(target: Target, duration: Duration, seed: u64) -> Report {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut backend = Backend::start(target);
    let family = unique_lock("keyed");
    let plain = unique_lock("plain");
    let args: Vec<&str> = TIMING
        .iter()
        .copied()
        .chain(["--keyed", &family, "--mode", "on-demand"])
        .collect();
    let start_sidecar = |identity: &str, url: &str| Sidecar::start(identity, url, &plain, &args);
    let mut slots: Vec<Slot> = (0..SIDECARS)
        .map(|i| Slot::start(i, format!("pod-{i}"), &backend, &start_sidecar))
        .collect();

    let log = Arc::new(Mutex::new(Log::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = slots
        .iter()
        .enumerate()
        .flat_map(|(s, slot)| (0..WORKERS_PER_SIDECAR).map(move |w| (s, w, slot.addr.clone())))
        .map(|(s, w, addr)| {
            let (family, log, stop) = (family.clone(), log.clone(), stop.clone());
            let seed = rng.random();
            std::thread::spawn(move || worker(s, w, family, addr, log, stop, seed))
        })
        .collect();

    let mut report = Report {
        target: target.name(),
        seed,
        ..Report::default()
    };
    let began = Instant::now();
    while began.elapsed() < duration {
        std::thread::sleep(Duration::from_millis(
            rng.random_range(CALM_MIN_MS..CALM_MAX_MS),
        ));
        let fault = backend.faults()[rng.random_range(0..backend.faults().len())];
        let victim = rng.random_range(0..slots.len());
        let started = Instant::now();
        inject(fault, &mut slots[victim], &mut backend, &start_sidecar);
        log.lock().unwrap().faults.push((started, Instant::now()));
        *report.faults.entry(fault.name()).or_default() += 1;
    }
    report.duration = began.elapsed();
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        let _ = worker.join();
    }
    let log = std::mem::take(&mut *log.lock().unwrap());
    analyse(&log, began, &mut report);
    drop(slots);
    report
}

/// One owner's claim on one key.
#[derive(Debug, Clone)]
struct Holding {
    owner: String,
    token: u64,
    /// The acquisition's request and answer: the claim began in between.
    acquire_sent: Instant,
    acquire_received: Instant,
    certain_from: Instant,
    certain_to: Instant,
    /// The last 200 about this holding was received then.
    last_seen: Instant,
}

fn analyse(log: &Log, began: Instant, report: &mut Report) {
    let at = |t: Instant| t.saturating_duration_since(began);
    let mut by_key: BTreeMap<usize, BTreeMap<&str, Holding>> = BTreeMap::new();
    for s in &log.samples {
        let Some(token) = s.token else { continue };
        let holdings = by_key.entry(s.key).or_default();
        match holdings.get_mut(s.owner.as_str()) {
            Some(h) => {
                if h.token != token {
                    report.violations.push(format!(
                        "key k{}: owner {} answered token {} and then {}",
                        s.key, s.owner, h.token, token
                    ));
                }
                h.certain_from = h.certain_from.min(s.received);
                h.certain_to = h.certain_to.max(s.sent);
                h.last_seen = h.last_seen.max(s.received);
            }
            None => {
                holdings.insert(
                    s.owner.as_str(),
                    Holding {
                        owner: s.owner.clone(),
                        token,
                        acquire_sent: s.sent,
                        acquire_received: s.received,
                        certain_from: s.received,
                        certain_to: s.sent,
                        last_seen: s.received,
                    },
                );
            }
        }
    }
    report.acquisitions = by_key.values().map(BTreeMap::len).sum();
    report.refusals = log.refusals.len();
    let released: BTreeMap<&str, Instant> = log
        .endings
        .iter()
        .filter_map(|e| Some((e.owner.as_str(), e.released?)))
        .collect();

    for (key, holdings) in &by_key {
        let holdings: Vec<&Holding> = holdings.values().collect();
        for (i, a) in holdings.iter().enumerate() {
            for b in &holdings[i + 1..] {
                let from = a.certain_from.max(b.certain_from);
                let to = a.certain_to.min(b.certain_to);
                if from < to {
                    report.violations.push(format!(
                        "overlap on key k{key}: {} (token {}) and {} (token {}) both held for {:?} at {:.3?}",
                        a.owner, a.token, b.owner, b.token, to - from, at(from)
                    ));
                }
                if a.token == b.token {
                    report.violations.push(format!(
                        "key k{key}: token {} given to {} and to {}",
                        a.token, a.owner, b.owner
                    ));
                }
                // Certainly in this order: the one answered before the other was asked.
                let Some((first, second)) =
                    surely_ordered(*a, *b, |h| (h.acquire_sent, h.acquire_received))
                else {
                    continue;
                };
                if second.token <= first.token {
                    report.violations.push(format!(
                        "key k{key}: token went from {} ({}) to {} ({}) at {:.3?}",
                        first.token,
                        first.owner,
                        second.token,
                        second.owner,
                        at(second.acquire_sent)
                    ));
                }
            }
        }
    }

    // A refusal after the whole wait is a liveness failure when, with no fault near, the key
    // was free (no holding could have been alive) for longer than a hand-over takes.
    let quiet_before = LEASE + HOLD + RENEW + RECOVERY_SLACK;
    let free_gap = RENEW + RECOVERY_SLACK;
    for refusal in &log.refusals {
        let faulted = log
            .faults
            .iter()
            .any(|&(from, to)| from < refusal.received && to + quiet_before > refusal.sent);
        if faulted {
            continue;
        }
        // When each holding of the key could have been alive: from its request until its
        // release was answered, or else until its hold or lease lapsed after it was last seen.
        let mut busy: Vec<(Instant, Instant)> = by_key
            .get(&refusal.key)
            .map(|holdings| {
                holdings
                    .values()
                    .map(|h| {
                        let end = released
                            .get(h.owner.as_str())
                            .copied()
                            .unwrap_or(h.last_seen + HOLD.max(LEASE));
                        (h.acquire_sent, end)
                    })
                    .collect()
            })
            .unwrap_or_default();
        busy.sort();
        let longest = longest_gap(&busy, refusal.sent, refusal.received);
        if longest > free_gap {
            report.violations.push(format!(
                "key k{}: a worker waited {:?} and was refused, though the key was free for {:?} of it (from {:.3?})",
                refusal.key,
                refusal.received - refusal.sent,
                longest,
                at(refusal.sent)
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A log from `(key, owner, token, sent ms, received ms)` answers, with owners released
    /// at the given ms.
    fn log(origin: Instant, answers: &[(usize, &str, Option<u64>, u64, u64)]) -> Log {
        Log {
            samples: answers
                .iter()
                .map(|&(key, owner, token, sent, received)| Sample {
                    key,
                    owner: owner.to_owned(),
                    sent: origin + MS * sent as u32,
                    received: origin + MS * received as u32,
                    token,
                })
                .collect(),
            ..Log::default()
        }
    }

    fn release(log: &mut Log, origin: Instant, owner: &str, at_ms: u32) {
        log.endings.push(Ending {
            owner: owner.to_owned(),
            released: Some(origin + MS * at_ms),
        });
    }

    fn violations(log: &Log, origin: Instant) -> Vec<String> {
        let mut report = Report::default();
        analyse(log, origin, &mut report);
        report.violations
    }

    #[test]
    fn owners_one_after_the_other_pass() {
        let origin = Instant::now();
        let mut log = log(
            origin,
            &[
                (1, "a", Some(1), 0, 2),
                (1, "a", Some(1), 5, 6),
                (1, "b", Some(2), 10, 12),
                (1, "b", Some(2), 15, 16),
                // Another key's tokens are its own.
                (2, "c", Some(1), 5, 7),
            ],
        );
        release(&mut log, origin, "a", 8);
        assert_eq!(violations(&log, origin), Vec::<String>::new());
    }

    #[test]
    fn two_owners_surely_holding_one_key_at_once_are_an_overlap() {
        let origin = Instant::now();
        let log = log(
            origin,
            &[
                (1, "a", Some(1), 0, 2),
                (1, "b", Some(2), 3, 4),
                (1, "a", Some(1), 10, 11),
                (1, "b", Some(2), 12, 13),
            ],
        );
        let found = violations(&log, origin);
        assert!(
            found.iter().any(|v| v.starts_with("overlap on key k1")),
            "{found:?}"
        );
        // The same on two different keys is fine.
        let log2 = self::log(
            origin,
            &[
                (1, "a", Some(1), 0, 2),
                (2, "b", Some(1), 3, 4),
                (1, "a", Some(1), 10, 11),
                (2, "b", Some(1), 12, 13),
            ],
        );
        assert_eq!(violations(&log2, origin), Vec::<String>::new());
    }

    #[test]
    fn a_key_whose_token_falls_or_repeats_is_caught() {
        let origin = Instant::now();
        let falling = log(
            origin,
            &[(1, "a", Some(5), 0, 2), (1, "b", Some(4), 10, 12)],
        );
        let found = violations(&falling, origin);
        assert!(
            found.iter().any(|v| v.contains("token went from 5")),
            "{found:?}"
        );
        let repeated = log(
            origin,
            &[(1, "a", Some(5), 0, 2), (1, "b", Some(5), 10, 12)],
        );
        let found = violations(&repeated, origin);
        assert!(
            found.iter().any(|v| v.contains("token 5 given to")),
            "{found:?}"
        );
        // Acquisitions in flight at once: their order is unknown, so is nothing to check.
        let unordered = log(
            origin,
            &[(1, "a", Some(5), 0, 10), (1, "b", Some(4), 5, 12)],
        );
        assert_eq!(violations(&unordered, origin), Vec::<String>::new());
    }

    #[test]
    fn a_refusal_while_the_key_stayed_free_is_caught_unless_a_fault_explains_it() {
        let origin = Instant::now();
        let secs = |s: u32| origin + Duration::from_secs(u64::from(s));
        // "a" held key 1 and released it at 1 s; a worker waited from 0 s to 3 s and was
        // refused: the key was free for 2 s of its wait.
        let mut free = log(origin, &[(1, "a", Some(1), 0, 1)]);
        release(&mut free, origin, "a", 1000);
        free.refusals.push(Refusal {
            key: 1,
            sent: secs(0),
            received: secs(3),
        });
        let found = violations(&free, origin);
        assert!(found.iter().any(|v| v.contains("was refused")), "{found:?}");

        // The same with a fault just before: not counted.
        let mut faulted = log(origin, &[(1, "a", Some(1), 0, 1)]);
        release(&mut faulted, origin, "a", 1000);
        faulted.refusals = free.refusals.clone();
        faulted.faults.push((origin, origin + MS * 500));
        assert_eq!(violations(&faulted, origin), Vec::<String>::new());

        // A holder that was never seen to release keeps the key until its hold runs out.
        let mut busy = log(
            origin,
            &[(1, "a", Some(1), 0, 1), (1, "a", Some(1), 900, 901)],
        );
        busy.refusals = free.refusals.clone();
        assert_eq!(violations(&busy, origin), Vec::<String>::new());
    }
}
