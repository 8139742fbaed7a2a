//! The SQL family: PostgreSQL and MySQL/MariaDB ([`server`], lease mode, with `row_lock` for
//! row-lock mode and [`wake`] for waiters woken through the server), and the SQLite file
//! ([`sqlite`], with `sqlite_wake`), with their URLs (`urls`); the servers' statements go out on
//! `pool`, with a time limit on each answer. This module holds what they share: the dialects and their statements, the modes, the key floors, batched renewals and
//! the row decoding.

pub(crate) mod pool;
pub(crate) mod row_lock;
pub mod server;
pub mod sqlite;
pub(crate) mod sqlite_wake;
pub use sqlite_wake::wake_file;
mod urls;
pub use urls::SqlServer;
pub mod wake;

pub use server::SqlDriver;

use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;
use sqlx::{AnyConnection, Connection};

use crate::driver::{Acquire, Holding, Lease};
use crate::drivers::batches::Pending;
use crate::drivers::sql::pool::StatementPool;
use crate::drivers::sql::wake::AdvisoryStatements;
use crate::error::{Error, Result};
use crate::names::{quote_sql_identifier, validate_sql_identifier};

/// Where a PostgreSQL or MySQL/MariaDB lock table lives: `postgres://` or `mysql://`
/// (`mariadb://`) with `?table=&schema=&mode=lease|row-lock`; every other query parameter goes
/// to the database driver (e.g. `sslmode`).
#[derive(Clone, PartialEq, Eq)]
pub struct SqlConfig {
    pub dialect: Dialect,
    pub url: url::Url,
    pub table: String,
    pub schema: Option<String>,
    pub mode: SqlMode,
}

/// The NOTIFY channel of releases; the payload is the lock name.
pub const RELEASE_CHANNEL: &str = "leasehold_released";
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
pub(crate) const RELISTEN_MIN: Duration = Duration::from_millis(100);
pub(crate) const RELISTEN_MAX: Duration = Duration::from_secs(2);
/// Connections per sidecar: renewals of several locks, and acquisitions, in parallel.
pub(crate) const POOL_SIZE: u32 = 4;

/// How a lock is held (`?mode=` in the URL, `lockMode` in the resource).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SqlMode {
    /// A row with holder, token and expiry, renewed by the holder (the default).
    #[default]
    Lease,
    /// The same row as the fence, plus a seeded row held `SELECT ... FOR UPDATE` in an open
    /// transaction on a dedicated connection; see [`crate::drivers::sql::row_lock`].
    RowLock,
}

impl SqlMode {
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "lease" => Some(SqlMode::Lease),
            "row-lock" => Some(SqlMode::RowLock),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SqlMode::Lease => "lease",
            SqlMode::RowLock => "row-lock",
        }
    }
}

/// The table of row-lock mode's seeded rows, beside the lock table.
pub fn row_table(table: &str) -> String {
    format!("{table}_rows")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Postgres,
    MySql,
}

/// The statements of one dialect for one table (public so that the benchmark can issue the
/// very same SQL raw, as its baseline).
pub struct Statements {
    pub create_table: String,
    /// Row-lock mode: one seeded row per lock, held `FOR UPDATE` by the holder's transaction.
    pub create_row_table: String,
    pub seed_row: String,
    /// Row-lock mode: whether a lock's row exists, read without taking or waiting for a lock.
    pub row_exists: String,
    pub lock_row: String,
    /// Postgres: the whole acquisition. MySQL: the take-over of an existing row.
    pub acquire: String,
    /// MySQL only: the first acquisition of a lock, inserting its row.
    pub insert: Option<String>,
    /// Many renewals at once ([`RenewMany`]).
    pub renew_many: RenewMany,
    pub release: String,
    pub observe: String,
    /// Clean-up of a deleted lock: its lease row is freed but kept with its token (so that a
    /// lock created again under the name continues above it), and its seeded row goes.
    pub delete_lock: String,
    pub delete_row: String,
    /// A family's idle keys forgotten above its token floor: see [`KeyFloor`].
    pub key_floor: KeyFloor,
    /// Row-lock mode: the seeded rows of a family's forgotten keys.
    pub forget_seeded: ForgetSeeded,
    /// PostgreSQL: the statements on an advisory lock's session ([`crate::drivers::sql::wake`]).
    pub(crate) advisory: Option<AdvisoryStatements>,
    /// MySQL/MariaDB in lease mode: the release on the named lock's session, which lets the
    /// named lock `?` (bound first) go as it frees the row, before the commit; then as
    /// [`Statements::release`].
    pub(crate) named_release: Option<String>,
}

/// Row-lock mode's seeded rows of a family's keys that have no lease row left (the sweep that
/// deleted them runs this in its transaction), skipping every row a holder or an acquisition
/// has locked (`FOR UPDATE SKIP LOCKED`): the sweep never waits for a holder, and a row it
/// deletes is one nobody holds. An acquisition that seeded a row the sweep then deleted seeds
/// it again. Exclusion never rests on a seeded row being there: the fence does.
pub enum ForgetSeeded {
    /// One statement: `$1`/`$2` the keys' name patterns.
    Postgres(String),
    /// The rows locked and read (patterns), then deleted by name: MySQL's `DELETE` has no
    /// `SKIP LOCKED`, and would wait for every holder's row it scans.
    MySql { select: String, table: String },
}

