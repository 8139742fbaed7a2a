//! The Redis family's URLs: `redis://`, `redis+sentinel://`, `redis+cluster://`, `redlock://`
//! and `tair://`, each with its TLS spelling, parsed into their configs and shown with
//! credentials redacted.

use std::fmt;

use crate::drivers::redis::redlock::RedlockConfig;
use crate::drivers::redis::sentinel::{DEFAULT_MIN_REPLICAS, SentinelAuth, SentinelConfig};
use crate::drivers::redis::tair::TairConfig;
use crate::drivers::redis::{RedisClusterConfig, RedisConfig};
use crate::drivers::url_parts::{
    DEFAULT_REDIS_PREFIX, Login, PrefixAndTls, check_prefix, endpoints, host_list, invalid_url,
    query_pairs, server_url, userinfo_and_hosts, write_tls_files,
};
use crate::error::{Error, Result};
use crate::redact::redact_url;
use crate::tls::Tls;

/// What a Redis-family backend takes from a resource besides its servers' addresses.
#[derive(Default)]
pub struct RedisOptions<'a> {
    /// The servers' user and password (for Sentinel, the master's).
    pub login: Login<'a>,
    pub database: Option<u16>,
    /// The prefix of every key and channel; `leasehold` when absent.
    pub prefix: Option<&'a str>,
    /// TLS to every server (`Some` with no CA: the system's roots); `None` for plain TCP.
    pub tls: Option<Tls>,
}

impl RedisOptions<'_> {
    fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        }
    }

    fn database_path(&self) -> String {
        self.database
            .map_or_else(|| "/".to_owned(), |d| format!("/{d}"))
    }

    fn prefix(&self) -> Result<String> {
        let prefix = self.prefix.unwrap_or(DEFAULT_REDIS_PREFIX);
        check_prefix(prefix).map_err(|reason| Error::InvalidConfig {
            field: "keyPrefix",
            reason,
        })?;
        Ok(prefix.to_owned())
    }

    /// Each endpoint as a server's URL, none twice.
    fn servers(&self, endpoints: &[String], path: &str) -> Result<Vec<url::Url>> {
        let mut servers: Vec<url::Url> = Vec::new();
        for endpoint in endpoints {
            let server = server_url(self.scheme(), endpoint, self.login, path, "endpoints")?;
            if servers.contains(&server) {
                return Err(Error::InvalidConfig {
                    field: "endpoints",
                    reason: format!("{endpoint:?} is listed twice"),
                });
            }
            servers.push(server);
        }
        Ok(servers)
    }
}

impl RedisConfig {
    /// One Redis master at `endpoint` (`host[:port]`).
    pub fn from_parts(endpoint: &str, options: RedisOptions<'_>) -> Result<Self> {
        let url = server_url(
            options.scheme(),
            endpoint,
            options.login,
            &options.database_path(),
            "endpoints",
        )?;
        Ok(RedisConfig {
            url,
            prefix: options.prefix()?,
            tls: options.tls,
        })
    }
}

impl RedlockConfig {
    /// Three or more independent masters, one per endpoint.
    pub fn from_parts(endpoints: &[String], options: RedisOptions<'_>) -> Result<Self> {
        if endpoints.len() < 3 {
            return Err(Error::InvalidConfig {
                field: "endpoints",
                reason: format!(
                    "Redlock needs at least 3 independent masters, got {}",
                    endpoints.len()
                ),
            });
        }
        Ok(RedlockConfig {
            masters: options.servers(endpoints, &options.database_path())?,
            prefix: options.prefix()?,
            tls: options.tls,
        })
    }
}

impl RedisClusterConfig {
    /// A Redis Cluster reached first through any of `endpoints` (port 6379 when omitted).
    pub fn from_parts(nodes: &[String], options: RedisOptions<'_>) -> Result<Self> {
        if options.database.is_some_and(|d| d != 0) {
            return Err(Error::InvalidConfig {
                field: "database",
                reason: "a Redis Cluster has only database 0".into(),
            });
        }
        let nodes = endpoints(nodes, 6379, "endpoints")?;
        Ok(RedisClusterConfig {
            nodes: options.servers(&nodes, "")?,
            prefix: options.prefix()?,
            tls: options.tls,
        })
    }
}

