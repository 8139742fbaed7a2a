//! SQL waiters woken by a lock the holder keeps inside the database server: MySQL/MariaDB's
//! named locks (`GET_LOCK`), in both modes, and PostgreSQL's session advisory locks
//! (`pg_advisory_lock`), in lease mode. A release hands the lock over in milliseconds, where
//! polling the row took a fifth of the renew interval.
//!
//! Each lock has a server-wide lock of its own, which the holding process keeps on a session of
//! its own for as long as it holds. A waiting process blocks on it on such a session, a step at a
//! time; when the holder lets it go (or its session ends) the server grants it to one waiter,
//! which keeps it, as the next in line, until it holds the row (and keeps it then) or stops
//! waiting. So a release wakes one waiter per process, with no herd.
//!
//! - **MySQL**: the granted waiter's engine is woken to try the lease row, one statement more.
//!   In lease mode the holder frees the row on its named lock's session, in the statement that
//!   lets the named lock go before its commit, so the waiter's `UPDATE` waits inside the server
//!   for that commit rather than for one more round trip.
//! - **PostgreSQL**: the waiter's blocking statement is its acquisition. It takes the advisory
//!   lock, then the row, in one statement. The holder lets go in its release statement, on its
//!   advisory lock's session, so the waiter is woken inside the server while that statement runs
//!   (its insertion then waits for the release's commit). A row taken so is kept for the
//!   waiter's engine ([`ServerLocks::take_woken`]), which claims it from the blocking
//!   statement's send ([`ServerLocks::counted_from`]): the row was written after it, so the
//!   claim ends no later than the row. The server's wall clock, which may step, cannot say when
//!   the write was. A statement that blocked for more than [`UNEXTENDED_SHARE`]'s share of the
//!   lease (a wait step is two seconds) would shorten the claim by as much, so its row is
//!   extended first, one round trip more, and claimed from the extension's send. A row nobody
//!   claims within [`WOKEN_KEPT`] is released. A family's keys keep to `NOTIFY` instead (see
//!   `SqlDriver::server_lock`).
//!
//! A holding engine that stops claiming without telling the driver (its lease ran out while it
//! was paused) would keep the server lock for good; so a held one checks every
//! [`HOLDING_CHECK`] that the row still names its holder and token.
//!
//! A wake-up is only a hint: the lease row, with its expiry by the database's clock, decides. A
//! waiter woken by a holder whose session died while its lease runs finds the row still leased
//! and waits out the lease as before; when a session cannot be had, waiters poll the row (and on
//! PostgreSQL hear `NOTIFY`).
//!
//! A process keeps at most [`NAMED_LOCK_SESSIONS`] such sessions: a sidecar holding thousands of
//! a family's keys would otherwise take every connection the server allows (151 by default on
//! MySQL and MariaDB, 100 on PostgreSQL) from every other client. A lock held beyond them keeps
//! no server lock; a lock waited for beyond them gets a session when one frees up, and its
//! waiters here read the row every [`WAIT_STEP_SECS`] meanwhile. A waiter elsewhere that finds a
//! held lock's server lock free (its holder has none) holds it as the next in line and reads the
//! row as often, so a release is noticed within that step rather than at the next renew
//! interval.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{AnyConnection, Row};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use crate::boot_clock::BootInstant;
use crate::driver::{ChangeFeeds, Lease};
use crate::drivers::sql::pool::{RESPONSE_TIMEOUT, answered};

/// How long one blocking wait lasts before the waiter looks whether it is still wanted. With the
/// row read once per renew interval besides, an idle waiter costs the server fewer requests than
/// the five row reads per interval it took before.
const WAIT_STEP_SECS: u32 = 2;
const WAIT_STEP: Duration = Duration::from_secs(WAIT_STEP_SECS as u64);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// After a failed session, before the next try.
const RETRY_PAUSE: Duration = Duration::from_secs(1);
/// How often a held server lock checks that the row is still its process's: an engine that
/// stops claiming without a word to the driver (its lease ran out while it was paused) must not
/// keep the server lock, and with it every waiter's wake-up, for good.
pub const HOLDING_CHECK: Duration = Duration::from_secs(30);
/// How long a row taken in a waiter's blocking statement (PostgreSQL) is kept for its engine,
/// which was woken to claim it at once; past this nobody wants it, and it is released.
const WOKEN_KEPT: Duration = Duration::from_secs(1);
/// How long a release waits for its lock's task to carry it out on the server lock's session.
const RELEASE_PATIENCE: Duration = Duration::from_millis(500);
/// Sessions kept after their lock's task ends, so that the next holding or wait does not
/// connect again (a keyed family takes a lock per acquisition).
const SPARE_SESSIONS: usize = 4;
/// The most server-lock sessions one process keeps open, spares included.
pub const NAMED_LOCK_SESSIONS: usize = 16;
/// A row a blocking statement took after waiting at most this share of the lease (1/N) is
/// claimed from the statement's send, which came before the row's write: the claim is that much
/// shorter, and the hand-over spares the extension's round trip. One that waited longer is
/// extended first ([`ServerLocks::extend_woken`]).
const UNEXTENDED_SHARE: u32 = 10;
/// PostgreSQL's error for a lock wait past `lock_timeout`: a waiter's step that ended.
const PG_LOCK_NOT_AVAILABLE: &str = "55P03";

