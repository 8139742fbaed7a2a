//! The holder: one task per lock that campaigns, renews, releases and self-fences, the same for
//! every backend. Its public face is [`Lock`]: a snapshot that is always instant to read, a few
//! commands (acquire, release, shutdown) and an event stream.
//!
//! Self-fencing (docs/design.md, invariant 1): a lease is claimed only while the local monotonic clock
//! (`CLOCK_BOOTTIME`, which unlike `CLOCK_MONOTONIC` keeps counting while the machine is
//! suspended: [`crate::boot_clock`]) is before `t_sent + lease_duration - safety_margin`, where `t_sent` is when the last successful
//! acquire or renew request was *sent*. The backend started its own lease no earlier than that, so
//! this process stops claiming before the backend can give the lock to anyone else. Where the
//! server that decides does not see the request itself (a ZooKeeper follower relays signs of
//! life to the leader later), the driver dates the backend's lease earlier still
//! ([`crate::Driver::counted_from`]), and `t_sent` is that instant. Readers
//! compare the deadline with the clock themselves, so a process that was paused answers "not
//! holder" the instant it resumes, before this task has run again.
//!
//! Its files, by layer: this one holds the public types (the settings, the snapshot and its
//! answers, the events); `lock` the handle the app holds and the commands it sends; `engine`
//! the task that campaigns, renews and fences; `in_flight` an acquisition the engine stopped
//! waiting for, followed to its end; `line` the turn a process waiting for a lock of several
//! permits takes in the lock's line (etcd, ZooKeeper).

mod engine;
mod in_flight;
mod line;
mod lock;

pub(crate) use engine::jitter;
pub use lock::Lock;
pub(crate) use lock::OnUnheld;

use std::time::{Duration, SystemTime};

use crate::boot_clock::BootInstant;
use crate::driver::Holding;
use crate::error::{Error, Result};
use crate::names::validate_lock_name;

/// Shortest lease accepted: below this, scheduling noise eats the safety margin.
pub const MIN_LEASE_DURATION: Duration = Duration::from_millis(200);
/// Longest lease accepted: a day is already far longer than any sane failover.
pub const MAX_LEASE_DURATION: Duration = Duration::from_secs(24 * 3600);
/// The longest pause between two attempts when the backend keeps failing.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);
/// How long a release on shutdown may take before the process exits anyway; the lease then
/// simply expires.
pub const SHUTDOWN_RELEASE_TIMEOUT: Duration = Duration::from_millis(600);
/// Default bound on an on-demand hold when the app does not give one.
pub const DEFAULT_HOLD: Duration = Duration::from_secs(60);
/// Capacity of the event channel; a slower reader misses events, never blocks the holder.
const EVENT_CAPACITY: usize = 64;

/// The part of the lease this process does not claim, to absorb clock-rate differences between
/// this host and the backend: 2% of the lease plus 10 ms.
pub fn safety_margin(lease_duration: Duration) -> Duration {
    lease_duration / 50 + Duration::from_millis(10)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Always try to hold the lock (leader election).
    Campaign,
    /// Hold the lock only while the app has asked for it.
    OnDemand,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "campaign" | "Campaign" => Ok(Mode::Campaign),
            "on-demand" | "OnDemand" | "ondemand" => Ok(Mode::OnDemand),
            other => Err(format!("expected campaign or on-demand, got {other:?}")),
        }
    }
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Campaign => "campaign",
            Mode::OnDemand => "on-demand",
        }
    }
}

#[derive(Debug, Clone)]
pub struct LockConfig {
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_interval: Duration,
    pub mode: Mode,
    /// After a voluntary release in campaign mode, sit out this long before campaigning again.
    pub cooldown: Duration,
    /// On demand, for one holding only (a keyed lock's key, taken for one owner): the engine
    /// touches the backend only for its first command, and stops once nothing is held or
    /// awaited, rather than keep watching an idle lock. Its events are logged at debug level: a
    /// family may take thousands of keys a second.
    pub single_use: bool,
    /// Single use, on a backend that keeps a queue ([`crate::Driver::keeps_queue`]): an attempt
    /// refused keeps its place in line, for the caller to come back to or leave
    /// ([`crate::Driver::abandon`]). A semaphore's first waiter keeps a place on every permit
    /// this way, so that nobody behind it takes a permit first (keyed.rs).
    pub keeps_queue_place: bool,
    /// Its events and its start and stop are logged at debug level, as a single-use lock's:
    /// the line a lock of several permits keeps its waiters in (`line`), which no app holds.
    pub quiet: bool,
    /// How many holders the lock has at once (a semaphore, docs/semaphores.md): each holds one
    /// permit, a lock of its own in the backend ([`LockConfig::permit_name`]). 1 is a mutual
    /// exclusion lock.
    pub permits: u32,
    /// Campaign mode: start sitting out, for this reason, until [`Lock::come_back`]: a lock put
    /// in place while the app is unhealthy ([`Lock::sit_out`]).
    pub sitting_out: Option<String>,
}

