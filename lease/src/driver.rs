//! The two contracts every backend implements. [`Driver`] is what the engine calls on a lock's
//! path: each call is one atomic compare-and-set on the backend, and timing, self-fencing,
//! retries and wake-ups live in [`crate::holder`], once for all backends. [`Upkeep`] is what
//! the operator and the idle-key sweep call: provisioning, clean-up, counting and warnings.
//! [`Backend`] is both, as [`crate::connect`] opens it.

use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use crate::boot_clock::BootInstant;

use crate::error::Result;

/// Proof of one acquisition: the lock, who took it, and the fencing token it was given.
/// Renew and release present the whole lease; the backend compares identity and token atomically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub lock: String,
    pub identity: String,
    pub token: u64,
}

/// The answer of a [`Upkeep::deprovision_held`] made as a release of `lease`: `released` false
/// is the holding gone, another's perhaps, and nothing deleted.
pub(crate) fn deleted_as_released(lease: &Lease, released: bool) -> Result<()> {
    match released {
        true => Ok(()),
        false => Err(crate::error::Error::Backend(format!(
            "lock {:?}: the deleter's holding had ended (another may hold the lock now); nothing was deleted",
            lease.lock
        ))),
    }
}

/// Who holds a lock, as the backend reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    pub identity: String,
    pub token: u64,
    /// Time left on the holder's lease, when the backend can tell.
    pub expires_in: Option<Duration>,
}

/// The outcome of one acquisition attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    Acquired(Lease),
    /// Someone else holds it (or it is free again by the time you read this).
    Busy(Option<Holding>),
    /// Nobody holds it, but a guard of the backend's does not grant it yet.
    Withheld(Withheld),
}

/// Why a free lock is not granted yet, and for how long when the backend can tell: a server that
/// may have lost leases (a restart without durable data, a promoted replica) waits out one lease
/// so that no lease it forgot is still claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Withheld {
    /// What withholds it, in a sentence an operator can act on.
    pub reason: String,
    /// How long until grants resume, when known.
    pub resume_in: Option<Duration>,
}

/// What a Redis or Tair server's restart guard says when it withholds a free lock.
pub const RESTART_GUARD: &str = "the server restarted without durable data or was promoted since it last granted this lock: a free lock is granted once one lease has passed on it, so that no lease it may have lost is still claimed";

#[async_trait]
pub trait Driver: Send + Sync + 'static {
    /// The backend's name ("sqlite", "redis", ...).
    fn kind(&self) -> &'static str;

    /// One attempt to take `lock` for `ttl`. The token of a successful attempt is strictly
    /// greater than that of every earlier acquisition of the same lock.
    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire>;

    /// Extend `lease` to `ttl` from now. `Ok(false)`: the lease is gone (expired or taken over),
    /// and nothing was changed.
    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool>;

    /// From when the backend counts the lease that the acquisition or renewal of `lease` sent at
    /// `sent` (and just answered) gave: the claim lasts one lease from then. For most backends
    /// the server that decides sees the call itself, so `sent`; ZooKeeper's leader counts from
    /// a follower's earlier, relayed sign of life.
    fn counted_from(&self, _lease: &Lease, sent: BootInstant) -> BootInstant {
        sent
    }

    /// Give `lease` up. `Ok(false)`: it was not ours any more, and nothing was changed.
    async fn release(&self, lease: &Lease) -> Result<bool>;

    /// The current holder, if any.
    async fn observe(&self, lock: &str) -> Result<Option<Holding>>;

    /// A counter that moves whenever the backend signals that `lock` may have become free.
    /// Take it *before* an acquisition attempt so that a release in between is not missed.
    /// `None`: this backend cannot notify, and waiters poll.
    fn changes(&self, _lock: &str) -> Option<watch::Receiver<u64>> {
        None
    }

    /// How often a waiter polls when no notification arrives. The default keeps a waiter at
    /// O(1) backend operations per renew interval.
    fn poll_interval(&self, renew_interval: Duration) -> Duration {
        renew_interval
    }

    /// Whether a dead holder's record counts as expired only once this process has seen it
    /// unchanged for its duration (Kubernetes Leases, whose writers' clocks are not trusted):
    /// reading a lock ahead of acquiring it ([`Driver::observe`]) then starts the count.
    fn expiry_is_observed(&self) -> bool {
        false
    }

    /// A cheap round trip, for readiness.
    async fn ping(&self) -> Result<()>;

    /// How long a crashed holder of `lock` can really keep it, when the backend enforces more
    /// than the lease asked for (ZooKeeper raises a session to its `minSessionTimeout`; etcd
    /// counts whole seconds). `None`: the lease is what the backend enforces, or not known yet.
    fn enforced_lease(&self, _lock: &str) -> Option<Duration> {
        None
    }

    /// This process has stopped waiting for `lock` (a try-lock that found it held, a wait that
    /// timed out, a client that went away): drivers with a queue leave it now, so that no
    /// abandoned place stands first in line when the holder releases. No effect on a lease this
    /// process holds. Best effort: a place that cannot be left now expires on its own.
    async fn abandon(&self, _lock: &str, _identity: &str) {}

    /// Whether contenders keep a place in a first-come first-served line (etcd, ZooKeeper): an
    /// attempt refused leaves a place that a later attempt of the same identity comes back to,
    /// until [`Driver::abandon`]. A semaphore's waiters then line up in order (keyed.rs).
    fn keeps_queue(&self) -> bool {
        false
    }
}

