//! etcd: a fair queue, as etcd's own `concurrency.Mutex`. Each contender puts a key
//! `PREFIX/LOCK/LEASE_ID` bound to an etcd lease; the key with the lowest create revision holds,
//! and every waiter watches only the key just below its own, so a release wakes exactly one
//! waiter. The token is the holder's create revision: later keys always get larger revisions.
//!
//! The holder's claim is bounded like every other driver's: `t_sent + ttl - margin`, where the
//! etcd lease's TTL (whole seconds, rounded up, never below etcd's minimum) is at least `ttl` and
//! restarts at the server when a keep-alive sent after `t_sent` arrives. So the key outlives the
//! claim. Three things keep the queue moving:
//!
//! - while waiting, a task sends keep-alives (every half TTL) so the place in the queue is kept;
//!   a waiter that stops asking (its app gave up) leaves the queue after three TTLs;
//! - while holding, only the engine's renewals keep the lease alive, so a holder whose renewals
//!   stall is dropped by etcd; and when its own lease runs out locally, the driver revokes the
//!   etcd lease at once instead of leaving the others to wait for the server's whole seconds;
//! - becoming the holder costs one keep-alive sent after `t_sent`, since the waiting task's last
//!   keep-alive may be older than the claim about to start, and the lease may have been revoked
//!   since the position was read.
//!
//! A free lock costs three round trips to take (the lease grant, one transaction that puts the
//! key and reads the queue around it, the keep-alive) and one to release (the revoke).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{OnceCell, watch};
use tokio::time::Instant;

use crate::driver::{Acquire, ChangeFeeds, Driver, Holding, Lease};
use crate::drivers::batches::{Batch, Batches, answer_all};
use crate::drivers::etcd_rpc::{
    Connect, DeleteRangeRequest, EVENT_DELETE, EtcdClient, KeyValue, PutRequest, RangeRequest,
    RpcError, SORT_ASCEND, SORT_DESCEND, TlsPem, TxnRequest,
};
use crate::drivers::queue_slot::{Attempts, Expiry, QueueSlot};
use crate::error::{Error, Result};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// A waiting key whose engine has not asked for this many TTLs is given up: its app stopped
/// waiting. Engines ask at least once per poll interval (about one lease).
const ABANDONED_AFTER_TTLS: u32 = 3;

/// Where to find etcd and how to log in.
#[derive(Clone)]
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

/// This process's key in one lock's queue.
struct Entry {
    lock: String,
    identity: String,
    key: String,
    etcd_lease: i64,
    granted: Duration,
    revision: i64,
    slot: QueueSlot,
}

struct Shared {
    config: EtcdConfig,
    client: OnceCell<EtcdClient>,
    entries: Mutex<HashMap<String, Arc<Entry>>>,
    /// One acquisition of a lock at a time ([`Attempts`]).
    attempts: Attempts,
    releases: ChangeFeeds,
    wakeups: AtomicU64,
}

pub struct EtcdDriver {
    shared: Arc<Shared>,
    /// Renewals' checks that arrive together are read together ([`check_keys`]).
    checks: Batches<KeyCheck, Result<bool>>,
}

/// A renewal's check that its key is still the one it put: a key deleted behind the driver's
/// back (`etcdctl del --prefix`, a lock's clean-up) lets the next contender in while the etcd
/// lease lives on, so a live lease alone proves nothing.
struct KeyCheck {
    client: EtcdClient,
    key: String,
    revision: i64,
}

/// The most keys one batch of checks reads: etcd refuses a transaction of more operations than
/// its `--max-txn-ops` (128 by default).
const MAX_CHECK_BATCH: usize = 128;

/// The checks of a batch in one transaction that reads every key, where each renewal sent a
/// transaction of its own. A key is still queued when it is there with the create revision it
/// was put with (a key put again has another). Each read is sent after its renewal began, as
/// its own transaction was.
async fn check_keys(batch: Batch<KeyCheck, Result<bool>>) {
    let client = batch[0].request.client.clone();
    let request = TxnRequest {
        success: batch
            .iter()
            .map(|pending| RangeRequest::key(&pending.request.key).into())
            .collect(),
        ..TxnRequest::default()
    };
    let ranges = match client.txn(request).await {
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
        let _ = pending.reply.send(Ok(queued));
    }
}

