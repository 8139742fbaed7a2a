//! Leader election among operator replicas on the Lease driver (in-memory Kubernetes API): one
//! leader at a time, and a standby takes over when the leader steps down.

mod support;

use std::time::Duration;

use leasehold_operator::election::{self, ELECTION_LEASE};
use leasehold_testkit::InMemoryApiServer;
use leasehold_testkit::in_memory_api_server::LEASES;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_leads_and_a_standby_takes_over_when_it_steps_down() {
    let api = InMemoryApiServer::new();
    let a = election::campaign(
        support::operator_client(&api),
        "leasehold-system",
        "operator-a",
    )
    .unwrap();
    tokio::time::timeout(Duration::from_secs(5), election::elected(&a))
        .await
        .expect("the first replica is elected");
    let b = election::campaign(
        support::operator_client(&api),
        "leasehold-system",
        "operator-b",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!b.answer().is_holder(), "two leaders");
    let lease = api
        .object(LEASES, "leasehold-system", ELECTION_LEASE)
        .unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], "operator-a");

    // The leader shuts down (SIGTERM, rollout): it releases, and the standby leads at once
    // (a watch wakes it), well before the 15 s lease would have run out.
    a.shutdown().await;
    tokio::time::timeout(Duration::from_secs(5), election::elected(&b))
        .await
        .expect("the standby is elected");
    tokio::time::timeout(Duration::from_secs(1), election::deposed(&a))
        .await
        .expect("the old leader knows it is not leading");
}
