//! Renewals on a Redis master (alone, or each of Redlock's) go out together: renewals that
//! arrive at once cost each server one script call, and each is still answered for its own
//! lease (extended only while it holds the key, with its own ttl). Real servers.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::{Acquire, Backend, Lease};
use leasehold_testkit::{
    Harness, RedisSentinelSet, RedisServer, RedlockHarness, command_calls, driver_for, unique_lock,
};

/// How many times Redis has run a script (`EVALSHA`, `EVAL`).
async fn script_calls(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    command_calls(conn, &["evalsha", "eval"]).await
}

/// What each lock is taken for: long enough that none runs out while the others are taken one
/// after another (each confirmed by a replica or a quorum, slow on a loaded machine), so that a
/// renewal's answer says only whether its token matches.
const TAKEN_FOR: Duration = Duration::from_secs(60);
/// What a renewal asks for: above [`TAKEN_FOR`], so that a key's time left says whether it was
/// extended.
const RENEWED_FOR: Duration = Duration::from_secs(120);

/// `count` locks named after `name`, each taken for [`TAKEN_FOR`].
async fn acquired(driver: &dyn Backend, name: &str, count: usize) -> Vec<Lease> {
    let mut leases = Vec::new();
    for i in 0..count {
        let lock = unique_lock(&format!("{name}-{i}"));
        match driver.try_acquire(&lock, "pod-a", TAKEN_FOR).await {
            Ok(Acquire::Acquired(lease)) => leases.push(lease),
            other => panic!("{lock}: {other:?}"),
        }
    }
    leases
}

/// 40 renewals at once, every other with a token its lock never had: each is answered for its
/// own lease (and only the owned ones extend their key, on every server in `urls`), in fewer
/// than 4 script calls per server, and fewer than 4 `WAIT`s for replicas where they are asked.
async fn renewals_at_once(driver: Arc<dyn Backend>, urls: &[String]) {
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
    let leases = acquired(&*driver, "renew", LOCKS).await;
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
        before.push((
            script_calls(admin).await,
            command_calls(admin, &["wait"]).await,
        ));
    }
    let answers = futures_util::future::join_all(
        asked
            .iter()
            .map(|(lease, _)| driver.renew(lease, RENEWED_FOR)),
    )
    .await;
    for ((lease, owned), answer) in asked.iter().zip(answers) {
        assert_eq!(answer.expect("renew"), *owned, "{}", lease.lock);
    }
    for (admin, (scripts_before, waits_before)) in admins.iter_mut().zip(before) {
        let scripts = script_calls(admin).await - scripts_before - 1;
        assert!(
            scripts < 4,
            "{LOCKS} renewals at once took {scripts} script calls"
        );
        let waits = command_calls(admin, &["wait"]).await - waits_before;
        assert!(waits < 4, "{LOCKS} renewals at once took {waits} WAITs");
        for (i, lease) in leases.iter().enumerate() {
            let pttl: i64 = redis::cmd("PTTL")
                .arg(format!("leasehold:{{{}}}:lease", lease.lock))
                .query_async(admin)
                .await
                .expect("PTTL");
            let taken_for = TAKEN_FOR.as_millis() as i64;
            if i % 2 == 0 {
                assert!(
                    pttl > taken_for,
                    "{}: renewed, yet {pttl} ms left",
                    lease.lock
                );
            } else {
                assert!(
                    (0..=taken_for).contains(&pttl),
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

/// Behind Sentinel, on the master, each batch confirmed by the replica with one `WAIT`; with
/// the replica's link cut, every renewal of a batch is an error that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_renewals_at_once_go_in_one_call_with_one_wait() {
    let set = RedisSentinelSet::start();
    let master = set.servers[set.master().expect("the sentinel names a master")].url();
    renewals_at_once(driver_for(&set.url()).await, &[master]).await;

    let driver = driver_for(&set.url()).await;
    let leases = acquired(&*driver, "unconfirmed", 10).await;
    set.replication_link.cut();
    let answers =
        futures_util::future::join_all(leases.iter().map(|lease| driver.renew(lease, RENEWED_FOR)))
            .await;
    for (lease, answer) in leases.iter().zip(answers) {
        let error = answer.expect_err("a renewal no replica confirmed");
        assert!(
            error
                .to_string()
                .contains("confirmed by 0 of the 1 replica(s) min-replicas asks for"),
            "{}: {error}",
            lease.lock
        );
    }
    set.replication_link.restore();
}
