//! `exec --via http://127.0.0.1:4040`: a running sidecar holds the lock (or a key) for this
//! process, through a hold bound to a connection (`POST .../hold`, an event stream). The claim
//! is what the stream says: held from `acquired`, until `validForMs` after the last event read
//! or `validUntilBootTimeMs` (the claim's end on the machine's boot clock), whichever is earlier,
//! or until `lost` or `released`. Closing the connection releases the lock at once; the command
//! holds a copy of it, so that it closes only once exec and every process the command started
//! are gone (an exec killed outright would otherwise release while its command still runs).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold_lease::BootInstant;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::config::EXIT_BAD_CONFIG;

/// The longest `wait` one request asks the sidecar for (its limit); a longer wait asks again.
const MAX_WAIT_PER_REQUEST: Duration = Duration::from_secs(300);
/// After a refused connection or a 503, before asking again.
const RETRY_PAUSE: Duration = Duration::from_secs(1);
/// Before a hold whose stream ended before the command started is asked for again: a sidecar
/// that ends every stream at once is not asked in a loop.
const ASK_AGAIN_PAUSE: Duration = Duration::from_millis(100);

/// What `--via` names: a sidecar's lock API.
#[derive(Debug, Clone)]
pub struct Via {
    /// `HOST:PORT`.
    authority: String,
}

impl Via {
    /// `http://HOST:PORT`, with no path: the lock API speaks plain HTTP on loopback.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let rest = raw
            .strip_prefix("http://")
            .ok_or_else(|| format!("{raw:?} is not http://HOST:PORT (the sidecar's lock API)"))?;
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        let port = authority.rsplit_once(':').map(|(_, port)| port);
        if authority.is_empty()
            || authority.contains(['/', '?', '#', '@', ' '])
            || port.is_none_or(|p| p.parse::<u16>().is_err())
        {
            return Err(format!(
                "{raw:?} is not http://HOST:PORT (the sidecar's lock API)"
            ));
        }
        Ok(Self {
            authority: authority.to_owned(),
        })
    }
}

/// What is held through the sidecar.
#[derive(Debug, Clone)]
pub enum Target {
    Lock(String),
    Key {
        family: String,
        key: String,
        owner: String,
        /// `read` or `write` on a read-write family; `None`, the family's plain acquisition.
        mode: Option<KeyMode>,
    },
    /// Several keys of one family, all or nothing.
    Keys {
        family: String,
        keys: Vec<String>,
        owner: String,
        /// `read` or `write` on a read-write family, for every key.
        mode: Option<KeyMode>,
    },
}

/// How a key of a read-write family is held: shared with other readers, or alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KeyMode {
    Read,
    Write,
}

impl Target {
    fn path(&self, wait: Duration) -> String {
        let wait = format!("wait={}ms", wait.as_millis());
        match self {
            // Exclusive: another `exec` through the same sidecar waits its turn rather than share
            // the pod's acquisition, or re-enter its owner's holding of the key.
            Target::Lock(name) => format!("/locks/{}/hold?exclusive=true&{wait}", encode(name)),
            Target::Key {
                family,
                key,
                owner,
                mode,
            } => {
                let mode = mode_param(*mode);
                format!(
                    "/locks/{}/keys/{}/hold?owner={}&exclusive=true{mode}&{wait}",
                    encode(family),
                    encode(key),
                    encode(owner)
                )
            }
            Target::Keys {
                family,
                keys,
                owner,
                mode,
            } => {
                let keys: Vec<String> = keys.iter().map(|key| encode(key)).collect();
                let mode = mode_param(*mode);
                format!(
                    "/locks/{}/hold?keys={}&owner={}&exclusive=true{mode}&{wait}",
                    encode(family),
                    keys.join(","),
                    encode(owner)
                )
            }
        }
    }
}

/// The hold's `mode` parameter, with its `&`; empty for the family's plain acquisition.
fn mode_param(mode: Option<KeyMode>) -> &'static str {
    match mode {
        Some(KeyMode::Read) => "&mode=read",
        Some(KeyMode::Write) => "&mode=write",
        None => "",
    }
}

/// Percent-encodes all but unreserved characters, so that a key's `/` or an owner's `&` stays
/// one path segment or one parameter.
fn encode(raw: &str) -> String {
    raw.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The hold's state, as the stream tells it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Claim {
    /// The token and the end of the claim, while held.
    pub held: Option<(u64, BootInstant)>,
    /// Of a lock of several permits, the permit held (the stream names it).
    pub permit: Option<u32>,
    /// The lease and the renew interval the sidecar holds it with.
    pub timing: Option<(Duration, Duration)>,
    /// Who holds it in the backend (the sidecar's identity, or `POD/OWNER` for a key).
    pub identity: Option<String>,
    /// Several keys' tokens, `KEY=TOKEN` each, comma-separated (`held` has the highest, for
    /// exec's own bookkeeping: no one token fences every key).
    pub tokens: Option<String>,
    /// The hold cannot go on: the status to exit with and why.
    pub failed: Option<(u8, String)>,
}

