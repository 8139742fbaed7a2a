//! The Kubernetes Lease driver at the API boundary, exchange by exchange (the kube-rs
//! `ApiServerVerifier` pattern with `tower-test`): what it sends, and what it makes of the
//! answers that a stateful fake would rarely produce at the right moment (a conflict between
//! read and write, a 403). The full lease behaviour is in module `kubernetes` of `lease/tests/conformance.rs`.

use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::coordination::v1::Lease as LeaseObject;
use kube::client::Body;
use leasehold_lease::kubernetes::{DURATION_ANNOTATION, KubernetesLeaseDriver, LeaseTarget};
use leasehold_lease::{Acquire, Driver, Error, Lease, Lock, LockConfig, Mode, Upkeep};
use leasehold_testkit::{KubernetesHarness, unique_lock};
use serde_json::{Value, json};
use tower_test::mock::{self, Handle};

type ApiServerHandle = Handle<Request<Body>, Response<Body>>;

/// Answers the driver's requests in order, checking each one.
struct ApiServerVerifier(ApiServerHandle);

impl ApiServerVerifier {
    async fn expect(
        &mut self,
        method: Method,
        path_end: &str,
    ) -> (Value, mock::SendResponse<Response<Body>>) {
        let (request, send) = tokio::time::timeout(Duration::from_secs(5), self.0.next_request())
            .await
            .expect("the driver sent no request")
            .expect("the client is gone");
        assert_eq!(request.method(), method, "{}", request.uri());
        assert!(
            request.uri().path().ends_with(path_end),
            "{} {} does not end with {path_end}",
            request.method(),
            request.uri()
        );
        let body = http_body_util::BodyExt::collect(request.into_body())
            .await
            .unwrap()
            .to_bytes();
        let value = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body).unwrap()
        };
        (value, send)
    }
}

fn reply(send: mock::SendResponse<Response<Body>>, code: StatusCode, body: &Value) {
    send.send_response(
        Response::builder()
            .status(code)
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap(),
    );
}

fn failure(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "reason": reason, "code": code, "message": format!("{reason} from the test")})
}

/// A Lease of Leasehold's held by `holder` with `transitions`, renewed `ago` before now for 15 s.
fn lease(name: &str, holder: &str, transitions: i32, ago: Duration, rv: &str) -> Value {
    let renewed = k8s_openapi::jiff::Timestamp::now()
        - k8s_openapi::jiff::SignedDuration::try_from(ago).unwrap();
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": rv,
                     "labels": {"app.kubernetes.io/managed-by": "leasehold"}},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                 "leaseTransitions": transitions, "renewTime": renewed.to_string()}
    })
}

fn driver() -> (KubernetesLeaseDriver, ApiServerVerifier) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    (
        KubernetesLeaseDriver::new(kube::Client::new(service, "ns"), "ns"),
        ApiServerVerifier(handle),
    )
}

#[tokio::test]
async fn a_conflict_on_resource_version_means_busy_not_an_error() {
    let (driver, mut api) = driver();
    let server = tokio::spawn(async move {
        let (_, send) = api.expect(Method::GET, "/namespaces/ns/leases/jobs").await;
        // Run out long ago (beyond any clock skew): taken at once.
        reply(
            send,
            StatusCode::OK,
            &lease("jobs", "a", 7, Duration::from_secs(120), "5"),
        );
        let (put, send) = api.expect(Method::PUT, "/namespaces/ns/leases/jobs").await;
        // The expired record is replaced with the version that was read, the next token, and
        // the exact duration next to its whole seconds.
        assert_eq!(put["metadata"]["resourceVersion"], "5");
        assert_eq!(put["spec"]["holderIdentity"], "b");
        assert_eq!(put["spec"]["leaseTransitions"], 8);
        assert_eq!(put["spec"]["leaseDurationSeconds"], 2);
        assert_eq!(put["metadata"]["annotations"][DURATION_ANNOTATION], "1500");
        reply(send, StatusCode::CONFLICT, &failure(409, "Conflict"));
        // Read again: another contender's write, not this one's.
        let (_, send) = api.expect(Method::GET, "/namespaces/ns/leases/jobs").await;
        reply(
            send,
            StatusCode::OK,
            &lease("jobs", "c", 8, Duration::ZERO, "6"),
        );
    });
    let outcome = driver
        .try_acquire("jobs", "b", Duration::from_millis(1500))
        .await
        .unwrap();
    assert_eq!(outcome, Acquire::Busy(None));
    server.await.unwrap();
}

/// A create committed whose answer was lost, sent again by the client (which retries a 504 on
/// its own) and refused as existing: the Lease names this process with this claim's own
/// acquireTime and claim value, so the acquisition holds rather than wait a lease for nobody.
/// A Lease naming the same identity and token with another acquireTime (an earlier attempt's)
/// or another claim value (another process given the same identity) is not taken for it.
#[tokio::test]
async fn a_write_committed_with_its_answer_lost_is_the_acquisition() {
    for found in ["own", "another acquireTime", "another claim value"] {
        let own = found == "own";
        let (driver, mut api) = driver();
        let server = tokio::spawn(async move {
            let (_, send) = api.expect(Method::GET, "/namespaces/ns/leases/jobs").await;
            reply(send, StatusCode::NOT_FOUND, &failure(404, "NotFound"));
            let (mut created, send) = api.expect(Method::POST, "/namespaces/ns/leases").await;
            reply(send, StatusCode::CONFLICT, &failure(409, "AlreadyExists"));
            let (_, send) = api.expect(Method::GET, "/namespaces/ns/leases/jobs").await;
            created["metadata"]["resourceVersion"] = json!("1");
            match found {
                "another acquireTime" => {
                    created["spec"]["acquireTime"] = json!("2026-01-01T00:00:00.000000Z");
                }
                "another claim value" => {
                    created["metadata"]["annotations"]["leasehold.dev/claim"] = json!("another");
                }
                _ => {}
            }
            reply(send, StatusCode::OK, &created);
        });
        let outcome = driver
            .try_acquire("jobs", "a", Duration::from_secs(15))
            .await
            .unwrap();
        match own {
            true => assert!(
                matches!(&outcome, Acquire::Acquired(lease) if lease.token == 1),
                "{outcome:?}"
            ),
            false => assert_eq!(outcome, Acquire::Busy(None), "{found}"),
        }
        server.await.unwrap();
    }
}

/// A write committed whose answer was a failure (a proxy's 500, a connection reset): the Lease
/// read back names this claim, so the acquisition holds rather than meet its own claim as
/// another's for a lease. A failure whose write did not commit is the failure.
#[tokio::test]
async fn a_write_committed_with_a_failed_answer_is_the_acquisition() {
    for committed in [true, false] {
        let (driver, mut api) = driver();
        let server = tokio::spawn(async move {
            let (_, send) = api.expect(Method::GET, "/namespaces/ns/leases/jobs").await;
            reply(send, StatusCode::NOT_FOUND, &failure(404, "NotFound"));
            let (mut created, send) = api.expect(Method::POST, "/namespaces/ns/leases").await;
            reply(
                send,
                StatusCode::INTERNAL_SERVER_ERROR,
                &failure(500, "InternalError"),
            );
            let (_, send) = api.expect(Method::GET, "/namespaces/ns/leases/jobs").await;
            if committed {
                created["metadata"]["resourceVersion"] = json!("1");
                reply(send, StatusCode::OK, &created);
            } else {
                reply(send, StatusCode::NOT_FOUND, &failure(404, "NotFound"));
            }
        });
        let outcome = driver
            .try_acquire("jobs", "a", Duration::from_secs(15))
            .await;
        match committed {
            true => assert!(
                matches!(&outcome, Ok(Acquire::Acquired(lease)) if lease.token == 1),
                "{outcome:?}"
            ),
            false => assert!(outcome.is_err(), "{outcome:?}"),
        }
        server.await.unwrap();
    }
}

