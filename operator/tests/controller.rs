//! The whole controller (watch, finalizer, provisioning, status, clean-up) against the in-memory
//! API server, which behaves as a real one where it matters here: the status subresource, a
//! delete that waits for finalizers, the garbage collector, and a namespace being deleted that
//! refuses new objects (events included).

use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold_crds::{Backend, CleanupPolicy, KubernetesBackend, RedisBackend};
use leasehold_lease::{Acquire, Driver};
use leasehold_operator::config::Watched;
use leasehold_operator::metrics::Metrics;
use leasehold_operator::reconcile::{self, Context, FINALIZER};
use leasehold_testkit::in_memory_api_server::{DISTRIBUTED_LOCKS, EVENTS, LEASES};
use leasehold_testkit::{InMemoryApiServer, RedisServer};
use serde_json::Value;

mod support;

const NS: &str = "team";

fn put_lock(api: &InMemoryApiServer, name: &str) {
    put_lock_with(api, name, CleanupPolicy::Delete);
}

fn put_lock_with(api: &InMemoryApiServer, name: &str, policy: CleanupPolicy) {
    put_lock_in(api, NS, name, policy);
}

fn put_lock_in(api: &InMemoryApiServer, namespace: &str, name: &str, policy: CleanupPolicy) {
    let mut lock = leasehold_testkit::distributed_lock(
        namespace,
        name,
        Backend {
            kubernetes: Some(KubernetesBackend::default()),
            ..Default::default()
        },
    );
    lock.spec.cleanup_policy = policy;
    lock.metadata.uid = None;
    api.put(DISTRIBUTED_LOCKS, serde_json::to_value(&lock).unwrap());
}

