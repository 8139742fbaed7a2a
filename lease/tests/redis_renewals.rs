//! Renewals on a Redis master (alone, or each of Redlock's) go out together: renewals that
//! arrive at once cost each server one script call, and each is still answered for its own
//! lease (extended only while it holds the key, with its own ttl). Real servers.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::testkit::{Harness, RedisServer, RedlockHarness, driver_for, unique_lock};
use leasehold_lease::{Acquire, Driver, Lease};

/// How many times Redis has run a script (`EVALSHA`, `EVAL`).
async fn script_calls(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split_once("calls=")?
                .1
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// 40 renewals at once, every other with a token its lock never had: each is answered for its
/// own lease (and only the owned ones extend their key, on every server in `urls`), in fewer
/// than 4 script calls per server.
async fn renewals_at_once(driver: Arc<dyn Driver>, urls: &[String]) {
    const LOCKS: usize = 40;
    let mut admins = Vec::new();
    for url in urls {
        admins.push(
            redis::Client::open(url.as_str())
                .expect("client")
                .get_multiplexed_async_connection()
                .await
                .expect("connect"),
        );
    }
    let mut leases = Vec::new();
    for i in 0..LOCKS {
        let lock = unique_lock(&format!("renew-{i}"));
        match driver
            .try_acquire(&lock, "pod-a", Duration::from_secs(2))
            .await
        {
            Ok(Acquire::Acquired(lease)) => leases.push(lease),
            other => panic!("{lock}: {other:?}"),
        }
    }
    let asked: Vec<(Lease, bool)> = leases
        .iter()
        .enumerate()
        .map(|(i, lease)| {
            let mut asked = lease.clone();
            if i % 2 == 1 {
                asked.token += 100;
            }
            (asked, i % 2 == 0)
        })
        .collect();
    let mut before = Vec::new();
    for admin in &mut admins {
        before.push(script_calls(admin).await);
    }
    let answers = futures_util::future::join_all(
        asked
            .iter()
            .map(|(lease, _)| driver.renew(lease, Duration::from_secs(30))),
    )
    .await;
    for ((lease, owned), answer) in asked.iter().zip(answers) {
        assert_eq!(answer.expect("renew"), *owned, "{}", lease.lock);
    }
    for (admin, before) in admins.iter_mut().zip(before) {
        let calls = script_calls(admin).await - before - 1;
        assert!(
            calls < 4,
            "{LOCKS} renewals at once took {calls} script calls"
        );
        for (i, lease) in leases.iter().enumerate() {
            let pttl: i64 = redis::cmd("PTTL")
                .arg(format!("leasehold:{{{}}}:lease", lease.lock))
                .query_async(admin)
                .await
                .expect("PTTL");
            if i % 2 == 0 {
                assert!(pttl > 2_000, "{}: renewed, yet {pttl} ms left", lease.lock);
            } else {
                assert!(
                    (0..=2_000).contains(&pttl),
                    "{}: a refused renewal left {pttl} ms",
                    lease.lock
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_at_once_go_in_one_call_and_answer_each_for_its_lease() {
    let server = RedisServer::start();
    renewals_at_once(driver_for(&server.url()).await, &[server.url()]).await;
}

/// On Redlock, on each master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_renewals_at_once_go_in_one_call_per_master() {
    let harness = RedlockHarness::new();
    let urls: Vec<String> = harness
        .masters
        .lock()
        .unwrap()
        .iter()
        .map(RedisServer::url)
        .collect();
    renewals_at_once(harness.driver().await, &urls).await;
}