/// A family's key Lease that an acquisition created from a floor read before a sweep raised
/// the floor (here from 5 to 51: another key's tokens), and whose raise above the new floor
/// failed, is given back still marked unchecked: the next taker reads the floor and draws above
/// it, never from the Lease's stale token, which may lie below tokens the key had before its
/// Lease was swept.
#[tokio::test]
async fn a_created_key_lease_whose_raise_above_the_floor_failed_is_taken_again_above_the_floor() {
    use leasehold_lease::kubernetes::{FLOOR_UNCHECKED_ANNOTATION, floor_lease};
    const KEY: &str = "orders.keys.k";
    let floor_name = floor_lease("orders");
    let floor = move |transitions: i32| {
        json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": floor_lease("orders"), "namespace": "ns", "resourceVersion": "9",
                         "labels": {"app.kubernetes.io/managed-by": "leasehold"}},
            "spec": {"leaseTransitions": transitions}
        })
    };
    let unchecked =
        |lease: &Value| !lease["metadata"]["annotations"][FLOOR_UNCHECKED_ANNOTATION].is_null();

    let (creator, mut api) = driver();
    let floor_path = format!("/leases/{floor_name}");
    let server = tokio::spawn(async move {
        let (_, send) = api.expect(Method::GET, &format!("/leases/{KEY}")).await;
        reply(send, StatusCode::NOT_FOUND, &failure(404, "NotFound"));
        let (_, send) = api.expect(Method::GET, &floor_path).await;
        reply(send, StatusCode::OK, &floor(5));
        let (mut created, send) = api.expect(Method::POST, "/namespaces/ns/leases").await;
        assert_eq!(created["spec"]["leaseTransitions"], 6);
        assert!(
            unchecked(&created),
            "a created key Lease is not marked: {created}"
        );
        created["metadata"]["resourceVersion"] = json!("1");
        reply(send, StatusCode::CREATED, &created);
        // The floor rose meanwhile: the token is raised above it, which fails; the Lease is
        // given back, still marked.
        let (_, send) = api.expect(Method::GET, &floor_path).await;
        reply(send, StatusCode::OK, &floor(51));
        let (_, send) = api.expect(Method::GET, &format!("/leases/{KEY}")).await;
        reply(send, StatusCode::OK, &created);
        let (_, send) = api.expect(Method::PUT, &format!("/leases/{KEY}")).await;
        reply(
            send,
            StatusCode::INTERNAL_SERVER_ERROR,
            &failure(500, "InternalError"),
        );
        let (_, send) = api.expect(Method::GET, &format!("/leases/{KEY}")).await;
        reply(send, StatusCode::OK, &created);
        let (mut given_back, send) = api.expect(Method::PUT, &format!("/leases/{KEY}")).await;
        assert!(
            given_back["spec"]["holderIdentity"].is_null(),
            "{given_back}"
        );
        assert_eq!(given_back["spec"]["leaseTransitions"], 6);
        assert!(
            unchecked(&given_back),
            "a Lease given back with an unchecked token keeps its mark: {given_back}"
        );
        given_back["metadata"]["resourceVersion"] = json!("2");
        reply(send, StatusCode::OK, &given_back);
        given_back
    });
    let outcome = creator.try_acquire(KEY, "a", Duration::from_secs(15)).await;
    assert!(outcome.is_err(), "{outcome:?}");
    let left = server.await.unwrap();

    // Another pod takes the key, free since it was given back.
    let (taker, mut api) = driver();
    let floor_path = format!("/leases/{floor_name}");
    let server = tokio::spawn(async move {
        let (_, send) = api.expect(Method::GET, &format!("/leases/{KEY}")).await;
        reply(send, StatusCode::OK, &left);
        let (_, send) = api.expect(Method::GET, &floor_path).await;
        reply(send, StatusCode::OK, &floor(51));
        let (mut put, send) = api.expect(Method::PUT, &format!("/leases/{KEY}")).await;
        assert_eq!(put["spec"]["leaseTransitions"], 52);
        assert!(!unchecked(&put), "the taker's token is checked: {put}");
        put["metadata"]["resourceVersion"] = json!("3");
        reply(send, StatusCode::OK, &put);
        let (_, send) = api.expect(Method::GET, &floor_path).await;
        reply(send, StatusCode::OK, &floor(51));
    });
    let outcome = taker
        .try_acquire(KEY, "b", Duration::from_secs(15))
        .await
        .unwrap();
    server.await.unwrap();
    assert!(
        matches!(&outcome, Acquire::Acquired(lease) if lease.token == 52),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn a_held_lease_is_busy_without_a_write() {
    let (driver, mut api) = driver();
    let server = tokio::spawn(async move {
        let (_, send) = api.expect(Method::GET, "/leases/jobs").await;
        reply(
            send,
            StatusCode::OK,
            &lease("jobs", "a", 7, Duration::from_secs(1), "5"),
        );
    });
    let Acquire::Busy(Some(holding)) = driver
        .try_acquire("jobs", "b", Duration::from_secs(15))
        .await
        .unwrap()
    else {
        panic!("a fresh lease must be busy")
    };
    assert_eq!((holding.identity.as_str(), holding.token), ("a", 7));
    // First seen now: held for a whole lease from now, whatever `renewTime` says.
    assert!(holding.expires_in.unwrap() <= Duration::from_secs(15));
    server.await.unwrap();
}

/// A Lease held by `holder` for 400 ms (its exact duration), renewed `ago` by the holder's clock.
fn short_lease(holder: &str, ago: Duration, rv: &str) -> Value {
    let mut lease = lease("jobs", holder, 3, ago, rv);
    lease["spec"]["leaseDurationSeconds"] = json!(1);
    lease["metadata"]["annotations"] = json!({ DURATION_ANNOTATION: "400" });
    lease
}

/// The holder's node runs seconds behind: its `renewTime` looks run out by this node's clock
/// while the holder still claims. A contender times the record from when it first saw it, and
/// from each renewal it sees, so it takes the lock only once the record has stood unchanged for
/// its whole duration.
#[tokio::test]
async fn expiry_is_observed_so_a_holder_with_a_slow_clock_keeps_its_lease() {
    let (driver, mut api) = driver();
    let server = tokio::spawn(async move {
        let skewed = Duration::from_secs(5);
        // First seen: busy, although renewTime + 400 ms passed 4.6 s ago here.
        let (_, send) = api.expect(Method::GET, "/leases/jobs").await;
        reply(send, StatusCode::OK, &short_lease("a", skewed, "5"));
        // Renewed (a new renewTime): timed again from now.
        let renewed = short_lease("a", skewed - Duration::from_millis(100), "6");
        let (_, send) = api.expect(Method::GET, "/leases/jobs").await;
        reply(send, StatusCode::OK, &renewed);
        // Unchanged for its whole duration: taken.
        let (_, send) = api.expect(Method::GET, "/leases/jobs").await;
        reply(send, StatusCode::OK, &renewed);
        let (put, send) = api.expect(Method::PUT, "/leases/jobs").await;
        assert_eq!(put["metadata"]["resourceVersion"], "6");
        assert_eq!(put["spec"]["holderIdentity"], "b");
        let mut taken = put.clone();
        taken["metadata"]["resourceVersion"] = json!("7");
        reply(send, StatusCode::OK, &taken);
    });
    let busy = |outcome: Acquire| match outcome {
        Acquire::Busy(Some(holding)) => holding,
        other => panic!("a held record was not busy: {other:?}"),
    };
    let ttl = Duration::from_secs(1);
    let first = busy(driver.try_acquire("jobs", "b", ttl).await.unwrap());
    assert_eq!(first.identity, "a");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let renewed = busy(driver.try_acquire("jobs", "b", ttl).await.unwrap());
    assert!(
        renewed.expires_in.unwrap() > Duration::from_millis(300),
        "a renewal seen restarts the count: {renewed:?}"
    );
    tokio::time::sleep(Duration::from_millis(450)).await;
    let Acquire::Acquired(lease) = driver.try_acquire("jobs", "b", ttl).await.unwrap() else {
        panic!("a record unchanged for its duration is free");
    };
    assert_eq!(lease.token, 4);
    server.await.unwrap();
}

#[tokio::test]
async fn renew_rereads_after_another_writer_and_keeps_the_lease() {
    let (driver, mut api) = driver();
    let server = tokio::spawn(async move {
        let (_, send) = api.expect(Method::GET, "/leases/jobs").await;
        reply(
            send,
            StatusCode::OK,
            &lease("jobs", "a", 8, Duration::from_secs(2), "5"),
        );
        let (_, send) = api.expect(Method::PUT, "/leases/jobs").await;
        reply(send, StatusCode::CONFLICT, &failure(409, "Conflict"));
        // Somebody labelled the Lease; it is still a's.
        let (_, send) = api.expect(Method::GET, "/leases/jobs").await;
        reply(
            send,
            StatusCode::OK,
            &lease("jobs", "a", 8, Duration::from_secs(2), "6"),
        );
        let (put, send) = api.expect(Method::PUT, "/leases/jobs").await;
        assert_eq!(put["metadata"]["resourceVersion"], "6");
        assert_eq!(
            put["spec"]["leaseTransitions"], 8,
            "a renewal keeps the token"
        );
        reply(send, StatusCode::OK, &put);
    });
    let lease = Lease {
        lock: "jobs".into(),
        identity: "a".into(),
        token: 8,
    };
    assert!(driver.renew(&lease, Duration::from_secs(15)).await.unwrap());
    server.await.unwrap();
}

#[tokio::test]
async fn renew_and_release_of_a_lease_taken_over_write_nothing() {
    let (driver, mut api) = driver();
    let server = tokio::spawn(async move {
        for _ in 0..2 {
            let (_, send) = api.expect(Method::GET, "/leases/jobs").await;
            reply(
                send,
                StatusCode::OK,
                &lease("jobs", "b", 9, Duration::from_secs(1), "7"),
            );
        }
        // A write here would hang the driver on an unanswered request, failing the timeout.
    });
    let old = Lease {
        lock: "jobs".into(),
        identity: "a".into(),
        token: 8,
    };
    let bounded = Duration::from_secs(5);
    assert!(
        !tokio::time::timeout(bounded, driver.renew(&old, Duration::from_secs(15)))
            .await
            .unwrap()
            .unwrap()
    );
    assert!(
        !tokio::time::timeout(bounded, driver.release(&old))
            .await
            .unwrap()
            .unwrap()
    );
    server.await.unwrap();
}

#[tokio::test]
async fn forbidden_says_to_check_rbac() {
    let (driver, mut api) = driver();
    let server = tokio::spawn(async move {
        let (_, send) = api.expect(Method::GET, "/leases/jobs").await;
        reply(send, StatusCode::FORBIDDEN, &failure(403, "Forbidden"));
    });
    let error = driver
        .try_acquire("jobs", "a", Duration::from_secs(15))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Backend(_)), "{error:?}");
    assert!(error.to_string().contains("RBAC"), "{error}");
    server.await.unwrap();
}

