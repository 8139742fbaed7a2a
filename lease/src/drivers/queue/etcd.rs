//! etcd: a fair queue, as etcd's own `concurrency.Mutex` on a `concurrency.Session`. Each
//! contender puts a key `PREFIX/LOCK/SESSION_ID-N` bound to its process's etcd lease (its
//! session); the key with the lowest create revision holds, and every waiter watches only the
//! key just below its own, so a release wakes exactly one waiter. The token is the holder's
//! create revision: later keys always get larger revisions.
//!
//! **One etcd lease per process** (and lease length), as a ZooKeeper session binds a client's
//! nodes: a sidecar holding 10,000 keyed locks keeps them all alive with one keep-alive per
//! batch of renewals, where a lease per key cost a keep-alive per renewal. A process that dies
//! or stops loses every key when its lease runs out.
//!
//! The holder's claim is bounded like every other driver's: `t_sent + ttl - margin`, where the
//! etcd lease's TTL (whole seconds, rounded up, never below etcd's minimum) is at least `ttl` and
//! restarts at the server when a keep-alive sent after `t_sent` arrives. So the key outlives the
//! claim:
//!
//! - becoming the holder costs one keep-alive sent after `t_sent` (shared by the claims and
//!   renewals asked at once), since the last keep-alive may be older than the claim about to
//!   start, and the lease may have ended since the position was read;
//! - a renewal sends a keep-alive after `t_sent` too, and reads its key back: a key deleted
//!   behind the driver's back lets the next contender in while the lease lives on;
//! - between them a keeper task keeps the lease alive (every half TTL), so a waiter keeps
//!   its place while its engine asks; a waiter that stops asking (its app gave up) leaves the
//!   queue after four TTLs.
//!
//! A key leaves the queue by its own delete, guarded by its create revision (a release, a
//! waiter giving up, a holder whose local lease ran out): the lease lives on for the process's
//! other keys. A delete that fails is tried again at each of the keeper's rounds until it lands
//! or the lease ends, so a key its process has let go never blocks the queue for longer than
//! etcd takes to answer again.
//!
//! A free lock costs two round trips to take (one transaction that puts the key and reads the
//! queue around it, the keep-alive), after the process's first, which grants its lease, and one
//! to release (the delete).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::driver::{Acquire, Driver, Holding, Lease, Upkeep};
use crate::drivers::batches::{Batch, Batches, Gather, answer_all};
use crate::drivers::queue::etcd_rpc::{
    Compare, Connect, DeleteRangeRequest, EVENT_DELETE, EtcdClient, KeyValue, PutRequest,
    RangeRequest, RpcError, SORT_ASCEND, SORT_DESCEND, TlsPem, TxnRequest,
};
use crate::drivers::queue::places::{Joined, Place};
use crate::drivers::queue::slot::{AttemptTurn, QueueSlot};
use crate::drivers::queue::{Lines, Transport};
use crate::error::{Error, Result};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How many keep-alives a session's keeper sends per TTL: the lease then always has half its TTL
/// left for a keep-alive to arrive, as a waiter's own keep-alives had before sessions.
const KEEP_ALIVES_PER_TTL: u32 = 2;
/// How many of its keeper's rounds a session goes unused before it is ended (revoked).
const IDLE_ROUNDS: u32 = KEEP_ALIVES_PER_TTL;
/// How long a put whose answer never came may still land: etcd answers a proposal it has not
/// applied after its request timeout (5 s and two election timeouts by default) but may apply it
/// later still, once a leader commits it; a minute leaves room for a leader change.
const LATE_PUT_WINDOW: Duration = Duration::from_secs(60);

/// Where to find etcd and how to log in.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `host:port`: reached over HTTPS when `tls` is set, else over HTTP.
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub user: Option<(String, String)>,
    pub tls: Option<EtcdTls>,
}

pub use crate::tls::Pem;

/// TLS to etcd: the CA that signed the members' certificates, and this client's certificate and
/// key for members that ask for one (`--client-cert-auth`).
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: Pem,
    pub client: Option<(Pem, Pem)>,
}

impl EtcdTls {
    fn pem(&self) -> Result<TlsPem> {
        Ok(TlsPem {
            ca: self.ca.read("ca")?,
            client: match &self.client {
                Some((cert, key)) => Some((cert.read("cert")?, key.read("key")?)),
                None => None,
            },
        })
    }
}

/// This process's key in one lock's queue; its token is the key's create revision.
type Entry = Place<Key>;

/// What an etcd place is: its key, and the session whose lease keeps it.
struct Key {
    key: String,
    session: SessionUse,
}

