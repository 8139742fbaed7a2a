//! A release whose message is lost on the network must not leave the lock blocked. On ZooKeeper
//! the session outlives a dropped connection, so a lost `delete` would leave the holder's node
//! first in the queue for as long as the process lives: nobody, the releasing sidecar included,
//! could take the lock. The driver keeps the node as an orphan and deletes it at its next call,
//! an idle sidecar's observation included.

use std::time::Duration;

use leasehold_e2e::fault_proxy::FaultProxy;
use leasehold_lease::{Acquire, Backend, BackendUrl};
use leasehold_testkit::{ZooKeeperServer, unique_lock};

async fn driver(url: &str) -> std::sync::Arc<dyn Backend> {
    leasehold_lease::connect(&BackendUrl::parse(url).expect("url"))
        .await
        .expect("driver")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_a_release_lost_in_a_partition_does_not_block_the_lock() {
    a_lost_release_does_not_block_the_lock(Release::Awaited).await;
}

/// The same release, given up by its caller mid-way, as the engine gives up a release that
/// takes longer than its budget: the dropped call must still leave the node to be deleted
/// (found by the waiters' safety check, on a ZooKeeper restart: four seconds with no holder).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_a_release_given_up_mid_way_does_not_block_the_lock() {
    a_lost_release_does_not_block_the_lock(Release::GivenUp).await;
}

enum Release {
    /// The caller waits for the release's own error.
    Awaited,
    /// The caller drops the release after a moment.
    GivenUp,
}

async fn a_lost_release_does_not_block_the_lock(release: Release) {
    let server = ZooKeeperServer::start();
    let proxy = FaultProxy::start(server.port());
    let lease = Duration::from_secs(6);
    let lock = unique_lock("lost-release");
    let a = driver(&format!(
        "zk://127.0.0.1:{}/leasehold?tick-time=100ms",
        proxy.port
    ))
    .await;
    let b = driver(&server.url()).await;
    let Acquire::Acquired(la) = a.try_acquire(&lock, "a", lease).await.expect("a") else {
        panic!("a did not acquire a free lock")
    };

    proxy.cut();
    match release {
        Release::Awaited => {
            let releasing = {
                let (a, la) = (a.clone(), la.clone());
                tokio::spawn(async move { a.release(&la).await })
            };
            tokio::time::sleep(Duration::from_millis(1500)).await;
            // Healed well within the session timeout: the session, and the node, live on.
            proxy.restore();
            let released = tokio::time::timeout(Duration::from_secs(10), releasing)
                .await
                .expect("the release returns")
                .expect("task");
            assert!(
                !matches!(released, Ok(true)),
                "the delete was not supposed to get through: {released:?}"
            );
        }
        Release::GivenUp => {
            let given_up = tokio::time::timeout(Duration::from_millis(300), a.release(&la)).await;
            assert!(given_up.is_err(), "the release returned: {given_up:?}");
            tokio::time::sleep(Duration::from_millis(1200)).await;
            proxy.restore();
        }
    }

    // What an idle sidecar does every renew interval; it reaches ZooKeeper again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if a.observe(&lock).await.is_ok() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a never reached ZooKeeper again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let taken = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        // a goes on observing, as an idle sidecar does every renew interval: an orphan whose
        // delete failed while a's connection came back is tried again then.
        let _ = a.observe(&lock).await;
        match b.try_acquire(&lock, "b", lease).await.expect("b") {
            Acquire::Acquired(lb) => {
                assert!(lb.token > la.token);
                break;
            }
            Acquire::Busy(holder) => assert!(
                tokio::time::Instant::now() < taken,
                "the lock stays blocked by a's released node: {holder:?}"
            ),
            Acquire::Withheld(withheld) => {
                panic!("a ZooKeeper lock is never withheld: {withheld:?}")
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
