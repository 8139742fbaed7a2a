//! `--app-health`: a campaign-mode holder whose app fails its health probe sits out (answers
//! "not holder" with the reason at once, lets its lease go once its last answer has run out),
//! so that its peer takes the lock; once the app is healthy again it campaigns again. Real
//! sidecar processes on a SQLite file, and an app that answers its probe 200 or 503; then the
//! other kinds of probe: HTTPS, TCP, and gRPC's health protocol served by tonic-health.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use leasehold_e2e::{Sidecar, eventually, hands_over, unique_lock};

/// An app's health endpoint on a free loopback port: 200 while healthy, else 503.
struct App {
    port: u16,
    healthy: Arc<AtomicBool>,
}

impl App {
    fn start() -> Self {
        Self::serve(None)
    }

    /// Over TLS, with a self-signed certificate no client could verify.
    fn start_tls() -> Self {
        use tokio_rustls::rustls;
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["app.invalid".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
        Self::serve(Some(Arc::new(config)))
    }

    fn serve(tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().unwrap().port();
        let healthy = Arc::new(AtomicBool::new(true));
        let answers = healthy.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let status = if answers.load(Ordering::SeqCst) {
                    "200 OK"
                } else {
                    "503 Service Unavailable"
                };
                match &tls {
                    None => answer(conn, status),
                    Some(config) => {
                        let Ok(session) =
                            tokio_rustls::rustls::ServerConnection::new(config.clone())
                        else {
                            continue;
                        };
                        answer(
                            tokio_rustls::rustls::StreamOwned::new(session, conn),
                            status,
                        );
                    }
                }
            }
        });
        Self { port, healthy }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/healthz", self.port)
    }

    fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::SeqCst);
    }
}

/// Reads the request (one read: probes are short) and answers `status`.
fn answer(mut conn: impl Read + Write, status: &str) {
    let mut request = [0u8; 1024];
    let _ = conn.read(&mut request);
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let _ = conn.flush();
}

const TIMING: [&str; 4] = ["--lease-duration", "3s", "--renew-interval", "1s"];

/// A sidecar's flags: [`TIMING`], and `url` probed every 200 ms, two failures in a row making
/// its campaign locks sit out.
fn probing(url: &str) -> Vec<&str> {
    [
        &TIMING[..],
        &[
            "--app-health",
            url,
            "--app-health-period",
            "200ms",
            "--app-health-failures",
            "2",
        ],
    ]
    .concat()
}

#[test]
fn a_holder_whose_app_is_unhealthy_sits_out_and_its_peer_takes_over() {
    let dir = tempfile::tempdir().unwrap();
    let backend = format!("sqlite://{}", dir.path().join("locks.db").display());
    let lock = unique_lock("app-health");
    let app = App::start();
    let app_url = app.url();
    let a = Sidecar::start("pod-a", &backend, &lock, &probing(&app_url));
    eventually(Duration::from_secs(5), "pod a holds", || a.is_holder());
    let first = a.get("/lock").token();
    let b = Sidecar::start("pod-b", &backend, &lock, &TIMING);
    assert!(a.get("/metrics").body.contains("leasehold_app_healthy 1"));

    app.set_healthy(false);
    let failing = Instant::now();
    // Until it steps down, pod a answers as holder; pod b takes over only once the last such
    // answer has run out (its lease is released then: within a lease).
    let stepped_down = hands_over(&a, &b, Duration::from_secs(10), |reply| {
        reply.status == 409 && reply.body.contains("the app is unhealthy")
    }) - failing;
    assert!(b.get("/lock").token() > first);
    let metrics = a.get("/metrics").body;
    assert!(metrics.contains("leasehold_app_healthy 0"), "{metrics}");
    let failures: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("leasehold_app_probe_failures_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no probe failure count: {metrics}"));
    assert!(failures >= 2, "{failures} failed probes counted");
    eprintln!("pod a stepped down {stepped_down:?} after its app began to fail");

    // Healthy again: pod a campaigns, and takes the lock once pod b is gone.
    app.set_healthy(true);
    eventually(
        Duration::from_secs(3),
        "pod a's app is healthy again",
        || a.get("/metrics").body.contains("leasehold_app_healthy 1"),
    );
    let reply = a.get("/lock");
    assert_eq!(reply.status, 409, "{}", reply.body);
    assert!(!reply.body.contains("unhealthy"), "{}", reply.body);
    drop(b);
    eventually(Duration::from_secs(10), "pod a holds again", || {
        a.is_holder()
    });
}

