//! The injection webhook on AdmissionReview fixtures: the locks are looked up on the in-memory
//! Kubernetes API, the JSON patch is applied to the pod, and the result checked field by field.

use kube::core::admission::AdmissionReview;
use leasehold_lease::testkit::InMemoryApiServer;
use leasehold_lease::testkit::in_memory_api_server::DISTRIBUTED_LOCKS;
use leasehold_operator::webhook::{self, Injection, SIDECAR_NAME};
use serde_json::{Value, json};

const NS: &str = "team";

fn api_with_locks(names: &[&str]) -> InMemoryApiServer {
    let api = InMemoryApiServer::new();
    for name in names {
        api.put(
            DISTRIBUTED_LOCKS,
            json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
                   "metadata": {"name": name, "namespace": NS},
                   "spec": {"backend": {"kubernetes": {}}}}),
        );
    }
    api
}

fn pod(
    annotation: Option<&str>,
    init_containers: Option<Value>,
    extra_container: Option<Value>,
) -> Value {
    let mut containers = vec![json!({"name": "app", "image": "example/app:1"})];
    containers.extend(extra_container);
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "app-7d9f", "namespace": NS},
        "spec": {"containers": containers}
    });
    if let Some(value) = annotation {
        pod["metadata"]["annotations"] = json!({"leasehold.dev/lock": value});
    }
    if let Some(init) = init_containers {
        pod["spec"]["initContainers"] = init;
    }
    pod
}

fn admission_review(pod: &Value) -> AdmissionReview<k8s_openapi::api::core::v1::Pod> {
    serde_json::from_value(json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "app-7d9f", "namespace": NS, "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod, "oldObject": null, "dryRun": false, "options": null
        }
    }))
    .unwrap()
}

fn injection(native: bool) -> Injection {
    Injection {
        image: "leasehold/leasehold:0.1.0".into(),
        native_sidecar: native,
    }
}

