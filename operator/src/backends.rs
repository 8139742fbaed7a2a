//! One open driver per backend, shared by the locks that name it and reused across
//! reconciliations while a lock's backend stays the same, and the three things the operator
//! asks of it: provision, observe, clean up. Every call is bounded, so an unresponsive backend
//! delays only its own locks. Secrets are read through a short-lived cache: thousands of locks
//! naming one password Secret cost one read of it per [`SECRET_TTL`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;

use kube::ResourceExt;
use leasehold_crds::DistributedLock;
use leasehold_lease::kubernetes::LOCK_ANNOTATION;
use leasehold_lease::{Backend, BackendUrl, Error};
use leasehold_resource::{self as resource, ResolvedLock};

use crate::status::Observation;

/// How long one backend call may take before the lock is reported unreachable.
pub const BACKEND_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a provisioning holds before it is done again (it also repairs what was removed by
/// hand: a dropped table, a deleted znode or Lease).
pub const PROVISION_EVERY: Duration = Duration::from_secs(300);

/// How long a family's count of held keys stands before it is counted again: counting may
/// walk the backend's whole keyspace (Redis's `SCAN`), too much for every resync.
pub const HELD_KEYS_EVERY: Duration = Duration::from_secs(60);

/// How long a Secret read for a lock serves the other locks that name it, and its next
/// reconciliations. A rotated password reaches the operator within this (the sidecars read their
/// Secrets on their own).
pub const SECRET_TTL: Duration = Duration::from_secs(60);

/// A lock's driver, the backend it was opened for, when it last provisioned which spec, and a
/// family's last count of held keys.
struct OpenDriver {
    backend: DriverKey,
    driver: Arc<dyn Backend>,
    /// The shared driver's failures (none for a Kubernetes-backed lock's own driver).
    failure: Option<Failure>,
    provisioned: Option<(Option<i64>, std::time::Instant)>,
    held_keys: Option<(Option<u64>, std::time::Instant)>,
}

/// What keeps a lock's records in the backend at its deletion.
#[derive(Debug, Clone, PartialEq)]
pub enum StillHeld {
    /// The lock's holder; `None` while the backend cannot name it yet.
    Lock(Option<leasehold_lease::Holding>),
    /// How many keys of a family are held.
    Keys(u64),
    /// How many of a lock's permits above permit 0 are held.
    Permits(u64),
}

#[derive(Default)]
pub struct Backends {
    open: Mutex<HashMap<String, OpenDriver>>,
    /// The drivers open, by backend, for the locks that name the same one: a connection (or
    /// pool, or session) per backend rather than per lock, as ZooKeeper's 60 connections per
    /// client address and the SQL servers' connection limits require. Kept while a lock's
    /// [`OpenDriver`] holds it.
    shared: Mutex<Vec<SharedDriver>>,
    /// Secrets read lately, by namespace and name, with when.
    secrets: SecretCache,
}

/// What locks must have in common to share a driver: the backend (with its credentials), and
/// on ZooKeeper the lease, since its session lasts one lease and is the driver's.
#[derive(Clone, PartialEq)]
struct DriverKey {
    url: BackendUrl,
    lease: Option<Duration>,
}

impl DriverKey {
    fn of(resolved: &ResolvedLock) -> Self {
        let lease =
            matches!(resolved.backend, BackendUrl::ZooKeeper(_)).then_some(resolved.lease_duration);
        Self {
            url: resolved.backend.clone(),
            lease,
        }
    }
}

/// One backend's driver as its locks share it. It is opened by one lock at a time: the locks
/// that come meanwhile (the first reconcile of many, after a restart) wait for it rather than
/// each open one of their own. A backend that a lock found unreachable (or slow past
/// [`BACKEND_TIMEOUT`]) is reported so for its other locks at once, for [`FAILURE_STANDS`]:
/// each would otherwise wait out the timeout, and a down backend's locks would hold every
/// reconcile slot, deletions on healthy backends waiting behind them.
struct SharedDriver {
    key: DriverKey,
    driver: DriverSlot,
    failure: Failure,
}

/// Where a shared driver is kept while any lock keeps it, opened under its lock.
type DriverSlot = Arc<tokio::sync::Mutex<Option<Weak<dyn Backend>>>>;

/// The last failure any of a backend's locks met there, with when.
type Failure = Arc<Mutex<Option<(Instant, Error)>>>;

/// How long a backend's failure answers for its other locks.
pub const FAILURE_STANDS: Duration = Duration::from_secs(5);

/// The failure still standing, if any.
fn standing(failure: &Failure) -> Option<Error> {
    failure
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .filter(|(at, _)| at.elapsed() < FAILURE_STANDS)
        .map(|(_, error)| error.clone())
}

/// Keep what a call met: a failure of reach or time stands for the backend's other locks, and
/// a success clears it.
fn note<T>(failure: &Failure, outcome: &leasehold_lease::Result<T>) {
    let mut slot = failure.lock().unwrap_or_else(|e| e.into_inner());
    match outcome {
        Ok(_) => *slot = None,
        Err(e @ (Error::Unreachable(_) | Error::Timeout(_))) => {
            *slot = Some((Instant::now(), e.clone()));
        }
        Err(_) => {}
    }
}

/// A Secret by namespace and name.
type SecretName = (String, String);

/// Secrets read lately, each kept for [`SECRET_TTL`].
#[derive(Default)]
pub struct SecretCache {
    client: Mutex<Option<kube::Client>>,
    read: Mutex<HashMap<SecretName, (Option<Secret>, Instant)>>,
}

impl SecretCache {
    fn with_client(&self, client: &kube::Client) -> &Self {
        let mut current = self.client.lock().unwrap_or_else(|e| e.into_inner());
        if current.is_none() {
            *current = Some(client.clone());
        }
        self
    }

    fn forget_old(&self) {
        self.read
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, (_, at)| at.elapsed() < SECRET_TTL);
    }
}

