//! What a family's keys leave in Redis (single master, each master of Redlock, Redis Cluster,
//! Tair). Keys are chosen at run time without bound (`order-1234`, ...), so a key nobody holds
//! must not keep a record for ever; its tokens must still rise when it is taken again after its records are
//! gone; and a sidecar of an earlier version, which draws a key's token from the key's own
//! counter alone, must keep drawing above every token given meanwhile (a rolling upgrade runs
//! both side by side). Real servers.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::keyed::{FamilyConfig, KeyAnswer, KeyRelease, KeyedFamily};
use leasehold_lease::redis::KEY_COUNTER_RETENTION;
use leasehold_testkit::{RedisServer, driver_for, unique_lock};
use redis::aio::MultiplexedConnection;

const LEASE: Duration = Duration::from_secs(5);
const HOLD: Duration = Duration::from_secs(60);

async fn keys(conn: &mut MultiplexedConnection) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("leasehold:*")
        .query_async(conn)
        .await
        .expect("KEYS");
    keys.sort();
    keys
}

async fn pttl(conn: &mut MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(conn)
        .await
        .expect("PTTL")
}

/// A family of a name of its own (from `prefix`) on `url`.
async fn family_on(url: &str, prefix: &str) -> (String, KeyedFamily) {
    let name = unique_lock(prefix);
    let family = KeyedFamily::new(
        driver_for(url).await,
        FamilyConfig::new(&name, "pod-a", LEASE),
        Arc::new(()),
    )
    .expect("family");
    (name, family)
}

async fn take(family: &KeyedFamily, key: &str) -> u64 {
    match family
        .acquire(key, "worker", Duration::ZERO, HOLD)
        .await
        .expect("acquire")
    {
        KeyAnswer::Held { token, .. } => token,
        other => panic!("{key}: {other:?}"),
    }
}

async fn give_back(family: &KeyedFamily, key: &str) {
    assert_eq!(
        family.release(key, "worker").await.expect("release"),
        KeyRelease::Released { holds: 0 }
    );
}

