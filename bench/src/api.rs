//! `api`: keyed acquire+release cycles as apps make them, through a sidecar over loopback (the
//! keyed HTTP routes, Dapr's HTTP and gRPC lock APIs, one keep-alive connection per owner),
//! beside the same cycles through the library (a family in this process) and raw through the
//! backend's own client, measured in the same run: cycles per second, request latency
//! percentiles, and the sidecar's CPU per request.

use super::*;

use leasehold_sidecar::dapr::{TryLockRequest, TryLockResponse, UnlockRequest, UnlockResponse};

/// Owners cycling at once, each on a key of its own, and how long each run lasts.
const API_OWNERS: [usize; 2] = [1, 16];
const API_DURATION: Duration = Duration::from_secs(3);
/// The backends measured.
const API_BACKENDS: [&str; 3] = ["redis", "postgres", "etcd"];
/// The family the sidecar serves (and Dapr's lock store by the same name).
const FAMILY: &str = "orders";

/// How an owner asks for its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// `POST /locks/orders/keys/KEY/acquire?owner=O`, then `.../release?owner=O`.
    KeyedHttp,
    /// Dapr's `POST /v1.0-alpha1/lock/orders` and `/v1.0-alpha1/unlock/orders`.
    DaprHttp,
    /// Dapr's `TryLockAlpha1` and `UnlockAlpha1`.
    DaprGrpc,
}

impl Route {
    fn label(self) -> &'static str {
        match self {
            Self::KeyedHttp => "keyed HTTP routes",
            Self::DaprHttp => "Dapr HTTP",
            Self::DaprGrpc => "Dapr gRPC",
        }
    }
}

/// What one run of owners measured: cycles per second and every request's (or library call's)
/// latency, sorted.
struct Run {
    cycles_per_second: f64,
    latencies: Vec<Duration>,
}

impl Run {
    fn from_owners(results: Vec<(u64, Vec<Duration>)>, elapsed: Duration) -> Self {
        let cycles: u64 = results.iter().map(|(c, _)| c).sum();
        let mut latencies: Vec<Duration> = results.into_iter().flat_map(|(_, l)| l).collect();
        latencies.sort();
        Self {
            cycles_per_second: cycles as f64 / elapsed.as_secs_f64(),
            latencies,
        }
    }

    fn percentile(&self, q: f64) -> Duration {
        self.latencies[((self.latencies.len() - 1) as f64 * q).round() as usize]
    }

    fn describe(&self) -> String {
        format!(
            "{:>8.0} cycles/s   p50 {:>6.3} ms   p90 {:>6.3} ms   p99 {:>6.3} ms",
            self.cycles_per_second,
            self.percentile(0.5).as_secs_f64() * 1e3,
            self.percentile(0.9).as_secs_f64() * 1e3,
            self.percentile(0.99).as_secs_f64() * 1e3
        )
    }
}

