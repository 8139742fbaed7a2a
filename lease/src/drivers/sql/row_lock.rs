//! Row-lock mode for PostgreSQL and MySQL/MariaDB: the holder keeps a transaction open on a
//! dedicated connection, holding its lock's seeded row with `SELECT ... FOR UPDATE NOWAIT`.
//! `COMMIT`, or the connection dying, lets the next contender in.
//!
//! A row lock alone cannot fence. When the holder's connection is killed (`pg_terminate_backend`,
//! `KILL`, a proxy timing out), the database frees the row at once, but the holder cannot know
//! before its next round trip and would go on answering "you are the holder" while a newcomer
//! takes the row. So the lease-mode row of the same lock stays the fence, written **outside**
//! the transaction (autocommit, on the shared pool) so that it survives the connection:
//!
//! - acquire = take the row lock, then the lease-mode compare-and-set (free or expired), which
//!   bumps the token; a newcomer behind a holder whose connection died therefore waits until the
//!   last committed expiry, exactly as long as the old holder may still believe it holds;
//! - renew = extend the fence, then prove the transaction still holds the row (the same
//!   `FOR UPDATE`, instant when held): the transaction is touched only once the fence is
//!   extended, since each statement restarts the server's bound on the session's idleness;
//!   a transaction found gone leaves the fence to run out;
//! - release = free the fence and `COMMIT` in the one transaction, so the two leave together and
//!   a woken waiter finds both free.
//!
//! A holder that stops renewing (paused, partitioned, its task gone) must not keep the row
//! forever: the driver drops the connection once the lease has run out locally, and the server
//! ends the session itself after the lease (`idle_in_transaction_session_timeout` on PostgreSQL,
//! `wait_timeout`, whole seconds, on MySQL) when the whole process is frozen.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::AnyConnection;
use sqlx::Executor;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::driver::{Acquire, Holding, Lease};
use crate::drivers::sql::pool::{RESPONSE_TIMEOUT, answered};
use crate::drivers::sql::{Dialect, Statements, map_err, open_session};
use crate::error::{Error, Result};

/// What row-lock mode asks of the lease-mode driver whose row of the same lock stays its fence
/// (the PostgreSQL and MySQL driver implements it).
pub(crate) trait Fence: Sync {
    fn dialect(&self) -> Dialect;
    fn statements(&self) -> &Statements;
    /// The fence's holder, if any.
    fn holder(&self, lock: &str) -> impl Future<Output = Result<Option<Holding>>> + Send;
    /// The fence's compare-and-set: the new token, or who holds it.
    fn acquire_row(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<std::result::Result<u64, Option<Holding>>>> + Send;
    fn renew_row(&self, lease: &Lease, ttl: Duration) -> impl Future<Output = Result<bool>> + Send;
    /// Free the fence if `lease` still holds it, on the pool.
    fn release_row(&self, lease: &Lease) -> impl Future<Output = Result<bool>> + Send;
    /// The same inside the transaction `tx`, so that the fence and the row lock leave together.
    fn release_row_in(
        &self,
        tx: &mut AnyConnection,
        lease: &Lease,
    ) -> impl Future<Output = Result<bool>> + Send;
}

/// How many times one attempt seeds its lock's row before it gives up (see [`RowLocks::lock_row`]).
const SEEDINGS: usize = 3;
/// Idle connections kept for the next attempt, so that a waiter's polling does not reconnect.
const SPARE_CONNECTIONS: usize = 2;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// MySQL error numbers for a row lock that is taken: MariaDB answers NOWAIT with
/// ER_LOCK_WAIT_TIMEOUT, MySQL 8 with ER_LOCK_NOWAIT.
const MYSQL_LOCK_WAIT_TIMEOUT: u16 = 1205;
const MYSQL_LOCK_NOWAIT: u16 = 3572;
/// PostgreSQL lock_not_available.
const POSTGRES_LOCK_NOT_AVAILABLE: &str = "55P03";

pub(crate) struct RowLocks {
    url: String,
    held: Mutex<HashMap<String, Arc<HeldRow>>>,
    spares: Mutex<Vec<AnyConnection>>,
}

/// One open transaction holding one lock's row.
struct HeldRow {
    lease: Lease,
    conn: tokio::sync::Mutex<Option<AnyConnection>>,
    /// When the local lease runs out; the reaper drops the connection then.
    expires: watch::Sender<Instant>,
    reaper: tokio::task::JoinHandle<()>,
}

impl Drop for HeldRow {
    fn drop(&mut self) {
        self.reaper.abort();
    }
}

/// A NOWAIT that found the row taken: "not acquired", not an error.
fn lock_unavailable(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return matches!(my.number(), MYSQL_LOCK_WAIT_TIMEOUT | MYSQL_LOCK_NOWAIT);
    }
    db.code().as_deref() == Some(POSTGRES_LOCK_NOT_AVAILABLE)
}

