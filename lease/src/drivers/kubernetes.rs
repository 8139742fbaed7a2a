//! The Kubernetes Lease driver: one `coordination.k8s.io/v1` Lease per lock.
//!
//! - **Acquire** reads the Lease and, when it is free or expired, replaces it with this holder,
//!   `leaseTransitions + 1`, and the `resourceVersion` it read. The API server refuses the write
//!   with 409 when anybody wrote in between, so of two contenders that saw the same expired
//!   record exactly one wins.
//! - **Token**: `leaseTransitions` after the acquisition. It goes up by one on *every*
//!   acquisition (client-go counts only changes of holder; a fencing token may not repeat when
//!   one pod takes the lock twice). Release keeps it, so the next holder continues from it.
//! - **Renew and release** present the identity and token they hold and write with the
//!   `resourceVersion` they read; a conflict re-reads and re-checks.
//! - **Expiry** is observed, as client-go's leader election does: a contender takes a held
//!   Lease only once it has seen the same record (the same holder's claim on the same object)
//!   unchanged for the record's whole duration on its own boot clock. The holder started its claim before it
//!   wrote the record, and the contender first saw the record after it was written, so the
//!   holder's claim has ended by then whatever the nodes' wall clocks say: `renewTime` is never
//!   compared across nodes. A contender that first sees a dead holder's record waits one lease
//!   from then, unless the record's `renewTime` is more than [`MAX_CLOCK_SKEW`] past its end on
//!   this node's wall clock (a key whose holder died long ago is taken at once): nodes' clocks
//!   must then agree within that, not within the lease's safety margin. A record this process
//!   has seen written (renewed, taken) is timed by observation alone, so a holder whose clock
//!   steps back keeps its lease.
//!   `leaseDurationSeconds` is whole seconds (what client-go and `kubectl` read), rounded up;
//!   the exact duration is kept in the annotation [`DURATION_ANNOTATION`].
//! - **Wake-ups**: one watch per lock (on the Lease's name), started by the first waiter.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease as LeaseObject, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::PostParams;
use kube::runtime::watcher;
use tokio::sync::watch;

use crate::boot_clock::BootInstant;
use crate::driver::{Acquire, Driver, Holding, Lease, Provisioned, Pruned, Upkeep};
use crate::drivers::url_parts::invalid_url;
use crate::error::{Error, Result};

/// `kubernetes://[NAMESPACE][?preferred-holder=yield]`: a `coordination.k8s.io/v1` Lease per
/// lock, named after the lock, in NAMESPACE (default: the pod's own), with in-cluster or
/// `KUBECONFIG` credentials.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct KubernetesConfig {
    pub namespace: Option<String>,
    /// `preferred-holder=yield`: the Lease's `preferredHolder` (Kubernetes' coordinated leader
    /// election, KEP-4355) moves the lock: a holder it does not name renews no more and lets its
    /// term run out, and a contender it does not name leaves the preferred one a head start.
    pub yield_to_preferred_holder: bool,
}

/// The query that makes a Lease's `preferredHolder` move the lock.
const YIELD_QUERY: &str = "preferred-holder=yield";

impl KubernetesConfig {
    /// `kubernetes://[NAMESPACE][?preferred-holder=yield]`.
    pub(crate) fn from_url(raw: &str, _scheme: &str, rest: &str) -> Result<Self> {
        let invalid = invalid_url(raw);
        let (namespace, query) = match rest.split_once('?') {
            Some((namespace, query)) => (namespace, Some(query)),
            None => (rest, None),
        };
        if namespace.contains(['/', '?', '@']) {
            return Err(invalid(
                        "kubernetes:// takes only a namespace (kubernetes://NAMESPACE), or nothing for the pod's own".into(),
                    ));
        }
        let yield_to_preferred_holder = match query {
            None => false,
            Some(YIELD_QUERY) => true,
            Some(other) => {
                return Err(invalid(format!(
                    "kubernetes:// takes one option, ?{YIELD_QUERY}, not ?{other}"
                )));
            }
        };
        let namespace = if namespace.is_empty() {
            None
        } else {
            crate::names::validate_namespace(namespace).map_err(|e| invalid(e.to_string()))?;
            Some(namespace.to_owned())
        };
        Ok(KubernetesConfig {
            namespace,
            yield_to_preferred_holder,
        })
    }
}

/// `kubernetes://NAMESPACE`, or `kubernetes://` for the pod's own, and the option.
impl fmt::Display for KubernetesConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let KubernetesConfig {
            namespace,
            yield_to_preferred_holder,
        } = self;
        write!(f, "kubernetes://{}", namespace.as_deref().unwrap_or(""))?;
        if *yield_to_preferred_holder {
            write!(f, "?{YIELD_QUERY}")?;
        }
        Ok(())
    }
}

/// The exact lease duration in milliseconds, next to the whole seconds of the spec.
pub const DURATION_ANNOTATION: &str = "leasehold.dev/lease-duration-ms";

/// Marks a family key's Lease that an acquisition created and whose token is not yet known to be
/// above the family's floor ([`floor_lease`]): the creation drew its token from a floor read
/// before it, and a sweep may have raised the floor since. Whoever takes such a Lease reads the
/// floor again. The mark goes with the first write made once the token is known to be above
/// the floor: the raise above it, the holder's first renewal or release, or a takeover, whose
/// write is checked against the version read after the floor. Without it, a key whose check failed (the raise above the floor
/// refused, or the creation's answer lost) would be taken again from its stale token, which may
/// lie below tokens the key was given before its Lease was swept.
pub const FLOOR_UNCHECKED_ANNOTATION: &str = "leasehold.dev/floor-unchecked";

/// A random value each acquisition writes on the Lease, so that the acquirer re-reading after a
/// write whose answer was lost knows its own claim from another's: two processes given the same
/// identity (a misconfiguration, but one a copied manifest makes) may write the same holder and
/// token, even in the same microsecond, and only one of them holds.
pub const CLAIM_ANNOTATION: &str = "leasehold.dev/claim";

/// How often renew and release re-read after a `resourceVersion` conflict before giving up:
/// conflicts come from writers that are not the holder (the operator, `kubectl annotate`), and
/// a holder should not lose its lease to them.
const CONFLICT_RETRIES: usize = 3;

/// The annotation that names, on a lock's Lease, the `DistributedLock` it serves: the operator
/// maps the Lease's holder changes to its lock by it (the Lease has no owner to map by). An
/// annotation, not a label: a lock's name may be longer than a label value may be.
pub const LOCK_ANNOTATION: &str = "leasehold.dev/lock";
/// The label on every Lease Leasehold makes. A Lease without it is another program's (a
/// controller's election Lease, `kube-node-lease`'s heartbeats): Leasehold neither takes it
/// over nor frees it, whatever a lock is named.
pub const MANAGED_BY_LABEL: (&str, &str) = ("app.kubernetes.io/managed-by", "leasehold");

/// Which Lease holds a lock. The Lease is owned by no object: the garbage collector would
/// delete an owned Lease with its owner, holder and token history with it, even while holders
/// still claim the lock (a foreground deletion deletes dependents before the owner's
/// finalizers have run), and a lock created again would start its tokens afresh. Clean-up is
/// the operator's finalizer's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LeaseTarget {
    /// The Lease's name (default: the lock's name).
    pub name: Option<String>,
}

