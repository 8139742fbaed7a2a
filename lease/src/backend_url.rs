//! The `--backend` URL: which backend, where, and with what options. Parsing is strict so that a
//! typo exits at start-up with a clear message instead of surfacing later as a lease failure.

use std::fmt;

use crate::error::{Error, Result};

use crate::drivers::url_parts::invalid_url;
pub use crate::drivers::url_parts::{DEFAULT_TABLE, Login};

pub use crate::drivers::kubernetes::KubernetesConfig;
pub use crate::drivers::queue::etcd::EtcdConfig;
pub use crate::drivers::queue::zookeeper::ZooKeeperConfig;
pub use crate::drivers::redis::RedisClusterConfig;
pub use crate::drivers::redis::RedisConfig;
pub use crate::drivers::redis::RedisOptions;
pub use crate::drivers::redis::redlock::RedlockConfig;
pub use crate::drivers::redis::sentinel::SentinelConfig;
pub use crate::drivers::redis::tair::TairConfig;
pub use crate::drivers::sql::sqlite::SqliteConfig;
pub use crate::drivers::sql::{SqlConfig, SqlServer};

/// The embedded default: a SQLite file in the working directory.
pub const DEFAULT_BACKEND: &str = "sqlite://./leasehold.db";

/// A backend and where it is: one typed config per backend, each parsed from its URL schemes
/// and shown (credentials redacted) by the backend's own module.
#[derive(Clone, PartialEq, Eq)]
pub enum BackendUrl {
    /// `sqlite://PATH[?table=NAME]`: lease rows in a local file.
    Sqlite(SqliteConfig),
    /// `redis://` and `rediss://`: one Redis master.
    Redis(RedisConfig),
    /// `redis+sentinel://` and `rediss+sentinel://`: the master a set of sentinels names,
    /// followed across failovers.
    RedisSentinel(SentinelConfig),
    /// `redis+cluster://` (also `redis-cluster://`) and `rediss+cluster://`: a Redis Cluster.
    RedisCluster(RedisClusterConfig),
    /// `tair://` and `tairs://`: Tair, or Redis with the TairString module.
    Tair(TairConfig),
    /// `redlock://` and `redlocks://`: N >= 3 independent Redis masters.
    Redlock(RedlockConfig),
    /// `etcd://` and `etcds://`: one etcd cluster.
    Etcd(EtcdConfig),
    /// `zk://` and `zks://`: one ZooKeeper ensemble.
    ZooKeeper(ZooKeeperConfig),
    /// `kubernetes://[NAMESPACE]`: a `coordination.k8s.io/v1` Lease per lock.
    Kubernetes(KubernetesConfig),
    /// `postgres://`, `mysql://` (`mariadb://`): a lock table in PostgreSQL or MySQL/MariaDB.
    Sql(SqlConfig),
}

impl BackendUrl {
    pub fn parse(raw: &str) -> Result<Self> {
        let invalid = invalid_url(raw);
        let Some((scheme, rest)) = raw.split_once("://") else {
            return Err(invalid(
                "expected SCHEME://..., e.g. sqlite://./leasehold.db or redis://127.0.0.1:6379"
                    .into(),
            ));
        };
        match scheme {
            "sqlite" => SqliteConfig::from_url(raw, scheme, rest).map(Self::Sqlite),
            "redis" | "rediss" => RedisConfig::from_url(raw, scheme, rest).map(Self::Redis),
            "redis+sentinel" | "rediss+sentinel" => {
                SentinelConfig::from_url(raw, scheme, rest).map(Self::RedisSentinel)
            }
            "redis+cluster" | "redis-cluster" | "rediss+cluster" | "rediss-cluster" => {
                RedisClusterConfig::from_url(raw, scheme, rest).map(Self::RedisCluster)
            }
            "redlock" | "redlocks" => RedlockConfig::from_url(raw, scheme, rest).map(Self::Redlock),
            "tair" | "tairs" => TairConfig::from_url(raw, scheme, rest).map(Self::Tair),
            "postgres" | "postgresql" | "mysql" | "mariadb" => {
                SqlConfig::from_url(raw, scheme, rest).map(Self::Sql)
            }
            "etcd" | "etcds" => EtcdConfig::from_url(raw, scheme, rest).map(Self::Etcd),
            "zk" | "zks" => ZooKeeperConfig::from_url(raw, scheme, rest).map(Self::ZooKeeper),
            "kubernetes" => KubernetesConfig::from_url(raw, scheme, rest).map(Self::Kubernetes),
            other => Err(invalid(format!(
                "unknown scheme {other:?} (available: sqlite://, redis://, rediss://, redis+sentinel://, rediss+sentinel://, redis+cluster://, rediss+cluster://, redlock://, redlocks://, tair://, tairs://, postgres://, mysql://, etcd://, etcds://, zk://, zks://, kubernetes://)"
            ))),
        }
    }

    /// The backend's name as shown in the API and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            BackendUrl::Sqlite(_) => "sqlite",
            BackendUrl::Redis(_) => "redis",
            BackendUrl::RedisSentinel(_) => "redis-sentinel",
            BackendUrl::RedisCluster(_) => "redis-cluster",
            BackendUrl::Redlock(_) => "redlock",
            BackendUrl::Tair(_) => "tair",
            BackendUrl::Etcd(_) => "etcd",
            BackendUrl::ZooKeeper(_) => "zookeeper",
            BackendUrl::Kubernetes(_) => "kubernetes",
            BackendUrl::Sql(SqlConfig { dialect, .. }) => dialect.as_str(),
        }
    }
}

/// Shown in logs and errors: never includes the password.
impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendUrl::Sqlite(config) => config.fmt(f),
            BackendUrl::Redis(config) => config.fmt(f),
            BackendUrl::RedisSentinel(config) => config.fmt(f),
            BackendUrl::RedisCluster(config) => config.fmt(f),
            BackendUrl::Tair(config) => config.fmt(f),
            BackendUrl::Redlock(config) => config.fmt(f),
            BackendUrl::Etcd(config) => config.fmt(f),
            BackendUrl::ZooKeeper(config) => config.fmt(f),
            BackendUrl::Kubernetes(config) => config.fmt(f),
            BackendUrl::Sql(config) => config.fmt(f),
        }
    }
}

impl fmt::Debug for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::str::FromStr for BackendUrl {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_never_show_passwords() {
        let err = BackendUrl::parse("redis://user:hunter2@h/notanumber").unwrap_err();
        let msg = err.to_string();
        assert!(!msg.contains("hunter2"), "{msg}");
        assert!(msg.contains("user:***@h"), "{msg}");
        let err = BackendUrl::parse("postgres://u:pw@db/x?mode=rowlock").unwrap_err();
        assert!(!err.to_string().contains("pw@"), "{err}");
        assert!(err.to_string().contains("lease or row-lock"), "{err}");
        let err = BackendUrl::parse("zk://u:pw@zk:2181/zookeeper").unwrap_err();
        assert!(!err.to_string().contains("pw@"), "{err}");
        let err =
            BackendUrl::parse("redis+sentinel://s/m?sentinel-password=hunter2&db=1").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert!(
            BackendUrl::parse("nosuch://x")
                .unwrap_err()
                .to_string()
                .contains("unknown scheme")
        );
        assert!(BackendUrl::parse("leasehold.db").is_err());
    }
}