/// Renewals, one or many at once. Each row is extended only where its holder and token are the
/// renewal's and its lease still runs (by the database's clock), and the rows extended are read back:
/// PostgreSQL's `UPDATE` returns them; MySQL's cannot, so a second statement reads which of the
/// renewals' rows now run past the present. A row that matched a renewal's holder and token but
/// was not extended had run out, and a token never comes back, so it cannot match that read;
/// a row extended and then released by its own holder before the read is answered as not
/// renewed, which is no loss.
#[derive(Clone)]
pub struct RenewMany {
    dialect: Dialect,
    table: String,
}

impl RenewMany {
    /// The renewals as a table `v(name, holder, token, ttl)`; its parameters are each renewal's
    /// lock, holder, token and ttl (PostgreSQL: ms; MySQL: µs), in turn.
    fn values(&self, rows: usize) -> String {
        match self.dialect {
            Dialect::Postgres => {
                let values: Vec<String> = (0..rows)
                    .map(|i| {
                        let n = 4 * i;
                        format!(
                            "(${}::varchar, ${}::varchar, ${}::bigint, ${}::bigint)",
                            n + 1,
                            n + 2,
                            n + 3,
                            n + 4
                        )
                    })
                    .collect();
                format!(
                    "(VALUES {}) AS v(name, holder, token, ttl)",
                    values.join(", ")
                )
            }
            Dialect::MySql => {
                let first = "SELECT ? AS name, ? AS holder, ? AS token, ? AS ttl";
                let rest = " UNION ALL SELECT ?, ?, ?, ?".repeat(rows.saturating_sub(1));
                format!("({first}{rest}) AS v")
            }
        }
    }

    /// The statement extending `rows` renewals' rows (PostgreSQL: returning them). An expiry
    /// is never brought earlier: a renewal sent before another, held up in the server (a table
    /// lock, a backup's global read lock) and run after it, would otherwise end the row before
    /// the claim the later one's answer gave the holder.
    pub fn statement(&self, rows: usize) -> String {
        let (t, v) = (&self.table, self.values(rows));
        match self.dialect {
            Dialect::Postgres => format!(
                "UPDATE {t} AS l \
                 SET expires_at = GREATEST(l.expires_at, now() + make_interval(secs => v.ttl / 1000.0)) \
                 FROM {v} \
                 WHERE l.name = v.name AND l.holder = v.holder AND l.token = v.token \
                 AND l.expires_at > now() \
                 RETURNING l.name, l.holder, l.token"
            ),
            Dialect::MySql => format!(
                "UPDATE {t} AS l JOIN {v} \
                   ON l.name = v.name AND l.holder = v.holder AND l.token = v.token \
                 SET l.expires_at = GREATEST(l.expires_at, {RENEWED_AT} + INTERVAL v.ttl MICROSECOND) \
                 WHERE l.expires_at > UTC_TIMESTAMP(6) AND {RENEWED_AT} IS NOT NULL"
            ),
        }
    }

    /// MySQL: the read of the rows [`Self::statement`] extended, with the same parameters, on
    /// the same connection after [`SET_RENEWED_AT`]: a row counts as renewed only when it
    /// expires no earlier than this renewal made it. A row merely live (extended by an older
    /// renewal that committed between the two statements, from its earlier start) does not
    /// cover the claim this answer gives.
    pub fn extended(&self, rows: usize) -> Option<String> {
        let (t, v) = (&self.table, self.values(rows));
        (self.dialect == Dialect::MySql).then(|| {
            format!(
                "SELECT l.name, l.holder, l.token FROM {t} AS l JOIN {v} \
                   ON l.name = v.name AND l.holder = v.holder AND l.token = v.token \
                 WHERE l.expires_at >= {RENEWED_AT} + INTERVAL v.ttl MICROSECOND"
            )
        })
    }
}

/// The statements for a family's keys, whose idle rows are deleted. A key's new row takes its
/// token from one above the family's floor row ([`crate::names::key_floor_row`]), read with a
/// shared lock; a sweep locks the floor exclusively, raises it to every token of the rows it
/// deletes and deletes them, in one transaction. So an acquisition either ends before the sweep
/// starts (and its key is held, not idle, when the sweep looks), or waits for the sweep and
/// reads the raised floor.
pub struct KeyFloor {
    /// PostgreSQL: the whole acquisition (`$1` lock, `$2` identity, `$3` ttl ms, `$4` the
    /// floor row). MySQL: the insertion of a key's first row, its token handed over by
    /// `LAST_INSERT_ID` (lock, identity, ttl µs, floor row), after the take-over of an existing
    /// row found none.
    pub acquire: String,
    /// The floor row where it is missing (the row, then its token): see [`make_floor`].
    pub ensure: String,
    /// The floor row's token, if there is one (the row).
    pub read: String,
    /// The highest token of the family's rows (the keys' name patterns), read without locking
    /// them: a held key's row may be locked by its holder's transaction (row-lock mode).
    pub highest: String,
    pub lock: String,
    pub forget: ForgetIdle,
    /// The family's keys held now (patterns); returns `held`.
    pub count_held: String,
}