/// One lock's wake-up counter and the task that watches its Lease, stopped with it.
struct LeaseWatch {
    tx: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for LeaseWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The Leases watched for waiters, by lock.
type Watches = Pruned<String, LeaseWatch>;

/// How far apart two nodes' wall clocks may be for a record dated by another node to count as
/// run out by this node's clock alone: far beyond what NTP-synced nodes see (milliseconds), and
/// beyond what breaks a cluster anyway (TLS validity, token expiry).
pub const MAX_CLOCK_SKEW: Duration = Duration::from_secs(60);

/// When this process first saw a held Lease's current record.
struct Sighting {
    /// The record's `resourceVersion`; `None` once the Lease was seen deleted.
    version: Option<String>,
    /// What the holder's writes change: the record is seen written (a renewal, a takeover)
    /// when this does, not at another writer's change of labels, annotations or
    /// `preferredHolder`, which says nothing of whether the holder is alive.
    claim: Claim,
    since: BootInstant,
    duration: Duration,
    /// This process saw the record written while it watched (a renewal, a takeover): its
    /// writer is alive, whatever its `renewTime` says by this node's clock.
    written_since_first_seen: bool,
    /// Who the record names, and its token.
    identity: String,
    token: u64,
    /// Counted free at once when last seen: dated long before this node's clock.
    long_over: bool,
    /// The claim of a deleted Lease's holder, as this process last saw it, where this record
    /// is of an object made since: that holder learns of the deletion only at its next
    /// renewal, so the lock stays busy until then, whoever takes and releases the new object.
    deleted_claim: Option<DeletedClaim>,
}

/// [`Sighting::deleted_claim`]: who held the deleted Lease, and until when it may claim it.
#[derive(Clone)]
struct DeletedClaim {
    identity: String,
    token: u64,
    until: BootInstant,
}

impl DeletedClaim {
    fn holding(&self, now: BootInstant) -> Option<Holding> {
        let left = self.until.saturating_duration_since(now);
        (!left.is_zero()).then(|| Holding {
            identity: self.identity.clone(),
            token: self.token,
            expires_in: Some(left),
        })
    }
}

/// The fields of a Lease a holder's acquisition or renewal writes, and the object's `uid`: a
/// Lease deleted and restored from a backup is another object, whatever its claim says.
#[derive(Clone, PartialEq)]
struct Claim {
    uid: Option<String>,
    identity: Option<String>,
    transitions: Option<i32>,
    acquired: Option<Timestamp>,
    renewed: Option<Timestamp>,
    duration: Duration,
}

impl Claim {
    fn of(object: &LeaseObject, record: &Record) -> Self {
        let spec = object.spec.as_ref();
        Self {
            uid: object.metadata.uid.clone(),
            identity: spec.and_then(|s| s.holder_identity.clone()),
            transitions: spec.and_then(|s| s.lease_transitions),
            acquired: spec.and_then(|s| s.acquire_time.as_ref().map(|t| t.0)),
            renewed: record.renewed,
            duration: record.duration,
        }
    }
}

/// A lock's highest token seen, and until when it is kept.
struct TokenSeen {
    token: u64,
    until: BootInstant,
}

/// The claim value ([`CLAIM_ANNOTATION`]) this process wrote with a lock's token, and until when
/// it is kept.
struct OwnClaim {
    token: u64,
    value: String,
    until: BootInstant,
}

/// How long a token seen is kept after it was last seen: past any lease a Lease deleted by hand
/// could be taken again within.
const TOKEN_KEPT: Duration = Duration::from_secs(600);

impl Sighting {
    /// How long the record seen stays held, from `now`: zero once it has run out.
    fn left(&self, now: BootInstant) -> Duration {
        self.duration
            .saturating_sub(now.saturating_duration_since(self.since))
    }

    /// The holding seen, for what is left of it at `now`; `None` once it has run out.
    fn holding(&self, now: BootInstant) -> Option<Holding> {
        let left = self.left(now);
        (!left.is_zero()).then(|| Holding {
            identity: self.identity.clone(),
            token: self.token,
            expires_in: Some(left),
        })
    }

    /// What a record of `claim`, replacing this one at `now`, inherits of a deleted Lease's
    /// holder: this record's own holder where `claim` is of another object (or the deletion
    /// was seen), who may claim for a duration from the deletion (at or before `now`, or when
    /// it was seen), and whatever this record inherited itself.
    fn deleted_claim_beside(&self, claim: &Claim, now: BootInstant) -> Option<DeletedClaim> {
        let another_object = self.version.is_none() || self.claim.uid != claim.uid;
        let own = (another_object && !self.long_over).then(|| DeletedClaim {
            identity: self.identity.clone(),
            token: self.token,
            until: match self.version {
                None => self.since + self.duration,
                Some(_) => now + self.duration,
            },
        });
        [own, self.deleted_claim.clone()]
            .into_iter()
            .flatten()
            .filter(|deleted| deleted.until > now)
            .max_by_key(|deleted| deleted.until)
    }
}

/// The holding of `lock` a process saw before its Lease was deleted, where `object`, naming
/// nobody, is another object made since (its `uid` differs, or the deletion was seen): the
/// deleted Lease's holder learns of the deletion only at its next renewal, so its claim may
/// run a whole duration from the deletion, timed (as [`KubernetesLeaseDriver::vanished`] does)
/// from when this process first finds the Lease gone or replaced. `None` once that has passed,
/// for a record taken as dead long ago, or where `object` is the one seen (a release).
fn replaced_unheld(
    sightings: &mut Pruned<String, Sighting>,
    lock: &str,
    object: &LeaseObject,
    now: BootInstant,
) -> Option<Holding> {
    let seen = sightings.get_mut(lock)?;
    if seen.long_over {
        return None;
    }
    if seen.version.is_some() {
        if seen.claim.uid == object.metadata.uid {
            return None;
        }
        seen.version = None;
        seen.since = now;
    }
    seen.holding(now)
}

/// The holding of `lock` this process saw, where `object`, the same Lease, names nobody but
/// still has its `acquireTime`: the holder did not write it (a release clears `acquireTime`, as
/// freeing it does), another writer cleared the holder (`kubectl patch`, a tool forcing a
/// failover as for client-go), and the holder, which learns of it only at its next renewal, may
/// claim until what it last renewed for runs out. That is the sighting's end where the edit
/// left the renewal seen; where the holder renewed unseen before the edit, up to its duration
/// from now, and the sighting is dated so. `None` once that has passed.
fn cleared_by_another(
    sightings: &mut Pruned<String, Sighting>,
    lock: &str,
    object: &LeaseObject,
    record: &Record,
    now: BootInstant,
) -> Option<Holding> {
    let seen = sightings.get_mut(lock)?;
    let acquired = object
        .spec
        .as_ref()
        .is_some_and(|s| s.acquire_time.is_some());
    if seen.version.is_none()
        || seen.long_over
        || seen.claim.uid != object.metadata.uid
        || !acquired
    {
        return None;
    }
    let claim = Claim::of(object, record);
    if seen.claim.renewed != claim.renewed {
        seen.since = now;
        seen.duration = record.duration.max(seen.claim.duration);
    }
    seen.claim = claim;
    seen.holding(now)
}

pub struct KubernetesLeaseDriver {
    client: kube::Client,
    namespace: String,
    targets: HashMap<String, LeaseTarget>,
    feeds: Mutex<Watches>,
    /// Held records as this process first saw them, by lock: their expiry.
    sightings: Mutex<Pruned<String, Sighting>>,
    /// The highest token this process has seen or drawn of each lock, a while after: a Lease
    /// deleted by hand takes its count with it, and one made again draws above this.
    tokens_seen: Mutex<Pruned<String, TokenSeen>>,
    /// The claim value of each lock this process holds: renewals and releases write only a
    /// Lease that carries it, so that a holder of the same identity and token (another process
    /// given this identity, which made a Lease deleted by hand again) is never taken for this one.
    own_claims: Mutex<Pruned<String, OwnClaim>>,
    /// The Lease's `preferredHolder` moves the lock ([`KubernetesConfig::yield_to_preferred_holder`]).
    yield_to_preferred_holder: bool,
}

impl KubernetesLeaseDriver {
    /// Leases in `namespace`, through `client`.
    pub fn new(client: kube::Client, namespace: impl Into<String>) -> Self {
        Self {
            client,
            namespace: namespace.into(),
            targets: HashMap::new(),
            feeds: Mutex::default(),
            sightings: Mutex::default(),
            tokens_seen: Mutex::default(),
            own_claims: Mutex::default(),
            yield_to_preferred_holder: false,
        }
    }

