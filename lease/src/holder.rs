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
//! ([`Driver::counted_from`]), and `t_sent` is that instant. Readers
//! compare the deadline with the clock themselves, so a process that was paused answers "not
//! holder" the instant it resumes, before this task has run again.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{broadcast, oneshot, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::boot_clock::BootInstant;
use crate::commands;
use crate::driver::{Acquire, Driver, Holding, Lease};
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
        }
    }

    pub fn validate(&self) -> Result<()> {
        validate_lock_name(&self.name)?;
        let bad = |field, reason: String| Error::InvalidConfig { field, reason };
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

/// The answer to "am I the holder?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Holder {
        token: u64,
        valid_for: Duration,
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
}

/// This process's lease, while it has one.
#[derive(Debug, Clone)]
pub struct Held {
    pub token: u64,
    /// The self-fence deadline: not holder from this instant on, unless renewed. On the boot
    /// clock, which counts time suspended.
    pub valid_until: BootInstant,
    pub acquired_at: SystemTime,
    /// On-demand: the sidecar releases the lock by then unless acquired again or extended (the
    /// end of the longest outstanding hold). An answer's validity never runs past it.
    pub hold_until: Option<BootInstant>,
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
        }
    }

    /// The answer at `now`. Computed by the reader so that it is right even when the holder task
    /// has not run for a while (a paused process).
    pub fn answer_at(&self, now: BootInstant) -> Answer {
        if !self.contacted || self.backend_error.is_some() {
            return Answer::Unknown;
        }
        match &self.held {
            Some(held) if now < held.valid_until => Answer::Holder {
                token: held.token,
                valid_for: held
                    .hold_until
                    .map_or(held.valid_until, |hold| hold.min(held.valid_until))
                    .saturating_duration_since(now),
            },
            _ => Answer::NotHolder,
        }
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

enum Command {
    Acquire {
        wait: Duration,
        hold: Duration,
        reply: oneshot::Sender<Answer>,
    },
    Release {
        reply: oneshot::Sender<bool>,
    },
    Extend {
        hold: Duration,
        reply: oneshot::Sender<Answer>,
    },
    /// Stop without releasing ([`Lock::retire`]); `done` fires once the engine has let go.
    Retire {
        done: oneshot::Sender<()>,
    },
}

/// Called once when a lock stops being held by this process: its lease released or lost, or its
/// task ended (or aborted) before that. It runs on whatever thread the engine runs or is dropped
/// on, so it must only do quick, non-blocking work. A keyed family frees a key's slot with it,
/// where a task per held key, waiting for the same moment, would cost each key its own memory.
pub(crate) struct OnUnheld(Option<Box<dyn FnOnce() + Send>>);

impl OnUnheld {
    pub(crate) fn new(hook: impl FnOnce() + Send + 'static) -> Self {
        Self(Some(Box::new(hook)))
    }

    fn fire(&mut self) {
        if let Some(hook) = self.0.take() {
            hook();
        }
    }
}

impl Drop for OnUnheld {
    fn drop(&mut self) {
        self.fire();
    }
}

/// A lock held (or sought) by this process. Cheap to clone; the task stops when the last clone
/// is shut down or dropped.
#[derive(Clone)]
pub struct Lock {
    inner: Arc<LockInner>,
}

/// The event channel, made at the first subscription. A channel holds its whole capacity from
/// the start (some 8 KiB), which a sidecar holding thousands of keyed locks, whose events nobody
/// reads, would pay for every key; and an event sent before anyone subscribes is lost either way.
#[derive(Clone, Default)]
struct Events(Arc<std::sync::OnceLock<broadcast::Sender<Event>>>);

impl Events {
    fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.0
            .get_or_init(|| broadcast::channel(EVENT_CAPACITY).0)
            .subscribe()
    }

    fn send(&self, event: Event) {
        if let Some(sender) = self.0.get() {
            let _ = sender.send(event);
        }
    }
}

struct LockInner {
    /// Shared with the engine: one copy per lock, of which a keyed family has thousands.
    config: Arc<LockConfig>,
    backend: &'static str,
    state: watch::Receiver<Snapshot>,
    events: Events,
    /// Boxed: a command is queued rarely, and most of them are small.
    commands: commands::Sender<Box<Command>>,
    /// Latches rather than watch channels: a watch channel takes some 400 bytes, which a
    /// sidecar holding 10,000 keyed locks pays per lock.
    shutdown: CancellationToken,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Cancelled once the task and every acquisition it left in flight have ended
    /// ([`Lock::settled`]).
    settled: CancellationToken,
}

impl Drop for LockInner {
    fn drop(&mut self) {
        // Asked to stop before ([`Lock::stop`]; a shutdown has taken the task already): the
        // task is left to end by itself.
        let stopping = self.shutdown.is_cancelled();
        self.shutdown.cancel();
        if let Some(task) = self.task.lock().unwrap_or_else(|e| e.into_inner()).take()
            && !stopping
        {
            // Like kill -9: whatever the task was doing (a release too) is not finished.
            task.abort();
        }
    }
}

impl Lock {
    /// Validate the config and start the holder task.
    pub fn start(
        driver: Arc<dyn Driver>,
        config: LockConfig,
        telemetry: Arc<dyn Telemetry>,
    ) -> Result<Self> {
        Self::start_with_hook(driver, config, telemetry, None)
    }

    /// [`Lock::start`], with `on_unheld` called once when this process stops holding the lock
    /// (after it is published as not held), or when the task ends without that.
    pub(crate) fn start_with_hook(
        driver: Arc<dyn Driver>,
        config: LockConfig,
        telemetry: Arc<dyn Telemetry>,
        on_unheld: Option<OnUnheld>,
    ) -> Result<Self> {
        let (lock, engine) = Self::prepare(driver, config, telemetry, on_unheld)?;
        lock.spawn(Box::new(engine).run());
        Ok(lock)
    }

