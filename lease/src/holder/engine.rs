//! The engine: the task that campaigns, renews, releases and fences one lock.

use super::in_flight::InFlight;
use super::line::LineTurn;
use super::lock::{Command, Events, Granted, LockInner, OnUnheld};
use super::{
    Answer, Event, EventKind, Held, LockConfig, MAX_RETRY_PAUSE, Mode, SHUTDOWN_RELEASE_TIMEOUT,
    Snapshot, Telemetry, WithheldUntil, safety_margin,
};

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::boot_clock::BootInstant;
use crate::commands;
use crate::driver::{Acquire, Driver, Holding, Lease};
use crate::error::{Error, Result};

/// Where an engine stands with its lease. What it keeps while it holds (the renewal schedule,
/// the app's holds) and what it keeps while it does not (an attempt still out, a cool-down,
/// sitting out) are apart, so neither outlives its phase.
pub(super) enum Phase {
    Unheld(Unheld),
    Held(HeldLease),
}

/// No lease.
#[derive(Default)]
pub(super) struct Unheld {
    /// An acquisition the engine stopped waiting for, waited for again by the next campaign
    /// step rather than sending another.
    pub(super) in_flight: Option<InFlight>,
    /// No campaign before this: after the app stepped down, or until a lease let lapse has
    /// been released (the same identity must not meet its own lease).
    pub(super) cooldown_until: Option<Instant>,
    /// Campaign mode: neither held nor campaigned for until [`super::Lock::come_back`], and why
    /// ([`super::Lock::sit_out`]).
    pub(super) sitting_out: Option<String>,
    /// Of a lock of several permits on a backend that keeps a queue, this process's turn in the
    /// lock's line while it waits ([`LineTurn`]); left when dropped, so never past the phase.
    pub(super) line: Option<LineTurn>,
}

/// The lease this process holds, and what the app holds of it.
pub(super) struct HeldLease {
    pub(super) lease: Lease,
    /// Of a lock with several permits, the one held (`lease.lock` is its backend name).
    pub(super) permit: u32,
    pub(super) valid_until: BootInstant,
    /// The next renewal is due a renew interval after this: the newest renewal's call, or for
    /// a lease not yet renewed, its acquisition's (or earlier, see [`Engine::schedule_from`]).
    pub(super) last_sent: Instant,
    pub(super) acquired_at: SystemTime,
    /// After a failed renewal: when to try again (before the regular schedule).
    pub(super) retry_at: Option<Instant>,
    /// On-demand: acquisitions the app holds, and when the hold lapses: the end of the longest
    /// hold among them, since each acquisition keeps the lock at least for its own hold.
    pub(super) holds: u32,
    /// Of those, the acquisitions connections hold ([`super::Lock::bind`]).
    pub(super) bound: u32,
    pub(super) hold_until: Option<BootInstant>,
}

impl HeldLease {
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
}

/// A single-use engine's one command.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Served {
    /// Not taken yet.
    No,
    /// Being served on its caller's task, before the caller has the handle: nobody can wait
    /// for a change of state yet, so publications change it without waking anyone (waking
    /// readers is a good part of a keyed cycle's cost otherwise; [`Engine::publish`]).
    OnCallersTask,
    Yes,
}

pub(super) struct Waiter {
    pub(super) deadline: Instant,
    pub(super) hold: Duration,
    pub(super) reply: oneshot::Sender<Granted>,
}

/// The result of one backend call made by the task.
pub(super) enum Call<T> {
    Done(T),
    Failed,
    /// No answer within the budget: the call may still take effect.
    TimedOut,
    ShuttingDown,
}

pub(super) struct Engine {
    /// The lock's handle, for an answer dropped unread to give its count back ([`Granted`]).
    pub(super) handle: std::sync::Weak<LockInner>,
    pub(super) driver: Arc<dyn Driver>,
    pub(super) backend: &'static str,
    pub(super) config: Arc<LockConfig>,
    pub(super) state: watch::Sender<Snapshot>,
    pub(super) events: Events,
    pub(super) commands: commands::Receiver<Box<Command>>,
    pub(super) shutdown: CancellationToken,
    pub(super) telemetry: Arc<dyn Telemetry>,
    pub(super) phase: Phase,
    pub(super) waiters: Vec<Waiter>,
    pub(super) served: Served,
    /// Kept by the engine and by each follow-up of an [`InFlight`]; [`Lock::settled`] resolves
    /// when the last is dropped.
    pub(super) settled: Arc<DropGuard>,
    /// Fired by [`Engine::forget`], or when the engine is dropped.
    pub(super) on_unheld: Option<OnUnheld>,
    /// Retired ([`Lock::retire`]): the lease is released only once the last answer ran out;
    /// why, and when it is released, told here.
    pub(super) retired: Option<(&'static str, oneshot::Sender<Option<BootInstant>>)>,
    /// A semaphore's rounds of attempts so far: each starts at another permit.
    pub(super) rounds: u32,
    /// How many permits the lock has now, shared with its handle; `None` for a single-use
    /// engine (a key's), whose count never changes: [`LockConfig::permits`].
    pub(super) permits: Option<Arc<super::Permits>>,
    /// The leaving of the last turn in the lock's line ([`LineTurn::leave`]), which the next
    /// attempt waits for.
    pub(super) line_left: Option<tokio::task::JoinHandle<()>>,
}

/// One acquisition's outcome, and the permit and moment it was sent for.
pub(super) struct Attempted {
    pub(super) outcome: Call<Acquire>,
    pub(super) permit: u32,
    pub(super) sent: Instant,
    pub(super) sent_boot: BootInstant,
}

impl Attempted {
    /// Of a refused attempt, how soon the permit may be free: its holder's lease runs out, or
    /// a backend's guard lets grants resume.
    fn free_in(&self) -> Option<Duration> {
        match &self.outcome {
            Call::Done(Acquire::Busy(holding)) => holding.as_ref().and_then(|h| h.expires_in),
            Call::Done(Acquire::Withheld(withheld)) => withheld.resume_in,
            _ => None,
        }
    }
}

/// An engine dropped while it waited for the lock (a keyed acquisition runs on its caller's
/// task, which is dropped when the client hangs up) leaves the queue as a wait that ends does:
/// otherwise its place would stand first in line, for nobody, until the backend gives it up.
/// An attempt still in flight leaves it once answered ([`InFlight`]).
impl Drop for Engine {
    fn drop(&mut self) {
        let waiting_unanswered = matches!(&self.phase, Phase::Unheld(u) if u.in_flight.is_none());
        if self.waiters.is_empty() || !waiting_unanswered || self.config.keeps_queue_place {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (leave, settled) = (self.leave_queue(&self.config.name), self.settled.clone());
        runtime.spawn(async move {
            let _settled = settled;
            leave.await;
        });
    }
}

/// Whether the task goes on.
pub(super) enum Flow {
    Continue,
    Stop,
}

/// Once the turn in line of an engine in `phase` may have moved; never without one.
async fn line_moved(phase: &mut Phase) {
    match phase {
        Phase::Unheld(Unheld {
            line: Some(line), ..
        }) => line.moved().await,
        _ => std::future::pending().await,
    }
}

/// Once any of `changes` moves (or its sender is gone).
async fn any_changed(changes: &mut [watch::Receiver<u64>]) {
    let each = changes.iter_mut().map(|c| Box::pin(c.changed()));
    let _ = futures_util::future::select_all(each).await;
}

/// Where a semaphore's round `round` starts among the permits: contenders with other
/// identities start at other permits, and each round at the next.
fn spread(identity: &str, round: u32) -> u32 {
    // FNV-1a: any stable spread of the identity does.
    let hash = identity.bytes().fold(0x811c_9dc5_u32, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    });
    hash.wrapping_add(round)
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
    /// How many permits the lock has now.
    pub(super) fn permits_now(&self) -> u32 {
        self.permits
            .as_ref()
            .map_or(self.config.permits, |permits| permits.now())
    }

