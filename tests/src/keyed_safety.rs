//! The keyed safety check: three sidecars serve one family of keyed locks on a real backend,
//! eight workers per sidecar each take random keys out of fifty (a fresh owner per acquisition,
//! as a request id would be), ask about the key while they "work", and release it, while a
//! sidecar is killed, paused or cut from the backend, or the backend restarts, at random.
//!
//! Some workers acquire a key again with a shorter `hold` (a re-entrant acquisition, which must
//! not cut the first one's hold short), and some ask another sidecar for a key they hold under
//! another owner and hang up while it waits (which must leave no queue place behind).
//!
//! It fails when two owners' claims on one key certainly overlap, when an answer's `validForMs`
//! promised a claim past the moment another owner certainly held the key, when a key's token
//! does not rise from one holder to the next (or two owners get one token), or when a worker is
//! refused a key after waiting through a stretch in which nobody could hold it, with no fault
//! nearby.
//!
//! A semaphore family ([`run_semaphore`], `--permits 2` on fewer keys) is checked the same way
//! permit by permit (each permit is a lock with its own tokens), and also fails when more owners
//! than it has permits certainly hold one key at once; a refusal is a liveness failure when any
//! permit stayed free through the wait.
//!
//! Readers and writers of a read-write family ([`run_read_write`], `mode=read|write` on keys of
//! two permits) are checked the same way, readers permit by permit and writers among
//! themselves, and the check also fails when a writer and any other owner certainly hold one
//! key at once (or an answer's promise reaches into the other's hold), or when a writer's token
//! is not above every earlier reader's and writer's. A refusal is not checked for liveness
//! there: a reader waits for writers that are still waiting, which the log does not see.
//!
//! Owners that take two or three keys at once ([`run_several`], all or nothing on twenty keys)
//! are checked key by key the same way, and the check also fails when an acquisition that was
//! refused left its owner holding any of the keys it named. Among a read-write family's
//! writers, some write two keys at once, checked so too.
//!
//! "Certainly" is as in [`crate::safety`]: a 200 answer means the sidecar claimed for that owner
//! at some instant between the request and the answer, so an owner's claim surely covers
//! [first 200 received, last 200 sent], and two of those that intersect are two holders. A 200
//! answer's `validForMs` was measured at the sidecar after the request was sent, so it promises
//! the claim until the request's sending plus `validForMs`, or until the owner asks to release.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::safety::{
    Backend, CALM_MAX_MS, CALM_MIN_MS, LEASE, RECOVERY_SLACK, RENEW, Slot, TIMING, Target,
    held_within, inject, longest_gap, surely_ordered,
};
use crate::{Placement, Sidecar, http, post_or_hang_up, unique_lock};

pub const SIDECARS: usize = 3;
pub const WORKERS_PER_SIDECAR: usize = 8;
pub const KEYS: usize = 50;

/// The family a run checks: how many permits each key has, and how many keys the workers share.
#[derive(Debug, Clone, Copy)]
struct Shape {
    permits: u32,
    keys: usize,
    /// How many keys an acquisition names (from two up to this when above one).
    at_once: usize,
    /// Percent of acquisitions that ask to write (`mode=write`, the others `mode=read`); 0:
    /// no mode is asked.
    writes: u32,
}

/// A key, one owner at a time: fifty keys, seldom contended.
const MUTEX: Shape = Shape {
    permits: 1,
    keys: KEYS,
    at_once: 1,
    writes: 0,
};
/// Two permits per key on twelve keys, so that the 24 workers fill them and wait.
const SEMAPHORE: Shape = Shape {
    permits: 2,
    keys: 12,
    at_once: 1,
    writes: 0,
};
/// Readers and writers on twelve keys of two permits, a third of the acquisitions writes.
const READ_WRITE: Shape = Shape {
    permits: 2,
    keys: 12,
    at_once: 1,
    writes: 33,
};
/// Two or three keys at a time out of twenty, so that acquisitions overlap on some of their
/// keys and wait for each other.
const SEVERAL: Shape = Shape {
    permits: 1,
    keys: 20,
    at_once: 3,
    writes: 0,
};
/// Percent of a read-write family's writes that write two keys at once.
const SEVERAL_WRITES: u32 = 30;
/// How long a worker waits for a key, and how long it may keep one without extending it.
const WAIT: Duration = Duration::from_secs(3);
const HOLD: Duration = Duration::from_secs(3);
/// How many times a worker asks about its key while it works, and the pause between.
const WORK_POLLS: usize = 4;
const WORK_PAUSE_MS: std::ops::Range<u64> = 2..15;
/// Percent of holdings acquired again, re-entrantly, with a hold this much shorter; the worker
/// then works past the shorter hold, which must not end the first acquisition's.
const REENTRIES: u32 = 20;
const SHORT_HOLD_MS: std::ops::Range<u64> = 30..300;
/// Percent of holdings during which the worker also asks the next sidecar for its key under
/// another owner, and hangs up after this long.
const HANG_UPS: u32 = 10;
const PATIENCE_MS: std::ops::Range<u64> = 30..600;
/// How long after a client hangs up its request may still be served (a sidecar notices the
/// closed connection and drops the request).
const HANG_UP_RACE: Duration = Duration::from_millis(100);