impl SentinelAuth {
    /// The sentinels' own login: a password, with or without a user.
    pub(crate) fn from_login(login: Login<'_>) -> std::result::Result<Option<Self>, String> {
        match (login.user, login.password) {
            (user, Some(password)) => Ok(Some(SentinelAuth {
                username: user.unwrap_or_default().to_owned(),
                password: password.to_owned(),
            })),
            (None, None) => Ok(None),
            (Some(_), None) => Err("the sentinels' user needs the sentinels' password".into()),
        }
    }
}

impl SentinelConfig {
    /// The master the sentinels at `sentinels` (port 26379 when omitted) monitor as
    /// `master_name`, with replicas that confirm each write (`min_replicas`, default 1).
    pub fn from_parts(
        sentinels: &[String],
        master_name: &str,
        min_replicas: Option<u32>,
        sentinel_login: Login<'_>,
        options: RedisOptions<'_>,
    ) -> Result<Self> {
        let invalid = |field, reason| Error::InvalidConfig { field, reason };
        crate::names::validate_lock_name(master_name).map_err(|_| {
            invalid(
                "masterName",
                format!("{master_name:?} must be letters, digits, '.', '_' or '-'"),
            )
        })?;
        let min_replicas = min_replicas.unwrap_or(DEFAULT_MIN_REPLICAS);
        if min_replicas > 16 {
            return Err(invalid(
                "minReplicas",
                format!("{min_replicas} is above 16"),
            ));
        }
        let sentinel_auth =
            SentinelAuth::from_login(sentinel_login).map_err(|r| invalid("sentinel", r))?;
        // Where the master is comes from the sentinels; the address here is replaced.
        let master = server_url(
            options.scheme(),
            "127.0.0.1",
            options.login,
            &options.database_path(),
            "endpoints",
        )?;
        Ok(SentinelConfig {
            sentinels: endpoints(
                sentinels,
                crate::drivers::redis::sentinel::DEFAULT_SENTINEL_PORT,
                "endpoints",
            )?,
            master_name: master_name.to_owned(),
            master,
            prefix: options.prefix()?,
            min_replicas,
            tls: options.tls,
            sentinel_auth,
        })
    }
}

impl TairConfig {
    /// One Tair instance at `endpoint` (`host[:port]`).
    pub fn from_parts(endpoint: &str, options: RedisOptions<'_>) -> Result<Self> {
        let RedisConfig { url, prefix, tls } =
            RedisConfig::from_parts(endpoint, options).map_err(|e| match e {
                Error::InvalidConfig {
                    field: "endpoints",
                    reason,
                } => Error::InvalidConfig {
                    field: "endpoint",
                    reason,
                },
                other => other,
            })?;
        Ok(TairConfig { url, prefix, tls })
    }
}

impl RedisConfig {
    /// `redis://` or `rediss://` (`raw`, whose scheme is `scheme`).
    pub(crate) fn from_url(raw: &str, scheme: &str, _rest: &str) -> Result<Self> {
        let invalid = invalid_url(raw);
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
        let mut options = PrefixAndTls::default();
        for (key, value) in url.query_pairs() {
            if !options.take(&key, &value) {
                return Err(invalid(format!("unknown option {key:?}")));
            }
        }
        let (prefix, tls) = options
            .finish(scheme == "rediss", "rediss:// (redlocks:// for Redlock)")
            .map_err(invalid)?;
        let mut url = url;
        url.set_query(None);
        Ok(RedisConfig { url, prefix, tls })
    }
}

