//! What a family's keys leave in Redis (single master, and each master of Redlock). Keys are
//! chosen at run time without bound (`order-1234`, ...), so a key nobody holds must not keep a
//! record for ever; its tokens must still rise when it is taken again after its records are
//! gone; and a sidecar of an earlier version, which draws a key's token from the key's own
//! counter alone, must keep drawing above every token given meanwhile (a rolling upgrade runs
//! both side by side). Real servers.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::keyed::{FamilyConfig, KeyAnswer, KeyRelease, KeyedFamily};
use leasehold_lease::redis::KEY_COUNTER_RETENTION;
use leasehold_lease::testkit::{RedisServer, driver_for, unique_lock};
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
