//! The fair-queue lock, first come first served, on its two transports: each contender puts a
//! place in line (an etcd key under the lock's prefix, a sequential ZooKeeper node) and holds
//! the lock once its place is first; each waiter watches the place just ahead. [`slot`] is
//! one contender's place and the tasks that serve it, and [`places`] this process's table of
//! them, the same for both; [`etcd`] and [`zookeeper`] are the backend operations.

pub mod etcd;
pub mod etcd_rpc;
pub(crate) mod places;
pub(crate) mod slot;
mod urls;
pub mod zookeeper;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tokio::time::Instant;

use crate::driver::{ChangeFeeds, Holding};
use crate::error::{Error, Result};
use places::{Place, Places};
use slot::{AttemptTurn, Attempts, Expiry};

/// How many renew intervals an engine's waiter sleeps between its questions, with nothing to
/// wake it: watches wake waiters, so polling is only the fallback for a watch that was missed.
const POLL_RENEW_INTERVALS: u32 = 3;
/// A waiting place whose engine has not asked for this many leases is given up: its app stopped
/// waiting. An engine asks at least every [`POLL_RENEW_INTERVALS`] renew intervals, jittered
/// by up to a fifth, and a renew interval is shorter than the lease: one that still waits has
/// asked by then, whatever its renew interval.
pub(crate) const ABANDONED_AFTER_LEASES: u32 = 4;
const _: () = assert!(ABANDONED_AFTER_LEASES * 5 > POLL_RENEW_INTERVALS * 6);

/// What this process keeps of the lines it stands in, the same on both transports.
pub(crate) struct Lines<Own> {
    /// This process's places, by lock.
    pub(crate) places: Places<Own>,
    /// One acquisition of a lock at a time ([`Attempts`]).
    pub(crate) attempts: Attempts,
    /// Bumped when a lock's line moves (a place left or released), waking its waiters.
    pub(crate) releases: ChangeFeeds,
    /// How many times a watch on the place ahead fired (the conformance suite's evidence that
    /// waiters are woken, not polling).
    pub(crate) wakeups: AtomicU64,
}

impl<Own> Default for Lines<Own> {
    fn default() -> Self {
        Self {
            places: Places::new(),
            attempts: Attempts::default(),
            releases: ChangeFeeds::default(),
            wakeups: AtomicU64::new(0),
        }
    }
}

/// What a transport gives the driver calls that are the same on both.
pub(crate) trait Transport: Send + Sync {
    /// The transport's own part of a place.
    type Own: Send + Sync + 'static;
    fn lines(&self) -> &Lines<Self::Own>;
    /// Who holds `lock` now: the holder first in its line. With `clear`, a place of this
    /// process's that the driver does not know, first in line, is deleted; only under the
    /// lock's [`Attempts`] turn, so that no acquisition of this driver's is putting a place it
    /// will count as its own meanwhile.
    fn first_in_line(
        &self,
        lock: &str,
        clear: bool,
    ) -> impl Future<Output = Result<Option<Holding>>> + Send;
    /// Takes `place` out of its line (forgotten here, deleted on the server, or left to be
    /// deleted once the server answers again).
    fn leave_line(&self, place: &Place<Self::Own>) -> impl Future<Output = ()> + Send;
    /// Whether the server already took `place` out of its line with whatever kept it (an etcd
    /// lease that ran out): it is then only forgotten here.
    fn line_gone(&self, _place: &Place<Self::Own>) -> bool {
        false
    }
}

/// [`crate::driver::Driver::observe`] on either transport: the holder first in line, places of
/// this process's the driver does not know cleared under the lock's attempts turn. An idle
/// engine observes every renew interval, so they are cleared then too, not only when it tries
/// to acquire.
pub(crate) async fn observe<T: Transport>(transport: &T, lock: &str) -> Result<Option<Holding>> {
    let _turn = transport.lines().attempts.turn(lock).await;
    transport.first_in_line(lock, true).await
}