/// A namespace that does not exist (a mistyped `kubernetes://NAMESPACE`) is an error that says
/// so, not a lock answered busy for ever.
#[tokio::test]
async fn a_lease_in_a_namespace_that_does_not_exist_is_an_error_that_names_it() {
    let harness = KubernetesHarness::new();
    harness.api.without_namespace(KubernetesHarness::NAMESPACE);
    let error = harness
        .client_driver()
        .try_acquire("jobs", "a", Duration::from_secs(15))
        .await
        .expect_err("a Lease created in a namespace that does not exist");
    assert!(matches!(error, Error::Backend(_)), "{error:?}");
    let message = error.to_string();
    assert!(
        message.contains(r#"namespaces "leasehold-test" not found"#)
            && message.contains("create the namespace"),
        "{message}"
    );
}

#[tokio::test]
async fn provision_creates_an_unheld_lease_owned_by_nothing() {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let driver = KubernetesLeaseDriver::new(kube::Client::new(service, "ns"), "ns").with_target(
        "jobs",
        LeaseTarget {
            name: Some("jobs-lease".into()),
        },
    );
    let mut api = ApiServerVerifier(handle);
    let server = tokio::spawn(async move {
        let (_, send) = api.expect(Method::GET, "/leases/jobs-lease").await;
        reply(send, StatusCode::NOT_FOUND, &failure(404, "NotFound"));
        let (post, send) = api.expect(Method::POST, "/namespaces/ns/leases").await;
        let created: LeaseObject = serde_json::from_value(post.clone()).unwrap();
        assert_eq!(created.metadata.name.as_deref(), Some("jobs-lease"));
        // No owner: the garbage collector must never take a Lease from under its holders.
        assert_eq!(created.metadata.owner_references, None);
        let spec = created.spec.unwrap();
        assert_eq!(
            (spec.holder_identity, spec.lease_transitions),
            (None, Some(0))
        );
        reply(send, StatusCode::CREATED, &post);
    });
    driver.provision(&["jobs".to_owned()]).await.unwrap();
    server.await.unwrap();
}

/// The watch, not polling, wakes a waiter: with a 20 s renew interval (the waiter's poll), a
/// release is taken over within a fraction of it, however loaded the machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_the_waiter_through_the_watch() {
    const POLL: Duration = Duration::from_secs(20);
    let harness = KubernetesHarness::new();
    let lock = unique_lock("watch");
    let config = |identity: &str| LockConfig {
        renew_interval: POLL,
        mode: Mode::Campaign,
        ..LockConfig::new(&lock, identity, Duration::from_secs(60))
    };
    let a = Lock::start(
        std::sync::Arc::new(harness.client_driver()),
        config("a"),
        std::sync::Arc::new(()),
    )
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !a.answer().is_holder() {
        assert!(tokio::time::Instant::now() < deadline, "a never held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let b = Lock::start(
        std::sync::Arc::new(harness.client_driver()),
        config("b"),
        std::sync::Arc::new(()),
    )
    .unwrap();
    // b settles into waiting: its first attempt found a's holding.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while b
        .snapshot()
        .current_holder
        .is_none_or(|holder| holder.identity != "a")
    {
        assert!(tokio::time::Instant::now() < deadline, "b never saw a hold");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!b.answer().is_holder());
    assert!(a.release().await.unwrap());
    let released = tokio::time::Instant::now();
    while !b.answer().is_holder() {
        assert!(
            released.elapsed() < POLL / 4,
            "b was not woken by the watch (its poll is {POLL:?})"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stored = harness
        .api
        .lease(KubernetesHarness::NAMESPACE, &lock)
        .unwrap();
    assert_eq!(stored["spec"]["holderIdentity"], "b");
    assert_eq!(stored["spec"]["leaseTransitions"], 2);
}

/// A family's floor Lease deleted by hand comes back at the highest token among the family's
/// key Leases, so that a key forgotten as idle and taken again draws above every key still
/// recorded, never from 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_floor_lease_comes_back_above_the_familys_tokens() {
    use leasehold_lease::kubernetes::floor_lease;
    const TTL: Duration = Duration::from_secs(10);
    let harness = KubernetesHarness::new();
    let driver = harness.client_driver();
    let family = unique_lock("floor");
    let forgotten = format!("{family}.keys.forgotten");
    let busy = format!("{family}.keys.busy");
    let take = async |lock: &str| match driver.try_acquire(lock, "pod-a", TTL).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        other => panic!("{lock}: {other:?}"),
    };
    for _ in 0..2 {
        let lease = take(&forgotten).await;
        assert!(driver.release(&lease).await.unwrap());
    }
    let mut last = None;
    for _ in 0..5 {
        let lease = take(&busy).await;
        assert!(driver.release(&lease).await.unwrap());
        last = Some(lease);
    }
    assert_eq!(last.unwrap().token, 5);
    let held = take(&busy).await;
    assert_eq!(
        forget_idle_now(&driver, &family).await,
        1,
        "only the released key is idle"
    );
    delete_by_hand(&harness, &floor_lease(&family));
    let again = take(&forgotten).await;
    assert!(
        again.token > held.token,
        "a key taken again drew {} below the family's recorded {}",
        again.token,
        held.token
    );
    let floor = harness
        .api
        .lease(KubernetesHarness::NAMESPACE, &floor_lease(&family))
        .expect("the floor made again");
    assert_eq!(floor["spec"]["leaseTransitions"], 6);
}

/// A held Lease deleted by hand (`kubectl delete lease`, a tool's prune): its holder claims until
/// its next renewal finds it gone. A contender that saw it held does not make it again before
/// the record it saw has had its time, and draws a token above the one it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_deleted_by_hand_is_not_taken_within_the_holders_claim() {
    const TTL: Duration = Duration::from_secs(2);
    let harness = KubernetesHarness::new();
    let (a, b) = (harness.client_driver(), harness.client_driver());
    let lock = unique_lock("deleted");
    let mut held = None;
    for _ in 0..3 {
        if let Some(lease) = held.take() {
            assert!(a.release(&lease).await.unwrap());
        }
        match a.try_acquire(&lock, "pod-a", TTL).await.unwrap() {
            Acquire::Acquired(lease) => held = Some(lease),
            other => panic!("a: {other:?}"),
        }
    }
    let held = held.unwrap();
    let first_seen = tokio::time::Instant::now();
    assert!(matches!(
        b.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
        Acquire::Busy(_)
    ));
    let deleted = tokio::time::Instant::now();
    delete_by_hand(&harness, &lock);
    let taken = loop {
        match b.try_acquire(&lock, "pod-b", TTL).await.unwrap() {
            Acquire::Acquired(lease) => break lease,
            Acquire::Busy(_) => {}
            other => panic!("b: {other:?}"),
        }
        assert!(deleted.elapsed() < TTL * 3, "b never took the lock");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        first_seen.elapsed() >= TTL,
        "b took the lock {:?} after the Lease was deleted, within a's claim",
        deleted.elapsed()
    );
    assert!(
        taken.token > held.token,
        "token {} after the deletion, {} before",
        taken.token,
        held.token
    );
    // The holder, told at its next renewal that its Lease is gone, takes the lock again later
    // above every token it held or saw.
    assert!(!a.renew(&held, TTL).await.unwrap());
    assert!(b.release(&taken).await.unwrap());
    delete_by_hand(&harness, &lock);
    match a.try_acquire(&lock, "pod-a", TTL).await.unwrap() {
        Acquire::Acquired(again) => assert!(
            again.token > held.token,
            "a drew {} after its Lease was deleted, {} before",
            again.token,
            held.token
        ),
        other => panic!("a: {other:?}"),
    }
}