/// This process's etcd lease for its keys of one TTL (see the module's notes).
struct Session {
    id: i64,
    /// The TTL etcd granted: at least the one asked for, in whole seconds.
    granted: Duration,
    /// Claims' keep-alives: those asked while one is on its way go out together in the next
    /// ([`Gather::WhileBusy`]), each sent after it was asked.
    keep_alives: Batches<(), Result<bool>>,
    /// Set once etcd has said the lease is gone (or this process revoked it): its keys went
    /// with it, and no key is put under it any more.
    ended: AtomicBool,
    /// How many of this process's entries are bound to it.
    users: AtomicUsize,
    keeper: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Session {
    fn ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }

    /// One keep-alive sent after this call began: whether the lease is still there.
    async fn keep_alive(&self) -> Result<bool> {
        Ok(self.kept(self.keep_alives.call(()).await??))
    }

    /// A keep-alive's answer, `alive`, taken note of: a lease gone ends the session.
    fn kept(&self, alive: bool) -> bool {
        if !alive {
            self.ended.store(true, Ordering::SeqCst);
        }
        alive
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(keeper) = self
            .keeper
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            keeper.abort();
        }
    }
}

/// An entry's hold on its session: counted while the entry lives, so that an unused session
/// can be ended.
struct SessionUse(Arc<Session>);

impl SessionUse {
    fn new(session: Arc<Session>) -> Self {
        session.users.fetch_add(1, Ordering::SeqCst);
        Self(session)
    }
}

impl Drop for SessionUse {
    fn drop(&mut self) {
        self.0.users.fetch_sub(1, Ordering::SeqCst);
    }
}

impl std::ops::Deref for SessionUse {
    type Target = Session;
    fn deref(&self) -> &Session {
        &self.0
    }
}

/// A key this process let go whose delete failed: tried again at the keeper's next round, while
/// its session lasts (the key goes with it).
struct Orphan {
    key: String,
    /// The key's create revision, when known (a put whose answer was lost has none).
    revision: Option<i64>,
    session: std::sync::Weak<Session>,
    /// For a put whose answer never came: until when it may still land, after any delete of its
    /// name. Its name is deleted again at each keeper round until then.
    may_land_until: Option<Instant>,
}

struct Shared {
    config: EtcdConfig,
    client: OnceCell<EtcdClient>,
    lines: Lines<Key>,
    /// This process's etcd leases, by their TTL in seconds; granted on first use.
    sessions: tokio::sync::Mutex<HashMap<i64, Arc<Session>>>,
    orphans: Mutex<Vec<Orphan>>,
    /// Numbers this process's keys, so that a key is never put twice under one name.
    keys_put: AtomicU64,
}

pub struct EtcdDriver {
    shared: Arc<Shared>,
    /// Renewals' checks that arrive together are read together ([`check_keys`]).
    checks: Batches<KeyCheck, Result<Checked>>,
}

/// A renewal's check that its key is still the one it put: a key deleted behind the driver's
/// back (`etcdctl del --prefix`, a lock's clean-up) lets the next contender in while the etcd
/// lease lives on, so a live lease alone proves nothing. Its session's keep-alive goes with it.
struct KeyCheck {
    client: EtcdClient,
    key: String,
    revision: i64,
    session: Arc<Session>,
}

/// What a renewal's check found.
#[derive(Clone, Copy)]
struct Checked {
    /// The session's lease is still there, after a keep-alive sent after the renewal began.
    alive: bool,
    /// The key is still the one put.
    queued: bool,
}

/// The most keys one batch of checks reads: etcd refuses a transaction of more operations than
/// its `--max-txn-ops` (128 by default).
const MAX_CHECK_BATCH: usize = 128;

/// The checks of a batch in one transaction that reads every key, where each renewal sent a
/// transaction of its own, beside one keep-alive for each session the batch's keys are bound
/// to, where each renewal sent its own. A key is still queued when it is there with the create
/// revision it was put with (a key put again has another). Each read and keep-alive is sent
/// after its renewal began, as its own were.
async fn check_keys(batch: Batch<KeyCheck, Result<Checked>>) {
    let client = batch[0].request.client.clone();
    let request = TxnRequest {
        success: batch
            .iter()
            .map(|pending| RangeRequest::key(&pending.request.key).into())
            .collect(),
        ..TxnRequest::default()
    };
    let mut sessions: Vec<&Arc<Session>> = Vec::new();
    for pending in &batch {
        if !sessions
            .iter()
            .any(|s| Arc::ptr_eq(s, &pending.request.session))
        {
            sessions.push(&pending.request.session);
        }
    }
    let keep_alives = futures_util::future::join_all(sessions.iter().map(|session| async {
        let alive = client.lease_keep_alive(session.id).await.map_err(map_err)?;
        Ok::<_, Error>(session.kept(alive.is_some()))
    }));
    let (read, kept) = tokio::join!(client.txn(request), keep_alives);
    let alive: HashMap<i64, Result<bool>> = sessions.iter().map(|s| s.id).zip(kept).collect();
    let ranges = match read {
        Ok(reply) => reply.ranges(),
        Err(e) => return answer_all(batch, Err(map_err(e))),
    };
    if ranges.len() != batch.len() {
        let error = Error::Backend(format!(
            "a transaction of {} reads was answered with {} results",
            batch.len(),
            ranges.len()
        ));
        return answer_all(batch, Err(error));
    }
    for (pending, range) in batch.into_iter().zip(ranges) {
        let queued = range
            .kvs
            .first()
            .is_some_and(|kv| kv.create_revision == pending.request.revision);
        let answer = match &alive[&pending.request.session.id] {
            Ok(alive) => Ok(Checked {
                alive: *alive,
                queued,
            }),
            Err(e) => Err(e.clone()),
        };
        let _ = pending.reply.send(answer);
    }
}

