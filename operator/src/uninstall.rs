//! `leasehold-operator --release-finalizers`, the chart's pre-delete hook: once the operator is
//! uninstalled nobody would remove its finalizer, and every lock (and then its namespace, and
//! the CRD) would stay `Terminating` when deleted. This removes the finalizer from every lock and
//! keeps each lock's records, as `cleanupPolicy: Retain` would: a Kubernetes-backed lock's Lease
//! is cut loose first, so the garbage collector does not delete it with its lock.
//!
//! Helm runs the hook while the operator still runs, and a running operator adds its finalizer
//! back to every lock at once; so the hook first scales the operator's Deployment to zero and
//! waits until none of its pods is left ([`stop_operator`]).

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use leasehold_crds::DistributedLock;
use serde_json::json;

use crate::backends::Backends;
use crate::config::Watched;
use crate::reconcile::FINALIZER;

/// The operator's Deployment, and the labels of its pods.
#[derive(Clone, Debug)]
pub struct OperatorDeployment {
    pub namespace: String,
    pub name: String,
    /// A label selector of the Deployment's pods, e.g. `app.kubernetes.io/name=leasehold-operator`.
    pub pods: String,
}

/// How often [`stop_operator`] looks for pods still running.
const POD_POLL: Duration = Duration::from_millis(500);

/// On the operator's Deployment while the hook has it scaled to zero: its replicas before, so
/// that a hook that fails scales it back (a retry of the hook, which finds zero, reads them
/// here).
pub const REPLICAS_BEFORE: &str = "leasehold.dev/replicas-before-uninstall";

/// Scale the operator's Deployment to zero and wait until none of its pods is left, at most
/// `patience`: a pod that is gone reconciles no more. A Deployment already deleted only waits
/// for its pods. Should its pods not go within `patience`, the Deployment is scaled back
/// ([`start_operator_again`]): left at zero, the webhook (which fails closed) would refuse the
/// pods it injects, and no lock would be reconciled, until someone noticed.
pub async fn stop_operator(
    client: &kube::Client,
    deployment: &OperatorDeployment,
    patience: Duration,
) -> Result<(), String> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &deployment.namespace);
    let before = match deployments.get_opt(&deployment.name).await {
        Ok(found) => found.map(|d| replicas_before(&d)),
        Err(e) => {
            return Err(format!(
                "cannot read the operator's Deployment {}/{}: {e}",
                deployment.namespace, deployment.name
            ));
        }
    };
    let scale = json!({
        "metadata": {"annotations": {REPLICAS_BEFORE: before.unwrap_or(1).to_string()}},
        "spec": {"replicas": 0},
    });
    match deployments
        .patch(
            &deployment.name,
            &PatchParams::default(),
            &Patch::Merge(&scale),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => {}
        // It may have been applied all the same (an answer lost).
        Err(e) => {
            let failed = format!(
                "cannot scale the operator's Deployment {}/{} to zero: {e}",
                deployment.namespace, deployment.name
            );
            return Err(scaled_back(client, deployment, failed).await);
        }
    }
    let started = Instant::now();
    loop {
        let running = match running_pods(client, deployment).await {
            Ok(running) => running,
            Err(e) => return Err(scaled_back(client, deployment, e).await),
        };
        if running.is_empty() {
            tracing::info!(deployment = %deployment.name, "the operator is stopped");
            return Ok(());
        }
        if started.elapsed() >= patience {
            let stuck = format!(
                "the operator's pods are still running after {patience:?} ({}); a running \
                 operator would add its finalizer back, so none was released",
                running.join(", "),
            );
            return Err(scaled_back(
                client,
                deployment,
                format!("{stuck}; find what keeps its pods"),
            )
            .await);
        }
        tokio::time::sleep(POD_POLL).await;
    }
}

