//! One contender's place in a fair-queue lock (etcd, ZooKeeper): waiting or holding, the local
//! end of a held lease, and the two tasks that serve the place (one watching the predecessor,
//! one tending the place). The backend operations stay in each driver.

use std::sync::Mutex;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

enum Place {
    /// In the queue; `asked` is the last time the engine tried to acquire.
    Waiting {
        asked: Instant,
    },
    Holding,
}

/// How a held place's wait for its local expiry ended.
pub(crate) enum Expiry {
    /// The local lease ran out: give the place up.
    Passed,
    /// Renewed (or the place changed): look again.
    Moved,
    /// The slot is gone.
    Closed,
}

pub(crate) struct QueueSlot {
    place: Mutex<Place>,
    /// While holding: when the local lease runs out.
    expires: watch::Sender<Instant>,
    /// The predecessor being watched, and the task watching it.
    watching: Mutex<Option<(String, JoinHandle<()>)>>,
    tender: Mutex<Option<JoinHandle<()>>>,
}

impl QueueSlot {
    /// A waiting place, and the receiver for its tending task: made now, before any acquisition
    /// can set the expiry, so the task never misses it.
    pub(crate) fn new() -> (Self, watch::Receiver<Instant>) {
        let now = Instant::now();
        let (expires, receiver) = watch::channel(now);
        let slot = Self {
            place: Mutex::new(Place::Waiting { asked: now }),
            expires,
            watching: Mutex::new(None),
            tender: Mutex::new(None),
        };
        (slot, receiver)
    }

    fn place(&self) -> std::sync::MutexGuard<'_, Place> {
        self.place.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn holding(&self) -> bool {
        matches!(*self.place(), Place::Holding)
    }

    /// While waiting: when the engine last asked.
    pub(crate) fn asked(&self) -> Option<Instant> {
        match *self.place() {
            Place::Waiting { asked } => Some(asked),
            Place::Holding => None,
        }
    }

    /// The engine asks again: still waiting, as of `at`.
    pub(crate) fn ask(&self, at: Instant) {
        *self.place() = Place::Waiting { asked: at };
    }

    /// Acquired: holding first, then the expiry that wakes the tending task, so it sees both.
    pub(crate) fn hold_until(&self, until: Instant) {
        *self.place() = Place::Holding;
        self.expires.send_replace(until);
    }

    /// Renewed.
    pub(crate) fn extend(&self, until: Instant) {
        self.expires.send_replace(until);
    }

    /// Whether the local lease has run out by `at`.
    pub(crate) fn expired_by(&self, at: Instant) -> bool {
        *self.expires.borrow() <= at
    }

    /// For the tending task of a held place: wait for the local lease to run out.
    pub(crate) async fn wait_expiry(&self, expires: &mut watch::Receiver<Instant>) -> Expiry {
        let until = *expires.borrow_and_update();
        tokio::select! {
            () = tokio::time::sleep_until(until) => {
                if self.expired_by(Instant::now()) { Expiry::Passed } else { Expiry::Moved }
            }
            changed = expires.changed() => {
                if changed.is_err() { Expiry::Closed } else { Expiry::Moved }
            }
        }
    }

    pub(crate) fn set_tender(&self, task: JoinHandle<()>) {
        *self.tender.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
    }

    /// Watch `predecessor` with the task `spawn` starts, unless it is watched already.
    pub(crate) fn watch(&self, predecessor: String, spawn: impl FnOnce() -> JoinHandle<()>) {
        let mut watching = self.watching.lock().unwrap_or_else(|e| e.into_inner());
        if watching
            .as_ref()
            .is_some_and(|(key, task)| *key == predecessor && !task.is_finished())
        {
            return;
        }
        if let Some((_, task)) = watching.take() {
            task.abort();
        }
        *watching = Some((predecessor, spawn()));
    }

    pub(crate) fn stop_watching(&self) {
        if let Some((_, task)) = self
            .watching
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            task.abort();
        }
    }

    pub(crate) fn abort_tasks(&self) {
        self.stop_watching();
        if let Some(task) = self.tender.lock().unwrap_or_else(|e| e.into_inner()).take() {
            task.abort();
        }
    }
}