impl LockConfig {
    /// A config with the defaults of docs/design.md: renew every third of the lease, and a cool-down
    /// of one lease after stepping down.
    pub fn new(name: &str, identity: &str, lease_duration: Duration) -> Self {
        Self {
            name: name.to_owned(),
            identity: identity.to_owned(),
            lease_duration,
            renew_interval: lease_duration / 3,
            mode: Mode::Campaign,
            cooldown: lease_duration,
            single_use: false,
            keeps_queue_place: false,
            quiet: false,
            permits: 1,
            sitting_out: None,
        }
    }

    /// The backend lock name of permit `permit`: the lock's own name for permit 0, so that a
    /// lock given permits keeps its holder, else the name a family called after the lock would
    /// give the key `#PERMIT`, which no key can be (`#` is refused in keys).
    pub fn permit_name(&self, permit: u32) -> String {
        crate::keyed::lock_permit_name(&self.name, permit)
    }

    pub fn validate(&self) -> Result<()> {
        validate_lock_name(&self.name)?;
        let bad = |field, reason: String| Error::InvalidConfig { field, reason };
        if !(1..=crate::keyed::MAX_PERMITS).contains(&self.permits) {
            return Err(bad(
                "permits",
                format!(
                    "a lock has 1 to {} permits (it was {})",
                    crate::keyed::MAX_PERMITS,
                    self.permits
                ),
            ));
        }
        if self.permits > 1
            && let Err(Error::InvalidConfig { reason, .. }) =
                crate::keyed::validate_family_name(&self.name)
        {
            return Err(bad(
                "lock",
                format!(
                    "a lock of several permits names them as a family names its keys: {reason}"
                ),
            ));
        }
        if self.keeps_queue_place && !self.single_use {
            return Err(bad(
                "keeps_queue_place",
                "only a single-use lock keeps a place in line for its caller".into(),
            ));
        }
        if self.identity.is_empty() || self.identity.len() > 253 {
            return Err(bad("identity", "it must be 1-253 characters".into()));
        }
        if self.identity.chars().any(char::is_control) {
            return Err(bad(
                "identity",
                "it must not contain control characters".into(),
            ));
        }
        if !(MIN_LEASE_DURATION..=MAX_LEASE_DURATION).contains(&self.lease_duration) {
            return Err(bad(
                "lease-duration",
                format!("it must be between {MIN_LEASE_DURATION:?} and {MAX_LEASE_DURATION:?}"),
            ));
        }
        if self.renew_interval.is_zero()
            || self.renew_interval + safety_margin(self.lease_duration) >= self.lease_duration
        {
            return Err(bad(
                "renew-interval",
                format!(
                    "it must be above zero and below the lease duration minus its safety margin ({:?})",
                    self.lease_duration - safety_margin(self.lease_duration)
                ),
            ));
        }
        Ok(())
    }
}

/// A lock's count of permits as it changes while the lock runs ([`Lock::set_permits`]): the
/// engine's next rounds read it, a holding is never revoked by it.
pub(crate) struct Permits {
    now: std::sync::atomic::AtomicU32,
    /// The most it has been: while above 1, answers name the permit (a holding may be on a
    /// permit above a lowered count).
    ever: std::sync::atomic::AtomicU32,
    /// The lock's driver, for reading who holds its permits ([`Lock::holders`]).
    driver: std::sync::Arc<dyn crate::driver::Driver>,
}

impl Permits {
    fn new(permits: u32, driver: std::sync::Arc<dyn crate::driver::Driver>) -> Self {
        Self {
            now: permits.into(),
            ever: permits.into(),
            driver,
        }
    }

