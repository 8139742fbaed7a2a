//! ZooKeeper: a fair queue of ephemeral sequential nodes, named as Apache Curator's
//! `InterProcessMutex` names them (`LOCKPATH/_c_<uuid>-lock-<sequence>`), so a Leasehold sidecar
//! and a Curator client on the same path queue together. The lowest sequence holds; each waiter
//! watches only the node just below its own; release deletes the node. The token is the node's
//! czxid: later nodes are created by later transactions. `LOCKPATH` is persistent when
//! provisioned, and a container node when a first contender creates it, so that the server
//! deletes an idle key's parent (see [`Shared::ensure_container_parent`]).
//!
//! Sessions: one per driver, with the lease as its timeout (the server may raise it to its
//! minimum, never lower it below the lease, else acquisition fails with an error). The leader
//! alone expires sessions, from the last sign of life a follower relayed to it, and a follower
//! cut off from the leader goes on answering reads from its stale state for up to `syncLimit`
//! ticks. So acquisition and renewal go through the leader (`sync` before the read), and the
//! claim is dated not from the renewal but from the newest earlier request whose touch the
//! leader has surely seen ([`Session::counted_from`], which takes the ensemble's `tickTime`
//! from the URL): the ephemeral node outlives the claim `counted_from + lease - margin`.
//!
//! - Disconnected: renewals fail, the sidecar answers "unknown" and stops claiming at its
//!   self-fence deadline, as with any backend.
//! - Expired: every node of the session is gone with it; the driver drops its queue entries and
//!   opens a new session on the next attempt, so there is never an orphan node (the Curator
//!   lost-session double holders, CURATOR-206/604/620, came from keeping state across sessions).
//! - The client library pings the session in the background, even when the engine's renewals
//!   stall; so when the local lease runs out without a renewal the driver deletes the node itself,
//!   and a frozen process loses its session to the server's timeout.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::OnceCell;
use tokio::time::Instant;
use zookeeper_client as zk;

use crate::boot_clock::BootInstant;
use crate::driver::{Acquire, Driver, Holding, Lease, Upkeep};
use crate::drivers::batches::{Batches, Pending};
use crate::drivers::queue::places::{Joined, Place};
use crate::drivers::queue::slot::QueueSlot;
use crate::drivers::queue::{Lines, Transport};
use crate::error::{Error, Result};
use crate::tls::Tls;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// The floor of [`connection_timeout`].
const MIN_CONNECTION_TIMEOUT: Duration = Duration::from_millis(1500);
/// The client's connection timeout for a session of `session_timeout`: 3/5 of it (the Java
/// client reads for 2/3), but never under `MIN_CONNECTION_TIMEOUT`.
///
/// zookeeper-client derives its tick from this: 1/8 of it when it is at most 3/5 of the session,
/// else 1/20 of the session. An idle session pings on the first tick 3 ticks after its last
/// request (every 4 ticks in practice), and drops a connection silent for 8 ticks. So from
/// 2.5 s sessions on, 3/5 gives the longest tick the library allows: a ping every 3/10 of the
/// session, 1.1 per renew interval at the default third of the lease (a fixed 3 s made a 15 s
/// session ping 3.3 times per renew interval). Shorter sessions (the conformance suite's
/// 1 s) keep 1/20 ticks: at 3/5 of a 1 s session their first connects failed on a loaded
/// machine.
fn connection_timeout(session_timeout: Duration) -> Duration {
    (session_timeout * 3 / 5).max(MIN_CONNECTION_TIMEOUT)
}

/// Curator's protected-name marker and lock-node name.
const NODE_MARKER: &str = "_c_";
const LOCK_NAME: &str = "-lock-";
/// How many times a contender creates a missing parent before its node.
const PARENT_ATTEMPTS: usize = 3;

/// Where to find ZooKeeper, under which path, and with which credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct ZooKeeperConfig {
    /// `host:port,host:port`
    pub servers: String,
    /// The absolute, validated parent path of every lock (`/leasehold`).
    pub root: String,
    /// Digest credentials (`user`, `password`); nodes are then created with creator-only ACLs.
    pub digest: Option<(String, String)>,
    /// The ensemble's `tickTime`: a follower relays its sessions' signs of life to the leader
    /// with its answer to the leader's ping, sent every half tick.
    pub tick_time: Duration,
    /// TLS to every server (`zks://`): the CA is required, the client pair optional.
    pub tls: Option<Tls>,
}

/// This process's node in one lock's queue; its token is the node's czxid.
type Entry = Place<Node>;

/// What a ZooKeeper place is: its sequential node.
struct Node {
    path: String,
    sequence: i64,
    /// The session that created the node and keeps it (its ephemeral owner): the node stays on
    /// the server after this process gave that session up, until the server expires it.
    session: i64,
    /// From when the leader surely counts the session that keeps this node, as of the last
    /// acquisition or renewal (see [`Session::counted_from`]).
    counted_from: Mutex<Option<BootInstant>>,
}

impl Node {
    /// Whether `session` is the one that keeps this node: a node of an earlier session of
    /// this process may outlive it on the server for a while, and be first in line meanwhile.
    fn kept_by(&self, session: &Session) -> bool {
        self.session == session.client.session_id().0
    }

    /// The node's name in its queue. It, not the sequence number, tells the node apart: a
    /// queue's parent deleted and made again numbers its children from 0 again, so another
    /// client's node may carry this one's number.
    fn name(&self) -> &str {
        self.path
            .rsplit_once('/')
            .map_or(&self.path, |(_, name)| name)
    }

    fn count_from(&self, from: BootInstant) {
        *self.counted_from.lock().unwrap_or_else(|e| e.into_inner()) = Some(from);
    }
}

struct Session {
    client: zk::Client,
    /// The lease the session was opened for, and the timeout the server granted (>= it).
    requested: Duration,
    timeout: Duration,
    /// Sent before the session was asked for: the leader created it, and started counting its
    /// life, later than this.
    opened: BootInstant,
    /// The ensemble's `tickTime`: how long a follower may take to relay a request's touch.
    tick: Duration,
    answered: Mutex<Answers>,
    /// The longest lease asked for through the session, in nanoseconds (0 before any).
    longest_claimed: AtomicU64,
}

/// Requests a session's server answered, (sent, answered), oldest first: every one answered
/// within the last session timeout and a tick, and the newest one before those. On the boot
/// clock, as the claims they date.
#[derive(Default)]
struct Answers(VecDeque<(BootInstant, BootInstant)>);

impl Answers {
    /// A request sent at `sent` was answered at `answered`, through a session of `timeout` on
    /// an ensemble of `tick`; answers no `sync` still to come needs are let go.
    fn note(
        &mut self,
        sent: BootInstant,
        answered: BootInstant,
        timeout: Duration,
        tick: Duration,
    ) {
        let kept = &mut self.0;
        kept.push_back((sent, answered));
        // The newest answer a whole tick older than a `sync` dates it: an older one is needed
        // only while a newer one is not yet a tick older than every `sync` still to date. A
        // `sync` sent a session timeout ago dates no claim that is still running.
        let dates_nothing_after = answered - (timeout + tick);
        while kept.len() > 1 && kept[1].1 + tick <= dates_nothing_after {
            kept.pop_front();
        }
        // A burst of calls: one answer of the middle is let go, which can only date a claim
        // from an earlier one.
        if kept.len() > ANSWERS_KEPT {
            let middle = kept.len() / 2;
            kept.remove(middle);
        }
    }

    /// When the newest request answered a whole tick before `synced` was sent.
    fn relayed_before(&self, synced: BootInstant, tick: Duration) -> Option<BootInstant> {
        self.0
            .iter()
            .rev()
            .find(|(_, answered)| *answered + tick <= synced)
            .map(|(sent, _)| *sent)
    }
}

/// How long the leader surely keeps a session past its last sign of life: the `granted`
/// timeout, at most the longest lease asked for through it, and at most the shortest session
/// opened (see [`Session::kept_for`]).
fn surely_kept_for(granted: Duration, longest_lease: Duration) -> Duration {
    granted.min(longest_lease.max(MIN_SESSION_TIMEOUT))
}

