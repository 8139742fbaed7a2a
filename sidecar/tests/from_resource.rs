//! `--resource`: the sidecar reads its lock from a DistributedLock (and the Secrets it
//! references) on the in-memory Kubernetes API, holds it, and follows spec changes by swapping
//! in a lock with the new settings while `/lock` keeps answering.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::Backend;
use leasehold_sidecar::api::AppState;
use leasehold_sidecar::from_resource::{self, ResourceRef};
use leasehold_sidecar::metrics::Metrics;
use leasehold_testkit::in_memory_api_server::DISTRIBUTED_LOCKS;
use leasehold_testkit::{InMemoryApiServer, RedisServer};
use serde_json::{Value, json};

/// `team/jobs` on the Redis at `redis`, its keys under `prefix`.
fn distributed_lock(redis: &RedisServer, prefix: &str, lease: &str) -> Value {
    json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
        "metadata": {"name": "jobs", "namespace": "team"},
        "spec": {"backend": {"redis": {"endpoints": [format!("127.0.0.1:{}", redis.port())],
                                       "keyPrefix": prefix}},
                 "leaseDuration": lease, "renewInterval": "1s"}
    })
}

/// A driver on the Redis of `distributed_lock(redis, prefix, _)`.
async fn redis_driver(redis: &RedisServer, prefix: &str) -> std::sync::Arc<dyn Backend> {
    let url = format!("{}?prefix={prefix}", redis.url());
    leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&url).unwrap())
        .await
        .unwrap()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within 10 s: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// pod-a's lock started from `team/jobs` on `api`, and the task that follows the resource.
async fn follow_jobs(
    api: &InMemoryApiServer,
) -> (AppState, leasehold_lease::Lock, tokio::task::JoinHandle<()>) {
    follow_jobs_rechecking(api, from_resource::SECRET_RECHECK).await
}

/// The same, reading the lock's Secrets again every `recheck`.
async fn follow_jobs_rechecking(
    api: &InMemoryApiServer,
    recheck: Duration,
) -> (AppState, leasehold_lease::Lock, tokio::task::JoinHandle<()>) {
    let (state, follower) = follow_resource(api, "team/jobs", recheck);
    eventually("team/jobs is started", || !state.locks().is_empty()).await;
    assert!(state.families().is_empty(), "team/jobs declares a lock");
    let lock = state.locks()[0].clone();
    (state, lock, follower)
}

/// pod-a's state serving `resource` (`NAMESPACE/NAME`) once it can, and the task that starts
/// it and follows it, reading its Secrets again every `recheck`.
fn follow_resource(
    api: &InMemoryApiServer,
    resource: &str,
    recheck: Duration,
) -> (AppState, tokio::task::JoinHandle<()>) {
    let metrics = Arc::new(Metrics::new());
    let r: ResourceRef = resource.parse().unwrap();
    let state = AppState::new(Vec::new(), metrics.clone())
        .expecting(vec![r.name.clone()], "its DistributedLock is being read");
    let follower = tokio::spawn(from_resource::follow(
        api.client(),
        r,
        "pod-a".into(),
        state.clone(),
        metrics,
        recheck,
        Err("the holder label is not followed here".into()),
    ));
    (state, follower)
}

/// pod-a following `team/jobs` (which does not exist yet) with its lock API on a loopback port.
async fn jobs_served_before_they_exist(
    api: &InMemoryApiServer,
) -> (AppState, tokio::task::JoinHandle<()>, std::net::SocketAddr) {
    let (state, follower) = follow_resource(api, "team/jobs", from_resource::SECRET_RECHECK);
    let addr = serve(&state).await;
    (state, follower, addr)
}