/// Two processes given the same identity by mistake: the first holds, its Lease is deleted by
/// hand, and the second, which never saw it, makes it again with the same identity and token.
/// The first's renewal and release find another claim value on the Lease and write nothing:
/// the second holds alone.
#[tokio::test]
async fn a_holder_does_not_renew_or_release_another_process_claim_of_the_same_identity_and_token() {
    const TTL: Duration = Duration::from_secs(15);
    let harness = KubernetesHarness::new();
    let (a, b) = (harness.client_driver(), harness.client_driver());
    let lock = unique_lock("same-identity");
    let held = match a.try_acquire(&lock, "pod-x", TTL).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        other => panic!("a: {other:?}"),
    };
    delete_by_hand(&harness, &lock);
    let taken = match b.try_acquire(&lock, "pod-x", TTL).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        other => panic!("b: {other:?}"),
    };
    assert_eq!(
        (&taken.identity, taken.token),
        (&held.identity, held.token),
        "the case needs the same identity and token on both sides"
    );
    assert!(
        !a.renew(&held, TTL).await.unwrap(),
        "a renewed b's claim of the same identity and token as its own"
    );
    assert!(
        !a.release(&held).await.unwrap(),
        "a released b's claim of the same identity and token as its own"
    );
    assert!(b.renew(&taken, TTL).await.unwrap(), "b lost its claim");
    assert!(b.release(&taken).await.unwrap());
}

/// A held Lease deleted by hand and made again, blank, by provisioning (the operator's, which
/// makes a missing Lease) names nobody, yet the holder of the one deleted claims it until its
/// next renewal finds it gone: a contender that saw it held waits out that claim, whether or
/// not it looked while the Lease was missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_deleted_and_made_again_blank_is_not_taken_within_the_holders_claim() {
    const TTL: Duration = Duration::from_secs(2);
    let harness = KubernetesHarness::new();
    for looked_while_missing in [true, false] {
        let (a, b) = (harness.client_driver(), harness.client_driver());
        let lock = unique_lock("remade");
        let held = match a.try_acquire(&lock, "pod-a", TTL).await.unwrap() {
            Acquire::Acquired(lease) => lease,
            other => panic!("a: {other:?}"),
        };
        let first_seen = tokio::time::Instant::now();
        assert!(matches!(
            b.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
            Acquire::Busy(_)
        ));
        delete_by_hand(&harness, &lock);
        if looked_while_missing {
            assert!(matches!(
                b.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
                Acquire::Busy(_)
            ));
        }
        harness
            .client_driver()
            .provision(std::slice::from_ref(&lock))
            .await
            .expect("provision");
        let taken = loop {
            match b.try_acquire(&lock, "pod-b", TTL).await.unwrap() {
                Acquire::Acquired(lease) => break lease,
                Acquire::Busy(_) => {}
                other => panic!("b: {other:?}"),
            }
            assert!(first_seen.elapsed() < TTL * 3, "b never took the lock");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(
            first_seen.elapsed() >= TTL,
            "b took the Lease made again {:?} after it first saw a's claim, within that claim \
             (looked while missing: {looked_while_missing})",
            first_seen.elapsed()
        );
        assert!(taken.token > held.token, "{taken:?} after {held:?}");
        assert!(!a.renew(&held, TTL).await.unwrap());
        assert!(b.release(&taken).await.unwrap());
    }
}

/// As above, with the Lease made again by a process that never saw it, which takes it and
/// releases it while the contender looks: the deleted Lease's holder still claims it until its
/// next renewal, so the contender waits that out, not only the new object's holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_deleted_then_taken_and_released_by_another_is_not_taken_within_the_holders_claim()
 {
    const TTL: Duration = Duration::from_secs(2);
    let harness = KubernetesHarness::new();
    let (a, b, newcomer) = (
        harness.client_driver(),
        harness.client_driver(),
        harness.client_driver(),
    );
    let lock = unique_lock("retaken");
    let held = match a.try_acquire(&lock, "pod-a", TTL).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        other => panic!("a: {other:?}"),
    };
    let first_seen = tokio::time::Instant::now();
    assert!(matches!(
        b.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
        Acquire::Busy(_)
    ));
    delete_by_hand(&harness, &lock);
    let between = match newcomer.try_acquire(&lock, "pod-n", TTL).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        other => panic!("the newcomer: {other:?}"),
    };
    assert!(matches!(
        b.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
        Acquire::Busy(_)
    ));
    assert!(newcomer.release(&between).await.unwrap());
    let taken = loop {
        match b.try_acquire(&lock, "pod-b", TTL).await.unwrap() {
            Acquire::Acquired(lease) => break lease,
            Acquire::Busy(_) => {}
            other => panic!("b: {other:?}"),
        }
        assert!(first_seen.elapsed() < TTL * 3, "b never took the lock");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        first_seen.elapsed() >= TTL,
        "b took the lock {:?} after it first saw a's claim, within that claim",
        first_seen.elapsed()
    );
    assert!(!a.renew(&held, TTL).await.unwrap());
    assert!(b.release(&taken).await.unwrap());
}

/// As above, with the newcomer's Lease deleted by hand in turn, its holder on a shorter lease
/// than the first's: the contender finds the Lease gone again, and waits out the first holder's
/// claim as well as the newcomer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_deleted_twice_is_not_taken_within_the_first_holders_claim() {
    const TTL: Duration = Duration::from_secs(3);
    const NEWCOMER_TTL: Duration = Duration::from_millis(300);
    let harness = KubernetesHarness::new();
    let (a, b, newcomer) = (
        harness.client_driver(),
        harness.client_driver(),
        harness.client_driver(),
    );
    let lock = unique_lock("deleted-twice");
    let held = match a.try_acquire(&lock, "pod-a", TTL).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        other => panic!("a: {other:?}"),
    };
    let first_seen = tokio::time::Instant::now();
    assert!(matches!(
        b.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
        Acquire::Busy(_)
    ));
    let remove = || {
        delete_by_hand(&harness, &lock);
    };
    remove();
    match newcomer
        .try_acquire(&lock, "pod-n", NEWCOMER_TTL)
        .await
        .unwrap()
    {
        Acquire::Acquired(_) => {}
        other => panic!("the newcomer: {other:?}"),
    }
    assert!(matches!(
        b.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
        Acquire::Busy(_)
    ));
    remove();
    let taken = loop {
        match b.try_acquire(&lock, "pod-b", TTL).await.unwrap() {
            Acquire::Acquired(lease) => break lease,
            Acquire::Busy(_) => {}
            other => panic!("b: {other:?}"),
        }
        assert!(first_seen.elapsed() < TTL * 3, "b never took the lock");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        first_seen.elapsed() >= TTL,
        "b took the lock {:?} after it first saw a's claim, within that claim",
        first_seen.elapsed()
    );
    assert!(!a.renew(&held, TTL).await.unwrap());
    assert!(b.release(&taken).await.unwrap());
}

