//! `cluster`, `sentinel`, `tair` and `tls`: the Redis family's other shapes against their raw
//! clients.

use super::*;

/// Redis Cluster (three durable masters): the driver's cycles beside the raw lock sent through
/// the same cluster client, in plain text and over TLS (three more masters that serve TLS
/// only); hand-over latency.
pub(crate) async fn cluster_section() {
    use leasehold_testkit::RedisCluster;
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
pub(crate) async fn redis_cluster_raw_cycles(cluster: &leasehold_testkit::RedisCluster) -> f64 {
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
pub(crate) async fn sentinel_section() {
    println!(
        "## Redis Sentinel (master + replica, append-only with fsync always; {CYCLES} cycles, best of {ROUNDS}; hand-over: {HANDOVERS} rounds)"
    );
    let set = leasehold_testkit::RedisSentinelSet::start();
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
pub(crate) async fn tair_raw_connection(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

/// The raw versioned-put lock: `EXSET NX PX WITHVERSION`, then `EXCAD` with that version.
pub(crate) async fn tair_raw_cycles(port: u16) -> f64 {
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
pub(crate) async fn tair_raw_driver_commands(port: u16) -> f64 {
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
pub(crate) async fn tair_section() {
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
pub(crate) async fn tls_section() {
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
