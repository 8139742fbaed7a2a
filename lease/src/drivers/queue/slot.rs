//! One contender's place in a fair-queue lock (etcd, ZooKeeper): waiting or holding, the local
//! end of a held lease, and the two tasks that serve the place (one watching the predecessor,
//! one tending the place). The backend operations stay in each driver.
//!
//! A waiter further back than next in line has nothing to learn from polling while its
//! predecessor's watch stands: only that watch can make it next. So its engine's polls are
//! answered from the last read of the queue, and the queue is read again only once that read is
//! [`QUIET_REREAD`] leases old (for a watch gone deaf, and for the holder's name it reports). The
//! next in line polls the queue every time, so a holder's expiry is never left to a watch alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, OwnedMutexGuard};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::driver::Holding;

/// How old, in leases, the last read of the queue may be when a waiter further back is answered
/// from it. Engines poll about once a lease, so this reads at every other poll.
const QUIET_REREAD: (u32, u32) = (3, 2);

struct Watching {
    predecessor: String,
    task: JoinHandle<()>,
    fired: Arc<AtomicBool>,
}

/// Handed to a watching task: it calls [`WatchFired::fire`] before it wakes the engine, so the
/// engine's next poll reads the queue even if it runs before the task has ended.
pub(crate) struct WatchFired(Arc<AtomicBool>);