/// A contender's last look at a held Lease was a while before it was deleted: the holder may
/// have renewed it since, unseen, and claims a whole duration from its last renewal. The
/// contender times its wait from when it first finds the Lease gone, not from its last look.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_deleted_after_an_unseen_renewal_is_waited_for_from_the_deletion() {
    const TTL: Duration = Duration::from_secs(2);
    let harness = KubernetesHarness::new();
    let (a, b) = (harness.client_driver(), harness.client_driver());
    let lock = unique_lock("renewed-unseen");
    let Acquire::Acquired(held) = a.try_acquire(&lock, "pod-a", TTL).await.unwrap() else {
        panic!("a takes the free lock");
    };
    assert!(matches!(
        b.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
        Acquire::Busy(_)
    ));
    tokio::time::sleep(TTL * 3 / 4).await;
    // Renewed where b does not look, then deleted.
    assert!(a.renew(&held, TTL).await.unwrap());
    delete_by_hand(&harness, &lock);
    let deleted = tokio::time::Instant::now();
    loop {
        match b.try_acquire(&lock, "pod-b", TTL).await.unwrap() {
            Acquire::Acquired(_) => break,
            Acquire::Busy(_) => {}
            other => panic!("b: {other:?}"),
        }
        assert!(deleted.elapsed() < TTL * 3, "b never took the lock");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        deleted.elapsed() >= TTL,
        "b took the lock {:?} after the deletion, within a's renewed claim",
        deleted.elapsed()
    );
}

/// A family's key Leases that nobody has held for the idle time are deleted, and no other: not
/// a held key's, not one released just now (with an hour's idle time), not the floor's, not a
/// plain lock's, not another family's. A key taken again after its Lease went draws above every
/// token it had (the family's floor Lease keeps them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_key_leases_are_deleted_and_tokens_rise_above_the_floor() {
    use leasehold_lease::kubernetes::{FLOOR_UNCHECKED_ANNOTATION, floor_lease};
    const TTL: Duration = Duration::from_secs(10);
    const HOUR: Duration = Duration::from_secs(3600);
    let harness = KubernetesHarness::new();
    let driver = harness.client_driver();
    let family = unique_lock("idle");
    let idle = format!("{family}.keys.idle");
    let held = format!("{family}.keys.held");
    let other_family = format!("{}.keys.k", unique_lock("other"));
    let plain = unique_lock("plain");
    let take = async |lock: &str| match driver.try_acquire(lock, "pod-a", TTL).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        other => panic!("{lock}: {other:?}"),
    };
    // The idle key goes through three holders, so its token is 3 when it is forgotten.
    let mut last = None;
    for _ in 0..3 {
        let lease = take(&idle).await;
        assert!(driver.release(&lease).await.unwrap());
        last = Some(lease);
    }
    let last = last.unwrap();
    assert_eq!(last.token, 3);
    let held_lease = take(&held).await;
    for lock in [&other_family, &plain] {
        let lease = take(lock).await;
        assert!(driver.release(&lease).await.unwrap());
    }
    let stored = |name: &str| harness.api.lease(KubernetesHarness::NAMESPACE, name);

    assert_eq!(driver.forget_idle_keys(&family, HOUR).await.unwrap(), 0);
    assert!(
        stored(&idle).is_some(),
        "released a moment ago, not idle an hour"
    );

    assert_eq!(forget_idle_now(&driver, &family).await, 1);
    assert!(
        stored(&idle).is_none(),
        "the idle key's Lease is still there"
    );
    assert!(stored(&held).is_some(), "a held key's Lease was deleted");
    assert!(stored(&other_family).is_some() && stored(&plain).is_some());
    let floor = stored(&floor_lease(&family)).expect("the family's floor");
    assert_eq!(floor["spec"]["leaseTransitions"], 3);
    assert!(
        floor["spec"]["holderIdentity"].is_null(),
        "the floor is held"
    );
    // The floor is no key: another sweep leaves it.
    assert_eq!(forget_idle_now(&driver, &family).await, 0);
    assert!(stored(&floor_lease(&family)).is_some());

    let again = take(&idle).await;
    assert_eq!(
        again.token, 4,
        "a key taken again draws above its forgotten tokens"
    );
    // Created again, its token checked above the floor: the mark that makes a taker read the
    // floor stays only until the holder's first renewal.
    let marked = |name: &str| {
        !stored(name).unwrap()["metadata"]["annotations"][FLOOR_UNCHECKED_ANNOTATION].is_null()
    };
    assert!(marked(&idle), "a created key Lease is not marked unchecked");
    assert!(driver.renew(&again, TTL).await.unwrap());
    assert!(
        !marked(&idle),
        "a renewed key Lease is still marked unchecked"
    );
    assert!(driver.release(&again).await.unwrap());
    assert!(driver.release(&held_lease).await.unwrap());
    assert_eq!(driver.count_held_keys(&family).await.unwrap(), Some(0));
}

/// A family's key whose plain name is no Kubernetes object name (a dot-separated part that
/// starts or ends with '-', as in `a-.b`: the API server refuses such a name) is held in a Lease
/// named by the key's hash, in the family's names: taken, refused to another pod, released, and
/// swept with the family's idle keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_plain_name_is_no_kubernetes_name_is_held_under_a_name_the_family_gives_it() {
    let harness = KubernetesHarness::new();
    let driver = harness.client_driver();
    let family = unique_lock("odd");
    const TTL: Duration = Duration::from_secs(10);
    let stored = |name: &str| harness.api.lease(KubernetesHarness::NAMESPACE, name);
    for key in ["a-.b", "x.-y", "p.q-.r"] {
        let lock = format!("{family}.keys.{key}");
        let name = driver.lease_name(&lock).into_owned();
        assert!(
            name.starts_with(&format!("{family}.keyh.")),
            "{lock} is held in the Lease {name}"
        );
        let lease = match driver.try_acquire(&lock, "pod-a", TTL).await {
            Ok(Acquire::Acquired(lease)) => lease,
            other => panic!("{lock}: {other:?}"),
        };
        assert!(matches!(
            driver.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
            Acquire::Busy(_)
        ));
        assert!(stored(&name).is_some(), "no Lease {name} for {lock}");
        assert_eq!(driver.count_held_keys(&family).await.unwrap(), Some(1));
        assert!(driver.release(&lease).await.unwrap());
    }
    assert_eq!(forget_idle_now(&driver, &family).await, 3);
}

/// A lock whose Lease is named like a family's key (`leaseName: orders.keys.x`) has that Lease
/// swept with the family's idle keys, the family's floor raised above its token first: taken
/// again, it draws above the floor, not from 1; so it does when the operator's provisioning
/// made the Lease again before anyone took it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_whose_lease_is_named_like_a_key_keeps_its_tokens_rising_after_a_sweep() {
    let harness = KubernetesHarness::new();
    let family = unique_lock("orders");
    let lock = unique_lock("plain");
    let driver = harness.client_driver().with_target(
        &lock,
        LeaseTarget {
            name: Some(format!("{family}.keys.x")),
        },
    );
    let ttl = Duration::from_secs(10);
    let mut last = 0;
    for provisioned_again in [false, true] {
        for _ in 0..3 {
            let Acquire::Acquired(lease) = driver.try_acquire(&lock, "pod-a", ttl).await.unwrap()
            else {
                panic!("{lock} is not free");
            };
            assert!(
                lease.token > last,
                "token {} after {last}, once the Lease was swept (provisioned again: {provisioned_again})",
                lease.token
            );
            last = lease.token;
            assert!(driver.release(&lease).await.unwrap());
        }
        assert_eq!(
            forget_idle_now(&driver, &family).await,
            1,
            "the Lease was not swept"
        );
        if provisioned_again {
            driver.provision_one(&lock).await.unwrap();
        }
    }
    let Acquire::Acquired(again) = driver.try_acquire(&lock, "pod-a", ttl).await.unwrap() else {
        panic!("{lock} is not free");
    };
    assert!(
        again.token > last,
        "token {} after {last}, once the Lease was swept and provisioned again",
        again.token
    );
}