/// The highest token among a family's rows that `statement` reads (every row: [`KeyFloor::highest`];
/// the idle ones: MySQL's [`ForgetIdle::MySql`]), with the keys' name `patterns` bound.
pub(crate) async fn highest_token(
    conn: &mut sqlx::AnyConnection,
    statement: &str,
    [plain, hashed]: [&str; 2],
) -> Result<i64> {
    sqlx::query(statement)
        .bind(plain)
        .bind(hashed)
        .fetch_one(conn)
        .await
        .map_err(map_err)?
        .try_get("highest")
        .map_err(map_err)
}

/// Make `family`'s floor row where it is missing, at the highest token of the family's rows: 0
/// for a new family; for one whose floor row was deleted by hand, above every key still
/// recorded, so that a key taken for the first time never draws below them. True when made.
pub(crate) async fn make_floor(
    conn: &mut sqlx::AnyConnection,
    floor: &KeyFloor,
    family: &str,
) -> Result<bool> {
    let row = crate::names::key_floor_row(family);
    let existing = sqlx::query(&floor.read)
        .bind(&row)
        .fetch_optional(&mut *conn)
        .await
        .map_err(map_err)?;
    if existing.is_some() {
        return Ok(false);
    }
    let [plain, hashed] = crate::names::key_name_patterns(family);
    let highest = highest_token(conn, &floor.highest, [&plain, &hashed]).await?;
    let made = sqlx::query(&floor.ensure)
        .bind(&row)
        .bind(highest)
        .execute(&mut *conn)
        .await
        .map_err(map_err)?
        .rows_affected();
    Ok(made > 0)
}

/// `lock` taken by `identity` with `token`.
pub(crate) fn taken(lock: &str, identity: &str, token: u64) -> Acquire {
    Acquire::Acquired(Lease {
        lock: lock.to_owned(),
        identity: identity.to_owned(),
        token,
    })
}

/// How many locks a MySQL driver remembers having found held ([`SqlDriver::poll_mysql`]).
pub(crate) const SEEN_HELD_REMEMBERED: usize = 4096;

/// How many seeded rows one MySQL `DELETE` names.
const SEEDED_DELETED_AT_ONCE: usize = 500;

/// Row-lock mode: delete the seeded rows of a family's keys left without a lease row, in the
/// sweep's transaction (see [`ForgetSeeded`]).
pub(crate) async fn forget_seeded(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    statements: &ForgetSeeded,
    plain: &str,
    hashed: &str,
) -> Result<()> {
    match statements {
        ForgetSeeded::Postgres(delete) => {
            sqlx::query(delete)
                .bind(plain)
                .bind(hashed)
                .execute(&mut **tx)
                .await
                .map_err(map_err)?;
        }
        ForgetSeeded::MySql { select, table } => {
            let names: Vec<String> = match sqlx::query_scalar(select)
                .bind(plain)
                .bind(hashed)
                .fetch_all(&mut **tx)
                .await
            {
                Ok(names) => names,
                // MariaDB before 10.6 has no SKIP LOCKED. A failed statement leaves a MySQL
                // transaction usable, so the sweep of the lease rows still commits; the seeded
                // rows stay there, as they did before they were swept.
                Err(e) => {
                    tracing::warn!(error = %map_err(e), "row-lock mode's seeded rows of idle keys are kept");
                    return Ok(());
                }
            };
            for chunk in names.chunks(SEEDED_DELETED_AT_ONCE) {
                let delete = format!(
                    "DELETE FROM {table} WHERE name IN ({})",
                    vec!["?"; chunk.len()].join(", ")
                );
                let mut query = sqlx::query(&delete);
                for name in chunk {
                    query = query.bind(name);
                }
                query.execute(&mut **tx).await.map_err(map_err)?;
            }
        }
    }
    Ok(())
}

/// A sweep's statements after the floor is locked.
pub enum ForgetIdle {
    /// One statement: `$1` the floor row, `$2`/`$3` the keys' name patterns, `$4` idle ms;
    /// returns `forgotten`.
    Postgres(String),
    /// The idle cut-off fixed once in a session variable (idle µs), then the highest idle
    /// token (patterns), the floor raised to it (token, floor row), the idle rows at or below
    /// it deleted (patterns, token).
    MySql {
        cutoff: String,
        highest: String,
        raise: String,
        delete: String,
    },
}

impl Dialect {
    fn quote(self, ident: &str) -> String {
        match self {
            Dialect::Postgres => quote_sql_identifier(ident),
            Dialect::MySql => format!("`{ident}`"),
        }
    }

