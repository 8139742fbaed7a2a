#![forbid(unsafe_code)]
//! A `DistributedLock` as the lease engine's configuration: the backend's config (with credentials
//! from the Secrets it references), the lock's timing, and for the Kubernetes backend the Lease
//! and its owner. The operator and the sidecar's `--resource` both read a lock through here, so
//! they always agree on where it lives.
//!
//! Credentials exist only inside the returned [`BackendUrl`], whose `Display` redacts them; no
//! error built here contains a secret value.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::{Api, ResourceExt};
use leasehold_crds::{Backend, DistributedLock, SecretKeyRef, SqlLockMode};

use leasehold_lease::kubernetes::LeaseTarget;
use leasehold_lease::sql::{Dialect, SqlMode};
use leasehold_lease::{
    BackendUrl, Error, EtcdConfig, KubernetesConfig, LockConfig, Login, Mode, RedisClusterConfig,
    RedisConfig, RedisOptions, RedlockConfig, Result, SentinelConfig, SqlConfig, SqlServer,
    TairConfig, ZooKeeperConfig,
};

/// Secret values by (Secret name, key).
pub type SecretValues = BTreeMap<(String, String), String>;

/// Everything a lock needs, read from its resource.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedLock {
    /// The lock's name in the backend and in the sidecar's API: the resource's name.
    pub name: String,
    pub backend: BackendUrl,
    pub lease_duration: Duration,
    pub renew_interval: Duration,
    pub mode: Mode,
    /// The Lease holding the lock, for the Kubernetes backend.
    pub lease: Option<LeaseTarget>,
    /// Set when the resource declares a family of keyed locks (`spec.keys`) rather than a lock.
    pub keys: Option<KeyLimits>,
    /// `spec.permits`: of a lock, how many pods hold it at once (of a family, how many owners
    /// hold each key, as [`KeyLimits::permits`] says).
    pub permits: u32,
}

/// A family's bounds on keys, from `spec.keys`, with the command line's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyLimits {
    pub max_key_length: usize,
    pub max_keys: usize,
    /// How many owners may hold one key at once (`spec.permits`).
    pub permits: u32,
    /// Keys have readers and writers (`spec.keys.readWrite`).
    pub read_write: bool,
}

impl ResolvedLock {
    pub fn lock_config(&self, identity: &str) -> LockConfig {
        LockConfig {
            renew_interval: self.renew_interval,
            mode: self.mode,
            permits: match self.keys {
                None => self.permits,
                Some(_) => 1,
            },
            ..LockConfig::new(&self.name, identity, self.lease_duration)
        }
    }

    /// The backend lock names of a lock's permits, permit 0 (the lock's own) first; a
    /// family's name alone.
    pub fn permit_names(&self) -> Vec<String> {
        let config = self.lock_config("names");
        (0..config.permits)
            .map(|permit| config.permit_name(permit))
            .collect()
    }

    /// The family this resource declares, for the pod `identity`; `None` for a plain lock.
    pub fn family_config(&self, identity: &str) -> Option<leasehold_lease::keyed::FamilyConfig> {
        self.keys
            .map(|limits| leasehold_lease::keyed::FamilyConfig {
                renew_interval: self.renew_interval,
                max_key_length: limits.max_key_length,
                max_keys: limits.max_keys,
                permits: limits.permits,
                read_write: limits.read_write,
                ..leasehold_lease::keyed::FamilyConfig::new(
                    &self.name,
                    identity,
                    self.lease_duration,
                )
            })
    }
}

/// Why a `DistributedLock` cannot use SQLite (the CRD's rule, the operator and the webhook say
/// the same).
pub const SQLITE_IN_A_CLUSTER: &str = "SQLite is not supported in a cluster: a SQLite file lives on \
    one machine, so pods on other nodes would each take their own copy of the lock. Use \
    `kubernetes: {}` (a Lease, nothing to run) or another shared backend; SQLite is for the \
    sidecar outside Kubernetes (--backend sqlite://PATH)";

/// The keys of an etcd `tlsSecretName` Secret, as cert-manager writes them: the CA, the client
/// certificate and its key.
pub const TLS_SECRET_KEYS: [&str; 3] = ["ca.crt", "tls.crt", "tls.key"];

/// The Secret keys `lock` references, in a stable order.
pub fn secret_refs(lock: &DistributedLock) -> Vec<SecretKeyRef> {
    let b = &lock.spec.backend;
    let mut refs: Vec<&SecretKeyRef> = Vec::new();
    if let Some(r) = &b.redis {
        refs.extend(r.username_secret_ref.iter().chain(&r.password_secret_ref));
        if let Some(sentinel) = &r.sentinel {
            refs.extend(
                sentinel
                    .username_secret_ref
                    .iter()
                    .chain(&sentinel.password_secret_ref),
            );
        }
    }
    if let Some(t) = &b.tair {
        refs.extend(t.username_secret_ref.iter().chain(&t.password_secret_ref));
    }
    for sql in [&b.postgres, &b.mysql].into_iter().flatten() {
        refs.extend(sql.user_secret_ref.iter().chain(&sql.password_secret_ref));
    }
    if let Some(z) = &b.zookeeper {
        refs.extend(&z.auth_secret_ref);
    }
    if let Some(e) = &b.etcd {
        refs.extend(e.username_secret_ref.iter().chain(&e.password_secret_ref));
    }
    let mut refs: Vec<SecretKeyRef> = refs.into_iter().cloned().collect();
    if let Some(name) = b.etcd.as_ref().and_then(|e| e.tls_secret_name.as_ref()) {
        refs.extend(TLS_SECRET_KEYS.map(|key| SecretKeyRef {
            name: name.clone(),
            key: key.into(),
        }));
    }
    refs
}

/// The annotation by which a Secret's owner lets Leasehold send the Secret's values to servers:
/// a comma-separated list of `host` or `host:port`, or `*` for any server.
///
/// Without it anyone who may create a `DistributedLock` could name any Secret of the namespace
/// and a server of theirs, and the operator (which may read Secrets) would log in there with the
/// Secret's value: the opt-in makes the Secret's owner, not the lock's author, decide where its
/// values go.
pub const ALLOWED_HOSTS_ANNOTATION: &str = "leasehold.dev/allowed-hosts";

/// The annotation by which a person ends a holding: `kubectl annotate dlock NAME
/// leasehold.dev/force-release=TOKEN` (on a lock of several permits `#PERMIT:TOKEN`), or on a
/// family of keyed locks `KEY:TOKEN` (`KEY#PERMIT:TOKEN` on a semaphore's). The holder's
/// sidecar (following the lock with `--resource`) steps down if it holds the lock (or the key)
/// with that token; the operator removes the annotation once that holding is over, or at once
/// if it was not current, and says so in an Event.
pub const FORCE_RELEASE_ANNOTATION: &str = "leasehold.dev/force-release";

/// The holding a lock's [`FORCE_RELEASE_ANNOTATION`] names, if it carries one: `TOKEN`, or on a
/// lock of several permits `#PERMIT:TOKEN` (tokens count per permit there); `Err` with the value
/// when it is neither.
pub fn force_release_token(lock: &DistributedLock) -> Option<Result<LockForceRelease, String>> {
    let raw = lock.annotations().get(FORCE_RELEASE_ANNOTATION)?;
    let raw_trimmed = raw.trim();
    let parsed = match raw_trimmed.strip_prefix('#') {
        Some(named) => named.split_once(':').and_then(|(permit, token)| {
            Some(LockForceRelease {
                permit: Some(permit.parse().ok()?),
                token: token.parse().ok()?,
            })
        }),
        None => raw_trimmed.parse().ok().map(|token| LockForceRelease {
            permit: None,
            token,
        }),
    };
    Some(parsed.ok_or_else(|| raw.clone()))
}

