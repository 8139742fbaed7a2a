#![forbid(unsafe_code)]
//! The benchmark command (`scripts/bench`). Every figure is printed beside a baseline measured in
//! the same run on the same machine:
//!
//! 1. `GET /lock` through the sidecar against a bare axum handler returning a constant;
//! 2. acquire+release cycles per driver against the raw protocol on one connection;
//! 3. graceful hand-over latency (holder releases -> waiter holds), per driver;
//! 4. the sidecar's idle resident memory.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold_lease::sql::{Dialect, SqlDriver, SqlMode};
use leasehold_lease::testkit::redis_server::field;
use leasehold_lease::testkit::{
    MariaDbServer, PostgresServer, REDLOCK_MASTERS, RedisServer, SqliteHarness, free_port,
    mariadb_server,
};
use leasehold_lease::{Acquire, Answer, Backend, Lock, LockConfig, Mode};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Concurrent keep-alive connections of the HTTP load generator.
const HTTP_CONNECTIONS: usize = 8;
const HTTP_DURATION: Duration = Duration::from_secs(3);
const HTTP_ROUNDS: usize = 3;
const CYCLES: usize = 2000;
const ROUNDS: usize = 3;
const HANDOVERS: usize = 20;
const LEASE: Duration = Duration::from_secs(15);

/// The sidecar's allocator, so that the sidecar's code run here costs what it costs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let [_, mode, port] = args.as_slice()
        && mode == "--bare-axum"
    {
        bare_axum(port.parse().expect("port"));
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads())
        .enable_all()
        .build()
        .expect("runtime");
    let sections: Vec<&str> = args[1..].iter().map(String::as_str).collect();
    if let Some(unknown) = sections.iter().find(|s| !SECTIONS.contains(s)) {
        eprintln!(
            "unknown section {unknown:?}; usage: leasehold-bench [{}]...",
            SECTIONS.join("|")
        );
        std::process::exit(2);
    }
    runtime.block_on(run(&sections));
}

/// The load generator's runtime threads: the sidecar's (2) unless [`WORKER_THREADS_VAR`] says
/// otherwise, to see how a figure and its baseline depend on the threads they share.
const WORKER_THREADS: usize = 2;
const WORKER_THREADS_VAR: &str = "LEASEHOLD_BENCH_WORKER_THREADS";

fn worker_threads() -> usize {
    match std::env::var(WORKER_THREADS_VAR) {
        Err(_) => WORKER_THREADS,
        Ok(v) => match v.parse() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("{WORKER_THREADS_VAR}={v:?}: expected a number of threads, at least 1");
                std::process::exit(2);
            }
        },
    }
}

/// The benchmark's sections, all of them when none is named on the command line.
const SECTIONS: &[&str] = &[
    "http",
    "drivers",
    "sql",
    "etcd",
    "zookeeper",
    "keyed",
    "keyed-many",
    "safety",
    "operator",
    "tls",
    "tair",
    "sentinel",
    "cluster",
];
/// The operator's load: this many Kubernetes-backed locks (`cleanupPolicy: Delete`, so each
/// Lease is owned by its lock), each held by a pod that renews every `OPERATOR_RENEW`, and how
/// long the operator's requests are counted once every lock is ready.
const OPERATOR_LOCKS: usize = 1000;
const OPERATOR_RENEW: Duration = Duration::from_secs(5);
const OPERATOR_MEASURE: Duration = Duration::from_secs(30);
/// Keyed locks: concurrent owners, each cycling on a key of its own, and how long each run is.
const KEYED_OWNERS: usize = 16;
const KEYED_DURATION: Duration = Duration::from_secs(3);
/// One sidecar holding this many keys of one family at once, its requests counted this long.
const MANY_KEYS: usize = 10_000;
const MANY_KEYS_MEASURE: Duration = Duration::from_secs(15);
/// The idle-waiter measurement: how many waiters, on which leases (a short one, and the default
/// 15 s), renewing every third of the lease, measured for at least 15 s and 5 renew intervals.
const IDLE_WAITERS: usize = 100;
const IDLE_LEASES: [Duration; 2] = [Duration::from_secs(3), Duration::from_secs(15)];
const IDLE_MEASURE: Duration = Duration::from_secs(15);

/// A plain etcd client on the local server, for the raw baselines.
async fn raw_etcd_client(port: u16) -> leasehold_lease::drivers::queue::etcd_rpc::EtcdClient {
    use leasehold_lease::drivers::queue::etcd_rpc::{Connect, EtcdClient};
    EtcdClient::connect(Connect {
        endpoints: &[format!("127.0.0.1:{port}")],
        tls: None,
        user: None,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
    })
    .await
    .expect("etcd")
}