async fn eventually<T>(within: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(start.elapsed() < within, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The operator running against `api` until the returned sender is dropped or fired.
fn operator(api: &InMemoryApiServer) -> tokio::sync::oneshot::Sender<()> {
    operator_task(api).0
}

/// The operator running against `api` until the returned sender is dropped or fired, and its
/// task, which ends once it has stopped.
fn operator_task(
    api: &InMemoryApiServer,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let ctx = Arc::new(Context::new(
        support::operator_client(api),
        "operator-0",
        Arc::new(Metrics::new()),
    ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(reconcile::run(ctx, Watched::AllNamespaces, async {
        let _ = stopped.await;
    }));
    (stop, task)
}

/// Lock `name` once the operator has put its finalizer on it and reported it ready.
async fn finalized_and_ready(api: &InMemoryApiServer, name: &str) -> Value {
    eventually(
        Duration::from_secs(10),
        "finalizer and ready status",
        || {
            let lock = lock_object(api, name)?;
            let finalized = lock["metadata"]["finalizers"][0] == FINALIZER;
            let ready = lock["status"]["conditions"][0]["status"] == "True";
            (finalized && ready).then_some(lock)
        },
    )
    .await
}

fn lock_object(api: &InMemoryApiServer, name: &str) -> Option<Value> {
    api.object(DISTRIBUTED_LOCKS, NS, name)
}

async fn delete_lock(api: &InMemoryApiServer, name: &str) {
    kube::Api::<leasehold_crds::DistributedLock>::namespaced(api.client(), NS)
        .delete(name, &Default::default())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_is_provisioned_reported_and_cleaned_up_on_delete() {
    let api = InMemoryApiServer::new();
    put_lock(&api, "jobs");
    let _stop = operator(&api);
    let ready = finalized_and_ready(&api, "jobs").await;
    assert_eq!(ready["status"]["backend"], "kubernetes", "{ready}");
    assert!(api.object(LEASES, NS, "jobs").is_some(), "the Lease");

    delete_lock(&api, "jobs").await;
    eventually(Duration::from_secs(10), "the lock is gone", || {
        lock_object(&api, "jobs").is_none().then_some(())
    })
    .await;
    // Cleaned up and cut loose first, so the garbage collector left the Lease and its
    // transitions (the token's high-water mark).
    let lease = api.object(LEASES, NS, "jobs").expect("the Lease was kept");
    assert!(lease["metadata"]["ownerReferences"].is_null(), "{lease}");
}

/// Deleting a namespace deletes its locks; the clean-up must not keep the namespace
/// `Terminating` waiting for a holder that is going away, nor for events it cannot publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_in_a_namespace_being_deleted_lets_go() {
    let api = InMemoryApiServer::new();
    put_lock(&api, "jobs");
    let stop = operator(&api);
    eventually(Duration::from_secs(10), "ready", || {
        let lock = lock_object(&api, "jobs")?;
        (lock["status"]["conditions"][0]["status"] == "True").then_some(())
    })
    .await;
    // A pod holds the lock.
    let driver = leasehold_lease::kubernetes::KubernetesLeaseDriver::new(api.client(), NS);
    let Acquire::Acquired(_) = driver
        .try_acquire("jobs", "pod-a", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("the free lock was not acquired")
    };
    api.terminate_namespace(NS);
    delete_lock(&api, "jobs").await;
    let started = Instant::now();
    eventually(Duration::from_secs(10), "the lock is gone", || {
        lock_object(&api, "jobs").is_none().then_some(())
    })
    .await;
    eprintln!("let go {:?} after the delete", started.elapsed());
    drop(stop);
}

/// A Lease's new holder shows in the status at once (not at the next resync), while its
/// renewals, every few seconds per lock, cost the operator no request at all; a release takes
/// the holder out of the status (the operator's apply no longer names the field).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_change_shows_at_once_and_renewals_cost_nothing() {
    let api = InMemoryApiServer::new();
    put_lock(&api, "jobs");
    let _stop = operator(&api);
    eventually(Duration::from_secs(10), "ready", || {
        let lock = lock_object(&api, "jobs")?;
        (lock["status"]["conditions"][0]["status"] == "True").then_some(())
    })
    .await;
    let driver = leasehold_lease::kubernetes::KubernetesLeaseDriver::new(api.client(), NS);
    let Acquire::Acquired(lease) = driver
        .try_acquire("jobs", "pod-a", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("the free lock was not acquired")
    };
    let took = Instant::now();
    eventually(
        reconcile::RESYNC / 3,
        "the holder in the status before the resync",
        || (lock_object(&api, "jobs")?["status"]["holder"] == "pod-a").then_some(()),
    )
    .await;
    eprintln!("the new holder showed after {:?}", took.elapsed());
    let before = api.settled_requests().await;
    for _ in 0..20 {
        let mut lease = api.object(LEASES, NS, "jobs").unwrap();
        lease["spec"]["renewTime"] = serde_json::json!(
            k8s_openapi::jiff::Timestamp::now()
                .round(k8s_openapi::jiff::Unit::Microsecond)
                .unwrap()
                .to_string()
        );
        api.put(LEASES, lease);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        api.requests() - before,
        0,
        "renewals made the operator call the API server"
    );
    assert!(driver.release(&lease).await.unwrap(), "released");
    eventually(
        reconcile::RESYNC / 3,
        "no holder in the status before the resync",
        || {
            let status = &lock_object(&api, "jobs")?["status"];
            (status.get("holder").is_none() && status["transitions"] == 1).then_some(())
        },
    )
    .await;
}

/// A lock whose holder changes between any two looks (workers taking it on demand, many times a
/// second) costs the operator what any lock does: the status the operator writes does not
/// bring the lock back to be reconciled, so the holder is read again at the resync or at a
/// change of the resource, not in a loop of the operator's own writes spending the API budget
/// that every lock shares. Here each status write hands the lock to another owner before it
/// is answered, so every look finds a holder the status does not name yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_whose_holder_keeps_changing_is_not_reconciled_again_by_its_own_status() {
    let redis = RedisServer::start();
    let api = InMemoryApiServer::new();
    let mut lock = leasehold_testkit::distributed_lock(
        NS,
        "jobs",
        Backend {
            redis: Some(RedisBackend {
                endpoints: vec![format!("127.0.0.1:{}", redis.port())],
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    lock.metadata.uid = None;
    api.put(DISTRIBUTED_LOCKS, serde_json::to_value(&lock).unwrap());
    let resolved = leasehold_resource::resolve(&lock, &Default::default()).unwrap();
    let driver = leasehold_resource::open(&api.client(), &resolved)
        .await
        .unwrap();
    let holding = Arc::new(tokio::sync::Mutex::new((0u32, None)));
    let hand_over = move || {
        let (driver, holding, name) = (driver.clone(), holding.clone(), resolved.name.clone());
        async move {
            let mut holding = holding.lock().await;
            if let Some(lease) = holding.1.take() {
                driver.release(&lease).await.unwrap();
            }
            holding.0 += 1;
            let owner = format!("pod-{}", holding.0);
            let Acquire::Acquired(lease) = driver
                .try_acquire(&name, &owner, Duration::from_secs(60))
                .await
                .unwrap()
            else {
                panic!("{owner} did not take the free lock")
            };
            holding.1 = Some(lease);
        }
    };
    hand_over().await;
    let inner = support::operator_client(&api);
    let client = kube::Client::new(
        tower::service_fn(move |request: http::Request<kube::client::Body>| {
            let (inner, hand_over) = (inner.clone(), hand_over.clone());
            async move {
                let status_write = request.method() == http::Method::PATCH
                    && request.uri().path().ends_with("/status");
                let response = inner.send(request).await?;
                if status_write {
                    hand_over().await;
                }
                Ok::<_, kube::Error>(response)
            }
        }),
        "default",
    );
    let ctx = Arc::new(Context::new(client, "operator-0", Arc::new(Metrics::new())));
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(reconcile::run(ctx, Watched::AllNamespaces, async {
        let _ = stopped.await;
    }));
    eventually(Duration::from_secs(10), "a holder in the status", || {
        lock_object(&api, "jobs")?["status"]["holder"]
            .as_str()
            .map(str::to_owned)
    })
    .await;
    let status_writes = || {
        api.requests_by_kind()
            .get("PATCH distributedlocks/status")
            .copied()
            .unwrap_or(0)
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let written = status_writes();
    assert!(
        written <= 2,
        "the operator wrote the status of a lock nobody edited {written} times in 2 s"
    );
}

/// Each holder change is told in an Event of its own words: a second change within minutes is
/// not folded into the first one's Event, which would go on naming the first holder and token
/// (with a count of 2) while the status names the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_holder_change_is_told_with_its_own_holder() {
    let api = InMemoryApiServer::new();
    put_lock(&api, "jobs");
    let _stop = operator(&api);
    finalized_and_ready(&api, "jobs").await;
    let driver = leasehold_lease::kubernetes::KubernetesLeaseDriver::new(api.client(), NS);
    for pod in ["pod-a", "pod-b"] {
        let Acquire::Acquired(lease) = driver
            .try_acquire("jobs", pod, Duration::from_secs(60))
            .await
            .unwrap()
        else {
            panic!("{pod} did not take the free lock")
        };
        eventually(Duration::from_secs(10), "the holder in the status", || {
            (lock_object(&api, "jobs")?["status"]["holder"] == pod).then_some(())
        })
        .await;
        assert!(driver.release(&lease).await.unwrap());
    }
    let notes = || {
        events_of(&api, "jobs")
            .iter()
            .filter(|e| e["reason"] == "HolderChanged")
            .map(|e| e["note"].as_str().unwrap_or_default().to_owned())
            .collect::<Vec<_>>()
    };
    let started = Instant::now();
    while !notes().last().is_some_and(|n| n.starts_with("pod-b holds")) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the latest HolderChanged Event does not name pod-b: {:?}",
            notes()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The Events about lock `name`, oldest (last written) first.
fn events_of(api: &InMemoryApiServer, name: &str) -> Vec<Value> {
    let mut events: Vec<Value> = api
        .objects(EVENTS)
        .into_iter()
        .filter(|e| e["regarding"]["name"] == name)
        .collect();
    events.sort_by_key(|e| {
        e["metadata"]["resourceVersion"]
            .as_str()
            .and_then(|v| v.parse::<u64>().ok())
    });
    events
}

/// The reasons of the Events about lock `name`, oldest first.
fn event_reasons(api: &InMemoryApiServer, name: &str) -> Vec<String> {
    events_of(api, name)
        .iter()
        .filter_map(|e| e["reason"].as_str().map(str::to_owned))
        .collect()
}

/// Set `leasehold.dev/force-release` on lock `name`.
fn annotate_force_release(api: &InMemoryApiServer, name: &str, value: &str) {
    let mut lock = lock_object(api, name).expect("the lock");
    lock["metadata"]["annotations"]["leasehold.dev/force-release"] = serde_json::json!(value);
    api.put(DISTRIBUTED_LOCKS, lock);
}

fn force_release_annotation(api: &InMemoryApiServer, name: &str) -> Option<Value> {
    lock_object(api, name)?["metadata"]["annotations"]
        .get("leasehold.dev/force-release")
        .cloned()
}

/// A person's force-release: while the holding with that token runs, the operator waits for
/// its sidecar to step down (here the test releases, as the sidecar does); then the annotation
/// goes and an Event says the holding ended. A token that is not current, or no token at all,
/// changes nothing, and the annotation goes with an Event saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_waits_for_its_holding_to_end_and_says_so() {
    let api = InMemoryApiServer::new();
    put_lock(&api, "jobs");
    let _stop = operator(&api);
    finalized_and_ready(&api, "jobs").await;
    let driver = leasehold_lease::kubernetes::KubernetesLeaseDriver::new(api.client(), NS);
    let Acquire::Acquired(lease) = driver
        .try_acquire("jobs", "pod-a", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("the free lock was not acquired")
    };

    annotate_force_release(&api, "jobs", "999");
    eventually(
        Duration::from_secs(10),
        "a token not current is refused",
        || {
            force_release_annotation(&api, "jobs")
                .is_none()
                .then_some(())
        },
    )
    .await;
    assert!(event_reasons(&api, "jobs").contains(&"ForceReleaseIgnored".to_owned()));
    assert_eq!(
        api.lease(NS, "jobs").unwrap()["spec"]["holderIdentity"],
        "pod-a"
    );

    annotate_force_release(&api, "jobs", "not-a-token");
    eventually(Duration::from_secs(10), "no token is refused", || {
        force_release_annotation(&api, "jobs")
            .is_none()
            .then_some(())
    })
    .await;
    assert!(event_reasons(&api, "jobs").contains(&"ForceReleaseInvalid".to_owned()));

    annotate_force_release(&api, "jobs", &lease.token.to_string());
    eventually(
        Duration::from_secs(10),
        "the request is acknowledged",
        || {
            event_reasons(&api, "jobs")
                .contains(&"ForceReleaseRequested".to_owned())
                .then_some(())
        },
    )
    .await;
    // The holding runs on until its sidecar steps down: the annotation stays meanwhile.
    tokio::time::sleep(reconcile::FORCE_RELEASE_RECHECK * 2).await;
    assert!(force_release_annotation(&api, "jobs").is_some());
    assert!(driver.release(&lease).await.unwrap());
    eventually(
        Duration::from_secs(10),
        "the ended holding is reported",
        || {
            (force_release_annotation(&api, "jobs").is_none()
                && event_reasons(&api, "jobs").contains(&"ForceReleased".to_owned()))
            .then_some(())
        },
    )
    .await;
}

/// Uninstalling: Helm runs the chart's pre-delete hook while the operator still runs. The hook
/// scales the operator's Deployment to zero and waits its pods out, then lets every lock go, so
/// that deleting a lock or its namespace later does not hang on a finalizer nobody will remove,
/// and keeps the records (a Kubernetes-backed lock's Lease is cut loose, not garbage-collected
/// with its lock). The test plays the Deployment controller and the kubelet: scaled to zero, the
/// operator runs on for a grace period, stops, and only then its pod goes (an evicted pod stays
/// listed, and is not waited for). The hook runs as its
/// ServiceAccount, with the RBAC the rendered chart gives it, and with the arguments the
/// rendered Job passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_uninstall_hook_stops_the_operator_then_releases_every_finalizer() {
    use leasehold_operator::uninstall::{OperatorDeployment, release_finalizers, stop_operator};
    const RELEASE_NS: &str = "leasehold-system";
    const DEPLOYMENTS: &str = "/apis/apps/v1/deployments";
    const PODS: &str = "/api/v1/pods";
    const GRACE: Duration = Duration::from_millis(700);
    let chart = support::objects(&support::rendered_chart());
    let named = |kind: &str, name: &str| {
        chart
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("the chart has no {kind} {name}"))
            .clone()
    };
    let job = named("Job", "leasehold-operator-uninstall");
    let args: Vec<&str> = job["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("the hook's args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let flag = |name: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("--{name}=")))
            .unwrap_or_else(|| panic!("the hook passes no --{name}: {args:?}"))
            .to_owned()
    };
    let deployment = OperatorDeployment {
        namespace: RELEASE_NS.into(),
        name: flag("operator-deployment"),
        pods: flag("operator-pods"),
    };
    let mut operator_deployment = named("Deployment", &deployment.name);
    operator_deployment["metadata"]["namespace"] = RELEASE_NS.into();
    let pod_labels = operator_deployment["spec"]["template"]["metadata"]["labels"].clone();

    let api = InMemoryApiServer::new();
    put_lock(&api, "jobs");
    put_lock(&api, "reports");
    api.put(DEPLOYMENTS, operator_deployment);
    api.put(
        PODS,
        serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "leasehold-operator-0", "namespace": RELEASE_NS,
                         "labels": pod_labels.clone()}}),
    );
    // An evicted pod stays listed, and runs nothing.
    api.put(
        PODS,
        serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "leasehold-operator-evicted", "namespace": RELEASE_NS,
                         "labels": pod_labels},
            "status": {"phase": "Failed", "reason": "Evicted"}}),
    );
    let (stop, operator_task) = operator_task(&api);
    eventually(Duration::from_secs(10), "both locks ready", || {
        ["jobs", "reports"]
            .iter()
            .all(|name| {
                lock_object(&api, name).is_some_and(|l| {
                    l["metadata"]["finalizers"][0] == FINALIZER
                        && l["status"]["conditions"][0]["status"] == "True"
                })
            })
            .then_some(())
    })
    .await;
    let kubelet = tokio::spawn({
        let (api, name) = (api.clone(), deployment.name.clone());
        async move {
            while api
                .object(DEPLOYMENTS, RELEASE_NS, &name)
                .is_none_or(|d| d["spec"]["replicas"] != 0)
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tokio::time::sleep(GRACE).await;
            let _ = stop.send(());
            operator_task.await.unwrap();
            assert!(api.remove(PODS, RELEASE_NS, "leasehold-operator-0"));
        }
    });
    let hook_user = "system:serviceaccount:leasehold-system:leasehold-operator-uninstall";
    api.grant(
        hook_user,
        support::rendered_chart_grants(RELEASE_NS, "leasehold-operator-uninstall"),
    );
    let hook = api.client_as(hook_user);
    stop_operator(&hook, &deployment, Duration::from_secs(30))
        .await
        .unwrap();
    kubelet.await.unwrap();
    let released = release_finalizers(&hook, &Watched::AllNamespaces)
        .await
        .unwrap();
    assert_eq!(released, ["team/jobs", "team/reports"]);
    // Nothing adds a finalizer back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for name in ["jobs", "reports"] {
        let lock = lock_object(&api, name).unwrap();
        assert!(
            lock["metadata"]["finalizers"]
                .as_array()
                .is_none_or(|f| f.is_empty()),
            "{lock}"
        );
    }
    assert_eq!(api.denied(), [], "requests outside the chart's RBAC");
    delete_lock(&api, "jobs").await;
    assert!(lock_object(&api, "jobs").is_none(), "the delete hung");
    let lease = api
        .object(LEASES, NS, "jobs")
        .expect("the Lease went with its lock");
    assert!(lease["metadata"]["ownerReferences"].is_null(), "{lease}");
}