/// Drop the connection when the lease runs out without a renewal: closing it is what makes the
/// server roll back and free the row.
async fn reap(row: Weak<HeldRow>, mut expires: watch::Receiver<Instant>) {
    loop {
        let at = *expires.borrow_and_update();
        tokio::select! {
            () = tokio::time::sleep_until(at) => {
                let Some(row) = row.upgrade() else { return };
                if *row.expires.borrow() <= Instant::now() {
                    row.conn.lock().await.take();
                    return;
                }
            }
            changed = expires.changed() => if changed.is_err() { return },
        }
    }
}

/// Insert `lock`'s row if absent, on `conn` outside any transaction, waiting for no lock of a
/// holder's on a row seeded meanwhile ([`Dialect::seed_without_waiting`]): the error then is a
/// lock that is taken.
async fn seed_row_on(
    conn: &mut AnyConnection,
    driver: &impl Fence,
    lock: &str,
) -> std::result::Result<(), sqlx::Error> {
    let bounded = driver.dialect().seed_without_waiting();
    if let Some((no_wait, _)) = bounded {
        conn.execute(no_wait).await?;
    }
    let seeded = sqlx::query(&driver.statements().seed_row)
        .bind(lock)
        .execute(&mut *conn)
        .await;
    if let Some((_, default_wait)) = bounded {
        conn.execute(default_wait).await?;
    }
    seeded.map(|_| ())
}

enum Locked {
    Held(AnyConnection),
    Taken(AnyConnection),
}

