//! Redis Cluster beyond the conformance suite, on three real masters: a lock whose slot moves to
//! another master while it is held, and release notices published on one master that reach a
//! waiter listening on another.

use std::time::Duration;

use leasehold_lease::{Acquire, Backend};
use leasehold_testkit::{
    FaultProxy, RedisCluster, RedisServer, campaign, claims, driver_for, unique_lock,
    until_pattern_subscribers,
};
use tokio::time::{Instant, sleep, timeout};

fn lease_key(lock: &str) -> String {
    format!("leasehold:{{{lock}}}:lease")
}

/// A lock is held while its slot, with the lease, the token counter and the epoch record, is
/// moved to another master (`MIGRATING`/`IMPORTING`, `MIGRATE`, `SETSLOT NODE`). The holder's
/// renewals follow it (`ASK`, then `MOVED`): it keeps the lock with the same token, nobody else
/// holds meanwhile, and on the new master the next holder's token is greater.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_keeps_its_holder_while_its_slot_moves() {
    let cluster = std::sync::Arc::new(tokio::task::block_in_place(RedisCluster::start));
    let lock = unique_lock("moving");
    let lease = Duration::from_secs(2);
    let a = campaign(driver_for(&cluster.url()).await, &lock, "a", lease);
    let began = Instant::now();
    let a_token = loop {
        if let Some(token) = a.answer().token() {
            break token;
        }
        assert!(began.elapsed() < Duration::from_secs(10), "a never held");
        sleep(Duration::from_millis(10)).await;
    };
    let b = campaign(driver_for(&cluster.url()).await, &lock, "b", lease);

    let slot = cluster.slot_of(&lease_key(&lock));
    let from = cluster.owner_of(slot);
    let to = (from + 1) % cluster.nodes.len();
    let mover = {
        let cluster = cluster.clone();
        tokio::task::spawn_blocking(move || cluster.migrate_slot(slot, to))
    };
    // Sampled through the move, and for a lease after it.
    let mut moved_at = None;
    while moved_at.is_none_or(|at: Instant| at.elapsed() < lease) {
        assert!(
            !(claims(&a) && b.answer().is_holder()),
            "two holders while the slot moved: a {:?}, b {:?}",
            a.snapshot().held,
            b.answer()
        );
        if moved_at.is_none() && mover.is_finished() {
            moved_at = Some(Instant::now());
        }
        sleep(Duration::from_millis(5)).await;
    }
    mover.await.expect("the slot moved");
    assert_eq!(cluster.owner_of(slot), to, "the slot moved");
    let moved = Instant::now();
    while a.answer().token() != Some(a_token) {
        assert!(
            moved.elapsed() < lease * 2,
            "a lost the lock to the move: {:?}, {:?}",
            a.answer(),
            a.snapshot()
        );
        sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !b.answer().is_holder(),
        "b holds beside a: {:?}",
        b.answer()
    );
    // The lease is on the new master, and renewed there: the claim stands (read as the
    // engine keeps it: an answer read at one instant is "unknown" while a renewal on a loaded
    // machine runs past its budget).
    sleep(lease).await;
    assert!(
        claims(&a) && a.snapshot().held.map(|h| h.token) == Some(a_token),
        "a kept renewing: {:?}",
        a.snapshot()
    );

    a.shutdown().await;
    let released = Instant::now();
    let b_token = loop {
        if let Some(token) = b.answer().token() {
            break token;
        }
        assert!(
            released.elapsed() < lease * 3,
            "b never took over on the new master: {:?}",
            b.snapshot()
        );
        sleep(Duration::from_millis(10)).await;
    };
    assert!(
        b_token > a_token,
        "tokens go on rising on the new master: {a_token} then {b_token}"
    );
    b.shutdown().await;
}