/// `state`'s lock API on a loopback port.
async fn serve(state: &AppState) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = leasehold_sidecar::api::lock_api(state.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// One request to `addr`: the status and the body.
async fn request(addr: std::net::SocketAddr, method: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.unwrap();
    let status = raw.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// `team/jobs` on `redis` with a lease of `lease`, put on a new in-memory API server and
/// followed by pod-a, once pod-a holds it.
async fn jobs_held_by_pod_a(
    redis: &RedisServer,
    lease: &str,
) -> (InMemoryApiServer, AppState, tokio::task::JoinHandle<()>) {
    let api = InMemoryApiServer::new();
    api.put(
        DISTRIBUTED_LOCKS,
        distributed_lock(redis, "leasehold", lease),
    );
    let (state, _, follower) = follow_jobs(&api).await;
    eventually("pod-a holds the lock", || {
        state.locks()[0].answer().is_holder()
    })
    .await;
    (api, state, follower)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_from_its_resource_follows_spec_changes() {
    let redis = RedisServer::start();
    let api = InMemoryApiServer::new();
    api.put(
        DISTRIBUTED_LOCKS,
        distributed_lock(&redis, "leasehold", "5s"),
    );
    let (state, lock, follower) = follow_jobs(&api).await;
    assert_eq!(lock.config().lease_duration, Duration::from_secs(5));
    assert_eq!(lock.config().identity, "pod-a");
    eventually("pod-a holds the lock", || {
        state.locks()[0].answer().is_holder()
    })
    .await;

    // The user changes the lease duration: the lock is restarted with it and held again.
    api.put(
        DISTRIBUTED_LOCKS,
        distributed_lock(&redis, "leasehold", "7s"),
    );
    eventually("the new settings are in force", || {
        state.locks()[0].config().lease_duration == Duration::from_secs(7)
    })
    .await;
    eventually("pod-a holds the lock again", || {
        state.locks()[0].answer().is_holder()
    })
    .await;
    assert_eq!(state.locks().len(), 1);

    // A change that cannot work keeps the running lock.
    let mut broken = distributed_lock(&redis, "leasehold", "7s");
    broken["spec"]["backend"]["redis"]["keyPrefix"] = json!("not a prefix");
    api.put(DISTRIBUTED_LOCKS, broken);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        state.locks()[0].config().lease_duration,
        Duration::from_secs(7)
    );
    assert_eq!(state.locks()[0].backend(), "redis");
    assert!(state.locks()[0].answer().is_holder());
    follower.abort();
}

/// While the app fails its health probe, a lock put in place by a spec change sits out from
/// its start, as the lock it replaces did: it takes nothing until the app is healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_replaced_while_the_app_is_unhealthy_sits_out_from_its_start() {
    let redis = RedisServer::start();
    let api = InMemoryApiServer::new();
    api.put(
        DISTRIBUTED_LOCKS,
        distributed_lock(&redis, "leasehold", "5s"),
    );
    let (state, _, follower) = follow_jobs(&api).await;
    eventually("pod-a holds the lock", || {
        state.locks()[0].answer().is_holder()
    })
    .await;
    // Nothing listens on the app's port: the first probe fails, and the next is an hour away.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("tcp://{}", closed.local_addr().unwrap());
    drop(closed);
    let health =
        leasehold_sidecar::app_health::AppHealth::parse(&url, Duration::from_secs(3600), 1)
            .expect("a probe");
    let prober = tokio::spawn(leasehold_sidecar::app_health::watch(
        health,
        state.clone(),
        Arc::new(Metrics::new()),
    ));
    eventually("the lock sits out", || {
        state.locks()[0].snapshot().sitting_out.is_some()
    })
    .await;
    let driver = redis_driver(&redis, "leasehold").await;
    eventually_async(
        "the lease is let go once its last answer ran out",
        || async { driver.observe("jobs").await.unwrap().is_none() },
    )
    .await;

    api.put(
        DISTRIBUTED_LOCKS,
        distributed_lock(&redis, "leasehold", "7s"),
    );
    eventually("the new settings are in force", || {
        state.locks()[0].config().lease_duration == Duration::from_secs(7)
    })
    .await;
    let lock = state.locks()[0].clone();
    assert!(
        lock.snapshot().sitting_out.is_some(),
        "the new lock campaigns while the app is unhealthy"
    );
    // A campaign's first attempts would take the free lock at once.
    let until = tokio::time::Instant::now() + Duration::from_secs(2);
    while tokio::time::Instant::now() < until {
        assert!(
            !lock.answer().is_holder() && lock.snapshot().held.is_none(),
            "the new lock took the lock while the app is unhealthy"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    prober.abort();
    follower.abort();
}

/// Helm and Argo CD create custom resources after Deployments: a pod whose lock does not exist
/// yet answers 503 with the reason (its app starts and can say why), then holds the lock once it
/// is created. A Secret it references that is missing is waited for the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_created_after_its_pod_is_taken_once_it_exists() {
    let redis = RedisServer::start();
    let api = InMemoryApiServer::new();
    let (state, follower, addr) = jobs_served_before_they_exist(&api).await;
    let mut said = String::new();
    for _ in 0..500 {
        let (status, body) = request(addr, "GET", "/lock").await;
        assert_eq!(status, 503, "{body}");
        said = body;
        if said.contains("does not exist") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        said.contains("team/jobs") && said.contains("does not exist"),
        "{said}"
    );
    let (status, body) = request(addr, "GET", "/locks/jobs").await;
    assert_eq!(status, 503, "{body}");

    // Created with a password from a Secret that does not exist yet.
    api.put(
        DISTRIBUTED_LOCKS,
        with_app_credentials(distributed_lock(&redis, "leasehold", "5s")),
    );
    eventually("the missing Secret is the reason", || {
        state
            .pending_reason("jobs")
            .is_some_and(|reason| reason.contains("redis-auth"))
    })
    .await;
    let (status, body) = request(addr, "GET", "/lock").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("redis-auth"), "{body}");

    rotate_redis_password(&redis, &api, "s3cret");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = request(addr, "GET", "/lock").await;
        if status == 200 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not held within 10 s of the Secret: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state.pending_reason("jobs"), None);
    follower.abort();
}