    /// Let the Lease's `preferredHolder` (KEP-4355) move the lock: a holder it does not name
    /// stops renewing, so its term runs out; a contender it does not name takes a free Lease
    /// only once it has gone unrenewed for two of its durations, the preferred one's head start.
    pub fn yielding_to_preferred_holder(mut self, yields: bool) -> Self {
        self.yield_to_preferred_holder = yields;
        self
    }

    /// Who holds `lock` by `object`, as observed: a named holder whose record this process has
    /// seen unchanged for less than its duration. A record first seen now counts from now.
    fn held_by(&self, lock: &str, object: &LeaseObject, record: &Record) -> Option<Holding> {
        let mut sightings = self.sightings.lock().unwrap_or_else(|e| e.into_inner());
        let now = BootInstant::now();
        // Seen held or released alike: a Lease made again after a deletion draws above it.
        self.saw_token(lock, record.transitions);
        let Some(identity) = record.identity.clone() else {
            // Released by its holder (the Lease seen held, now naming nobody) the lock is free;
            // but a Lease made again after a deletion (by provisioning, which makes a missing
            // Lease blank) is another object, which says nothing of the deleted one's holder.
            if let Some(holding) = replaced_unheld(&mut sightings, lock, object, now) {
                return Some(holding);
            }
            if let Some(holding) = cleared_by_another(&mut sightings, lock, object, record, now) {
                return Some(holding);
            }
            let deleted = sightings
                .get(lock)
                .and_then(|seen| seen.deleted_claim.as_ref()?.holding(now));
            if deleted.is_none() {
                sightings.remove(lock);
            }
            return deleted;
        };
        let version = object.metadata.resource_version.clone();
        let claim = Claim::of(object, record);
        let sighting = sightings
            .entry(lock.to_owned())
            .and_modify(|seen| {
                // A Lease made again after a deletion seen is a new record, whatever it says.
                if seen.version.is_none() || seen.claim != claim {
                    let deleted_claim = seen.deleted_claim_beside(&claim, now);
                    // The same holding, its duration shortened by another writer (a hand
                    // edit): its holder claims what it last renewed for all the same, the
                    // sighting's end, or where it renewed unseen, its duration from now.
                    let same_holding = seen.version.is_some()
                        && seen.claim.uid == claim.uid
                        && seen.identity == identity
                        && seen.token == record.transitions;
                    let duration = match same_holding {
                        false => record.duration,
                        true if seen.claim.renewed == claim.renewed => {
                            record.duration.max(seen.left(now))
                        }
                        true => record.duration.max(seen.claim.duration),
                    };
                    *seen = Sighting {
                        version: version.clone(),
                        claim: claim.clone(),
                        since: now,
                        duration,
                        written_since_first_seen: true,
                        identity: identity.clone(),
                        token: record.transitions,
                        long_over: false,
                        deleted_claim,
                    };
                } else {
                    seen.version = version.clone();
                }
            })
            .or_insert_with(|| Sighting {
                version: version.clone(),
                claim: claim.clone(),
                since: now,
                duration: record.duration,
                written_since_first_seen: false,
                identity: identity.clone(),
                token: record.transitions,
                long_over: false,
                deleted_claim: None,
            });
        // Busy until the deleted Lease's holder, too, can no longer claim it.
        let deleted_left = sighting
            .deleted_claim
            .as_ref()
            .and_then(|deleted| deleted.holding(now))
            .and_then(|holding| holding.expires_in)
            .unwrap_or_default();
        let left = sighting.left(now).max(deleted_left);
        // Dated by the writer's wall clock, which may have stepped back: a record seen written
        // while this process watched is timed by observation alone.
        let long_over = !sighting.written_since_first_seen
            && record
                .expires_at()
                .and_then(|end| {
                    end.checked_add(SignedDuration::try_from(MAX_CLOCK_SKEW).ok()?)
                        .ok()
                })
                .is_some_and(|end| end <= Timestamp::now());
        sighting.long_over = long_over;
        // A sighting is kept a while after it ran out (as long again as it lasted): the
        // contenders that watched it run out come back for it then, and one forgotten would be
        // counted again from their next look, a whole lease more.
        sightings.prune(|s| {
            now.saturating_duration_since(s.since) < s.duration * 2
                || s.deleted_claim.as_ref().is_some_and(|d| d.until > now)
        });
        (!left.is_zero() && !long_over).then_some(Holding {
            identity,
            token: record.transitions,
            expires_in: Some(left),
        })
    }

    /// `lock`'s Lease is gone (deleted by hand, pruned by a tool) where this process last saw it
    /// held: the holder may have renewed it since, unseen, and learns of the deletion only at
    /// its next renewal, so its claim may run for a whole duration from the deletion. Timed
    /// from when the deletion is first seen, as a record first seen is; `None` once that has
    /// passed, or for a record taken as dead long ago. The claim of the holder of a Lease
    /// deleted before the one seen stands too, however short the later holder's lease.
    fn vanished(&self, lock: &str) -> Option<Holding> {
        let mut sightings = self.sightings.lock().unwrap_or_else(|e| e.into_inner());
        let now = BootInstant::now();
        let seen = sightings.get_mut(lock)?;
        let deleted_before = seen
            .deleted_claim
            .as_ref()
            .and_then(|deleted| deleted.holding(now));
        if seen.long_over {
            return deleted_before;
        }
        // A sighting without a version is of the deletion: any record made since has one.
        if seen.version.take().is_some() {
            seen.since = now;
        }
        let left = seen.left(now);
        let own = (!left.is_zero()).then(|| Holding {
            identity: seen.identity.clone(),
            token: seen.token,
            expires_in: Some(left),
        });
        [own, deleted_before]
            .into_iter()
            .flatten()
            .max_by_key(|holding| holding.expires_in)
    }

    /// `token` of `lock` was seen or drawn.
    fn saw_token(&self, lock: &str, token: u64) {
        let mut seen = self.tokens_seen.lock().unwrap_or_else(|e| e.into_inner());
        let now = BootInstant::now();
        let entry = seen
            .entry(lock.to_owned())
            .or_insert(TokenSeen { token, until: now });
        entry.token = entry.token.max(token);
        entry.until = now + TOKEN_KEPT;
        seen.prune(|t| t.until > now);
    }

    /// `object`, just written by this process, holds `lock` for `identity` or no longer does:
    /// its claim value is kept, or forgotten. Kept a while past the lease, renewed with it.
    fn wrote_claim(&self, lock: &str, identity: &str, object: &LeaseObject) {
        let mut claims = self.own_claims.lock().unwrap_or_else(|e| e.into_inner());
        let record = Record::of(object);
        let held = record
            .as_ref()
            .filter(|record| record.identity.as_deref() == Some(identity));
        match (held, annotation(object, CLAIM_ANNOTATION)) {
            (Some(record), Some(value)) => {
                let now = BootInstant::now();
                claims.insert(
                    lock.to_owned(),
                    OwnClaim {
                        token: record.transitions,
                        value: value.to_owned(),
                        until: now + record.duration.max(Duration::from_secs(1)) * 2,
                    },
                );
                claims.prune(|claim| claim.until > now);
            }
            _ => {
                claims.remove(lock);
            }
        }
    }

    /// Whether `object` may be `lease`'s, as far as the claim value goes: the value this process
    /// wrote with the lease's token, where it remembers one.
    fn carries_own_claim(&self, lease: &Lease, object: &LeaseObject) -> bool {
        let claims = self.own_claims.lock().unwrap_or_else(|e| e.into_inner());
        match claims.get(&lease.lock) {
            Some(claim) if claim.token == lease.token => {
                annotation(object, CLAIM_ANNOTATION) == Some(claim.value.as_str())
            }
            _ => true,
        }
    }

