//! Keyed locks (docs/design.md, "Keyed locks"): a *family* of locks on keys that workers choose at
//! run time (`order-1234`), each taken by a per-request *owner*, so that only the worker that took
//! a key can extend or release it.
//!
//! Every key is an ordinary lock of the family's backend, run by the same self-fencing engine as
//! any other ([`crate::Lock`], on demand, with the identity `POD/OWNER`), so each key gets the
//! engine's guarantees: a claim that ends before the backend can hand the key on, a token per
//! key that rises with every holder, a hold that lapses when its owner goes quiet.
//!
//! Owners of one pod contend like owners of different pods. Within a pod they queue for a key on
//! a local first-come first-served slot, and only the slot's owner runs an engine for the key,
//! so the backend sees one contender per pod and key, and a key passes from owner to owner
//! through the backend: released, then acquired again with a new, higher token. (Handing the
//! backend lease over locally would give the next owner the same token as the last one.)
//!
//! **Semaphores.** A family with `permits: N` lets up to N owners hold a key at once. Each permit
//! is a lock of its own in the backend (permit 0 under the key's name, permit `i` under the
//! hashed name of `KEY#i`, which no key can have), so every permit has the engine's guarantees
//! and its own fencing token, a dead holder's permit is free within the lease, and nothing is
//! kept for a permit that its backend would not keep for a key. An owner holds at most one
//! permit of a key; an acquisition tries the permits in turn and, while all are held, waits for
//! a release notice (or polls) and tries again.
//!
//! A key's backend name is derived from the family and the key and cannot leave the family:
//! `FAMILY.keys.KEY` when the key is a plain lowercase name (so that it also fits a Kubernetes
//! Lease), else `FAMILY.keyh.` and the first 40 hex digits of the key's SHA-256. A plain lock whose
//! name starts with a family's `FAMILY.keys.` or `FAMILY.keyh.` is refused where the two meet.

mod line;
mod read_write;
mod several;

pub use read_write::{MAX_READ_WRITE_PERMITS, WriteHolding};
pub use several::{KeysAnswer, MAX_KEYS_AT_ONCE};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::OwnedMutexGuard;
use tokio::time::{Instant, timeout};

use crate::boot_clock::BootInstant;
use crate::driver::{Backend, Holding};
use crate::error::Error;
use crate::holder::{Answer, Event, Lock, LockConfig, Mode, OnUnheld, Telemetry};
use crate::names::{
    HASHED_KEY_INFIX, MAX_LOCK_NAME, PLAIN_KEY_INFIX, family_of, validate_lock_name,
};

/// The longest key accepted by default.
pub const DEFAULT_MAX_KEY_LENGTH: usize = 128;
/// How many keys one sidecar may hold at once in a family, by default.
pub const DEFAULT_MAX_KEYS: usize = 1024;
/// The longest owner value accepted.
pub const MAX_OWNER_LENGTH: usize = 128;
/// The most permits a key may have: an acquisition tries each in turn.
pub const MAX_PERMITS: u32 = 256;
/// The least time between the starts of two rounds of a semaphore acquisition's attempts.
const MIN_ROUND_GAP: Duration = Duration::from_millis(20);
/// Hex digits of a hashed key in its backend name.
const HASHED_KEY_DIGITS: usize = 40;
/// How long a key nobody holds keeps its record, on the backends that delete idle keys'
/// records ([`Driver::forget_idle_keys`]): long enough that a busy key is seldom forgotten
/// between two of its holders.
pub const IDLE_KEY_RETENTION: Duration = Duration::from_secs(3600);
/// How often each sidecar forgets its families' idle keys (spread by +-20 %).
pub const IDLE_KEY_SWEEP_INTERVAL: Duration = Duration::from_secs(600);

/// A family's settings: its name, this pod's identity, the lease every key shares, and the
/// bounds on keys.
#[derive(Debug, Clone)]
pub struct FamilyConfig {
    pub name: String,
    /// This pod; owners are told apart within it as `IDENTITY/OWNER`.
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_interval: Duration,
    pub max_key_length: usize,
    pub max_keys: usize,
    /// How many owners may hold one key at once (a semaphore); 1 is a mutual exclusion lock.
    pub permits: u32,
    /// Whether keys have readers and writers (docs/read-write.md): every acquisition reads,
    /// and a writer takes every permit.
    pub read_write: bool,
}

impl FamilyConfig {
    pub fn new(name: &str, identity: &str, lease_duration: Duration) -> Self {
        Self {
            name: name.to_owned(),
            identity: identity.to_owned(),
            lease_duration,
            renew_interval: lease_duration / 3,
            max_key_length: DEFAULT_MAX_KEY_LENGTH,
            max_keys: DEFAULT_MAX_KEYS,
            permits: 1,
            read_write: false,
        }
    }
}

/// What a keyed call refuses or cannot do. The first four are the caller's to fix (4xx).
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("invalid key {key:?}: {rule}")]
    BadKey { key: String, rule: String },
    #[error("invalid owner: {0}")]
    BadOwner(String),
    /// An acquisition of several keys named none, too many, or one twice.
    #[error("invalid keys: {0}")]
    BadKeys(String),
    /// A read-write lock's mode that is not `read` or `write`, or an upgrade from read to write.
    #[error("invalid mode: {0}")]
    BadMode(String),
    #[error("this sidecar already holds {0} keys of the family, its limit")]
    TooManyKeys(usize),
    /// The family was let go of (its `DistributedLock` deleted, or the sidecar stopping): its
    /// keys are released once their last answers run out, and no more are taken until it is
    /// started again.
    #[error(
        "the family {0:?} is stopped: its DistributedLock was deleted, or the sidecar is stopping"
    )]
    Stopped(String),
    #[error(transparent)]
    Lock(#[from] Error),
}

/// The state of one key as seen by one owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyAnswer {
    /// `owner` holds the key (its `permit`, 0 unless the family has several) now, self-fenced,
    /// with `holds` re-entrant acquisitions.
    Held {
        token: u64,
        valid_for: Duration,
        holds: u32,
        permit: u32,
        /// A writer's holding of a read-write lock: every permit of the key, its token the
        /// highest of theirs (read_write.rs).
        writer: bool,
    },
    /// Another owner holds it (in this pod, or in the backend as far as it was seen).
    HeldByAnother { holder: Option<String> },
    /// Nobody holds it, but a guard of the backend's does not grant it yet
    /// ([`crate::Withheld`]): why, and how long until grants resume when known.
    Withheld {
        reason: String,
        resume_in: Option<Duration>,
    },
    /// Nobody this pod knows of holds it for `owner`.
    NotHeld,
    /// The backend cannot be reached: nobody can tell.
    Unknown,
}

/// What a release did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyRelease {
    /// Released; `holds` acquisitions of the owner remain (0: the key is free).
    Released {
        holds: u32,
    },
    HeldByAnother {
        holder: String,
    },
    NotHeld,
}

/// One key's local slot and, while an owner holds it, that owner's engine.
struct KeyState {
    /// First come, first served among this pod's owners (tokio's mutex queues fairly).
    slot: Arc<tokio::sync::Mutex<()>>,
    current: Mutex<Option<Arc<KeyHolding>>>,
    /// On a key's own state (permit 0's): moves whenever an owner of this pod gives up any
    /// permit of the key, for this pod's owners waiting on the semaphore. Made by the first
    /// of them: most keys never have one, and a channel costs to make and to drop.
    given_up: std::sync::OnceLock<tokio::sync::watch::Sender<u64>>,
}