/// A pod that resigned (its preStop hook) while its lock did not exist yet never takes the lock
/// once it is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_resigned_before_its_lock_existed_never_takes_it() {
    let redis = RedisServer::start();
    let api = InMemoryApiServer::new();
    let (state, follower, addr) = jobs_served_before_they_exist(&api).await;
    let (status, body) = request(addr, "POST", "/resign").await;
    assert_eq!(status, 200, "{body}");
    api.put(
        DISTRIBUTED_LOCKS,
        distributed_lock(&redis, "leasehold", "5s"),
    );
    tokio::time::timeout(Duration::from_secs(10), follower)
        .await
        .expect("the follower ends once the lock it would start is unwanted")
        .expect("the follower ran to its end");
    assert!(state.locks().is_empty());
    let driver = redis_driver(&redis, "leasehold").await;
    assert_eq!(
        driver.observe("jobs").await.unwrap(),
        None,
        "nobody holds it"
    );
}

/// The CRD forbids moving a lock to another backend; a sidecar that sees it anyway steps down on
/// the old backend and does not campaign on the new one until the old lease and a renew
/// interval have passed, so it never holds on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_backend_is_never_held_on_both() {
    let redis = RedisServer::start();
    let api = InMemoryApiServer::new();
    never_held_on_both(
        &api,
        distributed_lock(&redis, "old", "3s"),
        distributed_lock(&redis, "new", "3s"),
    )
    .await;
}