impl Drop for EtcdDriver {
    fn drop(&mut self) {
        self.shared.lines.places.abort_all();
    }
}

fn map_err(e: RpcError) -> Error {
    match e {
        // The causes say what went wrong: a refused connection, an unknown certificate issuer.
        RpcError::Unreachable(text) => Error::Unreachable(text),
        RpcError::Status(_) => Error::Backend(e.to_string()),
    }
}

/// Whether etcd refused a request for naming a lease that is gone.
fn lease_gone(e: &RpcError) -> bool {
    matches!(e, RpcError::Status(status) if status.message().contains("lease not found"))
}

/// etcd leases count whole seconds: round up, so the key never expires before the claim does.
fn ttl_seconds(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}

impl Transport for Shared {
    type Own = Key;

    fn lines(&self) -> &Lines<Key> {
        &self.lines
    }

    /// The unknown places cleared are keys of this process's sessions
    /// ([`Shared::deleted_if_unknown_own`]).
    async fn first_in_line(&self, lock: &str, clear: bool) -> Result<Option<Holding>> {
        let client = self.client().await?;
        let reply = client
            .range(lowest(&self.queue_prefix(lock)))
            .await
            .map_err(map_err)?;
        match reply.kvs.first() {
            Some(kv) if clear && self.deleted_if_unknown_own(lock, kv).await? => Ok(None),
            Some(kv) => Ok(Some(self.holding(kv, true).await?)),
            None => Ok(None),
        }
    }

    async fn leave_line(&self, entry: &Entry) {
        self.leave(entry).await;
    }

    /// The session's lease is gone, and the key with it.
    fn line_gone(&self, entry: &Entry) -> bool {
        entry.session.ended()
    }
}

impl Shared {
    fn queue_prefix(&self, lock: &str) -> String {
        format!("{}/{lock}/", self.config.prefix)
    }

    async fn client(&self) -> Result<EtcdClient> {
        self.client
            .get_or_try_init(|| async {
                EtcdClient::connect(Connect {
                    endpoints: &self.config.endpoints,
                    tls: self.config.tls.as_ref().map(EtcdTls::pem).transpose()?,
                    user: self.config.user.clone(),
                    connect_timeout: CONNECT_TIMEOUT,
                    request_timeout: REQUEST_TIMEOUT,
                })
                .await
                .map_err(map_err)
            })
            .await
            .cloned()
    }

    /// The session for keys of `ttl`: this process's live one, or a new one granted now.
    async fn session(self: &Arc<Self>, ttl: Duration) -> Result<SessionUse> {
        let seconds = ttl_seconds(ttl);
        let mut sessions = self.sessions.lock().await;
        if let Some(session) = sessions.get(&seconds).filter(|s| !s.ended()) {
            // Counted under the map's lock: the keeper ends only a session nobody uses.
            return Ok(SessionUse::new(session.clone()));
        }
        let client = self.client().await?;
        let grant = client.lease_grant(seconds).await.map_err(map_err)?;
        if !grant.error.is_empty() {
            return Err(Error::Backend(format!("etcd lease grant: {}", grant.error)));
        }
        let granted = Duration::from_secs(u64::try_from(grant.ttl).unwrap_or(0));
        if granted < ttl {
            let _ = client.lease_revoke(grant.id).await;
            return Err(Error::Backend(format!(
                "etcd granted a {granted:?} lease where {ttl:?} was asked"
            )));
        }
        let id = grant.id;
        let session = Arc::new(Session {
            id,
            granted,
            keep_alives: Batches::gathered(Gather::WhileBusy, usize::MAX, move |batch| {
                let client = client.clone();
                async move {
                    let alive = client.lease_keep_alive(id).await;
                    answer_all(batch, alive.map(|ttl| ttl.is_some()).map_err(map_err));
                }
            }),
            ended: AtomicBool::new(false),
            users: AtomicUsize::new(0),
            keeper: Mutex::new(None),
        });
        let keeper = tokio::spawn(keep(Arc::downgrade(self), Arc::downgrade(&session)));
        *session.keeper.lock().unwrap_or_else(|e| e.into_inner()) = Some(keeper);
        sessions.insert(seconds, session.clone());
        Ok(SessionUse::new(session))
    }