impl WatchFired {
    pub(crate) fn fire(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The last read of the queue while waiting.
struct Seen {
    at: Instant,
    next_in_line: bool,
    holder: Option<Holding>,
}

enum Place {
    /// In the queue; `asked` is the last time the engine tried to acquire.
    Waiting {
        asked: Instant,
    },
    Holding,
    /// Left the queue (abandoned, expired or given up): it can never hold again.
    Left,
}

/// How a held place's wait for its local expiry ended.
pub(crate) enum Expiry {
    /// The local lease ran out: give the place up.
    Passed,
    /// Renewed (or the place changed): look again.
    Moved,
}

pub(crate) struct QueueSlot {
    place: Mutex<Place>,
    /// While holding: when the local lease runs out.
    expires: Mutex<Instant>,
    /// Raised when `expires` moves. A mutex and a `Notify` rather than a watch channel, which
    /// takes about 360 bytes: a sidecar holding 10,000 keyed locks has a slot per key.
    expiry_moved: Notify,
    /// The predecessor being watched, and the task watching it.
    watching: Mutex<Option<Watching>>,
    tender: Mutex<Option<JoinHandle<()>>>,
    seen: Mutex<Option<Seen>>,
}

impl QueueSlot {
    /// A waiting place. Its tending task cannot miss an expiry set before it first waits:
    /// `Notify` keeps the wake-up as a permit.
    pub(crate) fn new() -> Self {
        let now = Instant::now();
        Self {
            place: Mutex::new(Place::Waiting { asked: now }),
            expires: Mutex::new(now),
            expiry_moved: Notify::new(),
            watching: Mutex::new(None),
            tender: Mutex::new(None),
            seen: Mutex::new(None),
        }
    }

    fn expires(&self) -> std::sync::MutexGuard<'_, Instant> {
        self.expires.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// For the tending task of a waiting place: resolves once an acquisition (or a renewal)
    /// has set the expiry since the last wait.
    pub(crate) async fn expiry_moved(&self) {
        self.expiry_moved.notified().await;
    }

    fn place(&self) -> std::sync::MutexGuard<'_, Place> {
        self.place.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn holding(&self) -> bool {
        matches!(*self.place(), Place::Holding)
    }

    pub(crate) fn left(&self) -> bool {
        matches!(*self.place(), Place::Left)
    }

    /// While waiting: when the engine last asked.
    pub(crate) fn asked(&self) -> Option<Instant> {
        match *self.place() {
            Place::Waiting { asked } => Some(asked),
            Place::Holding | Place::Left => None,
        }
    }

    /// The engine asks again: still waiting, as of `at` (a place that left stays gone).
    pub(crate) fn ask(&self, at: Instant) {
        let mut place = self.place();
        if let Place::Waiting { .. } = *place {
            *place = Place::Waiting { asked: at };
        }
    }

    /// Leave the queue if still waiting; `false` if the place holds (or left already).
    ///
    /// This and [`QueueSlot::hold_until`] decide under one mutex which comes first, so a
    /// waiter given up without the lock's attempt turn (the engine's `abandon`, the tending
    /// task of a place nobody asks for) can never be removed from the backend after a late
    /// acquisition of that same place has claimed it, nor claim after it was removed.
    pub(crate) fn leave_if_waiting(&self) -> bool {
        let mut place = self.place();
        if let Place::Waiting { .. } = *place {
            *place = Place::Left;
            true
        } else {
            false
        }
    }

    /// The place left for good, whatever it was doing.
    pub(crate) fn mark_left(&self) {
        *self.place() = Place::Left;
    }

    /// Acquired: the expiry first, then holding, then the wake-up of the tending task. A task
    /// that finds the place holding reads its expiry next: were it still the one set while
    /// waiting (long past), the task would give the place up in the backend as the acquisition
    /// is answered, and the next in line would hold beside it. `false` if the place left
    /// meanwhile: it must not claim the lock (an expiry written on a place that left is read by
    /// nobody).
    #[must_use]
    pub(crate) fn hold_until(&self, until: Instant) -> bool {
        *self.expires() = until;
        let mut place = self.place();
        if let Place::Left = *place {
            return false;
        }
        *place = Place::Holding;
        drop(place);
        self.expiry_moved.notify_one();
        true
    }

    /// Renewed, until `until`: `false`, and nothing moved, if the local lease has run out
    /// meanwhile or the place left. The tending task gives a place up once its local lease has
    /// run out, so a renewal whose answer is read only after that (a stalled task) must not
    /// count: the next in line may hold by then. Decided under the expiry's mutex, which the
    /// tending task reads the expiry under too, so one of the two comes first.
    #[must_use]
    pub(crate) fn extend(&self, until: Instant) -> bool {
        let mut expires = self.expires();
        if *expires <= Instant::now() || self.left() {
            return false;
        }
        *expires = until;
        drop(expires);
        self.expiry_moved.notify_one();
        true
    }

    /// Whether the local lease has run out by `at`.
    pub(crate) fn expired_by(&self, at: Instant) -> bool {
        *self.expires() <= at
    }

    /// For the tending task of a held place: wait for the local lease to run out.
    /// A move of the expiry after `until` was read leaves a permit, so it is never missed.
    pub(crate) async fn wait_expiry(&self) -> Expiry {
        let until = *self.expires();
        tokio::select! {
            () = tokio::time::sleep_until(until) => {
                if self.expired_by(Instant::now()) { Expiry::Passed } else { Expiry::Moved }
            }
            () = self.expiry_moved.notified() => Expiry::Moved,
        }
    }

    /// A read of the queue at `at` found this place waiting, right behind the holder or not.
    pub(crate) fn saw(&self, at: Instant, next_in_line: bool, holder: Option<Holding>) {
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(Seen {
            at,
            next_in_line,
            holder,
        });
    }

    /// The holder to answer a poll at `now` with, without reading the queue: `Some` while this
    /// place waits further back than next in line, its predecessor's watch still stands, and
    /// the last read is recent enough for a lease of `ttl`.
    pub(crate) fn quiet_wait(&self, now: Instant, ttl: Duration) -> Option<Option<Holding>> {
        if self.holding() {
            return None;
        }
        let watched = self
            .watching
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|w| !w.task.is_finished() && !w.fired.load(Ordering::SeqCst));
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let (times, per) = QUIET_REREAD;
        match seen.as_ref() {
            Some(seen) if watched && !seen.next_in_line && now < seen.at + ttl * times / per => {
                Some(seen.holder.clone())
            }
            _ => None,
        }
    }

    pub(crate) fn set_tender(&self, task: JoinHandle<()>) {
        *self.tender.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
    }

    /// Watch `predecessor` with the task `spawn` starts, unless it is watched already.
    pub(crate) fn watch(
        &self,
        predecessor: String,
        spawn: impl FnOnce(WatchFired) -> JoinHandle<()>,
    ) {
        let mut watching = self.watching.lock().unwrap_or_else(|e| e.into_inner());
        if watching.as_ref().is_some_and(|w| {
            w.predecessor == predecessor && !w.task.is_finished() && !w.fired.load(Ordering::SeqCst)
        }) {
            return;
        }
        if let Some(old) = watching.take() {
            old.task.abort();
        }
        let fired = Arc::new(AtomicBool::new(false));
        let task = spawn(WatchFired(fired.clone()));
        *watching = Some(Watching {
            predecessor,
            task,
            fired,
        });
    }

    pub(crate) fn stop_watching(&self) {
        if let Some(old) = self
            .watching
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            old.task.abort();
        }
    }

    pub(crate) fn abort_tasks(&self) {
        self.stop_watching();
        if let Some(task) = self.tender.lock().unwrap_or_else(|e| e.into_inner()).take() {
            task.abort();
        }
    }
}

/// One acquisition at a time per lock in one driver. Two at once by one identity would both find
/// its place first in line and both be granted the lock; whoever then released one of them (an
/// engine giving back an answer that came too late) would delete the place under the other,
/// which claims the lock until its next renewal while the next in line takes it.
#[derive(Default, Clone)]
pub(crate) struct Attempts(Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>);

/// The right to make the one acquisition of a lock now. It may move to a task of its own, so
/// that an acquisition's step its caller may not wait for (putting a place in line) keeps the
/// turn until it is done.
pub(crate) struct AttemptTurn {
    attempts: Attempts,
    lock: String,
    turn: Option<OwnedMutexGuard<()>>,
}

