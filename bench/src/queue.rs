//! `etcd` and `zookeeper`: cycles against the raw client, hand-over through the predecessor
//! watch against the same recipe hand-written, and what idle waiters cost the server.

use super::*;

/// A plain etcd client on the local server, for the raw baselines.
pub(crate) async fn raw_etcd_client(
    port: u16,
) -> leasehold_lease::drivers::queue::etcd_rpc::EtcdClient {
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
pub(crate) async fn etcd_raw_cycles(port: u16) -> f64 {
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
pub(crate) async fn etcd_raw_handovers(port: u16) -> Vec<Duration> {
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
pub(crate) async fn zookeeper_raw_cycles(port: u16) -> f64 {
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
pub(crate) async fn zookeeper_raw_handovers(port: u16) -> Vec<Duration> {
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

/// ZooKeeper: cycles against the raw client, watch hand-over, and what 100 idle waiters cost.
pub(crate) async fn zookeeper_section() {
    use leasehold_lease::zookeeper::{ZooKeeperConfig, ZooKeeperDriver};
    println!(
        "## ZooKeeper 3.8 ({CYCLES} cycles, best of {ROUNDS}; hand-over: {HANDOVERS} rounds; {IDLE_WAITERS} idle waiters)"
    );
    let server = leasehold_testkit::ZooKeeperServer::start();
    let port = server.port();
    let connect = || -> Arc<dyn Backend> {
        Arc::new(
            ZooKeeperDriver::connect(ZooKeeperConfig {
                servers: format!("127.0.0.1:{port}"),
                root: "/leasehold".into(),
                digest: None,
                tick_time: leasehold_testkit::ZooKeeperServer::TICK_TIME,
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
pub(crate) async fn etcd_section() {
    use leasehold_lease::etcd::{EtcdConfig, EtcdDriver};
    println!(
        "## etcd 3.4 ({CYCLES} cycles, best of {ROUNDS}; hand-over: {HANDOVERS} rounds; {IDLE_WAITERS} idle waiters)"
    );
    let server = leasehold_testkit::EtcdServer::start();
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