/// On PostgreSQL without `schema`, the user's `search_path` finds the table, so a Secret naming
/// another user may move the lock to another table. The other pods see the Secret only at
/// their own re-read, up to a re-check interval later, and a holder among them claims the old
/// table until it does: the pod that saw it first waits out that interval too, beside the old
/// lease and a renew interval, before it campaigns on the new table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_seen_in_a_secret_waits_for_every_pod_to_have_read_it() {
    use leasehold_testkit::in_memory_api_server::SECRETS;
    let server = leasehold_testkit::PostgresServer::start();
    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&server.url())
        .await
        .unwrap();
    for user in ["alice", "bob"] {
        for statement in [
            format!("CREATE ROLE {user} LOGIN"),
            format!("CREATE SCHEMA {user} AUTHORIZATION {user}"),
        ] {
            sqlx::query(&statement).execute(&mut admin).await.unwrap();
        }
        // Each user's own table, where the lock is provisioned as the operator would.
        let url = format!("postgres://{user}@127.0.0.1:{}/postgres", server.port());
        let driver = leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&url).unwrap())
            .await
            .unwrap();
        driver.provision_one("jobs").await.unwrap();
    }
    let user_secret = |user: &str| {
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "pg-user", "namespace": "team",
                            "annotations": {"leasehold.dev/allowed-hosts": "127.0.0.1"}},
               "stringData": {"user": user}})
    };
    let api = InMemoryApiServer::new();
    api.put(SECRETS, user_secret("alice"));
    api.put(
        DISTRIBUTED_LOCKS,
        json!({
            "apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
            "metadata": {"name": "jobs", "namespace": "team"},
            "spec": {"backend": {"postgres": {"host": "127.0.0.1", "port": server.port(),
                                              "database": "postgres",
                                              "userSecretRef": {"name": "pg-user", "key": "user"}}},
                     "leaseDuration": "3s", "renewInterval": "1s"}
        }),
    );
    let recheck = Duration::from_secs(1);
    let (state, old_lock, follower) = follow_jobs_rechecking(&api, recheck).await;
    eventually("pod-a holds the lock", || old_lock.answer().is_holder()).await;

    api.put(SECRETS, user_secret("bob"));
    eventually("pod-a steps down on alice's table", || {
        !old_lock.answer().is_holder()
    })
    .await;
    let moved = tokio::time::Instant::now();
    // Old lease (3 s) + renew interval (1 s) + the re-check (1 s) before any claim on bob's.
    while moved.elapsed() < Duration::from_millis(4500) {
        assert!(
            !state.locks()[0].answer().is_holder(),
            "held on bob's table {:?} after the move, before every pod may have read the Secret",
            moved.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eventually("pod-a holds the lock on bob's table", || {
        state.locks()[0].answer().is_holder()
    })
    .await;
    follower.abort();
}

/// On the Kubernetes backend, another Lease (`leaseName`) is another place too, so that a pod
/// that still holds the old Lease is never beside one holding the new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_lease_name_is_never_held_beside_the_old_one() {
    let api = InMemoryApiServer::new();
    let on_lease = |lease_name: &str| {
        json!({
            "apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
            "metadata": {"name": "jobs", "namespace": "team"},
            "spec": {"backend": {"kubernetes": {"leaseName": lease_name}},
                     "leaseDuration": "3s", "renewInterval": "1s"}
        })
    };
    never_held_on_both(&api, on_lease("jobs-old"), on_lease("jobs-new")).await;
}