pub(crate) async fn api_section() {
    println!(
        "## api: keyed acquire+release cycles through a sidecar's routes ({API_DURATION:?} per run, one keep-alive connection per owner), beside the library and raw, in one run"
    );
    let backends = KeyedBackends::start();
    for (backend, url) in backends.urls() {
        if !API_BACKENDS.contains(&backend) {
            continue;
        }
        let driver = connect_driver(backend, &url).await;
        let sidecar = ApiSidecar::start(&url);
        let family = leasehold_lease::keyed::KeyedFamily::new(
            driver,
            leasehold_lease::keyed::FamilyConfig::new("orders-lib", "bench", LEASE),
            Arc::new(()),
        )
        .expect("family");
        for owners in API_OWNERS {
            println!("  {backend}, {owners} owner(s):");
            let library = library_run(&family, owners).await;
            println!("    {:<20} {}", "library (in process)", library.describe());
            for route in [Route::KeyedHttp, Route::DaprHttp, Route::DaprGrpc] {
                let cpu_before = cpu_seconds_of(sidecar.pid());
                let client_cpu_before = process_cpu_seconds();
                let run = route_run(&sidecar, route, owners).await;
                let requests = run.latencies.len() as f64;
                let cpu_per_request = (cpu_seconds_of(sidecar.pid()) - cpu_before) / requests;
                let client_cpu_per_request = (process_cpu_seconds() - client_cpu_before) / requests;
                println!(
                    "    {:<20} {}   p50 over the library's call {:+.3} ms   {:.0}% of the library's cycles   sidecar CPU {:.0} us/request   client CPU {:.0} us/request",
                    route.label(),
                    run.describe(),
                    (run.percentile(0.5).as_secs_f64() - library.percentile(0.5).as_secs_f64())
                        * 1e3,
                    100.0 * run.cycles_per_second / library.cycles_per_second,
                    cpu_per_request * 1e6,
                    client_cpu_per_request * 1e6
                );
            }
            if owners == KEYED_OWNERS {
                let raw = match backend {
                    "redis" => Some(keyed_redis_raw_cycles(&url).await),
                    "postgres" => Some(keyed_postgres_raw_cycles(&url).await),
                    _ => None,
                };
                if let Some(raw) = raw {
                    println!(
                        "    {:<20} {raw:>8.0} cycles/s (the backend's own client, no fencing, no restart guard)",
                        "raw"
                    );
                }
            }
        }
        family.shutdown().await;
    }
    println!(
        "  targets: a Dapr call within 0.3 ms p50 of the keyed HTTP route; the keyed HTTP route within 0.3 ms p50 of the library's call; at {KEYED_OWNERS} owners the HTTP path at least 60% of the library's cycles"
    );
}

/// A sidecar serving the family [`FAMILY`] on `url`, with Dapr's HTTP and gRPC APIs.
struct ApiSidecar {
    process: Process,
    lock_api: SocketAddr,
    dapr_http: SocketAddr,
    dapr_grpc: SocketAddr,
}

impl ApiSidecar {
    fn start(url: &str) -> Self {
        let [lock_api, dapr_http, dapr_grpc, probes] =
            [(); 4].map(|()| SocketAddr::from(([127, 0, 0, 1], free_port())));
        let process = Process(
            Command::new(sibling_binary("leasehold-sidecar"))
                .args(["--keyed", FAMILY, "--identity", "bench", "--backend", url])
                .args(["--listen", &lock_api.to_string()])
                .args(["--probe-listen", &probes.to_string()])
                .args(["--dapr-http-listen", &dapr_http.to_string()])
                .args(["--dapr-grpc-listen", &dapr_grpc.to_string()])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start sidecar"),
        );
        Self {
            process,
            lock_api,
            dapr_http,
            dapr_grpc,
        }
    }

    fn pid(&self) -> u32 {
        self.process.0.id()
    }
}

/// `owners` owners at once, owner `i` a task running `owner(start, key, owner)` on key
/// `order-i` as `worker-i` until [`API_DURATION`] after `start`: its cycles and latencies.
async fn owners_run<F, Fut>(owners: usize, owner: F) -> Run
where
    F: Fn(Instant, String, String) -> Fut,
    Fut: std::future::Future<Output = (u64, Vec<Duration>)> + Send + 'static,
{
    let start = Instant::now();
    let tasks: Vec<_> = (0..owners)
        .map(|i| tokio::spawn(owner(start, format!("order-{i}"), format!("worker-{i}"))))
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.expect("owner"));
    }
    Run::from_owners(results, start.elapsed())
}

/// `owners` owners of `family`, each cycling on a key of its own for [`API_DURATION`].
async fn library_run(family: &leasehold_lease::keyed::KeyedFamily, owners: usize) -> Run {
    owners_run(owners, |start, key, owner| {
        let family = family.clone();
        async move {
            let (mut cycles, mut latencies) = (0u64, Vec::new());
            while start.elapsed() < API_DURATION {
                let sent = Instant::now();
                let answer = family
                    .acquire(&key, &owner, Duration::ZERO, LEASE)
                    .await
                    .expect("acquire");
                latencies.push(sent.elapsed());
                assert!(
                    matches!(answer, leasehold_lease::keyed::KeyAnswer::Held { .. }),
                    "{key}: {answer:?}"
                );
                let sent = Instant::now();
                family.release(&key, &owner).await.expect("release");
                latencies.push(sent.elapsed());
                cycles += 1;
            }
            (cycles, latencies)
        }
    })
    .await
}