    /// The highest token of `lock` this process has seen or drawn lately (0: none).
    fn token_seen(&self, lock: &str) -> u64 {
        let seen = self.tokens_seen.lock().unwrap_or_else(|e| e.into_inner());
        let remembered = seen.get(lock).map_or(0, |t| t.token);
        drop(seen);
        // A sighting outlives the tokens kept where a lease is longer than they are kept: the
        // holder it names, and that of a Lease deleted before, drew theirs.
        let sightings = self.sightings.lock().unwrap_or_else(|e| e.into_inner());
        let sighted = sightings.get(lock).map_or(0, |seen| {
            seen.token.max(
                seen.deleted_claim
                    .as_ref()
                    .map_or(0, |deleted| deleted.token),
            )
        });
        remembered.max(sighted)
    }

    /// In-cluster (or `KUBECONFIG`) credentials; `namespace` defaults to the pod's own.
    pub async fn connect(namespace: Option<&str>) -> Result<Self> {
        crate::tls::use_ring_provider();
        let client = kube::Client::try_default()
            .await
            .map_err(|e| Error::Unreachable(format!("no Kubernetes API configuration: {e}")))?;
        let namespace = namespace
            .map(str::to_owned)
            .unwrap_or_else(|| client.default_namespace().to_owned());
        Ok(Self::new(client, namespace))
    }

    /// Use `target` for `lock` instead of a Lease named after the lock.
    pub fn with_target(mut self, lock: &str, target: LeaseTarget) -> Self {
        self.targets.insert(lock.to_owned(), target);
        self
    }

    /// The Lease that holds `lock`: a declared lock's `leaseName`, else the lock's own name, or
    /// for a family's key whose plain name the API server refuses, the one its hash gives
    /// ([`crate::keyed::kubernetes_lease_name`]).
    pub fn lease_name<'a>(&'a self, lock: &'a str) -> Cow<'a, str> {
        match self.targets.get(lock).and_then(|t| t.name.as_deref()) {
            Some(name) => Cow::Borrowed(name),
            None => {
                crate::keyed::kubernetes_lease_name(lock).map_or(Cow::Borrowed(lock), Cow::Owned)
            }
        }
    }

    fn api(&self) -> Api<LeaseObject> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    async fn read(&self, lock: &str) -> Result<Option<LeaseObject>> {
        self.api()
            .get_opt(&self.lease_name(lock))
            .await
            .map_err(classify)
    }

