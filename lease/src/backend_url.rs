//! The `--backend` URL: which backend, where, and with what options. Parsing is strict so that a
//! typo exits at start-up with a clear message instead of surfacing later as a lease failure.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::names::validate_sql_identifier;
use crate::redact::redact;

/// The embedded default: a SQLite file in the working directory.
pub const DEFAULT_BACKEND: &str = "sqlite://./leasehold.db";

/// The lock table used when the URL does not name one.
pub const DEFAULT_TABLE: &str = "leasehold_locks";

/// The prefix of every Redis key and channel Leasehold touches.
pub const DEFAULT_REDIS_PREFIX: &str = "leasehold";
/// ZooKeeper's own default `tickTime` (its sample configuration and the common Helm charts).
pub const DEFAULT_ZOOKEEPER_TICK_TIME: Duration = Duration::from_secs(2);
const MIN_ZOOKEEPER_TICK_TIME: Duration = Duration::from_millis(1);
const MAX_ZOOKEEPER_TICK_TIME: Duration = Duration::from_secs(60);

#[derive(Clone, PartialEq, Eq)]
pub enum BackendUrl {
    /// `sqlite://PATH[?table=NAME]`: lease rows in a local file.
    Sqlite { path: PathBuf, table: String },
    /// `redis://[user:password@]host[:port][/db][?prefix=NAME]`: one Redis master;
    /// `rediss://...[&ca=PATH][&cert=PATH&key=PATH]` over TLS (the system's roots without `ca`).
    Redis {
        url: url::Url,
        prefix: String,
        tls: Option<crate::tls::Tls>,
    },
    /// `redis+sentinel://[user:password@]host:port[,host:port...]/MASTER[/db][?prefix=NAME&min-replicas=N]`:
    /// the master the sentinels name MASTER, followed across failovers. Credentials and `db` are
    /// the master's; the sentinels' own are `sentinel-username` and `sentinel-password`.
    /// `rediss+sentinel://...[&ca=PATH][&cert=PATH&key=PATH]`: TLS to the sentinels and the master.
    RedisSentinel(crate::drivers::redis::sentinel::SentinelConfig),
    /// `redis+cluster://[user:password@]host[:port][,host[:port]...][?prefix=NAME]` (also spelled
    /// `redis-cluster://`): a Redis Cluster, found from any node listed, one `redis://` URL
    /// each. A lock's keys share one hash slot; the client follows `MOVED`, `ASK` and failovers.
    /// `rediss+cluster://...[?ca=PATH][&cert=PATH&key=PATH]` over TLS to every node, as `rediss://`.
    RedisCluster {
        nodes: Vec<url::Url>,
        prefix: String,
        tls: Option<crate::tls::Tls>,
    },
    /// `tair://[user:password@]host[:port][/db][?prefix=NAME]`: Tair, or Redis with the
    /// TairString module, locked with its versioned put (`EXSET`/`EXCAS`/`EXCAD`); `url` is
    /// the `redis://` URL to reach it. `tairs://...[&ca=PATH][&cert=PATH&key=PATH]` over TLS,
    /// as `rediss://` (`url` is then `rediss://`).
    Tair {
        url: url::Url,
        prefix: String,
        tls: Option<crate::tls::Tls>,
    },
    /// `redlock://[user:password@]host:port,host:port,host:port[/db][?prefix=NAME]`: N >= 3
    /// independent masters, one `redis://` URL each; `redlocks://` over TLS, as `rediss://`.
    Redlock {
        masters: Vec<url::Url>,
        prefix: String,
        tls: Option<crate::tls::Tls>,
    },
    /// `etcd://[user:password@]host:port[,host:port...][?prefix=NAME]`: one etcd cluster;
    /// `etcds://...?ca=PATH[&cert=PATH&key=PATH]` over TLS.
    Etcd {
        endpoints: Vec<String>,
        prefix: String,
        user: Option<(String, String)>,
        tls: Option<crate::drivers::queue::etcd::EtcdTls>,
    },
    /// `zk://[user:password@]host:port[,host:port...]/PATH[?tick-time=DURATION]`: one ZooKeeper
    /// ensemble; locks live under PATH. Credentials are ZooKeeper digest auth. `tick-time` is the
    /// ensemble's `tickTime` (default 2s, ZooKeeper's own), which bounds how late a follower
    /// relays a session's signs of life to the leader. `zks://` speaks TLS to every server (their
    /// `secureClientPort`), verified against `?ca=PATH`, with `&cert=PATH&key=PATH` for servers
    /// that ask for a client certificate (`ssl.clientAuth`).
    ZooKeeper {
        servers: String,
        root: String,
        digest: Option<(String, String)>,
        tick_time: Duration,
        tls: Option<crate::tls::Tls>,
    },
    /// `kubernetes://[NAMESPACE]`: a `coordination.k8s.io/v1` Lease per lock, named after the
    /// lock, in NAMESPACE (default: the pod's own), with in-cluster or `KUBECONFIG` credentials.
    Kubernetes { namespace: Option<String> },
    /// `postgres://` or `mysql://` (`mariadb://`) with `?table=&schema=&mode=lease|row-lock`;
    /// every other query parameter goes to the database driver (e.g. `sslmode`).
    Sql {
        dialect: crate::drivers::sql::Dialect,
        url: url::Url,
        table: String,
        schema: Option<String>,
        mode: crate::drivers::sql::SqlMode,
    },
}