/// One answer about one owner's hold on one key.
#[derive(Debug, Clone)]
struct Sample {
    key: usize,
    /// `slot/generation/owner`: unique per acquisition.
    owner: String,
    sent: Instant,
    received: Instant,
    token: Option<u64>,
    /// The answer's `validForMs`.
    valid_for: Duration,
    /// The permit held (0 without permits).
    permit: u32,
    /// A writer's holding (`"mode":"write"`), of every permit.
    writer: bool,
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
    /// The (first) release was asked for at this instant: no answer's promise outlives it.
    release_sent: Instant,
    /// The release was answered 200 at this instant.
    released: Option<Instant>,
}

/// A wait for a key that its client gave up on before any answer came.
#[derive(Debug, Clone, Copy)]
struct HangUp {
    key: usize,
    sent: Instant,
    hung_up: Instant,
}

#[derive(Default)]
struct Log {
    samples: Vec<Sample>,
    refusals: Vec<Refusal>,
    endings: Vec<Ending>,
    hang_ups: Vec<HangUp>,
    reentries: usize,
    /// Acquisitions of several keys answered 200.
    several: usize,
    /// Write locks acquired again among two keys, answered 200.
    written_again: usize,
    /// Refused acquisitions of several keys that left their owner holding some key.
    partials: Vec<String>,
    /// When each fault began and ended.
    faults: Vec<(Instant, Instant)>,
    /// Readers and writers were asked for: refusals say nothing of liveness.
    read_write: bool,
}

/// The figures of one run.
#[derive(Debug, Default)]
pub struct Report {
    pub target: &'static str,
    /// The permits of each key (1: one owner at a time).
    pub permits: u32,
    pub duration: Duration,
    pub seed: u64,
    pub acquisitions: usize,
    pub refusals: usize,
    pub reentries: usize,
    pub hang_ups: usize,
    /// Acquisitions of several keys at once that were granted.
    pub several: usize,
    /// Write locks acquired again among two keys at once, granted.
    pub written_again: usize,
    /// Writers' holdings granted (of a read-write family).
    pub writes: usize,
    pub faults: BTreeMap<&'static str, usize>,
    pub violations: Vec<String>,
}

impl Report {
    pub fn summary(&self) -> String {
        format!(
            "{:<18} {} {:>5.0}s  acquisitions {:>5}  re-entered {:>4}  hung up {:>3}  refused after waiting {:>4}  faults {:>3} ({})  violations {}  seed {}",
            self.target,
            if self.writes > 0 {
                format!(
                    "keyed, {} permits, {} writes ({} of two keys, {} again among two)",
                    self.permits, self.writes, self.several, self.written_again
                )
            } else if self.permits > 1 {
                format!("keyed, {} permits", self.permits)
            } else if self.several > 0 {
                format!("keyed, {} taken several at once", self.several)
            } else {
                "keyed".to_owned()
            },
            self.duration.as_secs_f64(),
            self.acquisitions,
            self.reentries,
            self.hang_ups,
            self.refusals,
            self.faults.values().sum::<usize>(),
            crate::safety::fault_counts(&self.faults),
            self.violations.len(),
            self.seed,
        )
    }
}

impl Sample {
    /// An answer about `owner`'s hold on `key`: `claim` is the token and `validForMs` of a 200.
    fn of(key: usize, owner: &str, sent: Instant, received: Instant, claim: Option<Claim>) -> Self {
        Self {
            key,
            owner: owner.to_owned(),
            sent,
            received,
            token: claim.map(|c| c.token),
            valid_for: claim.map(|c| c.valid_for).unwrap_or_default(),
            permit: claim.map(|c| c.permit).unwrap_or_default(),
            writer: claim.is_some_and(|c| c.writer),
        }
    }
}

/// What a 200 answer says of a holding.
#[derive(Debug, Clone, Copy)]
struct Claim {
    token: u64,
    valid_for: Duration,
    permit: u32,
    writer: bool,
}

/// The fencing token, `validForMs` and permit (0 when the family has none) of a 200 answer.
fn claim_of(body: &str) -> Option<Claim> {
    let answer = serde_json::from_str::<serde_json::Value>(body).ok()?;
    let token = answer.get("fencingToken")?.as_u64()?;
    let valid_for = answer.get("validForMs")?.as_u64()?;
    let permit = answer
        .get("permit")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    Some(Claim {
        token,
        valid_for: Duration::from_millis(valid_for),
        permit: u32::try_from(permit).ok()?,
        writer: answer.get("mode").and_then(serde_json::Value::as_str) == Some("write"),
    })
}

/// Release `owner`'s hold on `path` `holds` times (once per acquisition) and log how it ended.
fn release(target: SocketAddr, path: &str, owner: String, holds: usize, log: &Mutex<Log>) {
    release_with(target, &format!("{path}/release?"), owner, holds, log);
}

/// Send `release` (a route and its query up to the owner) with `owner` `holds` times, and log
/// how the holding ended.
fn release_with(target: SocketAddr, release: &str, owner: String, holds: usize, log: &Mutex<Log>) {
    let release_sent = Instant::now();
    let mut released = None;
    for _ in 0..holds {
        released = http(target, "POST", &format!("{release}owner={owner}"))
            .ok()
            .filter(|r| r.status == 200)
            .map(|_| Instant::now());
    }
    log.lock().unwrap().endings.push(Ending {
        owner,
        release_sent,
        released,
    });
}