    /// A single-use on-demand lock whose one acquisition (waiting up to `wait`, then kept at
    /// most `hold`) the engine makes on the caller's task, which would only wait for it
    /// otherwise; the engine's task is spawned once the lock is held, to renew it and answer
    /// commands. A keyed family starts one per acquisition, and the hops between the caller's
    /// task and the engine's were most of what a keyed cycle cost beyond its backend calls.
    /// Dropping the returned future mid-way drops the engine, as aborting its task would.
    pub(crate) async fn acquire_single_use(
        driver: Arc<dyn Driver>,
        config: LockConfig,
        telemetry: Arc<dyn Telemetry>,
        on_unheld: Option<OnUnheld>,
        wait: Duration,
        hold: Duration,
    ) -> Result<(Self, Answer)> {
        debug_assert!(config.single_use && config.mode == Mode::OnDemand);
        let (lock, engine) = Self::prepare(driver, config, telemetry, on_unheld)?;
        let mut engine = Box::new(engine);
        engine.started();
        let (reply, mut answer) = oneshot::channel();
        engine.served = true;
        engine.unwatched = true;
        let _ = engine
            .command(Some(Box::new(Command::Acquire { wait, hold, reply })))
            .await;
        // The steps the engine's task would take until the lock is held or nobody waits.
        while engine.held.is_none() && engine.wants_lock() && !engine.shutdown.is_cancelled() {
            engine.fence();
            if let Flow::Stop = Box::pin(engine.campaign_step()).await {
                break;
            }
        }
        engine.unwatched = false;
        if engine.held.is_some() {
            lock.spawn(engine.steps());
        } else {
            // Nothing to keep: the engine ends here (a late attempt is followed up by itself).
            engine.steps().await;
        }
        let answer = answer.try_recv().map_err(|_| Error::Shutdown)?;
        Ok((lock, answer))
    }

    /// The handle and its engine, not yet running.
    fn prepare(
        driver: Arc<dyn Driver>,
        config: LockConfig,
        telemetry: Arc<dyn Telemetry>,
        on_unheld: Option<OnUnheld>,
    ) -> Result<(Self, Engine)> {
        config.validate()?;
        let config = Arc::new(config);
        let (state_tx, state_rx) = watch::channel(Snapshot::initial());
        let events = Events::default();
        let (command_tx, command_rx) = commands::channel();
        let shutdown = CancellationToken::new();
        let settled = CancellationToken::new();
        let engine = Engine {
            backend: driver.kind(),
            driver,
            config: config.clone(),
            state: state_tx,
            events: events.clone(),
            commands: command_rx,
            shutdown: shutdown.clone(),
            telemetry,
            held: None,
            retry_at: None,
            cooldown_until: None,
            holds: 0,
            hold_until: None,
            waiters: Vec::new(),
            served: false,
            unwatched: false,
            in_flight: None,
            settled: Arc::new(settled.clone().drop_guard()),
            on_unheld,
            retired: None,
        };
        let lock = Self {
            inner: Arc::new(LockInner {
                config,
                backend: engine.backend,
                state: state_rx,
                events,
                commands: command_tx,
                shutdown,
                task: std::sync::Mutex::new(None),
                settled,
            }),
        };
        Ok((lock, engine))
    }

    fn spawn(&self, engine: impl Future<Output = ()> + Send + 'static) {
        let task = tokio::spawn(engine);
        *self.inner.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
    }

    pub fn config(&self) -> &LockConfig {
        &self.inner.config
    }

    pub fn name(&self) -> &str {
        &self.inner.config.name
    }