/// pod-a holds `team/jobs` as `before` declares it (a 3 s lease, renewed every second); once
/// it is edited to `after`, another place, pod-a steps down on the old place and claims the new
/// one only once the old lease and a renew interval have passed.
async fn never_held_on_both(api: &InMemoryApiServer, before: Value, after: Value) {
    api.put(DISTRIBUTED_LOCKS, before);
    let (state, old_lock, follower) = follow_jobs(api).await;
    eventually("pod-a holds the lock", || old_lock.answer().is_holder()).await;

    api.put(DISTRIBUTED_LOCKS, after);
    let moved = tokio::time::Instant::now();
    eventually("pod-a steps down on the old place", || {
        !old_lock.answer().is_holder()
    })
    .await;
    // Old lease (3 s) + renew interval (1 s) before any claim on the new place.
    while moved.elapsed() < Duration::from_millis(3500) {
        assert!(
            !state.locks()[0].answer().is_holder(),
            "held on the new place {:?} after the move",
            moved.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eventually("pod-a holds the lock on the new place", || {
        state.locks()[0].answer().is_holder()
    })
    .await;
    assert!(!old_lock.answer().is_holder());
    follower.abort();
}

/// A DistributedLock being deleted (its finalizer still on, as the operator keeps it while a
/// `cleanupPolicy: Delete` lock has a holder): the sidecar stops claiming the lock at once, and
/// releases it once the last answer it gave has run out (the pod's app runs on, and may act on
/// it until then), so that the operator can delete the records without a newcomer ever
/// overlapping the holder. Recreated, the lock is campaigned for again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_being_deleted_is_released_and_campaigned_again_when_it_returns() {
    let redis = RedisServer::start();
    let (api, state, follower) = jobs_held_by_pod_a(&redis, "3s").await;

    let mut deleting = distributed_lock(&redis, "leasehold", "3s");
    deleting["metadata"]["deletionTimestamp"] = json!("2026-11-22T12:00:00Z");
    deleting["metadata"]["finalizers"] = json!(["leasehold.dev/cleanup"]);
    let answered_until = answered_until(&state.locks()[0]);
    api.put(DISTRIBUTED_LOCKS, deleting);
    eventually("pod-a stops claiming the lock being deleted", || {
        !state.locks()[0].answer().is_holder()
    })
    .await;
    kept_until_the_answer_ran_out(&redis, answered_until).await;

    api.put(
        DISTRIBUTED_LOCKS,
        distributed_lock(&redis, "leasehold", "3s"),
    );
    eventually("pod-a holds the recreated lock", || {
        state.locks()[0].answer().is_holder()
    })
    .await;
    follower.abort();
}

/// When the last answer `lock` gave (asked now) runs out.
fn answered_until(lock: &leasehold_lease::Lock) -> tokio::time::Instant {
    let asked = tokio::time::Instant::now();
    match lock.answer() {
        leasehold_lease::Answer::Holder { valid_for, .. } => asked + valid_for,
        other => panic!("pod-a does not hold: {other:?}"),
    }
}

/// The backend keeps pod-a's lease until `answered_until`, and it is released soon after.
async fn kept_until_the_answer_ran_out(redis: &RedisServer, answered_until: tokio::time::Instant) {
    let driver = redis_driver(redis, "leasehold").await;
    while tokio::time::Instant::now() < answered_until {
        let holder = driver.observe("jobs").await.unwrap();
        // The observation may have been answered just after the answer ran out.
        if tokio::time::Instant::now() < answered_until {
            assert_eq!(
                holder.as_ref().map(|h| h.identity.as_str()),
                Some("pod-a"),
                "released while pod-a's last answer still ran"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eventually_async("the lease is released from Redis", || {
        let driver = driver.clone();
        async move { driver.observe("jobs").await.unwrap().is_none() }
    })
    .await;
}

/// The operator writes a lock's status at every holder change: that must not make every pod's
/// sidecar read the lock's Secrets again (only a spec change, a new generation, does).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_writes_cost_the_sidecar_no_secret_reads() {
    use leasehold_testkit::in_memory_api_server::SECRETS;
    let redis = RedisServer::start();
    let api = InMemoryApiServer::new();
    // Redis's default user has no password, so any password is accepted for it.
    api.put(
        SECRETS,
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "redis-auth", "namespace": "team",
                            "annotations": {"leasehold.dev/allowed-hosts": "127.0.0.1"}},
               "stringData": {"user": "default", "password": "anything"}}),
    );
    let mut lock = json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
        "metadata": {"name": "jobs", "namespace": "team"},
        "spec": {"backend": {"redis": {
                    "endpoints": [format!("127.0.0.1:{}", redis.port())],
                    "usernameSecretRef": {"name": "redis-auth", "key": "user"},
                    "passwordSecretRef": {"name": "redis-auth", "key": "password"}}},
                 "leaseDuration": "5s", "renewInterval": "1s"}
    });
    api.put(DISTRIBUTED_LOCKS, lock.clone());
    let (state, _, follower) = follow_jobs(&api).await;
    eventually("pod-a holds the lock", || {
        state.locks()[0].answer().is_holder()
    })
    .await;
    let before = api.settled_requests().await;
    for transitions in 1..=10 {
        lock["status"] =
            json!({"holder": "pod-a", "fencingToken": transitions, "transitions": transitions});
        api.put(DISTRIBUTED_LOCKS, lock.clone());
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        api.requests() - before,
        0,
        "status writes made the sidecar call the API server"
    );
    // A spec change is read, Secrets included.
    lock["spec"]["leaseDuration"] = json!("7s");
    api.put(DISTRIBUTED_LOCKS, lock.clone());
    eventually("the new settings are in force", || {
        state.locks()[0].config().lease_duration == Duration::from_secs(7)
    })
    .await;
    assert!(api.requests() > before, "the spec change was not read");
    follower.abort();
}

