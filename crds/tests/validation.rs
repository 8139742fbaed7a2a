//! The CRD: committed YAML matches the code, and its CEL rules, evaluated offline with the
//! same rule text the API server runs, accept good locks and reject bad ones with a clear message.

use leasehold_crds::{Backend, DistributedLock, RedisBackend, crd_yaml};
use serde_json::{Value, json};

const COMMITTED: &str = include_str!("../distributedlock.yaml");

fn schema() -> Value {
    let crd: Value = serde_yaml::from_str(COMMITTED).expect("committed CRD parses");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

fn lock(spec: Value) -> Value {
    json!({
        "apiVersion": "leasehold.dev/v1alpha1",
        "kind": "DistributedLock",
        "metadata": { "name": "jobs", "namespace": "default" },
        "spec": spec,
    })
}

/// The messages of the rules that reject `spec` (empty: accepted).
fn violations(spec: Value) -> Vec<String> {
    object_violations(&lock(spec), None)
}

/// The messages of the rules that reject `object`, as an update of `old` when given.
fn object_violations(object: &Value, old: Option<&Value>) -> Vec<String> {
    match kube_cel::Validator::new().validate(&schema(), object, old) {
        Ok(()) => Vec::new(),
        Err(errors) => errors
            .into_vec()
            .into_iter()
            .map(|e| e.to_string())
            .collect(),
    }
}

fn redis() -> Value {
    json!({ "redis": { "endpoints": ["redis:6379"] } })
}

#[test]
fn committed_crd_is_up_to_date() {
    assert!(
        COMMITTED == crd_yaml(),
        "crds/distributedlock.yaml is stale: run `cargo run -p leasehold-crds --bin crdgen > crds/distributedlock.yaml`"
    );
}

/// Server-side apply merges `status.conditions` by `type` only when the schema says so:
/// otherwise the operator's apply of its conditions replaces the whole list, wiping another
/// writer's.
#[test]
fn conditions_are_a_map_keyed_by_type() {
    let conditions = &schema()["properties"]["status"]["properties"]["conditions"];
    assert_eq!(conditions["x-kubernetes-list-type"], "map", "{conditions}");
    assert_eq!(conditions["x-kubernetes-list-map-keys"], json!(["type"]));
    let required = conditions["items"]["required"].as_array().unwrap();
    assert!(
        required.contains(&json!("type")),
        "a map key must be required"
    );
}

#[test]
fn good_locks_pass() {
    let good = [
        json!({ "backend": redis() }),
        json!({ "backend": redis(), "holderLabel": true }),
        json!({ "backend": redis(), "holderLabel": false, "keys": {} }),
        json!({ "backend": { "redis": { "endpoints": ["a:6379", "b:6379", "c:6379"],
            "passwordSecretRef": { "name": "redis", "key": "password" } } } }),
        json!({ "backend": { "redis": { "endpoints": ["sentinel-0:26379", "sentinel-1"],
            "sentinel": { "masterName": "locks", "minReplicas": 2 } } } }),
        json!({ "backend": { "redis": { "endpoints": ["node-0:6379", "node-1:6379"],
            "cluster": true } } }),
        json!({ "backend": { "redis": { "endpoints": ["node-0:6379"], "cluster": true,
            "database": 0 } } }),
        json!({ "backend": { "postgres": { "host": "db", "database": "app", "table": "locks",
            "schema": "public", "lockMode": "RowLock" } }, "mode": "OnDemand" }),
        json!({ "backend": { "mysql": { "host": "db", "database": "app" } } }),
        json!({ "backend": { "zookeeper": { "servers": ["zk:2181"], "path": "/leasehold/locks" } } }),
        json!({ "backend": { "etcd": { "endpoints": ["etcd:2379"] } } }),
        json!({ "backend": { "tair": { "endpoint": "tair:6379", "keyPrefix": "orders" } } }),
        json!({ "backend": { "kubernetes": { "leaseName": "jobs.lock" } } }),
        json!({ "backend": { "kubernetes": {} }, "leaseDuration": "1m30s", "renewInterval": "20s" }),
        json!({ "backend": redis(), "leaseDuration": "1s", "renewInterval": "500ms" }),
        json!({ "backend": redis(), "keys": {} }),
        json!({ "backend": redis(), "keys": {}, "permits": 8 }),
        json!({ "backend": redis(), "keys": { "readWrite": true }, "permits": 16 }),
        json!({ "backend": redis(), "keys": { "readWrite": false }, "permits": 256 }),
        json!({ "backend": redis(), "permits": 1 }),
        json!({ "backend": redis(), "permits": 3, "holderLabel": true }),
        json!({ "backend": { "kubernetes": { "leaseName": "workers" } }, "permits": 3 }),
        json!({ "backend": { "kubernetes": { "yieldToPreferredHolder": true } }, "permits": 1 }),
        json!({ "backend": redis(), "keys": { "maxKeyLength": 64, "maxHeldPerPod": 10000 },
            "cleanupPolicy": "Retain" }),
    ];
    for spec in good {
        assert_eq!(violations(spec.clone()), Vec::<String>::new(), "{spec}");
    }
}

#[test]
fn bad_locks_are_rejected_with_a_reason() {
    let bad = [
        (json!({ "backend": {} }), "set exactly one backend"),
        (
            json!({ "backend": { "redis": { "endpoints": ["a:1", "b:1"] } } }),
            "give one endpoint for a single Redis, or three or more independent masters for Redlock",
        ),
        (
            json!({ "backend": { "redis": { "endpoints": ["n:6379"], "cluster": true,
                "sentinel": { "masterName": "locks" } } } }),
            "cluster and sentinel exclude each other",
        ),
        (
            json!({ "backend": { "redis": { "endpoints": ["n:6379"], "cluster": true,
                "database": 2 } } }),
            "a Redis Cluster has only database 0",
        ),
        (
            json!({ "backend": { "redis": { "endpoints": ["s:26379"],
                "sentinel": { "masterName": "locks; FLUSHALL" } } } }),
            "masterName: letters, digits",
        ),
        (
            json!({ "backend": { "redis": { "endpoints": ["r:1"] }, "kubernetes": {} } }),
            "set exactly one backend",
        ),
        (
            json!({ "backend": redis(), "holderLabel": true, "keys": {} }),
            "a family of keyed locks has a holder per key",
        ),
        (
            json!({ "backend": { "kubernetes": { "yieldToPreferredHolder": true } }, "permits": 2 }),
            "Kubernetes' coordinated leader election (yieldToPreferredHolder) names one",
        ),
        (
            json!({ "backend": redis(), "keys": { "readWrite": true }, "permits": 17 }),
            "a read-write family's key has at most 16 permits",
        ),
        (
            json!({ "backend": redis(), "leaseDuration": "10s", "renewInterval": "10s" }),
            "renewInterval must be shorter than leaseDuration",
        ),
        (
            json!({ "backend": redis(), "renewInterval": "20s" }),
            "renewInterval must be shorter than leaseDuration",
        ),
        (
            json!({ "backend": redis(), "leaseDuration": "500ms", "renewInterval": "100ms" }),
            "leaseDuration must be between 1s and 24h",
        ),
        (
            json!({ "backend": redis(), "leaseDuration": "48h" }),
            "leaseDuration must be between 1s and 24h",
        ),
        (
            json!({ "backend": redis(), "renewInterval": "0s" }),
            "renewInterval must be above zero",
        ),
        (
            json!({ "backend": { "redis": { "endpoints": ["a:1", "b:1"] } } }),
            "three or more independent masters",
        ),
        (
            json!({ "backend": { "redis": { "endpoints": ["a:1"], "keyPrefix": "a:b" } } }),
            "keyPrefix",
        ),
        (
            json!({ "backend": { "postgres": { "host": "db", "database": "app",
                "table": "locks; DROP TABLE users" } } }),
            "table must be a plain SQL identifier",
        ),
        (
            json!({ "backend": { "mysql": { "host": "db", "database": "app", "table": "1locks" } } }),
            "table must be a plain SQL identifier",
        ),
        (
            json!({ "backend": { "postgres": { "host": "db", "database": "app", "schema": "a.b" } } }),
            "schema must be a plain SQL identifier",
        ),
        (
            json!({ "backend": { "sqlite": { "path": "/var/lib/leasehold/locks.db" } } }),
            "SQLite is not supported in a cluster",
        ),
        (
            json!({ "backend": { "zookeeper": { "servers": ["zk:2181"], "path": "/a/../b" } } }),
            "path must be absolute",
        ),
        (
            json!({ "backend": { "zookeeper": { "servers": ["zk:2181"], "path": "/zookeeper/x" } } }),
            "path must be absolute",
        ),
        (
            json!({ "backend": { "zookeeper": { "servers": ["zk:2181"], "path": "locks" } } }),
            "path must be absolute",
        ),
        (
            json!({ "backend": { "kubernetes": { "leaseName": "Not_A_Name" } } }),
            "leaseName must be a DNS subdomain name",
        ),
    ];
    for (spec, reason) in bad {
        let found = violations(spec.clone());
        assert!(
            found.iter().any(|m| m.contains(reason)),
            "{spec} should be rejected with {reason:?}, got {found:?}"
        );
    }
}

#[test]
fn defaults_are_those_of_the_design() {
    let parsed: DistributedLock =
        serde_json::from_value(lock(json!({ "backend": redis() }))).unwrap();
    assert_eq!(parsed.spec.lease_duration, "15s");
    assert_eq!(parsed.spec.renew_interval, None, "a third of the lease");
    assert_eq!(parsed.spec.mode, leasehold_crds::LockMode::Campaign);
    assert_eq!(
        parsed.spec.cleanup_policy,
        leasehold_crds::CleanupPolicy::Retain
    );
    let spec = &schema()["properties"]["spec"]["properties"];
    assert_eq!(spec["leaseDuration"]["default"], "15s");
    assert!(spec["renewInterval"]["default"].is_null());
}

/// The schema's defaults filled in, as the API server does before it runs the CEL rules.
fn with_defaults(schema: &Value, value: &mut Value) {
    let Some(object) = value.as_object_mut() else {
        return;
    };
    let Some(properties) = schema["properties"].as_object() else {
        return;
    };
    for (name, property) in properties {
        if let Some(default) = property.get("default")
            && !object.contains_key(name)
        {
            object.insert(name.clone(), default.clone());
        }
        if let Some(child) = object.get_mut(name) {
            with_defaults(property, child);
        }
    }
}

/// Short and long leases without a renewInterval pass once the API server has applied the
/// defaults (a fixed 5 s default refused 3 s and 5 s leases, and renewed a 24 h lease every 5 s);
/// the sidecar then renews every third of the lease.
#[test]
fn leases_without_a_renew_interval_pass_with_the_defaults_applied() {
    let schema = schema();
    for lease in ["1s", "3s", "5s", "24h"] {
        let mut object = lock(json!({ "backend": redis(), "leaseDuration": lease }));
        with_defaults(&schema, &mut object);
        assert_eq!(
            object_violations(&object, None),
            Vec::<String>::new(),
            "leaseDuration {lease}"
        );
        let parsed: DistributedLock = serde_json::from_value(object).unwrap();
        assert_eq!(parsed.spec.renew_interval, None);
    }
    // Defaults do not hide a bad explicit value.
    let mut object =
        lock(json!({ "backend": redis(), "leaseDuration": "3s", "renewInterval": "5s" }));
    with_defaults(&schema, &mut object);
    assert!(
        kube_cel::Validator::new()
            .validate(&schema, &object, None)
            .is_err()
    );
}

/// Credentials appear only as references to Secrets, never as values in the resource.
#[test]
fn secrets_are_referenced_never_inline() {
    fn walk(path: &str, schema: &Value, found: &mut Vec<String>) {
        if let Some(props) = schema["properties"].as_object() {
            for (name, sub) in props {
                let lower = name.to_lowercase();
                let sensitive = [
                    "password",
                    "username",
                    "secret",
                    "credential",
                    "auth",
                    "key",
                ]
                .iter()
                .any(|w| lower.contains(w));
                let is_ref = name.ends_with("SecretRef")
                    && sub["properties"]["name"].is_object()
                    && sub["properties"]["key"].is_object();
                let is_name = name.ends_with("SecretName") && sub["type"] == "string";
                // A keyed family's bounds and its count of held keys, not key material.
                let allowed = ["keyPrefix", "key", "keys", "maxKeyLength", "heldKeys"];
                if sensitive && !is_ref && !is_name && !allowed.contains(&name.as_str()) {
                    found.push(format!("{path}.{name}"));
                }
                walk(&format!("{path}.{name}"), sub, found);
            }
        }
        if schema["items"].is_object() {
            walk(&format!("{path}[]"), &schema["items"], found);
        }
    }
    let mut found = Vec::new();
    walk("", &schema(), &mut found);
    assert!(found.is_empty(), "inline secret-like fields: {found:?}");
}

#[test]
fn printer_columns_for_kubectl_get() {
    let crd: Value = serde_yaml::from_str(COMMITTED).unwrap();
    let names: Vec<&str> = crd["spec"]["versions"][0]["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    for column in [
        "Backend",
        "Holder",
        "Token",
        "Held keys",
        "Held permits",
        "Age",
    ] {
        assert!(names.contains(&column), "{column} missing from {names:?}");
    }
    assert_eq!(crd["spec"]["names"]["shortNames"][0], "dlock");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(crd["spec"]["group"], "leasehold.dev");
    assert_eq!(
        crd["spec"]["versions"][0]["subresources"]["status"],
        json!({})
    );
}

#[test]
fn backend_kind() {
    let single = Backend {
        redis: Some(RedisBackend {
            endpoints: vec!["r:1".into()],
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(single.kind(), Some("redis"));
    let redlock = Backend {
        redis: Some(RedisBackend {
            endpoints: vec!["a:1".into(), "b:1".into(), "c:1".into()],
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(redlock.kind(), Some("redlock"));
    let sentinel = Backend {
        redis: Some(RedisBackend {
            endpoints: vec!["a:1".into(), "b:1".into(), "c:1".into()],
            sentinel: Some(leasehold_crds::RedisSentinel {
                master_name: "locks".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(sentinel.kind(), Some("redis-sentinel"));
    // minReplicas's range is a plain schema limit, which the API server checks before any rule.
    let min_replicas = &schema()["properties"]["spec"]["properties"]["backend"]["properties"]["redis"]
        ["properties"]["sentinel"]["properties"]["minReplicas"];
    assert_eq!(min_replicas["minimum"].as_f64(), Some(0.0));
    assert_eq!(min_replicas["maximum"].as_f64(), Some(16.0));
    assert_eq!(Backend::default().kind(), None);
    let two = Backend {
        kubernetes: Some(Default::default()),
        ..single
    };
    assert_eq!(two.kind(), None);
}

/// A transition rule, as the API server runs it on an update: the backend's location cannot
/// change, since a holder that has not yet seen the edit would keep claiming on the old one
/// while others start on the new one; its credentials may (a Secret renamed by External Secrets
/// or a kustomize hash), and everything outside the backend may.
#[test]
fn the_backends_location_cannot_change_once_created_but_its_credentials_may() {
    let update = |old: Value, new: Value| object_violations(&lock(new), Some(&lock(old)));
    let spec =
        |backend: Value| json!({"backend": backend, "leaseDuration": "15s", "renewInterval": "5s"});
    let refused = |old: Value, new: Value| {
        let errors = update(spec(old.clone()), spec(new.clone()));
        assert!(
            errors.iter().any(|e| e.contains("location is immutable")),
            "{old} -> {new}: {errors:?}"
        );
    };
    let allowed = |old: Value, new: Value| {
        assert_eq!(
            update(spec(old.clone()), spec(new.clone())),
            Vec::<String>::new(),
            "{old} -> {new}"
        );
    };
    let redis = json!({"redis": {"endpoints": ["redis:6379"],
        "passwordSecretRef": {"name": "redis-auth-1", "key": "password"}}});

    // A Lease: its name is its place; whether holders yield to a preferred one is not.
    refused(
        json!({"kubernetes": {}}),
        json!({"kubernetes": {"leaseName": "other"}}),
    );
    allowed(
        json!({"kubernetes": {"leaseName": "jobs"}}),
        json!({"kubernetes": {"leaseName": "jobs", "yieldToPreferredHolder": true}}),
    );

    // Moves: another endpoint, database, prefix, TLS, kind.
    refused(
        redis.clone(),
        json!({"redis": {"endpoints": ["other-redis:6379"]}}),
    );
    let mut database = redis.clone();
    database["redis"]["database"] = json!(2);
    refused(redis.clone(), database);
    let mut prefix = redis.clone();
    prefix["redis"]["keyPrefix"] = json!("other");
    refused(redis.clone(), prefix);
    let mut tls = redis.clone();
    tls["redis"]["tls"] = json!(true);
    refused(redis.clone(), tls);
    refused(redis.clone(), json!({"etcd": {"endpoints": ["etcd:2379"]}}));
    let sentinel = |master: &str| {
        json!({"redis": {"endpoints": ["s1:26379", "s2:26379", "s3:26379"],
                         "sentinel": {"masterName": master}}})
    };
    refused(sentinel("locks"), sentinel("other"));
    let pg = |host: &str, secret: &str| {
        json!({"postgres": {"host": host, "database": "app", "schema": "locks",
                            "userSecretRef": {"name": secret, "key": "user"},
                            "passwordSecretRef": {"name": secret, "key": "password"}}})
    };
    refused(pg("pg-1", "pg-auth"), pg("pg-2", "pg-auth"));
    // Without a schema, the user's search_path finds the table: the user is part of the place.
    let unqualified = |secret: &str| {
        let mut lock = pg("pg-1", secret);
        lock["postgres"].as_object_mut().unwrap().remove("schema");
        lock
    };
    refused(unqualified("pg-auth-1"), unqualified("pg-auth-2"));
    let mut password_only = unqualified("pg-auth-1");
    password_only["postgres"]["passwordSecretRef"]["name"] = json!("pg-password-2");
    allowed(unqualified("pg-auth-1"), password_only);

    // Credentials: a renamed Secret, a password added, the TLS material's Secret renamed.
    let mut renamed = redis.clone();
    renamed["redis"]["passwordSecretRef"]["name"] = json!("redis-auth-2");
    allowed(redis.clone(), renamed);
    let mut with_user = redis.clone();
    with_user["redis"]["usernameSecretRef"] = json!({"name": "redis-auth-2", "key": "user"});
    allowed(redis.clone(), with_user);
    allowed(pg("pg-1", "pg-auth-1"), pg("pg-1", "pg-auth-2"));
    let etcd =
        |secret: &str| json!({"etcd": {"endpoints": ["etcd:2379"], "tlsSecretName": secret}});
    allowed(etcd("etcd-tls-1"), etcd("etcd-tls-2"));

    // Outside the backend, anything.
    let longer = json!({"backend": redis.clone(), "leaseDuration": "30s", "renewInterval": "10s"});
    assert_eq!(update(spec(redis.clone()), longer), Vec::<String>::new());
    // A new lock has no old self: any backend.
    assert_eq!(violations(spec(redis)), Vec::<String>::new());
}

/// A family of keyed locks: bounds in range, deleted with its records on every backend, and a
/// lock cannot become a family or back (their records differ).
#[test]
fn a_family_of_keyed_locks_is_checked() {
    // Delete on every backend: a family's tokens outlive its keys' records (a counter or floor
    // per family, revisions, zxids; on Redis Cluster and Tair, records that expire and counters
    // that start again at the clock).
    for backend in [
        redis(),
        json!({ "postgres": { "host": "db", "database": "app" } }),
        json!({ "etcd": { "endpoints": ["etcd:2379"] } }),
        json!({ "redis": { "endpoints": ["node-0:6379"], "cluster": false } }),
        json!({ "redis": { "endpoints": ["node-0:6379"], "cluster": true } }),
        json!({ "tair": { "endpoint": "tair:6379" } }),
        json!({ "kubernetes": {} }),
    ] {
        let spec = json!({ "backend": backend, "keys": {}, "cleanupPolicy": "Delete" });
        assert_eq!(violations(spec.clone()), Vec::<String>::new(), "{spec}");
    }
    let update = |old: Value, new: Value| object_violations(&lock(new), Some(&lock(old)));
    let plain = json!({ "backend": redis() });
    let family = json!({ "backend": redis(), "keys": { "maxHeldPerPod": 5 } });
    for (old, new) in [(plain.clone(), family.clone()), (family.clone(), plain)] {
        let errors = update(old, new);
        assert!(
            errors
                .iter()
                .any(|e| e.contains("keys cannot be added or removed")),
            "{errors:?}"
        );
    }
    let wider = json!({ "backend": redis(), "keys": { "maxHeldPerPod": 50 } });
    assert_eq!(update(family.clone(), wider), Vec::<String>::new());
    // Read-write may be turned on, never off: owners of a family that is not read-write never
    // look at a writer's gate.
    let read_write = json!({ "backend": redis(), "keys": { "readWrite": true }, "permits": 2 });
    assert_eq!(
        update(family.clone(), read_write.clone()),
        Vec::<String>::new()
    );
    for off in [
        json!({ "backend": redis(), "keys": { "readWrite": false }, "permits": 2 }),
        json!({ "backend": redis(), "keys": {}, "permits": 4 }),
    ] {
        let errors = update(read_write.clone(), off);
        assert!(
            errors
                .iter()
                .any(|e| e.contains("keys.readWrite cannot be turned off")),
            "{errors:?}"
        );
    }
    let more_readers = json!({ "backend": redis(), "keys": { "readWrite": true }, "permits": 8 });
    assert_eq!(update(read_write, more_readers), Vec::<String>::new());
    // The bounds' ranges are plain schema limits, which the API server checks before any rule.
    let keys = &schema()["properties"]["spec"]["properties"]["keys"]["properties"];
    for (field, min, max) in [("maxKeyLength", 1, 1024), ("maxHeldPerPod", 1, 1_000_000)] {
        assert_eq!(keys[field]["minimum"].as_f64(), Some(min as f64), "{field}");
        assert_eq!(keys[field]["maximum"].as_f64(), Some(max as f64), "{field}");
    }
    let permits = &schema()["properties"]["spec"]["properties"]["permits"];
    assert_eq!(permits["minimum"].as_f64(), Some(1.0), "{permits}");
    assert_eq!(permits["maximum"].as_f64(), Some(256.0), "{permits}");
}