/// An uninstall hook whose operator does not stop in time (a pod on a node that no longer
/// answers stays listed as running) releases no finalizer, and scales the operator back to
/// the replicas it had: left at zero, its webhook would refuse the pods it injects and no lock
/// would be reconciled. A hook that runs again meanwhile finds zero and the count noted before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uninstall_hook_whose_operator_does_not_stop_scales_it_back() {
    use leasehold_operator::uninstall::{OperatorDeployment, REPLICAS_BEFORE, stop_operator};
    const RELEASE_NS: &str = "leasehold-system";
    const DEPLOYMENTS: &str = "/apis/apps/v1/deployments";
    const PODS: &str = "/api/v1/pods";
    let chart = support::objects(&support::rendered_chart());
    let mut operator_deployment = chart
        .iter()
        .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "leasehold-operator")
        .expect("the chart's Deployment")
        .clone();
    operator_deployment["metadata"]["namespace"] = RELEASE_NS.into();
    operator_deployment["spec"]["replicas"] = 3.into();
    let pod_labels = operator_deployment["spec"]["template"]["metadata"]["labels"].clone();
    let api = InMemoryApiServer::new();
    api.put(DEPLOYMENTS, operator_deployment);
    api.put(
        PODS,
        serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "leasehold-operator-0", "namespace": RELEASE_NS,
                         "labels": pod_labels},
            "status": {"phase": "Running"}}),
    );
    let hook_user = "system:serviceaccount:leasehold-system:leasehold-operator-uninstall";
    api.grant(
        hook_user,
        support::rendered_chart_grants(RELEASE_NS, "leasehold-operator-uninstall"),
    );
    let hook = api.client_as(hook_user);
    let deployment = OperatorDeployment {
        namespace: RELEASE_NS.into(),
        name: "leasehold-operator".into(),
        pods: "app.kubernetes.io/name=leasehold-operator".into(),
    };
    let replicas = |api: &InMemoryApiServer| {
        let d = api
            .object(DEPLOYMENTS, RELEASE_NS, "leasehold-operator")
            .expect("the Deployment");
        (
            d["spec"]["replicas"].clone(),
            d["metadata"]["annotations"][REPLICAS_BEFORE].clone(),
        )
    };
    let failed = stop_operator(&hook, &deployment, Duration::from_millis(500))
        .await
        .expect_err("the operator's pod never went");
    assert!(failed.contains("scaled back"), "{failed}");
    assert_eq!(replicas(&api), (3.into(), Value::Null));

    // A run of the hook before failed to scale it back: the next finds the count it noted.
    let mut stopped = api
        .object(DEPLOYMENTS, RELEASE_NS, "leasehold-operator")
        .unwrap();
    stopped["spec"]["replicas"] = 0.into();
    stopped["metadata"]["annotations"][REPLICAS_BEFORE] = "3".into();
    api.put(DEPLOYMENTS, stopped);
    stop_operator(&hook, &deployment, Duration::from_millis(500))
        .await
        .expect_err("the operator's pod never went");
    assert_eq!(replicas(&api), (3.into(), Value::Null));
    assert_eq!(api.denied(), [], "requests outside the chart's RBAC");

    // A step that fails once the operator is stopped (here its pods cannot be listed) scales
    // it back too.
    let blind = "system:serviceaccount:leasehold-system:blind";
    api.grant(
        blind,
        support::rendered_chart_grants(RELEASE_NS, "leasehold-operator-uninstall")
            .into_iter()
            .filter(|grant| grant.rule["resources"][0] != "pods")
            .collect(),
    );
    let failed = leasehold_operator::uninstall::release_every_finalizer(
        &api.client_as(blind),
        Some(&deployment),
        &Watched::AllNamespaces,
        Duration::from_secs(5),
    )
    .await
    .expect_err("the pods cannot be listed");
    assert!(failed.contains("scaled back"), "{failed}");
    assert_eq!(replicas(&api), (3.into(), Value::Null));
}

