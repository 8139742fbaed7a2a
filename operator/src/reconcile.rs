//! The controller for `DistributedLock`: a finalizer first, then provisioning and status on
//! every change of the resource (not of its status) and every [`RESYNC`]; clean-up on deletion
//! when the spec asks for it. Decisions are in [`crate::status`]; this module only talks to
//! the API server.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{FutureExt, StreamExt};
use k8s_openapi::api::coordination::v1::Lease as LeaseObject;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::{self, ObjectRef, reflector};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};
use leasehold_crds::{CleanupPolicy, DistributedLock};
use leasehold_lease::kubernetes::LOCK_ANNOTATION;
use serde_json::json;

use crate::backends::{Backends, StillHeld};
use crate::config::{Watched, api_in};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::status::{self, Notice, Observation};
use leasehold_resource as resource;

/// The finalizer that lets the operator clean up the backend before the lock goes.
pub const FINALIZER: &str = "leasehold.dev/cleanup";
/// The field manager of the status, for server-side apply.
pub const MANAGER: &str = "leasehold-operator";
/// How often, on average, a healthy lock's holder is read again (holders change without
/// touching the resource). Each lock's period is this within +-20 %, fixed by its name
/// ([`resync_after`]), so that thousands of locks created at once spread out instead of
/// coming back in one wave.
pub const RESYNC: Duration = Duration::from_secs(60);
/// A Kubernetes-backed lock's holder changes reach the operator through its Lease's watch: it
/// is read again only this often (to repair what provisioning makes), within +-20 %. Not a
/// family's (its keys' Leases are not watched), nor one naming a Lease of its own choosing.
pub const RESYNC_WATCHED: Duration = Duration::from_secs(900);
/// The most locks reconciled at once. A reconcile's backend calls are bounded
/// ([`crate::backends::BACKEND_TIMEOUT`]); this bounds how many run against the backends and
/// the API server together, after a restart or a leader change reconciles every lock.
pub const CONCURRENCY: u16 = 32;
/// The first retry of a failing lock, doubled per failure up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_secs(2);
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// The longest pause between two looks at a holder that a clean-up waits for.
const HOLDER_RECHECK: Duration = Duration::from_secs(8);
/// How long a clean-up is retried before the lock is let go with its records kept.
pub const CLEANUP_DEADLINE: Duration = Duration::from_secs(300);

pub struct Context {
    pub client: kube::Client,
    pub recorder: Recorder,
    pub backends: Backends,
    pub metrics: Arc<Metrics>,
    /// Consecutive failures per lock, for the backoff.
    pub failures: Mutex<HashMap<ObjectRef<DistributedLock>, u32>>,
    /// Force-releases asked for (by lock uid, what is released: empty for the lock, else the
    /// key and permit, and token) whose holding still runs, with when the operator first saw
    /// each.
    pub force_releases: Mutex<HashMap<(String, String, u64), Instant>>,
}

impl Context {
    pub fn new(client: kube::Client, identity: &str, metrics: Arc<Metrics>) -> Self {
        let reporter = Reporter {
            controller: MANAGER.into(),
            instance: Some(identity.to_owned()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            backends: Backends::default(),
            metrics,
            failures: Mutex::default(),
            force_releases: Mutex::default(),
        }
    }
}

/// Reconcile every watched `DistributedLock` until `shutdown` resolves: one controller per
/// watched namespace (each with its own watches, so that the operator needs no cluster-wide
/// right there), sharing [`CONCURRENCY`] between them.
pub async fn run(
    ctx: Arc<Context>,
    watched: Watched,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let shutdown = shutdown.shared();
    let scopes = watched.scopes();
    let namespaces = u16::try_from(scopes.len()).unwrap_or(u16::MAX).max(1);
    let concurrency = (CONCURRENCY / namespaces).max(1);
    let mut forgetters = Vec::new();
    let mut controllers = Vec::new();
    for scope in scopes {
        let locks = api_in::<DistributedLock>(&ctx.client, scope);
        let leases = api_in::<LeaseObject>(&ctx.client, scope);
        let namespace = scope.map(str::to_owned);
        // Only Leases the operator made for a lock (they carry the managed-by label), and only
        // when their holder changes: a renewal every few seconds per lock must not cost a
        // reconcile.
        let owned_leases =
            watcher::Config::default().labels("app.kubernetes.io/managed-by=leasehold");
        let holder_changes = watcher(leases, owned_leases)
            .default_backoff()
            .touched_objects()
            .predicate_filter(lease_holder, Default::default());
        // The operator's own status writes are left out of what starts a reconcile: a lock
        // whose holder changed again by the time its status was written would otherwise be
        // reconciled again by that write, in a loop as fast as the API server answers.
        // A watch the API server refuses (an upgrade of the control plane, the CRD not
        // installed yet, a token expired) is retried after a growing pause of its own: the
        // controller's shared one is reset by every change of a Lease.
        let (reader, writer) = reflector::store();
        let lock_changes = reflector(
            writer,
            watcher(locks, watcher::Config::default().any_semantic()).default_backoff(),
        )
        .applied_objects()
        .predicate_filter(what_asks_for_a_reconcile, Default::default());
        let controller = Controller::for_stream(lock_changes, reader)
            .with_config(kube::runtime::controller::Config::default().concurrency(concurrency))
            .watches_stream(holder_changes, lock_of_lease)
            .graceful_shutdown_on(shutdown.clone());
        // Each namespace on its own, so that one whose locks cannot be listed holds no other
        // namespace's clean-up back.
        let store = controller.store();
        let ctx_of_store = ctx.clone();
        forgetters.push(async move {
            if store.wait_until_ready().await.is_err() {
                return;
            }
            loop {
                tokio::time::sleep(RESYNC).await;
                ctx_of_store
                    .backends
                    .forget_all_but(namespace.as_deref(), &store.state());
            }
        });
        controllers.push(
            controller
                .run(reconcile, error_policy, ctx.clone())
                .for_each(|outcome| async move {
                    use kube::runtime::controller::Error as Failed;
                    match outcome {
                        // A resumed watch whose revision was compacted lists again: routine.
                        Err(Failed::QueueError(watcher::Error::WatchError(status)))
                            if status.code == 410 =>
                        {
                            tracing::debug!(error = %status, "a watch restarts from a list");
                        }
                        // The watches failing: nothing is reconciled until they are back.
                        Err(e @ Failed::QueueError(_)) => {
                            tracing::warn!(error = %e, "watching the locks or their Leases failed; retrying");
                        }
                        // A reconcile's own error is logged and counted by `error_policy`.
                        Err(e) => tracing::debug!(error = %e, "reconcile did not complete"),
                        Ok(_) => {}
                    }
                }),
        );
    }
    let forget_deleted = async move {
        futures_util::future::join_all(forgetters).await;
        std::future::pending::<()>().await
    };
    tokio::select! {
        _ = futures_util::future::join_all(controllers) => {}
        () = forget_deleted => {}
    }
}

/// The lock a Lease serves: the one its annotation names (a key's Lease names none).
fn lock_of_lease(lease: LeaseObject) -> Option<ObjectRef<DistributedLock>> {
    let lock = lease.annotations().get(LOCK_ANNOTATION)?;
    Some(ObjectRef::new(lock).within(&lease.namespace()?))
}

/// What of a Lease the status shows: who holds it and how many times it changed hands (not when
/// it was last renewed).
fn lease_holder(lease: &LeaseObject) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let spec = lease.spec.as_ref();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    spec.and_then(|s| s.holder_identity.as_deref())
        .hash(&mut hasher);
    spec.and_then(|s| s.lease_transitions).hash(&mut hasher);
    Some(hasher.finish())
}