    pub fn backend(&self) -> &'static str {
        self.inner.backend
    }

    /// The latest state; never waits on the backend.
    pub fn snapshot(&self) -> Snapshot {
        self.inner.state.borrow().clone()
    }

    pub fn answer(&self) -> Answer {
        self.inner.state.borrow().answer()
    }

    pub fn watch(&self) -> watch::Receiver<Snapshot> {
        self.inner.state.clone()
    }

    pub fn events(&self) -> broadcast::Receiver<Event> {
        self.inner.events.subscribe()
    }

    /// Wait up to `max` for this process to become the holder; then the answer as it is.
    pub async fn wait_for_holder(&self, max: Duration) -> Answer {
        let deadline = Instant::now() + max;
        let mut state = self.inner.state.clone();
        loop {
            let answer = state.borrow_and_update().answer();
            if answer.is_holder() {
                return answer;
            }
            tokio::select! {
                changed = state.changed() => if changed.is_err() { return self.answer() },
                _ = sleep_until(deadline) => return self.answer(),
            }
        }
    }

    /// On-demand: acquire (re-entrant), waiting up to `wait`, and keep it at most `hold` unless
    /// acquired again. In campaign mode this only waits for the campaign to win.
    pub async fn acquire(&self, wait: Duration, hold: Duration) -> Result<Answer> {
        if self.inner.config.mode == Mode::Campaign {
            return Ok(self.wait_for_holder(wait).await);
        }
        let (reply, answer) = oneshot::channel();
        self.inner
            .commands
            .send(Box::new(Command::Acquire { wait, hold, reply }))
            .map_err(|_| Error::Shutdown)?;
        answer.await.map_err(|_| Error::Shutdown)
    }

    /// Step down (campaign mode: then sit out the cool-down) or drop one on-demand acquisition.
    /// `Ok(false)`: this process did not hold the lock.
    pub async fn release(&self) -> Result<bool> {
        let (reply, released) = oneshot::channel();
        self.inner
            .commands
            .send(Box::new(Command::Release { reply }))
            .map_err(|_| Error::Shutdown)?;
        released.await.map_err(|_| Error::Shutdown)
    }

    /// On-demand: keep the app's hold at least `hold` from now, without acquiring again (a hold
    /// only moves later: an extension never cuts an acquisition's hold short).
    /// The answer is the lock's as it stands; nothing changes when it is not held.
    pub async fn extend(&self, hold: Duration) -> Result<Answer> {
        let (reply, answer) = oneshot::channel();
        self.inner
            .commands
            .send(Box::new(Command::Extend { hold, reply }))
            .map_err(|_| Error::Shutdown)?;
        answer.await.map_err(|_| Error::Shutdown)
    }

    /// Release the lease if held and stop the task. Returns within
    /// [`SHUTDOWN_RELEASE_TIMEOUT`] plus a little, whatever the backend does.
    pub async fn shutdown(&self) {
        self.inner.shutdown.cancel();
        let task = self
            .inner
            .task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(mut task) = task
            && timeout(
                SHUTDOWN_RELEASE_TIMEOUT + Duration::from_millis(200),
                &mut task,
            )
            .await
            .is_err()
        {
            task.abort();
        }
    }

    /// Stop for good without releasing: the lease runs out on its own (within the lease), so
    /// that no other process takes the lock while an app may still act on an answer this one
    /// gave. For a lock replaced by another with the same identity (new settings, new
    /// credentials), which takes the lock once the lease has run out. Falls back to
    /// [`Lock::shutdown`] when the task does not take the request in time.
    pub async fn retire(&self) {
        let (done, retired) = oneshot::channel();
        if self
            .inner
            .commands
            .send(Box::new(Command::Retire { done }))
            .is_ok()
        {
            let _ = timeout(SHUTDOWN_RELEASE_TIMEOUT, retired).await;
        }
        self.shutdown().await;
    }

    /// Ask the task to stop, without waiting for it: it releases what it holds on its way out
    /// (as on shutdown), and it is left to end by itself, not aborted, when the last handle is
    /// dropped. Cheaper than a task that waits for [`Lock::shutdown`], which a keyed family
    /// would spawn for every holding that ends.
    pub(crate) fn stop(&self) {
        self.inner.shutdown.cancel();
    }

    /// Resolves once the task has ended and no acquisition it started can still take the lock:
    /// one it stopped waiting for is followed to its end, and what it took is given back
    /// ([`InFlight`]). Until then the backend may still show this identity as the holder.
    pub async fn settled(&self) {
        self.inner.settled.cancelled().await;
    }
}

/// An acquisition sent to the backend, whose answer the engine has not had yet.
type Attempt = Pin<Box<dyn Future<Output = Result<Acquire>> + Send>>;

/// An acquisition the engine stopped waiting for (its budget ran out, or the engine stopped).
/// The backend may still carry it out: a statement already handed to SQLite's worker, a
/// command already on the wire. The engine's next campaign step waits for it rather than
/// sending another; if the engine ends first, it is followed to its end in the background and
/// a lease it took is released, so that nobody is left holding the lock for nobody (until its
/// lease runs out) and a retry by the same identity does not meet its own earlier attempt.
struct InFlight {
    attempt: Option<Attempt>,
    sent: Instant,
    sent_boot: BootInstant,
    driver: Arc<dyn Driver>,
    /// The lock and identity the attempt is for, to leave the queue if it took a place.
    config: Arc<LockConfig>,
    /// How long the follow-up waits for the attempt before giving up on it.
    patience: Duration,
    settled: Arc<DropGuard>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(attempt) = self.attempt.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (driver, config, patience, settled) = (
            self.driver.clone(),
            self.config.clone(),
            self.patience,
            self.settled.clone(),
        );
        runtime.spawn(async move {
            let _settled = settled;
            match timeout(patience, attempt).await {
                Ok(Ok(Acquire::Acquired(lease))) => {
                    tracing::debug!(lock = %lease.lock, token = lease.token,
                        "an acquisition answered too late took the lock; releasing it");
                    let _ = timeout(patience, driver.release(&lease)).await;
                }
                // Nobody waits for it: a place it took in a fair queue (etcd, ZooKeeper) after
                // the wait ended, and so after the engine left the queue, is left too, rather
                // than standing first in line for three leases.
                _ => {
                    let _ = timeout(patience, driver.abandon(&config.name, &config.identity)).await;
                }
            }
        });
    }
}

struct HeldLease {
    lease: Lease,
    valid_until: BootInstant,
    /// The next renewal is due a renew interval after this: the newest renewal's call, or for
    /// a lease not yet renewed, its acquisition's (or earlier, see [`Engine::on_acquired`]).
    last_sent: Instant,
    acquired_at: SystemTime,
}

struct Waiter {
    deadline: Instant,
    hold: Duration,
    reply: oneshot::Sender<Answer>,
}

/// The result of one backend call made by the task.
enum Call<T> {
    Done(T),
    Failed,
    /// No answer within the budget: the call may still take effect.
    TimedOut,
    ShuttingDown,
}