impl BackendUrl {
    pub fn parse(raw: &str) -> Result<Self> {
        let invalid = |reason: String| Error::InvalidUrl {
            url: redact(raw),
            reason,
        };
        let Some((scheme, rest)) = raw.split_once("://") else {
            return Err(invalid(
                "expected SCHEME://..., e.g. sqlite://./leasehold.db or redis://127.0.0.1:6379"
                    .into(),
            ));
        };
        match scheme {
            "sqlite" => {
                let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
                if path.is_empty() {
                    return Err(invalid("the SQLite file path is empty".into()));
                }
                let mut table = DEFAULT_TABLE.to_owned();
                for (key, value) in query_pairs(query) {
                    match key.as_str() {
                        "table" => table = value,
                        other => return Err(invalid(format!("unknown option {other:?}"))),
                    }
                }
                validate_sql_identifier("table name", &table)?;
                Ok(BackendUrl::Sqlite {
                    path: PathBuf::from(path),
                    table,
                })
            }
            "redlock" | "redlocks" => {
                let (authority_and_path, query) = rest.split_once('?').unwrap_or((rest, ""));
                let (authority, path) = authority_and_path
                    .split_once('/')
                    .map_or((authority_and_path, ""), |(a, p)| (a, p));
                let (userinfo, hosts) = userinfo_and_hosts(authority);
                let hosts: Vec<&str> = hosts.split(',').collect();
                if hosts.len() < 3 {
                    return Err(invalid(format!(
                        "Redlock needs at least 3 independent masters (host:port,host:port,host:port), got {}",
                        hosts.len()
                    )));
                }
                let mut masters = Vec::new();
                let mut prefix = DEFAULT_REDIS_PREFIX.to_owned();
                let mut tls = None;
                let single_scheme = if scheme == "redlocks" {
                    "rediss"
                } else {
                    "redis"
                };
                for host in &hosts {
                    let single = match query {
                        "" => format!("{single_scheme}://{userinfo}{host}/{path}"),
                        q => format!("{single_scheme}://{userinfo}{host}/{path}?{q}"),
                    };
                    let BackendUrl::Redis {
                        url,
                        prefix: p,
                        tls: t,
                    } = Self::parse(&single)
                        .map_err(|e| invalid(format!("master {host:?}: {e}")))?
                    else {
                        unreachable!("redis:// parses as Redis")
                    };
                    if masters.contains(&url) {
                        return Err(invalid(format!("master {host:?} is listed twice")));
                    }
                    masters.push(url);
                    prefix = p;
                    tls = t;
                }
                Ok(BackendUrl::Redlock {
                    masters,
                    prefix,
                    tls,
                })
            }
            "zk" | "zks" => {
                let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
                let mut tick_time = DEFAULT_ZOOKEEPER_TICK_TIME;
                let mut tls = crate::tls::TlsOptions::default();
                for (key, value) in query_pairs(query) {
                    match key.as_str() {
                        other if tls.take(other, &value) => {}
                        "tick-time" => {
                            tick_time = humantime::parse_duration(&value)
                                .ok()
                                .filter(|t| (MIN_ZOOKEEPER_TICK_TIME..=MAX_ZOOKEEPER_TICK_TIME).contains(t))
                                .ok_or_else(|| {
                                    invalid(format!(
                                        "tick-time must be a duration from {MIN_ZOOKEEPER_TICK_TIME:?} to {MAX_ZOOKEEPER_TICK_TIME:?} (the ensemble's tickTime), got {value:?}"
                                    ))
                                })?;
                        }
                        other => {
                            return Err(invalid(format!(
                                "unknown option {other:?} (zk:// takes tick-time, zks:// also ca, cert and key)"
                            )));
                        }
                    }
                }
                let (authority, path) = rest
                    .split_once('/')
                    .map(|(a, p)| (a, format!("/{p}")))
                    .ok_or_else(|| {
                        invalid("the lock path is missing (zk://host:port/PATH)".into())
                    })?;
                crate::names::validate_zookeeper_path(&path).map_err(|e| invalid(e.to_string()))?;
                let (digest, hosts) = split_credentials(authority).map_err(invalid)?;
                let servers = host_list(hosts, 2181).map_err(invalid)?;
                let tls = tls.finish(scheme == "zks", "zks://").map_err(invalid)?;
                if tls.as_ref().is_some_and(|t| t.ca.is_none()) {
                    return Err(invalid(
                        "zks:// needs ?ca=PATH, the CA that signed the servers' certificates"
                            .into(),
                    ));
                }
                Ok(BackendUrl::ZooKeeper {
                    servers: servers.join(","),
                    root: path,
                    digest,
                    tick_time,
                    tls,
                })
            }
            "kubernetes" => {
                if rest.contains(['/', '?', '@']) {
                    return Err(invalid(
                        "kubernetes:// takes only a namespace (kubernetes://NAMESPACE), or nothing for the pod's own".into(),
                    ));
                }
                if rest.is_empty() {
                    return Ok(BackendUrl::Kubernetes { namespace: None });
                }
                crate::names::validate_namespace(rest).map_err(|e| invalid(e.to_string()))?;
                Ok(BackendUrl::Kubernetes {
                    namespace: Some(rest.to_owned()),
                })
            }
            "etcd" | "etcds" => {
                let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
                if authority.contains('/') {
                    return Err(invalid(
                        "etcd URLs have no path; the key prefix is ?prefix=NAME".into(),
                    ));
                }
                let (user, hosts) = split_credentials(authority).map_err(invalid)?;
                let endpoints = host_list(hosts, 2379).map_err(invalid)?;
                let mut prefix = DEFAULT_REDIS_PREFIX.to_owned();
                let mut tls = crate::tls::TlsOptions::default();
                for (key_name, value) in query_pairs(query) {
                    match key_name.as_str() {
                        "prefix" => prefix = value,
                        other if tls.take(other, &value) => {}
                        other => return Err(invalid(format!("unknown option {other:?}"))),
                    }
                }
                check_prefix(&prefix).map_err(invalid)?;
                let tls = match tls.finish(scheme == "etcds", "etcds://").map_err(invalid)? {
                    None => None,
                    Some(crate::tls::Tls { ca: None, .. }) => {
                        return Err(invalid(
                            "etcds:// needs ?ca=PATH, the CA that signed the members' certificates"
                                .into(),
                        ));
                    }
                    Some(crate::tls::Tls {
                        ca: Some(ca),
                        client,
                    }) => Some(crate::drivers::queue::etcd::EtcdTls { ca, client }),
                };
                Ok(BackendUrl::Etcd {
                    endpoints,
                    prefix,
                    user,
                    tls,
                })
            }
            "redis+sentinel" | "rediss+sentinel" => {
                let secure = scheme == "rediss+sentinel";
                let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
                let (authority, path) = rest.split_once('/').ok_or_else(|| {
                    invalid(
                        "the master's name is missing (redis+sentinel://host:port,.../MASTER)"
                            .into(),
                    )
                })?;
                let (master_name, db) = path.split_once('/').unwrap_or((path, ""));
                crate::names::validate_lock_name(master_name).map_err(|_| {
                    invalid(format!(
                        "the master's name {master_name:?} must be letters, digits, '.', '_' or '-'"
                    ))
                })?;
                if !db.is_empty() && db.parse::<u16>().is_err() {
                    return Err(invalid(format!(
                        "the database must be a number, got {db:?}"
                    )));
                }
                let (userinfo, hosts) = userinfo_and_hosts(authority);
                let sentinels = host_list(
                    hosts,
                    crate::drivers::redis::sentinel::DEFAULT_SENTINEL_PORT,
                )
                .map_err(invalid)?;
                let mut prefix = DEFAULT_REDIS_PREFIX.to_owned();
                let mut min_replicas = crate::drivers::redis::sentinel::DEFAULT_MIN_REPLICAS;
                let mut tls = crate::tls::TlsOptions::default();
                let (mut sentinel_username, mut sentinel_password) = (None, None);
                for (key, value) in query_pairs(query) {
                    match key.as_str() {
                        "prefix" => prefix = value,
                        "min-replicas" => {
                            min_replicas = value.parse().ok().filter(|n| *n <= 16).ok_or_else(|| {
                                invalid(format!(
                                    "min-replicas must be a number from 0 to 16 (replicas that confirm each acquisition and renewal), got {value:?}"
                                ))
                            })?;
                        }
                        "sentinel-username" => sentinel_username = Some(value),
                        "sentinel-password" => sentinel_password = Some(value),
                        other if tls.take(other, &value) => {}
                        other => {
                            return Err(invalid(format!(
                                "unknown option {other:?} (redis+sentinel:// takes prefix, min-replicas, sentinel-username and sentinel-password; rediss+sentinel:// also ca, cert and key)"
                            )));
                        }
                    }
                }
                check_prefix(&prefix).map_err(invalid)?;
                let tls = tls.finish(secure, "rediss+sentinel://").map_err(invalid)?;
                let sentinel_auth = match (sentinel_username, sentinel_password) {
                    (username, Some(password)) => {
                        Some(crate::drivers::redis::sentinel::SentinelAuth {
                            username: username.unwrap_or_default(),
                            password,
                        })
                    }
                    (None, None) => None,
                    (Some(_), None) => {
                        return Err(invalid("sentinel-username needs sentinel-password".into()));
                    }
                };
                // Where the master is comes from the sentinels; the address here is replaced.
                let master_scheme = if secure { "rediss" } else { "redis" };
                let master =
                    url::Url::parse(&format!("{master_scheme}://{userinfo}127.0.0.1/{db}"))
                        .map_err(|e| invalid(format!("the credentials: {e}")))?;
                Ok(BackendUrl::RedisSentinel(
                    crate::drivers::redis::sentinel::SentinelConfig {
                        sentinels,
                        master_name: master_name.to_owned(),
                        master,
                        prefix,
                        min_replicas,
                        tls,
                        sentinel_auth,
                    },
                ))
            }
            "redis+cluster" | "redis-cluster" | "rediss+cluster" | "rediss-cluster" => {
                let secure = scheme.starts_with("rediss");
                let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
                let authority = authority.strip_suffix('/').unwrap_or(authority);
                if authority.contains('/') {
                    return Err(invalid(
                        "a Redis Cluster has only database 0, so its URL has no path".into(),
                    ));
                }
                let (userinfo, hosts) = userinfo_and_hosts(authority);
                let mut prefix = DEFAULT_REDIS_PREFIX.to_owned();
                let mut tls = crate::tls::TlsOptions::default();
                for (key, value) in query_pairs(query) {
                    match key.as_str() {
                        "prefix" => prefix = value,
                        other if tls.take(other, &value) => {}
                        other => {
                            return Err(invalid(format!(
                                "unknown option {other:?} (redis+cluster:// takes prefix; rediss+cluster:// also ca, cert and key)"
                            )));
                        }
                    }
                }
                check_prefix(&prefix).map_err(invalid)?;
                let tls = tls.finish(secure, "rediss+cluster://").map_err(invalid)?;
                let node_scheme = if secure { "rediss" } else { "redis" };
                let mut nodes: Vec<url::Url> = Vec::new();
                for host in host_list(hosts, 6379).map_err(invalid)? {
                    let node = url::Url::parse(&format!("{node_scheme}://{userinfo}{host}"))
                        .map_err(|e| invalid(format!("node {host:?}: {e}")))?;
                    if nodes.contains(&node) {
                        return Err(invalid(format!("node {host:?} is listed twice")));
                    }
                    nodes.push(node);
                }
                Ok(BackendUrl::RedisCluster { nodes, prefix, tls })
            }
            "tair" | "tairs" => {
                let redis_scheme = if scheme == "tairs" { "rediss" } else { "redis" };
                // Errors name the scheme the user wrote, not the one it is parsed as.
                let as_redis =
                    Self::parse(&format!("{redis_scheme}://{rest}")).map_err(|e| match e {
                        Error::InvalidUrl { reason, .. } => {
                            invalid(reason.replace("rediss://", "tairs://"))
                        }
                        other => other,
                    })?;
                match as_redis {
                    BackendUrl::Redis { url, prefix, tls } => {
                        Ok(BackendUrl::Tair { url, prefix, tls })
                    }
                    _ => unreachable!("redis:// parses as Redis"),
                }
            }
            "redis" | "rediss" => {
                let url = url::Url::parse(raw).map_err(|e| invalid(e.to_string()))?;
                if url.host_str().is_none_or(str::is_empty) {
                    return Err(invalid("the Redis host is missing".into()));
                }
                let db = url.path().trim_start_matches('/');
                if !db.is_empty() && db.parse::<u16>().is_err() {
                    return Err(invalid(format!(
                        "the database must be a number, got {db:?}"
                    )));
                }
                let mut prefix = DEFAULT_REDIS_PREFIX.to_owned();
                let mut tls = crate::tls::TlsOptions::default();
                for (key, value) in url.query_pairs() {
                    match &*key {
                        "prefix" => prefix = value.into_owned(),
                        other if tls.take(other, &value) => {}
                        other => return Err(invalid(format!("unknown option {other:?}"))),
                    }
                }
                check_prefix(&prefix).map_err(invalid)?;
                let tls = tls
                    .finish(scheme == "rediss", "rediss:// (redlocks:// for Redlock)")
                    .map_err(invalid)?;
                let mut url = url;
                url.set_query(None);
                Ok(BackendUrl::Redis { url, prefix, tls })
            }
            "postgres" | "postgresql" | "mysql" | "mariadb" => {
                let dialect = if scheme.starts_with("postgres") {
                    crate::drivers::sql::Dialect::Postgres
                } else {
                    crate::drivers::sql::Dialect::MySql
                };
                let normalized = match scheme {
                    "mariadb" => format!("mysql://{rest}"),
                    _ => raw.to_owned(),
                };
                let mut url = url::Url::parse(&normalized).map_err(|e| invalid(e.to_string()))?;
                if url.host_str().is_none_or(str::is_empty) {
                    return Err(invalid("the database host is missing".into()));
                }
                if url.path().trim_start_matches('/').is_empty() {
                    return Err(invalid("the database name is missing (…/DATABASE)".into()));
                }
                let (mut table, mut schema) = (DEFAULT_TABLE.to_owned(), None);
                let mut mode = crate::drivers::sql::SqlMode::Lease;
                let mut passed_on = Vec::new();
                for (key, value) in url.query_pairs() {
                    match &*key {
                        "table" => table = value.into_owned(),
                        "schema" if dialect == crate::drivers::sql::Dialect::Postgres => {
                            schema = Some(value.into_owned())
                        }
                        "schema" => {
                            return Err(invalid(
                                "MySQL has no schemas inside a database; put the database in the path".into(),
                            ));
                        }
                        "mode" => {
                            mode =
                                crate::drivers::sql::SqlMode::parse(&value).ok_or_else(|| {
                                    invalid(format!(
                                        "mode must be lease or row-lock, got {value:?}"
                                    ))
                                })?;
                        }
                        _ => passed_on.push((key.into_owned(), value.into_owned())),
                    }
                }
                validate_sql_identifier("table name", &table)?;
                if mode == crate::drivers::sql::SqlMode::RowLock {
                    validate_sql_identifier(
                        "row-lock table name (table + \"_rows\")",
                        &crate::drivers::sql::row_table(&table),
                    )?;
                }
                if let Some(schema) = &schema {
                    validate_sql_identifier("schema name", schema)?;
                }
                if passed_on.is_empty() {
                    url.set_query(None);
                } else {
                    url.query_pairs_mut().clear().extend_pairs(passed_on);
                }
                Ok(BackendUrl::Sql {
                    dialect,
                    url,
                    table,
                    schema,
                    mode,
                })
            }
            other => Err(invalid(format!(
                "unknown scheme {other:?} (available: sqlite://, redis://, rediss://, redis+sentinel://, rediss+sentinel://, redis+cluster://, rediss+cluster://, redlock://, redlocks://, tair://, tairs://, postgres://, mysql://, etcd://, etcds://, zk://, zks://, kubernetes://)"
            ))),
        }
    }