impl RowLocks {
    pub(crate) fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            held: Mutex::new(HashMap::new()),
            spares: Mutex::new(Vec::new()),
        }
    }

    fn held(&self, lock: &str) -> Option<Arc<HeldRow>> {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.get(lock).cloned()
    }

    fn forget(&self, lock: &str, row: &Arc<HeldRow>) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.get(lock).is_some_and(|r| Arc::ptr_eq(r, row)) {
            held.remove(lock);
        }
    }

    async fn connect(&self, dialect: Dialect) -> Result<AnyConnection> {
        match tokio::time::timeout(CONNECT_TIMEOUT, open_session(&self.url, dialect)).await {
            Ok(conn) => conn.map_err(map_err),
            Err(_) => Err(Error::Unreachable(format!(
                "no connection within {CONNECT_TIMEOUT:?}"
            ))),
        }
    }

    /// Keep a connection that is outside any transaction for the next attempt.
    fn spare(&self, conn: AnyConnection) {
        let mut spares = self.spares.lock().unwrap_or_else(|e| e.into_inner());
        if spares.len() < SPARE_CONNECTIONS {
            spares.push(conn);
        }
    }

    async fn rollback_and_spare(&self, mut conn: AnyConnection) {
        if answered(RESPONSE_TIMEOUT, conn.execute("ROLLBACK"))
            .await
            .is_ok()
        {
            self.spare(conn);
        }
    }

    /// Open a transaction and try the row; seeds the row on first use.
    async fn lock_row(&self, driver: &impl Fence, lock: &str, ttl: Duration) -> Result<Locked> {
        let spare = self.spares.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let (mut conn, mut reused) = match spare {
            Some(conn) => (conn, true),
            None => (self.connect(driver.dialect()).await?, false),
        };
        let mut seeded = 0;
        loop {
            let begin = driver.dialect().row_lock_begin(ttl);
            if let Err(e) = answered(RESPONSE_TIMEOUT, conn.execute(&*begin)).await {
                if !reused {
                    return Err(map_err(e));
                }
                // The spare went stale (a server restart, an idle timeout): one fresh try.
                (conn, reused) = (self.connect(driver.dialect()).await?, false);
                continue;
            }
            let rows = answered(
                RESPONSE_TIMEOUT,
                sqlx::query(&driver.statements().lock_row)
                    .bind(lock)
                    .fetch_all(&mut conn),
            )
            .await;
            match rows {
                Ok(rows) if !rows.is_empty() => return Ok(Locked::Held(conn)),
                // A family's idle-key sweep may delete a row between its seeding and its
                // locking: seeded again, a few times.
                Ok(_) if seeded < SEEDINGS => {
                    answered(RESPONSE_TIMEOUT, conn.execute("ROLLBACK"))
                        .await
                        .map_err(map_err)?;
                    match answered(RESPONSE_TIMEOUT, seed_row_on(&mut conn, driver, lock)).await {
                        // Seeded meanwhile by a contender that holds it now.
                        Err(e) if lock_unavailable(&e) => return Ok(Locked::Taken(conn)),
                        seeding => seeding.map_err(map_err)?,
                    }
                    seeded += 1;
                }
                Ok(_) => {
                    return Err(Error::Backend(format!(
                        "the row of lock {lock:?} vanished right after it was seeded, {SEEDINGS} times"
                    )));
                }
                Err(e) if lock_unavailable(&e) => return Ok(Locked::Taken(conn)),
                Err(e) => return Err(map_err(e)),
            }
        }
    }

    pub(crate) async fn try_acquire(
        &self,
        driver: &impl Fence,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<Acquire> {
        if let Some(row) = self.held(lock) {
            // Not re-entrant: this process already holds the row (or is using it right now).
            let live = row.conn.try_lock().map_or(true, |conn| conn.is_some());
            if live {
                return Ok(Acquire::Busy(driver.holder(lock).await?));
            }
            self.forget(lock, &row);
        }
        // While the fence shows a live holder the row cannot be ours either: a waiter costs one
        // plain read, as in lease mode, and opens no transaction.
        if let Some(holder) = driver.holder(lock).await? {
            return Ok(Acquire::Busy(Some(holder)));
        }
        let started = Instant::now();
        let conn = match self.lock_row(driver, lock, ttl).await? {
            Locked::Held(conn) => conn,
            Locked::Taken(conn) => {
                self.rollback_and_spare(conn).await;
                return Ok(Acquire::Busy(driver.holder(lock).await?));
            }
        };
        // Holding the row, bump the token on the fence; this commits on its own, so it outlives
        // this connection. Not taken: a holder whose connection died may still believe it holds.
        let token = match driver.acquire_row(lock, identity, ttl).await {
            Ok(Ok(token)) => token,
            Ok(Err(holder)) => {
                self.rollback_and_spare(conn).await;
                return Ok(Acquire::Busy(holder));
            }
            Err(e) => return Err(e), // dropping the connection frees the row
        };
        let lease = Lease {
            lock: lock.to_owned(),
            identity: identity.to_owned(),
            token,
        };
        let (expires, watch_expires) = watch::channel(started + ttl);
        let row = Arc::new_cyclic(|weak| HeldRow {
            lease: lease.clone(),
            conn: tokio::sync::Mutex::new(Some(conn)),
            expires,
            reaper: tokio::spawn(reap(weak.clone(), watch_expires)),
        });
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(lock.to_owned(), row);
        Ok(Acquire::Acquired(lease))
    }

    pub(crate) async fn renew(
        &self,
        driver: &impl Fence,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<bool> {
        let Some(row) = self.held(&lease.lock).filter(|row| row.lease == *lease) else {
            return Ok(false);
        };
        let sent = Instant::now();
        let mut conn = row.conn.lock().await;
        if conn.is_none() {
            self.forget(&lease.lock, &row);
            return Ok(false);
        }
        // The fence first: each statement on the held transaction restarts the server's bound
        // on the session's idleness, so the row's transaction is touched only once the fence
        // is extended. Should fence renewals fail while a holder's host goes silent, the server
        // ends its session (and frees the row) as the fence runs out, not a lease after the
        // last failed attempt.
        if !driver.renew_row(lease, ttl).await? {
            if let Some(tx) = conn.take() {
                self.rollback_and_spare(tx).await;
            }
            self.forget(&lease.lock, &row);
            return Ok(false);
        }
        let tx = conn
            .as_mut()
            .expect("the transaction, seen above under the same guard");
        // Already ours, so this returns at once; an error means the transaction is gone.
        let still_held = answered(
            RESPONSE_TIMEOUT,
            sqlx::query(&driver.statements().lock_row)
                .bind(&lease.lock)
                .fetch_all(&mut *tx),
        )
        .await;
        if !matches!(&still_held, Ok(rows) if !rows.is_empty()) {
            if let Err(e) = still_held {
                tracing::warn!(lock = %lease.lock, error = %map_err(e), "the transaction holding the lock's row is gone: the lock is lost");
            }
            conn.take();
            self.forget(&lease.lock, &row);
            // The row is free, or is once this connection closes: the applications' own
            // `FOR UPDATE` transactions may take it now, so the holding is lost, not in doubt
            // (an error here would leave the engine claiming until its validity ran out). The
            // fence just extended is left to run out, not freed: Leasehold's contenders wait
            // for it as for any holder that lost its connection.
            return Ok(false);
        }
        row.expires.send_replace(sent + ttl);
        Ok(true)
    }

    /// [`RowLocks::release`], deleting the lock's seeded row in the same transaction before it
    /// commits: the row is this transaction's until then, so the DELETE waits for nobody, and
    /// no contender takes the row or the fence between the release and the deletion.
    pub(crate) async fn release_deleting_row(
        &self,
        driver: &impl Fence,
        lease: &Lease,
    ) -> Result<()> {
        let not_held = || {
            Error::Backend(format!(
                "lock {:?} is not held by this process's transaction",
                lease.lock
            ))
        };
        let row = self
            .held(&lease.lock)
            .filter(|row| row.lease == *lease)
            .ok_or_else(not_held)?;
        self.forget(&lease.lock, &row);
        let mut tx = row.conn.lock().await.take().ok_or_else(not_held)?;
        // On an error the transaction is dropped (rolled back): nothing is deleted, and the
        // caller frees the fence.
        if !answered(RESPONSE_TIMEOUT, driver.release_row_in(&mut tx, lease)).await? {
            return Err(not_held());
        }
        let deleted = async {
            sqlx::query(&driver.statements().delete_row)
                .bind(&lease.lock)
                .execute(&mut tx)
                .await?;
            tx.execute("COMMIT").await
        };
        answered(RESPONSE_TIMEOUT, deleted).await.map_err(map_err)?;
        self.spare(tx);
        Ok(())
    }

    pub(crate) async fn release(&self, driver: &impl Fence, lease: &Lease) -> Result<bool> {
        if let Some(row) = self.held(&lease.lock).filter(|row| row.lease == *lease) {
            self.forget(&lease.lock, &row);
            let tx = row.conn.lock().await.take();
            if let Some(mut tx) = tx {
                let released =
                    answered(RESPONSE_TIMEOUT, driver.release_row_in(&mut tx, lease)).await;
                if let Ok(released) = released
                    && answered(RESPONSE_TIMEOUT, tx.execute("COMMIT"))
                        .await
                        .is_ok()
                {
                    self.spare(tx);
                    return Ok(released);
                }
                // The transaction is gone with its update; free the fence on its own below.
            }
        }
        driver.release_row(lease).await
    }
}