/// `owners` owners cycling through `route` of `sidecar`, each on a connection and a key of its
/// own, for [`API_DURATION`].
async fn route_run(sidecar: &ApiSidecar, route: Route, owners: usize) -> Run {
    wait_until_serving(
        sidecar.lock_api,
        &format!("/locks/{FAMILY}/keys/warm-up"),
        409,
    )
    .await;
    let (lock_api, dapr_http, dapr_grpc) = (sidecar.lock_api, sidecar.dapr_http, sidecar.dapr_grpc);
    owners_run(owners, |start, key, owner| async move {
        match route {
            Route::KeyedHttp => {
                let acquire = format!("/locks/{FAMILY}/keys/{key}/acquire?owner={owner}");
                let release = format!("/locks/{FAMILY}/keys/{key}/release?owner={owner}");
                http_cycles(lock_api, start, [("", acquire), ("", release)]).await
            }
            Route::DaprHttp => {
                let lock = format!(
                    r#"{{"resourceId":"{key}","lockOwner":"{owner}","expiryInSeconds":10}}"#
                );
                let unlock = format!(r#"{{"resourceId":"{key}","lockOwner":"{owner}"}}"#);
                http_cycles(
                    dapr_http,
                    start,
                    [
                        (&*lock, format!("/v1.0-alpha1/lock/{FAMILY}")),
                        (&*unlock, format!("/v1.0-alpha1/unlock/{FAMILY}")),
                    ],
                )
                .await
            }
            Route::DaprGrpc => grpc_cycles(dapr_grpc, start, &key, &owner).await,
        }
    })
    .await
}

/// Acquire and release requests (each a body, empty for none, and a path) on one keep-alive
/// connection until [`API_DURATION`] after `start`, each answered 200: the cycles and every
/// request's latency.
async fn http_cycles(
    addr: SocketAddr,
    start: Instant,
    requests: [(&str, String); 2],
) -> (u64, Vec<Duration>) {
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    conn.set_nodelay(true).expect("nodelay");
    let mut reader = BufReader::new(&mut conn);
    let (mut cycles, mut latencies) = (0u64, Vec::new());
    while start.elapsed() < API_DURATION {
        for (body, path) in &requests {
            let sent = Instant::now();
            let (status, answer) = request_with_body(&mut reader, "POST", path, body)
                .await
                .expect("request");
            latencies.push(sent.elapsed());
            assert_eq!(status, 200, "{path}: {answer}");
            assert!(
                !answer.contains(r#""success":false"#),
                "{path}: not taken: {answer}"
            );
        }
        cycles += 1;
    }
    (cycles, latencies)
}

/// Dapr's `TryLockAlpha1` and `UnlockAlpha1` on one HTTP/2 connection until [`API_DURATION`]
/// after `start`: the cycles and every call's latency.
async fn grpc_cycles(
    addr: SocketAddr,
    start: Instant,
    key: &str,
    owner: &str,
) -> (u64, Vec<Duration>) {
    let (mut grpc, connection) = GrpcConnection::connect(addr).await;
    let (try_lock, unlock) = (
        grpc.uri("/dapr.proto.runtime.v1.Dapr/TryLockAlpha1"),
        grpc.uri("/dapr.proto.runtime.v1.Dapr/UnlockAlpha1"),
    );
    let calls = async move {
        let (mut cycles, mut latencies) = (0u64, Vec::new());
        while start.elapsed() < API_DURATION {
            let sent = Instant::now();
            let locked: TryLockResponse = grpc
                .unary(
                    &try_lock,
                    &TryLockRequest {
                        store_name: FAMILY.to_owned(),
                        resource_id: key.to_owned(),
                        lock_owner: owner.to_owned(),
                        expiry_in_seconds: 10,
                    },
                )
                .await;
            latencies.push(sent.elapsed());
            assert!(locked.success, "{key}: not taken");
            let sent = Instant::now();
            let unlocked: UnlockResponse = grpc
                .unary(
                    &unlock,
                    &UnlockRequest {
                        store_name: FAMILY.to_owned(),
                        resource_id: key.to_owned(),
                        lock_owner: owner.to_owned(),
                    },
                )
                .await;
            latencies.push(sent.elapsed());
            assert_eq!(unlocked.status, 0, "{key}: not unlocked");
            cycles += 1;
        }
        // Dropping the connection's last sender closes it, which ends `connection`.
        drop(grpc);
        (cycles, latencies)
    };
    tokio::join!(calls, connection).0
}

/// One owner's HTTP/2 connection to a gRPC server, with no buffer between the caller and the
/// connection. The load generator shares the cores with the sidecar and the backend, so it is
/// kept as lean as the HTTP/1 client beside it: tonic's `Channel` puts a buffer task and a
/// reconnecting service in front of the connection. hyper still runs the connection on a task
/// of its own, and each answer's hand-back on another.
struct GrpcConnection {
    addr: SocketAddr,
    send: hyper::client::conn::http2::SendRequest<http_body_util::Full<hyper::body::Bytes>>,
}

impl GrpcConnection {
    /// The connection, and a future that ends when the connection does (once its last sender
    /// is dropped), failing the run should the connection fail.
    async fn connect(addr: SocketAddr) -> (Self, impl Future<Output = ()>) {
        let tcp = TcpStream::connect(addr).await.expect("connect");
        tcp.set_nodelay(true).expect("nodelay");
        let (send, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .expect("HTTP/2 handshake");
        let connection = async move {
            if let Err(e) = connection.await {
                panic!("gRPC connection to {addr}: {e}");
            }
        };
        (Self { addr, send }, connection)
    }

    /// The absolute URI of `path` on this server, as HTTP/2's pseudo-headers need it.
    fn uri(&self, path: &str) -> ::http::Uri {
        format!("http://{}{path}", self.addr).parse().expect("uri")
    }

    /// One unary call: `request` framed as gRPC's length-prefixed message, the answer checked
    /// for `grpc-status: 0` and decoded.
    async fn unary<Req, Resp>(&mut self, uri: &::http::Uri, request: &Req) -> Resp
    where
        Req: prost::Message,
        Resp: prost::Message + Default,
    {
        use http_body_util::BodyExt;
        let len = request.encoded_len();
        let mut body = Vec::with_capacity(5 + len);
        body.push(0);
        body.extend_from_slice(&u32::try_from(len).expect("message size").to_be_bytes());
        request.encode(&mut body).expect("encode");
        let request = ::http::Request::post(uri.clone())
            .header(::http::header::CONTENT_TYPE, "application/grpc")
            .header(::http::header::TE, "trailers")
            .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
            .expect("request");
        self.send.ready().await.expect("connection ready");
        let answer = self.send.send_request(request).await.expect("gRPC call");
        assert_eq!(answer.status(), 200, "{uri}: HTTP status");
        let (parts, body) = answer.into_parts();
        let body = body.collect().await.expect("gRPC answer");
        let status = body
            .trailers()
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| parts.headers.get("grpc-status"))
            .map(|s| s.to_str().unwrap_or("?").to_owned());
        assert_eq!(status.as_deref(), Some("0"), "{uri}: {parts:?}");
        let message = body.to_bytes();
        assert!(
            message.len() >= 5
                && message[0] == 0
                && u32::from_be_bytes([message[1], message[2], message[3], message[4]]) as usize
                    == message.len() - 5,
            "{uri}: not one uncompressed message"
        );
        Resp::decode(&message[5..]).expect("decode")
    }
}
