//! The injection webhook on AdmissionReview fixtures: the locks are looked up on the in-memory
//! Kubernetes API, the JSON patch is applied to the pod, and the result checked field by field.

mod support;

use kube::core::admission::AdmissionReview;
use leasehold_operator::config::Watched;
use leasehold_operator::lock_cache::LockCache;
use leasehold_operator::webhook::{self, Injection, SIDECAR_NAME};
use leasehold_testkit::InMemoryApiServer;
use leasehold_testkit::in_memory_api_server::DISTRIBUTED_LOCKS;
use serde_json::{Value, json};

const NS: &str = "team";

/// An API server with `names` as locks in `NS`, which the pods' ServiceAccount (`default`, as
/// the API server sets it when a pod names none) may read.
fn api_with_locks(names: &[&str]) -> InMemoryApiServer {
    let api = InMemoryApiServer::new();
    support::grant_default_account_locks(&api, NS);
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
    leasehold_testkit::with_service_account_token(pod)
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
    Injection::new("leasehold/leasehold:0.1.0", native)
}

/// The webhook's answer: allowed, the message, and the pod after its patch.
async fn admit(api: &InMemoryApiServer, pod: &Value, native: bool) -> (bool, String, Value) {
    admit_with(api, &LockCache::none(), pod, native).await
}

/// [`admit`], finding the pod's locks in `locks` first.
async fn admit_with(
    api: &InMemoryApiServer,
    locks: &LockCache,
    pod: &Value,
    native: bool,
) -> (bool, String, Value) {
    let answer = webhook::review(
        &support::operator_client(api),
        locks,
        &injection(native),
        admission_review(pod),
    )
    .await;
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
            "[::]:4041",
            "--log-format",
            "json",
            "--apps-stop-first"
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
    // A kill by a failed liveness probe would run the preStop hook while the app runs.
    assert!(c.get("livenessProbe").is_none(), "{c}");
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
    assert_eq!(c["imagePullPolicy"], "IfNotPresent");
    // The app is untouched.
    assert_eq!(
        patched["spec"]["containers"],
        pod(None, None, None)["spec"]["containers"]
    );
}