    /// Delete `key` if it is still the one put at `revision` (whatever it is, without one: a key
    /// name is never put twice).
    async fn delete_key(&self, key: &str, revision: Option<i64>) -> Result<()> {
        let client = self.client().await?;
        let delete = TxnRequest {
            compare: revision
                .map(|revision| Compare::created_at(key, revision))
                .into_iter()
                .collect(),
            success: vec![
                DeleteRangeRequest {
                    key: key.as_bytes().to_vec(),
                    range_end: Vec::new(),
                    prev_kv: false,
                }
                .into(),
            ],
            failure: Vec::new(),
        };
        client.txn(delete).await.map_err(map_err)?;
        Ok(())
    }

    /// Give the key up. Should etcd not answer, the delete is tried again at the keeper's next
    /// round (or the key goes with the session's lease). The key is recorded as an orphan
    /// before the delete and taken back after it, so that a delete whose caller stops waiting
    /// (a time limit drops this future) is tried again too, rather than leaving the key in the
    /// queue for nobody while the session lives.
    async fn leave(&self, entry: &Entry) {
        self.forget(entry);
        self.orphaned(&entry.key, Some(entry.token), &entry.session.0, None);
        match self.delete_key(&entry.key, Some(entry.token)).await {
            Ok(()) => self.adopted(&entry.key, entry.token),
            Err(e) => {
                tracing::debug!(error = %e, key = %entry.key, "etcd delete failed; tried again")
            }
        }
    }

