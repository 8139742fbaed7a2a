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

use std::time::Duration;

use tokio::sync::watch;

use crate::driver::ChangeFeeds;
use places::{Place, Places};

/// What a transport gives the driver calls that are the same on both.
pub(crate) trait Transport: Send + Sync {
    type Place: Place;
    fn places(&self) -> &Places<Self::Place>;
    /// Bumped when a lock's line moves (a place left or released), waking its waiters.
    fn releases(&self) -> &ChangeFeeds;
    /// Takes `place` out of its line (forgotten here, deleted on the server, or left to be
    /// deleted once the server answers again).
    fn leave_line(&self, place: &Self::Place) -> impl Future<Output = ()> + Send;
}

/// `Driver::abandon`: `identity`'s waiting place in `lock`'s line is given up, unless it already
/// holds.
pub(crate) async fn abandon<T: Transport>(transport: &T, lock: &str, identity: &str) {
    // Without the lock's attempt turn, which the engine's own late attempt may hold while it
    // calls this: the place's own state decides whether the attempt claimed first.
    if let Some(place) = transport.places().abandoned(lock, identity) {
        transport.leave_line(&place).await;
        place.slot().abort_tasks();
        // The one behind may be first now.
        transport.releases().bump(lock);
    }
}

/// `Driver::changes`: the lock's line moving.
pub(crate) fn changes<T: Transport>(transport: &T, lock: &str) -> Option<watch::Receiver<u64>> {
    Some(transport.releases().subscribe(lock))
}

/// `Driver::poll_interval`: watches wake waiters, and polling is only the fallback for a watch
/// that was missed.
pub(crate) fn poll_interval(renew_interval: Duration) -> Duration {
    renew_interval * 3
}