/// `team/orders` on the Redis at `redis`: a family of keyed locks.
fn keyed_family(redis: &RedisServer, lease: &str, max_held: u32) -> Value {
    json!({
        "apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
        "metadata": {"name": "orders", "namespace": "team"},
        "spec": {"backend": {"redis": {"endpoints": [format!("127.0.0.1:{}", redis.port())]}},
                 "leaseDuration": lease, "renewInterval": "1s",
                 "keys": {"maxKeyLength": 16, "maxHeldPerPod": max_held}}
    })
}

/// pod-a's family started from `team/orders` on `api`, and the task that follows the resource
/// (reading its Secrets again every `recheck`).
async fn follow_orders(
    api: &InMemoryApiServer,
    recheck: Duration,
) -> (
    leasehold_lease::keyed::KeyedFamily,
    tokio::task::JoinHandle<()>,
) {
    let (state, follower) = follow_resource(api, "team/orders", recheck);
    eventually("team/orders is started", || !state.families().is_empty()).await;
    assert!(state.locks().is_empty(), "team/orders declares a family");
    (state.families()[0].clone(), follower)
}

/// A `DistributedLock` with `spec.keys` is served as a family (`/locks/orders/keys/...`) with its
/// bounds; a spec change applies from the next acquisition; a deletion releases every key and
/// takes no more until the resource returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_family_from_its_resource_follows_spec_changes_and_deletion() {
    use leasehold_lease::keyed::{KeyAnswer, KeyError};
    let redis = RedisServer::start();
    let api = InMemoryApiServer::new();
    api.put(DISTRIBUTED_LOCKS, keyed_family(&redis, "5s", 2));
    let (family, follower) = follow_orders(&api, from_resource::SECRET_RECHECK).await;
    assert_eq!(family.name(), "orders");
    assert_eq!(family.config().lease_duration, Duration::from_secs(5));
    let hold = Duration::from_secs(60);
    let take = |key: &'static str| {
        let family = family.clone();
        async move { family.acquire(key, "w1", Duration::ZERO, hold).await }
    };
    for key in ["sku-1", "sku-2"] {
        assert!(
            matches!(take(key).await, Ok(KeyAnswer::Held { .. })),
            "{key}"
        );
    }
    assert!(matches!(take("sku-3").await, Err(KeyError::TooManyKeys(2))));
    assert!(matches!(
        take("sku-with-a-long-name").await,
        Err(KeyError::BadKey { .. })
    ));

    api.put(DISTRIBUTED_LOCKS, keyed_family(&redis, "7s", 3));
    eventually("the new bounds are in force", || {
        family.config().max_keys == 3
    })
    .await;
    assert_eq!(family.config().lease_duration, Duration::from_secs(7));
    assert!(matches!(take("sku-3").await, Ok(KeyAnswer::Held { .. })));

    let mut deleting = keyed_family(&redis, "7s", 3);
    deleting["metadata"]["deletionTimestamp"] = json!("2026-11-22T12:00:00Z");
    deleting["metadata"]["finalizers"] = json!(["leasehold.dev/cleanup"]);
    api.put(DISTRIBUTED_LOCKS, deleting);
    eventually("every key is let go of", || family.held_keys() == 0).await;
    // Kept in the backend while the last answer about each may still be acted on (its claim,
    // at least 4.6 s of the 7 s lease at the last renewal), then released.
    let driver = redis_driver(&redis, "leasehold").await;
    let names: Vec<String> = ["sku-1", "sku-2", "sku-3"]
        .into_iter()
        .map(|key| family.backend_name(key).unwrap())
        .collect();
    for name in &names {
        let holder = driver.observe(name).await.unwrap();
        assert!(
            holder.is_some(),
            "{name} released while its answer still ran"
        );
    }
    for name in &names {
        eventually_async("the key is released", || {
            let (driver, name) = (driver.clone(), name.clone());
            async move { driver.observe(&name).await.unwrap().is_none() }
        })
        .await;
    }
    assert!(matches!(take("sku-4").await, Err(KeyError::Stopped(_))));

    api.put(DISTRIBUTED_LOCKS, keyed_family(&redis, "7s", 3));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match take("sku-4").await {
            Ok(KeyAnswer::Held { .. }) => break,
            Err(KeyError::Stopped(_)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("the recreated family does not serve: {other:?}"),
        }
    }
    follower.abort();
}