/// A keyed family's waiters watch Leases named at run time: the watches nobody listens to any
/// more are stopped (each is a request the API server keeps open), and one still listened to
/// stays and still wakes its waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_nobody_listens_to_are_stopped() {
    let harness = KubernetesHarness::new();
    let driver = harness.client_driver();
    let kept_lock = unique_lock("kept");
    let mut kept = driver.changes(&kept_lock).expect("a watch");
    let gone = unique_lock("gone");
    for i in 0..500 {
        drop(driver.changes(&format!("{gone}-{i}")).expect("a watch"));
    }
    assert!(
        driver.watches() < 200,
        "{} watches kept for 1 waiter",
        driver.watches()
    );
    // Let the watch settle before the write it must see.
    tokio::time::sleep(Duration::from_millis(300)).await;
    kept.borrow_and_update();
    let other = harness.client_driver();
    let Acquire::Acquired(lease) = other
        .try_acquire(&kept_lock, "pod-b", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!("not acquired");
    };
    tokio::time::timeout(Duration::from_secs(5), kept.changed())
        .await
        .expect("the kept watch saw the write")
        .expect("feed open");
    assert!(other.release(&lease).await.unwrap());
}

/// A contender that has watched a dead holder's Lease run out takes it on its next try, also
/// when other locks' sightings were pruned meanwhile: a sighting just run out is kept, not
/// forgotten and counted again from the next look, a whole lease more each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_seen_running_out_is_free_after_other_sightings_are_pruned() {
    // Long enough that the sightings below are all made well within one lease.
    const TTL: Duration = Duration::from_secs(2);
    let harness = KubernetesHarness::new();
    let (dead, contender) = (harness.client_driver(), harness.client_driver());
    let name = unique_lock("pruned");
    // As many sightings as make the contender's map prune itself at the next one.
    let locks: Vec<String> = (0..64).map(|i| format!("{name}-{i}")).collect();
    for lock in &locks {
        let taken = dead.try_acquire(lock, "dead", TTL).await.unwrap();
        assert!(matches!(taken, Acquire::Acquired(_)), "{lock}: {taken:?}");
    }
    for lock in &locks[..63] {
        let seen = contender.try_acquire(lock, "b", TTL).await.unwrap();
        assert!(matches!(seen, Acquire::Busy(Some(_))), "{lock}: {seen:?}");
    }
    tokio::time::sleep(TTL + Duration::from_millis(50)).await;
    // The 64th sighting prunes the map, every earlier sighting having run out.
    let pruning = contender.try_acquire(&locks[63], "b", TTL).await.unwrap();
    assert!(matches!(pruning, Acquire::Busy(Some(_))), "{pruning:?}");
    let again = contender.try_acquire(&locks[0], "b", TTL).await.unwrap();
    assert!(
        matches!(again, Acquire::Acquired(_)),
        "a Lease watched until it ran out is held again: {again:?}"
    );
}

/// Deletes the family's key Leases nobody holds now, as the operator's clean-up does: how many.
async fn forget_idle_now(driver: &KubernetesLeaseDriver, family: &str) -> u64 {
    driver
        .forget_idle_keys(family, Duration::ZERO)
        .await
        .expect("forget idle keys")
}

/// Delete the Lease `name` as a person would (`kubectl delete lease`), past the driver.
fn delete_by_hand(harness: &KubernetesHarness, name: &str) {
    assert!(
        harness.api.remove(
            leasehold_testkit::in_memory_api_server::LEASES,
            KubernetesHarness::NAMESPACE,
            name
        ),
        "the Lease {name} was not there to delete"
    );
}

/// Set `preferredHolder` and `strategy` on `lock`'s Lease, as coordinated leader election's
/// tooling (KEP-4355) does.
fn prefer(harness: &KubernetesHarness, lock: &str, preferred: &str) {
    let mut lease = harness
        .api
        .lease(KubernetesHarness::NAMESPACE, lock)
        .expect("the Lease");
    lease["spec"]["preferredHolder"] = json!(preferred);
    lease["spec"]["strategy"] = json!("OldestEmulationVersion");
    harness
        .api
        .put(leasehold_testkit::in_memory_api_server::LEASES, lease);
}

fn spec_field(harness: &KubernetesHarness, lock: &str, field: &str) -> Value {
    harness
        .api
        .lease(KubernetesHarness::NAMESPACE, lock)
        .expect("the Lease")["spec"][field]
        .clone()
}

/// A dead holder's Lease that another writer keeps touching (labels re-applied by a GitOps
/// tool, an annotation loop) is still free once the holder's claim has run out: only a write
/// of the claim itself (holder, token, renewal, duration) says its holder is alive. Counting
/// every new `resourceVersion` as a renewal, a contender's wait began again at each touch and
/// the lock was never taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holders_lease_touched_by_another_writer_is_taken_when_the_claim_runs_out() {
    const TTL: Duration = Duration::from_secs(2);
    let harness = KubernetesHarness::new();
    let (dead, contender) = (harness.client_driver(), harness.client_driver());
    let lock = unique_lock("touched");
    let Acquire::Acquired(_never_renewed) = dead.try_acquire(&lock, "pod-a", TTL).await.unwrap()
    else {
        panic!("the lock is free");
    };
    let started = tokio::time::Instant::now();
    let mut touches = 0u32;
    let token = loop {
        match contender.try_acquire(&lock, "pod-b", TTL).await.unwrap() {
            Acquire::Acquired(lease) => break lease.token,
            busy => assert!(
                started.elapsed() < TTL * 3,
                "never taken after {touches} touches by another writer: {busy:?}"
            ),
        }
        let mut lease = harness
            .api
            .lease(KubernetesHarness::NAMESPACE, &lock)
            .expect("the Lease");
        touches += 1;
        lease["metadata"]["labels"]["touched"] = json!(touches.to_string());
        harness
            .api
            .put(leasehold_testkit::in_memory_api_server::LEASES, lease);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        started.elapsed() >= TTL - Duration::from_millis(200),
        "taken {:?} into a claim of {TTL:?}",
        started.elapsed()
    );
    assert!(touches > 3, "touched {touches} times only");
    assert_eq!(token, 2);
}

/// A held Lease whose holder another writer clears (`kubectl patch` removing
/// `holderIdentity`, as done to force a client-go leader to fail over) is not taken while its
/// holder may still claim it: the holder learns of the edit only at its next renewal, and what
/// it last renewed for runs until then. A release by the holder clears `acquireTime`; the edit
/// leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cleared_by_another_writer_is_not_taken_within_the_holders_claim() {
    edited_by_another_writer(HandEdit::HolderCleared, false).await;
}

/// As above, where the holder renewed after the contender last looked: its claim runs from
/// that renewal, which the contender never saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cleared_by_another_writer_after_an_unseen_renewal_is_not_taken_within_its_claim()
{
    edited_by_another_writer(HandEdit::HolderCleared, true).await;
}

/// A held Lease whose duration another writer shortens is not taken within what its holder
/// last renewed for: the holder, which claims by its own renewal, has not seen the edit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holders_duration_shortened_by_another_writer_is_not_taken_within_the_holders_claim() {
    edited_by_another_writer(HandEdit::DurationShortened, false).await;
}

/// As above, where the holder renewed after the contender last looked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holders_duration_shortened_after_an_unseen_renewal_is_not_taken_within_its_claim() {
    edited_by_another_writer(HandEdit::DurationShortened, true).await;
}

#[derive(Debug, Clone, Copy)]
enum HandEdit {
    HolderCleared,
    DurationShortened,
}

