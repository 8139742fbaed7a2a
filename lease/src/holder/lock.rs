//! The handle an app holds ([`Lock`]): reading the published snapshot, sending the engine its
//! commands, and ending it.

use super::engine::{Engine, Flow, Phase, Served, Unheld};
use super::{
    Answer, EVENT_CAPACITY, Event, LockConfig, Mode, Permits, SHUTDOWN_RELEASE_TIMEOUT, Snapshot,
    Telemetry,
};

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, oneshot, watch};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;

use crate::boot_clock::BootInstant;
use crate::commands;
use crate::driver::Driver;
use crate::error::{Error, Result};

pub(super) enum Command {
    Acquire {
        wait: Duration,
        hold: Duration,
        reply: oneshot::Sender<Granted>,
    },
    /// `holding`: only the holding of this (permit, token) (a later one is another
    /// acquisition's).
    Release {
        holding: Option<(u32, u64)>,
        /// Given back by the connection that holds it ([`Lock::bind`]), not by another call.
        by_connection: bool,
        reply: oneshot::Sender<bool>,
    },
    /// A connection holds the acquisition made as `holding` ([`Lock::bind`]).
    Bind {
        holding: (u32, u64),
        reply: oneshot::Sender<bool>,
    },
    Extend {
        hold: Duration,
        holding: Option<(u32, u64)>,
        reply: oneshot::Sender<Answer>,
    },
    /// Campaign mode: step aside and stop campaigning ([`Lock::sit_out`]).
    SitOut {
        reason: String,
        reply: oneshot::Sender<()>,
    },
    /// Campaign again ([`Lock::come_back`]).
    ComeBack { reply: oneshot::Sender<()> },
    /// End the holding with this token, on this permit when one is named
    /// ([`Lock::force_release`]).
    ForceRelease {
        permit: Option<u32>,
        token: u64,
        reply: oneshot::Sender<bool>,
    },
    /// Stop, releasing only once the last answer has run out ([`Lock::retire`]); `done` fires
    /// once the engine has let go, with when the release is made (if a lease was held).
    Retire {
        reason: &'static str,
        done: oneshot::Sender<Option<BootInstant>>,
    },
    /// The count of permits changed ([`Lock::set_permits`]): a waiting campaign tries again
    /// with it now rather than at its next poll.
    PermitsChanged,
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

    pub(super) fn fire(&mut self) {
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
    pub(super) inner: Arc<LockInner>,
}

/// The event channel, made at the first subscription. A channel holds its whole capacity from
/// the start (some 8 KiB), which a sidecar holding thousands of keyed locks, whose events nobody
/// reads, would pay for every key; and an event sent before anyone subscribes is lost either way.
#[derive(Clone, Default)]
pub(super) struct Events(Arc<std::sync::OnceLock<broadcast::Sender<Event>>>);

impl Events {
    pub(super) fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.0
            .get_or_init(|| broadcast::channel(EVENT_CAPACITY).0)
            .subscribe()
    }

    pub(super) fn send(&self, event: Event) {
        if let Some(sender) = self.0.get() {
            let _ = sender.send(event);
        }
    }
}

pub(super) struct LockInner {
    /// Shared with the engine: one copy per lock, of which a keyed family has thousands.
    pub(super) config: Arc<LockConfig>,
    /// The count of permits as it changes ([`Lock::set_permits`]), shared with the engine;
    /// `None` for a single-use lock (a key's), whose count is its config's.
    pub(super) permits: Option<Arc<Permits>>,
    pub(super) backend: &'static str,
    pub(super) state: watch::Receiver<Snapshot>,
    pub(super) events: Events,
    /// Boxed: a command is queued rarely, and most of them are small.
    pub(super) commands: commands::Sender<Box<Command>>,
    /// Latches rather than watch channels: a watch channel takes some 400 bytes, which a
    /// sidecar holding 10,000 keyed locks pays per lock.
    pub(super) shutdown: CancellationToken,
    pub(super) task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Cancelled once the task and every acquisition it left in flight have ended
    /// ([`Lock::settled`]).
    pub(super) settled: CancellationToken,
}

/// An acquisition's answer on its way to its caller, with the hold it counted. Should it be
/// dropped unread (its caller gone after the engine sent it and before reading it, a client that
/// hung up in that moment), the engine is told to give the count back, as it does itself for a
/// caller already gone when it sends: otherwise the lock stays held for nobody until the hold
/// ends.
pub(super) struct Granted {
    answer: Answer,
    give_back: Option<GiveBack>,
}