    /// The most permits the lock has had: while above 1, holdings are named with their permit.
    pub(super) fn permits_ever(&self) -> u32 {
        self.permits
            .as_ref()
            .map_or(self.config.permits, |permits| permits.ever())
    }

    pub(super) fn held(&self) -> Option<&HeldLease> {
        match &self.phase {
            Phase::Held(held) => Some(held),
            Phase::Unheld(_) => None,
        }
    }

    pub(super) fn held_mut(&mut self) -> Option<&mut HeldLease> {
        match &mut self.phase {
            Phase::Held(held) => Some(held),
            Phase::Unheld(_) => None,
        }
    }

    /// What the engine keeps while it holds no lease; nothing while it holds one.
    pub(super) fn unheld_mut(&mut self) -> Option<&mut Unheld> {
        match &mut self.phase {
            Phase::Unheld(unheld) => Some(unheld),
            Phase::Held(_) => None,
        }
    }

    /// The engine is boxed: an `async fn` keeps its arguments apart from its locals, so an
    /// engine taken by value would be stored twice in every lock's task.
    pub(super) async fn run(self: Box<Self>) {
        self.started();
        self.steps().await;
    }

    pub(super) fn started(&self) {
        if self.config.single_use || self.config.quiet {
            tracing::debug!(lock = %self.config.name, identity = %self.config.identity,
                backend = self.backend, "single-use lock started");
        } else {
            tracing::info!(lock = %self.config.name, identity = %self.config.identity,
                backend = self.backend, mode = self.config.mode.as_str(), "lock started");
        }
    }