impl Attempts {
    /// Wait until no other acquisition of `lock` is under way.
    pub(crate) async fn turn(&self, lock: &str) -> AttemptTurn {
        let mutex = self.map().entry(lock.to_owned()).or_default().clone();
        AttemptTurn {
            attempts: self.clone(),
            lock: lock.to_owned(),
            turn: Some(mutex.lock_owned().await),
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<()>>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for AttemptTurn {
    fn drop(&mut self) {
        let mut map = self.attempts.map();
        drop(self.turn.take());
        // Forgotten once nobody holds or waits for it, so the map is as large as the attempts
        // under way (a keyed family's locks come and go).
        if map
            .get(&self.lock)
            .is_some_and(|mutex| Arc::strong_count(mutex) == 1)
        {
            map.remove(&self.lock);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_place_left_while_waiting_can_no_longer_hold() {
        let slot = QueueSlot::new();
        assert!(slot.leave_if_waiting());
        slot.ask(Instant::now());
        assert!(!slot.hold_until(Instant::now() + Duration::from_secs(5)));
        assert!(!slot.holding() && slot.left());
    }

    #[tokio::test]
    async fn an_expiry_set_before_the_tending_task_waits_still_wakes_it() {
        let slot = Arc::new(QueueSlot::new());
        // Acquired before the task first waits, as a fast acquisition may be.
        // Far enough that it has not passed by the renewal below on a slow machine.
        let until = Instant::now() + Duration::from_secs(5);
        assert!(slot.hold_until(until));
        tokio::time::timeout(Duration::from_secs(5), slot.expiry_moved())
            .await
            .expect("the hold's expiry wakes a later wait");
        // Renewed after the expiry was read: the wait answers Moved, not Passed at the old time.
        let tending = tokio::spawn({
            let slot = slot.clone();
            async move { slot.wait_expiry().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(slot.extend(until + Duration::from_secs(60)));
        let moved = tokio::time::timeout(Duration::from_secs(5), tending).await;
        assert!(matches!(moved.expect("woken").unwrap(), Expiry::Moved));
        // Not renewed again: the wait ends when the local lease passes.
        assert!(slot.extend(Instant::now() + Duration::from_millis(50)));
        let _ = tokio::time::timeout(Duration::from_millis(10), slot.expiry_moved()).await;
        let passed = tokio::time::timeout(Duration::from_secs(5), slot.wait_expiry()).await;
        assert!(matches!(passed.expect("ends"), Expiry::Passed));
        assert!(slot.expired_by(Instant::now()));
    }

    #[tokio::test]
    async fn a_renewal_read_after_the_local_lease_ran_out_does_not_count() {
        let slot = QueueSlot::new();
        assert!(slot.hold_until(Instant::now() + Duration::from_millis(20)));
        // The wake-up the hold left for a tending task that was not waiting yet.
        slot.expiry_moved().await;
        // The tending task finds the local lease run out and gives the place up ...
        let passed = tokio::time::timeout(Duration::from_secs(5), slot.wait_expiry()).await;
        assert!(matches!(passed.expect("ends"), Expiry::Passed));
        // ... and a renewal whose answer is read only now finds the lease gone, moving nothing.
        assert!(!slot.extend(Instant::now() + Duration::from_secs(5)));
        assert!(slot.expired_by(Instant::now()));
        // A place that left is not renewed either, however long its expiry runs.
        let left = QueueSlot::new();
        assert!(left.hold_until(Instant::now() + Duration::from_secs(5)));
        left.mark_left();
        assert!(!left.extend(Instant::now() + Duration::from_secs(10)));
    }

    /// The tending task reads a holding place's expiry under the expiry's mutex: held here, an
    /// acquisition must not show the place holding before its expiry is written.
    #[test]
    fn a_place_is_seen_holding_only_with_the_expiry_of_its_acquisition() {
        let slot = Arc::new(QueueSlot::new());
        let reading = slot.expires();
        let (started, starting) = std::sync::mpsc::channel();
        let acquiring = std::thread::spawn({
            let slot = slot.clone();
            move || {
                started.send(()).unwrap();
                slot.hold_until(Instant::now() + Duration::from_secs(60))
            }
        });
        starting.recv().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !slot.holding(),
            "the place holds while its expiry is still the one of its wait ({:?} ago)",
            reading.elapsed()
        );
        drop(reading);
        assert!(acquiring.join().expect("acquired"));
        assert!(slot.holding() && !slot.expired_by(Instant::now()));
    }

    #[tokio::test]
    async fn a_held_place_is_not_left_by_an_abandoned_wait() {
        let slot = QueueSlot::new();
        assert!(slot.hold_until(Instant::now() + Duration::from_secs(5)));
        assert!(!slot.leave_if_waiting());
        assert!(slot.holding());
    }
}