impl resource::SecretSource for SecretCache {
    async fn secret(
        &self,
        namespace: &str,
        name: &str,
    ) -> std::result::Result<Option<Secret>, kube::Error> {
        let key = (namespace.to_owned(), name.to_owned());
        if let Some((secret, at)) = self
            .read
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            && at.elapsed() < SECRET_TTL
        {
            return Ok(secret.clone());
        }
        let client = self
            .client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .expect("the cache is given its client before it is read");
        let secret = client.secret(namespace, name).await?;
        // A missing Secret is not kept: the one created next is read at the next try.
        if secret.is_some() {
            self.read
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key, (secret.clone(), Instant::now()));
        }
        Ok(secret)
    }
}

fn key(lock: &DistributedLock) -> String {
    format!(
        "{}/{}",
        lock.namespace().unwrap_or_default(),
        lock.name_any()
    )
}

async fn bounded<T>(
    what: impl Future<Output = leasehold_lease::Result<T>>,
) -> leasehold_lease::Result<T> {
    tokio::time::timeout(BACKEND_TIMEOUT, what)
        .await
        .unwrap_or(Err(Error::Timeout(BACKEND_TIMEOUT)))
}

/// How many records named under `resolved`'s name as a family names its keys are held (a
/// family's keys, a lock's permits above 0), for a clean-up to wait for. Every driver counts
/// today; a backend that could not is an error (`what` says what it could not count), as
/// deleting those records would take them from under their holders.
async fn held_under(
    driver: &dyn Backend,
    resolved: &ResolvedLock,
    what: &str,
) -> leasehold_lease::Result<u64> {
    bounded(driver.count_held_keys(&resolved.name))
        .await?
        .ok_or_else(|| Error::InvalidConfig {
            field: "cleanupPolicy",
            reason: format!(
                "the {} backend cannot count {what}, so their records are kept",
                resolved.backend.kind()
            ),
        })
}

