//! `spec.holderLabel`: the pod that holds a lock carries `leasehold.dev/holder: "true"`, every
//! other pod of the lock `"false"`, so that a Service selecting the label routes to the holder
//! only (on a lock of several permits, to each of its holders). Each lock also has a label of
//! its own, `holder.leasehold.dev/LOCK`, which a pod that takes several locks carries instead;
//! a holder takes both off the lock's other pods, so pods of one lock and of several can share
//! a lock. Readiness is left alone: gating it on the lock would keep a rolling update from ever
//! finding a ready new pod.
//!
//! Each sidecar writes its own pod's label: it knows at once when it starts or stops holding
//! (the operator learns of a new holder only at its next read of the backend). A holder first
//! takes the label off every other pod of the lock that still carries it (one that was killed,
//! or lost the API server, cannot take its own off; on a lock of several permits, every other
//! pod the backend names on no permit), then puts it on its own pod, and looks again at each
//! renewal; every write is made only while the lock is still held. A sidecar
//! that stops holding, or stops, takes its own label off first.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};
use leasehold_lease::Lock;
use serde_json::json;
use tokio::sync::watch;

use crate::api::AppState;

/// The label a Service selects to reach the holder, on a pod that takes one lock.
pub const HOLDER_LABEL: &str = "leasehold.dev/holder";
/// The prefix of each lock's label on a pod that takes several: `holder.leasehold.dev/LOCK`.
pub const HOLDER_LABEL_PREFIX: &str = "holder.leasehold.dev/";
/// The prefix of the annotation naming the permit a holder of a lock holds:
/// `permit.holder.leasehold.dev/LOCK`. A holder reads that permit before it takes the label off
/// a pod the permits it knows of do not name: a count lowered before this process started
/// leaves holdings above it that only their own pods know of.
pub const HOLDER_PERMIT_PREFIX: &str = "permit.holder.leasehold.dev/";
/// The longest name part of a label key.
const LABEL_NAME_MAX: usize = 63;
/// The webhook's annotation, naming the locks a pod takes.
const LOCK_ANNOTATION: &str = "leasehold.dev/lock";
/// How often the lock is looked for while it is not running yet, and the most a failed label
/// write waits to be tried again.
const NOT_RUNNING_CHECK: Duration = Duration::from_secs(1);
/// The longest one label write may take when the sidecar stops.
const LAST_WRITE: Duration = Duration::from_secs(2);

/// What this sidecar knows of its own pod's labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnLabels {
    /// Nothing yet: the sidecar has just started.
    Unknown,
    /// Set to `"false"` by this sidecar.
    Off,
    /// Set to `"true"` by this sidecar, and the lock still held when the write was answered.
    On,
    /// A write of `"true"` may have landed while the lock stopped being held (an answer read
    /// after a failed backend call, the claim's end or a release), or its answer was an error:
    /// the pod may carry the label, so it is taken off as [`OwnLabels::On`] would be.
    MaybeOn,
}

impl OwnLabels {
    /// After a take-over that answered whether this pod carries its labels while held.
    fn after_take_over(carried: kube::Result<bool>) -> Self {
        match carried {
            Ok(true) => OwnLabels::On,
            Ok(false) | Err(_) => OwnLabels::MaybeOn,
        }
    }

    /// Whether a sidecar that does not hold (or whose lock's labels are turned off: `on`
    /// false) takes its pod's labels off: those it may have put on, and once after a start
    /// while the lock asks for labels.
    fn to_clear(self, on: bool) -> bool {
        match self {
            OwnLabels::Off => false,
            OwnLabels::Unknown => on,
            OwnLabels::On | OwnLabels::MaybeOn => true,
        }
    }

    /// Whether a sidecar that stops takes its pod's labels off.
    fn to_clear_at_stop(self) -> bool {
        matches!(self, OwnLabels::On | OwnLabels::MaybeOn)
    }
}

