//! `operator`: the operator's API requests per second with many Kubernetes-backed locks held
//! and renewed.

use super::*;

/// The operator's load: locks in their thousands (`cleanupPolicy: Delete`, so each Lease is
/// the operator's), each held by a pod that renews every `OPERATOR_RENEW`, and how long the
/// operator's requests are counted once every lock is ready.
pub(crate) const OPERATOR_LOCKS: [usize; 2] = [1_000, 10_000];
pub(crate) const OPERATOR_RENEW: Duration = Duration::from_secs(5);
pub(crate) const OPERATOR_MEASURE: Duration = Duration::from_secs(30);
/// How long the operator binary runs before its memory is read: its election, then a first
/// reconcile of every lock.
pub(crate) const OPERATOR_MEMORY_WINDOW: Duration = Duration::from_secs(60);

/// API requests per second that one operator makes for each count of locks whose holders
/// renew every `OPERATOR_RENEW`, on the in-memory API server (it counts the requests it serves;
/// the holders' renewals are written to it directly, so only the operator's count), then what
/// a new leader costs: the first reconcile of every lock.
pub(crate) async fn operator_section() {
    for locks in OPERATOR_LOCKS {
        operator_load(locks).await;
    }
}

fn start_operator(
    client: kube::Client,
    name: &str,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let ctx = Arc::new(leasehold_operator::reconcile::Context::new(
        client,
        name,
        Arc::new(leasehold_operator::metrics::Metrics::new()),
    ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let controller = tokio::spawn(leasehold_operator::reconcile::run(
        ctx,
        leasehold_operator::config::Watched::AllNamespaces,
        async {
            let _ = stopped.await;
        },
    ));
    (stop, controller)
}

async fn operator_load(locks: usize) {
    use leasehold_testkit::InMemoryApiServer;
    use leasehold_testkit::in_memory_api_server::{DISTRIBUTED_LOCKS, LEASES};
    println!(
        "## operator: {locks} Kubernetes-backed locks, each held by a pod renewing every {OPERATOR_RENEW:?} (requests counted for {OPERATOR_MEASURE:?})"
    );
    let api = InMemoryApiServer::new();
    let ns = "load";
    for i in 0..locks {
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
    let (stop, controller) = start_operator(api.client(), "operator-0");
    let started = Instant::now();
    let first_requests = api.requests();
    let ready = || {
        (0..locks).all(|i| {
            api.object(DISTRIBUTED_LOCKS, ns, &format!("lock-{i}"))
                .is_some_and(|l| l["status"]["conditions"][0]["status"] == "True")
                && api.object(LEASES, ns, &format!("lock-{i}")).is_some()
        })
    };
    while !ready() {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the locks were not all provisioned within 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "  provisioned {locks} locks in {:.1} s, {} API requests",
        started.elapsed().as_secs_f64(),
        api.requests() - first_requests
    );
    // Every lock gets its holder, then renewals spread evenly over the interval.
    let renewals = tokio::spawn({
        let api = api.clone();
        async move {
            let tick = OPERATOR_RENEW / locks as u32;
            let mut interval = tokio::time::interval(tick);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            for round in 0u64.. {
                for i in 0..locks {
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
    println!(
        "  steady: operator API requests {:.1}/s ({made} in {OPERATOR_MEASURE:?}); the holders' own renewals: {:.1}/s",
        made as f64 / OPERATOR_MEASURE.as_secs_f64(),
        locks as f64 / OPERATOR_RENEW.as_secs_f64()
    );
    // A new leader: the operator stops, another starts and reconciles every lock once.
    let _ = stop.send(());
    let _ = controller.await;
    let before = api.requests();
    let kinds_before = api.requests_by_kind();
    let (stop, controller) = start_operator(api.client(), "operator-1");
    tokio::time::sleep(OPERATOR_MEASURE).await;
    let made = api.requests() - before;
    let per_lock = made as f64 / locks as f64;
    println!(
        "  a new leader's first {OPERATOR_MEASURE:?}, unpaced: {made} API requests ({per_lock:.1} per lock, {:.1}/s)",
        made as f64 / OPERATOR_MEASURE.as_secs_f64()
    );
    let kinds: Vec<String> = api
        .requests_by_kind()
        .into_iter()
        .map(|(kind, n)| {
            (
                kind.clone(),
                n - kinds_before.get(&kind).copied().unwrap_or(0),
            )
        })
        .filter(|(_, n)| *n > 0)
        .map(|(kind, n)| format!("{kind} {n}"))
        .collect();
    println!("    by request: {}", kinds.join(", "));
    // The same with the operator's default pacing (`--api-qps`, `--api-burst`).
    let _ = stop.send(());
    let _ = controller.await;
    let (qps, burst) = (
        leasehold_operator::api_rate_limit::DEFAULT_QPS,
        leasehold_operator::api_rate_limit::DEFAULT_BURST,
    );
    let paced = kube::Client::new(
        tower::Layer::layer(
            &leasehold_operator::api_rate_limit::ApiRateLimitLayer::new(qps, burst),
            api.clone().service(),
        ),
        "default",
    );
    let before = api.requests();
    let (stop, controller) = start_operator(paced, "operator-2");
    tokio::time::sleep(OPERATOR_MEASURE).await;
    let paced_made = api.requests() - before;
    println!(
        "  a new leader's first {OPERATOR_MEASURE:?}, paced at {qps}/s (burst {burst}): {paced_made} API requests ({:.1}/s); every lock reconciled in about {:.0} s (derived)",
        paced_made as f64 / OPERATOR_MEASURE.as_secs_f64(),
        made as f64 / f64::from(qps)
    );
    // A resync does what a new leader's first reconcile does, once per period per lock: a
    // figure derived from the two measured above, since a window of the period is too long.
    let period = leasehold_operator::reconcile::RESYNC_WATCHED;
    println!(
        "  resyncs, one every {period:?} per lock on average: {:.1} API requests/s (derived)",
        per_lock * locks as f64 / period.as_secs_f64()
    );
    let _ = stop.send(());
    let _ = controller.await;
    operator_memory(&api, locks).await;
    renewals.abort();
}

/// The operator binary, in a process of its own (the figures above share one with the API
/// server), leading and reconciling every lock of `api` over HTTP while their holders renew:
/// its resident memory after [`OPERATOR_MEMORY_WINDOW`], and its peak.
async fn operator_memory(api: &leasehold_testkit::InMemoryApiServer, locks: usize) {
    let dir = tempfile::tempdir().expect("temp dir");
    let kubeconfig = dir.path().join("kubeconfig");
    api.listen_with_kubeconfig(&kubeconfig, "default").await;
    // A mounted certificate (as with cert-manager), so that the webhook issues none.
    leasehold_testkit::write_test_certificates(dir.path());
    for (from, to) in [("server.crt", "tls.crt"), ("server.key", "tls.key")] {
        std::fs::copy(dir.path().join(from), dir.path().join(to)).expect("certificate");
    }
    let qps = 1_000;
    let before = api.requests();
    let operator = Process(
        Command::new(sibling_binary("leasehold-operator"))
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAMESPACE", "leasehold-system")
            .env("POD_NAME", "operator-3")
            .env("RUST_LOG", "warn")
            .args([
                format!("--metrics-listen=127.0.0.1:{}", free_port()),
                format!("--webhook-listen=127.0.0.1:{}", free_port()),
                format!("--api-qps={qps}"),
                format!("--api-burst={qps}"),
            ])
            .arg("--webhook-cert-dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the operator binary"),
    );
    tokio::time::sleep(OPERATOR_MEMORY_WINDOW).await;
    let pid = operator.0.id();
    println!(
        "  the operator binary, {locks} locks (its own process, --api-qps {qps}): {} API requests in {OPERATOR_MEMORY_WINDOW:?}; resident {:.0} MiB, peak {:.0} MiB (target: under 256 MiB)",
        api.requests() - before,
        rss_kib(pid) as f64 / 1024.0,
        peak_rss_kib(pid) as f64 / 1024.0
    );
}

/// Now, as a Lease's `MicroTime`.
pub(crate) fn k8s_now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Microsecond)
        .unwrap()
        .to_string()
}