/// A condition reason for a lease-engine error.
pub fn reason(error: &Error) -> &'static str {
    match error {
        Error::Unreachable(_) => "Unreachable",
        Error::Timeout(_) => "Timeout",
        Error::Backend(_) => "BackendError",
        Error::InvalidUrl { .. } | Error::InvalidName { .. } | Error::InvalidConfig { .. } => {
            "InvalidSpec"
        }
        Error::Shutdown => "ShuttingDown",
    }
}

impl Backends {
    /// The lock's configuration, with its Secrets read (through the cache).
    pub async fn resolve(
        &self,
        client: &kube::Client,
        lock: &DistributedLock,
    ) -> leasehold_lease::Result<ResolvedLock> {
        self.secrets.forget_old();
        // A short name would reach another server from here than from the lock's pods (and
        // the lock's Secrets with it): refused before anything is read or sent.
        let own = client.default_namespace();
        if let Some(namespace) = lock.metadata.namespace.as_deref().filter(|ns| *ns != own) {
            let short = resource::short_endpoints(lock);
            if let Some(endpoint) = short.first() {
                // A short name has no IPv6 address's colons: a port follows the first one.
                let qualified = match endpoint.split_once(':') {
                    Some((host, port)) => format!("{host}.{namespace}:{port}"),
                    None => format!("{endpoint}.{namespace}"),
                };
                return Err(leasehold_lease::Error::InvalidConfig {
                    field: "backend",
                    reason: format!(
                        "{endpoint:?} names its server by a short name, which the lock's pods resolve in namespace {namespace} and the operator in its own ({own}); write the name with its namespace ({qualified:?} for a Service) or in full"
                    ),
                });
            }
        }
        let source = self.secrets.with_client(client);
        let secrets = bounded(resource::read_secrets(source, lock)).await?;
        resource::resolve(lock, &secrets)
    }

    /// How many backend drivers are open for all the locks (several locks on one backend
    /// share one; a Kubernetes-backed lock's is its own, over the shared API client).
    pub fn drivers_open(&self) -> usize {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let mut distinct: Vec<*const ()> = open
            .values()
            .map(|o| Arc::as_ptr(&o.driver) as *const ())
            .collect();
        distinct.sort();
        distinct.dedup();
        distinct.len()
    }

    /// The shared driver's place for `key`, made if there is none.
    fn shared_entry(&self, key: &DriverKey) -> (DriverSlot, Failure) {
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        // Places nobody uses: no lock keeps the driver, nobody opens it, no failure stands.
        shared.retain(|entry| {
            Arc::strong_count(&entry.driver) > 1
                || entry.driver.try_lock().map_or(true, |driver| {
                    driver.as_ref().is_some_and(|d| d.strong_count() > 0)
                })
                || standing(&entry.failure).is_some()
        });
        if let Some(entry) = shared.iter().find(|entry| &entry.key == key) {
            return (entry.driver.clone(), entry.failure.clone());
        }
        let entry = SharedDriver {
            key: key.clone(),
            driver: Arc::default(),
            failure: Arc::default(),
        };
        let found = (entry.driver.clone(), entry.failure.clone());
        shared.push(entry);
        found
    }

    /// The driver for `resolved`: the lock's own while its backend stays the same, else the one
    /// its backend's other locks share, else one opened now; with the shared driver's failures.
    async fn driver(
        &self,
        client: &kube::Client,
        lock: &DistributedLock,
        resolved: &ResolvedLock,
    ) -> leasehold_lease::Result<(Arc<dyn Backend>, Option<Failure>)> {
        let key = key(lock);
        let backend = DriverKey::of(resolved);
        if let Some(open) = self
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            && open.backend == backend
        {
            return Ok((open.driver.clone(), open.failure.clone()));
        }
        // A Kubernetes-backed lock's driver is bound to its Lease; every other is the backend's.
        let (driver, failure) = if matches!(resolved.backend, BackendUrl::Kubernetes(_)) {
            (bounded(resource::open(client, resolved)).await?, None)
        } else {
            let (slot, failure) = self.shared_entry(&backend);
            if let Some(error) = standing(&failure) {
                return Err(error);
            }
            let mut slot = slot.lock().await;
            let driver = match slot.as_ref().and_then(Weak::upgrade) {
                Some(driver) => driver,
                None => {
                    let opened = bounded(resource::open(client, resolved)).await;
                    note(&failure, &opened);
                    let driver = opened?;
                    *slot = Some(Arc::downgrade(&driver));
                    driver
                }
            };
            (driver, Some(failure))
        };
        self.open.lock().unwrap_or_else(|e| e.into_inner()).insert(
            key,
            OpenDriver {
                backend,
                driver: driver.clone(),
                failure: failure.clone(),
                provisioned: None,
                held_keys: None,
            },
        );
        Ok((driver, failure))
    }

