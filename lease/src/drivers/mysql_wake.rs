//! MySQL/MariaDB waiters woken by the database, in both modes, as PostgreSQL's are by `NOTIFY`:
//! a release hands the lock over in milliseconds, where polling the row took a fifth of the
//! renew interval.
//!
//! Each lock has a server-wide named lock (`GET_LOCK`), which the holding process keeps on a
//! session of its own for as long as it holds. A waiting process blocks in `GET_LOCK` on such a
//! session, a second at a time; when the holder's `RELEASE_LOCK` (or its session's end) lets the
//! server grant it, the waiter's engine is woken to try the lease row. The server grants a named
//! lock to one session at a time, so a release wakes one waiter, and that waiter keeps the named
//! lock, as the next in line, until it holds the row (and keeps it then) or stops waiting.
//!
//! A holding engine that stops claiming without telling the driver (its lease ran out while it
//! was paused) would keep the named lock for good; so a held named lock checks every
//! [`HOLDING_CHECK`] that the row still names its holder and token.
//!
//! A wake-up is only a hint: the lease row, with its expiry by the database's clock, decides. A
//! waiter woken by a holder whose session died while its lease runs finds the row still leased
//! and waits out the lease as before; when a session cannot be had, waiters poll the row.
//!
//! A process keeps at most [`NAMED_LOCK_SESSIONS`] such sessions: a sidecar holding thousands of
//! a family's keys would otherwise take every connection the server allows (151 by default on
//! MySQL and MariaDB) from every other client. A lock held beyond them keeps no named lock; a
//! lock waited for beyond them gets a session when one frees up, and its waiters here read the
//! row every [`WAIT_STEP_SECS`] meanwhile. A waiter elsewhere that finds a held lock's named lock
//! free (its holder has none) holds it as the next in line and reads the row as often, so a
//! release is noticed within that step rather than at the next renew interval.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{AnyConnection, Connection, Row};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::driver::ChangeFeeds;

/// How long one blocking `GET_LOCK` waits before the waiter looks whether it is still wanted.
/// With the row read once per renew interval besides, an idle waiter costs the server fewer
/// requests than the five row reads per interval it took before.
const WAIT_STEP_SECS: u32 = 2;
const WAIT_STEP: Duration = Duration::from_secs(WAIT_STEP_SECS as u64);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// After a failed session, before the next try.
const RETRY_PAUSE: Duration = Duration::from_secs(1);
/// How often a held named lock checks that the row is still its process's: an engine that stops
/// claiming without a word to the driver (its lease ran out while it was paused) must not keep
/// the named lock, and with it every waiter's wake-up, for good.
pub const HOLDING_CHECK: Duration = Duration::from_secs(30);
/// Sessions kept after their lock's task ends, so that the next holding or wait does not
/// connect again (a keyed family takes a lock per acquisition).
const SPARE_SESSIONS: usize = 4;
/// The most named-lock sessions one process keeps open, spares included.
pub const NAMED_LOCK_SESSIONS: usize = 16;

/// A named-lock session, and its place among the process's [`NAMED_LOCK_SESSIONS`].
struct Session {
    conn: AnyConnection,
    _permit: OwnedSemaphorePermit,
}

/// What the driver tells a lock's task.
enum Holding {
    /// This process holds the lock now, as this holder with this token.
    Held(String, u64),
    /// It no longer does.
    LetGo,
}

pub(crate) struct NamedLocks {
    url: String,
    table: String,
    /// The dialect's read of a lock's live holder and token (`?` = the lock's name).
    observe: String,
    feeds: Arc<ChangeFeeds>,
    tasks: Mutex<HashMap<String, mpsc::UnboundedSender<Holding>>>,
    spares: Mutex<Vec<Session>>,
    sessions: Arc<Semaphore>,
}

impl NamedLocks {
    pub(crate) fn new(url: &str, table: &str, observe: &str, feeds: Arc<ChangeFeeds>) -> Arc<Self> {
        Arc::new(Self {
            url: url.to_owned(),
            table: table.to_owned(),
            observe: observe.to_owned(),
            feeds,
            tasks: Mutex::new(HashMap::new()),
            spares: Mutex::new(Vec::new()),
            sessions: Arc::new(Semaphore::new(NAMED_LOCK_SESSIONS)),
        })
    }

    fn name(&self, lock: &str) -> String {
        named_lock(&self.table, lock)
    }

    /// Send `message` to `lock`'s task, starting it when there is none.
    fn tell(self: &Arc<Self>, lock: &str, message: Option<Holding>) {
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
        tasks: &mut HashMap<String, mpsc::UnboundedSender<Holding>>,
        lock: &str,
        first: Option<Holding>,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Some(first) = first {
            let _ = tx.send(first);
        }
        tasks.insert(lock.to_owned(), tx);
        tokio::spawn(self.clone().run(lock.to_owned(), rx));
    }

    /// This process holds `lock` now: keep its named lock until it lets go. Not when all the
    /// process's sessions are taken and the lock has no task yet: the holding goes without a
    /// named lock, and without a task, which a sidecar holding thousands of keys would pay for
    /// in memory (waiters elsewhere read the row every step as the next in line).
    pub(crate) fn held(self: &Arc<Self>, lock: &str, identity: &str, token: u64) {
        let running = self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(lock);
        let spare = !self
            .spares
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
        if running || spare || self.sessions.available_permits() > 0 {
            self.tell(lock, Some(Holding::Held(identity.to_owned(), token)));
        }
    }