    /// A fresh, unheld Lease for `lock`; a declared lock's names its `DistributedLock`.
    fn blank(&self, lock: &str) -> LeaseObject {
        LeaseObject {
            metadata: ObjectMeta {
                name: Some(self.lease_name(lock).into_owned()),
                namespace: Some(self.namespace.clone()),
                labels: Some(
                    [(MANAGED_BY_LABEL.0.to_owned(), MANAGED_BY_LABEL.1.to_owned())].into(),
                ),
                annotations: self
                    .targets
                    .contains_key(lock)
                    .then(|| [(LOCK_ANNOTATION.to_owned(), lock.to_owned())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        }
    }

    /// Refuse a Lease that Leasehold did not make ([`MANAGED_BY_LABEL`]): taking it over would
    /// put a second leader beside another program's, and freeing it would end that one's term.
    fn check_managed(&self, object: &LeaseObject) -> Result<()> {
        let labels = object.metadata.labels.as_ref();
        if labels
            .and_then(|l| l.get(MANAGED_BY_LABEL.0))
            .map(String::as_str)
            == Some(MANAGED_BY_LABEL.1)
        {
            return Ok(());
        }
        let name = object.metadata.name.as_deref().unwrap_or_default();
        Err(Error::InvalidConfig {
            field: "lease",
            reason: format!(
                "the Lease {}/{name} was not made by Leasehold (it lacks the label {}={}): it \
                 belongs to another program, whose leader it would displace; name another Lease \
                 (spec.backend.kubernetes.leaseName, or the lock's name), or add the label to \
                 hand this one to Leasehold",
                self.namespace, MANAGED_BY_LABEL.0, MANAGED_BY_LABEL.1
            ),
        })
    }

    /// Write `next` over `read` (whose `resourceVersion` it carries). `Ok(None)`: somebody wrote
    /// in between.
    async fn replace(&self, lock: &str, next: &LeaseObject) -> Result<Option<LeaseObject>> {
        let creating = next.metadata.resource_version.is_none();
        let result = if creating {
            self.api().create(&PostParams::default(), next).await
        } else {
            self.api()
                .replace(&self.lease_name(lock), &PostParams::default(), next)
                .await
        };
        match result {
            Ok(written) => Ok(Some(written)),
            // 409: Conflict on resourceVersion, or AlreadyExists on create.
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(None),
            // A create has no object to miss: its namespace does not exist, which no waiting
            // mends (answered as busy, the lock would wait for nobody without a word).
            Err(kube::Error::Api(status)) if status.code == 404 && creating => {
                Err(Error::Backend(format!(
                    "the Lease {}/{} cannot be created: {}; create the namespace, or name one \
                     that exists (kubernetes://NAMESPACE)",
                    self.namespace,
                    self.lease_name(lock),
                    status.message
                )))
            }
            // The Lease was deleted between our read and our write.
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(None),
            Err(e) => Err(classify(e)),
        }
    }

    /// Re-read and rewrite the lease's Lease with `change` while it is still `lease`'s, retrying
    /// conflicts with other writers. `Ok(false)`: it is not ours (any more).
    async fn rewrite_own(
        &self,
        lease: &Lease,
        require_unexpired: bool,
        yields: bool,
        change: impl Fn(&mut LeaseObject),
    ) -> Result<bool> {
        for _ in 0..CONFLICT_RETRIES {
            let Some(mut object) = self.read(&lease.lock).await? else {
                return Ok(false);
            };
            let Some(record) = Record::of(&object) else {
                return Ok(false);
            };
            if record.identity.as_deref() != Some(lease.identity.as_str())
                || record.transitions != lease.token
                || !self.carries_own_claim(lease, &object)
                || (require_unexpired && record.expired_at(Timestamp::now()))
            {
                return Ok(false);
            }
            if let Some(preferred) = preferred_other(&object, &lease.identity).filter(|_| yields) {
                // The end of this holder's term: it stops claiming now, and the Lease runs out
                // on its own, after which the preferred holder takes it.
                tracing::info!(lock = %lease.lock, preferred,
                    "the Lease prefers another holder: not renewing, the term runs out");
                return Ok(false);
            }
            change(&mut object);
            if let Some(written) = self.replace(&lease.lock, &object).await? {
                self.wrote_claim(&lease.lock, &lease.identity, &written);
                return Ok(true);
            }
        }
        Err(Error::Backend(format!(
            "the Lease {} kept changing during {CONFLICT_RETRIES} attempts to write it",
            self.lease_name(&lease.lock)
        )))
    }

    /// How many Leases are watched now (for tests of the pruning).
    pub fn watches(&self) -> usize {
        self.feeds.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The namespace's Leases of `family`'s keys (its floor's too), page by page.
    fn leases_of<'a>(&'a self, family: &'a str) -> FamilyLeases<'a> {
        FamilyLeases {
            driver: self,
            family,
            // Only Leasehold's own: another program's Leases are never read, counted or swept.
            params: Some(
                kube::api::ListParams::default()
                    .labels(&format!("{}={}", MANAGED_BY_LABEL.0, MANAGED_BY_LABEL.1))
                    .limit(FamilyLeases::PAGE),
            ),
        }
    }

    /// `family`'s token floor, its Lease made first where it is missing ([`Self::make_floor`]).
    async fn floor(&self, family: &str) -> Result<u64> {
        for _ in 0..CONFLICT_RETRIES {
            if let Some(object) = self.read(&floor_lease(family)).await? {
                return Ok(Record::of(&object).map_or(0, |record| record.transitions));
            }
            self.make_floor(family).await?;
        }
        Err(Error::Backend(format!(
            "the Lease {} kept disappearing during {CONFLICT_RETRIES} attempts to read it",
            floor_lease(family)
        )))
    }

    /// Make `family`'s floor Lease, which is missing, at the highest token among the family's
    /// key Leases: 0 for a new family; for one whose floor was deleted by hand, above every key
    /// still recorded, so that a key taken again never draws below them. Another writer's floor
    /// made meanwhile wins (the creation fails with a conflict, and the floor is read again).
    async fn make_floor(&self, family: &str) -> Result<()> {
        let name = floor_lease(family);
        let mut highest = 0;
        let mut pages = self.leases_of(family);
        while let Some(page) = pages.next().await? {
            highest = page
                .iter()
                .filter(|lease| lease.metadata.name.as_deref() != Some(name.as_str()))
                .filter_map(Record::of)
                .map(|record| record.transitions)
                .fold(highest, u64::max);
        }
        let mut object = self.blank(&name);
        object
            .spec
            .get_or_insert_with(LeaseSpec::default)
            .lease_transitions = Some(
            i32::try_from(highest)
                .map_err(|_| Error::Backend("leaseTransitions would pass 2^31".into()))?,
        );
        if self.replace(&name, &object).await?.is_some() && highest > 0 {
            tracing::warn!(
                family,
                floor = highest,
                "the family's token floor Lease was missing while key Leases remain; it was made again at their highest token"
            );
        }
        Ok(())
    }

    /// Raise `family`'s token floor to at least `token`.
    async fn raise_floor(&self, family: &str, token: u64) -> Result<()> {
        let name = floor_lease(family);
        let token = i32::try_from(token)
            .map_err(|_| Error::Backend("leaseTransitions would pass 2^31".into()))?;
        for _ in 0..CONFLICT_RETRIES {
            let Some(mut object) = self.read(&name).await? else {
                self.make_floor(family).await?;
                continue;
            };
            let spec = object.spec.get_or_insert_with(LeaseSpec::default);
            if spec.lease_transitions.unwrap_or(0) >= token {
                return Ok(());
            }
            spec.lease_transitions = Some(token);
            if self.replace(&name, &object).await?.is_some() {
                return Ok(());
            }
        }
        Err(Error::Backend(format!(
            "the Lease {name} kept changing during {CONFLICT_RETRIES} attempts to raise it"
        )))
    }

    /// `lease`, just created for a key of `family`, raised above the family's floor if a sweep
    /// raised the floor after this acquisition read it. A sweep raises the floor before it
    /// deletes, and the creation found no Lease, so the floor read now covers every token the
    /// key had. Until this answers, nobody has been given the token it replaces.
    async fn above_floor(&self, lease: Lease, family: &str, ttl: Duration) -> Result<Acquire> {
        let raised = async {
            let floor = self.floor(family).await?;
            if floor < lease.token {
                return Ok(Some(lease.clone()));
            }
            let token = floor + 1;
            // `claim` below cannot fail then.
            i32::try_from(token)
                .map_err(|_| Error::Backend("leaseTransitions would pass 2^31".into()))?;
            let written = self
                .rewrite_own(&lease, true, false, |object| {
                    let _ = claim(object, &lease.identity, token, ttl);
                    mark_floor_unchecked(object, false);
                })
                .await?;
            Ok::<_, Error>(written.then(|| Lease {
                token,
                ..lease.clone()
            }))
        };
        match raised.await {
            Ok(Some(lease)) => Ok(Acquire::Acquired(lease)),
            // Taken from it already: the lease ran out meanwhile.
            Ok(None) => Ok(Acquire::Busy(None)),
            Err(e) => {
                // The token below the floor is never handed out; the Lease goes back, still
                // marked unchecked, so that its next taker reads the floor.
                let _ = self.give_back(&lease, false).await;
                Err(e)
            }
        }
    }

    /// Release `lease`. Like client-go, the holder is cleared and the transitions count stays as
    /// the next token's base. `renewTime` is kept as the moment of the release: how long a key
    /// has been idle, for the sweep ([`Upkeep::forget_idle_keys`]). Nobody is named, so nobody
    /// holds it. `checked`: the token is known to be above the family's floor, and the Lease's
    /// [`FLOOR_UNCHECKED_ANNOTATION`] goes.
    async fn give_back(&self, lease: &Lease, checked: bool) -> Result<bool> {
        self.rewrite_own(lease, false, false, |object| {
            let spec = object.spec.get_or_insert_with(LeaseSpec::default);
            spec.holder_identity = None;
            spec.renew_time = Some(now_micro());
            spec.acquire_time = None;
            spec.lease_duration_seconds = Some(1);
            if checked {
                mark_floor_unchecked(object, false);
            }
        })
        .await
    }

    fn feed(&self, lock: &str) -> watch::Receiver<u64> {
        let mut feeds = self.feeds.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(watch) = feeds.get(lock)
            && !watch.task.is_finished()
        {
            return watch.tx.subscribe();
        }
        // Each watch is a request the API server keeps open, so one nobody listens to any
        // more is stopped (dropped).
        feeds.prune(|watch| watch.tx.receiver_count() > 0);
        let (tx, rx) = watch::channel(0u64);
        let stream = watcher(
            self.api(),
            watcher::Config::default().fields(&format!("metadata.name={}", self.lease_name(lock))),
        );
        let sender = tx.clone();
        let task = tokio::spawn(async move {
            // Every event (a write, a deletion, a re-list after a broken watch) may have freed
            // the lock; waiters re-check with one read. Errors are retried by the watcher's
            // backoff, and a waiter still polls meanwhile.
            let mut stream = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(stream));
            while let Some(event) = stream.next().await {
                if event.is_ok() {
                    sender.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
        });
        feeds.insert(lock.to_owned(), LeaseWatch { tx, task });
        rx
    }
}

/// The Leases of a family's keys, read a page at a time ([`KubernetesLeaseDriver::leases_of`]);
/// a key's Lease is named after its lock.
struct FamilyLeases<'a> {
    driver: &'a KubernetesLeaseDriver,
    family: &'a str,
    /// The next page's request; `None` after the last page.
    params: Option<kube::api::ListParams>,
}

impl FamilyLeases<'_> {
    const PAGE: u32 = 500;

    async fn next(&mut self) -> Result<Option<Vec<LeaseObject>>> {
        let Some(params) = self.params.take() else {
            return Ok(None);
        };
        let page = self.driver.api().list(&params).await.map_err(classify)?;
        if let Some(next) = page.metadata.continue_.filter(|next| !next.is_empty()) {
            self.params = Some(params.continue_token(&next));
        }
        let family = Some(self.family);
        Ok(Some(
            page.items
                .into_iter()
                .filter(|lease| {
                    lease
                        .metadata
                        .name
                        .as_deref()
                        .and_then(crate::names::family_of)
                        == family
                })
                .collect(),
        ))
    }
}

/// The part of a Lease that decides who holds it.
#[derive(Debug, Clone, PartialEq)]
struct Record {
    identity: Option<String>,
    transitions: u64,
    renewed: Option<Timestamp>,
    duration: Duration,
}

impl Record {
    fn of(object: &LeaseObject) -> Option<Self> {
        let spec = object.spec.as_ref()?;
        let exact = annotation(object, DURATION_ANNOTATION)
            .and_then(|ms| ms.parse::<u64>().ok())
            .map(Duration::from_millis);
        let whole = spec
            .lease_duration_seconds
            .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0)));
        Some(Self {
            identity: spec.holder_identity.clone().filter(|h| !h.is_empty()),
            transitions: u64::try_from(spec.lease_transitions.unwrap_or(0)).unwrap_or(0),
            renewed: spec.renew_time.as_ref().map(|t| t.0),
            // The exact figure only when it agrees with the whole seconds: a writer that does
            // not know the annotation (client-go) leaves a stale one behind.
            duration: match (exact, whole) {
                (Some(exact), Some(whole)) if whole == round_up(exact) => exact,
                (_, Some(whole)) => whole,
                (Some(exact), None) => exact,
                (None, None) => Duration::ZERO,
            },
        })
    }

    fn expires_at(&self) -> Option<Timestamp> {
        let renewed = self.renewed?;
        let duration = SignedDuration::try_from(self.duration).ok()?;
        renewed.checked_add(duration).ok()
    }

    /// Free: nobody named, or the last renewal's lease has run out.
    fn expired_at(&self, now: Timestamp) -> bool {
        self.identity.is_none() || self.expires_at().is_none_or(|end| end <= now)
    }

    /// Held, or run out less than [`MAX_CLOCK_SKEW`] ago by this clock: the holder's clock may
    /// run that far behind this one, and it still claims the key until its own clock says the
    /// lease ran out. What clean-up deletes, and the held keys the status counts, go by this.
    fn maybe_held_at(&self, now: Timestamp) -> bool {
        self.identity.is_some()
            && self
                .expires_at()
                .and_then(|end| {
                    end.checked_add(SignedDuration::try_from(MAX_CLOCK_SKEW).ok()?)
                        .ok()
                })
                .is_some_and(|end| end > now)
    }

    #[cfg(test)]
    fn holding(&self, now: Timestamp) -> Option<Holding> {
        if self.expired_at(now) {
            return None;
        }
        let left = self.expires_at()?.duration_since(now);
        Some(Holding {
            identity: self.identity.clone()?,
            token: self.transitions,
            expires_in: Duration::try_from(left).ok(),
        })
    }
}

/// The Lease that keeps `family`'s token floor: at least every token of the family's keys whose
/// Leases were deleted as idle. Named like a hashed key's Lease, but a hash is hex digits, so
/// it is no key's.
pub fn floor_lease(family: &str) -> String {
    format!("{family}{}floor", crate::names::HASHED_KEY_INFIX)
}

fn round_up(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs() + u64::from(d.subsec_nanos() > 0))
}

/// `leaseDurationSeconds` for `ttl`: rounded up, so that readers of the whole seconds never
/// see the lease end early.
fn whole_seconds(ttl: Duration) -> i32 {
    i32::try_from(round_up(ttl).as_secs().max(1)).unwrap_or(i32::MAX)
}

fn now_micro() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// The holder the Lease's `preferredHolder` names, when it is not `identity`.
fn preferred_other<'a>(object: &'a LeaseObject, identity: &str) -> Option<&'a str> {
    object
        .spec
        .as_ref()?
        .preferred_holder
        .as_deref()
        .filter(|preferred| !preferred.is_empty() && *preferred != identity)
}