/// The labels that say whether a pod holds `lock`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderLabels {
    /// What this pod carries: `holder.leasehold.dev/LOCK` (one label per lock, as one label
    /// cannot name several holdings), and [`HOLDER_LABEL`] too on a pod whose sidecar follows
    /// this one resource alone.
    pub own: Vec<String>,
    /// What a holder takes off the lock's other pods: both, whatever those pods take, so that
    /// pods of one lock and pods of several can share it.
    pub cleared: Vec<String>,
    /// The annotation naming the permit a labelled pod holds ([`HOLDER_PERMIT_PREFIX`]); none
    /// for a lock whose name is longer than an annotation's name part may be.
    pub permit: Option<String>,
}

/// The holder labels of `lock` on a pod whose sidecar follows `resources_in_pod` resources.
/// `Err` says why the pod carries none: it takes several, and the lock's name is longer than a
/// label's name part may be.
pub fn labels_for(lock: &str, resources_in_pod: usize) -> Result<HolderLabels, String> {
    // A lock's name is a DNS subdomain: lowercase letters, digits, '-' and '.', as a label's
    // name part may be, and up to 253 characters, where a label's stops at 63.
    let per_lock = (lock.len() <= LABEL_NAME_MAX).then(|| format!("{HOLDER_LABEL_PREFIX}{lock}"));
    let alone = (resources_in_pod <= 1).then(|| HOLDER_LABEL.to_owned());
    let own: Vec<String> = alone.iter().chain(&per_lock).cloned().collect();
    if own.is_empty() {
        return Err(format!(
            "this pod takes several locks, so each holder label is {HOLDER_LABEL_PREFIX}LOCK, and {lock:?} is longer than the {LABEL_NAME_MAX} characters a label's name may have; none is written"
        ));
    }
    let cleared = std::iter::once(HOLDER_LABEL.to_owned())
        .chain(per_lock)
        .collect();
    let permit = (lock.len() <= LABEL_NAME_MAX).then(|| format!("{HOLDER_PERMIT_PREFIX}{lock}"));
    Ok(HolderLabels {
        own,
        cleared,
        permit,
    })
}

/// Keep pod `pod`'s labels `labels` (in `namespace`) in step with whether this sidecar holds
/// `lock`, while `enabled` says the lock asks for it. Ends when `enabled`'s sender is dropped
/// (the sidecar stops), taking the pod's labels off first if they were on.
pub async fn follow(
    client: kube::Client,
    namespace: String,
    pod: String,
    lock: String,
    labels: HolderLabels,
    state: AppState,
    mut enabled: watch::Receiver<bool>,
) {
    let pods: Api<Pod> = Api::namespaced(client, &namespace);
    let mut labeled = OwnLabels::Unknown;
    loop {
        let on = *enabled.borrow_and_update();
        let running = state.locks().into_iter().find(|l| l.name() == lock);
        // Seen before the answer is read: a change after it wakes the wait below.
        let mut changes = running.as_ref().map(|l| {
            let mut changes = l.watch();
            changes.borrow_and_update();
            changes
        });
        // A running lock's own changes wake the task; otherwise it looks again at each renewal.
        let period = running
            .as_ref()
            .map_or(NOT_RUNNING_CHECK, |l| l.config().renew_interval);
        let holding = running.filter(|l| on && l.answer().is_holder());
        let mut failed = false;
        if let Some(holding) = &holding {
            let carried = take_over(&pods, &pod, &lock, &labels, holding).await;
            if let Err(e) = &carried {
                failed = true;
                tracing::warn!(%lock, %pod, error = %e, "cannot label the pod as the lock's holder; trying again");
            }
            labeled = OwnLabels::after_take_over(carried);
        } else if labeled.to_clear(on) {
            match clear_labels(&pods, &pod, &labels.own).await {
                Ok(()) => labeled = OwnLabels::Off,
                Err(e) => {
                    failed = true;
                    tracing::warn!(%lock, %pod, error = %e, "cannot take the holder label off the pod; trying again");
                }
            }
        }
        // A failed write is tried again after a short pause, whatever wakes the task.
        let period = match failed {
            true => {
                changes = None;
                period.min(NOT_RUNNING_CHECK)
            }
            false => period,
        };
        tokio::select! {
            changed = enabled.changed() => if changed.is_err() {
                // The sidecar stops: its pod no longer serves as the holder.
                if labeled.to_clear_at_stop() {
                    let _ =
                        tokio::time::timeout(LAST_WRITE, clear_labels(&pods, &pod, &labels.own)).await;
                }
                return;
            },
            () = async {
                // A lock that stopped publishes nothing more: the pause below wakes the task.
                let changed = match &mut changes {
                    Some(changes) => changes.changed().await.is_ok(),
                    None => false,
                };
                if !changed {
                    std::future::pending::<()>().await;
                }
            } => {}
            () = tokio::time::sleep(period) => {}
        }
    }
}