/// The raw client operations of the simplest etcd lock: grant a lease, put the key with it,
/// revoke the lease.
async fn etcd_raw_cycles(port: u16) -> f64 {
    use leasehold_lease::drivers::queue::etcd_rpc::PutRequest;
    let client = raw_etcd_client(port).await;
    let start = Instant::now();
    for _ in 0..CYCLES {
        let lease = client.lease_grant(15).await.expect("grant");
        client
            .put(PutRequest {
                key: b"raw/lock".to_vec(),
                value: b"bench".to_vec(),
                lease: lease.id,
            })
            .await
            .expect("put");
        client.lease_revoke(lease.id).await.expect("revoke");
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The raw predecessor-watch lock on etcd (the recipe of etcd's own `concurrency.Mutex`,
/// hand-written): two sessions, each with a lease and a key under one prefix, take turns; the
/// waiter puts its key, watches the holder's from its own put's revision on, and holds once the
/// delete has arrived and a listing by create revision shows its key first. Timed from the
/// holder's delete being sent.
async fn etcd_raw_handovers(port: u16) -> Vec<Duration> {
    use leasehold_lease::drivers::queue::etcd_rpc::{
        DeleteRangeRequest, EVENT_DELETE, EtcdClient, PutRequest, RangeRequest, SORT_ASCEND,
    };
    const PREFIX: &str = "raw-handover/";
    let mut sessions = Vec::new();
    for _ in 0..2 {
        let client = raw_etcd_client(port).await;
        let lease = client
            .lease_grant(LEASE.as_secs() as i64)
            .await
            .expect("grant");
        sessions.push((client, format!("{PREFIX}{:016x}", lease.id), lease.id));
    }
    let join = |(client, key, lease): &(EtcdClient, String, i64)| {
        let (client, key, lease) = (client.clone(), key.clone(), *lease);
        async move {
            client
                .put(PutRequest {
                    key: key.into_bytes(),
                    value: b"bench".to_vec(),
                    lease,
                })
                .await
                .expect("put")
                .header
                .map_or(0, |h| h.revision)
        }
    };
    join(&sessions[0]).await;
    let mut latencies = Vec::new();
    for round in 0..HANDOVERS {
        let (holder, waiter) = (&sessions[round % 2], &sessions[(round + 1) % 2]);
        let joined = join(waiter).await;
        let mut deleted = waiter
            .0
            .watch(holder.1.clone().into_bytes(), joined + 1)
            .await
            .expect("watch the predecessor");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let released = Instant::now();
        holder
            .0
            .delete_range(DeleteRangeRequest {
                key: holder.1.clone().into_bytes(),
                range_end: Vec::new(),
                prev_kv: false,
            })
            .await
            .expect("delete");
        loop {
            let reply = deleted
                .message()
                .await
                .expect("watch")
                .expect("the watch stream ended");
            if reply.events.iter().any(|e| e.r#type == EVENT_DELETE) {
                break;
            }
        }
        let first = waiter
            .0
            .range(RangeRequest::prefix(PREFIX).first_by_create(SORT_ASCEND))
            .await
            .expect("list");
        assert_eq!(
            first.kvs.first().map(|kv| kv.key.as_slice()),
            Some(waiter.1.as_bytes()),
            "the waiter is first"
        );
        latencies.push(released.elapsed());
    }
    latencies.sort();
    latencies
}

/// The raw client operations of the simplest ZooKeeper lock: create an ephemeral sequential
/// node, delete it.
async fn zookeeper_raw_cycles(port: u16) -> f64 {
    use zookeeper_client as zk;
    let client = zk::Client::connector()
        .with_session_timeout(LEASE)
        .connect(&format!("127.0.0.1:{port}"))
        .await
        .expect("zookeeper");
    let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    match client.create("/raw", b"", &options).await {
        Ok(_) | Err(zk::Error::NodeExists) => {}
        Err(e) => panic!("create /raw: {e}"),
    }
    let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let start = Instant::now();
    for _ in 0..CYCLES {
        let (_, sequence) = client
            .create("/raw/lock-", b"bench", &ephemeral)
            .await
            .expect("create");
        client
            .delete(&format!("/raw/lock-{sequence}"), None)
            .await
            .expect("delete");
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The raw predecessor-watch lock on ZooKeeper (Curator's recipe, hand-written): two sessions
/// take turns; the waiter's node watches the holder's, and the waiter holds once the watch has
/// fired and a listing shows its node first. Timed from the holder's delete being sent.
async fn zookeeper_raw_handovers(port: u16) -> Vec<Duration> {
    use zookeeper_client as zk;
    let connect = || async {
        zk::Client::connector()
            .with_session_timeout(LEASE)
            .connect(&format!("127.0.0.1:{port}"))
            .await
            .expect("zookeeper")
    };
    let sessions = [connect().await, connect().await];
    let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    match sessions[0].create("/raw-handover", b"", &options).await {
        Ok(_) | Err(zk::Error::NodeExists) => {}
        Err(e) => panic!("create /raw-handover: {e}"),
    }
    let ephemeral = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let join = |session: &zk::Client| {
        let session = session.clone();
        let ephemeral = ephemeral.clone();
        async move {
            let (_, sequence) = session
                .create("/raw-handover/lock-", b"bench", &ephemeral)
                .await
                .expect("create");
            format!("lock-{sequence}")
        }
    };
    let mut holding = join(&sessions[0]).await;
    let mut latencies = Vec::new();
    for round in 0..HANDOVERS {
        let (holder, waiter) = (&sessions[round % 2], &sessions[(round + 1) % 2]);
        let waiting = join(waiter).await;
        let (stat, watcher) = waiter
            .check_and_watch_stat(&format!("/raw-handover/{holding}"))
            .await
            .expect("watch the predecessor");
        assert!(stat.is_some(), "the holder's node is there");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let released = Instant::now();
        holder
            .delete(&format!("/raw-handover/{holding}"), None)
            .await
            .expect("delete");
        watcher.changed().await;
        let mut children = waiter.list_children("/raw-handover").await.expect("list");
        children.sort();
        assert_eq!(children.first(), Some(&waiting), "the waiter is first");
        latencies.push(released.elapsed());
        holding = waiting;
    }
    latencies.sort();
    latencies
}

/// The raw blocking lock on Redis: `SET NX PX`, and a waiter that blocks in `BLPOP` on a signal
/// list the holder pushes to after its `DEL`, then takes the key. Timed from the holder's
/// release being sent to the waiter's `SET` succeeding.
async fn redis_raw_blocking_handovers(url: &str) -> Vec<Duration> {
    let client = redis::Client::open(url).expect("client");
    let mut sessions = Vec::new();
    for _ in 0..2 {
        sessions.push(
            client
                .get_multiplexed_async_connection()
                .await
                .expect("connect"),
        );
    }
    let take = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        async move {
            set_nx_px("raw-blocking", "bench")
                .query_async::<Option<String>>(&mut conn)
                .await
                .expect("SET")
                .is_some()
        }
    };
    let _: () = redis::cmd("DEL")
        .arg("raw-blocking")
        .arg("raw-blocking:signal")
        .query_async(&mut sessions[0])
        .await
        .expect("DEL");
    assert!(take(&mut sessions[0]).await);
    let mut latencies = Vec::new();
    for round in 0..HANDOVERS {
        let (h, w) = (round % 2, (round + 1) % 2);
        let mut holder = sessions[h].clone();
        let mut waiter = sessions[w].clone();
        let waiting = async {
            loop {
                if take(&mut waiter).await {
                    return Instant::now();
                }
                let _: Option<(String, String)> = redis::cmd("BLPOP")
                    .arg("raw-blocking:signal")
                    .arg(5)
                    .query_async(&mut waiter)
                    .await
                    .expect("BLPOP");
            }
        };
        let giving = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let released = Instant::now();
            let _: () = redis::pipe()
                .cmd("DEL")
                .arg("raw-blocking")
                .ignore()
                .cmd("LPUSH")
                .arg("raw-blocking:signal")
                .arg(1)
                .ignore()
                .query_async(&mut holder)
                .await
                .expect("release");
            released
        };
        let (held, released) = tokio::join!(waiting, giving);
        latencies.push(held - released);
        let _: () = redis::cmd("DEL")
            .arg("raw-blocking:signal")
            .query_async(&mut sessions[0])
            .await
            .expect("DEL");
    }
    latencies.sort();
    latencies
}

/// 100 idle waiters behind one holder, on each of `IDLE_LEASES`: what they cost the backend, in
/// requests it received. One line per lease.
async fn idle_waiters(
    connect: impl Fn() -> Arc<dyn Backend>,
    received: impl AsyncFn() -> u64,
) -> Vec<String> {
    let mut lines = Vec::new();
    for lease in IDLE_LEASES {
        lines.push(idle_waiters_on(&connect, &received, lease).await);
    }
    lines
}

async fn idle_waiters_on(
    connect: &impl Fn() -> Arc<dyn Backend>,
    received: &impl AsyncFn() -> u64,
    lease: Duration,
) -> String {
    let renew = lease / 3;
    let measure = IDLE_MEASURE.max(renew * 5);
    let lock = format!("idle-{}s", lease.as_secs());
    let config = |id: String| LockConfig {
        renew_interval: renew,
        mode: Mode::Campaign,
        ..LockConfig::new(&lock, &id, lease)
    };
    let holder = Lock::start(connect(), config("holder".into()), Arc::new(())).expect("holder");
    while !holder.answer().is_holder() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let waiters: Vec<Lock> = (0..IDLE_WAITERS)
        .map(|i| Lock::start(connect(), config(format!("w{i}")), Arc::new(())).expect("waiter"))
        .collect();
    tokio::time::sleep(lease * 2).await;
    let before = received().await;
    tokio::time::sleep(measure).await;
    let requests = received().await - before;
    assert!(waiters.iter().all(|w| !w.answer().is_holder()));
    for waiter in waiters {
        waiter.shutdown().await;
    }
    holder.shutdown().await;
    let intervals = measure.as_secs_f64() / renew.as_secs_f64();
    format!(
        "{:>7.1} requests/s = {:.2} per waiter per renew interval (lease {lease:?}, renew {renew:?})",
        requests as f64 / measure.as_secs_f64(),
        requests as f64 / IDLE_WAITERS as f64 / intervals
    )
}

/// ZooKeeper: cycles against the raw client, watch hand-over, and what 100 idle waiters cost.
async fn zookeeper_section() {
    use leasehold_lease::zookeeper::{ZooKeeperConfig, ZooKeeperDriver};
    println!(
        "## ZooKeeper 3.8 ({CYCLES} cycles, best of {ROUNDS}; hand-over: {HANDOVERS} rounds; {IDLE_WAITERS} idle waiters)"
    );
    let server = leasehold_lease::testkit::ZooKeeperServer::start();
    let port = server.port();
    let connect = || -> Arc<dyn Backend> {
        Arc::new(
            ZooKeeperDriver::connect(ZooKeeperConfig {
                servers: format!("127.0.0.1:{port}"),
                root: "/leasehold".into(),
                digest: None,
                tick_time: leasehold_lease::testkit::ZooKeeperServer::TICK_TIME,
                tls: None,
            })
            .expect("zookeeper driver"),
        )
    };
    let driver = connect();
    let (mut raw, mut ours) = (0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(zookeeper_raw_cycles(port).await);
        ours = ours.max(driver_cycles(&*driver).await);
    }
    println!("  zookeeper raw create + delete  : {raw:>9.0} cycles/s");
    println!(
        "  zookeeper ZooKeeperDriver      : {ours:>9.0} cycles/s  ({:.0} %; adds the queue listing)",
        100.0 * ours / raw
    );
    let latency = handover_latencies(connect(), connect()).await;
    println!("  zookeeper hand-over, watch     : {}", describe(&latency));
    let raw = zookeeper_raw_handovers(port).await;
    println!(
        "  zookeeper raw predecessor-watch lock, hand-over: {}",
        describe(&raw)
    );
    for idle in idle_waiters(connect, async || server.packets_received()).await {
        println!("  zookeeper {IDLE_WAITERS} idle waiters + holder: {idle}");
    }
}

/// etcd: cycles against the raw client, hand-over through the predecessor watch, and what 100
/// idle waiters cost the server.
async fn etcd_section() {
    use leasehold_lease::etcd::{EtcdConfig, EtcdDriver};
    println!(
        "## etcd 3.4 ({CYCLES} cycles, best of {ROUNDS}; hand-over: {HANDOVERS} rounds; {IDLE_WAITERS} idle waiters)"
    );
    let server = leasehold_lease::testkit::EtcdServer::start();
    let port = server.port();
    let connect = || -> Arc<dyn Backend> {
        Arc::new(
            EtcdDriver::connect(EtcdConfig {
                endpoints: vec![format!("127.0.0.1:{port}")],
                prefix: "leasehold".into(),
                user: None,
                tls: None,
            })
            .expect("etcd driver"),
        )
    };
    let driver = connect();
    let (mut raw, mut ours) = (0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(etcd_raw_cycles(port).await);
        ours = ours.max(driver_cycles(&*driver).await);
    }
    println!("  etcd raw grant + put + revoke  : {raw:>9.0} cycles/s");
    println!(
        "  etcd EtcdDriver                : {ours:>9.0} cycles/s  ({:.0} %; a put with the queue read in one transaction, a keep-alive before the claim, a delete; the process's etcd lease is granted once)",
        100.0 * ours / raw
    );
    let latency = handover_latencies(connect(), connect()).await;
    println!("  etcd hand-over, watch          : {}", describe(&latency));
    let raw = etcd_raw_handovers(port).await;
    println!(
        "  etcd raw predecessor-watch lock, hand-over: {}",
        describe(&raw)
    );

    for idle in idle_waiters(connect, async || server.messages_received()).await {
        println!("  etcd {IDLE_WAITERS} idle waiters + holder: {idle}");
    }
}
/// How long the benchmark runs the safety check per driver (`scripts/soak` runs it longer).
const SAFETY_DURATION: Duration = Duration::from_secs(30);

/// The multi-process safety check per driver: hand-overs, faults, overlaps (must be 0) and the
/// longest time without a holder.
async fn safety_section() {
    use leasehold_e2e::safety::{self, Scenario, Target};
    println!(
        "## safety check: 3 sidecars, random kill/pause/restart/partition, {SAFETY_DURATION:?} per driver (lease {:?}, renew {:?})",
        safety::LEASE,
        safety::RENEW
    );
    for target in Target::ALL {
        let seed = rand::random();
        let report = tokio::task::spawn_blocking(move || {
            safety::run(Scenario::campaign(target), SAFETY_DURATION, 3, seed)
        })
        .await
        .expect("safety run");
        println!("  {}", report.summary());
        for violation in &report.violations {
            println!("    VIOLATION {violation}");
        }
    }
}

/// The baseline server: axum with the sidecar's runtime shape, answering a constant.
fn bare_axum(port: u16) {
    const BODY: &str = r#"{"lock":"bench","holder":true,"identity":"bench","currentHolder":"bench","fencingToken":1,"validForMs":14000,"backend":"sqlite","mode":"campaign","since":"2026-01-01T00:00:00.000Z"}"#;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let app = axum::Router::new().route(
            "/lock",
            axum::routing::get(|| async {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    BODY,
                )
            }),
        );
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind");
        axum::serve(listener, app).await.expect("serve");
    });
}

