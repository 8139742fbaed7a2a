#![forbid(unsafe_code)]
// kube's `printcolumn(...)` is repeated once per column, with the same argument names;
// clippy reads that as duplicated attributes.
#![allow(clippy::duplicated_attributes)]
//! The `DistributedLock` custom resource (group `leasehold.dev`, version `v1alpha1`): a lock and
//! its backend. Validation lives in the schema as CEL rules, so the API server rejects a bad
//! lock at `kubectl apply`; `tests/validation.rs` evaluates the same rules offline.
//!
//! Secrets are only ever referenced (`*SecretRef`), never inline, so nothing secret is stored in
//! the resource, its status or its events.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "leasehold.dev";
pub const VERSION: &str = "v1alpha1";
pub const DEFAULT_LEASE_DURATION: &str = "15s";
pub const DEFAULT_TABLE: &str = "leasehold_locks";
/// The condition the operator sets on every lock.
pub const CONDITION_BACKEND_READY: &str = "BackendReady";
/// The condition of a lock being deleted with `cleanupPolicy: Delete`: `False` while its
/// records cannot be removed yet, with why (`HolderAlive`, `CleanupFailed`, `GaveUp`).
pub const CONDITION_CLEANED_UP: &str = "CleanedUp";

/// A Go-style duration, as Kubernetes CEL's `duration()` reads it: `15s`, `500ms`, `1m30s`.
const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$";

