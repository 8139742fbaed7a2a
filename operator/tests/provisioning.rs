//! The operator's provisioning and clean-up against the real servers of each backend (started
//! by the test harness), with Secrets and Leases on the in-memory Kubernetes API. Each test
//! then checks the backend itself: the table and seeded row, the parent znode, the Lease, and
//! that a driver takes the provisioned lock.

use std::time::Duration;

use kube::ResourceExt;
use leasehold_crds::{
    Backend, CleanupPolicy, DistributedLock, EtcdBackend, KubernetesBackend, RedisBackend,
    RedisSentinel, SecretKeyRef, SqlBackend, SqlLockMode, ZooKeeperBackend,
};
use leasehold_lease::Acquire;
use leasehold_operator::backends::{Backends, StillHeld};
use leasehold_operator::status::Observation;
use leasehold_resource as resource;
use leasehold_testkit::in_memory_api_server::{LEASES, SECRETS};
use leasehold_testkit::{
    EtcdServer, InMemoryApiServer, MariaDbServer, PostgresServer, RedisSentinelSet, RedisServer,
    ZooKeeperServer,
};
use serde_json::json;

mod support;
use support::operator_client;

const NS: &str = "team";

fn lock(name: &str, backend: Backend) -> DistributedLock {
    let mut lock = leasehold_testkit::distributed_lock(NS, name, backend);
    lock.spec.cleanup_policy = CleanupPolicy::Delete;
    lock
}

/// A Secret its owner opened to the test servers, which all listen on loopback.
fn secret(api: &InMemoryApiServer, name: &str, key: &str, value: &str) -> SecretKeyRef {
    secret_allowing(api, name, key, value, Some("127.0.0.1"))
}

fn secret_allowing(
    api: &InMemoryApiServer,
    name: &str,
    key: &str,
    value: &str,
    allowed_hosts: Option<&str>,
) -> SecretKeyRef {
    let data = k8s_openapi::ByteString(value.as_bytes().to_vec());
    let annotations = match allowed_hosts {
        Some(hosts) => json!({resource::ALLOWED_HOSTS_ANNOTATION: hosts}),
        None => json!({}),
    };
    api.put(
        SECRETS,
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": name, "namespace": NS, "annotations": annotations},
               "data": {key: data}}),
    );
    SecretKeyRef {
        name: name.into(),
        key: key.into(),
    }
}

/// Provision through the operator; returns the observation and a driver for the same lock.
async fn provision(
    api: &InMemoryApiServer,
    lock: &DistributedLock,
) -> (Observation, std::sync::Arc<dyn leasehold_lease::Backend>) {
    let operator = operator_client(api);
    let (_, observation) = Backends::default().observe(&operator, lock).await;
    let resolved = Backends::default()
        .resolve(&operator, lock)
        .await
        .expect("resolve");
    // The sidecar's driver, with the pod's own rights (not under test here).
    let driver = resource::open(&api.client(), &resolved)
        .await
        .expect("open");
    (observation, driver)
}

/// A lock on a Kubernetes Lease named after it.
fn lease_lock(name: &str) -> DistributedLock {
    lock(
        name,
        Backend {
            kubernetes: Some(KubernetesBackend::default()),
            ..Default::default()
        },
    )
}

async fn takes(driver: &dyn leasehold_lease::Backend, lock: &str) {
    match driver
        .try_acquire(lock, "pod-a", Duration::from_secs(30))
        .await
        .unwrap()
    {
        Acquire::Acquired(lease) => assert!(driver.release(&lease).await.unwrap()),
        busy => panic!("the provisioned lock is not free: {busy:?}"),
    }
}