    /// The backend's name as shown in the API and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            BackendUrl::Sqlite { .. } => "sqlite",
            BackendUrl::Redis { .. } => "redis",
            BackendUrl::RedisSentinel(_) => "redis-sentinel",
            BackendUrl::RedisCluster { .. } => "redis-cluster",
            BackendUrl::Redlock { .. } => "redlock",
            BackendUrl::Tair { .. } => "tair",
            BackendUrl::Etcd { .. } => "etcd",
            BackendUrl::ZooKeeper { .. } => "zookeeper",
            BackendUrl::Kubernetes { .. } => "kubernetes",
            BackendUrl::Sql { dialect, .. } => dialect.as_str(),
        }
    }
}

/// Shown in logs and errors: never includes the password.
impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendUrl::Sqlite { path, table } => {
                write!(f, "sqlite://{}?table={table}", path.display())
            }
            // The prefix is shown: it is part of where the lock lives (a sidecar that follows a
            // resource tells a moved lock by this text).
            BackendUrl::Redis { url, prefix, tls } => {
                write!(f, "{} (prefix {prefix}", redact(url.as_str()))?;
                write_tls_files(f, tls.as_ref())?;
                f.write_str(")")
            }
            BackendUrl::RedisSentinel(config) => {
                let user = match (config.master.username(), config.master.password()) {
                    ("", None) => String::new(),
                    (user, Some(_)) => format!("{user}:***@"),
                    (user, None) => format!("{user}@"),
                };
                let scheme = if config.tls.is_some() {
                    "rediss+sentinel"
                } else {
                    "redis+sentinel"
                };
                write!(
                    f,
                    "{scheme}://{user}{}/{}{} (prefix {}, min-replicas {}",
                    config.sentinels.join(","),
                    config.master_name,
                    config.master.path().trim_end_matches('/'),
                    config.prefix,
                    config.min_replicas
                )?;
                if let Some(auth) = &config.sentinel_auth {
                    match auth.username.as_str() {
                        "" => f.write_str(", sentinel password ***")?,
                        user => write!(f, ", sentinel user {user} with password ***")?,
                    }
                }
                write_tls_files(f, config.tls.as_ref())?;
                f.write_str(")")
            }
            BackendUrl::RedisCluster { nodes, prefix, tls } => {
                let user = match nodes.first().map(|n| (n.username(), n.password())) {
                    Some((user, Some(_))) => format!("{user}:***@"),
                    Some((user, None)) if !user.is_empty() => format!("{user}@"),
                    _ => String::new(),
                };
                let hosts: Vec<String> = nodes
                    .iter()
                    .map(|n| {
                        format!(
                            "{}:{}",
                            n.host_str().unwrap_or_default(),
                            n.port().unwrap_or(6379)
                        )
                    })
                    .collect();
                let scheme = if tls.is_some() {
                    "rediss+cluster"
                } else {
                    "redis+cluster"
                };
                write!(f, "{scheme}://{user}{} (prefix {prefix}", hosts.join(","))?;
                write_tls_files(f, tls.as_ref())?;
                f.write_str(")")
            }
            BackendUrl::Tair { url, prefix, tls } => {
                let shown = redact(url.as_str());
                let (scheme, shown) = match shown.strip_prefix("rediss://") {
                    Some(rest) => ("tairs", rest),
                    None => ("tair", shown.strip_prefix("redis://").unwrap_or(&shown)),
                };
                write!(f, "{scheme}://{shown} (prefix {prefix}")?;
                write_tls_files(f, tls.as_ref())?;
                f.write_str(")")
            }
            BackendUrl::Redlock {
                masters,
                prefix,
                tls,
            } => {
                let masters: Vec<String> = masters.iter().map(|m| redact(m.as_str())).collect();
                write!(f, "redlock over {} (prefix {prefix}", masters.join(", "))?;
                write_tls_files(f, tls.as_ref())?;
                f.write_str(")")
            }
            BackendUrl::ZooKeeper {
                servers,
                root,
                digest,
                tick_time,
                tls,
            } => {
                let user = digest
                    .as_ref()
                    .map_or_else(String::new, |(u, _)| format!("{u}:***@"));
                let scheme = if tls.is_some() { "zks" } else { "zk" };
                write!(f, "{scheme}://{user}{servers}{root}")?;
                let mut options = Vec::new();
                if *tick_time != DEFAULT_ZOOKEEPER_TICK_TIME {
                    options.push(format!(
                        "tick-time={}",
                        humantime::format_duration(*tick_time)
                    ));
                }
                for (name, path) in tls.iter().flat_map(crate::tls::Tls::files) {
                    options.push(format!("{name}={}", path.display()));
                }
                if !options.is_empty() {
                    write!(f, "?{}", options.join("&"))?;
                }
                Ok(())
            }
            BackendUrl::Etcd {
                endpoints,
                prefix,
                user,
                tls,
            } => {
                let user = user
                    .as_ref()
                    .map_or_else(String::new, |(u, _)| format!("{u}:***@"));
                let scheme = if tls.is_some() { "etcds" } else { "etcd" };
                write!(
                    f,
                    "{scheme}://{user}{}?prefix={prefix}",
                    endpoints.join(",")
                )?;
                // File paths are shown; PEM text from a Secret never is.
                let files = tls.iter().flat_map(|t| {
                    std::iter::once(("ca", &t.ca))
                        .chain(t.client.iter().flat_map(|(c, k)| [("cert", c), ("key", k)]))
                });
                for (name, pem) in files {
                    if let crate::tls::Pem::File(path) = pem {
                        write!(f, "&{name}={}", path.display())?;
                    }
                }
                Ok(())
            }
            BackendUrl::Kubernetes { namespace } => {
                write!(f, "kubernetes://{}", namespace.as_deref().unwrap_or(""))
            }
            BackendUrl::Sql {
                url,
                table,
                schema,
                mode,
                ..
            } => {
                // PEM text given inline (from a Secret) is never shown; file paths are.
                let mut shown = url.clone();
                if shown.query().is_some() {
                    let pairs: Vec<(String, String)> = url
                        .query_pairs()
                        .map(|(k, v)| {
                            let v = if v.trim_start().starts_with("-----BEGIN") {
                                "inline-pem".to_owned()
                            } else {
                                v.into_owned()
                            };
                            (k.into_owned(), v)
                        })
                        .collect();
                    shown.query_pairs_mut().clear().extend_pairs(pairs);
                }
                write!(f, "{}", redact(shown.as_str()))?;
                match schema {
                    Some(schema) => write!(f, " (table {schema}.{table}")?,
                    None => write!(f, " (table {table}")?,
                }
                write!(f, ", {} mode)", mode.as_str())
            }
        }
    }
}