/// Redis ACL user `app` with `password` only, and the Secret `redis-auth` holding it.
fn rotate_redis_password(redis: &RedisServer, api: &InMemoryApiServer, password: &str) {
    use leasehold_testkit::in_memory_api_server::SECRETS;
    use leasehold_testkit::redis_cluster::command;
    command(
        redis.port(),
        &[
            "ACL",
            "SETUSER",
            "app",
            "on",
            "resetpass",
            &format!(">{password}"),
            "~*",
            "&*",
            "+@all",
        ],
    )
    .expect("ACL SETUSER");
    api.put(
        SECRETS,
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "redis-auth", "namespace": "team",
                            "annotations": {"leasehold.dev/allowed-hosts": "127.0.0.1"}},
               "stringData": {"user": "app", "password": password}}),
    );
}

/// Every connection `app` has is cut: its clients must log in again, with what they know.
fn cut_app_connections(redis: &RedisServer) {
    leasehold_testkit::redis_cluster::command(redis.port(), &["CLIENT", "KILL", "USER", "app"])
        .expect("CLIENT KILL");
}

/// A lock or family of `team/NAME` on `redis`, logging in as `app` from `redis-auth`.
fn with_app_credentials(mut resource: Value) -> Value {
    let redis = &mut resource["spec"]["backend"]["redis"];
    redis["usernameSecretRef"] = json!({"name": "redis-auth", "key": "user"});
    redis["passwordSecretRef"] = json!({"name": "redis-auth", "key": "password"});
    resource
}

/// A password rotated under a running lock (the new one set and the old one revoked, as External
/// Secrets or Vault do, then every connection cut): the sidecar reads the Secret again within its
/// re-check, restarts the lock with it, and holds again with a greater token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_password_reaches_the_running_lock() {
    let redis = RedisServer::start();
    let api = InMemoryApiServer::new();
    rotate_redis_password(&redis, &api, "first-password");
    api.put(
        DISTRIBUTED_LOCKS,
        with_app_credentials(distributed_lock(&redis, "leasehold", "3s")),
    );
    let (state, _, follower) = follow_jobs_rechecking(&api, Duration::from_millis(300)).await;
    eventually("pod-a holds the lock", || {
        state.locks()[0].answer().is_holder()
    })
    .await;
    let before = state.locks()[0].answer().token().unwrap();
    // The re-checks of a Secret that did not change read the API server's cache, not etcd.
    let reads = |kind: &str| api.requests_by_kind().get(kind).copied().unwrap_or(0);
    let (consistent, cached) = (reads("GET secrets"), reads("GET secrets from the cache"));
    // Three re-checks at 300 ms, however late a loaded machine runs them.
    eventually("three re-checks read the Secret from the cache", || {
        reads("GET secrets from the cache") >= cached + 3
    })
    .await;
    assert_eq!(
        reads("GET secrets"),
        consistent,
        "re-checks of an unchanged Secret read it from etcd"
    );

    rotate_redis_password(&redis, &api, "second-password");
    cut_app_connections(&redis);
    eventually(
        "pod-a holds the lock with the new password, a greater token",
        || {
            state.locks()[0]
                .answer()
                .token()
                .is_some_and(|token| token > before)
        },
    )
    .await;
    // The new lock's connections log in with the new password: cut them, and it still holds.
    let token = state.locks()[0].answer().token().unwrap();
    cut_app_connections(&redis);
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Its answer is "unknown" for a moment where a renewal runs past its budget on a slow
    // machine; a lost lock would come back with a greater token, or none.
    eventually("pod-a still holds, with the same token", || {
        state.locks()[0].answer().token() == Some(token)
    })
    .await;
    follower.abort();
}

