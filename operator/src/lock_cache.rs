//! The webhook's copy of the DistributedLocks: a watch of each watched scope keeps them in
//! memory, so that a pod's admission finds its locks with no API request. Every replica keeps
//! its own (every replica serves the webhook; only the leader runs the controller). A lock the
//! copy does not have (created a moment ago, or the watch still starting or failing) is read
//! from the API server instead, so a miss costs a request, never a wrong answer.

use std::sync::Arc;

use futures_util::StreamExt;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use leasehold_crds::DistributedLock;

use crate::config::{Watched, api_in};

/// Cheap to clone: clones share the stores.
#[derive(Clone, Default)]
pub struct LockCache {
    stores: Arc<Vec<Store<DistributedLock>>>,
}

/// Admission reads a lock's name and spec alone: its managed fields, annotations (a `kubectl
/// apply`'s copy of the whole object among them) and status, most of what a lock weighs, are
/// not kept on every replica.
fn keep_what_admission_reads(lock: &mut DistributedLock) {
    lock.metadata.managed_fields = None;
    lock.metadata.annotations = None;
    lock.status = None;
}

impl LockCache {
    /// No copy: every look-up goes to the API server.
    pub fn none() -> Self {
        Self::default()
    }

    /// Watch the locks of each scope of `watched` for as long as the process runs (a failing
    /// watch starts again with backoff).
    pub fn start(client: &kube::Client, watched: &Watched) -> Self {
        let stores = watched
            .scopes()
            .into_iter()
            .map(|scope| {
                let (store, writer) = reflector::store();
                let locks = api_in::<DistributedLock>(client, scope);
                let stream = reflector::reflector(
                    writer,
                    watcher(locks, watcher::Config::default().any_semantic())
                        .default_backoff()
                        .modify(keep_what_admission_reads),
                );
                tokio::spawn(stream.for_each(|_| async {}));
                store
            })
            .collect();
        Self {
            stores: Arc::new(stores),
        }
    }

    /// The lock `namespace/name` as the watch last saw it, if it has it.
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<DistributedLock>> {
        let key = ObjectRef::new(name).within(namespace);
        self.stores.iter().find_map(|store| store.get(&key))
    }
}