/// What of a lock asks for a reconcile: its spec (the generation), its annotations (a
/// force-release), its finalizers, its deletion, and its identity (a lock deleted and made
/// again). Not its status, which only the operator writes.
fn what_asks_for_a_reconcile(lock: &DistributedLock) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let meta = lock.meta();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    meta.uid.hash(&mut hasher);
    meta.generation.hash(&mut hasher);
    meta.annotations.hash(&mut hasher);
    meta.finalizers.hash(&mut hasher);
    meta.deletion_timestamp.is_some().hash(&mut hasher);
    Some(hasher.finish())
}

pub async fn reconcile(lock: Arc<DistributedLock>, ctx: Arc<Context>) -> Result<Action> {
    let started = std::time::Instant::now();
    let namespace = lock.namespace().unwrap_or_default();
    let api: Api<DistributedLock> = Api::namespaced(ctx.client.clone(), &namespace);
    // A policy of a later version's CRD deletes nothing, as `Retain`.
    let outcome = if matches!(
        lock.spec.cleanup_policy,
        CleanupPolicy::Retain | CleanupPolicy::Unrecognized
    ) {
        retained(&api, &lock, &ctx).await
    } else {
        finalizer(&api, FINALIZER, lock, |event| async {
            match event {
                Finalizer::Apply(lock) => apply(&lock, &ctx).await,
                Finalizer::Cleanup(lock) => cleanup(&lock, &ctx).await,
            }
        })
        .await
        .map_err(|e| match e {
            kube::runtime::finalizer::Error::ApplyFailed(e)
            | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
            other => Error::Finalizer(other.to_string()),
        })
    };
    ctx.metrics
        .reconciled(started.elapsed(), outcome.as_ref().err().map(Error::label));
    outcome
}

/// A lock whose records are kept when it is deleted (`cleanupPolicy: Retain`) needs no clean-up,
/// so it carries no finalizer: deleting it, or its namespace, never waits on the operator. One
/// left from when its policy was `Delete` is taken off.
async fn retained(
    api: &Api<DistributedLock>,
    lock: &DistributedLock,
    ctx: &Context,
) -> Result<Action> {
    let finalizers = lock.finalizers();
    if let Some(at) = finalizers.iter().position(|f| f == FINALIZER) {
        // Tested against the list read: a finalizer another controller added meanwhile stays.
        let patch: json_patch::Patch = serde_json::from_value(json!([
            {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
            {"op": "remove", "path": format!("/metadata/finalizers/{at}")},
        ]))
        .map_err(|e| Error::Finalizer(e.to_string()))?;
        api.patch(
            &lock.name_any(),
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        )
        .await
        .map_err(Error::Kube)?;
    }
    if lock.meta().deletion_timestamp.is_some() {
        ctx.backends.forget(lock);
        forget_force_releases(ctx, lock);
        return Ok(Action::await_change());
    }
    apply(lock, ctx).await
}

/// Provision, read the holder, and write status and events when they changed.
async fn apply(lock: &DistributedLock, ctx: &Context) -> Result<Action> {
    let (backend, observation) = ctx.backends.observe(&ctx.client, lock).await;
    let current = lock.status.as_ref();
    let next = status::desired(
        current,
        lock.meta().generation,
        &backend,
        &observation,
        Timestamp::now(),
    );
    if current != Some(&next) {
        write_status(ctx, lock, &next).await.map_err(Error::Kube)?;
    }
    for notice in status::notices(current, &next) {
        publish(ctx, lock, &notice).await;
    }
    match observation {
        Observation::Ready { holder, .. } => {
            ctx.failures
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&ObjectRef::from(lock));
            let asked = if lock.spec.keys.is_some() {
                match key_force_release(ctx, lock).await {
                    Ok(asked) => asked,
                    // The backend cannot tell now: the request waits for the next look, as a
                    // lock's does while its backend fails.
                    Err(e) => {
                        tracing::warn!(error = %e, "a force-released key could not be read on the backend; looking again");
                        return Ok(Action::requeue(FORCE_RELEASE_RECHECK));
                    }
                }
            } else {
                match lock_force_release(ctx, lock, holder).await {
                    Ok(asked) => asked,
                    Err(e) => {
                        tracing::warn!(error = %e, "a force-released permit could not be read on the backend; looking again");
                        return Ok(Action::requeue(FORCE_RELEASE_RECHECK));
                    }
                }
            };
            if let Some((asked, holding)) = asked
                && let Some(again) = force_release(ctx, lock, asked, holding.as_ref()).await?
            {
                return Ok(Action::requeue(again));
            }
            Ok(Action::requeue(resync_after(lock)))
        }
        // The status says why; the error sends the lock through the backoff.
        Observation::Failed { message, .. } => {
            Err(Error::Backend(leasehold_lease::Error::Backend(message)))
        }
    }
}

/// How often a force-release whose holding still runs is looked at again.
pub const FORCE_RELEASE_RECHECK: Duration = Duration::from_secs(2);
/// How long a force-release waits for its holder's sidecar to step down before it is given up,
/// at least: the holder's lease is released only once its last answer has run out, so the wait
/// is also three of the lock's leases when that is longer.
pub const FORCE_RELEASE_PATIENCE: Duration = Duration::from_secs(120);

/// What a force-release annotation asks for.
enum Asked {
    /// The lock's holding with this token (on a lock of several permits, of this permit).
    Lock(resource::LockForceRelease),
    /// A family key's holding with this token (`KEY:TOKEN`, `KEY#PERMIT:TOKEN`).
    Key(resource::KeyForceRelease),
    /// Not a request that can be carried out: why.
    Invalid(String),
}