    pub fn statements(self, schema: Option<&str>, table: &str) -> Statements {
        let qualified = |table: &str| match schema {
            Some(schema) => format!("{}.{}", self.quote(schema), self.quote(table)),
            None => self.quote(table),
        };
        let t = qualified(table);
        // The row-lock table's statements. Where its name is too long for the server to keep
        // whole (a lease-mode table of 59 to 63 bytes; row-lock mode refuses such a table),
        // they name no table and are never run: cut short, the name would be another table's.
        let r = match validate_sql_identifier("row-lock table name", &row_table(table)) {
            Ok(()) => qualified(&row_table(table)),
            Err(_) => String::new(),
        };
        match self {
            Dialect::Postgres => {
                let until = "now() + make_interval(secs => $3::bigint / 1000.0)";
                Statements {
                    create_table: format!(
                        "CREATE TABLE IF NOT EXISTS {t} (\
                           name VARCHAR(253) PRIMARY KEY, \
                           holder VARCHAR(253), \
                           token BIGINT NOT NULL, \
                           expires_at TIMESTAMPTZ NOT NULL)"
                    ),
                    create_row_table: format!(
                        "CREATE TABLE IF NOT EXISTS {r} (name VARCHAR(253) PRIMARY KEY)"
                    ),
                    seed_row: format!(
                        "INSERT INTO {r} (name) VALUES ($1) ON CONFLICT (name) DO NOTHING"
                    ),
                    row_exists: format!("SELECT 1 FROM {r} WHERE name = $1"),
                    lock_row: format!("SELECT name FROM {r} WHERE name = $1 FOR UPDATE NOWAIT"),
                    acquire: format!(
                        "INSERT INTO {t} AS l (name, holder, token, expires_at) VALUES ($1, $2, 1, {until}) \
                         ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, token = l.token + 1, \
                         expires_at = EXCLUDED.expires_at \
                         WHERE l.holder IS NULL OR l.expires_at <= now() \
                         RETURNING token"
                    ),
                    insert: None,
                    renew_many: RenewMany {
                        dialect: self,
                        table: t.clone(),
                    },
                    // A release that freed the lease notifies the waiters and commits without
                    // waiting for the disk, so the waiter it wakes is not held up by a flush. A
                    // release lost in a crash leaves the lease held until it runs out: the next
                    // holder waits longer, and never overlaps. Acquisitions and renewals still
                    // wait: lost, they would repeat a token or shorten a lease its holder counts on.
                    // Dated by the clock as the row is written: in row-lock mode the release
                    // ends the holding's transaction, whose `now()` is the acquisition.
                    release: format!(
                        "WITH released AS (\
                           UPDATE {t} SET holder = NULL, expires_at = clock_timestamp() \
                           WHERE name = $1 AND holder = $2 AND token = $3 RETURNING name) \
                         SELECT count(*) AS released FROM released, \
                           LATERAL (SELECT pg_notify('{RELEASE_CHANNEL}', released.name), \
                             set_config('synchronous_commit', 'off', true)) AS notified"
                    ),
                    observe: format!(
                        "SELECT holder, token, \
                           CAST(EXTRACT(EPOCH FROM (expires_at - now())) * 1000 AS BIGINT) AS remaining_ms \
                         FROM {t} WHERE name = $1 AND holder IS NOT NULL AND expires_at > now()"
                    ),
                    delete_lock: format!(
                        "UPDATE {t} SET holder = NULL, expires_at = now() WHERE name = $1"
                    ),
                    delete_row: format!("DELETE FROM {r} WHERE name = $1"),
                    key_floor: KeyFloor {
                        acquire: format!(
                            "INSERT INTO {t} AS l (name, holder, token, expires_at) \
                             SELECT $1, $2, f.token + 1, {until} FROM {t} AS f WHERE f.name = $4 FOR SHARE \
                             ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, token = l.token + 1, \
                             expires_at = EXCLUDED.expires_at \
                             WHERE l.holder IS NULL OR l.expires_at <= now() \
                             RETURNING token"
                        ),
                        ensure: format!(
                            "INSERT INTO {t} (name, holder, token, expires_at) VALUES ($1, NULL, $2, now()) \
                             ON CONFLICT (name) DO NOTHING"
                        ),
                        read: format!("SELECT token FROM {t} WHERE name = $1"),
                        highest: format!(
                            "SELECT COALESCE(MAX(token), 0) AS highest FROM {t} \
                             WHERE name LIKE $1 ESCAPE '|' OR name LIKE $2 ESCAPE '|'"
                        ),
                        lock: format!("SELECT token FROM {t} WHERE name = $1 FOR UPDATE"),
                        forget: ForgetIdle::Postgres(format!(
                            "WITH gone AS (\
                               DELETE FROM {t} WHERE (name LIKE $2 ESCAPE '|' OR name LIKE $3 ESCAPE '|') \
                               AND expires_at <= now() - make_interval(secs => $4::bigint / 1000.0) \
                               RETURNING token), \
                             raised AS (\
                               UPDATE {t} SET token = GREATEST({t}.token, (SELECT max(token) FROM gone)) \
                               WHERE name = $1 RETURNING name) \
                             SELECT count(*) AS forgotten FROM gone"
                        )),
                        count_held: format!(
                            "SELECT count(*) AS held FROM {t} \
                             WHERE (name LIKE $1 ESCAPE '|' OR name LIKE $2 ESCAPE '|') \
                             AND holder IS NOT NULL AND expires_at > now()"
                        ),
                    },
                    forget_seeded: ForgetSeeded::Postgres(format!(
                        "DELETE FROM {r} WHERE name IN (\
                           SELECT s.name FROM {r} AS s \
                           WHERE (s.name LIKE $1 ESCAPE '|' OR s.name LIKE $2 ESCAPE '|') \
                           AND NOT EXISTS (SELECT 1 FROM {t} AS l WHERE l.name = s.name) \
                           FOR UPDATE OF s SKIP LOCKED)"
                    )),
                    advisory: Some(AdvisoryStatements {
                        // The advisory lock first (the session holds nothing else: a wait that
                        // ended in an error may have left it held), then the row, dated by the
                        // clock as the row is written (`now()` is the statement's start, a
                        // blocked step earlier).
                        acquire: format!(
                            "WITH cleared AS MATERIALIZED (SELECT pg_advisory_unlock_all()), \
                             woken AS MATERIALIZED (SELECT pg_advisory_lock($4) FROM cleared) \
                             INSERT INTO {t} AS l (name, holder, token, expires_at) \
                             SELECT $1, $2, 1, clock_timestamp() + make_interval(secs => $3::bigint / 1000.0) FROM woken \
                             ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, token = l.token + 1, \
                             expires_at = EXCLUDED.expires_at \
                             WHERE l.holder IS NULL OR l.expires_at <= clock_timestamp() \
                             RETURNING token"
                        ),
                        // The row just taken, extended from this statement on: its claim
                        // counts from this send, which the blocking statement cannot date.
                        extend: format!(
                            "UPDATE {t} SET expires_at = clock_timestamp() + make_interval(secs => $3::bigint / 1000.0) \
                             WHERE name = $1 AND holder = $2 AND token = $4"
                        ),
                        // The advisory lock goes once the row is updated, before the commit:
                        // the waiter it wakes waits inside the server for the commit, and
                        // takes the row then.
                        release: format!(
                            "WITH released AS (\
                               UPDATE {t} SET holder = NULL, expires_at = now() \
                               WHERE name = $1 AND holder = $2 AND token = $3 RETURNING name) \
                             SELECT count(*) AS released, pg_advisory_unlock($4) AS unlocked \
                             FROM released, \
                               LATERAL (SELECT pg_notify('{RELEASE_CHANNEL}', released.name), \
                                 set_config('synchronous_commit', 'off', true)) AS notified"
                        ),
                    }),
                    named_release: None,
                }
            }
            Dialect::MySql => Statements {
                // utf8mb4_bin: lock names and identities compare exactly, never case-folded.
                create_table: format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                       name VARCHAR(253) NOT NULL PRIMARY KEY, \
                       holder VARCHAR(253) NULL, \
                       token BIGINT NOT NULL, \
                       expires_at DATETIME(6) NOT NULL\
                     ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
                ),
                create_row_table: format!(
                    "CREATE TABLE IF NOT EXISTS {r} (name VARCHAR(253) NOT NULL PRIMARY KEY) \
                     ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
                ),
                seed_row: format!("INSERT IGNORE INTO {r} (name) VALUES (?)"),
                // A plain SELECT is a consistent read in InnoDB: no lock taken or waited for.
                row_exists: format!("SELECT 1 FROM {r} WHERE name = ?"),
                // The row exists (seeded first) and the match is on the primary key, so InnoDB
                // takes a record lock only: no gap locks, none of their deadlocks.
                lock_row: format!("SELECT name FROM {r} WHERE name = ? FOR UPDATE NOWAIT"),
                // LAST_INSERT_ID(expr) hands the new token to this connection atomically.
                acquire: format!(
                    "UPDATE {t} SET holder = ?, token = LAST_INSERT_ID(token + 1), \
                       expires_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
                     WHERE name = ? AND (holder IS NULL OR expires_at <= UTC_TIMESTAMP(6))"
                ),
                insert: Some(format!(
                    "INSERT IGNORE INTO {t} (name, holder, token, expires_at) \
                     VALUES (?, ?, 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)"
                )),
                renew_many: RenewMany {
                    dialect: self,
                    table: t.clone(),
                },
                release: format!(
                    "UPDATE {t} SET holder = NULL, expires_at = UTC_TIMESTAMP(6) \
                     WHERE name = ? AND holder = ? AND token = ?"
                ),
                observe: format!(
                    "SELECT holder, token, \
                       CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) DIV 1000 AS SIGNED) AS remaining_ms \
                     FROM {t} WHERE name = ? AND holder IS NOT NULL AND expires_at > UTC_TIMESTAMP(6)"
                ),
                delete_lock: format!(
                    "UPDATE {t} SET holder = NULL, expires_at = UTC_TIMESTAMP(6) WHERE name = ?"
                ),
                delete_row: format!("DELETE FROM {r} WHERE name = ?"),
                key_floor: KeyFloor {
                    // LOCK IN SHARE MODE: MariaDB's spelling too. The ignored duplicate is a key
                    // whose row another session inserted first.
                    acquire: format!(
                        "INSERT IGNORE INTO {t} (name, holder, token, expires_at) \
                         SELECT ?, ?, LAST_INSERT_ID(f.token + 1), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND \
                         FROM {t} AS f WHERE f.name = ? LOCK IN SHARE MODE"
                    ),
                    ensure: format!(
                        "INSERT IGNORE INTO {t} (name, holder, token, expires_at) VALUES (?, NULL, ?, UTC_TIMESTAMP(6))"
                    ),
                    read: format!("SELECT token FROM {t} WHERE name = ?"),
                    highest: format!(
                        "SELECT CAST(COALESCE(MAX(token), 0) AS SIGNED) AS highest FROM {t} \
                         WHERE name LIKE ? ESCAPE '|' OR name LIKE ? ESCAPE '|'"
                    ),
                    lock: format!("SELECT token FROM {t} WHERE name = ? FOR UPDATE"),
                    forget: ForgetIdle::MySql {
                        cutoff: "SET @leasehold_cutoff = UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND"
                            .into(),
                        highest: format!(
                            "SELECT COALESCE(MAX(token), 0) AS highest FROM {t} \
                             WHERE (name LIKE ? ESCAPE '|' OR name LIKE ? ESCAPE '|') AND expires_at <= @leasehold_cutoff"
                        ),
                        raise: format!("UPDATE {t} SET token = GREATEST(token, ?) WHERE name = ?"),
                        // `token <= ?`: the DELETE reads rows as they are now, the SELECT
                        // of `highest` from the transaction's snapshot. A release committed in
                        // between (row-lock mode commits it with the holder's transaction,
                        // after stamping its time) is kept for the next sweep, never deleted
                        // above the floor.
                        delete: format!(
                            "DELETE FROM {t} \
                             WHERE (name LIKE ? ESCAPE '|' OR name LIKE ? ESCAPE '|') AND expires_at <= @leasehold_cutoff \
                             AND token <= ?"
                        ),
                    },
                    count_held: format!(
                        "SELECT CAST(COUNT(*) AS SIGNED) AS held FROM {t} \
                         WHERE (name LIKE ? ESCAPE '|' OR name LIKE ? ESCAPE '|') \
                         AND holder IS NOT NULL AND expires_at > UTC_TIMESTAMP(6)"
                    ),
                },
                forget_seeded: ForgetSeeded::MySql {
                    select: format!(
                        "SELECT s.name FROM {r} AS s \
                         WHERE (s.name LIKE ? ESCAPE '|' OR s.name LIKE ? ESCAPE '|') \
                         AND NOT EXISTS (SELECT 1 FROM {t} AS l WHERE l.name = s.name) \
                         FOR UPDATE SKIP LOCKED"
                    ),
                    table: r.clone(),
                },
                advisory: None,
                // `RELEASE_LOCK` runs for the matched row, which the statement has locked: the
                // waiter it wakes claims the row with an `UPDATE` that waits for this commit.
                // Its argument reads the row (`LEFT(name, 0)` is empty), so that no server
                // evaluates it once, before any row is locked.
                named_release: Some(format!(
                    "UPDATE {t} SET holder = IF(RELEASE_LOCK(CONCAT(?, LEFT(name, 0))) IS NULL, NULL, NULL), \
                     expires_at = UTC_TIMESTAMP(6) WHERE name = ? AND holder = ? AND token = ?"
                )),
            },
        }
    }

    /// Row-lock mode: the statements that make a contender's seeding of a lock's row wait for
    /// no lock, and that end that: on MySQL an `INSERT IGNORE` of a row that exists takes a
    /// shared lock on it for the duplicate check, and so waits while a holder's transaction
    /// holds the row (`innodb_lock_wait_timeout`, 50 s by default), stalling the contender
    /// instead of answering that the lock is taken. MariaDB then waits for no lock; MySQL, whose
    /// least wait is a second, waits that long at most. PostgreSQL's `ON CONFLICT DO NOTHING`
    /// waits for no lock of a row that exists.
    pub fn seed_without_waiting(self) -> Option<(&'static str, &'static str)> {
        match self {
            Dialect::Postgres => None,
            Dialect::MySql => Some((
                "SET SESSION innodb_lock_wait_timeout = 0",
                "SET SESSION innodb_lock_wait_timeout = DEFAULT",
            )),
        }
    }

    /// The bound on row-lock waits set on each of the pool's connections ([`POOL_LOCK_WAIT`]),
    /// where the role's or the server's own bound is not lower already.
    pub fn pool_lock_wait(self) -> String {
        match self {
            Dialect::Postgres => format!(
                "SELECT set_config('lock_timeout', '{ms}', false) FROM pg_settings \
                 WHERE name = 'lock_timeout' AND (setting::bigint = 0 OR setting::bigint > {ms})",
                ms = POOL_LOCK_WAIT.as_millis()
            ),
            Dialect::MySql => format!(
                "SET SESSION innodb_lock_wait_timeout = LEAST(@@SESSION.innodb_lock_wait_timeout, {})",
                POOL_LOCK_WAIT.as_secs()
            ),
        }
    }

    /// A sweep of a family's idle keys locks the family's floor row, which every acquisition of
    /// the family's keys reads: the server ends the sweep's session should it stall between its
    /// statements (its client cut off or frozen), and a statement waits for a lock only so
    /// long, rather than keep the floor locked until TCP gives up, hours later. On PostgreSQL
    /// in the sweep's transaction; on MySQL, whose bounds are the session's, on a connection of
    /// the sweep's own.
    pub fn sweep_bounds(self) -> String {
        let bound = SWEEP_STALL_BOUND;
        match self {
            Dialect::Postgres => format!(
                "SET LOCAL idle_in_transaction_session_timeout = {ms}; SET LOCAL lock_timeout = {ms}",
                ms = bound.as_millis()
            ),
            // READ COMMITTED: the deletion keeps locks on the rows it deletes only, not on every
            // row it scans (held keys among them, whose renewals would wait for the sweep).
            Dialect::MySql => format!(
                "SET SESSION wait_timeout = {s}; SET SESSION innodb_lock_wait_timeout = {s}; \
                 SET TRANSACTION ISOLATION LEVEL READ COMMITTED",
                s = bound.as_secs()
            ),
        }
    }

    /// What each of the driver's sessions runs as it opens, whatever the server's, database's
    /// or role's defaults say: a write acknowledged is on disk, and on the synchronous standbys
    /// the server names (PostgreSQL's `synchronous_commit` `off` and `local` are raised to `on`;
    /// `remote_write`, `on` and `remote_apply` are kept), and committed as its statement ends
    /// (MySQL's `autocommit`). An acquisition lost in a crash or a failover would repeat its
    /// token, and one left uncommitted would roll back when its connection closes, under a
    /// holder that counts on it.
    pub fn session_setup(self) -> &'static str {
        match self {
            Dialect::Postgres => {
                "SELECT set_config('synchronous_commit', 'on', false) \
                 WHERE current_setting('synchronous_commit') IN ('off', 'local')"
            }
            Dialect::MySql => "SET autocommit = 1",
        }
    }

    /// Row-lock mode: open the holder's transaction with its session bounded by the server
    /// (several statements, sent as one unprepared batch).
    pub fn row_lock_begin(self, ttl: Duration) -> String {
        match self {
            // SET LOCAL: the bound ends with the transaction; the idle connection is unbounded.
            // READ COMMITTED whatever the role's or database's default: the fence is written
            // on the pool while the transaction holds the row, and a snapshot taken at the row
            // lock (REPEATABLE READ, SERIALIZABLE) could not update the fence at the release.
            Dialect::Postgres => format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED; \
                 SET LOCAL idle_in_transaction_session_timeout = {}",
                ttl.as_millis().max(1)
            ),
            // READ COMMITTED: a locking read takes record locks only, never gap locks.
            Dialect::MySql => format!(
                "SET SESSION wait_timeout = {}; \
                 SET TRANSACTION ISOLATION LEVEL READ COMMITTED; BEGIN",
                ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0)
            ),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Postgres => "postgres",
            Dialect::MySql => "mysql",
        }
    }
}