/// A hold through a sidecar, asked for until taken; closed (and so released) when dropped and
/// the command's copy of the connection is closed too.
pub struct Hold {
    task: tokio::task::JoinHandle<()>,
    /// A copy of the connection's socket that is not closed on exec, for the command to inherit.
    inheritable: Arc<Mutex<Option<OwnedFd>>>,
    /// Set once the command is being started ([`Hold::inheritable`]): a stream that ends before
    /// is asked for again, as the command has not run.
    command_started: Arc<AtomicBool>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        // The task owns the connection: ending it closes exec's side of it, and the connection
        // closes once the command's copy is closed too.
        self.task.abort();
    }
}

impl Hold {
    /// Ask `via` for `target` until it is held, giving up after `wait` (`None`: never).
    pub fn start(
        via: Via,
        target: Target,
        wait: Option<Duration>,
    ) -> (Self, watch::Receiver<Claim>) {
        let (claims, claim) = watch::channel(Claim::default());
        let inheritable = Arc::new(Mutex::new(None));
        let command_started = Arc::new(AtomicBool::new(false));
        let (copy, started) = (inheritable.clone(), command_started.clone());
        let task = tokio::spawn(async move {
            let failed = hold(&via, &target, wait, &claims, &copy, &started).await;
            claims.send_modify(|c| {
                c.held = None;
                c.failed = Some(failed);
            });
        });
        let hold = Self {
            task,
            inheritable,
            command_started,
        };
        (hold, claim)
    }