/// The webhook's answer: allowed, the message, and the pod after its patch.
async fn admit(api: &InMemoryApiServer, pod: &Value, native: bool) -> (bool, String, Value) {
    let answer = webhook::review(&api.client(), &injection(native), admission_review(pod)).await;
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    let response = &answer["response"];
    assert_eq!(
        response["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002",
        "the answer names the request"
    );
    let allowed = response["allowed"].as_bool().unwrap();
    let message = response["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let mut patched = pod.clone();
    if let Some(patch) = response.get("patch") {
        // The API server reads the patch as base64 text.
        let encoded = patch.as_str().expect("the patch is base64 text");
        assert_eq!(response["patchType"], "JSONPatch");
        let bytes = base64_decode(encoded);
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut patched, &patch).expect("the patch applies to the pod");
    }
    (allowed, message, patched)
}

fn base64_decode(text: &str) -> Vec<u8> {
    // k8s-openapi's ByteString decodes standard base64 from JSON.
    serde_json::from_value::<k8s_openapi::ByteString>(json!(text))
        .unwrap()
        .0
}

fn sidecars(pod: &Value, list: &str) -> Vec<Value> {
    pod["spec"][list]
        .as_array()
        .map(|c| {
            c.iter()
                .filter(|c| c["name"] == SIDECAR_NAME)
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn an_annotated_pod_gets_a_native_sidecar() {
    let api = api_with_locks(&["jobs"]);
    let (allowed, _, patched) = admit(&api, &pod(Some("jobs"), None, None), true).await;
    assert!(allowed);
    let injected = sidecars(&patched, "initContainers");
    assert_eq!(injected.len(), 1);
    assert_eq!(
        patched["metadata"]["labels"][webhook::INJECTED_LABEL],
        "true",
        "labelled for the PodMonitor"
    );
    let c = &injected[0];
    assert_eq!(c["restartPolicy"], "Always");
    assert_eq!(c["image"], "leasehold/leasehold:0.1.0");
    assert_eq!(
        c["args"],
        json!([
            "--resource",
            "team/jobs",
            "--probe-listen",
            "0.0.0.0:4041",
            "--log-format",
            "json"
        ])
    );
    assert_eq!(c["env"][0]["name"], "LEASEHOLD_IDENTITY");
    assert_eq!(
        c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(c["ports"][0]["containerPort"], 4041);
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    // The app starts after the lock API answers.
    assert_eq!(c["startupProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["startupProbe"]["httpGet"]["port"], 4041);
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], 4041);
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(
        c["lifecycle"]["preStop"]["exec"]["command"],
        json!(["/leasehold-sidecar", "--resign"])
    );
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(c["resources"]["requests"]["memory"], "16Mi");
    assert_eq!(c["resources"]["limits"]["memory"], "64Mi");
    // The app is untouched.
    assert_eq!(
        patched["spec"]["containers"],
        pod(None, None, None)["spec"]["containers"]
    );
}

#[tokio::test]
async fn existing_init_containers_are_kept_and_the_sidecar_appended() {
    let api = api_with_locks(&["jobs"]);
    let init = json!([{"name": "migrate", "image": "example/migrate:1"}]);
    let (allowed, _, patched) = admit(&api, &pod(Some("jobs"), Some(init), None), true).await;
    assert!(allowed);
    let names: Vec<&str> = patched["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["migrate", SIDECAR_NAME]);
}

#[tokio::test]
async fn without_native_sidecars_a_plain_container_is_added() {
    let api = api_with_locks(&["jobs"]);
    let (allowed, _, patched) = admit(&api, &pod(Some("jobs"), None, None), false).await;
    assert!(allowed);
    let injected = sidecars(&patched, "containers");
    assert_eq!(injected.len(), 1);
    assert!(injected[0].get("restartPolicy").is_none());
    assert!(patched["spec"].get("initContainers").is_none());
}

#[tokio::test]
async fn an_unannotated_pod_is_left_alone() {
    let api = api_with_locks(&["jobs"]);
    let original = pod(None, None, None);
    let (allowed, _, patched) = admit(&api, &original, true).await;
    assert!(allowed);
    assert_eq!(patched, original);
    assert_eq!(
        api.requests(),
        0,
        "no lookup for a pod that asks for nothing"
    );
}

#[tokio::test]
async fn an_injected_pod_is_left_as_it_is() {
    let api = api_with_locks(&["jobs"]);
    let already = json!({"name": SIDECAR_NAME, "image": "leasehold/leasehold:0.0.9"});
    let original = pod(Some("jobs"), Some(json!([already])), None);
    let (allowed, _, patched) = admit(&api, &original, true).await;
    assert!(allowed);
    assert_eq!(patched, original, "injection is idempotent");
}

#[tokio::test]
async fn several_locks_share_one_sidecar() {
    let api = api_with_locks(&["jobs", "reports"]);
    let (allowed, _, patched) = admit(&api, &pod(Some("jobs, reports"), None, None), true).await;
    assert!(allowed);
    let injected = sidecars(&patched, "initContainers");
    assert_eq!(injected.len(), 1);
    assert_eq!(injected[0]["args"][1], "team/jobs,team/reports");
}

#[tokio::test]
async fn a_malformed_annotation_is_denied_with_the_reason() {
    let api = api_with_locks(&["jobs"]);
    for (value, needle) in [
        ("Jobs", "\"Jobs\" is not a DistributedLock name"),
        ("jobs,,reports", "an empty lock name"),
        ("jobs,jobs", "named twice"),
        ("", "an empty lock name"),
    ] {
        let (allowed, message, _) = admit(&api, &pod(Some(value), None, None), true).await;
        assert!(!allowed, "{value:?} was admitted");
        assert!(message.contains(needle), "{value:?}: {message}");
        assert!(message.contains("leasehold.dev/lock"), "{message}");
    }
}

#[tokio::test]
async fn an_unknown_lock_is_denied_by_name() {
    let api = api_with_locks(&["jobs"]);
    let (allowed, message, patched) =
        admit(&api, &pod(Some("jobs,nightly"), None, None), true).await;
    assert!(!allowed);
    assert!(
        message.contains("nightly") && message.contains("namespace team"),
        "{message}"
    );
    assert!(
        !message.contains("jobs,"),
        "only the missing lock is named: {message}"
    );
    assert!(sidecars(&patched, "initContainers").is_empty());
}

/// Most pods carry labels already: the injected label joins them and changes none.
#[tokio::test]
async fn a_labelled_pod_keeps_its_labels_and_gains_the_injected_one() {
    let api = api_with_locks(&["jobs"]);
    let mut labelled = pod(Some("jobs"), None, None);
    labelled["metadata"]["labels"] = json!({"app": "reports", "tier": "batch"});
    let (allowed, _, patched) = admit(&api, &labelled, true).await;
    assert!(allowed);
    assert_eq!(
        patched["metadata"]["labels"],
        json!({"app": "reports", "tier": "batch", "leasehold.dev/injected": "true"})
    );
}

/// Backend-gated readiness is a pod's explicit choice, by annotation; anything but true or false
/// is refused with the reason.
#[tokio::test]
async fn backend_gated_readiness_is_opted_into_by_annotation() {
    let api = api_with_locks(&["jobs"]);
    let args = |patched: &Value| -> Vec<String> {
        sidecars(patched, "initContainers")[0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect()
    };
    let (_, _, plain) = admit(&api, &pod(Some("jobs"), None, None), true).await;
    assert!(!args(&plain).contains(&"--readiness-requires-backend".to_owned()));
    let mut gated = pod(Some("jobs"), None, None);
    gated["metadata"]["annotations"][webhook::READINESS_ANNOTATION] = json!("true");
    let (allowed, _, patched) = admit(&api, &gated, true).await;
    assert!(allowed);
    assert!(args(&patched).contains(&"--readiness-requires-backend".to_owned()));
    gated["metadata"]["annotations"][webhook::READINESS_ANNOTATION] = json!("yes");
    let (allowed, message, _) = admit(&api, &gated, true).await;
    assert!(!allowed);
    assert!(message.contains("readiness-requires-backend"), "{message}");
}