/// From when a claim of `lease` may count, given when the leader surely last heard from the
/// session (`relayed`) and how long it surely keeps the session from then (`kept_for`, see
/// [`Session::counted_from`]).
fn claim_counted_from(relayed: BootInstant, kept_for: Duration, lease: Duration) -> BootInstant {
    relayed + kept_for.saturating_sub(lease)
}

/// How often the nodes this process gave up while ZooKeeper could not be reached are deleted
/// when no call of its own reached the server first: one left first in a queue keeps every
/// other pod waiting, and a process that only renews makes no call that deletes them.
const ORPHAN_SWEEP: Duration = Duration::from_secs(1);

/// How long a create whose answer never came may still land: forwarded by a server the client
/// then lost, it commits once the leader has it, which a listing made through a lagging server
/// may not show yet. Its protected prefix is looked for (after a `sync`) until then; a minute
/// leaves room for a leader election.
const LATE_CREATE_WINDOW: Duration = Duration::from_secs(60);

/// A node to delete, or a protected name prefix (`.../_c_<uuid>-lock-`) whose sequence is
/// unknown: a create whose answer never came, looked for until it can no longer land.
struct Orphan {
    path: String,
    may_land_until: Option<Instant>,
    /// Looked for and deleted at least once: what is left is the sweep's watch for a late
    /// landing, which the calls that reach the server do not wait for.
    looked: bool,
}

/// Delete the orphans every [`ORPHAN_SWEEP`] on the session in use, for as long as the driver
/// lives. A session ended took its nodes with it; none is opened for this.
async fn sweep_orphans(shared: Weak<Shared>) {
    loop {
        tokio::time::sleep(ORPHAN_SWEEP).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared
            .orphans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
        {
            continue;
        }
        let current = shared.session.lock().await.clone();
        if let Some(session) = current.filter(|s| !s.client.state().is_terminated()) {
            shared.delete_orphans(&session.client, true).await;
        }
    }
}

/// A place being created ([`Shared::creating`]), until dropped.
struct Creating<'a>(&'a AtomicUsize);

impl Drop for Creating<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The most answered requests a session remembers (see [`Session::answered`]).
const ANSWERS_KEPT: usize = 256;

impl Session {
    fn answered(&self, sent: BootInstant, answered: BootInstant) {
        self.answered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .note(sent, answered, self.timeout, self.tick);
    }

    /// The latest instant from which the leader surely counts this session's life (it expires
    /// the session one session timeout after the last sign of life it saw), given a `sync`
    /// sent at `synced` that succeeded.
    ///
    /// A request answered by a follower is not seen by the leader: the follower notes the touch
    /// and relays it with its answer to the leader's next ping (every half tick). A follower cut
    /// off from the leader goes on answering reads for up to `syncLimit` ticks, so neither a read
    /// nor the request of the renewal itself proves anything. A `sync` does: it reaches the
    /// leader, so the link was up after every request answered a whole tick before the `sync`
    /// was sent, and at least one ping answer carried those requests' touches to the leader.
    /// The newest of them dates the leader's count; failing one, the session's opening does.
    ///
    /// The leader keeps the session a whole timeout from then ([`Session::kept_for`]), so a
    /// claim of `lease` may start that, less `lease`, after it (the caller never dates a claim
    /// after its own call).
    ///
    /// A waiter that sent nothing for a while (a quiet place in the queue) has such requests
    /// all the same: [`keep_answered`] reads through the session every fifth of its timeout.
    /// The client library's own pings count for nothing here, as nothing here sees them: a
    /// process stopped or starved sends none, and the leader's count of the session stays where
    /// the last relayed request left it.
    fn counted_from(&self, synced: BootInstant, lease: Duration) -> BootInstant {
        let nanos = u64::try_from(lease.as_nanos()).unwrap_or(u64::MAX);
        self.longest_claimed.fetch_max(nanos, Ordering::SeqCst);
        let kept_for = self.kept_for();
        let answers = self.answered.lock().unwrap_or_else(|e| e.into_inner());
        let relayed = answers
            .relayed_before(synced, self.tick)
            .map_or(self.opened, |sent| sent.max(self.opened));
        claim_counted_from(relayed, kept_for, lease)
    }

    /// How long the leader surely keeps the session past its last sign of life. The timeout
    /// the first server granted may be above every lease (raised to its `minSessionTimeout`, or
    /// asked for by a call that needed any session), and a server the client reconnects to
    /// lowers it to its `maxSessionTimeout` without a word; every server allows each lease
    /// asked for through the session (and the shortest session, 1 s), so the timeout is
    /// counted as the longest of those at most. Before any lease was asked for through it, the
    /// session counts as the one opened (for a lease, or for a call that needed any), which only
    /// [`keep_answered`] reads: its reads date the first claim too.
    fn kept_for(&self) -> Duration {
        match self.longest_claimed.load(Ordering::SeqCst) {
            0 => self.requested.min(self.timeout),
            longest => surely_kept_for(self.timeout, Duration::from_nanos(longest)),
        }
    }
}

/// How often [`keep_answered`] reads through a session, as a fraction of the timeout it is
/// surely kept for ([`Session::kept_for`]).
const KEEP_ANSWERED_FRACTION: f64 = 0.2;

/// Read through `session` every [`KEEP_ANSWERED_FRACTION`] of the time the leader surely keeps
/// it ([`Session::kept_for`]) for as long as it lives, noting each answer: the requests
/// [`Session::counted_from`] dates claims from, so that a place that waited quietly in its
/// queue still has a claim when its turn comes. A read the server answers itself (the root's
/// stat) is enough: the server notes the touch and relays it.
async fn keep_answered(session: Weak<Session>) {
    let mut every = Duration::ZERO;
    loop {
        tokio::time::sleep(every).await;
        let Some(session) = session.upgrade() else {
            return;
        };
        every = session.kept_for().mul_f64(KEEP_ANSWERED_FRACTION);
        if session.client.state().is_terminated() {
            return;
        }
        let sent = BootInstant::now();
        let read = tokio::time::timeout(session.timeout, session.client.check_stat("/")).await;
        if let Ok(Ok(_)) = read {
            session.answered(sent, BootInstant::now());
        }
    }
}

/// The shortest lease, in the ensemble's ticks, that the refusal in `try_acquire` names: claims
/// outlast a third of the lease from 2.8 ticks on (see [`Session::counted_from`]).
const MIN_LEASE_TICKS: u32 = 3;

/// The longest a connected session goes without an answered request of its own, as a fraction
/// of its timeout: [`keep_answered`]'s reads, and room for their round trips.
const IDLE_PING_FRACTION: f64 = 0.3;

/// The session timeout when a call needs a session before any lease asked for one.
const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(15);
/// The shortest session opened: the client times requests out at a fraction of the session
/// timeout, and leases shorter than this are fenced by the driver's own expiry anyway.
const MIN_SESSION_TIMEOUT: Duration = Duration::from_secs(1);

struct Shared {
    config: ZooKeeperConfig,
    /// The TLS settings of `config`, their PEM documents read at start.
    tls: Option<zk::TlsOptions>,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    lines: Lines<Node>,
    /// Places being created: each on the session current when it was asked for, which is
    /// not replaced meanwhile (a place's node lives and dies with its session).
    creating: AtomicUsize,
    provisioned: OnceCell<()>,
    /// Nodes this process gave up while ZooKeeper was unreachable. The library keeps the
    /// session alive across a reconnect, so they would stay first in line forever: they are
    /// deleted on the next call that reaches the server.
    orphans: Mutex<Vec<Orphan>>,
    /// Per lock: the lowest node last read, who it is, and the session that owns it.
    holders: Mutex<HashMap<String, (String, Holding, i64)>>,
    /// For tests: creates wait for a permit here before they are sent.
    #[cfg(feature = "test-hooks")]
    creates_held: Mutex<Option<Arc<tokio::sync::Semaphore>>>,
}

