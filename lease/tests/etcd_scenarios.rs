//! etcd's fair queue: a release wakes exactly one waiter, and hand-overs follow the queue.

use leasehold_lease::etcd::{EtcdConfig, EtcdDriver};
use leasehold_lease::testkit::conformance::{contenders, one_release_wakes_exactly_one_waiter};
use leasehold_lease::testkit::{EtcdHarness, EtcdServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_release_wakes_exactly_one_of_fifty_waiters() {
    let server = EtcdServer::start();
    one_release_wakes_exactly_one_waiter(|| {
        EtcdDriver::connect(EtcdConfig {
            endpoints: vec![format!("http://127.0.0.1:{}", server.port())],
            prefix: "leasehold".into(),
            user: None,
        })
        .expect("driver")
    })
    .await;
}

/// Twenty contenders, two hundred hand-overs. The token is the create revision of a contender's
/// key, the order it joined the
/// queue in, so strictly increasing tokens (checked by `contenders`) mean the lock went round
/// in FIFO order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_contenders_two_hundred_handovers_in_fifo_order() {
    contenders(&mut EtcdHarness::new(), 20, 10).await;
}