/// Make `spec` this holder's, from now, for `ttl`.
fn claim(object: &mut LeaseObject, identity: &str, token: u64, ttl: Duration) -> Result<()> {
    let token = i32::try_from(token)
        .map_err(|_| Error::Backend("leaseTransitions would pass 2^31".into()))?;
    extend(object, ttl);
    let spec = object.spec.get_or_insert_with(LeaseSpec::default);
    spec.holder_identity = Some(identity.to_owned());
    spec.lease_transitions = Some(token);
    spec.acquire_time = spec.renew_time.clone();
    let value = format!("{:032x}", rand::random::<u128>());
    set_annotation(object, CLAIM_ANNOTATION, value);
    Ok(())
}

/// Whether `found` holds the claim `sent` wrote: the same holder, token, acquireTime (to the
/// microsecond the API server keeps) and [`CLAIM_ANNOTATION`].
fn same_claim(found: &LeaseObject, sent: &LeaseObject) -> bool {
    let sent_claim = annotation(sent, CLAIM_ANNOTATION);
    if sent_claim.is_none() || annotation(found, CLAIM_ANNOTATION) != sent_claim {
        return false;
    }
    let (Some(found), Some(sent)) = (&found.spec, &sent.spec) else {
        return false;
    };
    let micros = |time: &Option<MicroTime>| serde_json::to_value(time).ok();
    sent.holder_identity.is_some()
        && found.holder_identity == sent.holder_identity
        && found.lease_transitions == sent.lease_transitions
        && sent.acquire_time.is_some()
        && micros(&found.acquire_time) == micros(&sent.acquire_time)
}

/// The value of `object`'s annotation `name`.
fn annotation<'a>(object: &'a LeaseObject, name: &str) -> Option<&'a str> {
    object
        .metadata
        .annotations
        .as_ref()?
        .get(name)
        .map(String::as_str)
}

/// Set `object`'s annotation `name` to `value`.
fn set_annotation(object: &mut LeaseObject, name: &str, value: String) {
    object
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(name.to_owned(), value);
}

/// Whether `object` carries [`FLOOR_UNCHECKED_ANNOTATION`].
fn floor_unchecked(object: &LeaseObject) -> bool {
    annotation(object, FLOOR_UNCHECKED_ANNOTATION).is_some()
}

/// Set or clear [`FLOOR_UNCHECKED_ANNOTATION`] on `object`.
fn mark_floor_unchecked(object: &mut LeaseObject, unchecked: bool) {
    if unchecked {
        set_annotation(object, FLOOR_UNCHECKED_ANNOTATION, "true".to_owned());
        return;
    }
    let annotations = &mut object.metadata.annotations;
    if let Some(map) = annotations.as_mut() {
        map.remove(FLOOR_UNCHECKED_ANNOTATION);
        if map.is_empty() {
            *annotations = None;
        }
    }
}

/// Date the lease from now for `ttl`: `renewTime`, the whole seconds, and the exact duration.
fn extend(object: &mut LeaseObject, ttl: Duration) {
    set_annotation(object, DURATION_ANNOTATION, ttl.as_millis().to_string());
    let spec = object.spec.get_or_insert_with(LeaseSpec::default);
    spec.renew_time = Some(now_micro());
    spec.lease_duration_seconds = Some(whole_seconds(ttl));
}

/// kube's errors in the lease engine's terms. Status bodies carry no secrets, only the API
/// server's reason.
fn classify(e: kube::Error) -> Error {
    match e {
        kube::Error::Api(status) => match status.code {
            401 | 403 => Error::Backend(format!(
                "the API server refused ({}): {}; check the ServiceAccount's RBAC for leases",
                status.code, status.message
            )),
            429 | 500..=599 => Error::Unreachable(format!(
                "the API server answered {}: {}",
                status.code, status.message
            )),
            code => Error::Backend(format!(
                "the API server answered {code}: {}",
                status.message
            )),
        },
        other => Error::Unreachable(other.to_string()),
    }
}