pub struct ZooKeeperDriver {
    shared: Arc<Shared>,
    /// Renewals that arrive together are checked together ([`check_nodes`]).
    renewals: Batches<NodeCheck, NodeFound>,
}

/// The most locks whose lowest node's holder is remembered ([`Shared::holders`]).
const HOLDERS_CACHED: usize = 4096;

/// The most nodes one batch of renewals reads: each answer carries the node's data (a holder's
/// identity) and stat, well within ZooKeeper's 1 MiB `jute.maxbuffer`.
const MAX_RENEW_BATCH: usize = 512;

/// A renewal's check that its node is still there, on the session that should keep it.
struct NodeCheck {
    session: Arc<Session>,
    path: String,
    /// What the batch's `sync` names (ZooKeeper syncs the whole server with the leader).
    parent: String,
}

/// When the check's `sync` was sent, and whether the node was there after it.
type NodeFound = std::result::Result<(BootInstant, bool), zk::Error>;

/// The renewals of a batch, per session (one, unless it was replaced meanwhile): one `sync`
/// through the leader, then one `multiRead` of every node, where each renewal took a `sync` and
/// a read of its own. Each node is read after the `sync` was answered, as a renewal of its own
/// reads it, so each claim is dated as before. A server older than 3.6 has no `multiRead`:
/// there each node is read on its own, after the batch's one `sync`.
async fn check_nodes(batch: Vec<Pending<NodeCheck, NodeFound>>) {
    let mut sessions: Vec<Vec<Pending<NodeCheck, NodeFound>>> = Vec::new();
    for pending in batch {
        match sessions
            .iter_mut()
            .find(|group| Arc::ptr_eq(&group[0].request.session, &pending.request.session))
        {
            Some(group) => group.push(pending),
            None => sessions.push(vec![pending]),
        }
    }
    for group in sessions {
        let session = group[0].request.session.clone();
        let synced = BootInstant::now();
        let found = match session.client.sync(&group[0].request.parent).await {
            Ok(()) => read_nodes(&session.client, &group).await,
            Err(e) => Err(e),
        };
        match found {
            Ok(found) => {
                session.answered(synced, BootInstant::now());
                for (pending, found) in group.into_iter().zip(found) {
                    let _ = pending.reply.send(found.map(|found| (synced, found)));
                }
            }
            Err(e) => {
                for pending in group {
                    let _ = pending.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// Whether each node of `group` is there: one `multiRead`, or a read each where the server has
/// none.
async fn read_nodes(
    client: &zk::Client,
    group: &[Pending<NodeCheck, NodeFound>],
) -> std::result::Result<Vec<std::result::Result<bool, zk::Error>>, zk::Error> {
    let mut reader = client.new_multi_reader();
    for pending in group {
        reader.add_get_data(&pending.request.path)?;
    }
    match reader.commit().await {
        Ok(results) if results.len() == group.len() => Ok(results
            .into_iter()
            .map(|result| match result {
                zk::MultiReadResult::Data { .. } => Ok(true),
                zk::MultiReadResult::Error {
                    err: zk::Error::NoNode,
                } => Ok(false),
                zk::MultiReadResult::Error { err } => Err(err),
                _ => Err(zk::Error::UnexpectedError(
                    "multiRead answered a data read with something else".to_owned(),
                )),
            })
            .collect()),
        Ok(results) => Err(zk::Error::UnexpectedError(format!(
            "multiRead answered {} reads with {} results",
            group.len(),
            results.len()
        ))),
        Err(zk::Error::Unimplemented) => {
            let mut found = Vec::with_capacity(group.len());
            for pending in group {
                found.push(
                    client
                        .check_stat(&pending.request.path)
                        .await
                        .map(|s| s.is_some()),
                );
            }
            Ok(found)
        }
        Err(e) => Err(e),
    }
}

impl Drop for ZooKeeperDriver {
    fn drop(&mut self) {
        self.shared.lines.places.abort_all();
    }
}

fn map_err(e: zk::Error) -> Error {
    match e {
        zk::Error::ConnectionLoss
        | zk::Error::Timeout
        | zk::Error::NoHosts
        | zk::Error::SessionExpired
        | zk::Error::ClientClosed
        // What ended the request's connection: zookeeper-client hands a request in flight the
        // connection's own failure ("no response from connection in 400ms", an I/O error).
        | zk::Error::Custom(_) => Error::Unreachable(e.to_string()),
        zk::Error::NoAuth | zk::Error::AuthFailed => {
            Error::Backend(format!("not allowed by ZooKeeper: {e}"))
        }
        other => Error::Backend(other.to_string()),
    }
}

/// The sequence of a Curator-style lock node name, if it is one.
fn sequence_of(name: &str) -> Option<i64> {
    name.rsplit_once(LOCK_NAME)?.1.parse().ok()
}

/// Where a sequence number stands in ZooKeeper's counter, which is a signed 32-bit number that
/// goes on from 2147483647 to -2147483648: read as unsigned, the counter only rises until it
/// wraps from 4294967295 to 0.
fn counted(sequence: i64) -> u32 {
    sequence as i32 as u32
}

/// Whether the node of `sequence` was made before the node of `other`, of one parent: the two
/// are far fewer than 2^31 creations apart, so the difference tells, across a wrap too.
fn made_before(sequence: i64, other: i64) -> bool {
    (counted(other).wrapping_sub(counted(sequence)) as i32) > 0
}

/// `queue` (sequence, node name) in the order its nodes were made. Sorted by the number alone,
/// a node made after the counter's wrap would stand first, ahead of the holder. The nodes of a
/// queue at once span far less than half the counter, so the first made is the one after the
/// widest gap between numbers, going round.
fn in_creation_order(queue: &mut [(i64, String)]) {
    queue.sort_by_key(|(sequence, name)| (counted(*sequence), name.clone()));
    let n = queue.len();
    let oldest = (0..n)
        .max_by_key(|&i| counted(queue[i].0).wrapping_sub(counted(queue[(i + n - 1) % n].0)))
        .unwrap_or(0);
    queue.rotate_left(oldest);
}

impl Transport for Shared {
    type Own = Node;

    fn lines(&self) -> &Lines<Node> {
        &self.lines
    }

    /// The nodes this process gave up go first ([`Shared::delete_orphans`]); the unknown
    /// places cleared are this session's nodes ([`Shared::deleted_if_unknown_own`]).
    async fn first_in_line(&self, lock: &str, clear: bool) -> Result<Option<Holding>> {
        let session = self.any_session().await?;
        self.delete_orphans(&session.client, false).await;
        let queue = self.queue(&session.client, lock).await?;
        let Some((_, name)) = queue.first() else {
            return Ok(None);
        };
        let first = self.holding_and_owner(&session.client, lock, name).await?;
        if clear
            && self
                .deleted_if_unknown_own(&session, lock, name, first.as_ref())
                .await?
        {
            return Ok(None);
        }
        Ok(first.map(|(holding, _)| holding))
    }

    /// A node that could not be deleted is left to the orphans' clean-up.
    async fn leave_line(&self, entry: &Entry) {
        let _ = self.leave(entry).await;
    }
}

impl Shared {
    fn parent(&self, lock: &str) -> String {
        format!("{}/{lock}", self.config.root)
    }

    fn acls(&self) -> zk::Acls<'static> {
        if self.config.digest.is_some() {
            zk::Acls::creator_all()
        } else {
            zk::Acls::anyone_all()
        }
    }

    /// A live session fit for `lease`: the current one if it was opened for this lease (or
    /// still has nodes and a timeout no shorter), else a new one with `lease` as its timeout, so
    /// that a dead holder's node goes one lease after its last sign of life.
    async fn session(&self, lease: Duration) -> Result<Arc<Session>> {
        let mut session = self.session.lock().await;
        self.fit_session(&mut session, lease).await
    }

    /// [`Shared::session`] for a place about to be created on it: the session is not replaced
    /// until the place is known ([`Shared::entries`]) or its creation has ended.
    async fn session_to_create_on(&self, lease: Duration) -> Result<(Arc<Session>, Creating<'_>)> {
        let mut session = self.session.lock().await;
        let fit = self.fit_session(&mut session, lease).await?;
        // Counted before the choice is let go of, so that no other call replaces it meanwhile.
        self.creating.fetch_add(1, Ordering::SeqCst);
        Ok((fit, Creating(&self.creating)))
    }

    async fn fit_session(
        &self,
        session: &mut Option<Arc<Session>>,
        lease: Duration,
    ) -> Result<Arc<Session>> {
        let lease = lease.max(MIN_SESSION_TIMEOUT);
        if let Some(current) = session.as_ref() {
            if !current.client.state().is_terminated() {
                let has_nodes =
                    !self.lines.places.is_empty() || self.creating.load(Ordering::SeqCst) > 0;
                if current.requested == lease || (has_nodes && lease <= current.timeout) {
                    return Ok(current.clone());
                }
                if has_nodes {
                    return Err(Error::InvalidConfig {
                        field: "lease-duration",
                        reason: format!(
                            "longer than this process's ZooKeeper session timeout ({:?})",
                            current.timeout
                        ),
                    });
                }
            } else {
                // Expired or closed: its nodes are gone with it; so are this driver's places.
                self.lines.places.drop_all();
            }
        }
        let opened = BootInstant::now();
        let mut connector = zk::Client::connector()
            .with_session_timeout(lease)
            .with_connection_timeout(connection_timeout(lease));
        if let Some((user, password)) = &self.config.digest {
            connector = connector.with_auth("digest", format!("{user}:{password}").as_bytes());
        }
        let connecting = async {
            match &self.tls {
                Some(tls) => {
                    crate::tls::use_ring_provider();
                    connector
                        .with_tls(tls.clone())
                        .secure_connect(&self.config.servers)
                        .await
                }
                None => connector.connect(&self.config.servers).await,
            }
        };
        let client = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(client) => client.map_err(map_err)?,
            Err(_) => return Err(self.no_session().await),
        };
        let timeout = client.session_timeout();
        if timeout < lease {
            return Err(Error::InvalidConfig {
                field: "lease-duration",
                reason: format!(
                    "ZooKeeper capped the session timeout at {timeout:?}; raise maxSessionTimeout or shorten the lease"
                ),
            });
        }
        let fresh = Arc::new(Session {
            client,
            requested: lease,
            timeout,
            opened,
            tick: self.config.tick_time,
            answered: Mutex::new(Answers::default()),
            longest_claimed: AtomicU64::new(0),
        });
        tokio::spawn(keep_answered(Arc::downgrade(&fresh)));
        *session = Some(fresh.clone());
        Ok(fresh)
    }

    /// Why no session came within [`CONNECT_TIMEOUT`]. Over TLS the client retries a failed
    /// handshake without saying why, so one handshake of our own with the first server names it.
    async fn no_session(&self) -> Error {
        let Some(tls) = &self.config.tls else {
            return Error::Unreachable(format!("no ZooKeeper session within {CONNECT_TIMEOUT:?}"));
        };
        let first = self.config.servers.split(',').next().unwrap_or_default();
        let cause = match first.rsplit_once(':') {
            Some((host, port)) => match port.parse() {
                Ok(port) => {
                    let host = host.trim_start_matches('[').trim_end_matches(']');
                    crate::tls::handshake_failure(host, port, tls).await
                }
                Err(_) => None,
            },
            None => None,
        };
        Error::Unreachable(match cause {
            Some(cause) => format!(
                "no ZooKeeper session over TLS within {CONNECT_TIMEOUT:?}: the TLS handshake with {first} fails: {cause}"
            ),
            None => format!(
                "no ZooKeeper session over TLS within {CONNECT_TIMEOUT:?} (no server answered in time)"
            ),
        })
    }

    /// The current session, whatever its timeout, for calls that need no particular one.
    async fn any_session(&self) -> Result<Arc<Session>> {
        let current = self.session.lock().await.clone();
        match current {
            Some(s) if !s.client.state().is_terminated() => Ok(s),
            _ => self.session(DEFAULT_SESSION_TIMEOUT).await,
        }
    }

    fn forget(&self, entry: &Entry) {
        if self.lines.places.forget(entry) {
            // Nobody here waits for the lock any more: its holder needs no remembering.
            self.holders
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&entry.lock);
        }
    }

    /// Give the node up: `Ok(true)` deleted now, `Ok(false)` already gone. If the delete fails
    /// or this call is dropped before it ends (the delete may never have arrived, and the
    /// session outlives a dropped connection, so the node would stand in the queue for as long
    /// as this process lives), the node is remembered as an orphan and deleted at the next call
    /// that reaches ZooKeeper, an idle sidecar's observation included.
    async fn leave(&self, entry: &Entry) -> Result<bool> {
        self.forget(entry);
        let unless_deleted = OrphanGuard::new(self, entry.path.clone());
        let deleted = match self.any_session().await {
            Ok(session) => match session.client.delete(&entry.path, None).await {
                Ok(()) => Ok(true),
                Err(zk::Error::NoNode) => Ok(false),
                Err(e) => Err(map_err(e)),
            },
            Err(e) => Err(e),
        };
        if deleted.is_ok() {
            unless_deleted.disarm();
        }
        deleted
    }

    /// A node (or a protected name prefix) to delete at the next call that reaches ZooKeeper.
    fn orphan(&self, path: String) {
        let may_land_until = path
            .ends_with(LOCK_NAME)
            .then(|| Instant::now() + LATE_CREATE_WINDOW);
        self.orphans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Orphan {
                path,
                may_land_until,
                looked: false,
            });
    }

    /// Whether an orphan waits for its first deletion (not only the sweep's watch for a late
    /// landing).
    fn orphans_pending(&self) -> bool {
        self.orphans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|orphan| !orphan.looked)
    }

    /// Delete the nodes this process gave up or may have created unawares. A protected prefix
    /// is looked for after a `sync` (the create may have been forwarded by a server that the
    /// one answering has not heard from yet), and again at each sweep until its create can no
    /// longer land: its name is this process's alone, so whatever holds it is that create.
    async fn delete_orphans(&self, client: &zk::Client, watch_late_landings: bool) {
        let orphans = std::mem::take(&mut *self.orphans.lock().unwrap_or_else(|e| e.into_inner()));
        for mut orphan in orphans {
            if orphan.looked && !watch_late_landings {
                self.orphans
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(orphan);
                continue;
            }
            let deleted = if orphan.path.ends_with(LOCK_NAME) {
                let (parent, name) = orphan.path.rsplit_once('/').unwrap_or_default();
                let listed = match client.sync(parent).await {
                    Ok(()) => client.list_children(parent).await,
                    Err(e) => Err(e),
                };
                match listed {
                    Ok(children) => {
                        let mut ok = true;
                        for child in children.iter().filter(|c| c.starts_with(name)) {
                            let path = format!("{parent}/{child}");
                            ok &= matches!(
                                client.delete(&path, None).await,
                                Ok(()) | Err(zk::Error::NoNode)
                            );
                        }
                        ok
                    }
                    Err(zk::Error::NoNode) => true,
                    Err(_) => false,
                }
            } else {
                matches!(
                    client.delete(&orphan.path, None).await,
                    Ok(()) | Err(zk::Error::NoNode)
                )
            };
            let may_land = orphan
                .may_land_until
                .is_some_and(|until| until > Instant::now());
            orphan.looked |= deleted;
            if !deleted || may_land {
                self.orphans
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(orphan);
            }
        }
    }

    /// The lock's parent as a persistent node, for locks provisioned up front.
    async fn ensure_parent(&self, client: &zk::Client, lock: &str) -> Result<()> {
        let acls = self.acls();
        let options = zk::CreateMode::Persistent.with_acls(acls);
        match client.mkdir(&self.parent(lock), &options).await {
            Ok(()) | Err(zk::Error::NodeExists) => Ok(()),
            Err(e) => Err(map_err(e)),
        }
    }

    /// The lock's parent created on demand, by a first contender: a container node, which the
    /// server deletes once its last child is gone (as Curator creates its locks' parents). A
    /// keyed family's keys are chosen at run time without bound (`order-1234`), so persistent
    /// parents would pile up in every server's memory; the tokens (czxids) rise across the
    /// deletion, since zxids are the ensemble's. The root stays persistent.
    async fn ensure_container_parent(&self, client: &zk::Client, lock: &str) -> Result<()> {
        let options = zk::CreateMode::Container.with_acls(self.acls());
        let parent = self.parent(lock);
        match client.create(&parent, &[], &options).await {
            Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
            Err(zk::Error::NoNode) => {
                let root = zk::CreateMode::Persistent.with_acls(self.acls());
                match client.mkdir(&self.config.root, &root).await {
                    Ok(()) | Err(zk::Error::NodeExists) => {}
                    Err(e) => return Err(map_err(e)),
                }
                match client.create(&parent, &[], &options).await {
                    Ok(_) | Err(zk::Error::NodeExists) => Ok(()),
                    Err(e) => Err(map_err(e)),
                }
            }
            Err(e) => Err(map_err(e)),
        }
    }

    /// A new place's protected name in `lock`'s queue, before the sequence number the server
    /// appends: unique, so that a create whose answer was lost can be found by it.
    fn place_prefix(&self, lock: &str) -> String {
        format!(
            "{}/{NODE_MARKER}{:032x}{LOCK_NAME}",
            self.parent(lock),
            rand::random::<u128>()
        )
    }

    async fn enqueue(
        self: &Arc<Self>,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<Arc<Entry>> {
        // Held until the place is known (or its creation failed): see `Shared::creating`.
        let (session, _creating) = self.session_to_create_on(ttl).await?;
        #[cfg(feature = "test-hooks")]
        {
            let held = self
                .creates_held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            if let Some(gate) = held {
                let _ = gate
                    .acquire()
                    .await
                    .map(tokio::sync::SemaphorePermit::forget);
            }
        }
        let client = &session.client;
        let prefix = self.place_prefix(lock);
        let acls = self.acls();
        let options = zk::CreateMode::EphemeralSequential.with_acls(acls);
        // The create may happen with its answer lost (or with this call given up mid-way):
        // then the node is found by its protected name later and deleted (Curator's
        // protection mode does the same).
        let unless_created = OrphanGuard::new(self, prefix.clone());
        // The parent may be missing, or be a container the server deletes between our
        // creating it and our child landing in it: a few tries.
        let mut created = client.create(&prefix, identity.as_bytes(), &options).await;
        for _ in 0..PARENT_ATTEMPTS {
            if !matches!(created, Err(zk::Error::NoNode)) {
                break;
            }
            self.ensure_container_parent(client, lock).await?;
            created = client.create(&prefix, identity.as_bytes(), &options).await;
        }
        let (stat, sequence) = created.map_err(map_err)?;
        unless_created.disarm();
        let slot = QueueSlot::new();
        let entry = Arc::new(Entry {
            lock: lock.to_owned(),
            identity: identity.to_owned(),
            token: stat.czxid,
            slot,
            own: Node {
                path: format!("{prefix}{sequence}"),
                sequence: sequence.into_i64(),
                session: stat.ephemeral_owner,
                counted_from: Mutex::new(None),
            },
        });
        let task = tokio::spawn(super::tend(
            self.clone(),
            entry.clone(),
            ttl * super::ABANDONED_AFTER_LEASES,
        ));
        entry.slot.set_tender(task);
        // Attempts given up while the connection was down each left a create queued in the
        // client, and they all land once it reconnects: this process keeps its earliest place
        // (or the one it holds) and leaves the others, which it would otherwise no longer know
        // of while they stood ahead of the place it watches.
        let placed = self.lines.places.joined(entry.clone(), |present| {
            present.slot.holding() || made_before(present.sequence, entry.sequence)
        });
        let (kept, surplus) = match placed {
            Joined::Kept { kept, surplus } => (kept, Some(surplus)),
            Joined::Put { place, replaced } => (place, replaced),
            // The wait was given up while the node was created: it leaves the queue at once
            // rather than stand in it, unasked, for four leases. The attempt finds it gone.
            Joined::Abandoned(place) => {
                place.slot.abort_tasks();
                let _ = self.leave(&place).await;
                self.lines.releases.bump(lock);
                return Ok(place);
            }
        };
        if let Some(surplus) = surplus {
            tracing::debug!(lock, node = %surplus.path, kept = %kept.path,
                "a second place in the queue; leaving it");
            surplus.slot.abort_tasks();
            let _ = self.leave(&surplus).await;
        }
        Ok(kept)
    }

    /// The queue of `lock`, first made first: (sequence, node name).
    async fn queue(&self, client: &zk::Client, lock: &str) -> Result<Vec<(i64, String)>> {
        let children = match client.list_children(&self.parent(lock)).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => Vec::new(),
            Err(e) => return Err(map_err(e)),
        };
        let mut queue: Vec<(i64, String)> = children
            .into_iter()
            .filter_map(|name| Some((sequence_of(&name)?, name)))
            .collect();
        in_creation_order(&mut queue);
        Ok(queue)
    }

    /// Who the node `name` of `lock`'s queue is, and the session that owns it. A node's data,
    /// czxid and owner never change, so the answer for the lowest node is cached per lock until
    /// the lowest node does: an idle waiter's poll costs one listing.
    async fn holding_and_owner(
        &self,
        client: &zk::Client,
        lock: &str,
        name: &str,
    ) -> Result<Option<(Holding, i64)>> {
        if let Some((cached, holding, owner)) = self
            .holders
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(lock)
            && cached == name
        {
            return Ok(Some((holding.clone(), *owner)));
        }
        let path = format!("{}/{name}", self.parent(lock));
        match client.get_data(&path).await {
            Ok((data, stat)) => {
                let holding = Holding {
                    identity: String::from_utf8_lossy(&data).into_owned(),
                    token: u64::try_from(stat.czxid).unwrap_or(0),
                    expires_in: None,
                };
                let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
                // Keyed locks are named at run time, without bound; the cache only saves a
                // read, so it starts over rather than grow.
                if holders.len() >= HOLDERS_CACHED && !holders.contains_key(lock) {
                    holders.clear();
                }
                holders.insert(
                    lock.to_owned(),
                    (name.to_owned(), holding.clone(), stat.ephemeral_owner),
                );
                Ok(Some((holding, stat.ephemeral_owner)))
            }
            // Gone between the listing and the read: free right now.
            Err(zk::Error::NoNode) => Ok(None),
            Err(e) => Err(map_err(e)),
        }
    }

    async fn holder(&self, lock: &str) -> Result<Option<Holding>> {
        self.first_in_line(lock, false).await
    }

    /// Delete `name`, first in `lock`'s queue (`first`: who it is and its owner), when it is a
    /// place of this driver's own session that no entry of the driver knows (one place per lock
    /// and process): a create whose answer never came back, or a place given up and not yet
    /// deleted. Left alone it would block every waiter, this process's included, for as long
    /// as the session lives. True when it was deleted (or was already gone). Called under the
    /// lock's [`Attempts`] turn only.
    async fn deleted_if_unknown_own(
        &self,
        session: &Session,
        lock: &str,
        name: &str,
        first: Option<&(Holding, i64)>,
    ) -> Result<bool> {
        if first.is_none_or(|(_, owner)| *owner != session.client.session_id().0) {
            return Ok(false);
        }
        let path = format!("{}/{name}", self.parent(lock));
        let known = self
            .lines
            .places
            .get(lock)
            .is_some_and(|entry| entry.path == path);
        if known {
            return Ok(false);
        }
        tracing::debug!(lock, node = %path,
            "a place of this session's that the driver does not know, first in line; deleting it");
        match session.client.delete(&path, None).await {
            Ok(()) | Err(zk::Error::NoNode) => {
                self.holders
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(lock);
                Ok(true)
            }
            Err(e) => Err(map_err(e)),
        }
    }

    /// Wake this process's waiters of `entry.lock` when `predecessor` is deleted.
    fn watch_predecessor(
        self: &Arc<Self>,
        session: &Arc<Session>,
        entry: &Entry,
        predecessor: String,
    ) {
        let (shared, session, lock, path) = (
            self.clone(),
            session.clone(),
            entry.lock.clone(),
            predecessor.clone(),
        );
        entry.slot.watch(predecessor, move |fired| {
            tokio::spawn(async move {
                match session.client.check_and_watch_stat(&path).await {
                    Ok((Some(_), watcher)) => {
                        watcher.changed().await;
                    }
                    Ok((None, _)) => {}
                    Err(e) => tracing::debug!(error = %e, "zookeeper watch failed"),
                }
                fired.fire();
                shared.lines.wakeups.fetch_add(1, Ordering::Relaxed);
                shared.lines.releases.bump(&lock);
            })
        });
    }
}