/// The names of a patched pod's init containers, in the order the kubelet starts them.
fn init_container_names(pod: &Value) -> Vec<&str> {
    pod["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect()
}

#[tokio::test]
async fn existing_init_containers_are_kept_and_the_sidecar_appended() {
    let api = api_with_locks(&["jobs"]);
    let init = json!([{"name": "migrate", "image": "example/migrate:1"}]);
    let (allowed, _, patched) = admit(&api, &pod(Some("jobs"), Some(init), None), true).await;
    assert!(allowed);
    let names = init_container_names(&patched);
    assert_eq!(names, ["migrate", SIDECAR_NAME]);
}

/// An init container that takes a lock (a migration run under it) names itself in
/// `leasehold.dev/start-before`: the sidecar starts before it, and its lock API answers by the
/// time that init container runs. A name that is no init container of the pod, or a sidecar
/// injected as a plain container (which starts after every init container), is refused with
/// the reason.
#[tokio::test]
async fn the_sidecar_starts_before_the_init_container_the_pod_names() {
    let api = api_with_locks(&["jobs"]);
    let init = json!([
        {"name": "fetch", "image": "example/fetch:1"},
        {"name": "migrate", "image": "example/migrate:1"}
    ]);
    let named = |value: &str| {
        let mut pod = pod(Some("jobs"), Some(init.clone()), None);
        pod["metadata"]["annotations"][webhook::START_BEFORE_ANNOTATION] = json!(value);
        pod
    };
    let (allowed, message, patched) = admit(&api, &named("migrate"), true).await;
    assert!(allowed, "{message}");
    let names = init_container_names(&patched);
    assert_eq!(names, ["fetch", SIDECAR_NAME, "migrate"]);
    assert_eq!(
        sidecars(&patched, "initContainers")[0]["restartPolicy"],
        "Always"
    );
    // The kubelet signals the sidecar while `migrate` may still run and act on its lock: the
    // leases wait out their last answers rather than go at once.
    let args = args(&patched);
    assert!(
        !args.iter().any(|a| a == "--apps-stop-first"),
        "released at once while an init container may still hold the lock: {args:?}"
    );

    let (allowed, message, _) = admit(&api, &named("migrat"), true).await;
    assert!(!allowed, "a name that is no init container was admitted");
    assert!(
        message.contains(webhook::START_BEFORE_ANNOTATION)
            && message.contains("\"migrat\"")
            && message.contains("\"migrate\""),
        "{message}"
    );
    let (allowed, message, _) = admit(&api, &named("migrate"), false).await;
    assert!(
        !allowed,
        "a plain container cannot start before an init container"
    );
    assert!(message.contains("plain container"), "{message}");
}

/// A pod's own native sidecars, declared before the injected one, are stopped after it and may
/// still act on its answers when it is signalled: there it is not told that the apps have
/// stopped first, and each lease waits out its last answer.
#[tokio::test]
async fn beside_native_sidecars_of_the_pod_leases_wait_out_their_answers_at_the_stop() {
    let api = api_with_locks(&["jobs"]);
    let init = json!([{"name": "worker", "image": "example/worker:1", "restartPolicy": "Always"}]);
    let (allowed, message, patched) = admit(&api, &pod(Some("jobs"), Some(init), None), true).await;
    assert!(allowed, "{message}");
    let injected = sidecars(&patched, "initContainers");
    assert_eq!(injected.len(), 1);
    let args = args(&patched);
    assert!(
        !args.iter().any(|a| a == "--apps-stop-first"),
        "released at once while the pod's own native sidecar may run on: {args:?}"
    );
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
    // A plain container would keep a Job's pod running: it exits with the pod's containers.
    let args = injected[0]["args"].as_array().unwrap();
    let at = args
        .iter()
        .position(|a| a == "--exit-with-pod")
        .expect("--exit-with-pod");
    assert_eq!(args[at + 1], SIDECAR_NAME);
    // Started beside the app, it is stopped while the app may still act on an answer: it
    // releases each lease only once the last answer given has run out.
    assert!(!args.iter().any(|a| a == "--apps-stop-first"), "{args:?}");
    // A native sidecar is stopped by the kubelet once the app has exited: it needs none of
    // that, and releases at once.
    let (_, _, native) = admit(&api, &pod(Some("jobs"), None, None), true).await;
    let native_args = sidecars(&native, "initContainers")[0]["args"].to_string();
    assert!(!native_args.contains("--exit-with-pod"), "{native_args}");
    assert!(
        native_args.contains("\"--apps-stop-first\""),
        "{native_args}"
    );
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

/// Helm and Argo CD create custom resources after Deployments: a pod naming a lock that does
/// not exist yet gets its sidecar, which waits for the lock (503 with the reason until then).
#[tokio::test]
async fn a_lock_not_created_yet_is_injected_all_the_same() {
    let api = api_with_locks(&["jobs"]);
    let (allowed, message, patched) =
        admit(&api, &pod(Some("jobs,nightly"), None, None), true).await;
    assert!(allowed, "{message}");
    let injected = sidecars(&patched, "initContainers");
    assert_eq!(injected.len(), 1);
    assert_eq!(injected[0]["args"][1], "team/jobs,team/nightly");

    // Dapr's API asked for, and the lock that may be a family not there yet: injected too.
    let mut dapr = pod(Some("nightly"), None, None);
    dapr["metadata"]["annotations"]["leasehold.dev/dapr-api"] = json!("true");
    let (allowed, message, _) = admit(&api, &dapr, true).await;
    assert!(allowed, "{message}");
}

/// The webhook's own API errors (here: it may not read locks) do not refuse pods, whatever the
/// failure policy: the sidecar is injected unchecked and reads the lock itself.
#[tokio::test]
async fn a_lock_the_webhook_cannot_look_up_is_injected_unchecked() {
    let api = api_with_locks(&["jobs"]);
    let answer = webhook::review(
        &api.client_as("system:serviceaccount:leasehold-system:nobody"),
        &LockCache::none(),
        &injection(true),
        admission_review(&pod(Some("jobs"), None, None)),
    )
    .await;
    assert!(
        !api.denied().is_empty(),
        "the look-up was refused by RBAC, as the test intends"
    );
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    assert!(answer["response"]["patch"].is_string(), "{answer}");
}

/// An API server slow to answer the webhook's look-ups of the pod's locks (locks not created
/// yet, or the webhook's copy still starting) does not make the webhook miss the API server's
/// deadline for it (`timeoutSeconds: 5`), which would refuse the pod: the look-ups together
/// take a bounded time, and locks not found in it are injected unchecked.
#[tokio::test]
async fn a_slow_look_up_of_the_pods_locks_still_answers_in_time() {
    let api = api_with_locks(&[]);
    let inner = support::operator_client(&api);
    let slow = kube::Client::new(
        tower::service_fn(move |request: http::Request<kube::client::Body>| {
            let inner = inner.clone();
            async move {
                if request.method() == http::Method::GET
                    && request.uri().path().contains("/distributedlocks/")
                {
                    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
                }
                inner.send(request).await
            }
        }),
        "default",
    );
    let started = std::time::Instant::now();
    let answer = webhook::review(
        &slow,
        &LockCache::none(),
        &injection(true),
        admission_review(&pod(Some("jobs,nightly"), None, None)),
    )
    .await;
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(4),
        "the webhook answered after {took:?}, past the API server's deadline for it"
    );
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    assert!(answer["response"]["patch"].is_string(), "{answer}");
}

/// A pod's locks come from the webhook's watch-fed copy: once it has them, admitting pods reads
/// no lock from the API server, and a lock created later reaches the copy through the watch.
#[tokio::test]
async fn the_webhook_finds_locks_in_its_watch_fed_copy() {
    let api = api_with_locks(&["jobs"]);
    let locks = LockCache::start(&support::operator_client(&api), &Watched::AllNamespaces);
    let seen = async |name: &str| {
        for _ in 0..500 {
            if locks.get(NS, name).is_some() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("the watch never brought {name}");
    };
    seen("jobs").await;
    let reads = || {
        api.requests_by_kind()
            .get("GET distributedlocks")
            .copied()
            .unwrap_or(0)
    };
    let before = reads();
    for _ in 0..5 {
        let (allowed, message, patched) =
            admit_with(&api, &locks, &pod(Some("jobs"), None, None), true).await;
        assert!(allowed, "{message}");
        assert_eq!(sidecars(&patched, "initContainers").len(), 1);
    }
    assert_eq!(reads(), before, "an admission read a lock the copy had");

    // Created after the watch started: in the copy, and refused from it (SQLite).
    api.put(
        DISTRIBUTED_LOCKS,
        json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
               "metadata": {"name": "local", "namespace": NS},
               "spec": {"backend": {"sqlite": {"path": "/data/l.db"}}}}),
    );
    seen("local").await;
    let before = reads();
    let (allowed, message, _) =
        admit_with(&api, &locks, &pod(Some("local"), None, None), true).await;
    assert!(!allowed && message.contains("SQLite"), "{message}");
    assert_eq!(reads(), before);

    // Not in the copy: read from the API server.
    let (allowed, _, _) = admit_with(&api, &locks, &pod(Some("later"), None, None), true).await;
    assert!(allowed);
    assert_eq!(reads(), before + 1, "a lock the copy lacks is read");
}