/// A lock that pods take through the Leasehold sidecar.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "leasehold.dev",
    version = "v1alpha1",
    kind = "DistributedLock",
    plural = "distributedlocks",
    shortname = "dlock",
    category = "leasehold",
    namespaced,
    status = "DistributedLockStatus",
    printcolumn(name = "Backend", type_ = "string", json_path = ".status.backend"),
    printcolumn(name = "Holder", type_ = "string", json_path = ".status.holder"),
    printcolumn(name = "Token", type_ = "integer", json_path = ".status.fencingToken"),
    printcolumn(name = "Held keys", type_ = "integer", json_path = ".status.heldKeys"),
    printcolumn(
        name = "Held permits",
        type_ = "integer",
        json_path = ".status.heldPermits"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"BackendReady\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new(
    "!has(self.renewInterval) || duration(self.renewInterval) < duration(self.leaseDuration)"
).message("renewInterval must be shorter than leaseDuration"))]
#[x_kube(validation = Rule::new("!has(self.holderLabel) || !self.holderLabel || !has(self.keys)").message(
    "holderLabel marks the pod that holds a lock; a family of keyed locks has a holder per key"
))]
#[x_kube(validation = Rule::new(
    "!has(self.permits) || self.permits == 1 || has(self.keys) || !has(self.backend.kubernetes) || !has(self.backend.kubernetes.yieldToPreferredHolder) || !self.backend.kubernetes.yieldToPreferredHolder"
).message(
    "a lock of several permits has several holders, and Kubernetes' coordinated leader election (yieldToPreferredHolder) names one"
))]
#[x_kube(validation = Rule::new(
    "!has(self.keys) || !has(self.keys.readWrite) || !self.keys.readWrite || !has(self.permits) || self.permits <= 16"
).message(
    "a read-write family's key has at most 16 permits: a writer probes each permit it does not take"
))]
#[x_kube(validation = Rule::new("has(self.keys) == has(oldSelf.keys)").message(
    "keys cannot be added or removed: a lock and a family of keyed locks keep different records; create a new DistributedLock instead"
))]
#[x_kube(validation = Rule::new(
    "!has(oldSelf.keys) || !has(oldSelf.keys.readWrite) || !oldSelf.keys.readWrite || (has(self.keys) && has(self.keys.readWrite) && self.keys.readWrite)"
).message(
    "keys.readWrite cannot be turned off: a writer holds its key alone through a gate that owners of a family that is not read-write never look at, so they would take the key beside it; create a new DistributedLock instead"
))]
#[serde(rename_all = "camelCase")]
pub struct DistributedLockSpec {
    /// Where the lock lives: exactly one backend. Its location cannot change (the kind, the
    /// endpoints or host, database, table, schema, mode, key prefix or path, the Lease's name,
    /// TLS on or off): a holder that has not yet seen the change would keep claiming on the old
    /// backend while others start afresh on the new one (two holders, and tokens starting
    /// again). Credentials may change (the Secrets named for users, passwords and TLS
    /// material): running sidecars pick them up and hand over as for any other change. On
    /// PostgreSQL without `schema`, the user is part of the location: the table is found through
    /// the user's `search_path`, which another user may resolve to another schema. To move
    /// a lock, stop its pods (or remove their annotation), delete the lock, and create it again
    /// on the new backend.
    #[x_kube(validation = Rule::new(concat!(
        "has(self.redis) == has(oldSelf.redis) && ",
        "has(self.tair) == has(oldSelf.tair) && ",
        "has(self.postgres) == has(oldSelf.postgres) && ",
        "has(self.mysql) == has(oldSelf.mysql) && ",
        "has(self.sqlite) == has(oldSelf.sqlite) && ",
        "has(self.zookeeper) == has(oldSelf.zookeeper) && ",
        "has(self.etcd) == has(oldSelf.etcd) && ",
        "has(self.kubernetes) == has(oldSelf.kubernetes) && ",
        "(!has(self.redis) || (self.redis.endpoints == oldSelf.redis.endpoints && ",
        "has(self.redis.cluster) == has(oldSelf.redis.cluster) && ",
        "(!has(self.redis.cluster) || self.redis.cluster == oldSelf.redis.cluster) && ",
        "has(self.redis.database) == has(oldSelf.redis.database) && ",
        "(!has(self.redis.database) || self.redis.database == oldSelf.redis.database) && ",
        "has(self.redis.keyPrefix) == has(oldSelf.redis.keyPrefix) && ",
        "(!has(self.redis.keyPrefix) || self.redis.keyPrefix == oldSelf.redis.keyPrefix) && ",
        "((has(self.redis.tls) && ",
        "self.redis.tls) || has(self.redis.tlsSecretName)) == ((has(oldSelf.redis.tls) && ",
        "oldSelf.redis.tls) || has(oldSelf.redis.tlsSecretName)) && ",
        "has(self.redis.sentinel) == has(oldSelf.redis.sentinel) && ",
        "(!has(self.redis.sentinel) || (self.redis.sentinel.masterName == oldSelf.redis.sentinel.masterName && ",
        "has(self.redis.sentinel.minReplicas) == has(oldSelf.redis.sentinel.minReplicas) && ",
        "(!has(self.redis.sentinel.minReplicas) || self.redis.sentinel.minReplicas == oldSelf.redis.sentinel.minReplicas))))) && ",
        "(!has(self.tair) || (self.tair.endpoint == oldSelf.tair.endpoint && ",
        "has(self.tair.database) == has(oldSelf.tair.database) && ",
        "(!has(self.tair.database) || self.tair.database == oldSelf.tair.database) && ",
        "has(self.tair.keyPrefix) == has(oldSelf.tair.keyPrefix) && ",
        "(!has(self.tair.keyPrefix) || self.tair.keyPrefix == oldSelf.tair.keyPrefix) && ",
        "((has(self.tair.tls) && ",
        "self.tair.tls) || has(self.tair.tlsSecretName)) == ((has(oldSelf.tair.tls) && ",
        "oldSelf.tair.tls) || has(oldSelf.tair.tlsSecretName)))) && ",
        "(!has(self.postgres) || (self.postgres.host == oldSelf.postgres.host && ",
        "has(self.postgres.port) == has(oldSelf.postgres.port) && ",
        "(!has(self.postgres.port) || self.postgres.port == oldSelf.postgres.port) && ",
        "self.postgres.database == oldSelf.postgres.database && ",
        "has(self.postgres.table) == has(oldSelf.postgres.table) && ",
        "(!has(self.postgres.table) || self.postgres.table == oldSelf.postgres.table) && ",
        "has(self.postgres.schema) == has(oldSelf.postgres.schema) && ",
        "(!has(self.postgres.schema) || self.postgres.schema == oldSelf.postgres.schema) && ",
        "(has(self.postgres.schema) || (has(self.postgres.userSecretRef) == has(oldSelf.postgres.userSecretRef) && ",
        "(!has(self.postgres.userSecretRef) || self.postgres.userSecretRef == oldSelf.postgres.userSecretRef))) && ",
        "has(self.postgres.lockMode) == has(oldSelf.postgres.lockMode) && ",
        "(!has(self.postgres.lockMode) || self.postgres.lockMode == oldSelf.postgres.lockMode) && ",
        "((has(self.postgres.tls) && ",
        "self.postgres.tls) || has(self.postgres.tlsSecretName)) == ((has(oldSelf.postgres.tls) && ",
        "oldSelf.postgres.tls) || has(oldSelf.postgres.tlsSecretName)))) && ",
        "(!has(self.mysql) || (self.mysql.host == oldSelf.mysql.host && ",
        "has(self.mysql.port) == has(oldSelf.mysql.port) && ",
        "(!has(self.mysql.port) || self.mysql.port == oldSelf.mysql.port) && ",
        "self.mysql.database == oldSelf.mysql.database && ",
        "has(self.mysql.table) == has(oldSelf.mysql.table) && ",
        "(!has(self.mysql.table) || self.mysql.table == oldSelf.mysql.table) && ",
        "has(self.mysql.schema) == has(oldSelf.mysql.schema) && ",
        "(!has(self.mysql.schema) || self.mysql.schema == oldSelf.mysql.schema) && ",
        "has(self.mysql.lockMode) == has(oldSelf.mysql.lockMode) && ",
        "(!has(self.mysql.lockMode) || self.mysql.lockMode == oldSelf.mysql.lockMode) && ",
        "((has(self.mysql.tls) && ",
        "self.mysql.tls) || has(self.mysql.tlsSecretName)) == ((has(oldSelf.mysql.tls) && ",
        "oldSelf.mysql.tls) || has(oldSelf.mysql.tlsSecretName)))) && ",
        "(!has(self.sqlite) || self.sqlite == oldSelf.sqlite) && ",
        "(!has(self.zookeeper) || (self.zookeeper.servers == oldSelf.zookeeper.servers && ",
        "self.zookeeper.path == oldSelf.zookeeper.path && ",
        "has(self.zookeeper.sessionTimeout) == has(oldSelf.zookeeper.sessionTimeout) && ",
        "(!has(self.zookeeper.sessionTimeout) || self.zookeeper.sessionTimeout == oldSelf.zookeeper.sessionTimeout) && ",
        "has(self.zookeeper.tickTime) == has(oldSelf.zookeeper.tickTime) && ",
        "(!has(self.zookeeper.tickTime) || self.zookeeper.tickTime == oldSelf.zookeeper.tickTime) && ",
        "has(self.zookeeper.tlsSecretName) == has(oldSelf.zookeeper.tlsSecretName))) && ",
        "(!has(self.etcd) || (self.etcd.endpoints == oldSelf.etcd.endpoints && ",
        "has(self.etcd.prefix) == has(oldSelf.etcd.prefix) && ",
        "(!has(self.etcd.prefix) || self.etcd.prefix == oldSelf.etcd.prefix) && ",
        "has(self.etcd.tlsSecretName) == has(oldSelf.etcd.tlsSecretName))) && ",
        "(!has(self.kubernetes) || (has(self.kubernetes.leaseName) == has(oldSelf.kubernetes.leaseName) && ",
        "(!has(self.kubernetes.leaseName) || self.kubernetes.leaseName == oldSelf.kubernetes.leaseName)))",
    )).message(
        "backend's location is immutable (kind, endpoints, database, table, prefix, path, lease name, TLS on or off): holders and fencing tokens live in it; credentials and the Secrets they come from may change; to move a lock, stop its pods, delete the DistributedLock and create it again on the new backend"
    ))]
    pub backend: Backend,

    /// How long a lease lasts without renewal (1s to 24h). A dead holder is replaced within
    /// leaseDuration + renewInterval.
    #[serde(default = "default_lease_duration")]
    #[schemars(length(max = 32), pattern(DURATION_PATTERN))]
    #[x_kube(validation = Rule::new(
        "duration(self) >= duration('1s') && duration(self) <= duration('24h')"
    ).message("leaseDuration must be between 1s and 24h"))]
    pub lease_duration: String,

    /// How often the holder renews its lease; below leaseDuration. Unset: a third of
    /// leaseDuration (no fixed default, which a short lease would be below and a long one far
    /// too frequent for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), pattern(DURATION_PATTERN))]
    #[x_kube(validation = Rule::new("duration(self) > duration('0s')")
        .message("renewInterval must be above zero"))]
    pub renew_interval: Option<String>,

    /// Campaign: every sidecar always tries to hold the lock (leader election). OnDemand: a
    /// sidecar takes it only when its app asks (POST /lock/acquire).
    #[serde(default)]
    pub mode: LockMode,

    /// What happens to backend artifacts (table rows, znodes, Lease) when the lock is deleted:
    /// `Delete` clears them once nobody holds the lock, keeping only the token's high-water
    /// mark, so that a lock created again under the same name never reuses a token. For a
    /// family of keyed locks, once none of its keys is held: the keys' records go, above the
    /// family's counter or floor (on Redis Cluster and Tair each key's records expire by
    /// themselves, a day after its last acquisition).
    #[serde(default)]
    pub cleanup_policy: CleanupPolicy,

    /// The pod that holds the lock carries the label `leasehold.dev/holder: "true"`, and every
    /// other pod of the lock `"false"`, so that a Service selecting the label sends traffic to
    /// the holder only (readiness stays as it is, so rolling updates proceed); the same goes in
    /// the lock's own label `holder.leasehold.dev/LOCK`, which is all a pod that takes several
    /// locks carries. Its sidecar
    /// writes the label on its own pod, and takes it off a pod that held the lock before (one
    /// that died keeps it): the pods' ServiceAccount needs `list` and `patch` on pods in the
    /// namespace. A lock only, not a family of keyed locks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_label: Option<bool>,

    /// Declares a family of keyed locks rather than one lock: workers take keys they choose at
    /// run time (`POST localhost:4040/locks/NAME/keys/KEY/acquire?owner=ID`), each key an
    /// ordinary lock on this backend with this lease. Every key is taken on demand, so `mode`
    /// does not apply. Cannot be added or removed later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<KeysSpec>,

    /// How many owners may hold one key at once (default 1): each key of the family is a
    /// semaphore of this many permits, each permit with its own fencing token; the keyed
    /// answers then give the permit held and, on `GET`, how many are held. On a lock (without
    /// `keys`), how many pods hold it at once, each on a permit of its own: `/lock` answers 200
    /// to each, with its `permit`; its name is then at most 207 characters. A change applies to
    /// the acquisitions after it and revokes no holding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 256))]
    pub permits: Option<u32>,
}