    /// `key` put at `revision` is deleted: no longer an orphan.
    fn adopted(&self, key: &str, revision: i64) {
        self.orphans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|o| !(o.key == key && o.revision == Some(revision)));
    }

    fn orphaned(
        &self,
        key: &str,
        revision: Option<i64>,
        session: &Arc<Session>,
        may_land_until: Option<Instant>,
    ) {
        let mut orphans = self.orphans.lock().unwrap_or_else(|e| e.into_inner());
        orphans.push(Orphan {
            key: key.to_owned(),
            revision,
            session: Arc::downgrade(session),
            may_land_until,
        });
    }

    /// Try the failed deletes again; those of an ended session are gone with it. A put whose
    /// answer never came is deleted again until it can no longer land.
    async fn delete_orphans(&self) {
        let orphans = std::mem::take(&mut *self.orphans.lock().unwrap_or_else(|e| e.into_inner()));
        for orphan in orphans {
            if orphan.session.upgrade().is_none_or(|s| s.ended()) {
                continue;
            }
            let deleted = self.delete_key(&orphan.key, orphan.revision).await.is_ok();
            let may_land = orphan.may_land_until.is_some_and(|t| t > Instant::now());
            if !deleted || may_land {
                self.orphans
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(orphan);
            }
        }
    }

    fn forget(&self, entry: &Entry) {
        self.lines.places.forget(entry);
    }

    /// A key name for a new place in `lock`'s queue under the session `session`, never put
    /// before: the session's id (so a key tells whose session it is bound to) and a number.
    fn new_place_key(&self, lock: &str, session: i64) -> String {
        let number = self.keys_put.fetch_add(1, Ordering::Relaxed);
        format!("{}{session:016x}-{number:x}", self.queue_prefix(lock))
    }

    /// Queue a new key for `lock` under a new etcd lease, and learn where it stands from the
    /// same transaction that puts it: the put and the reads are one round trip.
    async fn enqueue(
        self: &Arc<Self>,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<(Arc<Entry>, Position)> {
        let client = self.client().await?;
        let session = self.session(ttl).await?;
        let queue = self.queue_prefix(lock);
        let key = self.new_place_key(lock, session.id);
        // Reads after a put in one transaction see the put: the newest two keys by create
        // revision are this one and the one just below it, since nothing can be created
        // after this put within its revision.
        let mut newest_two = RangeRequest::prefix(&queue).first_by_create(SORT_DESCEND);
        newest_two.limit = 2;
        let txn = TxnRequest {
            success: vec![
                PutRequest {
                    key: key.clone().into_bytes(),
                    value: identity.as_bytes().to_vec(),
                    lease: session.id,
                }
                .into(),
                RangeRequest::key(&key).into(),
                newest_two.into(),
                lowest(&queue).into(),
            ],
            ..TxnRequest::default()
        };
        let read = async {
            let reply = client.txn(txn).await.map_err(|e| {
                if lease_gone(&e) {
                    // Revoked or run out since it was looked up: the next attempt grants anew.
                    session.ended.store(true, Ordering::SeqCst);
                }
                map_err(e)
            })?;
            let read_at = reply.header.as_ref().map_or(0, |h| h.revision);
            let mut gets = reply.ranges().into_iter();
            let (Some(own), Some(newest), Some(lowest)) = (gets.next(), gets.next(), gets.next())
            else {
                return Err(Error::Backend("etcd txn answered without its reads".into()));
            };
            let Some(revision) = own.kvs.first().map(|kv| kv.create_revision) else {
                return Err(Error::Backend("etcd txn did not read back its put".into()));
            };
            let position = Position {
                queued: true,
                predecessor: newest
                    .kvs
                    .into_iter()
                    .find(|kv| kv.create_revision < revision)
                    .map(|kv| kv.key),
                holder: lowest.kvs.into_iter().next(),
                revision: read_at,
            };
            Ok((revision, position))
        };
        let (revision, position) = match read.await {
            Ok(read) => read,
            Err(e) => {
                // The put may have landed with its answer lost (or unread), or may land later
                // still: a key nobody tends would stand in the queue, first in line for nobody,
                // for as long as the session lives. Its name is new, so whatever holds that name
                // is this put: it is deleted now and again at the keeper's rounds until the put
                // can no longer land.
                let _ = self.delete_key(&key, None).await;
                let until = Instant::now() + LATE_PUT_WINDOW;
                self.orphaned(&key, None, &session.0, Some(until));
                return Err(e);
            }
        };
        let slot = QueueSlot::new();
        let entry = Arc::new(Entry {
            lock: lock.to_owned(),
            identity: identity.to_owned(),
            token: revision,
            slot,
            own: Key { key, session },
        });
        let task = tokio::spawn(super::tend(
            self.clone(),
            entry.clone(),
            entry.session.granted * super::ABANDONED_AFTER_LEASES,
        ));
        entry.slot.set_tender(task);
        match self.lines.places.joined(entry.clone(), |_| false) {
            Joined::Put { place, .. } => Ok((place, position)),
            // The wait was given up while the key was put: it leaves the queue at once rather
            // than stand in it, unasked, for four leases.
            Joined::Abandoned(surplus) | Joined::Kept { surplus, .. } => {
                surplus.slot.abort_tasks();
                self.leave(&surplus).await;
                self.lines.releases.bump(lock);
                let position = Position {
                    queued: false,
                    ..position
                };
                Ok((surplus, position))
            }
        }
    }

    /// Where `entry` stands: whether its key still exists, the key just below it, the lowest
    /// key, all read at one revision.
    async fn position(&self, entry: &Entry) -> Result<Position> {
        let client = self.client().await?;
        let queue = self.queue_prefix(&entry.lock);
        let below = RangeRequest {
            max_create_revision: entry.token - 1,
            ..RangeRequest::prefix(&queue)
        };
        let txn = TxnRequest {
            success: vec![
                RangeRequest::key(&entry.key).into(),
                below.first_by_create(SORT_DESCEND).into(),
                lowest(&queue).into(),
            ],
            ..TxnRequest::default()
        };
        let reply = client.txn(txn).await.map_err(map_err)?;
        let revision = reply.header.as_ref().map_or(0, |h| h.revision);
        let mut gets = reply.ranges().into_iter();
        let (Some(own), Some(below), Some(lowest)) = (gets.next(), gets.next(), gets.next()) else {
            return Err(Error::Backend("etcd txn answered without its reads".into()));
        };
        // The key must be the one this entry put, not one of the same name put since.
        let queued = own
            .kvs
            .first()
            .is_some_and(|kv| kv.create_revision == entry.token);
        Ok(Position {
            queued,
            predecessor: below.kvs.into_iter().next().map(|kv| kv.key),
            holder: lowest.kvs.into_iter().next(),
            revision,
        })
    }

    /// Wake this process's waiters of `entry.lock` when `predecessor` goes away.
    async fn watch_predecessor(
        self: &Arc<Self>,
        entry: &Arc<Entry>,
        predecessor: Vec<u8>,
        from: i64,
    ) -> Result<()> {
        let name = String::from_utf8_lossy(&predecessor).into_owned();
        let shared = self.clone();
        let lock = entry.lock.clone();
        entry.slot.watch(name, move |fired| {
            tokio::spawn(async move {
                let watched = async {
                    let client = shared.client().await?;
                    let mut stream = client.watch(predecessor, from + 1).await.map_err(map_err)?;
                    while let Some(reply) = stream
                        .message()
                        .await
                        .map_err(|status| map_err(status.into()))?
                    {
                        if reply.events.iter().any(|e| e.r#type == EVENT_DELETE) {
                            break;
                        }
                        if reply.canceled {
                            // Compacted past `from`, or refused: look again rather than wait.
                            tracing::debug!(reason = %reply.cancel_reason, "etcd watch canceled");
                            break;
                        }
                    }
                    Ok::<_, Error>(())
                };
                // Deleted, or the watch broke: either way the waiter must look again.
                if let Err(e) = watched.await {
                    tracing::debug!(error = %e, "etcd watch ended");
                }
                fired.fire();
                shared.lines.wakeups.fetch_add(1, Ordering::Relaxed);
                shared.lines.releases.bump(&lock);
            })
        });
        Ok(())
    }

    async fn holder(&self, lock: &str) -> Result<Option<Holding>> {
        self.first_in_line(lock, false).await
    }

    /// Delete `first`, the lowest key of `lock`'s queue, when it is bound to one of this
    /// process's sessions but is no place this process knows (under the lock's attempt turn,
    /// every place being put is known by then): a put answered too late to be
    /// waited for (a stalled link), landing after the delete that gave it up. Its session
    /// lives on for the process's other keys, so it would hold the lock for nobody, and every
    /// other pod would wait, for as long as the process runs. True when it was.
    async fn deleted_if_unknown_own(&self, lock: &str, first: &KeyValue) -> Result<bool> {
        let own = self
            .sessions
            .lock()
            .await
            .values()
            .any(|session| session.id == first.lease);
        if !own {
            return Ok(false);
        }
        let known = self
            .lines
            .places
            .get(lock)
            .is_some_and(|entry| entry.key.as_bytes() == first.key.as_slice());
        if known {
            return Ok(false);
        }
        let key = String::from_utf8_lossy(&first.key).into_owned();
        tracing::debug!(
            lock,
            key,
            "a key of this process's session that the driver does not know, first in line; deleting it"
        );
        self.delete_key(&key, Some(first.create_revision)).await?;
        Ok(true)
    }

    /// Who holds, from the lowest key. `with_expiry` costs one more round trip, for the lease's
    /// remaining time: an upper bound, since etcd reports whole seconds rounded down.
    async fn holding(&self, kv: &KeyValue, with_expiry: bool) -> Result<Holding> {
        let expires_in = if with_expiry {
            let client = self.client().await?;
            let ttl = client.lease_time_to_live(kv.lease).await.map_err(map_err)?;
            (ttl.ttl >= 0)
                .then(|| Duration::from_secs((ttl.ttl + 1).min(ttl.granted_ttl).unsigned_abs()))
        } else {
            None
        };
        Ok(Holding {
            identity: String::from_utf8_lossy(&kv.value).into_owned(),
            token: u64::try_from(kv.create_revision).unwrap_or(0),
            expires_in,
        })
    }
}