/// A pod whose ServiceAccount may not read its lock would get a sidecar that can only answer
/// 503: refused with what to grant, asked of the API server (a SubjectAccessReview) so that
/// every binding counts, a group's among them.
#[tokio::test]
async fn a_pod_whose_service_account_may_not_read_its_lock_is_refused_with_the_reason() {
    let api = api_with_locks(&["jobs", "nightly"]);
    let mut other = pod(Some("jobs"), None, None);
    other["spec"]["serviceAccountName"] = json!("reporter");
    let (allowed, message, _) = admit(&api, &other, true).await;
    assert!(!allowed, "admitted a pod that may not read its lock");
    assert!(
        message.contains(
            "ServiceAccount team/reporter may not list and watch DistributedLock team/jobs"
        ) && message.contains("sidecar-rbac"),
        "{message}"
    );

    // May read one lock of two: refused, naming the other.
    support::grant_on_locks(
        &api,
        "system:serviceaccount:team:reporter",
        NS,
        &["jobs"],
        &["get", "list", "watch"],
    );
    let (allowed, _, _) = admit(&api, &other, true).await;
    assert!(allowed, "the granted lock is readable");
    other["metadata"]["annotations"]["leasehold.dev/lock"] = json!("jobs,nightly");
    let (allowed, message, _) = admit(&api, &other, true).await;
    assert!(!allowed && message.contains("team/nightly"), "{message}");

    // `get` alone is not what the sidecar does (it lists and watches by name): refused.
    support::grant_on_locks(&api, "system:serviceaccounts:team", NS, &[], &["get"]);
    let (allowed, message, _) = admit(&api, &other, true).await;
    assert!(
        !allowed && message.contains("may not list and watch DistributedLock team/nightly"),
        "{message}"
    );

    // Granted to every ServiceAccount of the namespace, by group.
    support::grant_on_locks(
        &api,
        "system:serviceaccounts:team",
        NS,
        &[],
        &["list", "watch"],
    );
    let (allowed, message, patched) = admit(&api, &other, true).await;
    assert!(allowed, "{message}");
    assert_eq!(sidecars(&patched, "initContainers").len(), 1);
}

/// Injected as a plain container (clusters without native sidecars), the sidecar exits with a
/// pod that finishes (a Job's) by watching the pod: a pod whose ServiceAccount may not list and
/// watch pods would never complete, so it is refused with what to grant. A pod that never
/// finishes, or one with a native sidecar, needs no such right.
#[tokio::test]
async fn a_finishing_pod_whose_plain_sidecar_may_not_watch_it_is_refused_with_the_reason() {
    let api = api_with_locks(&["jobs"]);
    let mut job = pod(Some("jobs"), None, None);
    job["spec"]["restartPolicy"] = json!("Never");
    let (allowed, message, _) = admit(&api, &job, false).await;
    assert!(
        !allowed
            && message.contains("ServiceAccount team/default may not list and watch pods in team"),
        "{message}"
    );
    job["spec"]["restartPolicy"] = json!("OnFailure");
    let (allowed, _, _) = admit(&api, &job, false).await;
    assert!(
        !allowed,
        "admitted a finishing pod its sidecar cannot watch"
    );
    let (allowed, message, _) = admit(&api, &job, true).await;
    assert!(
        allowed,
        "a native sidecar is stopped by the kubelet: {message}"
    );
    let (allowed, message, _) = admit(&api, &pod(Some("jobs"), None, None), false).await;
    assert!(allowed, "a pod that never finishes: {message}");

    let lock_rule = json!({"apiGroups": ["leasehold.dev"], "resources": ["distributedlocks"],
                           "verbs": ["get", "list", "watch"]});
    let pods_rule = json!({"apiGroups": [""], "resources": ["pods"],
                           "verbs": ["get", "list", "watch"]});
    let grant = |rules: Vec<Value>| {
        api.grant(
            "system:serviceaccount:team:default",
            rules
                .into_iter()
                .map(|rule| leasehold_testkit::in_memory_api_server::Grant {
                    namespace: Some(NS.into()),
                    rule,
                })
                .collect(),
        )
    };
    grant(vec![lock_rule.clone(), pods_rule.clone()]);
    let (allowed, message, patched) = admit(&api, &job, false).await;
    assert!(allowed, "{message}");
    assert_eq!(sidecars(&patched, "containers").len(), 1);
    // Neither: the lock is named first.
    grant(vec![]);
    let (allowed, message, _) = admit(&api, &job, false).await;
    assert!(
        !allowed && message.contains("DistributedLock team/jobs"),
        "{message}"
    );
}

/// A pod that turns its service account token off keeps it from its app: the sidecar, which
/// reads its lock with the token, gets one of its own (a projected volume mounted in the sidecar
/// alone), and the app still has none.
#[tokio::test]
async fn a_pod_that_turns_its_token_off_gets_one_for_the_sidecar_alone() {
    let api = api_with_locks(&["jobs"]);
    let mut tokenless = pod(Some("jobs"), None, None);
    tokenless["spec"]["automountServiceAccountToken"] = json!(false);
    let (allowed, message, patched) = admit(&api, &tokenless, true).await;
    assert!(allowed, "{message}");
    assert_own_token(&patched);

    // The pod's own volume of that name is not replaced: refused with the reason.
    tokenless["spec"]["volumes"] = json!([{"name": webhook::TOKEN_VOLUME, "emptyDir": {}}]);
    let (allowed, message, _) = admit(&api, &tokenless, true).await;
    assert!(
        !allowed && message.contains("rename that volume"),
        "{message}"
    );

    // A pod that gets the API server's token mount (as `pod` has it) leaves it to the sidecar.
    let mounted = pod(Some("jobs"), None, None);
    let (allowed, message, patched) = admit(&api, &mounted, true).await;
    assert!(allowed, "{message}");
    let sidecar = &sidecars(&patched, "initContainers")[0];
    assert!(sidecar["volumeMounts"].is_null(), "{sidecar}");
    assert!(
        !patched["spec"]["volumes"]
            .to_string()
            .contains(webhook::TOKEN_VOLUME)
    );
}