/// The task every place keeps: a waiting place nobody has asked about for `abandoned_after` is
/// given up rather than hold everyone behind it; a held one leaves the line once its local lease
/// runs out.
///
/// Every held or waiting key keeps one of these tasks, so its size counts per key: the leaving is
/// boxed, because its future (which may open a session or make a gRPC call) would make each task
/// several KB where it is otherwise a few hundred bytes.
pub(crate) async fn tend<T: Transport>(
    transport: Arc<T>,
    place: Arc<Place<T::Own>>,
    abandoned_after: Duration,
) {
    let slot = &place.slot;
    loop {
        if slot.left() {
            return;
        }
        if transport.line_gone(&place) {
            transport.lines().places.forget(&place);
            return;
        }
        match slot.asked() {
            Some(asked) => {
                tokio::select! {
                    () = tokio::time::sleep_until(asked + abandoned_after) => {
                        let still_waiting = slot
                            .asked()
                            .is_some_and(|asked| asked + abandoned_after <= Instant::now());
                        // Unless an acquisition claimed the place meanwhile: then guard it.
                        if still_waiting && slot.leave_if_waiting() {
                            Box::pin(transport.leave_line(&place)).await;
                            transport.lines().releases.bump(&place.lock);
                            return;
                        }
                    }
                    // An acquisition sets the expiry: stop waiting and guard it at once.
                    () = slot.expiry_moved() => {}
                }
            }
            None => match slot.wait_expiry().await {
                Expiry::Passed => {
                    Box::pin(transport.leave_line(&place)).await;
                    transport.lines().releases.bump(&place.lock);
                    return;
                }
                Expiry::Moved => {}
            },
        }
    }
}

/// Put `identity`'s place in `lock`'s line (`put`, a transport's enqueue) on a task of its own,
/// which keeps the lock's attempt `turn` until the place is recorded: an acquisition dropped
/// midway (the engine's time budget, a client that hung up) cannot leave a place nobody knows
/// of, nor let another acquisition put a second place meanwhile. A wait abandoned meanwhile
/// marks the place, which leaves as soon as it is put ([`Places::joined`]). The turn comes
/// back with the place.
pub(crate) async fn join_line<T, R>(
    transport: &Arc<T>,
    turn: AttemptTurn,
    lock: &str,
    identity: &str,
    put: impl Future<Output = Result<R>> + Send + 'static,
) -> Result<(R, AttemptTurn)>
where
    T: Transport + 'static,
    R: Send + 'static,
{
    transport.lines().places.joining(lock, identity);
    let (transport, lock) = (transport.clone(), lock.to_owned());
    let (put, turn) = tokio::spawn(async move {
        let put = put.await;
        if put.is_err() {
            transport.lines().places.not_joined(&lock);
        }
        (put, turn)
    })
    .await
    .map_err(|e| Error::Backend(format!("putting a place in line failed: {e}")))?;
    Ok((put?, turn))
}

/// `Driver::abandon`: `identity`'s waiting place in `lock`'s line is given up, unless it already
/// holds.
pub(crate) async fn abandon<T: Transport>(transport: &T, lock: &str, identity: &str) {
    // Without the lock's attempt turn, which the engine's own late attempt may hold while it
    // calls this: the place's own state decides whether the attempt claimed first. A place
    // still being put is marked and leaves once put.
    if let Some(place) = transport.lines().places.abandoned(lock, identity) {
        transport.leave_line(&place).await;
        place.slot.abort_tasks();
        // The one behind may be first now.
        transport.lines().releases.bump(lock);
    }
}

/// The `Driver` hints that are the same on both transports (each driver's `shared` is its
/// [`Transport`]): a fair queue keeps its waiters' places; its line moving (a place left or
/// released) wakes them; and since watches wake them, polling is only the fallback for a watch
/// that was missed.
macro_rules! fair_queue_hints {
    () => {
        fn keeps_queue(&self) -> bool {
            true
        }

        fn changes(&self, lock: &str) -> Option<tokio::sync::watch::Receiver<u64>> {
            use super::Transport;
            Some(self.shared.lines().releases.subscribe(lock))
        }

        fn poll_interval(&self, renew_interval: std::time::Duration) -> std::time::Duration {
            renew_interval * super::POLL_RENEW_INTERVALS
        }
    };
}
pub(crate) use fair_queue_hints;