/// A lock's force-release request, if it carries one, with the holder of the permit it names
/// (`holder`, permit 0's, unless it names another); `Err` when the backend cannot be read now.
/// On a lock of several permits the request must name the permit: tokens count per permit.
async fn lock_force_release(
    ctx: &Context,
    lock: &DistributedLock,
    holder: Option<leasehold_lease::Holding>,
) -> std::result::Result<Option<(Asked, Option<leasehold_lease::Holding>)>, leasehold_lease::Error>
{
    let asked = match resource::force_release_token(lock) {
        None => return Ok(None),
        Some(Err(raw)) => {
            let why = format!(
                "{raw:?} is not a fencing token (#PERMIT:TOKEN on a lock of several permits)"
            );
            return Ok(Some((Asked::Invalid(why), holder)));
        }
        Some(Ok(asked)) => asked,
    };
    let several = resource::has_had_permits(lock);
    let invalid = |why: String| Ok(Some((Asked::Invalid(why), holder.clone())));
    match asked.permit {
        None if several => invalid(format!(
            "the lock has several permits, whose tokens count apart: name the holding as #PERMIT:TOKEN (#0:{})",
            asked.token
        )),
        Some(permit) if !several && permit > 0 => invalid(format!(
            "the lock has one permit: name the holding by its token alone ({})",
            asked.token
        )),
        Some(permit) if permit >= leasehold_lease::keyed::MAX_PERMITS => {
            invalid(format!("permit {permit} is not one a lock can have"))
        }
        None | Some(0) => Ok(Some((Asked::Lock(asked), holder))),
        Some(permit) => {
            let name = leasehold_lease::keyed::lock_permit_name(&lock.name_any(), permit);
            let holdings = ctx.backends.observe_key(&ctx.client, lock, &[name]).await?;
            Ok(Some((Asked::Lock(asked), holdings.into_iter().next())))
        }
    }
}

/// A family's force-release request, if it carries one, with the key's holding it names (else
/// who holds the key); `Err` when the backend cannot be read now.
async fn key_force_release(
    ctx: &Context,
    lock: &DistributedLock,
) -> std::result::Result<Option<(Asked, Option<leasehold_lease::Holding>)>, leasehold_lease::Error>
{
    let asked = match resource::force_release_key(lock) {
        None => return Ok(None),
        Some(Err(raw)) => {
            let why = format!("{raw:?} is not KEY:TOKEN (KEY#PERMIT:TOKEN)");
            return Ok(Some((Asked::Invalid(why), None)));
        }
        Some(Ok(asked)) => asked,
    };
    let names = match key_lock_names(lock, &asked) {
        Ok(names) => names,
        Err(why) => return Ok(Some((Asked::Invalid(why), None))),
    };
    let holdings = ctx.backends.observe_key(&ctx.client, lock, &names).await?;
    let holding = holdings
        .iter()
        .find(|h| h.token == asked.token)
        .or(holdings.first())
        .cloned();
    Ok(Some((Asked::Key(asked), holding)))
}

/// The backend lock names of the family `lock`'s key that `asked` names (its permit's, or on a
/// plain family the key's own); `Err` when the key is not one, or a semaphore's request does not
/// name the permit (two permits of a key may hold one token on some backends).
fn key_lock_names(
    lock: &DistributedLock,
    asked: &resource::KeyForceRelease,
) -> std::result::Result<Vec<String>, String> {
    let permits = match asked.permit {
        Some(permit) if permit < leasehold_lease::keyed::MAX_PERMITS => permit..permit + 1,
        Some(permit) => return Err(format!("permit {permit} is not one a key can have")),
        None if lock.spec.permits.unwrap_or(1) > 1 => {
            return Err(format!(
                "{} is a semaphore's key: name the permit, KEY#PERMIT:TOKEN",
                asked.key
            ));
        }
        None => 0..1,
    };
    // A key longer than the family's bound may still be held, taken before the bound was
    // lowered; a force-release names a holding, so any key the resource may ever have allowed
    // is looked for (one nobody holds is then reported as such).
    leasehold_lease::keyed::key_lock_names(
        &lock.name_any(),
        &asked.key,
        permits,
        leasehold_crds::MAX_KEY_LENGTH as usize,
    )
}

/// A person's `leasehold.dev/force-release=TOKEN` (a family's: `KEY:TOKEN`): while `holder`
/// still holds with that token, its sidecar (which follows the lock) is stepping down, and the
/// lock is looked at again in [`FORCE_RELEASE_RECHECK`]; once it does not, the annotation is
/// removed and an Event says what became of it (also when the token was not current, or the
/// request is not one).
async fn force_release(
    ctx: &Context,
    lock: &DistributedLock,
    asked: Asked,
    holder: Option<&leasehold_lease::Holding>,
) -> Result<Option<Duration>> {
    let by = annotation_author(lock, resource::FORCE_RELEASE_ANNOTATION);
    let uid = lock.metadata.uid.clone().unwrap_or_default();
    // What is released, as the requests still running are remembered by.
    let (subject, released) = match &asked {
        Asked::Key(asked) => match asked.permit {
            Some(permit) => (
                format!("key {} (permit {permit})", asked.key),
                format!("{}#{permit}", asked.key),
            ),
            None => (format!("key {}", asked.key), asked.key.clone()),
        },
        Asked::Lock(resource::LockForceRelease {
            permit: Some(permit),
            ..
        }) => (format!("the lock's permit {permit}"), format!("#{permit}")),
        _ => ("the lock".to_owned(), String::new()),
    };
    let now = match holder {
        Some(h) => format!("{} holds {subject} with token {}", h.identity, h.token),
        None => format!("nobody holds {subject}"),
    };
    let asked = match asked {
        Asked::Lock(asked) => Ok(asked.token),
        Asked::Key(asked) => Ok(asked.token),
        Asked::Invalid(why) => Err(why),
    };
    let notice = match asked {
        Err(why) => Notice {
            warning: true,
            reason: "ForceReleaseInvalid",
            note: if lock.spec.keys.is_some() {
                format!(
                    "{} on a family, set by {by}, names a key's holding as KEY:TOKEN, but {why}; nothing was released",
                    resource::FORCE_RELEASE_ANNOTATION
                )
            } else {
                format!(
                    "{}, set by {by}, names the lock's holding by its fencing token, but {why}; nothing was released ({now})",
                    resource::FORCE_RELEASE_ANNOTATION
                )
            },
        },
        Ok(token) if holder.is_some_and(|h| h.token == token) => {
            let (first_seen, new) = {
                let mut asked = ctx.force_releases.lock().unwrap_or_else(|e| e.into_inner());
                match asked.get(&(uid.clone(), released.clone(), token)) {
                    Some(at) => (*at, false),
                    None => {
                        asked.insert((uid.clone(), released.clone(), token), Instant::now());
                        (Instant::now(), true)
                    }
                }
            };
            let lease = resource::parse_go_duration(&lock.spec.lease_duration).unwrap_or_default();
            let patience = FORCE_RELEASE_PATIENCE.max(lease * 3);
            if first_seen.elapsed() < patience {
                if new {
                    publish(
                        ctx,
                        lock,
                        &Notice {
                            warning: false,
                            reason: "ForceReleaseRequested",
                            note: format!(
                                "{by} asked to end the holding of {subject} with token {token} ({now}); its sidecar steps down"
                            ),
                        },
                    )
                    .await;
                }
                return Ok(Some(FORCE_RELEASE_RECHECK));
            }
            Notice {
                warning: true,
                reason: "ForceReleaseStalled",
                note: format!(
                    "the holding of {subject} with token {token} did not end within {}s of {by}'s request ({now}); its sidecar steps down only if it follows the lock (--resource, as the webhook injects it)",
                    patience.as_secs()
                ),
            }
        }
        Ok(token) => {
            let asked_while_current = ctx
                .force_releases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(&(uid.clone(), released.clone(), token));
            if asked_while_current {
                Notice {
                    warning: false,
                    reason: "ForceReleased",
                    note: format!(
                        "the holding of {subject} with token {token} ended at the request of {by}; {now}"
                    ),
                }
            } else {
                Notice {
                    warning: true,
                    reason: "ForceReleaseIgnored",
                    note: format!(
                        "token {token}, set by {by}, is not the current holding of {subject}; nothing was released ({now})"
                    ),
                }
            }
        }
    };
    remove_annotation(ctx, lock, resource::FORCE_RELEASE_ANNOTATION).await?;
    // Forgotten only once the annotation is gone: a patch that failed is tried again with the
    // request still known.
    ctx.force_releases
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|(asked_of, _, _), _| asked_of != &uid);
    publish(ctx, lock, &notice).await;
    Ok(None)
}