/// A shard's replica takes over (`CLUSTER FAILOVER`) and restarts on its own data before any
/// lock call reached it: durable and no longer promoted, it looks like a master restarted that
/// lost nothing. It is not one: its data came from the old master, and an unplanned failover
/// can hand over data without the old master's last acquisition. The lock's epoch record names
/// the old master as its keeper (node ID and configuration epoch), so the restarted node waits
/// out a lease before it grants the free lock, as a promoted replica does, and its token is
/// greater.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_restarted_before_it_served_a_lock_waits_out_a_lease() {
    let mut cluster = tokio::task::block_in_place(RedisCluster::start_with_replicas);
    let lock = unique_lock("promoted");
    let lease = Duration::from_secs(3);
    let driver = driver_for(&cluster.url()).await;
    let Acquire::Acquired(first) = driver.try_acquire(&lock, "a", lease).await.unwrap() else {
        panic!("a fresh lock on a fresh durable cluster is free");
    };
    assert!(driver.release(&first).await.unwrap());
    drop(driver);

    let slot = cluster.slot_of(&lease_key(&lock));
    tokio::task::block_in_place(|| {
        cluster.fail_over_shard(slot);
        let promoted = cluster.owner_of(slot);
        cluster.restart_node(promoted);
    });
    let driver = driver_for(&cluster.url()).await;
    let began = Instant::now();
    let withheld = loop {
        match driver.try_acquire(&lock, "b", lease).await {
            Ok(Acquire::Withheld(withheld)) => break withheld,
            Ok(other) => panic!(
                "the promoted replica, restarted, granted the lock without waiting out a lease: \
                 {other:?}"
            ),
            // The cluster settling after the restart (a moved slot, a connection refused).
            Err(e) => {
                assert!(began.elapsed() < Duration::from_secs(20), "no answer: {e}");
                sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(withheld.reason, leasehold_lease::RESTART_GUARD);
    let second = loop {
        match driver.try_acquire(&lock, "b", lease).await {
            Ok(Acquire::Acquired(lease)) => break lease,
            Ok(_) | Err(_) => {
                assert!(
                    began.elapsed() < lease * 3 + Duration::from_secs(20),
                    "b never took the free lock"
                );
                sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert!(
        second.token > first.token,
        "tokens rise across the failover: {} then {}",
        first.token,
        second.token
    );
}

/// A durable master restarted on its own data grants a free lock at once, although another
/// master is not durable: durability is read per master, and the one serving the lock's slot
/// is read again in its new incarnation. Read as "every master durable", the restarted master
/// waited out a lease because of the other one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_master_restarted_grants_at_once_beside_a_master_that_is_not_durable() {
    let mut cluster = tokio::task::block_in_place(RedisCluster::start);
    let lock = unique_lock("restarted");
    let lease = Duration::from_secs(3);
    let driver = driver_for(&cluster.url()).await;
    let Acquire::Acquired(first) = driver.try_acquire(&lock, "a", lease).await.unwrap() else {
        panic!("a fresh lock on a fresh durable cluster is free");
    };
    assert!(driver.release(&first).await.unwrap());
    let owner = cluster.owner_of(cluster.slot_of(&lease_key(&lock)));
    let other = (owner + 1) % cluster.nodes.len();
    leasehold_testkit::redis_cluster::command(
        cluster.nodes[other].port(),
        &["CONFIG", "SET", "appendfsync", "everysec"],
    )
    .expect("CONFIG SET");
    tokio::task::block_in_place(|| cluster.restart_node(owner));
    let began = Instant::now();
    let second = loop {
        match driver.try_acquire(&lock, "b", lease).await {
            Ok(Acquire::Acquired(lease)) => break lease,
            Ok(other) => panic!("the durable master restarted held up a free lock: {other:?}"),
            // The cluster settling after the restart (a moved slot, a connection refused).
            Err(e) => {
                assert!(began.elapsed() < Duration::from_secs(20), "no answer: {e}");
                sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert!(
        second.token > first.token && second.token <= first.token + 2,
        "tokens go on from {} without a floor: {}",
        first.token,
        second.token
    );
}

/// Three locks, one on each master: a driver listens for release notices on one node, and a
/// release on any master wakes it through the cluster bus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_any_master_wakes_a_waiter() {
    let cluster = tokio::task::block_in_place(RedisCluster::start);
    let mut locks = vec![None; cluster.nodes.len()];
    let mut n = 0;
    while locks.iter().any(Option::is_none) {
        let lock = format!("{}-{n}", unique_lock("wake"));
        let owner = cluster.owner_of(cluster.slot_of(&lease_key(&lock)));
        locks[owner].get_or_insert(lock);
        n += 1;
    }
    let holder = driver_for(&cluster.url()).await;
    let waiter = driver_for(&cluster.url()).await;
    let ttl = Duration::from_secs(5);
    for (node, lock) in locks.iter().flatten().enumerate() {
        let mut changes = waiter.changes(lock).expect("release notices");
        if node == 0 {
            let nodes: Vec<&RedisServer> = cluster.nodes.iter().collect();
            assert!(
                until_pattern_subscribers(&nodes, 2, Duration::from_secs(10)).await,
                "the release listeners did not subscribe"
            );
        }
        changes.borrow_and_update();
        let Acquire::Acquired(lease) = holder.try_acquire(lock, "a", ttl).await.unwrap() else {
            panic!("{lock} on node {node} was free");
        };
        assert!(matches!(
            waiter.try_acquire(lock, "b", ttl).await.unwrap(),
            Acquire::Busy(Some(_))
        ));
        assert!(holder.release(&lease).await.unwrap());
        timeout(Duration::from_secs(2), changes.changed())
            .await
            .unwrap_or_else(|_| {
                panic!("no release notice from node {node} (the waiter listens on one node)")
            })
            .expect("feed open");
        assert!(matches!(
            waiter.try_acquire(lock, "b", ttl).await.unwrap(),
            Acquire::Acquired(_)
        ));
    }
}

/// Driven by the driver alone: the cluster's answers are routed by slot, so a lock named to land
/// on each master is held, refused to another and released there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_master_serves_the_locks_of_its_slots() {
    let cluster = tokio::task::block_in_place(RedisCluster::start);
    let driver: std::sync::Arc<dyn Backend> = driver_for(&cluster.url()).await;
    let mut seen = vec![false; cluster.nodes.len()];
    let mut n = 0;
    while seen.iter().any(|s| !s) {
        let lock = format!("{}-{n}", unique_lock("spread"));
        n += 1;
        let node = cluster.owner_of(cluster.slot_of(&lease_key(&lock)));
        if seen[node] {
            continue;
        }
        seen[node] = true;
        let Acquire::Acquired(lease) = driver
            .try_acquire(&lock, "a", Duration::from_secs(5))
            .await
            .unwrap()
        else {
            panic!("{lock} was free");
        };
        // The lease is on that master itself, not on the node the client first asked.
        let stored = leasehold_testkit::redis_cluster::command(
            cluster.nodes[node].port(),
            &["GET", &lease_key(&lock)],
        )
        .unwrap();
        assert_eq!(stored, format!("{}:a", lease.token), "on node {node}");
        assert!(driver.release(&lease).await.unwrap());
    }
}

/// Over TLS, a cluster whose nodes another CA signed is refused with the cause named, from the
/// driver's calls (readiness carries it), never a panic; the right CA then works on the same
/// nodes, each reached on its TLS port as the cluster names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_signed_by_another_ca_is_refused_by_name() {
    let cluster = tokio::task::block_in_place(RedisCluster::start_tls);
    let url = cluster.url();
    let elsewhere = tempfile::tempdir().unwrap();
    leasehold_testkit::write_test_certificates(elsewhere.path());
    let files = cluster.nodes[0].tls_files();
    let wrong_ca = url.replace(
        &format!("ca={}", files.ca.display()),
        &format!("ca={}", elsewhere.path().join("ca.crt").display()),
    );
    assert_ne!(wrong_ca, url);
    let driver = driver_for(&wrong_ca).await;
    match driver
        .try_acquire("tls-refusal", "a", Duration::from_secs(5))
        .await
    {
        Err(leasehold_lease::Error::Unreachable(message)) => {
            assert!(message.contains("not signed by the CA given"), "{message}")
        }
        other => panic!("expected the cluster to be unreachable over TLS, got {other:?}"),
    }
    let driver = driver_for(&url).await;
    assert!(matches!(
        driver
            .try_acquire("tls-refusal", "a", Duration::from_secs(5))
            .await
            .unwrap(),
        Acquire::Acquired(_)
    ));
}

/// Masters that refuse `CONFIG` to the lock's user (as managed clusters do) are still checked
/// for a policy that evicts lock keys: `INFO memory` tells it, and each warning names its master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masters_that_refuse_config_are_still_checked_for_eviction() {
    use leasehold_testkit::redis_cluster::command;
    let cluster = RedisCluster::start();
    for node in &cluster.nodes {
        let port = node.port();
        command(port, &["CONFIG", "SET", "maxmemory-policy", "allkeys-lfu"]).unwrap();
        command(
            port,
            &[
                "ACL", "SETUSER", "locker", "on", ">secret", "~*", "&*", "+@all", "-config",
            ],
        )
        .unwrap();
    }
    let url = cluster
        .url()
        .replacen("redis+cluster://", "redis+cluster://locker:secret@", 1);
    let driver = leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&url).unwrap())
        .await
        .unwrap();
    let warnings = driver.warnings().await.unwrap();
    assert!(
        warnings.len() == 3
            && warnings
                .iter()
                .all(|w| w.starts_with("master ") && w.contains("allkeys-lfu")),
        "{warnings:?}"
    );
}

/// The lease [`held_family_key`] takes its key for.
const FAMILY_KEY_LEASE: Duration = Duration::from_secs(5);

/// A driver on `cluster`, and a family's key (named after `name`) it holds for
/// [`FAMILY_KEY_LEASE`]: the key's epoch record and counter are its own, in its slot.
async fn held_family_key(
    cluster: &RedisCluster,
    name: &str,
) -> (std::sync::Arc<dyn Backend>, String, leasehold_lease::Lease) {
    let driver = driver_for(&cluster.url()).await;
    let lock = format!("{}.keys.order-1", unique_lock(name));
    match driver
        .try_acquire(&lock, "a", FAMILY_KEY_LEASE)
        .await
        .unwrap()
    {
        Acquire::Acquired(lease) => (driver, lock, lease),
        other => panic!("{lock} was free: {other:?}"),
    }
}

/// A family's key on a cluster keeps its own epoch record and counter, which expire a day after
/// the key was last used: renewals push them back, so that a key held longer than that still
/// has them (a promoted replica restarted on its own data trusts a missing record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_keep_a_held_family_keys_records() {
    let cluster = tokio::task::block_in_place(RedisCluster::start);
    let (driver, lock, lease) = held_family_key(&cluster, "records").await;
    let ttl = FAMILY_KEY_LEASE;
    let node = cluster.nodes[cluster.owner_of(cluster.slot_of(&lease_key(&lock)))].port();
    let records = [
        format!("leasehold:{{{lock}}}:epoch"),
        format!("leasehold:{{{lock}}}:token"),
    ];
    let pttl = |key: &str| -> i64 {
        leasehold_testkit::redis_cluster::command(node, &["PTTL", key])
            .unwrap()
            .parse()
            .unwrap()
    };
    let day = leasehold_lease::redis::KEY_COUNTER_RETENTION.as_millis() as i64;
    for key in &records {
        let kept = pttl(key);
        assert!(
            kept > day / 2,
            "{key} kept for {kept} ms after the acquisition"
        );
        // As if the key had been held for most of a day.
        leasehold_testkit::redis_cluster::command(node, &["PEXPIRE", key, "60000"]).unwrap();
    }
    assert!(driver.renew(&lease, ttl).await.unwrap());
    for key in &records {
        let kept = pttl(key);
        assert!(
            kept > day / 2,
            "{key} left to expire in {kept} ms while its key is held and renewed"
        );
    }
    assert!(driver.release(&lease).await.unwrap());
}