/// Whether the lock `lock` declares (not a family) has several permits, or had them while some
/// may still be held: its spec says more than one, or the operator still counts them
/// (`status.heldPermits`, kept while a permit above a lowered count is held). Holdings are
/// named with their permit then, and the permits above 0 are counted and cleaned up.
pub fn has_had_permits(lock: &DistributedLock) -> bool {
    lock.spec.keys.is_none()
        && (lock.spec.permits.unwrap_or(1) > 1
            || lock
                .status
                .as_ref()
                .is_some_and(|status| status.held_permits.is_some()))
}

/// A lock's holding that a force-release names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockForceRelease {
    /// On a lock of several permits, the permit (`#PERMIT:TOKEN`).
    pub permit: Option<u32>,
    pub token: u64,
}

/// A family key's holding that a force-release names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyForceRelease {
    pub key: String,
    /// A semaphore's permit (`KEY#PERMIT:TOKEN`): on some backends two permits of a key may
    /// hold the same token, so a semaphore's request names the permit.
    pub permit: Option<u32>,
    pub token: u64,
}

/// The key holding a family's [`FORCE_RELEASE_ANNOTATION`] names (`KEY:TOKEN`, or
/// `KEY#PERMIT:TOKEN`; a key may hold `:` itself, the token is what follows the last one, and
/// no key holds `#`), if it carries one; `Err` with the value when it is not of that form.
pub fn force_release_key(lock: &DistributedLock) -> Option<Result<KeyForceRelease, String>> {
    let raw = lock.annotations().get(FORCE_RELEASE_ANNOTATION)?;
    let parsed = raw.trim().rsplit_once(':').and_then(|(key, token)| {
        let token = token.parse::<u64>().ok()?;
        let (key, permit) = match key.split_once('#') {
            Some((key, permit)) => (key, Some(permit.parse::<u32>().ok()?)),
            None => (key, None),
        };
        (!key.is_empty()).then(|| KeyForceRelease {
            key: key.to_owned(),
            permit,
            token,
        })
    });
    Some(parsed.ok_or_else(|| raw.clone()))
}

/// `host:port` of every server the lock's backend is reached at: where its Secrets' values go.
pub fn backend_endpoints(lock: &DistributedLock) -> Vec<String> {
    let b = &lock.spec.backend;
    let mut endpoints = Vec::new();
    if let Some(r) = &b.redis {
        endpoints.extend(r.endpoints.iter().cloned());
    }
    if let Some(t) = &b.tair {
        endpoints.push(t.endpoint.clone());
    }
    for (sql, default_port) in [(&b.postgres, 5432), (&b.mysql, 3306)] {
        if let Some(sql) = sql {
            endpoints.push(format!("{}:{}", sql.host, sql.port.unwrap_or(default_port)));
        }
    }
    if let Some(z) = &b.zookeeper {
        endpoints.extend(z.servers.iter().cloned());
    }
    if let Some(e) = &b.etcd {
        endpoints.extend(e.endpoints.iter().cloned());
    }
    endpoints
}

/// The endpoints of `lock` whose host is one DNS label (`redis:6379`): a name resolved through
/// the search path of whoever connects, so a pod of the lock's namespace finds that namespace's
/// Service, and a process of another namespace (the operator) its own namespace's.
pub fn short_endpoints(lock: &DistributedLock) -> Vec<String> {
    backend_endpoints(lock)
        .into_iter()
        .filter(|endpoint| {
            let (host, _) = split_port(endpoint);
            !host.contains('.') && !host.contains(':') && host != "localhost"
        })
        .collect()
}

/// `host` (lower-cased, IPv6 without brackets) and `port` of `host[:port]` or `[v6][:port]`.
fn split_port(endpoint: &str) -> (String, Option<&str>) {
    let (host, port) = match endpoint.rsplit_once(':') {
        Some((host, port))
            if !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && (!host.contains(':') || host.ends_with(']')) =>
        {
            (host, Some(port))
        }
        _ => (endpoint, None),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (host.to_ascii_lowercase(), port)
}

/// Whether the Secret `name`, annotated `allowed`, may be sent to every one of `endpoints`;
/// the refusal says what to annotate.
pub fn check_secret_allowed(name: &str, allowed: Option<&str>, endpoints: &[String]) -> Result<()> {
    let refuse = |reason: String| Error::InvalidConfig {
        field: "secretRef",
        reason: format!(
            "Secret {name:?} {reason}; its owner allows a server with the annotation \
             {ALLOWED_HOSTS_ANNOTATION}: \"HOST[:PORT],...\" (here {:?})",
            endpoints.join(",")
        ),
    };
    let Some(allowed) = allowed else {
        return Err(refuse("is not opened to Leasehold".into()));
    };
    let entries: Vec<&str> = allowed
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    if entries.contains(&"*") {
        return Ok(());
    }
    for endpoint in endpoints {
        let (host, port) = split_port(endpoint);
        let named = entries.iter().any(|entry| {
            let (allowed_host, allowed_port) = split_port(entry);
            allowed_host == host && allowed_port.is_none_or(|p| Some(p) == port)
        });
        if !named {
            return Err(refuse(format!(
                "may not be sent to {endpoint:?}: {ALLOWED_HOSTS_ANNOTATION} does not name it"
            )));
        }
    }
    Ok(())
}

/// The Secret keys `lock` may reference: read when present, not required. A Redis, Tair or SQL
/// `tlsSecretName` Secret may hold a CA, a client pair, or both; a ZooKeeper one needs the CA
/// (checked when the URL is built).
pub fn optional_secret_refs(lock: &DistributedLock) -> Vec<SecretKeyRef> {
    let b = &lock.spec.backend;
    let name = b
        .redis
        .as_ref()
        .and_then(|r| r.tls_secret_name.as_ref())
        .or_else(|| b.tair.as_ref().and_then(|t| t.tls_secret_name.as_ref()))
        .or_else(|| {
            b.zookeeper
                .as_ref()
                .and_then(|z| z.tls_secret_name.as_ref())
        })
        .or_else(|| {
            [&b.postgres, &b.mysql]
                .into_iter()
                .flatten()
                .find_map(|sql| sql.tls_secret_name.as_ref())
        });
    name.map(|name| {
        TLS_SECRET_KEYS
            .map(|key| SecretKeyRef {
                name: name.clone(),
                key: key.into(),
            })
            .to_vec()
    })
    .unwrap_or_default()
}

/// Where Secrets are read from: the API server (a [`kube::Client`]), or a cache in front of it.
pub trait SecretSource {
    /// The Secret `name` of `namespace`, `None` when it does not exist.
    fn secret(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = std::result::Result<Option<Secret>, kube::Error>> + Send;
}

impl SecretSource for kube::Client {
    async fn secret(
        &self,
        namespace: &str,
        name: &str,
    ) -> std::result::Result<Option<Secret>, kube::Error> {
        Api::<Secret>::namespaced(self.clone(), namespace)
            .get_opt(name)
            .await
    }
}

/// Secrets read again and again (a running lock's re-check of its credentials): from the API
/// server's cache (`resourceVersion=0`, no quorum read from etcd), and read through to etcd
/// only when the cached copy is not the one read last (changed, new, or gone). A cache that
/// lags shows an older copy, which the read through then replaces with the current one, so a
/// rotated credential is never taken back; and each Secret is read through at least every
/// [`CachedSecrets::READ_THROUGH_EVERY`], should a cache stop following. One per follower: it
/// remembers what it read.
pub struct CachedSecrets {
    client: kube::Client,
    last:
        std::sync::Mutex<std::collections::HashMap<(String, String), (Secret, std::time::Instant)>>,
}

impl CachedSecrets {
    /// How long a Secret is taken from the cache, unchanged there, before it is read through.
    pub const READ_THROUGH_EVERY: std::time::Duration = std::time::Duration::from_secs(300);

    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            last: std::sync::Mutex::default(),
        }
    }
}