/// While this sidecar holds `holding`: take the labels off every other pod of the lock that
/// carries one, then make sure this pod carries its own. Each write is made only while the
/// lock is still held, so a holder that lost it meanwhile labels nobody. Whether this pod
/// carries its labels.
async fn take_over(
    pods: &Api<Pod>,
    own: &str,
    lock: &str,
    labels: &HolderLabels,
    holding: &Lock,
) -> kube::Result<bool> {
    let mut own_labeled: Vec<&str> = Vec::new();
    let mut failed = None;
    // A lock of several permits has a holder per permit: a labelled pod that holds another one
    // keeps its label, and a pod is taken off only when the backend names it on no permit (a
    // read that fails takes nobody's off, rather than a holder's).
    let others_holding: Option<Vec<String>> = match holding.has_had_permits() {
        false => Some(Vec::new()),
        true => match holding.holders().await {
            Ok(holders) => Some(holders.into_iter().map(|h| h.identity).collect()),
            Err(e) => {
                tracing::debug!(%lock, error = %e, "the permits' holders cannot be read; no label is taken off");
                None
            }
        },
    };
    for label in &labels.cleared {
        // A quorum read (no resourceVersion), not the API server's cache: a cached list may
        // miss a pod labelled a moment ago, which would then keep its label beside this one's.
        let labeled = pods
            .list(&ListParams::default().labels(&format!("{label}=true")))
            .await?;
        for other in labeled {
            let Some(name) = other.metadata.name.as_deref() else {
                continue;
            };
            if name == own {
                own_labeled.push(label);
            } else if takes(&other, lock)
                && others_holding
                    .as_ref()
                    .is_some_and(|holders| !holders.iter().any(|h| h == name))
                && !holds_the_permit_it_names(&other, name, labels, holding, lock).await
                && holding.answer().is_holder()
            {
                tracing::info!(%lock, pod = name, %label, "taking the holder label off a pod that no longer holds the lock");
                // One pod that cannot be written must not keep the holder's own label off.
                if let Err(e) = clear_labels(pods, name, std::slice::from_ref(label)).await {
                    failed = Some(e);
                }
            }
        }
    }
    let carried = labels.own.iter().all(|l| own_labeled.contains(&l.as_str()));
    if !carried && let Some((permit, _)) = holding.answer().holding() {
        let annotation = labels.permit.as_ref().map(|key| (key, permit));
        set_holder_labels(pods, own, &labels.own, annotation).await?;
        tracing::info!(%lock, pod = own, "labelled the pod as the lock's holder");
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(carried || holding.answer().is_holder()),
    }
}

/// Whether the backend names `pod` (called `name`) on the permit its annotation says it holds,
/// above the permits this process reads: its label stays. A read that fails keeps it too,
/// rather than take a holder's off.
async fn holds_the_permit_it_names(
    pod: &Pod,
    name: &str,
    labels: &HolderLabels,
    holding: &Lock,
    lock: &str,
) -> bool {
    let Some(permit) = labels
        .permit
        .as_ref()
        .and_then(|key| pod.metadata.annotations.as_ref()?.get(key))
        .and_then(|value| value.parse::<u32>().ok())
        .filter(|&permit| permit > 0)
    else {
        return false;
    };
    match holding.permit_holder(permit).await {
        Ok(holder) => holder.is_some_and(|h| h.identity == name),
        Err(e) => {
            tracing::debug!(%lock, pod = name, permit, error = %e, "the permit a labelled pod names cannot be read; its label stays");
            true
        }
    }
}