struct GiveBack {
    lock: std::sync::Weak<LockInner>,
    holding: (u32, u64),
}

impl Granted {
    /// An answer that counted nothing.
    pub(super) fn uncounted(answer: Answer) -> Self {
        Self {
            answer,
            give_back: None,
        }
    }

    /// An answer that counted a hold of `lock`'s (when it is a holder's).
    pub(super) fn counted(answer: Answer, lock: &std::sync::Weak<LockInner>) -> Self {
        Self {
            answer,
            give_back: answer.holding().map(|holding| GiveBack {
                lock: lock.clone(),
                holding,
            }),
        }
    }

    /// Read by its caller: the count is the caller's.
    pub(super) fn read(mut self) -> Answer {
        self.give_back = None;
        self.answer
    }

    /// Come back unsent (its caller was already gone): the engine takes the count back itself.
    pub(super) fn unsent(mut self) {
        self.give_back = None;
    }
}

impl Drop for Granted {
    fn drop(&mut self) {
        let Some(give_back) = self.give_back.take() else {
            return;
        };
        if let Some(inner) = give_back.lock.upgrade() {
            let (reply, _) = oneshot::channel();
            let _ = inner.commands.send(Box::new(Command::Release {
                holding: Some(give_back.holding),
                by_connection: false,
                reply,
            }));
        }
    }
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
        engine.served = Served::OnCallersTask;
        let _ = engine
            .command(Some(Box::new(Command::Acquire { wait, hold, reply })))
            .await;
        // The steps the engine's task would take until the lock is held or nobody waits.
        while engine.held().is_none() && engine.wants_lock() && !engine.shutdown.is_cancelled() {
            engine.fence();
            if let Flow::Stop = Box::pin(engine.campaign_step()).await {
                break;
            }
        }
        engine.served = Served::Yes;
        if engine.held().is_some() {
            lock.spawn(engine.steps());
        } else {
            // Nothing to keep: the engine ends here (a late attempt is followed up by itself).
            engine.steps().await;
        }
        let answer = answer.try_recv().map_err(|_| Error::Shutdown)?;
        Ok((lock, answer.read()))
    }

    /// The handle and its engine, not yet running.
    pub(super) fn prepare(
        driver: Arc<dyn Driver>,
        config: LockConfig,
        telemetry: Arc<dyn Telemetry>,
        on_unheld: Option<OnUnheld>,
    ) -> Result<(Self, Engine)> {
        config.validate()?;
        let config = Arc::new(config);
        let sitting_out = config
            .sitting_out
            .clone()
            .filter(|_| config.mode == Mode::Campaign);
        let (state_tx, state_rx) = watch::channel(Snapshot {
            sitting_out: sitting_out.clone(),
            ..Snapshot::initial()
        });
        let events = Events::default();
        let (command_tx, command_rx) = commands::channel();
        let shutdown = CancellationToken::new();
        let settled = CancellationToken::new();
        // A key's engine keeps its count for good: no room is spent on changing it.
        let permits =
            (!config.single_use).then(|| Arc::new(Permits::new(config.permits, driver.clone())));
        let mut engine = Engine {
            handle: std::sync::Weak::new(),
            backend: driver.kind(),
            driver,
            config: config.clone(),
            state: state_tx,
            events: events.clone(),
            commands: command_rx,
            shutdown: shutdown.clone(),
            telemetry,
            phase: Phase::Unheld(Unheld {
                sitting_out,
                ..Unheld::default()
            }),
            waiters: Vec::new(),
            served: Served::No,
            settled: Arc::new(settled.clone().drop_guard()),
            on_unheld,
            retired: None,
            rounds: 0,
            permits: permits.clone(),
            line_left: None,
        };
        let lock = Self {
            inner: Arc::new(LockInner {
                config,
                permits,
                backend: engine.backend,
                state: state_rx,
                events,
                commands: command_tx,
                shutdown,
                task: std::sync::Mutex::new(None),
                settled,
            }),
        };
        engine.handle = Arc::downgrade(&lock.inner);
        Ok((lock, engine))
    }

    pub(super) fn spawn(&self, engine: impl Future<Output = ()> + Send + 'static) {
        let task = tokio::spawn(engine);
        *self.inner.task.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
    }

    /// The settings the lock was started with; its permits now are [`Lock::permits`].
    pub fn config(&self) -> &LockConfig {
        &self.inner.config
    }

    /// How many permits the lock has now.
    pub fn permits(&self) -> u32 {
        self.inner
            .permits
            .as_ref()
            .map_or(self.inner.config.permits, |permits| permits.now())
    }

    /// Whether the lock has had several permits: holdings are named with their permit, since
    /// tokens count per permit (a holding may be on a permit above a lowered count).
    pub fn has_had_permits(&self) -> bool {
        self.inner
            .permits
            .as_ref()
            .map_or(self.inner.config.permits, |permits| permits.ever())
            > 1
    }

    /// Who holds the lock in the backend now, any process: each permit's holder, one read per
    /// permit the lock has had (a key's lock: its one holder).
    pub async fn holders(&self) -> Result<Vec<crate::driver::Holding>> {
        let Some(permits) = &self.inner.permits else {
            return Ok(Vec::new());
        };
        let config = &self.inner.config;
        let reads = (0..permits.ever()).map(|permit| {
            let (driver, name) = (permits.driver.clone(), config.permit_name(permit));
            async move { driver.observe(&name).await }
        });
        let read = futures_util::future::try_join_all(reads).await?;
        Ok(read.into_iter().flatten().collect())
    }

    /// Who holds permit `permit` in the backend now, any process: also a permit above every
    /// count this process has had (one taken elsewhere before the count was lowered).
    pub async fn permit_holder(&self, permit: u32) -> Result<Option<crate::driver::Holding>> {
        match &self.inner.permits {
            Some(permits) if permit < crate::keyed::MAX_PERMITS => {
                permits
                    .driver
                    .observe(&self.inner.config.permit_name(permit))
                    .await
            }
            _ => Ok(None),
        }
    }

    /// Hold the lock with `permits` permits from now on: the next attempts try that many, and
    /// no holding is revoked (one on a permit above a lowered count is kept until it ends).
    /// Every process of the lock must come to the same count: each admits up to its own.
    pub fn set_permits(&self, permits: u32) -> Result<()> {
        LockConfig {
            permits,
            ..(*self.inner.config).clone()
        }
        .validate()?;
        match &self.inner.permits {
            Some(now) => {
                now.set(permits);
                let _ = self.inner.commands.send(Box::new(Command::PermitsChanged));
                Ok(())
            }
            None => Err(Error::InvalidConfig {
                field: "permits",
                reason: "a key's lock keeps its count of permits".into(),
            }),
        }
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

    /// What `read` takes from the lock's state now, without copying it whole (a keyed call
    /// asks for a count or a flag on every acquisition and release).
    pub(crate) fn read_snapshot<T>(&self, read: impl FnOnce(&Snapshot) -> T) -> T {
        read(&self.inner.state.borrow())
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
        answer.await.map(Granted::read).map_err(|_| Error::Shutdown)
    }

    /// Step down (campaign mode: then sit out the cool-down) or drop one on-demand acquisition.
    /// `Ok(false)`: this process did not hold the lock.
    pub async fn release(&self) -> Result<bool> {
        self.release_command(None, false).await
    }

    /// [`Lock::release`], only while the lock is held as `holding` says (its permit and token,
    /// [`Answer::holding`]): an acquisition made under one holding gives nothing of a later one
    /// up (the lease lost and taken again meanwhile; on a lock of several permits, perhaps
    /// another permit with the same token).
    pub async fn release_if(&self, holding: (u32, u64)) -> Result<bool> {
        self.release_command(Some(holding), false).await
    }

    /// On-demand: a connection holds one acquisition made as `holding` (a hold stream's) and
    /// tells its client, event by event, how long it may act on it. A release by any other
    /// call never ends such an acquisition at once: once only connections' acquisitions remain,
    /// it ends the holding as a force-release does (not held from now on, the lease released
    /// once the last answer has run out), since each connection's client may act on its last
    /// event until it reads that the holding ended. `Ok(false)`: not held as `holding`.
    pub async fn bind(&self, holding: (u32, u64)) -> Result<bool> {
        let (reply, bound) = oneshot::channel();
        self.inner
            .commands
            .send(Box::new(Command::Bind { holding, reply }))
            .map_err(|_| Error::Shutdown)?;
        bound.await.map_err(|_| Error::Shutdown)
    }

    /// [`Lock::release_if`] by the connection that holds the acquisition ([`Lock::bind`]).
    pub async fn release_bound(&self, holding: (u32, u64)) -> Result<bool> {
        self.release_command(Some(holding), true).await
    }

    async fn release_command(
        &self,
        holding: Option<(u32, u64)>,
        by_connection: bool,
    ) -> Result<bool> {
        let (reply, released) = oneshot::channel();
        self.inner
            .commands
            .send(Box::new(Command::Release {
                holding,
                by_connection,
                reply,
            }))
            .map_err(|_| Error::Shutdown)?;
        released.await.map_err(|_| Error::Shutdown)
    }

    /// On-demand: keep the app's hold at least `hold` from now, without acquiring again (a hold
    /// only moves later: an extension never cuts an acquisition's hold short).
    /// The answer is the lock's as it stands; nothing changes when it is not held.
    pub async fn extend(&self, hold: Duration) -> Result<Answer> {
        self.extend_command(hold, None).await
    }

    /// [`Lock::extend`], only while the lock is held as `holding` (permit, token) says.
    pub async fn extend_if(&self, holding: (u32, u64), hold: Duration) -> Result<Answer> {
        self.extend_command(hold, Some(holding)).await
    }

    async fn extend_command(&self, hold: Duration, holding: Option<(u32, u64)>) -> Result<Answer> {
        let (reply, answer) = oneshot::channel();
        self.inner
            .commands
            .send(Box::new(Command::Extend {
                hold,
                holding,
                reply,
            }))
            .map_err(|_| Error::Shutdown)?;
        answer.await.map_err(|_| Error::Shutdown)
    }

    /// Campaign mode: stop holding and campaigning for the lock, saying why (its app is
    /// unhealthy), until [`Lock::come_back`]. Answers say "not holder" at once; a lease held is
    /// released once the last answer's validity has run out, as on [`Lock::retire`], so that
    /// nobody holds it while this process's app may still act on an answer.
    pub async fn sit_out(&self, reason: &str) -> Result<()> {
        let (reply, done) = oneshot::channel();
        self.inner
            .commands
            .send(Box::new(Command::SitOut {
                reason: reason.to_owned(),
                reply,
            }))
            .map_err(|_| Error::Shutdown)?;
        done.await.map_err(|_| Error::Shutdown)
    }

    /// Campaign again after [`Lock::sit_out`] (not before its lease, if it held one, has been
    /// released).
    pub async fn come_back(&self) -> Result<()> {
        let (reply, done) = oneshot::channel();
        self.inner
            .commands
            .send(Box::new(Command::ComeBack { reply }))
            .map_err(|_| Error::Shutdown)?;
        done.await.map_err(|_| Error::Shutdown)
    }

    /// A person asked to end the holding with `token` (`leasehold.dev/force-release`): if this
    /// process holds the lock with it, answers say "not holder" at once, the lease is released
    /// once the last answer's validity has run out. Campaign mode campaigns again only a
    /// cool-down after that release, so that another contender takes the lock; on demand, an
    /// acquisition meets "busy" until the release (no backend gives the lock again to an
    /// identity whose lease stands). `Ok(false)`: not this process's holding. On a lock of
    /// several permits, whose tokens count per permit, name the `permit` too.
    pub async fn force_release(&self, permit: Option<u32>, token: u64) -> Result<bool> {
        let (reply, done) = oneshot::channel();
        self.inner
            .commands
            .send(Box::new(Command::ForceRelease {
                permit,
                token,
                reply,
            }))
            .map_err(|_| Error::Shutdown)?;
        done.await.map_err(|_| Error::Shutdown)
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

    /// Stop for good, releasing only once the last answer given has run out: no other process
    /// takes the lock while an app may still act on an answer this one gave. For a lock
    /// replaced by another with the same identity (new settings, new credentials), which takes
    /// the lock after that. Falls back to [`Lock::shutdown`] when the task does not take the
    /// request in time (the engine honours the retirement all the same).
    pub async fn retire(&self) -> Option<BootInstant> {
        self.retire_for("handed over").await
    }

    /// [`Lock::retire`], saying why in the `released` event; when the lease is released, if one
    /// was held. The release is made by a task of its own: a process that exits before then
    /// leaves the lease to run out instead.
    pub async fn retire_for(&self, reason: &'static str) -> Option<BootInstant> {
        let (done, retired) = oneshot::channel();
        let mut released_at = None;
        if self
            .inner
            .commands
            .send(Box::new(Command::Retire { reason, done }))
            .is_ok()
        {
            released_at = timeout(SHUTDOWN_RELEASE_TIMEOUT, retired)
                .await
                .ok()
                .and_then(Result::ok)
                .flatten();
        }
        self.shutdown().await;
        released_at
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