/// Who set `annotation`, as the field manager that owns it (`kubectl-annotate`, say).
fn annotation_author(lock: &DistributedLock, annotation: &str) -> String {
    let field = format!("f:{annotation}");
    lock.metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|entry| {
            entry.fields_v1.as_ref().is_some_and(|fields| {
                fields.0["f:metadata"]["f:annotations"]
                    .get(&field)
                    .is_some()
            })
        })
        .filter_map(|entry| entry.manager.clone())
        .next_back()
        .unwrap_or_else(|| "an unknown field manager".to_owned())
}

/// Remove `annotation` if it still has the value read (a newer request stays).
async fn remove_annotation(ctx: &Context, lock: &DistributedLock, annotation: &str) -> Result<()> {
    let Some(value) = lock.annotations().get(annotation) else {
        return Ok(());
    };
    let path = format!(
        "/metadata/annotations/{}",
        annotation.replace('~', "~0").replace('/', "~1")
    );
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": path, "value": value},
        {"op": "remove", "path": path},
    ]))
    .map_err(|e| Error::Finalizer(e.to_string()))?;
    let api: Api<DistributedLock> =
        Api::namespaced(ctx.client.clone(), &lock.namespace().unwrap_or_default());
    match api
        .patch(
            &lock.name_any(),
            &PatchParams::default(),
            &Patch::Json::<()>(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Changed meanwhile: the next reconcile reads the new request.
        Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => Ok(()),
        Err(e) => Err(Error::Kube(e)),
    }
}

/// On deletion: remove the backend's artifacts when the spec says `Delete`, then let go.
///
/// Not while someone holds the lock: with its record gone, a newcomer would take the lock while
/// the holder still claims it until its next renewal fails, and the newcomer's token would start
/// again from the bottom. Sidecars that follow the resource step down as soon as it is being
/// deleted; the records go once the last holder has released or its lease has run out.
///
/// Never for ever: a clean-up that cannot finish (a holder that does not let go, a backend the
/// operator cannot reach) is given up at once when the namespace is being deleted, and after
/// [`CLEANUP_DEADLINE`] otherwise. The records are then kept, which is always safe (a lock
/// created again under the name continues from them), the status says so, and the finalizer
/// goes, so that neither the lock nor its namespace stays `Terminating`.
async fn cleanup(lock: &DistributedLock, ctx: &Context) -> Result<Action> {
    if lock.spec.cleanup_policy == CleanupPolicy::Delete
        && let Err(error) = clean_up_backend(lock, ctx).await
    {
        let namespace = lock.namespace().unwrap_or_default();
        let why_stop = if namespace_terminating(ctx, &namespace).await {
            Some("the namespace is being deleted".to_owned())
        } else if time_since_deletion(lock) >= CLEANUP_DEADLINE {
            Some(format!(
                "the clean-up was retried for {}s",
                CLEANUP_DEADLINE.as_secs()
            ))
        } else {
            None
        };
        let Some(why_stop) = why_stop else {
            let reason = match error {
                Error::HolderAlive(_) => "HolderAlive",
                _ => "CleanupFailed",
            };
            record_cleanup(ctx, lock, reason, &error.to_string()).await;
            return Err(error);
        };
        let mut note = format!(
            "{why_stop}: the lock is let go with its records kept in the backend ({error})"
        );
        if let Err(e) = ctx.backends.disown_lease(&ctx.client, lock).await {
            note.push_str(&format!(
                "; its Lease could not be cut loose, so the garbage collector may delete it: {e}"
            ));
        }
        record_cleanup(ctx, lock, "GaveUp", &note).await;
        publish(
            ctx,
            lock,
            &Notice {
                warning: true,
                reason: "CleanupAbandoned",
                note,
            },
        )
        .await;
    }
    ctx.backends.forget(lock);
    ctx.failures
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&ObjectRef::from(lock));
    forget_force_releases(ctx, lock);
    Ok(Action::await_change())
}

/// A deleted lock's pending force-releases are forgotten with it.
fn forget_force_releases(ctx: &Context, lock: &DistributedLock) {
    let uid = lock.metadata.uid.clone().unwrap_or_default();
    ctx.force_releases
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|(asked_of, _, _), _| asked_of != &uid);
}

