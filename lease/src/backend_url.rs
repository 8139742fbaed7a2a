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

    /// Where the backend is, without who logs in or with what: the same for two configurations
    /// of one backend that differ in credentials alone (a password, a user name rotated with
    /// it, a TLS CA or client pair, a Sentinel's own login), and another for another server,
    /// database, table, prefix or path, or TLS turned on or off. On PostgreSQL without an
    /// explicit `schema`, who logs in decides where the table is (the user's `search_path`), so
    /// there the user stays part of the location.
    pub fn location(&self) -> String {
        use crate::tls::Tls;
        fn anonymous(url: &url::Url) -> url::Url {
            let mut url = url.clone();
            // Fails on URLs that cannot have a user (none here); the URL is then kept as is.
            let _ = url.set_username("");
            let _ = url.set_password(None);
            url
        }
        fn bare(tls: &Option<Tls>) -> Option<Tls> {
            tls.as_ref().map(|_| Tls {
                ca: None,
                client: None,
            })
        }
        let mut user = None;
        let place = match self.clone() {
            BackendUrl::Sqlite(config) => BackendUrl::Sqlite(config),
            BackendUrl::Redis(config) => BackendUrl::Redis(RedisConfig {
                url: anonymous(&config.url),
                tls: bare(&config.tls),
                ..config
            }),
            BackendUrl::RedisSentinel(config) => BackendUrl::RedisSentinel(SentinelConfig {
                master: anonymous(&config.master),
                sentinel_auth: None,
                tls: bare(&config.tls),
                ..config
            }),
            BackendUrl::RedisCluster(config) => BackendUrl::RedisCluster(RedisClusterConfig {
                nodes: config.nodes.iter().map(anonymous).collect(),
                tls: bare(&config.tls),
                ..config
            }),
            BackendUrl::Tair(config) => BackendUrl::Tair(TairConfig {
                url: anonymous(&config.url),
                tls: bare(&config.tls),
                ..config
            }),
            BackendUrl::Redlock(config) => BackendUrl::Redlock(RedlockConfig {
                masters: config.masters.iter().map(anonymous).collect(),
                tls: bare(&config.tls),
                ..config
            }),
            BackendUrl::Etcd(config) => BackendUrl::Etcd(EtcdConfig {
                user: None,
                tls: config
                    .tls
                    .as_ref()
                    .map(|_| crate::drivers::queue::etcd::EtcdTls {
                        ca: crate::tls::Pem::Text(String::new()),
                        client: None,
                    }),
                ..config
            }),
            BackendUrl::ZooKeeper(config) => BackendUrl::ZooKeeper(ZooKeeperConfig {
                digest: None,
                tls: bare(&config.tls),
                ..config
            }),
            // Whether holders yield to a preferred one changes how, not where, it is held.
            BackendUrl::Kubernetes(config) => BackendUrl::Kubernetes(KubernetesConfig {
                yield_to_preferred_holder: false,
                ..config
            }),
            BackendUrl::Sql(config) => {
                // Without a schema, the user's search_path finds the table: the user is named
                // beside the place, in words no redaction of the URL hides (a URL naming a user
                // without a password shows it as `***`, as it would a password).
                if config.schema.is_none() && config.url.scheme().starts_with("postgres") {
                    user = Some(config.url.username().to_owned());
                }
                let mut url = anonymous(&config.url);
                let kept: Vec<(String, String)> = url
                    .query_pairs()
                    .filter(|(name, _)| {
                        !crate::drivers::sql::server::PEM_OPTIONS.contains(&name.as_ref())
                    })
                    .map(|(name, value)| (name.into_owned(), value.into_owned()))
                    .collect();
                if kept.is_empty() {
                    url.set_query(None);
                } else {
                    url.query_pairs_mut().clear().extend_pairs(kept);
                }
                BackendUrl::Sql(SqlConfig { url, ..config })
            }
        };
        match user {
            Some(user) => format!("{place} as user {user:?}"),
            None => place.to_string(),
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

    fn at(url: &str) -> String {
        BackendUrl::parse(url).expect("a backend URL").location()
    }

    /// A user name rotated with its password is the same backend; another host, database or
    /// file is another, even when an `@` stands in its path or options.
    #[test]
    fn the_location_leaves_out_who_logs_in_and_nothing_else() {
        assert_eq!(
            at("kubernetes://team"),
            at("kubernetes://team?preferred-holder=yield")
        );
        assert_ne!(at("kubernetes://team"), at("kubernetes://other"));
        assert_eq!(
            at("redis://app-1:pw1@redis.team:6379/0"),
            at("redis://app-2:pw2@redis.team:6379/0")
        );
        assert_ne!(
            at("redis://app:pw@redis.team:6379/0"),
            at("redis://app:pw@redis.other:6379/0")
        );
        assert_eq!(
            at("postgres://v-app-1:pw@db:5432/locks?schema=locks"),
            at("postgres://v-app-2:pw@db:5432/locks?schema=locks")
        );
        // Without a schema, the user's search_path finds the table: another user, another
        // place; the same user with a rotated password, the same place.
        assert_ne!(
            at("postgres://alice:pw@db:5432/locks"),
            at("postgres://bob:pw@db:5432/locks")
        );
        assert_eq!(
            at("postgres://alice:pw1@db:5432/locks"),
            at("postgres://alice:pw2@db:5432/locks")
        );
        // Users without a password (certificates, trust, IAM tokens) as well.
        assert_ne!(
            at("postgres://alice@db:5432/locks"),
            at("postgres://bob@db:5432/locks")
        );
        assert_ne!(at("sqlite:///data/a@b.db"), at("sqlite:///data/c@b.db"));
        assert_ne!(
            at("redis://redis.team:6379/0?prefix=a"),
            at("redis://redis.team:6379/0?prefix=b")
        );
    }

    /// Credentials that are not in the URL's user part: a Sentinel's own login, a TLS CA and
    /// client pair (on SQL, the database driver's options naming them).
    #[test]
    fn the_location_leaves_out_every_credential() {
        assert_eq!(
            at("redis+sentinel://s1:26379,s2:26379/locks"),
            at(
                "redis+sentinel://m:pw@s1:26379,s2:26379/locks?sentinel-username=watcher&sentinel-password=x"
            )
        );
        assert_ne!(
            at("redis+sentinel://s1:26379/locks"),
            at("redis+sentinel://s1:26379/other")
        );
        assert_eq!(
            at("rediss://h:6380/0?ca=/tls/a.crt"),
            at("rediss://h:6380/0?ca=/tls/b.crt&cert=/tls/c.crt&key=/tls/c.key")
        );
        assert_ne!(at("rediss://h:6380/0"), at("redis://h:6380/0"));
        assert_eq!(
            at("redlocks://a:1,b:2,c:3?ca=/ca"),
            at("redlocks://u:p@a:1,b:2,c:3?cert=/c&key=/k")
        );
        assert_eq!(
            at("etcds://e1:2379?prefix=l&ca=/ca"),
            at("etcds://root:pw@e1:2379?prefix=l&ca=/other&cert=/c&key=/k")
        );
        assert_eq!(
            at("zks://z1:2281/locks?ca=/ca"),
            at("zks://u:p@z1:2281/locks?ca=/ca&cert=/c&key=/k")
        );
        assert_eq!(
            at("postgres://u:pw@db/locks?schema=s&sslmode=verify-full&sslrootcert=/ca"),
            at(
                "postgres://u:pw@db/locks?schema=s&sslmode=verify-full&sslrootcert=/ca2&sslcert=/c&sslkey=/k"
            )
        );
        assert_eq!(
            at("mysql://u:pw@db/locks?ssl-mode=VERIFY_IDENTITY"),
            at("mysql://v:pw@db/locks?ssl-mode=VERIFY_IDENTITY&ssl-cert=/c&ssl-key=/k")
        );
        assert_ne!(
            at("postgres://u:pw@db/locks?schema=s"),
            at("postgres://u:pw@db/locks?schema=t")
        );
    }

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
