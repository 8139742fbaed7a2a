//! `operator`: the operator's API requests per second with many Kubernetes-backed locks held
//! and renewed.

use super::*;

/// The operator's load: this many Kubernetes-backed locks (`cleanupPolicy: Delete`, so each
/// Lease is owned by its lock), each held by a pod that renews every `OPERATOR_RENEW`, and how
/// long the operator's requests are counted once every lock is ready.
pub(crate) const OPERATOR_LOCKS: usize = 1000;
pub(crate) const OPERATOR_RENEW: Duration = Duration::from_secs(5);
pub(crate) const OPERATOR_MEASURE: Duration = Duration::from_secs(30);

/// API requests per second that one operator makes for `OPERATOR_LOCKS` locks whose holders
/// renew every `OPERATOR_RENEW`, on the in-memory API server (it counts the requests it
/// serves; the holders' renewals are written to it directly, so only the operator's count).
pub(crate) async fn operator_section() {
    use leasehold_testkit::InMemoryApiServer;
    use leasehold_testkit::in_memory_api_server::{DISTRIBUTED_LOCKS, LEASES};
    println!(
        "## operator: {OPERATOR_LOCKS} Kubernetes-backed locks, each held by a pod renewing every {OPERATOR_RENEW:?} (requests counted for {OPERATOR_MEASURE:?})"
    );
    let api = InMemoryApiServer::new();
    let ns = "load";
    for i in 0..OPERATOR_LOCKS {
        let mut lock = leasehold_testkit::distributed_lock(
            ns,
            &format!("lock-{i}"),
            leasehold_crds::Backend {
                kubernetes: Some(Default::default()),
                ..Default::default()
            },
        );
        lock.spec.cleanup_policy = leasehold_crds::CleanupPolicy::Delete;
        lock.metadata.uid = None;
        api.put(DISTRIBUTED_LOCKS, serde_json::to_value(&lock).unwrap());
    }
    let ctx = Arc::new(leasehold_operator::reconcile::Context::new(
        api.client(),
        "operator-0",
        Arc::new(leasehold_operator::metrics::Metrics::new()),
    ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let controller = tokio::spawn(leasehold_operator::reconcile::run(ctx, None, async {
        let _ = stopped.await;
    }));
    let started = Instant::now();
    let ready = || {
        (0..OPERATOR_LOCKS).all(|i| {
            api.object(DISTRIBUTED_LOCKS, ns, &format!("lock-{i}"))
                .is_some_and(|l| l["status"]["conditions"][0]["status"] == "True")
                && api.object(LEASES, ns, &format!("lock-{i}")).is_some()
        })
    };
    while !ready() {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the locks were not all provisioned within 5 minutes"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "  provisioned {OPERATOR_LOCKS} locks in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // Every lock gets its holder, then renewals spread evenly over the interval.
    let renewals = tokio::spawn({
        let api = api.clone();
        async move {
            let tick = OPERATOR_RENEW / OPERATOR_LOCKS as u32;
            let mut interval = tokio::time::interval(tick);
            for round in 0u64.. {
                for i in 0..OPERATOR_LOCKS {
                    interval.tick().await;
                    let Some(mut lease) = api.object(LEASES, ns, &format!("lock-{i}")) else {
                        continue;
                    };
                    let now = k8s_now();
                    lease["spec"]["holderIdentity"] = serde_json::json!(format!("pod-{i}"));
                    lease["spec"]["leaseDurationSeconds"] = serde_json::json!(15);
                    lease["spec"]["renewTime"] = serde_json::json!(now);
                    if round == 0 {
                        lease["spec"]["acquireTime"] = serde_json::json!(now);
                        lease["spec"]["leaseTransitions"] = serde_json::json!(1);
                    }
                    api.put(LEASES, lease);
                }
            }
        }
    });
    // One whole round of acquisitions (and the status writes they cause) before counting.
    tokio::time::sleep(OPERATOR_RENEW + Duration::from_secs(5)).await;
    let before = api.requests();
    tokio::time::sleep(OPERATOR_MEASURE).await;
    let made = api.requests() - before;
    renewals.abort();
    let _ = stop.send(());
    let _ = controller.await;
    println!(
        "  operator API requests: {:.1}/s ({made} in {OPERATOR_MEASURE:?}); the holders' own renewals: {:.1}/s",
        made as f64 / OPERATOR_MEASURE.as_secs_f64(),
        OPERATOR_LOCKS as f64 / OPERATOR_RENEW.as_secs_f64()
    );
}

/// Now, as a Lease's `MicroTime`.
pub(crate) fn k8s_now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Microsecond)
        .unwrap()
        .to_string()
}
