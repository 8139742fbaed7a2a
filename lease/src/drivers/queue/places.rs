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

pub(crate) struct Places<X>(Mutex<Table<X>>);

/// The places, and the places being put in line: one table, so that an abandoned wait either
/// finds its place or marks the one being put as abandoned, never neither.
struct Table<X> {
    places: HashMap<String, Arc<Place<X>>>,
    /// Per lock, the identity whose place is being put in line (by a task of its own, which
    /// holds the lock's attempt turn), and whether its wait was abandoned meanwhile.
    joining: HashMap<String, Joining>,
}

struct Joining {
    identity: String,
    abandoned: bool,
}

impl<X> std::ops::Deref for Table<X> {
    type Target = HashMap<String, Arc<Place<X>>>;
    fn deref(&self) -> &Self::Target {
        &self.places
    }
}

impl<X> std::ops::DerefMut for Table<X> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.places
    }
}

impl<X> Places<X> {
    pub(crate) fn new() -> Self {
        Self(Mutex::new(Table {
            places: HashMap::new(),
            joining: HashMap::new(),
        }))
    }

    fn map(&self) -> MutexGuard<'_, Table<X>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `identity`'s place in `lock`'s line is about to be put: an abandoned wait meanwhile
    /// marks it, and [`Places::joined`] then tells the place to leave as soon as it is put.
    /// Every call is followed by one of [`Places::joined`] (the place put) or
    /// [`Places::not_joined`] (the put failed).
    pub(crate) fn joining(&self, lock: &str, identity: &str) {
        self.map().joining.insert(
            lock.to_owned(),
            Joining {
                identity: identity.to_owned(),
                abandoned: false,
            },
        );
    }

    /// The place being put in `lock`'s line was not put.
    pub(crate) fn not_joined(&self, lock: &str) {
        self.map().joining.remove(lock);
    }

    /// `place` was put in line: made its lock's place (unless the present one is to be
    /// `kept`: then `place` is surplus), or, should its wait have been abandoned while it was
    /// put, marked left and handed back (`Joined::Abandoned`) for its caller to take out of
    /// the line.
    pub(crate) fn joined(
        &self,
        place: Arc<Place<X>>,
        kept: impl Fn(&Place<X>) -> bool,
    ) -> Joined<X> {
        let mut map = self.map();
        let abandoned = map
            .joining
            .remove(&place.lock)
            .is_some_and(|j| j.abandoned && j.identity == place.identity);
        if abandoned {
            drop(map);
            place.slot.mark_left();
            return Joined::Abandoned(place);
        }
        match map.get(&place.lock).filter(|present| kept(present)) {
            Some(present) => Joined::Kept {
                kept: present.clone(),
                surplus: place,
            },
            None => {
                let replaced = map.insert(place.lock.clone(), place.clone());
                Joined::Put { place, replaced }
            }
        }
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
    /// A place still being put in line for `identity` is marked, to leave once it is put.
    pub(crate) fn abandoned(&self, lock: &str, identity: &str) -> Option<Arc<Place<X>>> {
        let mut map = self.map();
        // A place being put anew (its old one perhaps still here, about to be left) too.
        if let Some(joining) = map.joining.get_mut(lock).filter(|j| j.identity == identity) {
            joining.abandoned = true;
        }
        let place = map.get(lock).filter(|p| p.identity == identity)?;
        place.slot.leave_if_waiting().then(|| place.clone())
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
        let places = std::mem::take(&mut self.map().places);
        for place in places.values() {
            place.slot.abort_tasks();
        }
    }
}

/// What became of a place put in line ([`Places::joined`]).
pub(crate) enum Joined<X> {
    /// Made its lock's place, replacing `replaced`, if any.
    Put {
        place: Arc<Place<X>>,
        replaced: Option<Arc<Place<X>>>,
    },
    /// The present place is kept; the new one is surplus, to be taken out of the line.
    Kept {
        kept: Arc<Place<X>>,
        surplus: Arc<Place<X>>,
    },
    /// Its wait was abandoned while it was put: marked left, to be taken out of the line.
    Abandoned(Arc<Place<X>>),
}