impl Drop for EtcdDriver {
    fn drop(&mut self) {
        let entries = self
            .shared
            .entries
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for entry in entries.values() {
            entry.slot.abort_tasks();
        }
    }
}

fn map_err(e: RpcError) -> Error {
    match e {
        // The causes say what went wrong: a refused connection, an unknown certificate issuer.
        RpcError::Unreachable(text) => Error::Unreachable(text),
        RpcError::Status(_) => Error::Backend(e.to_string()),
    }
}

/// etcd leases count whole seconds: round up, so the key never expires before the claim does.
fn ttl_seconds(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
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

    /// One keep-alive round trip: whether the lease is still there.
    async fn keep_alive(&self, etcd_lease: i64) -> Result<bool> {
        let client = self.client().await?;
        Ok(client
            .lease_keep_alive(etcd_lease)
            .await
            .map_err(map_err)?
            .is_some())
    }

    /// Give the key up (best effort: if etcd is unreachable, its TTL does it).
    async fn leave(&self, entry: &Entry) {
        self.forget(entry);
        if let Ok(client) = self.client().await {
            let _ = client.lease_revoke(entry.etcd_lease).await;
        }
    }

    fn forget(&self, entry: &Entry) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries
            .get(&entry.lock)
            .is_some_and(|e| e.revision == entry.revision)
        {
            entries.remove(&entry.lock);
        }
        drop(entries);
        entry.slot.mark_left();
        entry.slot.stop_watching();
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
        let grant = client
            .lease_grant(ttl_seconds(ttl))
            .await
            .map_err(map_err)?;
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
        let queue = self.queue_prefix(lock);
        let key = format!("{queue}{:016x}", grant.id);
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
                    lease: grant.id,
                }
                .into(),
                RangeRequest::key(&key).into(),
                newest_two.into(),
                lowest(&queue).into(),
            ],
            ..TxnRequest::default()
        };
        let read = async {
            let reply = client.txn(txn).await.map_err(map_err)?;
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
                // The put may have landed with its answer lost (or unread): a key nobody tends
                // would stand in the queue until its TTL ran out.
                let _ = client.lease_revoke(grant.id).await;
                return Err(e);
            }
        };
        let slot = QueueSlot::new();
        let entry = Arc::new(Entry {
            lock: lock.to_owned(),
            identity: identity.to_owned(),
            key,
            etcd_lease: grant.id,
            granted,
            revision,
            slot,
        });
        let task = tokio::spawn(tend(self.clone(), entry.clone()));
        entry.slot.set_tender(task);
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(lock.to_owned(), entry.clone());
        Ok((entry, position))
    }

    /// Where `entry` stands: whether its key still exists, the key just below it, the lowest
    /// key, all read at one revision.
    async fn position(&self, entry: &Entry) -> Result<Position> {
        let client = self.client().await?;
        let queue = self.queue_prefix(&entry.lock);
        let below = RangeRequest {
            max_create_revision: entry.revision - 1,
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
            .is_some_and(|kv| kv.create_revision == entry.revision);
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
                shared.wakeups.fetch_add(1, Ordering::Relaxed);
                shared.releases.bump(&lock);
            })
        });
        Ok(())
    }

    async fn holder(&self, lock: &str) -> Result<Option<Holding>> {
        let client = self.client().await?;
        let reply = client
            .range(lowest(&self.queue_prefix(lock)))
            .await
            .map_err(map_err)?;
        match reply.kvs.first() {
            Some(kv) => Ok(Some(self.holding(kv, true).await?)),
            None => Ok(None),
        }
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

/// Keep a waiting key alive while its engine keeps asking; end a held one when its local lease
/// runs out.
///
/// Every held or waiting key keeps one of these tasks, so its size counts per key: the calls to
/// etcd are boxed, since a gRPC call's future would otherwise make each task several KB.
async fn tend(shared: Arc<Shared>, entry: Arc<Entry>) {
    loop {
        if entry.slot.left() {
            return;
        }
        match entry.slot.asked() {
            Some(asked) if asked.elapsed() > entry.granted * ABANDONED_AFTER_TTLS => {
                // Nobody asks any more (an on-demand wait that timed out): leave the queue
                // rather than hold everyone behind a key no one will use. Unless an
                // acquisition claimed the place meanwhile: then guard it.
                if entry.slot.leave_if_waiting() {
                    Box::pin(shared.leave(&entry)).await;
                    shared.releases.bump(&entry.lock);
                    return;
                }
            }
            Some(_) => {
                // An acquisition sets the expiry: stop waiting and start guarding it at once.
                tokio::select! {
                    () = tokio::time::sleep(entry.granted / 2) => {}
                    () = entry.slot.expiry_moved() => continue,
                }
                if !entry.slot.holding() {
                    match Box::pin(shared.keep_alive(entry.etcd_lease)).await {
                        Ok(false) => {
                            shared.forget(&entry);
                            return;
                        }
                        Ok(true) => {}
                        Err(e) => tracing::debug!(error = %e, "etcd keep-alive failed"),
                    }
                }
            }
            None => match entry.slot.wait_expiry().await {
                Expiry::Passed => {
                    Box::pin(shared.leave(&entry)).await;
                    shared.releases.bump(&entry.lock);
                    return;
                }
                Expiry::Moved => {}
            },
        }
    }
}

impl EtcdDriver {
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
                entries: Mutex::new(HashMap::new()),
                attempts: Attempts::default(),
                releases: ChangeFeeds::default(),
                wakeups: AtomicU64::new(0),
            }),
            checks: Batches::new(MAX_CHECK_BATCH, check_keys),
        })
    }

    /// How many times a watched predecessor went away (or its watch broke) and woke a waiter.
    pub fn wakeups(&self) -> u64 {
        self.shared.wakeups.load(Ordering::Relaxed)
    }

    fn entry(&self, lock: &str) -> Option<Arc<Entry>> {
        let entries = self
            .shared
            .entries
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        entries.get(lock).cloned()
    }

    fn held(&self, lease: &Lease) -> Option<Arc<Entry>> {
        self.entry(&lease.lock).filter(|e| {
            e.slot.holding()
                && e.identity == lease.identity
                && u64::try_from(e.revision).ok() == Some(lease.token)
        })
    }
}