/// What provisioning and clean-up need of a backend: the operator prepares and clears it, and
/// the sidecar sweeps idle keys and counts held ones. Never on a lock's hot path.
#[async_trait]
pub trait Upkeep: Send + Sync + 'static {
    /// Create what the backend needs (the lock table, seeded rows for `locks`), if absent.
    /// Idempotent; backends with nothing to create, or that create it on open, need not
    /// override it.
    async fn provision(&self, _locks: &[String]) -> Result<()> {
        Ok(())
    }

    /// [`Upkeep::provision`] of one lock, with what provisioning saw of its holder: a caller
    /// that wants the holder too asks [`Driver::observe`] only when provisioning read nothing
    /// (a thousand Kubernetes-backed locks are then one read each, not two).
    async fn provision_one(&self, lock: &str) -> Result<Provisioned> {
        self.provision(std::slice::from_ref(&lock.to_owned()))
            .await?;
        Ok(Provisioned::Unread)
    }

    /// Remove what the use of `locks` left in the backend (their holders, keys, znodes, seeded
    /// rows), for a lock deleted with `cleanupPolicy: Delete`, but never the token's high-water
    /// mark: a lock created again under the same name must continue above every token it gave
    /// (a freed row or Lease, a kept counter; etcd and ZooKeeper tokens are cluster-wide
    /// revisions, which need nothing kept). Structures other locks share (the lock table, the
    /// ZooKeeper root) stay.
    async fn deprovision(&self, locks: &[String]) -> Result<()>;

    /// [`Upkeep::deprovision`] of `lease`'s lock while this process holds it (see
    /// [`crate::delete_records`]), and only while it does: a deletion that reaches the backend
    /// after the holding ended (a stalled clean-up, a request held up on the wire) must not
    /// free another's. So each backend matches the holding as a release does, in the deletion
    /// itself, and answers an error when it is not there (nothing is deleted then).
    async fn deprovision_held(&self, lease: &Lease) -> Result<()>;

    /// Delete the records of `family`'s keys that nobody has held for `idle_for` (keys are
    /// chosen at run time without bound), raising first what keeps their tokens rising (see
    /// [`crate::names::family_of`]); how many were deleted. Backends whose idle keys leave
    /// nothing of their own accord (Redis, etcd, ZooKeeper) or that keep them (those not built
    /// yet) do nothing.
    async fn forget_idle_keys(&self, _family: &str, _idle_for: Duration) -> Result<u64> {
        Ok(0)
    }

    /// How many of `family`'s keys have a live holder now, in every process, for the family's
    /// status and its clean-up; `None` from a backend that cannot count them.
    async fn count_held_keys(&self, _family: &str) -> Result<Option<u64>> {
        Ok(None)
    }

    /// Backend settings that endanger locks (Redis may evict lock keys), as warnings for the
    /// lock's status and events.
    async fn warnings(&self) -> Result<Vec<String>> {
        Ok(Vec::new())
    }
}