/// How long a sweep of idle keys may stall in its transaction, or wait for a lock, before the
/// server ends it ([`Dialect::sweep_bounds`]): far longer than its statements take.
/// Below the pool's bound on lock waits ([`POOL_LOCK_WAIT`]), so that a key's acquisition
/// behind a stalled sweep is still answered.
const SWEEP_STALL_BOUND: Duration = Duration::from_secs(2);

/// How long a statement on the pool waits for another session's row lock before the server
/// ends it: below the response timeout ([`pool::RESPONSE_TIMEOUT`]), so that a statement the
/// client stopped waiting for while it waited for a row does not go on to commit unknown to
/// it. An answer lost after its commit is like any lost answer: the holder it names is not
/// told, finds the row held by itself at its next attempt, and waits out that lease.
pub(crate) const POOL_LOCK_WAIT: Duration = Duration::from_secs(4);

pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

pub(crate) fn token(lease: &Lease) -> i64 {
    i64::try_from(lease.token).unwrap_or(i64::MAX)
}

/// MySQL: the session variable a batch of renewals dates itself by ([`SET_RENEWED_AT`]), so
/// that its read-back can tell its own extension from another's.
const RENEWED_AT: &str = "CAST(@leasehold_renewed_at AS DATETIME(6))";

/// MySQL: dates a batch of renewals, on the connection that then runs it and reads it back.
const SET_RENEWED_AT: &str = "SET @leasehold_renewed_at = UTC_TIMESTAMP(6)";