/// Shown with the prefix: it is part of where the lock lives (a sidecar that follows a resource tells a moved lock by this text).
impl fmt::Display for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let RedisConfig { url, prefix, tls } = self;
        write!(f, "{} (prefix {prefix}", redact_url(url))?;
        write_tls_files(f, tls.as_ref())?;
        f.write_str(")")
    }
}

impl SentinelConfig {
    /// `redis+sentinel://` or `rediss+sentinel://`.
    pub(crate) fn from_url(raw: &str, scheme: &str, rest: &str) -> Result<Self> {
        let invalid = invalid_url(raw);
        let secure = scheme == "rediss+sentinel";
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = rest.split_once('/').ok_or_else(|| {
            invalid("the master's name is missing (redis+sentinel://host:port,.../MASTER)".into())
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
        let mut options = PrefixAndTls::default();
        let mut min_replicas = DEFAULT_MIN_REPLICAS;
        let (mut sentinel_username, mut sentinel_password) = (None, None);
        for (key, value) in query_pairs(query) {
            match key.as_str() {
                "min-replicas" => {
                    min_replicas = value.parse().ok().filter(|n| *n <= 16).ok_or_else(|| {
                                invalid(format!(
                                    "min-replicas must be a number from 0 to 16 (replicas that confirm each acquisition and renewal), got {value:?}"
                                ))
                            })?;
                }
                "sentinel-username" => sentinel_username = Some(value),
                "sentinel-password" => sentinel_password = Some(value),
                other if options.take(other, &value) => {}
                other => {
                    return Err(invalid(format!(
                        "unknown option {other:?} (redis+sentinel:// takes prefix, min-replicas, sentinel-username and sentinel-password; rediss+sentinel:// also ca, cert and key)"
                    )));
                }
            }
        }
        let (prefix, tls) = options
            .finish(secure, "rediss+sentinel://")
            .map_err(invalid)?;
        let sentinel_auth = SentinelAuth::from_login(Login {
            user: sentinel_username.as_deref(),
            password: sentinel_password.as_deref(),
        })
        .map_err(|_| invalid("sentinel-username needs sentinel-password".into()))?;
        // Where the master is comes from the sentinels; the address here is replaced.
        let master_scheme = if secure { "rediss" } else { "redis" };
        let master = url::Url::parse(&format!("{master_scheme}://{userinfo}127.0.0.1/{db}"))
            .map_err(|e| invalid(format!("the credentials: {e}")))?;
        Ok(SentinelConfig {
            sentinels,
            master_name: master_name.to_owned(),
            master,
            prefix,
            min_replicas,
            tls,
            sentinel_auth,
        })
    }
}

/// The sentinels, the master's name and database, never a password.
impl fmt::Display for SentinelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let config = self;
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
}

impl RedisClusterConfig {
    /// `redis+cluster://` (or `redis-cluster://`), and their `rediss` spellings.
    pub(crate) fn from_url(raw: &str, scheme: &str, rest: &str) -> Result<Self> {
        let invalid = invalid_url(raw);
        let secure = scheme.starts_with("rediss");
        let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
        let authority = authority.strip_suffix('/').unwrap_or(authority);
        if authority.contains('/') {
            return Err(invalid(
                "a Redis Cluster has only database 0, so its URL has no path".into(),
            ));
        }
        let (userinfo, hosts) = userinfo_and_hosts(authority);
        let mut options = PrefixAndTls::default();
        for (key, value) in query_pairs(query) {
            if !options.take(&key, &value) {
                return Err(invalid(format!(
                    "unknown option {key:?} (redis+cluster:// takes prefix; rediss+cluster:// also ca, cert and key)"
                )));
            }
        }
        let (prefix, tls) = options
            .finish(secure, "rediss+cluster://")
            .map_err(invalid)?;
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
        Ok(RedisClusterConfig { nodes, prefix, tls })
    }
}

/// The nodes and the prefix, never a password.
impl fmt::Display for RedisClusterConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let RedisClusterConfig { nodes, prefix, tls } = self;
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
}