impl SecretSource for CachedSecrets {
    async fn secret(
        &self,
        namespace: &str,
        name: &str,
    ) -> std::result::Result<Option<Secret>, kube::Error> {
        let api = Api::<Secret>::namespaced(self.client.clone(), namespace);
        let key = (namespace.to_owned(), name.to_owned());
        let cached = match api.get_with(name, &kube::api::GetParams::any()).await {
            Ok(secret) => Some(secret),
            Err(kube::Error::Api(status)) if status.is_not_found() => None,
            Err(e) => return Err(e),
        };
        let version = |s: &Secret| (s.metadata.uid.clone(), s.metadata.resource_version.clone());
        {
            let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            if let (Some(cached), Some((last, read_at))) = (&cached, last.get(&key))
                && cached.metadata.resource_version.is_some()
                && version(cached) == version(last)
                && read_at.elapsed() < Self::READ_THROUGH_EVERY
            {
                return Ok(Some(last.clone()));
            }
        }
        let current = api.get_opt(name).await?;
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match &current {
            Some(secret) => last.insert(key, (secret.clone(), std::time::Instant::now())),
            None => last.remove(&key),
        };
        Ok(current)
    }
}

/// Read the referenced Secret keys from the lock's namespace. A missing Secret or key, or a
/// Secret whose owner has not allowed the lock's servers ([`ALLOWED_HOSTS_ANNOTATION`]), is an
/// [`Error::InvalidConfig`] that names it (never its value).
pub async fn read_secrets(
    source: &impl SecretSource,
    lock: &DistributedLock,
) -> Result<SecretValues> {
    let namespace = lock.namespace().unwrap_or_else(|| "default".into());
    let endpoints = backend_endpoints(lock);
    let mut values = SecretValues::new();
    // Each Secret is read once, however many of its keys the lock takes (a TLS Secret's three).
    let mut read: std::collections::HashMap<String, Secret> = std::collections::HashMap::new();
    let required = secret_refs(lock).into_iter().map(|r| (r, true));
    let optional = optional_secret_refs(lock).into_iter().map(|r| (r, false));
    for (r, required) in required.chain(optional) {
        let key = (r.name.clone(), r.key.clone());
        if values.contains_key(&key) {
            continue;
        }
        let secret = match read.get(&r.name) {
            Some(secret) => secret.clone(),
            None => {
                let secret = source
                    .secret(&namespace, &r.name)
                    .await
                    .map_err(|e| match e {
                        kube::Error::Api(s) if s.code == 403 => Error::Backend(format!(
                            "not allowed to read Secret {namespace}/{}: {}",
                            r.name, s.message
                        )),
                        other => Error::Unreachable(format!(
                            "reading Secret {namespace}/{}: {other}",
                            r.name
                        )),
                    })?
                    .ok_or_else(|| missing(&r, "the Secret does not exist"))?;
                read.insert(r.name.clone(), secret.clone());
                secret
            }
        };
        check_secret_allowed(
            &r.name,
            secret
                .annotations()
                .get(ALLOWED_HOSTS_ANNOTATION)
                .map(String::as_str),
            &endpoints,
        )?;
        let value = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&r.key))
            .map(|v| String::from_utf8(v.0.clone()))
            .transpose()
            .map_err(|_| missing(&r, "the key is not UTF-8 text"))?
            .or_else(|| {
                secret
                    .string_data
                    .as_ref()
                    .and_then(|d| d.get(&r.key))
                    .cloned()
            });
        match value {
            Some(value) => {
                values.insert(key, value);
            }
            None if required => return Err(missing(&r, "the Secret has no such key")),
            None => {}
        }
    }
    Ok(values)
}

fn missing(r: &SecretKeyRef, reason: &str) -> Error {
    Error::InvalidConfig {
        field: "secretRef",
        reason: format!("Secret {:?} key {:?}: {reason}", r.name, r.key),
    }
}

/// `field` holds a value of a later version's CRD, which this version cannot serve.
fn unrecognized(field: &'static str) -> Error {
    Error::InvalidConfig {
        field,
        reason: "a value this version of Leasehold does not know (a CRD newer than the operator or sidecar): upgrade them, or use a value this version's CRD lists".to_owned(),
    }
}

/// The lock's configuration, with `secrets` from [`read_secrets`].
pub fn resolve(lock: &DistributedLock, secrets: &SecretValues) -> Result<ResolvedLock> {
    let name = lock.name_any();
    leasehold_lease::names::validate_lock_name(&name)?;
    let namespace = lock.namespace().unwrap_or_else(|| "default".into());
    let spec = &lock.spec;
    let duration = |field: &'static str, raw: &str| {
        parse_go_duration(raw).ok_or_else(|| Error::InvalidConfig {
            field,
            reason: format!("{raw:?} is not a duration such as 15s or 500ms"),
        })
    };
    let lease_duration = duration("leaseDuration", &spec.lease_duration)?;
    // Unset: a third of the lease, as on the command line.
    let renew_interval = match &spec.renew_interval {
        Some(raw) => duration("renewInterval", raw)?,
        None => lease_duration / 3,
    };
    let (backend, lease) = backend_config(lock, &namespace, secrets)?;
    let resolved = ResolvedLock {
        name,
        backend,
        lease_duration,
        renew_interval,
        mode: match spec.mode {
            leasehold_crds::LockMode::Campaign => Mode::Campaign,
            leasehold_crds::LockMode::OnDemand => Mode::OnDemand,
            leasehold_crds::LockMode::Unrecognized => return Err(unrecognized("mode")),
        },
        lease,
        keys: spec.keys.as_ref().map(|keys| KeyLimits {
            max_key_length: keys
                .max_key_length
                .map_or(leasehold_lease::keyed::DEFAULT_MAX_KEY_LENGTH, |n| {
                    n as usize
                }),
            max_keys: keys
                .max_held_per_pod
                .map_or(leasehold_lease::keyed::DEFAULT_MAX_KEYS, |n| n as usize),
            permits: spec.permits.unwrap_or(1),
            read_write: keys.read_write.unwrap_or(false),
        }),
        permits: spec.permits.unwrap_or(1),
    };
    resolved.lock_config("validation").validate()?;
    if let Some(permits) = spec.permits {
        let max = leasehold_lease::keyed::MAX_PERMITS;
        let yields = matches!(
            &resolved.backend,
            BackendUrl::Kubernetes(KubernetesConfig {
                yield_to_preferred_holder: true,
                ..
            })
        );
        let reason = if !(1..=max).contains(&permits) {
            Some(format!(
                "a lock or a key has 1 to {max} permits (it was {permits})"
            ))
        } else if permits > 1 && resolved.keys.is_none() && yields {
            Some("a lock of several permits has several holders, and Kubernetes' coordinated leader election (yieldToPreferredHolder) names one".to_owned())
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(Error::InvalidConfig {
                field: "permits",
                reason,
            });
        }
    }
    if let Some(keys) = resolved.keys
        && keys.read_write
        && keys.permits > leasehold_lease::keyed::MAX_READ_WRITE_PERMITS
    {
        return Err(Error::InvalidConfig {
            field: "permits",
            reason: format!(
                "a read-write family's key has 1 to {} permits (it was {}): a writer probes each permit it does not take",
                leasehold_lease::keyed::MAX_READ_WRITE_PERMITS,
                keys.permits
            ),
        });
    }
    if resolved.keys.is_some() {
        leasehold_lease::keyed::validate_family_name(&resolved.name)?;
    }
    Ok(resolved)
}

/// The driver for a resolved lock. The Kubernetes backend uses `client` (the caller's own
/// credentials) and the lock's Lease target; the others connect by URL.
pub async fn open(
    client: &kube::Client,
    resolved: &ResolvedLock,
) -> Result<std::sync::Arc<dyn leasehold_lease::Backend>> {
    Ok(match &resolved.backend {
        BackendUrl::Kubernetes(KubernetesConfig {
            namespace,
            yield_to_preferred_holder,
        }) => std::sync::Arc::new(
            leasehold_lease::kubernetes::KubernetesLeaseDriver::new(
                client.clone(),
                namespace
                    .clone()
                    .unwrap_or_else(|| client.default_namespace().to_owned()),
            )
            .with_target(&resolved.name, resolved.lease.clone().unwrap_or_default())
            .yielding_to_preferred_holder(*yield_to_preferred_holder),
        ),
        url => leasehold_lease::connect(url).await?,
    })
}

