//! This process's places in the queues it stands in, one per lock: the table both transports
//! keep, and what the driver calls ask of it (the place that holds a lease, the waiting place an
//! abandoned wait gives up, a place forgotten once it is left).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::slot::QueueSlot;
use crate::driver::Lease;

/// One contender's place in one lock's line: what both transports keep, and the transport's own
/// part (`own`: an etcd key and its session, a ZooKeeper node's path), which the place
/// dereferences to.
pub(crate) struct Place<X> {
    pub(crate) lock: String,
    pub(crate) identity: String,
    /// The fencing token the place grants (etcd: its key's create revision; ZooKeeper: its
    /// node's czxid); it also tells a lock's place from a later one.
    pub(crate) token: i64,
    pub(crate) slot: QueueSlot,
    pub(crate) own: X,
}

impl<X> Place<X> {
    /// The lease this place grants while it holds.
    pub(crate) fn lease(&self) -> Lease {
        Lease {
            lock: self.lock.clone(),
            identity: self.identity.clone(),
            token: u64::try_from(self.token).unwrap_or(0),
        }
    }
}

impl<X> std::ops::Deref for Place<X> {
    type Target = X;
    fn deref(&self) -> &X {
        &self.own
    }
}

pub(crate) struct Places<X>(Mutex<HashMap<String, Arc<Place<X>>>>);

impl<X> Places<X> {
    pub(crate) fn new() -> Self {
        Self(Mutex::new(HashMap::new()))
    }

    fn map(&self) -> MutexGuard<'_, HashMap<String, Arc<Place<X>>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `lock`'s place, if this process stands in its queue.
    pub(crate) fn get(&self, lock: &str) -> Option<Arc<Place<X>>> {
        self.map().get(lock).cloned()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    /// The place that holds `lease`: its lock's, holding, for its identity, with its token.
    pub(crate) fn holding(&self, lease: &Lease) -> Option<Arc<Place<X>>> {
        self.get(&lease.lock).filter(|p| {
            p.slot.holding()
                && p.identity == lease.identity
                && u64::try_from(p.token).ok() == Some(lease.token)
        })
    }

    /// `identity`'s place in `lock`'s queue while it only waits, now marked left so that an
    /// attempt still in flight can no longer hold it; a place that holds is not given.
    pub(crate) fn abandoned(&self, lock: &str, identity: &str) -> Option<Arc<Place<X>>> {
        self.get(lock)
            .filter(|p| p.identity == identity && p.slot.leave_if_waiting())
    }

    /// Make `place` its lock's place.
    pub(crate) fn put(&self, place: Arc<Place<X>>) {
        self.map().insert(place.lock.to_owned(), place);
    }

    /// Make `place` its lock's place, unless the present one is to be `kept`: then `Err` with
    /// it. `Ok` with the place it replaced, if any.
    pub(crate) fn put_unless(
        &self,
        place: Arc<Place<X>>,
        kept: impl Fn(&Place<X>) -> bool,
    ) -> Result<Option<Arc<Place<X>>>, Arc<Place<X>>> {
        let mut map = self.map();
        match map.get(&place.lock).filter(|present| kept(present)) {
            Some(present) => Err(present.clone()),
            None => Ok(map.insert(place.lock.clone(), place)),
        }
    }

    /// Forget `place` if it is still its lock's (a later one stays); either way it serves no
    /// more: marked left, its watch stopped. Whether it was its lock's place.
    pub(crate) fn forget(&self, place: &Place<X>) -> bool {
        let mut map = self.map();
        let current = map.get(&place.lock).is_some_and(|p| p.token == place.token);
        if current {
            map.remove(&place.lock);
        }
        drop(map);
        place.slot.mark_left();
        place.slot.stop_watching();
        current
    }

    /// Stop every place's tasks (the driver is going).
    pub(crate) fn abort_all(&self) {
        for place in self.map().values() {
            place.slot.abort_tasks();
        }
    }

    /// Empty the table, stopping every place's tasks (the session that kept them is gone).
    pub(crate) fn drop_all(&self) {
        let places = std::mem::take(&mut *self.map());
        for place in places.values() {
            place.slot.abort_tasks();
        }
    }
}