/// Ask `other` (another sidecar) for `key` under a new owner while this worker holds it, and
/// hang up while it waits. Should the wait have been served (this worker's holding was lost
/// meanwhile), the holding is logged and released like any other.
fn wait_and_hang_up(
    other: SocketAddr,
    (key, path, mode): (usize, &str, &str),
    owner: String,
    patience: Duration,
    log: &Mutex<Log>,
) {
    let sent = Instant::now();
    let acquire = format!(
        "{path}/acquire?owner={owner}&wait={}ms&hold={}ms{mode}",
        WAIT.as_millis(),
        HOLD.as_millis()
    );
    let served = match post_or_hang_up(other, &acquire, patience) {
        Ok(Some(reply)) => (reply.status == 200).then_some((reply, sent, Instant::now())),
        Ok(None) => {
            let hung_up = Instant::now();
            std::thread::sleep(HANG_UP_RACE);
            let asked = Instant::now();
            match http(other, "GET", &format!("{path}?owner={owner}")) {
                // Served as it hung up: the holding is real, and this worker gives it back.
                Ok(reply) if reply.status == 200 => Some((reply, asked, Instant::now())),
                _ => {
                    log.lock()
                        .unwrap()
                        .hang_ups
                        .push(HangUp { key, sent, hung_up });
                    None
                }
            }
        }
        Err(_) => None,
    };
    let Some((reply, sent, received)) = served else {
        return;
    };
    if let Some(claim) = claim_of(&reply.body) {
        let sample = Sample::of(key, &owner, sent, received, Some(claim));
        log.lock().unwrap().samples.push(sample);
    }
    release(other, path, owner, 1, log);
}

/// One worker: take a random key, ask about it a few times, release it; again until `stop`.
/// `addrs` are every sidecar's addresses, this worker's at `slot`.
fn worker(
    slot: usize,
    index: usize,
    (family, shape): (String, Shape),
    addrs: Vec<Arc<Mutex<(SocketAddr, u32)>>>,
    log: Arc<Mutex<Log>>,
    stop: Arc<AtomicBool>,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let key = rng.random_range(0..shape.keys);
        let (target, generation) = *addrs[slot].lock().unwrap();
        n += 1;
        let owner = format!("s{slot}g{generation}w{index}n{n}");
        if shape.at_once > 1 {
            several_at_once(target, &family, shape, "", owner, &mut rng, &log);
            continue;
        }
        let path = format!("/locks/{family}/keys/k{key}");
        let mode = match shape.writes {
            0 => "",
            writes if rng.random_range(0..100) < writes => "&mode=write",
            _ => "&mode=read",
        };
        // A share of the writes writes two keys at once, all or nothing.
        if !mode.is_empty() && mode.ends_with("write") && rng.random_range(0..100) < SEVERAL_WRITES
        {
            let two = Shape {
                at_once: 2,
                ..shape
            };
            several_at_once(target, &family, two, mode, owner, &mut rng, &log);
            continue;
        }
        let sent = Instant::now();
        let answer = http(
            target,
            "POST",
            &format!(
                "{path}/acquire?owner={owner}&wait={}ms&hold={}ms{mode}",
                WAIT.as_millis(),
                HOLD.as_millis()
            ),
        );
        let received = Instant::now();
        let claim = match answer {
            Ok(reply) if reply.status == 200 => claim_of(&reply.body),
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
        if claim.is_none() {
            continue;
        }
        let sample = Sample::of(key, &owner, sent, received, claim);
        log.lock().unwrap().samples.push(sample);
        let mut holds = 1;
        let roll = rng.random_range(0..100);
        if roll < REENTRIES && mode.ends_with("write") && rng.random_bool(0.5) {
            let short = Duration::from_millis(rng.random_range(SHORT_HOLD_MS));
            let first = (key, owner.as_str());
            written_again_among_two(target, &family, shape, first, short, &mut rng, &log);
        } else if roll < REENTRIES {
            let short = Duration::from_millis(rng.random_range(SHORT_HOLD_MS));
            let sent = Instant::now();
            let again = http(
                target,
                "POST",
                &format!(
                    "{path}/acquire?owner={owner}&hold={}ms{mode}",
                    short.as_millis()
                ),
            );
            let received = Instant::now();
            let claim = again
                .ok()
                .filter(|r| r.status == 200)
                .and_then(|r| claim_of(&r.body));
            if claim.is_some() {
                holds += 1;
                let mut log = log.lock().unwrap();
                log.reentries += 1;
                log.samples
                    .push(Sample::of(key, &owner, sent, received, claim));
            }
            // Work past the shorter hold: the first acquisition still keeps the key.
            std::thread::sleep(short + Duration::from_millis(rng.random_range(20..100)));
        } else if roll < REENTRIES + HANG_UPS {
            let (other, _) = *addrs[(slot + 1) % addrs.len()].lock().unwrap();
            let patience = Duration::from_millis(rng.random_range(PATIENCE_MS));
            // A reader's hang-up asks to write: a writer abandoned midway gives back its parts.
            let mode = if mode.is_empty() { "" } else { "&mode=write" };
            let waited = (key, path.as_str(), mode);
            wait_and_hang_up(other, waited, format!("{owner}x"), patience, &log);
        }
        for _ in 0..rng.random_range(1..=WORK_POLLS) {
            std::thread::sleep(Duration::from_millis(rng.random_range(WORK_PAUSE_MS)));
            let sent = Instant::now();
            let Ok(reply) = http(target, "GET", &format!("{path}?owner={owner}")) else {
                break;
            };
            let received = Instant::now();
            let claim = (reply.status == 200)
                .then(|| claim_of(&reply.body))
                .flatten();
            let sample = Sample::of(key, &owner, sent, received, claim);
            log.lock().unwrap().samples.push(sample);
            if reply.status == 409 {
                break; // lost it (hold lapsed, lease lost): nothing to release
            }
        }
        release(target, &path, owner, holds, &log);
    }
}