/// The sidecar of `patched` reads its own projected token, the app none.
fn assert_own_token(patched: &Value) {
    let sidecar = &sidecars(patched, "initContainers")[0];
    assert_eq!(
        sidecar["volumeMounts"],
        json!([{"name": webhook::TOKEN_VOLUME, "readOnly": true,
                "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}])
    );
    let volume = patched["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == webhook::TOKEN_VOLUME)
        .expect("the token's volume");
    let sources = volume["projected"]["sources"].to_string();
    for part in [
        "serviceAccountToken",
        "kube-root-ca.crt",
        "metadata.namespace",
    ] {
        assert!(sources.contains(part), "{part} missing: {sources}");
    }
    let app = &patched["spec"]["containers"][0];
    assert!(
        !app["volumeMounts"]
            .to_string()
            .contains(webhook::TOKEN_VOLUME),
        "the app got the sidecar's token: {app}"
    );
}

/// A pod on the node's network would serve its lock API on the node's loopback, to every other
/// pod on the host network and every process of the node: refused with the reason.
#[tokio::test]
async fn a_pod_on_the_host_network_is_refused_with_the_reason() {
    let api = api_with_locks(&["jobs"]);
    let mut hosted = pod(Some("jobs"), None, None);
    hosted["spec"]["hostNetwork"] = json!(true);
    let (allowed, message, _) = admit(&api, &hosted, true).await;
    assert!(!allowed);
    assert!(message.contains("hostNetwork"), "{message}");

    hosted["spec"]["hostNetwork"] = json!(false);
    let (allowed, message, _) = admit(&api, &hosted, true).await;
    assert!(allowed, "{message}");
}

/// An annotation may name a pod's locks, not thousands: one naming more than a pod takes is
/// refused before any lock is looked up, so that a review cannot make the webhook send the API
/// server a request per name.
#[tokio::test]
async fn an_annotation_naming_more_locks_than_a_pod_takes_is_refused_unread() {
    let api = api_with_locks(&["jobs"]);
    let names: Vec<String> = (0..=webhook::MAX_LOCKS_PER_POD)
        .map(|i| format!("lock-{i}"))
        .collect();
    let before = api.requests();
    let (allowed, message, _) = admit(&api, &pod(Some(&names.join(",")), None, None), true).await;
    assert!(!allowed);
    assert!(
        message.contains(&format!("at most {}", webhook::MAX_LOCKS_PER_POD)),
        "{message}"
    );
    assert_eq!(api.requests(), before, "locks were looked up");
    let (allowed, message, _) =
        admit(&api, &pod(Some(&names[1..].join(",")), None, None), true).await;
    assert!(allowed, "{message}");
}

/// A pod whose ServiceAccount turns the token off (and that does not turn it on itself) has no
/// token mounted when the webhook sees it: the sidecar gets one of its own, the app none.
#[tokio::test]
async fn a_pod_whose_service_account_gives_no_token_gets_one_for_the_sidecar_alone() {
    let api = api_with_locks(&["jobs"]);
    let mut unmounted = pod(Some("jobs"), None, None);
    unmounted["spec"]["containers"][0]
        .as_object_mut()
        .unwrap()
        .remove("volumeMounts");
    unmounted["spec"].as_object_mut().unwrap().remove("volumes");
    let (allowed, message, patched) = admit(&api, &unmounted, true).await;
    assert!(allowed, "{message}");
    assert_own_token(&patched);
    // The token mounted in any container (an init container's counts): the API server's
    // ServiceAccount admission mounts it into the sidecar too.
    let init = json!([{"name": "setup", "image": "example/setup:1", "volumeMounts": [
        {"name": "kube-api-access-x7k2p", "readOnly": true,
         "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]}]);
    unmounted["spec"]["initContainers"] = init;
    let (allowed, message, patched) = admit(&api, &unmounted, true).await;
    assert!(allowed, "{message}");
    assert!(sidecars(&patched, "initContainers")[0]["volumeMounts"].is_null());
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

/// The arguments of the sidecar a patch injects as a native sidecar.
fn args(patched: &Value) -> Vec<String> {
    sidecars(patched, "initContainers")[0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

/// Backend-gated readiness is a pod's explicit choice, by annotation; anything but true or false
/// is refused with the reason.
#[tokio::test]
async fn backend_gated_readiness_is_opted_into_by_annotation() {
    let api = api_with_locks(&["jobs"]);
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

/// A pod names its app's health endpoint by annotation; its sidecar steps down while the app
/// fails it: `PORT/PATH` of an HTTP endpoint, or an HTTPS, TCP or gRPC one by its kind. Anything
/// else is refused with the reason.
#[tokio::test]
async fn the_apps_health_endpoint_is_named_by_annotation() {
    let api = api_with_locks(&["jobs"]);
    let (_, _, plain) = admit(&api, &pod(Some("jobs"), None, None), true).await;
    assert!(!args(&plain).contains(&"--app-health".to_owned()));
    let mut probed = pod(Some("jobs"), None, None);
    for (value, url) in [
        ("8080/healthz", "http://127.0.0.1:8080/healthz"),
        ("9000", "http://127.0.0.1:9000/"),
        ("https:8443/healthz", "https://127.0.0.1:8443/healthz"),
        ("https:8443", "https://127.0.0.1:8443/"),
        ("tcp:5432", "tcp://127.0.0.1:5432"),
        ("grpc:9090", "grpc://127.0.0.1:9090"),
        (
            "grpc:9090/shop.v1.Orders",
            "grpc://127.0.0.1:9090/shop.v1.Orders",
        ),
    ] {
        probed["metadata"]["annotations"][webhook::APP_HEALTH_ANNOTATION] = json!(value);
        let (allowed, message, patched) = admit(&api, &probed, true).await;
        assert!(allowed, "{message}");
        let args = args(&patched);
        let at = args
            .iter()
            .position(|a| a == "--app-health")
            .expect("--app-health");
        assert_eq!(args[at + 1], url);
    }
    for bad in [
        "healthz",
        "http://127.0.0.1:8080/healthz",
        "70000/x",
        "8080/a b",
        "ftp:8080",
        "tcp:5432/healthz",
        "grpc:9090/a/b",
        "https:",
    ] {
        probed["metadata"]["annotations"][webhook::APP_HEALTH_ANNOTATION] = json!(bad);
        let (allowed, message, _) = admit(&api, &probed, true).await;
        assert!(!allowed, "{bad}");
        assert!(message.contains("PORT/PATH"), "{message}");
    }
}

/// A pod whose app listens on 4040 or 4041 (Spark's UI) moves the sidecar's ports by
/// annotation: the lock API through `LEASEHOLD_LISTEN` (which the preStop `--resign` reads
/// too), the probes with their port. Anything but two distinct ports, clear of Dapr's when the
/// pod asks for Dapr's API, is refused with the reason.
#[tokio::test]
async fn the_sidecars_ports_move_by_annotation() {
    let api = api_with_locks(&["jobs"]);
    let (_, _, plain) = admit(&api, &pod(Some("jobs"), None, None), true).await;
    let c = &sidecars(&plain, "initContainers")[0];
    assert_eq!(c["ports"][0]["containerPort"], 4041);
    assert!(
        !c["env"].to_string().contains("LEASEHOLD_LISTEN"),
        "the default port needs no setting: {}",
        c["env"]
    );
    let mut moved = pod(Some("jobs"), None, None);
    moved["metadata"]["annotations"][webhook::PORT_ANNOTATION] = json!("4050");
    moved["metadata"]["annotations"][webhook::PROBE_PORT_ANNOTATION] = json!("4051");
    let (allowed, message, patched) = admit(&api, &moved, true).await;
    assert!(allowed, "{message}");
    let c = &sidecars(&patched, "initContainers")[0];
    assert!(
        c["env"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": "LEASEHOLD_LISTEN", "value": "127.0.0.1:4050"})),
        "{}",
        c["env"]
    );
    let args = args(&patched);
    let at = args.iter().position(|a| a == "--probe-listen").unwrap();
    assert_eq!(args[at + 1], "[::]:4051");
    assert_eq!(c["ports"][0]["containerPort"], 4051);
    for probe in ["startupProbe", "readinessProbe"] {
        assert_eq!(c[probe]["httpGet"]["port"], 4051, "{probe}");
    }
    for (port, probe, dapr, why) in [
        ("0", "4051", "false", "a port number"),
        ("40x0", "4051", "false", "a port number"),
        ("70000", "4051", "false", "a port number"),
        ("4050", "4050", "false", "two ports"),
        ("3500", "4051", "true", "Dapr's"),
    ] {
        let mut bad = pod(Some("jobs"), None, None);
        bad["metadata"]["annotations"][webhook::PORT_ANNOTATION] = json!(port);
        bad["metadata"]["annotations"][webhook::PROBE_PORT_ANNOTATION] = json!(probe);
        bad["metadata"]["annotations"][webhook::DAPR_ANNOTATION] = json!(dapr);
        if dapr == "true" {
            api.put(
                DISTRIBUTED_LOCKS,
                json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
                       "metadata": {"name": "orders", "namespace": NS},
                       "spec": {"backend": {"kubernetes": {}}, "keys": {}}}),
            );
            bad["metadata"]["annotations"][webhook::ANNOTATION] = json!("orders");
        }
        let (allowed, message, _) = admit(&api, &bad, true).await;
        assert!(!allowed, "{port}/{probe}");
        assert!(message.contains(why), "{port}/{probe}: {message}");
    }
}

/// Pod Security's `restricted` profile, as documented
/// (kubernetes.io/docs/concepts/security/pod-security-standards): the checks that a container
/// or a pod can fail, with the pod-level fields that satisfy a container's.
fn restricted_violations(pod: &Value) -> Vec<String> {
    let spec = &pod["spec"];
    let pod_sc = &spec["securityContext"];
    let mut violations = Vec::new();
    for field in ["hostNetwork", "hostPID", "hostIPC"] {
        if spec[field] == true {
            violations.push(format!("pod: {field}"));
        }
    }
    const VOLUMES: [&str; 8] = [
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    ];
    for volume in spec["volumes"].as_array().into_iter().flatten() {
        let kinds: Vec<&String> = volume
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "name")
            .collect();
        if kinds.iter().any(|k| !VOLUMES.contains(&k.as_str())) {
            violations.push(format!("volume {}: {kinds:?}", volume["name"]));
        }
    }
    let containers = ["initContainers", "containers", "ephemeralContainers"]
        .into_iter()
        .flat_map(|list| spec[list].as_array().into_iter().flatten());
    for c in containers {
        let name = c["name"].as_str().unwrap_or("?");
        let sc = &c["securityContext"];
        let either = |field: &str| {
            if sc[field].is_null() {
                &pod_sc[field]
            } else {
                &sc[field]
            }
        };
        if sc["privileged"] == true {
            violations.push(format!("{name}: privileged"));
        }
        if sc["allowPrivilegeEscalation"] != false {
            violations.push(format!("{name}: allowPrivilegeEscalation is not false"));
        }
        if either("runAsNonRoot") != true {
            violations.push(format!("{name}: runAsNonRoot is not true"));
        }
        if either("runAsUser") == 0 {
            violations.push(format!("{name}: runAsUser 0"));
        }
        let seccomp = either("seccompProfile")["type"].as_str().unwrap_or("");
        if !matches!(seccomp, "RuntimeDefault" | "Localhost") {
            violations.push(format!("{name}: seccompProfile {seccomp:?}"));
        }
        let drops = sc["capabilities"]["drop"].as_array();
        if !drops.is_some_and(|d| d.contains(&json!("ALL"))) {
            violations.push(format!("{name}: capabilities do not drop ALL"));
        }
        for added in sc["capabilities"]["add"].as_array().into_iter().flatten() {
            if added != "NET_BIND_SERVICE" {
                violations.push(format!("{name}: adds capability {added}"));
            }
        }
        for port in c["ports"].as_array().into_iter().flatten() {
            if port["hostPort"].as_i64().is_some_and(|p| p != 0) {
                violations.push(format!("{name}: hostPort"));
            }
        }
        if !sc["procMount"].is_null() && sc["procMount"] != "Default" {
            violations.push(format!("{name}: procMount"));
        }
    }
    violations
}

/// A pod that `restricted` admits stays admissible with the sidecar, in both injection modes;
/// the checker itself refuses a pod that leaves the container settings out.
#[tokio::test]
async fn the_injected_pod_meets_pod_security_restricted() {
    let api = api_with_locks(&["jobs"]);
    let mut app = pod(Some("jobs"), None, None);
    app["spec"]["securityContext"] = json!({"runAsNonRoot": true});
    app["spec"]["containers"][0]["securityContext"] = json!({
        "allowPrivilegeEscalation": false,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    });
    assert_eq!(restricted_violations(&app), Vec::<String>::new());
    for native in [true, false] {
        let (allowed, _, patched) = admit(&api, &app, native).await;
        assert!(allowed);
        assert_eq!(
            restricted_violations(&patched),
            Vec::<String>::new(),
            "native sidecar: {native}"
        );
    }
    let bare = pod(Some("jobs"), None, None);
    let violations = restricted_violations(&bare);
    assert!(
        violations.iter().any(|v| v.contains("seccompProfile")),
        "{violations:?}"
    );
}

#[tokio::test]
async fn resources_pull_secrets_and_pull_policy_are_the_operators_settings() {
    let api = api_with_locks(&["jobs"]);
    let mut injection = Injection::new("registry.example/leasehold:0.1.0", true);
    injection.resources = webhook::resources(&webhook::Resources {
        cpu_limit: Some("200m".into()),
        ..webhook::Resources::default()
    });
    injection.image_pull_secrets = vec!["registry-a".into(), "registry-b".into()];
    injection.image_pull_policy = "Always".into();
    let patch = |pod: &Value| {
        let review = admission_review(pod);
        let api = api.clone();
        let injection = injection.clone();
        let pod = pod.clone();
        async move {
            let answer = webhook::review(
                &support::operator_client(&api),
                &LockCache::none(),
                &injection,
                review,
            )
            .await;
            let bytes = base64_decode(answer["response"]["patch"].as_str().unwrap());
            let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
            let mut patched = pod;
            json_patch::patch(&mut patched, &patch).unwrap();
            patched
        }
    };
    let patched = patch(&pod(Some("jobs"), None, None)).await;
    let c = &sidecars(&patched, "initContainers")[0];
    assert_eq!(c["resources"]["limits"]["cpu"], "200m");
    assert_eq!(c["imagePullPolicy"], "Always");
    assert_eq!(c["resources"]["requests"]["cpu"], "10m");
    assert_eq!(c["resources"]["limits"]["memory"], "64Mi");
    assert_eq!(
        patched["spec"]["imagePullSecrets"],
        json!([{"name": "registry-a"}, {"name": "registry-b"}])
    );
    // The pod's own pull secrets stay, and one it already names is not added twice.
    let mut own = pod(Some("jobs"), None, None);
    own["spec"]["imagePullSecrets"] = json!([{"name": "app-registry"}, {"name": "registry-b"}]);
    let patched = patch(&own).await;
    assert_eq!(
        patched["spec"]["imagePullSecrets"],
        json!([{"name": "app-registry"}, {"name": "registry-b"}, {"name": "registry-a"}])
    );
}

#[test]
fn quantities_are_checked_before_they_reach_a_pod() {
    for ok in ["10m", "0.5", "64Mi", "1", "1e3", "2Gi", "100k"] {
        assert!(webhook::is_quantity(ok), "{ok}");
    }
    for bad in ["", "ten", "64MB", "1.2.3", "-1", "m", "1e", "64 Mi"] {
        assert!(!webhook::is_quantity(bad), "{bad}");
    }
}

/// A SQLite file is on one machine: a pod must not get a sidecar that would hold its own copy
/// of the lock (the CRD refuses such locks; this catches one made before the rule).
#[tokio::test]
async fn a_pod_naming_a_sqlite_lock_is_denied_with_the_reason() {
    let api = api_with_locks(&["jobs"]);
    api.put(
        DISTRIBUTED_LOCKS,
        json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
               "metadata": {"name": "local", "namespace": NS},
               "spec": {"backend": {"sqlite": {"path": "/var/lib/leasehold/locks.db"}}}}),
    );
    let (allowed, message, patched) = admit(&api, &pod(Some("jobs,local"), None, None), true).await;
    assert!(!allowed);
    assert!(
        message.contains("team/local") && message.contains("SQLite is not supported in a cluster"),
        "{message}"
    );
    assert!(sidecars(&patched, "initContainers").is_empty());
}

/// `leasehold.dev/dapr-api: "true"` serves Dapr's lock API on Dapr's own loopback ports, so an
/// app written for Dapr's lock building block runs unchanged; only for a family of keyed locks
/// (a Dapr lock store), and anything but true or false is refused with the reason.
#[tokio::test]
async fn dapr_api_is_opted_into_for_a_family() {
    let api = api_with_locks(&["jobs"]);
    api.put(
        DISTRIBUTED_LOCKS,
        json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
               "metadata": {"name": "orders", "namespace": NS},
               "spec": {"backend": {"kubernetes": {}}, "keys": {"maxHeldPerPod": 64}}}),
    );
    let with = |locks: &str, dapr: &str| {
        let mut p = pod(Some(locks), None, None);
        p["metadata"]["annotations"][webhook::DAPR_ANNOTATION] = json!(dapr);
        p
    };
    let (allowed, message, patched) = admit(&api, &with("jobs,orders", "true"), true).await;
    assert!(allowed, "{message}");
    let args = sidecars(&patched, "initContainers")[0]["args"].clone();
    let args: Vec<&str> = args
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for pair in [
        ["--dapr-http-listen", "127.0.0.1:3500"],
        ["--dapr-grpc-listen", "127.0.0.1:50001"],
    ] {
        assert!(args.windows(2).any(|w| w == pair), "{pair:?} in {args:?}");
    }

    let (allowed, message, _) = admit(&api, &with("jobs", "true"), true).await;
    assert!(!allowed);
    assert!(
        message.contains(webhook::DAPR_ANNOTATION) && message.contains("spec.keys"),
        "{message}"
    );
    let (allowed, message, _) = admit(&api, &with("orders", "yes"), true).await;
    assert!(!allowed);
    assert!(
        message.contains("expected \"true\" or \"false\""),
        "{message}"
    );
    let (allowed, _, patched) = admit(&api, &with("orders", "false"), true).await;
    assert!(allowed);
    let args = sidecars(&patched, "initContainers")[0]["args"].to_string();
    assert!(!args.contains("dapr"), "{args}");
}

/// The sidecar's image runs on Linux nodes of the architectures it is built for only: an
/// injected pod is kept on such nodes by a required node affinity, added to each of its own
/// terms (terms are alternatives), and a pod that could run nowhere else (a Windows pod, a node
/// selector naming another system or architecture) is refused.
#[tokio::test]
async fn an_injected_pod_is_kept_on_linux_nodes_of_the_images_architecture() {
    let api = api_with_locks(&["jobs"]);
    let linux = json!({"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]});
    let arch = json!({"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]});
    let terms = |pod: &Value| {
        pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"]
            .clone()
    };

    let (allowed, message, patched) = admit(&api, &pod(Some("jobs"), None, None), true).await;
    assert!(allowed, "{message}");
    assert_eq!(
        terms(&patched),
        json!([{"matchExpressions": [linux.clone(), arch.clone()]}])
    );

    // The pod's own terms each gain the requirement; its other affinities stay.
    let mut placed = pod(Some("jobs"), None, None);
    placed["spec"]["affinity"] = json!({
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-7"]}]}
        ]}},
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}
    });
    let (allowed, message, patched) = admit(&api, &placed, true).await;
    assert!(allowed, "{message}");
    assert_eq!(
        terms(&patched),
        json!([
            {"matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a"]}, linux.clone(), arch.clone()
            ]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-7"]}],
             "matchExpressions": [linux.clone(), arch.clone()]}
        ])
    );
    assert!(patched["spec"]["affinity"]["podAntiAffinity"].is_object());

    // An affinity without a node affinity, and a node affinity without required terms.
    for affinity in [
        json!({"podAffinity": {}}),
        json!({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}),
    ] {
        let mut other = pod(Some("jobs"), None, None);
        other["spec"]["affinity"] = affinity.clone();
        let (allowed, message, patched) = admit(&api, &other, true).await;
        assert!(allowed, "{message}");
        assert_eq!(
            terms(&patched),
            json!([{"matchExpressions": [linux.clone(), arch.clone()]}]),
            "{affinity}"
        );
    }

    // A pod bound to another architecture could never run the sidecar.
    let mut arm = pod(Some("jobs"), None, None);
    arm["spec"]["nodeSelector"] = json!({"kubernetes.io/arch": "arm64"});
    let (allowed, message, _) = admit(&api, &arm, true).await;
    assert!(!allowed);
    assert!(
        message.contains("arm64") && message.contains("amd64"),
        "{message}"
    );

    // So could a pod whose every required term asks for another architecture; a term that
    // allows one of the image's keeps the pod admitted.
    let mut arm_affinity = pod(Some("jobs"), None, None);
    arm_affinity["spec"]["affinity"] = json!({
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64"]}]},
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "NotIn", "values": ["amd64"]}]}
        ]}}
    });
    let (allowed, message, _) = admit(&api, &arm_affinity, true).await;
    assert!(
        !allowed,
        "a pod that no node of the image's architecture can run was admitted"
    );
    assert!(
        message.contains("affinity") && message.contains("amd64"),
        "{message}"
    );
    let mut either = arm_affinity.clone();
    either["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] = json!(["arm64", "amd64"]);
    let (allowed, message, _) = admit(&api, &either, true).await;
    assert!(allowed, "{message}");

    // A Windows pod, or one bound to Windows nodes, could not run the sidecar either.
    let windows_only = json!({
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["windows"]}]}
        ]}}
    });
    let on_windows = [
        ("os", json!({"name": "windows"}), ["windows", "linux"]),
        (
            "nodeSelector",
            json!({"kubernetes.io/os": "windows"}),
            ["kubernetes.io/os=windows", "linux"],
        ),
        (
            "affinity",
            windows_only,
            ["affinity", "kubernetes.io/os linux"],
        ),
    ];
    for (field, value, said) in on_windows {
        let mut windows = pod(Some("jobs"), None, None);
        windows["spec"][field] = value.clone();
        let (allowed, message, _) = admit(&api, &windows, true).await;
        assert!(!allowed, "admitted with {field} {value}");
        assert!(said.iter().all(|s| message.contains(s)), "{message}");
    }
    // A Linux pod says so and is admitted.
    let mut linux_pod = pod(Some("jobs"), None, None);
    linux_pod["spec"]["os"] = json!({"name": "linux"});
    linux_pod["spec"]["nodeSelector"] = json!({"kubernetes.io/os": "linux"});
    let (allowed, message, _) = admit(&api, &linux_pod, true).await;
    assert!(allowed, "{message}");

    // A multi-architecture image: Linux nodes of any architecture.
    let mut windows = pod(Some("jobs"), None, None);
    windows["spec"]["os"] = json!({"name": "windows"});
    let mut any = injection(true);
    any.architectures.clear();
    for (pod, admitted) in [(&arm, true), (&windows, false)] {
        let answer = webhook::review(
            &support::operator_client(&api),
            &LockCache::none(),
            &any,
            admission_review(pod),
        )
        .await;
        assert_eq!(answer["response"]["allowed"], admitted, "{answer}");
    }
}