/// The largest `maxKeyLength` a family may be given (its schema's maximum).
pub const MAX_KEY_LENGTH: u32 = 1024;

/// The bounds of a family's keys.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeysSpec {
    /// The longest key accepted, in bytes (default 128). A key is letters, digits and
    /// `. _ - : / @`; a longer or ill-formed key is refused with 400.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_KEY_LENGTH))]
    pub max_key_length: Option<u32>,
    /// How many keys of the family one pod may hold at once (default 1024); one more is
    /// refused with 429.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000000))]
    pub max_held_per_pod: Option<u32>,
    /// Keys have readers and writers (docs/read-write.md): every acquisition reads, sharing
    /// the key with up to `spec.permits` readers, and `mode=write` holds it alone. At most 16
    /// permits then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_write: Option<bool>,
}

fn default_lease_duration() -> String {
    DEFAULT_LEASE_DURATION.to_owned()
}

#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum LockMode {
    #[default]
    Campaign,
    OnDemand,
    /// A value of a later version's CRD, read by this version: the lock is refused as invalid
    /// rather than failing to decode, which would fail the whole list it came in and stop every
    /// lock's reconciling. Not in the schema.
    #[serde(other)]
    #[schemars(skip)]
    Unrecognized,
}

#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum CleanupPolicy {
    #[default]
    Retain,
    Delete,
    /// A value of a later version's CRD ([`LockMode::Unrecognized`]): nothing is deleted from
    /// the backend, as under `Retain`.
    #[serde(other)]
    #[schemars(skip)]
    Unrecognized,
}