/// The same under a family: the keys taken after the rotation are taken with the new password.
/// (A key held across it keeps the connections it was taken with; cut, as here, it is lost
/// within its lease and taken again with the new password.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_password_reaches_a_running_family() {
    use leasehold_lease::keyed::KeyAnswer;
    let redis = RedisServer::start();
    let api = InMemoryApiServer::new();
    rotate_redis_password(&redis, &api, "first-password");
    api.put(
        DISTRIBUTED_LOCKS,
        with_app_credentials(keyed_family(&redis, "3s", 8)),
    );
    let (family, follower) = follow_orders(&api, Duration::from_millis(300)).await;
    let hold = Duration::from_secs(60);
    let held = family.acquire("sku-1", "w1", Duration::ZERO, hold).await;
    assert!(matches!(held, Ok(KeyAnswer::Held { .. })), "{held:?}");

    rotate_redis_password(&redis, &api, "second-password");
    tokio::time::sleep(Duration::from_secs(1)).await;
    cut_app_connections(&redis);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match family.acquire("sku-2", "w2", Duration::ZERO, hold).await {
            Ok(KeyAnswer::Held { .. }) => break,
            other => assert!(
                tokio::time::Instant::now() < deadline,
                "a key taken after the rotation: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    follower.abort();
}

/// A lock restarted for a spec change lets its lease run out rather than releasing it: another
/// pod waiting for the lock does not hold it before the last `validForMs` this pod's lock gave
/// has run out, and the lock is held by somebody once it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_lock_lets_its_lease_run_out_before_anyone_else_holds() {
    use leasehold_lease::{LockConfig, Mode};
    let redis = RedisServer::start();
    let (api, state, follower) = jobs_held_by_pod_a(&redis, "3s").await;
    let other = leasehold_lease::Lock::start(
        redis_driver(&redis, "leasehold").await,
        LockConfig {
            mode: Mode::Campaign,
            ..LockConfig::new("jobs", "pod-b", Duration::from_secs(3))
        },
        Arc::new(()),
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!other.answer().is_holder());

    // The last answer pod-a's app had, and until when it may act on it.
    let mut changed = distributed_lock(&redis, "leasehold", "3s");
    changed["spec"]["renewInterval"] = json!("900ms");
    let (promised, token) = match state.locks()[0].answer() {
        leasehold_lease::Answer::Holder {
            valid_for, token, ..
        } => (tokio::time::Instant::now() + valid_for, token),
        other => panic!("pod-a does not hold: {other:?}"),
    };
    let observer = redis_driver(&redis, "leasehold").await;
    api.put(DISTRIBUTED_LOCKS, changed);
    eventually("the new settings are in force", || {
        state.locks()[0].config().renew_interval == Duration::from_millis(900)
    })
    .await;
    // Until then the lease pod-a's app acted on stays in Redis, and nobody else holds.
    loop {
        let seen = observer.observe("jobs").await.unwrap();
        if tokio::time::Instant::now() >= promised {
            break;
        }
        assert_eq!(
            seen.as_ref().map(|h| (h.identity.as_str(), h.token)),
            Some(("pod-a", token)),
            "{:?} before pod-a's last answer ran out",
            promised - tokio::time::Instant::now()
        );
        assert!(!other.answer().is_holder(), "pod-b holds");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eventually("somebody holds the lock again", || {
        other.answer().is_holder() || state.locks()[0].answer().is_holder()
    })
    .await;
    other.shutdown().await;
    follower.abort();
}

/// A resource without the operator's finalizer (`cleanupPolicy: Retain`) is gone the moment it is
/// deleted: the sidecar stops claiming its lock at once, releases it once the last answer it
/// gave has run out, and campaigns again when it comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_deleted_without_a_finalizer_is_released() {
    let redis = RedisServer::start();
    let (api, state, follower) = jobs_held_by_pod_a(&redis, "3s").await;
    let answered_until = answered_until(&state.locks()[0]);
    assert!(api.remove(DISTRIBUTED_LOCKS, "team", "jobs"));
    eventually("pod-a stops claiming the lock", || {
        !state.locks()[0].answer().is_holder()
    })
    .await;
    kept_until_the_answer_ran_out(&redis, answered_until).await;
    api.put(
        DISTRIBUTED_LOCKS,
        distributed_lock(&redis, "leasehold", "3s"),
    );
    eventually("pod-a holds the lock again", || {
        state.locks()[0].answer().is_holder()
    })
    .await;
    follower.abort();
}

async fn eventually_async<F: std::future::Future<Output = bool>>(
    what: &str,
    mut check: impl FnMut() -> F,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within 10 s: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