/// A node (or protected prefix) that a call may leave behind, remembered as an orphan unless
/// the call disarms the guard: it ends early on an error, and also when its caller gives up on
/// it mid-way (the engine bounds a release by a budget, and drops it then), where code after
/// the `await` would never run. The session outlives a dropped connection, and a node left
/// behind would stand in the queue for as long as this process lives.
struct OrphanGuard<'a> {
    shared: &'a Shared,
    path: Option<String>,
}

impl<'a> OrphanGuard<'a> {
    fn new(shared: &'a Shared, path: String) -> Self {
        Self {
            shared,
            path: Some(path),
        }
    }

    /// The call finished what it began: nothing is left behind.
    fn disarm(mut self) {
        self.path = None;
    }
}

impl Drop for OrphanGuard<'_> {
    fn drop(&mut self) {
        if let Some(path) = self.path.take() {
            self.shared.orphan(path);
        }
    }
}

impl ZooKeeperDriver {
    /// Opens the session on first use, with the first lease as its timeout.
    pub fn connect(config: ZooKeeperConfig) -> Result<Self> {
        crate::names::validate_zookeeper_path(&config.root)?;
        let tls = config.tls.as_ref().map(tls_options).transpose()?;
        let driver = Self {
            shared: Arc::new(Shared {
                config,
                tls,
                session: tokio::sync::Mutex::new(None),
                lines: Lines::default(),
                creating: AtomicUsize::new(0),
                provisioned: OnceCell::new(),
                orphans: Mutex::new(Vec::new()),
                holders: Mutex::new(HashMap::new()),
                #[cfg(feature = "test-hooks")]
                creates_held: Mutex::new(None),
            }),
            renewals: Batches::new(MAX_RENEW_BATCH, check_nodes),
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(sweep_orphans(Arc::downgrade(&driver.shared)));
        }
        Ok(driver)
    }