/// The most renewals one batch carries: four parameters each, far under PostgreSQL's and
/// MySQL's 65,535.
pub(crate) const MAX_RENEW_BATCH: usize = 512;

/// A batch of renewals ([`RenewMany`]), [`padded`]: each renewal is answered with whether its
/// row came back extended.
pub(crate) async fn renew_batch(pool: StatementPool, many: Arc<RenewMany>, batch: RenewalBatch) {
    let rows = batch.len().next_power_of_two();
    let bound = |sql| {
        let mut query = sqlx::query(sql);
        for (lease, ttl) in padded(&batch) {
            let ttl = match many.dialect {
                Dialect::Postgres => ms(*ttl),
                Dialect::MySql => micros(*ttl),
            };
            query = query
                .bind(lease.lock.clone())
                .bind(lease.identity.clone())
                .bind(token(lease))
                .bind(ttl);
        }
        query
    };
    let (update, read_back) = (many.statement(rows), many.extended(rows));
    let extended = async {
        let rows = match &read_back {
            None => pool.fetch_all(bound(&update)).await?,
            Some(read_back) => {
                let mut session = pool.session().await?;
                session
                    .run(|connection| async {
                        sqlx::query(SET_RENEWED_AT)
                            .execute(&mut *connection)
                            .await?;
                        bound(&update).execute(&mut *connection).await?;
                        bound(read_back).fetch_all(&mut *connection).await
                    })
                    .await?
            }
        };
        rows.iter()
            .map(extended_row)
            .collect::<std::result::Result<Extended, _>>()
    };
    let extended = extended.await.map_err(map_err);
    answer_renewals(batch, extended);
}