struct Engine {
    driver: Arc<dyn Driver>,
    backend: &'static str,
    config: Arc<LockConfig>,
    state: watch::Sender<Snapshot>,
    events: Events,
    commands: commands::Receiver<Box<Command>>,
    shutdown: CancellationToken,
    telemetry: Arc<dyn Telemetry>,
    held: Option<HeldLease>,
    /// After a failed renewal: when to try again (before the regular schedule).
    retry_at: Option<Instant>,
    cooldown_until: Option<Instant>,
    /// On-demand: acquisitions the app holds, and when the hold lapses: the end of the longest
    /// hold among them, since each acquisition keeps the lock at least for its own hold.
    holds: u32,
    hold_until: Option<BootInstant>,
    waiters: Vec<Waiter>,
    /// A single-use engine has taken its first command.
    served: bool,
    /// No reader can wait for a change yet: a single-use engine's steps on its caller's task,
    /// before the caller has the handle. Publications then change the state without waking
    /// anyone, which was a good part of a keyed cycle's cost ([`Engine::publish`]).
    unwatched: bool,
    in_flight: Option<InFlight>,
    /// Kept by the engine and by each follow-up of an [`InFlight`]; [`Lock::settled`] resolves
    /// when the last is dropped.
    settled: Arc<DropGuard>,
    /// Fired by [`Engine::forget`], or when the engine is dropped.
    on_unheld: Option<OnUnheld>,
    /// Retired ([`Lock::retire`]): the lease is left to run out, not released; told here.
    retired: Option<oneshot::Sender<()>>,
}

/// An engine dropped while it waited for the lock (a keyed acquisition runs on its caller's
/// task, which is dropped when the client hangs up) leaves the queue as a wait that ends does:
/// otherwise its place would stand first in line, for nobody, until the backend gives it up.
/// An attempt still in flight leaves it once answered ([`InFlight`]).
impl Drop for Engine {
    fn drop(&mut self) {
        if self.waiters.is_empty() || self.held.is_some() || self.in_flight.is_some() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (driver, config) = (self.driver.clone(), self.config.clone());
        let settled = self.settled.clone();
        runtime.spawn(async move {
            let _settled = settled;
            let budget = config.renew_interval;
            let _ = timeout(budget, driver.abandon(&config.name, &config.identity)).await;
        });
    }
}

/// Whether the task goes on.
enum Flow {
    Continue,
    Stop,
}

/// `d` spread by +-20 %. The spread needs no secrecy, so it is drawn from the clock (splitmix64)
/// rather than the OS's entropy, which a sidecar alone in a root filesystem without `/dev` (as
/// `scripts/smoke-root` runs it) cannot open: seeding `rand`'s thread generator panicked there.
pub(crate) fn jitter(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |t| t.subsec_nanos() as u64 ^ t.as_secs());
    let mut x = nanos.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    let unit = (x >> 11) as f64 / (1u64 << 53) as f64;
    d.mul_f64(0.8 + 0.4 * unit)
}

impl Engine {
    /// The engine is boxed: an `async fn` keeps its arguments apart from its locals, so an
    /// engine taken by value would be stored twice in every lock's task.
    async fn run(self: Box<Self>) {
        self.started();
        self.steps().await;
    }

    fn started(&self) {
        if self.config.single_use {
            tracing::debug!(lock = %self.config.name, identity = %self.config.identity,
                backend = self.backend, "single-use lock started");
        } else {
            tracing::info!(lock = %self.config.name, identity = %self.config.identity,
                backend = self.backend, mode = self.config.mode.as_str(), "lock started");
        }
    }

    /// The engine's steps until it stops, then its release.
    async fn steps(mut self: Box<Self>) {
        loop {
            if self.shutdown.is_cancelled() {
                break;
            }
            self.fence();
            let flow = if self.held.is_some() {
                self.hold_step().await
            } else if self.wants_lock() {
                // Every step but the holding one is boxed: each keyed lock has a task, and it
                // spends its life holding, so the other steps should not size it.
                Box::pin(self.campaign_step()).await
            } else if self.config.single_use {
                if self.served {
                    break; // its holding is over, or its wait ended without one
                }
                Box::pin(self.first_command()).await
            } else {
                Box::pin(self.idle_step()).await
            };
            if let Flow::Stop = flow {
                break;
            }
        }
        // A retirement still queued (the engine was in a call when it came, and the caller then
        // shut it down) is honoured all the same: a retired lock never releases.
        if self.retired.is_none()
            && let Some(command) = self
                .commands
                .take_queued(|c| matches!(**c, Command::Retire { .. }))
            && let Command::Retire { done } = *command
        {
            self.retired = Some(done);
        }
        match self.retired.take() {
            Some(done) => {
                self.lapse();
                let _ = done.send(());
            }
            None => self.step_down("shutdown").await,
        }
        for waiter in self.waiters.drain(..) {
            let _ = waiter.reply.send(Answer::NotHolder);
        }
        if self.config.single_use {
            tracing::debug!(lock = %self.config.name, "single-use lock stopped");
        } else {
            tracing::info!(lock = %self.config.name, "lock stopped");
        }
    }