/// `, ca FILE, cert FILE, key FILE` for the files among `tls`'s documents; PEM text from a
/// Secret is never shown.
fn write_tls_files(f: &mut fmt::Formatter<'_>, tls: Option<&crate::tls::Tls>) -> fmt::Result {
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

/// The key prefix of a Redis or etcd URL: a name that cannot reach into other keys.
fn check_prefix(prefix: &str) -> std::result::Result<(), String> {
    crate::names::validate_lock_name(prefix)
        .map_err(|_| format!("prefix {prefix:?} must be letters, digits, '.', '_' or '-'"))
}

/// `user:password@hosts` into the user information as written, `@` included (empty without
/// one), for URLs of each host, and the host list.
fn userinfo_and_hosts(authority: &str) -> (String, &str) {
    match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (format!("{userinfo}@"), hosts),
        None => (String::new(), authority),
    }
}

/// `user:password@hosts` into the (percent-decoded) credentials and the host list.
#[allow(clippy::type_complexity)]
fn split_credentials(
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
fn host_list(hosts: &str, default_port: u16) -> std::result::Result<Vec<String>, String> {
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

fn query_pairs(query: &str) -> Vec<(String, String)> {
    url::form_urlencoded::parse(query.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_sentinel_urls() {
        let url = BackendUrl::parse(
            "redis+sentinel://u:pw@s1:26380,s2/locks/3?prefix=team&min-replicas=0",
        )
        .unwrap();
        let BackendUrl::RedisSentinel(config) = &url else {
            panic!("{url}")
        };
        assert_eq!(config.sentinels, ["s1:26380", "s2:26379"]);
        assert_eq!(
            (
                config.master_name.as_str(),
                config.prefix.as_str(),
                config.min_replicas
            ),
            ("locks", "team", 0)
        );
        assert_eq!(config.master.username(), "u");
        assert_eq!(
            url.to_string(),
            "redis+sentinel://u:***@s1:26380,s2:26379/locks/3 (prefix team, min-replicas 0)"
        );
        let plain = BackendUrl::parse("redis+sentinel://s1/locks").unwrap();
        assert!(matches!(&plain, BackendUrl::RedisSentinel(c) if c.min_replicas == 1));
        assert_eq!(plain.kind(), "redis-sentinel");
        for (bad, reason) in [
            ("redis+sentinel://s1", "the master's name is missing"),
            ("redis+sentinel://s1/", "must be letters, digits"),
            ("redis+sentinel://s1/a b", "must be letters, digits"),
            (
                "redis+sentinel://s1/locks/x",
                "the database must be a number",
            ),
            (
                "redis+sentinel://s1/locks?min-replicas=17",
                "min-replicas must be a number",
            ),
            (
                "redis+sentinel://s1/locks?ca=/ca.crt",
                "ca, cert and key are TLS options: use rediss+sentinel://",
            ),
            (
                "rediss+sentinel://s1/locks?key=/c.key",
                "cert and key go together",
            ),
            (
                "redis+sentinel://s1/locks?sentinel-username=watcher",
                "sentinel-username needs sentinel-password",
            ),
            ("redis+sentinel://s1/locks?db=1", "unknown option \"db\""),
        ] {
            let error = BackendUrl::parse(bad).unwrap_err().to_string();
            assert!(error.contains(reason), "{bad}: {error}");
        }
    }

    /// Over TLS the sentinels and the master are both reached with `rediss://`; the sentinels'
    /// own password never shows.
    #[test]
    fn redis_sentinel_tls_and_sentinel_credentials() {
        let url = BackendUrl::parse(
            "rediss+sentinel://:pw@s1:26380/locks?ca=/tls/ca.crt&sentinel-username=watcher&sentinel-password=s%40cret",
        )
        .unwrap();
        let BackendUrl::RedisSentinel(config) = &url else {
            panic!("{url}")
        };
        assert_eq!(config.master.scheme(), "rediss");
        assert!(config.tls.as_ref().is_some_and(|t| t.ca.is_some()));
        let auth = config
            .sentinel_auth
            .as_ref()
            .expect("the sentinels' credentials");
        assert_eq!(
            (auth.username.as_str(), auth.password.as_str()),
            ("watcher", "s@cret")
        );
        let shown = url.to_string();
        assert_eq!(
            shown,
            "rediss+sentinel://:***@s1:26380/locks (prefix leasehold, min-replicas 1, sentinel user watcher with password ***, ca /tls/ca.crt)"
        );
        let password_only =
            BackendUrl::parse("redis+sentinel://s1/locks?sentinel-password=x").unwrap();
        assert!(
            password_only.to_string().contains("sentinel password ***"),
            "{password_only}"
        );
        assert!(!password_only.to_string().contains("=x"), "{password_only}");
    }

    #[test]
    fn redis_cluster_urls() {
        let url = BackendUrl::parse("redis+cluster://u:pw@n1:7000,n2?prefix=team").unwrap();
        let BackendUrl::RedisCluster { nodes, prefix, tls } = &url else {
            panic!("{url}")
        };
        assert!(tls.is_none());
        assert_eq!(
            nodes.iter().map(url::Url::as_str).collect::<Vec<_>>(),
            ["redis://u:pw@n1:7000", "redis://u:pw@n2:6379"]
        );
        assert_eq!(prefix, "team");
        assert_eq!(
            url.to_string(),
            "redis+cluster://u:***@n1:7000,n2:6379 (prefix team)"
        );
        assert_eq!(url.kind(), "redis-cluster");
        // The spelling is the same backend.
        assert_eq!(
            BackendUrl::parse("redis-cluster://n1:7000/").unwrap(),
            BackendUrl::parse("redis+cluster://n1:7000").unwrap()
        );
        for (bad, reason) in [
            ("redis+cluster://n1/1", "has no path"),
            ("redis+cluster://n1,n1", "listed twice"),
            ("redis+cluster://n1?db=1", "unknown option \"db\""),
            ("redis+cluster://n1?prefix=a:b", "must be letters, digits"),
            (
                "redis+cluster://n1?ca=/ca.crt",
                "ca, cert and key are TLS options: use rediss+cluster://",
            ),
            (
                "rediss+cluster://n1?cert=/c.crt",
                "cert and key go together",
            ),
            ("redis+cluster://", "bad endpoint"),
        ] {
            let error = BackendUrl::parse(bad).unwrap_err().to_string();
            assert!(error.contains(reason), "{bad}: {error}");
        }
    }

    /// `tairs://` is Tair over TLS, as `rediss://` is Redis; its errors name `tairs://`.
    #[test]
    fn tair_urls() {
        let plain = BackendUrl::parse("tair://:pw@t:6379/2?prefix=team").unwrap();
        assert!(
            matches!(&plain, BackendUrl::Tair { url, tls: None, .. } if url.scheme() == "redis")
        );
        assert_eq!(plain.to_string(), "tair://:***@t:6379/2 (prefix team)");
        assert_eq!(plain.kind(), "tair");
        let secure =
            BackendUrl::parse("tairs://t:6380?ca=/tls/ca.crt&cert=/tls/c.crt&key=/tls/c.key")
                .unwrap();
        let BackendUrl::Tair { url, tls, .. } = &secure else {
            panic!("{secure}")
        };
        assert_eq!(url.scheme(), "rediss");
        assert!(
            tls.as_ref()
                .is_some_and(|t| t.ca.is_some() && t.client.is_some())
        );
        assert_eq!(
            secure.to_string(),
            "tairs://t:6380 (prefix leasehold, ca /tls/ca.crt, cert /tls/c.crt, key /tls/c.key)"
        );
        assert_eq!(secure.kind(), "tair");
        for (bad, reason) in [
            ("tair://t?ca=/ca.crt", "use tairs://"),
            ("tairs://t?cert=/c.crt", "cert and key go together"),
        ] {
            let error = BackendUrl::parse(bad).unwrap_err().to_string();
            assert!(error.contains(reason), "{bad}: {error}");
            assert!(
                error.contains(bad.split('?').next().unwrap()),
                "{bad}: {error}"
            );
        }
    }

    /// Over TLS every node is a `rediss://` URL, verified against the CA given (else the
    /// system's roots), and the files' paths show where the URL is shown.
    #[test]
    fn redis_cluster_tls_urls() {
        let url = BackendUrl::parse(
            "rediss+cluster://:pw@n1:7000,n2?ca=/etc/ca.crt&cert=/etc/c.crt&key=/etc/c.key",
        )
        .unwrap();
        let BackendUrl::RedisCluster { nodes, tls, .. } = &url else {
            panic!("{url}")
        };
        assert_eq!(
            nodes.iter().map(url::Url::as_str).collect::<Vec<_>>(),
            ["rediss://:pw@n1:7000", "rediss://:pw@n2:6379"]
        );
        let tls = tls.as_ref().expect("TLS settings");
        assert!(tls.ca.is_some() && tls.client.is_some());
        let shown = url.to_string();
        assert!(
            shown.starts_with("rediss+cluster://:***@n1:7000,n2:6379 (prefix leasehold"),
            "{shown}"
        );
        assert!(!shown.contains("pw"), "{shown}");
        assert_eq!(
            BackendUrl::parse("rediss-cluster://n1").unwrap(),
            BackendUrl::parse("rediss+cluster://n1").unwrap()
        );
        let BackendUrl::RedisCluster { tls, .. } =
            BackendUrl::parse("rediss+cluster://n1").unwrap()
        else {
            unreachable!()
        };
        assert!(
            tls.is_some_and(|t| t.ca.is_none() && t.client.is_none()),
            "the system's roots, no client certificate"
        );
    }

    #[test]
    fn sqlite_urls() {
        assert_eq!(
            BackendUrl::parse(DEFAULT_BACKEND).unwrap(),
            BackendUrl::Sqlite {
                path: "./leasehold.db".into(),
                table: DEFAULT_TABLE.into()
            }
        );
        assert_eq!(
            BackendUrl::parse("sqlite:///var/lib/l.db?table=my_locks").unwrap(),
            BackendUrl::Sqlite {
                path: "/var/lib/l.db".into(),
                table: "my_locks".into()
            }
        );
        for bad in [
            "sqlite://",
            "sqlite://x.db?table=a;drop",
            "sqlite://x.db?tabel=a",
        ] {
            assert!(BackendUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn redis_urls() {
        let u = BackendUrl::parse("redis://:s3cret@127.0.0.1:6380/2?prefix=team-a").unwrap();
        match &u {
            BackendUrl::Redis { url, prefix, tls } => {
                assert!(tls.is_none());
                assert_eq!(url.port(), Some(6380));
                assert_eq!(prefix, "team-a");
            }
            _ => panic!("not redis"),
        }
        assert!(!u.to_string().contains("s3cret"), "{u}");
        for bad in [
            "redis://",
            "redis://h:notaport",
            "redis://h/db0",
            "redis://h?prefix=a:b",
        ] {
            assert!(BackendUrl::parse(bad).is_err(), "{bad}");
        }
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

    #[test]
    fn sql_urls() {
        let pg = BackendUrl::parse(
            "postgres://app:pw@db:5432/app?schema=locking&table=locks&sslmode=require",
        )
        .unwrap();
        let BackendUrl::Sql {
            dialect,
            url,
            table,
            schema,
            mode,
        } = &pg
        else {
            panic!("not sql")
        };
        assert_eq!(*dialect, crate::drivers::sql::Dialect::Postgres);
        assert_eq!(
            (table.as_str(), schema.as_deref()),
            ("locks", Some("locking"))
        );
        assert_eq!(
            url.query(),
            Some("sslmode=require"),
            "driver options pass through"
        );
        assert!(!pg.to_string().contains("pw"), "{pg}");
        assert_eq!(*mode, crate::drivers::sql::SqlMode::Lease);
        let rows = BackendUrl::parse("postgres://db/app?mode=row-lock").unwrap();
        assert!(
            matches!(
                rows,
                BackendUrl::Sql {
                    mode: crate::drivers::sql::SqlMode::RowLock,
                    ..
                }
            ),
            "{rows}"
        );
        let my = BackendUrl::parse("mariadb://root@127.0.0.1:3306/app").unwrap();
        assert_eq!(my.kind(), "mysql");
        for bad in [
            "postgres://db",
            "postgres:///app",
            "mysql://db/app?schema=x",
            "mysql://db/app?table=a-b",
            "postgres://db/app?schema=a;b",
            "postgres://db/app?mode=sometimes",
            // 60 + "_rows" is past the 63-character identifier limit.
            "postgres://db/app?mode=row-lock&table=aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        ] {
            assert!(BackendUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn redlock_urls() {
        let url = BackendUrl::parse("redlock://:pw@a:1,b:2,c:3/2?prefix=team").unwrap();
        let BackendUrl::Redlock {
            masters, prefix, ..
        } = &url
        else {
            panic!("not redlock: {url}")
        };
        assert_eq!(prefix, "team");
        let masters: Vec<&str> = masters.iter().map(url::Url::as_str).collect();
        assert_eq!(
            masters,
            [
                "redis://:pw@a:1/2",
                "redis://:pw@b:2/2",
                "redis://:pw@c:3/2"
            ]
        );
        assert_eq!(url.kind(), "redlock");
        assert!(!url.to_string().contains("pw"), "{url}");
        for bad in [
            "redlock://a:1,b:2",
            "redlock://a:1,a:1,b:2",
            "redlock://a:1,,b:2",
            "redlock://a:1,b:2,c:3/x",
            "redlock://a:1,b:2,c:3?bogus=1",
        ] {
            let err = BackendUrl::parse(bad).unwrap_err();
            assert!(
                err.to_string().contains("invalid backend URL"),
                "{bad}: {err}"
            );
        }
        let err = BackendUrl::parse("redlock://:hunter2@a:1,b:2").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn zookeeper_urls() {
        let url = BackendUrl::parse("zk://app:s3cret@z1:2181,z2/team/locks").unwrap();
        let BackendUrl::ZooKeeper {
            servers,
            root,
            digest,
            tick_time,
            tls: None,
        } = &url
        else {
            panic!("not zk: {url}")
        };
        assert_eq!(servers, "z1:2181,z2:2181");
        assert_eq!(root, "/team/locks");
        assert_eq!(digest, &Some(("app".to_owned(), "s3cret".to_owned())));
        assert_eq!(*tick_time, DEFAULT_ZOOKEEPER_TICK_TIME);
        assert_eq!(url.to_string(), "zk://app:***@z1:2181,z2:2181/team/locks");
        let ticked = BackendUrl::parse("zk://z1/locks?tick-time=500ms").unwrap();
        assert!(
            matches!(&ticked, BackendUrl::ZooKeeper { tick_time, .. } if *tick_time == Duration::from_millis(500)),
            "{ticked}"
        );
        assert_eq!(ticked.to_string(), "zk://z1:2181/locks?tick-time=500ms");
        assert_eq!(BackendUrl::parse(&ticked.to_string()).unwrap(), ticked);
        for bad in [
            "zk://z1:2181",
            "zk://z1:2181/",
            "zk://z1:2181/a/../b",
            "zk://z1:2181/zookeeper",
            "zk://z1:2181/a?x=1",
            "zk://z1:2181/a?tick-time=0s",
            "zk://z1:2181/a?tick-time=2m",
            "zk://z1:2181/a?tick-time=soon",
            "zk://z1:x/a",
            "zk://z1:2181/a?ca=/ca.crt",
            "zks://z1:2181/a",
            "zks://z1:2181/a?ca=/ca.crt&cert=/c.crt",
        ] {
            assert!(BackendUrl::parse(bad).is_err(), "{bad}");
        }
        let secure =
            BackendUrl::parse("zks://z1:2281/locks?ca=/tls/ca.crt&cert=/tls/c.crt&key=/tls/c.key")
                .unwrap();
        let BackendUrl::ZooKeeper { tls: Some(tls), .. } = &secure else {
            panic!("not zks: {secure}")
        };
        assert!(tls.ca.is_some() && tls.client.is_some());
        assert_eq!(
            secure.to_string(),
            "zks://z1:2281/locks?ca=/tls/ca.crt&cert=/tls/c.crt&key=/tls/c.key"
        );
        assert_eq!(BackendUrl::parse(&secure.to_string()).unwrap(), secure);
    }

    #[test]
    fn etcd_urls() {
        let url = BackendUrl::parse("etcd://root:pw%40x@a:1,b?prefix=team").unwrap();
        let BackendUrl::Etcd {
            endpoints,
            prefix,
            user,
            tls,
        } = &url
        else {
            panic!("not etcd: {url}")
        };
        assert_eq!(endpoints, &["a:1", "b:2379"]);
        assert_eq!(prefix, "team");
        assert_eq!(user, &Some(("root".to_owned(), "pw@x".to_owned())));
        assert!(tls.is_none());
        assert_eq!(url.to_string(), "etcd://root:***@a:1,b:2379?prefix=team");

        let url =
            BackendUrl::parse("etcds://a:1?ca=/tls/ca.crt&cert=/tls/c.crt&key=/tls/c.key").unwrap();
        let BackendUrl::Etcd { endpoints, tls, .. } = &url else {
            panic!("not etcd: {url}")
        };
        assert_eq!(endpoints, &["a:1"]);
        let file = |p: &str| crate::drivers::queue::etcd::Pem::File(p.into());
        assert!(tls.as_ref().is_some_and(|t| t.ca == file("/tls/ca.crt")
            && t.client == Some((file("/tls/c.crt"), file("/tls/c.key")))));
        assert_eq!(
            url.to_string(),
            "etcds://a:1?prefix=leasehold&ca=/tls/ca.crt&cert=/tls/c.crt&key=/tls/c.key"
        );
        let server_only = BackendUrl::parse("etcds://a?ca=/tls/ca.crt").unwrap();
        assert!(
            matches!(server_only, BackendUrl::Etcd { tls: Some(ref t), .. } if t.client.is_none())
        );

        for bad in [
            "etcd://",
            "etcd://a:1/path",
            "etcd://a:x",
            "etcd://a:1?prefix=a/b",
            "etcd://a:1?bogus=1",
            "etcd://nopassword@a:1",
            // TLS options without TLS, TLS without a CA, half a client pair.
            "etcd://a:1?ca=/tls/ca.crt",
            "etcds://a:1",
            "etcds://a:1?ca=/ca.crt&cert=/c.crt",
            "etcds://a:1?ca=/ca.crt&key=/c.key",
        ] {
            assert!(BackendUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn kubernetes_urls() {
        assert_eq!(
            BackendUrl::parse("kubernetes://").unwrap(),
            BackendUrl::Kubernetes { namespace: None }
        );
        let url = BackendUrl::parse("kubernetes://team-a").unwrap();
        assert_eq!(
            url,
            BackendUrl::Kubernetes {
                namespace: Some("team-a".into())
            }
        );
        assert_eq!(
            (url.kind(), url.to_string().as_str()),
            ("kubernetes", "kubernetes://team-a")
        );
        for bad in [
            "kubernetes://Team",
            "kubernetes://a.b",
            "kubernetes://ns/lease",
            "kubernetes://ns?lease=x",
            "kubernetes://u:p@ns",
        ] {
            assert!(BackendUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
