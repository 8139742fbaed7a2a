//! The fair-queue backends' URLs: `etcd://` and `zk://`, each with its TLS spelling, parsed
//! into their configs and shown with credentials redacted.

use std::fmt;
use std::time::Duration;

use crate::drivers::queue::etcd::{EtcdConfig, EtcdTls};
use crate::drivers::queue::zookeeper::ZooKeeperConfig;
use crate::drivers::url_parts::{
    DEFAULT_REDIS_PREFIX, Login, PrefixAndTls, check_prefix, endpoints, host_list, invalid_url,
    query_pairs, split_credentials,
};
use crate::error::{Error, Result};
use crate::tls::{Tls, pem_files};

/// ZooKeeper's own default `tickTime` (its sample configuration and the common Helm charts).
pub(crate) const DEFAULT_ZOOKEEPER_TICK_TIME: Duration = Duration::from_secs(2);
pub(crate) const MIN_ZOOKEEPER_TICK_TIME: Duration = Duration::from_millis(1);
pub(crate) const MAX_ZOOKEEPER_TICK_TIME: Duration = Duration::from_secs(60);

/// A ZooKeeper `tickTime` as written (`2s`, `500ms`), within the bounds an ensemble accepts.
fn parse_tick_time(raw: &str) -> std::result::Result<Duration, String> {
    humantime::parse_duration(raw)
        .ok()
        .filter(|t| (MIN_ZOOKEEPER_TICK_TIME..=MAX_ZOOKEEPER_TICK_TIME).contains(t))
        .ok_or_else(|| {
            format!(
                "tick-time must be a duration from {MIN_ZOOKEEPER_TICK_TIME:?} to {MAX_ZOOKEEPER_TICK_TIME:?} (the ensemble's tickTime), got {raw:?}"
            )
        })
}

impl EtcdConfig {
    /// An etcd cluster at `endpoints` (port 2379 when omitted), its keys under `prefix`
    /// (`leasehold` when absent).
    pub fn from_parts(
        members: &[String],
        prefix: Option<&str>,
        login: Login<'_>,
        tls: Option<EtcdTls>,
    ) -> Result<Self> {
        let prefix = prefix.unwrap_or(DEFAULT_REDIS_PREFIX);
        check_prefix(prefix).map_err(|reason| Error::InvalidConfig {
            field: "prefix",
            reason,
        })?;
        Ok(EtcdConfig {
            endpoints: endpoints(members, 2379, "endpoints")?,
            prefix: prefix.to_owned(),
            user: login.pair(),
            tls,
        })
    }

    /// `etcd://` or `etcds://` (which needs a CA).
    pub(crate) fn from_url(raw: &str, scheme: &str, rest: &str) -> Result<Self> {
        let invalid = invalid_url(raw);
        let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
        if authority.contains('/') {
            return Err(invalid(
                "etcd URLs have no path; the key prefix is ?prefix=NAME".into(),
            ));
        }
        let (user, hosts) = split_credentials(authority).map_err(invalid)?;
        let endpoints = host_list(hosts, 2379).map_err(invalid)?;
        let mut options = PrefixAndTls::default();
        for (key, value) in query_pairs(query) {
            if !options.take(&key, &value) {
                return Err(invalid(format!("unknown option {key:?}")));
            }
        }
        let (prefix, tls) = options
            .finish(scheme == "etcds", "etcds://")
            .map_err(invalid)?;
        let tls = match tls {
            None => None,
            Some(crate::tls::Tls { ca: None, .. }) => {
                return Err(invalid(
                    "etcds:// needs ?ca=PATH, the CA that signed the members' certificates".into(),
                ));
            }
            Some(crate::tls::Tls {
                ca: Some(ca),
                client,
            }) => Some(crate::drivers::queue::etcd::EtcdTls { ca, client }),
        };
        Ok(EtcdConfig {
            endpoints,
            prefix,
            user,
            tls,
        })
    }
}