fn secret<'a>(secrets: &'a SecretValues, r: &Option<SecretKeyRef>) -> Result<Option<&'a str>> {
    match r {
        None => Ok(None),
        Some(r) => secrets
            .get(&(r.name.clone(), r.key.clone()))
            .map(|v| Some(v.as_str()))
            .ok_or_else(|| missing(r, "it was not read")),
    }
}

fn login<'a>(
    secrets: &'a SecretValues,
    user: &Option<SecretKeyRef>,
    password: &Option<SecretKeyRef>,
) -> Result<Login<'a>> {
    Ok(Login {
        user: secret(secrets, user)?,
        password: secret(secrets, password)?,
    })
}

/// The backend's typed config, built from the resource's fields and the Secrets' values.
fn backend_config(
    lock: &DistributedLock,
    namespace: &str,
    secrets: &SecretValues,
) -> Result<(BackendUrl, Option<LeaseTarget>)> {
    let Backend {
        redis,
        postgres,
        mysql,
        sqlite,
        zookeeper,
        etcd,
        kubernetes,
        tair,
    } = &lock.spec.backend;
    if lock.spec.backend.kind().is_none() {
        return Err(Error::InvalidConfig {
            field: "backend",
            reason: "set exactly one backend".into(),
        });
    }
    let config = if let Some(r) = redis {
        let options = RedisOptions {
            login: login(secrets, &r.username_secret_ref, &r.password_secret_ref)?,
            database: r.database,
            prefix: r.key_prefix.as_deref(),
            tls: tls_secret(r.tls, r.tls_secret_name.as_deref(), secrets)?,
        };
        if let Some(sentinel) = &r.sentinel {
            BackendUrl::RedisSentinel(SentinelConfig::from_parts(
                &r.endpoints,
                &sentinel.master_name,
                sentinel.min_replicas,
                login(
                    secrets,
                    &sentinel.username_secret_ref,
                    &sentinel.password_secret_ref,
                )?,
                options,
            )?)
        } else if r.cluster == Some(true) {
            BackendUrl::RedisCluster(RedisClusterConfig::from_parts(&r.endpoints, options)?)
        } else if let [endpoint] = r.endpoints.as_slice() {
            BackendUrl::Redis(RedisConfig::from_parts(endpoint, options)?)
        } else {
            BackendUrl::Redlock(RedlockConfig::from_parts(&r.endpoints, options)?)
        }
    } else if let Some((dialect, sql)) = postgres
        .as_ref()
        .map(|s| (Dialect::Postgres, s))
        .or(mysql.as_ref().map(|s| (Dialect::MySql, s)))
    {
        BackendUrl::Sql(SqlConfig::from_parts(SqlServer {
            dialect,
            host: &sql.host,
            port: sql.port,
            database: &sql.database,
            login: login(secrets, &sql.user_secret_ref, &sql.password_secret_ref)?,
            table: sql.table.as_deref(),
            schema: sql.schema.as_deref(),
            mode: match sql.lock_mode {
                SqlLockMode::Lease => SqlMode::Lease,
                SqlLockMode::RowLock => SqlMode::RowLock,
                SqlLockMode::Unrecognized => return Err(unrecognized("lockMode")),
            },
            driver_options: sql_tls(dialect, sql, secrets)?,
        })?)
    } else if let Some(t) = tair {
        BackendUrl::Tair(TairConfig::from_parts(
            &t.endpoint,
            RedisOptions {
                login: login(secrets, &t.username_secret_ref, &t.password_secret_ref)?,
                database: t.database,
                prefix: t.key_prefix.as_deref(),
                tls: tls_secret(t.tls, t.tls_secret_name.as_deref(), secrets)?,
            },
        )?)
    } else if sqlite.is_some() {
        return Err(Error::InvalidConfig {
            field: "backend.sqlite",
            reason: SQLITE_IN_A_CLUSTER.into(),
        });
    } else if let Some(z) = zookeeper {
        if z.session_timeout.is_some() {
            // The driver derives the session timeout from the lease (a session that outlives
            // the lease would let a dead holder block the lock); a separate one cannot be honoured.
            return Err(Error::InvalidConfig {
                field: "sessionTimeout",
                reason:
                    "the ZooKeeper session timeout follows leaseDuration; remove sessionTimeout"
                        .into(),
            });
        }
        let digest = match secret(secrets, &z.auth_secret_ref)? {
            None => Login::default(),
            Some(digest) => {
                let (user, password) =
                    digest.split_once(':').ok_or_else(|| Error::InvalidConfig {
                        field: "authSecretRef",
                        reason: "the ZooKeeper digest credentials must be user:password".into(),
                    })?;
                Login {
                    user: Some(user),
                    password: Some(password),
                }
            }
        };
        let tls = tls_secret(None, z.tls_secret_name.as_deref(), secrets)?;
        if let (Some(tls), Some(name)) = (&tls, &z.tls_secret_name)
            && tls.ca.is_none()
        {
            return Err(Error::InvalidConfig {
                field: "tlsSecretName",
                reason: format!(
                    "Secret {name:?} has no ca.crt: TLS to ZooKeeper needs the CA that signed the servers' certificates"
                ),
            });
        }
        BackendUrl::ZooKeeper(ZooKeeperConfig::from_parts(
            &z.servers,
            &z.path,
            digest,
            z.tick_time.as_deref(),
            tls,
        )?)
    } else if let Some(e) = etcd {
        BackendUrl::Etcd(EtcdConfig::from_parts(
            &e.endpoints,
            e.prefix.as_deref(),
            login(secrets, &e.username_secret_ref, &e.password_secret_ref)?,
            etcd_tls(e.tls_secret_name.as_deref(), secrets)?,
        )?)
    } else if let Some(k) = kubernetes {
        let lease_name = k.lease_name.clone().unwrap_or_else(|| lock.name_any());
        leasehold_lease::names::validate_lease_name(&lease_name)?;
        let target = LeaseTarget {
            name: Some(lease_name),
        };
        return Ok((
            BackendUrl::Kubernetes(KubernetesConfig {
                namespace: Some(namespace.to_owned()),
                yield_to_preferred_holder: k.yield_to_preferred_holder.unwrap_or(false),
            }),
            Some(target),
        ));
    } else {
        unreachable!("kind() checked that one backend is set")
    };
    Ok((config, None))
}

/// etcd's TLS from the `tlsSecretName` Secret's PEM text: the CA and the client pair.
fn etcd_tls(
    tls_secret: Option<&str>,
    secrets: &SecretValues,
) -> Result<Option<leasehold_lease::etcd::EtcdTls>> {
    let Some(name) = tls_secret else {
        return Ok(None);
    };
    let pem = |key: &str| -> Result<leasehold_lease::tls::Pem> {
        secrets
            .get(&(name.to_owned(), key.to_owned()))
            .map(|text| leasehold_lease::tls::Pem::Text(text.clone()))
            .ok_or_else(|| Error::InvalidConfig {
                field: "tlsSecretName",
                reason: format!("Secret {name:?} key {key:?} was not read"),
            })
    };
    let [ca, cert, key] = TLS_SECRET_KEYS;
    Ok(Some(leasehold_lease::etcd::EtcdTls {
        ca: pem(ca)?,
        client: Some((pem(cert)?, pem(key)?)),
    }))
}

/// The database driver's own TLS options for `sql`: the server verified, certificate and host
/// name, against the Secret's CA (PEM text, which the driver takes inline) or the system's
/// roots, with the Secret's client pair when it has one.
fn sql_tls(
    dialect: Dialect,
    sql: &leasehold_crds::SqlBackend,
    secrets: &SecretValues,
) -> Result<Vec<(&'static str, String)>> {
    if sql.tls != Some(true) && sql.tls_secret_name.is_none() {
        return Ok(Vec::new());
    }
    let (mode, ca, cert, key) = match dialect {
        Dialect::Postgres => (
            ("sslmode", "verify-full"),
            "sslrootcert",
            "sslcert",
            "sslkey",
        ),
        Dialect::MySql => (
            ("ssl-mode", "VERIFY_IDENTITY"),
            "ssl-ca",
            "ssl-cert",
            "ssl-key",
        ),
    };
    let mut options = vec![(mode.0, mode.1.to_owned())];
    if let Some(name) = &sql.tls_secret_name {
        let tls = tls_from_secret(name, secrets)?;
        if let Some(leasehold_lease::tls::Pem::Text(pem)) = tls.ca {
            options.push((ca, pem));
        }
        if let Some((leasehold_lease::tls::Pem::Text(c), leasehold_lease::tls::Pem::Text(k))) =
            tls.client
        {
            options.push((cert, c));
            options.push((key, k));
        }
    }
    Ok(options)
}