impl KeyState {
    /// Tell this pod's owners waiting on the key's semaphore that a permit was given up. A key
    /// nobody has waited on has no channel to tell: a waiter makes it before its first try.
    fn tell_given_up(&self) {
        // Paired with the fence in `given_up_notices`: either this finds the channel of a
        // waiter that makes it now, or that waiter's tries see the permit given up.
        std::sync::atomic::fence(Ordering::SeqCst);
        if let Some(given_up) = self.given_up.get() {
            given_up.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Notices of permits of the key given up by this pod's owners from now on.
    fn given_up_notices(&self) -> tokio::sync::watch::Receiver<u64> {
        let notices = self
            .given_up
            .get_or_init(|| tokio::sync::watch::Sender::new(0))
            .subscribe();
        std::sync::atomic::fence(Ordering::SeqCst);
        notices
    }
}

impl Default for KeyState {
    fn default() -> Self {
        Self {
            slot: Arc::default(),
            current: Mutex::default(),
            given_up: std::sync::OnceLock::new(),
        }
    }
}

struct KeyHolding {
    owner: String,
    /// The key, the permit held, and the name of the permit's local state ([`permit_key`]).
    key: String,
    permit: u32,
    permit_key: String,
    lock: Lock,
    /// Tells this holding from the key's later ones ([`FamilyInner::serials`]).
    serial: u64,
    /// The key's local slot, given back the moment the holding is forgotten: a task may still
    /// hold the holding itself a moment longer, and the next owner must not wait for it.
    slot: Mutex<Option<OwnedMutexGuard<()>>>,
    /// Whether the owner may be told it holds the key. A reader's permit above 0 of a
    /// read-write family is not until its acquisition has probed the write gate
    /// (read_write.rs); the owner's other calls meanwhile answer "not held".
    checked: std::sync::atomic::AtomicBool,
    /// A part of a write lock, not a holding of the owner's own (a read, a semaphore's permit):
    /// the one is never acquired again as the other.
    of_write: bool,
}

impl KeyHolding {
    /// Whether the holding still keeps its key's slot: [`KeyedFamily::forget`] has not
    /// forgotten it.
    fn keeps_slot(&self) -> bool {
        self.slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

/// A family of keyed locks on one backend. Cheap to clone.
#[derive(Clone)]
pub struct KeyedFamily {
    inner: Arc<FamilyInner>,
}

struct FamilyInner {
    name: String,
    identity: String,
    /// The lease and the bounds; a change applies to the keys acquired after it, while each
    /// held key keeps the lease it was taken with.
    config: std::sync::RwLock<FamilyConfig>,
    /// Set while the family is stopped (its resource deleted): no key is taken.
    stopped: std::sync::atomic::AtomicBool,
    /// Whether the family is read-write, apart from `config` so that every call can ask without
    /// its lock. Set once and never cleared ([`KeyedFamily::reconfigure`] refuses to), so a
    /// call that finds it clear knows no writer of this pod holds any key.
    read_write: std::sync::atomic::AtomicBool,
    /// The driver new keys are taken with; a key held now keeps the one it was taken with.
    driver: std::sync::RwLock<Arc<dyn Backend>>,
    /// What the keys' engines report, by family ([`FamilyTelemetry`]).
    telemetry: Arc<FamilyTelemetry>,
    keys: Mutex<HashMap<String, Arc<KeyState>>>,
    held: AtomicUsize,
    /// The keys held and those whose acquisition is under way: what `max_keys` bounds, so that
    /// acquisitions started together cannot all pass the bound and hold beyond it.
    admitted: AtomicUsize,
    /// The most permits the family has had: where an owner's holding may be, permits having
    /// been lowered since it was taken.
    permits_ever: AtomicU32,
    /// The count of permits now, told to the acquisitions that wait on permit 0 alone while the
    /// family has one, so that a count raised meanwhile is theirs too.
    permits_now: tokio::sync::watch::Sender<u32>,
    /// The longest keys the family has taken: a key held may be longer than the bound now in
    /// force, which was lowered since, and is still extended, released and told of.
    longest_key_ever: AtomicUsize,
    /// Where each semaphore acquisition starts among the permits, so that owners spread.
    next_first: AtomicU32,
    /// Owners inside an acquisition that does not hold the key yet.
    waiting: AtomicUsize,
    /// The writers of this pod that hold a key's write lock, by key (one at most: the write
    /// gate's local slot queues the others).
    writers: Mutex<HashMap<String, Arc<read_write::Writer>>>,
    /// The last holding's serial: an engine's hook names the holding it ends by it, since it
    /// cannot keep the holding (which keeps the engine's lock).
    serials: std::sync::atomic::AtomicU64,
}

impl FamilyInner {
    /// Drop `key`'s state when nobody holds it, waits for it or watches it (the slot's only
    /// other reference would be a waiter's; the state's, a semaphore's waiter's), so that keys
    /// refused or given back leave nothing behind.
    fn drop_state_if_idle(&self, key: &str) {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if keys.get(key).is_some_and(|s| {
            Arc::strong_count(s) == 1 && Arc::strong_count(&s.slot) == 1 && current_of(s).is_none()
        }) {
            keys.remove(key);
        }
    }

    fn driver(&self) -> Arc<dyn Backend> {
        self.driver
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// The keys' engines report under the family's name through this, never under their own.
struct FamilyTelemetry {
    family: String,
    inner: Arc<dyn Telemetry>,
}

impl Telemetry for FamilyTelemetry {
    fn event(&self, event: &Event) {
        self.inner.key_event(&self.family, event);
    }
    fn renewed(&self, _lock: &str, latency: Duration) {
        self.inner.key_renewed(&self.family, latency);
    }
    fn backend_error(&self, _lock: &str, error: &Error) {
        self.inner.key_backend_error(&self.family, error);
    }
}

/// Counts an owner as waiting for as long as it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl KeyedFamily {
    pub fn new(
        driver: Arc<dyn Backend>,
        config: FamilyConfig,
        telemetry: Arc<dyn Telemetry>,
    ) -> Result<Self, Error> {
        validate_family_name(&config.name)?;
        validate_family_identity(&config.identity)?;
        check_settings(&config)?;
        let permits = config.permits;
        let longest_key = config.max_key_length;
        let read_write = config.read_write;
        let family = Self {
            inner: Arc::new(FamilyInner {
                telemetry: Arc::new(FamilyTelemetry {
                    family: config.name.clone(),
                    inner: telemetry,
                }),
                name: config.name.clone(),
                identity: config.identity.clone(),
                config: std::sync::RwLock::new(config),
                stopped: std::sync::atomic::AtomicBool::new(false),
                read_write: std::sync::atomic::AtomicBool::new(read_write),
                driver: std::sync::RwLock::new(driver),
                keys: Mutex::new(HashMap::new()),
                held: AtomicUsize::new(0),
                admitted: AtomicUsize::new(0),
                permits_ever: AtomicU32::new(permits),
                permits_now: tokio::sync::watch::Sender::new(permits),
                longest_key_ever: AtomicUsize::new(longest_key),
                next_first: AtomicU32::new(0),
                waiting: AtomicUsize::new(0),
                writers: Mutex::default(),
                serials: std::sync::atomic::AtomicU64::new(0),
            }),
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(forget_idle_keys(Arc::downgrade(&family.inner)));
        }
        Ok(family)
    }

    /// The family's name: its route (`/locks/NAME/keys/...`), its Dapr store, its metric label.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// This pod's identity; owners are `IDENTITY/OWNER`.
    pub fn identity(&self) -> &str {
        &self.inner.identity
    }

    /// The settings now in force.
    pub fn config(&self) -> FamilyConfig {
        self.read_config(FamilyConfig::clone)
    }

    /// What `read` takes from the settings now in force, without copying them whole (every
    /// keyed call reads them).
    fn read_config<T>(&self, read: impl FnOnce(&FamilyConfig) -> T) -> T {
        read(&self.inner.config.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Apply new settings (the family's resource changed). The name and the identity stay; the
    /// lease and bounds apply from the next acquisition, and a key held now keeps the lease it
    /// was taken with until it is released (each key is its own lock, so the two never meet).
    pub fn reconfigure(&self, config: FamilyConfig) -> Result<(), Error> {
        if config.name != self.inner.name || config.identity != self.inner.identity {
            return Err(Error::InvalidConfig {
                field: "family",
                reason: "a family's name and identity cannot change".into(),
            });
        }
        check_settings(&config)?;
        // Checked and changed under one lock, so that two changes at once cannot both pass.
        let mut in_force = self.inner.config.write().unwrap_or_else(|e| e.into_inner());
        // Owners of a family that is not read-write never look at a writer's gate: a writer
        // of this pod or another would hold its key beside them.
        if in_force.read_write && !config.read_write {
            return Err(Error::InvalidConfig {
                field: "readWrite",
                reason: "a read-write family cannot stop being one: owners of a family that is \
                         not read-write never look at a writer's gate, and would take a key \
                         beside its writer; create a new family instead"
                    .into(),
            });
        }
        self.inner
            .permits_ever
            .fetch_max(config.permits, Ordering::SeqCst);
        self.inner
            .longest_key_ever
            .fetch_max(config.max_key_length, Ordering::SeqCst);
        let permits = config.permits;
        if config.read_write {
            self.inner.read_write.store(true, Ordering::SeqCst);
        }
        *in_force = config;
        // Told under the same lock, so that of two changes at once the last to take effect
        // is also the last told to the waiters.
        self.inner.permits_now.send_replace(permits);
        drop(in_force);
        Ok(())
    }

    /// Take the keys acquired from now on with `driver`: the same backend, reached with new
    /// credentials (a rotated password or certificate). A key held now keeps the driver it was
    /// taken with until it is released, so nothing held changes hands.
    pub fn replace_driver(&self, driver: Arc<dyn Backend>) {
        *self.inner.driver.write().unwrap_or_else(|e| e.into_inner()) = driver;
    }

    /// The driver new keys are taken with.
    fn driver(&self) -> Arc<dyn Backend> {
        self.inner.driver()
    }

    /// Let go of every key ([`KeyedFamily::retire`]: each released once the last answer about it
    /// has run out) and take no more until [`KeyedFamily::resume`]: the family's resource is
    /// being deleted. When the last release is made, if any key was held.
    pub async fn stop(&self) -> Option<BootInstant> {
        self.inner.stopped.store(true, Ordering::SeqCst);
        self.retire().await
    }

    pub fn resume(&self) {
        self.inner.stopped.store(false, Ordering::SeqCst);
    }

    fn check_running(&self) -> Result<(), KeyError> {
        if self.inner.stopped.load(Ordering::SeqCst) {
            return Err(KeyError::Stopped(self.inner.name.clone()));
        }
        Ok(())
    }

    pub fn backend(&self) -> &'static str {
        self.driver().kind()
    }

    /// A cheap round trip to the backend new keys are taken on, for readiness.
    pub async fn ping(&self) -> Result<(), Error> {
        self.driver().ping().await
    }

    /// Whether the family takes no keys ([`KeyedFamily::stop`]): its resource deleted, or its
    /// backend moved.
    pub fn is_stopped(&self) -> bool {
        self.inner.stopped.load(Ordering::SeqCst)
    }

    /// How many keys owners of this pod hold now.
    pub fn held_keys(&self) -> usize {
        self.inner.held.load(Ordering::SeqCst)
    }

    /// How many keys and permits this pod keeps local state for: those held, waited for, or
    /// with an attempt still settling. Keys refused or given back keep none.
    pub fn tracked_keys(&self) -> usize {
        self.inner
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// How many of this pod's owners are waiting for a key now.
    pub fn waiting_owners(&self) -> usize {
        self.inner.waiting.load(Ordering::SeqCst)
    }

    /// The backend lock name of `key`, after checking the key.
    pub fn backend_name(&self, key: &str) -> Result<String, KeyError> {
        self.check_key(key)?;
        Ok(backend_name(&self.inner.name, key))
    }

    /// The backend name of `key`'s permit `permit` (of a semaphore; permit 0 is the key's own).
    pub fn permit_backend_name(&self, key: &str, permit: u32) -> Result<String, KeyError> {
        self.check_key(key)?;
        Ok(self.permit_name(key, permit))
    }

    /// The backend name of the line where `key`'s waiters stand, on a backend that keeps a
    /// queue (etcd, ZooKeeper): a pod's first waiter has a place in it.
    pub fn line_backend_name(&self, key: &str) -> Result<String, KeyError> {
        self.check_key(key)?;
        Ok(self.permit_name(key, line::LINE))
    }

    /// `key` is a key of the family as it may be held: a bound lowered since it was taken
    /// leaves it to be extended, released and told of.
    fn check_key(&self, key: &str) -> Result<(), KeyError> {
        key_within(key, self.inner.longest_key_ever.load(Ordering::SeqCst))
    }

    /// `owner` is an owner, and its holdings' backend identity (`POD/OWNER`, and a reader's or
    /// writer's probe `POD/OWNER probe`) is within the 253 characters every backend keeps of a
    /// holder: a pod named at length leaves less room for its owners.
    fn check_owner(&self, owner: &str) -> Result<(), KeyError> {
        owner_well_formed(owner)?;
        let room = crate::names::MAX_LOCK_NAME
            .saturating_sub(self.inner.identity.len() + 1 + read_write::PROBE.len());
        if owner.len() > room {
            return Err(KeyError::BadOwner(format!(
                "an owner is 1 to {room} characters in this pod (the backend keeps 253 of \
                 {:?}, a slash, the owner and {:?}); it was {}",
                self.inner.identity,
                read_write::PROBE,
                owner.len()
            )));
        }
        Ok(())
    }

    /// `key` may be taken now: within the bound in force.
    fn check_new_key(&self, key: &str) -> Result<(), KeyError> {
        key_within(key, self.read_config(|c| c.max_key_length))
    }

    /// `key`'s local state, if it has one: kept while the look lasts, and dropped after it if
    /// idle by then (a release that found it in use meanwhile left it to this look).
    fn existing<'k>(&'k self, key: &'k str) -> Option<StateInUse<'k>> {
        StateInUse::existing(&self.inner, key)
    }

    /// Take `key` for `owner`, waiting up to `wait`, and keep it at most `hold` unless extended
    /// or acquired again. Re-entrant for the same owner (a count).
    pub async fn acquire(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<KeyAnswer, KeyError> {
        self.take(key, owner, wait, hold, true).await
    }

    /// Take `key` to read for `owner` (a family declared read-write): what
    /// [`KeyedFamily::acquire`] does on such a family, where every acquisition reads.
    pub async fn acquire_read(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<KeyAnswer, KeyError> {
        self.check_new_key(key)?;
        self.check_read_write()?;
        self.take(key, owner, wait, hold, true).await
    }

    /// Take `key` for `owner` if nobody holds it, the owner included: Dapr's `TryLock`, which
    /// is not re-entrant (a second try by the holder fails, and one unlock frees the key).
    pub async fn try_acquire_once(
        &self,
        key: &str,
        owner: &str,
        hold: Duration,
    ) -> Result<KeyAnswer, KeyError> {
        self.take(key, owner, Duration::ZERO, hold, false).await
    }

    async fn take(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
        hold: Duration,
        reentrant: bool,
    ) -> Result<KeyAnswer, KeyError> {
        self.check_new_key(key)?;
        self.check_owner(owner)?;
        self.check_running()?;
        if let Some((answer, _)) = self.reenter_write(key, owner, hold, reentrant).await? {
            return Ok(answer);
        }
        let answer = if self.is_read_write() {
            self.take_reading(key, owner, wait, hold, reentrant).await
        } else {
            let answer = self.take_checked(key, owner, wait, hold, reentrant).await;
            // Asked for as a semaphore's permit, granted as one: also when the family became
            // read-write meanwhile (the holding is then put in place as a reader's, told of
            // once past the write gate), its owner's calls find what it is answered, as they
            // would in a pod that has not seen the change yet. A family still not read-write
            // put the holding in place told of already.
            if let Ok(KeyAnswer::Held { permit, token, .. }) = &answer
                && self.is_read_write()
                && let Some(holding) = self.holding_taken(key, *permit, owner, *token)
            {
                holding.checked.store(true, Ordering::SeqCst);
            }
            answer
        };
        if let Ok(KeyAnswer::HeldByAnother { .. }) = answer {
            self.inner.telemetry.inner.key_contended(&self.inner.name);
        }
        answer
    }

    /// The permit `owner` holds of `key`: re-entrant (or refused, once) where it is, the
    /// answer then `Some`. One not told of (a reader's still probing the write gate, a part of
    /// the owner's write lock being taken) is not the owner's to re-enter: refused as held.
    async fn reenter_owned(
        &self,
        key: &str,
        owner: &str,
        hold: Duration,
        reentrant: bool,
    ) -> Result<Option<KeyAnswer>, KeyError> {
        let Some(current) = self.owned_permit(key, owner) else {
            return Ok(None);
        };
        if !current.checked.load(Ordering::SeqCst) {
            return Ok(Some(KeyAnswer::HeldByAnother {
                holder: Some(self.qualified(owner)),
            }));
        }
        self.reenter(&current, hold, reentrant).await
    }

    async fn take_checked(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
        hold: Duration,
        reentrant: bool,
    ) -> Result<KeyAnswer, KeyError> {
        let deadline = Instant::now() + wait;
        if let Some(answer) = self.reenter_owned(key, owner, hold, reentrant).await? {
            return Ok(answer);
        }
        let wait = deadline.saturating_duration_since(Instant::now());
        let _waiting = Waiting::new(&self.inner.waiting);
        if self.read_config(|c| c.permits) == 1 {
            if wait.is_zero() {
                // One attempt, not a wait: a count raised meanwhile is the next attempt's.
                return self.take_part(key, 0, owner, wait, hold, reentrant).await;
            }
            let mut permits = self.inner.permits_now.subscribe();
            tokio::select! {
                biased;
                answer = self.take_part(key, 0, owner, wait, hold, reentrant) => return answer,
                // Raised while waiting for permit 0: the permits added are the waiter's to take
                // as much as permit 0 (giving up its wait, and its place in a queue, for them).
                _ = permits.wait_for(|&permits| permits > 1) => {}
            }
        }
        let wait = deadline.saturating_duration_since(Instant::now());
        self.take_any_permit(key, owner, wait, hold, reentrant)
            .await
    }

    /// Take a permit of `key` for `owner`: each in turn (from a different one for each
    /// acquisition, to spread the owners), and while every one is held, again after a release
    /// notice or a nap, until `wait` runs out. The count of permits is read at each round, so
    /// that a change applies to the next one. On a backend that keeps a queue, an owner that
    /// waits lines up instead ([`line`]).
    async fn take_any_permit(
        &self,
        key: &str,
        owner: &str,
        wait: Duration,
        hold: Duration,
        reentrant: bool,
    ) -> Result<KeyAnswer, KeyError> {
        let deadline = Instant::now() + wait;
        let first = self.inner.next_first.fetch_add(1, Ordering::Relaxed);
        // Not a read-write family's readers: a writer of this pod waiting for a permit keeps
        // its slot, and the first in line a place before it in the backend, each refused by
        // the other.
        if self.driver().keeps_queue() && !wait.is_zero() && !self.is_read_write() {
            return self
                .take_in_line(key, owner, deadline, hold, reentrant, first)
                .await;
        }
        // This pod's releases of any permit of the key; the state is kept while watched.
        let own_key = StateInUse::new(&self.inner, key);
        let mut given_up = own_key.given_up_notices();
        loop {
            let round = Instant::now();
            let driver = self.driver();
            let mut notices = self.permit_notices(key, &*driver);
            let refused = match self
                .permit_round(key, owner, first, hold, reentrant, InLine::Leave)
                .await?
            {
                Ok(held) => return Ok(held),
                Err(refused) => refused,
            };
            if Instant::now() >= deadline {
                return Ok(refused);
            }
            self.nap_for_permits(&mut notices, &mut given_up, round, deadline, InLine::Leave)
                .await;
        }
    }

    /// Release notices of each permit of `key`, from the backend, taken before a round.
    fn permit_notices(
        &self,
        key: &str,
        driver: &dyn Backend,
    ) -> Vec<tokio::sync::watch::Receiver<u64>> {
        let permits = self.read_config(|c| c.permits);
        (0..permits)
            .filter_map(|permit| driver.changes(&self.permit_name(key, permit)))
            .collect()
    }

    /// One attempt at each permit of `key` for `owner`, from `first` on: the answer of the
    /// permit taken, else the most telling refusal.
    async fn permit_round(
        &self,
        key: &str,
        owner: &str,
        first: u32,
        hold: Duration,
        reentrant: bool,
        in_line: InLine,
    ) -> Result<Result<KeyAnswer, KeyAnswer>, KeyError> {
        let permits = self.read_config(|c| c.permits);
        let mut refused = None;
        for offset in 0..permits {
            let permit = nth_permit(first, offset, permits);
            let answer = self
                .take_permit(key, permit, owner, hold, reentrant, in_line)
                .await?;
            if matches!(answer, KeyAnswer::Held { .. }) {
                return Ok(Ok(answer));
            }
            refused = Some(more_telling(refused, answer));
        }
        Ok(Err(
            refused.unwrap_or(KeyAnswer::HeldByAnother { holder: None })
        ))
    }

    /// Until a release notice of a permit of the key (`notices`, taken before the round that
    /// began at `round`) or a release by this pod (`given_up`), or `deadline`.
    ///
    /// Notices only shorten the nap: a queue backend's notices also move when this pod's own
    /// attempts leave the queue, so those of a round whose attempts left it
    /// ([`InLine::Leave`]) are taken as seen here (a release during the round is found at the
    /// next), and a round follows a notice no sooner than [`MIN_ROUND_GAP`] after the last.
    /// The nap is at most half a renew interval, since a holder that dies sends no notice, and
    /// queue backends send none to whom is not queued.
    async fn nap_for_permits(
        &self,
        notices: &mut [tokio::sync::watch::Receiver<u64>],
        given_up: &mut tokio::sync::watch::Receiver<u64>,
        round: Instant,
        deadline: Instant,
        in_line: InLine,
    ) {
        let renew_interval = self.read_config(|c| c.renew_interval);
        let driver = self.driver();
        if in_line == InLine::Leave {
            for notice in notices.iter_mut() {
                notice.borrow_and_update();
            }
        }
        let nap_until = deadline
            .min(Instant::now() + (renew_interval / 2).min(driver.poll_interval(renew_interval)));
        let notice = async {
            let backend = async {
                if notices.is_empty() {
                    std::future::pending::<()>().await;
                }
                futures_util::future::select_all(notices.iter_mut().map(|n| Box::pin(changed(n))))
                    .await;
            };
            tokio::select! {
                _ = backend => {}
                _ = changed(given_up) => {}
            }
            tokio::time::sleep_until(round + MIN_ROUND_GAP).await;
        };
        let _ = tokio::time::timeout_at(nap_until, notice).await;
    }

    /// An acquisition by the owner of `current`: re-entrant, or refused when it may not be
    /// (`reentrant` false: Dapr's try-lock). `None`: its engine ended a moment ago (the hold
    /// lapsed, the lease was lost) and it is forgotten, so the owner takes the key afresh.
    async fn reenter(
        &self,
        current: &KeyHolding,
        hold: Duration,
        reentrant: bool,
    ) -> Result<Option<KeyAnswer>, KeyError> {
        if !reentrant {
            return Ok(Some(KeyAnswer::HeldByAnother {
                holder: Some(self.qualified(&current.owner)),
            }));
        }
        match current.lock.acquire(Duration::ZERO, hold).await {
            Ok(answer) => Ok(Some(self.answer_for(current, answer))),
            Err(Error::Shutdown) => {
                self.forget(&current.permit_key, current.serial);
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// One attempt at permit `permit` of `key` for `owner`, of a semaphore.
    async fn take_permit(
        &self,
        key: &str,
        permit: u32,
        owner: &str,
        hold: Duration,
        reentrant: bool,
        in_line: InLine,
    ) -> Result<KeyAnswer, KeyError> {
        // A permit above the family's count, lowered since, is re-entered by its holder and
        // given to nobody new: take_part_in_line decides both.
        let part = Part::Own(in_line);
        self.take_part_in_line(key, permit, owner, Duration::ZERO, hold, reentrant, part)
            .await
    }

    /// Take permit `permit` of `key` (or its write gate, or its line) for `owner`, whatever
    /// the family's count of permits: re-entrant where the owner holds it.
    async fn take_part(
        &self,
        key: &str,
        permit: u32,
        owner: &str,
        wait: Duration,
        hold: Duration,
        reentrant: bool,
    ) -> Result<KeyAnswer, KeyError> {
        let part = Part::Own(InLine::Leave);
        self.take_part_in_line(key, permit, owner, wait, hold, reentrant, part)
            .await
    }

    /// [`KeyedFamily::take_part`] for a writer: a part of its write lock, never told of as a
    /// holding of its own (a writer is answered from all its parts, once it has them all).
    async fn take_write_part(
        &self,
        key: &str,
        permit: u32,
        owner: &str,
        wait: Duration,
        hold: Duration,
    ) -> Result<KeyAnswer, KeyError> {
        self.take_part_in_line(key, permit, owner, wait, hold, true, Part::OfWrite)
            .await
    }

    /// [`KeyedFamily::take_part`], keeping the place of an attempt refused in the backend's
    /// line when told to ([`InLine::Keep`]), for a holding of the owner's own or a part of a
    /// write lock ([`Part`]).
    #[allow(clippy::too_many_arguments)]
    async fn take_part_in_line(
        &self,
        key: &str,
        permit: u32,
        owner: &str,
        wait: Duration,
        hold: Duration,
        reentrant: bool,
        part: Part,
    ) -> Result<KeyAnswer, KeyError> {
        let deadline = Instant::now() + wait;
        let base_key = key;
        let key = &*permit_key(key, permit);
        let state = StateInUse::new(&self.inner, key);
        if let Some(current) = current_of(&state).filter(|c| c.owner == owner) {
            // The owner's calls check how it holds the key as they start, and two of them may
            // start together: a read and a write of one owner meet here at the latest.
            match (current.of_write, part) {
                (false, Part::OfWrite) => {
                    return Err(read_write::reads_so_cannot_write(owner, base_key));
                }
                (true, Part::Own(_)) => {
                    return Err(read_write::writes_so_cannot_read(owner, base_key));
                }
                // A write lock taken again acquires its parts through its writer; a part of
                // the owner's met here is of another write of the owner's still being taken
                // (or given back after its client hung up). Shared, the two would be two write
                // locks on the same parts, each released as the whole: not the owner's turn,
                // as a 409 naming it says (a retry once that write is answered re-enters it).
                (true, Part::OfWrite) => {
                    if let Some(answer) = self.reenter(&current, hold, reentrant).await? {
                        if let KeyAnswer::Held { token, .. } = answer
                            && let Err(e) = current.lock.release_if(own_permit(token)).await
                        {
                            tracing::debug!(family = self.name(), key, error = %e, "a part met twice was not given back; it lapses with its hold");
                        }
                        return Ok(KeyAnswer::HeldByAnother {
                            holder: Some(self.qualified(owner)),
                        });
                    }
                }
                // One not told of yet (a reader's, still probing the write gate) is not the
                // owner's to re-enter, as in `reenter_owned`.
                (false, Part::Own(_)) if !current.checked.load(Ordering::SeqCst) => {
                    return Ok(KeyAnswer::HeldByAnother {
                        holder: Some(self.qualified(owner)),
                    });
                }
                (false, Part::Own(_)) => {
                    if let Some(answer) = self.reenter(&current, hold, reentrant).await? {
                        return Ok(answer);
                    }
                }
            }
        }
        // Permits above the family's count, lowered since, are kept by their holders (re-entered
        // above) but go to nobody new, not even an owner whose holding of one ended as it asked
        // again: it would hold beside the count's holders of the lower permits. A writer takes
        // them as parts of its write lock (read_write.rs).
        if matches!(part, Part::Own(_))
            && (1..MAX_PERMITS).contains(&permit)
            && permit >= self.read_config(|c| c.permits)
        {
            return Ok(KeyAnswer::NotHeld);
        }
        // A free slot is taken without arming a timer: tokio's mutex hands a slot given back
        // to its first waiter, so taking it at once never passes anyone in the queue.
        let slot = match state.slot.clone().try_lock_owned() {
            Ok(slot) => slot,
            Err(_) => match timeout(wait, state.slot.clone().lock_owned()).await {
                Ok(slot) => slot,
                Err(_) => {
                    return Ok(KeyAnswer::HeldByAnother {
                        holder: current_of(&state).map(|c| self.qualified(&c.owner)),
                    });
                }
            },
        };
        let (lease_duration, renew_interval, max_keys) =
            self.read_config(|c| (c.lease_duration, c.renew_interval, c.max_keys));
        let counted = counts_as_held(permit);
        let admission = match counted {
            true => Some(
                Admission::take(&self.inner.admitted, max_keys)
                    .ok_or(KeyError::TooManyKeys(max_keys))?,
            ),
            false => None,
        };
        self.check_running()?;
        let serial = self.inner.serials.fetch_add(1, Ordering::Relaxed) + 1;
        // Once the engine no longer holds the key (released, its hold lapsed, its lease lost) or
        // has ended, the key's slot goes to the next owner.
        let family = Arc::downgrade(&self.inner);
        let forgotten = key.to_owned();
        let on_unheld = OnUnheld::new(move || {
            if let Some(inner) = family.upgrade() {
                KeyedFamily { inner }.forget(&forgotten, serial);
            }
        });
        let (lock, answer) = Lock::acquire_single_use(
            self.driver(),
            LockConfig {
                mode: Mode::OnDemand,
                single_use: true,
                keeps_queue_place: part == Part::Own(InLine::Keep),
                renew_interval,
                name: backend_name(&self.inner.name, key),
                identity: self.qualified(owner),
                ..LockConfig::new("", "", lease_duration)
            },
            self.inner.telemetry.clone(),
            Some(on_unheld),
            deadline.saturating_duration_since(Instant::now()),
            hold,
        )
        .await?;
        if !answer.is_holder() {
            let snapshot = lock.snapshot();
            let holder = snapshot.current_holder.map(|h: Holding| h.identity);
            let withheld = snapshot.withheld.filter(|_| holder.is_none());
            lock.shutdown().await;
            // An attempt that could not tell may still take the key (a write the backend carries
            // out late): the slot waits for it to be followed up and given back, so that the
            // owner's retry does not meet its own earlier attempt in the backend.
            drop(state);
            if timeout(Duration::ZERO, lock.settled()).await.is_ok() {
                drop(slot);
                self.inner.drop_state_if_idle(key);
            } else {
                // The slot goes with the attempt; so does the state, unless used by then.
                let family = Arc::downgrade(&self.inner);
                let key = key.to_owned();
                tokio::spawn(async move {
                    lock.settled().await;
                    drop(slot);
                    if let Some(inner) = family.upgrade() {
                        inner.drop_state_if_idle(&key);
                    }
                });
            }
            return Ok(match (answer, withheld) {
                (Answer::Unknown, _) => KeyAnswer::Unknown,
                (_, Some(withheld)) => KeyAnswer::Withheld {
                    reason: withheld.reason,
                    resume_in: withheld.until.map(|until| until.remaining()),
                },
                _ => KeyAnswer::HeldByAnother { holder },
            });
        }
        let holding = Arc::new(KeyHolding {
            owner: owner.to_owned(),
            key: base_key.to_owned(),
            permit,
            permit_key: key.to_owned(),
            lock,
            serial,
            slot: Mutex::new(Some(slot)),
            // A reader's permit above 0 is told of once it has passed the write gate; a part
            // of a write lock never is.
            of_write: part == Part::OfWrite,
            checked: std::sync::atomic::AtomicBool::new(match part {
                Part::OfWrite => false,
                Part::Own(_) => !(self.is_read_write() && permit > 0 && permit != read_write::GATE),
            }),
        });
        // Counted before it is put in place: the engine's hook may forget it (and count it
        // out) from then on.
        if let Some(admission) = admission {
            admission.keep();
            self.inner.held.fetch_add(1, Ordering::SeqCst);
        }
        *state.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(holding.clone());
        // `stop` raises its flag before it looks for holdings: either it saw this one, or this
        // sees the flag. In place, the holding may have been read as held by another call of
        // its owner's meanwhile: it is let go as `stop` lets go, once that answer has run out.
        if let Err(stopped) = self.check_running() {
            holding.lock.retire_for("stopping").await;
            self.forget(key, serial);
            return Err(stopped);
        }
        // The engine's hook found nothing to forget if the holding ended before it was put in
        // place; the engine publishes that before it calls the hook. Ended, it is not answered
        // held with the validity it had when granted.
        if holding.lock.read_snapshot(|s| s.held.is_none()) {
            self.forget(key, serial);
            return Ok(KeyAnswer::NotHeld);
        }
        Ok(self.answer_for(&holding, answer))
    }

    /// A person's force-release of `key` (`leasehold.dev/force-release: KEY:TOKEN` on the
    /// family): the holding of `key` by an owner of this pod with `token`, on whichever permit,
    /// steps down as a lock's does ([`Lock::force_release`]): it answers "not held" at once and
    /// is released once its last answer has run out; its owner's calls then meet "not held",
    /// and a hold bound to a connection ends with `released`. `Ok(false)`: no owner of this pod
    /// holds `key` with `token`. A semaphore's request names the permit: on some backends two
    /// permits of a key may hold the same token.
    pub async fn force_release(
        &self,
        key: &str,
        permit: Option<u32>,
        token: u64,
    ) -> Result<bool, KeyError> {
        self.check_key(key)?;
        if permit.is_none() && self.has_had_permits() {
            return Err(KeyError::BadKeys(format!(
                "{key}: a semaphore's holding is named with its permit, KEY#PERMIT:TOKEN"
            )));
        }
        let Some(holding) = self.find_holding(key, |holding| {
            permit.is_none_or(|permit| holding.permit == permit)
                && holding
                    .lock
                    .read_snapshot(|s| s.held.as_ref().is_some_and(|held| held.token == token))
        }) else {
            return Ok(false);
        };
        holding
            .lock
            .force_release(None, token)
            .await
            .map_err(KeyError::Lock)
    }

    /// The engine of `key`'s permit `permit` while `owner` holds it, told of (not a reader's
    /// still probing the write gate): what a hold bound to a connection follows, on the
    /// permit it was taken on.
    pub fn holding_on_permit(&self, key: &str, permit: u32, owner: &str) -> Option<Lock> {
        if self.writer_of(key, Some(owner)).is_some() {
            return None;
        }
        self.holding_on(key, permit, owner)
            .filter(|current| current.checked.load(Ordering::SeqCst))
            .map(|current| current.lock.clone())
    }

    /// The backend lock name of `key`'s permit `permit`.
    fn permit_name(&self, key: &str, permit: u32) -> String {
        backend_name(&self.inner.name, &permit_key(key, permit))
    }

    /// `owner`'s holding of `key`, on whichever permit it is.
    fn owned_permit(&self, key: &str, owner: &str) -> Option<Arc<KeyHolding>> {
        self.find_holding(key, |holding| holding.owner == owner)
    }

    /// A holding of `key` by an owner of this pod that `wanted` accepts, on any permit the
    /// family has had (on a read-write family, any permit a writer may take: one above the
    /// family's count whose token was above its own, see [`read_write`]).
    fn find_holding(
        &self,
        key: &str,
        wanted: impl Fn(&KeyHolding) -> bool,
    ) -> Option<Arc<KeyHolding>> {
        let mut permits = self.inner.permits_ever.load(Ordering::SeqCst);
        if self.is_read_write() {
            permits = permits.max(read_write::MAX_READ_WRITE_PERMITS);
        }
        let keys = self.inner.keys.lock().unwrap_or_else(|e| e.into_inner());
        (0..permits).find_map(|permit| {
            keys.get(&*permit_key(key, permit))
                .and_then(|s| current_of(s))
                .filter(|holding| wanted(holding))
        })
    }

    /// `owner`'s holding of permit `permit` of `key` (or of its write gate).
    fn holding_on(&self, key: &str, permit: u32, owner: &str) -> Option<Arc<KeyHolding>> {
        self.existing(&permit_key(key, permit))
            .and_then(|s| current_of(&s))
            .filter(|holding| holding.owner == owner)
    }

    /// `owner`'s holding of permit `permit` of `key` (or of its write gate or line) while it is
    /// still the one taken with `token`: one taken again since (its lease lost meanwhile) is
    /// another acquisition's.
    fn holding_taken(
        &self,
        key: &str,
        permit: u32,
        owner: &str,
        token: u64,
    ) -> Option<Arc<KeyHolding>> {
        self.holding_on(key, permit, owner).filter(|holding| {
            holding
                .lock
                .read_snapshot(|s| s.held.as_ref().is_some_and(|held| held.token == token))
        })
    }

    /// What a call by `owner` on `key` is about: the owner's holding, else another owner's
    /// (of permit 0, the one a mutual exclusion lock has), to say who holds it.
    fn holding_for(&self, key: &str, owner: &str) -> Option<Arc<KeyHolding>> {
        self.owned_permit(key, owner)
            .or_else(|| self.existing(key).and_then(|s| current_of(&s)))
    }

    /// Give up one acquisition of `key` by `owner`.
    pub async fn release(&self, key: &str, owner: &str) -> Result<KeyRelease, KeyError> {
        if let Some(writer) = self.writer_of(key, Some(owner)) {
            return self.release_write(key, &writer).await;
        }
        self.release_held(key, owner, None).await
    }

    /// [`KeyedFamily::release`], only of the owner's holding on `(permit, token)` when one is
    /// given: a holding taken again since (its lease lost meanwhile) is not given up.
    async fn release_held(
        &self,
        key: &str,
        owner: &str,
        held: Option<(u32, u64)>,
    ) -> Result<KeyRelease, KeyError> {
        self.release_held_as(key, owner, held, false).await
    }

    /// [`KeyedFamily::release_held`], `by_connection` when the connection holding the
    /// acquisition gives it back ([`Lock::bind`]).
    async fn release_held_as(
        &self,
        key: &str,
        owner: &str,
        held: Option<(u32, u64)>,
        by_connection: bool,
    ) -> Result<KeyRelease, KeyError> {
        self.check_key(key)?;
        self.check_owner(owner)?;
        let current = match held {
            Some((permit, _)) => self.holding_on(key, permit, owner),
            // Not a part of a write under way, nor a read being checked: the owner has not
            // been told of either, and the one would be answered held with a part going back.
            None => self
                .holding_for(key, owner)
                .filter(|c| c.owner != owner || c.checked.load(Ordering::SeqCst)),
        };
        let Some(current) = current else {
            return Ok(KeyRelease::NotHeld);
        };
        let token = held.map(|(_, token)| token);
        if current.owner != owner {
            return Ok(KeyRelease::HeldByAnother {
                holder: self.qualified(&current.owner),
            });
        }
        let released = match token {
            Some(token) if by_connection => current.lock.release_bound(own_permit(token)).await,
            Some(token) => current.lock.release_if(own_permit(token)).await,
            None => current.lock.release().await,
        };
        match released {
            Ok(true) => {}
            // Nothing held, or its engine ended a moment ago (the hold lapsed).
            Ok(false) | Err(Error::Shutdown) => return Ok(KeyRelease::NotHeld),
            Err(e) => return Err(e.into()),
        }
        let holds = current.lock.read_snapshot(|s| s.holds);
        // Free the slot now rather than when the watcher gets to it, so that the next owner's
        // acquisition is not refused for a moment; a slot already given back was forgotten by
        // the engine's hook.
        if holds == 0 && current.keeps_slot() {
            self.forget(&current.permit_key, current.serial);
        }
        Ok(KeyRelease::Released { holds })
    }

    /// Who holds `key` in the backend now, as its driver reports it (any pod's owner, as
    /// `POD/OWNER`): what an observer of the key follows.
    pub async fn observe(&self, key: &str) -> Result<Option<Holding>, KeyError> {
        self.check_key(key)?;
        Ok(self
            .driver()
            .observe(&backend_name(&self.inner.name, key))
            .await?)
    }

    /// The holders of `key`'s permits in the backend now (any pod's owners), one read per
    /// permit the family has had in this pod.
    pub async fn observe_permits(&self, key: &str) -> Result<Vec<Holding>, KeyError> {
        self.check_key(key)?;
        let permits = self.inner.permits_ever.load(Ordering::SeqCst);
        let driver = self.driver();
        let reads = (0..permits).map(|permit| {
            let name = self.permit_name(key, permit);
            let driver = driver.clone();
            async move { driver.observe(&name).await }
        });
        let holders = futures_util::future::try_join_all(reads).await?;
        Ok(holders.into_iter().flatten().collect())
    }

    /// How many owners may hold one key at once (1 unless the family is a semaphore).
    pub fn permits(&self) -> u32 {
        self.read_config(|c| c.permits)
    }

    /// Whether the family has had more than one permit per key: holders of higher permits may
    /// remain after the count was lowered, and answers name the permit.
    pub fn has_had_permits(&self) -> bool {
        self.inner.permits_ever.load(Ordering::SeqCst) > 1
    }

    /// Keep `owner`'s hold on `key` at least `hold` from now, without acquiring again (a hold
    /// only moves later).
    pub async fn extend(
        &self,
        key: &str,
        owner: &str,
        hold: Duration,
    ) -> Result<KeyAnswer, KeyError> {
        if let Some(writer) = self.writer_of(key, Some(owner)) {
            return self.extend_write(key, &writer, hold).await;
        }
        self.extend_held(key, owner, hold, None).await
    }

    /// [`KeyedFamily::extend`], only of the owner's holding on `(permit, token)` when one is
    /// given.
    async fn extend_held(
        &self,
        key: &str,
        owner: &str,
        hold: Duration,
        held: Option<(u32, u64)>,
    ) -> Result<KeyAnswer, KeyError> {
        self.check_key(key)?;
        self.check_owner(owner)?;
        let current = match held {
            Some((permit, _)) => self.holding_on(key, permit, owner),
            None => self
                .holding_for(key, owner)
                .filter(|c| c.owner != owner || c.checked.load(Ordering::SeqCst)),
        };
        let Some(current) = current else {
            return Ok(KeyAnswer::NotHeld);
        };
        if current.owner != owner {
            return Ok(KeyAnswer::HeldByAnother {
                holder: Some(self.qualified(&current.owner)),
            });
        }
        let extended = match held {
            Some((_, token)) => current.lock.extend_if(own_permit(token), hold).await,
            None => current.lock.extend(hold).await,
        };
        match extended {
            Ok(answer) => Ok(self.answer_for(&current, answer)),
            Err(Error::Shutdown) => Ok(KeyAnswer::NotHeld),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether `owner` (or, without one, any owner of this pod) holds `key` now, self-fenced.
    pub fn status(&self, key: &str, owner: Option<&str>) -> Result<KeyAnswer, KeyError> {
        self.check_key(key)?;
        if let Some(owner) = owner {
            self.check_owner(owner)?;
        }
        Ok(match self.holding_now(key, owner) {
            // A hold that ran out (its release waiting on a renewal's late answer) is over.
            KeyAnswer::Held { valid_for, .. } if valid_for.is_zero() => KeyAnswer::NotHeld,
            answer => answer,
        })
    }

    /// [`KeyedFamily::status`] as the key's holding (or write lock) answers it.
    fn holding_now(&self, key: &str, owner: Option<&str>) -> KeyAnswer {
        if let Some(writer) = self.writer_of(key, owner) {
            return self.write_answer(key, &writer);
        }
        let current = match owner {
            Some(owner) => self.holding_for(key, owner),
            // Any holding told of: a reader's beside a write lock's parts being taken.
            None => self.find_holding(key, |c| c.checked.load(Ordering::SeqCst)),
        };
        let Some(current) = current.filter(|c| c.checked.load(Ordering::SeqCst)) else {
            return KeyAnswer::NotHeld;
        };
        if owner.is_some_and(|o| o != current.owner) {
            return KeyAnswer::HeldByAnother {
                holder: Some(self.qualified(&current.owner)),
            };
        }
        self.answer_for(&current, current.lock.answer())
    }

    /// Release every key and stop: all at once, as a stopping sidecar has a second to exit in.
    pub async fn shutdown(&self) {
        let holdings = self.let_go_of_writers();
        futures_util::future::join_all(holdings.iter().map(|h| h.lock.shutdown())).await;
    }

    /// Let go of every key this pod's owners hold, as [`KeyedFamily::shutdown`] does, but
    /// release each only once the last answer about it has run out (its hold, or its claim if
    /// that ends first): each stops being claimed at once, and no other owner takes it while
    /// one of this pod's may still act on an answer (a Dapr client holds until its expiry,
    /// whatever happens to the sidecar). When the last release is made, if any key was held;
    /// a process that exits before then leaves the rest to run out.
    pub async fn retire(&self) -> Option<BootInstant> {
        let holdings = self.let_go_of_writers();
        let released = futures_util::future::join_all(
            holdings.iter().map(|h| h.lock.retire_for("shutting down")),
        )
        .await;
        released.into_iter().flatten().max()
    }

    /// Forget the writers (their parts end with their holdings), and every holding now.
    fn let_go_of_writers(&self) -> Vec<Arc<KeyHolding>> {
        self.inner
            .writers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        let keys = self.inner.keys.lock().unwrap_or_else(|e| e.into_inner());
        keys.values().filter_map(|s| current_of(s)).collect()
    }

    /// How the backend names `owner` of this pod as a key's holder (`IDENTITY/OWNER`).
    pub fn qualified(&self, owner: &str) -> String {
        format!("{}/{owner}", self.inner.identity)
    }

    fn answer_for(&self, holding: &KeyHolding, answer: Answer) -> KeyAnswer {
        match answer {
            Answer::Holder {
                token, valid_for, ..
            } => KeyAnswer::Held {
                token,
                valid_for,
                holds: holding.lock.read_snapshot(|s| s.holds),
                permit: holding.permit,
                writer: false,
            },
            Answer::NotHolder => KeyAnswer::NotHeld,
            Answer::Unknown => KeyAnswer::Unknown,
        }
    }

    /// Stop the engine of `key`'s holding `serial` and free the key's slot for the next owner,
    /// if that holding is still the key's.
    fn forget(&self, key: &str, serial: u64) {
        let Some(state) = self.existing(key) else {
            return;
        };
        let mut current = state.current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(holding) = current.take_if(|c| c.serial == serial) {
            drop(current);
            drop(
                holding
                    .slot
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take(),
            );
            if counts_as_held(holding.permit) {
                self.inner.held.fetch_sub(1, Ordering::SeqCst);
                self.inner.admitted.fetch_sub(1, Ordering::SeqCst);
            }
            // Permit 0's state is the key's own, in hand already.
            match holding.permit {
                0 => state.tell_given_up(),
                _ => {
                    if let Some(key) = self.existing(&holding.key) {
                        key.tell_given_up();
                    }
                }
            }
            // Stopped, not shut down: the hook runs inside the engine's step down, before the
            // release goes out, and the engine must be left to finish it even when this drops
            // its last handle.
            holding.lock.stop();
            // Dropping the state drops it from the family's map too, if idle.
            drop(state);
            self.part_let_go(&holding.key, &holding.owner);
        }
    }
}

/// Forget the family's idle keys every [`IDLE_KEY_SWEEP_INTERVAL`], for as long as the family
/// lives. A sweep that fails is tried again at the next.
async fn forget_idle_keys(family: std::sync::Weak<FamilyInner>) {
    loop {
        tokio::time::sleep(crate::holder::jitter(IDLE_KEY_SWEEP_INTERVAL)).await;
        let Some(family) = family.upgrade() else {
            return;
        };
        match family
            .driver()
            .forget_idle_keys(&family.name, IDLE_KEY_RETENTION)
            .await
        {
            Ok(0) => {}
            Ok(forgotten) => {
                tracing::info!(family = %family.name, forgotten, "forgot idle keys' records")
            }
            Err(e) => {
                tracing::warn!(family = %family.name, error = %e, "could not forget idle keys")
            }
        }
    }
}

/// A key's (or permit's) local state while a call uses it; dropped from the family's map
/// afterwards if nothing else holds, waits for or watches it.
struct StateInUse<'a> {
    inner: &'a FamilyInner,
    key: &'a str,
    state: Option<Arc<KeyState>>,
}

impl<'a> StateInUse<'a> {
    /// The state of `key` if it has one; none is made.
    fn existing(inner: &'a FamilyInner, key: &'a str) -> Option<Self> {
        let state = inner
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()?;
        Some(Self {
            inner,
            key,
            state: Some(state),
        })
    }

    fn new(inner: &'a FamilyInner, key: &'a str) -> Self {
        let state = inner
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.to_owned())
            .or_default()
            .clone();
        Self {
            inner,
            key,
            state: Some(state),
        }
    }
}

impl std::ops::Deref for StateInUse<'_> {
    type Target = KeyState;
    fn deref(&self) -> &KeyState {
        self.state.as_deref().expect("in use until dropped")
    }
}

impl Drop for StateInUse<'_> {
    fn drop(&mut self) {
        self.state.take();
        self.inner.drop_state_if_idle(self.key);
    }
}

/// The holding of a key's (or a permit's) engine with `token`: each engine is a lock of one
/// permit, its permit 0 (a semaphore's permits are engines apart).
pub fn own_permit(token: u64) -> (u32, u64) {
    (0, token)
}

/// Once `notices` moves; never, should its sender be gone.
async fn changed(notices: &mut tokio::sync::watch::Receiver<u64>) {
    if notices.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The name of the local state, and the key of the backend name, of `key`'s permit `permit`:
/// the key itself for permit 0, else `KEY#PERMIT`, which no key can be (`#` is refused in keys),
/// and whose backend name is therefore always hashed.
fn permit_key(key: &str, permit: u32) -> std::borrow::Cow<'_, str> {
    match permit {
        0 => key.into(),
        read_write::GATE => format!("{key}#w").into(),
        line::LINE => format!("{key}#q").into(),
        permit => format!("{key}#{permit}").into(),
    }
}

/// A place among a family's `max_keys`, taken as an acquisition starts: given back when the
/// acquisition ends without holding, kept by the holding it made (and given back when that is
/// forgotten).
struct Admission<'a>(&'a AtomicUsize);

impl<'a> Admission<'a> {
    fn take(admitted: &'a AtomicUsize, max_keys: usize) -> Option<Self> {
        admitted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max_keys).then_some(n + 1)
            })
            .ok()
            .map(|_| Admission(admitted))
    }

    /// The acquisition holds: its place stays taken until its holding is forgotten.
    fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether a holding of `permit` counts toward the pod's held keys (`maxHeldPerPod`): every
/// part does but a semaphore's line, where a waiter stands, not a holder.
fn counts_as_held(permit: u32) -> bool {
    permit != line::LINE
}

/// What an attempt refused does with its place in the backend's line (etcd, ZooKeeper): leave
/// it, or keep it for the owner's next attempt ([`line`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InLine {
    Leave,
    Keep,
}

/// What a permit (or gate) taken is to its owner: a holding of its own (an owner's key, a
/// semaphore's or a reader's permit), or a part of its write lock, which it is told of only
/// as the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Own(InLine),
    OfWrite,
}

/// The permit an acquisition that starts at `first` tries `offset`-th, of `permits`: each once,
/// from `first`'s on, also where `first` (a counter that wraps) is not a multiple of `permits`.
fn nth_permit(first: u32, offset: u32, permits: u32) -> u32 {
    (first % permits + offset) % permits
}

/// Of two refusals, the one that tells the caller more: a holder over a guard's wait, a guard's
/// wait over an unreachable backend.
fn more_telling(earlier: Option<KeyAnswer>, later: KeyAnswer) -> KeyAnswer {
    let rank = |answer: &KeyAnswer| match answer {
        KeyAnswer::HeldByAnother { holder: Some(_) } => 3,
        KeyAnswer::HeldByAnother { holder: None } => 2,
        KeyAnswer::Withheld { .. } => 1,
        _ => 0,
    };
    match earlier {
        Some(earlier) if rank(&earlier) >= rank(&later) => earlier,
        _ => later,
    }
}

fn current_of(state: &KeyState) -> Option<Arc<KeyHolding>> {
    state
        .current
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

/// The engine checks the lease and renew interval of each key; check them once, up front.
fn check_settings(config: &FamilyConfig) -> Result<(), Error> {
    if !(1..=MAX_PERMITS).contains(&config.permits) {
        return Err(Error::InvalidConfig {
            field: "permits",
            reason: format!(
                "a key has 1 to {MAX_PERMITS} permits (it was {})",
                config.permits
            ),
        });
    }
    if config.read_write && config.permits > MAX_READ_WRITE_PERMITS {
        return Err(Error::InvalidConfig {
            field: "permits",
            reason: format!(
                "a read-write family's key has 1 to {MAX_READ_WRITE_PERMITS} permits (it was {}): a writer probes each permit it does not take",
                config.permits
            ),
        });
    }
    if config.max_keys == 0 || config.max_key_length == 0 {
        return Err(Error::InvalidConfig {
            field: "family",
            reason: "the key length and the number of keys held must be at least 1".into(),
        });
    }
    LockConfig {
        renew_interval: config.renew_interval,
        ..LockConfig::new(&config.name, &config.identity, config.lease_duration)
    }
    .validate()
}

/// `Ok` when `key` is a key of at most `max` characters.
fn key_within(key: &str, max: usize) -> Result<(), KeyError> {
    if is_key(key, max) {
        return Ok(());
    }
    // Every keyed call checks its key: the message is only built for a refusal.
    Err(KeyError::BadKey {
        key: key.chars().take(max + 16).collect(),
        rule: format!(
            "a key is 1 to {max} characters among letters, digits and . _ - : / @ (it was {} long)",
            key.len()
        ),
    })
}

fn owner_well_formed(owner: &str) -> Result<(), KeyError> {
    if owner.is_empty() || owner.len() > MAX_OWNER_LENGTH {
        return Err(KeyError::BadOwner(format!(
            "an owner is 1 to {MAX_OWNER_LENGTH} characters (it was {})",
            owner.len()
        )));
    }
    if !owner.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(KeyError::BadOwner(
            "an owner is printable ASCII without spaces".into(),
        ));
    }
    Ok(())
}

/// Whether `key` is a key: 1 to `max_key_length` letters, digits and `. _ - : / @`.
fn is_key(key: &str, max_key_length: usize) -> bool {
    !key.is_empty()
        && key.len() <= max_key_length
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:/@".contains(&b))
}

/// The backend lock names of `key`'s `permits` in `family`, in order, for those who read a key's
/// holders without a family of their own (the operator, for a force-release). `Err` when `key`
/// is not a key of at most `max_key_length` characters.
pub fn key_lock_names(
    family: &str,
    key: &str,
    permits: std::ops::Range<u32>,
    max_key_length: usize,
) -> Result<Vec<String>, String> {
    if !is_key(key, max_key_length) {
        return Err(format!(
            "{key:?} is not a key: 1 to {max_key_length} letters, digits and . _ - : / @"
        ));
    }
    Ok(permits
        .map(|permit| backend_name(family, &permit_key(key, permit)))
        .collect())
}

/// The backend lock name of permit `permit` of a plain lock `lock` (a semaphore lock): the
/// lock's own name for permit 0, else the hashed name a family called `lock` would give the key
/// `#PERMIT`. No key has it: keys never hold `#`, and a key's permits hash `KEY#PERMIT` with a
/// key that is never empty.
pub fn lock_permit_name(lock: &str, permit: u32) -> String {
    match permit {
        0 => lock.to_owned(),
        permit => hashed_name(lock, &format!("#{permit}")),
    }
}

/// The backend lock name of the line that the processes waiting for a plain lock `lock` of
/// several permits stand in on a backend that keeps a queue: the hashed name a family called
/// `lock` would give the key `#q`, which no key, and no permit, has.
pub fn lock_line_name(lock: &str) -> String {
    hashed_name(lock, "#q")
}

/// `FAMILY.keys.KEY` for a plain lowercase key that keeps the name valid everywhere, else
/// `FAMILY.keyh.` and the key's hash.
fn backend_name(family: &str, key: &str) -> String {
    let plain = key
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && key.as_bytes()[0].is_ascii_alphanumeric()
        && key.as_bytes()[key.len() - 1].is_ascii_alphanumeric()
        && !key.contains("..");
    let name = format!("{family}{PLAIN_KEY_INFIX}{key}");
    if plain && name.len() <= MAX_LOCK_NAME {
        name
    } else {
        hashed_name(family, key)
    }
}

/// The name of `lock`'s Kubernetes Lease where the lock's own is one the API server refuses: a
/// family's plain key with a dot-separated part that starts or ends with '-' (`orders.keys.a-.b`)
/// is held in the Lease its hash names, as the family names keys it cannot name plainly. On
/// every other backend the key keeps its plain name; on Kubernetes the plain name was never
/// accepted, so no Lease of that name is held by anyone.
pub fn kubernetes_lease_name(lock: &str) -> Option<String> {
    if crate::names::validate_lease_name(lock).is_ok() {
        return None;
    }
    let family = family_of(lock)?;
    let key = lock[family.len()..].strip_prefix(PLAIN_KEY_INFIX)?;
    Some(hashed_name(family, key))
}

fn hashed_name(family: &str, key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{family}{HASHED_KEY_INFIX}{}", &hex[..HASHED_KEY_DIGITS])
}

/// A family's name is a lock name short enough that its keys' derived names are lock names too.
pub fn validate_family_name(family: &str) -> Result<(), Error> {
    validate_lock_name(family)?;
    // A key's lock name must say which family it is of (`family_of`: the first infix in it
    // ends the family), which a family containing an infix, or ending in `.keys` or `.keyh`,
    // would not: the backends count tokens and forget idle keys by that family.
    if let Some(infix) = [PLAIN_KEY_INFIX, HASHED_KEY_INFIX]
        .into_iter()
        .find(|infix| family_of(&format!("{family}{infix}x")) != Some(family))
    {
        return Err(Error::InvalidConfig {
            field: "family",
            reason: format!(
                "{family:?} would not end where {infix:?} follows it in its keys' names: a family may neither contain `.keys.` or `.keyh.` nor end in `.keys` or `.keyh`"
            ),
        });
    }
    let longest = hashed_name(family, "x");
    if longest.len() > MAX_LOCK_NAME {
        return Err(Error::InvalidConfig {
            field: "family",
            reason: format!(
                "{family:?} is too long for a family: its keys' backend names ({family}.keyh. and {HASHED_KEY_DIGITS} hex digits) must stay within {MAX_LOCK_NAME} characters, so a family name is at most {} characters",
                MAX_LOCK_NAME - (longest.len() - family.len())
            ),
        });
    }
    Ok(())
}

/// A pod's identity as a family's owners are named by it: an owner holds as `IDENTITY/OWNER`
/// ([`KeyedFamily::qualified`]), and owners may contain `/`, so an identity with one would
/// name another pod's owner as this pod's (`a` with owner `b/c`, `a/b` with owner `c`): the
/// other's holding taken for one's own in answers and a writer's gate.
pub fn validate_family_identity(identity: &str) -> Result<(), Error> {
    if identity.contains('/') {
        return Err(Error::InvalidConfig {
            field: "identity",
            reason: format!(
                "{identity:?}: a pod serving keyed families has an identity without `/`, which separates it from an owner in the holder's name (a pod's name has none)"
            ),
        });
    }
    Ok(())
}

/// Whether a plain lock named `lock` would share the backend with a key of `family`.
pub fn collides_with_family(lock: &str, family: &str) -> bool {
    family_of(lock) == Some(family)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acquisition_tries_every_permit_once_wherever_its_counter_stands() {
        for permits in [1, 3, 4, 7, 256] {
            for first in [0, 1, 5, u32::MAX - 1, u32::MAX] {
                let mut tried: Vec<u32> = (0..permits)
                    .map(|offset| nth_permit(first, offset, permits))
                    .collect();
                assert_eq!(tried[0], first % permits, "{first} of {permits}");
                tried.sort_unstable();
                assert_eq!(
                    tried,
                    (0..permits).collect::<Vec<_>>(),
                    "{first} of {permits}"
                );
            }
        }
    }

    /// A driver on a SQLite file in `dir`.
    async fn sqlite_in(dir: &tempfile::TempDir) -> Arc<dyn Backend> {
        let url = format!("sqlite://{}", dir.path().join("locks.db").display());
        crate::connect(&crate::BackendUrl::parse(&url).expect("url"))
            .await
            .expect("driver")
    }

    /// An owner too long for the backend identity beside a long pod name is refused as a bad
    /// owner (a 400), before anything is asked of the backend; one that fits is taken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_owner_too_long_beside_the_pods_identity_is_refused_as_such() {
        let dir = tempfile::tempdir().expect("a directory");
        let driver = sqlite_in(&dir).await;
        let identity = "p".repeat(200);
        let family = KeyedFamily::new(
            driver,
            FamilyConfig::new("orders", &identity, Duration::from_secs(30)),
            Arc::new(()),
        )
        .expect("family");
        let hold = Duration::from_secs(60);
        let refused = family
            .acquire("k", &"o".repeat(60), Duration::ZERO, hold)
            .await;
        assert!(
            matches!(&refused, Err(KeyError::BadOwner(why)) if why.contains("1 to 46 characters")),
            "{refused:?}"
        );
        assert!(matches!(
            family
                .acquire("k", &"o".repeat(46), Duration::ZERO, hold)
                .await,
            Ok(KeyAnswer::Held { .. })
        ));
        family.shutdown().await;
    }

    /// A pod whose identity has a `/` serves no family: its owners' holder names could be
    /// another pod's owners' (`a` with `b/c`, `a/b` with `c`).
    #[tokio::test]
    async fn an_identity_with_a_slash_serves_no_family() {
        let dir = tempfile::tempdir().expect("a directory");
        let refused = KeyedFamily::new(
            sqlite_in(&dir).await,
            FamilyConfig::new("orders", "a/b", Duration::from_secs(15)),
            Arc::new(()),
        );
        assert!(
            matches!(
                &refused,
                Err(Error::InvalidConfig {
                    field: "identity",
                    ..
                })
            ),
            "{:?}",
            refused.as_ref().err()
        );
    }

    /// A write that cannot fit the pod's limit of held keys (each key written holds its gate and
    /// every permit) is refused as bad keys before anything is taken or waited for, not after
    /// waiting for keys it could never hold together.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_over_the_limit_of_held_keys_is_refused_before_it_waits() {
        let dir = tempfile::tempdir().expect("a directory");
        let driver = sqlite_in(&dir).await;
        let family = KeyedFamily::new(
            driver,
            FamilyConfig {
                permits: 4,
                read_write: true,
                max_keys: 10,
                ..FamilyConfig::new("orders", "pod-a", Duration::from_secs(30))
            },
            Arc::new(()),
        )
        .expect("family");
        // A wait far longer than any stall of a loaded machine: a refusal after waiting would
        // take all of it (the reader holds for longer).
        let (hold, wait) = (Duration::from_secs(120), Duration::from_secs(60));
        assert!(matches!(
            family
                .acquire_read("a", "reader", Duration::ZERO, hold)
                .await,
            Ok(KeyAnswer::Held { .. })
        ));
        let three: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let asked = Instant::now();
        let refused = family.acquire_all_write(&three, "writer", wait, hold).await;
        assert!(
            matches!(&refused, Err(KeyError::BadKeys(why)) if why.contains("holds 15 keys")),
            "three keys of four permits, ten held keys at most: {refused:?} after {:?}",
            asked.elapsed()
        );
        assert!(asked.elapsed() < wait / 2, "{:?}", asked.elapsed());
        // Two keys fit: taken once the reader is gone.
        assert!(matches!(
            family.release("a", "reader").await,
            Ok(KeyRelease::Released { .. })
        ));
        let two: Vec<String> = ["a", "b"].map(String::from).to_vec();
        assert!(matches!(
            family.acquire_all_write(&two, "writer", wait, hold).await,
            Ok(KeysAnswer::Held(_))
        ));
        assert!(matches!(
            family.release("b", "writer").await,
            Ok(KeyRelease::Released { .. })
        ));

        // Lowered below a write held: that write is acquired again (it takes nothing new), a
        // new one is refused.
        family
            .reconfigure(FamilyConfig {
                permits: 4,
                read_write: true,
                max_keys: 4,
                ..FamilyConfig::new("orders", "pod-a", Duration::from_secs(30))
            })
            .expect("fewer held keys");
        assert!(matches!(
            family.acquire_write("a", "writer", wait, hold).await,
            Ok(KeyAnswer::Held { writer: true, .. })
        ));
        let refused = family.acquire_write("b", "writer", wait, hold).await;
        assert!(
            matches!(&refused, Err(KeyError::BadKeys(why)) if why.contains("holds 5 keys")),
            "{refused:?}"
        );
        for _ in 0..2 {
            assert!(matches!(
                family.release("a", "writer").await,
                Ok(KeyRelease::Released { .. })
            ));
        }
        assert!(matches!(
            family
                .acquire_read("a", "reader", Duration::ZERO, hold)
                .await,
            Ok(KeyAnswer::Held { .. })
        ));
        family.shutdown().await;
    }

    /// Bounds lowered while keys are held apply from the next acquisition: a key longer than the
    /// new bound, and keys held together beyond the new count, are still told of, extended and
    /// released; a new acquisition meets the new bounds.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_held_before_the_bounds_were_lowered_are_still_released() {
        let dir = tempfile::tempdir().expect("a directory");
        let driver = sqlite_in(&dir).await;
        let lease = Duration::from_secs(30);
        let config = |max_key_length, max_keys| FamilyConfig {
            max_key_length,
            max_keys,
            ..FamilyConfig::new("orders", "pod-a", lease)
        };
        let family = KeyedFamily::new(driver, config(64, 4), Arc::new(())).expect("family");
        let long = "k".repeat(60);
        let three: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let hold = Duration::from_secs(60);
        assert!(matches!(
            family.acquire(&long, "o", Duration::ZERO, hold).await,
            Ok(KeyAnswer::Held { .. })
        ));
        family
            .acquire_all(&three, "o", Duration::ZERO, hold)
            .await
            .expect("three keys");

        family.reconfigure(config(32, 2)).expect("lowered bounds");
        assert!(matches!(
            family
                .acquire(&"n".repeat(60), "o", Duration::ZERO, hold)
                .await,
            Err(KeyError::BadKey { .. })
        ));
        assert!(matches!(
            family.status(&long, Some("o")),
            Ok(KeyAnswer::Held { .. })
        ));
        assert!(matches!(
            family.extend(&long, "o", hold).await,
            Ok(KeyAnswer::Held { .. })
        ));
        assert!(matches!(
            family.release(&long, "o").await,
            Ok(KeyRelease::Released { holds: 0 })
        ));
        family
            .extend_all(&three, "o", hold)
            .await
            .expect("extended together");
        let released = family
            .release_all(&three, "o")
            .await
            .expect("released together");
        assert!(
            released
                .iter()
                .all(|(_, r)| matches!(r, KeyRelease::Released { holds: 0 })),
            "{released:?}"
        );
        family.shutdown().await;
    }

    #[test]
    fn plain_keys_keep_their_name_and_others_are_hashed() {
        assert_eq!(
            backend_name("orders", "order-1234"),
            "orders.keys.order-1234"
        );
        for odd in ["Order-1", "sku/998", "a:b", "x_y", "-a", "a..b", "@"] {
            let name = backend_name("orders", odd);
            assert!(name.starts_with("orders.keyh."), "{odd}: {name}");
            validate_lock_name(&name).unwrap();
        }
        // Deterministic, and distinct keys stay distinct.
        assert_eq!(backend_name("f", "Sku/1"), backend_name("f", "Sku/1"));
        assert_ne!(backend_name("f", "Sku/1"), backend_name("f", "Sku/2"));
        let long = "a".repeat(250);
        assert!(backend_name("orders", &long).starts_with("orders.keyh."));
        assert!(collides_with_family("orders.keys.x", "orders"));
        assert!(!collides_with_family("orders", "orders"));
        assert_eq!(family_of(&backend_name("orders", "Sku/1")), Some("orders"));
        assert_eq!(family_of("a.keys.b.keyh.c"), Some("a"));
        assert_eq!(family_of(".keys.x"), None);
    }

    #[test]
    fn a_family_name_leaves_room_for_its_keys() {
        validate_family_name(&"a".repeat(207)).unwrap();
        let error = validate_family_name(&"a".repeat(208)).unwrap_err();
        assert!(error.to_string().contains("at most 207"), "{error}");
        assert!(validate_family_name("orders.keys.x").is_err());
        assert!(validate_family_name("a.keyh.b").is_err());
        // Its keys would be named `orders.keys.keys.K`, whose family reads as `orders`.
        assert!(validate_family_name("orders.keys").is_err());
        assert!(validate_family_name("orders.keyh").is_err());
        validate_family_name("orders.key").unwrap();
        validate_family_name("orders.keyset").unwrap();
    }

    /// A key given back while another call looks at its state (a status, say) leaves no state
    /// behind: the release, finding the state in use, leaves it to the look, which drops it
    /// once done.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_given_back_while_its_state_is_looked_at_leaves_no_state_behind() {
        let dir = tempfile::tempdir().expect("a directory");
        let family = KeyedFamily::new(
            sqlite_in(&dir).await,
            FamilyConfig::new("orders", "pod-a", Duration::from_secs(30)),
            Arc::new(()),
        )
        .expect("family");
        let hold = Duration::from_secs(30);
        let answer = family.acquire("k", "o", Duration::ZERO, hold).await;
        assert!(matches!(answer, Ok(KeyAnswer::Held { .. })), "{answer:?}");
        let look = family.existing("k").expect("the key's state");
        assert!(matches!(
            family.release("k", "o").await,
            Ok(KeyRelease::Released { .. })
        ));
        assert_eq!(family.tracked_keys(), 1, "in use by the look");
        drop(look);
        assert_eq!(family.held_keys(), 0);
        assert_eq!(
            family.tracked_keys(),
            0,
            "the state of a key given back outlived the look at it"
        );
    }

    /// A read-write family is never reconfigured into one that is not (its resource edited, a
    /// CRD without the rule that refuses it): its owners would stop looking at the writers'
    /// gate and take keys beside them. Turning it on is taken.
    #[tokio::test]
    async fn a_read_write_family_cannot_stop_being_one() {
        let dir = tempfile::tempdir().expect("a directory");
        let config = FamilyConfig {
            permits: 2,
            ..FamilyConfig::new("docs", "pod-a", Duration::from_secs(2))
        };
        let family =
            KeyedFamily::new(sqlite_in(&dir).await, config.clone(), Arc::new(())).expect("family");
        let read_write = FamilyConfig {
            read_write: true,
            ..config.clone()
        };
        family.reconfigure(read_write.clone()).expect("turned on");
        let off = family.reconfigure(FamilyConfig {
            permits: 3,
            ..config
        });
        assert!(
            matches!(
                &off,
                Err(Error::InvalidConfig {
                    field: "readWrite",
                    ..
                })
            ),
            "{off:?}"
        );
        assert!(family.is_read_write(), "the family stays read-write");
        assert_eq!(family.permits(), 2, "nothing of the refused change applies");
        family.reconfigure(read_write).expect("the same again");
    }

    /// A family made read-write while an owner waits for a permit: the permit it is then given
    /// (above 0) is its own as answered, to extend, read and release, not a reader's that never
    /// passed the write gate and that its owner's calls cannot find.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_permit_granted_after_the_family_became_read_write_is_its_owners() {
        let dir = tempfile::tempdir().expect("a directory");
        let config = FamilyConfig {
            permits: 2,
            renew_interval: Duration::from_millis(200),
            ..FamilyConfig::new("docs", "pod-a", Duration::from_secs(2))
        };
        let family =
            KeyedFamily::new(sqlite_in(&dir).await, config.clone(), Arc::new(())).expect("family");
        let hold = Duration::from_secs(30);
        let mut on_top = None;
        for owner in ["o1", "o2"] {
            let answer = family.acquire("doc", owner, Duration::ZERO, hold).await;
            if let Ok(KeyAnswer::Held { permit: 1, .. }) = answer {
                on_top = Some(owner);
            }
        }
        let on_top = on_top.expect("one of two owners on permit 1");
        let waiting = {
            let family = family.clone();
            tokio::spawn(async move {
                family
                    .acquire("doc", "o3", Duration::from_secs(10), hold)
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        family
            .reconfigure(FamilyConfig {
                read_write: true,
                ..config
            })
            .expect("turned on");
        family.release("doc", on_top).await.expect("released");
        let answer = waiting.await.expect("the waiter").expect("answered");
        assert!(
            matches!(answer, KeyAnswer::Held { permit: 1, .. }),
            "{answer:?}"
        );
        let status = family.status("doc", Some("o3"));
        assert!(
            matches!(status, Ok(KeyAnswer::Held { permit: 1, .. })),
            "{status:?}"
        );
        assert_eq!(
            family.release("doc", "o3").await.expect("released"),
            KeyRelease::Released { holds: 0 }
        );
    }

    /// Two writes of one key by one owner, the second sent while the first holds the write gate
    /// and waits for a reader: the second is refused (a 409 naming the owner: not its turn)
    /// rather than merged into the first's parts, two write locks of which only one is the
    /// owner's to act on and release.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_write_of_an_owner_sent_while_its_first_is_waiting_is_refused() {
        let dir = tempfile::tempdir().expect("a directory");
        let family = |pod: &str, permits: u32, driver: Arc<dyn Backend>| {
            KeyedFamily::new(
                driver,
                FamilyConfig {
                    permits,
                    read_write: true,
                    renew_interval: Duration::from_millis(200),
                    ..FamilyConfig::new("docs", pod, Duration::from_secs(2))
                },
                Arc::new(()),
            )
            .expect("family")
        };
        // A pod of two permits has a reader on permit 1: this pod's writer, of one permit,
        // holds the gate and waits until permit 1 is free.
        let other = family("pod-b", 2, sqlite_in(&dir).await);
        let this = family("pod-a", 1, sqlite_in(&dir).await);
        let hold = Duration::from_secs(30);
        for reader in ["r0", "r1"] {
            let answer = other.acquire_read("k", reader, Duration::ZERO, hold).await;
            assert!(matches!(answer, Ok(KeyAnswer::Held { .. })), "{answer:?}");
        }
        assert!(matches!(
            other.release("k", "r0").await,
            Ok(KeyRelease::Released { .. })
        ));
        let wait = Duration::from_secs(10);
        let first = tokio::spawn({
            let this = this.clone();
            async move { this.acquire_write("k", "w", wait, hold).await }
        });
        while this.holding_on("k", read_write::GATE, "w").is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Answered while the first still waits for the reader.
        let second = tokio::time::timeout(
            Duration::from_secs(5),
            this.acquire_write("k", "w", wait, hold),
        )
        .await;
        assert!(
            matches!(&second, Ok(Ok(KeyAnswer::HeldByAnother { holder: Some(holder) })) if holder == "pod-a/w"),
            "the second write, sent while the first waited: {second:?}"
        );
        assert!(!first.is_finished(), "the first write did not wait");
        assert!(matches!(
            other.release("k", "r1").await,
            Ok(KeyRelease::Released { .. })
        ));
        let first = first.await.expect("the first write");
        assert!(
            matches!(first, Ok(KeyAnswer::Held { .. })),
            "the first write: {first:?}"
        );
        assert!(matches!(
            this.release("k", "w").await,
            Ok(KeyRelease::Released { .. })
        ));
        assert_eq!(this.held_keys(), 0, "a part of a write lock was left held");
    }

    /// As above, with the first write holding a permit already (this pod counts two, its own
    /// reader on permit 1): that part of the unanswered write is no read by the owner, so the
    /// second write is a 409 naming the owner, not a 400 refusing an upgrade.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_write_of_an_owner_whose_first_holds_a_permit_is_refused_as_held() {
        let dir = tempfile::tempdir().expect("a directory");
        let this = KeyedFamily::new(
            sqlite_in(&dir).await,
            FamilyConfig {
                permits: 2,
                read_write: true,
                renew_interval: Duration::from_millis(200),
                ..FamilyConfig::new("docs", "pod-a", Duration::from_secs(2))
            },
            Arc::new(()),
        )
        .expect("family");
        let hold = Duration::from_secs(30);
        for reader in ["r0", "r1"] {
            let answer = this.acquire_read("k", reader, Duration::ZERO, hold).await;
            assert!(matches!(answer, Ok(KeyAnswer::Held { .. })), "{answer:?}");
        }
        assert!(matches!(
            this.release("k", "r0").await,
            Ok(KeyRelease::Released { .. })
        ));
        let wait = Duration::from_secs(10);
        let first = tokio::spawn({
            let this = this.clone();
            async move { this.acquire_write("k", "w", wait, hold).await }
        });
        while this.holding_on("k", 0, "w").is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let second = tokio::time::timeout(
            Duration::from_secs(5),
            this.acquire_write("k", "w", wait, hold),
        )
        .await;
        assert!(
            matches!(&second, Ok(Ok(KeyAnswer::HeldByAnother { holder: Some(holder) })) if holder == "pod-a/w"),
            "the second write, sent while the first held permit 0 and waited: {second:?}"
        );
        assert!(matches!(
            this.release("k", "r1").await,
            Ok(KeyRelease::Released { .. })
        ));
        let first = first.await.expect("the first write");
        assert!(
            matches!(first, Ok(KeyAnswer::Held { .. })),
            "the first write: {first:?}"
        );
        assert!(matches!(
            this.release("k", "w").await,
            Ok(KeyRelease::Released { .. })
        ));
        assert_eq!(this.held_keys(), 0, "a part of a write lock was left held");
    }
}