/// PostgreSQL's statements on an advisory-lock session (see [`crate::drivers::sql::Dialect`]).
#[derive(Clone)]
pub(crate) struct AdvisoryStatements {
    /// Block on the advisory lock a step, then take the row if free: `$1` lock, `$2` holder,
    /// `$3` lease in ms, `$4` advisory key; returns `token`.
    pub acquire: String,
    /// Extend the row the blocking statement took: `$1` lock, `$2` holder, `$3` lease in ms,
    /// `$4` token.
    pub extend: String,
    /// Free the row if still held as `$2` with token `$3`, and let the advisory key `$4` go in
    /// the same statement; returns `released`.
    pub release: String,
}

/// The kind of lock the server keeps for each lease lock.
pub(crate) enum ServerLock {
    /// MySQL/MariaDB: `GET_LOCK` on a name of 64 characters at most; in lease mode, with the
    /// release that lets it go as it frees the row ([`super::Statements::named_release`]).
    Named(Option<String>),
    /// PostgreSQL: a session advisory lock on a 64-bit key.
    Advisory(AdvisoryStatements),
}

/// A server lock's session, and its place among the process's [`NAMED_LOCK_SESSIONS`].
struct Session {
    conn: AnyConnection,
    _permit: OwnedSemaphorePermit,
}

/// Who waits here, for a PostgreSQL waiter's statement to take the row for.
#[derive(Clone)]
struct Waiter {
    identity: String,
    ttl: Duration,
}

/// What the driver tells a lock's task.
enum Message {
    /// This process holds the lock now, as this holder with this token.
    Held(String, u64),
    /// It no longer holds it as this holder with this token. About an earlier holding (a late
    /// call of an engine whose claim ran out), it leaves the later one and its server lock be.
    LetGo(String, u64),
    /// This holder waits for the lock here, for a lease this long.
    Waiting(Waiter),
    /// Release this lease on the server lock's session (PostgreSQL, MySQL in lease mode); `None`
    /// back when the task does not hold the lock's server lock for it (nor for a lease it
    /// holds now, which keeps its server lock), and the pool is to release it.
    Release(Lease, oneshot::Sender<Option<Result<bool, sqlx::Error>>>),
}

/// One step of a waiter's blocking wait.
enum Step {
    /// The server lock is this session's; the row is to be tried.
    Granted,
    NotGranted,
    /// PostgreSQL: the server lock is this session's, and the row was taken for the waiter.
    Took(Woken),
}

/// A row a waiter's blocking statement took, kept for its engine.
struct Woken {
    lease: Lease,
    ttl: Duration,
    counted_from: BootInstant,
    at: Instant,
}

/// What a lock's task tells itself about the lock: whether this process holds it, as which
/// lease, and who waits here.
#[derive(Default)]
struct View {
    holding: bool,
    lease: Option<(String, u64)>,
    waiter: Option<Waiter>,
}

impl View {
    /// Whether the lease last held here is `identity`'s with `token`.
    fn is(&self, identity: &str, token: u64) -> bool {
        self.lease
            .as_ref()
            .is_some_and(|(i, t)| i == identity && *t == token)
    }

    /// Apply the driver's message; a release the task cannot carry out here is answered so.
    fn apply(&mut self, message: Message) {
        match message {
            Message::Held(identity, token) => {
                self.holding = true;
                self.lease = Some((identity, token));
                // Its engine no longer waits; the next waiter here says so when it does.
                self.waiter = None;
            }
            Message::LetGo(identity, token) => {
                if self.is(&identity, token) {
                    self.holding = false;
                }
            }
            Message::Waiting(waiter) => self.waiter = Some(waiter),
            Message::Release(_, reply) => {
                let _ = reply.send(None);
            }
        }
    }
}