/// The clean-up proper: an error when it must be tried again.
async fn clean_up_backend(lock: &DistributedLock, ctx: &Context) -> Result<()> {
    // The lock is taken before its records go, so that nobody can take it in between (see
    // `leasehold_lease::delete_records`); a holder keeps the records until it lets go.
    let notice = match ctx.backends.clean_up(&ctx.client, lock).await {
        Ok(Some(kept)) => {
            // Said once per deletion, not at every re-check.
            let first_wait = !ctx
                .failures
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(&ObjectRef::from(lock));
            let who = match kept {
                StillHeld::Lock(None) => "the backend cannot name the holder yet (it waits out a lease a restart may have lost)".to_owned(),
                StillHeld::Lock(Some(h)) => {
                    format!("{} (token {}) still holds the lock", h.identity, h.token)
                }
                StillHeld::Keys(1) => "1 key of the family is still held".to_owned(),
                StillHeld::Keys(n) => format!("{n} keys of the family are still held"),
                StillHeld::Permits(1) => "a permit of the lock is still held".to_owned(),
                StillHeld::Permits(n) => format!("{n} permits of the lock are still held"),
            };
            let note = format!(
                "{who}, so the records are kept until nothing holds them (a release, or a lease \
                 that runs out); sidecars that follow this resource release now, other clients must stop \
                 (or set cleanupPolicy: Retain to keep the records and let the resource go)"
            );
            if first_wait {
                publish(
                    ctx,
                    lock,
                    &Notice {
                        warning: true,
                        reason: "CleanupWaiting",
                        note: note.clone(),
                    },
                )
                .await;
            }
            return Err(Error::HolderAlive(note));
        }
        Ok(None) => Notice {
            warning: false,
            reason: "CleanedUp",
            note: "removed the lock's artifacts from the backend".into(),
        },
        // A spec or Secret that can no longer be read (a namespace being deleted takes the
        // Secrets too) must not hold the lock forever: say so and let go.
        Err(
            e @ (leasehold_lease::Error::InvalidConfig { .. }
            | leasehold_lease::Error::InvalidUrl { .. }
            | leasehold_lease::Error::InvalidName { .. }),
        ) => Notice {
            warning: true,
            reason: "CleanupSkipped",
            note: format!("the backend was not cleaned up: {e}"),
        },
        Err(e) => {
            publish(
                ctx,
                lock,
                &Notice {
                    warning: true,
                    reason: "CleanupFailed",
                    note: e.to_string(),
                },
            )
            .await;
            return Err(Error::Backend(e));
        }
    };
    publish(ctx, lock, &notice).await;
    Ok(())
}

/// Whether `namespace` is being deleted. The API server then refuses every new object in it
/// (events included) and waits for this lock's finalizer. Unknown (not allowed to read it, no
/// answer) counts as no.
async fn namespace_terminating(ctx: &Context, namespace: &str) -> bool {
    let api: Api<Namespace> = Api::all(ctx.client.clone());
    match api.get_opt(namespace).await {
        Ok(Some(ns)) => {
            ns.metadata.deletion_timestamp.is_some()
                || ns
                    .status
                    .and_then(|s| s.phase)
                    .is_some_and(|p| p == "Terminating")
        }
        Ok(None) => true,
        Err(e) => {
            tracing::debug!(%namespace, error = %e, "cannot read the namespace");
            false
        }
    }
}

fn time_since_deletion(lock: &DistributedLock) -> Duration {
    lock.meta()
        .deletion_timestamp
        .as_ref()
        .and_then(|t| Duration::try_from(Timestamp::now().duration_since(t.0)).ok())
        .unwrap_or_default()
}

/// Say in the status how the clean-up stands: status writes, unlike events, are accepted in a
/// namespace being deleted. Best effort: it must not keep the finalizer.
async fn record_cleanup(ctx: &Context, lock: &DistributedLock, reason: &str, message: &str) {
    let current = lock.status.clone().unwrap_or_default();
    let Some(next) = status::with_cleanup(&current, reason, message, Timestamp::now()) else {
        return;
    };
    if let Err(e) = write_status(ctx, lock, &next).await {
        tracing::warn!(lock = %lock.name_any(), error = %e, "cannot write the clean-up status");
    }
}

/// Server-side apply of the lock's whole status, as the operator's field manager.
async fn write_status(
    ctx: &Context,
    lock: &DistributedLock,
    status: &leasehold_crds::DistributedLockStatus,
) -> kube::Result<()> {
    let api: Api<DistributedLock> =
        Api::namespaced(ctx.client.clone(), &lock.namespace().unwrap_or_default());
    let patch = json!({
        "apiVersion": DistributedLock::api_version(&()),
        "kind": DistributedLock::kind(&()),
        "status": status,
    });
    api.patch_status(
        &lock.name_any(),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map(|_| ())
}

/// Publish an event on the lock. Best effort: events are refused in a namespace being deleted,
/// and a lost event must never keep a finalizer.
async fn publish(ctx: &Context, lock: &DistributedLock, notice: &Notice) {
    let event = Event {
        type_: if notice.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: notice.reason.into(),
        note: Some(status::event_note(&notice.note)),
        // Events alike in all but their note (another holder, another error) are folded
        // into the first one's (a count on it, its note kept) unless their actions differ:
        // the note's hash in the action keeps each one's own words.
        action: format!(
            "{}-{:08x}",
            if notice.warning { "Check" } else { "Reconcile" },
            note_hash(&notice.note)
        ),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &lock.object_ref(&())).await {
        tracing::warn!(lock = %lock.name_any(), reason = notice.reason, error = %e,
            "cannot publish an event");
    }
}

/// A short, stable hash of an Event's note (FNV-1a, 32 bits): the same words give the same
/// hash in every operator process and version.
fn note_hash(note: &str) -> u32 {
    note.bytes().fold(0x811c_9dc5_u32, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    })
}