/// The CA and the client pair in a `tlsSecretName` Secret whose keys are each optional.
fn tls_from_secret(name: &str, secrets: &SecretValues) -> Result<leasehold_lease::tls::Tls> {
    let pem = |key: &str| {
        secrets
            .get(&(name.to_owned(), key.to_owned()))
            .map(|text| leasehold_lease::tls::Pem::Text(text.clone()))
    };
    let [ca, cert, key] = TLS_SECRET_KEYS;
    let client = match (pem(cert), pem(key)) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => {
            return Err(Error::InvalidConfig {
                field: "tlsSecretName",
                reason: format!("Secret {name:?} has one of tls.crt and tls.key without the other"),
            });
        }
    };
    let ca = pem(ca);
    if ca.is_none() && client.is_none() {
        return Err(Error::InvalidConfig {
            field: "tlsSecretName",
            reason: format!("Secret {name:?} has none of ca.crt, tls.crt and tls.key"),
        });
    }
    Ok(leasehold_lease::tls::Tls { ca, client })
}

/// TLS from a Redis, Tair or ZooKeeper resource: with a `tlsSecretName`, the Secret's PEM text
/// (its CA if it has one, else the system's roots; its client pair if it has one); with `tls`
/// alone, the system's roots; neither, none.
fn tls_secret(
    tls: Option<bool>,
    tls_secret: Option<&str>,
    secrets: &SecretValues,
) -> Result<Option<leasehold_lease::tls::Tls>> {
    match tls_secret {
        Some(name) => tls_from_secret(name, secrets).map(Some),
        None if tls == Some(true) => Ok(Some(leasehold_lease::tls::Tls {
            ca: None,
            client: None,
        })),
        None => Ok(None),
    }
}