/// A family's key whose records are gone (a day idle before it was taken again, say) is renewed
/// while its slot is being migrated: a call on several of the slot's keys, some missing, is
/// answered TRYAGAIN by both nodes until the migration ends, so the renewal renews the lease
/// alone rather than fail for as long as the slot stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_family_key_is_renewed_while_its_slot_migrates_without_its_records() {
    use leasehold_testkit::redis_cluster::command;
    let cluster = tokio::task::block_in_place(RedisCluster::start);
    let (driver, lock, lease) = held_family_key(&cluster, "migrating").await;
    let ttl = FAMILY_KEY_LEASE;
    let slot = cluster.slot_of(&lease_key(&lock));
    let (from, to) = {
        let from = cluster.owner_of(slot);
        (
            cluster.nodes[from].port(),
            cluster.nodes[(from + 1) % cluster.nodes.len()].port(),
        )
    };
    let id = |port| command(port, &["CLUSTER", "MYID"]).unwrap();
    let slot_arg = slot.to_string();
    command(
        to,
        &["CLUSTER", "SETSLOT", &slot_arg, "IMPORTING", &id(from)],
    )
    .unwrap();
    command(
        from,
        &["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &id(to)],
    )
    .unwrap();
    command(from, &["DEL", &format!("leasehold:{{{lock}}}:epoch")]).unwrap();
    let renewed = driver.renew(&lease, ttl).await.map_err(|e| e.to_string());
    for port in [from, to] {
        command(port, &["CLUSTER", "SETSLOT", &slot_arg, "STABLE"]).unwrap();
    }
    assert_eq!(renewed, Ok(true), "the renewal while the slot migrates");
    assert!(driver.release(&lease).await.unwrap());
}