/// Retry a failing lock after a delay that doubles per consecutive failure, so one broken
/// backend costs little and never holds up the others (each lock has its own queue entry).
pub fn error_policy(lock: Arc<DistributedLock>, error: &Error, ctx: Arc<Context>) -> Action {
    let mut failures = ctx.failures.lock().unwrap_or_else(|e| e.into_inner());
    let count = failures.entry(ObjectRef::from(lock.as_ref())).or_insert(0);
    *count = count.saturating_add(1);
    let delay = match error {
        // Not a failure: the holder's release is what the clean-up waits for, soon.
        Error::HolderAlive(_) => backoff(*count).min(HOLDER_RECHECK),
        _ => backoff(*count),
    };
    tracing::warn!(lock = %lock.name_any(), namespace = ?lock.namespace(), error = %error,
        retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// When a healthy `lock` is looked at again: [`RESYNC`] (or [`RESYNC_WATCHED`] for a
/// Kubernetes-backed lock), within +-20 % by a hash of its namespace and name.
pub fn resync_after(lock: &DistributedLock) -> Duration {
    use std::hash::{Hash, Hasher};
    // Only a lock's own Lease, made by the operator, is watched: not a family's key Leases, nor
    // a Lease the lock names (`leaseName`) that the operator may not have made.
    // Nor a lock's permits above 0, whose Leases are counted at each look.
    let watched = lock
        .spec
        .backend
        .kubernetes
        .as_ref()
        .is_some_and(|k| k.lease_name.is_none())
        && lock.spec.keys.is_none()
        && !resource::has_had_permits(lock);
    let base = if watched { RESYNC_WATCHED } else { RESYNC };
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (lock.namespace(), lock.name_any()).hash(&mut hasher);
    let place = (hasher.finish() % 1000) as f64 / 1000.0;
    base.mul_f64(0.8 + 0.4 * place)
}

/// The delay before retry number `failures` (1-based).
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    (FIRST_BACKOFF * 2u32.pow(doublings)).min(MAX_BACKOFF)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{self, Scenario, timeout_after_1s};
    use leasehold_lease::Backend;
    use leasehold_testkit::RedisServer;

    /// A Redis server of the test's own, and a driver on it as a pod's sidecar would have.
    async fn redis() -> (RedisServer, Arc<dyn Backend>) {
        let server = RedisServer::start();
        let url = leasehold_lease::BackendUrl::parse(&server.url()).unwrap();
        let driver = leasehold_lease::connect(&url).await.unwrap();
        (server, driver)
    }

    /// The lock's holder and token in the backend.
    async fn holder(driver: &Arc<dyn Backend>, lock: &str) -> Option<(String, u64)> {
        driver
            .observe(lock)
            .await
            .unwrap()
            .map(|h| (h.identity, h.token))
    }

    /// A key longer than the family's bound, held since before the bound was lowered, can
    /// still be force-released; what is no key at all is refused.
    #[test]
    fn a_force_release_names_keys_longer_than_the_familys_bound_now() {
        let mut lock = fixtures::family(fixtures::redis_lock("orders", 6379));
        lock.spec.keys.as_mut().unwrap().max_key_length = Some(8);
        let asked = |key: &str| resource::KeyForceRelease {
            key: key.to_owned(),
            permit: None,
            token: 3,
        };
        let long = "order-123456789";
        assert_eq!(
            key_lock_names(&lock, &asked(long)),
            Ok(vec![
                leasehold_lease::keyed::key_lock_names("orders", long, 0..1, long.len())
                    .unwrap()
                    .remove(0)
            ])
        );
        assert!(key_lock_names(&lock, &asked("no spaces")).is_err());
        assert!(key_lock_names(&lock, &asked(&"k".repeat(1025))).is_err());
    }

    fn held(identity: &str, token: u64) -> Option<(String, u64)> {
        Some((identity.into(), token))
    }

    /// The token the next holder of `lock` gets (it takes and releases the lock).
    async fn next_token(driver: &Arc<dyn Backend>, lock: &str) -> u64 {
        let leasehold_lease::Acquire::Acquired(lease) = driver
            .try_acquire(lock, "pod-next", Duration::from_secs(30))
            .await
            .unwrap()
        else {
            panic!("{lock} is not free")
        };
        driver.release(&lease).await.unwrap();
        lease.token
    }

    /// Thousands of locks created at once come back spread over +-20 % of the resync, each
    /// at a period of its own that does not change; a Kubernetes-backed lock, whose holder
    /// changes come through its Lease's watch, at the longer one.
    #[test]
    fn resyncs_spread_over_a_fifth_either_side_and_watched_locks_wait_longer() {
        let periods: Vec<Duration> = (0..1000)
            .map(|i| resync_after(&fixtures::redis_lock(&format!("lock-{i}"), 1)))
            .collect();
        let (min, max) = (
            *periods.iter().min().unwrap(),
            *periods.iter().max().unwrap(),
        );
        assert!(
            min >= RESYNC.mul_f64(0.8) && max <= RESYNC.mul_f64(1.2),
            "{min:?}..{max:?}"
        );
        assert!(
            min < RESYNC.mul_f64(0.82) && max > RESYNC.mul_f64(1.18),
            "not spread: {min:?}..{max:?}"
        );
        let lock = fixtures::redis_lock("lock-7", 1);
        assert_eq!(resync_after(&lock), resync_after(&lock.clone()));
        let watched = fixtures::lock(
            "lease",
            leasehold_crds::Backend {
                kubernetes: Some(Default::default()),
                ..Default::default()
            },
        );
        let period = resync_after(&watched);
        assert!(
            period >= RESYNC_WATCHED.mul_f64(0.8) && period <= RESYNC_WATCHED.mul_f64(1.2),
            "{period:?}"
        );
        // A family's key Leases, and a Lease the lock names, are not watched.
        let family = fixtures::family(watched.clone());
        let mut named = watched;
        named.spec.backend.kubernetes.as_mut().unwrap().lease_name = Some("theirs".into());
        for unwatched in [family, named] {
            let period = resync_after(&unwatched);
            assert!(period <= RESYNC.mul_f64(1.2), "{period:?}");
        }
    }

    #[tokio::test]
    async fn a_new_lock_gets_the_finalizer_first() {
        let (ctx, api) = Context::test();
        let lock = fixtures::redis_lock("jobs", leasehold_testkit::free_port());
        let scenario = api.run(Scenario::FinalizerCreation(lock.clone()));
        reconcile(Arc::new(lock), ctx).await.expect("reconcile");
        timeout_after_1s(scenario).await;
    }

    #[tokio::test]
    async fn create_then_provision_then_status_then_a_quiet_resync() {
        let (server, driver) = redis().await;
        let (ctx, api) = Context::test();
        let lock = fixtures::with_finalizer(fixtures::redis_lock("jobs", server.port()));
        let scenario = api.run(Scenario::Provisioned(lock.clone()));
        let action = reconcile(Arc::new(lock.clone()), ctx.clone())
            .await
            .expect("reconcile");
        assert_eq!(action, Action::requeue(resync_after(&lock)));
        timeout_after_1s(scenario).await;
        // The backend is reachable and a driver can take the lock.
        assert!(matches!(
            driver
                .try_acquire("jobs", "pod-a", Duration::from_secs(30))
                .await
                .unwrap(),
            leasehold_lease::Acquire::Acquired(_)
        ));

        // The holder shows up in the status at the next look (from the status written first).
        let mut lock = lock;
        let provisioned = Observation::Ready {
            holder: None,
            held_keys: None,
            held_permits: None,
            warnings: vec![],
        };
        lock.status = Some(status::desired(
            None,
            Some(1),
            "redis",
            &provisioned,
            Timestamp::now(),
        ));
        let (ctx2, api) = Context::test();
        let scenario = api.run(Scenario::HolderChanged(lock.clone(), "pod-a"));
        reconcile(Arc::new(lock.clone()), ctx2)
            .await
            .expect("reconcile");
        timeout_after_1s(scenario).await;

        // With the status as it should be, a second reconcile sends nothing at all.
        let (backend, observation) = ctx.backends.observe(&ctx.client, &lock).await;
        let mut settled = lock.clone();
        settled.status = Some(status::desired(
            None,
            Some(1),
            &backend,
            &observation,
            Timestamp::now(),
        ));
        assert_eq!(
            settled.status.as_ref().unwrap().holder.as_deref(),
            Some("pod-a")
        );
        let (ctx, api) = Context::test();
        let scenario = api.run(Scenario::Nothing);
        reconcile(Arc::new(settled), ctx).await.expect("reconcile");
        timeout_after_1s(scenario).await;
    }

    #[tokio::test]
    async fn an_unreachable_backend_sets_the_condition_warns_and_backs_off() {
        let (ctx, api) = Context::test();
        let lock = fixtures::with_finalizer(fixtures::unreachable_redis_lock("cache"));
        let scenario = api.run(Scenario::BackendUnreachable(lock.clone()));
        let error = reconcile(Arc::new(lock.clone()), ctx.clone())
            .await
            .unwrap_err();
        assert_eq!(error.label(), "backend");
        assert!(!error.to_string().contains(fixtures::SECRET_PASSWORD));
        timeout_after_1s(scenario).await;
        let lock = Arc::new(lock);
        assert_eq!(
            error_policy(lock.clone(), &error, ctx.clone()),
            Action::requeue(FIRST_BACKOFF)
        );
        assert_eq!(
            error_policy(lock, &error, ctx),
            Action::requeue(FIRST_BACKOFF * 2)
        );
    }

    #[tokio::test]
    async fn a_spec_change_moves_observed_generation_without_events() {
        let (server, _) = redis().await;
        let (ctx, api) = Context::test();
        let mut lock = fixtures::with_finalizer(fixtures::redis_lock("jobs", server.port()));
        let (backend, observation) = ctx.backends.observe(&ctx.client, &lock).await;
        lock.status = Some(status::desired(
            None,
            Some(1),
            &backend,
            &observation,
            Timestamp::now(),
        ));
        // The user changed the lease duration: generation 2.
        lock.spec.lease_duration = "30s".into();
        lock.meta_mut().generation = Some(2);
        let scenario = api.run(Scenario::StatusOnly(lock.clone()));
        reconcile(Arc::new(lock), ctx).await.expect("reconcile");
        timeout_after_1s(scenario).await;
    }

    #[tokio::test]
    async fn delete_with_retain_leaves_the_backend_alone() {
        let (server, driver) = redis().await;
        driver
            .try_acquire("jobs", "pod-a", Duration::from_secs(30))
            .await
            .unwrap();
        let (ctx, api) = Context::test();
        let lock = fixtures::being_deleted(
            fixtures::redis_lock("jobs", server.port()),
            CleanupPolicy::Retain,
        );
        let scenario = api.run(Scenario::RemoveFinalizer(lock.clone()));
        reconcile(Arc::new(lock), ctx).await.expect("reconcile");
        timeout_after_1s(scenario).await;
        assert_eq!(holder(&driver, "jobs").await, held("pod-a", 1));
    }

    #[tokio::test]
    async fn delete_with_delete_clears_the_lock_in_the_backend_and_keeps_its_token() {
        let (server, driver) = redis().await;
        // "jobs" had a holder that crashed (its lease ran out); "other" is held.
        for (lock, lease) in [("jobs", 50), ("other", 30_000)] {
            driver
                .try_acquire(lock, "pod-a", Duration::from_millis(lease))
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (ctx, api) = Context::test();
        let lock = fixtures::being_deleted(
            fixtures::redis_lock("jobs", server.port()),
            CleanupPolicy::Delete,
        );
        let scenario = api.run(Scenario::CleanedUp(lock.clone()));
        reconcile(Arc::new(lock), ctx).await.expect("reconcile");
        timeout_after_1s(scenario).await;
        // Only the deleted lock is cleared; its token stays, so that a lock created again under
        // the name continues above it.
        assert_eq!(holder(&driver, "jobs").await, None);
        assert_eq!(holder(&driver, "other").await, held("pod-a", 1));
        // Token 2 went to the clean-up itself, which took the lock to delete its records.
        assert_eq!(next_token(&driver, "jobs").await, 3);
    }

    /// Deleting a held lock's records would let a newcomer in beside the holder and restart the
    /// lock's tokens: the clean-up waits, says so, and keeps the finalizer and the row.
    #[tokio::test]
    async fn delete_waits_while_the_lock_has_a_holder() {
        let (server, driver) = redis().await;
        let leasehold_lease::Acquire::Acquired(lease) = driver
            .try_acquire("jobs", "pod-a", Duration::from_secs(30))
            .await
            .unwrap()
        else {
            panic!("the free lock was not acquired")
        };
        let (ctx, api) = Context::test();
        let lock = fixtures::being_deleted(
            fixtures::redis_lock("jobs", server.port()),
            CleanupPolicy::Delete,
        );
        let scenario = api.run(Scenario::CleanupWaits(lock.clone()));
        let error = reconcile(Arc::new(lock.clone()), ctx)
            .await
            .expect_err("the clean-up went ahead under a live holder");
        assert_eq!(error.label(), "holder_alive");
        assert!(error.to_string().contains("pod-a (token 1)"), "{error}");
        timeout_after_1s(scenario).await;
        assert_eq!(
            holder(&driver, "jobs").await,
            held("pod-a", 1),
            "the held lock was cleared"
        );

        // Once the holder has released, the same clean-up goes through.
        assert!(driver.release(&lease).await.unwrap());
        let (ctx, api) = Context::test();
        let scenario = api.run(Scenario::CleanedUp(lock.clone()));
        reconcile(Arc::new(lock), ctx).await.expect("reconcile");
        timeout_after_1s(scenario).await;
        assert_eq!(holder(&driver, "jobs").await, None);
        assert_eq!(next_token(&driver, "jobs").await, 3);
    }

    /// A family has no single holder: its status counts the keys held in every pod, and
    /// follows the count at each look.
    #[tokio::test]
    async fn a_family_status_counts_its_held_keys() {
        let (server, driver) = redis().await;
        let mut leases = Vec::new();
        for key in ["orders.keys.o-1", "orders.keyh.0123456789abcdef"] {
            let leasehold_lease::Acquire::Acquired(lease) = driver
                .try_acquire(key, "pod-a", Duration::from_secs(30))
                .await
                .unwrap()
            else {
                panic!("{key} is not free")
            };
            leases.push(lease);
        }
        // Neither a plain lock nor another family's key is one of the family's.
        for other in ["orders", "ordersx.keys.o-1"] {
            driver
                .try_acquire(other, "pod-a", Duration::from_secs(30))
                .await
                .unwrap();
        }
        let (ctx, api) = Context::test();
        let lock = fixtures::with_finalizer(fixtures::family(fixtures::redis_lock(
            "orders",
            server.port(),
        )));
        let scenario = api.run(Scenario::FamilyProvisioned(lock.clone(), 2));
        reconcile(Arc::new(lock.clone()), ctx.clone())
            .await
            .expect("reconcile");
        timeout_after_1s(scenario).await;

        assert!(driver.release(&leases[0]).await.unwrap());
        let (ctx, api) = Context::test();
        let mut counted = lock.clone();
        counted.status = Some(status::desired(
            None,
            lock.meta().generation,
            "redis",
            &Observation::Ready {
                holder: None,
                held_keys: Some(2),
                held_permits: None,
                warnings: vec![],
            },
            Timestamp::now(),
        ));
        let scenario = api.run(Scenario::HeldKeysChanged(counted.clone(), 1));
        reconcile(Arc::new(counted), ctx).await.expect("reconcile");
        timeout_after_1s(scenario).await;
    }

    /// `cleanupPolicy: Delete` on a family waits while any of its keys is held, names how many,
    /// and goes through once none is.
    #[tokio::test]
    async fn delete_of_a_family_waits_for_its_held_keys() {
        let (server, driver) = redis().await;
        let leasehold_lease::Acquire::Acquired(lease) = driver
            .try_acquire("orders.keys.o-1", "pod-a", Duration::from_secs(30))
            .await
            .unwrap()
        else {
            panic!("the free key was not acquired")
        };
        let (ctx, api) = Context::test();
        let lock = fixtures::being_deleted(
            fixtures::family(fixtures::redis_lock("orders", server.port())),
            CleanupPolicy::Delete,
        );
        let scenario = api.run(Scenario::CleanupWaits(lock.clone()));
        let error = reconcile(Arc::new(lock.clone()), ctx)
            .await
            .expect_err("the clean-up went ahead with a key held");
        assert_eq!(error.label(), "holder_alive");
        assert!(
            error
                .to_string()
                .contains("1 key of the family is still held"),
            "{error}"
        );
        timeout_after_1s(scenario).await;

        assert!(driver.release(&lease).await.unwrap());
        let (ctx, api) = Context::test();
        let scenario = api.run(Scenario::CleanedUp(lock.clone()));
        reconcile(Arc::new(lock), ctx).await.expect("reconcile");
        timeout_after_1s(scenario).await;
    }

    /// A lock of several permits: the status names permit 0's holder and counts the permits
    /// held in every pod; `cleanupPolicy: Delete` waits while any permit is held (also once
    /// the count was lowered to one), and goes through once none is.
    #[tokio::test]
    async fn a_lock_of_several_permits_is_counted_and_cleaned_up_once_none_is_held() {
        let (server, driver) = redis().await;
        let permit = |i| leasehold_lease::keyed::lock_permit_name("workers", i);
        let mut leases = Vec::new();
        for (i, pod) in [(0, "pod-a"), (2, "pod-b")] {
            let leasehold_lease::Acquire::Acquired(lease) = driver
                .try_acquire(&permit(i), pod, Duration::from_secs(30))
                .await
                .unwrap()
            else {
                panic!("permit {i} is not free")
            };
            leases.push(lease);
        }
        let lock = fixtures::with_permits(fixtures::redis_lock("workers", server.port()), 3);
        let (ctx, api) = Context::test();
        let provisioned = fixtures::with_finalizer(lock.clone());
        let scenario = api.run(Scenario::PermitsProvisioned(
            provisioned.clone(),
            "pod-a",
            2,
        ));
        reconcile(Arc::new(provisioned), ctx)
            .await
            .expect("reconcile");
        timeout_after_1s(scenario).await;

        // Lowered to one permit meanwhile: the status still counts permits held, so the
        // clean-up still waits for the one above.
        let mut deleted = fixtures::being_deleted(lock, CleanupPolicy::Delete);
        deleted.spec.permits = Some(1);
        deleted.status = Some(leasehold_crds::DistributedLockStatus {
            held_permits: Some(2),
            ..Default::default()
        });
        for (still, says) in [
            (&leases[1], "a permit of the lock is still held"),
            (&leases[0], "pod-a (token 1) still holds the lock"),
        ] {
            let (ctx, api) = Context::test();
            let scenario = api.run(Scenario::CleanupWaits(deleted.clone()));
            let error = reconcile(Arc::new(deleted.clone()), ctx)
                .await
                .expect_err("the clean-up went ahead with a permit held");
            assert!(error.to_string().contains(says), "{error}");
            timeout_after_1s(scenario).await;
            assert!(driver.release(still).await.unwrap());
        }
        let (ctx, api) = Context::test();
        let scenario = api.run(Scenario::CleanedUp(deleted.clone()));
        reconcile(Arc::new(deleted), ctx).await.expect("reconcile");
        timeout_after_1s(scenario).await;
    }

    /// A namespace being deleted refuses every event; the clean-up must not wait for a holder
    /// there (or retry a publish) and keep the namespace `Terminating`.
    #[tokio::test]
    async fn delete_in_a_terminating_namespace_lets_go_at_once() {
        let (server, driver) = redis().await;
        driver
            .try_acquire("jobs", "pod-a", Duration::from_secs(30))
            .await
            .unwrap();
        let (ctx, api) = Context::test();
        let lock = fixtures::being_deleted(
            fixtures::redis_lock("jobs", server.port()),
            CleanupPolicy::Delete,
        );
        let scenario = api.run(Scenario::CleanupInTerminatingNamespace(lock.clone()));
        let action = reconcile(Arc::new(lock), ctx).await.expect("reconcile");
        assert_eq!(action, Action::await_change());
        timeout_after_1s(scenario).await;
        assert_eq!(
            holder(&driver, "jobs").await,
            held("pod-a", 1),
            "the held lock must be kept, not cleared under its holder"
        );
    }

    #[tokio::test]
    async fn delete_gives_up_on_an_unreachable_backend_after_the_deadline() {
        let (ctx, api) = Context::test();
        let mut lock = fixtures::being_deleted(
            fixtures::unreachable_redis_lock("cache"),
            CleanupPolicy::Delete,
        );
        let deleted = Timestamp::now() - CLEANUP_DEADLINE - Duration::from_secs(1);
        lock.meta_mut().deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(deleted),
        );
        let scenario = api.run(Scenario::CleanupPastItsDeadline(lock.clone()));
        let action = reconcile(Arc::new(lock), ctx).await.expect("reconcile");
        assert_eq!(action, Action::await_change());
        timeout_after_1s(scenario).await;
    }

    #[tokio::test]
    async fn before_the_deadline_an_unreachable_backend_keeps_the_finalizer() {
        let (ctx, api) = Context::test();
        let lock = fixtures::being_deleted(
            fixtures::unreachable_redis_lock("cache"),
            CleanupPolicy::Delete,
        );
        let scenario = api.run(Scenario::CleanupFailsForNow(lock.clone()));
        let error = reconcile(Arc::new(lock), ctx).await.unwrap_err();
        assert_eq!(error.label(), "backend");
        timeout_after_1s(scenario).await;
    }

    #[test]
    fn backoff_doubles_to_a_ceiling() {
        assert_eq!(backoff(1), Duration::from_secs(2));
        assert_eq!(backoff(2), Duration::from_secs(4));
        assert_eq!(backoff(5), Duration::from_secs(32));
        assert_eq!(backoff(30), MAX_BACKOFF);
    }
}
