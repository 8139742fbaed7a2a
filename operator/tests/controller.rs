//! The whole controller (watch, finalizer, provisioning, status, clean-up) against the in-memory
//! API server, which behaves as a real one where it matters here: the status subresource, a
//! delete that waits for finalizers, the garbage collector, and a namespace being deleted that
//! refuses new objects (events included).

use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold_crds::{Backend, CleanupPolicy, KubernetesBackend};
use leasehold_lease::testkit::InMemoryApiServer;
use leasehold_lease::testkit::in_memory_api_server::{DISTRIBUTED_LOCKS, LEASES};
use leasehold_lease::{Acquire, Driver};
use leasehold_operator::metrics::Metrics;
use leasehold_operator::reconcile::{self, Context, FINALIZER};
use serde_json::Value;

mod support;

const NS: &str = "team";

fn put_lock(api: &InMemoryApiServer, name: &str) {
    let mut lock = leasehold_lease::testkit::distributed_lock(
        NS,
        name,
        Backend {
            kubernetes: Some(KubernetesBackend::default()),
            ..Default::default()
        },
    );
    lock.spec.cleanup_policy = CleanupPolicy::Delete;
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
    let ctx = Arc::new(Context::new(
        support::operator_client(api),
        "operator-0",
        Arc::new(Metrics::new()),
    ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(reconcile::run(ctx, None, async {
        let _ = stopped.await;
    }));
    stop
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
    let ready = eventually(
        Duration::from_secs(10),
        "finalizer and ready status",
        || {
            let lock = lock_object(&api, "jobs")?;
            let finalized = lock["metadata"]["finalizers"][0] == FINALIZER;
            let ready = lock["status"]["conditions"][0]["status"] == "True";
            (finalized && ready).then_some(lock)
        },
    )
    .await;
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
/// renewals, every few seconds per lock, cost the operator no request at all.
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
    let Acquire::Acquired(_) = driver
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
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = api.requests();
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
}

/// Uninstalling: the chart's pre-delete hook lets every lock go, so that deleting a lock or its
/// namespace later does not hang on a finalizer nobody will remove, and keeps the records (a
/// Kubernetes-backed lock's Lease is cut loose, not garbage-collected with its lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_uninstall_hook_releases_every_finalizer_and_keeps_the_records() {
    let api = InMemoryApiServer::new();
    put_lock(&api, "jobs");
    put_lock(&api, "reports");
    let stop = operator(&api);
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
    // The operator is uninstalled.
    let _ = stop.send(());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released = leasehold_operator::uninstall::release_finalizers(&api.client(), None)
        .await
        .unwrap();
    assert_eq!(released, ["team/jobs", "team/reports"]);
    for name in ["jobs", "reports"] {
        let lock = lock_object(&api, name).unwrap();
        assert!(
            lock["metadata"]["finalizers"]
                .as_array()
                .is_none_or(|f| f.is_empty()),
            "{lock}"
        );
    }
    delete_lock(&api, "jobs").await;
    assert!(lock_object(&api, "jobs").is_none(), "the delete hung");
    let lease = api
        .object(LEASES, NS, "jobs")
        .expect("the Lease went with its lock");
    assert!(lease["metadata"]["ownerReferences"].is_null(), "{lease}");
}