/// Exactly one of the fields is set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = Rule::new(
    "(has(self.redis) ? 1 : 0) + (has(self.postgres) ? 1 : 0) + (has(self.mysql) ? 1 : 0) + \
     (has(self.sqlite) ? 1 : 0) + (has(self.zookeeper) ? 1 : 0) + (has(self.etcd) ? 1 : 0) + \
     (has(self.kubernetes) ? 1 : 0) + (has(self.tair) ? 1 : 0) == 1"
).message("set exactly one backend: redis, tair, postgres, mysql, zookeeper, etcd or kubernetes"))]
#[serde(rename_all = "camelCase")]
pub struct Backend {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis: Option<RedisBackend>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postgres: Option<SqlBackend>,
    /// MySQL or MariaDB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mysql: Option<SqlBackend>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("false").message(
        "SQLite is not supported in a cluster: a SQLite file lives on one machine, so pods on other nodes would each take their own copy of the lock; use kubernetes: {} (a Lease, nothing to run) or another shared backend"
    ))]
    pub sqlite: Option<SqliteBackend>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zookeeper: Option<ZooKeeperBackend>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdBackend>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<KubernetesBackend>,
    /// Tair (or Redis with the TairString module): the versioned put of the seed articles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tair: Option<TairBackend>,
}