/// A lock whose records are kept (`cleanupPolicy: Retain`) needs no clean-up and carries no
/// finalizer: it is provisioned and reported all the same, and deleting it, operator or not,
/// does not wait. A `Delete` lock switched to `Retain` has the finalizer taken off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_lock_carries_no_finalizer() {
    let api = InMemoryApiServer::new();
    put_lock(&api, "switched");
    put_lock_with(&api, "kept", CleanupPolicy::Retain);
    let stop = operator(&api);
    let ready = |l: &Value| l["status"]["conditions"][0]["status"] == "True";
    let has_finalizer = |l: &Value| {
        l["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| f.iter().any(|f| f == FINALIZER))
    };
    eventually(Duration::from_secs(10), "both locks ready", || {
        let switched = lock_object(&api, "switched")?;
        let kept = lock_object(&api, "kept")?;
        (ready(&switched) && has_finalizer(&switched) && ready(&kept)).then_some(())
    })
    .await;
    assert!(
        !has_finalizer(&lock_object(&api, "kept").unwrap()),
        "a retained lock got the finalizer"
    );
    let mut switched = lock_object(&api, "switched").unwrap();
    switched["spec"]["cleanupPolicy"] = "Retain".into();
    api.put(DISTRIBUTED_LOCKS, switched);
    eventually(Duration::from_secs(10), "the finalizer taken off", || {
        lock_object(&api, "switched")
            .filter(|l| !has_finalizer(l) && ready(l))
            .map(|_| ())
    })
    .await;
    // With the operator gone, deleting them does not wait on it.
    let _ = stop.send(());
    tokio::time::sleep(Duration::from_millis(200)).await;
    for name in ["kept", "switched"] {
        delete_lock(&api, name).await;
        assert!(lock_object(&api, name).is_none(), "deleting {name} waits");
    }
}

