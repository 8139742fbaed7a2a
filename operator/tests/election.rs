//! Leader election among operator replicas on the Lease driver (in-memory Kubernetes API): one
//! leader at a time, and a standby takes over when the leader steps down.

mod support;

use std::time::Duration;

use leasehold_operator::election::{self, ELECTION_LEASE};
use leasehold_testkit::InMemoryApiServer;
use leasehold_testkit::in_memory_api_server::LEASES;

/// A replica called `identity` campaigning on `api`.
fn campaign(api: &InMemoryApiServer, identity: &str) -> leasehold_lease::Lock {
    election::campaign(support::operator_client(api), "leasehold-system", identity).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_leads_and_a_standby_takes_over_when_it_steps_down() {
    let api = InMemoryApiServer::new();
    let a = campaign(&api, "operator-a");
    tokio::time::timeout(Duration::from_secs(5), election::elected(&a))
        .await
        .expect("the first replica is elected");
    let b = campaign(&api, "operator-b");
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

/// A leader whose renewal fails (the API server down a moment, overloaded, restarting) leads
/// on while its claim stands: a blip deposes nobody, where stepping down and being elected
/// again would cut its reconciles short and resync every lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_leads_on_through_a_failed_renewal_while_its_claim_stands() {
    let api = InMemoryApiServer::new();
    let a = campaign(&api, "operator-a");
    tokio::time::timeout(Duration::from_secs(5), election::elected(&a))
        .await
        .expect("the replica is elected");
    api.set_down(true);
    // The renewal due a renew interval after the election fails; the claim runs 15 s.
    let deposed = tokio::time::timeout(
        election::ELECTION_RENEW_INTERVAL + Duration::from_secs(2),
        election::deposed(&a),
    )
    .await;
    api.set_down(false);
    assert!(
        deposed.is_err(),
        "a failed renewal deposed a leader whose claim stood: {:?}",
        a.snapshot()
    );
    tokio::time::timeout(Duration::from_secs(10), async {
        while !a.answer().is_holder() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the leader renews once the API server answers");
}

/// Set when the future that owns it is dropped, finished or cut short.
struct Dropped(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for Dropped {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A controller whose reconcile goes on after the stop, as one waiting for a backend: `dropped`
/// is set once it is cut short.
fn endless_reconcile(
    dropped: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> impl FnOnce(tokio::sync::oneshot::Receiver<()>) -> tokio::task::JoinHandle<()> {
    let running = Dropped(dropped.clone());
    move |stop| {
        tokio::spawn(async move {
            let _running = running;
            let _ = stop.await;
            std::future::pending::<()>().await;
        })
    }
}

/// A deposed leader stops reconciling at once: a reconcile still running (a backend slow to
/// answer) is cut where it is, not finished beside the new leader's.
#[tokio::test]
async fn a_deposed_leaders_reconciles_are_cut_short() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dropped = std::sync::Arc::new(AtomicBool::new(false));
    let end = tokio::time::timeout(
        Duration::from_secs(5),
        election::reconcile_while_leading(
            endless_reconcile(&dropped),
            tokio::time::sleep(Duration::from_millis(20)),
            std::future::pending::<&str>(),
            Duration::from_secs(60),
        ),
    )
    .await
    .expect("the deposed leader waited for its reconciles");
    assert_eq!(end, election::TermEnd::Deposed);
    assert!(dropped.load(Ordering::SeqCst), "a reconcile runs on");
}

/// A leader whose reconciler ends on its own (a panic) stops leading: it would otherwise renew
/// the Lease and reconcile nothing, and no standby would take over.
#[tokio::test]
async fn a_leader_whose_reconciler_ends_stops_leading() {
    let end = tokio::time::timeout(
        Duration::from_secs(5),
        election::reconcile_while_leading(
            |_stop| tokio::spawn(async { panic!("a reconciler that fails") }),
            std::future::pending::<()>(),
            std::future::pending::<&str>(),
            Duration::from_secs(60),
        ),
    )
    .await
    .expect("the leader went on leading without its reconciler");
    assert_eq!(end, election::TermEnd::ControllerEnded);
}

/// A leader told to stop still leads: its reconciles finish before it hands over.
#[tokio::test]
async fn a_stopping_leaders_reconciles_finish() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let finished = std::sync::Arc::new(AtomicBool::new(false));
    let end = election::reconcile_while_leading(
        |stop| {
            let finished = finished.clone();
            tokio::spawn(async move {
                let _ = stop.await;
                tokio::time::sleep(Duration::from_millis(50)).await;
                finished.store(true, Ordering::SeqCst);
            })
        },
        std::future::pending::<()>(),
        async { "SIGTERM" },
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(end, election::TermEnd::Signalled("SIGTERM"));
    assert!(finished.load(Ordering::SeqCst), "a reconcile was cut short");
}

/// A stopping leader's reconciles finish only while it leads and within its patience: deposed
/// meanwhile (its renewals failing while it drains), or past the patience (a clean-up waiting
/// on a backend, the pod's grace period running out), they are cut short, so that no standby
/// reconciles beside them and the leadership is handed over before the pod is killed.
#[tokio::test]
async fn a_stopping_leaders_reconciles_are_cut_short_when_deposed_or_past_its_patience() {
    use std::sync::atomic::{AtomicBool, Ordering};
    for (deposed_after, patience) in [(50, 60_000), (60_000, 50)] {
        let dropped = std::sync::Arc::new(AtomicBool::new(false));
        let end = tokio::time::timeout(
            Duration::from_secs(5),
            election::reconcile_while_leading(
                endless_reconcile(&dropped),
                tokio::time::sleep(Duration::from_millis(deposed_after)),
                async { "SIGTERM" },
                Duration::from_millis(patience),
            ),
        )
        .await
        .unwrap_or_else(|_| {
            panic!("a stopping leader drained on (deposed after {deposed_after} ms, patience {patience} ms)")
        });
        assert_eq!(end, election::TermEnd::Signalled("SIGTERM"));
        assert!(dropped.load(Ordering::SeqCst), "a reconcile runs on");
    }
}