/// The endpoints and the prefix, the user but never the password.
impl fmt::Display for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Every field named, so that a field added (a secret, say) is decided on here.
        let EtcdConfig {
            endpoints,
            prefix,
            user,
            tls,
        } = self;
        let user = user
            .as_ref()
            .map_or_else(String::new, |(u, _)| format!("{u}:***@"));
        let scheme = if tls.is_some() { "etcds" } else { "etcd" };
        write!(
            f,
            "{scheme}://{user}{}?prefix={prefix}",
            endpoints.join(",")
        )?;
        let files = tls
            .iter()
            .flat_map(|t| pem_files(Some(&t.ca), t.client.as_ref()));
        for (name, path) in files {
            write!(f, "&{name}={}", path.display())?;
        }
        Ok(())
    }
}

impl ZooKeeperConfig {
    /// An ensemble at `servers` (port 2181 when omitted), its locks under `path`, with the
    /// ensemble's `tick_time` (2 s when absent). TLS needs the CA that signed the servers'
    /// certificates.
    pub fn from_parts(
        servers: &[String],
        path: &str,
        digest: Login<'_>,
        tick_time: Option<&str>,
        tls: Option<Tls>,
    ) -> Result<Self> {
        let invalid = |field, reason| Error::InvalidConfig { field, reason };
        crate::names::validate_zookeeper_path(path)?;
        let tick_time = tick_time
            .map(parse_tick_time)
            .transpose()
            .map_err(|r| invalid("tickTime", r))?
            .unwrap_or(DEFAULT_ZOOKEEPER_TICK_TIME);
        if tls.as_ref().is_some_and(|t| t.ca.is_none()) {
            return Err(invalid(
                "tlsSecretName",
                "TLS to ZooKeeper needs the CA that signed the servers' certificates".into(),
            ));
        }
        Ok(ZooKeeperConfig {
            servers: endpoints(servers, 2181, "servers")?.join(","),
            root: path.to_owned(),
            digest: digest.pair(),
            tick_time,
            tls,
        })
    }

    /// `zk://` or `zks://` (which needs a CA): servers, the lock path and the ensemble's tick.
    pub(crate) fn from_url(raw: &str, scheme: &str, rest: &str) -> Result<Self> {
        let invalid = invalid_url(raw);
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let mut tick_time = DEFAULT_ZOOKEEPER_TICK_TIME;
        let mut tls = crate::tls::TlsOptions::default();
        for (key, value) in query_pairs(query) {
            match key.as_str() {
                other if tls.take(other, &value) => {}
                "tick-time" => tick_time = parse_tick_time(&value).map_err(invalid)?,
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
            .ok_or_else(|| invalid("the lock path is missing (zk://host:port/PATH)".into()))?;
        crate::names::validate_zookeeper_path(&path).map_err(|e| invalid(e.to_string()))?;
        let (digest, hosts) = split_credentials(authority).map_err(invalid)?;
        let servers = host_list(hosts, 2181).map_err(invalid)?;
        let tls = tls.finish(scheme == "zks", "zks://").map_err(invalid)?;
        if tls.as_ref().is_some_and(|t| t.ca.is_none()) {
            return Err(invalid(
                "zks:// needs ?ca=PATH, the CA that signed the servers' certificates".into(),
            ));
        }
        Ok(ZooKeeperConfig {
            servers: servers.join(","),
            root: path,
            digest,
            tick_time,
            tls,
        })
    }
}

/// The servers and the path, the user but never the password.
impl fmt::Display for ZooKeeperConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ZooKeeperConfig {
            servers,
            root,
            digest,
            tick_time,
            tls,
        } = self;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend_url::BackendUrl;
    use std::time::Duration;

    #[test]
    fn zookeeper_urls() {
        let url = BackendUrl::parse("zk://app:s3cret@z1:2181,z2/team/locks").unwrap();
        let BackendUrl::ZooKeeper(ZooKeeperConfig {
            servers,
            root,
            digest,
            tick_time,
            tls: None,
        }) = &url
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
            matches!(&ticked, BackendUrl::ZooKeeper(ZooKeeperConfig { tick_time, .. }) if *tick_time == Duration::from_millis(500)),
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
        let BackendUrl::ZooKeeper(ZooKeeperConfig { tls: Some(tls), .. }) = &secure else {
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
        let BackendUrl::Etcd(EtcdConfig {
            endpoints,
            prefix,
            user,
            tls,
        }) = &url
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
        let BackendUrl::Etcd(EtcdConfig { endpoints, tls, .. }) = &url else {
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
            matches!(server_only, BackendUrl::Etcd(EtcdConfig { tls: Some(ref t), .. }) if t.client.is_none())
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
}