/// The sidecar runs as the image's user, or, told none (OpenShift's restricted SCC refuses a
/// user outside the namespace's range and assigns one), as the one the platform assigns, still
/// never as root.
#[test]
fn the_sidecars_user_is_the_images_or_left_to_the_platform() {
    let container = |injection: &Injection| {
        serde_json::to_value(webhook::sidecar(
            "team",
            &["jobs".to_owned()],
            injection,
            webhook::Ports::default(),
        ))
        .unwrap()
    };
    let with_image_user = container(&injection(true));
    assert_eq!(with_image_user["securityContext"]["runAsUser"], 65532);
    let assigned = container(&Injection {
        run_as_user: None,
        ..injection(true)
    });
    let sc = &assigned["securityContext"];
    assert!(sc.get("runAsUser").is_none(), "{sc}");
    assert_eq!(sc["runAsNonRoot"], true);
}

/// Containers share the pod's network: an app that declares the port the sidecar's lock API or
/// probes take would crash-loop beside it (or keep the sidecar from turning ready), so the pod
/// is refused with the annotation that moves the sidecar's port.
#[tokio::test]
async fn a_port_an_app_declares_for_itself_is_refused_with_the_annotation_that_moves_it() {
    let api = api_with_locks(&["jobs"]);
    let declaring = |port: u16, protocol: &str| {
        pod(
            Some("jobs"),
            None,
            Some(json!({"name": "ui", "image": "example/ui:1",
                        "ports": [{"containerPort": port, "protocol": protocol}]})),
        )
    };
    for (port, annotation) in [
        (webhook::API_PORT, webhook::PORT_ANNOTATION),
        (webhook::PROBE_PORT, webhook::PROBE_PORT_ANNOTATION),
    ] {
        let (allowed, message, _) = admit(&api, &declaring(port, "TCP"), true).await;
        assert!(!allowed, "port {port} taken twice");
        assert!(
            message.contains("\"ui\"") && message.contains(annotation),
            "{message}"
        );
        let (allowed, message, _) = admit(&api, &declaring(port, "UDP"), true).await;
        assert!(
            allowed,
            "a UDP port beside the sidecar's TCP one: {message}"
        );
    }
    // Moved, the sidecar's lock API leaves the app its port.
    let mut moved = declaring(webhook::API_PORT, "TCP");
    moved["metadata"]["annotations"][webhook::PORT_ANNOTATION] = json!("4050");
    let (allowed, message, patched) = admit(&api, &moved, true).await;
    assert!(allowed, "{message}");
    let env = sidecars(&patched, "initContainers")[0]["env"].to_string();
    assert!(env.contains("\"127.0.0.1:4050\""), "{env}");
}