pub(crate) struct ServerLocks {
    kind: ServerLock,
    url: String,
    /// The lock table's database, schema and name ([`wake_place`]).
    place: String,
    /// The dialect's read of a lock's live holder and token (the lock's name bound first).
    observe: String,
    feeds: Arc<ChangeFeeds>,
    tasks: Mutex<HashMap<String, mpsc::UnboundedSender<Message>>>,
    spares: Mutex<Vec<Session>>,
    sessions: Arc<Semaphore>,
    /// PostgreSQL: rows taken by waiters' statements, not yet claimed by their engines.
    woken: Mutex<HashMap<String, Woken>>,
    /// PostgreSQL: the instants claims of rows taken so count from, by lock and token, until
    /// their first renewal.
    counted: Mutex<HashMap<String, (u64, BootInstant)>>,
    /// PostgreSQL: locks whose waiter here is blocked in the server, and whether a `NOTIFY` of
    /// a release came meanwhile (which the blocked statement may not have been woken by).
    blocked: Mutex<HashMap<String, bool>>,
    /// Locks whose task keeps the server lock for this process's holder and waits for the
    /// driver's word: a release sent to it is carried out at once ([`ServerLocks::release`]).
    ready: Mutex<std::collections::HashSet<String>>,
}

impl ServerLocks {
    pub(crate) fn new(
        kind: ServerLock,
        url: &str,
        place: &str,
        observe: &str,
        feeds: Arc<ChangeFeeds>,
    ) -> Arc<Self> {
        Arc::new(Self {
            kind,
            url: url.to_owned(),
            place: place.to_owned(),
            observe: observe.to_owned(),
            feeds,
            tasks: Mutex::new(HashMap::new()),
            spares: Mutex::new(Vec::new()),
            sessions: Arc::new(Semaphore::new(NAMED_LOCK_SESSIONS)),
            woken: Mutex::new(HashMap::new()),
            counted: Mutex::new(HashMap::new()),
            blocked: Mutex::new(HashMap::new()),
            ready: Mutex::new(std::collections::HashSet::new()),
        })
    }