    pub(crate) fn let_go(self: &Arc<Self>, lock: &str) {
        let running = self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(lock);
        if running {
            self.tell(lock, Some(Holding::LetGo));
        }
    }

    /// A waiter of this process subscribed to `lock`'s releases.
    pub(crate) fn watch(self: &Arc<Self>, lock: &str) {
        self.tell(lock, None);
    }

    fn waited(&self, lock: &str) -> bool {
        self.feeds.is_subscribed(lock)
    }

    async fn connect(&self, permit: OwnedSemaphorePermit) -> Option<Session> {
        match tokio::time::timeout(CONNECT_TIMEOUT, AnyConnection::connect(&self.url)).await {
            Ok(Ok(conn)) => Some(Session {
                conn,
                _permit: permit,
            }),
            Ok(Err(e)) => {
                tracing::debug!(error = %crate::redact::redact(&e.to_string()), "no session for a named lock");
                None
            }
            Err(_) => None,
        }
    }

    /// One lock's task: its session, whether the named lock is this process's, and whether the
    /// process holds the lock. Ends when the lock is neither held nor waited for here.
    async fn run(self: Arc<Self>, lock: String, mut messages: mpsc::UnboundedReceiver<Holding>) {
        let name = self.name(&lock);
        let mut session = self.spares.lock().unwrap_or_else(|e| e.into_inner()).pop();
        // A spare may have gone stale (a server restart): its failure is retried at once.
        let mut spare = session.is_some();
        let (mut holding, mut locked) = (false, false);
        // The holding the driver last announced.
        let mut lease: Option<(String, u64)> = None;
        loop {
            // Everything the driver said so far.
            while let Ok(message) = messages.try_recv() {
                apply(message, &mut holding, &mut lease);
            }
            let wanted = holding || self.waited(&lock);
            if !wanted {
                let mut clean = !locked;
                if locked && let Some(session) = &mut session {
                    clean = release(&mut session.conn, &name).await.is_ok();
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
                        let waited = !holding && self.waited(&lock);
                        tokio::select! {
                            message = messages.recv() => match message {
                                Some(message) => apply(message, &mut holding, &mut lease),
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
            let outcome = if locked {
                if holding {
                    // Ours, and held: nothing to do until the driver speaks, but look now and
                    // then whether the row still says so.
                    tokio::select! {
                        message = messages.recv() => match message {
                            Some(Holding::LetGo) => {
                                holding = false;
                                // The release's whole point: the next waiter goes now.
                                let released = release(conn, &name).await;
                                locked = false;
                                released.map(|_| ())
                            }
                            Some(Holding::Held(identity, token)) => {
                                lease = Some((identity, token));
                                Ok(())
                            }
                            None => return,
                        },
                        () = tokio::time::sleep(HOLDING_CHECK) => {
                            match self.still_held(conn, &lock, lease.as_ref()).await {
                                Ok(still) => {
                                    holding = still;
                                    Ok(())
                                }
                                Err(e) => Err(e),
                            }
                        }
                    }
                } else {
                    // Ours as the next in line: the holder has no named lock (beyond its
                    // process's sessions, or its session gone), so no release would wake us.
                    // The engine reads the row every step, and at the lease's end.
                    tokio::select! {
                        message = messages.recv() => match message {
                            Some(message) => {
                                apply(message, &mut holding, &mut lease);
                                Ok(())
                            }
                            None => return,
                        },
                        () = tokio::time::sleep(WAIT_STEP) => {
                            self.feeds.bump(&lock);
                            Ok(())
                        }
                    }
                }
            } else {
                // Held: take it at once if free. Waiting: block a step for the holder to let go.
                let wait = if holding { 0 } else { WAIT_STEP_SECS };
                match get(conn, &name, wait).await {
                    Ok(true) => {
                        locked = true;
                        if !holding {
                            self.feeds.bump(&lock);
                        }
                        Ok(())
                    }
                    Ok(false) if holding => {
                        // Another session has it (a waiter between its wake-up and its try):
                        // wait for the driver rather than spin.
                        match messages.recv().await {
                            Some(Holding::LetGo) => holding = false,
                            Some(Holding::Held(identity, token)) => {
                                lease = Some((identity, token));
                            }
                            None => return,
                        }
                        Ok(())
                    }
                    Ok(false) => Ok(()),
                    Err(e) => Err(e),
                }
            };
            match outcome {
                Ok(()) => spare = false,
                Err(_) if std::mem::take(&mut spare) => {
                    session = None;
                    locked = false;
                }
                Err(e) => {
                    tracing::debug!(lock, error = %e, "named-lock session failed; waiters poll meanwhile");
                    session = None;
                    locked = false;
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }
}

impl NamedLocks {
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

/// What the driver said, applied to a lock task's view: whether the process holds the lock,
/// and as which holder and token.
fn apply(message: Holding, holding: &mut bool, lease: &mut Option<(String, u64)>) {
    match message {
        Holding::Held(identity, token) => {
            *holding = true;
            *lease = Some((identity, token));
        }
        Holding::LetGo => *holding = false,
    }
}

/// The server-wide name of `lock`'s named lock: 64 characters at most, whatever the lock's name,
/// and apart from other tables' locks of the same name.
pub fn named_lock(table: &str, lock: &str) -> String {
    let digest = Sha256::digest(format!("{table}\0{lock}").as_bytes());
    let hex: String = digest[..20].iter().map(|b| format!("{b:02x}")).collect();
    format!("leasehold:{hex}")
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

async fn release(conn: &mut AnyConnection, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT RELEASE_LOCK(?) AS released")
        .bind(name)
        .fetch_one(conn)
        .await?;
    Ok(())
}
