//! SQLite, lease mode: one row per lock in a local file. The embedded default, for one machine
//! with nothing else installed. Several processes on the same file exclude each other through
//! SQLite's own file locking; every decision is one atomic statement.
//!
//! Expiry is computed by SQLite from the machine's clock (`julianday('now')`), the one clock all
//! processes on the file share. The fencing token lives in the row and survives release (the row
//! is kept, only the holder is cleared), so it increases for the life of the file.

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::Row;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use tokio::sync::watch;

use crate::boot_clock::BootInstant;
use crate::driver::{Acquire, ChangeFeeds, Driver, Holding, Lease, Upkeep};
use crate::drivers::batches::Batches;
use crate::drivers::sql::sqlite_wake::WakeFiles;
use crate::drivers::sql::{
    Extended, MAX_RENEW_BATCH, RenewalBatch, answer_renewals, extended_row, padded, token,
};
use crate::error::{Error, Result};
use crate::names::{quote_sql_identifier, validate_sql_identifier};

/// Where a SQLite lock table lives (`sqlite://PATH[?table=NAME]`).
#[derive(Clone, PartialEq, Eq)]
pub struct SqliteConfig {
    pub path: std::path::PathBuf,
    pub table: String,
}

/// How long a statement waits for another process's write lock before giving up.
const BUSY_TIMEOUT: Duration = Duration::from_secs(1);

/// How long opening a file busy with other openers is tried again.
const OPEN_DEADLINE: Duration = Duration::from_secs(10);

/// Milliseconds since the Unix epoch by SQLite's clock. `julianday('now')` is stable within one
/// statement, so every comparison in a statement sees the same instant.
const NOW_MS: &str = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)";

/// Polling bounds: a local file is cheap to poll, so waiters look more often than once per
/// renew interval, but never in a tight loop.
const MIN_POLL: Duration = Duration::from_millis(50);
const MAX_POLL: Duration = Duration::from_secs(1);

pub struct SqliteDriver {
    pool: SqlitePool,
    sql: Statements,
    /// Renewals that arrive together go out in one statement.
    renewals: Batches<(Lease, Duration), Result<bool>>,
    /// Wakes waiters in this process at once.
    local_releases: Arc<ChangeFeeds>,
    /// Wakes waiters in other processes on the machine ([`crate::drivers::sql::sqlite_wake`]).
    wake: Option<Arc<WakeFiles>>,
}

struct Statements {
    acquire: String,
    /// For a family's key: a new row's token is one above the family's floor, or where the
    /// floor row is gone (deleted by hand), above the highest token of the family's rows.
    acquire_key: String,
    ensure_floor: String,
    raise_floor: String,
    forget_idle: String,
    count_held_keys: String,
    release: String,
    observe: String,
    delete: String,
}

/// The renewal of `rows` leases at once: each row is extended only where its holder and token
/// are the renewal's and its lease still runs, and the statement returns the rows it extended.
/// Parameters: each renewal's lock, holder, token and ttl in ms, in turn.
fn renew_many(table: &str, rows: usize) -> String {
    let t = quote_sql_identifier(table);
    let values: Vec<String> = (0..rows)
        .map(|i| {
            let n = 4 * i;
            format!("(?{}, ?{}, ?{}, ?{})", n + 1, n + 2, n + 3, n + 4)
        })
        .collect();
    format!(
        "UPDATE {t} SET expires_at_ms = {NOW_MS} + v.column4 FROM (VALUES {}) AS v \
         WHERE {t}.name = v.column1 AND {t}.holder = v.column2 AND {t}.token = v.column3 \
         AND {t}.expires_at_ms > {NOW_MS} \
         RETURNING name, holder, token",
        values.join(", ")
    )
}

/// A batch of renewals in one write transaction (one fsync, where each renewal took one),
/// [`padded`] as the other SQL drivers' are.
async fn renew_batch(pool: SqlitePool, table: Arc<str>, batch: RenewalBatch) {
    let rows = batch.len().next_power_of_two();
    let sql = renew_many(&table, rows);
    let mut query = sqlx::query(&sql);
    for (lease, ttl) in padded(&batch) {
        query = query
            .bind(lease.lock.clone())
            .bind(lease.identity.clone())
            .bind(token(lease))
            .bind(ms(*ttl));
    }
    let extended = match query.fetch_all(&pool).await {
        Ok(rows) => rows
            .iter()
            .map(extended_row)
            .collect::<std::result::Result<Extended, _>>(),
        Err(e) => Err(e),
    };
    answer_renewals(batch, extended.map_err(map_err));
}