/// A Go duration as the CRD's pattern admits it (`1m30s`, `500ms`, `1.5s`).
pub fn parse_go_duration(raw: &str) -> Option<Duration> {
    let mut total = Duration::ZERO;
    let mut rest = raw;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let number_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        let (number, tail) = rest.split_at(number_end);
        let value: f64 = number.parse().ok()?;
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += Duration::try_from_secs_f64(value * scale).ok()?;
        rest = tail;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_crds::{EtcdBackend, RedisBackend, SqlBackend, ZooKeeperBackend};
    use leasehold_lease::SqlConfig;

    fn lock(backend: Backend) -> DistributedLock {
        leasehold_testkit::distributed_lock("team", "jobs", backend)
    }

    fn key(name: &str, key: &str) -> SecretKeyRef {
        SecretKeyRef {
            name: name.into(),
            key: key.into(),
        }
    }

    #[test]
    fn a_locks_force_release_names_a_token_and_on_several_permits_the_permit() {
        let mut lock = lock(Backend::default());
        let mut asked = |value: &str| {
            lock.metadata.annotations =
                Some([(FORCE_RELEASE_ANNOTATION.to_owned(), value.to_owned())].into());
            force_release_token(&lock)
        };
        let named = |permit, token| Some(Ok(LockForceRelease { permit, token }));
        assert_eq!(asked(" 42 "), named(None, 42));
        assert_eq!(asked("#2:9"), named(Some(2), 9));
        for bad in ["x", "-1", "#2", "#:9", "#x:9", "2:9", "k#2:9", "#2:"] {
            assert_eq!(asked(bad), Some(Err(bad.to_owned())), "{bad}");
        }
    }

    #[test]
    fn a_familys_force_release_names_a_key_and_a_token() {
        let mut family = lock(Backend::default());
        let asked = |family: &mut DistributedLock, value: &str| {
            family.metadata.annotations =
                Some([(FORCE_RELEASE_ANNOTATION.to_owned(), value.to_owned())].into());
            force_release_key(family)
        };
        let named = |key: &str, permit: Option<u32>, token: u64| {
            Some(Ok(KeyForceRelease {
                key: key.into(),
                permit,
                token,
            }))
        };
        assert_eq!(
            asked(&mut family, "order-1234:7"),
            named("order-1234", None, 7)
        );
        // A key may hold `:`; the token follows the last one.
        assert_eq!(
            asked(&mut family, " tenant:a:12 "),
            named("tenant:a", None, 12)
        );
        // A semaphore's permit.
        assert_eq!(asked(&mut family, "k1#2:9"), named("k1", Some(2), 9));
        for bad in ["7", ":7", "k:", "k:x", "k:-1", "#1:7", "k#:7", "k#x:7"] {
            assert_eq!(asked(&mut family, bad), Some(Err(bad.to_owned())), "{bad}");
        }
        family.metadata.annotations = None;
        assert_eq!(force_release_key(&family), None);
    }

    #[test]
    fn permits_make_a_family_a_semaphore_and_a_lock_held_by_that_many() {
        let kubernetes = || Backend {
            kubernetes: Some(Default::default()),
            ..Default::default()
        };
        let mut family = lock(kubernetes());
        family.spec.keys = Some(Default::default());
        family.spec.permits = Some(4);
        let resolved = resolve(&family, &SecretValues::default()).unwrap();
        assert_eq!(resolved.family_config("pod").unwrap().permits, 4);
        let mut workers = lock(kubernetes());
        workers.spec.permits = Some(3);
        let resolved = resolve(&workers, &SecretValues::default()).unwrap();
        assert_eq!(resolved.lock_config("pod").permits, 3);
        assert_eq!(resolved.permit_names().len(), 3);
        assert_eq!(resolved.permit_names()[0], workers.name_any());
        for (keys, permits, says) in [
            (false, 0, "1 to 256"),
            (true, 0, "1 to 256"),
            (true, 257, "1 to 256"),
        ] {
            let mut bad = lock(kubernetes());
            bad.spec.keys = keys.then(Default::default);
            bad.spec.permits = Some(permits);
            let error = resolve(&bad, &SecretValues::default()).unwrap_err();
            assert!(error.to_string().contains(says), "{permits}: {error}");
        }
        let mut one = lock(kubernetes());
        one.spec.permits = Some(1);
        resolve(&one, &SecretValues::default()).unwrap();
        let mut yielding = lock(Backend {
            kubernetes: Some(leasehold_crds::KubernetesBackend {
                yield_to_preferred_holder: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        });
        yielding.spec.permits = Some(2);
        let error = resolve(&yielding, &SecretValues::default()).unwrap_err();
        assert!(
            error.to_string().contains("yieldToPreferredHolder"),
            "{error}"
        );
        let mut long = lock(kubernetes());
        long.metadata.name = Some("w".repeat(220));
        long.spec.permits = Some(2);
        let error = resolve(&long, &SecretValues::default()).unwrap_err();
        assert!(error.to_string().contains("several permits"), "{error}");
    }

    #[test]
    fn a_read_write_family_has_readers_and_at_most_16_permits() {
        let mut family = lock(Backend {
            kubernetes: Some(Default::default()),
            ..Default::default()
        });
        family.spec.keys = Some(leasehold_crds::KeysSpec {
            read_write: Some(true),
            ..Default::default()
        });
        family.spec.permits = Some(16);
        let resolved = resolve(&family, &SecretValues::default()).unwrap();
        let config = resolved.family_config("pod").unwrap();
        assert!(config.read_write && config.permits == 16);
        family.spec.permits = Some(17);
        let error = resolve(&family, &SecretValues::default()).unwrap_err();
        assert!(error.to_string().contains("1 to 16 permits"), "{error}");
        family.spec.keys = Some(Default::default());
        let resolved = resolve(&family, &SecretValues::default()).unwrap();
        assert!(!resolved.family_config("pod").unwrap().read_write);
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("15s"), Some(Duration::from_secs(15)));
        assert_eq!(parse_go_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("500ms"), Some(Duration::from_millis(500)));
        for bad in ["", "15", "s", "1d", "1.2.3s"] {
            assert_eq!(parse_go_duration(bad), None, "{bad}");
        }
    }

    /// A resource's fields go into the config as values: a database name, a password or a
    /// prefix cannot add a path, a query option or another host, and a bad one is refused by
    /// its field's name.
    #[test]
    fn fields_are_values_never_url_text() {
        let secrets: SecretValues = [
            (
                ("db".into(), "password".into()),
                "%41?sslmode=disable#".into(),
            ),
            (("db".into(), "user".into()), "u@evil:1".into()),
        ]
        .into();
        let sql = lock(Backend {
            postgres: Some(SqlBackend {
                host: "pg.db".into(),
                database: "app/x?sslmode=disable".into(),
                user_secret_ref: Some(key("db", "user")),
                password_secret_ref: Some(key("db", "password")),
                ..Default::default()
            }),
            ..Default::default()
        });
        let backend = resolve(&sql, &secrets).unwrap().backend;
        let BackendUrl::Sql(SqlConfig { url, .. }) = &backend else {
            panic!("{backend}")
        };
        assert_eq!(url.host_str(), Some("pg.db"));
        assert_eq!(url.query(), None, "{url}");
        assert_eq!(url.path_segments().unwrap().count(), 1, "{url}");
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .unwrap()
                .into_owned()
        };
        assert_eq!(decode(url.path()), "/app/x?sslmode=disable");
        assert_eq!(decode(url.username()), "u@evil:1");
        assert_eq!(decode(url.password().unwrap()), "%41?sslmode=disable#");

        let redis = |change: fn(&mut RedisBackend)| {
            let mut redis = RedisBackend {
                endpoints: vec!["r:6379".into()],
                password_secret_ref: Some(key("db", "password")),
                ..Default::default()
            };
            change(&mut redis);
            resolve(
                &lock(Backend {
                    redis: Some(redis),
                    ..Default::default()
                }),
                &secrets,
            )
        };
        let BackendUrl::Redis(RedisConfig { url, .. }) = redis(|_| {}).unwrap().backend else {
            panic!("a single Redis")
        };
        assert_eq!(
            (url.host_str(), url.path(), url.query()),
            (Some("r"), "/", None)
        );
        for (change, field) in [
            (
                (|r| r.endpoints = vec!["r:6379/5".into()]) as fn(&mut RedisBackend),
                "endpoints",
            ),
            (|r| r.endpoints = vec!["u:p@r:6379".into()], "endpoints"),
            (|r| r.key_prefix = Some("a:b".into()), "keyPrefix"),
            (
                |r| r.endpoints = vec!["a:1".into(), "b:1".into(), "a:1".into()],
                "endpoints",
            ),
        ] {
            match redis(change) {
                Err(Error::InvalidConfig { field: f, reason }) => {
                    assert_eq!(f, field, "{reason}");
                    assert!(!reason.contains("%41"), "{reason}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
        let error = redis(|r| {
            r.sentinel = Some(leasehold_crds::RedisSentinel {
                master_name: "m".into(),
                username_secret_ref: Some(key("db", "user")),
                ..Default::default()
            })
        })
        .unwrap_err()
        .to_string();
        assert!(error.contains("needs the sentinels' password"), "{error}");
        assert!(redis(|r| r.endpoints = vec!["r:6379/".into()]).is_ok());

        // A connect string in one entry is several servers; credentials in one are refused.
        let zookeeper = |servers: &[&str]| {
            resolve(
                &lock(Backend {
                    zookeeper: Some(ZooKeeperBackend {
                        servers: servers.iter().map(|s| s.to_string()).collect(),
                        path: "/locks".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                &secrets,
            )
        };
        let BackendUrl::ZooKeeper(ZooKeeperConfig { servers, .. }) =
            zookeeper(&["z1:2181,z2", "z3"]).unwrap().backend
        else {
            panic!("ZooKeeper")
        };
        assert_eq!(servers, "z1:2181,z2:2181,z3:2181");
        let etcd = resolve(
            &lock(Backend {
                etcd: Some(EtcdBackend {
                    endpoints: vec!["u:p@e1:2379".into()],
                    ..Default::default()
                }),
                ..Default::default()
            }),
            &secrets,
        )
        .unwrap_err()
        .to_string();
        assert!(etcd.contains("credentials go in a Secret"), "{etcd}");
        for database in ["", ".", ".."] {
            let mut named = sql.clone();
            named.spec.backend.postgres.as_mut().unwrap().database = database.into();
            assert!(resolve(&named, &secrets).is_err(), "{database:?}");
        }
    }

    #[test]
    fn sql_with_secrets_encodes_them_and_never_shows_them() {
        let lock = lock(Backend {
            postgres: Some(SqlBackend {
                host: "pg.db".into(),
                port: Some(5433),
                database: "app".into(),
                lock_mode: SqlLockMode::RowLock,
                user_secret_ref: Some(key("pg", "user")),
                password_secret_ref: Some(key("pg", "password")),
                ..Default::default()
            }),
            ..Default::default()
        });
        let secrets: SecretValues = [
            (("pg".into(), "user".into()), "app".into()),
            (("pg".into(), "password".into()), "p@ss:w/rd?".into()),
        ]
        .into();
        let resolved = resolve(&lock, &secrets).unwrap();
        let BackendUrl::Sql(SqlConfig { url, mode, .. }) = &resolved.backend else {
            panic!("{:?}", resolved.backend)
        };
        assert_eq!(*mode, leasehold_lease::sql::SqlMode::RowLock);
        assert_eq!(url.host_str(), Some("pg.db"));
        assert_eq!(url.port(), Some(5433));
        assert_eq!(url.username(), "app");
        assert_eq!(
            percent_encoding::percent_decode_str(url.password().unwrap())
                .decode_utf8()
                .unwrap(),
            "p@ss:w/rd?"
        );
        assert!(!resolved.backend.to_string().contains("p@ss"));
        assert_eq!(resolved.lease_duration, Duration::from_secs(15));
        // No renewInterval: a third of the lease.
        assert_eq!(resolved.renew_interval, Duration::from_secs(5));
    }

    #[test]
    fn a_missing_secret_names_it() {
        let lock = lock(Backend {
            redis: Some(RedisBackend {
                endpoints: vec!["r:6379".into()],
                password_secret_ref: Some(key("redis", "password")),
                ..Default::default()
            }),
            ..Default::default()
        });
        let error = resolve(&lock, &SecretValues::new())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("\"redis\"") && error.contains("\"password\""),
            "{error}"
        );
    }

    #[test]
    fn a_secret_goes_only_to_the_servers_its_owner_allows() {
        let endpoints = [
            "redis.team.svc:6379".to_owned(),
            "[fd00::1]:6380".to_owned(),
        ];
        let allowed = |annotation: Option<&str>| {
            check_secret_allowed("redis-auth", annotation, &endpoints).map_err(|e| e.to_string())
        };
        for ok in [
            "*",
            "redis.team.svc, [fd00::1]",
            "REDIS.team.svc:6379,[fd00::1]:6380",
            "other:1,redis.team.svc,fd00::1",
        ] {
            assert_eq!(allowed(Some(ok)), Ok(()), "{ok}");
        }
        let unopened = allowed(None).unwrap_err();
        assert!(
            unopened.contains("\"redis-auth\" is not opened to Leasehold")
                && unopened.contains(ALLOWED_HOSTS_ANNOTATION),
            "{unopened}"
        );
        for refused in [
            "redis.team.svc",
            "redis.team.svc:6380,[fd00::1]",
            "",
            "redis",
        ] {
            let error = allowed(Some(refused)).unwrap_err();
            assert!(error.contains("may not be sent to"), "{refused}: {error}");
        }
    }

    /// A cluster's endpoints are its nodes, any number of them; the password never shows, and
    /// what a cluster cannot do is refused by name.
    #[test]
    fn a_cluster_resource_names_its_nodes() {
        let cluster = |change: fn(&mut RedisBackend)| {
            let mut redis = RedisBackend {
                endpoints: vec!["node-0:7000".into(), "node-1".into()],
                cluster: Some(true),
                key_prefix: Some("team".into()),
                password_secret_ref: Some(key("redis", "password")),
                ..Default::default()
            };
            change(&mut redis);
            lock(Backend {
                redis: Some(redis),
                ..Default::default()
            })
        };
        let secrets: SecretValues =
            [(("redis".into(), "password".into()), "p@ss/word".into())].into();
        let backend = resolve(&cluster(|_| {}), &secrets).unwrap().backend;
        let BackendUrl::RedisCluster(RedisClusterConfig { nodes, prefix, tls }) = &backend else {
            panic!("{backend}")
        };
        assert!(tls.is_none());
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[1].port(), Some(6379), "the default port");
        assert_eq!(nodes[0].password(), Some("p%40ss%2Fword"));
        assert_eq!(prefix, "team");
        assert_eq!(
            backend.to_string(),
            "redis+cluster://:***@node-0:7000,node-1:6379 (prefix team)"
        );
        let error = resolve(&cluster(|r| r.database = Some(3)), &secrets)
            .unwrap_err()
            .to_string();
        assert!(error.contains("only database 0"), "{error}");
        assert!(resolve(&cluster(|r| r.database = Some(0)), &secrets).is_ok());

        // Over TLS: every node is `rediss://`, with the CA from the Secret, never shown.
        let secrets: SecretValues = [
            (("redis".into(), "password".into()), "p@ss/word".into()),
            (("redis-ca".into(), "ca.crt".into()), "CA PEM".into()),
        ]
        .into();
        let backend = resolve(
            &cluster(|r| r.tls_secret_name = Some("redis-ca".into())),
            &secrets,
        )
        .unwrap()
        .backend;
        let BackendUrl::RedisCluster(RedisClusterConfig { nodes, tls, .. }) = &backend else {
            panic!("{backend}")
        };
        assert!(nodes.iter().all(|n| n.scheme() == "rediss"));
        assert!(
            tls.as_ref().and_then(|t| t.ca.clone())
                == Some(leasehold_lease::tls::Pem::Text("CA PEM".into())),
            "the Secret's CA"
        );
        let shown = backend.to_string();
        assert!(
            shown.starts_with("rediss+cluster://:***@node-0:7000"),
            "{shown}"
        );
        assert!(!shown.contains("CA PEM"), "{shown}");
        let system_roots = resolve(&cluster(|r| r.tls = Some(true)), &secrets)
            .unwrap()
            .backend;
        assert!(
            matches!(&system_roots, BackendUrl::RedisCluster(RedisClusterConfig { tls: Some(t), .. }) if t.ca.is_none()),
            "{system_roots}"
        );
    }

    /// The sentinels are the endpoints; the password and database are the master's, and the
    /// password never shows.
    #[test]
    fn a_sentinel_resource_names_the_sentinels_and_the_master() {
        let sentinel = lock(Backend {
            redis: Some(RedisBackend {
                endpoints: vec!["s-0:26379".into(), "s-1".into()],
                database: Some(2),
                password_secret_ref: Some(key("redis", "password")),
                sentinel: Some(leasehold_crds::RedisSentinel {
                    master_name: "locks".into(),
                    min_replicas: Some(2),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        let secrets: SecretValues =
            [(("redis".into(), "password".into()), "p@ss/word".into())].into();
        let backend = resolve(&sentinel, &secrets).unwrap().backend;
        let BackendUrl::RedisSentinel(config) = &backend else {
            panic!("{backend}")
        };
        assert_eq!(config.sentinels, ["s-0:26379", "s-1:26379"]);
        assert_eq!(config.master_name, "locks");
        assert_eq!(config.min_replicas, 2);
        assert_eq!(config.master.password(), Some("p%40ss%2Fword"));
        assert_eq!(config.master.path(), "/2");
        assert!(config.tls.is_none() && config.sentinel_auth.is_none());
        assert_eq!(
            backend.to_string(),
            "redis+sentinel://:***@s-0:26379,s-1:26379/locks/2 (prefix leasehold, min-replicas 2)"
        );
    }

    /// Tair over TLS from a `DistributedLock`: `tairs://` with the Secret's CA, never shown.
    #[test]
    fn a_tair_resource_over_tls() {
        let tair = lock(Backend {
            tair: Some(leasehold_crds::TairBackend {
                endpoint: "r-tair.example:6380".into(),
                tls_secret_name: Some("tair-ca".into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        assert!(optional_secret_refs(&tair).contains(&key("tair-ca", "ca.crt")));
        let secrets: SecretValues = [(("tair-ca".into(), "ca.crt".into()), "CA PEM".into())].into();
        let backend = resolve(&tair, &secrets).unwrap().backend;
        let BackendUrl::Tair(TairConfig { url, tls, .. }) = &backend else {
            panic!("{backend}")
        };
        assert_eq!(url.scheme(), "rediss");
        assert!(
            tls.as_ref().and_then(|t| t.ca.clone())
                == Some(leasehold_lease::tls::Pem::Text("CA PEM".into()))
        );
        assert_eq!(
            backend.to_string(),
            "tairs://r-tair.example:6380/ (prefix leasehold)"
        );
    }

    /// Over TLS, with the sentinels' own credentials from a Secret: both reach the driver, the
    /// CA from `tlsSecretName`, and neither password shows.
    #[test]
    fn a_sentinel_resource_over_tls_with_the_sentinels_credentials() {
        let sentinel = lock(Backend {
            redis: Some(RedisBackend {
                endpoints: vec!["s-0:26380".into()],
                password_secret_ref: Some(key("redis", "password")),
                tls_secret_name: Some("redis-ca".into()),
                sentinel: Some(leasehold_crds::RedisSentinel {
                    master_name: "locks".into(),
                    username_secret_ref: Some(key("sentinel", "username")),
                    password_secret_ref: Some(key("sentinel", "password")),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        let refs = secret_refs(&sentinel);
        assert!(
            refs.contains(&key("sentinel", "password"))
                && refs.contains(&key("sentinel", "username")),
            "the sentinels' Secret keys are read: {refs:?}"
        );
        let secrets: SecretValues = [
            (("redis".into(), "password".into()), "master-pw".into()),
            (("sentinel".into(), "username".into()), "watcher".into()),
            (("sentinel".into(), "password".into()), "s&ntinel=pw".into()),
            (("redis-ca".into(), "ca.crt".into()), "CA PEM".into()),
        ]
        .into();
        let backend = resolve(&sentinel, &secrets).unwrap().backend;
        let BackendUrl::RedisSentinel(config) = &backend else {
            panic!("{backend}")
        };
        assert_eq!(config.master.scheme(), "rediss");
        assert!(
            config.tls.as_ref().and_then(|t| t.ca.clone())
                == Some(leasehold_lease::tls::Pem::Text("CA PEM".into()))
        );
        let auth = config
            .sentinel_auth
            .as_ref()
            .expect("the sentinels' credentials");
        assert_eq!(
            (auth.username.as_str(), auth.password.as_str()),
            ("watcher", "s&ntinel=pw")
        );
        let shown = backend.to_string();
        assert!(
            shown.starts_with("rediss+sentinel://:***@s-0:26380/locks"),
            "{shown}"
        );
        assert!(
            !shown.contains("pw") && !shown.contains("CA PEM"),
            "{shown}"
        );
    }

    #[test]
    fn zookeeper_tls_comes_from_its_secret_and_needs_the_ca() {
        let zk = lock(Backend {
            zookeeper: Some(ZooKeeperBackend {
                servers: vec!["z:2281".into()],
                path: "/locks".into(),
                tls_secret_name: Some("zk-tls".into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        let keys: Vec<String> = optional_secret_refs(&zk)
            .into_iter()
            .map(|r| r.key)
            .collect();
        assert_eq!(keys, TLS_SECRET_KEYS.map(String::from));
        let pem = |key: &str, text: &str| (("zk-tls".to_owned(), key.to_owned()), text.to_owned());
        let full: SecretValues = [
            pem("ca.crt", "CA"),
            pem("tls.crt", "CERT"),
            pem("tls.key", "KEY"),
        ]
        .into();
        let resolved = resolve(&zk, &full).unwrap().backend;
        let BackendUrl::ZooKeeper(ZooKeeperConfig { tls: Some(tls), .. }) = &resolved else {
            panic!("no TLS: {resolved}")
        };
        assert!(tls.ca == Some(leasehold_lease::tls::Pem::Text("CA".into())));
        assert!(tls.client.is_some());
        assert!(resolved.to_string().starts_with("zks://z:2281/locks"));
        assert!(!resolved.to_string().contains("KEY"));
        let without_ca: SecretValues = [pem("tls.crt", "CERT"), pem("tls.key", "KEY")].into();
        let error = resolve(&zk, &without_ca).unwrap_err().to_string();
        assert!(error.contains("ca.crt"), "{error}");
    }

    #[test]
    fn three_redis_endpoints_are_redlock_and_zookeeper_digest_splits() {
        let redlock = lock(Backend {
            redis: Some(RedisBackend {
                endpoints: vec!["a:1".into(), "b:2".into(), "c:3".into()],
                key_prefix: Some("team".into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        let resolved = resolve(&redlock, &SecretValues::new()).unwrap();
        assert_eq!(resolved.backend.kind(), "redlock");
        let zk = lock(Backend {
            zookeeper: Some(ZooKeeperBackend {
                servers: vec!["z:2181".into()],
                path: "/locks".into(),
                auth_secret_ref: Some(key("zk", "digest")),
                tick_time: Some("500ms".into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        let secrets: SecretValues = [(("zk".into(), "digest".into()), "app:s3 cr+t".into())].into();
        let BackendUrl::ZooKeeper(ZooKeeperConfig {
            digest,
            root,
            tick_time,
            ..
        }) = resolve(&zk, &secrets).unwrap().backend
        else {
            panic!()
        };
        assert_eq!(digest, Some(("app".into(), "s3 cr+t".into())));
        assert_eq!(root, "/locks");
        assert_eq!(tick_time, Duration::from_millis(500));
    }

    #[test]
    fn the_kubernetes_backend_targets_its_lease_under_either_policy() {
        let mut lock = lock(Backend {
            kubernetes: Some(Default::default()),
            ..Default::default()
        });
        for policy in [
            leasehold_crds::CleanupPolicy::Retain,
            leasehold_crds::CleanupPolicy::Delete,
        ] {
            lock.spec.cleanup_policy = policy;
            let resolved = resolve(&lock, &SecretValues::new()).unwrap();
            assert_eq!(
                resolved.backend,
                BackendUrl::Kubernetes(KubernetesConfig {
                    namespace: Some("team".into()),
                    yield_to_preferred_holder: false,
                })
            );
            assert_eq!(resolved.lease.unwrap().name.as_deref(), Some("jobs"));
        }
        // Coordinated leader election, when the lock asks for it.
        if let Some(k) = lock.spec.backend.kubernetes.as_mut() {
            k.yield_to_preferred_holder = Some(true);
        }
        let resolved = resolve(&lock, &SecretValues::new()).unwrap();
        assert_eq!(
            resolved.backend.to_string(),
            "kubernetes://team?preferred-holder=yield"
        );
    }

    /// The TLS Secret's three keys are read like any other, their PEM text goes to the driver,
    /// and none of it shows in the URL's text.
    #[test]
    fn etcd_tls_comes_from_its_secret() {
        let lock = lock(Backend {
            etcd: Some(EtcdBackend {
                endpoints: vec!["e1:2379".into(), "e2:2379".into()],
                tls_secret_name: Some("etcd-client".into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        let refs = secret_refs(&lock);
        assert_eq!(
            refs,
            TLS_SECRET_KEYS.map(|k| key("etcd-client", k)).to_vec()
        );
        let mut secrets: SecretValues = refs
            .iter()
            .map(|r| ((r.name.clone(), r.key.clone()), format!("PEM OF {}", r.key)))
            .collect();
        let resolved = resolve(&lock, &secrets).unwrap();
        let BackendUrl::Etcd(EtcdConfig { endpoints, tls, .. }) = &resolved.backend else {
            panic!("not etcd: {}", resolved.backend)
        };
        assert_eq!(endpoints, &["e1:2379", "e2:2379"]);
        let text = |t: &str| leasehold_lease::tls::Pem::Text(t.into());
        assert!(tls.as_ref().is_some_and(|t| t.ca == text("PEM OF ca.crt")
            && t.client == Some((text("PEM OF tls.crt"), text("PEM OF tls.key")))));
        let shown = resolved.backend.to_string();
        assert_eq!(shown, "etcds://e1:2379,e2:2379?prefix=leasehold");

        secrets.remove(&("etcd-client".into(), "tls.key".into()));
        let e = resolve(&lock, &secrets).unwrap_err().to_string();
        assert!(e.contains("tls.key"), "{e}");
    }

    #[test]
    fn redis_tls_comes_from_the_flag_and_the_secret() {
        let mut redis = RedisBackend {
            endpoints: vec!["r:6379".into()],
            tls: Some(true),
            ..Default::default()
        };
        let resolved = resolve(
            &lock(Backend {
                redis: Some(redis.clone()),
                ..Default::default()
            }),
            &SecretValues::new(),
        )
        .unwrap();
        let BackendUrl::Redis(RedisConfig { url, tls, .. }) = &resolved.backend else {
            panic!("{}", resolved.backend)
        };
        assert_eq!(url.scheme(), "rediss");
        assert!(
            tls.as_ref()
                .is_some_and(|t| t.ca.is_none() && t.client.is_none())
        );

        redis.tls = None;
        redis.tls_secret_name = Some("redis-tls".into());
        redis.endpoints = vec!["a:1".into(), "b:1".into(), "c:1".into()];
        let lock = lock(Backend {
            redis: Some(redis),
            ..Default::default()
        });
        let optional: Vec<String> = optional_secret_refs(&lock)
            .into_iter()
            .map(|r| r.key)
            .collect();
        assert_eq!(optional, TLS_SECRET_KEYS);
        let ca_only: SecretValues =
            [(("redis-tls".into(), "ca.crt".into()), "CA PEM".into())].into();
        let BackendUrl::Redlock(RedlockConfig { tls, masters, .. }) =
            resolve(&lock, &ca_only).unwrap().backend
        else {
            panic!()
        };
        assert!(masters.iter().all(|m| m.scheme() == "rediss"));
        let tls = tls.unwrap();
        assert!(
            tls.ca == Some(leasehold_lease::tls::Pem::Text("CA PEM".into()))
                && tls.client.is_none()
        );
        let half: SecretValues = [(("redis-tls".into(), "tls.crt".into()), "CERT".into())].into();
        let e = resolve(&lock, &half).unwrap_err().to_string();
        assert!(e.contains("tls.crt and tls.key"), "{e}");
    }

    #[test]
    fn sql_tls_verifies_the_server_in_each_dialect() {
        for (postgres, wanted) in [
            (true, "sslmode=verify-full"),
            (false, "ssl-mode=VERIFY_IDENTITY"),
        ] {
            let sql = leasehold_crds::SqlBackend {
                host: "db".into(),
                database: "app".into(),
                tls: Some(true),
                ..Default::default()
            };
            let backend = if postgres {
                Backend {
                    postgres: Some(sql),
                    ..Default::default()
                }
            } else {
                Backend {
                    mysql: Some(sql),
                    ..Default::default()
                }
            };
            let shown = resolve(&lock(backend), &SecretValues::new())
                .unwrap()
                .backend
                .to_string();
            assert!(shown.contains(wanted), "{shown}");
        }
    }
}