    /// How many times a watched predecessor went away (or its watch failed) and woke a waiter.
    pub fn wakeups(&self) -> u64 {
        self.shared.lines.wakeups.load(Ordering::Relaxed)
    }

    /// For tests: from now on, each place is created once its session is chosen and a permit
    /// added to the semaphore returned lets it go on.
    #[cfg(feature = "test-hooks")]
    pub fn hold_creates(&self) -> Arc<tokio::sync::Semaphore> {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        *self
            .shared
            .creates_held
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(gate.clone());
        gate
    }

    /// For tests: the driver gives its session up as it does one its client found expired
    /// and opens another at its next call, while the session goes on: the server may keep a
    /// session the client gave up for a while, and its nodes with it. The session ends (and
    /// its nodes go) when what is returned is dropped.
    #[cfg(feature = "test-hooks")]
    pub async fn give_up_a_session_the_server_keeps(&self) -> Box<dyn std::any::Any + Send> {
        Box::new(self.shared.session.lock().await.take())
    }

    /// For tests: `path` is a node this driver gave up without reaching ZooKeeper (a delete
    /// that failed), to be deleted later.
    #[cfg(feature = "test-hooks")]
    pub fn gave_up_unreached(&self, path: &str) {
        self.shared.orphan(path.to_owned());
    }

