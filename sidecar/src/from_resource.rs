//! `--resource NAMESPACE/NAME`: the lock's configuration comes from its `DistributedLock` and
//! the Secrets it references, and follows the resource. When the spec changes, the sidecar
//! starts the lock anew with the new settings, swaps it in, and only then releases the old
//! lease, so `/lock` always answers. A change that cannot be applied (a bad spec, a missing
//! Secret) is logged and the lock keeps running as it was.
//!
//! The backend itself is immutable (a CEL transition rule refuses the edit). Should a sidecar
//! still see it change (a CRD installed without the rule), it stops claiming on the old backend
//! first and campaigns on the new one only after the old lease and a renew interval have
//! passed, so this pod never holds both; a holder elsewhere that has not yet seen the change
//! can still overlap with it, which is why the API server refuses the edit.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use leasehold_crds::DistributedLock;
use leasehold_lease::Lock;
use leasehold_lease::keyed::KeyedFamily;
use leasehold_resource::{self as resource, ResolvedLock};
use tokio::time::sleep_until;

use crate::api::{AppState, LetGo};
use crate::metrics::Metrics;

/// A `DistributedLock` named on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ResourceRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl std::str::FromStr for ResourceRef {
    type Err = String;
    fn from_str(raw: &str) -> Result<Self, String> {
        let (namespace, name) = raw
            .split_once('/')
            .ok_or("expected NAMESPACE/NAME, e.g. default/jobs")?;
        leasehold_lease::names::validate_namespace(namespace).map_err(|e| e.to_string())?;
        leasehold_lease::names::validate_lease_name(name).map_err(|e| e.to_string())?;
        Ok(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

async fn read(
    secrets: &resource::CachedSecrets,
    lock: &DistributedLock,
) -> Result<ResolvedLock, String> {
    let secrets = resource::read_secrets(secrets, lock)
        .await
        .map_err(|e| e.to_string())?;
    resource::resolve(lock, &secrets).map_err(|e| e.to_string())
}

/// What a resource runs in this sidecar: one lock, or a family of keyed locks (`spec.keys`).
#[derive(Clone)]
pub enum Running {
    Lock(Lock),
    Family(KeyedFamily),
}

async fn open(
    client: &kube::Client,
    resolved: &ResolvedLock,
) -> Result<Arc<dyn leasehold_lease::Backend>, String> {
    resource::open(client, resolved)
        .await
        .map_err(|e| format!("cannot open backend {}: {e}", resolved.backend))
}

/// [`open`], with its connection opened at once rather than on the first request.
async fn open_early(
    client: &kube::Client,
    resolved: &ResolvedLock,
) -> Result<Arc<dyn leasehold_lease::Backend>, String> {
    let driver = open(client, resolved).await?;
    crate::run::open_connection_early(&driver);
    Ok(driver)
}

async fn start(
    client: &kube::Client,
    resolved: &ResolvedLock,
    identity: &str,
    metrics: &Arc<Metrics>,
    state: &AppState,
) -> Result<Running, String> {
    let driver = open_early(client, resolved).await?;
    match resolved.family_config(identity) {
        Some(family) => KeyedFamily::new(driver, family, metrics.clone())
            .map(Running::Family)
            .map_err(|e| e.to_string()),
        None => start_lock_on(driver, resolved, identity, metrics, state).map(Running::Lock),
    }
}

async fn start_lock(
    client: &kube::Client,
    resolved: &ResolvedLock,
    identity: &str,
    metrics: &Arc<Metrics>,
    state: &AppState,
) -> Result<Lock, String> {
    start_lock_on(
        open_early(client, resolved).await?,
        resolved,
        identity,
        metrics,
        state,
    )
}

/// A lock put in place follows the app's health as it is now: the health check may have
/// found the app unhealthy, or healthy again, after the lock was started (sitting out or not)
/// and before it was put where the check finds the locks.
async fn follow_app_health(state: &AppState, lock: &Lock) {
    let _turn = state.app_health_turn().await;
    match state.app_unhealthy() {
        Some(reason) => {
            let _ = lock.sit_out(&reason).await;
        }
        None if lock.snapshot().sitting_out.is_some() => {
            let _ = lock.come_back().await;
        }
        None => {}
    }
}

/// A lock put in place while the app is unhealthy starts sitting out, as the others do.
fn start_lock_on(
    driver: Arc<dyn leasehold_lease::Backend>,
    resolved: &ResolvedLock,
    identity: &str,
    metrics: &Arc<Metrics>,
    state: &AppState,
) -> Result<Lock, String> {
    metrics.register_lock(&resolved.name);
    let config = leasehold_lease::LockConfig {
        sitting_out: state.app_unhealthy(),
        ..resolved.lock_config(identity)
    };
    Lock::start(driver, config, metrics.clone()).map_err(|e| e.to_string())
}

/// A driver with `resolved`'s credentials that the backend accepted: new credentials replace
/// running ones only once they work.
async fn open_checked(
    client: &kube::Client,
    resolved: &ResolvedLock,
) -> Result<Arc<dyn leasehold_lease::Backend>, String> {
    let driver = open(client, resolved).await?;
    match tokio::time::timeout(Duration::from_secs(5), driver.ping()).await {
        Ok(Ok(())) => Ok(driver),
        Ok(Err(e)) => Err(format!("the backend refused them: {e}")),
        Err(_) => Err("the backend did not answer within 5 s".into()),
    }
}

/// Stop claiming: the lock's lease, or every key of the family, is released.
async fn step_down(state: &AppState, current: &ResolvedLock) {
    // The pod's apps run on: what they were told holds until it runs out.
    let locks: Vec<Lock> = state
        .locks()
        .into_iter()
        .filter(|l| l.name() == current.name)
        .collect();
    let families: Vec<KeyedFamily> = state
        .families()
        .into_iter()
        .filter(|f| f.name() == current.name)
        .collect();
    state
        .let_go(&locks, &families, LetGo::ResourceDeleted)
        .await;
}

/// Read `lock`'s Secrets and start what it declares. The error is the reason to answer with
/// until it can be started.
async fn start_resource(
    client: &kube::Client,
    secrets: &resource::CachedSecrets,
    lock: &DistributedLock,
    identity: &str,
    metrics: &Arc<Metrics>,
    state: &AppState,
) -> Result<(ResolvedLock, Running), String> {
    let resolved = read(secrets, lock).await?;
    let running = start(client, &resolved, identity, metrics, state).await?;
    Ok((resolved, running))
}

/// How soon a resource that could not be started (a Secret missing, the backend not reached)
/// is tried again, doubling up to [`START_RETRY_MAX`]. A resource created or edited meanwhile
/// is tried at once.
const START_RETRY_MIN: Duration = Duration::from_secs(1);
const START_RETRY_MAX: Duration = Duration::from_secs(30);

/// How often a running lock's Secrets are read again by default, so that a rotated password or
/// certificate (External Secrets, Vault, cert-manager) reaches the backend connections before
/// the old one is revoked.
pub const SECRET_RECHECK: Duration = Duration::from_secs(30);

/// Whether `lock` takes anything from a Secret.
fn references_secrets(lock: &DistributedLock) -> bool {
    !resource::secret_refs(lock).is_empty() || !resource::optional_secret_refs(lock).is_empty()
}

/// Follow one resource until the process ends: start its lock (or family) once the resource
/// exists and its Secrets and backend can be used, until then answering 503 with the reason;
/// then replace the lock in `state` on spec changes, and on a change of the Secrets it
/// references, read again every `secret_recheck`: a lock is restarted with the new credentials
/// (the spec change's hand-over), a family takes its next keys with them while the keys held
/// keep theirs.
pub async fn follow(
    client: kube::Client,
    r: ResourceRef,
    identity: String,
    state: AppState,
    metrics: Arc<Metrics>,
    secret_recheck: Duration,
    holder_label: Result<tokio::sync::watch::Sender<bool>, String>,
) {
    let api: Api<DistributedLock> = Api::namespaced(client.clone(), &r.namespace);
    // The re-check every `secret_recheck`, in every pod of the lock, reads the API server's
    // cache, and etcd only when a Secret changed.
    let secrets = resource::CachedSecrets::new(client.clone());
    let config = watcher::Config::default().fields(&format!("metadata.name={}", r.name));
    let mut changes = std::pin::pin!(watcher(api, config).default_backoff());
    // Whether the resource was listed since the watch last started again: one missing from
    // that list was deleted while the watch was down.
    let mut listed = false;
    // Released because the resource is being deleted; started again if it comes back.
    let mut stepped_down = false;
    // The object (uid) and generation last read: the operator writes the status on every
    // holder change, and reading the Secrets again for each of those, in every pod, would load
    // the API server for nothing (the generation moves with the spec only).
    let mut read_generation: Option<(Option<String>, i64)> = None;
    // The resource as last read, whose Secrets the re-check reads again.
    let mut last: Option<DistributedLock> = None;
    let mut recheck =
        tokio::time::interval_at(tokio::time::Instant::now() + secret_recheck, secret_recheck);
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // What runs, once started.
    let mut current: Option<ResolvedLock> = None;
    // Not started: when to try the resource last read again, and the delay after that.
    let mut retry_at: Option<tokio::time::Instant> = None;
    let mut retry_delay = START_RETRY_MIN;
    // The object (uid) and generation whose start failed last.
    let mut failed_generation: Option<(Option<String>, i64)> = None;
    let not_started = |reason: String| {
        if state.pending_reason(&r.name).as_deref() != Some(reason.as_str()) {
            tracing::warn!(resource = %r, reason = %reason, "the lock is not started yet; it answers 503 with the reason until it is");
        }
        state.set_pending(&r.name, reason);
    };
    // Said once: the lock asks for the holder label where it cannot be given.
    let mut label_refused = false;
    loop {
        // Whether the lock asks for the holder label, as last read.
        let asked = last.as_ref().is_some_and(|l| {
            l.spec.holder_label == Some(true)
                && l.spec.keys.is_none()
                && l.metadata.deletion_timestamp.is_none()
        });
        match &holder_label {
            Ok(label) => {
                label.send_if_modified(|on| std::mem::replace(on, asked) != asked);
            }
            Err(reason) => {
                if asked && !label_refused {
                    tracing::error!(resource = %r, %reason, "spec.holderLabel asks for a label this pod cannot carry");
                }
                label_refused = asked;
            }
        }
        let rechecking =
            current.is_some() && last.as_ref().is_some_and(references_secrets) && !stepped_down;
        let retry = retry_at.filter(|_| current.is_none());
        let (lock, secrets_only, retried) = tokio::select! {
            change = changes.next() => match change {
                None => return,
                Some(Ok(watcher::Event::Apply(lock))) => (lock, false, false),
                Some(Ok(watcher::Event::InitApply(lock))) => {
                    listed = true;
                    (lock, false, false)
                }
                Some(Ok(watcher::Event::Init)) => {
                    listed = false;
                    continue;
                }
                Some(Ok(watcher::Event::InitDone)) if listed => continue,
                // Deleted: a lock without a finalizer (`cleanupPolicy: Retain`) goes at once,
                // or went while the watch was down. Its lock or keys are released; it is
                // started again if the resource comes back.
                Some(Ok(watcher::Event::Delete(_) | watcher::Event::InitDone)) => {
                    if current.is_none() {
                        last = None;
                        retry_at = None;
                        not_started(format!("DistributedLock {r} does not exist (yet); it is taken once it is created"));
                        continue;
                    }
                    if let Some(current) = current.as_ref().filter(|_| !stepped_down) {
                        tracing::warn!(resource = %r, "the DistributedLock was deleted: releasing its lock (or its keys) and taking it no more");
                        step_down(&state, current).await;
                        stepped_down = true;
                    }
                    continue;
                }
                Some(Err(e)) => {
                    if current.is_none() {
                        not_started(format!("cannot read DistributedLock {r}: {e}"));
                    } else {
                        tracing::warn!(resource = %r, error = %e, "watching the DistributedLock failed; retrying");
                    }
                    continue;
                }
            },
            () = sleep_until(retry.unwrap_or_else(tokio::time::Instant::now)), if retry.is_some() => match &last {
                Some(lock) => (lock.clone(), false, true),
                None => continue,
            },
            _ = recheck.tick(), if rechecking => match &last {
                Some(lock) => (lock.clone(), true, false),
                None => continue,
            },
        };
        let Some(running) = current.clone() else {
            if lock.metadata.deletion_timestamp.is_some() {
                last = None;
                retry_at = None;
                not_started(format!(
                    "DistributedLock {r} is being deleted; it is taken if it is created again"
                ));
                continue;
            }
            last = Some(lock.clone());
            if state.has_resigned() {
                return; // nothing is started once the pod has resigned
            }
            // The operator's status writes change the object, not its spec: an attempt that
            // failed on this generation is tried again on the timer only.
            let generation = lock
                .metadata
                .generation
                .map(|g| (lock.metadata.uid.clone(), g));
            if !retried
                && retry_at.is_some()
                && generation.is_some()
                && generation == failed_generation
            {
                continue;
            }
            match start_resource(&client, &secrets, &lock, &identity, &metrics, &state).await {
                Ok((resolved, started)) => {
                    let placed = match &started {
                        Running::Lock(lock) => Some(lock.clone()),
                        Running::Family(_) => None,
                    };
                    let installed = match started {
                        Running::Lock(lock) => state.install_lock(lock).map_err(Running::Lock),
                        Running::Family(family) => {
                            state.install_family(family).map_err(Running::Family)
                        }
                    };
                    if let Err(unwanted) = installed {
                        // The pod resigned meanwhile: it takes nothing any more.
                        match unwanted {
                            Running::Lock(lock) => lock.shutdown().await,
                            Running::Family(family) => family.shutdown().await,
                        }
                        return;
                    }
                    if let Some(lock) = placed {
                        follow_app_health(&state, &lock).await;
                    }
                    tracing::info!(resource = %r, backend = %resolved.backend, "lock configured from its resource");
                    read_generation = generation;
                    current = Some(resolved);
                    retry_at = None;
                    retry_delay = START_RETRY_MIN;
                    recheck.reset();
                }
                Err(reason) => {
                    failed_generation = generation;
                    not_started(format!("DistributedLock {r}: {reason}"));
                    retry_at = Some(tokio::time::Instant::now() + retry_delay);
                    retry_delay = (retry_delay * 2).min(START_RETRY_MAX);
                }
            }
            continue;
        };
        if !secrets_only {
            // A person's force-release: only the holding with that token steps down (on a lock
            // of several permits, whose tokens count per permit, the one named with its
            // permit; a request without one is the operator's to refuse).
            if let Some(Ok(asked)) = resource::force_release_token(&lock)
                && running.keys.is_none()
                && let Some(held) = state.locks().into_iter().find(|l| l.name() == running.name)
                && match asked.permit {
                    None => !held.has_had_permits(),
                    Some(permit) => held.has_had_permits() || permit == 0,
                }
                && held
                    .force_release(asked.permit, asked.token)
                    .await
                    .unwrap_or(false)
            {
                let token = asked.token;
                tracing::warn!(resource = %r, token, permit = asked.permit, "force-released by the lock's annotation: stepping down");
            }
            if let Some(Ok(asked)) = resource::force_release_key(&lock)
                && running.keys.is_some()
                && let Some(family) = state
                    .families()
                    .into_iter()
                    .find(|f| f.name() == running.name)
            {
                let (key, token) = (&asked.key, asked.token);
                match family.force_release(key, asked.permit, token).await {
                    Ok(true) => {
                        tracing::warn!(resource = %r, key, token, "force-released by the family's annotation: the key's holding steps down")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(resource = %r, key, token, error = %e, "the family's force-release annotation cannot be carried out")
                    }
                }
            }
            if lock.metadata.deletion_timestamp.is_some() {
                // The operator deletes a `cleanupPolicy: Delete` lock's records only once nobody
                // holds it: release now rather than at the next failed renewal.
                if !stepped_down {
                    tracing::warn!(resource = %r, "the DistributedLock is being deleted: releasing its lock (or its keys) and taking it no more");
                    step_down(&state, &running).await;
                    stepped_down = true;
                }
                continue;
            }
            let generation = lock
                .metadata
                .generation
                .map(|g| (lock.metadata.uid.clone(), g));
            last = Some(lock.clone());
            if generation.is_some() && generation == read_generation && !stepped_down {
                continue;
            }
            read_generation = generation;
        }
        let next = match read(&secrets, &lock).await {
            Ok(next) if next == running && !stepped_down => continue,
            Ok(next) => next,
            Err(e) if secrets_only => {
                tracing::warn!(resource = %r, error = %e, "the DistributedLock's Secrets cannot be read again; keeping the running credentials");
                continue;
            }
            Err(e) => {
                tracing::warn!(resource = %r, error = %e, "the changed DistributedLock cannot be used; keeping the running configuration");
                continue;
            }
        };
        if next.keys.is_some() != running.keys.is_some() {
            tracing::error!(resource = %r, "the DistributedLock changed between a lock and a family of keyed locks, which its CRD forbids; keeping the running configuration");
            continue;
        }
        // Who logs in aside, a different URL is another backend.
        // Another Lease (`leaseName`) is another place as well.
        let moved =
            next.backend.location() != running.backend.location() || next.lease != running.lease;
        // The same backend, reached otherwise: new credentials.
        let credentials_changed = !moved && next.backend != running.backend;
        if let Some(config) = next.family_config(&identity) {
            let Some(family) = state
                .families()
                .into_iter()
                .find(|f| f.name() == running.name)
            else {
                continue;
            };
            if moved {
                // Each held key is a lock on the old backend: stopping releases them all, and
                // the family stays stopped rather than start afresh beside holders elsewhere.
                tracing::error!(resource = %r, from = %running.backend, to = %next.backend,
                    "the DistributedLock's backend changed, which its CRD forbids: the family's keys are released and no more are taken until this pod restarts");
                state.note_releases_due(family.stop().await);
                stepped_down = true;
                continue;
            }
            if credentials_changed {
                match open_checked(&client, &next).await {
                    Ok(driver) => {
                        family.replace_driver(driver);
                        tracing::info!(resource = %r, "the DistributedLock's credentials changed: the family takes its next keys with them");
                    }
                    Err(e) => {
                        tracing::warn!(resource = %r, error = %e, "the changed credentials cannot be used; keeping the running ones");
                        continue;
                    }
                }
            }
            match family.reconfigure(config) {
                Ok(()) => {
                    family.resume();
                    tracing::info!(resource = %r, "DistributedLock changed: the family's new settings apply from the next acquisition");
                    current = Some(next);
                    stepped_down = false;
                }
                Err(e) => {
                    tracing::warn!(resource = %r, error = %e, "the changed DistributedLock cannot be applied; keeping the running configuration");
                }
            }
            continue;
        }
        // Only the count of permits changed: the running lock takes it for its next attempts
        // and keeps its holding (a change of permits revokes none), rather than restart.
        let permits_only = resource::ResolvedLock {
            permits: running.permits,
            ..next.clone()
        } == running;
        if permits_only
            && !stepped_down
            && let Some(held) = state.locks().into_iter().find(|l| l.name() == running.name)
        {
            match held.set_permits(next.permits) {
                Ok(()) => {
                    tracing::info!(resource = %r, permits = next.permits, "the DistributedLock's permits changed: the next acquisitions use them, no holding is revoked");
                    current = Some(next);
                }
                Err(e) => {
                    tracing::warn!(resource = %r, error = %e, "the changed DistributedLock cannot be applied; keeping the running configuration");
                }
            }
            continue;
        }
        if moved {
            tracing::error!(resource = %r, from = %running.backend, to = %next.backend,
                "the DistributedLock's backend changed, which its CRD forbids: stepping down on the old backend before campaigning on the new one");
            step_down(&state, &running).await;
            // A holder elsewhere claims the old place until it steps down too: at the watch
            // event that brought the change, or, where the Secrets moved it (the user that
            // finds a PostgreSQL table without `schema`), at its own re-read of them.
            let seen_by_all = if references_secrets(&lock) {
                secret_recheck
            } else {
                Duration::ZERO
            };
            tokio::time::sleep(running.lease_duration + running.renew_interval + seen_by_all).await;
        }
        let started = if credentials_changed {
            match open_checked(&client, &next).await {
                Ok(driver) => start_lock_on(driver, &next, &identity, &metrics, &state),
                Err(e) => Err(e),
            }
        } else {
            start_lock(&client, &next, &identity, &metrics, &state).await
        };
        match started {
            Ok(fresh) => {
                if credentials_changed {
                    tracing::info!(resource = %r, backend = %next.backend, "the DistributedLock's credentials changed: lock restarted with them");
                } else {
                    tracing::info!(resource = %r, backend = %next.backend, "DistributedLock changed: lock restarted with the new settings");
                }
                // The old lock is released only once its last answer has run out: an app may act
                // on an answer it gave until its `validForMs` ends, and nobody else may hold the
                // lock meanwhile. The new lock (the same identity) takes it after that.
                let placed = fresh.clone();
                match state.replace(fresh) {
                    Ok(Some(old)) => {
                        state.note_releases_due(old.retire().await);
                        follow_app_health(&state, &placed).await;
                    }
                    Ok(None) => follow_app_health(&state, &placed).await,
                    Err(fresh) => {
                        // The pod resigned meanwhile: the new lock takes nothing.
                        fresh.shutdown().await;
                        return;
                    }
                }
                current = Some(next);
                stepped_down = false;
            }
            Err(e) => {
                tracing::warn!(resource = %r, error = %e, "the changed DistributedLock cannot be started; keeping the running configuration");
            }
        }
    }
}
