//! Release notices on Redis go out only when someone waits: every sidecar's listener hears every
//! lock's notices, so a release that nobody waited for must not publish one. An acquisition
//! that finds the lock held marks it, and the release that follows publishes, wakes the waiter
//! and takes the mark down. Real servers.

use std::time::Duration;

use leasehold_lease::{Acquire, Backend, Lease};
use leasehold_testkit::{RedisServer, command_calls, driver_for, unique_lock};
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
    // The listener's subscription moves every feed once it is established.
    let _ = timeout(Duration::from_secs(3), changes.changed()).await;
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