    /// For tests: a place in `lock`'s queue on this driver's own session that the driver does not
    /// know of, as a create whose answer never came back leaves one. Returns its path.
    #[cfg(feature = "test-hooks")]
    pub async fn place_unknown_to_the_driver(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<String> {
        self.create_landing_late(&self.shared.place_prefix(lock), identity, ttl)
            .await
    }

    /// For tests: a create of `lock`'s place whose answer never came, as the driver records it
    /// (its protected prefix, returned), to land later by [`Self::create_landing_late`].
    #[cfg(feature = "test-hooks")]
    pub fn create_answered_never(&self, lock: &str) -> String {
        let prefix = self.shared.place_prefix(lock);
        self.shared.orphan(prefix.clone());
        prefix
    }

    /// For tests: the node of a create with the protected `prefix` landing now, on the driver's
    /// session. Returns its path.
    #[cfg(feature = "test-hooks")]
    pub async fn create_landing_late(
        &self,
        prefix: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<String> {
        let session = self.shared.session(ttl).await?;
        let prefix = prefix.to_owned();
        let options = zk::CreateMode::EphemeralSequential.with_acls(self.shared.acls());
        let (_, sequence) = session
            .client
            .create(&prefix, identity.as_bytes(), &options)
            .await
            .map_err(map_err)?;
        Ok(format!("{prefix}{sequence}"))
    }

    fn entry(&self, lock: &str) -> Option<Arc<Entry>> {
        self.shared.lines.places.get(lock)
    }

    /// A waiter further back answered without a request (see `queue::slot`), while `session` is
    /// connected and no orphan waits to be deleted.
    fn quiet_wait(
        &self,
        session: &Session,
        entry: &Entry,
        now: Instant,
        ttl: Duration,
    ) -> Option<Option<Holding>> {
        let connected = session.client.state() == zk::SessionState::SyncConnected;
        if connected && !self.shared.orphans_pending() {
            entry.slot.quiet_wait(now, ttl)
        } else {
            None
        }
    }

    fn held(&self, lease: &Lease) -> Option<Arc<Entry>> {
        self.shared.lines.places.holding(lease)
    }
}

#[async_trait]
impl Driver for ZooKeeperDriver {
    fn kind(&self) -> &'static str {
        "zookeeper"
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        // After a quiet wait a claim lasts at least 7/10 of the lease minus a tick (see
        // `Session::counted_from`); it must outlast the default renew interval, a third of the
        // lease, or the holder would lose every claim before renewing it.
        let tick = self.shared.config.tick_time;
        let session = ttl.max(MIN_SESSION_TIMEOUT);
        if session
            .mul_f64(1.0 - IDLE_PING_FRACTION)
            .saturating_sub(tick)
            <= ttl / 3
        {
            return Err(Error::InvalidConfig {
                field: "lease-duration",
                reason: format!(
                    "ZooKeeper needs a lease of at least {MIN_LEASE_TICKS} ticks ({:?} at tick-time {tick:?}): a \
                     claim counts from the last sign of life the leader has surely heard of, up to a tick \
                     and 3/10 of the session before a renewal, so a shorter lease would run out between \
                     renewals; lengthen the lease, or set tick-time to the ensemble's own tickTime",
                    tick * MIN_LEASE_TICKS
                ),
            });
        }
        let mut turn = self.shared.lines.attempts.turn(lock).await;
        // Opening a session first, when needed, must not eat into the lease measured below.
        let current = self.shared.session(ttl).await?;
        let sent = Instant::now();
        let entry = match self.entry(lock) {
            Some(entry) if entry.slot.holding() || entry.identity != identity => {
                return Ok(Acquire::Busy(self.shared.holder(lock).await?));
            }
            Some(entry) => {
                entry.slot.ask(sent);
                if let Some(holder) = self.quiet_wait(&current, &entry, sent, ttl) {
                    return Ok(Acquire::Busy(holder));
                }
                entry
            }
            None => {
                // A task of its own (see `super::join_line`): if this call is dropped midway,
                // the node it may already have created is still recorded, never left behind.
                let (shared, owned_lock, owned_identity) =
                    (self.shared.clone(), lock.to_owned(), identity.to_owned());
                let put = async move { shared.enqueue(&owned_lock, &owned_identity, ttl).await };
                let (entry, returned) =
                    super::join_line(&self.shared, turn, lock, identity, put).await?;
                turn = returned;
                entry
            }
        };
        let _turn = turn;
        let session = self.shared.session(ttl).await?;
        if !entry.kept_by(&session) {
            // Made on a session given up since (the client found it expired): the server may
            // still keep the node, first in line, until it expires the session itself, and
            // then gives the lock to the next in line; it counts for nothing here.
            self.shared.forget(&entry);
            entry.slot.abort_tasks();
            return Ok(Acquire::Busy(None));
        }
        self.shared.delete_orphans(&session.client, false).await;
        // Through the leader first: a follower cut off from it lists a queue the leader may
        // already have moved on from (see `Session::counted_from`).
        let synced = BootInstant::now();
        session
            .client
            .sync(&self.shared.parent(lock))
            .await
            .map_err(map_err)?;
        let queue = self.shared.queue(&session.client, lock).await?;
        let counted_from = session.counted_from(synced, ttl);
        session.answered(synced, BootInstant::now());
        let Some(position) = queue.iter().position(|(_, name)| name == entry.name()) else {
            // The node is gone (session expired and renewed): back to the end of the queue.
            tracing::debug!(lock, node = %entry.path, "queue place gone; joining again");
            self.shared.forget(&entry);
            entry.slot.abort_tasks();
            return Ok(Acquire::Busy(self.shared.holder(lock).await?));
        };
        if position > 0 {
            tracing::debug!(lock, position, queued = queue.len(), first = %queue[0].1,
                mine = %entry.path, "waiting in the queue");
            let parent = self.shared.parent(lock);
            let predecessor = format!("{parent}/{}", queue[position - 1].1);
            self.shared.watch_predecessor(&session, &entry, predecessor);
            let first = self
                .shared
                .holding_and_owner(&session.client, lock, &queue[0].1)
                .await?;
            if self
                .shared
                .deleted_if_unknown_own(&session, lock, &queue[0].1, first.as_ref())
                .await?
            {
                return Ok(Acquire::Busy(None));
            }
            let holder = first.map(|(holding, _)| holding);
            entry.slot.saw(sent, position == 1, holder.clone());
            return Ok(Acquire::Busy(holder));
        }
        if !entry.slot.hold_until(sent + ttl) {
            // Abandoned while this attempt ran (the engine gave up on it): its node is gone.
            return Ok(Acquire::Busy(None));
        }
        entry.count_from(counted_from);
        Ok(Acquire::Acquired(entry.lease()))
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let sent = Instant::now();
        let Some(entry) = self.held(lease) else {
            return Ok(false);
        };
        if entry.slot.expired_by(sent) {
            return Ok(false);
        }
        let session = self.shared.session(ttl).await?;
        if !entry.kept_by(&session) {
            // The session that keeps the node was given up: the claim is the server's to end.
            self.shared.forget(&entry);
            entry.slot.abort_tasks();
            return Ok(false);
        }
        // A read alone could be answered by a follower cut off from the leader, which may be
        // expiring this session meanwhile; the `sync` goes through the leader.
        let found = self
            .renewals
            .call(NodeCheck {
                session: session.clone(),
                path: entry.path.clone(),
                parent: self.shared.parent(&lease.lock),
            })
            .await?;
        match found {
            Ok((synced, true)) => {
                // Read after the local lease ran out (a stalled task): the node is given up,
                // not kept.
                if !entry.slot.extend(sent + ttl) {
                    return Ok(false);
                }
                entry.count_from(session.counted_from(synced, ttl));
                Ok(true)
            }
            Ok((_, false)) | Err(zk::Error::SessionExpired) => {
                self.shared.forget(&entry);
                entry.slot.abort_tasks();
                Ok(false)
            }
            Err(e) => Err(map_err(e)),
        }
    }

    /// ZooKeeper's leader counts a session from the last sign of life a follower relayed to it,
    /// which may be older than the request that renewed. A place gone since its answer (its
    /// session ended meanwhile) has none to count from: its claim is counted from a day before
    /// the call, so it is none (on a host up for less than a day, from the boot: a claim only on
    /// a host up for less than a lease, and never longer than one counted from the call).
    fn counted_from(&self, lease: &Lease, sent: BootInstant) -> BootInstant {
        match self.held(lease) {
            Some(entry) => entry
                .counted_from
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .map_or(sent, |from| from.min(sent)),
            None => sent - crate::MAX_LEASE_DURATION,
        }
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let Some(entry) = self.held(lease) else {
            return Ok(false);
        };
        entry.slot.abort_tasks();
        let released = self.shared.leave(&entry).await?;
        if released {
            self.shared.lines.releases.bump(&lease.lock);
        }
        Ok(released)
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        super::observe(&*self.shared, lock).await
    }

    /// The session's timeout: ZooKeeper deletes a dead holder's node only when it ends.
    fn enforced_lease(&self, _lock: &str) -> Option<Duration> {
        let session = self.shared.session.try_lock().ok()?;
        session.as_ref().map(|s| s.timeout)
    }

    async fn abandon(&self, lock: &str, identity: &str) {
        super::abandon(&*self.shared, lock, identity).await;
    }

    // Sessions are kept alive by the client's own pings, whatever the waiters' poll.
    super::fair_queue_hints!();

    async fn ping(&self) -> Result<()> {
        let session = self.shared.any_session().await?;
        session
            .client
            .check_stat("/")
            .await
            .map(|_| ())
            .map_err(map_err)
    }
}

#[async_trait]
impl Upkeep for ZooKeeperDriver {
    /// A key's parent with a node under it has a holder: its lowest. The root's children are
    /// listed once, then each of the family's parents is asked for its count, many at a time.
    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        const AT_ONCE: usize = 256;
        let session = self.shared.any_session().await?;
        let client = &session.client;
        let keys: Vec<String> = match client.list_children(&self.shared.config.root).await {
            Ok(children) => children
                .into_iter()
                .filter(|lock| crate::names::family_of(lock) == Some(family))
                .collect(),
            Err(zk::Error::NoNode) => return Ok(Some(0)),
            Err(e) => return Err(map_err(e)),
        };
        let mut held = 0;
        for chunk in keys.chunks(AT_ONCE) {
            let stats = futures_util::future::join_all(
                chunk
                    .iter()
                    .map(|lock| client.check_stat(&self.shared.parent(lock))),
            )
            .await;
            for stat in stats {
                // A parent gone meanwhile (a container the server deleted) is not held.
                if stat.map_err(map_err)?.is_some_and(|s| s.num_children > 0) {
                    held += 1;
                }
            }
        }
        Ok(Some(held))
    }