/// The renewals of `batch`, padded to a power of two with its last one again (the same row
/// twice is extended once), so that each connection's statement cache holds one statement per
/// power of two, not one per batch size.
pub(crate) fn padded(batch: &RenewalBatch) -> impl Iterator<Item = &(Lease, Duration)> {
    let last = batch.len().saturating_sub(1);
    (0..batch.len().next_power_of_two()).map(move |i| &batch[i.min(last)].request)
}

/// A batch of renewals, each a lease and its ttl, answered with whether it was renewed.
pub(crate) type RenewalBatch = Vec<Pending<(Lease, Duration), Result<bool>>>;

/// The rows a batch of renewals extended: lock, holder and token.
pub(crate) type Extended = std::collections::HashSet<(String, String, i64)>;

/// One row a batch of renewals extended (columns `name`, `holder`, `token`).
pub(crate) fn extended_row<'r, R>(
    row: &'r R,
) -> std::result::Result<(String, String, i64), sqlx::Error>
where
    R: Row,
    &'r str: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok((
        row.try_get("name")?,
        row.try_get("holder")?,
        row.try_get("token")?,
    ))
}

/// Each renewal of `batch` is renewed when its row is among those `extended`.
pub(crate) fn answer_renewals(batch: RenewalBatch, extended: Result<Extended>) {
    for pending in batch {
        let (lease, _) = &pending.request;
        let answer = match &extended {
            Ok(rows) => {
                Ok(rows.contains(&(lease.lock.clone(), lease.identity.clone(), token(lease))))
            }
            Err(e) => Err(e.clone()),
        };
        let _ = pending.reply.send(answer);
    }
}