/// With `operator.watchNamespaces`, the chart grants the operator the watched namespaces'
/// Secrets, Leases and events there alone (not kube-system's election Leases, nor any other
/// namespace's Secrets), and the locks themselves cluster-wide: with those grants it
/// provisions, reports and cleans up a lock in each watched namespace, leaves a lock elsewhere
/// alone, and is refused nothing; and a watched namespace being deleted, whose RoleBinding
/// went first, does not stay `Terminating` on its lock's finalizer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_watched_namespaces_the_operator_is_granted_those_namespaces_alone() {
    const OTHER_WATCHED: &str = "team-b";
    const UNWATCHED: &str = "elsewhere";
    let text = support::rendered_chart_with(&[
        "--set",
        &format!("operator.watchNamespaces={{{NS},{OTHER_WATCHED}}}"),
    ]);
    let grants = support::grants_of(&text, "leasehold-system", "leasehold-operator");
    for grant in grants.iter().filter(|g| g.namespace.is_none()) {
        let resources = grant.rule["resources"].as_array().unwrap();
        for kept_to_the_namespace in ["secrets", "leases", "events"] {
            assert!(
                !resources.iter().any(|r| r == kept_to_the_namespace),
                "{kept_to_the_namespace} granted cluster-wide: {}",
                grant.rule
            );
        }
    }
    for ns in [NS, OTHER_WATCHED] {
        assert!(
            grants.iter().any(|g| g.namespace.as_deref() == Some(ns)
                && g.rule["resources"].to_string().contains("secrets")),
            "no Role in {ns}: {grants:?}"
        );
    }
    assert!(
        grants
            .iter()
            .all(|g| g.namespace.as_deref() != Some(UNWATCHED)),
        "{grants:?}"
    );
    // The webhook admits pods of the watched namespaces only: it may read no other's locks.
    let webhook_configuration = support::objects(&text)
        .into_iter()
        .find(|o| o["kind"] == "MutatingWebhookConfiguration")
        .expect("the webhook configuration");
    let expressions =
        &webhook_configuration["webhooks"][0]["namespaceSelector"]["matchExpressions"];
    assert!(
        expressions.as_array().unwrap().iter().any(|e| e["operator"] == "In"
            && e["values"] == serde_json::json!([NS, OTHER_WATCHED])),
        "{expressions}"
    );
    let hook = support::grants_of(&text, "leasehold-system", "leasehold-operator-uninstall");
    assert!(
        hook.iter()
            .filter(|g| g.namespace.is_none())
            .all(|g| !g.rule["resources"].to_string().contains("leases")),
        "the uninstall hook may touch Leases cluster-wide: {hook:?}"
    );

    let api = InMemoryApiServer::new();
    api.grant(support::OPERATOR_USER, grants.clone());
    for ns in [NS, OTHER_WATCHED, UNWATCHED] {
        put_lock_in(&api, ns, "jobs", CleanupPolicy::Delete);
    }
    let ctx = Arc::new(Context::new(
        api.client_as(support::OPERATOR_USER),
        "operator-0",
        Arc::new(Metrics::new()),
    ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let watched = Watched::from_names(&[NS, OTHER_WATCHED]);
    let task = tokio::spawn(reconcile::run(ctx, watched, async {
        let _ = stopped.await;
    }));
    finalized_and_ready(&api, "jobs").await;
    eventually(
        Duration::from_secs(10),
        "the other watched lock ready",
        || {
            let lock = api.object(DISTRIBUTED_LOCKS, OTHER_WATCHED, "jobs")?;
            (lock["status"]["conditions"][0]["status"] == "True").then_some(())
        },
    )
    .await;
    for ns in [NS, OTHER_WATCHED] {
        assert!(
            api.object(LEASES, ns, "jobs").is_some(),
            "the Lease in {ns}"
        );
    }
    delete_lock(&api, "jobs").await;
    eventually(Duration::from_secs(10), "the lock is gone", || {
        lock_object(&api, "jobs").is_none().then_some(())
    })
    .await;
    assert_eq!(
        api.denied(),
        Vec::new(),
        "requests the chart's Roles do not allow"
    );
    // The other watched namespace deleted: the namespace controller deletes its RoleBinding in
    // the same sweep as its lock, here first.
    api.terminate_namespace(OTHER_WATCHED);
    api.grant(
        support::OPERATOR_USER,
        grants
            .iter()
            .filter(|g| g.namespace.as_deref() != Some(OTHER_WATCHED))
            .cloned()
            .collect(),
    );
    kube::Api::<leasehold_crds::DistributedLock>::namespaced(api.client(), OTHER_WATCHED)
        .delete("jobs", &Default::default())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(20),
        "the lock of the namespace being deleted is gone",
        || {
            api.object(DISTRIBUTED_LOCKS, OTHER_WATCHED, "jobs")
                .is_none()
                .then_some(())
        },
    )
    .await;
    let _ = stop.send(());
    task.await.unwrap();
    let unwatched = api.object(DISTRIBUTED_LOCKS, UNWATCHED, "jobs").unwrap();
    assert!(
        unwatched["status"].is_null() && unwatched["metadata"]["finalizers"].is_null(),
        "a lock outside the watched namespaces was reconciled: {unwatched}"
    );
    assert!(api.object(LEASES, UNWATCHED, "jobs").is_none());
}

