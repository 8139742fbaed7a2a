//! The `--backend` URL: which backend, where, and with what options. Parsing is strict so that a
//! typo exits at start-up with a clear message instead of surfacing later as a lease failure.

use std::fmt;

use crate::error::{Error, Result};
use crate::redact::redact;

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

/// The lock table used when the URL does not name one.
pub const DEFAULT_TABLE: &str = "leasehold_locks";

/// The prefix of every Redis key and channel Leasehold touches.
pub const DEFAULT_REDIS_PREFIX: &str = "leasehold";

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

/// The error for a bad `raw` URL, as a function of the reason (credentials redacted).
pub(crate) fn invalid_url(raw: &str) -> impl Fn(String) -> Error + Copy + '_ {
    move |reason| Error::InvalidUrl {
        url: redact(raw),
        reason,
    }
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

/// `, ca FILE, cert FILE, key FILE` for the files among `tls`'s documents; PEM text from a
/// Secret is never shown.
pub(crate) fn write_tls_files(
    f: &mut fmt::Formatter<'_>,
    tls: Option<&crate::tls::Tls>,
) -> fmt::Result {
    for (name, path) in tls.into_iter().flat_map(crate::tls::Tls::files) {
        write!(f, ", {name} {}", path.display())?;
    }
    Ok(())
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

/// A user and a password as a resource gives them (from its Secrets); either may be absent.
#[derive(Clone, Copy, Default)]
pub struct Login<'a> {
    pub user: Option<&'a str>,
    pub password: Option<&'a str>,
}

impl Login<'_> {
    /// Both parts, an absent one empty; `None` when neither is given.
    pub(crate) fn pair(self) -> Option<(String, String)> {
        match self {
            Login {
                user: None,
                password: None,
            } => None,
            Login { user, password } => Some((
                user.unwrap_or_default().to_owned(),
                password.unwrap_or_default().to_owned(),
            )),
        }
    }
}

/// One server's URL (`scheme://host[:port]PATH`) with `login` as its user information, the URL
/// percent-encoding it: the configs a resource names are built from its fields this way, not
/// through the `--backend` grammar. `field` names the resource's field in errors.
pub(crate) fn server_url(
    scheme: &str,
    endpoint: &str,
    login: Login<'_>,
    path: &str,
    field: &'static str,
) -> Result<url::Url> {
    let bad = || Error::InvalidConfig {
        field,
        reason: format!("bad endpoint {endpoint:?} (host:port)"),
    };
    let mut url = url::Url::parse(&format!("{scheme}://{endpoint}")).map_err(|_| bad())?;
    let only_host = url.host_str().is_some_and(|h| !h.is_empty())
        && matches!(url.path(), "" | "/")
        && url.query().is_none()
        && url.fragment().is_none()
        && url.username().is_empty()
        && url.password().is_none();
    if !only_host {
        return Err(bad());
    }
    if let Some((user, password)) = login.pair() {
        set_login(&mut url, &user, &password).map_err(|()| bad())?;
    }
    url.set_path(path);
    Ok(url)
}

/// `user` and `password` as `url`'s user information, every byte but letters and digits
/// percent-encoded, `%` included: the URL would keep a `%41` as written, and the client, which
/// decodes it, would send `A`.
pub(crate) fn set_login(
    url: &mut url::Url,
    user: &str,
    password: &str,
) -> std::result::Result<(), ()> {
    let encoded = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    url.set_username(&encoded(user))?;
    url.set_password(Some(&encoded(password)))
}

/// `host[:port]` of each endpoint, with `default_port` where none is given; an entry may list
/// several, comma-separated, as a connect string does. `field` names the resource's field in
/// errors; credentials, paths and options have no place in an endpoint.
pub(crate) fn endpoints(
    endpoints: &[String],
    default_port: u16,
    field: &'static str,
) -> Result<Vec<String>> {
    let bad = |endpoint: &str| Error::InvalidConfig {
        field,
        reason: format!(
            "bad endpoint {endpoint:?}: host:port (credentials go in a Secret, options in their own fields)"
        ),
    };
    let mut all = Vec::new();
    for endpoint in endpoints {
        if endpoint.contains(['@', '/', '?', '#']) {
            return Err(bad(endpoint));
        }
        all.extend(host_list(endpoint, default_port).map_err(|_| bad(endpoint))?);
    }
    if all.is_empty() {
        return Err(Error::InvalidConfig {
            field,
            reason: "no endpoint is given".into(),
        });
    }
    Ok(all)
}

/// The key prefix of a Redis or etcd URL: a name that cannot reach into other keys.
pub(crate) fn check_prefix(prefix: &str) -> std::result::Result<(), String> {
    crate::names::validate_lock_name(prefix)
        .map_err(|_| format!("prefix {prefix:?} must be letters, digits, '.', '_' or '-'"))
}

/// `user:password@hosts` into the user information as written, `@` included (empty without
/// one), for URLs of each host, and the host list.
pub(crate) fn userinfo_and_hosts(authority: &str) -> (String, &str) {
    match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (format!("{userinfo}@"), hosts),
        None => (String::new(), authority),
    }
}

/// `user:password@hosts` into the (percent-decoded) credentials and the host list.
#[allow(clippy::type_complexity)]
pub(crate) fn split_credentials(
    authority: &str,
) -> std::result::Result<(Option<(String, String)>, &str), String> {
    let Some((userinfo, hosts)) = authority.rsplit_once('@') else {
        return Ok((None, authority));
    };
    let (user, password) = userinfo
        .split_once(':')
        .ok_or_else(|| "credentials are user:password".to_owned())?;
    let decode = |s: &str| {
        url::form_urlencoded::parse(format!("v={s}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default()
    };
    Ok((Some((decode(user), decode(password))), hosts))
}

/// `host[:port],host[:port]` into `host:port` entries, with `default_port` where none is given.
pub(crate) fn host_list(
    hosts: &str,
    default_port: u16,
) -> std::result::Result<Vec<String>, String> {
    hosts
        .split(',')
        .map(|host| {
            let parsed = url::Url::parse(&format!("http://{host}"))
                .ok()
                .filter(|u| u.host_str().is_some_and(|h| !h.is_empty()) && u.path() == "/")
                .ok_or_else(|| format!("bad endpoint {host:?} (host:port)"))?;
            let port = parsed.port().unwrap_or(default_port);
            Ok(format!("{}:{port}", parsed.host_str().unwrap_or_default()))
        })
        .collect()
}

pub(crate) fn query_pairs(query: &str) -> Vec<(String, String)> {
    url::form_urlencoded::parse(query.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
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