fn sibling_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let path = exe.with_file_name(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/bench",
        path.display()
    );
    path
}

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

async fn wait_until_serving(addr: SocketAddr, path: &str, want: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(mut conn) = TcpStream::connect(addr).await {
            let mut reader = BufReader::new(&mut conn);
            if get(&mut reader, path)
                .await
                .is_ok_and(|status| status == want)
            {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{addr}{path} never answered {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One keep-alive request; returns the status. Minimal on purpose: the client's own cost is
/// the same for both servers.
async fn get(conn: &mut BufReader<&mut TcpStream>, path: &str) -> std::io::Result<u16> {
    request(conn, "GET", path).await
}

async fn request(
    conn: &mut BufReader<&mut TcpStream>,
    method: &str,
    path: &str,
) -> std::io::Result<u16> {
    conn.get_mut()
        .write_all(
            format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut line = String::new();
    conn.read_line(&mut line).await?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("bad status line"))?;
    let mut length = 0usize;
    loop {
        line.clear();
        conn.read_line(&mut line).await?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    conn.read_exact(&mut body).await?;
    Ok(status)
}

async fn requests_per_second(addr: SocketAddr, path: &'static str, expect: u16) -> f64 {
    let deadline = Instant::now() + HTTP_DURATION;
    let mut tasks = Vec::new();
    for _ in 0..HTTP_CONNECTIONS {
        tasks.push(tokio::spawn(async move {
            let mut conn = TcpStream::connect(addr).await.expect("connect");
            conn.set_nodelay(true).ok();
            let mut reader = BufReader::new(&mut conn);
            let mut done = 0u64;
            while Instant::now() < deadline {
                let status = get(&mut reader, path).await.expect("request");
                assert_eq!(status, expect, "unexpected status from {path}");
                done += 1;
            }
            done
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("load task");
    }
    total as f64 / HTTP_DURATION.as_secs_f64()
}

async fn http_section() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (sidecar_port, bare_port) = (free_port(), free_port());
    let sidecar = Process(
        Command::new(sibling_binary("leasehold-sidecar"))
            .args(["--lock", "bench", "--identity", "bench"])
            .arg("--backend")
            .arg(format!("sqlite://{}/bench.db", dir.path().display()))
            .args(["--listen", &format!("127.0.0.1:{sidecar_port}")])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sidecar"),
    );
    let _bare = Process(
        Command::new(std::env::current_exe().expect("exe"))
            .args(["--bare-axum", &bare_port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start bare axum"),
    );
    let sidecar_addr = SocketAddr::from(([127, 0, 0, 1], sidecar_port));
    let bare_addr = SocketAddr::from(([127, 0, 0, 1], bare_port));
    wait_until_serving(sidecar_addr, "/lock", 200).await;
    wait_until_serving(bare_addr, "/lock", 200).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_rss = rss_kib(sidecar.0.id());

    let (mut ours, mut base) = (Vec::new(), Vec::new());
    for _ in 0..HTTP_ROUNDS {
        base.push(requests_per_second(bare_addr, "/lock", 200).await);
        ours.push(requests_per_second(sidecar_addr, "/lock", 200).await);
    }
    let loaded_rss = rss_kib(sidecar.0.id());
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    let (ours, base) = (best(&ours), best(&base));
    println!(
        "## GET /lock ({HTTP_CONNECTIONS} keep-alive connections, best of {HTTP_ROUNDS} x {HTTP_DURATION:?})"
    );
    println!("  bare axum constant handler : {base:>10.0} req/s");
    println!("  leasehold-sidecar /lock    : {ours:>10.0} req/s");
    println!(
        "  ratio                      : {:>10.1} %",
        100.0 * ours / base
    );
    println!("## sidecar memory");
    println!(
        "  idle RSS                   : {:>10.1} MiB",
        idle_rss as f64 / 1024.0
    );
    println!(
        "  RSS after the load         : {:>10.1} MiB",
        loaded_rss as f64 / 1024.0
    );
}

/// Redis without an append-only file (fsync would dominate both sides of a comparison), once it
/// has been up for a lease: until then it grants no free lock, since it cannot tell its start
/// from a restart that lost leases their holders still claim (`drivers/redis/mod.rs`).
fn redis_without_persistence() -> RedisServer {
    let redis = RedisServer::start_with(false);
    tokio::task::block_in_place(|| redis.wait_until_up_for(LEASE));
    redis
}

async fn driver_cycles(driver: &dyn Backend) -> f64 {
    let start = Instant::now();
    for i in 0..CYCLES {
        let lease = match driver
            .try_acquire("cycles", "bench", LEASE)
            .await
            .expect("acquire")
        {
            Acquire::Acquired(lease) => lease,
            Acquire::Busy(h) => panic!("cycle {i}: busy {h:?}"),
            Acquire::Withheld(w) => panic!("cycle {i}: withheld {w:?}"),
        };
        assert!(driver.release(&lease).await.expect("release"));
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The raw lock's take: `SET key value NX PX lease`, answered `OK` or nil.
fn set_nx_px(key: &str, value: &str) -> redis::Cmd {
    let mut set = redis::cmd("SET");
    set.arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(LEASE.as_millis() as u64);
    set
}

async fn redis_raw_cycles(url: &str) -> f64 {
    redis_raw_cycles_confirmed(url, 0).await
}

/// The raw lock (`SET NX PX`, the compare-and-delete script), each `SET` confirmed by
/// `replicas` replicas (`WAIT`) when that is not 0.
async fn redis_raw_cycles_confirmed(url: &str, replicas: i64) -> f64 {
    let client = redis::Client::open(url).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    raw_lock_cycles(&mut conn, replicas).await
}

/// The raw lock's cycles on `conn` (one server, or a cluster client that routes each command
/// to its key's master), each `SET` confirmed by `replicas` replicas when that is not 0.
async fn raw_lock_cycles(conn: &mut impl redis::aio::ConnectionLike, replicas: i64) -> f64 {
    let release = redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    );
    let start = Instant::now();
    for i in 0..CYCLES {
        let set: Option<String> = set_nx_px("raw", "bench")
            .query_async(conn)
            .await
            .expect("SET");
        assert!(set.is_some(), "cycle {i}: SET NX failed");
        if replicas > 0 {
            let acked: i64 = redis::cmd("WAIT")
                .arg(replicas)
                .arg(500)
                .query_async(conn)
                .await
                .expect("WAIT");
            assert!(acked >= replicas, "cycle {i}: {acked} replicas confirmed");
        }
        let deleted: i64 = release
            .key("raw")
            .arg("bench")
            .invoke_async(conn)
            .await
            .expect("EVAL");
        assert_eq!(deleted, 1);
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The raw Redlock a hand-written client does: `SET NX PX` on every master at once, a majority
/// needed, then the compare-and-delete script on every master at once. With `tokens`, it also
/// mints a fencing token as the driver must: the first round's script answers each master's
/// counter beside the `SET`, and a second round, on the masters that granted, raises their
/// counters to one above the largest seen before the lock counts as taken.
async fn redlock_raw_cycles(masters: &[url::Url], tokens: bool) -> f64 {
    let mut conns = Vec::new();
    for url in masters {
        let client = redis::Client::open(url.as_str()).expect("client");
        conns.push(
            client
                .get_multiplexed_async_connection()
                .await
                .expect("connect"),
        );
    }
    let release = redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    );
    let set_and_read_counter = redis::Script::new(
        "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
         return tonumber(redis.call('GET', KEYS[2]) or '0') end return -1",
    );
    let raise_counter = redis::Script::new(
        "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end \
         if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then \
         redis.call('SET', KEYS[2], ARGV[2]) end return 1",
    );
    let quorum = masters.len() / 2 + 1;
    let start = Instant::now();
    for i in 0..CYCLES {
        let set = futures_util::future::join_all(conns.iter().map(|conn| {
            let mut conn = conn.clone();
            let set_and_read_counter = &set_and_read_counter;
            async move {
                if tokens {
                    let counter: i64 = set_and_read_counter
                        .key("raw")
                        .key("raw:token")
                        .arg("bench")
                        .arg(LEASE.as_millis() as u64)
                        .invoke_async(&mut conn)
                        .await?;
                    Ok((counter >= 0).then_some(counter))
                } else {
                    set_nx_px("raw", "bench")
                        .query_async::<Option<String>>(&mut conn)
                        .await
                        .map(|set| set.map(|_| 0))
                }
            }
        }))
        .await;
        let granted: Vec<(usize, i64)> = set
            .iter()
            .enumerate()
            .filter_map(|(m, r)| match r {
                Ok(Some(counter)) => Some((m, *counter)),
                _ => None,
            })
            .collect();
        assert!(
            granted.len() >= quorum,
            "cycle {i}: only {} masters",
            granted.len()
        );
        if tokens {
            let token = 1 + granted.iter().map(|(_, c)| *c).max().unwrap_or(0);
            let raised = futures_util::future::join_all(granted.iter().map(|(m, _)| {
                let mut conn = conns[*m].clone();
                let raise_counter = &raise_counter;
                async move {
                    raise_counter
                        .key("raw")
                        .key("raw:token")
                        .arg("bench")
                        .arg(token)
                        .invoke_async::<i64>(&mut conn)
                        .await
                }
            }))
            .await;
            let raised = raised.iter().filter(|r| matches!(r, Ok(1))).count();
            assert!(
                raised >= quorum,
                "cycle {i}: token on only {raised} masters"
            );
        }
        futures_util::future::join_all(conns.iter().map(|conn| {
            let mut conn = conn.clone();
            let release = &release;
            async move {
                release
                    .key("raw")
                    .arg("bench")
                    .invoke_async::<i64>(&mut conn)
                    .await
            }
        }))
        .await;
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

async fn sqlite_raw_cycles(path: &std::path::Path) -> f64 {
    use sqlx::Connection;
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Full);
    let mut conn = sqlx::SqliteConnection::connect_with(&options)
        .await
        .expect("connect");
    sqlx::query("CREATE TABLE IF NOT EXISTS raw_locks (name TEXT PRIMARY KEY, holder TEXT, expires_at_ms INTEGER)")
        .execute(&mut conn)
        .await
        .expect("create");
    let start = Instant::now();
    for _ in 0..CYCLES {
        sqlx::query(
            "INSERT INTO raw_locks (name, holder, expires_at_ms) VALUES ('raw', 'bench', 0)",
        )
        .execute(&mut conn)
        .await
        .expect("insert");
        sqlx::query("DELETE FROM raw_locks WHERE name = 'raw' AND holder = 'bench'")
            .execute(&mut conn)
            .await
            .expect("delete");
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// Two on-demand holders, each on its own connection, hand the lock back and forth; the time
/// from the holder's release call to the waiter holding.
async fn handover_latencies(a: Arc<dyn Backend>, b: Arc<dyn Backend>) -> Vec<Duration> {
    let config = |id: &str| LockConfig {
        mode: Mode::OnDemand,
        ..LockConfig::new("handover", id, LEASE)
    };
    let locks = [
        Lock::start(a, config("a"), Arc::new(())).expect("lock a"),
        Lock::start(b, config("b"), Arc::new(())).expect("lock b"),
    ];
    let hold = Duration::from_secs(300);
    assert!(
        locks[0]
            .acquire(Duration::from_secs(30), hold)
            .await
            .unwrap()
            .is_holder()
    );
    let mut latencies = Vec::new();
    for round in 0..HANDOVERS {
        let (holder, waiter) = (&locks[round % 2], locks[(round + 1) % 2].clone());
        let waiting = tokio::spawn(async move {
            let answer = waiter.acquire(Duration::from_secs(60), hold).await.unwrap();
            (answer, Instant::now())
        });
        // Let the waiter's attempt fail and settle into waiting, then release at a random
        // point of its polling cycle, as a real release would.
        let settle: u64 = rand::Rng::random_range(&mut rand::rng(), 100..1100);
        tokio::time::sleep(Duration::from_millis(settle)).await;
        let released = Instant::now();
        assert!(holder.release().await.unwrap());
        let (answer, held) = waiting.await.unwrap();
        assert!(
            matches!(answer, Answer::Holder { .. }),
            "round {round}: {answer:?}"
        );
        latencies.push(held - released);
    }
    for lock in &locks {
        lock.shutdown().await;
    }
    latencies.sort();
    latencies
}

fn describe(latencies: &[Duration]) -> String {
    let pick = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    format!(
        "median {:>8.2} ms   p90 {:>8.2} ms   max {:>8.2} ms",
        pick(0.5).as_secs_f64() * 1e3,
        pick(0.9).as_secs_f64() * 1e3,
        pick(1.0).as_secs_f64() * 1e3
    )
}

async fn driver_section() {
    println!(
        "## acquire+release cycles ({CYCLES} sequential cycles on one client, best of {ROUNDS}, alternating)"
    );
    let redis = redis_without_persistence();
    let url = url::Url::parse(&redis.url()).expect("url");
    let driver =
        leasehold_lease::redis::RedisDriver::connect(&url, "leasehold", None).expect("driver");
    let (mut raw, mut ours) = (0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(redis_raw_cycles(&redis.url()).await);
        ours = ours.max(driver_cycles(&driver).await);
    }
    println!("  redis  raw SET NX PX + EVAL del : {raw:>9.0} cycles/s");
    println!(
        "  redis  RedisDriver              : {ours:>9.0} cycles/s  ({:.0} %)",
        100.0 * ours / raw
    );

    let masters: Vec<RedisServer> = (0..REDLOCK_MASTERS)
        .map(|_| RedisServer::start_with(false))
        .collect();
    let urls: Vec<url::Url> = masters
        .iter()
        .map(|m| url::Url::parse(&m.url()).expect("url"))
        .collect();
    let driver = leasehold_lease::redlock::RedlockDriver::connect(&urls, "leasehold", None)
        .expect("redlock");
    let (mut raw, mut with_tokens, mut ours) = (0.0f64, 0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(redlock_raw_cycles(&urls, false).await);
        with_tokens = with_tokens.max(redlock_raw_cycles(&urls, true).await);
        ours = ours.max(driver_cycles(&driver).await);
    }
    println!("  redlock raw SET NX + del, 5 masters: {raw:>6.0} cycles/s");
    println!(
        "  redlock raw, with a token round   : {with_tokens:>6.0} cycles/s  ({:.0} %; the counters read with the SET, raised on a majority before holding)",
        100.0 * with_tokens / raw
    );
    println!(
        "  redlock RedlockDriver, 5 masters  : {ours:>6.0} cycles/s  ({:.0} % of raw, {:.0} % of raw with the token round)",
        100.0 * ours / raw,
        100.0 * ours / with_tokens
    );
    drop(masters);

    let sqlite = SqliteHarness::new();
    let driver = leasehold_lease::sqlite::SqliteDriver::open(&sqlite.path(), "leasehold_locks")
        .await
        .expect("sqlite");
    let (mut raw, mut ours) = (0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(sqlite_raw_cycles(&sqlite.dir_path().join("raw.db")).await);
        ours = ours.max(driver_cycles(&driver).await);
    }
    println!("  sqlite raw INSERT + DELETE      : {raw:>9.0} cycles/s");
    println!(
        "  sqlite SqliteDriver             : {ours:>9.0} cycles/s  ({:.0} %)",
        100.0 * ours / raw
    );

    println!(
        "## graceful hand-over, release -> waiter holds ({HANDOVERS} rounds, lease {LEASE:?})"
    );
    let durable = RedisServer::start();
    let url = url::Url::parse(&durable.url()).expect("url");
    let connect = || -> Arc<dyn Backend> {
        Arc::new(
            leasehold_lease::redis::RedisDriver::connect(&url, "leasehold", None).expect("driver"),
        )
    };
    let redis_latency = handover_latencies(connect(), connect()).await;
    println!(
        "  redis  (pub/sub wake-up)        : {}",
        describe(&redis_latency)
    );
    let redis_raw = redis_raw_blocking_handovers(&durable.url()).await;
    println!(
        "  redis  raw BLPOP-signalled lock : {}",
        describe(&redis_raw)
    );
    let open = || async {
        Arc::new(
            leasehold_lease::sqlite::SqliteDriver::open(&sqlite.path(), "leasehold_locks")
                .await
                .expect("sqlite"),
        ) as Arc<dyn Backend>
    };
    let sqlite_latency = handover_latencies(open().await, open().await).await;
    println!(
        "  sqlite (wake files, two drivers): {}",
        describe(&sqlite_latency)
    );
}

/// The raw baseline for a SQL database: the lease-table statements a hand-written lock would
/// issue (insert the row, delete it where the holder matches), in a loop on one connection.
async fn sql_raw_cycles(dialect: Dialect, url: &str) -> f64 {
    use sqlx::Connection;
    sqlx::any::install_default_drivers();
    let mut conn = sqlx::AnyConnection::connect(url).await.expect("connect");
    let (create, insert, delete) = match dialect {
        Dialect::Postgres => (
            "CREATE TABLE IF NOT EXISTS raw_locks (name VARCHAR(253) PRIMARY KEY, holder VARCHAR(253), expires_at TIMESTAMPTZ NOT NULL)",
            "INSERT INTO raw_locks (name, holder, expires_at) VALUES ($1, $2, now() + interval '15 seconds')",
            "DELETE FROM raw_locks WHERE name = $1 AND holder = $2",
        ),
        Dialect::MySql => (
            "CREATE TABLE IF NOT EXISTS raw_locks (name VARCHAR(253) NOT NULL PRIMARY KEY, holder VARCHAR(253), expires_at DATETIME(6) NOT NULL) ENGINE=InnoDB",
            "INSERT INTO raw_locks (name, holder, expires_at) VALUES (?, ?, NOW(6) + INTERVAL 15 SECOND)",
            "DELETE FROM raw_locks WHERE name = ? AND holder = ?",
        ),
    };
    sqlx::query(create)
        .execute(&mut conn)
        .await
        .expect("create");
    let start = Instant::now();
    for _ in 0..CYCLES {
        sqlx::query(insert)
            .bind("raw")
            .bind("bench")
            .execute(&mut conn)
            .await
            .expect("insert");
        sqlx::query(delete)
            .bind("raw")
            .bind("bench")
            .execute(&mut conn)
            .await
            .expect("delete");
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The hand-written row lock: `BEGIN`, `SELECT ... FOR UPDATE NOWAIT` on a seeded row,
/// `COMMIT`, in a loop on one connection.
async fn sql_raw_row_lock_cycles(dialect: Dialect, url: &str) -> f64 {
    use sqlx::{Connection, Executor};
    sqlx::any::install_default_drivers();
    let sql = dialect.statements(None, "leasehold_locks");
    let mut conn = sqlx::AnyConnection::connect(url).await.expect("connect");
    for setup in [&sql.create_row_table, &sql.seed_row] {
        sqlx::query(setup)
            .bind("raw-row")
            .execute(&mut conn)
            .await
            .expect("setup");
    }
    let start = Instant::now();
    for _ in 0..CYCLES {
        conn.execute("BEGIN").await.expect("begin");
        let rows = sqlx::query(&sql.lock_row)
            .bind("raw-row")
            .fetch_all(&mut conn)
            .await
            .expect("lock");
        assert_eq!(rows.len(), 1);
        conn.execute("COMMIT").await.expect("commit");
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The driver's own statements for one acquire+release cycle, issued raw (lease mode on one
/// connection; row-lock mode on a transaction connection plus one for the fence): what is left
/// between this and the driver is the driver's overhead (pool, bookkeeping).
async fn sql_same_statements_cycles(dialect: Dialect, url: &str, mode: SqlMode) -> f64 {
    use sqlx::{Connection, Executor, Row};
    sqlx::any::install_default_drivers();
    let sql = dialect.statements(None, "leasehold_locks");
    let lock = format!("same-sql-{}", mode.as_str());
    let mut conn = sqlx::AnyConnection::connect(url).await.expect("connect");
    let mut tx = sqlx::AnyConnection::connect(url).await.expect("connect");
    for setup in [&sql.create_table, &sql.create_row_table] {
        sqlx::query(setup).execute(&mut conn).await.expect("create");
    }
    sqlx::query(&sql.seed_row)
        .bind(&lock)
        .execute(&mut conn)
        .await
        .expect("seed");
    let ttl_ms = LEASE.as_millis() as i64;
    let start = Instant::now();
    for _ in 0..CYCLES {
        if mode == SqlMode::RowLock {
            sqlx::query(&sql.observe)
                .bind(&lock)
                .fetch_all(&mut conn)
                .await
                .expect("observe");
            tx.execute(&*dialect.row_lock_begin(LEASE))
                .await
                .expect("begin");
            sqlx::query(&sql.lock_row)
                .bind(&lock)
                .fetch_all(&mut tx)
                .await
                .expect("lock row");
        }
        let token: i64 = match dialect {
            Dialect::Postgres => {
                let rows = sqlx::query(&sql.acquire)
                    .bind(&lock)
                    .bind("bench")
                    .bind(ttl_ms)
                    .fetch_all(&mut conn)
                    .await
                    .expect("acquire");
                rows.first()
                    .map(|r| r.get::<i64, _>("token"))
                    .expect("acquired")
            }
            Dialect::MySql => {
                let done = sqlx::query(&sql.acquire)
                    .bind("bench")
                    .bind(ttl_ms * 1000)
                    .bind(&lock)
                    .execute(&mut conn)
                    .await
                    .expect("acquire");
                match done.last_insert_id() {
                    Some(token) if done.rows_affected() == 1 => token,
                    _ => {
                        let insert = sql.insert.as_deref().expect("insert");
                        sqlx::query(insert)
                            .bind(&lock)
                            .bind("bench")
                            .bind(ttl_ms * 1000)
                            .execute(&mut conn)
                            .await
                            .expect("insert");
                        1
                    }
                }
            }
        };
        let release = sqlx::query(&sql.release)
            .bind(&lock)
            .bind("bench")
            .bind(token);
        let on = match mode {
            SqlMode::Lease => &mut conn,
            SqlMode::RowLock => &mut tx,
        };
        match dialect {
            Dialect::Postgres => drop(release.fetch_all(&mut *on).await.expect("release")),
            Dialect::MySql => drop(release.execute(&mut *on).await.expect("release")),
        }
        if mode == SqlMode::RowLock {
            tx.execute("COMMIT").await.expect("commit");
        }
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

async fn sql_section() {
    let postgres = PostgresServer::start();
    let mariadb = MariaDbServer::start();
    for (dialect, url) in [
        (Dialect::Postgres, postgres.url()),
        (Dialect::MySql, mariadb.url()),
    ] {
        let name = dialect.as_str();
        for mode in [SqlMode::Lease, SqlMode::RowLock] {
            let wakeup = match (dialect, mode) {
                (Dialect::Postgres, SqlMode::Lease) => "advisory lock",
                (Dialect::Postgres, SqlMode::RowLock) => "LISTEN/NOTIFY",
                (Dialect::MySql, _) => "named locks",
            };
            let connect = || -> Arc<dyn Backend> {
                Arc::new(
                    SqlDriver::connect(dialect, &url, None, "leasehold_locks", mode)
                        .expect("driver"),
                )
            };
            let driver = connect();
            let (mut raw, mut same, mut ours) = (0.0f64, 0.0f64, 0.0f64);
            for _ in 0..ROUNDS {
                raw = raw.max(match mode {
                    SqlMode::Lease => sql_raw_cycles(dialect, &url).await,
                    SqlMode::RowLock => sql_raw_row_lock_cycles(dialect, &url).await,
                });
                same = same.max(sql_same_statements_cycles(dialect, &url, mode).await);
                ours = ours.max(driver_cycles(&*driver).await);
            }
            let (raw_name, mode_name) = match mode {
                SqlMode::Lease => ("raw INSERT + DELETE", "lease mode"),
                SqlMode::RowLock => ("raw FOR UPDATE + COMMIT", "row-lock mode"),
            };
            println!("  {name:<8} {raw_name:<28}: {raw:>9.0} cycles/s");
            println!("  {name:<8} {mode_name}: driver's statements raw : {same:>9.0} cycles/s");
            println!(
                "  {name:<8} {mode_name}: SqlDriver                : {ours:>9.0} cycles/s  ({:.0} % of the same statements raw, {:.0} % of the hand-written lock)",
                100.0 * ours / same,
                100.0 * ours / raw
            );
            let latency = handover_latencies(connect(), connect()).await;
            println!(
                "  {name:<8} {mode_name}: hand-over, {wakeup:<13}: {}",
                describe(&latency)
            );
        }
        // The best blocking locks of the same server, for the hand-overs above.
        for (what, setup, take, give) in blocking_locks(dialect) {
            let latency = raw_blocking_handovers(&url, setup, take, give).await;
            println!(
                "  {name:<8} raw blocking hand-over, {what:<17}: {}",
                describe(&latency)
            );
        }
    }
    mysql_idle_waiters(&mariadb.url()).await;
}

/// 100 idle waiters on one MySQL lock, in both modes, counted by the server's own `Questions`
/// (every statement a client sent). Before named-lock wake-ups a waiter read the row five
/// times per renew interval; each waiter here is a process of its own (its own driver), with
/// its pool's connection and its named-lock session.
async fn mysql_idle_waiters(url: &str) {
    use sqlx::Connection;
    sqlx::any::install_default_drivers();
    let admin = tokio::sync::Mutex::new(sqlx::AnyConnection::connect(url).await.expect("connect"));
    // Two sessions per waiter: more than MariaDB's default of 151.
    sqlx::query("SET GLOBAL max_connections = 1000")
        .execute(&mut *admin.lock().await)
        .await
        .expect("max_connections");
    for mode in [SqlMode::Lease, SqlMode::RowLock] {
        let questions =
            async || mariadb_server::status(&mut *admin.lock().await, "Questions").await;
        let connect = || -> Arc<dyn Backend> {
            Arc::new(
                SqlDriver::connect(Dialect::MySql, url, None, "leasehold_locks", mode)
                    .expect("driver"),
            )
        };
        let mode_name = match mode {
            SqlMode::Lease => "lease mode",
            SqlMode::RowLock => "row-lock mode",
        };
        for idle in idle_waiters(connect, &questions).await {
            println!("  mysql    {mode_name}: {IDLE_WAITERS} idle waiters + holder: {idle}");
        }
        // What one poll of a waiter costs, which it sent five times per renew interval before.
        let (holder, waiter) = (connect(), connect());
        let lock = format!("poll-cost-{}", mode_name.replace(' ', "-"));
        let Acquire::Acquired(lease) = holder.try_acquire(&lock, "holder", LEASE).await.unwrap()
        else {
            panic!("{lock} is not free");
        };
        let busy = async || {
            let attempt = waiter.try_acquire(&lock, "waiter", LEASE).await.unwrap();
            assert!(matches!(attempt, Acquire::Busy(_)), "{attempt:?}");
        };
        busy().await; // the waiter's first use makes sure of the tables
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = questions().await;
        busy().await;
        // Less the second `SHOW`, which counts itself.
        let poll = questions().await - before - 1;
        holder.release(&lease).await.expect("release");
        println!(
            "  mysql    {mode_name}: one poll of a waiter: {poll} statements (five polls per renew interval before named-lock wake-ups: {} per waiter)",
            5 * poll
        );
    }
}

/// A server's own blocking locks, as (name, set-up, take, give) statements: the waiter blocks
/// in `take` until the holder's `give`.
type BlockingLock = (
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
    &'static [&'static str],
);

fn blocking_locks(dialect: Dialect) -> Vec<BlockingLock> {
    const ROW: &[&str] = &[
        "CREATE TABLE IF NOT EXISTS leasehold_bench_row (id INT PRIMARY KEY, n INT NOT NULL)",
        "DELETE FROM leasehold_bench_row",
        "INSERT INTO leasehold_bench_row VALUES (1, 0)",
    ];
    const FOR_UPDATE: &[&str] = &[
        "BEGIN",
        "SELECT n FROM leasehold_bench_row WHERE id = 1 FOR UPDATE",
    ];
    match dialect {
        Dialect::Postgres => vec![
            (
                "pg_advisory_lock",
                &[],
                &["SELECT pg_advisory_lock(4242)"],
                &["SELECT pg_advisory_unlock(4242)"],
            ),
            ("SELECT FOR UPDATE", ROW, FOR_UPDATE, &["COMMIT"]),
        ],
        Dialect::MySql => vec![
            (
                "GET_LOCK",
                &[],
                &["SELECT GET_LOCK('leasehold_bench', 60)"],
                &["SELECT RELEASE_LOCK('leasehold_bench')"],
            ),
            ("SELECT FOR UPDATE", ROW, FOR_UPDATE, &["COMMIT"]),
        ],
    }
}

async fn run_statements(conn: &mut sqlx::AnyConnection, statements: &'static [&'static str]) {
    for statement in statements {
        sqlx::raw_sql(statement)
            .execute(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
}

/// Two sessions hand a server's own blocking lock back and forth: the time from the holder's
/// `give` being sent to the blocked waiter's `take` returning.
async fn raw_blocking_handovers(
    url: &str,
    setup: &'static [&'static str],
    take: &'static [&'static str],
    give: &'static [&'static str],
) -> Vec<Duration> {
    use sqlx::Connection;
    sqlx::any::install_default_drivers();
    let mut a = sqlx::AnyConnection::connect(url).await.expect("connect");
    let mut b = sqlx::AnyConnection::connect(url).await.expect("connect");
    run_statements(&mut a, setup).await;
    run_statements(&mut a, take).await;
    let mut latencies = Vec::new();
    for round in 0..HANDOVERS {
        let (holder, waiter) = if round % 2 == 0 {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        // Polled side by side in one task: the waiter blocks in the server, and the holder
        // gives the lock up once the waiter is surely blocked.
        let waiting = async {
            run_statements(waiter, take).await;
            Instant::now()
        };
        let giving = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let released = Instant::now();
            run_statements(holder, give).await;
            released
        };
        let (held, released) = tokio::join!(waiting, giving);
        latencies.push(held - released);
    }
    latencies.sort();
    latencies
}

async fn run(sections: &[&str]) {
    let wanted = |section: &str| sections.is_empty() || sections.contains(&section);
    println!(
        "leasehold benchmark on {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    if wanted("http") {
        http_section().await;
    }
    if wanted("drivers") {
        driver_section().await;
    }
    if wanted("sql") {
        println!(
            "## PostgreSQL 15 and MariaDB 10.11, lease and row-lock modes ({CYCLES} cycles, best of {ROUNDS}; hand-over: {HANDOVERS} rounds)"
        );
        sql_section().await;
    }
    if wanted("etcd") {
        etcd_section().await;
    }
    if wanted("zookeeper") {
        zookeeper_section().await;
    }
    if wanted("keyed") {
        keyed_section().await;
    }
    if wanted("keyed-many") {
        many_keys_section().await;
    }
    if wanted("safety") {
        safety_section().await;
    }
    if wanted("operator") {
        operator_section().await;
    }
    if wanted("tls") {
        tls_section().await;
    }
    if wanted("tair") {
        tair_section().await;
    }
    if wanted("sentinel") {
        sentinel_section().await;
    }
    if wanted("cluster") {
        cluster_section().await;
    }
}

/// Redis Cluster (three durable masters): the driver's cycles beside the raw lock sent through
/// the same cluster client, in plain text and over TLS (three more masters that serve TLS
/// only); hand-over latency.
async fn cluster_section() {
    use leasehold_lease::testkit::RedisCluster;
    println!(
        "## Redis Cluster (3 masters, append-only with fsync always; {CYCLES} cycles, best of {ROUNDS}; hand-over: {HANDOVERS} rounds)"
    );
    let open = |url: String| async move {
        leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&url).expect("url"))
            .await
            .expect("driver")
    };
    for tls in [false, true] {
        let cluster = if tls {
            tokio::task::block_in_place(RedisCluster::start_tls)
        } else {
            tokio::task::block_in_place(RedisCluster::start)
        };
        let driver = open(cluster.url()).await;
        let (mut raw, mut ours) = (0.0f64, 0.0f64);
        for _ in 0..ROUNDS {
            raw = raw.max(redis_cluster_raw_cycles(&cluster).await);
            ours = ours.max(driver_cycles(&*driver).await);
        }
        let (scheme, wire) = if tls {
            ("rediss+cluster://", "TLS")
        } else {
            ("redis+cluster:// ", "plain")
        };
        println!("  raw SET NX PX + DEL script, {wire:<5}    : {raw:>7.0} cycles/s");
        println!(
            "  {scheme}                   : {ours:>7.0} cycles/s  ({:.0} % of raw)",
            100.0 * ours / raw
        );
        if !tls {
            let handover =
                handover_latencies(open(cluster.url()).await, open(cluster.url()).await).await;
            println!(
                "  hand-over, redis+cluster://            : {}",
                describe(&handover)
            );
        }
    }
}

/// The raw lock through the redis-rs cluster client, which routes each command to the master
/// of its key's slot as the driver's client does.
async fn redis_cluster_raw_cycles(cluster: &leasehold_lease::testkit::RedisCluster) -> f64 {
    let tls = cluster.nodes[0].tls_port().is_some();
    let nodes: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| {
            let scheme = if tls { "rediss" } else { "redis" };
            format!("{scheme}://127.0.0.1:{}", n.client_port())
        })
        .collect();
    let mut builder = redis::cluster::ClusterClientBuilder::new(nodes);
    if tls {
        let files = cluster.nodes[0].tls_files();
        let read = |path: &std::path::Path| std::fs::read(path).expect("a test certificate");
        builder = builder.certs(redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read(&files.client_cert),
                client_key: read(&files.client_key),
            }),
            root_cert: Some(read(&files.ca)),
        });
    }
    let mut conn = builder
        .build()
        .expect("cluster client")
        .get_async_connection()
        .await
        .expect("connect");
    raw_lock_cycles(&mut conn, 0).await
}

/// Redis behind Sentinel (a master and a replica, both `appendfsync always`, and a sentinel):
/// the Sentinel driver's cycles with and without a replica's confirmation, beside the
/// single-master driver on the same master and the raw lock with `WAIT 1`; hand-over latency.
async fn sentinel_section() {
    println!(
        "## Redis Sentinel (master + replica, append-only with fsync always; {CYCLES} cycles, best of {ROUNDS}; hand-over: {HANDOVERS} rounds)"
    );
    let set = leasehold_lease::testkit::RedisSentinelSet::start();
    let open = |url: String| async move {
        leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&url).expect("url"))
            .await
            .expect("driver")
    };
    let master = set.servers[set.master().expect("a master")].port();
    let confirmed = open(set.url()).await;
    let unconfirmed = open(format!("{}?min-replicas=0", set.url())).await;
    let single = open(format!("redis://127.0.0.1:{master}")).await;
    let (mut raw, mut ours, mut alone, mut plain) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(redis_raw_cycles_confirmed(&format!("redis://127.0.0.1:{master}"), 1).await);
        ours = ours.max(driver_cycles(&*confirmed).await);
        alone = alone.max(driver_cycles(&*unconfirmed).await);
        plain = plain.max(driver_cycles(&*single).await);
    }
    println!("  raw SET NX PX + WAIT 1 + DEL script    : {raw:>7.0} cycles/s");
    println!(
        "  redis+sentinel:// (min-replicas=1)     : {ours:>7.0} cycles/s  ({:.0} % of raw)",
        100.0 * ours / raw
    );
    println!("  redis+sentinel:// (min-replicas=0)     : {alone:>7.0} cycles/s");
    println!("  redis:// on the same master            : {plain:>7.0} cycles/s");
    let handover = handover_latencies(open(set.url()).await, open(set.url()).await).await;
    println!(
        "  hand-over, redis+sentinel://           : {}",
        describe(&handover)
    );
}

/// A bare connection to the Tair server, as the raw baselines use.
async fn tair_raw_connection(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

/// The raw versioned-put lock: `EXSET NX PX WITHVERSION`, then `EXCAD` with that version.
async fn tair_raw_cycles(port: u16) -> f64 {
    let mut conn = tair_raw_connection(port).await;
    let start = Instant::now();
    for i in 0..CYCLES {
        let version: i64 = redis::cmd("EXSET")
            .arg("raw")
            .arg("bench")
            .arg("PX")
            .arg(LEASE.as_millis() as u64)
            .arg("NX")
            .arg("WITHVERSION")
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: EXSET: {e}"));
        let deleted: i64 = redis::cmd("EXCAD")
            .arg("raw")
            .arg(version)
            .query_async(&mut conn)
            .await
            .expect("EXCAD");
        assert_eq!(deleted, 1);
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The driver's own commands issued raw: the server's incarnation, the claim and the token's
/// draw in one round trip; the delete and the release notice in another. What the driver
/// costs beyond its commands is the gap between this and the driver.
async fn tair_raw_driver_commands(port: u16) -> f64 {
    let mut conn = tair_raw_connection(port).await;
    let start = Instant::now();
    for i in 0..CYCLES {
        let (_, version, _): (String, i64, i64) = redis::pipe()
            .cmd("INFO")
            .arg("replication")
            .cmd("EXSET")
            .arg("{raw}:lease")
            .arg(format!("{}:bench", i + 1))
            .arg("PX")
            .arg(LEASE.as_millis() as u64)
            .arg("NX")
            .arg("ABS")
            .arg(((i + 1) as i64) << 32)
            .arg("WITHVERSION")
            .cmd("INCR")
            .arg("{raw}:token")
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: claim: {e}"));
        let (deleted, _): (i64, i64) = redis::pipe()
            .cmd("EXCAD")
            .arg("{raw}:lease")
            .arg(version)
            .cmd("PUBLISH")
            .arg("raw:released:bench")
            .arg(1)
            .query_async(&mut conn)
            .await
            .expect("EXCAD");
        assert_eq!(deleted, 1);
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The Tair driver beside the raw versioned-put lock on the same server, and its hand-over
/// beside the Redis driver's, in the same run.
async fn tair_section() {
    println!(
        "## Tair (Redis 7 with the TairString test double, tairstring-fake, no append-only file; {CYCLES} cycles, best of {ROUNDS}; hand-over: {HANDOVERS} rounds)"
    );
    let tair = RedisServer::start_tair_with(false);
    // Without persistence the driver cannot tell the server's start from a restart that lost
    // leases: it grants once the server has been up for a lease.
    tokio::task::block_in_place(|| tair.wait_until_up_for(LEASE));
    let open = |url: String| async move {
        leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&url).expect("url"))
            .await
            .expect("driver")
    };
    let driver = open(tair.url()).await;
    let (mut raw, mut same, mut ours) = (0.0f64, 0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(tair_raw_cycles(tair.port()).await);
        same = same.max(tair_raw_driver_commands(tair.port()).await);
        ours = ours.max(driver_cycles(&*driver).await);
    }
    println!("  raw EXSET NX PX + EXCAD        : {raw:>7.0} cycles/s");
    println!(
        "  the driver's commands, raw     : {same:>7.0} cycles/s  ({:.0} %; INFO replication+EXSET+INCR, EXCAD+PUBLISH)",
        100.0 * same / raw
    );
    println!(
        "  TairDriver                     : {ours:>7.0} cycles/s  ({:.0} %; the token draw and its check ride in the claim's round trip, the release notice in the delete's)",
        100.0 * ours / raw
    );
    let tair_handover = handover_latencies(open(tair.url()).await, open(tair.url()).await).await;
    let redis = redis_without_persistence();
    let redis_handover = handover_latencies(open(redis.url()).await, open(redis.url()).await).await;
    println!("  hand-over, tair  : {}", describe(&tair_handover));
    println!("  hand-over, redis : {}", describe(&redis_handover));
}

/// What TLS costs: the same driver's acquire+release cycles in plain text and over TLS (with a
/// client certificate), in the same run. Redis on one server (its plain and TLS ports);
/// PostgreSQL on two, since the TLS one refuses plain text.
async fn tls_section() {
    println!(
        "## TLS: acquire+release cycles, plain text beside TLS with client certificates ({CYCLES} sequential cycles, best of {ROUNDS}, alternating)"
    );
    let open = |url: String| async move {
        leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&url).expect("url"))
            .await
            .expect("driver")
    };
    let redis = RedisServer::start_tls();
    let (plain, tls) = (open(redis.plain_url()).await, open(redis.url()).await);
    let (mut p, mut t) = (0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        p = p.max(driver_cycles(&*plain).await);
        t = t.max(driver_cycles(&*tls).await);
    }
    println!("  redis      redis://   : {p:>7.0} cycles/s");
    println!(
        "  redis      rediss://  : {t:>7.0} cycles/s  ({:.0} % of plain)",
        100.0 * t / p
    );
    let (plain_server, tls_server) = (PostgresServer::start(), PostgresServer::start_tls());
    let (plain, tls) = (open(plain_server.url()).await, open(tls_server.url()).await);
    let (mut p, mut t) = (0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        p = p.max(driver_cycles(&*plain).await);
        t = t.max(driver_cycles(&*tls).await);
    }
    println!("  postgres   plain      : {p:>7.0} cycles/s");
    println!(
        "  postgres   verify-full: {t:>7.0} cycles/s  ({:.0} % of plain)",
        100.0 * t / p
    );
}

/// API requests per second that one operator makes for `OPERATOR_LOCKS` locks whose holders
/// renew every `OPERATOR_RENEW`, on the in-memory API server (it counts the requests it
/// serves; the holders' renewals are written to it directly, so only the operator's count).
async fn operator_section() {
    use leasehold_lease::testkit::InMemoryApiServer;
    use leasehold_lease::testkit::in_memory_api_server::{DISTRIBUTED_LOCKS, LEASES};
    println!(
        "## operator: {OPERATOR_LOCKS} Kubernetes-backed locks, each held by a pod renewing every {OPERATOR_RENEW:?} (requests counted for {OPERATOR_MEASURE:?})"
    );
    let api = InMemoryApiServer::new();
    let ns = "load";
    for i in 0..OPERATOR_LOCKS {
        let mut lock = leasehold_lease::testkit::distributed_lock(
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
fn k8s_now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Microsecond)
        .unwrap()
        .to_string()
}

/// [`KEYED_OWNERS`] owners at once, each a task running `owner(i, start)` (its cycles until
/// [`KEYED_DURATION`] after `start`, counted): all their cycles per second.
async fn owners_cycling<F, Fut>(owner: F) -> f64
where
    F: Fn(usize, Instant) -> Fut,
    Fut: std::future::Future<Output = u64> + Send + 'static,
{
    let start = Instant::now();
    let owners: Vec<_> = (0..KEYED_OWNERS)
        .map(|i| tokio::spawn(owner(i, start)))
        .collect();
    let mut total = 0;
    for owner in owners {
        total += owner.await.expect("owner");
    }
    total as f64 / start.elapsed().as_secs_f64()
}

/// Acquire+release cycles per second of `KEYED_OWNERS` owners of one sidecar's family, each on
/// a key of its own, for `KEYED_DURATION`.
async fn keyed_cycles(family: &leasehold_lease::keyed::KeyedFamily) -> f64 {
    owners_cycling(|i, start| {
        let family = family.clone();
        async move {
            let (key, owner) = (format!("order-{i}"), format!("worker-{i}"));
            let mut cycles = 0u64;
            while start.elapsed() < KEYED_DURATION {
                let answer = family
                    .acquire(&key, &owner, Duration::ZERO, LEASE)
                    .await
                    .expect("acquire");
                assert!(
                    matches!(answer, leasehold_lease::keyed::KeyAnswer::Held { .. }),
                    "{key}: {answer:?}"
                );
                family.release(&key, &owner).await.expect("release");
                cycles += 1;
            }
            cycles
        }
    })
    .await
}

/// The same load on the family's driver alone, without the engine a key's holding runs: where
/// the family's gap to raw lies, in the driver's calls or around them.
async fn keyed_driver_cycles(
    family: &leasehold_lease::keyed::KeyedFamily,
    driver: Arc<dyn Backend>,
) -> f64 {
    owners_cycling(|i, start| {
        let driver = driver.clone();
        let lock = family.backend_name(&format!("order-{i}")).expect("key");
        async move {
            let owner = format!("bench/worker-{i}");
            let mut cycles = 0u64;
            while start.elapsed() < KEYED_DURATION {
                let lease = match driver
                    .try_acquire(&lock, &owner, LEASE)
                    .await
                    .expect("acquire")
                {
                    Acquire::Acquired(lease) => lease,
                    Acquire::Busy(h) => panic!("{lock}: busy {h:?}"),
                    Acquire::Withheld(w) => panic!("{lock}: withheld {w:?}"),
                };
                assert!(driver.release(&lease).await.expect("release"));
                cycles += 1;
            }
            cycles
        }
    })
    .await
}

/// The same load on raw Redis: `SET NX PX` and the compare-and-delete script, one key per owner,
/// on one multiplexed connection (as the driver has).
async fn keyed_redis_raw_cycles(url: &str) -> f64 {
    let client = redis::Client::open(url).expect("client");
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    owners_cycling(|i, start| {
        let mut conn = conn.clone();
        async move {
            let release = redis::Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            );
            let (key, owner) = (format!("raw:order-{i}"), format!("worker-{i}"));
            let mut cycles = 0u64;
            while start.elapsed() < KEYED_DURATION {
                let set: Option<String> = set_nx_px(&key, &owner)
                    .query_async(&mut conn)
                    .await
                    .expect("SET");
                assert!(set.is_some(), "{key}: SET NX failed");
                let deleted: i64 = release
                    .key(&key)
                    .arg(&owner)
                    .invoke_async(&mut conn)
                    .await
                    .expect("EVAL");
                assert_eq!(deleted, 1);
                cycles += 1;
            }
            cycles
        }
    })
    .await
}

/// The same load on raw PostgreSQL: insert the key's row, delete it where the owner matches, on
/// a pool as large as the driver's.
async fn keyed_postgres_raw_cycles(url: &str) -> f64 {
    sqlx::any::install_default_drivers();
    let pool = sqlx::any::AnyPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .expect("pool");
    sqlx::query("CREATE TABLE IF NOT EXISTS raw_keys (name VARCHAR(253) PRIMARY KEY, holder VARCHAR(253), expires_at TIMESTAMPTZ NOT NULL)")
        .execute(&pool)
        .await
        .expect("create");
    owners_cycling(|i, start| {
        let pool = pool.clone();
        async move {
            let (key, owner) = (format!("order-{i}"), format!("worker-{i}"));
            let mut cycles = 0u64;
            while start.elapsed() < KEYED_DURATION {
                sqlx::query("INSERT INTO raw_keys (name, holder, expires_at) VALUES ($1, $2, now() + interval '15 seconds')")
                    .bind(&key)
                    .bind(&owner)
                    .execute(&pool)
                    .await
                    .expect("insert");
                sqlx::query("DELETE FROM raw_keys WHERE name = $1 AND holder = $2")
                    .bind(&key)
                    .bind(&owner)
                    .execute(&pool)
                    .await
                    .expect("delete");
                cycles += 1;
            }
            cycles
        }
    })
    .await
}

async fn keyed_section() {
    use leasehold_lease::keyed::{FamilyConfig, KeyedFamily};
    println!(
        "## keyed locks: {KEYED_OWNERS} owners of one sidecar, each cycling acquire+release on a key of its own ({KEYED_DURATION:?}, best of {ROUNDS}, alternating)"
    );
    let family = |driver: Arc<dyn Backend>| {
        KeyedFamily::new(
            driver,
            FamilyConfig::new("orders", "bench", LEASE),
            Arc::new(()),
        )
        .expect("family")
    };
    let redis = redis_without_persistence();
    let driver =
        leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&redis.url()).expect("url"))
            .await
            .expect("redis");
    let keyed = family(driver.clone());
    let mut admin = redis.admin().await;
    // Best rate of each; over all rounds, the server's CPU (s), the cycles, and the calls and
    // commands the server ran.
    let mut runs = [(0.0f64, 0.0f64, 0.0f64, 0u64, 0u64, 0.0f64); 3];
    for _ in 0..ROUNDS {
        for (i, run) in runs.iter_mut().enumerate() {
            let own_cpu = process_cpu_seconds();
            let cpu = redis_cpu_seconds(&mut admin).await;
            let (commands, scripts) = redis_commands(&mut admin).await;
            let rate = match i {
                0 => keyed_redis_raw_cycles(&redis.url()).await,
                1 => keyed_driver_cycles(&keyed, driver.clone()).await,
                _ => keyed_cycles(&keyed).await,
            };
            run.0 = run.0.max(rate);
            run.1 += redis_cpu_seconds(&mut admin).await - cpu;
            run.5 += process_cpu_seconds() - own_cpu;
            run.2 += rate * KEYED_DURATION.as_secs_f64();
            let (commands_after, scripts_after) = redis_commands(&mut admin).await;
            run.3 += scripts_after - scripts;
            // Less the INFO calls that read the counters.
            run.4 += commands_after - commands - 2;
        }
    }
    let raw = runs[0].0;
    for (run, label) in runs.iter().zip([
        "raw SET NX PX + EVAL del",
        "driver calls alone      ",
        "keyed family            ",
    ]) {
        println!(
            "  redis    {label} : {:>8.0} cycles/s  ({:>3.0} %)   server CPU {:>5.1} µs/cycle, client CPU {:>5.1} µs/cycle, {:.2} script calls and {:.1} commands a cycle",
            run.0,
            100.0 * run.0 / raw,
            1e6 * run.1 / run.2,
            1e6 * run.5 / run.2,
            run.3 as f64 / run.2,
            run.4 as f64 / run.2,
        );
    }
    keyed.shutdown().await;

    let postgres = PostgresServer::start();
    let driver = leasehold_lease::connect(
        &leasehold_lease::BackendUrl::parse(&postgres.url()).expect("url"),
    )
    .await
    .expect("postgres");
    let keyed = family(driver);
    let (mut raw, mut ours) = (0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(keyed_postgres_raw_cycles(&postgres.url()).await);
        ours = ours.max(keyed_cycles(&keyed).await);
    }
    println!("  postgres raw INSERT + DELETE, 4 connections: {raw:>6.0} cycles/s");
    println!(
        "  postgres keyed family, 4 connections     : {ours:>6.0} cycles/s  ({:.0} %)",
        100.0 * ours / raw
    );
    keyed.shutdown().await;
}

/// The CPU time this process (the load and the family or driver it drives) has used, user
/// and system, all threads (`/proc/self/stat`, in clock ticks of 10 ms).
fn process_cpu_seconds() -> f64 {
    const TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .expect("stat")
        .1
        .split_whitespace()
        .collect();
    // utime and stime are the stat file's 14th and 15th fields; the 3rd is fields[0] here.
    let ticks: u64 = fields[11..13]
        .iter()
        .map(|f| f.parse::<u64>().expect("ticks"))
        .sum();
    ticks as f64 / TICKS_PER_SECOND
}

/// The CPU time Redis has used, user and system (`INFO cpu`).
async fn redis_cpu_seconds(conn: &mut redis::aio::MultiplexedConnection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .expect("INFO");
    ["used_cpu_user", "used_cpu_sys"]
        .iter()
        .filter_map(|name| field(&info, name)?.parse::<f64>().ok())
        .sum()
}

/// Redis's counts of the commands it has run (those inside scripts included) and of the
/// script calls (`EVALSHA`, one round trip each).
async fn redis_commands(conn: &mut redis::aio::MultiplexedConnection) -> (u64, u64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    let calls = |line: &str| -> u64 {
        line.split_once("calls=")
            .and_then(|(_, rest)| rest.split(',').next()?.parse().ok())
            .unwrap_or(0)
    };
    let total = info
        .lines()
        .filter(|l| l.starts_with("cmdstat_"))
        .map(calls)
        .sum();
    let scripts = info
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .map(calls)
        .sum();
    (total, scripts)
}

/// One sidecar process holding `MANY_KEYS` keys of a family on Redis: its memory, idle and
/// loaded, and the Redis commands per second that keeping the keys costs, beside the least
/// it could cost with one renewal per key per renew interval.
async fn many_keys_section() {
    println!(
        "## keyed locks: one sidecar holding {MANY_KEYS} keys of one family (lease {LEASE:?}, renewals every {:?})",
        LEASE / 3
    );
    let redis = redis_without_persistence();
    let conn = redis.admin().await;
    let [commands, scripts] = many_keys_on(&redis.url(), "Redis", async || {
        let (commands, scripts) = redis_commands(&mut conn.clone()).await;
        // Less this count's own INFO call.
        [commands.saturating_sub(1), scripts]
    })
    .await;
    println!(
        "  Redis requests/s keeping them: {scripts:.0} script calls (one renewal per key per interval would be {:.0}; renewals within {:?} of each other go in one call), {commands:.0} commands run inside them and beside",
        MANY_KEYS as f64 / (LEASE / 3).as_secs_f64(),
        leasehold_lease::redis::RENEWAL_LINGER
    );
    let postgres = PostgresServer::start();
    let admin = {
        use sqlx::Connection;
        sqlx::any::install_default_drivers();
        let mut admin = sqlx::AnyConnection::connect(&postgres.url())
            .await
            .expect("connect");
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&mut admin)
            .await
            .expect("pg_stat_statements");
        tokio::sync::Mutex::new(admin)
    };
    let [statements, renewals] = many_keys_on(&postgres.url(), "PostgreSQL", async || {
        use sqlx::Row;
        let row = sqlx::query(
            "SELECT CAST(COALESCE(SUM(calls), 0) AS BIGINT) AS every, \
               CAST(COALESCE(SUM(calls) FILTER (WHERE query LIKE 'UPDATE %SET expires_at%'), 0) AS BIGINT) AS renewals \
             FROM pg_stat_statements",
        )
        .fetch_one(&mut *admin.lock().await)
        .await
        .expect("pg_stat_statements");
        let count = |column: &str| row.try_get::<i64, _>(column).expect("count") as u64;
        // Less this count's own query.
        [count("every").saturating_sub(1), count("renewals")]
    })
    .await;
    println!(
        "  PostgreSQL statements/s keeping them: {renewals:.0} renewal statements (one renewal per key per interval would be {:.0}; renewals within {:?} of each other go in one statement), {statements:.0} statements in all",
        MANY_KEYS as f64 / (LEASE / 3).as_secs_f64(),
        leasehold_lease::redis::RENEWAL_LINGER
    );
    drop(postgres);

    let mariadb = MariaDbServer::start();
    let admin = {
        use sqlx::Connection;
        tokio::sync::Mutex::new(
            sqlx::AnyConnection::connect(&mariadb.url())
                .await
                .expect("connect"),
        )
    };
    // Statements the clients sent (`Questions`), and the most sessions open at once.
    let [statements, _] = many_keys_on(&mariadb.url(), "MariaDB", async || {
        let mut admin = admin.lock().await;
        // Less these two statements.
        let questions = mariadb_server::status(&mut admin, "Questions")
            .await
            .saturating_sub(2);
        [questions, 0]
    })
    .await;
    let sessions = mariadb_server::status(&mut *admin.lock().await, "Max_used_connections").await;
    println!(
        "  MariaDB statements/s keeping them: {statements:.0} (one renewal per key per interval would be {:.0}); the most sessions open at once: {sessions} (the sidecar's pool, its named-lock sessions, this bench's own)",
        MANY_KEYS as f64 / (LEASE / 3).as_secs_f64(),
    );
    drop(mariadb);

    let zookeeper = leasehold_lease::testkit::ZooKeeperServer::start();
    let [requests] = many_keys_on(&zookeeper.url(), "ZooKeeper", async || {
        [zookeeper.packets_received()]
    })
    .await;
    println!(
        "  ZooKeeper requests/s keeping them: {requests:.0} (a sync and a read per key per interval would be {:.0}; renewals within {:?} of each other take one sync and one multiRead)",
        2.0 * MANY_KEYS as f64 / (LEASE / 3).as_secs_f64(),
        leasehold_lease::redis::RENEWAL_LINGER
    );
    drop(zookeeper);

    let etcd = leasehold_lease::testkit::EtcdServer::start();
    let [messages] = many_keys_on(&etcd.url(), "etcd", async || [etcd.messages_received()]).await;
    println!(
        "  etcd requests/s keeping them: {messages:.0} gRPC messages (one keep-alive per key per interval would be {:.0}; the sidecar's keys share one etcd lease, and renewals within {:?} of each other take one read and one keep-alive)",
        MANY_KEYS as f64 / (LEASE / 3).as_secs_f64(),
        leasehold_lease::redis::RENEWAL_LINGER
    );
}

/// One sidecar on `backend` takes `MANY_KEYS` keys of a family over `KEYED_OWNERS`
/// connections and keeps them: prints how long taking them took and its memory, idle and
/// holding them, and answers the backend's request counters (`count`, each counting up) per
/// second in the steady state.
async fn many_keys_on<const N: usize>(
    backend: &str,
    name: &str,
    count: impl AsyncFn() -> [u64; N],
) -> [f64; N] {
    let port = free_port();
    let sidecar = Process(
        Command::new(sibling_binary("leasehold-sidecar"))
            .args(["--keyed", "orders", "--identity", "bench"])
            .args(["--max-keys", &MANY_KEYS.to_string()])
            .args(["--backend", backend])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sidecar"),
    );
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    wait_until_serving(addr, "/locks/orders/keys/probe", 409).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_rss = rss_kib(sidecar.0.id());

    let started = Instant::now();
    let workers: Vec<_> = (0..KEYED_OWNERS)
        .map(|w| {
            tokio::spawn(async move {
                let mut conn = TcpStream::connect(addr).await.expect("connect");
                let mut reader = BufReader::new(&mut conn);
                for i in (w..MANY_KEYS).step_by(KEYED_OWNERS) {
                    let path =
                        format!("/locks/orders/keys/order-{i}/acquire?owner=req-{i}&hold=1h");
                    let status = request(&mut reader, "POST", &path).await.expect("acquire");
                    assert_eq!(status, 200, "{path}");
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("worker");
    }
    let took = started.elapsed();
    // Past the first renewals of every key, so that what is counted is the steady state.
    tokio::time::sleep(LEASE / 3 + Duration::from_secs(1)).await;
    let before = count().await;
    let measure = Instant::now();
    tokio::time::sleep(MANY_KEYS_MEASURE).await;
    let after = count().await;
    let seconds = measure.elapsed().as_secs_f64();
    let held_rss = rss_kib(sidecar.0.id());
    println!(
        "  {name}: acquiring {MANY_KEYS} keys over {KEYED_OWNERS} connections: {:.1} s ({:.0} keys/s)",
        took.as_secs_f64(),
        MANY_KEYS as f64 / took.as_secs_f64()
    );
    println!(
        "  {name}: sidecar RSS: idle {:.1} MiB, holding {MANY_KEYS} keys {:.1} MiB (target under 64 MiB)",
        idle_rss as f64 / 1024.0,
        held_rss as f64 / 1024.0
    );
    std::array::from_fn(|i| (after[i] - before[i]) as f64 / seconds)
}