/// A holder takes a lock, a contender sees it held, the holder renews once more (unseen by the
/// contender, when `renew_unseen`), and another writer makes `edit` to the Lease: the
/// contender takes the lock only once the holder's last renewal has run out, with the next
/// token.
async fn edited_by_another_writer(edit: HandEdit, renew_unseen: bool) {
    const TTL: Duration = Duration::from_secs(3);
    let harness = KubernetesHarness::new();
    let (holder, contender) = (harness.client_driver(), harness.client_driver());
    let lock = unique_lock("edited");
    let Acquire::Acquired(held) = holder.try_acquire(&lock, "pod-a", TTL).await.unwrap() else {
        panic!("the lock is free");
    };
    let mut renewed = tokio::time::Instant::now();
    assert!(
        matches!(
            contender.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
            Acquire::Busy(_)
        ),
        "taken beside its holder"
    );
    if renew_unseen {
        tokio::time::sleep(TTL / 2).await;
        renewed = tokio::time::Instant::now();
        assert!(holder.renew(&held, TTL).await.unwrap(), "the holder renews");
    }
    let mut lease = harness
        .api
        .lease(KubernetesHarness::NAMESPACE, &lock)
        .expect("the Lease");
    match edit {
        HandEdit::HolderCleared => lease["spec"]["holderIdentity"] = Value::Null,
        HandEdit::DurationShortened => lease["spec"]["leaseDurationSeconds"] = json!(1),
    }
    harness
        .api
        .put(leasehold_testkit::in_memory_api_server::LEASES, lease);
    let token = loop {
        match contender.try_acquire(&lock, "pod-b", TTL).await.unwrap() {
            Acquire::Acquired(lease) => break lease.token,
            busy => assert!(
                renewed.elapsed() < TTL * 3,
                "never taken after the edit ({edit:?}): {busy:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        renewed.elapsed() >= TTL,
        "taken {:?} into the holder's claim of {TTL:?} ({edit:?})",
        renewed.elapsed()
    );
    assert_eq!(token, held.token + 1);
}

/// A lock whose Lease is named like a family's key, swept as idle and made again by a
/// provisioner that last read it at a lower token than its holders reached since: the Lease
/// made again is marked for its floor to be read, and a process that never saw it draws above
/// the family's floor, which the sweep raised to the last holders' tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_named_like_a_key_made_again_by_provisioning_draws_above_the_familys_floor() {
    let harness = KubernetesHarness::new();
    let family = unique_lock("orders");
    let lock = unique_lock("plain");
    let target = || LeaseTarget {
        name: Some(format!("{family}.keys.x")),
    };
    let holder = harness.client_driver().with_target(&lock, target());
    let provisioner = harness.client_driver().with_target(&lock, target());
    let ttl = Duration::from_secs(10);
    taken_and_released(&holder, &lock, ttl, 3).await;
    provisioner.provision_one(&lock).await.unwrap();
    let last = taken_and_released(&holder, &lock, ttl, 3).await;
    assert_eq!(
        forget_idle_now(&holder, &family).await,
        1,
        "the Lease was not swept"
    );
    provisioner.provision_one(&lock).await.unwrap();
    let newcomer = harness.client_driver().with_target(&lock, target());
    draws_above(&newcomer, &lock, ttl, last).await;
}

/// A Lease deleted by hand and made again by provisioning (the operator makes a missing Lease)
/// starts from the highest token its provisioner saw: a process that never saw the Lease draws
/// above the last holders' tokens, not from 1 again, which a holder of the deleted Lease may
/// still fence with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_made_again_by_provisioning_starts_from_the_token_its_provisioner_saw() {
    const TTL: Duration = Duration::from_secs(30);
    let harness = KubernetesHarness::new();
    let (holder, provisioner) = (harness.client_driver(), harness.client_driver());
    let lock = unique_lock("made-again");
    provisioner
        .provision(std::slice::from_ref(&lock))
        .await
        .expect("provision");
    let last = taken_and_released(&holder, &lock, TTL, 3).await;
    provisioner
        .provision(std::slice::from_ref(&lock))
        .await
        .expect("provision, reading the Lease");
    delete_by_hand(&harness, &lock);
    provisioner
        .provision(std::slice::from_ref(&lock))
        .await
        .expect("provision, making the Lease again");
    draws_above(&harness.client_driver(), &lock, TTL, last).await;
}

/// `lock` taken and released `times` by "pod-a" through `driver`: the last token drawn.
async fn taken_and_released(
    driver: &KubernetesLeaseDriver,
    lock: &str,
    ttl: Duration,
    times: u32,
) -> u64 {
    let mut last = 0;
    for _ in 0..times {
        let Acquire::Acquired(lease) = driver.try_acquire(lock, "pod-a", ttl).await.unwrap() else {
            panic!("{lock} is not free");
        };
        assert!(driver.release(&lease).await.unwrap());
        last = lease.token;
    }
    last
}

/// `newcomer`, a process that never saw `lock`, takes it with a token above `last`.
async fn draws_above(newcomer: &KubernetesLeaseDriver, lock: &str, ttl: Duration, last: u64) {
    let Acquire::Acquired(lease) = newcomer.try_acquire(lock, "pod-b", ttl).await.unwrap() else {
        panic!("{lock} made again is not free");
    };
    assert!(
        lease.token > last,
        "token {} drawn after tokens up to {last}",
        lease.token
    );
}

/// A token seen on a released Lease counts as one seen: the Lease deleted by hand and made again
/// by a process that saw it draws above it, not from 1 again, which repeated a token an earlier
/// holder may still write with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_seen_on_a_released_lease_is_not_drawn_again_after_a_deletion() {
    const TTL: Duration = Duration::from_secs(10);
    let harness = KubernetesHarness::new();
    let (holder, observer) = (harness.client_driver(), harness.client_driver());
    let lock = unique_lock("released");
    let mut last = 0;
    for _ in 0..3 {
        let Acquire::Acquired(lease) = holder.try_acquire(&lock, "pod-a", TTL).await.unwrap()
        else {
            panic!("the lock is free");
        };
        assert!(holder.release(&lease).await.unwrap());
        last = lease.token;
    }
    assert_eq!(observer.observe(&lock).await.unwrap(), None, "released");
    delete_by_hand(&harness, &lock);
    let Acquire::Acquired(again) = observer.try_acquire(&lock, "pod-b", TTL).await.unwrap() else {
        panic!("the Lease deleted is free");
    };
    assert!(
        again.token > last,
        "token {} drawn after {last} was seen on the released Lease",
        again.token
    );
}

/// Without the option, `preferredHolder` and `strategy` change nothing and are kept through
/// acquisitions, renewals and releases: they are other tooling's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leases_preferred_holder_and_strategy_are_kept_and_change_nothing_by_default() {
    const TTL: Duration = Duration::from_secs(10);
    let harness = KubernetesHarness::new();
    let driver = harness.client_driver();
    let lock = unique_lock("kept");
    let Acquire::Acquired(first) = driver.try_acquire(&lock, "pod-a", TTL).await.unwrap() else {
        panic!("the lock is free");
    };
    prefer(&harness, &lock, "pod-b");
    assert!(driver.renew(&first, TTL).await.unwrap(), "renewed as ever");
    assert!(driver.release(&first).await.unwrap());
    let Acquire::Acquired(again) = driver.try_acquire(&lock, "pod-c", TTL).await.unwrap() else {
        panic!("the lock is free");
    };
    assert!(driver.renew(&again, TTL).await.unwrap());
    assert_eq!(spec_field(&harness, &lock, "preferredHolder"), "pod-b");
    assert_eq!(
        spec_field(&harness, &lock, "strategy"),
        "OldestEmulationVersion"
    );
}