/// A campaign-mode sidecar probing `url` holds while the app is healthy, sits out with the
/// reason naming the endpoint once `set_healthy(false)` makes the probes fail, and holds again
/// once the app is healthy (when the app can `come_back`).
fn sits_out_while_unhealthy(url: &str, set_healthy: impl Fn(bool), comes_back: bool) {
    let dir = tempfile::tempdir().unwrap();
    let backend = format!("sqlite://{}", dir.path().join("locks.db").display());
    let lock = unique_lock("app-health-kinds");
    let a = Sidecar::start("pod-a", &backend, &lock, &probing(url));
    eventually(Duration::from_secs(5), "pod a holds", || a.is_holder());
    assert!(a.get("/metrics").body.contains("leasehold_app_healthy 1"));
    set_healthy(false);
    eventually(Duration::from_secs(5), "pod a sits out", || {
        let reply = a.get("/lock");
        reply.status == 409 && reply.body.contains("the app is unhealthy")
    });
    let reply = a.get("/lock");
    assert!(reply.body.contains(url), "{}", reply.body);
    if !comes_back {
        return;
    }
    set_healthy(true);
    eventually(Duration::from_secs(10), "pod a holds again", || {
        a.is_holder()
    });
}

#[test]
fn an_https_endpoint_is_probed_without_verifying_its_certificate() {
    let app = App::start_tls();
    let url = format!("https://127.0.0.1:{}/healthz", app.port);
    sits_out_while_unhealthy(&url, |healthy| app.set_healthy(healthy), true);
}

/// Unhealthy once the port is closed. Not opened again: a port given up may meanwhile be any
/// connection's local port, on a machine running other tests.
#[test]
fn a_tcp_endpoint_is_healthy_while_it_accepts_connections() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("tcp://127.0.0.1:{}", listener.local_addr().unwrap().port());
    let open = Arc::new(std::sync::Mutex::new(Some(listener)));
    let accepting = open.clone();
    std::thread::spawn(move || {
        loop {
            match &*accepting.lock().unwrap() {
                Some(listener) => {
                    listener.set_nonblocking(true).unwrap();
                    while let Ok((conn, _)) = listener.accept() {
                        drop(conn);
                    }
                }
                None => return,
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    sits_out_while_unhealthy(
        &url,
        |listening| {
            if !listening {
                open.lock().unwrap().take();
            }
        },
        false,
    );
}

#[test]
fn a_grpc_endpoint_is_healthy_while_its_service_is_serving() {
    const SERVICE: &str = "shop.v1.Orders";
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (reporter, service) = tonic_health::server::health_reporter();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    runtime.spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let status = |serving: bool| {
        use tonic_health::ServingStatus;
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        runtime.block_on(reporter.set_service_status(SERVICE, status));
    };
    status(true);
    let url = format!("grpc://127.0.0.1:{port}/{SERVICE}");
    sits_out_while_unhealthy(&url, status, true);
}

#[test]
fn a_bad_app_health_endpoint_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let backend = format!("sqlite://{}", dir.path().join("locks.db").display());
    for (args, says) in [
        (
            &["--app-health", "127.0.0.1:8080/healthz"][..],
            "http://HOST:PORT/PATH",
        ),
        (
            &["--app-health", "http://127.0.0.1/healthz"][..],
            "http://HOST:PORT/PATH",
        ),
        (
            &[
                "--app-health",
                "http://127.0.0.1:8080/",
                "--app-health-failures",
                "0",
            ][..],
            "at least 1",
        ),
        (&["--app-health-period", "1s"][..], "--app-health <URL>"),
    ] {
        let output = std::process::Command::new(leasehold_e2e::sidecar_binary())
            .args(["--lock", "jobs", "--backend", &backend])
            .args(args)
            .output()
            .expect("run the sidecar");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {says:?} not in {stderr}");
    }
}