    /// As [`Upkeep::deprovision`], in one multi-operation whose first step deletes this
    /// holding's node: should it be gone (the session ended, another first in line now),
    /// nothing is deleted.
    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        let Some(entry) = self.held(lease) else {
            return crate::driver::deleted_as_released(lease, false);
        };
        entry.slot.abort_tasks();
        let session = self.shared.any_session().await?;
        let client = &session.client;
        let parent = self.shared.parent(&lease.lock);
        let children = match client.list_children(&parent).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => Vec::new(),
            Err(e) => return Err(map_err(e)),
        };
        let mut deletion = client.new_multi_writer();
        deletion.add_delete(&entry.path, None).map_err(map_err)?;
        for child in children {
            let path = format!("{parent}/{child}");
            if path != entry.path {
                deletion.add_delete(&path, None).map_err(map_err)?;
            }
        }
        deletion.add_delete(&parent, None).map_err(map_err)?;
        match deletion.commit().await {
            Ok(_) => {
                self.shared.forget(&entry);
                Ok(())
            }
            Err(zk::MultiWriteError::OperationFailed {
                index: 0,
                source: zk::Error::NoNode,
            }) => {
                self.shared.forget(&entry);
                crate::driver::deleted_as_released(lease, false)
            }
            Err(e) => Err(map_err(e.into())),
        }
    }

    /// The lock's parent node and the contenders' nodes under it (whose sessions then find
    /// their node gone and stop claiming).
    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        let session = self.shared.any_session().await?;
        let client = &session.client;
        for lock in locks {
            let parent = self.shared.parent(lock);
            let children = match client.list_children(&parent).await {
                Ok(children) => children,
                Err(zk::Error::NoNode) => continue,
                Err(e) => return Err(map_err(e)),
            };
            for child in children {
                match client.delete(&format!("{parent}/{child}"), None).await {
                    Ok(()) | Err(zk::Error::NoNode) => {}
                    Err(e) => return Err(map_err(e)),
                }
            }
            match client.delete(&parent, None).await {
                Ok(()) | Err(zk::Error::NoNode) => {}
                Err(e) => return Err(map_err(e)),
            }
        }
        Ok(())
    }

    /// Create the root path and each lock's parent node.
    async fn provision(&self, locks: &[String]) -> Result<()> {
        let session = self.shared.any_session().await?;
        self.shared
            .provisioned
            .get_or_try_init(|| async {
                let options = zk::CreateMode::Persistent.with_acls(self.shared.acls());
                match session
                    .client
                    .mkdir(&self.shared.config.root, &options)
                    .await
                {
                    Ok(()) | Err(zk::Error::NodeExists) => Ok(()),
                    Err(e) => Err(map_err(e)),
                }
            })
            .await?;
        for lock in locks {
            self.shared.ensure_parent(&session.client, lock).await?;
        }
        Ok(())
    }
}