/// Every key's own counter is gone after a while: the only records kept for good are the
/// family's counter and the server's epoch record.
async fn only_family_records_stay(servers: &[RedisServer], url: &str) {
    let (name, family) = family_on(url, "idle").await;
    let mut tokens = Vec::new();
    for i in 0..20 {
        let key = format!("order-{i}");
        tokens.push(take(&family, &key).await);
        give_back(&family, &key).await;
    }
    let counter = format!("leasehold:{{{name}}}:keytokens");
    for server in servers {
        let mut conn = server.admin().await;
        for key in keys(&mut conn).await {
            let left = pttl(&mut conn, &key).await;
            if key == counter || key == "leasehold:epoch" {
                assert_eq!(left, -1, "{key}");
                continue;
            }
            // A key's own counter, kept for the versions before family counters, then gone.
            assert!(
                key.ends_with(":token") && key.contains(".keys.order-"),
                "a record left by an idle key: {key}"
            );
            assert!(
                left > 0 && left <= KEY_COUNTER_RETENTION.as_millis() as i64,
                "{key} is kept for ever (PTTL {left})"
            );
        }
    }

    // The key's own counters expire (here: at once): a key taken again still gets a higher
    // token, from the family's counter.
    for server in servers {
        let mut conn = server.admin().await;
        for key in keys(&mut conn).await {
            if key.ends_with(":token") {
                let _: i64 = redis::cmd("DEL")
                    .arg(&key)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
        }
    }
    let again = take(&family, "order-0").await;
    assert!(
        again > tokens[0],
        "order-0 taken again with token {again} after {}",
        tokens[0]
    );
    give_back(&family, "order-0").await;
    family.shutdown().await;
}

/// A key with a counter of its own left by an earlier version: the next token is above it, and
/// an earlier version's next draw (`INCR` of that counter) is above that.
async fn earlier_versions_counters_are_honoured(servers: &[RedisServer], url: &str) {
    let (name, family) = family_on(url, "upgrade").await;
    let own = format!("leasehold:{{{name}.keys.sku-9}}:token");
    for server in servers {
        let _: () = redis::cmd("SET")
            .arg(&own)
            .arg(1000)
            .query_async(&mut server.admin().await)
            .await
            .unwrap();
    }
    let token = take(&family, "sku-9").await;
    assert!(
        token > 1000,
        "token {token} below the key's earlier counter 1000"
    );
    give_back(&family, "sku-9").await;
    // Another key of the family raises the family's counter; an earlier version's draw for
    // sku-9 must still exceed every token sku-9 was given.
    for i in 0..5 {
        let key = format!("other-{i}");
        take(&family, &key).await;
        give_back(&family, &key).await;
    }
    for server in servers {
        let drawn: u64 = redis::cmd("INCR")
            .arg(&own)
            .query_async(&mut server.admin().await)
            .await
            .unwrap();
        assert!(
            drawn > token,
            "an earlier version would draw {drawn} after {token}"
        );
    }
    let next = take(&family, "sku-9").await;
    assert!(next > token + 1, "token {next} after an earlier version's");
    family.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_idle_keys_leave_only_the_familys_counter() {
    let server = RedisServer::start();
    let url = server.url();
    only_family_records_stay(&[server], &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_draw_above_counters_of_earlier_versions() {
    let server = RedisServer::start();
    let url = server.url();
    earlier_versions_counters_are_honoured(&[server], &url).await;
}

fn redlock() -> (Vec<RedisServer>, String) {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let hosts: Vec<String> = servers
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port()))
        .collect();
    let url = format!("redlock://{}", hosts.join(","));
    (servers, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_idle_keys_leave_only_the_familys_counter() {
    let (servers, url) = redlock();
    only_family_records_stay(&servers, &url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_keys_draw_above_counters_of_earlier_versions() {
    let (servers, url) = redlock();
    earlier_versions_counters_are_honoured(&servers, &url).await;
}

/// The server's clock in microseconds (`TIME`).
async fn server_micros(conn: &mut MultiplexedConnection) -> i64 {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await.expect("TIME");
    secs * 1_000_000 + micros
}

/// Twenty keys, each taken and given back three times over: each key's tokens rise. The last
/// token of each, by key.
async fn cycle_keys(family: &KeyedFamily) -> std::collections::HashMap<String, u64> {
    let mut last = std::collections::HashMap::new();
    for round in 0..3 {
        for i in 0..20 {
            let key = format!("order-{i}");
            let token = take(family, &key).await;
            if let Some(before) = last.insert(key.clone(), token) {
                assert!(
                    token > before,
                    "{key} round {round}: {token} after {before}"
                );
            }
            give_back(family, &key).await;
        }
    }
    last
}

/// A key whose token runs ahead of the clock (a floor raised by restarts in quick succession)
/// keeps its counter until the clock has passed it by the retention: `order-1`'s counter, set
/// 10^9 ms ahead through `conn`, a connection to the server that holds it.
async fn ahead_of_the_clock_is_kept_longer(
    family: &KeyedFamily,
    name: &str,
    conn: &mut MultiplexedConnection,
) {
    let retention = KEY_COUNTER_RETENTION.as_millis() as i64;
    let ahead_ms: i64 = 1_000_000_000;
    let counter = format!("leasehold:{{{name}.keys.order-1}}:token");
    let now = server_micros(conn).await;
    let _: () = redis::cmd("SET")
        .arg(&counter)
        .arg(now + ahead_ms * 1000)
        .query_async(conn)
        .await
        .unwrap();
    let token = take(family, "order-1").await;
    assert!(token as i64 > now + ahead_ms * 1000, "token {token}");
    give_back(family, "order-1").await;
    let left = pttl(conn, &counter).await;
    assert!(
        left > retention + ahead_ms - 60_000,
        "a counter {ahead_ms} ms ahead of the clock is kept {left} ms"
    );
}

/// On a Redis Cluster a family's key keeps a counter and an epoch record of its own, in its own
/// slot: both expire a day after the key's last acquisition, later by as much as its token runs
/// ahead of the clock, and a key whose records are gone still draws above every earlier token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_idle_keys_leave_records_that_expire() {
    let cluster = tokio::task::block_in_place(leasehold_testkit::RedisCluster::start);
    let (name, family) = family_on(&cluster.url(), "idle").await;
    let last = cycle_keys(&family).await;
    let retention = KEY_COUNTER_RETENTION.as_millis() as i64;
    let mut records = 0;
    for node in &cluster.nodes {
        let mut conn = node.admin().await;
        for key in keys(&mut conn).await {
            assert!(
                key.contains(&format!("{{{name}.keys.order-")),
                "a record of no key: {key}"
            );
            let left = pttl(&mut conn, &key).await;
            assert!(
                left > 0 && left <= retention,
                "{key} is kept for ever (PTTL {left})"
            );
            records += 1;
        }
    }
    // Each key's counter and epoch record; the leases are gone with their release.
    assert_eq!(records, 40, "records of 20 idle keys");

    let counter = format!("leasehold:{{{name}.keys.order-1}}:token");
    let node = &cluster.nodes[cluster.owner_of(cluster.slot_of(&counter))];
    ahead_of_the_clock_is_kept_longer(&family, &name, &mut node.admin().await).await;

    // Records gone (as when they expire): the key's next token is still above its last one,
    // whether the epoch record went with the counter or stayed.
    for (key, with_epoch) in [("order-2", true), ("order-3", false)] {
        let prefix = format!("leasehold:{{{name}.keys.{key}}}");
        let node = &cluster.nodes[cluster.owner_of(cluster.slot_of(&prefix))];
        let mut conn = node.admin().await;
        let mut gone = redis::cmd("DEL");
        gone.arg(format!("{prefix}:token"));
        if with_epoch {
            gone.arg(format!("{prefix}:epoch"));
        }
        let deleted: i64 = gone.query_async(&mut conn).await.unwrap();
        assert_eq!(deleted, if with_epoch { 2 } else { 1 }, "{key}'s records");
        let again = take(&family, key).await;
        assert!(
            again > last[key],
            "{key} taken again with token {again} after {}",
            last[key]
        );
        give_back(&family, key).await;
    }
    family.shutdown().await;
}

/// On Tair each of a family's keys has a token counter of its own (the claim draws it in the
/// claim's round trip, without Lua): it expires a day after the key's last claim, later by as
/// much as its token runs ahead of the clock, and a key whose counter is gone still draws above
/// every earlier token. The server's epoch record is the only record kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tair_idle_keys_leave_counters_that_expire() {
    let server = RedisServer::start_tair();
    let (name, family) = family_on(&server.url(), "idle").await;
    let last = cycle_keys(&family).await;
    let retention = KEY_COUNTER_RETENTION.as_millis() as i64;
    let mut conn = server.admin().await;
    let mut counters = 0;
    for key in keys(&mut conn).await {
        let left = pttl(&mut conn, &key).await;
        if key == "leasehold:epoch:tair" {
            assert_eq!(left, -1, "{key}");
            continue;
        }
        assert!(
            key.starts_with(&format!("leasehold:{{{name}.keys.order-")) && key.ends_with(":token"),
            "a record left by an idle key: {key}"
        );
        assert!(
            left > 0 && left <= retention,
            "{key} is kept for ever (PTTL {left})"
        );
        counters += 1;
    }
    assert_eq!(counters, 20, "one counter a key");

    ahead_of_the_clock_is_kept_longer(&family, &name, &mut conn).await;

    // A counter gone (as when it expires): the key's next token is still above its last one,
    // from this driver (which remembers the counter) and from a new one (which reads it first).
    for (key, fresh) in [("order-2", false), ("order-3", true)] {
        let deleted: i64 = redis::cmd("DEL")
            .arg(format!("leasehold:{{{name}.keys.{key}}}:token"))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(deleted, 1, "{key}'s counter");
        let again = if fresh {
            let other = KeyedFamily::new(
                driver_for(&server.url()).await,
                FamilyConfig::new(&name, "pod-b", LEASE),
                Arc::new(()),
            )
            .expect("family");
            let token = take(&other, key).await;
            give_back(&other, key).await;
            other.shutdown().await;
            token
        } else {
            let token = take(&family, key).await;
            give_back(&family, key).await;
            token
        };
        assert!(
            again > last[key],
            "{key} taken again with token {again} after {}",
            last[key]
        );
    }
    family.shutdown().await;
}