/// What [`Upkeep::provision_one`] saw of the lock's holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Provisioned {
    /// Provisioning did not read the lock's record.
    Unread,
    /// The record as provisioning read or wrote it: its holder, as [`Driver::observe`] would
    /// have answered then.
    Read(Option<Holding>),
}

/// A connected backend: both contracts, as [`crate::connect`] opens it. Hand it to the engine as
/// an `Arc<dyn Driver>`.
pub trait Backend: Driver + Upkeep {}

impl<T: Driver + Upkeep> Backend for T {}

/// Below this many entries, [`Pruned::prune`] keeps them all.
const MIN_PRUNED: usize = 64;

/// What a driver keeps per lock (or per holding), pruned as it grows: keyed locks are named at
/// run time, without bound, so nothing kept for them may stay for good. A map otherwise.
pub(crate) struct Pruned<K, V> {
    entries: std::collections::HashMap<K, V>,
    /// How many entries were left after the last pruning.
    kept: usize,
}

impl<K, V> Default for Pruned<K, V> {
    fn default() -> Self {
        Self {
            entries: std::collections::HashMap::new(),
            kept: 0,
        }
    }
}

impl<K, V> Pruned<K, V> {
    /// Drop the entries `wanted` no longer wants (nobody listens to them, their holding is
    /// over), once the map has doubled since the last look.
    pub(crate) fn prune(&mut self, wanted: impl Fn(&V) -> bool) {
        if self.entries.len() >= MIN_PRUNED && self.entries.len() >= 2 * self.kept {
            self.entries.retain(|_, entry| wanted(entry));
            self.kept = self.entries.len();
        }
    }
}

impl<K, V> std::ops::Deref for Pruned<K, V> {
    type Target = std::collections::HashMap<K, V>;
    fn deref(&self) -> &Self::Target {
        &self.entries
    }
}

impl<K, V> std::ops::DerefMut for Pruned<K, V> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.entries
    }
}

/// Per-lock change counters, for drivers that learn of releases (from the backend, or from
/// another holder in the same process) and wake local waiters through [`Driver::changes`].
#[derive(Default)]
pub struct ChangeFeeds {
    feeds: std::sync::Mutex<Pruned<String, watch::Sender<u64>>>,
}

impl ChangeFeeds {
    pub fn subscribe(&self, lock: &str) -> watch::Receiver<u64> {
        let mut feeds = self.feeds.lock().unwrap_or_else(|e| e.into_inner());
        feeds.prune(|tx| tx.receiver_count() > 0);
        feeds
            .entry(lock.to_owned())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    /// The locks with a waiter subscribed now, among those `wanted`.
    pub fn subscribed(&self, wanted: impl Fn(&str) -> bool) -> Vec<String> {
        let feeds = self.feeds.lock().unwrap_or_else(|e| e.into_inner());
        feeds
            .iter()
            .filter(|(lock, tx)| tx.receiver_count() > 0 && wanted(lock))
            .map(|(lock, _)| lock.clone())
            .collect()
    }

    /// Whether a waiter is subscribed to `lock` now.
    pub fn is_subscribed(&self, lock: &str) -> bool {
        let feeds = self.feeds.lock().unwrap_or_else(|e| e.into_inner());
        feeds.get(lock).is_some_and(|tx| tx.receiver_count() > 0)
    }

    /// How many feeds are kept (for tests of the pruning).
    pub fn len(&self) -> usize {
        self.feeds.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Wake the waiters of one lock.
    pub fn bump(&self, lock: &str) {
        let feeds = self.feeds.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = feeds.get(lock) {
            tx.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Wake every waiter: after a reconnect, releases may have been missed.
    pub fn bump_all(&self) {
        let feeds = self.feeds.lock().unwrap_or_else(|e| e.into_inner());
        for tx in feeds.values() {
            tx.send_modify(|n| *n = n.wrapping_add(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feeds_nobody_listens_to_are_pruned() {
        let feeds = ChangeFeeds::default();
        let kept = feeds.subscribe("kept");
        for i in 0..1000 {
            drop(feeds.subscribe(&format!("gone-{i}")));
        }
        assert!(feeds.len() <= 64, "{} feeds kept", feeds.len());
        assert_eq!(feeds.subscribed(|_| true), vec!["kept".to_owned()]);
        feeds.bump("kept");
        assert!(kept.has_changed().unwrap(), "the live feed still wakes");
    }
}