impl Statements {
    fn new(table: &str) -> Self {
        let t = quote_sql_identifier(table);
        Self {
            acquire: format!(
                "INSERT INTO {t} (name, holder, token, expires_at_ms) VALUES (?1, ?2, 1, {NOW_MS} + ?3) \
                 ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, token = {t}.token + 1, \
                 expires_at_ms = excluded.expires_at_ms \
                 WHERE {t}.holder IS NULL OR {t}.expires_at_ms <= {NOW_MS} \
                 RETURNING token"
            ),
            // WHERE true: SQLite's upsert after a SELECT needs it, to tell ON CONFLICT from a join.
            acquire_key: format!(
                "INSERT INTO {t} (name, holder, token, expires_at_ms) \
                 SELECT ?1, ?2, COALESCE((SELECT token FROM {t} WHERE name = ?4), \
                   (SELECT MAX(token) FROM {t} WHERE name LIKE ?5 ESCAPE '|' OR name LIKE ?6 ESCAPE '|'), 0) + 1, \
                   {NOW_MS} + ?3 WHERE true \
                 ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, token = {t}.token + 1, \
                 expires_at_ms = excluded.expires_at_ms \
                 WHERE {t}.holder IS NULL OR {t}.expires_at_ms <= {NOW_MS} \
                 RETURNING token"
            ),
            // ?2, ?3: the keys' name patterns. A family whose floor row was deleted by hand
            // gets it back above every key still recorded.
            ensure_floor: format!(
                "INSERT INTO {t} (name, holder, token, expires_at_ms) \
                 SELECT ?1, NULL, COALESCE(MAX(token), 0), 0 FROM {t} \
                 WHERE name LIKE ?2 ESCAPE '|' OR name LIKE ?3 ESCAPE '|' \
                 ON CONFLICT (name) DO NOTHING"
            ),
            // ?2, ?3: the keys' name patterns; ?4: the idle cut-off, one instant for both
            // statements of a sweep.
            raise_floor: format!(
                "UPDATE {t} SET token = MAX(token, COALESCE((SELECT MAX(token) FROM {t} \
                   WHERE (name LIKE ?2 ESCAPE '|' OR name LIKE ?3 ESCAPE '|') AND expires_at_ms <= ?4), 0)) \
                 WHERE name = ?1"
            ),
            forget_idle: format!(
                "DELETE FROM {t} \
                 WHERE (name LIKE ?1 ESCAPE '|' OR name LIKE ?2 ESCAPE '|') AND expires_at_ms <= ?3"
            ),
            count_held_keys: format!(
                "SELECT COUNT(*) FROM {t} WHERE (name LIKE ?1 ESCAPE '|' OR name LIKE ?2 ESCAPE '|') \
                 AND holder IS NOT NULL AND expires_at_ms > {NOW_MS}"
            ),
            // The release's time stays in the row: a family's key is forgotten only once it has
            // been idle a while (`forget_idle_keys`).
            release: format!(
                "UPDATE {t} SET holder = NULL, expires_at_ms = {NOW_MS} \
                 WHERE name = ?1 AND holder = ?2 AND token = ?3"
            ),
            observe: format!(
                "SELECT holder, token, expires_at_ms - {NOW_MS} AS remaining_ms FROM {t} \
                 WHERE name = ?1 AND holder IS NOT NULL AND expires_at_ms > {NOW_MS}"
            ),
            // Freed, not deleted: the row keeps the lock's token, so that a lock created again
            // under the name continues above it.
            delete: format!("UPDATE {t} SET holder = NULL, expires_at_ms = 0 WHERE name = ?1"),
        }
    }
}