/// A lock written under a later version's CRD, with a value this version does not know (the
/// CRD stays at the later version when the operator is rolled back: Helm neither upgrades nor
/// rolls back CRDs), is refused on its own status as invalid; every other lock is reconciled as
/// ever, rather than every list of locks failing to decode with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_with_a_value_of_a_later_crd_is_refused_alone() {
    let api = InMemoryApiServer::new();
    put_lock(&api, "jobs");
    for (name, spec) in [
        (
            "later-mode",
            serde_json::json!({"backend": {"kubernetes": {}}, "mode": "Elected"}),
        ),
        (
            "later-sql-mode",
            serde_json::json!({"backend": {"postgres": {"host": "db.team.svc", "database": "locks",
                "lockMode": "Advisory"}}}),
        ),
    ] {
        api.put(
            DISTRIBUTED_LOCKS,
            serde_json::json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
                "metadata": {"name": name, "namespace": NS}, "spec": spec}),
        );
    }
    // A clean-up policy of a later version deletes nothing here, as `Retain`: no finalizer.
    let mut later_policy = serde_json::to_value(leasehold_testkit::distributed_lock(
        NS,
        "later-policy",
        Backend {
            kubernetes: Some(KubernetesBackend::default()),
            ..Default::default()
        },
    ))
    .unwrap();
    later_policy["spec"]["cleanupPolicy"] = serde_json::json!("Archive");
    later_policy["metadata"]["uid"] = Value::Null;
    api.put(DISTRIBUTED_LOCKS, later_policy);
    let _stop = operator(&api);
    finalized_and_ready(&api, "jobs").await;
    eventually(
        Duration::from_secs(10),
        "the later policy's lock ready, without a finalizer",
        || {
            let lock = lock_object(&api, "later-policy")?;
            let ready = lock["status"]["conditions"][0]["status"] == "True";
            (ready && lock["metadata"]["finalizers"].is_null()).then_some(())
        },
    )
    .await;
    delete_lock(&api, "later-policy").await;
    assert!(
        lock_object(&api, "later-policy").is_none(),
        "deleting a lock of a later policy waits on the operator"
    );
    for (name, field) in [("later-mode", "mode"), ("later-sql-mode", "lockMode")] {
        let condition = eventually(Duration::from_secs(10), "the refusal", || {
            let lock = lock_object(&api, name)?;
            let condition = lock["status"]["conditions"][0].clone();
            (condition["status"] == "False").then_some(condition)
        })
        .await;
        assert_eq!(condition["reason"], "InvalidSpec", "{condition}");
        let message = condition["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(field) && message.contains("does not know"),
            "{name}: {message}"
        );
    }
}