struct Position {
    queued: bool,
    predecessor: Option<Vec<u8>>,
    /// The lowest key: the holder.
    holder: Option<KeyValue>,
    revision: i64,
}

/// The lowest key of a queue.
fn lowest(queue: &str) -> RangeRequest {
    RangeRequest::prefix(queue).first_by_create(SORT_ASCEND)
}

/// Keep a session's lease alive while the session is used, try failed deletes again, and end
/// (revoke) a session nobody has used for [`IDLE_ROUNDS`].
async fn keep(shared: std::sync::Weak<Shared>, session: std::sync::Weak<Session>) {
    let mut idle = 0;
    loop {
        let Some(period) = session.upgrade().map(|s| s.granted / KEEP_ALIVES_PER_TTL) else {
            return;
        };
        tokio::time::sleep(period).await;
        let (Some(shared), Some(session)) = (shared.upgrade(), session.upgrade()) else {
            return;
        };
        idle = if session.users.load(Ordering::SeqCst) == 0 {
            idle + 1
        } else {
            0
        };
        if idle >= IDLE_ROUNDS {
            let mut sessions = shared.sessions.lock().await;
            if session.users.load(Ordering::SeqCst) == 0 {
                sessions.retain(|_, s| !Arc::ptr_eq(s, &session));
                drop(sessions);
                session.ended.store(true, Ordering::SeqCst);
                if let Ok(client) = shared.client().await {
                    let _ = client.lease_revoke(session.id).await;
                }
                return;
            }
        }
        if !session.ended()
            && let Err(e) = Box::pin(session.keep_alive()).await
        {
            tracing::debug!(error = %e, "etcd keep-alive failed");
        }
        if session.ended() {
            // Gone (run out while this process was cut off or paused): the next acquisition
            // grants a new one, and the keys bound to this one went with it.
            let mut sessions = shared.sessions.lock().await;
            sessions.retain(|_, s| !Arc::ptr_eq(s, &session));
            return;
        }
        Box::pin(shared.delete_orphans()).await;
    }
}