    /// A single-use engine waits for its one command without reading the backend first.
    async fn first_command(&mut self) -> Flow {
        tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => Flow::Stop,
            command = self.commands.recv() => {
                self.served = true;
                self.command(command).await
            }
        }
    }

    fn wants_lock(&self) -> bool {
        match self.config.mode {
            Mode::Campaign => true,
            Mode::OnDemand => !self.waiters.is_empty(),
        }
    }

    /// Send an acquisition of the lock; it is waited for through [`InFlight`].
    fn send_acquisition(&self) -> InFlight {
        let driver = self.driver.clone();
        let (name, identity) = (self.config.name.clone(), self.config.identity.clone());
        let ttl = self.config.lease_duration;
        InFlight {
            attempt: Some(Box::pin(async move {
                driver.try_acquire(&name, &identity, ttl).await
            })),
            sent: Instant::now(),
            sent_boot: BootInstant::now(),
            driver: self.driver.clone(),
            config: self.config.clone(),
            patience: self.config.lease_duration,
            settled: self.settled.clone(),
        }
    }

    /// Drop a lease whose self-fence deadline has passed.
    fn fence(&mut self) {
        if self
            .held
            .as_ref()
            .is_some_and(|held| BootInstant::now() >= held.valid_until)
        {
            self.lose("the lease ran out before it could be renewed");
        }
    }

    async fn call<T>(
        &mut self,
        budget: Duration,
        op: impl std::future::Future<Output = Result<T>>,
    ) -> Call<T> {
        tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => Call::ShuttingDown,
            outcome = timeout(budget, op) => match outcome {
                Ok(Ok(value)) => {
                    self.backend_ok();
                    Call::Done(value)
                }
                Ok(Err(e)) => {
                    self.backend_failed(&e);
                    Call::Failed
                }
                Err(_) => {
                    let e = Error::Timeout(budget);
                    self.backend_failed(&e);
                    Call::TimedOut
                }
            },
        }
    }

    fn backend_ok(&mut self) {
        let was = self.state.borrow().backend_error.is_some();
        if was {
            tracing::info!(lock = %self.config.name, "backend reachable again");
        }
        self.publish(|s| {
            let changed = s.backend_error.is_some() || !s.contacted;
            if changed {
                s.since = SystemTime::now();
            }
            s.backend_error = None;
            s.contacted = true;
            changed
        });
    }

    fn backend_failed(&mut self, e: &Error) {
        self.telemetry.backend_error(&self.config.name, e);
        let first = self.state.borrow().backend_error.is_none();
        if first {
            tracing::warn!(lock = %self.config.name, error = %e, "backend call failed");
        } else {
            tracing::debug!(lock = %self.config.name, error = %e, "backend call failed again");
        }
        let message = e.to_string();
        self.publish(|s| {
            if s.backend_error.is_none() {
                s.since = SystemTime::now();
            }
            s.backend_error = Some(message);
            s.withheld = None;
            true
        });
    }

    fn retry_pause(&self) -> Duration {
        jitter(
            self.driver
                .poll_interval(self.config.renew_interval)
                .min(MAX_RETRY_PAUSE),
        )
    }

    /// Publish the lease state (holder or not) after it changed.
    fn publish_lease(&mut self) {
        self.publish_lease_and(|_| {});
    }

    /// [`Engine::publish_lease`], with `also` changed in the same step: each publication wakes
    /// every reader's notifier, at a price a keyed cycle paid several times.
    fn publish_lease_and(&mut self, also: impl FnOnce(&mut Snapshot)) {
        let hold_until = self.hold_until;
        let held = self.held.as_ref().map(|h| Held {
            token: h.lease.token,
            valid_until: h.valid_until,
            acquired_at: h.acquired_at,
            hold_until,
        });
        let me = self.held.as_ref().map(|h| Holding {
            identity: h.lease.identity.clone(),
            token: h.lease.token,
            expires_in: Some(h.valid_until.remaining()),
        });
        let holds = self.holds;
        self.publish(|s| {
            if s.held.is_some() != held.is_some() {
                s.since = SystemTime::now();
            }
            s.held = held;
            if me.is_some() {
                s.current_holder = me;
                s.withheld = None;
            }
            s.holds = holds;
            also(s);
            true
        });
    }

    /// Change the published state; `change` tells whether anything changed. Readers are woken
    /// when something did, unless none can be waiting yet ([`Engine::unwatched`]): they read
    /// the state as it is when they first look.
    fn publish(&self, change: impl FnOnce(&mut Snapshot) -> bool) {
        let unwatched = self.unwatched;
        self.state.send_if_modified(|s| change(s) && !unwatched);
    }

    fn emit(&self, kind: EventKind, token: u64, reason: &'static str) {
        let event = Event {
            kind,
            lock: self.config.name.clone(),
            token,
            at: SystemTime::now(),
            reason,
        };
        match kind {
            EventKind::Acquired | EventKind::Released if self.config.single_use => {
                tracing::debug!(lock = %event.lock, token, reason, kind = kind.as_str());
            }
            EventKind::Acquired => {
                tracing::info!(lock = %event.lock, token, "acquired")
            }
            EventKind::Lost => tracing::warn!(lock = %event.lock, token, reason, "lost"),
            EventKind::Released => tracing::info!(lock = %event.lock, token, reason, "released"),
        }
        self.telemetry.event(&event);
        self.events.send(event);
    }

    /// Stop claiming the lease (if any) and tell readers and listeners, before anything else.
    fn forget(&mut self, kind: EventKind, reason: &'static str) -> Option<HeldLease> {
        let held = self.held.take()?;
        self.holds = 0;
        self.hold_until = None;
        self.retry_at = None;
        self.publish_lease_and(|s| s.current_holder = None);
        self.emit(kind, held.lease.token, reason);
        if let Some(mut hook) = self.on_unheld.take() {
            hook.fire();
        }
        Some(held)
    }

    fn lose(&mut self, reason: &'static str) {
        self.forget(EventKind::Lost, reason);
    }

    /// Let go without releasing at once: whoever acted on this process's answers may do so until
    /// the last `validForMs` ran out (the claim, or the hold if it ends first), and nobody else
    /// may hold the lock before. Then, with a safety margin for an answer read late, the lease is
    /// released (compared by token, so only if still this one) and the driver dropped: a session
    /// backend (ZooKeeper, etcd) keeps the lock as long as its session lives.
    fn lapse(&mut self) {
        let hold_until = self.hold_until;
        let Some(held) = self.forget(EventKind::Released, "handed over") else {
            return;
        };
        let answered_until = hold_until.map_or(held.valid_until, |h| h.min(held.valid_until));
        let after = answered_until + safety_margin(self.config.lease_duration);
        let driver = self.driver.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(after.to_tokio()).await;
            let _ = timeout(SHUTDOWN_RELEASE_TIMEOUT, driver.release(&held.lease)).await;
            drop(driver);
        });
    }

    /// Stop claiming first, then tell the backend: the app must never believe it holds a lock the
    /// backend could already have handed on.
    async fn step_down(&mut self, reason: &'static str) {
        let Some(held) = self.forget(EventKind::Released, reason) else {
            return;
        };
        let budget = SHUTDOWN_RELEASE_TIMEOUT;
        match timeout(budget, self.driver.release(&held.lease)).await {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                tracing::debug!(lock = %self.config.name, "release found the lease already gone")
            }
            Ok(Err(e)) => {
                self.backend_failed(&e);
                tracing::warn!(lock = %self.config.name, error = %e,
                    "release failed; the lease will expire on its own")
            }
            Err(_) => {
                self.backend_failed(&Error::Timeout(budget));
                tracing::warn!(lock = %self.config.name,
                    "release timed out; the lease will expire on its own")
            }
        }
    }

    /// The self-fence deadline after an acquisition or renewal of `lease` sent at `sent`.
    fn claim_until(&self, lease: &Lease, sent: BootInstant) -> BootInstant {
        self.driver.counted_from(lease, sent) + self.config.lease_duration
            - safety_margin(self.config.lease_duration)
    }

    fn on_acquired(&mut self, lease: Lease, sent: Instant, sent_boot: BootInstant) {
        let valid_until = self.claim_until(&lease, sent_boot);
        // The first renewal is due a renew interval after the call, as ever, or earlier, while
        // as much of the claim is left as a claim counted from the call would leave it (a renew
        // interval at most): a lease the backend counted from well before this engine's call
        // (a PostgreSQL waiter's row, taken in its blocking statement while the engine was busy)
        // would otherwise run out before a renewal due a renew interval after the call.
        let (lease_duration, renew_interval) =
            (self.config.lease_duration, self.config.renew_interval);
        let left_at_renewal = renew_interval
            .min(lease_duration.saturating_sub(safety_margin(lease_duration) + renew_interval));
        let due = (valid_until - left_at_renewal).to_tokio();
        let schedule_from = due
            .checked_sub(renew_interval)
            .map_or(sent, |from| from.min(sent));
        let token = lease.token;
        self.held = Some(HeldLease {
            lease,
            valid_until,
            last_sent: schedule_from,
            acquired_at: SystemTime::now(),
        });
        self.retry_at = None;
        // Only waiters still there get the lock and count: one whose client went away would
        // otherwise keep it for its whole hold, for nobody. (A waiter whose wait ran out while
        // this attempt was in flight is still there, and is told it holds.) They are counted
        // before the lease is published, in one publication with it, so that a caller told it
        // holds reads its count; the rare waiter that goes in between is taken back out.
        // Taken, not drained: a held keyed lock would keep the emptied list's room for good.
        let waiters: Vec<Waiter> = std::mem::take(&mut self.waiters)
            .into_iter()
            .filter(|w| !w.reply.is_closed())
            .collect();
        let (holds_before, hold_before) = (self.holds, self.hold_until);
        let now = BootInstant::now();
        let longest = waiters.iter().map(|w| w.hold).max();
        self.count_holds(now, waiters.len() as u32, longest);
        self.publish_lease();
        self.emit(EventKind::Acquired, token, "acquired");
        let answer = self.state.borrow().answer();
        let (mut told, mut longest_told) = (0, None);
        for waiter in waiters {
            if waiter.reply.send(answer).is_ok() {
                told += 1;
                longest_told = longest_told.max(Some(waiter.hold));
            }
        }
        if !(answer.is_holder() && told == self.holds - holds_before) {
            self.holds = holds_before;
            self.hold_until = hold_before;
            if answer.is_holder() {
                self.count_holds(now, told, longest_told);
            }
            self.publish_lease();
        }
    }

    /// Count `acquisitions` more, the `longest` of their holds keeping the lock at least that
    /// long from `now`.
    fn count_holds(&mut self, now: BootInstant, acquisitions: u32, longest: Option<Duration>) {
        self.holds += acquisitions;
        if let Some(hold) = longest {
            self.keep_for(now, hold);
        }
    }

    /// Keep the lock at least `hold` from `now`: a hold only ever moves later, so that no
    /// acquisition (nor an extension) cuts short an earlier one's, which its caller counts on.
    fn keep_for(&mut self, now: BootInstant, hold: Duration) {
        let end = now + hold;
        self.hold_until = Some(self.hold_until.map_or(end, |current| current.max(end)));
    }

    /// On-demand: a lease that no app holds (every waiter had gone by the time it was taken) is
    /// given back at once.
    async fn release_unwanted(&mut self) {
        if self.config.mode == Mode::OnDemand && self.held.is_some() && self.holds == 0 {
            self.step_down("nobody waits for it any more").await;
        }
    }

    /// Answer the on-demand waiters whose wait is over, and drop those whose client went away.
    /// When the last one goes, the driver is told, so that a queue place is not left standing.
    async fn expire_waiters(&mut self) {
        let now = Instant::now();
        let answer = self.state.borrow().answer();
        let had_waiters = !self.waiters.is_empty();
        let (expired, waiting): (Vec<_>, Vec<_>) = self
            .waiters
            .drain(..)
            .partition(|w| w.deadline <= now || w.reply.is_closed());
        self.waiters = waiting;
        for waiter in expired {
            let _ = waiter.reply.send(answer);
        }
        if had_waiters && !self.wants_lock() && self.held.is_none() {
            let (name, identity) = (self.config.name.clone(), self.config.identity.clone());
            let budget = self.config.renew_interval;
            let _ = timeout(budget, self.driver.abandon(&name, &identity)).await;
        }
    }

    fn next_waiter_deadline(&self) -> Option<Instant> {
        self.waiters.iter().map(|w| w.deadline).min()
    }

    async fn command(&mut self, command: Option<Box<Command>>) -> Flow {
        let Some(command) = command else {
            return Flow::Stop;
        };
        match *command {
            Command::Acquire { wait, hold, reply } => {
                let answer = self.state.borrow().answer();
                if self.held.is_some() {
                    // Already ours: count it (re-entrant), but only for a client still there
                    // (one that hung up while this command waited for a busy engine would keep
                    // the lock for its hold, for nobody). While the backend cannot confirm the
                    // lease, answer "unknown" at once and count nothing.
                    if answer.is_holder() {
                        // Counted before the answer goes out, so that the caller reads the
                        // new count; taken back if nobody was there to get it.
                        let before = self.hold_until;
                        self.count_holds(BootInstant::now(), 1, Some(hold));
                        self.publish_lease();
                        // The answer's validity as the new hold leaves it.
                        let answer = self.state.borrow().answer();
                        if reply.send(answer).is_err() {
                            self.holds -= 1;
                            self.hold_until = before;
                            self.publish_lease();
                        }
                    } else {
                        let _ = reply.send(answer);
                    }
                } else {
                    self.waiters.push(Waiter {
                        deadline: Instant::now() + wait,
                        hold,
                        reply,
                    });
                }
            }
            Command::Extend { hold, reply } => {
                let answer = self.state.borrow().answer();
                if self.held.is_some() && answer.is_holder() && self.config.mode == Mode::OnDemand {
                    self.keep_for(BootInstant::now(), hold);
                    self.publish_lease();
                }
                let _ = reply.send(self.state.borrow().answer());
            }
            Command::Retire { done } => {
                self.retired = Some(done);
                return Flow::Stop;
            }
            Command::Release { reply } => {
                if self.held.is_none() {
                    let _ = reply.send(false);
                    return Flow::Continue;
                }
                match self.config.mode {
                    Mode::OnDemand if self.holds > 1 => {
                        self.holds -= 1;
                        self.publish_lease();
                    }
                    Mode::OnDemand => self.step_down("released by the app").await,
                    Mode::Campaign => {
                        self.step_down("stepped down by the app").await;
                        self.cooldown_until = Some(Instant::now() + self.config.cooldown);
                    }
                }
                let _ = reply.send(true);
            }
        }
        Flow::Continue
    }

    async fn hold_step(&mut self) -> Flow {
        let Some(held) = &self.held else {
            return Flow::Continue;
        };
        let valid_until = held.valid_until.to_tokio();
        let renew_at = self
            .retry_at
            .unwrap_or(held.last_sent + self.config.renew_interval);
        let hold_deadline = self.hold_until.map(BootInstant::to_tokio);
        // One timer for the three deadlines, and the rarer steps boxed: each lock's task is
        // sized by this wait, which it sits in while it holds (a sleep takes about a hundred
        // bytes, a renewal about 450).
        let next = renew_at
            .min(valid_until)
            .min(hold_deadline.unwrap_or(valid_until));
        tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => return Flow::Stop,
            command = self.commands.recv() => return Box::pin(self.command(command)).await,
            _ = sleep_until(next) => {}
        }
        let now = Instant::now();
        if now >= valid_until {
            // The fence at the top of the loop gives the lease up.
            return Flow::Continue;
        }
        if hold_deadline.is_some_and(|deadline| now >= deadline) {
            tracing::warn!(lock = %self.config.name,
                "the app did not acquire again within its hold; releasing");
            Box::pin(self.step_down("the app's hold elapsed")).await;
            return Flow::Continue;
        }
        if now >= renew_at {
            return Box::pin(self.renew()).await;
        }
        Flow::Continue
    }

    async fn renew(&mut self) -> Flow {
        let Some(held) = &self.held else {
            return Flow::Continue;
        };
        let lease = held.lease.clone();
        let (sent, sent_boot) = (Instant::now(), BootInstant::now());
        // Waiting past the self-fence deadline is pointless: the lease is gone by then.
        let budget = held
            .valid_until
            .saturating_duration_since(sent_boot)
            .min(self.config.renew_interval);
        if budget.is_zero() {
            self.lose("the lease ran out before it could be renewed");
            return Flow::Continue;
        }
        let driver = self.driver.clone();
        let ttl = self.config.lease_duration;
        match self.call(budget, driver.renew(&lease, ttl)).await {
            Call::Done(true) => {
                self.telemetry.renewed(&self.config.name, sent.elapsed());
                let valid_until = self.claim_until(&lease, sent_boot);
                if let Some(held) = &mut self.held {
                    held.last_sent = sent;
                    held.valid_until = valid_until;
                }
                self.retry_at = None;
                self.publish_lease();
            }
            Call::Done(false) => self.lose("the backend no longer has this lease"),
            Call::Failed | Call::TimedOut => {
                self.retry_at = Some(Instant::now() + self.retry_pause())
            }
            Call::ShuttingDown => return Flow::Stop,
        }
        Flow::Continue
    }

    async fn campaign_step(&mut self) -> Flow {
        if let Some(until) = self.cooldown_until {
            if Instant::now() < until {
                tokio::select! {
                    biased;
                    _ = self.shutdown.cancelled() => return Flow::Stop,
                    command = self.commands.recv() => return self.command(command).await,
                    _ = sleep_until(until) => {}
                }
                return Flow::Continue;
            }
            self.cooldown_until = None;
        }
        // Subscribe before the attempt, so that a release right after it still wakes us; not
        // when nobody can be left waiting after it (try-locks: every wait already over), which
        // would cost a try-lock a feed, and on SQL a waiter's blocking statement.
        let now = Instant::now();
        let may_wait = match self.config.mode {
            Mode::Campaign => true,
            Mode::OnDemand => self.waiters.iter().any(|w| w.deadline > now),
        };
        let mut changes = if may_wait {
            self.driver.changes(&self.config.name)
        } else {
            None
        };
        if let Some(changes) = &mut changes {
            changes.borrow_and_update();
        }
        let budget = self.config.renew_interval;
        let mut in_flight = match self.in_flight.take() {
            Some(in_flight) => in_flight,
            None => self.send_acquisition(),
        };
        let outcome = match in_flight.attempt.as_mut() {
            Some(attempt) => self.call(budget, attempt.as_mut()).await,
            None => Call::Failed,
        };
        let (sent, sent_boot) = (in_flight.sent, in_flight.sent_boot);
        match outcome {
            // Unfinished: the backend may still carry it out.
            Call::TimedOut | Call::ShuttingDown => self.in_flight = Some(in_flight),
            Call::Done(_) | Call::Failed => in_flight.attempt = None,
        }
        self.check_enforced_lease();
        let pause = match outcome {
            Call::Done(Acquire::Acquired(lease)) => {
                if BootInstant::now() >= self.claim_until(&lease, sent_boot) {
                    // An attempt that was waited for again, and whose claim ran out meanwhile.
                    let budget = self.config.renew_interval;
                    let _ = timeout(budget, self.driver.release(&lease)).await;
                    return Flow::Continue;
                }
                self.on_acquired(lease, sent, sent_boot);
                self.release_unwanted().await;
                return Flow::Continue;
            }
            Call::Done(Acquire::Busy(holding)) => {
                let poll = jitter(self.driver.poll_interval(self.config.renew_interval));
                // Try again right after the holder's lease runs out, if that comes first.
                let pause = holding
                    .as_ref()
                    .and_then(|h| h.expires_in)
                    .map_or(poll, |left| (left + Duration::from_millis(1)).min(poll));
                self.publish(|s| {
                    let changed = s.current_holder != holding || s.withheld.is_some();
                    s.current_holder = holding;
                    s.withheld = None;
                    changed
                });
                pause
            }
            Call::Done(Acquire::Withheld(withheld)) => {
                let poll = jitter(self.driver.poll_interval(self.config.renew_interval));
                // Try again as soon as grants resume, if that comes first.
                let pause = withheld
                    .resume_in
                    .map_or(poll, |left| (left + Duration::from_millis(1)).min(poll));
                let until = withheld.resume_in.map(|left| BootInstant::now() + left);
                let first = self
                    .state
                    .borrow()
                    .withheld
                    .as_ref()
                    .is_none_or(|w| w.reason != withheld.reason);
                if first {
                    tracing::warn!(lock = %self.config.name, resume_in = ?withheld.resume_in,
                        "the lock is free but not granted yet: {}", withheld.reason);
                }
                self.publish(|s| {
                    s.current_holder = None;
                    s.withheld = Some(WithheldUntil {
                        reason: withheld.reason,
                        until,
                    });
                    true
                });
                pause
            }
            Call::Failed | Call::TimedOut => self.retry_pause(),
            Call::ShuttingDown => return Flow::Stop,
        };
        self.expire_waiters().await;
        if !self.wants_lock() {
            // Nobody waits for an unanswered attempt now: it is followed up in the background.
            self.in_flight = None;
            return Flow::Continue;
        }
        let wake = Instant::now() + pause;
        let waiter_deadline = self.next_waiter_deadline();
        tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => return Flow::Stop,
            command = self.commands.recv() => return self.command(command).await,
            _ = async {
                match &mut changes {
                    Some(changes) => { let _ = changes.changed().await; }
                    None => std::future::pending::<()>().await,
                }
            } => {}
            _ = sleep_until(waiter_deadline.unwrap_or(wake)), if waiter_deadline.is_some() => {}
            _ = sleep_until(wake) => {}
        }
        Flow::Continue
    }

    /// Warn when the backend enforces a longer lease than configured: takeover after a crash
    /// then takes that long, not `lease + renew interval`.
    fn check_enforced_lease(&mut self) {
        let Some(enforced) = self.driver.enforced_lease(&self.config.name) else {
            return;
        };
        let lease = self.config.lease_duration;
        let warning = (enforced > lease).then(|| {
            format!(
                "the {} backend enforces a {enforced:?} lease where {lease:?} was configured: a \
                 crashed holder is replaced after up to {:?}, not {:?} (raise the lease to at \
                 least {enforced:?}, or lower the server's minimum)",
                self.backend,
                enforced + self.config.renew_interval,
                lease + self.config.renew_interval,
            )
        });
        if warning == self.state.borrow().warning {
            return;
        }
        if let Some(text) = &warning {
            tracing::warn!(lock = %self.config.name, "{text}");
        }
        self.publish(|s| {
            s.warning = warning;
            true
        });
    }

    /// On-demand and not wanted: keep an eye on the holder and on the backend's health.
    async fn idle_step(&mut self) -> Flow {
        let driver = self.driver.clone();
        let budget = self.config.renew_interval;
        let name = self.config.name.clone();
        match self.call(budget, driver.observe(&name)).await {
            Call::Done(holding) => {
                self.publish(|s| {
                    let changed = s.current_holder != holding;
                    s.current_holder = holding;
                    changed
                });
            }
            Call::Failed | Call::TimedOut => {}
            Call::ShuttingDown => return Flow::Stop,
        }
        let pause = jitter(self.config.renew_interval);
        tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => Flow::Stop,
            command = self.commands.recv() => self.command(command).await,
            _ = sleep(pause) => Flow::Continue,
        }
    }
}
