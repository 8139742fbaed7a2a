//! `handover`: a lock handed from one sidecar to another as apps see it. Two on-demand sidecar
//! processes share a lock; one holds it, the other's `POST /lock/acquire?wait=` waits; the time
//! from the holder's `POST /lock/release` being sent to the waiter's answer, beside each
//! server's own blocking locks handed between two sessions in the same run.

use super::*;

/// Hand-overs per backend.
const API_HANDOVERS: usize = 30;
/// The target: a hand-over through the API within this many times the server's best blocking
/// lock.
const TARGET_RATIO: f64 = 2.0;

pub(crate) async fn handover_section() {
    println!(
        "## hand-over through the API: two on-demand sidecars, release sent -> the waiting acquire answers ({API_HANDOVERS} rounds, lease {LEASE:?}), beside the server's own blocking locks"
    );
    let redis = RedisServer::start();
    let postgres = PostgresServer::start();
    let mariadb = MariaDbServer::start();
    let etcd = leasehold_testkit::EtcdServer::start();
    let zookeeper = leasehold_testkit::ZooKeeperServer::start();
    let targets: [(&str, String); 7] = [
        ("redis", redis.url()),
        (
            "postgres lease mode",
            format!("{}?mode=lease", postgres.url()),
        ),
        (
            "postgres row-lock mode",
            format!("{}?mode=row-lock", postgres.url()),
        ),
        (
            "mariadb lease mode",
            format!("{}?mode=lease", mariadb.url()),
        ),
        (
            "mariadb row-lock mode",
            format!("{}?mode=row-lock", mariadb.url()),
        ),
        ("etcd", etcd.url()),
        ("zookeeper", zookeeper.url()),
    ];
    for (name, url) in targets {
        let ours = api_handovers(&url).await;
        println!("  {name:<24} through the API   : {}", describe(&ours));
        let peers: Vec<(&str, Vec<Duration>)> = match name {
            "redis" => vec![(
                "BLPOP-signalled lock",
                redis_raw_blocking_handovers(&redis.url()).await,
            )],
            "postgres lease mode" | "postgres row-lock mode" => {
                sql_peers(Dialect::Postgres, &postgres.url()).await
            }
            "mariadb lease mode" | "mariadb row-lock mode" => {
                sql_peers(Dialect::MySql, &mariadb.url()).await
            }
            "etcd" => vec![(
                "predecessor-watch lock",
                etcd_raw_handovers(etcd.port()).await,
            )],
            _ => vec![(
                "predecessor-watch lock",
                zookeeper_raw_handovers(zookeeper.port()).await,
            )],
        };
        let median = |latencies: &[Duration]| latencies[latencies.len() / 2].as_secs_f64();
        let mut best = f64::MAX;
        for (peer, latencies) in &peers {
            println!("  {name:<24} raw {peer:<17}: {}", describe(latencies));
            best = best.min(median(latencies));
        }
        let ratio = median(&ours) / best;
        println!(
            "  {name:<24} median {ratio:.1}x the best of them (target: within {TARGET_RATIO:.0}x){}",
            if ratio <= TARGET_RATIO {
                ""
            } else {
                "  MISSED"
            }
        );
    }
}

async fn sql_peers(dialect: Dialect, url: &str) -> Vec<(&'static str, Vec<Duration>)> {
    let mut peers = Vec::new();
    for (what, setup, take, give) in blocking_locks(dialect) {
        peers.push((what, raw_blocking_handovers(url, setup, take, give).await));
    }
    peers
}