    /// The copy of the held connection the command is to inherit, as the command is started:
    /// kept open across the command's spawn, then dropped here.
    pub fn inheritable(&self) -> Option<OwnedFd> {
        self.command_started.store(true, Ordering::SeqCst);
        self.inheritable
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

/// Ask until held, then follow the stream; the failure that ends it. A stream that ends
/// before the command is started is asked for again: nothing ran, and the wait goes on.
async fn hold(
    via: &Via,
    target: &Target,
    wait: Option<Duration>,
    claims: &watch::Sender<Claim>,
    inheritable: &Mutex<Option<OwnedFd>>,
    command_started: &AtomicBool,
) -> (u8, String) {
    let started = Instant::now();
    let mut told_unreachable = false;
    loop {
        let left = wait.map_or(MAX_WAIT_PER_REQUEST, |w| {
            w.saturating_sub(started.elapsed())
        });
        let asked = ask(via, target, left.min(MAX_WAIT_PER_REQUEST)).await;
        match asked {
            Ok(Answer::Stream { mut lines, sent }) => {
                // `dup` leaves close-on-exec off: the command, spawned while the copy is open,
                // keeps the connection open as long as it or a process it started lives.
                match nix::unistd::dup(lines.get_mut().get_ref()) {
                    Ok(copy) => {
                        *inheritable.lock().unwrap_or_else(|e| e.into_inner()) = Some(copy);
                    }
                    Err(e) => {
                        return (
                            1,
                            format!("cannot copy the connection for the command: {e}"),
                        );
                    }
                }
                let ended = follow(lines, sent, claims).await;
                if command_started.load(Ordering::SeqCst) {
                    return ended;
                }
                tracing::info!(why = %ended.1, "the hold ended before the command started; asking again");
                claims.send_modify(|c| {
                    c.held = None;
                    c.tokens = None;
                });
                tokio::time::sleep(ASK_AGAIN_PAUSE).await;
            }
            // Held by another, the backend unreachable, or the pod's key limit reached: all pass.
            Ok(Answer::Refused { status, body }) if matches!(status, 409 | 429 | 503) => {
                tracing::debug!(status, body, "not held yet");
                if status != 409 {
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
            Ok(Answer::Refused { status, body }) => {
                return (
                    EXIT_BAD_CONFIG,
                    format!("the sidecar at {} refused: {status} {body}", via.authority),
                );
            }
            Err(e) => {
                if !told_unreachable {
                    eprintln!(
                        "leasehold exec: the sidecar at {} cannot be reached ({e}); trying again",
                        via.authority
                    );
                    told_unreachable = true;
                }
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
        // Waiting runs out in `exec`'s own wait; this only stops asking.
        if wait.is_some_and(|w| started.elapsed() >= w) {
            std::future::pending::<()>().await;
        }
    }
}

enum Answer {
    /// The hold's event stream, and when its request was sent.
    Stream {
        lines: tokio::io::Lines<BufReader<TcpStream>>,
        sent: BootInstant,
    },
    Refused {
        status: u16,
        body: String,
    },
}

/// How far apart two readings of one boot clock may seem through the events' milliseconds,
/// each rounded down.
const BOOT_CLOCK_ROUNDING: Duration = Duration::from_millis(2);

async fn ask(via: &Via, target: &Target, wait: Duration) -> std::io::Result<Answer> {
    let mut connection = TcpStream::connect(&via.authority).await?;
    connection.set_nodelay(true)?;
    let request = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\n\r\n",
        target.path(wait),
        via.authority
    );
    let sent = BootInstant::now();
    connection.write_all(request.as_bytes()).await?;
    let mut reader = BufReader::new(connection);
    let mut status_line = String::new();
    reader.read_line(&mut status_line).await?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {status_line:?}")))?;
    let mut length = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await? == 0 {
            return Err(std::io::Error::other("the answer ended in its head"));
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse::<usize>().ok();
        }
    }
    if status == 200 {
        return Ok(Answer::Stream {
            lines: reader.lines(),
            sent,
        });
    }
    let mut body = vec![0; length.unwrap_or(0).min(64 * 1024)];
    reader.read_exact(&mut body).await?;
    Ok(Answer::Refused {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Follow the stream, asked for at `sent`, until it ends; the claim moves with each event.
async fn follow(
    mut lines: tokio::io::Lines<BufReader<TcpStream>>,
    sent: BootInstant,
    claims: &watch::Sender<Claim>,
) -> (u8, String) {
    let mut kind = String::new();
    // Whether the sidecar's boot clock is this machine's, told by the first event that says.
    let mut shared_boot_clock = None;
    loop {
        let line = match lines.next_line().await {
            Ok(Some(line)) => line,
            Ok(None) => {
                return (
                    super::EXIT_LOCK_LOST,
                    "the sidecar closed the stream".into(),
                );
            }
            Err(e) => return (super::EXIT_LOCK_LOST, format!("the stream broke: {e}")),
        };
        // Chunk sizes come on lines of their own; an event's lines are whole.
        if let Some(k) = line.strip_prefix("event: ") {
            kind = k.to_owned();
            continue;
        }
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        // Dated on arrival alone, the claim would end past the sidecar's by as long as the
        // event waited to be read: exec stopped (Ctrl-Z) or starved, the event in a buffer.
        let read = BootInstant::now();
        let Ok(body) = serde_json::from_str::<serde_json::Value>(data) else {
            continue;
        };
        // Several keys: each key's token, and the highest of them as the claim's.
        let keys: Vec<(&str, u64)> = body["keys"]
            .as_array()
            .map(|keys| {
                keys.iter()
                    .filter_map(|k| Some((k["key"].as_str()?, k["fencingToken"].as_u64()?)))
                    .collect()
            })
            .unwrap_or_default();
        let token = body["fencingToken"]
            .as_u64()
            .or_else(|| keys.iter().map(|(_, token)| *token).max());
        let tokens = (!keys.is_empty()).then(|| {
            keys.iter()
                .map(|(key, token)| format!("{key}={token}"))
                .collect::<Vec<_>>()
                .join(",")
        });
        match kind.as_str() {
            "acquired" | "renewed" => {
                let (Some(token), Some(valid_for)) = (token, body["validForMs"].as_u64()) else {
                    continue;
                };
                // The claim's end on the boot clock is exact however late the event is read,
                // where the sidecar's boot clock is this machine's.
                let mut end = read + Duration::from_millis(valid_for);
                if let Some(until) = body["validUntilBootTimeMs"].as_u64() {
                    let until = BootInstant::from_millis(until);
                    // An event with no time left says nothing of when it was written.
                    if shared_boot_clock.is_none() && valid_for > 0 {
                        let written = until - Duration::from_millis(valid_for);
                        shared_boot_clock = Some(shares_boot_clock(
                            body["bootId"].as_str(),
                            written,
                            sent,
                            read,
                        ));
                    }
                    if shared_boot_clock == Some(true) {
                        end = end.min(until);
                    }
                }
                let timing = body["leaseDurationMs"]
                    .as_u64()
                    .zip(body["renewIntervalMs"].as_u64())
                    .map(|(lease, renew)| {
                        (Duration::from_millis(lease), Duration::from_millis(renew))
                    });
                let identity = body["identity"].as_str().map(str::to_owned);
                let permit = body["permit"].as_u64().and_then(|p| u32::try_from(p).ok());
                claims.send_modify(|c| {
                    c.held = Some((token, end));
                    c.permit = permit.or(c.permit);
                    c.timing = timing.or(c.timing);
                    c.identity = identity.or(c.identity.take());
                    c.tokens = tokens.or(c.tokens.take());
                });
            }
            "lost" | "released" => {
                let reason = body["reason"].as_str().unwrap_or("").to_owned();
                return (
                    super::EXIT_LOCK_LOST,
                    format!("the sidecar says {kind}: {reason}"),
                );
            }
            _ => {}
        }
    }
}

/// Whether the sidecar's boot clock is this process's: the sidecar runs on this machine's
/// kernel, this boot (`boot_id`), and an event it wrote at `written` on its clock was written
/// between the sending of the request and the reading of the event (a time namespace may move
/// the clock). A sidecar elsewhere (through a port forward) has its events dated from their
/// reading alone.
fn shares_boot_clock(
    boot_id: Option<&str>,
    written: BootInstant,
    sent: BootInstant,
    read: BootInstant,
) -> bool {
    let shared = boot_id.is_some_and(|id| Some(id) == leasehold_lease::boot_clock::boot_id())
        && written + BOOT_CLOCK_ROUNDING >= sent
        && written <= read + BOOT_CLOCK_ROUNDING;
    if !shared {
        eprintln!(
            "leasehold exec: the sidecar's boot clock is not this process's (another machine, or \
             another time namespace); a renewal read late is dated from its reading"
        );
    }
    shared
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event of this boot, written between the request's sending and its reading, is of
    /// this machine's boot clock; one of another boot, or written before the request was sent
    /// or after it was read, is not.
    #[test]
    fn a_boot_clock_is_shared_only_by_this_boot_between_request_and_reading() {
        let here = leasehold_lease::boot_clock::boot_id();
        assert!(here.is_some(), "no boot id on this machine");
        let sent = BootInstant::now();
        let read = sent + Duration::from_secs(30);
        let shared = |id, written| shares_boot_clock(id, written, sent, read);
        assert!(shared(here, sent));
        assert!(shared(here, sent + Duration::from_secs(5)));
        assert!(shared(here, read + Duration::from_millis(1)));
        assert!(!shared(here, sent - Duration::from_secs(3600)));
        assert!(!shared(here, read + Duration::from_secs(1)));
        let elsewhere = Some("00000000-0000-0000-0000-000000000000");
        assert!(!shared(elsewhere, sent + Duration::from_secs(5)));
        assert!(!shared(None, sent + Duration::from_secs(5)));
    }

    #[test]
    fn via_is_an_http_authority() {
        assert_eq!(
            Via::parse("http://127.0.0.1:4040").unwrap().authority,
            "127.0.0.1:4040"
        );
        assert_eq!(
            Via::parse("http://localhost:4040/").unwrap().authority,
            "localhost:4040"
        );
        for bad in [
            "127.0.0.1:4040",
            "https://x:1",
            "http://",
            "http://x:1/lock",
            "http://u@x:1",
        ] {
            assert!(Via::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_stay_one_segment_or_one_parameter() {
        let target = Target::Key {
            family: "orders".into(),
            key: "a/b:c".into(),
            owner: "me&you=1".into(),
            mode: None,
        };
        assert_eq!(
            target.path(Duration::from_secs(2)),
            "/locks/orders/keys/a%2Fb%3Ac/hold?owner=me%26you%3D1&exclusive=true&wait=2000ms"
        );
        let writer = Target::Key {
            family: "orders".into(),
            key: "k".into(),
            owner: "job".into(),
            mode: Some(KeyMode::Write),
        };
        assert_eq!(
            writer.path(Duration::ZERO),
            "/locks/orders/keys/k/hold?owner=job&exclusive=true&mode=write&wait=0ms"
        );
        let several = Target::Keys {
            family: "orders".into(),
            keys: vec!["a/1".into(), "b".into()],
            owner: "job".into(),
            mode: None,
        };
        assert_eq!(
            several.path(Duration::ZERO),
            "/locks/orders/hold?keys=a%2F1,b&owner=job&exclusive=true&wait=0ms"
        );
        let written = Target::Keys {
            family: "orders".into(),
            keys: vec!["a".into(), "b".into()],
            owner: "job".into(),
            mode: Some(KeyMode::Write),
        };
        assert_eq!(
            written.path(Duration::ZERO),
            "/locks/orders/hold?keys=a,b&owner=job&exclusive=true&mode=write&wait=0ms"
        );
        assert_eq!(
            Target::Lock("jobs".into()).path(Duration::ZERO),
            "/locks/jobs/hold?exclusive=true&wait=0ms"
        );
    }
}