/// Sort database errors into unreachable (retry), missing privilege (say which), and the rest.
/// PostgreSQL undefined_table (42P01); MySQL ER_NO_SUCH_TABLE (42S02).
pub(crate) fn is_missing_table(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("42P01") | Some("42S02")))
}

/// A session of the driver's own at `url`, set up as each one is ([`Dialect::session_setup`]):
/// a row-lock holder's, a wake-up's.
pub(crate) async fn open_session(url: &str, dialect: Dialect) -> sqlx::Result<AnyConnection> {
    let mut conn = AnyConnection::connect(url).await?;
    sqlx::Executor::execute(&mut conn, dialect.session_setup()).await?;
    Ok(conn)
}

pub(crate) fn map_err(e: sqlx::Error) -> Error {
    match &e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::WorkerCrashed => Error::Unreachable(e.to_string()),
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // PostgreSQL insufficient_privilege; MySQL's access-denied errors (SQLSTATE 42000).
            Some(code)
                if code == "42501" || (code == "42000" && db.message().contains("denied")) =>
            {
                Error::Backend(format!(
                    "missing privilege: {} (the lock table needs CREATE once, then SELECT, INSERT and UPDATE)",
                    db.message()
                ))
            }
            // PostgreSQL admin_shutdown / cannot_connect_now / crash_shutdown.
            Some("57P01") | Some("57P02") | Some("57P03") => Error::Unreachable(e.to_string()),
            _ => Error::Backend(e.to_string()),
        },
        _ => Error::Backend(e.to_string()),
    }
}

/// The holder from an `observe` row (`holder`, `token`, `remaining_ms`), for every SQL backend.
pub(crate) fn holding_from_row<'r, R>(row: &'r R) -> Result<Holding, sqlx::Error>
where
    R: Row,
    &'r str: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let remaining: i64 = row.try_get("remaining_ms")?;
    Ok(Holding {
        identity: row.try_get("holder")?,
        token: row.try_get::<i64, _>("token")? as u64,
        expires_in: Some(Duration::from_millis(remaining.max(0) as u64)),
    })
}