#[async_trait]
impl Driver for EtcdDriver {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    /// The lock's whole queue: every contender's key goes, and so does the etcd lease each key
    /// was bound to, so that a holder's next keep-alive fails even if it missed the delete.
    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        let client = self.shared.client().await?;
        for lock in locks {
            let queue = self.shared.queue_prefix(lock);
            let range = RangeRequest::prefix(&queue);
            let deleted = client
                .delete_range(DeleteRangeRequest {
                    key: range.key,
                    range_end: range.range_end,
                    prev_kv: true,
                })
                .await
                .map_err(map_err)?;
            for kv in deleted.prev_kvs.iter().filter(|kv| kv.lease != 0) {
                match client.lease_revoke(kv.lease).await {
                    Ok(()) => {}
                    // Revoked or expired meanwhile: the key's claim is gone either way.
                    Err(RpcError::Status(status)) if status.code() == tonic::Code::NotFound => {}
                    Err(e) => return Err(map_err(e)),
                }
            }
        }
        Ok(())
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        let _turn = self.shared.attempts.turn(lock).await;
        let sent = Instant::now();
        // A key queued by this call has its position read with the put.
        let (entry, position) = match self.entry(lock) {
            Some(entry) if entry.slot.holding() || entry.identity != identity => {
                // Not re-entrant, and one identity per lock and process.
                return Ok(Acquire::Busy(self.shared.holder(lock).await?));
            }
            Some(entry) if entry.granted >= ttl => {
                entry.slot.ask(sent);
                // Further back than next in line, with the watch standing: see `queue_slot`.
                if let Some(holder) = entry.slot.quiet_wait(sent, ttl) {
                    return Ok(Acquire::Busy(holder));
                }
                let position = self.shared.position(&entry).await?;
                (entry, position)
            }
            Some(entry) => {
                self.shared.leave(&entry).await;
                self.shared.enqueue(lock, identity, ttl).await?
            }
            None => {
                // A task of its own: if this call is abandoned midway (the engine's time budget),
                // the key it may already have put is still recorded and tended.
                let (shared, lock, identity) =
                    (self.shared.clone(), lock.to_owned(), identity.to_owned());
                tokio::spawn(async move { shared.enqueue(&lock, &identity, ttl).await })
                    .await
                    .map_err(|e| Error::Backend(format!("enqueue task failed: {e}")))??
            }
        };
        if !position.queued {
            // The key expired (keep-alives failed): back to the end of the queue next time.
            self.shared.forget(&entry);
            entry.slot.abort_tasks();
            return Ok(Acquire::Busy(self.shared.holder(lock).await?));
        }
        if let Some(predecessor) = position.predecessor {
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
        if !self.shared.keep_alive(entry.etcd_lease).await? {
            self.shared.forget(&entry);
            entry.slot.abort_tasks();
            return Ok(Acquire::Busy(self.shared.holder(lock).await?));
        }
        if !entry.slot.hold_until(sent + ttl) {
            // Abandoned while this attempt ran (the engine gave up on it): its key is gone.
            return Ok(Acquire::Busy(self.shared.holder(lock).await?));
        }
        Ok(Acquire::Acquired(Lease {
            lock: lock.to_owned(),
            identity: identity.to_owned(),
            token: u64::try_from(entry.revision).unwrap_or(0),
        }))
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let sent = Instant::now();
        let Some(entry) = self.held(lease) else {
            return Ok(false);
        };
        if entry.slot.expired_by(sent) || ttl > entry.granted {
            return Ok(false);
        }
        // Both sent after `sent`: the lease restarted at the server, and the key is still ours.
        let check = KeyCheck {
            client: self.shared.client().await?,
            key: entry.key.clone(),
            revision: entry.revision,
        };
        let (alive, queued) = tokio::join!(
            self.shared.keep_alive(entry.etcd_lease),
            self.checks.call(check)
        );
        if !alive? || !queued?? {
            // The key may have been deleted while its lease lived: end the lease too, so that
            // nothing of this claim remains.
            self.shared.leave(&entry).await;
            entry.slot.abort_tasks();
            return Ok(false);
        }
        entry.slot.extend(sent + ttl);
        Ok(true)
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let Some(entry) = self.held(lease) else {
            return Ok(false);
        };
        self.shared.forget(&entry);
        entry.slot.abort_tasks();
        let client = self.shared.client().await?;
        client
            .lease_revoke(entry.etcd_lease)
            .await
            .map_err(map_err)?;
        self.shared.releases.bump(&lease.lock);
        Ok(true)
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        self.shared.holder(lock).await
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

    /// The TTL etcd granted (whole seconds, at least its minimum): a dead holder's key lives
    /// that long.
    fn enforced_lease(&self, lock: &str) -> Option<Duration> {
        self.entry(lock).map(|e| e.granted)
    }

    async fn abandon(&self, lock: &str, identity: &str) {
        // Without the lock's attempt turn, which the engine's own late attempt may hold while
        // it calls this: the place's own state decides whether the attempt claimed first.
        if let Some(entry) = self
            .entry(lock)
            .filter(|e| e.identity == identity && e.slot.leave_if_waiting())
        {
            self.shared.leave(&entry).await;
            entry.slot.abort_tasks();
            // The one behind may be first now.
            self.shared.releases.bump(lock);
        }
    }

    fn changes(&self, lock: &str) -> Option<watch::Receiver<u64>> {
        Some(self.shared.releases.subscribe(lock))
    }

    /// Watches wake waiters; polling is only the fallback for a watch that was missed. With a
    /// keep-alive every half TTL, an idle waiter costs etcd about one message per renew
    /// interval at the default lease (three renew intervals).
    fn poll_interval(&self, renew_interval: Duration) -> Duration {
        renew_interval * 3
    }

    async fn ping(&self) -> Result<()> {
        let client = self.shared.client().await?;
        client.status().await.map_err(map_err)?;
        Ok(())
    }
}
