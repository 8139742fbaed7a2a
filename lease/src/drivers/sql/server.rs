//! PostgreSQL and MySQL/MariaDB: one row per lock in a lock table, one SQL core with the dialect
//! differences kept in [`Dialect`]. This is lease mode; row-lock mode ([`crate::drivers::sql::row_lock`])
//! adds a `FOR UPDATE` row lock in front of the very same row, which stays its fence.
//!
//! - Expiry is computed by the database's own clock (`now()`, `UTC_TIMESTAMP(6)`), so a client whose clock
//!   is wrong by minutes can neither steal a live lease nor keep an expired one.
//! - Acquire inserts the row, or takes it over with a compare-and-set when it is free or
//!   expired; the token goes up by one on every acquisition and is never reset (a release keeps
//!   the row).
//! - Renew and release match name, holder **and** token.
//! - Waiters are woken by a lock the holder keeps in the server ([`crate::drivers::sql::wake`]):
//!   MySQL's named locks, in both modes; PostgreSQL's advisory locks in lease mode, where the
//!   waiter's blocking statement takes the row too. PostgreSQL's release statements also
//!   `NOTIFY`, which wakes what keeps no such lock: row-lock mode, a family's keys, a lock held
//!   beyond the process's sessions.
//!
//! Table and schema names are validated identifiers, quoted in the dialect's way; lock names and
//! identities are always bound parameters.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::any::AnyPoolOptions;
use sqlx::{Connection, Row};
use tokio::sync::{OnceCell, watch};

use crate::boot_clock::BootInstant;
use crate::driver::{Acquire, ChangeFeeds, Driver, Holding, Lease, Upkeep};
use crate::drivers::batches::Batches;
use crate::drivers::sql::pool::{RESPONSE_TIMEOUT, StatementPool, Unanswered};
use crate::drivers::sql::row_lock::{Fence, RowLocks};
use crate::drivers::sql::wake::{ServerLock, ServerLocks};
use crate::drivers::sql::{
    CONNECT_TIMEOUT, Dialect, ForgetIdle, KeyFloor, MAX_RENEW_BATCH, POOL_SIZE, RELEASE_CHANNEL,
    RELISTEN_MAX, RELISTEN_MIN, SEEN_HELD_REMEMBERED, SqlMode, Statements, forget_seeded,
    highest_token, holding_from_row, is_missing_table, make_floor, map_err, micros, ms,
    renew_batch, row_table, taken, token,
};
use crate::error::{Error, Result};
use crate::names::validate_sql_identifier;

/// How long creating the tables may take: the statement can wait behind another session's use
/// of the table's definition.
const DDL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a sweep of a family's idle keys may take, all its statements together (each stall
/// inside it is bounded by the server, [`Dialect::sweep_bounds`]).
const SWEEP_TIMEOUT: Duration = Duration::from_secs(60);

pub struct SqlDriver {
    pub(crate) dialect: Dialect,
    pub(crate) pool: StatementPool,
    pub(crate) sql: Statements,
    mode: SqlMode,
    /// Whether the row-lock table's name (the table's, `_rows` added) is one the server keeps
    /// whole: a longer one would be cut short, and name another table, or the lock table itself.
    row_table_fits: bool,
    /// Row-lock mode's open transactions.
    row_locks: Option<RowLocks>,
    /// The table is created on first use, so that a database that is down at start-up is
    /// reported by readiness rather than by a crash.
    provisioned: OnceCell<()>,
    pub(crate) releases: Arc<ChangeFeeds>,
    listener: Option<tokio::task::JoinHandle<()>>,
    /// The server locks that wake waiters: MySQL's named locks, PostgreSQL's advisory locks
    /// (lease mode; see [`SqlDriver::server_lock`]).
    server_locks: Option<Arc<ServerLocks>>,
    /// Renewals that arrive together go out together ([`RenewMany`]).
    renewals: Batches<(Lease, Duration), Result<bool>>,
    /// The families whose floor row this process has made sure of ([`KeyFloor`]).
    floors: std::sync::Mutex<std::collections::HashSet<String>>,
    /// MySQL in lease mode: the locks this process last found held ([`SqlDriver::poll_mysql`]).
    seen_held: std::sync::Mutex<std::collections::HashSet<String>>,
    /// In-memory files holding PEM text given inline, open while the pool may connect.
    _pem_files: Vec<std::fs::File>,
}

/// The database drivers' TLS options that name a PEM file.
pub(crate) const PEM_OPTIONS: [&str; 8] = [
    "sslrootcert",
    "ssl-root-cert",
    "sslca",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
];

