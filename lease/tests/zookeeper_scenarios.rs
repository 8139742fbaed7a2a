//! ZooKeeper's fair queue: a release wakes exactly one waiter, and hand-overs follow the queue.

use leasehold_lease::testkit::conformance::{
    contenders, one_release_wakes_exactly_one_waiter, waiters_further_back_poll_quietly,
};
use leasehold_lease::testkit::{ZooKeeperHarness, ZooKeeperServer};
use leasehold_lease::zookeeper::{ZooKeeperConfig, ZooKeeperDriver};

fn driver(server: &ZooKeeperServer) -> ZooKeeperDriver {
    ZooKeeperDriver::connect(ZooKeeperConfig {
        servers: format!("127.0.0.1:{}", server.port()),
        root: "/leasehold".into(),
        digest: None,
    })
    .expect("driver")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_release_wakes_exactly_one_of_fifty_waiters() {
    let server = ZooKeeperServer::start();
    one_release_wakes_exactly_one_waiter(|| driver(&server)).await;
}

/// Of three in the queue, the one at the back polls without costing ZooKeeper a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_further_back_cost_no_requests() {
    let server = ZooKeeperServer::start();
    waiters_further_back_poll_quietly(|| driver(&server), || server.packets_received()).await;
}

/// Twenty contenders, two hundred hand-overs. The token is the czxid of a contender's node, the order it joined the
/// queue in, so strictly increasing tokens (checked by `contenders`) mean the lock went round
/// in FIFO order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_contenders_two_hundred_handovers_in_fifo_order() {
    contenders(&mut ZooKeeperHarness::new(), 20, 10).await;
}

/// A server whose `minSessionTimeout` is above the lease keeps a crashed holder's node that
/// long: the lock says so (log, `/lock`, `/readyz`) instead of promising a takeover within the
/// lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_longer_than_the_lease_is_reported() {
    use std::time::Duration;
    let server = leasehold_lease::testkit::ZooKeeperServer::start_with_min_session(Some(
        Duration::from_secs(4),
    ));
    let url = leasehold_lease::BackendUrl::parse(&server.url()).unwrap();
    leasehold_lease::testkit::conformance::an_enforced_lease_longer_than_configured_is_reported(
        leasehold_lease::connect(&url).await.unwrap(),
        Duration::from_secs(2),
        "4s",
    )
    .await;
}
