//! etcd's fair queue: a release wakes exactly one waiter, and hand-overs follow the queue.

use leasehold_lease::etcd::{EtcdConfig, EtcdDriver};
use leasehold_lease::testkit::conformance::{
    contenders, one_release_wakes_exactly_one_waiter, waiters_further_back_poll_quietly,
};
use leasehold_lease::testkit::{EtcdHarness, EtcdServer};

fn driver(server: &EtcdServer) -> EtcdDriver {
    EtcdDriver::connect(EtcdConfig {
        endpoints: vec![format!("http://127.0.0.1:{}", server.port())],
        prefix: "leasehold".into(),
        user: None,
    })
    .expect("driver")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_release_wakes_exactly_one_of_fifty_waiters() {
    let server = EtcdServer::start();
    one_release_wakes_exactly_one_waiter(|| driver(&server)).await;
}

/// Of three in the queue, the one at the back polls without costing etcd a message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_further_back_cost_no_requests() {
    let server = EtcdServer::start();
    waiters_further_back_poll_quietly(|| driver(&server), || server.messages_received()).await;
}

/// Twenty contenders, two hundred hand-overs. The token is the create revision of a contender's
/// key, the order it joined the
/// queue in, so strictly increasing tokens (checked by `contenders`) mean the lock went round
/// in FIFO order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_contenders_two_hundred_handovers_in_fifo_order() {
    contenders(&mut EtcdHarness::new(), 20, 10).await;
}