/// [`API_HANDOVERS`] hand-overs of one lock between two on-demand sidecars on `url`.
async fn api_handovers(url: &str) -> Vec<Duration> {
    let lock = format!("handover-{}", free_port());
    let sidecars = [
        OnDemandSidecar::start(url, &lock, "a"),
        OnDemandSidecar::start(url, &lock, "b"),
    ];
    for sidecar in &sidecars {
        wait_until_serving(sidecar.probes, "/readyz", 200).await;
    }
    let mut connections = Vec::new();
    for sidecar in &sidecars {
        connections.push(connect_to(sidecar.addr).await);
    }
    const ACQUIRE: &str = "/lock/acquire?wait=60s&hold=5m";
    let (status, body) = post(&mut connections[0], ACQUIRE).await;
    assert_eq!(status, 200, "first acquisition: {body}");
    let mut latencies = Vec::new();
    for round in 0..API_HANDOVERS {
        let (holder, waiter) = (round % 2, (round + 1) % 2);
        let mut waiting_conn = std::mem::replace(
            &mut connections[waiter],
            connect_to(sidecars[waiter].addr).await,
        );
        let waiting = tokio::spawn(async move {
            let answer = post(&mut waiting_conn, ACQUIRE).await;
            (answer, Instant::now(), waiting_conn)
        });
        // Release at a random point of the waiter's wait, as a real release would.
        let settle: u64 = rand::Rng::random_range(&mut rand::rng(), 100..600);
        tokio::time::sleep(Duration::from_millis(settle)).await;
        let released = Instant::now();
        let (status, body) = post(&mut connections[holder], "/lock/release").await;
        assert_eq!(status, 200, "round {round}: release: {body}");
        let ((status, body), held, conn) = waiting.await.expect("waiter");
        assert_eq!(status, 200, "round {round}: the waiter: {body}");
        latencies.push(held - released);
        connections[waiter] = conn;
    }
    latencies.sort();
    latencies
}

async fn connect_to(addr: SocketAddr) -> TcpStream {
    let conn = TcpStream::connect(addr).await.expect("connect");
    conn.set_nodelay(true).expect("nodelay");
    conn
}

/// One request on a keep-alive connection, which holds no answer but this one's.
async fn post(conn: &mut TcpStream, path: &str) -> (u16, String) {
    request_with_body(&mut BufReader::new(conn), "POST", path, "")
        .await
        .expect("request")
}

/// Where the sidecars' logs go: a directory named by [`LOG_DIR_VAR`], to trace a hand-over
/// (with [`LOG_FILTER_VAR`] as their `RUST_LOG`, e.g. `debug,sqlx=debug`); nowhere by default.
const LOG_DIR_VAR: &str = "LEASEHOLD_BENCH_SIDECAR_LOGS";
const LOG_FILTER_VAR: &str = "LEASEHOLD_BENCH_SIDECAR_LOG_FILTER";

fn log_file(lock: &str, identity: &str) -> Stdio {
    match std::env::var_os(LOG_DIR_VAR) {
        None => Stdio::null(),
        Some(dir) => {
            let path = std::path::Path::new(&dir).join(format!("{lock}-{identity}.log"));
            std::fs::File::create(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
                .into()
        }
    }
}

/// A sidecar process holding `lock` on demand, as `identity`.
struct OnDemandSidecar {
    _process: Process,
    addr: SocketAddr,
    probes: SocketAddr,
}

impl OnDemandSidecar {
    fn start(url: &str, lock: &str, identity: &str) -> Self {
        let [addr, probes] = [(); 2].map(|()| SocketAddr::from(([127, 0, 0, 1], free_port())));
        let process = Process(
            Command::new(sibling_binary("leasehold-sidecar"))
                .args([
                    "--lock",
                    lock,
                    "--mode",
                    "on-demand",
                    "--identity",
                    identity,
                ])
                .args(["--backend", url])
                .args(["--lease-duration", &format!("{}s", LEASE.as_secs())])
                .args(["--listen", &addr.to_string()])
                .args(["--probe-listen", &probes.to_string()])
                .env(
                    "RUST_LOG",
                    std::env::var(LOG_FILTER_VAR).unwrap_or("warn".into()),
                )
                .stdout(Stdio::null())
                .stderr(log_file(lock, identity))
                .spawn()
                .expect("start sidecar"),
        );
        Self {
            _process: process,
            addr,
            probes,
        }
    }
}
