//! The `leasehold-operator` binary as the chart runs it, against the in-memory Kubernetes API
//! served over HTTP (a kubeconfig names it): it issues its webhook certificate into the Secret,
//! publishes the CA as the webhook configuration's `caBundle`, turns ready only then, answers
//! admission reviews over TLS with the sidecar patch, counts them, leads, stands by with its
//! webhook serving when deposed, drains on SIGTERM, and paces its requests to the API.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use leasehold_testkit::in_memory_api_server::{
    DISTRIBUTED_LOCKS, LEASES, MUTATING_WEBHOOK_CONFIGURATIONS, SECRETS,
};
use leasehold_testkit::{InMemoryApiServer, free_port};
use serde_json::{Value, json};
use support::{chart_webhook_configuration, from_base64, post};

mod support;

const NS: &str = "leasehold-system";

struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// GET `path` on the plain-HTTP metrics port: (status, body).
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut text = String::new();
    tcp.read_to_string(&mut text).await.ok()?;
    let status = text.get(9..12)?.parse().ok()?;
    Some((status, text.split_once("\r\n\r\n")?.1.to_owned()))
}

async fn eventually<T>(
    within: Duration,
    what: &str,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> T {
    let start = Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(start.elapsed() < within, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The operator binary with `args`, reaching `api` over HTTP through a kubeconfig (kept in the
/// returned directory while it runs).
async fn start_operator(api: &InMemoryApiServer, args: &[&str]) -> (Operator, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.listen_with_kubeconfig(&kubeconfig, NS).await;
    let child = Command::new(env!("CARGO_BIN_EXE_leasehold-operator"))
        .env("KUBECONFIG", &kubeconfig)
        .env("POD_NAMESPACE", NS)
        .env("POD_NAME", "leasehold-operator-0")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the operator binary");
    (Operator(child), dir)
}

/// An API server with the chart's webhook configuration and 300 Kubernetes-backed locks: as
/// many reconciles as a new leader meets.
fn with_hundreds_of_locks() -> InMemoryApiServer {
    let api = InMemoryApiServer::new();
    api.put(
        MUTATING_WEBHOOK_CONFIGURATIONS,
        chart_webhook_configuration(&[]),
    );
    for i in 0..300 {
        api.put(
            DISTRIBUTED_LOCKS,
            json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
                   "metadata": {"name": format!("lock-{i}"), "namespace": "team"},
                   "spec": {"backend": {"kubernetes": {}}}}),
        );
    }
    api
}

/// Hundreds of locks to reconcile at once, as after a new leader: the binary sends its API
/// requests at `--api-qps` once `--api-burst` have gone, not all at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_binary_paces_its_api_requests() {
    let api = with_hundreds_of_locks();
    let (qps, burst) = (20, 10);
    let (_operator, _kubeconfig) = start_operator(
        &api,
        &[
            &format!("--metrics-listen=127.0.0.1:{}", free_port()),
            &format!("--webhook-listen=127.0.0.1:{}", free_port()),
            &format!("--api-qps={qps}"),
            &format!("--api-burst={burst}"),
        ],
    )
    .await;
    // Counted from its first request: whatever it sends later is paced the same.
    let first = api.requests();
    eventually(Duration::from_secs(30), "a first API request", async || {
        (api.requests() > first).then_some(())
    })
    .await;
    let started = Instant::now();
    let window = Duration::from_secs(4);
    tokio::time::sleep(window).await;
    let made = api.requests() - first;
    let allowed = burst + qps * (started.elapsed().as_secs_f64().ceil() as u64 + 1);
    assert!(
        made <= allowed,
        "{made} API requests in {:?}, more than {burst} at once and {qps}/s after: {:?}",
        started.elapsed(),
        api.requests_by_kind()
    );
    assert!(
        made >= qps,
        "only {made} API requests in {window:?}: the operator is not reconciling"
    );
}

/// A leader whose reconciles wait on a small request budget (`--api-qps 2`, hundreds of locks)
/// still renews its election Lease every renew interval: the election's requests do not queue
/// behind the reconciles', or the leader would be deposed, and its successor resync every lock
/// into the same queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_renews_its_lease_while_its_reconciles_wait_for_the_request_budget() {
    let api = with_hundreds_of_locks();
    let (_operator, _kubeconfig) = start_operator(
        &api,
        &[
            &format!("--metrics-listen=127.0.0.1:{}", free_port()),
            &format!("--webhook-listen=127.0.0.1:{}", free_port()),
            "--api-qps=2",
            "--api-burst=2",
        ],
    )
    .await;
    let lease = || api.object(LEASES, NS, "leasehold-operator");
    let renewed = |lease: &Value| {
        (
            lease["spec"]["holderIdentity"].clone(),
            lease["spec"]["renewTime"].clone(),
        )
    };
    let mut last = eventually(Duration::from_secs(30), "a leader", async || {
        lease()
            .filter(|l| l["spec"]["holderIdentity"] == "leasehold-operator-0")
            .map(|l| renewed(&l))
    })
    .await;
    let (watched, mut since) = (Instant::now(), Instant::now());
    let mut longest = Duration::ZERO;
    while watched.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = renewed(&lease().expect("the election Lease"));
        assert_eq!(
            now.0,
            "leasehold-operator-0",
            "the leader lost its Lease: {:?}",
            api.requests_by_kind()
        );
        if now != last {
            (last, since) = (now, Instant::now());
        }
        longest = longest.max(since.elapsed());
    }
    // Renewed every 5 s; a renewal may be tried again within its interval.
    assert!(
        longest < Duration::from_secs(10),
        "the leader's Lease went {longest:?} without a renewal: {:?}",
        api.requests_by_kind()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_binary_issues_its_certificate_and_serves_the_webhook() {
    let api = InMemoryApiServer::new();
    api.put(
        MUTATING_WEBHOOK_CONFIGURATIONS,
        chart_webhook_configuration(&[]),
    );
    api.put(
        DISTRIBUTED_LOCKS,
        json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
               "metadata": {"name": "nightly-report", "namespace": "team"},
               "spec": {"backend": {"kubernetes": {}}}}),
    );
    let (metrics_port, webhook_port) = (free_port(), free_port());
    let (mut operator, _kubeconfig) = start_operator(
        &api,
        &[
            &format!("--metrics-listen=127.0.0.1:{metrics_port}"),
            &format!("--webhook-listen=127.0.0.1:{webhook_port}"),
            "--sidecar-image=registry.example/leasehold:9",
        ],
    )
    .await;

    eventually(Duration::from_secs(30), "/readyz answers 200", async || {
        get(metrics_port, "/readyz")
            .await
            .filter(|(status, _)| *status == 200)
    })
    .await;
    let secret = api
        .object(SECRETS, NS, "leasehold-webhook-tls")
        .expect("the webhook Secret");
    let ca = eventually(Duration::from_secs(10), "the caBundle", async || {
        let configuration = api
            .object(MUTATING_WEBHOOK_CONFIGURATIONS, "", "leasehold")
            .unwrap();
        configuration["webhooks"][0]["clientConfig"]["caBundle"]
            .as_str()
            .map(str::to_owned)
    })
    .await;
    assert_eq!(Value::String(ca.clone()), secret["data"]["ca.crt"]);
    let ca = from_base64(&ca);

    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "e2e-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "team", "operation": "CREATE", "userInfo": {},
            "object": leasehold_testkit::with_service_account_token(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "app-1", "namespace": "team",
                             "annotations": {"leasehold.dev/lock": "nightly-report"}},
                "spec": {"containers": [{"name": "app", "image": "example/app:1"}]}}))
        }
    })
    .to_string();
    let webhook: std::net::SocketAddr = format!("127.0.0.1:{webhook_port}").parse().unwrap();
    let (status, body, _) = post(webhook, &ca, time::OffsetDateTime::now_utc(), &review)
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["response"]["uid"], "e2e-1");
    let patch = from_base64(answer["response"]["patch"].as_str().unwrap());
    assert!(
        patch.contains("registry.example/leasehold:9") && patch.contains("team/nightly-report"),
        "the flags reached the patch: {patch}"
    );

    let (_, metrics) = eventually(Duration::from_secs(15), "leader and counted", async || {
        get(metrics_port, "/metrics").await.filter(|(_, m)| {
            m.contains("leasehold_operator_leader 1")
                && m.contains("leasehold_operator_admissions_total{result=\"injected\"} 1")
        })
    })
    .await;
    assert!(!metrics.contains("PRIVATE KEY"));
    // The self-managed serving certificate lasts 90 days: its end is published for the alert.
    let expiry: i64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("leasehold_operator_webhook_certificate_expiry_timestamp_seconds ")
        })
        .expect("the certificate's end is a metric")
        .parse()
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (now + 80 * 86_400..=now + 91 * 86_400).contains(&expiry),
        "{expiry} is not about 90 days from {now}"
    );

    // Another replica takes the election Lease: this one stops reconciling but stays up, and
    // its webhook answers on.
    let mut lease = api
        .object(LEASES, NS, "leasehold-operator")
        .expect("the election Lease");
    lease["spec"]["holderIdentity"] = json!("leasehold-operator-1");
    lease["spec"]["renewTime"] = json!(now_micro_time());
    api.put(LEASES, lease.clone());
    eventually(Duration::from_secs(20), "deposed", async || {
        get(metrics_port, "/metrics")
            .await
            .filter(|(_, m)| m.contains("leasehold_operator_leader 0"))
    })
    .await;
    assert!(
        operator.0.try_wait().unwrap().is_none(),
        "a deposed replica exited: the webhook went with it"
    );
    let (status, body, _) = post(webhook, &ca, time::OffsetDateTime::now_utc(), &review)
        .await
        .unwrap();
    assert_eq!(status, 200, "a deposed replica's webhook: {body}");
    // The other replica steps down: this one leads again.
    lease["spec"]["holderIdentity"] = Value::Null;
    api.put(LEASES, lease);
    eventually(Duration::from_secs(20), "leading again", async || {
        get(metrics_port, "/metrics")
            .await
            .filter(|(_, m)| m.contains("leasehold_operator_leader 1"))
    })
    .await;

    // SIGTERM: not ready at once, the webhook still answers while endpoints catch up, then a
    // clean exit.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(operator.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    eventually(
        Duration::from_secs(3),
        "not ready after SIGTERM",
        async || {
            get(metrics_port, "/readyz")
                .await
                .filter(|(status, _)| *status == 503)
        },
    )
    .await;
    let (status, body, _) = post(webhook, &ca, time::OffsetDateTime::now_utc(), &review)
        .await
        .expect("the webhook stopped answering at SIGTERM");
    assert_eq!(status, 200, "{body}");
    assert!(
        operator.0.try_wait().unwrap().is_none(),
        "exited without draining"
    );
    let status = eventually(Duration::from_secs(15), "exit after SIGTERM", async || {
        operator.0.try_wait().unwrap()
    })
    .await;
    assert!(status.success(), "{status:?}");
}

/// A Lease's `renewTime`, now.
fn now_micro_time() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}