/// After an answer `status` other than 200 to `owner`'s acquisition of the keys `names`, log
/// each of `keys` that the owner holds nonetheless, as the sidecar answers about it.
fn none_held(
    target: SocketAddr,
    family: &str,
    owner: &str,
    (keys, names): (&[usize], &str),
    status: u16,
    log: &Mutex<Log>,
) {
    for &key in keys {
        let path = format!("/locks/{family}/keys/k{key}?owner={owner}");
        if let Ok(asked) = http(target, "GET", &path)
            && asked.status == 200
        {
            log.lock().unwrap().partials.push(format!(
                "{owner} was answered {status} for keys {names}, but holds k{key}: {}",
                asked.body
            ));
        }
    }
}

/// Log each key of a 200 answer for several keys (`keys`) as held by `owner`, with the
/// answer's token and validity for it, found by its name; asked at `sent`, answered at
/// `received`. A 200 that does not name every key asked, with a claim, holds some keys
/// without the others: a violation.
fn keys_held(
    log: &mut Log,
    body: &str,
    keys: &[usize],
    owner: &str,
    (sent, received): (Instant, Instant),
) {
    let parsed = serde_json::from_str::<serde_json::Value>(body).unwrap_or_default();
    let answered = parsed["keys"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    for &key in keys {
        let name = format!("k{key}");
        let claim = answered
            .iter()
            .find(|answer| answer["key"] == name.as_str())
            .and_then(|answer| claim_of(&answer.to_string()));
        match claim {
            Some(claim) => log
                .samples
                .push(Sample::of(key, owner, sent, received, Some(claim))),
            None => log.partials.push(format!(
                "{owner} was answered 200 for several keys without a claim on {name}: {body}"
            )),
        }
    }
}

/// A writer of `key` writes it again among two keys at once (`acquire?keys=...&mode=write`,
/// with a hold of `short`): on a 200, both keys are logged as held and released together once,
/// which leaves the first acquisition of `key`, asked about afterwards as before; on any other
/// answer, the owner must not hold the other key.
fn written_again_among_two(
    target: SocketAddr,
    family: &str,
    shape: Shape,
    (key, owner): (usize, &str),
    short: Duration,
    rng: &mut StdRng,
    log: &Mutex<Log>,
) {
    let other = (key + rng.random_range(1..shape.keys)) % shape.keys;
    let names = format!("k{key},k{other}");
    let sent = Instant::now();
    let answer = http(
        target,
        "POST",
        &format!(
            "/locks/{family}/acquire?keys={names}&owner={owner}&wait={}ms&hold={}ms&mode=write",
            WAIT.as_millis(),
            short.as_millis()
        ),
    );
    let received = Instant::now();
    let Ok(reply) = answer else {
        return;
    };
    if reply.status != 200 {
        // Its first acquisition of `key` is its own to keep.
        none_held(target, family, owner, (&[other], &names), reply.status, log);
        return;
    }
    {
        let mut log = log.lock().unwrap();
        log.reentries += 1;
        log.written_again += 1;
        keys_held(
            &mut log,
            &reply.body,
            &[key, other],
            owner,
            (sent, received),
        );
    }
    std::thread::sleep(Duration::from_millis(rng.random_range(WORK_PAUSE_MS)));
    let release = format!("/locks/{family}/release?keys={names}&");
    release_with(target, &release, owner.to_owned(), 1, log);
}

/// One acquisition of two to `shape.at_once` random keys at once, all or nothing (`mode`, as
/// the acquisition's query ends, `&mode=write` to write them): on a 200, each key is logged as
/// held (the answer's token and validity for it) and asked about while the owner works, then
/// all are released together; on any other answer, the owner must hold none of them.
fn several_at_once(
    target: SocketAddr,
    family: &str,
    shape: Shape,
    mode: &str,
    owner: String,
    rng: &mut StdRng,
    log: &Mutex<Log>,
) {
    let count = rng.random_range(2..=shape.at_once);
    let mut keys: Vec<usize> = Vec::with_capacity(count);
    while keys.len() < count {
        let key = rng.random_range(0..shape.keys);
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    let names: Vec<String> = keys.iter().map(|k| format!("k{k}")).collect();
    let names = names.join(",");
    let sent = Instant::now();
    let answer = http(
        target,
        "POST",
        &format!(
            "/locks/{family}/acquire?keys={names}&owner={owner}&wait={}ms&hold={}ms{mode}",
            WAIT.as_millis(),
            HOLD.as_millis()
        ),
    );
    let received = Instant::now();
    let key_path = |key: usize| format!("/locks/{family}/keys/k{key}");
    let reply = match answer {
        Ok(reply) => reply,
        // The sidecar was killed under us: nothing to check.
        Err(_) => {
            std::thread::sleep(Duration::from_millis(20));
            return;
        }
    };
    if reply.status != 200 {
        // Refused, or cannot tell: whatever was taken on the way was given back before the
        // answer, so the owner holds none of the keys.
        none_held(target, family, &owner, (&keys, &names), reply.status, log);
        if reply.status != 409 {
            std::thread::sleep(Duration::from_millis(20));
        }
        return;
    }
    {
        let mut log = log.lock().unwrap();
        log.several += 1;
        keys_held(&mut log, &reply.body, &keys, &owner, (sent, received));
    }
    for _ in 0..rng.random_range(1..=WORK_POLLS) {
        std::thread::sleep(Duration::from_millis(rng.random_range(WORK_PAUSE_MS)));
        let key = keys[rng.random_range(0..keys.len())];
        let sent = Instant::now();
        let Ok(reply) = http(target, "GET", &format!("{}?owner={owner}", key_path(key))) else {
            break;
        };
        let received = Instant::now();
        let claim = (reply.status == 200)
            .then(|| claim_of(&reply.body))
            .flatten();
        log.lock()
            .unwrap()
            .samples
            .push(Sample::of(key, &owner, sent, received, claim));
        if reply.status == 409 {
            break;
        }
    }
    let release = format!("/locks/{family}/release?keys={names}&");
    release_with(target, &release, owner, 1, log);
}

/// Run the keyed check against `target` for `duration`.
pub fn run(target: Target, duration: Duration, seed: u64) -> Report {
    run_shaped(target, duration, seed, MUTEX)
}

/// Run the check against `target` for `duration` on a family whose keys have two permits.
pub fn run_semaphore(target: Target, duration: Duration, seed: u64) -> Report {
    run_shaped(target, duration, seed, SEMAPHORE)
}

/// Run the check against `target` for `duration` with readers and writers of keys of two
/// permits.
pub fn run_read_write(target: Target, duration: Duration, seed: u64) -> Report {
    run_shaped(target, duration, seed, READ_WRITE)
}

/// Run the check against `target` for `duration` with owners taking several keys at once.
pub fn run_several(target: Target, duration: Duration, seed: u64) -> Report {
    run_shaped(target, duration, seed, SEVERAL)
}

fn run_shaped(target: Target, duration: Duration, seed: u64, shape: Shape) -> Report {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut backend = Backend::start(target);
    let family = unique_lock("keyed");
    let plain = unique_lock("plain");
    let permits = shape.permits.to_string();
    let args: Vec<&str> = TIMING
        .iter()
        .copied()
        .chain(["--keyed", &family, "--mode", "on-demand"])
        .chain(["--permits", &permits])
        .chain((shape.writes > 0).then_some("--read-write"))
        .collect();
    let start_sidecar = |placement: &Placement, identity: &str, url: &str| {
        Sidecar::start_on(placement, identity, url, &plain, &args)
    };
    let mut slots: Vec<Slot> = (0..SIDECARS)
        .map(|i| Slot::start(i, format!("pod-{i}"), &backend, &start_sidecar))
        .collect();

    let log = Arc::new(Mutex::new(Log {
        read_write: shape.writes > 0,
        ..Log::default()
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = slots
        .iter()
        .enumerate()
        .flat_map(|(s, _)| (0..WORKERS_PER_SIDECAR).map(move |w| (s, w)))
        .map(|(s, w)| {
            let (family, log, stop) = (family.clone(), log.clone(), stop.clone());
            let addrs = slots.iter().map(|slot| slot.addr.clone()).collect();
            let seed = rng.random();
            std::thread::spawn(move || worker(s, w, (family, shape), addrs, log, stop, seed))
        })
        .collect();

    let mut report = Report {
        target: target.name(),
        permits: shape.permits,
        seed,
        ..Report::default()
    };
    let faults = backend.faults();
    let began = Instant::now();
    while began.elapsed() < duration {
        std::thread::sleep(Duration::from_millis(
            rng.random_range(CALM_MIN_MS..CALM_MAX_MS),
        ));
        let fault = faults[rng.random_range(0..faults.len())];
        let victim = rng.random_range(0..slots.len());
        let started = Instant::now();
        inject(fault, &mut slots[victim], &mut backend, &start_sidecar);
        log.lock().unwrap().faults.push((started, Instant::now()));
        *report.faults.entry(fault.name()).or_default() += 1;
    }
    report.duration = began.elapsed();
    stop.store(true, Ordering::SeqCst);
    // A worker that panicked saw something it could not record: a failed run.
    for worker in workers {
        if worker.join().is_err() {
            report
                .violations
                .push("a worker thread panicked (its message is above)".to_owned());
        }
    }
    let log = std::mem::take(&mut *log.lock().unwrap());
    analyse(&log, began, shape.permits, &mut report);
    drop(slots);
    report
}

/// Each permit's holdings, by (key, permit), each by (owner, token).
type ByPermit<'a> = BTreeMap<(usize, u32), BTreeMap<(&'a str, u64), Holding>>;

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
    /// The latest end of the claim an answer promised (its request's sending plus its
    /// `validForMs`), before the owner asked to release.
    promised_to: Instant,
}

fn analyse(log: &Log, began: Instant, permits: u32, report: &mut Report) {
    let at = |t: Instant| t.saturating_duration_since(began);
    // By owner and token: an owner whose holding ended (its sidecar paused past the lease) and
    // that acquires again (a re-entrant acquisition finds nothing to re-enter) holds anew.
    // Each permit of a key is a lock of its own: checked apart, by (key, permit).
    // A writer holds every permit with the highest of their tokens: writers are checked among
    // themselves (under [`WRITERS`]) and then against every other holding of their key.
    let mut by_key: ByPermit = BTreeMap::new();
    for s in &log.samples {
        let Some(token) = s.token else { continue };
        let permit = if s.writer { WRITERS } else { s.permit };
        let holdings = by_key.entry((s.key, permit)).or_default();
        match holdings.get_mut(&(s.owner.as_str(), token)) {
            Some(h) => {
                h.certain_from = h.certain_from.min(s.received);
                h.certain_to = h.certain_to.max(s.sent);
                h.last_seen = h.last_seen.max(s.received);
                h.promised_to = h.promised_to.max(s.sent + s.valid_for);
            }
            None => {
                holdings.insert(
                    (s.owner.as_str(), token),
                    Holding {
                        owner: s.owner.clone(),
                        token,
                        acquire_sent: s.sent,
                        acquire_received: s.received,
                        certain_from: s.received,
                        certain_to: s.sent,
                        last_seen: s.received,
                        promised_to: s.sent + s.valid_for,
                    },
                );
            }
        }
    }
    report.acquisitions = by_key.values().map(BTreeMap::len).sum();
    report.refusals = log.refusals.len();
    report.reentries = log.reentries;
    report.hang_ups = log.hang_ups.len();
    report.several = log.several;
    report.written_again = log.written_again;
    report.violations.extend(log.partials.iter().cloned());
    let released: BTreeMap<&str, Instant> = log
        .endings
        .iter()
        .filter_map(|e| Some((e.owner.as_str(), e.released?)))
        .collect();
    // A promise ends when its owner asks to release: the app has stopped relying on it.
    for e in &log.endings {
        for h in by_key.values_mut().flat_map(BTreeMap::values_mut) {
            if h.owner == e.owner {
                h.promised_to = h.promised_to.min(e.release_sent.max(h.certain_to));
            }
        }
    }

    for (&(key, permit), holdings) in &by_key {
        let name = if permit == WRITERS {
            format!("k{key} writers")
        } else if permits > 1 {
            format!("k{key} permit {permit}")
        } else {
            format!("k{key}")
        };
        let holdings: Vec<&Holding> = holdings.values().collect();
        for (i, a) in holdings.iter().enumerate() {
            for b in &holdings[i + 1..] {
                overlap_or_broken_promise(&name, ("", a), ("", b), &at, report);
                if a.token == b.token {
                    report.violations.push(format!(
                        "key {name}: token {} given to {} and to {}",
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
                        "key {name}: token went from {} ({}) to {} ({}) at {:.3?}",
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

    if permits > 1 {
        over_admissions(&by_key, permits, &at, report);
    }
    report.writes = by_key
        .iter()
        .filter(|((_, permit), _)| *permit == WRITERS)
        .map(|(_, holdings)| holdings.len())
        .sum();
    writers_alone(&by_key, &at, report);
    if log.read_write {
        return;
    }

    // A refusal after the whole wait is a liveness failure when, with no fault near, the key
    // (one of its permits) was free (no holding could have been alive) for longer than a
    // hand-over takes.
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
        // When each holding of the permit could have been alive: from its request until its
        // release was answered, or else until its hold or lease lapsed after it was last seen.
        // A client that hung up might have taken any permit.
        let longest = (0..permits)
            .map(|permit| {
                let mut busy: Vec<(Instant, Instant)> = by_key
                    .get(&(refusal.key, permit))
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
                busy.extend(
                    log.hang_ups
                        .iter()
                        .filter(|h| h.key == refusal.key)
                        .map(|h| (h.sent, h.hung_up + HANG_UP_RACE)),
                );
                busy.sort();
                longest_gap(&busy, refusal.sent, refusal.received)
            })
            .max()
            .unwrap_or_default();
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

/// Two holdings of one key (`name`) that certainly overlap, or, if not, one whose answer
/// promised its claim past the moment the other certainly held: a violation each. Each
/// holding comes with what it is called in the message (`"writer "`, or nothing). Whether they
/// overlap.
fn overlap_or_broken_promise(
    name: &str,
    (a_is, a): (&str, &Holding),
    (b_is, b): (&str, &Holding),
    at: &dyn Fn(Instant) -> Duration,
    report: &mut Report,
) -> bool {
    let from = a.certain_from.max(b.certain_from);
    let to = a.certain_to.min(b.certain_to);
    if from < to {
        report.violations.push(format!(
            "overlap on key {name}: {a_is}{} (token {}) and {b_is}{} (token {}) both held for {:?} at {:.3?}",
            a.owner, a.token, b.owner, b.token, to - from, at(from)
        ));
        return true;
    }
    for (promiser, other) in [(a, b), (b, a)] {
        let held = held_within(
            (
                promiser.certain_from,
                promiser.promised_to.max(promiser.certain_to),
            ),
            (other.certain_from, other.certain_to),
            (other.acquire_sent, other.acquire_received),
        );
        if let Some(from) = held {
            report.violations.push(format!(
                "broken promise on key {name}: {} (token {}) was promised validity until {:.3?}, but {} (token {}) held from {:.3?}",
                promiser.owner,
                promiser.token,
                at(promiser.promised_to),
                other.owner,
                other.token,
                at(from)
            ));
        }
    }
    false
}

/// The pseudo-permit writers' holdings are checked under: a writer holds every permit.
const WRITERS: u32 = u32::MAX;

/// A writer and any other owner certainly holding one key at once, or a promise of either
/// reaching into the other's certain hold; a writer whose token is not above an earlier
/// reader's (earlier writers are checked among the writers).
fn writers_alone(by_key: &ByPermit, at: &dyn Fn(Instant) -> Duration, report: &mut Report) {
    for (&(key, permit), writers) in by_key {
        if permit != WRITERS {
            continue;
        }
        let readers = by_key
            .range((key, 0)..(key, WRITERS))
            .flat_map(|(_, holdings)| holdings.values());
        for reader in readers {
            for writer in writers.values() {
                let name = format!("k{key}");
                let writer_is = ("writer ", writer);
                if overlap_or_broken_promise(&name, writer_is, ("reader ", reader), at, report) {
                    continue;
                }
                if let Some((first, second)) =
                    surely_ordered(reader, writer, |h| (h.acquire_sent, h.acquire_received))
                    && std::ptr::eq(first, reader)
                    && second.token <= first.token
                {
                    report.violations.push(format!(
                        "key k{key}: writer {} got token {} after reader {} had {}",
                        second.owner, second.token, first.owner, first.token
                    ));
                }
            }
        }
    }
}

/// More owners than `permits` certainly holding one key at once, whatever permits their answers
/// named: the semaphore's own promise.
fn over_admissions(
    by_key: &ByPermit,
    permits: u32,
    at: &dyn Fn(Instant) -> Duration,
    report: &mut Report,
) {
    let mut by_key_only: BTreeMap<usize, Vec<&Holding>> = BTreeMap::new();
    for (&(key, _), holdings) in by_key {
        by_key_only
            .entry(key)
            .or_default()
            .extend(holdings.values());
    }
    for (key, holdings) in by_key_only {
        // Starts before ends at one instant: certain intervals that only touch do not overlap.
        let mut edges: Vec<(Instant, i32, &Holding)> = holdings
            .iter()
            .filter(|h| h.certain_from < h.certain_to)
            .flat_map(|h| [(h.certain_from, 1, *h), (h.certain_to, -1, *h)])
            .collect();
        edges.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        let mut holding: Vec<&Holding> = Vec::new();
        for (instant, step, h) in edges {
            if step < 0 {
                holding.retain(|other| !std::ptr::eq(*other, h));
                continue;
            }
            holding.push(h);
            if holding.len() > permits as usize {
                let owners: Vec<String> = holding
                    .iter()
                    .map(|h| format!("{} (token {})", h.owner, h.token))
                    .collect();
                report.violations.push(format!(
                    "key k{key}: {} owners held it at once at {:.3?}, with {permits} permits: {}",
                    holding.len(),
                    at(instant),
                    owners.join(", ")
                ));
            }
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
                    valid_for: Duration::ZERO,
                    permit: 0,
                    writer: false,
                })
                .collect(),
            ..Log::default()
        }
    }

    /// `log`'s answer `index` promised validity for `ms`.
    fn promise(log: &mut Log, index: usize, ms: u32) {
        log.samples[index].valid_for = MS * ms;
    }

    fn release(log: &mut Log, origin: Instant, owner: &str, at_ms: u32) {
        log.endings.push(Ending {
            owner: owner.to_owned(),
            release_sent: origin + MS * at_ms,
            released: Some(origin + MS * at_ms),
        });
    }

    fn violations(log: &Log, origin: Instant) -> Vec<String> {
        violations_with_permits(log, origin, 1)
    }

    fn violations_with_permits(log: &Log, origin: Instant, permits: u32) -> Vec<String> {
        let mut report = Report::default();
        analyse(log, origin, permits, &mut report);
        report.violations
    }

    /// `log`'s answers about `owner` named permit `permit`.
    fn on_permit(log: &mut Log, owner: &str, permit: u32) {
        for sample in log.samples.iter_mut().filter(|s| s.owner == owner) {
            sample.permit = permit;
        }
    }

    /// `log`'s answers about `owner` were a writer's.
    fn writes(log: &mut Log, owner: &str) {
        for sample in log.samples.iter_mut().filter(|s| s.owner == owner) {
            sample.writer = true;
        }
    }

    #[test]
    fn a_writer_beside_a_reader_or_below_an_earlier_readers_token_is_caught() {
        let origin = Instant::now();
        // Readers r1 and r2 (permits 0 and 1), then writer w with a token above both.
        let answers = [
            (1, "r1", Some(5), 0, 2),
            (1, "r2", Some(9), 1, 3),
            (1, "r1", Some(5), 4, 5),
            (1, "r2", Some(9), 4, 5),
            (1, "w", Some(10), 6, 8),
            (1, "w", Some(10), 9, 10),
        ];
        let mut apart = log(origin, &answers);
        on_permit(&mut apart, "r2", 1);
        writes(&mut apart, "w");
        assert_eq!(
            violations_with_permits(&apart, origin, 2),
            Vec::<String>::new()
        );
        // The writer's token below the reader's of permit 1.
        let mut low = log(origin, &answers);
        on_permit(&mut low, "r2", 1);
        writes(&mut low, "w");
        for sample in low.samples.iter_mut().filter(|s| s.owner == "w") {
            sample.token = Some(8);
        }
        let found = violations_with_permits(&low, origin, 2);
        assert!(
            found.len() == 1 && found[0].contains("writer w got token 8 after reader r2 had 9"),
            "{found:?}"
        );
        // A reader still surely holding while the writer surely holds: one permit is enough.
        let mut beside = log(
            origin,
            &[answers.as_slice(), &[(1, "r1", Some(5), 9, 10)]].concat(),
        );
        on_permit(&mut beside, "r2", 1);
        writes(&mut beside, "w");
        let found = violations_with_permits(&beside, origin, 2);
        assert!(
            found
                .iter()
                .any(|v| v.contains("overlap on key k1: writer w")),
            "{found:?}"
        );
        // A writer's promise reaching into a later reader's hold.
        let mut promised = log(
            origin,
            &[
                answers.as_slice(),
                &[(1, "r3", Some(11), 20, 21), (1, "r3", Some(11), 22, 23)],
            ]
            .concat(),
        );
        on_permit(&mut promised, "r2", 1);
        writes(&mut promised, "w");
        promise(&mut promised, 5, 20);
        let found = violations_with_permits(&promised, origin, 2);
        assert!(
            found
                .iter()
                .any(|v| v.contains("broken promise on key k1: w")),
            "{found:?}"
        );
    }

    #[test]
    fn as_many_owners_as_permits_pass_and_one_more_is_caught() {
        let origin = Instant::now();
        let answers = [
            (1, "a", Some(1), 0, 2),
            (1, "b", Some(1), 1, 3),
            (1, "a", Some(1), 10, 11),
            (1, "b", Some(1), 12, 13),
        ];
        let mut two = log(origin, &answers);
        on_permit(&mut two, "b", 1);
        assert_eq!(
            violations_with_permits(&two, origin, 2),
            Vec::<String>::new()
        );
        // A third owner, on a permit of its own as its answers say, while both hold.
        let mut three = log(
            origin,
            &[
                answers.as_slice(),
                &[(1, "c", Some(7), 4, 5), (1, "c", Some(7), 8, 9)],
            ]
            .concat(),
        );
        on_permit(&mut three, "b", 1);
        on_permit(&mut three, "c", 2);
        let found = violations_with_permits(&three, origin, 2);
        assert!(
            found
                .iter()
                .any(|v| v.starts_with("key k1: 3 owners held it at once")),
            "{found:?}"
        );
        // Two owners on one permit are an overlap of that permit.
        let mut shared = log(origin, &answers);
        on_permit(&mut shared, "a", 1);
        on_permit(&mut shared, "b", 1);
        let found = violations_with_permits(&shared, origin, 2);
        assert!(
            found
                .iter()
                .any(|v| v.starts_with("overlap on key k1 permit 1")),
            "{found:?}"
        );
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
    fn another_owner_holding_before_an_answers_validity_ends_is_a_broken_promise() {
        let origin = Instant::now();
        // "a" asked at 0 ms and was promised `ms`; "b" held the key from 500 ms.
        let promised = |ms: u32| {
            let mut log = log(
                origin,
                &[
                    (1, "a", Some(1), 0, 2),
                    (1, "b", Some(2), 400, 500),
                    (1, "b", Some(2), 600, 601),
                ],
            );
            promise(&mut log, 0, ms);
            log
        };
        let found = violations(&promised(1000), origin);
        assert!(
            found
                .iter()
                .any(|v| v.starts_with("broken promise on key k1")),
            "{found:?}"
        );

        // The same, but "a" asked to release at 300 ms: the promise ended there.
        let mut kept = promised(1000);
        release(&mut kept, origin, "a", 300);
        assert_eq!(violations(&kept, origin), Vec::<String>::new());

        // A promise that ended before "b" held is kept.
        assert_eq!(violations(&promised(450), origin), Vec::<String>::new());

        // "b" seen once only: it held at some instant of its answer's window, which lies
        // inside the promise; a window reaching past the promise may have held after it.
        let seen_once = |window: (u64, u64)| {
            let mut log = log(
                origin,
                &[
                    (1, "a", Some(1), 0, 2),
                    (1, "b", Some(2), window.0, window.1),
                ],
            );
            promise(&mut log, 0, 450);
            violations(&log, origin)
        };
        let found = seen_once((400, 401));
        assert!(
            found.iter().any(|v| v.starts_with("broken promise")),
            "{found:?}"
        );
        assert_eq!(seen_once((400, 500)), Vec::<String>::new());
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