impl SqliteDriver {
    /// Open (creating if needed) the file and the lock table.
    ///
    /// Processes that open one new file at once race to switch it to WAL and create the
    /// table; SQLite answers the loser `SQLITE_BUSY` at once, without its busy handler, where
    /// waiting would deadlock. The open is tried again until [`OPEN_DEADLINE`].
    pub async fn open(path: &Path, table: &str) -> Result<Self> {
        validate_sql_identifier("table name", table)?;
        let deadline = tokio::time::Instant::now() + OPEN_DEADLINE;
        let mut pause = Duration::from_millis(5);
        let pool = loop {
            let failure = match open_pool(path, table).await {
                Ok(pool) => break pool,
                Err(failure) => failure,
            };
            let (OpenFailure::Connect(e) | OpenFailure::Provision(e)) = &failure;
            if is_busy(e) && tokio::time::Instant::now() + pause < deadline {
                tracing::debug!(path = %path.display(), error = %e, "the file is busy; opening again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
                continue;
            }
            return Err(match failure {
                OpenFailure::Connect(e) => {
                    Error::Unreachable(format!("cannot open {}: {e}", path.display()))
                }
                OpenFailure::Provision(e) => map_err(e),
            });
        };
        let renewals = {
            let (pool, table) = (pool.clone(), Arc::<str>::from(table));
            Batches::new(MAX_RENEW_BATCH, move |batch| {
                renew_batch(pool.clone(), table.clone(), batch)
            })
        };
        Ok(Self {
            pool,
            sql: Statements::new(table),
            renewals,
            local_releases: Arc::default(),
            wake: WakeFiles::beside(path),
        })
    }
}

/// Where opening a file failed: connecting to it, or creating the lock table.
enum OpenFailure {
    Connect(sqlx::Error),
    Provision(sqlx::Error),
}

/// A pool on the file, in WAL mode, with the lock table created if it is absent.
async fn open_pool(path: &Path, table: &str) -> Result<SqlitePool, OpenFailure> {
    let options = SqliteConnectOptions::from_str("sqlite://")
        .map_err(OpenFailure::Connect)?
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // Tokens must never repeat, even after a power cut: fsync every commit.
        .synchronous(SqliteSynchronous::Full)
        // Lock names differ by case (`orders` and `Orders` are two families): a family's key
        // patterns must not match another's rows, which SQLite's `LIKE` does by default.
        .pragma("case_sensitive_like", "ON")
        .busy_timeout(BUSY_TIMEOUT);
    let pool = SqlitePoolOptions::new()
        .max_connections(2)
        .acquire_timeout(BUSY_TIMEOUT * 2)
        // An in-process file has no connection to lose: no ping before each use.
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .map_err(OpenFailure::Connect)?;
    let t = quote_sql_identifier(table);
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {t} (\
           name TEXT PRIMARY KEY NOT NULL, \
           holder TEXT, \
           token INTEGER NOT NULL, \
           expires_at_ms INTEGER NOT NULL)"
    ))
    .execute(&pool)
    .await
    .map_err(OpenFailure::Provision)?;
    Ok(pool)
}

/// `SQLITE_BUSY` or `SQLITE_LOCKED`, extended codes included: another connection keeps the
/// file locked.
fn is_busy(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .and_then(|code| code.parse::<u32>().ok())
            .is_some_and(|code| matches!(code & 0xff, 5 | 6)),
        _ => false,
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn map_err(e: sqlx::Error) -> Error {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => {
            Error::Unreachable(e.to_string())
        }
        ref busy if is_busy(busy) => Error::Unreachable(e.to_string()),
        other => Error::Backend(other.to_string()),
    }
}