fn ready(observation: &Observation) -> &[String] {
    match observation {
        Observation::Ready { warnings, .. } => warnings,
        failed => panic!("not provisioned: {failed:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_row_lock_is_seeded_and_keeps_only_its_token_on_delete() {
    let server = PostgresServer::start();
    let api = InMemoryApiServer::new();
    let user = secret(&api, "pg", "user", "postgres");
    let lock = lock(
        "jobs",
        Backend {
            postgres: Some(SqlBackend {
                host: "127.0.0.1".into(),
                port: Some(server.port()),
                database: "postgres".into(),
                lock_mode: SqlLockMode::RowLock,
                user_secret_ref: Some(user),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (observation, driver) = provision(&api, &lock).await;
    assert!(ready(&observation).is_empty());
    let pool = sqlx::PgPool::connect(&server.url()).await.unwrap();
    let rows: Vec<String> = sqlx::query_scalar("SELECT name FROM leasehold_locks_rows")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(rows, ["jobs"], "the row is seeded before anyone locks it");
    takes(&*driver, "jobs").await;

    Backends::default()
        .clean_up(&operator_client(&api), &lock)
        .await
        .unwrap();
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM leasehold_locks_rows WHERE name = 'jobs'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(left, 0, "the seeded row of the deleted lock is still there");
    // The lease row stays, free, with its token: a lock created again continues above it.
    let (holder, token): (Option<String>, i64) =
        sqlx::query_as("SELECT holder, token FROM leasehold_locks WHERE name = 'jobs'")
            .fetch_one(&pool)
            .await
            .unwrap();
    // Token 2 went to the clean-up itself, which took the lock to delete its records.
    assert_eq!((holder, token), (None, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_gets_its_lock_table() {
    let server = MariaDbServer::start();
    let api = InMemoryApiServer::new();
    let user = secret(&api, "db", "user", "root");
    let lock = lock(
        "reports",
        Backend {
            mysql: Some(SqlBackend {
                host: "127.0.0.1".into(),
                port: Some(server.port()),
                database: server.url().rsplit('/').next().unwrap().to_owned(),
                table: Some("team_locks".into()),
                user_secret_ref: Some(user),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (observation, driver) = provision(&api, &lock).await;
    ready(&observation);
    let pool = sqlx::MySqlPool::connect(&server.url()).await.unwrap();
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'team_locks'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(tables, 1);
    takes(&*driver, "reports").await;
}

/// Managed Redis refuses `CONFIG` and evicts by default: the policy is then read from
/// `INFO memory`, which a lock's user may run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_that_refuses_config_is_still_checked_for_eviction() {
    let server = RedisServer::start();
    let mut conn = server.admin().await;
    for command in [
        vec!["CONFIG", "SET", "maxmemory-policy", "volatile-lru"],
        vec![
            "ACL", "SETUSER", "locker", "on", ">secret", "~*", "&*", "+@all", "-config",
        ],
    ] {
        let _: () = redis::cmd(command[0])
            .arg(&command[1..])
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let url = format!("redis://locker:secret@127.0.0.1:{}", server.port());
    let driver = leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&url).unwrap())
        .await
        .unwrap();
    let warnings = driver.warnings().await.unwrap();
    assert!(
        warnings.len() == 1 && warnings[0].contains("volatile-lru"),
        "{warnings:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_that_may_evict_lock_keys_is_ready_with_a_warning() {
    let server = RedisServer::start();
    let mut conn = server.admin().await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async(&mut conn)
        .await
        .unwrap();
    let api = InMemoryApiServer::new();
    let lock = lock(
        "cache",
        Backend {
            redis: Some(RedisBackend {
                endpoints: vec![format!("127.0.0.1:{}", server.port())],
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (observation, driver) = provision(&api, &lock).await;
    let warnings = ready(&observation);
    assert!(
        warnings.len() == 1 && warnings[0].contains("allkeys-lru"),
        "{warnings:?}"
    );
    takes(&*driver, "cache").await;
    // The clean-up removes the lease key and keeps the token counter, so that a lock created
    // again under the name continues above it.
    Backends::default()
        .clean_up(&operator_client(&api), &lock)
        .await
        .unwrap();
    for (key, kept) in [
        ("leasehold:{cache}:lease", 0),
        ("leasehold:{cache}:token", 1),
    ] {
        let left: i64 = redis::cmd("EXISTS")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(left, kept, "{key}");
    }
}

/// Redis behind Sentinel: the operator reaches the master through the sentinels it is given
/// (the endpoints), reports the lock ready, and its clean-up runs on that master, keeping the
/// token counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sentinel_is_reached_through_the_sentinels() {
    let set = RedisSentinelSet::start();
    let api = InMemoryApiServer::new();
    let lock = lock(
        "payouts",
        Backend {
            redis: Some(RedisBackend {
                endpoints: vec![format!("127.0.0.1:{}", set.sentinel_port())],
                sentinel: Some(RedisSentinel {
                    master_name: leasehold_testkit::redis_sentinel::MASTER_NAME.into(),
                    min_replicas: Some(1),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (observation, driver) = provision(&api, &lock).await;
    ready(&observation);
    assert_eq!(driver.kind(), "redis-sentinel");
    // The replica must confirm the acquisition; on a machine busy starting the other tests'
    // servers that can take longer than the driver waits, and the acquisition is then retried,
    // as the sidecar's engine would.
    let started = std::time::Instant::now();
    let lease = loop {
        match driver
            .try_acquire("payouts", "pod-a", Duration::from_secs(10))
            .await
        {
            Ok(Acquire::Acquired(lease)) => break lease,
            Ok(busy) => panic!("the provisioned lock is not free: {busy:?}"),
            Err(e) => assert!(started.elapsed() < Duration::from_secs(10), "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let exists = |key: &str| set.on_master(&["EXISTS", key]).unwrap();
    assert_eq!(exists("leasehold:{payouts}:lease"), "int(1)");
    // Held: the clean-up names the holder and deletes nothing.
    let backends = Backends::default();
    let waiting = backends
        .clean_up(&operator_client(&api), &lock)
        .await
        .unwrap();
    let Some(StillHeld::Lock(Some(holder))) = waiting else {
        panic!("{waiting:?}")
    };
    assert_eq!(holder.identity, "pod-a");
    assert_eq!(exists("leasehold:{payouts}:lease"), "int(1)");
    assert!(driver.release(&lease).await.unwrap());
    assert_eq!(
        backends
            .clean_up(&operator_client(&api), &lock)
            .await
            .unwrap(),
        None
    );
    assert_eq!(exists("leasehold:{payouts}:lease"), "int(0)");
    assert_eq!(exists("leasehold:{payouts}:token"), "int(1)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_gets_its_parent_node_and_loses_it_on_delete() {
    let server = ZooKeeperServer::start();
    let api = InMemoryApiServer::new();
    let lock = lock(
        "elect",
        Backend {
            zookeeper: Some(ZooKeeperBackend {
                servers: vec![format!("127.0.0.1:{}", server.port())],
                path: "/apps/team".into(),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (observation, driver) = provision(&api, &lock).await;
    ready(&observation);
    let zk = zookeeper_client::Client::connect(&format!("127.0.0.1:{}", server.port()))
        .await
        .unwrap();
    assert!(
        zk.check_stat("/apps/team/elect").await.unwrap().is_some(),
        "the lock's parent node exists"
    );
    takes(&*driver, "elect").await;
    drop(driver);
    Backends::default()
        .clean_up(&operator_client(&api), &lock)
        .await
        .unwrap();
    assert!(zk.check_stat("/apps/team/elect").await.unwrap().is_none());
    assert!(
        zk.check_stat("/apps/team").await.unwrap().is_some(),
        "the shared root stays"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_is_checked_and_its_queue_removed_on_delete() {
    let server = EtcdServer::start();
    let api = InMemoryApiServer::new();
    let lock = lock(
        "queue",
        Backend {
            etcd: Some(EtcdBackend {
                endpoints: vec![format!("127.0.0.1:{}", server.port())],
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (observation, driver) = provision(&api, &lock).await;
    ready(&observation);
    let Acquire::Acquired(held) = driver
        .try_acquire("queue", "pod-a", Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("not acquired")
    };
    // Held: the clean-up names the holder, deletes nothing and leaves no place in the queue.
    let backends = Backends::default();
    let waiting = backends
        .clean_up(&operator_client(&api), &lock)
        .await
        .unwrap();
    let Some(StillHeld::Lock(Some(holder))) = waiting else {
        panic!("{waiting:?}")
    };
    assert_eq!(holder.identity, "pod-a");
    assert!(driver.renew(&held, Duration::from_secs(30)).await.unwrap());
    assert!(driver.release(&held).await.unwrap());
    assert_eq!(
        backends
            .clean_up(&operator_client(&api), &lock)
            .await
            .unwrap(),
        None
    );
    let other = resource::open(
        &api.client(),
        &Backends::default()
            .resolve(&operator_client(&api), &lock)
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(
        other.observe("queue").await.unwrap(),
        None,
        "the holder's key is gone"
    );
}

/// The Lease is owned by no object, so that no garbage collection takes it (see
/// `a_foreground_deletion_of_a_held_lock_leaves_its_lease`); the finalizer frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_backend_gets_a_lease_no_object_owns() {
    let api = InMemoryApiServer::new();
    let lock = lock(
        "leader",
        Backend {
            kubernetes: Some(KubernetesBackend {
                lease_name: Some("leader-lease".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (observation, driver) = provision(&api, &lock).await;
    ready(&observation);
    let lease = api
        .object(LEASES, NS, "leader-lease")
        .expect("the Lease was created");
    assert!(lease["metadata"]["ownerReferences"].is_null(), "{lease}");
    takes(&*driver, &lock.name_any()).await;
    Backends::default()
        .clean_up(&operator_client(&api), &lock)
        .await
        .unwrap();
    // Freed, with its transitions kept: a lock created again continues above them.
    let lease = api
        .object(LEASES, NS, "leader-lease")
        .expect("the Lease, and its token, were deleted");
    assert!(lease["metadata"]["ownerReferences"].is_null(), "{lease}");
    assert!(lease["spec"]["holderIdentity"].is_null(), "{lease}");
    // The second transition is the clean-up's own, which took the lock to free it.
    assert_eq!(lease["spec"]["leaseTransitions"], 2, "{lease}");
}

/// A lock whose Lease exists and is held (what a new operator leader finds for every lock)
/// costs one read of the Lease: provisioning's read also tells the holder, and cutting the
/// Lease loose from an owner, where one is left, is the same write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisioning_an_existing_lease_reads_it_once_and_reports_its_holder() {
    let api = InMemoryApiServer::new();
    let lock = lease_lock("leader");
    let mut lease = owned_lease("leader", "pod-a");
    lease["metadata"]["ownerReferences"] = serde_json::Value::Null;
    lease["metadata"]["annotations"] = json!({"leasehold.dev/lock": "leader"});
    api.put(LEASES, lease);
    let gets = || {
        api.requests_by_kind()
            .get("GET leases")
            .copied()
            .unwrap_or(0)
    };
    let before = gets();
    let (_, observation) = Backends::default()
        .observe(&operator_client(&api), &lock)
        .await;
    assert_eq!(gets() - before, 1, "{:?}", api.requests_by_kind());
    match observation {
        Observation::Ready {
            holder: Some(holder),
            ..
        } => assert_eq!((holder.identity.as_str(), holder.token), ("pod-a", 7)),
        other => panic!("the holder was not reported: {other:?}"),
    }
    // Owned by its lock, as an earlier version left it: still one read, and one write.
    api.put(LEASES, owned_lease("leader", "pod-a"));
    let before = gets();
    let (_, observation) = Backends::default()
        .observe(&operator_client(&api), &lock)
        .await;
    assert_eq!(gets() - before, 1, "{:?}", api.requests_by_kind());
    assert!(matches!(
        observation,
        Observation::Ready {
            holder: Some(_),
            ..
        }
    ));
    let lease = api.object(LEASES, NS, "leader").expect("the Lease");
    assert!(lease["metadata"]["ownerReferences"].is_null(), "{lease}");
    assert_eq!(lease["spec"]["holderIdentity"], "pod-a", "{lease}");
}

/// Under `cleanupPolicy: Retain` the Lease is not owned by the lock: the garbage collector
/// deletes what a lock owns whatever its policy, and a lock created again under the same name
/// would then start its tokens afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_lease_is_not_owned_by_its_lock() {
    let api = InMemoryApiServer::new();
    let mut lock = lease_lock("retained");
    lock.spec.cleanup_policy = CleanupPolicy::Retain;
    let (observation, driver) = provision(&api, &lock).await;
    ready(&observation);
    takes(&*driver, &lock.name_any()).await;
    let lease = api
        .object(LEASES, NS, "retained")
        .expect("the Lease was created");
    assert!(
        lease["metadata"]["ownerReferences"].is_null(),
        "a retained Lease must not be garbage-collected with its lock: {lease}"
    );
}

#[tokio::test]
async fn a_missing_secret_is_an_invalid_spec_that_names_it() {
    let api = InMemoryApiServer::new();
    let lock = lock(
        "jobs",
        Backend {
            redis: Some(RedisBackend {
                endpoints: vec!["127.0.0.1:1".into()],
                password_secret_ref: Some(SecretKeyRef {
                    name: "absent".into(),
                    key: "password".into(),
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (_, observation) = Backends::default()
        .observe(&operator_client(&api), &lock)
        .await;
    let Observation::Failed { reason, message } = observation else {
        panic!("{observation:?}")
    };
    assert_eq!(reason, "InvalidSpec");
    assert!(message.contains("\"absent\""), "{message}");
}

/// A server named by a short name (`redis:6379`) is found through the search path of whoever
/// connects: the lock's pods find their namespace's Service, the operator its own namespace's.
/// A lock of another namespace than the operator's that names one is refused with the way to
/// write it, and nothing is read or sent; in the operator's own namespace the name is the same
/// for both.
#[tokio::test]
async fn a_short_server_name_in_another_namespace_is_refused_with_the_full_form() {
    let api = InMemoryApiServer::new();
    let backend = Backend {
        redis: Some(RedisBackend {
            endpoints: vec!["redis:6379".into()],
            ..Default::default()
        }),
        ..Default::default()
    };
    let elsewhere = lock("jobs", backend.clone());
    let (_, observation) = Backends::default()
        .observe(&operator_client(&api), &elsewhere)
        .await;
    let Observation::Failed { reason, message } = observation else {
        panic!("{observation:?}")
    };
    assert_eq!(reason, "InvalidSpec");
    assert!(message.contains(&format!("redis.{NS}")), "{message}");

    let own_namespace = operator_client(&api).default_namespace().to_owned();
    let mut at_home = lock("jobs", backend);
    at_home.metadata.namespace = Some(own_namespace);
    let (_, observation) = Backends::default()
        .observe(&operator_client(&api), &at_home)
        .await;
    assert!(
        !matches!(
            observation,
            Observation::Failed {
                reason: "InvalidSpec",
                ..
            }
        ),
        "{observation:?}"
    );
}

/// Whoever may create a lock must not be able to make the operator log in to a server of theirs
/// with a Secret of the namespace: the Secret's owner names the servers it may go to, and until
/// then the operator does not even connect.
#[tokio::test]
async fn a_secret_goes_only_to_servers_its_owner_allowed() {
    let api = InMemoryApiServer::new();
    // The lock's author's server: it counts the connections the operator makes to it.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let theirs = format!("127.0.0.1:{}", listener.local_addr().unwrap().port());
    for (secret_name, allowed) in [
        ("unopened", None),
        ("elsewhere", Some("redis.team.svc:6379")),
    ] {
        let password = secret_allowing(&api, secret_name, "password", "hunter2", allowed);
        let lock = lock(
            "jobs",
            Backend {
                redis: Some(RedisBackend {
                    endpoints: vec![theirs.clone()],
                    password_secret_ref: Some(password),
                    ..Default::default()
                }),
                ..Default::default()
            },
        );
        let (_, observation) = Backends::default()
            .observe(&operator_client(&api), &lock)
            .await;
        let Observation::Failed { reason, message } = observation else {
            panic!("{observation:?}")
        };
        assert_eq!(reason, "InvalidSpec");
        assert!(
            message.contains(&format!("Secret {secret_name:?}"))
                && message.contains(resource::ALLOWED_HOSTS_ANNOTATION)
                && !message.contains("hunter2"),
            "{message}"
        );
        assert!(
            listener.accept().is_err(),
            "the operator connected to a server the Secret's owner never allowed"
        );
    }
}

/// In a namespace being deleted the API server refuses new objects: a Kubernetes-backed lock
/// whose Lease does not exist yet is reported with the server's reason, and the namespace's
/// state is there to read (the clean-up gives up at once on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_being_deleted_refuses_the_lease_and_says_so() {
    let api = InMemoryApiServer::new();
    api.terminate_namespace(NS);
    let lock = lease_lock("leader");
    let (_, observation) = Backends::default()
        .observe(&operator_client(&api), &lock)
        .await;
    let Observation::Failed { message, .. } = observation else {
        panic!("a Lease was created in a namespace being deleted: {observation:?}")
    };
    assert!(message.contains("being terminated"), "{message}");
    assert!(api.object(LEASES, NS, "leader").is_none());
    let namespace = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(api.client())
        .get(NS)
        .await
        .unwrap();
    assert!(namespace.metadata.deletion_timestamp.is_some());
}

/// A Lease an earlier version made the lock's dependent is cut loose at provisioning: the
/// garbage collector deletes an owned Lease (holder and token history with it) once its lock
/// goes, before or without the finalizer's clean-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_owned_by_its_lock_is_cut_loose_at_provisioning() {
    let api = InMemoryApiServer::new();
    let lock = lease_lock("leader");
    api.put(
        leasehold_testkit::in_memory_api_server::DISTRIBUTED_LOCKS,
        serde_json::to_value(&lock).unwrap(),
    );
    api.put(LEASES, owned_lease("leader", "pod-a"));
    // The in-memory garbage collector is real enough to take such a Lease with its lock.
    let other = {
        let mut other = lock.clone();
        other.metadata.name = Some("other".into());
        other.metadata.uid = Some("uid-other".into());
        other
    };
    api.put(
        leasehold_testkit::in_memory_api_server::DISTRIBUTED_LOCKS,
        serde_json::to_value(&other).unwrap(),
    );
    let mut owned_by_other = owned_lease("other", "pod-b");
    owned_by_other["metadata"]["ownerReferences"][0]["uid"] = json!("uid-other");
    api.put(LEASES, owned_by_other);
    kube::Api::<DistributedLock>::namespaced(api.client(), NS)
        .delete("other", &Default::default())
        .await
        .unwrap();
    assert!(api.object(LEASES, NS, "other").is_none());

    let (observation, _) = provision(&api, &lock).await;
    ready(&observation);
    let lease = api.object(LEASES, NS, "leader").expect("the Lease");
    assert!(lease["metadata"]["ownerReferences"].is_null(), "{lease}");
    kube::Api::<DistributedLock>::namespaced(api.client(), NS)
        .delete("leader", &Default::default())
        .await
        .unwrap();
    let lease = api
        .object(LEASES, NS, "leader")
        .expect("the garbage collector deleted the held Lease");
    assert_eq!(lease["spec"]["holderIdentity"], "pod-a");
}

/// A Lease held by `holder` and owned by the lock `lock` (uid `uid-LOCK`), as an earlier
/// version created it.
fn owned_lease(lock: &str, holder: &str) -> serde_json::Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {
            "name": lock, "namespace": NS,
            "labels": {"app.kubernetes.io/managed-by": "leasehold"},
            "ownerReferences": [{
                "apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
                "name": lock, "uid": format!("uid-{lock}"), "controller": true,
                "blockOwnerDeletion": false
            }]
        },
        "spec": {
            "holderIdentity": holder, "leaseDurationSeconds": 30,
            "acquireTime": "2026-01-01T00:00:00.000000Z",
            "renewTime": "2030-01-01T00:00:00.000000Z",
            "leaseTransitions": 7
        }
    })
}

/// A foreground deletion (`kubectl delete --cascade=foreground`, Argo CD's prune) deletes a
/// lock's dependents while its finalizer still waits for the holder to let go: the Lease,
/// owned by nothing, stays, its holder and token with it, so that nobody else can take the
/// lock meanwhile and the next token continues above the last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreground_deletion_of_a_held_lock_leaves_its_lease() {
    let api = InMemoryApiServer::new();
    let mut lock = lease_lock("leader");
    lock.metadata.finalizers = Some(vec!["leasehold.dev/cleanup".into()]);
    api.put(
        leasehold_testkit::in_memory_api_server::DISTRIBUTED_LOCKS,
        serde_json::to_value(&lock).unwrap(),
    );
    let (observation, driver) = provision(&api, &lock).await;
    ready(&observation);
    let Acquire::Acquired(held) = driver
        .try_acquire("leader", "pod-a", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("not acquired")
    };
    kube::Api::<DistributedLock>::namespaced(api.client(), NS)
        .delete(
            "leader",
            &kube::api::DeleteParams {
                propagation_policy: Some(kube::api::PropagationPolicy::Foreground),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let lease = api
        .object(LEASES, NS, "leader")
        .expect("the foreground deletion took the held Lease");
    assert_eq!(lease["spec"]["holderIdentity"], "pod-a");
    let busy = driver
        .try_acquire("leader", "pod-b", Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        matches!(busy, Acquire::Busy(_)),
        "pod-b took the lock pod-a holds: {busy:?}"
    );
    assert!(driver.renew(&held, Duration::from_secs(60)).await.unwrap());
}

/// Redis over TLS from a `DistributedLock`: the CA and the client pair come from a Secret's PEM
/// text, and the operator provisions and observes through them (the server asks every client
/// for a certificate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_over_tls_with_its_certificates_from_a_secret() {
    let server = RedisServer::start_tls();
    let files = server.tls_files();
    let api = InMemoryApiServer::new();
    let pem = |path: &std::path::Path| std::fs::read_to_string(path).unwrap();
    api.put(
        SECRETS,
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "redis-tls", "namespace": NS,
                            "annotations": {resource::ALLOWED_HOSTS_ANNOTATION: "127.0.0.1"}},
               "stringData": {"ca.crt": pem(&files.ca), "tls.crt": pem(&files.client_cert),
                              "tls.key": pem(&files.client_key)}}),
    );
    let lock = lock(
        "cache",
        Backend {
            redis: Some(RedisBackend {
                endpoints: vec![format!("127.0.0.1:{}", server.tls_port().unwrap())],
                tls_secret_name: Some("redis-tls".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (observation, driver) = provision(&api, &lock).await;
    ready(&observation);
    takes(&*driver, "cache").await;
    let resolved = Backends::default()
        .resolve(&operator_client(&api), &lock)
        .await
        .unwrap();
    let shown = resolved.backend.to_string();
    assert!(
        shown.starts_with("rediss://") && !shown.contains("PRIVATE KEY"),
        "{shown}"
    );
}

/// PostgreSQL over TLS from a `DistributedLock`: `verify-full` against the Secret's CA, with its
/// client pair, the PEM text held in memory (no file is written: the root filesystem is
/// read-only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_with_its_certificates_from_a_secret() {
    let server = PostgresServer::start_tls();
    let files = server.tls_files();
    let api = InMemoryApiServer::new();
    let pem = |path: &std::path::Path| std::fs::read_to_string(path).unwrap();
    api.put(
        SECRETS,
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "pg-tls", "namespace": NS,
                            "annotations": {resource::ALLOWED_HOSTS_ANNOTATION: "127.0.0.1"}},
               "stringData": {"ca.crt": pem(&files.ca), "tls.crt": pem(&files.client_cert),
                              "tls.key": pem(&files.client_key)}}),
    );
    let user = secret(&api, "pg", "user", "postgres");
    let lock = lock(
        "jobs",
        Backend {
            postgres: Some(SqlBackend {
                host: "127.0.0.1".into(),
                port: Some(server.port()),
                database: "postgres".into(),
                user_secret_ref: Some(user),
                tls_secret_name: Some("pg-tls".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (observation, driver) = provision(&api, &lock).await;
    ready(&observation);
    takes(&*driver, "jobs").await;
    let shown = Backends::default()
        .resolve(&operator_client(&api), &lock)
        .await
        .unwrap()
        .backend
        .to_string();
    assert!(
        shown.contains("sslmode=verify-full") && !shown.contains("BEGIN"),
        "{shown}"
    );
}

/// Tair from a `DistributedLock`: provisioned and taken on a server with the TairString module;
/// a plain Redis behind it is reported with the missing commands named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tair_is_checked_for_its_commands() {
    let api = InMemoryApiServer::new();
    let tair_lock = |port: u16| {
        lock(
            "orders",
            Backend {
                tair: Some(leasehold_crds::TairBackend {
                    endpoint: format!("127.0.0.1:{port}"),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
    };
    let server = RedisServer::start_tair();
    let (observation, driver) = provision(&api, &tair_lock(server.port())).await;
    ready(&observation);
    takes(&*driver, "orders").await;

    let plain = RedisServer::start();
    let (_, observation) = Backends::default()
        .observe(&operator_client(&api), &tair_lock(plain.port()))
        .await;
    let Observation::Failed { reason, message } = observation else {
        panic!("a plain Redis passed for Tair: {observation:?}")
    };
    assert_eq!(reason, "BackendError");
    assert!(
        message.contains("EXSET") && message.contains("TairString"),
        "{message}"
    );
}

/// A family of keyed locks (`spec.keys`): the operator provisions what its keys share (the
/// tables) and checks the backend, but seeds no row and creates no Lease under the family's own
/// name, which no key uses; and a family has no single holder to report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_family_gets_what_its_keys_share_and_no_record_of_its_own() {
    let server = PostgresServer::start();
    let api = InMemoryApiServer::new();
    let user = secret(&api, "pg", "user", "postgres");
    let mut family = lock(
        "orders",
        Backend {
            postgres: Some(SqlBackend {
                host: "127.0.0.1".into(),
                port: Some(server.port()),
                database: "postgres".into(),
                lock_mode: SqlLockMode::RowLock,
                user_secret_ref: Some(user),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    family.spec.cleanup_policy = CleanupPolicy::Retain;
    family.spec.keys = Some(leasehold_crds::KeysSpec::default());
    let (observation, driver) = provision(&api, &family).await;
    assert!(ready(&observation).is_empty());
    let pool = sqlx::PgPool::connect(&server.url()).await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM leasehold_locks_rows")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "a row was seeded under the family's name");
    // A key held: still no holder for the family as a whole.
    let Acquire::Acquired(_held) = driver
        .try_acquire("orders.keys.sku-1", "pod-a/w1", Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("the key is not free");
    };
    let (_, observation) = Backends::default()
        .observe(&operator_client(&api), &family)
        .await;
    assert!(
        matches!(observation, Observation::Ready { holder: None, .. }),
        "{observation:?}"
    );

    let mut leases = lease_lock("jobs");
    leases.spec.cleanup_policy = CleanupPolicy::Retain;
    leases.spec.keys = Some(leasehold_crds::KeysSpec::default());
    let (observation, _) = provision(&api, &leases).await;
    ready(&observation);
    assert!(
        api.object(LEASES, NS, "jobs").is_none(),
        "a Lease was made for the family's own name"
    );
}

/// `cleanupPolicy: Delete` on a family on the Kubernetes Lease: the clean-up waits while a key
/// is held and names how many are, then deletes every key's Lease and keeps the family's floor
/// Lease, at least every deleted key's token: a family created again continues above them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_family_loses_its_keys_leases_on_delete_and_keeps_its_floor() {
    let api = InMemoryApiServer::new();
    let mut family = lease_lock("orders");
    family.spec.keys = Some(leasehold_crds::KeysSpec::default());
    let (observation, driver) = provision(&api, &family).await;
    ready(&observation);
    let take = async |key: &str| match driver
        .try_acquire(key, "pod-a/w1", Duration::from_secs(30))
        .await
        .unwrap()
    {
        Acquire::Acquired(lease) => lease,
        busy => panic!("{key} is not free: {busy:?}"),
    };
    // Each key taken twice (tokens 1 and 2), and sku-3 held at the end.
    let mut highest = 0;
    for key in [
        "orders.keys.sku-1",
        "orders.keys.sku-2",
        "orders.keys.sku-3",
    ] {
        let lease = take(key).await;
        assert!(driver.release(&lease).await.unwrap());
        highest = highest.max(lease.token);
    }
    for key in ["orders.keys.sku-1", "orders.keys.sku-2"] {
        let lease = take(key).await;
        assert!(driver.release(&lease).await.unwrap());
        highest = highest.max(lease.token);
    }
    let held = take("orders.keys.sku-3").await;
    highest = highest.max(held.token);
    let backends = Backends::default();
    let waiting = backends
        .clean_up(&operator_client(&api), &family)
        .await
        .unwrap();
    assert_eq!(waiting, Some(StillHeld::Keys(1)));
    for key in [
        "orders.keys.sku-1",
        "orders.keys.sku-2",
        "orders.keys.sku-3",
    ] {
        assert!(
            api.object(LEASES, NS, key).is_some(),
            "{key}'s Lease went while a key was held"
        );
    }
    assert!(driver.release(&held).await.unwrap());
    assert_eq!(
        backends
            .clean_up(&operator_client(&api), &family)
            .await
            .unwrap(),
        None
    );
    for key in [
        "orders.keys.sku-1",
        "orders.keys.sku-2",
        "orders.keys.sku-3",
    ] {
        assert!(
            api.object(LEASES, NS, key).is_none(),
            "{key}'s Lease is left after the family's clean-up"
        );
    }
    let floor = api
        .object(
            LEASES,
            NS,
            &leasehold_lease::kubernetes::floor_lease("orders"),
        )
        .expect("the family's floor Lease");
    let transitions = floor["spec"]["leaseTransitions"].as_u64().unwrap_or(0);
    assert!(
        transitions >= highest,
        "the floor {transitions} is below the deleted keys' token {highest}: {floor}"
    );
}

/// Locks on one backend share one driver (one connection pool, one ZooKeeper session, not one
/// per lock), and one read of the Secret they name serves them all for a while; a lock on
/// another backend gets a driver of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_on_one_backend_share_a_driver_and_one_read_of_their_secret() {
    let server = RedisServer::start();
    {
        use std::io::{BufRead, Write};
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        conn.write_all(
            b"*4\r\n$6\r\nCONFIG\r\n$3\r\nSET\r\n$11\r\nrequirepass\r\n$6\r\ns3cret\r\n",
        )
        .unwrap();
        let mut reply = String::new();
        std::io::BufReader::new(conn).read_line(&mut reply).unwrap();
        assert_eq!(reply.trim_end(), "+OK");
    }
    let api = InMemoryApiServer::new();
    let password = secret(&api, "redis-auth", "password", "s3cret");
    let on = |name: &str, port: u16, password: Option<SecretKeyRef>| {
        lock(
            name,
            Backend {
                redis: Some(RedisBackend {
                    endpoints: vec![format!("127.0.0.1:{port}")],
                    password_secret_ref: password,
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
    };
    let backends = Backends::default();
    let operator = operator_client(&api);
    let before = api.requests();
    for name in ["a", "b", "c"] {
        let (_, observation) = backends
            .observe(&operator, &on(name, server.port(), Some(password.clone())))
            .await;
        ready(&observation);
    }
    assert_eq!(
        api.requests() - before,
        1,
        "three locks naming one Secret read it more than once"
    );
    assert_eq!(backends.drivers_open(), 1, "three locks on one Redis");
    let other = RedisServer::start();
    let (_, observation) = backends
        .observe(&operator, &on("d", other.port(), None))
        .await;
    ready(&observation);
    assert_eq!(backends.drivers_open(), 2, "a lock on another Redis");
}

/// A Secret the API server will not give (refused here; throttled or timed out likewise) is the
/// API server's trouble, not the backend's: the condition says so with a reason of its own.
#[tokio::test]
async fn a_secret_the_api_server_will_not_give_is_not_called_a_backend_fault() {
    let server = RedisServer::start();
    let api = InMemoryApiServer::new();
    let password = secret(&api, "redis-auth", "password", "s3cret");
    let lock = lock(
        "jobs",
        Backend {
            redis: Some(RedisBackend {
                endpoints: vec![format!("127.0.0.1:{}", server.port())],
                password_secret_ref: Some(password),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let (_, observation) = Backends::default()
        .observe(&api.client_as("nobody"), &lock)
        .await;
    let Observation::Failed { reason, message } = observation else {
        panic!("read a Secret it may not: {observation:?}")
    };
    assert_eq!(reason, "SecretUnreadable", "{message}");
    assert!(message.contains("redis-auth"), "{message}");
}

/// Locks whose first reconciles come together (a restart) open one driver for their backend,
/// not one each; on ZooKeeper, whose session lasts a lease, locks of another lease get another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_reconciled_together_open_one_driver_per_backend_and_zookeeper_lease() {
    let server = ZooKeeperServer::start();
    let api = InMemoryApiServer::new();
    let on_zookeeper = |name: &str, lease: u64| {
        let mut lock = lock(
            name,
            Backend {
                zookeeper: Some(ZooKeeperBackend {
                    servers: vec![format!("127.0.0.1:{}", server.port())],
                    path: "/apps/team".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
        );
        lock.spec.lease_duration = format!("{lease}s");
        lock
    };
    let backends = std::sync::Arc::new(Backends::default());
    let operator = operator_client(&api);
    let observing: Vec<_> = (0..6)
        .map(|i| {
            let (backends, operator) = (backends.clone(), operator.clone());
            let lock = on_zookeeper(&format!("lock-{i}"), if i < 4 { 15 } else { 30 });
            tokio::spawn(async move { backends.observe(&operator, &lock).await.1 })
        })
        .collect();
    for observing in observing {
        ready(&observing.await.unwrap());
    }
    assert_eq!(
        backends.drivers_open(),
        2,
        "six locks on one ensemble, of two leases"
    );
}

/// A backend that cannot be reached costs its first lock the open's timeout; the locks behind
/// it are told at once for a few seconds, rather than each holding a reconcile slot as long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_cannot_be_opened_fails_its_other_locks_at_once() {
    let server = ZooKeeperServer::start();
    let proxy = leasehold_testkit::FaultProxy::start(server.port());
    proxy.cut();
    let api = InMemoryApiServer::new();
    let on_zookeeper = |name: &str| {
        lock(
            name,
            Backend {
                zookeeper: Some(ZooKeeperBackend {
                    servers: vec![format!("127.0.0.1:{}", proxy.port)],
                    path: "/apps/team".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
    };
    let backends = Backends::default();
    let operator = operator_client(&api);
    let started = std::time::Instant::now();
    let (_, first) = backends.observe(&operator, &on_zookeeper("a")).await;
    let first_took = started.elapsed();
    let Observation::Failed { message, .. } = first else {
        panic!("opened through a cut link: {first:?}")
    };
    let started = std::time::Instant::now();
    let (_, second) = backends.observe(&operator, &on_zookeeper("b")).await;
    let second_took = started.elapsed();
    let Observation::Failed { message: again, .. } = second else {
        panic!("opened through a cut link: {second:?}")
    };
    assert_eq!(again, message);
    assert!(
        second_took < first_took / 4,
        "the second lock waited {second_took:?}, the first {first_took:?}"
    );
}