/// The hook as the chart runs it: stop the operator (when its Deployment is named), release
/// every watched lock's finalizer, and check that nothing started the operator again meanwhile
/// (a GitOps tool's drift correction, a person: it would have added the finalizers back). The
/// names of the locks released. Should any step fail after the operator was stopped, it is
/// scaled back ([`start_operator_again`]) and the error says so: the uninstall may be tried
/// again.
pub async fn release_every_finalizer(
    client: &kube::Client,
    deployment: Option<&OperatorDeployment>,
    watched: &Watched,
    patience: Duration,
) -> Result<Vec<String>, String> {
    let Some(deployment) = deployment else {
        return release_finalizers(client, watched).await;
    };
    stop_operator(client, deployment, patience).await?;
    let released = match release_finalizers(client, watched).await {
        Ok(released) => released,
        Err(e) => return Err(scaled_back(client, deployment, e).await),
    };
    match running_pods(client, deployment).await {
        Ok(running) if running.is_empty() => Ok(released),
        Ok(running) => Err(format!(
            "the operator was started again while the finalizers were released ({}): stop \
             whatever scales deployment/{} up, then uninstall again",
            running.join(", "),
            deployment.name
        )),
        Err(e) => Err(scaled_back(client, deployment, e).await),
    }
}

/// `failed`, after the operator is scaled back up (or why it could not be).
pub async fn scaled_back(
    client: &kube::Client,
    deployment: &OperatorDeployment,
    failed: String,
) -> String {
    match start_operator_again(client, deployment).await {
        Ok(()) => format!("{failed}. The operator is scaled back up"),
        Err(e) => format!("{failed}. {e}"),
    }
}

/// The replicas a Deployment had before the hook scaled it to zero: its own count, or at zero
/// the count an earlier run of the hook noted ([`REPLICAS_BEFORE`]).
fn replicas_before(deployment: &Deployment) -> i32 {
    let replicas = deployment
        .spec
        .as_ref()
        .and_then(|spec| spec.replicas)
        .unwrap_or(1);
    let noted = deployment
        .annotations()
        .get(REPLICAS_BEFORE)
        .and_then(|n| n.parse::<i32>().ok());
    match (replicas, noted) {
        (0, Some(noted)) => noted,
        _ => replicas,
    }
}

/// Scale the operator's Deployment back to the replicas it had before [`stop_operator`], after
/// the hook failed: it serves the webhook and reconciles again, and the uninstall may be
/// tried again. A Deployment the hook did not scale is left alone.
pub async fn start_operator_again(
    client: &kube::Client,
    deployment: &OperatorDeployment,
) -> Result<(), String> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &deployment.namespace);
    let found = deployments.get_opt(&deployment.name).await;
    let cannot = |e: &dyn std::fmt::Display| {
        format!(
            "cannot scale the operator back up ({e}): kubectl scale deployment/{} -n {} \
             --replicas=2",
            deployment.name, deployment.namespace
        )
    };
    let Some(found) = found.map_err(|e| cannot(&e))? else {
        return Ok(());
    };
    if !found.annotations().contains_key(REPLICAS_BEFORE) {
        return Ok(());
    }
    let scale = json!({
        "metadata": {"annotations": {REPLICAS_BEFORE: null}},
        "spec": {"replicas": replicas_before(&found)},
    });
    deployments
        .patch(
            &deployment.name,
            &PatchParams::default(),
            &Patch::Merge(&scale),
        )
        .await
        .map_err(|e| cannot(&e))?;
    tracing::info!(deployment = %deployment.name, "the operator is scaled back up");
    Ok(())
}

/// The operator's pods that may still run: all but those that ended (`Succeeded`, `Failed`:
/// an evicted pod stays listed until it is cleaned up).
pub async fn running_pods(
    client: &kube::Client,
    deployment: &OperatorDeployment,
) -> Result<Vec<String>, String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &deployment.namespace);
    let listed = pods
        .list(&ListParams::default().labels(&deployment.pods))
        .await
        .map_err(|e| format!("cannot list the operator's pods: {e}"))?;
    Ok(listed
        .items
        .iter()
        .filter(|pod| {
            !matches!(
                pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
        })
        .map(|pod| pod.name_any())
        .collect())
}

/// Release the finalizer of every watched lock; the names of the locks released.
pub async fn release_finalizers(
    client: &kube::Client,
    watched: &Watched,
) -> Result<Vec<String>, String> {
    let mut locks = Vec::new();
    for api in watched.apis::<DistributedLock>(client) {
        let listed = api
            .list(&ListParams::default())
            .await
            .map_err(|e| format!("cannot list DistributedLocks: {e}"))?;
        locks.extend(listed);
    }
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