    /// Whether the lock's backend was provisioned for its current spec less than
    /// [`PROVISION_EVERY`] ago.
    fn provisioned(&self, lock: &DistributedLock) -> bool {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key(lock))
            .and_then(|open| open.provisioned)
            .is_some_and(|(generation, at)| {
                generation == lock.metadata.generation && at.elapsed() < PROVISION_EVERY
            })
    }

    fn mark_provisioned(&self, lock: &DistributedLock, done: bool) {
        if let Some(open) = self
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&key(lock))
        {
            open.provisioned = done.then(|| (lock.metadata.generation, std::time::Instant::now()));
        }
    }

    /// A family's count of held keys made less than [`HELD_KEYS_EVERY`] ago.
    fn held_keys_counted(&self, lock: &DistributedLock) -> Option<Option<u64>> {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key(lock))
            .and_then(|open| open.held_keys)
            .filter(|(_, at)| at.elapsed() < HELD_KEYS_EVERY)
            .map(|(counted, _)| counted)
    }

    fn mark_held_keys(&self, lock: &DistributedLock, counted: Option<u64>) {
        if let Some(open) = self
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&key(lock))
        {
            open.held_keys = Some((counted, std::time::Instant::now()));
        }
    }

    /// Provision the lock's backend and read its holder.
    pub async fn observe(
        &self,
        client: &kube::Client,
        lock: &DistributedLock,
    ) -> (String, Observation) {
        let resolved = match self.resolve(client, lock).await {
            Ok(resolved) => resolved,
            Err(e) => {
                let kind = lock.spec.backend.kind().unwrap_or("unknown").to_owned();
                // The API server's trouble (a Secret that cannot be read now) is not the
                // backend's: it gets a reason of its own.
                let observation = match e {
                    Error::InvalidConfig { .. }
                    | Error::InvalidUrl { .. }
                    | Error::InvalidName { .. } => failed(&e),
                    _ => Observation::Failed {
                        reason: "SecretUnreadable",
                        message: e.to_string(),
                    },
                };
                return (kind, observation);
            }
        };
        let kind = resolved.backend.kind().to_owned();
        let mut failure = None;
        let outcome = async {
            let (driver, shared_failure) = self.driver(client, lock, &resolved).await?;
            failure = shared_failure;
            if let Some(error) = failure.as_ref().and_then(standing) {
                return Err(error);
            }
            // A family's keys come and go at run time: provisioning makes what they share (the
            // table, the parent node), and nothing is seeded or created under the family's name.
            let family = resolved.keys.is_some();
            // The holder as provisioning read it, where it did (one read of a Lease, not two).
            let mut seen = leasehold_lease::Provisioned::Unread;
            if !self.provisioned(lock) {
                if family {
                    bounded(driver.provision(&[])).await?;
                } else {
                    seen = bounded(driver.provision_one(&resolved.name)).await?;
                }
                self.mark_provisioned(lock, true);
            }
            // For a family this read is the health check only: no key is named after it.
            let holder = match seen {
                leasehold_lease::Provisioned::Read(holder) => Ok(holder),
                leasehold_lease::Provisioned::Unread => {
                    bounded(driver.observe(&resolved.name)).await
                }
            }
            .map(|holder| holder.filter(|_| !family));
            // A backend that fails is provisioned again at the next look: what failed may be
            // what provisioning makes.
            if holder.is_err() {
                self.mark_provisioned(lock, false);
            }
            let holder = holder?;
            let mut warnings = bounded(driver.warnings()).await.unwrap_or_default();
            // Counting reads more than a lock's health needs (Redis's SCAN, which a user may
            // not be allowed): a failure is a warning, not an unusable backend. A lock's
            // permits above 0 are named as a family named after it names its keys, and counted
            // the same way.
            let several_permits = resource::has_had_permits(lock);
            let counted = if !family && !several_permits {
                None
            } else if let Some(counted) = self.held_keys_counted(lock) {
                counted
            } else {
                match bounded(driver.count_held_keys(&resolved.name)).await {
                    Ok(counted) => {
                        self.mark_held_keys(lock, counted);
                        counted
                    }
                    Err(e) => {
                        let what = match family {
                            true => "the family's held keys",
                            false => "the lock's held permits",
                        };
                        warnings.push(format!("{what} could not be counted: {e}"));
                        None
                    }
                }
            };
            // Once lowered to one permit, the higher ones are counted until none is held.
            let (held_keys, held_permits) = match several_permits {
                false => (counted, None),
                true if resolved.permits == 1 && counted == Some(0) => (None, None),
                true => (None, counted.map(|n| n + u64::from(holder.is_some()))),
            };
            Ok::<_, Error>(Observation::Ready {
                holder,
                held_keys,
                held_permits,
                warnings,
            })
        }
        .await;
        if let Some(failure) = &failure {
            note(failure, &outcome);
        }
        (kind, outcome.unwrap_or_else(|e| failed(&e)))
    }

    /// Who holds the family `lock`'s backend locks `names` now (a key's permits): the holdings
    /// found. What a force-release of a key looks at.
    pub async fn observe_key(
        &self,
        client: &kube::Client,
        lock: &DistributedLock,
        names: &[String],
    ) -> leasehold_lease::Result<Vec<leasehold_lease::Holding>> {
        let resolved = self.resolve(client, lock).await?;
        let (driver, _) = self.driver(client, lock, &resolved).await?;
        // All at once: a semaphore's permits, each within the backend's time.
        let read = futures_util::future::join_all(names.iter().map(|name| {
            let driver = driver.clone();
            async move { bounded(driver.observe(name)).await }
        }))
        .await;
        read.into_iter().filter_map(Result::transpose).collect()
    }

    /// Remove the lock's artifacts from its backend while holding the lock (see
    /// [`leasehold_lease::delete_records`]), and forget its driver: `Ok(Some(kept))`, with
    /// nothing removed, while another holds it.
    ///
    /// A family of keyed locks has no lock of its own to take: its keys' records go once none
    /// of them is held, above what keeps their tokens rising (a floor or counter per family),
    /// as the sidecars' idle-key sweeps delete them. A key taken meanwhile by a client that does
    /// not follow the resource keeps its record.
    pub async fn clean_up(
        &self,
        client: &kube::Client,
        lock: &DistributedLock,
    ) -> leasehold_lease::Result<Option<StillHeld>> {
        let resolved = self.resolve(client, lock).await?;
        let (driver, _) = self.driver(client, lock, &resolved).await?;
        if resolved.keys.is_some() {
            match held_under(&*driver, &resolved, "a family's held keys").await? {
                0 => bounded(driver.forget_idle_keys(&resolved.name, Duration::ZERO)).await?,
                held => return Ok(Some(StillHeld::Keys(held))),
            };
        } else {
            // A lock of several permits: its permits above 0 are kept while any is held, and
            // go as a family's idle keys do once permit 0's records have gone.
            let several_permits = resource::has_had_permits(lock);
            if several_permits {
                match held_under(&*driver, &resolved, "a lock's held permits").await? {
                    0 => {}
                    held => return Ok(Some(StillHeld::Permits(held))),
                }
            }
            let held = bounded(leasehold_lease::delete_records(
                &*driver,
                &resolved.name,
                resolved.lease_duration,
            ))
            .await?;
            if let Some(holder) = held {
                return Ok(Some(StillHeld::Lock(holder)));
            }
            if several_permits {
                bounded(driver.forget_idle_keys(&resolved.name, Duration::ZERO)).await?;
            }
        }
        self.forget(lock);
        Ok(None)
    }

    /// On the Kubernetes backend, cut the lock's Lease loose from the lock, which an earlier
    /// version made its owner: the garbage collector would delete an owned Lease, holder and
    /// token history with it, while holders still claim the lock (a foreground deletion takes
    /// dependents before the finalizer has run) or once the lock goes without a clean-up. No
    /// Lease is given an owner now; this is done before a lock is let go (provisioning does the
    /// same in the driver, with the read that tells the holder). The Lease is annotated with its
    /// lock's name ([`LOCK_ANNOTATION`]) at the same time.
    pub async fn disown_lease(
        &self,
        client: &kube::Client,
        lock: &DistributedLock,
    ) -> leasehold_lease::Result<()> {
        let Some(kubernetes) = &lock.spec.backend.kubernetes else {
            return Ok(());
        };
        let namespace = lock.namespace().unwrap_or_default();
        let name = kubernetes
            .lease_name
            .clone()
            .unwrap_or_else(|| lock.name_any());
        let api: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
            kube::Api::namespaced(client.clone(), &namespace);
        let unreachable =
            |e: kube::Error| Error::Unreachable(format!("Lease {namespace}/{name}: {e}"));
        for _ in 0..3 {
            let Some(mut lease) =
                bounded(async { api.get_opt(&name).await.map_err(unreachable) }).await?
            else {
                return Ok(());
            };
            // Another program's Lease is not Leasehold's to write (the driver refuses it too).
            let (label, value) = leasehold_lease::kubernetes::MANAGED_BY_LABEL;
            if lease
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(label))
                .map(String::as_str)
                != Some(value)
            {
                return Ok(());
            }
            let uid = lock.metadata.uid.as_deref();
            let owners = lease.metadata.owner_references.take().unwrap_or_default();
            let kept: Vec<_> = owners
                .iter()
                .filter(|o| Some(o.uid.as_str()) != uid)
                .cloned()
                .collect();
            // The annotation the operator maps the Lease's holder changes by, where an earlier
            // version mapped them by the owner.
            let name_of_lock = lock.name_any();
            let annotations = lease
                .metadata
                .annotations
                .get_or_insert_with(Default::default);
            let annotated = annotations.get(LOCK_ANNOTATION) == Some(&name_of_lock);
            if kept.len() == owners.len() && annotated {
                return Ok(());
            }
            annotations.insert(LOCK_ANNOTATION.to_owned(), name_of_lock);
            lease.metadata.owner_references = (!kept.is_empty()).then_some(kept);
            let replaced = bounded(async {
                match api.replace(&name, &Default::default(), &lease).await {
                    Ok(_) => Ok(true),
                    // Renewed meanwhile: read it again.
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) => Err(unreachable(e)),
                }
            })
            .await?;
            if replaced {
                return Ok(());
            }
        }
        Err(Error::Backend(format!(
            "the Lease {namespace}/{name} kept changing; it is still owned by its lock"
        )))
    }

    pub fn forget(&self, lock: &DistributedLock) {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key(lock));
    }

    /// Forget the backends of locks that are gone from `namespace` (`None`: from every
    /// namespace), `locks` being all that are left there: a lock without a finalizer
    /// (`cleanupPolicy: Retain`) is deleted without a last reconcile that would forget it.
    pub fn forget_all_but(
        &self,
        namespace: Option<&str>,
        locks: &[std::sync::Arc<DistributedLock>],
    ) {
        let alive: std::collections::HashSet<String> = locks.iter().map(|lock| key(lock)).collect();
        let within = |lock: &str| {
            namespace.is_none_or(|ns| lock.split_once('/').is_some_and(|(of, _)| of == ns))
        };
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|lock, _| !within(lock) || alive.contains(lock));
    }
}

fn failed(error: &Error) -> Observation {
    Observation::Failed {
        reason: reason(error),
        message: error.to_string(),
    }
}
