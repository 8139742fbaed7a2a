//! `leasehold-operator --release-finalizers`, the chart's pre-delete hook: once the operator is
//! uninstalled nobody would remove its finalizer, and every lock (and then its namespace, and
//! the CRD) would stay `Terminating` when deleted. This removes the finalizer from every lock and
//! keeps each lock's records, as `cleanupPolicy: Retain` would: a Kubernetes-backed lock's Lease
//! is cut loose first, so the garbage collector does not delete it with its lock.

use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use leasehold_crds::DistributedLock;
use serde_json::json;

use crate::backends::Backends;
use crate::reconcile::FINALIZER;

/// Release every lock's finalizer (in `namespace`, or all); the names of the locks released.
pub async fn release_finalizers(
    client: &kube::Client,
    namespace: Option<&str>,
) -> Result<Vec<String>, String> {
    let api: Api<DistributedLock> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let locks = api
        .list(&ListParams::default())
        .await
        .map_err(|e| format!("cannot list DistributedLocks: {e}"))?;
    let backends = Backends::default();
    let mut released = Vec::new();
    for lock in locks {
        if !lock.finalizers().iter().any(|f| f == FINALIZER) {
            continue;
        }
        let name = format!(
            "{}/{}",
            lock.namespace().unwrap_or_default(),
            lock.name_any()
        );
        if let Err(e) = backends.disown_lease(client, &lock).await {
            tracing::warn!(lock = %name, error = %e, "its Lease could not be cut loose; the garbage collector may delete it with the lock");
        }
        let others: Vec<&String> = lock
            .finalizers()
            .iter()
            .filter(|f| *f != FINALIZER)
            .collect();
        // With the resourceVersion read: a finalizer added meanwhile is not lost.
        let patch = json!({"metadata": {
            "finalizers": others,
            "resourceVersion": lock.resource_version(),
        }});
        let namespaced: Api<DistributedLock> =
            Api::namespaced(client.clone(), &lock.namespace().unwrap_or_default());
        namespaced
            .patch(
                &lock.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .map_err(|e| format!("cannot release {name}: {e}"))?;
        tracing::info!(lock = %name, "finalizer released; the lock's records are kept");
        released.push(name);
    }
    Ok(released)
}