/// A holder whose master falls silent renews on a new connection within its lease, while the
/// cluster's other masters go on answering the same driver (a lock of its there is renewed
/// ten times a second): redis-rs's cluster client retries a command that timed out on the
/// same connection, and reconnects only to a node whose connection closed, and an answer from
/// another master says nothing of the silent one. Every node announces a proxy's port
/// (`cluster-announce-port`), so that the client reaches each master through one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_master_falls_silent_renews_on_a_new_connection() {
    let cluster = tokio::task::block_in_place(RedisCluster::start);
    // Chosen while the nodes still name their own ports, by which the harness knows them.
    let mut locks = vec![None; cluster.nodes.len()];
    let mut n = 0;
    while locks.iter().any(Option::is_none) {
        let lock = format!("{}-{n}", unique_lock("silent_master"));
        let owner = cluster.owner_of(cluster.slot_of(&lease_key(&lock)));
        locks[owner].get_or_insert(lock);
        n += 1;
    }
    let proxies: Vec<FaultProxy> = cluster
        .nodes
        .iter()
        .map(|node| FaultProxy::start(node.port()))
        .collect();
    for (node, proxy) in cluster.nodes.iter().zip(&proxies) {
        leasehold_testkit::redis_cluster::command(
            node.port(),
            &[
                "CONFIG",
                "SET",
                "cluster-announce-port",
                &proxy.port.to_string(),
            ],
        )
        .expect("announce the proxy's port");
    }
    let announced = |port: u16| {
        let nodes = leasehold_testkit::redis_cluster::command(port, &["CLUSTER", "NODES"])
            .expect("cluster nodes");
        proxies
            .iter()
            .all(|proxy| nodes.contains(&format!("127.0.0.1:{}@", proxy.port)))
    };
    let began = Instant::now();
    while !cluster.nodes.iter().all(|node| announced(node.port())) {
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "the nodes did not learn each other's announced ports"
        );
        sleep(Duration::from_millis(50)).await;
    }
    let hosts: Vec<String> = proxies
        .iter()
        .map(|proxy| format!("127.0.0.1:{}", proxy.port))
        .collect();
    let driver = driver_for(&format!("redis+cluster://{}", hosts.join(","))).await;
    let [Some(silent), Some(answering), ..] = &locks[..] else {
        unreachable!("a lock on each master")
    };
    let lease = Duration::from_secs(10);
    let other = campaign(driver.clone(), answering, "b", Duration::from_secs(1));
    let holder = campaign(driver, silent, "a", lease);
    let began = Instant::now();
    let token = loop {
        if let (Some(token), true) = (holder.answer().token(), other.answer().is_holder()) {
            break token;
        }
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "the locks were not taken"
        );
        sleep(Duration::from_millis(10)).await;
    };
    proxies[0].strand();
    let stranded = leasehold_lease::BootInstant::now();
    let start = Instant::now();
    while holder
        .snapshot()
        .held
        .is_none_or(|held| held.valid_until <= stranded + lease)
    {
        assert!(
            start.elapsed() < lease,
            "no renewal went through within the lease after the master fell silent: {:?}",
            holder.snapshot()
        );
        sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(holder.answer().token(), Some(token), "the holding was kept");
    assert!(claims(&holder));
    assert!(
        other.answer().is_holder(),
        "the other master's lock was kept"
    );
}