impl Backend {
    /// The name of the backend that is set, as shown in `kubectl get dlock`.
    pub fn kind(&self) -> Option<&'static str> {
        let set = [
            (
                self.redis.is_some(),
                match &self.redis {
                    Some(r) if r.sentinel.is_some() => "redis-sentinel",
                    Some(r) if r.cluster == Some(true) => "redis-cluster",
                    Some(r) if r.endpoints.len() >= 3 => "redlock",
                    _ => "redis",
                },
            ),
            (self.postgres.is_some(), "postgres"),
            (self.mysql.is_some(), "mysql"),
            (self.sqlite.is_some(), "sqlite"),
            (self.zookeeper.is_some(), "zookeeper"),
            (self.etcd.is_some(), "etcd"),
            (self.kubernetes.is_some(), "kubernetes"),
            (self.tair.is_some(), "tair"),
        ];
        let mut chosen = set.iter().filter(|(on, _)| *on).map(|(_, name)| *name);
        match (chosen.next(), chosen.next()) {
            (Some(name), None) => Some(name),
            _ => None,
        }
    }
}

/// A key of a Secret in the lock's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key within the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// One Redis master, three or more independent masters for Redlock, or the sentinels of a
/// master that Redis Sentinel fails over.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.sentinel) || (has(self.cluster) && self.cluster) || self.endpoints.size() == 1 || self.endpoints.size() >= 3")
    .message("give one endpoint for a single Redis, or three or more independent masters for Redlock"))]
#[x_kube(validation = Rule::new("!(has(self.cluster) && self.cluster) || !has(self.sentinel)")
    .message("cluster and sentinel exclude each other: a Redis Cluster finds its masters itself"))]
#[x_kube(validation = Rule::new("!(has(self.cluster) && self.cluster) || !has(self.database) || self.database == 0")
    .message("a Redis Cluster has only database 0"))]