    /// The engine's steps until it stops, then its release.
    pub(super) async fn steps(mut self: Box<Self>) {
        loop {
            if self.shutdown.is_cancelled() {
                break;
            }
            self.fence();
            let flow = if self.held().is_some() {
                self.hold_step().await
            } else if self.wants_lock() {
                // Every step but the holding one is boxed: each keyed lock has a task, and it
                // spends its life holding, so the other steps should not size it.
                Box::pin(self.campaign_step()).await
            } else if self.config.single_use {
                if self.served != Served::No {
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
        // shut it down) is honoured all the same: a retired lock never releases before its
        // last answer has run out.
        if self.retired.is_none()
            && let Some(command) = self
                .commands
                .take_queued(|c| matches!(**c, Command::Retire { .. }))
            && let Command::Retire { reason, done } = *command
        {
            self.retired = Some((reason, done));
        }
        // Waiting in line (etcd, ZooKeeper), not holding: the place goes with the engine, or it
        // would stand first in line for nobody, for as long as the backend keeps it (a campaign
        // waits in line for good; a single-use engine's wait leaves it as it ends).
        let waiting = matches!(&self.phase, Phase::Unheld(_))
            && !self.config.keeps_queue_place
            && !self.config.single_use;
        match self.retired.take() {
            Some((reason, done)) => {
                let released_at = self.lapse_for(reason);
                let _ = done.send(released_at);
            }
            None => self.step_down("shutdown").await,
        }
        if waiting {
            if let Some(unheld) = self.unheld_mut() {
                unheld.in_flight = None;
            }
            self.leave_queue_within(&self.config.name, SHUTDOWN_RELEASE_TIMEOUT)
                .await;
        }
        for waiter in self.waiters.drain(..) {
            let _ = waiter.reply.send(Granted::uncounted(Answer::NotHolder));
        }
        if self.config.single_use || self.config.quiet {
            tracing::debug!(lock = %self.config.name, "single-use lock stopped");
        } else {
            tracing::info!(lock = %self.config.name, "lock stopped");
        }
    }

    /// A single-use engine waits for its one command without reading the backend first.
    pub(super) async fn first_command(&mut self) -> Flow {
        tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => Flow::Stop,
            command = self.commands.recv() => {
                self.served = Served::Yes;
                self.command(command).await
            }
        }
    }

    pub(super) fn wants_lock(&self) -> bool {
        match self.config.mode {
            Mode::Campaign => match &self.phase {
                Phase::Unheld(unheld) => unheld.sitting_out.is_none(),
                Phase::Held(_) => true,
            },
            Mode::OnDemand => !self.waiters.is_empty(),
        }
    }

    /// Send an acquisition of the lock's permit `permit` (0, of a lock without several); it is
    /// waited for through [`InFlight`].
    pub(super) fn send_acquisition(&self, permit: u32) -> InFlight {
        let driver = self.driver.clone();
        let name = self.config.permit_name(permit);
        let (lock, identity) = (name.clone(), self.config.identity.clone());
        let ttl = self.config.lease_duration;
        InFlight {
            attempt: Some(Box::pin(async move {
                driver.try_acquire(&name, &identity, ttl).await
            })),
            sent: Instant::now(),
            sent_boot: BootInstant::now(),
            permit,
            lock,
            driver: self.driver.clone(),
            config: self.config.clone(),
            patience: self.config.lease_duration,
            settled: self.settled.clone(),
        }
    }

    /// Drop a lease whose self-fence deadline has passed.
    pub(super) fn fence(&mut self) {
        if self
            .held()
            .is_some_and(|held| BootInstant::now() >= held.valid_until)
        {
            self.lose("the lease ran out before it could be renewed");
        }
    }

    pub(super) async fn call<T>(
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

    pub(super) fn backend_ok(&mut self) {
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

    pub(super) fn backend_failed(&mut self, e: &Error) {
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

    pub(super) fn retry_pause(&self) -> Duration {
        jitter(
            self.driver
                .poll_interval(self.config.renew_interval)
                .min(MAX_RETRY_PAUSE),
        )
    }

    /// Publish the lease state (holder or not) after it changed.
    pub(super) fn publish_lease(&mut self) {
        self.publish_lease_and(|_| {});
    }

    /// [`Engine::publish_lease`], with `also` changed in the same step: each publication wakes
    /// every reader's notifier, at a price a keyed cycle paid several times.
    pub(super) fn publish_lease_and(&mut self, also: impl FnOnce(&mut Snapshot)) {
        self.publish_lease_unless(|| false, also);
    }

    /// [`Engine::publish_lease_and`], unless `stale` says, as the change is made, that what it
    /// publishes no longer stands; whether it was published. Readers compare the boot clock
    /// themselves, so a claim they may have read as run out is checked in the same step as it
    /// is replaced, not before.
    pub(super) fn publish_lease_unless(
        &mut self,
        stale: impl FnOnce() -> bool,
        also: impl FnOnce(&mut Snapshot),
    ) -> bool {
        let held = self.held().map(|h| Held {
            token: h.lease.token,
            permit: h.permit,
            valid_until: h.valid_until,
            acquired_at: h.acquired_at,
            hold_until: h.hold_until,
        });
        let me = self.held().map(|h| Holding {
            identity: h.lease.identity.clone(),
            token: h.lease.token,
            expires_in: Some(h.valid_until.remaining()),
        });
        let holds = self.held().map_or(0, |h| h.holds);
        let mut published = false;
        self.publish(|s| {
            if stale() {
                return false;
            }
            published = true;
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
        published
    }

    /// Change the published state; `change` tells whether anything changed. Readers are woken
    /// when something did, unless none can be waiting yet ([`Served::OnCallersTask`]): they read
    /// the state as it is when they first look.
    pub(super) fn publish(&self, change: impl FnOnce(&mut Snapshot) -> bool) {
        let unwatched = self.served == Served::OnCallersTask;
        self.state.send_if_modified(|s| change(s) && !unwatched);
    }

    pub(super) fn emit(&self, kind: EventKind, token: u64, permit: u32, reason: &'static str) {
        let event = Event {
            kind,
            lock: self.config.name.clone(),
            token,
            permit,
            at: SystemTime::now(),
            reason,
        };
        match kind {
            EventKind::Acquired | EventKind::Released
                if self.config.single_use || self.config.quiet =>
            {
                tracing::debug!(lock = %event.lock, token, reason, kind = kind.as_str());
            }
            // A token counts per permit: the log names the permit beside it.
            EventKind::Lost if self.permits_ever() > 1 => {
                tracing::warn!(lock = %event.lock, permit, token, reason, "lost")
            }
            _ if self.permits_ever() > 1 => {
                tracing::info!(lock = %event.lock, permit, token, reason, "{}", kind.as_str())
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
    pub(super) fn forget(&mut self, kind: EventKind, reason: &'static str) -> Option<HeldLease> {
        if !matches!(self.phase, Phase::Held(_)) {
            return None;
        }
        let Phase::Held(held) =
            std::mem::replace(&mut self.phase, Phase::Unheld(Unheld::default()))
        else {
            return None;
        };
        // A lease never published (taken for waiters who had all gone) was never told of: its
        // end is not either, so that listeners see every `released` after its `acquired`.
        let announced =
            self.state.borrow().held.as_ref().is_some_and(|shown| {
                (shown.permit, shown.token) == (held.permit, held.lease.token)
            });
        self.publish_lease_and(|s| s.current_holder = None);
        if announced {
            self.emit(kind, held.lease.token, held.permit, reason);
        }
        if let Some(mut hook) = self.on_unheld.take() {
            hook.fire();
        }
        Some(held)
    }

    pub(super) fn lose(&mut self, reason: &'static str) {
        self.forget(EventKind::Lost, reason);
    }

    /// Let go without releasing at once, saying why: whoever acted on this process's answers
    /// may do so until the last `validForMs` ran out (the claim, or the hold if it ends first),
    /// and nobody else may hold the lock before. Then, with a safety margin for an answer read
    /// late, the lease is released (compared by token, so only if still this one) and the
    /// driver dropped: a session backend (ZooKeeper, etcd) keeps the lock as long as its
    /// session lives. When the lease will be released, if one was held.
    pub(super) fn lapse_for(&mut self, reason: &'static str) -> Option<BootInstant> {
        self.lapse_as(EventKind::Released, reason)
    }

    /// [`Engine::lapse_for`], telling listeners of it as `kind`: a lease found lost is let go
    /// of the same way.
    pub(super) fn lapse_as(
        &mut self,
        kind: EventKind,
        reason: &'static str,
    ) -> Option<BootInstant> {
        let held = self.forget(kind, reason)?;
        let answered_until = held
            .hold_until
            .map_or(held.valid_until, |h| h.min(held.valid_until));
        let after = answered_until + safety_margin(self.config.lease_duration);
        let driver = self.driver.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(after.to_tokio()).await;
            let _ = timeout(SHUTDOWN_RELEASE_TIMEOUT, driver.release(&held.lease)).await;
            drop(driver);
        });
        Some(after)
    }

    /// [`Engine::lapse_for`], then no campaign until `past` after the lease's release has been
    /// made: the same identity must not meet its own lease. Whether a lease was held.
    pub(super) fn lapse_and_wait(&mut self, reason: &'static str, past: Duration) -> bool {
        let Some(released_at) = self.lapse_for(reason) else {
            return false;
        };
        let until = (released_at + SHUTDOWN_RELEASE_TIMEOUT + past).to_tokio();
        if let Some(unheld) = self.unheld_mut() {
            unheld.cooldown_until = Some(until);
        }
        true
    }

    /// Stop claiming first, then tell the backend: the app must never believe it holds a lock the
    /// backend could already have handed on.
    pub(super) async fn step_down(&mut self, reason: &'static str) {
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
    pub(super) fn claim_until(&self, lease: &Lease, sent: BootInstant) -> BootInstant {
        self.driver.counted_from(lease, sent) + self.config.lease_duration
            - safety_margin(self.config.lease_duration)
    }

    /// What the next renewal of a claim valid until `valid_until`, made by a call sent at
    /// `sent`, is scheduled from (it is due a renew interval after): the call, as ever, or
    /// earlier, so that the renewal comes while as much of the claim is left as a claim counted
    /// from the call would leave (a renew interval at most). A lease the backend counted from
    /// well before the call (a PostgreSQL waiter's row, taken in its blocking statement while
    /// the engine was busy; a Sentinel majority's answer; a ZooKeeper session's last sign of
    /// life) would otherwise run out before a renewal due a renew interval after the call.
    fn schedule_from(&self, valid_until: BootInstant, sent: Instant) -> Instant {
        let (lease_duration, renew_interval) =
            (self.config.lease_duration, self.config.renew_interval);
        let left_at_renewal = renew_interval
            .min(lease_duration.saturating_sub(safety_margin(lease_duration) + renew_interval));
        let due = (valid_until - left_at_renewal).to_tokio();
        let from = due
            .checked_sub(renew_interval)
            .map_or(sent, |from| from.min(sent));
        // Never due sooner than a quarter of a renew interval after the call: a backend that
        // dates every call far enough back would otherwise be asked again at once, over and
        // over. Its claim then runs out before the renewal, and the lease is lost.
        sent.checked_sub(renew_interval * 3 / 4)
            .map_or(from, |earliest| from.max(earliest))
    }

    pub(super) fn on_acquired(
        &mut self,
        lease: Lease,
        permit: u32,
        sent: Instant,
        sent_boot: BootInstant,
    ) {
        let valid_until = self.claim_until(&lease, sent_boot);
        let schedule_from = self.schedule_from(valid_until, sent);
        let token = lease.token;
        self.leave_line();
        self.phase = Phase::Held(HeldLease {
            lease,
            permit,
            valid_until,
            last_sent: schedule_from,
            acquired_at: SystemTime::now(),
            retry_at: None,
            holds: 0,
            bound: 0,
            hold_until: None,
        });
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
        if waiters.is_empty() && self.config.mode == Mode::OnDemand {
            // Nobody to give it to (every waiter's client went while the attempt ran): given
            // back at once by `release_unwanted`, and never published, since a reader of the
            // lock (a `GET /lock` of the pod) told it holds would be told so for a whole claim
            // that the release then ends at once.
            return;
        }
        let now = BootInstant::now();
        let longest = waiters.iter().map(|w| w.hold).max();
        if let Some(held) = self.held_mut() {
            held.count_holds(now, waiters.len() as u32, longest);
        }
        self.publish_lease();
        self.emit(EventKind::Acquired, token, permit, "acquired");
        let answer = self.state.borrow().answer();
        let mut told = 0;
        for waiter in waiters {
            match waiter.reply.send(Granted::counted(answer, &self.handle)) {
                Ok(()) => told += 1,
                Err(unsent) => unsent.unsent(),
            }
        }
        let counted = self.held().map_or(0, |h| h.holds);
        if !(answer.is_holder() && told == counted) {
            if let Some(held) = self.held_mut() {
                if answer.is_holder() {
                    // The count is of those told; the hold stays as answered, which a reader of
                    // the lock may have been told too: a waiter gone between the count and the
                    // answer leaves the lock kept for its hold rather than cut short what the
                    // others were told.
                    held.holds = told;
                } else {
                    held.holds = 0;
                    held.hold_until = None;
                }
            }
            self.publish_lease();
        }
    }

    /// On-demand: a lease that no app holds (every waiter had gone by the time it was taken) is
    /// given back at once.
    pub(super) async fn release_unwanted(&mut self) {
        if self.config.mode == Mode::OnDemand && self.held().is_some_and(|h| h.holds == 0) {
            self.step_down("nobody waits for it any more").await;
        }
    }

    /// Answer the on-demand waiters whose wait is over, and drop those whose client went away.
    /// When the last one goes, the driver is told, so that a queue place is not left standing.
    pub(super) async fn expire_waiters(&mut self) {
        let now = Instant::now();
        let answer = self.state.borrow().answer();
        let had_waiters = !self.waiters.is_empty();
        let (expired, waiting): (Vec<_>, Vec<_>) = self
            .waiters
            .drain(..)
            .partition(|w| w.deadline <= now || w.reply.is_closed());
        self.waiters = waiting;
        for waiter in expired {
            let _ = waiter.reply.send(Granted::uncounted(answer));
        }
        if had_waiters
            && !self.wants_lock()
            && self.held().is_none()
            && !self.config.keeps_queue_place
        {
            self.leave_queue(&self.config.name).await;
        }
    }

    /// Leave `lock`'s queue (etcd, ZooKeeper), if this process has a place in it, within a
    /// renew interval: a place nobody waits for would stand first in line for nobody. The
    /// future owns what it needs: the engine is not `Sync`, so none of it may be held across
    /// the wait.
    fn leave_queue(&self, lock: &str) -> impl Future<Output = ()> + Send + 'static {
        self.leave_queue_within(lock, self.config.renew_interval)
    }

    /// [`Engine::leave_queue`], given up after `budget`.
    fn leave_queue_within(
        &self,
        lock: &str,
        budget: Duration,
    ) -> impl Future<Output = ()> + Send + 'static {
        let driver = self.driver.clone();
        let (lock, identity) = (lock.to_owned(), self.config.identity.clone());
        async move {
            let _ = timeout(budget, driver.abandon(&lock, &identity)).await;
        }
    }

    pub(super) fn next_waiter_deadline(&self) -> Option<Instant> {
        self.waiters.iter().map(|w| w.deadline).min()
    }

    pub(super) async fn command(&mut self, command: Option<Box<Command>>) -> Flow {
        let Some(command) = command else {
            return Flow::Stop;
        };
        match *command {
            Command::Acquire { wait, hold, reply } => {
                let answer = self.state.borrow().answer();
                if self.held().is_some() {
                    // Already ours: count it (re-entrant), but only for a client still there
                    // (one that hung up while this command waited for a busy engine would keep
                    // the lock for its hold, for nobody). While the backend cannot confirm the
                    // lease, answer "unknown" at once and count nothing.
                    let claim_stands = self.state.borrow().claim_stands_at(BootInstant::now());
                    if claim_stands && let Some(held) = self.held_mut() {
                        // Counted before the answer goes out, so that the caller reads the
                        // new count; taken back if nobody was there to get it, hold and all
                        // (the pod's state, which `GET /lock` shows, is the pod's apps' to end
                        // at any time, as a release does).
                        let before = held.hold_until;
                        held.count_holds(BootInstant::now(), 1, Some(hold));
                        self.publish_lease();
                        // The answer's validity as the new hold leaves it.
                        let answer = self.state.borrow().answer();
                        if let Err(unsent) = reply.send(Granted::counted(answer, &self.handle)) {
                            unsent.unsent();
                            if let Some(held) = self.held_mut() {
                                held.holds -= 1;
                                held.hold_until = before;
                                self.publish_lease();
                            }
                        }
                    } else {
                        let _ = reply.send(Granted::uncounted(answer));
                    }
                } else {
                    self.waiters.push(Waiter {
                        deadline: Instant::now() + wait,
                        hold,
                        reply,
                    });
                }
            }
            Command::Extend {
                hold,
                holding,
                reply,
            } => {
                // While the claim stands, even through a backend error (an answer of
                // "unknown"): the hold is the app's, and the claim still ends on its own. Not
                // once the hold has ended (its lapse may wait behind a renewal): the app has
                // been answered "not held" since, and an extension would hold again unasked.
                let now = BootInstant::now();
                let on_demand = self.config.mode == Mode::OnDemand;
                if let Some(held) = self.held_mut()
                    && now < held.valid_until
                    && held.hold_until.is_none_or(|until| now < until)
                    && holding.is_none_or(|h| h == (held.permit, held.lease.token))
                    && on_demand
                {
                    held.keep_for(now, hold);
                    self.publish_lease();
                }
                let _ = reply.send(self.state.borrow().answer());
            }
            Command::SitOut { reason, reply } => {
                let sitting_out =
                    matches!(&self.phase, Phase::Unheld(u) if u.sitting_out.is_some());
                if self.config.mode == Mode::Campaign && !sitting_out {
                    tracing::warn!(lock = %self.config.name, reason, "sitting out");
                    // Answers say "not holder" at once; the lease is released once the last
                    // answer's validity has run out, and no campaign starts again before that
                    // release has been made. Not holding but waiting: leave the queue (etcd,
                    // ZooKeeper) now, and let an attempt still out be followed up (released if
                    // it took the lock), rather than keep a place first in line for nobody.
                    if !self.lapse_and_wait("sitting out", Duration::ZERO) {
                        if let Some(unheld) = self.unheld_mut() {
                            unheld.in_flight = None;
                        }
                        self.leave_queue(&self.config.name).await;
                    }
                    if let Some(unheld) = self.unheld_mut() {
                        unheld.sitting_out = Some(reason.clone());
                    }
                    self.publish(|s| {
                        s.sitting_out = Some(reason);
                        true
                    });
                }
                let _ = reply.send(());
            }
            Command::ForceRelease {
                permit,
                token,
                reply,
            } => {
                let ours = self.held().is_some_and(|h| {
                    h.lease.token == token && permit.is_none_or(|permit| permit == h.permit)
                });
                if ours {
                    tracing::warn!(lock = %self.config.name, token, "force-released by a person");
                    // As a sit-out: "not holder" at once, the lease released once the last
                    // answer has run out.
                    // No backend gives the lock to the same identity while its lease stands,
                    // so an on-demand waiter meets "busy" until the release; a campaign sits
                    // out a cool-down past it too, so that another contender takes the lock.
                    match self.config.mode {
                        Mode::Campaign => {
                            self.lapse_and_wait("force-released", self.config.cooldown);
                        }
                        Mode::OnDemand => {
                            self.lapse_for("force-released");
                        }
                    }
                }
                let _ = reply.send(ours);
            }
            Command::ComeBack { reply } => {
                if self
                    .unheld_mut()
                    .is_some_and(|unheld| unheld.sitting_out.take().is_some())
                {
                    tracing::info!(lock = %self.config.name, "campaigning again");
                    self.publish(|s| s.sitting_out.take().is_some());
                }
                let _ = reply.send(());
            }
            Command::PermitsChanged => {
                tracing::info!(lock = %self.config.name, permits = self.permits_now(),
                    "the lock's count of permits changed: the next attempts use it");
                // A campaign of one permit waits in permit 0's queue (etcd, ZooKeeper); rounds
                // over several keep no place, so it is left now, or it would stand first in
                // line for nobody once this process holds another permit.
                if matches!(&self.phase, Phase::Unheld(u) if u.in_flight.is_none()) {
                    self.leave_queue(&self.config.name).await;
                }
                // A turn in the line keeps places on the permits of the count it was taken for.
                self.leave_line();
            }
            Command::Retire { reason, done } => {
                self.retired = Some((reason, done));
                return Flow::Stop;
            }
            Command::Bind { holding, reply } => {
                let bound = match self.held_mut() {
                    // Each bound acquisition is one of those counted.
                    Some(held)
                        if holding == (held.permit, held.lease.token)
                            && held.bound < held.holds =>
                    {
                        held.bound += 1;
                        true
                    }
                    _ => false,
                };
                let _ = reply.send(bound);
            }
            Command::Release {
                holding,
                by_connection,
                reply,
            } => {
                let ours = self.held().is_some_and(|held| {
                    holding.is_none_or(|h| h == (held.permit, held.lease.token))
                });
                if !ours {
                    let _ = reply.send(false);
                    return Flow::Continue;
                }
                let (holds, bound) = match self.held_mut() {
                    Some(held) if by_connection => {
                        held.bound = held.bound.saturating_sub(1);
                        (held.holds, held.bound)
                    }
                    Some(held) => (held.holds, held.bound),
                    None => (0, 0),
                };
                match self.config.mode {
                    // Only connections' acquisitions are left, and another call gives one
                    // back: their clients may act on their last events until they read that
                    // the holding ended, so the lease waits out the last answer.
                    Mode::OnDemand if !by_connection && bound > 0 && holds <= bound => {
                        self.lapse_for("released by a call while a connection holds it");
                    }
                    Mode::OnDemand if holds > 1 => {
                        if let Some(held) = self.held_mut() {
                            held.holds -= 1;
                        }
                        self.publish_lease();
                    }
                    Mode::OnDemand => self.step_down("released by the app").await,
                    Mode::Campaign => {
                        self.step_down("stepped down by the app").await;
                        let until = Instant::now() + self.config.cooldown;
                        if let Some(unheld) = self.unheld_mut() {
                            unheld.cooldown_until = Some(until);
                        }
                    }
                }
                let _ = reply.send(true);
            }
        }
        Flow::Continue
    }

    pub(super) async fn hold_step(&mut self) -> Flow {
        let Some(held) = self.held() else {
            return Flow::Continue;
        };
        let valid_until = held.valid_until.to_tokio();
        let renew_at = held
            .retry_at
            .unwrap_or(held.last_sent + self.config.renew_interval);
        let hold_deadline = held.hold_until.map(BootInstant::to_tokio);
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
            // Released once the margin for an answer read late has passed too: the app counts
            // its `validForMs` from when it read the answer. An acquisition meanwhile meets the
            // lease as busy (not re-entrant on any backend) and is woken by its release.
            self.lapse_for("the app's hold elapsed");
            return Flow::Continue;
        }
        if now >= renew_at {
            return Box::pin(self.renew()).await;
        }
        Flow::Continue
    }

    pub(super) async fn renew(&mut self) -> Flow {
        let Some(held) = self.held() else {
            return Flow::Continue;
        };
        let (lease, claimed_until) = (held.lease.clone(), held.valid_until);
        let (sent, sent_boot) = (Instant::now(), BootInstant::now());
        // Waiting past the self-fence deadline is pointless: the lease is gone by then.
        let budget = claimed_until
            .saturating_duration_since(sent_boot)
            .min(self.config.renew_interval);
        if budget.is_zero() {
            self.lose("the lease ran out before it could be renewed");
            return Flow::Continue;
        }
        let driver = self.driver.clone();
        let ttl = self.config.lease_duration;
        match self.call(budget, driver.renew(&lease, ttl)).await {
            // Read only once the claim it renews had run out (a stalled task; the call's time
            // limit bounds the wait, not when its answer is read). The app has been answered
            // "not held" since, and a fair-queue driver's place may have been given up to the
            // next in line: the lease is lost, as the fence would have found it on time. What
            // the renewal kept is released once the answers it backed have run out (they have,
            // but for the margin for an answer read late).
            Call::Done(true) if BootInstant::now() >= claimed_until => {
                self.lapse_as(
                    EventKind::Lost,
                    "the renewal was answered after the lease ran out",
                );
            }
            Call::Done(true) => {
                self.telemetry.renewed(&self.config.name, sent.elapsed());
                let valid_until = self.claim_until(&lease, sent_boot);
                let schedule_from = self.schedule_from(valid_until, sent);
                if let Some(held) = self.held_mut() {
                    held.last_sent = schedule_from;
                    held.valid_until = valid_until;
                    held.retry_at = None;
                }
                // The task may stall between the check above and here (a throttled CPU).
                if !self.publish_lease_unless(|| BootInstant::now() >= claimed_until, |_| {}) {
                    if let Some(held) = self.held_mut() {
                        held.valid_until = claimed_until;
                    }
                    self.lapse_as(
                        EventKind::Lost,
                        "the renewal was published after the lease ran out",
                    );
                }
            }
            Call::Done(false) => self.lose("the backend no longer has this lease"),
            Call::Failed | Call::TimedOut => {
                let at = Instant::now() + self.retry_pause();
                if let Some(held) = self.held_mut() {
                    held.retry_at = Some(at);
                }
            }
            Call::ShuttingDown => return Flow::Stop,
        }
        Flow::Continue
    }

    pub(super) async fn campaign_step(&mut self) -> Flow {
        let cooldown_until = match &self.phase {
            Phase::Unheld(unheld) => unheld.cooldown_until,
            Phase::Held(_) => return Flow::Continue,
        };
        if let Some(until) = cooldown_until {
            if Instant::now() < until {
                tokio::select! {
                    biased;
                    _ = self.shutdown.cancelled() => return Flow::Stop,
                    command = self.commands.recv() => return self.command(command).await,
                    _ = sleep_until(until) => {}
                }
                return Flow::Continue;
            }
            if let Some(unheld) = self.unheld_mut() {
                unheld.cooldown_until = None;
            }
        }
        // Subscribe before the attempt, so that a release right after it still wakes us; not
        // when nobody can be left waiting after it (try-locks: every wait already over), which
        // would cost a try-lock a feed, and on SQL a waiter's blocking statement.
        let now = Instant::now();
        let may_wait = match self.config.mode {
            Mode::Campaign => true,
            Mode::OnDemand => self.waiters.iter().any(|w| w.deadline > now),
        };
        let permits = self.permits_now();
        // A turn taken for another count of permits keeps places on permits that the count no
        // longer has, or none on those it gained; one whose line's engine ended never moves:
        // left, the next refusal lines up again.
        let lines_up = self.lines_up(permits);
        let stale =
            |turn: &LineTurn| !lines_up || turn.permits() != permits as usize || turn.ended();
        if self
            .unheld_mut()
            .and_then(|u| u.line.as_ref())
            .is_some_and(stale)
        {
            self.leave_line();
        }
        if let Some(left) = self.line_left.take() {
            tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => return Flow::Stop,
                _ = left => {}
            }
        }
        if self.waits_in_line() {
            return self.wait_in_line().await;
        }
        let mut changes = if may_wait {
            self.driver.changes(&self.config.name)
        } else {
            None
        };
        if let Some(changes) = &mut changes {
            changes.borrow_and_update();
        }
        // A semaphore's other permits: a release of any of them wakes the campaign too.
        let mut other_changes: Vec<_> = if may_wait && permits > 1 {
            (1..permits)
                .filter_map(|permit| self.driver.changes(&self.config.permit_name(permit)))
                .collect()
        } else {
            Vec::new()
        };
        for changes in &mut other_changes {
            changes.borrow_and_update();
        }
        let Attempted {
            outcome,
            permit,
            sent,
            sent_boot,
        } = match self.unheld_mut().and_then(|u| u.in_flight.take()) {
            Some(in_flight) => self.follow(in_flight).await,
            None if permits == 1 => self.follow(self.send_acquisition(0)).await,
            None => self.try_permits().await,
        };
        self.check_enforced_lease();
        let refused = matches!(outcome, Call::Done(Acquire::Busy(_) | Acquire::Withheld(_)));
        let pause = match outcome {
            Call::Done(Acquire::Acquired(lease)) => {
                // An attempt that was waited for again, and whose claim ran out meanwhile; or
                // one sent for a permit the lock no longer has (its count was lowered).
                if BootInstant::now() >= self.claim_until(&lease, sent_boot)
                    || permit >= self.permits_now()
                {
                    let budget = self.config.renew_interval;
                    let _ = timeout(budget, self.driver.release(&lease)).await;
                    return Flow::Continue;
                }
                self.on_acquired(lease, permit, sent, sent_boot);
                self.release_unwanted().await;
                return Flow::Continue;
            }
            Call::Done(Acquire::Busy(holding)) => {
                let poll = self.poll_pause();
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
                let poll = self.poll_pause();
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
            // Nor for a turn in line.
            if let Some(unheld) = self.unheld_mut() {
                unheld.in_flight = None;
            }
            self.leave_line();
            return Flow::Continue;
        }
        // Refused on every permit: line up, unless in line already.
        if lines_up && refused && self.unheld_mut().is_some_and(|u| u.line.is_none()) {
            let names = (0..permits).map(|p| self.config.permit_name(p)).collect();
            let line = LineTurn::join(&self.driver, &self.config, names, &self.settled);
            if let Some(unheld) = self.unheld_mut() {
                unheld.line = line;
            }
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
            _ = any_changed(&mut other_changes), if !other_changes.is_empty() => {}
            _ = line_moved(&mut self.phase) => {}
            _ = sleep_until(waiter_deadline.unwrap_or(wake)), if waiter_deadline.is_some() => {}
            _ = sleep_until(wake) => {}
        }
        Flow::Continue
    }

    /// Whether the processes waiting for the lock line up for its permits ([`LineTurn`]): a
    /// lock's of several permits, on a backend that keeps a queue. A key's waiters line up in
    /// its family instead (keyed/line.rs).
    fn lines_up(&self, permits: u32) -> bool {
        permits > 1 && !self.config.single_use && self.driver.keeps_queue()
    }

    /// Leave the lock's line, if in it ([`LineTurn::leave`]).
    fn leave_line(&mut self) {
        let turn = self.unheld_mut().and_then(|u| u.line.take());
        if let Some(left) = turn.and_then(LineTurn::leave) {
            // An earlier leaving still running goes on by itself.
            self.line_left = Some(left);
        }
    }

    /// In line for the permits, behind another process: no attempt until first.
    fn waits_in_line(&self) -> bool {
        matches!(&self.phase, Phase::Unheld(Unheld { line: Some(line), in_flight: None, .. })
            if !line.first())
    }

    /// Behind another process in the line: wait until first (or for a command, the end of a
    /// wait, or a poll's time, after which the next step looks again).
    async fn wait_in_line(&mut self) -> Flow {
        let leaving = self
            .unheld_mut()
            .and_then(|u| u.line.as_mut())
            .and_then(LineTurn::leave_places);
        if let Some(leaving) = leaving {
            leaving.await;
        }
        self.expire_waiters().await;
        if !self.wants_lock() {
            self.leave_line();
            return Flow::Continue;
        }
        let poll = Instant::now() + self.poll_pause();
        let wake = self
            .next_waiter_deadline()
            .map_or(poll, |end| end.min(poll));
        tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => Flow::Stop,
            command = self.commands.recv() => self.command(command).await,
            _ = line_moved(&mut self.phase) => Flow::Continue,
            _ = sleep_until(wake) => Flow::Continue,
        }
    }

    /// Wait for an acquisition's answer within a renew interval; one unanswered by then is kept
    /// to be waited for again by the next step ([`Unheld::in_flight`]). An attempt that keeps
    /// its place in line (a semaphore's first waiter, keyed/line.rs) is waited for up to a
    /// lease: given up on, its follow-up would leave the place it made, and the next attempt
    /// would line up again behind everyone who asked meanwhile.
    async fn follow(&mut self, mut in_flight: InFlight) -> Attempted {
        let budget = if self.config.keeps_queue_place {
            self.config.lease_duration
        } else {
            self.config.renew_interval
        };
        let outcome = match in_flight.attempt.as_mut() {
            Some(attempt) => self.call(budget, attempt.as_mut()).await,
            None => Call::Failed,
        };
        let (permit, sent, sent_boot) = (in_flight.permit, in_flight.sent, in_flight.sent_boot);
        match outcome {
            // Unfinished: the backend may still carry it out.
            Call::TimedOut | Call::ShuttingDown => {
                if let Some(unheld) = self.unheld_mut() {
                    unheld.in_flight = Some(in_flight);
                }
            }
            Call::Done(_) | Call::Failed => in_flight.attempt = None,
        }
        // A semaphore's attempt that did not take its permit keeps no queue place on it (etcd,
        // ZooKeeper; a failed attempt may have made one): the next round may take another
        // permit, and a place left here would stand first in line for nobody once the permit's
        // holder goes.
        let refused = matches!(
            outcome,
            Call::Done(Acquire::Busy(_) | Acquire::Withheld(_)) | Call::Failed
        );
        if self.permits_ever() > 1 && refused {
            let lock = self.config.permit_name(permit);
            match &mut self.phase {
                Phase::Unheld(Unheld {
                    line: Some(line), ..
                }) if line.first() && line.covers(&lock) => line.kept_a_place(),
                _ => self.leave_queue(&lock).await,
            }
        }
        Attempted {
            outcome,
            permit,
            sent,
            sent_boot,
        }
    }

    /// A semaphore's round: each permit once, one attempt at a time (so that at most one can
    /// take a permit), from another permit each round so that contenders spread over them; a
    /// permit not taken keeps no queue place ([`Engine::follow`]). The round ends at the first
    /// permit taken, or at a failure; refused everywhere, the answer is the refusal whose permit
    /// may be free soonest.
    async fn try_permits(&mut self) -> Attempted {
        let permits = self.permits_now();
        self.rounds = self.rounds.wrapping_add(1);
        let first = spread(&self.config.identity, self.rounds) % permits;
        let mut refused: Option<Attempted> = None;
        for offset in 0..permits {
            let permit = (first + offset) % permits;
            let attempt = self.follow(self.send_acquisition(permit)).await;
            if !matches!(
                attempt.outcome,
                Call::Done(Acquire::Busy(_) | Acquire::Withheld(_))
            ) {
                return attempt;
            }
            let sooner = |earlier: &Attempted| match (earlier.free_in(), attempt.free_in()) {
                (Some(earlier), Some(later)) => earlier <= later,
                (earlier, _) => earlier.is_some(),
            };
            refused = Some(match refused {
                Some(earlier) if sooner(&earlier) => earlier,
                _ => attempt,
            });
        }
        refused.unwrap_or(Attempted {
            outcome: Call::Failed,
            permit: 0,
            sent: Instant::now(),
            sent_boot: BootInstant::now(),
        })
    }

    /// How long a refused campaign waits before it tries again, unless woken: a semaphore's
    /// within half a renew interval, since a release notice reaches only those queued for a
    /// permit on some backends, and a semaphore's contenders do not queue.
    fn poll_pause(&self) -> Duration {
        let poll = self.driver.poll_interval(self.config.renew_interval);
        jitter(match self.permits_now() {
            1 => poll,
            _ => poll.min(self.config.renew_interval / 2),
        })
    }

    /// Warn when the backend enforces a longer lease than configured: takeover after a crash
    /// then takes that long, not `lease + renew interval`.
    pub(super) fn check_enforced_lease(&mut self) {
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
    pub(super) async fn idle_step(&mut self) -> Flow {
        self.leave_line();
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
