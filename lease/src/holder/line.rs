//! First come, first served among the processes waiting for a lock of several permits, on a
//! backend that keeps a queue (etcd, ZooKeeper; docs/semaphores.md).
//!
//! Each permit is a fair-queue lock of its own, and a waiter kept in every permit's queue would
//! stand first in several. Instead, a process whose round of attempts was refused lines up for
//! the lock's *line*, a lock of its own (`lock_line_name`) that it campaigns for in the
//! backend's order. Only the line's holder tries the permits while it waits, keeping its place
//! in every permit's queue, so that a permit given up goes to it next and a newcomer's attempt,
//! placed behind it, is refused. Once it holds a permit (or stops waiting), it leaves the
//! permits' queues first and then the line, which passes to the next waiter.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::timeout;
use tokio_util::sync::DropGuard;

use super::{Lock, LockConfig, Mode, Snapshot};
use crate::driver::Driver;

/// This process's turn in a lock's line, from lining up until it is left ([`LineTurn::leave`],
/// or dropped).
pub(super) struct LineTurn {
    /// The line's own engine, campaigning for it; taken when the turn is left.
    line: Option<Lock>,
    state: watch::Receiver<Snapshot>,
    driver: Arc<dyn Driver>,
    identity: String,
    /// The permits whose queues the turn may keep a place in, by backend name.
    permits: Vec<String>,
    /// Whether an attempt first in line may have kept a place in them since they were last
    /// left.
    kept: bool,
    budget: Duration,
    /// Kept until the places and the line are left: the lock has not settled before.
    settled: Arc<DropGuard>,
}

impl LineTurn {
    /// Line up for `config`'s lock, whose permits are named `permits`; `None` if the line's
    /// engine cannot start (the permits' attempts go on without it).
    pub(super) fn join(
        driver: &Arc<dyn Driver>,
        config: &LockConfig,
        permits: Vec<String>,
        settled: &Arc<DropGuard>,
    ) -> Option<Self> {
        let line_config = LockConfig {
            renew_interval: config.renew_interval,
            mode: Mode::Campaign,
            quiet: true,
            ..LockConfig::new(
                &crate::keyed::lock_line_name(&config.name),
                &config.identity,
                config.lease_duration,
            )
        };
        let line = match Lock::start(driver.clone(), line_config, Arc::new(())) {
            Ok(line) => line,
            Err(e) => {
                tracing::warn!(lock = %config.name, error = %e,
                    "cannot line up for the lock's permits; trying them in turn");
                return None;
            }
        };
        Some(Self {
            state: line.watch(),
            line: Some(line),
            driver: driver.clone(),
            identity: config.identity.clone(),
            permits,
            kept: false,
            budget: config.renew_interval,
            settled: settled.clone(),
        })
    }

    /// Whether this process stands first in line now: only then does it try the permits. The
    /// line's lease held, not its answer: a renewal that failed once leaves the answer unknown
    /// while the lease is still the line's, and the places kept must not be left for that.
    pub(super) fn first(&self) -> bool {
        self.state.borrow().held.is_some()
    }

    /// How many permits the turn keeps places in: a turn taken for another count is left.
    pub(super) fn permits(&self) -> usize {
        self.permits.len()
    }

    /// Whether the line's engine has ended (only a panic ends it while the turn lasts): such a
    /// turn never moves again, and is left.
    pub(super) fn ended(&self) -> bool {
        self.state.has_changed().is_err()
    }

    /// Resolves when the turn may have moved (the line's state changed).
    pub(super) async fn moved(&mut self) {
        if self.state.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Whether `lock` (a permit's backend name) is among the permits this turn keeps places in.
    pub(super) fn covers(&self, lock: &str) -> bool {
        self.permits.iter().any(|p| p == lock)
    }

    /// An attempt first in line kept its place in a permit's queue.
    pub(super) fn kept_a_place(&mut self) {
        self.kept = true;
    }

    /// Leave the permits' queues while staying in line: a turn that is no longer first (its
    /// line's lease was lost meanwhile) must not stand in front of the new first, which would
    /// wait for a place nobody comes back to.
    pub(super) fn leave_places(&mut self) -> Option<impl Future<Output = ()> + Send + 'static> {
        if !std::mem::take(&mut self.kept) {
            return None;
        }
        Some(leave(
            self.driver.clone(),
            self.identity.clone(),
            self.permits.clone(),
            self.budget,
        ))
    }
}

/// Leave `identity`'s places in the queues of `permits`, each within `budget`.
async fn leave(driver: Arc<dyn Driver>, identity: String, permits: Vec<String>, budget: Duration) {
    let leaving = permits
        .iter()
        .map(|lock| timeout(budget, driver.abandon(lock, &identity)));
    futures_util::future::join_all(leaving).await;
}

impl LineTurn {
    /// Leave: the places in the permits' queues first, so that the next in line does not stand
    /// behind them, then the line. On a task of its own, since the engine goes on at once (it
    /// took a permit, or nobody waits any more); the engine's next attempt waits for it, so
    /// that the leaving cannot take the places of a turn that follows. A place where this
    /// process holds the permit is not touched ([`crate::Driver::abandon`]).
    pub(super) fn leave(mut self) -> Option<tokio::task::JoinHandle<()>> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        Some(runtime.spawn(self.leaving()?))
    }

    fn leaving(&mut self) -> Option<impl Future<Output = ()> + Send + 'static> {
        let line = self.line.take()?;
        let (driver, identity) = (self.driver.clone(), std::mem::take(&mut self.identity));
        let permits = std::mem::take(&mut self.permits);
        let (settled, budget) = (self.settled.clone(), self.budget);
        Some(async move {
            leave(driver.clone(), identity.clone(), permits, budget).await;
            line.shutdown().await;
            // A line's engine campaigns, and one that stops while it waits behind another
            // leaves its place in the line's queue standing (until the driver abandons it,
            // leases later): once first, a place kept for nobody keeps the waiters behind it
            // from trying any permit.
            let _ = timeout(budget, driver.abandon(line.name(), &identity)).await;
            // The lock settles once the line's engine has, attempts it left in flight included.
            tokio::spawn(async move {
                let _settled = settled;
                line.settled().await;
            });
        })
    }
}

/// A turn dropped without [`LineTurn::leave`] (its engine dropped) is left all the same.
impl Drop for LineTurn {
    fn drop(&mut self) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                if let Some(leaving) = self.leaving() {
                    runtime.spawn(leaving);
                }
            }
            Err(_) => {
                if let Some(line) = self.line.take() {
                    line.stop();
                }
            }
        }
    }
}