pub struct RedisBackend {
    /// `host:port` of each master, or with `sentinel`, of each sentinel (port 26379 when
    /// omitted).
    #[schemars(length(min = 1, max = 9))]
    pub endpoints: Vec<String>,
    /// Redis Sentinel: `endpoints` are sentinels, and the lock lives on the master they name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sentinel: Option<RedisSentinel>,
    /// Redis Cluster: `endpoints` are nodes of one cluster (any of them will do to find the
    /// rest), and each lock lives on the master of its keys' slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<bool>,
    /// The logical database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 15))]
    pub database: Option<u16>,
    /// Prefix of every key and channel (default `leasehold`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$')")
        .message("keyPrefix: letters, digits, '.', '_' and '-'"))]
    pub key_prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<SecretKeyRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
    /// TLS to every endpoint (`rediss://`; in a cluster, to every node the cluster names too),
    /// verified against the system's roots unless `tlsSecretName` gives a CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<bool>,
    /// A Secret with `ca.crt` (the CA that signed the servers' certificates) and/or `tls.crt`
    /// and `tls.key` (a client certificate, for servers that ask for one); implies `tls`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub tls_secret_name: Option<String>,
}

/// The master Redis Sentinel monitors, and how many replicas must confirm each write.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RedisSentinel {
    /// The name the sentinels monitor the master under (`sentinel monitor NAME ...`).
    #[schemars(length(min = 1, max = 128))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$')")
        .message("masterName: letters, digits, '.', '_' and '-'"))]
    pub master_name: String,
    /// Replicas that must confirm each acquisition and renewal before it counts (default 1);
    /// 0 lets a failover lose a lease the master took alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 16))]
    pub min_replicas: Option<u32>,
    /// The sentinels' own user (an ACL user on the sentinels), when they ask for one; the
    /// redis section's username and password are the master's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<SecretKeyRef>,
    /// The sentinels' own password (`requirepass` on the sentinels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
}

#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum SqlLockMode {
    /// A lock table with expiry by the database's clock; survives connection loss.
    #[default]
    Lease,
    /// `SELECT ... FOR UPDATE` on a seeded row held in an open transaction.
    RowLock,
    /// A value of a later version's CRD ([`LockMode::Unrecognized`]): the lock is refused as
    /// invalid. Not in the schema.
    #[serde(other)]
    #[schemars(skip)]
    Unrecognized,
}

/// One Tair instance (or Redis with the TairString module).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TairBackend {
    /// `host:port`.
    #[schemars(length(min = 1, max = 253))]
    pub endpoint: String,
    /// The logical database.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 255))]
    pub database: Option<u16>,
    /// Prefix of every key and channel (default `leasehold`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$')")
        .message("keyPrefix: letters, digits, '.', '_' and '-'"))]
    pub key_prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<SecretKeyRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
    /// TLS (`tairs://`), verified against the system's roots unless `tlsSecretName` gives a
    /// CA: managed Tair instances accept only TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<bool>,
    /// A Secret with `ca.crt` and/or `tls.crt` and `tls.key`, as for Redis; implies `tls`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub tls_secret_name: Option<String>,
}

/// PostgreSQL, or MySQL/MariaDB.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SqlBackend {
    #[schemars(length(min = 1, max = 253))]
    pub host: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<u16>,
    #[schemars(length(min = 1, max = 63))]
    pub database: String,
    /// The lock table (default `leasehold_locks`): a plain identifier, never spliced unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z_][A-Za-z0-9_]*$')")
        .message("table must be a plain SQL identifier: letters, digits and '_', not starting with a digit"))]
    pub table: Option<String>,
    /// PostgreSQL schema of the table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z_][A-Za-z0-9_]*$')")
        .message("schema must be a plain SQL identifier"))]
    pub schema: Option<String>,
    #[serde(default)]
    pub lock_mode: SqlLockMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_secret_ref: Option<SecretKeyRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
    /// TLS with the server verified, certificate and host name (PostgreSQL `verify-full`,
    /// MySQL `VERIFY_IDENTITY`), against the system's roots unless `tlsSecretName` gives a CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<bool>,
    /// A Secret with `ca.crt` and/or `tls.crt` and `tls.key` (a client certificate); implies
    /// `tls`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub tls_secret_name: Option<String>,
}