/// The client's TLS settings from `tls`'s PEM documents, read now so that a missing or bad file
/// says so at start. The servers are verified against the CA given (`zks://` requires one).
fn tls_options(tls: &Tls) -> Result<zk::TlsOptions> {
    let invalid = |field: &'static str, e: zk::Error| Error::InvalidConfig {
        field,
        reason: format!("not usable for TLS to ZooKeeper: {e}"),
    };
    let Some(ca) = &tls.ca else {
        return Err(Error::InvalidConfig {
            field: "ca",
            reason: "TLS to ZooKeeper needs the CA that signed the servers' certificates".into(),
        });
    };
    let mut options = zk::TlsOptions::new()
        .with_pem_ca(&ca.read("ca")?)
        .map_err(|e| invalid("ca", e))?;
    if let Some((cert, key)) = &tls.client {
        options = options
            .with_pem_identity(&cert.read("cert")?, &key.read("key")?)
            .map_err(|e| invalid("cert", e))?;
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(sequences: &[i64]) -> Vec<i64> {
        let mut queue: Vec<(i64, String)> = sequences
            .iter()
            .map(|s| (*s, format!("_c_0-lock-{s:010}")))
            .collect();
        in_creation_order(&mut queue);
        queue.into_iter().map(|(s, _)| s).collect()
    }

    /// ZooKeeper's counter goes on from 2147483647 to -2147483648: a node made after that
    /// stands behind the holder made before it, not first in line beside it.
    #[test]
    fn nodes_made_after_the_counter_wraps_stand_behind_those_made_before() {
        let (max, min) = (i64::from(i32::MAX), i64::from(i32::MIN));
        assert_eq!(order(&[min, max, max - 1]), [max - 1, max, min]);
        assert_eq!(order(&[min + 1, min, max]), [max, min, min + 1]);
        // And from -1 to 0.
        assert_eq!(order(&[1, 0, -1, -2]), [-2, -1, 0, 1]);
        assert_eq!(order(&[12, 3, 7]), [3, 7, 12]);
        assert_eq!(order(&[]), Vec::<i64>::new());
        assert_eq!(order(&[5]), [5]);
        // A queue that spans more than a quarter of the counter, across the wrap.
        let quarter = 1i64 << 30;
        assert_eq!(order(&[quarter + 5, -1, 5]), [-1, 5, quarter + 5]);
        assert!(made_before(max, min) && !made_before(min, max));
        assert!(made_before(-1, 0) && made_before(3, 7) && !made_before(7, 3));
    }

    /// A process stopped or starved for most of its session sends nothing meanwhile, not even
    /// the client library's pings: a renewal's `sync` that reaches the leader after that dates
    /// the claim from the last request answered before the stall, so the claim ends before the
    /// leader can expire the session and another can take the lock.
    #[test]
    fn a_claim_after_a_stall_ends_before_the_leader_can_expire_the_session() {
        let (timeout, tick, lease) = (
            Duration::from_secs(10),
            Duration::from_millis(100),
            Duration::from_secs(10),
        );
        let opened = BootInstant::now();
        let last_sent = opened + Duration::from_secs(1);
        let mut answers = Answers::default();
        answers.note(
            last_sent,
            last_sent + Duration::from_millis(5),
            timeout,
            tick,
        );
        // Stalled 7 s, then a renewal: its `sync` reaches the leader, whose count of the session
        // may still start at the last request, 7 s before.
        let synced = last_sent + Duration::from_secs(7);
        let relayed = answers.relayed_before(synced, tick).unwrap();
        let claim_end = claim_counted_from(relayed, timeout, lease) + lease;
        let expirable_from = last_sent + timeout;
        assert!(
            claim_end <= expirable_from,
            "the claim ends {:?} after the leader may expire the session",
            claim_end.saturating_duration_since(expirable_from)
        );
    }

    /// A server whose `minSessionTimeout` is above the lease grants a longer session; a server
    /// the client reconnects to may grant no more than the lease. Claims count on the lease.
    #[test]
    fn a_session_granted_above_its_leases_is_counted_as_kept_for_the_longest() {
        let secs = Duration::from_secs;
        assert_eq!(surely_kept_for(secs(20), secs(10)), secs(10));
        // Reused for a longer lease, up to what the server granted.
        assert_eq!(surely_kept_for(secs(20), secs(15)), secs(15));
        assert_eq!(surely_kept_for(secs(20), secs(30)), secs(20));
        // A session a call opened with the default timeout counts for the lease asked for.
        assert_eq!(surely_kept_for(secs(15), secs(10)), secs(10));
        // A lease under the shortest session opened: that session counts.
        let short = Duration::from_millis(200);
        assert_eq!(surely_kept_for(secs(4), short), secs(1));
        assert_eq!(surely_kept_for(secs(4), Duration::ZERO), secs(1));
    }

    /// A burst of calls within a tick does not push out the answer that dates the claims of
    /// `sync`s sent during it: the burst's own answers are too recent to date them.
    #[test]
    fn a_burst_of_answers_keeps_the_one_that_dates_claims() {
        let (timeout, tick) = (Duration::from_secs(1), Duration::from_millis(100));
        let start = BootInstant::now();
        let mut answers = Answers::default();
        answers.note(start, start + Duration::from_millis(2), timeout, tick);
        let burst = start + Duration::from_millis(90);
        for i in 0..1000 {
            let sent = burst + Duration::from_micros(50 * i);
            answers.note(sent, sent + Duration::from_millis(1), timeout, tick);
        }
        let synced = start + Duration::from_millis(150);
        assert_eq!(answers.relayed_before(synced, tick), Some(start));
        // Once the burst is a tick old, its newest answer dates claims, and the first is let go.
        let later = burst + Duration::from_millis(50) + tick + Duration::from_millis(5);
        assert!(answers.relayed_before(later, tick).unwrap() > burst);
        assert!(answers.0.len() <= ANSWERS_KEPT);
        let much_later = later + timeout + tick * 2;
        answers.note(much_later, much_later, timeout, tick);
        assert!(answers.0.front().unwrap().0 > start);
    }
}