    /// Send `message` to `lock`'s task, starting it when there is none.
    fn tell(self: &Arc<Self>, lock: &str, message: Option<Message>) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(task) = tasks.get(lock) {
            match message {
                None => return,
                Some(message) => match task.send(message) {
                    Ok(()) => return,
                    // The task ended a moment ago: start another.
                    Err(mpsc::error::SendError(message)) => {
                        tasks.remove(lock);
                        return self.start(&mut tasks, lock, Some(message));
                    }
                },
            }
        }
        self.start(&mut tasks, lock, message);
    }

    fn start(
        self: &Arc<Self>,
        tasks: &mut HashMap<String, mpsc::UnboundedSender<Message>>,
        lock: &str,
        first: Option<Message>,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Some(first) = first {
            let _ = tx.send(first);
        }
        tasks.insert(lock.to_owned(), tx);
        tokio::spawn(self.clone().run(lock.to_owned(), rx));
    }

    fn running(&self, lock: &str) -> bool {
        self.tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(lock)
    }

    /// Whether `lock`'s task keeps the server lock for the holder here and waits for the
    /// driver's word, so that a release sent to it does not wait behind a connection or a retry.
    fn ready_to_release(&self, lock: &str) -> bool {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(lock)
    }

    fn set_ready(&self, lock: &str, ready: bool) {
        let mut all = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        if ready {
            all.insert(lock.to_owned());
        } else {
            all.remove(lock);
        }
    }

    /// This process holds `lock` now: keep its server lock until it lets go. Not when all the
    /// process's sessions are taken and the lock has no task yet: the holding goes without a
    /// server lock, and without a task, which a sidecar holding thousands of keys would pay for
    /// in memory (waiters elsewhere read the row every step as the next in line).
    pub(crate) fn held(self: &Arc<Self>, lock: &str, identity: &str, token: u64) {
        let spare = !self
            .spares
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
        if self.running(lock) || spare || self.sessions.available_permits() > 0 {
            self.tell(lock, Some(Message::Held(identity.to_owned(), token)));
        }
    }

    /// This process no longer holds `lock` as `identity` with `token`.
    pub(crate) fn let_go(self: &Arc<Self>, lock: &str, identity: &str, token: u64) {
        if self.running(lock) {
            self.tell(lock, Some(Message::LetGo(identity.to_owned(), token)));
        }
    }

    /// `identity` of this process waits for `lock`, with leases of `ttl`.
    pub(crate) fn watch(self: &Arc<Self>, lock: &str, identity: &str, ttl: Duration) {
        let waiter = Waiter {
            identity: identity.to_owned(),
            ttl,
        };
        self.tell(lock, Some(Message::Waiting(waiter)));
    }

    /// Release `lease` on its server lock's session, letting the server lock go in the same
    /// statement (PostgreSQL, MySQL in lease mode): the next waiter is woken inside the server
    /// a round trip sooner. `None`: this process keeps no server lock for it, or releases
    /// elsewhere, and the pool is to release it.
    pub(crate) async fn release(
        self: &Arc<Self>,
        lease: &Lease,
    ) -> Option<Result<bool, sqlx::Error>> {
        self.forget_counted(lease);
        let here = matches!(
            self.kind,
            ServerLock::Advisory(_) | ServerLock::Named(Some(_))
        );
        if !here || !self.ready_to_release(&lease.lock) {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        self.tell(&lease.lock, Some(Message::Release(lease.clone(), tx)));
        // A task busy elsewhere (connecting) leaves the release to the pool; its own release
        // statement, when it comes to it, then matches no row and lets the server lock go.
        tokio::time::timeout(RELEASE_PATIENCE, rx)
            .await
            .ok()?
            .ok()
            .flatten()
    }

    /// A row a waiter's statement took for `identity` with leases of `ttl`, which its engine now
    /// claims; the task goes on keeping the server lock as the holder's.
    pub(crate) fn take_woken(
        self: &Arc<Self>,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Option<Lease> {
        let woken = {
            let mut all = self.woken.lock().unwrap_or_else(|e| e.into_inner());
            match all.get(lock) {
                Some(w) if w.lease.identity == identity && w.ttl == ttl => all.remove(lock)?,
                _ => return None,
            }
        };
        self.counted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(lock.to_owned(), (woken.lease.token, woken.counted_from));
        self.held(lock, identity, woken.lease.token);
        Some(woken.lease)
    }

    /// From when the database counts `lease`, acquired or renewed by a call sent at `sent`: a
    /// row taken in a blocking statement counts from its extension's send.
    pub(crate) fn counted_from(&self, lease: &Lease, sent: BootInstant) -> BootInstant {
        let counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
        match counted.get(&lease.lock) {
            Some((token, from)) if *token == lease.token => sent.min(*from),
            _ => sent,
        }
    }

    /// `lease` was renewed or released: its claims count from their own calls again. Only
    /// `lease`'s own entry goes: a late call about an earlier lease of the lock (an attempt
    /// given back after its answer came too late) leaves the woken row's claim counted from its
    /// blocking statement, which the row's expiry is counted from.
    pub(crate) fn forget_counted(&self, lease: &Lease) {
        let mut counted = self.counted.lock().unwrap_or_else(|e| e.into_inner());
        if counted
            .get(&lease.lock)
            .is_some_and(|(token, _)| *token == lease.token)
        {
            counted.remove(&lease.lock);
        }
    }

    /// A `NOTIFY` of `lock`'s release came: whether a waiter here is blocked in the server,
    /// which the release wakes there (the feed is not bumped, or its engine would try the row
    /// beside the statement that takes it).
    pub(crate) fn heard_release(&self, lock: &str) -> bool {
        let mut blocked = self.blocked.lock().unwrap_or_else(|e| e.into_inner());
        match blocked.get_mut(lock) {
            Some(notified) => {
                *notified = true;
                true
            }
            None => false,
        }
    }

    fn waited(&self, lock: &str) -> bool {
        self.feeds.is_subscribed(lock)
    }

    async fn connect(&self, permit: OwnedSemaphorePermit) -> Option<Session> {
        let connecting = async {
            // A PostgreSQL waiter claims the row in its blocking statement, and a MySQL
            // release frees the row on this session: their writes are the driver's own.
            let dialect = match self.kind {
                ServerLock::Advisory(_) => super::Dialect::Postgres,
                ServerLock::Named(_) => super::Dialect::MySql,
            };
            let mut conn = super::open_session(&self.url, dialect).await?;
            if let ServerLock::Advisory(_) = self.kind {
                // A waiter's statement blocks a step at a time.
                sqlx::query(&format!("SET lock_timeout = {}", WAIT_STEP.as_millis()))
                    .execute(&mut conn)
                    .await?;
            }
            Ok::<_, sqlx::Error>(conn)
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(Ok(conn)) => Some(Session {
                conn,
                _permit: permit,
            }),
            Ok(Err(e)) => {
                tracing::debug!(error = %crate::redact::redact(&e.to_string()), "no session for a server lock");
                None
            }
            Err(_) => None,
        }
    }

    /// One lock's task: its session, whether the server lock is this process's, and whether the
    /// process holds the lock. Ends when the lock is neither held nor waited for here.
    async fn run(self: Arc<Self>, lock: String, mut messages: mpsc::UnboundedReceiver<Message>) {
        let mut session = self.spares.lock().unwrap_or_else(|e| e.into_inner()).pop();
        // A spare may have gone stale (a server restart): its failure is retried at once.
        let mut spare = session.is_some();
        let mut locked = false;
        let mut view = View::default();
        // When a held server lock next checks the row: a deadline, not a timer begun anew each
        // time round, which the messages of waiters here asking again and again would keep
        // putting off for good.
        let mut holding_check: Option<Instant> = None;
        let _ready = Ready {
            locks: self.clone(),
            lock: lock.clone(),
        };
        loop {
            self.set_ready(&lock, false);
            // Everything the driver said so far, up to a release this task can carry out, which
            // is carried out before anything said after it.
            let mut release = None;
            while release.is_none()
                && let Ok(message) = messages.try_recv()
            {
                match message {
                    Message::Release(lease, reply)
                        if locked
                            && view.holding
                            && view.is(&lease.identity, lease.token)
                            && session.is_some() =>
                    {
                        release = Some((lease, reply));
                    }
                    message => view.apply(message),
                }
            }
            let wanted = view.holding || self.waited(&lock);
            if !wanted {
                let mut clean = !locked;
                if locked && let Some(session) = &mut session {
                    clean = answered(RESPONSE_TIMEOUT, self.let_go_here(&mut session.conn, &lock))
                        .await
                        .is_ok();
                }
                locked = false;
                let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
                // A message or a waiter that came meanwhile keeps the task.
                if messages.is_empty() && !self.waited(&lock) {
                    tasks.remove(&lock);
                    drop(tasks);
                    if let Some(session) = session.filter(|_| clean) {
                        let mut spares = self.spares.lock().unwrap_or_else(|e| e.into_inner());
                        // Not while other locks wait for a session: it is theirs.
                        if spares.len() < SPARE_SESSIONS && self.sessions.available_permits() > 0 {
                            spares.push(session);
                        }
                    }
                    return;
                }
                continue;
            }
            if session.is_none() {
                locked = false;
                let permit = match self.sessions.clone().try_acquire_owned() {
                    Ok(permit) => permit,
                    // All the process's sessions are taken: wait for one, and meanwhile let
                    // the waiters here read the row every step (a lock only held here waits
                    // without a timer: a sidecar may hold thousands of them).
                    Err(_) => {
                        let waited = !view.holding && self.waited(&lock);
                        tokio::select! {
                            message = messages.recv() => match message {
                                Some(message) => view.apply(message),
                                None => return,
                            },
                            permit = self.sessions.clone().acquire_owned() => {
                                if let Ok(permit) = permit {
                                    session = self.connect(permit).await;
                                }
                            }
                            () = tokio::time::sleep(WAIT_STEP), if waited => {
                                self.feeds.bump(&lock);
                            }
                        }
                        continue;
                    }
                };
                session = self.connect(permit).await;
                if session.is_none() {
                    tokio::time::sleep(RETRY_PAUSE).await;
                    continue;
                }
            }
            let conn = &mut session.as_mut().expect("a session").conn;
            if release.is_some() || !(locked && view.holding) {
                holding_check = None;
            }
            let outcome = if let Some((lease, reply)) = release {
                view.holding = false;
                locked = false;
                answered(RESPONSE_TIMEOUT, self.release_for(conn, &lease, reply)).await
            } else if locked && view.holding {
                // Ours, and held: nothing to do until the driver speaks, but look now and then
                // whether the row still says so.
                self.set_ready(&lock, true);
                let check_at = *holding_check.get_or_insert_with(|| Instant::now() + HOLDING_CHECK);
                tokio::select! {
                    message = messages.recv() => match message {
                        Some(Message::LetGo(identity, token)) if view.is(&identity, token) => {
                            view.holding = false;
                            // The release's whole point: the next waiter goes now.
                            let released = answered(RESPONSE_TIMEOUT, self.let_go_of(conn, &lock)).await;
                            locked = false;
                            released
                        }
                        Some(Message::Release(lease, reply))
                            if view.is(&lease.identity, lease.token) =>
                        {
                            view.holding = false;
                            locked = false;
                            answered(RESPONSE_TIMEOUT, self.release_for(conn, &lease, reply)).await
                        }
                        Some(message) => {
                            view.apply(message);
                            Ok(())
                        }
                        None => return,
                    },
                    () = tokio::time::sleep_until(check_at) => {
                        holding_check = None;
                        match answered(RESPONSE_TIMEOUT, self.still_held(conn, &lock, view.lease.as_ref())).await {
                            Ok(still) => {
                                view.holding = still;
                                Ok(())
                            }
                            Err(e) => Err(e),
                        }
                    }
                }
            } else if locked {
                // Ours as the next in line: the holder has no server lock (beyond its process's
                // sessions, or its session gone), so no release would wake us. The engine reads
                // the row every step, and at the lease's end. A row taken for an engine here
                // waits for it to claim it, a moment.
                let kept = self.woken_left(&lock);
                tokio::select! {
                    message = messages.recv() => match message {
                        Some(message) => {
                            view.apply(message);
                            Ok(())
                        }
                        None => return,
                    },
                    () = tokio::time::sleep(kept.unwrap_or(WAIT_STEP)) => {
                        if kept.is_some() {
                            // Unclaimed: release it, and the server lock with it.
                            let unclaimed = answered(RESPONSE_TIMEOUT, self.let_go_here(conn, &lock)).await;
                            locked = false;
                            unclaimed
                        } else {
                            self.feeds.bump(&lock);
                            Ok(())
                        }
                    }
                }
            } else if view.holding {
                // Held: take the server lock at once if free.
                match answered(RESPONSE_TIMEOUT, self.take_now(conn, &lock)).await {
                    Ok(true) => {
                        locked = true;
                        Ok(())
                    }
                    Ok(false) => {
                        // Another session has it (a waiter between its wake-up and its try):
                        // wait for the driver rather than spin.
                        match messages.recv().await {
                            Some(message) => view.apply(message),
                            None => return,
                        }
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            } else {
                // Waiting: block a step for the holder to let go.
                self.blocked
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(lock.clone(), false);
                let step = answered(
                    WAIT_STEP + 2 * RESPONSE_TIMEOUT,
                    self.wait_step(conn, &lock, view.waiter.as_ref()),
                )
                .await;
                let notified = self
                    .blocked
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&lock)
                    .unwrap_or(false);
                match step {
                    Ok(Step::Granted) => {
                        locked = true;
                        self.feeds.bump(&lock);
                        Ok(())
                    }
                    Ok(Step::Took(woken)) => {
                        locked = true;
                        // Its engine is told to claim it, and waits no more.
                        view.waiter = None;
                        self.woken
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(lock.clone(), woken);
                        self.feeds.bump(&lock);
                        Ok(())
                    }
                    Ok(Step::NotGranted) => {
                        if notified {
                            self.feeds.bump(&lock);
                        }
                        Ok(())
                    }
                    Err(e) => {
                        self.feeds.bump(&lock);
                        Err(e)
                    }
                }
            };
            match outcome {
                Ok(()) => spare = false,
                Err(_) if std::mem::take(&mut spare) => {
                    session = None;
                    locked = false;
                }
                Err(e) => {
                    tracing::debug!(lock, error = %e, "server-lock session failed; waiters poll meanwhile");
                    session = None;
                    locked = false;
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    /// How much longer the row taken for an engine here is kept for it, if there is one.
    fn woken_left(&self, lock: &str) -> Option<Duration> {
        let woken = self.woken.lock().unwrap_or_else(|e| e.into_inner());
        woken
            .get(lock)
            .map(|w| (w.at + WOKEN_KEPT).saturating_duration_since(Instant::now()))
    }

    /// Let go of the server lock this session holds as the next in line, and of a row taken for
    /// an engine here that nobody claimed.
    async fn let_go_here(&self, conn: &mut AnyConnection, lock: &str) -> Result<(), sqlx::Error> {
        let unclaimed = self
            .woken
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(lock);
        match unclaimed {
            Some(woken) => self.release_here(conn, &woken.lease).await.map(|_| ()),
            None => self.let_go_of(conn, lock).await,
        }
    }
}

impl ServerLocks {
    /// The server-wide name of `lock`'s named lock (MySQL).
    fn name(&self, lock: &str) -> String {
        named_lock(&self.place, lock)
    }

    /// Take `lock`'s server lock if free, without waiting.
    async fn take_now(&self, conn: &mut AnyConnection, lock: &str) -> Result<bool, sqlx::Error> {
        match &self.kind {
            ServerLock::Named(_) => get(conn, &self.name(lock), 0).await,
            ServerLock::Advisory(_) => {
                // Nothing else held first: a waiter's step that timed out in its insertion (a
                // row locked past `lock_timeout`) leaves its advisory lock with the session.
                let row = sqlx::query(
                    "WITH cleared AS MATERIALIZED (SELECT pg_advisory_unlock_all()) \
                     SELECT pg_try_advisory_lock($1) AS got FROM cleared",
                )
                .bind(advisory_key(&self.place, lock))
                .fetch_one(conn)
                .await?;
                row.try_get::<bool, _>("got")
            }
        }
    }

    /// Wait a step for `lock`'s server lock; on PostgreSQL, with a waiter known, take the row
    /// for it in the same statement.
    async fn wait_step(
        &self,
        conn: &mut AnyConnection,
        lock: &str,
        waiter: Option<&Waiter>,
    ) -> Result<Step, sqlx::Error> {
        let granted = |got: bool| if got { Step::Granted } else { Step::NotGranted };
        let ServerLock::Advisory(sql) = &self.kind else {
            return get(conn, &self.name(lock), WAIT_STEP_SECS)
                .await
                .map(granted);
        };
        let key = advisory_key(&self.place, lock);
        let Some(waiter) = waiter else {
            return match sqlx::query("SELECT pg_advisory_lock($1)")
                .bind(key)
                .execute(conn)
                .await
            {
                Ok(_) => Ok(Step::Granted),
                Err(e) if lock_not_available(&e) => Ok(Step::NotGranted),
                Err(e) => Err(e),
            };
        };
        let query = sqlx::query(&sql.acquire)
            .bind(lock)
            .bind(&waiter.identity)
            .bind(i64::try_from(waiter.ttl.as_millis()).unwrap_or(i64::MAX))
            .bind(key);
        let sent = BootInstant::now();
        let rows = match query.fetch_all(&mut *conn).await {
            Ok(rows) => rows,
            Err(e) if lock_not_available(&e) => {
                // The step may have timed out on the row, granted the advisory lock, which
                // outlives the statement: let go of it, or it would stay with the session (a
                // spare, once nobody waits) and every waiter elsewhere would wait out a step.
                sqlx::query("SELECT pg_advisory_unlock_all()")
                    .execute(&mut *conn)
                    .await?;
                return Ok(Step::NotGranted);
            }
            Err(e) => return Err(e),
        };
        let Some(row) = rows.first() else {
            // Granted, and the row still held (its holder keeps no advisory lock, or its
            // lease runs on after its session died): the next in line.
            return Ok(Step::Granted);
        };
        let token = row.try_get::<i64, _>("token")? as u64;
        let lease = Lease {
            lock: lock.to_owned(),
            identity: waiter.identity.clone(),
            token,
        };
        // Blocked briefly, the statement's own send dates the claim closely enough (the row
        // was written after it), and the hand-over is a round trip shorter.
        let blocked = BootInstant::now().saturating_duration_since(sent);
        let counted_from = if blocked <= waiter.ttl / UNEXTENDED_SHARE {
            sent
        } else {
            match self.extend_woken(conn, sql, &lease, waiter.ttl).await {
                Ok(Some(extended)) => extended,
                // Taken from under it since (only a clock that jumped lets that happen): the
                // server lock is this session's, and the row is to be tried as the next in
                // line.
                Ok(None) => return Ok(Step::Granted),
                Err(e) => {
                    tracing::warn!(lock, error = %e, "extending a row taken by a blocking statement failed; its claim counts from that statement's send");
                    sent
                }
            }
        };
        Ok(Step::Took(Woken {
            lease,
            ttl: waiter.ttl,
            counted_from,
            at: Instant::now(),
        }))
    }

    /// Extend the row a blocking statement took for `lease`, and the instant its claim counts
    /// from: this statement's send. The blocking statement's own send came a wait step before
    /// the row's write, and the moment of the write cannot be had from the server's wall clock,
    /// which may step meanwhile; `None` when the row is no longer the lease's.
    async fn extend_woken(
        &self,
        conn: &mut AnyConnection,
        sql: &AdvisoryStatements,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Option<BootInstant>, sqlx::Error> {
        let sent = BootInstant::now();
        let done = sqlx::query(&sql.extend)
            .bind(&lease.lock)
            .bind(&lease.identity)
            .bind(i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX))
            .bind(i64::try_from(lease.token).unwrap_or(i64::MAX))
            .execute(conn)
            .await?;
        Ok((done.rows_affected() == 1).then_some(sent))
    }

    /// Let `lock`'s server lock go.
    async fn let_go_of(&self, conn: &mut AnyConnection, lock: &str) -> Result<(), sqlx::Error> {
        match &self.kind {
            ServerLock::Named(_) => {
                sqlx::query("SELECT RELEASE_LOCK(?) AS released")
                    .bind(self.name(lock))
                    .fetch_one(conn)
                    .await?;
            }
            ServerLock::Advisory(_) => {
                sqlx::query("SELECT pg_advisory_unlock($1) AS released")
                    .bind(advisory_key(&self.place, lock))
                    .fetch_one(conn)
                    .await?;
            }
        }
        Ok(())
    }

    /// Carry out the driver's release of `lease` here and answer it; not known let go, the
    /// session goes (an error), and the pool tries.
    async fn release_for(
        &self,
        conn: &mut AnyConnection,
        lease: &Lease,
        reply: oneshot::Sender<Option<Result<bool, sqlx::Error>>>,
    ) -> Result<(), sqlx::Error> {
        match self.release_here(conn, lease).await {
            Ok(released) => {
                let _ = reply.send(Some(Ok(released)));
                Ok(())
            }
            Err(e) => {
                let _ = reply.send(None);
                Err(e)
            }
        }
    }

    /// Release `lease`'s row and its server lock in one statement (PostgreSQL; MySQL in lease
    /// mode, where a row no longer the lease's leaves the named lock to one statement more).
    async fn release_here(
        &self,
        conn: &mut AnyConnection,
        lease: &Lease,
    ) -> Result<bool, sqlx::Error> {
        let token = i64::try_from(lease.token).unwrap_or(i64::MAX);
        let sql = match &self.kind {
            ServerLock::Advisory(sql) => sql,
            ServerLock::Named(Some(release)) => {
                let done = sqlx::query(release)
                    .bind(self.name(&lease.lock))
                    .bind(&lease.lock)
                    .bind(&lease.identity)
                    .bind(token)
                    .execute(&mut *conn)
                    .await?;
                let released = done.rows_affected() == 1;
                if !released {
                    self.let_go_of(conn, &lease.lock).await?;
                }
                return Ok(released);
            }
            ServerLock::Named(None) => {
                self.let_go_of(conn, &lease.lock).await?;
                return Ok(false);
            }
        };
        let row = sqlx::query(&sql.release)
            .bind(&lease.lock)
            .bind(&lease.identity)
            .bind(token)
            .bind(advisory_key(&self.place, &lease.lock))
            .fetch_one(conn)
            .await?;
        Ok(row.try_get::<i64, _>("released")? == 1)
    }

    /// Whether the row still shows `lease` as its live holder.
    async fn still_held(
        &self,
        conn: &mut AnyConnection,
        lock: &str,
        lease: Option<&(String, u64)>,
    ) -> Result<bool, sqlx::Error> {
        let Some((identity, token)) = lease else {
            return Ok(false);
        };
        let row = sqlx::query(&self.observe)
            .bind(lock)
            .fetch_optional(conn)
            .await?;
        Ok(match row {
            Some(row) => {
                row.try_get::<Option<String>, _>("holder")?.as_deref() == Some(identity.as_str())
                    && row.try_get::<i64, _>("token")? == i64::try_from(*token).unwrap_or(-1)
            }
            None => false,
        })
    }
}

fn lock_not_available(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == PG_LOCK_NOT_AVAILABLE)
}

fn digest(place: &str, lock: &str) -> [u8; 32] {
    Sha256::digest(format!("{place}\0{lock}").as_bytes()).into()
}

/// Where a lock table's locks live, for their server locks' names ([`named_lock`],
/// [`advisory_key`]): MySQL's named locks are one space per server and PostgreSQL's advisory
/// keys one per database, so the database and the schema are named beside the table; two apps'
/// locks of one name on one server then wake only their own waiters.
pub fn wake_place(database: &str, schema: Option<&str>, table: &str) -> String {
    format!("{database}/{}/{table}", schema.unwrap_or(""))
}

/// A lock's task's mark as ready to release ([`ServerLocks::ready_to_release`]), taken off
/// however the task ends.
struct Ready {
    locks: Arc<ServerLocks>,
    lock: String,
}

impl Drop for Ready {
    fn drop(&mut self) {
        self.locks.set_ready(&self.lock, false);
    }
}

/// The server-wide name of `lock`'s named lock: 64 characters at most, whatever the lock's name,
/// and apart from other tables' and databases' locks of the same name (`place`, [`wake_place`]).
pub fn named_lock(place: &str, lock: &str) -> String {
    let hex: String = digest(place, lock)[..20]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("leasehold:{hex}")
}

/// The key of `lock`'s PostgreSQL advisory lock, apart from other tables' and schemas' locks of
/// the same name (`place`, [`wake_place`]). Advisory keys are one space per database: an
/// application's own advisory locks could meet one of these only by a 64-bit collision, and
/// would then delay wake-ups, never decide who holds.
pub fn advisory_key(place: &str, lock: &str) -> i64 {
    let digest = digest(place, lock);
    i64::from_be_bytes(digest[..8].try_into().expect("eight bytes"))
}

/// `GET_LOCK(name, wait)`: whether this session has the named lock now.
async fn get(conn: &mut AnyConnection, name: &str, wait_secs: u32) -> Result<bool, sqlx::Error> {
    let row = sqlx::query("SELECT GET_LOCK(?, ?) AS got")
        .bind(name)
        .bind(i64::from(wait_secs))
        .fetch_one(conn)
        .await?;
    // NULL on an error such as the session being killed: not ours.
    Ok(row.try_get::<Option<i64>, _>("got")?.unwrap_or(0) == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A release of an earlier lease of a lock, made after a waiter's blocking statement took
    /// the row, leaves the woken lease's claim counted from that statement: counted from the
    /// claim's own later call, it would end after the row's expiry.
    #[tokio::test]
    async fn a_late_call_about_an_earlier_lease_leaves_a_woken_claim_counted_from_its_statement() {
        let locks = ServerLocks::new(
            ServerLock::Named(None),
            "mysql://nobody@127.0.0.1:1/none",
            "place",
            "SELECT 1",
            Arc::new(ChangeFeeds::default()),
        );
        let lease = |token| Lease {
            lock: "l".into(),
            identity: "a".into(),
            token,
        };
        let statement = BootInstant::now();
        locks
            .counted
            .lock()
            .unwrap()
            .insert("l".into(), (7, statement));
        let later = statement + Duration::from_secs(1);
        assert!(locks.release(&lease(6)).await.is_none());
        assert_eq!(
            locks.counted_from(&lease(7), later),
            statement,
            "the woken claim counts from its own later call after a release of lease 6"
        );
        locks.forget_counted(&lease(7));
        assert_eq!(locks.counted_from(&lease(7), later), later);
    }
}