/// A SQLite file: refused in a cluster (a CEL rule says why). The field stays so that a lock
/// that names it gets that reason rather than a silently pruned field; SQLite is for the
/// sidecar outside Kubernetes.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SqliteBackend {
    #[schemars(length(min = 2, max = 4096))]
    #[x_kube(validation = Rule::new("self.startsWith('/')").message("path must be absolute"))]
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z_][A-Za-z0-9_]*$')")
        .message("table must be a plain SQL identifier"))]
    pub table: Option<String>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ZooKeeperBackend {
    /// `host:port` of each server of the ensemble.
    #[schemars(length(min = 1, max = 15))]
    pub servers: Vec<String>,
    /// Parent path of the lock nodes, e.g. `/leasehold/locks`.
    #[schemars(length(min = 2, max = 1024))]
    #[x_kube(validation = Rule::new(
        "self.matches('^(/[A-Za-z0-9._-]+)+$') && !self.split('/').exists(s, s == '.' || s == '..' || s == 'zookeeper')"
    ).message("path must be absolute, made of segments of letters, digits, '.', '_' and '-', without '.', '..' or 'zookeeper' segments"))]
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), pattern(DURATION_PATTERN))]
    pub session_timeout: Option<String>,
    /// The ensemble's `tickTime` (default `2s`, ZooKeeper's own). A follower relays its clients'
    /// signs of life to the leader within a tick, so holders stop claiming that much earlier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), pattern(DURATION_PATTERN))]
    pub tick_time: Option<String>,
    /// Digest credentials (`user:password`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth_secret_ref: Option<SecretKeyRef>,
    /// TLS to every server (their `secureClientPort`): a Secret with `ca.crt`, the CA that
    /// signed the servers' certificates, and `tls.crt` and `tls.key` for servers that ask for a
    /// client certificate (`ssl.clientAuth`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub tls_secret_name: Option<String>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EtcdBackend {
    /// `host:port` of each member.
    #[schemars(length(min = 1, max = 15))]
    pub endpoints: Vec<String>,
    /// Key prefix of the lock keys (default `leasehold`): letters, digits, `.`, `_` and `-`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<SecretKeyRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
    /// A Secret with `ca.crt`, `tls.crt` and `tls.key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub tls_secret_name: Option<String>,
}

/// A `coordination.k8s.io/v1` Lease in the lock's namespace; needs no infrastructure.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KubernetesBackend {
    /// The Lease's name (default: the lock's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    #[x_kube(validation = Rule::new(
        "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')"
    ).message("leaseName must be a DNS subdomain name"))]
    pub lease_name: Option<String>,
    /// Kubernetes' coordinated leader election (KEP-4355): the Lease's `preferredHolder`, which
    /// cluster tooling sets, moves the lock. A holder it does not name renews no more and lets
    /// its term run out (it stops claiming first); a contender it does not name takes the free
    /// Lease only once it has gone unrenewed for two lease durations, the preferred pod's head
    /// start. Off: `preferredHolder` and `strategy` are kept as they are and change nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub yield_to_preferred_holder: Option<bool>,
}

/// What the operator last saw.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DistributedLockStatus {
    /// A map keyed by `type` for server-side apply, so that each writer owns its own
    /// conditions and another writer's stay when the operator applies its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The backend in use (redis, redlock, postgres, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The identity of the current holder, as the backend reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// The current holder's fencing token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<i64>,
    /// How many times the holder has changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transitions: Option<i64>,
    /// For a family of keyed locks (`spec.keys`), which has no single holder: how many of its
    /// keys are held now, across every pod, as the operator last counted them (once a minute).
    /// Absent until the first count, or when the backend cannot be counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_keys: Option<i64>,
    /// For a lock of several permits (`spec.permits` without `spec.keys`): how many of its
    /// permits are held now, as the operator last counted them (once a minute); `holder` and
    /// `fencingToken` are permit 0's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_permits: Option<i64>,
}

/// The CRD as YAML, exactly as `crdgen` writes it and `crds/distributedlock.yaml` holds it.
pub fn crd_yaml() -> String {
    let crd = DistributedLock::crd();
    let yaml = serde_yaml::to_string(&crd).expect("the CRD serializes");
    format!(
        "# Generated by `cargo run -p leasehold-crds --bin crdgen > crds/distributedlock.yaml`.\n\
         # Do not edit: change crds/src/lib.rs and regenerate.\n{yaml}"
    )
}