impl EtcdDriver {
    /// For tests: a key in `lock`'s queue under this driver's own session that the driver does
    /// not know of, as a put answered too late to be waited for leaves one. Returns its name.
    #[cfg(feature = "test-hooks")]
    pub async fn place_unknown_to_the_driver(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<String> {
        let client = self.shared.client().await?;
        let session = self.shared.session(ttl).await?;
        let key = self.shared.new_place_key(lock, session.id);
        client
            .put(PutRequest {
                key: key.clone().into_bytes(),
                value: identity.as_bytes().to_vec(),
                lease: session.id,
            })
            .await
            .map_err(map_err)?;
        Ok(key)
    }

    /// Connects on first use, so an unreachable etcd shows in readiness, not as a crash.
    pub fn connect(config: EtcdConfig) -> Result<Self> {
        if config.endpoints.is_empty() {
            return Err(Error::InvalidConfig {
                field: "backend",
                reason: "no etcd endpoint".into(),
            });
        }
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                client: OnceCell::new(),
                lines: Lines::default(),
                sessions: tokio::sync::Mutex::new(HashMap::new()),
                orphans: Mutex::new(Vec::new()),
                keys_put: AtomicU64::new(0),
            }),
            checks: Batches::new(MAX_CHECK_BATCH, check_keys),
        })
    }

    /// How many times a watched predecessor went away (or its watch broke) and woke a waiter.
    pub fn wakeups(&self) -> u64 {
        self.shared.lines.wakeups.load(Ordering::Relaxed)
    }

    fn entry(&self, lock: &str) -> Option<Arc<Entry>> {
        self.shared.lines.places.get(lock)
    }

    fn held(&self, lease: &Lease) -> Option<Arc<Entry>> {
        self.shared.lines.places.holding(lease)
    }

    /// A key put in `lock`'s queue for `identity` (after `leaving`, its old one, is left), its
    /// position read with the put, on a task of its own (see [`super::join_line`]): if this
    /// call is dropped midway, the key it may already have put is still recorded and tended.
    async fn join_line(
        &self,
        turn: AttemptTurn,
        lock: &str,
        identity: &str,
        ttl: Duration,
        leaving: Option<Arc<Entry>>,
    ) -> Result<((Arc<Entry>, Position), AttemptTurn)> {
        let (shared, owned_lock, owned_identity) =
            (self.shared.clone(), lock.to_owned(), identity.to_owned());
        let put = async move {
            if let Some(old) = leaving {
                shared.leave(&old).await;
            }
            shared.enqueue(&owned_lock, &owned_identity, ttl).await
        };
        super::join_line(&self.shared, turn, lock, identity, put).await
    }
}

#[async_trait]
impl Driver for EtcdDriver {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        let mut turn = self.shared.lines.attempts.turn(lock).await;
        let sent = Instant::now();
        // A key queued by this call has its position read with the put.
        let (entry, position) = match self.entry(lock) {
            Some(entry) if entry.slot.holding() || entry.identity != identity => {
                // Not re-entrant, and one identity per lock and process.
                return Ok(Acquire::Busy(self.shared.holder(lock).await?));
            }
            Some(entry) if entry.session.granted >= ttl && !entry.session.ended() => {
                entry.slot.ask(sent);
                // Further back than next in line, with the watch standing: see `queue::slot`.
                if let Some(holder) = entry.slot.quiet_wait(sent, ttl) {
                    return Ok(Acquire::Busy(holder));
                }
                let position = self.shared.position(&entry).await?;
                (entry, position)
            }
            // None, or a key of an ended session or a shorter grant: that one is left on the
            // task that puts the new one, so that a wait abandoned in between marks the new one.
            stale => {
                let (joined, returned) = self.join_line(turn, lock, identity, ttl, stale).await?;
                turn = returned;
                joined
            }
        };
        let _turn = turn;
        if !position.queued {
            // The key expired (keep-alives failed): back to the end of the queue next time.
            self.shared.forget(&entry);
            entry.slot.abort_tasks();
            return Ok(Acquire::Busy(self.shared.holder(lock).await?));
        }
        if let Some(predecessor) = position.predecessor {
            if let Some(first) = &position.holder
                && self.shared.deleted_if_unknown_own(lock, first).await?
            {
                return Ok(Acquire::Busy(None));
            }
            // Only the next in line may act on the holder's expiry; the others wait for their
            // watch, and cost one read per poll.
            let next_in_line = position
                .holder
                .as_ref()
                .is_some_and(|h| h.key == predecessor);
            self.shared
                .watch_predecessor(&entry, predecessor, position.revision)
                .await?;
            let holder = match &position.holder {
                Some(kv) => Some(self.shared.holding(kv, next_in_line).await?),
                None => None,
            };
            entry.slot.saw(sent, next_in_line, holder.clone());
            return Ok(Acquire::Busy(holder));
        }
        // Lowest: ours. A keep-alive sent after `sent` before claiming from `sent`: it refreshes
        // the lease of a key that waited (its last keep-alive may be older than the claim), and
        // for every key it shows the lease still there, read after the position was. A key
        // queued by this very call needs it too: its position may be stale by now (an answer
        // followed up late) and its lease revoked meanwhile (the waiter hung up and the key
        // was abandoned); claiming on that stale position let a second holder in for 6 ms in
        // the suite's etcd waiter check.
        if !entry.session.keep_alive().await? {
            self.shared.forget(&entry);
            entry.slot.abort_tasks();
            return Ok(Acquire::Busy(self.shared.holder(lock).await?));
        }
        if !entry.slot.hold_until(sent + ttl) {
            // Abandoned while this attempt ran (the engine gave up on it): its key is gone.
            return Ok(Acquire::Busy(self.shared.holder(lock).await?));
        }
        Ok(Acquire::Acquired(entry.lease()))
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let sent = Instant::now();
        let Some(entry) = self.held(lease) else {
            return Ok(false);
        };
        if entry.slot.expired_by(sent) || ttl > entry.session.granted {
            return Ok(false);
        }
        // Both sent after `sent`: the lease restarted at the server, and the key is still ours.
        let check = KeyCheck {
            client: self.shared.client().await?,
            key: entry.key.clone(),
            revision: entry.token,
            session: entry.session.0.clone(),
        };
        let checked = self.checks.call(check).await??;
        if !checked.alive || !checked.queued {
            // The key may have been deleted, or its lease have run out: either way it is not
            // ours any more, and whatever of it is left goes.
            self.shared.leave(&entry).await;
            entry.slot.abort_tasks();
            return Ok(false);
        }
        // Read after the local lease ran out (a stalled task): the place is given up, not kept.
        Ok(entry.slot.extend(sent + ttl))
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let Some(entry) = self.held(lease) else {
            return Ok(false);
        };
        self.shared.forget(&entry);
        entry.slot.abort_tasks();
        // Recorded before the delete, as `leave` does: should etcd not answer, or the caller
        // stop waiting (a time limit drops this future), the key goes at the keeper's next
        // round rather than stand first in the queue for as long as the session lives.
        self.shared
            .orphaned(&entry.key, Some(entry.token), &entry.session.0, None);
        self.shared
            .delete_key(&entry.key, Some(entry.token))
            .await?;
        self.shared.adopted(&entry.key, entry.token);
        self.shared.lines.releases.bump(&lease.lock);
        Ok(true)
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        super::observe(&*self.shared, lock).await
    }

    /// The TTL etcd granted (whole seconds, at least its minimum): a dead holder's key lives
    /// that long.
    fn enforced_lease(&self, lock: &str) -> Option<Duration> {
        self.entry(lock).map(|e| e.session.granted)
    }

    async fn abandon(&self, lock: &str, identity: &str) {
        super::abandon(&*self.shared, lock, identity).await;
    }

    // With a keep-alive every half TTL, an idle waiter costs etcd about one message per renew
    // interval at the default lease (its poll: three renew intervals).
    super::fair_queue_hints!();

    async fn ping(&self) -> Result<()> {
        let client = self.shared.client().await?;
        client.status().await.map_err(map_err)?;
        Ok(())
    }
}