/// With `?preferred-holder=yield`, tooling moves the lock by naming a `preferredHolder`: the
/// holder renews no more (its engine stops claiming), the Lease runs out, and the preferred pod
/// takes it, while another pod leaves it a head start of two lease durations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preferred_holder_moves_the_lock_at_the_end_of_the_holders_term() {
    const TTL: Duration = Duration::from_secs(1);
    let harness = KubernetesHarness::new();
    let driver = || harness.client_driver().yielding_to_preferred_holder(true);
    let (a, b, c) = (driver(), driver(), driver());
    let lock = unique_lock("preferred");
    let Acquire::Acquired(held) = a.try_acquire(&lock, "pod-a", TTL).await.unwrap() else {
        panic!("the lock is free");
    };
    // Preferred to itself: renewed as ever.
    prefer(&harness, &lock, "pod-a");
    assert!(a.renew(&held, TTL).await.unwrap());
    prefer(&harness, &lock, "pod-b");
    let moved = tokio::time::Instant::now();
    assert!(
        !a.renew(&held, TTL).await.unwrap(),
        "the holder renews against another preferredHolder"
    );
    // Its term runs out on its own: until then the lock is busy for everyone.
    assert!(matches!(
        b.try_acquire(&lock, "pod-b", TTL).await.unwrap(),
        Acquire::Busy(Some(_))
    ));
    let taken = loop {
        // Another pod, not preferred, is held back all along.
        match c.try_acquire(&lock, "pod-c", TTL).await.unwrap() {
            Acquire::Withheld(w) => assert!(w.reason.contains("pod-b"), "{}", w.reason),
            Acquire::Busy(_) => {}
            Acquire::Acquired(lease) => {
                panic!("pod-c took the preferred pod's head start: {lease:?}")
            }
        }
        match b.try_acquire(&lock, "pod-b", TTL).await.unwrap() {
            Acquire::Acquired(lease) => break lease,
            _ => {
                assert!(moved.elapsed() < TTL * 5, "pod-b never took the lock");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert!(
        moved.elapsed() >= TTL,
        "pod-b took the lock {:?} after the preference, within pod-a's term",
        moved.elapsed()
    );
    assert!(taken.token > held.token);
    assert!(
        b.renew(&taken, TTL).await.unwrap(),
        "the preferred holder renews"
    );
    // A preferred pod that never comes: the others take the lock after the head start.
    prefer(&harness, &lock, "pod-gone");
    assert!(!b.renew(&taken, TTL).await.unwrap());
    let gone = tokio::time::Instant::now();
    loop {
        match c.try_acquire(&lock, "pod-c", TTL).await.unwrap() {
            Acquire::Acquired(lease) => {
                assert!(lease.token > taken.token);
                break;
            }
            _ => {
                assert!(
                    gone.elapsed() < TTL * 8,
                    "nobody took the lock from a preferred pod that never came"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    assert!(
        gone.elapsed() >= TTL * 2,
        "pod-c took the lock {:?} after the last renewal, within the head start",
        gone.elapsed()
    );
}

/// A Lease another program made (a controller's leader election, without Leasehold's
/// managed-by label) is never taken over, even once its holder's term has run out, never freed
/// by a lock's clean-up, and refused at provisioning with the reason; labelled, it is
/// Leasehold's to use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_leasehold_did_not_make_is_neither_taken_nor_freed() {
    use leasehold_testkit::in_memory_api_server::LEASES;
    let harness = KubernetesHarness::new();
    let driver = harness.client_driver();
    let lock = unique_lock("foreign");
    let renewed =
        k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(120);
    harness.api.put(
        LEASES,
        json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": lock, "namespace": KubernetesHarness::NAMESPACE},
            "spec": {"holderIdentity": "controller-0_4f1c", "leaseDurationSeconds": 15,
                     "leaseTransitions": 3, "renewTime": renewed.to_string()}
        }),
    );
    let holder = || spec_field(&harness, &lock, "holderIdentity");
    let refused = driver
        .try_acquire(&lock, "pod-a", Duration::from_secs(10))
        .await
        .expect_err("another program's Lease, its term run out, was taken over");
    assert!(
        matches!(&refused, Error::InvalidConfig { .. })
            && refused
                .to_string()
                .contains("app.kubernetes.io/managed-by=leasehold"),
        "{refused}"
    );
    let refused = driver
        .provision(std::slice::from_ref(&lock))
        .await
        .expect_err("provisioning accepted another program's Lease");
    assert!(
        refused.to_string().contains("not made by Leasehold"),
        "{refused}"
    );
    driver
        .deprovision(std::slice::from_ref(&lock))
        .await
        .expect("a lock's clean-up goes on without the Lease");
    assert_eq!(
        holder(),
        "controller-0_4f1c",
        "another program's holder was freed"
    );

    let mut lease = harness
        .api
        .lease(KubernetesHarness::NAMESPACE, &lock)
        .expect("the Lease");
    lease["metadata"]["labels"] = json!({"app.kubernetes.io/managed-by": "leasehold"});
    harness.api.put(LEASES, lease);
    driver.provision(std::slice::from_ref(&lock)).await.unwrap();
    let Acquire::Acquired(taken) = driver
        .try_acquire(&lock, "pod-a", Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!("a labelled Lease whose term ran out was not taken");
    };
    assert_eq!(taken.token, 4, "the Lease's own count goes on");
    assert_eq!(holder(), "pod-a");
}

/// The operator deletes a family's key Leases once none is held: a key whose holder's clock
/// runs behind this node's (its `renewTime` looks run out here, by less than the allowed skew)
/// counts as held and keeps its Lease, since its holder still claims it; a waiter would take a
/// deleted Lease at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_holders_clock_runs_behind_is_neither_counted_free_nor_deleted() {
    const TTL: Duration = Duration::from_secs(10);
    let harness = KubernetesHarness::new();
    let driver = harness.client_driver();
    let family = unique_lock("skewed");
    let key = format!("{family}.keys.k");
    let Acquire::Acquired(_) = driver.try_acquire(&key, "pod-a", TTL).await.unwrap() else {
        panic!("the key is not free");
    };
    let renewed_ago = |ago: Duration| {
        let mut lease = harness
            .api
            .lease(KubernetesHarness::NAMESPACE, &key)
            .expect("the key's Lease");
        let renewed = k8s_openapi::jiff::Timestamp::now()
            - k8s_openapi::jiff::SignedDuration::try_from(ago).unwrap();
        lease["spec"]["renewTime"] = json!(renewed.to_string());
        harness
            .api
            .put(leasehold_testkit::in_memory_api_server::LEASES, lease);
    };
    // pod-a's clock runs 12 s behind: its renewal a moment ago reads 12 s old here, its
    // 10 s lease 2 s run out.
    renewed_ago(Duration::from_secs(12));
    assert_eq!(driver.count_held_keys(&family).await.unwrap(), Some(1));
    assert_eq!(forget_idle_now(&driver, &family).await, 0);
    assert!(
        harness
            .api
            .lease(KubernetesHarness::NAMESPACE, &key)
            .is_some(),
        "the Lease of a key its holder still claims was deleted"
    );
    // Run out by more than any allowed skew: free, and deleted.
    renewed_ago(TTL + leasehold_lease::kubernetes::MAX_CLOCK_SKEW + Duration::from_secs(1));
    assert_eq!(driver.count_held_keys(&family).await.unwrap(), Some(0));
    assert_eq!(forget_idle_now(&driver, &family).await, 1);
}

/// The holder's node clock steps back by minutes: its renewals carry a `renewTime` long past
/// their end by this node's clock. A record seen written while this contender watched has a
/// live writer, so it is timed by observation, not taken as dead long ago.
#[tokio::test]
async fn a_holder_whose_clock_steps_back_keeps_a_lease_seen_renewed() {
    let (driver, mut api) = driver();
    let server = tokio::spawn(async move {
        let (_, send) = api.expect(Method::GET, "/leases/jobs").await;
        reply(
            send,
            StatusCode::OK,
            &lease("jobs", "a", 7, Duration::from_secs(1), "5"),
        );
        // Renewed, dated by a clock that stepped back two minutes.
        let (_, send) = api.expect(Method::GET, "/leases/jobs").await;
        reply(
            send,
            StatusCode::OK,
            &lease("jobs", "a", 7, Duration::from_secs(120), "6"),
        );
        // No write follows: the test's end drops the handle, so a PUT would find no answer.
    });
    for _ in 0..2 {
        let outcome = driver
            .try_acquire("jobs", "b", Duration::from_secs(15))
            .await
            .unwrap();
        assert!(
            matches!(&outcome, Acquire::Busy(Some(holding)) if holding.identity == "a"),
            "a record seen renewed was taken as run out long ago: {outcome:?}"
        );
    }
    server.await.unwrap();
}