/// Whether `pod` takes `lock` (its annotation names it).
fn takes(pod: &Pod, lock: &str) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(LOCK_ANNOTATION))
        .is_some_and(|names| names.split(',').any(|n| n.trim() == lock))
}

/// Label this process's pod `pod` as a holder, and name the permit it holds in `annotation`.
async fn set_holder_labels(
    pods: &Api<Pod>,
    pod: &str,
    labels: &[String],
    annotation: Option<(&String, u32)>,
) -> kube::Result<()> {
    let labels: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|label| (label.clone(), "true".into()))
        .collect();
    let annotations: serde_json::Map<String, serde_json::Value> = annotation
        .into_iter()
        .map(|(key, permit)| (key.clone(), permit.to_string().into()))
        .collect();
    let patch = json!({"metadata": {"labels": &labels, "annotations": annotations}});
    match merge(pods, pod, &patch).await {
        // An admission policy of an older chart refuses the annotation: the labels alone.
        Err(kube::Error::Api(refused)) if refused.code == 422 && annotation.is_some() => {
            tracing::debug!(pod, error = %refused, "the permit's annotation was refused; labelling without it");
            merge(pods, pod, &json!({"metadata": {"labels": labels}})).await
        }
        done => done,
    }
}

/// Merge `patch` into pod `pod`.
async fn merge(pods: &Api<Pod>, pod: &str, patch: &serde_json::Value) -> kube::Result<()> {
    pods.patch(pod, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .map(|_| ())
}

/// Say "false" in each of `labels` on pod `pod`.
async fn clear_labels(pods: &Api<Pod>, pod: &str, labels: &[String]) -> kube::Result<()> {
    let labels: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|label| (label.clone(), "false".into()))
        .collect();
    merge(pods, pod, &json!({"metadata": {"labels": labels}})).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(annotation: Option<&str>) -> Pod {
        let mut pod = Pod::default();
        if let Some(value) = annotation {
            pod.metadata.annotations =
                Some([(LOCK_ANNOTATION.to_owned(), value.to_owned())].into());
        }
        pod
    }

    #[test]
    fn labels_a_write_may_have_put_on_are_taken_off_once_the_pod_does_not_hold() {
        let error = || Err(kube::Error::LinesCodecMaxLineLengthExceeded);
        // The lock stopped being held while the pod's label was written: the write may have
        // landed, so the pod takes it off when it no longer holds, and when it stops.
        for labels in [
            OwnLabels::after_take_over(Ok(false)),
            OwnLabels::after_take_over(error()),
        ] {
            assert_eq!(labels, OwnLabels::MaybeOn);
            assert!(labels.to_clear(true) && labels.to_clear(false));
            assert!(labels.to_clear_at_stop());
        }
        let on = OwnLabels::after_take_over(Ok(true));
        assert!(on.to_clear(true) && on.to_clear(false) && on.to_clear_at_stop());
        // Taken off already: nothing more to write.
        assert!(!OwnLabels::Off.to_clear(true) && !OwnLabels::Off.to_clear_at_stop());
        // Just started: labels taken off once where the lock asks for them, and left alone
        // where it does not (a lock that never had them gets no "false" label).
        assert!(OwnLabels::Unknown.to_clear(true));
        assert!(!OwnLabels::Unknown.to_clear(false) && !OwnLabels::Unknown.to_clear_at_stop());
    }

    /// The lock stops being held while the pod's `"true"` label is written: the write lands,
    /// and is answered after the release. The pod, which no longer holds, takes the label off.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_label_written_as_the_lock_stopped_being_held_is_taken_off() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};

        use leasehold_lease::{LockConfig, Mode};
        use leasehold_testkit::InMemoryApiServer;
        use tower::ServiceExt;

        const PODS: &str = "/api/v1/pods";
        let dir = tempfile::tempdir().unwrap();
        let mut config = LockConfig::new("jobs", "pod-0", Duration::from_secs(30));
        config.mode = Mode::OnDemand;
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let backend = crate::test_support::sqlite_backend(&dir).await;
        let lock = Lock::start(backend, config, metrics.clone()).unwrap();
        let state = AppState::new(vec![lock.clone()], metrics);
        let api = InMemoryApiServer::new();
        api.put(
            PODS,
            json!({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "pod-0", "namespace": "default",
                                "annotations": {LOCK_ANNOTATION: "jobs"}}}),
        );
        // Every write to a pod goes through; one made while the lock is held is answered only
        // once the lock has been released (a release, or the claim's end, as the write ran).
        let released_during_write = Arc::new(AtomicBool::new(false));
        let service = tower::service_fn({
            let (server, lock, released) =
                (api.clone(), lock.clone(), released_during_write.clone());
            move |request: http::Request<kube::client::Body>| {
                let (server, lock, released) = (server.clone(), lock.clone(), released.clone());
                async move {
                    let write = request.method() == http::Method::PATCH;
                    let answer = server.clone().service().oneshot(request).await;
                    let labelled = server.object(PODS, "default", "pod-0").is_some_and(|pod| {
                        pod["metadata"]["labels"][HOLDER_LABEL].as_str() == Some("true")
                    });
                    if write && labelled && lock.answer().is_holder() {
                        assert!(lock.release().await.unwrap());
                        released.store(true, Ordering::SeqCst);
                    }
                    answer
                }
            }
        });
        let client = kube::Client::new(service, "default");
        let (enabled, following) = watch::channel(true);
        let labels = labels_for("jobs", 1).unwrap();
        let task = tokio::spawn(follow(
            client,
            "default".into(),
            "pod-0".into(),
            "jobs".into(),
            labels,
            state,
            following,
        ));
        let label = || {
            api.object(PODS, "default", "pod-0").and_then(|pod| {
                pod["metadata"]["labels"][HOLDER_LABEL]
                    .as_str()
                    .map(str::to_owned)
            })
        };
        let until = |value: &'static str| async move {
            let start = tokio::time::Instant::now();
            while label().as_deref() != Some(value) {
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "the pod's label is {:?}, not {value:?}",
                    label()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        // Not holding: the label is put to "false" as the sidecar starts.
        until("false").await;
        let held = lock.acquire(Duration::ZERO, Duration::from_secs(60)).await;
        assert!(held.unwrap().is_holder());
        tokio::time::timeout(Duration::from_secs(10), async {
            while !released_during_write.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the holder's label was written, and the lock released before its answer");
        until("false").await;
        drop(enabled);
        task.await.unwrap();
    }

    #[test]
    fn a_lock_has_its_own_label_and_a_pod_of_one_lock_the_plain_one_too() {
        let per_lock = "holder.leasehold.dev/report";
        let alone = labels_for("report", 1).unwrap();
        assert_eq!(alone.own, [HOLDER_LABEL, per_lock]);
        assert_eq!(alone.cleared, [HOLDER_LABEL, per_lock]);
        let several = labels_for("report", 2).unwrap();
        assert_eq!(several.own, [per_lock]);
        assert_eq!(
            several.cleared,
            [HOLDER_LABEL, per_lock],
            "pods of one lock too"
        );
        let longest = "a".repeat(LABEL_NAME_MAX);
        assert_eq!(
            labels_for(&longest, 2).unwrap().own,
            [format!("holder.leasehold.dev/{longest}")]
        );
        let error = labels_for(&format!("{longest}b"), 2).unwrap_err();
        assert!(error.contains("63 characters"), "{error}");
        let too_long = labels_for(&format!("{longest}b"), 1).unwrap();
        assert_eq!(
            (too_long.own, too_long.cleared),
            (vec![HOLDER_LABEL.to_owned()], vec![HOLDER_LABEL.to_owned()])
        );
    }

    #[test]
    fn a_pod_of_the_lock_is_one_whose_annotation_names_it() {
        assert!(takes(&pod(Some("report")), "report"));
        assert!(takes(&pod(Some("jobs, report")), "report"));
        assert!(!takes(&pod(Some("reports")), "report"));
        assert!(!takes(&pod(None), "report"));
    }
}
