//! `--exit-with-pod` against the in-memory Kubernetes API: the sidecar's wait ends when the
//! Job's containers have finished, and not before.

use std::time::Duration;

use leasehold_sidecar::pod_exit;
use leasehold_testkit::InMemoryApiServer;
use serde_json::{Value, json};

const PODS: &str = "/api/v1/pods";

fn job_pod(app_state: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "report-28c4x", "namespace": "reports"},
        "spec": {"restartPolicy": "Never",
                 "containers": [{"name": "app"}, {"name": "leasehold-sidecar"}]},
        "status": {"containerStatuses": [
            {"name": "app", "state": app_state, "ready": false, "restartCount": 0,
             "image": "app", "imageID": ""},
            {"name": "leasehold-sidecar", "state": {"running": {}}, "ready": true,
             "restartCount": 0, "image": "leasehold", "imageID": ""},
        ]},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_ends_when_the_jobs_containers_have_finished() {
    let api = InMemoryApiServer::new();
    api.put(PODS, job_pod(json!({"running": {}})));
    let mut wait = tokio::spawn({
        let client = api.client();
        async move { pod_exit::wait(client, "reports", "report-28c4x", "leasehold-sidecar").await }
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut wait)
            .await
            .is_err(),
        "the wait ended while the app was running"
    );
    api.put(PODS, job_pod(json!({"terminated": {"exitCode": 0}})));
    tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("the wait did not end when the app had finished")
        .unwrap();
}
