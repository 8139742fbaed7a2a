//! `--exit-with-pod`: on clusters without native sidecars the webhook injects the sidecar as a
//! plain container, and a plain container that never exits keeps a Job's pod running for ever.
//! The sidecar watches its own Pod and returns once every other container has finished for
//! good; the caller then steps down and exits like on SIGTERM.

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};

/// Whether every container of `pod` but `own` has finished and will not be restarted: the
/// pod's `restartPolicy` is `Never`, or `OnFailure` and each exited with 0. A pod that
/// restarts its containers (`Always`, a Deployment's) never finishes.
pub fn finished(pod: &Pod, own: &str) -> bool {
    let Some(spec) = &pod.spec else { return false };
    let policy = spec.restart_policy.as_deref().unwrap_or("Always");
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref());
    let mut others = spec.containers.iter().filter(|c| c.name != own).peekable();
    if others.peek().is_none() {
        return false;
    }
    others.all(|container| {
        let terminated = statuses
            .and_then(|all| all.iter().find(|s| s.name == container.name))
            .and_then(|s| s.state.as_ref())
            .and_then(|state| state.terminated.as_ref());
        match (terminated, policy) {
            (Some(_), "Never") => true,
            (Some(t), "OnFailure") => t.exit_code == 0,
            _ => false,
        }
    })
}

/// Resolves once the pod `name` in `namespace` has [`finished`] but for `own`. Watch errors
/// are retried with backoff: the sidecar keeps serving meanwhile.
pub async fn wait(client: kube::Client, namespace: &str, name: &str, own: &str) {
    let api: Api<Pod> = Api::namespaced(client, namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut pods = std::pin::pin!(watcher(api, config).default_backoff().applied_objects());
    while let Some(change) = pods.next().await {
        match change {
            Ok(pod) if finished(&pod, own) => return,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(pod = %name, error = %e, "watching this pod failed; retrying");
            }
        }
    }
    std::future::pending::<()>().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(policy: &str, states: &[(&str, serde_json::Value)]) -> Pod {
        let containers: Vec<_> = ["app", "worker", "leasehold-sidecar"]
            .iter()
            .map(|n| json!({"name": n}))
            .collect();
        let statuses: Vec<_> = states
            .iter()
            .map(|(name, state)| {
                json!({"name": name, "state": state, "ready": false, "restartCount": 0,
                       "image": "i", "imageID": ""})
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": "job-abc"},
            "spec": {"restartPolicy": policy, "containers": containers},
            "status": {"containerStatuses": statuses},
        }))
        .unwrap()
    }

    fn exited(code: i32) -> serde_json::Value {
        json!({"terminated": {"exitCode": code}})
    }

    #[test]
    fn finished_only_when_every_other_container_is_done_for_good() {
        let running = json!({"running": {}});
        let own = "leasehold-sidecar";
        let cases = [
            (
                "Never",
                vec![("app", exited(0)), ("worker", exited(1))],
                true,
            ),
            (
                "Never",
                vec![("app", exited(0)), ("worker", running.clone())],
                false,
            ),
            ("Never", vec![("app", exited(0))], false),
            (
                "OnFailure",
                vec![("app", exited(0)), ("worker", exited(0))],
                true,
            ),
            // A failed container is restarted under OnFailure.
            (
                "OnFailure",
                vec![("app", exited(0)), ("worker", exited(2))],
                false,
            ),
            (
                "Always",
                vec![("app", exited(0)), ("worker", exited(0))],
                false,
            ),
        ];
        for (policy, states, expected) in cases {
            let mut all = states.clone();
            all.push((own, running.clone()));
            assert_eq!(
                finished(&pod(policy, &all), own),
                expected,
                "{policy} {states:?}"
            );
        }
    }
}