/// A pod whose every container has requests equal to its limits is of the Guaranteed QoS
/// class; the sidecar, given requests equal to its limits there too, keeps it so. Any other
/// pod gets the configured resources.
#[tokio::test]
async fn a_guaranteed_pod_stays_guaranteed_with_its_sidecar() {
    let api = api_with_locks(&["jobs"]);
    let mut guaranteed = pod(Some("jobs"), None, None);
    guaranteed["spec"]["containers"][0]["resources"] = json!({
        "requests": {"cpu": "1000m", "memory": "1Gi"},
        "limits": {"cpu": "1", "memory": "1073741824"},
    });
    guaranteed["spec"]["initContainers"] = json!([{"name": "migrate", "image": "example/m:1",
        "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}}}]);
    let (allowed, message, patched) = admit(&api, &guaranteed, true).await;
    assert!(allowed, "{message}");
    let sidecar = &sidecars(&patched, "initContainers")[0];
    for name in ["cpu", "memory"] {
        assert_eq!(
            sidecar["resources"]["requests"][name], sidecar["resources"]["limits"][name],
            "the sidecar's {name} request is not its limit: the pod is no longer Guaranteed"
        );
    }
    assert_eq!(
        sidecar["resources"]["limits"]["cpu"],
        webhook::GUARANTEED_CPU
    );
    assert_eq!(
        sidecar["resources"]["limits"]["memory"],
        webhook::DEFAULT_MEMORY_LIMIT
    );

    // An app without a CPU limit makes the pod Burstable whatever the sidecar has.
    let mut burstable = guaranteed.clone();
    burstable["spec"]["containers"][0]["resources"]["limits"]
        .as_object_mut()
        .unwrap()
        .remove("cpu");
    let (allowed, message, patched) = admit(&api, &burstable, true).await;
    assert!(allowed, "{message}");
    let sidecar = &sidecars(&patched, "initContainers")[0];
    assert_eq!(
        sidecar["resources"]["requests"]["cpu"],
        webhook::DEFAULT_CPU_REQUEST
    );
    assert!(sidecar["resources"]["limits"]["cpu"].is_null());
}
