//! The pieces every backend's URL grammar (`from_url`) and resource mapping (`from_parts`) is
//! made of: host lists, credentials, prefixes, options, errors that never show a password.
//! Below the drivers, so that each backend's module and [`crate::backend_url`]'s dispatch over
//! them both build on it.

use std::fmt;

use crate::error::{Error, Result};
use crate::redact::redact;

/// The lock table used when the URL does not name one.
pub const DEFAULT_TABLE: &str = "leasehold_locks";

/// The prefix of every Redis key and channel Leasehold touches.
pub const DEFAULT_REDIS_PREFIX: &str = "leasehold";

/// The error for a bad `raw` URL, as a function of the reason (credentials redacted).
pub(crate) fn invalid_url(raw: &str) -> impl Fn(String) -> Error + Copy + '_ {
    move |reason| Error::InvalidUrl {
        url: redact(raw),
        reason,
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

/// The options the Redis family's and etcd's URLs share, gathered while a query is parsed
/// beside each backend's own: `prefix`, and the TLS files (`ca`, `cert`, `key`).
pub(crate) struct PrefixAndTls {
    prefix: String,
    tls: crate::tls::TlsOptions,
}

impl Default for PrefixAndTls {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_REDIS_PREFIX.to_owned(),
            tls: crate::tls::TlsOptions::default(),
        }
    }
}

impl PrefixAndTls {
    /// Take `key=value` if it is one of these options.
    pub(crate) fn take(&mut self, key: &str, value: &str) -> bool {
        if key == "prefix" {
            self.prefix = value.to_owned();
            return true;
        }
        self.tls.take(key, value)
    }

    /// The prefix, checked, and the TLS settings of a URL whose scheme asks for TLS
    /// (`secure`); the error says what is wrong.
    pub(crate) fn finish(
        self,
        secure: bool,
        tls_scheme: &str,
    ) -> std::result::Result<(String, Option<crate::tls::Tls>), String> {
        check_prefix(&self.prefix)?;
        Ok((self.prefix, self.tls.finish(secure, tls_scheme)?))
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
