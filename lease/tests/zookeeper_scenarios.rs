//! ZooKeeper's fair queue: a release wakes exactly one waiter, and hand-overs follow the queue.

use std::time::Duration;

use leasehold_lease::testkit::conformance::contenders;
use leasehold_lease::testkit::{ZooKeeperHarness, ZooKeeperServer, unique_lock};
use leasehold_lease::zookeeper::{ZooKeeperConfig, ZooKeeperDriver};
use leasehold_lease::{Acquire, Driver};

const WAITERS: usize = 50;
/// Long enough that no waiter's key needs its engine to come back during the test.
const TTL: Duration = Duration::from_secs(10);

fn driver(server: &ZooKeeperServer) -> ZooKeeperDriver {
    ZooKeeperDriver::connect(ZooKeeperConfig {
        servers: format!("127.0.0.1:{}", server.port()),
        root: "/leasehold".into(),
        digest: None,
    })
    .expect("driver")
}

/// Fifty waiters queue behind a holder; its release wakes the first of them and nobody else,
/// and that one holds with the next token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_release_wakes_exactly_one_waiter() {
    let server = ZooKeeperServer::start();
    let lock = unique_lock("herd");
    let holder = driver(&server);
    let Acquire::Acquired(lease) = holder.try_acquire(&lock, "holder", TTL).await.unwrap() else {
        panic!("the first contender must hold")
    };
    let mut waiters = Vec::new();
    for i in 0..WAITERS {
        let waiter = driver(&server);
        let identity = format!("w{i}");
        let busy = waiter.try_acquire(&lock, &identity, TTL).await.unwrap();
        assert!(
            matches!(busy, Acquire::Busy(Some(_))),
            "{identity}: {busy:?}"
        );
        waiters.push((waiter, identity));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let woken = || waiters.iter().map(|(w, _)| w.wakeups()).sum::<u64>();
    assert_eq!(woken(), 0, "waiters woke before any release");

    assert!(holder.release(&lease).await.unwrap());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while waiters[0].0.wakeups() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first waiter was never woken"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(woken(), 1, "one release woke {} waiters", woken());

    let (first, identity) = &waiters[0];
    let Acquire::Acquired(next) = first.try_acquire(&lock, identity, TTL).await.unwrap() else {
        panic!("the woken waiter is not the holder")
    };
    assert!(next.token > lease.token);
    // The others are still behind it, in order.
    let (second, identity) = &waiters[1];
    assert!(matches!(
        second.try_acquire(&lock, identity, TTL).await.unwrap(),
        Acquire::Busy(_)
    ));
}

/// Twenty contenders, two hundred hand-overs. The token is the czxid of a contender's node, the
/// order it joined the queue in, so strictly increasing tokens (checked by `contenders`) mean
/// the lock went round in FIFO order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_contenders_two_hundred_handovers_in_fifo_order() {
    contenders(&mut ZooKeeperHarness::new(), 20, 10).await;
}