    pub(crate) fn now(&self) -> u32 {
        self.now.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub(crate) fn ever(&self) -> u32 {
        self.ever.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn set(&self, permits: u32) {
        self.ever
            .fetch_max(permits, std::sync::atomic::Ordering::SeqCst);
        self.now.store(permits, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The answer to "am I the holder?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Holder {
        token: u64,
        valid_for: Duration,
        /// The permit held, of a lock with several ([`LockConfig::permits`]); 0 otherwise.
        /// With the token, what names the holding: tokens count per permit.
        permit: u32,
    },
    NotHolder,
    /// The backend cannot be reached (or has not been yet): this process does not claim the lock
    /// and cannot tell who does.
    Unknown,
}

impl Answer {
    pub fn is_holder(&self) -> bool {
        matches!(self, Answer::Holder { .. })
    }

    /// The fencing token, while this process holds.
    pub fn token(&self) -> Option<u64> {
        match self {
            Answer::Holder { token, .. } => Some(*token),
            _ => None,
        }
    }

    /// The permit and the token, while this process holds: what names its holding.
    pub fn holding(&self) -> Option<(u32, u64)> {
        match self {
            Answer::Holder { token, permit, .. } => Some((*permit, *token)),
            _ => None,
        }
    }
}

/// This process's lease, while it has one.
#[derive(Debug, Clone)]
pub struct Held {
    pub token: u64,
    /// The permit held, of a lock with several ([`LockConfig::permits`]); 0 otherwise.
    pub permit: u32,
    /// The self-fence deadline: not holder from this instant on, unless renewed. On the boot
    /// clock, which counts time suspended.
    pub valid_until: BootInstant,
    pub acquired_at: SystemTime,
    /// On-demand: the sidecar releases the lock by then unless acquired again or extended (the
    /// end of the longest outstanding hold). An answer's validity never runs past it.
    pub hold_until: Option<BootInstant>,
}

impl Held {
    /// Until when an answer about this holding is valid: its claim, cut at the hold's end.
    pub fn answered_until(&self) -> BootInstant {
        self.hold_until
            .map_or(self.valid_until, |hold| hold.min(self.valid_until))
    }
}

/// Everything the API shows, published by the holder task on every change.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub held: Option<Held>,
    /// The holder as last seen in the backend (this process while it holds).
    pub current_holder: Option<Holding>,
    /// The last backend error, until the next successful call.
    pub backend_error: Option<String>,
    /// Whether the backend has answered at least once.
    pub contacted: bool,
    /// When the current answer began (holder / not holder / unknown).
    pub since: SystemTime,
    /// On-demand mode: how many acquisitions the app holds (re-entrant count).
    pub holds: u32,
    /// The backend keeps a dead holder's claim longer than the lease (ZooKeeper's
    /// `minSessionTimeout`, etcd's whole seconds): a crashed holder is replaced later than the
    /// lease promises. Shown by `/lock` and `/readyz`, and logged once.
    pub warning: Option<String>,
    /// The last attempt found the lock free, but a guard of the backend's withholds it (see
    /// [`crate::Withheld`]): why, and when grants resume if the backend said. Cleared by the
    /// next attempt that finds otherwise.
    pub withheld: Option<WithheldUntil>,
    /// Campaign mode: this process sits out, and why ([`Lock::sit_out`]).
    pub sitting_out: Option<String>,
}

/// A [`crate::Withheld`] answer, dated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WithheldUntil {
    pub reason: String,
    /// When grants resume, when known.
    pub until: Option<BootInstant>,
}

impl Snapshot {
    fn initial() -> Self {
        Self {
            held: None,
            current_holder: None,
            backend_error: None,
            contacted: false,
            since: SystemTime::now(),
            holds: 0,
            warning: None,
            withheld: None,
            sitting_out: None,
        }
    }

    /// The answer at `now`. Computed by the reader so that it is right even when the holder task
    /// has not run for a while (a paused process).
    pub fn answer_at(&self, now: BootInstant) -> Answer {
        if !self.contacted || self.backend_error.is_some() {
            return Answer::Unknown;
        }
        // Not held once the claim or the hold has run out, also while the engine has yet to
        // lapse it (it may be waiting for a renewal's answer).
        match &self.held {
            Some(held) if now < held.answered_until() => Answer::Holder {
                token: held.token,
                permit: held.permit,
                valid_for: held.answered_until().saturating_duration_since(now),
            },
            _ => Answer::NotHolder,
        }
    }

    /// Whether the claim stands at `now`, whatever the hold: the backend reached, and the lease
    /// held within its claim. A hold that ran out a moment ago, its lease not let go yet, may be
    /// taken again on it.
    pub fn claim_stands_at(&self, now: BootInstant) -> bool {
        self.contacted
            && self.backend_error.is_none()
            && self
                .held
                .as_ref()
                .is_some_and(|held| now < held.valid_until)
    }

    pub fn answer(&self) -> Answer {
        self.answer_at(BootInstant::now())
    }

    /// Ready for traffic: the backend answered the last call.
    pub fn ready(&self) -> bool {
        self.contacted && self.backend_error.is_none()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Acquired,
    Lost,
    Released,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Acquired => "acquired",
            EventKind::Lost => "lost",
            EventKind::Released => "released",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Event {
    pub kind: EventKind,
    pub lock: String,
    pub token: u64,
    /// The permit, of a lock with several; 0 otherwise.
    pub permit: u32,
    pub at: SystemTime,
    pub reason: &'static str,
}

/// Hooks for metrics; the lease engine itself depends on no metrics library.
///
/// The `key_*` hooks carry a keyed family's keys, reported by family only: keys are chosen at
/// run time and without bound, so a key must never become a metric label (every key ever taken
/// would stay a series in the sidecar's memory and in Prometheus).
pub trait Telemetry: Send + Sync + 'static {
    fn event(&self, _event: &Event) {}
    fn renewed(&self, _lock: &str, _latency: Duration) {}
    fn backend_error(&self, _lock: &str, _error: &Error) {}
    /// A key of `family` was acquired, lost or released (`event.lock` is the key's backend name).
    fn key_event(&self, _family: &str, _event: &Event) {}
    fn key_renewed(&self, _family: &str, _latency: Duration) {}
    fn key_backend_error(&self, _family: &str, _error: &Error) {}
    /// An owner of `family` was refused a key another owner held (after its wait).
    fn key_contended(&self, _family: &str) {}
}

impl Telemetry for () {}