#[async_trait]
impl Driver for KubernetesLeaseDriver {
    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        let (mut object, created) = match self.read(lock).await? {
            Some(object) => {
                self.check_managed(&object)?;
                (object, false)
            }
            None => (self.blank(lock), true),
        };
        if created && let Some(holding) = self.vanished(lock) {
            return Ok(Acquire::Busy(Some(holding)));
        }
        let record = Record::of(&object).unwrap_or(Record {
            identity: None,
            transitions: 0,
            renewed: None,
            duration: Duration::ZERO,
        });
        if !created && let Some(holding) = self.held_by(lock, &object, &record) {
            return Ok(Acquire::Busy(Some(holding)));
        }
        if self.yield_to_preferred_holder
            && let Some(preferred) = preferred_other(&object, identity)
        {
            // The preferred holder's head start: two durations after the last renewal (by
            // the writer's clock, which only delays this contender, never lets it in early
            // beside a holder: the holding itself is judged by observation, above).
            let unrenewed = record.renewed.map_or(Duration::MAX, |renewed| {
                Duration::try_from(Timestamp::now().duration_since(renewed)).unwrap_or_default()
            });
            let head_start = record.duration.max(ttl) * 2;
            if unrenewed < head_start {
                return Ok(Acquire::Withheld(crate::driver::Withheld {
                    reason: format!(
                        "the Lease prefers {preferred} (preferredHolder): others take it only once it has gone unrenewed for {head_start:?}"
                    ),
                    resume_in: Some(head_start - unrenewed),
                }));
            }
        }
        // A family's key whose Lease was forgotten as idle starts again above the family's
        // floor, which the sweep raised before it deleted the Lease. The sweep goes by the
        // Lease's name: so does the floor, also for a lock whose Lease is named like a key,
        // which provisioning may have made again, blank (never taken), before this call.
        let lease_name = self.lease_name(lock);
        let family = crate::names::family_of(&lease_name)
            .filter(|_| created || record.transitions == 0 || floor_unchecked(&object));
        let floor = match family {
            Some(family) => self.floor(family).await?,
            None => 0,
        };
        let token = record.transitions.max(floor).max(self.token_seen(lock)) + 1;
        claim(&mut object, identity, token, ttl)?;
        // A Lease that existed keeps its name while this write is checked against the version
        // read: a sweep deleting it between the floor's read and the write fails the write, so
        // the token is above the floor. A created one is checked after its creation.
        mark_floor_unchecked(&mut object, created && family.is_some());
        let lease = Lease {
            lock: lock.to_owned(),
            identity: identity.to_owned(),
            token,
        };
        let written = match self.replace(lock, &object).await {
            Ok(Some(written)) => Some(written),
            // The write may have committed with its answer lost (a 500 from a proxy, a reset
            // connection, a timeout): read once, as the engine would wait a lease for its own
            // claim, held for nobody, before taking the lock again.
            Err(error) => match self.read(lock).await {
                Ok(Some(found)) if same_claim(&found, &object) => Some(found),
                _ => return Err(error),
            },
            // A conflict may be this very write: committed, its answer lost (a 504 or 503), and
            // sent again by the client, which retries those on its own. The Lease then names
            // this process with this claim's own value; taken as anything else, it would
            // be held for nobody for a lease. It was written after this call began, from which
            // the engine counts the claim.
            Ok(None) => self
                .read(lock)
                .await?
                .filter(|found| same_claim(found, &object)),
        };
        match written {
            Some(written) => {
                self.wrote_claim(lock, identity, &written);
                let acquired = match family {
                    Some(family) => self.above_floor(lease, family, ttl).await,
                    None => Ok(Acquire::Acquired(lease)),
                };
                if let Ok(Acquire::Acquired(lease)) = &acquired {
                    self.saw_token(lock, lease.token);
                }
                acquired
            }
            // Another contender wrote first; whoever it is, the next read shows it.
            None => Ok(Acquire::Busy(None)),
        }
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let yields = self.yield_to_preferred_holder;
        // A lease the engine renews was checked above the floor when it was acquired.
        let renewed = self
            .rewrite_own(lease, true, yields, |object| {
                extend(object, ttl);
                mark_floor_unchecked(object, false);
            })
            .await;
        if matches!(renewed, Ok(true)) {
            self.saw_token(&lease.lock, lease.token);
        }
        renewed
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        // A lease the engine releases was checked above the floor when it was acquired.
        self.give_back(lease, true).await
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        let Some(object) = self.read(lock).await? else {
            return Ok(None);
        };
        Ok(Record::of(&object).and_then(|record| self.held_by(lock, &object, &record)))
    }

    fn changes(&self, lock: &str) -> Option<watch::Receiver<u64>> {
        Some(self.feed(lock))
    }

    fn expiry_is_observed(&self) -> bool {
        true
    }

    async fn ping(&self) -> Result<()> {
        self.client
            .apiserver_version()
            .await
            .map(|_| ())
            .map_err(classify)
    }
}

/// A Lease freed by a deletion of its lock's records: nobody named, and cut loose from any
/// owner an earlier version gave it; `leaseTransitions`, the token, stays.
fn free(object: &mut LeaseObject) {
    object.metadata.owner_references = None;
    if let Some(spec) = object.spec.as_mut() {
        spec.holder_identity = None;
        spec.acquire_time = None;
        spec.renew_time = None;
    }
}

#[async_trait]
impl Upkeep for KubernetesLeaseDriver {
    /// Freed as [`Upkeep::deprovision`] frees it, only while it names this holding (the
    /// `resourceVersion` it was read at is the write's precondition).
    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        let freed = self.rewrite_own(lease, false, false, free).await?;
        crate::driver::deleted_as_released(lease, freed)
    }

    /// The Lease is freed, not deleted: it keeps `leaseTransitions`, the token, so that a lock
    /// created again under the name continues above it. It is also cut loose from any owner an
    /// earlier version gave it, whose deletion the garbage collector would otherwise follow.
    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        for lock in locks {
            let mut freed = false;
            for _ in 0..CONFLICT_RETRIES {
                let Some(mut object) = self.read(lock).await? else {
                    freed = true;
                    break;
                };
                if let Err(foreign) = self.check_managed(&object) {
                    // Nothing of it is Leasehold's to free; the lock goes without it.
                    tracing::warn!(error = %foreign, "left the Lease as it is");
                    freed = true;
                    break;
                }
                free(&mut object);
                if self.replace(lock, &object).await?.is_some() {
                    freed = true;
                    break;
                }
            }
            if !freed {
                return Err(Error::Backend(format!(
                    "the Lease {} kept changing; it was not freed",
                    self.lease_name(lock)
                )));
            }
        }
        Ok(())
    }

    /// The namespace's Leases, read page by page; a key's Lease is named after its lock. A key
    /// whose holder's lease ran out less than [`MAX_CLOCK_SKEW`] ago counts as held: its holder
    /// may still claim it by a clock behind this one.
    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        let now = Timestamp::now();
        let mut held = 0;
        let mut pages = self.leases_of(family);
        while let Some(page) = pages.next().await? {
            held += page
                .iter()
                .filter_map(Record::of)
                .filter(|record| record.maybe_held_at(now))
                .count() as u64;
        }
        Ok(Some(held))
    }

    /// The family's key Leases that nobody has held for `idle_for` are deleted, each only as it
    /// was read (a precondition on its `resourceVersion`), after the family's floor
    /// ([`floor_lease`]) was raised to its token: a key taken again draws above it.
    async fn forget_idle_keys(&self, family: &str, idle_for: Duration) -> Result<u64> {
        let idle_for = SignedDuration::try_from(idle_for).unwrap_or(SignedDuration::MAX);
        let floor = floor_lease(family);
        let mut forgotten = 0;
        let mut pages = self.leases_of(family);
        while let Some(page) = pages.next().await? {
            for lease in &page {
                let (Some(name), Some(version)) = (
                    lease.metadata.name.as_deref(),
                    lease.metadata.resource_version.as_deref(),
                ) else {
                    continue;
                };
                let Some(record) = Record::of(lease).filter(|_| name != floor) else {
                    continue;
                };
                let now = Timestamp::now();
                // Idle since its release, or since its last holder's lease ran out.
                let created = lease.metadata.creation_timestamp.as_ref().map(|t| t.0);
                let idle_since = match record.identity {
                    None => record.renewed,
                    Some(_) => record.expires_at(),
                }
                .or(created);
                // Not while its holder, by a clock behind this one, may still claim it.
                let idle = !record.maybe_held_at(now)
                    && idle_since
                        .and_then(|since| since.checked_add(idle_for).ok())
                        .is_none_or(|until| until <= now);
                if !idle {
                    continue;
                }
                self.raise_floor(family, record.transitions).await?;
                let delete = kube::api::DeleteParams {
                    preconditions: Some(kube::api::Preconditions {
                        resource_version: Some(version.to_owned()),
                        uid: None,
                    }),
                    ..kube::api::DeleteParams::default()
                };
                match self.api().delete(name, &delete).await {
                    Ok(_) => forgotten += 1,
                    // Taken (or forgotten by another sweep) since it was read.
                    Err(kube::Error::Api(status)) if matches!(status.code, 404 | 409) => {}
                    Err(e) => return Err(classify(e)),
                }
            }
        }
        Ok(forgotten)
    }

    /// A Lease per lock: made unheld where missing; one that exists is checked to be
    /// Leasehold's and made what this version makes ([`KubernetesLeaseDriver::disown`]).
    async fn provision(&self, locks: &[String]) -> Result<()> {
        for lock in locks {
            self.provision_lease(lock).await?;
        }
        Ok(())
    }

    /// One read of the Lease (and a write only where it is missing or must change), which also
    /// answers who holds it.
    async fn provision_one(&self, lock: &str) -> Result<Provisioned> {
        let object = self.provision_lease(lock).await?;
        Ok(Provisioned::Read(
            Record::of(&object).and_then(|record| self.held_by(lock, &object, &record)),
        ))
    }
}