#[async_trait]
impl Upkeep for EtcdDriver {
    /// As [`Upkeep::deprovision`], in one transaction on this holding's key: should it be gone
    /// (its session's lease ran out, another first in the queue now), nothing is deleted.
    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        let Some(entry) = self.held(lease) else {
            return crate::driver::deleted_as_released(lease, false);
        };
        self.shared.forget(&entry);
        entry.slot.abort_tasks();
        // Recorded first, as a release does: should the deletion not land, the key goes at the
        // keeper's next round rather than stand first in the queue for nobody.
        self.shared
            .orphaned(&entry.key, Some(entry.token), &entry.session.0, None);
        let client = self.shared.client().await?;
        let range = RangeRequest::prefix(&self.shared.queue_prefix(&lease.lock));
        let deletion = TxnRequest {
            compare: vec![Compare::created_at(&entry.key, entry.token)],
            success: vec![
                DeleteRangeRequest {
                    key: range.key,
                    range_end: range.range_end,
                    prev_kv: false,
                }
                .into(),
            ],
            failure: Vec::new(),
        };
        let done = client.txn(deletion).await.map_err(map_err)?;
        if done.succeeded {
            self.shared.adopted(&entry.key, entry.token);
        }
        crate::driver::deleted_as_released(lease, done.succeeded)
    }

    /// The lock's whole queue: every contender's key goes. Their etcd leases stay, since each is
    /// a whole process's (its other locks' keys are bound to it): a holder learns at its next
    /// renewal, which reads its key back.
    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        let client = self.shared.client().await?;
        for lock in locks {
            let queue = self.shared.queue_prefix(lock);
            let range = RangeRequest::prefix(&queue);
            client
                .delete_range(DeleteRangeRequest {
                    key: range.key,
                    range_end: range.range_end,
                    prev_kv: false,
                })
                .await
                .map_err(map_err)?;
        }
        Ok(())
    }

    /// A key whose queue has an entry has a holder: its lowest (a released key's entries go).
    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        let client = self.shared.client().await?;
        let root = format!("{}/", self.shared.config.prefix);
        let reply = client
            .range(RangeRequest {
                keys_only: true,
                ..RangeRequest::prefix(&format!("{root}{family}.key"))
            })
            .await
            .map_err(map_err)?;
        let held: std::collections::HashSet<&str> = reply
            .kvs
            .iter()
            .filter_map(|kv| std::str::from_utf8(&kv.key).ok())
            .filter_map(|key| key.strip_prefix(&root)?.split('/').next())
            .filter(|lock| crate::names::family_of(lock) == Some(family))
            .collect();
        Ok(Some(held.len() as u64))
    }
}