#[async_trait]
impl Driver for SqliteDriver {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        // fetch_all, not fetch_optional: the statement must run to completion so that its
        // write transaction commits now. A half-stepped INSERT ... RETURNING keeps the file's
        // write lock, and a holder paused at that moment would lock everyone out.
        let sent = BootInstant::now();
        let rows = match crate::names::family_of(lock) {
            Some(family) => {
                let [plain, hashed] = crate::names::key_name_patterns(family);
                sqlx::query(&self.sql.acquire_key)
                    .bind(lock)
                    .bind(identity)
                    .bind(ms(ttl))
                    .bind(crate::names::key_floor_row(family))
                    .bind(plain)
                    .bind(hashed)
            }
            None => sqlx::query(&self.sql.acquire)
                .bind(lock)
                .bind(identity)
                .bind(ms(ttl)),
        }
        .fetch_all(&self.pool)
        .await
        .map_err(map_err)?;
        match rows.into_iter().next() {
            Some(row) => {
                let token: i64 = row.try_get("token").map_err(map_err)?;
                if let Some(wake) = &self.wake {
                    wake.held(lock, token as u64, sent + ttl);
                }
                Ok(Acquire::Acquired(Lease {
                    lock: lock.to_owned(),
                    identity: identity.to_owned(),
                    token: token as u64,
                }))
            }
            None => Ok(Acquire::Busy(self.observe(lock).await?)),
        }
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let sent = BootInstant::now();
        let renewed = self.renewals.call((lease.clone(), ttl)).await??;
        if let Some(wake) = &self.wake {
            match renewed {
                true => wake.held(&lease.lock, lease.token, sent + ttl),
                false => wake.let_go(&lease.lock, lease.token),
            }
        }
        Ok(renewed)
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let done = sqlx::query(&self.sql.release)
            .bind(&lease.lock)
            .bind(&lease.identity)
            .bind(token(lease))
            .execute(&self.pool)
            .await
            .map_err(map_err)?;
        let released = done.rows_affected() == 1;
        // Not held either way now: a waiter elsewhere may go.
        if let Some(wake) = &self.wake {
            wake.let_go(&lease.lock, lease.token);
        }
        if released {
            self.local_releases.bump(&lease.lock);
        }
        Ok(released)
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        let rows = sqlx::query(&self.sql.observe)
            .bind(lock)
            .fetch_all(&self.pool)
            .await
            .map_err(map_err)?;
        rows.first()
            .map(crate::drivers::sql::holding_from_row)
            .transpose()
            .map_err(map_err)
    }

    fn changes(&self, lock: &str) -> Option<watch::Receiver<u64>> {
        let changes = self.local_releases.subscribe(lock);
        if let Some(wake) = &self.wake {
            wake.watch(lock, &self.local_releases);
        }
        Some(changes)
    }

    fn poll_interval(&self, renew_interval: Duration) -> Duration {
        (renew_interval / 5).clamp(MIN_POLL, MAX_POLL)
    }

    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map_err(map_err)?;
        Ok(())
    }
}

#[async_trait]
impl Upkeep for SqliteDriver {
    /// The row is freed, matched as a release is: the deletion itself (the row keeps the
    /// token).
    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        crate::driver::deleted_as_released(lease, self.release(lease).await?)
    }

    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        for lock in locks {
            sqlx::query(&self.sql.delete)
                .bind(lock)
                .execute(&self.pool)
                .await
                .map_err(map_err)?;
        }
        Ok(())
    }

    /// One write transaction, so nobody takes a key between the floor's rise and its row's
    /// deletion: the floor first rises to every token of the rows idle since the cut-off, then
    /// those rows go.
    async fn forget_idle_keys(&self, family: &str, idle_for: Duration) -> Result<u64> {
        let floor = crate::names::key_floor_row(family);
        let [plain, hashed] = crate::names::key_name_patterns(family);
        let mut tx = self.pool.begin().await.map_err(map_err)?;
        sqlx::query(&self.sql.ensure_floor)
            .bind(&floor)
            .bind(&plain)
            .bind(&hashed)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        let now: i64 = sqlx::query_scalar(&format!("SELECT {NOW_MS}"))
            .fetch_one(&mut *tx)
            .await
            .map_err(map_err)?;
        let cutoff = now.saturating_sub(ms(idle_for));
        sqlx::query(&self.sql.raise_floor)
            .bind(&floor)
            .bind(&plain)
            .bind(&hashed)
            .bind(cutoff)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        let forgotten = sqlx::query(&self.sql.forget_idle)
            .bind(&plain)
            .bind(&hashed)
            .bind(cutoff)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?
            .rows_affected();
        tx.commit().await.map_err(map_err)?;
        Ok(forgotten)
    }

    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        let [plain, hashed] = crate::names::key_name_patterns(family);
        let held: i64 = sqlx::query_scalar(&self.sql.count_held_keys)
            .bind(&plain)
            .bind(&hashed)
            .fetch_one(&self.pool)
            .await
            .map_err(map_err)?;
        Ok(Some(u64::try_from(held).unwrap_or(0)))
    }
}