impl KubernetesLeaseDriver {
    /// `lock`'s Lease, made if missing and disowned if owned, as last read or written.
    async fn provision_lease(&self, lock: &str) -> Result<LeaseObject> {
        let lease_name = self.lease_name(lock);
        crate::names::validate_lease_name(&lease_name)?;
        // Named like a family's key, its tokens may have risen unseen to the family's floor.
        let named_like_a_key = crate::names::family_of(&lease_name).is_some();
        for _ in 0..CONFLICT_RETRIES {
            let written = match self.read(lock).await? {
                // 409 AlreadyExists: another provisioner won; read what it made. Made again
                // after a deletion, it starts from the highest token this process saw of it,
                // so that a process that never saw it draws above its last holders.
                None => {
                    let mut object = self.blank(lock);
                    object
                        .spec
                        .get_or_insert_with(LeaseSpec::default)
                        .lease_transitions =
                        Some(i32::try_from(self.token_seen(lock)).unwrap_or(i32::MAX));
                    // The next acquisition reads the floor.
                    mark_floor_unchecked(&mut object, named_like_a_key);
                    self.replace(lock, &object).await?
                }
                Some(mut object) => {
                    self.check_managed(&object)?;
                    if let Some(record) = Record::of(&object) {
                        self.saw_token(lock, record.transitions);
                    }
                    if !self.disown(lock, &mut object) {
                        return Ok(object);
                    }
                    // Renewed meanwhile: read it again.
                    self.replace(lock, &object).await?
                }
            };
            if let Some(written) = written {
                return Ok(written);
            }
        }
        Err(Error::Backend(format!(
            "the Lease {} kept changing during {CONFLICT_RETRIES} attempts to provision it",
            self.lease_name(lock)
        )))
    }

    /// Make `object` owned by no `DistributedLock` of `lock`'s name (an earlier version made it
    /// its lock's dependent, which the garbage collector would delete with the lock) and, for a
    /// declared lock, annotated with the lock's name; whether anything changed.
    fn disown(&self, lock: &str, object: &mut LeaseObject) -> bool {
        let mut changed = false;
        if let Some(owners) = object.metadata.owner_references.as_mut() {
            let before = owners.len();
            owners.retain(|o| !(o.kind == "DistributedLock" && o.name == lock));
            changed |= owners.len() != before;
            if owners.is_empty() {
                object.metadata.owner_references = None;
            }
        }
        if self.targets.contains_key(lock) {
            let annotations = object
                .metadata
                .annotations
                .get_or_insert_with(Default::default);
            if annotations.get(LOCK_ANNOTATION).map(String::as_str) != Some(lock) {
                annotations.insert(LOCK_ANNOTATION.to_owned(), lock.to_owned());
                changed = true;
            }
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend_url::BackendUrl;

    fn holding_of(object: &LeaseObject) -> Option<Holding> {
        Record::of(object).and_then(|r| r.holding(Timestamp::now()))
    }

    fn lease(
        holder: Option<&str>,
        renewed_ago: Duration,
        secs: i32,
        exact_ms: Option<u64>,
    ) -> LeaseObject {
        let renewed = Timestamp::now() - SignedDuration::try_from(renewed_ago).unwrap();
        LeaseObject {
            metadata: ObjectMeta {
                annotations: exact_ms
                    .map(|ms| [(DURATION_ANNOTATION.to_owned(), ms.to_string())].into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_owned),
                lease_duration_seconds: Some(secs),
                lease_transitions: Some(7),
                renew_time: Some(MicroTime(renewed)),
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn a_lease_expires_by_its_exact_duration_when_the_seconds_agree() {
        let object = lease(Some("a"), Duration::from_millis(400), 1, Some(300));
        assert_eq!(holding_of(&object), None);
        let object = lease(Some("a"), Duration::from_millis(100), 1, Some(300));
        let held = holding_of(&object).unwrap();
        assert_eq!((held.identity.as_str(), held.token), ("a", 7));
        assert!(held.expires_in.unwrap() <= Duration::from_millis(200));
    }

    #[test]
    fn a_stale_annotation_from_another_writer_is_ignored() {
        // client-go rewrote the Lease with 15 s and left our 300 ms annotation behind.
        let object = lease(Some("other"), Duration::from_secs(1), 15, Some(300));
        assert!(holding_of(&object).is_some());
    }

    #[test]
    fn an_empty_holder_is_free() {
        assert_eq!(holding_of(&lease(Some(""), Duration::ZERO, 15, None)), None);
        assert_eq!(holding_of(&lease(None, Duration::ZERO, 15, None)), None);
    }

    #[test]
    fn durations_round_up_to_whole_seconds() {
        assert_eq!(round_up(Duration::from_millis(300)), Duration::from_secs(1));
        assert_eq!(round_up(Duration::from_secs(15)), Duration::from_secs(15));
        assert_eq!(
            round_up(Duration::from_millis(15_001)),
            Duration::from_secs(16)
        );
    }

    #[test]
    fn a_claim_is_known_by_its_own_value_not_by_holder_token_and_time() {
        let read = lease(None, Duration::from_secs(60), 1, None);
        let (mut mine, mut theirs) = (read.clone(), read);
        claim(&mut mine, "same-identity", 8, Duration::from_secs(5)).unwrap();
        claim(&mut theirs, "same-identity", 8, Duration::from_secs(5)).unwrap();
        // Two processes of one identity claiming in the same microsecond.
        theirs.spec.as_mut().unwrap().acquire_time =
            mine.spec.as_ref().unwrap().acquire_time.clone();
        assert!(same_claim(&mine, &mine));
        assert!(!same_claim(&theirs, &mine));
        assert!(!same_claim(&mine, &theirs));
        // A Lease another program wrote, without the value, is nobody's claim of ours.
        let mut bare = mine.clone();
        bare.metadata.annotations = None;
        assert!(!same_claim(&bare, &mine));
    }

    #[test]
    fn kubernetes_urls() {
        assert_eq!(
            BackendUrl::parse("kubernetes://").unwrap(),
            BackendUrl::Kubernetes(KubernetesConfig::default())
        );
        let url = BackendUrl::parse("kubernetes://team-a").unwrap();
        assert_eq!(
            url,
            BackendUrl::Kubernetes(KubernetesConfig {
                namespace: Some("team-a".into()),
                yield_to_preferred_holder: false,
            })
        );
        for raw in [
            "kubernetes://team-a?preferred-holder=yield",
            "kubernetes://?preferred-holder=yield",
        ] {
            let url = BackendUrl::parse(raw).unwrap();
            let BackendUrl::Kubernetes(config) = &url else {
                panic!("{raw}: {url:?}")
            };
            assert!(config.yield_to_preferred_holder, "{raw}");
            assert_eq!(url.to_string(), raw);
        }
        assert_eq!(
            (url.kind(), url.to_string().as_str()),
            ("kubernetes", "kubernetes://team-a")
        );
        for bad in [
            "kubernetes://Team",
            "kubernetes://a.b",
            "kubernetes://ns/lease",
            "kubernetes://ns?lease=x",
            "kubernetes://ns?preferred-holder=take",
            "kubernetes://a/b?preferred-holder=yield",
            "kubernetes://u:p@ns",
        ] {
            assert!(BackendUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
