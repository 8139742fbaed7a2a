//! Release notices on Redis go out only when someone waits: every sidecar's listener hears every
//! lock's notices, so a release that nobody waited for must not publish one. An acquisition
//! that finds the lock held marks it, and the release that follows publishes, wakes the waiter
//! and takes the mark down. A subscription whose connection falls silent is made again. Real
//! servers.

use std::time::Duration;

use leasehold_lease::{Acquire, Backend, Lease};
use leasehold_testkit::{
    FaultProxy, RedisServer, command_calls, driver_for, unique_lock, until_pattern_subscribers,
};
use tokio::time::timeout;

const TTL: Duration = Duration::from_secs(5);

/// How many notices the server has published (those from scripts included).
async fn publishes(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    command_calls(conn, &["publish"]).await
}

async fn take(driver: &dyn Backend, lock: &str, identity: &str) -> Lease {
    match driver
        .try_acquire(lock, identity, TTL)
        .await
        .expect("acquire")
    {
        Acquire::Acquired(lease) => lease,
        other => panic!("{lock} for {identity}: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_publishes_only_after_an_attempt_found_the_lock_held() {
    let server = RedisServer::start();
    let (holder, waiter) = (
        driver_for(&server.url()).await,
        driver_for(&server.url()).await,
    );
    let mut admin = server.admin().await;
    let lock = unique_lock("notice");
    let mark = format!("leasehold:{{{lock}}}:waiters");
    let mut changes = waiter.changes(&lock).expect("release notices");
    assert!(
        until_pattern_subscribers(&[&server], 2, Duration::from_secs(10)).await,
        "the release listeners did not subscribe"
    );
    changes.borrow_and_update();

    // Nobody waited: no notice.
    let lease = take(&*holder, &lock, "a").await;
    let before = publishes(&mut admin).await;
    assert!(holder.release(&lease).await.expect("release"));
    assert_eq!(
        publishes(&mut admin).await - before,
        0,
        "a release that nobody waited for published a notice"
    );

    // A waiter found it held: the release publishes once, wakes it, and takes the mark down.
    let lease = take(&*holder, &lock, "a").await;
    assert!(matches!(
        waiter.try_acquire(&lock, "b", TTL).await.expect("attempt"),
        Acquire::Busy(Some(_))
    ));
    let marked: bool = redis::cmd("EXISTS")
        .arg(&mark)
        .query_async(&mut admin)
        .await
        .expect("EXISTS");
    assert!(marked, "a busy attempt left no mark");
    let before = publishes(&mut admin).await;
    assert!(holder.release(&lease).await.expect("release"));
    assert_eq!(publishes(&mut admin).await - before, 1);
    timeout(Duration::from_secs(2), changes.changed())
        .await
        .expect("the waiter was not told of the release")
        .expect("feed open");
    let marked: bool = redis::cmd("EXISTS")
        .arg(&mark)
        .query_async(&mut admin)
        .await
        .expect("EXISTS");
    assert!(!marked, "the release left the mark");

    // The waiter's turn; nobody waits for it, so its release is quiet again.
    let lease = take(&*waiter, &lock, "b").await;
    let before = publishes(&mut admin).await;
    assert!(waiter.release(&lease).await.expect("release"));
    assert_eq!(publishes(&mut admin).await - before, 0);
}

/// A Redis user may be refused the release channels (Redis 7 gives a new user none unless
/// `acl-pubsub-default` says otherwise): its releases still release, each of a batch sent
/// together, and waiters learn of them at their next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_refused_the_release_channels_still_releases() {
    refused_the_release_channels(RedisServer::start(), "redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tair_user_refused_the_release_channels_still_releases() {
    refused_the_release_channels(RedisServer::start_tair(), "tair").await;
}

async fn refused_the_release_channels(server: RedisServer, scheme: &str) {
    let mut admin = server.admin().await;
    let _: () = redis::cmd("ACL")
        .arg(
            &[
                "SETUSER",
                "locker",
                "on",
                ">secret",
                "~*",
                "resetchannels",
                "+@all",
            ][..],
        )
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    let url = format!("{scheme}://locker:secret@127.0.0.1:{}", server.port());
    let (holder, waiter) = (driver_for(&url).await, driver_for(&url).await);
    let locks: Vec<String> = (0..4)
        .map(|i| unique_lock(&format!("refused-{i}")))
        .collect();
    let mut leases = Vec::new();
    for lock in &locks {
        leases.push(take(&*holder, lock, "a").await);
        // A waiter found it held, so the release has a notice to publish.
        assert!(matches!(
            waiter.try_acquire(lock, "b", TTL).await.expect("attempt"),
            Acquire::Busy(Some(_))
        ));
    }
    let released =
        futures_util::future::join_all(leases.iter().map(|lease| holder.release(lease))).await;
    for (lock, released) in locks.iter().zip(released) {
        assert!(
            released.unwrap_or_else(|e| panic!("the release of {lock} failed: {e}")),
            "{lock} was not released"
        );
        take(&*waiter, lock, "b").await;
    }
}

/// The least-privileged user `docs/backends/redis.md` shows takes, releases and is woken by
/// release notices, with no warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_least_privileged_user_takes_locks_and_hears_releases() {
    let server = RedisServer::start();
    let mut admin = server.admin().await;
    let documented = include_str!("../../docs/backends/redis.md")
        .lines()
        .find(|line| line.starts_with("ACL SETUSER leasehold "))
        .expect("redis.md shows an ACL SETUSER line")
        .replace("PASSWORD", "secret");
    let mut setuser = redis::cmd("ACL");
    for word in documented.split_whitespace().skip(1) {
        setuser.arg(word);
    }
    let _: () = setuser.query_async(&mut admin).await.expect("ACL SETUSER");
    let url = format!("redis://leasehold:secret@127.0.0.1:{}", server.port());
    let (holder, waiter) = (driver_for(&url).await, driver_for(&url).await);
    let lock = unique_lock("least");
    let mut changes = waiter.changes(&lock).expect("release notices");
    if !until_pattern_subscribers(&[&server], 2, Duration::from_secs(10)).await {
        let log: redis::Value = redis::cmd("ACL")
            .arg("LOG")
            .query_async(&mut admin)
            .await
            .unwrap();
        panic!("the subscription was not established: {log:?}");
    }
    changes.borrow_and_update();
    let lease = take(&*holder, &lock, "a").await;
    assert!(matches!(
        waiter.try_acquire(&lock, "b", TTL).await.expect("attempt"),
        Acquire::Busy(Some(_))
    ));
    assert!(holder.release(&lease).await.expect("release"));
    timeout(Duration::from_secs(2), changes.changed())
        .await
        .expect("the waiter was not told of the release")
        .expect("feed open");
    let lease = take(&*waiter, &lock, "b").await;
    assert!(waiter.release(&lease).await.expect("release"));
    assert_eq!(
        waiter.warnings().await.expect("warnings"),
        Vec::<String>::new()
    );
    assert_eq!(
        waiter.count_held_keys(&lock).await.expect("counting"),
        Some(0)
    );
}

/// The subscription's connection falls silent without being closed (a NAT or conntrack entry
/// gone): no notice comes over it any more, and nothing ends it. The listener's ping goes
/// unanswered and it subscribes again on a new connection (every waiter is woken then, for a
/// release it may have missed), so a release after that wakes the waiter at once again, where
/// each waiter would otherwise have learnt of every release only at its next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_that_falls_silent_is_made_again() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.port());
    let holder = driver_for(&server.url()).await;
    let waiter = driver_for(&format!("redis://127.0.0.1:{}", proxy.port)).await;
    let lock = unique_lock("silent-notice");
    let mut changes = waiter.changes(&lock).expect("release notices");
    assert!(
        until_pattern_subscribers(&[&server], 2, Duration::from_secs(10)).await,
        "the release listeners did not subscribe"
    );
    changes.borrow_and_update();

    proxy.strand();
    // A ping every 5 s, answered within 5 s. The stranded connection stays open on the server
    // beside the new one.
    assert!(
        until_pattern_subscribers(&[&server], 3, Duration::from_secs(15)).await,
        "not subscribed again once the connection fell silent"
    );
    changes.borrow_and_update();

    let lease = take(&*holder, &lock, "a").await;
    // The waiter's own connection fell silent too: its first attempt may time out on it.
    let start = tokio::time::Instant::now();
    loop {
        match waiter.try_acquire(&lock, "b", TTL).await {
            Ok(Acquire::Busy(Some(_))) => break,
            other => {
                assert!(
                    start.elapsed() < Duration::from_secs(12),
                    "the waiter never found the lock held: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    changes.borrow_and_update();
    assert!(holder.release(&lease).await.expect("release"));
    timeout(Duration::from_secs(2), changes.changed())
        .await
        .expect("the release woke the waiter")
        .unwrap();
}