impl RedlockConfig {
    /// `redlock://` or `redlocks://`: each master is parsed as a `redis://` URL.
    pub(crate) fn from_url(raw: &str, scheme: &str, rest: &str) -> Result<Self> {
        let invalid = invalid_url(raw);
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
            let single_rest = &single[single_scheme.len() + 3..];
            let RedisConfig {
                url,
                prefix: p,
                tls: t,
            } = RedisConfig::from_url(&single, single_scheme, single_rest)
                .map_err(|e| invalid(format!("master {host:?}: {e}")))?;
            if masters.contains(&url) {
                return Err(invalid(format!("master {host:?} is listed twice")));
            }
            masters.push(url);
            prefix = p;
            tls = t;
        }
        Ok(RedlockConfig {
            masters,
            prefix,
            tls,
        })
    }
}

/// Every master, redacted, and the prefix.
impl fmt::Display for RedlockConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Every field named, so that a field added (a secret, say) is decided on here.
        let RedlockConfig {
            masters,
            prefix,
            tls,
        } = self;
        let masters: Vec<String> = masters.iter().map(redact_url).collect();
        write!(f, "redlock over {} (prefix {prefix}", masters.join(", "))?;
        write_tls_files(f, tls.as_ref())?;
        f.write_str(")")
    }
}

impl TairConfig {
    /// `tair://` or `tairs://`: parsed as the `redis://` URL that reaches the server.
    pub(crate) fn from_url(raw: &str, scheme: &str, rest: &str) -> Result<Self> {
        let invalid = invalid_url(raw);
        let redis_scheme = if scheme == "tairs" { "rediss" } else { "redis" };
        // Errors name the scheme the user wrote, not the one it is parsed as.
        let RedisConfig { url, prefix, tls } =
            RedisConfig::from_url(&format!("{redis_scheme}://{rest}"), redis_scheme, rest)
                .map_err(|e| match e {
                    Error::InvalidUrl { reason, .. } => {
                        invalid(reason.replace("rediss://", "tairs://"))
                    }
                    other => other,
                })?;
        Ok(TairConfig { url, prefix, tls })
    }
}

/// As `tair://`, redacted, with the prefix.
impl fmt::Display for TairConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let TairConfig { url, prefix, tls } = self;
        let shown = redact_url(url);
        let (scheme, shown) = match shown.strip_prefix("rediss://") {
            Some(rest) => ("tairs", rest),
            None => ("tair", shown.strip_prefix("redis://").unwrap_or(&shown)),
        };
        write!(f, "{scheme}://{shown} (prefix {prefix}")?;
        write_tls_files(f, tls.as_ref())?;
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend_url::BackendUrl;

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
        let BackendUrl::RedisCluster(RedisClusterConfig { nodes, prefix, tls }) = &url else {
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
            matches!(&plain, BackendUrl::Tair(TairConfig { url, tls: None, .. }) if url.scheme() == "redis")
        );
        assert_eq!(plain.to_string(), "tair://:***@t:6379/2 (prefix team)");
        assert_eq!(plain.kind(), "tair");
        let secure =
            BackendUrl::parse("tairs://t:6380?ca=/tls/ca.crt&cert=/tls/c.crt&key=/tls/c.key")
                .unwrap();
        let BackendUrl::Tair(TairConfig { url, tls, .. }) = &secure else {
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
        let BackendUrl::RedisCluster(RedisClusterConfig { nodes, tls, .. }) = &url else {
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
        let BackendUrl::RedisCluster(RedisClusterConfig { tls, .. }) =
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
    fn redis_urls() {
        let u = BackendUrl::parse("redis://:s3cret@127.0.0.1:6380/2?prefix=team-a").unwrap();
        match &u {
            BackendUrl::Redis(RedisConfig { url, prefix, tls }) => {
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
    fn redlock_urls() {
        let url = BackendUrl::parse("redlock://:pw@a:1,b:2,c:3/2?prefix=team").unwrap();
        let BackendUrl::Redlock(RedlockConfig {
            masters, prefix, ..
        }) = &url
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
}