/// Whether an option's value is PEM text given inline rather than a file's name: anything that
/// holds a PEM header, wherever it starts (a key exported by `openssl pkcs12 -nodes` begins with
/// "Bag Attributes").
pub(crate) fn inline_pem(value: &str) -> bool {
    value.contains("-----BEGIN")
}

/// `url` as it may be shown: its credentials hidden ([`crate::redact::redact_url`]), and every
/// value of PEM text given inline, and every TLS option's value that is not a plain file name,
/// replaced by `inline-pem`.
pub(crate) fn shown_url(url: &url::Url) -> String {
    let mut shown = url.clone();
    if shown.query().is_some() {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let hidden = inline_pem(&v) || (PEM_OPTIONS.contains(&&*k) && v.contains('\n'));
                let v = if hidden {
                    "inline-pem".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        shown.query_pairs_mut().clear().extend_pairs(pairs);
    }
    crate::redact::redact_url(&shown)
}

/// A database URL given as text, as it may be shown in an error: as [`shown_url`] shows it once
/// parsed. One that does not parse is shown redacted ([`crate::redact::redact`]) unless it
/// holds a PEM header, and then not at all: its query may hold a key.
pub(crate) fn shown_raw_url(raw: &str) -> String {
    match url::Url::parse(raw) {
        Ok(url) => shown_url(&url),
        Err(_) if raw.contains("BEGIN") => "the database URL".to_owned(),
        Err(_) => crate::redact::redact(raw),
    }
}

/// `url` with every TLS option that carries PEM text (a Secret's, from a `DistributedLock`)
/// turned into the name of an in-memory file holding it: the database drivers read these
/// options as file names, and the sidecar's root filesystem is read-only. The files are
/// returned, to be kept open as long as connections may be made.
fn pem_text_to_files(url: &str) -> Result<(String, Vec<std::fs::File>)> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let invalid = |reason: String| Error::InvalidUrl {
        url: shown_raw_url(url),
        reason,
    };
    let mut parsed = url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
    let inline = |(k, v): &(String, String)| PEM_OPTIONS.contains(&k.as_str()) && inline_pem(v);
    let pairs: Vec<(String, String)> = parsed.query_pairs().into_owned().collect();
    if !pairs.iter().any(inline) {
        return Ok((url.to_owned(), Vec::new()));
    }
    let mut files = Vec::new();
    let mut rewritten = Vec::new();
    for pair in pairs {
        if !inline(&pair) {
            rewritten.push(pair);
            continue;
        }
        let fd =
            nix::sys::memfd::memfd_create(c"leasehold-tls", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                .map_err(|e| invalid(format!("cannot hold {} in memory: {e}", pair.0)))?;
        let mut file = std::fs::File::from(fd);
        file.write_all(pair.1.as_bytes())
            .map_err(|e| invalid(format!("cannot hold {} in memory: {e}", pair.0)))?;
        rewritten.push((pair.0, format!("/proc/self/fd/{}", file.as_raw_fd())));
        files.push(file);
    }
    parsed.query_pairs_mut().clear().extend_pairs(rewritten);
    Ok((parsed.into(), files))
}

impl Drop for SqlDriver {
    fn drop(&mut self) {
        if let Some(listener) = &self.listener {
            listener.abort();
        }
    }
}

impl SqlDriver {
    /// A lazily connecting pool; `url` is the database's own URL (credentials included, never
    /// logged).
    pub fn connect(
        dialect: Dialect,
        url: &str,
        schema: Option<&str>,
        table: &str,
        mode: SqlMode,
    ) -> Result<Self> {
        // sqlx builds a `verify-ca` verifier from the process's provider.
        crate::tls::use_ring_provider();
        validate_sql_identifier("table name", table)?;
        let row_table_fits =
            validate_sql_identifier("row-lock table name (table + \"_rows\")", &row_table(table));
        if mode == SqlMode::RowLock {
            row_table_fits.clone()?;
        }
        if let Some(schema) = schema {
            validate_sql_identifier("schema name", schema)?;
        }
        let (url, pem_files) = pem_text_to_files(url)?;
        let url = url.as_str();
        sqlx::any::install_default_drivers();
        let options = AnyPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(CONNECT_TIMEOUT)
            // sqlx pings a pooled connection before each use by default: a second round trip
            // for every statement, a hand-over's two included. A dead connection fails its
            // statement instead, which the engine counts as a backend error and tries again.
            .test_before_acquire(false)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    sqlx::Executor::execute(&mut *conn, dialect.session_setup()).await?;
                    sqlx::Executor::execute(&mut *conn, &*dialect.pool_lock_wait())
                        .await
                        .map(|_| ())
                })
            });
        let pool = StatementPool::connect_lazy(options, url).map_err(|e| Error::InvalidUrl {
            url: crate::redact::redact(url),
            reason: e.to_string(),
        })?;
        let releases = Arc::new(ChangeFeeds::default());
        let sql = dialect.statements(schema, table);
        let server_lock = match (dialect, mode) {
            // Row-lock mode's release ends the row's transaction too: on the pool's session.
            (Dialect::MySql, SqlMode::Lease) => Some(ServerLock::Named(sql.named_release.clone())),
            (Dialect::MySql, SqlMode::RowLock) => Some(ServerLock::Named(None)),
            (Dialect::Postgres, SqlMode::Lease) => sql.advisory.clone().map(ServerLock::Advisory),
            // Row-lock mode's holder keeps its row locked on a session of its own already;
            // its waiters hear `NOTIFY`.
            (Dialect::Postgres, SqlMode::RowLock) => None,
        };
        let database = url::Url::parse(url)
            .map(|url| url.path().trim_start_matches('/').to_owned())
            .unwrap_or_default();
        let place = super::wake::wake_place(&database, schema, table);
        let server_locks = server_lock
            .map(|kind| ServerLocks::new(kind, url, &place, &sql.observe, releases.clone()));
        let listener = (dialect == Dialect::Postgres).then(|| {
            tokio::spawn(listen_for_releases(
                url.to_owned(),
                releases.clone(),
                server_locks.clone(),
            ))
        });
        let renewals = {
            let (pool, many) = (pool.clone(), Arc::new(sql.renew_many.clone()));
            Batches::new(MAX_RENEW_BATCH, move |batch| {
                renew_batch(pool.clone(), many.clone(), batch)
            })
        };
        Ok(Self {
            dialect,
            pool,
            sql,
            mode,
            row_table_fits: row_table_fits.is_ok(),
            row_locks: (mode == SqlMode::RowLock).then(|| RowLocks::new(url)),
            provisioned: OnceCell::new(),
            server_locks,
            releases,
            listener,
            renewals,
            floors: Default::default(),
            seen_held: Default::default(),
            _pem_files: pem_files,
        })
    }

    pub fn mode(&self) -> SqlMode {
        self.mode
    }

    /// The server locks that wake `lock`'s waiters. Not for a family's keys on PostgreSQL:
    /// an advisory lock's session per acquisition would cost every cycle of a key a statement
    /// (or a connection) more, and `NOTIFY` wakes their waiters.
    fn server_lock(&self, lock: &str) -> Option<&Arc<ServerLocks>> {
        let keyed_postgres =
            self.dialect == Dialect::Postgres && crate::names::family_of(lock).is_some();
        self.server_locks.as_ref().filter(|_| !keyed_postgres)
    }

    /// The compare-and-set on the lock row: the new token, or `None` while someone holds it.
    pub(crate) async fn acquire_row(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<Option<u64>> {
        match self.dialect {
            Dialect::Postgres => self.acquire_postgres(lock, identity, ttl).await,
            Dialect::MySql => self.acquire_mysql(lock, identity, ttl).await,
        }
    }

    pub(crate) async fn renew_row(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        self.renewals.call((lease.clone(), ttl)).await?
    }

    /// [`Self::release_row`] on a connection of the pool's.
    async fn release_row_on_pool(&self, lease: &Lease) -> Result<bool> {
        let mut session = self.pool.session().await.map_err(map_err)?;
        session.run(|c| self.release_row(c, lease)).await
    }

    /// Free the lock row if `lease` still holds it, on the pool or inside a transaction.
    pub(crate) async fn release_row<'c, E>(&self, executor: E, lease: &Lease) -> Result<bool>
    where
        E: sqlx::Executor<'c, Database = sqlx::Any>,
    {
        let query = sqlx::query(&self.sql.release)
            .bind(&lease.lock)
            .bind(&lease.identity)
            .bind(token(lease));
        Ok(match self.dialect {
            Dialect::Postgres => {
                let row = query.fetch_one(executor).await.map_err(map_err)?;
                row.try_get::<i64, _>("released").map_err(map_err)? == 1
            }
            Dialect::MySql => {
                query
                    .execute(executor)
                    .await
                    .map_err(map_err)?
                    .rows_affected()
                    == 1
            }
        })
    }

    /// Create the tables if they are absent, once per process.
    pub(crate) async fn ensure_tables(&self) -> Result<()> {
        self.provisioned
            .get_or_try_init(|| async {
                let mut session = self.pool.session().await.map_err(map_err)?;
                session
                    .run_within(DDL_TIMEOUT, |c| {
                        sqlx::query(&self.sql.create_table).execute(c)
                    })
                    .await
                    .map_err(map_err)?;
                if self.mode == SqlMode::RowLock {
                    session
                        .run_within(DDL_TIMEOUT, |c| {
                            sqlx::query(&self.sql.create_row_table).execute(c)
                        })
                        .await
                        .map_err(map_err)?;
                }
                Ok::<_, Error>(())
            })
            .await?;
        Ok(())
    }

    /// Row-lock mode: insert the lock's row if absent. A row that exists is not inserted again:
    /// on MySQL the insertion would wait for the lock of a holder's transaction on the row
    /// ([`Dialect::seed_without_waiting`]), for as long as it holds.
    pub(crate) async fn seed_row(&self, lock: &str) -> Result<()> {
        let exists = self
            .pool
            .fetch_optional(sqlx::query(&self.sql.row_exists).bind(lock))
            .await
            .map_err(map_err)?;
        if exists.is_some() {
            return Ok(());
        }
        self.pool
            .execute(sqlx::query(&self.sql.seed_row).bind(lock))
            .await
            .map_err(map_err)?;
        Ok(())
    }

    /// [`Upkeep::forget_idle_keys`] on `conn`, in one transaction bounded by the server
    /// ([`Dialect::sweep_bounds`]).
    async fn forget_idle_keys_on(
        &self,
        conn: &mut sqlx::AnyConnection,
        family: &str,
        idle_for: Duration,
    ) -> Result<u64> {
        let floor = &self.sql.key_floor;
        let row = crate::names::key_floor_row(family);
        let [plain, hashed] = crate::names::key_name_patterns(family);
        let bounds = &*self.dialect.sweep_bounds();
        if self.dialect == Dialect::MySql {
            sqlx::Executor::execute(&mut *conn, bounds)
                .await
                .map_err(map_err)?;
        }
        let mut tx = sqlx::Connection::begin(conn).await.map_err(map_err)?;
        if self.dialect == Dialect::Postgres {
            sqlx::Executor::execute(&mut *tx, bounds)
                .await
                .map_err(map_err)?;
        }
        make_floor(&mut tx, floor, family).await?;
        sqlx::query(&floor.lock)
            .bind(&row)
            .fetch_all(&mut *tx)
            .await
            .map_err(map_err)?;
        let forgotten = match &floor.forget {
            ForgetIdle::Postgres(forget) => {
                let forgotten: i64 = sqlx::query(forget)
                    .bind(&row)
                    .bind(&plain)
                    .bind(&hashed)
                    .bind(ms(idle_for))
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(map_err)?
                    .try_get("forgotten")
                    .map_err(map_err)?;
                u64::try_from(forgotten).unwrap_or(0)
            }
            ForgetIdle::MySql {
                cutoff,
                highest,
                raise,
                delete,
            } => {
                sqlx::query(cutoff)
                    .bind(micros(idle_for))
                    .execute(&mut *tx)
                    .await
                    .map_err(map_err)?;
                let highest = highest_token(&mut tx, highest, [&plain, &hashed]).await?;
                sqlx::query(raise)
                    .bind(highest)
                    .bind(&row)
                    .execute(&mut *tx)
                    .await
                    .map_err(map_err)?;
                sqlx::query(delete)
                    .bind(&plain)
                    .bind(&hashed)
                    .bind(highest)
                    .execute(&mut *tx)
                    .await
                    .map_err(map_err)?
                    .rows_affected()
            }
        };
        if self.row_locks.is_some() {
            forget_seeded(&mut tx, &self.sql.forget_seeded, &plain, &hashed).await?;
        }
        tx.commit().await.map_err(map_err)?;
        Ok(forgotten)
    }

    /// Make sure `family`'s floor row exists: once per process, or again when `again`.
    async fn ensure_floor(&self, floor: &KeyFloor, family: &str, again: bool) -> Result<()> {
        let known = || {
            self.floors
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(family)
        };
        if !again && known() {
            return Ok(());
        }
        let mut session = self.pool.session().await.map_err(map_err)?;
        let created = session.run(|c| make_floor(c, floor, family)).await?;
        if again && created && known() {
            tracing::warn!(
                family,
                "the family's token floor row was missing (deleted by hand?): made again above \
                 its keys' highest recorded token; keys forgotten as idle before may repeat theirs"
            );
        }
        self.floors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(family.to_owned());
        Ok(())
    }

    /// [`Self::acquire_row`], or who holds the lock. A lock found free, yet not taken, is for a
    /// family's key one whose floor row may be gone (deleted by hand; the acquisition reads it):
    /// put back, and tried once more.
    async fn acquire_row_or_holder(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<std::result::Result<u64, Option<Holding>>> {
        if let Some(token) = self.acquire_row(lock, identity, ttl).await? {
            return Ok(Ok(token));
        }
        let holder = self.observe(lock).await?;
        let Some(family) = crate::names::family_of(lock).filter(|_| holder.is_none()) else {
            return Ok(Err(holder));
        };
        self.ensure_floor(&self.sql.key_floor, family, true).await?;
        Ok(match self.acquire_row(lock, identity, ttl).await? {
            Some(token) => Ok(token),
            None => Err(self.observe(lock).await?),
        })
    }

    async fn acquire_postgres(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<Option<u64>> {
        let query = match crate::names::family_of(lock) {
            Some(family) => {
                let floor = &self.sql.key_floor;
                self.ensure_floor(floor, family, false).await?;
                sqlx::query(&floor.acquire)
                    .bind(lock)
                    .bind(identity)
                    .bind(ms(ttl))
                    .bind(crate::names::key_floor_row(family))
            }
            None => sqlx::query(&self.sql.acquire)
                .bind(lock)
                .bind(identity)
                .bind(ms(ttl)),
        };
        let rows = self.pool.fetch_all(query).await.map_err(map_err)?;
        rows.first()
            .map(|row| row.try_get::<i64, _>("token").map(|t| t as u64))
            .transpose()
            .map_err(map_err)
    }

    /// The take-over of `lock`'s row where it is free or run out: one statement.
    async fn take_over_mysql(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<Option<u64>> {
        // LAST_INSERT_ID(token + 1) puts the new token in the statement's own OK packet: one
        // round trip, and no other session can see or change it in between.
        let taken = self
            .pool
            .execute(
                sqlx::query(&self.sql.acquire)
                    .bind(identity)
                    .bind(micros(ttl))
                    .bind(lock),
            )
            .await
            .map_err(map_err)?;
        if taken.rows_affected() != 1 {
            return Ok(None);
        }
        let token = taken.last_insert_id().ok_or_else(|| {
            Error::Backend("MySQL did not return the new token (LAST_INSERT_ID)".into())
        })?;
        Ok(Some(token as u64))
    }

    /// A waiter's poll of a lock this process last found held (MySQL, lease mode): the take-over,
    /// then the read of who holds, two statements. An attempt on a lock not known held tries
    /// the insertion of its first row before the read instead (three statements when held),
    /// which a lock taken once, as a family's new key, needs. `None` when the read finds no
    /// holder: the lock is to be tried in full.
    async fn poll_mysql(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<Option<Acquire>> {
        if let Some(token) = self.take_over_mysql(lock, identity, ttl).await? {
            return Ok(Some(taken(lock, identity, token)));
        }
        Ok(self
            .observe(lock)
            .await?
            .map(|holder| Acquire::Busy(Some(holder))))
    }

    /// Remember whether `lock` was found held, for the next attempt's order of statements.
    fn saw_held(&self, lock: &str, held: bool) {
        let mut seen = self.seen_held.lock().unwrap_or_else(|e| e.into_inner());
        if !held {
            seen.remove(lock);
            return;
        }
        // Only an order of statements rides on it: past this many locks, start over.
        if seen.len() >= SEEN_HELD_REMEMBERED && !seen.contains(lock) {
            seen.clear();
        }
        seen.insert(lock.to_owned());
    }

    async fn acquire_mysql(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> Result<Option<u64>> {
        if let Some(token) = self.take_over_mysql(lock, identity, ttl).await? {
            return Ok(Some(token));
        }
        if let Some(family) = crate::names::family_of(lock) {
            let floor = &self.sql.key_floor;
            self.ensure_floor(floor, family, false).await?;
            let inserted = self
                .pool
                .execute(
                    sqlx::query(&floor.acquire)
                        .bind(lock)
                        .bind(identity)
                        .bind(micros(ttl))
                        .bind(crate::names::key_floor_row(family)),
                )
                .await
                .map_err(map_err)?;
            if inserted.rows_affected() != 1 {
                return Ok(None);
            }
            let token = inserted.last_insert_id().ok_or_else(|| {
                Error::Backend("MySQL did not return the new token (LAST_INSERT_ID)".into())
            })?;
            return Ok(Some(token as u64));
        }
        let insert = self.sql.insert.as_deref().unwrap_or_default();
        let inserted = self
            .pool
            .execute(
                sqlx::query(insert)
                    .bind(lock)
                    .bind(identity)
                    .bind(micros(ttl)),
            )
            .await
            .map_err(map_err)?;
        Ok((inserted.rows_affected() == 1).then_some(1))
    }
}

/// How long the LISTEN connection may hear nothing before it is pinged.
const LISTEN_QUIET: Duration = Duration::from_secs(5);

/// One LISTEN connection per process; a lost connection wakes every waiter, since a release may
/// have gone unheard meanwhile.
async fn listen_for_releases(
    url: String,
    feeds: Arc<ChangeFeeds>,
    server_locks: Option<Arc<ServerLocks>>,
) {
    let mut pause = RELISTEN_MIN;
    loop {
        let listening = tokio::time::timeout(CONNECT_TIMEOUT, async {
            let mut listener = sqlx::postgres::PgListener::connect(&url).await?;
            listener.listen(RELEASE_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        })
        .await;
        match listening {
            Ok(Ok(mut listener)) => {
                pause = RELISTEN_MIN;
                feeds.bump_all();
                loop {
                    let heard = tokio::time::timeout(LISTEN_QUIET, listener.try_recv()).await;
                    let Ok(heard) = heard else {
                        // Quiet: a ping tells a quiet connection from one the server fell
                        // silent on, which would leave every release unheard. (`try_recv` is
                        // cancel-safe; a notice arriving during the ping is kept for it.)
                        let ping = sqlx::Executor::execute(&mut listener, "SELECT 1");
                        if !matches!(
                            tokio::time::timeout(RESPONSE_TIMEOUT, ping).await,
                            Ok(Ok(_))
                        ) {
                            tracing::debug!("postgres LISTEN connection fell silent");
                            feeds.bump_all();
                            break;
                        }
                        continue;
                    };
                    match heard {
                        Ok(Some(notice)) => {
                            let lock = notice.payload();
                            // A waiter blocked in the server is woken there, taking the row.
                            if !server_locks.as_ref().is_some_and(|s| s.heard_release(lock)) {
                                feeds.bump(lock);
                            }
                        }
                        // The connection dropped; try_recv reconnects on the next call.
                        Ok(None) => feeds.bump_all(),
                        Err(e) => {
                            tracing::debug!(error = %e, "postgres LISTEN failed");
                            break;
                        }
                    }
                }
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "postgres LISTEN could not start"),
            Err(_) => tracing::debug!("postgres LISTEN timed out"),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RELISTEN_MAX);
    }
}

#[async_trait]
impl Driver for SqlDriver {
    fn kind(&self) -> &'static str {
        self.dialect.as_str()
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        let server_lock = self.server_lock(lock);
        // Taken already, by this waiter's blocking statement, which woke it.
        if let Some(lease) = server_lock.and_then(|s| s.take_woken(lock, identity, ttl)) {
            return Ok(Acquire::Acquired(lease));
        }
        self.ensure_tables().await?;
        let mysql_lease = self.dialect == Dialect::MySql && self.row_locks.is_none();
        let known_held = mysql_lease
            && self
                .seen_held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(lock);
        let polled = if known_held {
            self.poll_mysql(lock, identity, ttl).await?
        } else {
            None
        };
        let acquired = match (polled, &self.row_locks) {
            (Some(polled), _) => polled,
            (None, Some(row_locks)) => row_locks.try_acquire(self, lock, identity, ttl).await?,
            (None, None) => match self.acquire_row_or_holder(lock, identity, ttl).await? {
                Ok(token) => taken(lock, identity, token),
                Err(holder) => Acquire::Busy(holder),
            },
        };
        if mysql_lease {
            self.saw_held(lock, matches!(acquired, Acquire::Busy(Some(_))));
        }
        match (&acquired, server_lock) {
            (Acquire::Acquired(lease), Some(server)) => {
                server.held(lock, &lease.identity, lease.token)
            }
            // A waiter here: block on the lock's server lock. Not at the subscription, which
            // comes before every attempt: a session per acquisition of a free lock would be
            // spent for nothing. A release between the two leaves the server lock free, so the
            // waiter's first wait is granted at once and wakes it.
            (Acquire::Busy(_), Some(server)) if self.releases.is_subscribed(lock) => {
                server.watch(lock, identity, ttl)
            }
            _ => {}
        }
        Ok(acquired)
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let renewed = match &self.row_locks {
            Some(row_locks) => row_locks.renew(self, lease, ttl).await,
            None => self.renew_row(lease, ttl).await,
        };
        if let Some(server) = self.server_lock(&lease.lock) {
            server.forget_counted(lease);
            if let Ok(false) = renewed {
                server.let_go(&lease.lock, &lease.identity, lease.token);
            }
        }
        renewed
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let server_lock = self.server_lock(&lease.lock);
        // On the server lock's session, which lets it go in the same statement (PostgreSQL,
        // and MySQL in lease mode).
        let released_there = match server_lock {
            Some(server) => server.release(lease).await,
            None => None,
        };
        // There, the server lock went in the same statement.
        let let_go = released_there.is_none();
        let released = match (released_there, &self.row_locks) {
            (Some(released), _) => released.map_err(map_err)?,
            (None, Some(row_locks)) => row_locks.release(self, lease).await?,
            (None, None) => self.release_row_on_pool(lease).await?,
        };
        // Not held either way now: the next waiter goes.
        if let (true, Some(server)) = (let_go, server_lock) {
            server.let_go(&lease.lock, &lease.identity, lease.token);
        }
        if released {
            self.releases.bump(&lease.lock);
        }
        Ok(released)
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        self.ensure_tables().await?;
        let rows = self
            .pool
            .fetch_all(sqlx::query(&self.sql.observe).bind(lock))
            .await
            .map_err(map_err)?;
        rows.first()
            .map(holding_from_row)
            .transpose()
            .map_err(map_err)
    }

    fn changes(&self, lock: &str) -> Option<watch::Receiver<u64>> {
        Some(self.releases.subscribe(lock))
    }

    /// A row taken in a waiter's blocking statement counts from the database's writing it,
    /// before the engine asked for it.
    fn counted_from(&self, lease: &Lease, sent: BootInstant) -> BootInstant {
        match self.server_lock(&lease.lock) {
            Some(server) => server.counted_from(lease, sent),
            None => sent,
        }
    }

    /// PostgreSQL waiters are woken by NOTIFY, MySQL's by named locks, and both read the row once
    /// per renew interval as a fallback.
    fn poll_interval(&self, renew_interval: Duration) -> Duration {
        renew_interval
    }

    async fn ping(&self) -> Result<()> {
        let mut session = self.pool.session().await.map_err(map_err)?;
        session.run(|c| c.ping()).await.map_err(map_err)
    }
}

#[async_trait]
impl Upkeep for SqlDriver {
    /// MySQL/MariaDB: the server-wide settings that let a commit be acknowledged and then lost
    /// in a crash ([`durability_warnings`]); no session can raise them.
    async fn warnings(&self) -> Result<Vec<String>> {
        if self.dialect != Dialect::MySql {
            return Ok(Vec::new());
        }
        let row = self
            .pool
            .fetch_one(sqlx::query(
                "SELECT CAST(@@innodb_flush_log_at_trx_commit AS SIGNED) AS flush, \
                 CAST(@@log_bin AS SIGNED) AS log_bin, CAST(@@sync_binlog AS SIGNED) AS sync_binlog",
            ))
            .await
            .map_err(map_err)?;
        let setting = |name| row.try_get::<i64, _>(name).map_err(map_err);
        Ok(durability_warnings(
            setting("flush")?,
            setting("log_bin")? != 0,
            setting("sync_binlog")?,
        ))
    }

    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        self.ensure_tables().await?;
        let [plain, hashed] = crate::names::key_name_patterns(family);
        let held: i64 = self
            .pool
            .fetch_one(
                sqlx::query(&self.sql.key_floor.count_held)
                    .bind(&plain)
                    .bind(&hashed),
            )
            .await
            .map_err(map_err)?
            .try_get("held")
            .map_err(map_err)?;
        Ok(Some(u64::try_from(held).unwrap_or(0)))
    }

    async fn forget_idle_keys(&self, family: &str, idle_for: Duration) -> Result<u64> {
        self.ensure_tables().await?;
        let mut session = self.pool.session().await.map_err(map_err)?;
        match self.dialect {
            // MySQL's bounds stay with the session: the sweep runs on a connection of its
            // own, closed once it is done.
            Dialect::MySql => {
                let mut own = session.detach();
                let forgotten = tokio::time::timeout(
                    SWEEP_TIMEOUT,
                    self.forget_idle_keys_on(&mut own, family, idle_for),
                )
                .await;
                let Ok(forgotten) = forgotten else {
                    // Unanswered: dropped, not closed, which would wait on it again.
                    return Err(Unanswered::unanswered(SWEEP_TIMEOUT));
                };
                let _ = tokio::time::timeout(RESPONSE_TIMEOUT, own.close()).await;
                forgotten
            }
            Dialect::Postgres => {
                session
                    .run_within(SWEEP_TIMEOUT, |c| {
                        self.forget_idle_keys_on(c, family, idle_for)
                    })
                    .await
            }
        }
    }

    /// Create the lock table (and in row-lock mode the row table, seeded with `locks`) if
    /// absent; needs CREATE the first time only.
    /// In row-lock mode the row is held `FOR UPDATE` by this process's own transaction: the
    /// fence is freed and the row deleted in that transaction, which then commits. Released
    /// first and deleted after, a contender woken by the release could take the row and the
    /// fence in between, and the deletion would free the fence under it.
    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        if let Some(row_locks) = &self.row_locks {
            return row_locks.release_deleting_row(self, lease).await;
        }
        // In lease mode the row freed, matched as a release is, is the deletion (the row keeps
        // the token).
        crate::driver::deleted_as_released(lease, self.release(lease).await?)
    }

    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        // A lease-mode table whose name leaves no room for `_rows` never had a row table.
        let statements = match self.row_table_fits {
            true => &[&self.sql.delete_lock, &self.sql.delete_row][..],
            false => &[&self.sql.delete_lock][..],
        };
        for lock in locks {
            for statement in statements {
                match self.pool.execute(sqlx::query(statement).bind(lock)).await {
                    Ok(_) => {}
                    // The table was never created: nothing to remove.
                    Err(e) if is_missing_table(&e) => {}
                    Err(e) => return Err(map_err(e)),
                }
            }
        }
        Ok(())
    }

    async fn provision(&self, locks: &[String]) -> Result<()> {
        self.ensure_tables().await?;
        if self.mode == SqlMode::RowLock {
            for lock in locks {
                self.seed_row(lock).await?;
            }
        }
        Ok(())
    }
}

impl Fence for SqlDriver {
    fn dialect(&self) -> Dialect {
        self.dialect
    }

    fn statements(&self) -> &Statements {
        &self.sql
    }

    async fn holder(&self, lock: &str) -> Result<Option<Holding>> {
        Driver::observe(self, lock).await
    }

    fn acquire_row(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<std::result::Result<u64, Option<Holding>>>> + Send {
        SqlDriver::acquire_row_or_holder(self, lock, identity, ttl)
    }

    fn renew_row(&self, lease: &Lease, ttl: Duration) -> impl Future<Output = Result<bool>> + Send {
        SqlDriver::renew_row(self, lease, ttl)
    }

    fn release_row(&self, lease: &Lease) -> impl Future<Output = Result<bool>> + Send {
        SqlDriver::release_row_on_pool(self, lease)
    }

    fn release_row_in(
        &self,
        tx: &mut sqlx::AnyConnection,
        lease: &Lease,
    ) -> impl Future<Output = Result<bool>> + Send {
        SqlDriver::release_row(self, tx, lease)
    }
}

/// What MySQL/MariaDB's settings `innodb_flush_log_at_trx_commit`, `log_bin` and `sync_binlog`
/// endanger. A commit not on disk when acknowledged can vanish in a crash: an acquisition lost
/// so repeats its token beside the holder that still claims it, a renewal lost ends a holder's
/// row early. With the binary log on, crash recovery also rolls back what InnoDB prepared but
/// the binary log lacks, so `sync_binlog` must be 1 as well.
pub(crate) fn durability_warnings(flush: i64, log_bin: bool, sync_binlog: i64) -> Vec<String> {
    let mut warnings = Vec::new();
    // 1, and MariaDB's 3 (as 1, with group commit), write and sync the log at each commit.
    if flush == 0 || flush == 2 {
        warnings.push(format!(
            "innodb_flush_log_at_trx_commit is {flush}: a crash may lose acquisitions and renewals already answered (a token handed out twice, two holders); set it to 1"
        ));
    }
    if log_bin && sync_binlog != 1 {
        warnings.push(format!(
            "sync_binlog is {sync_binlog} with the binary log on: crash recovery may roll back acquisitions and renewals already answered (a token handed out twice, two holders); set it to 1"
        ));
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::durability_warnings;

    #[test]
    fn only_settings_that_lose_answered_commits_are_warned_of() {
        assert!(durability_warnings(1, false, 0).is_empty());
        assert!(durability_warnings(1, true, 1).is_empty());
        assert!(durability_warnings(3, false, 0).is_empty());
        for (flush, log_bin, sync_binlog, says) in [
            (2, false, 0, "innodb_flush_log_at_trx_commit is 2"),
            (0, true, 1, "innodb_flush_log_at_trx_commit is 0"),
            (1, true, 0, "sync_binlog is 0"),
            (1, true, 100, "sync_binlog is 100"),
        ] {
            let warnings = durability_warnings(flush, log_bin, sync_binlog);
            assert_eq!(warnings.len(), 1, "{warnings:?}");
            assert!(warnings[0].contains(says), "{warnings:?}");
        }
        assert_eq!(durability_warnings(2, true, 0).len(), 2);
    }
}
