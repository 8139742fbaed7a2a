//! PostgreSQL and MySQL/MariaDB: one row per lock in a lock table, one SQL core with the dialect
//! differences kept in [`Dialect`]. This is lease mode; row-lock mode ([`crate::drivers::sql::row_lock`])
//! adds a `FOR UPDATE` row lock in front of the very same row, which stays its fence.
//!
//! - Expiry is computed by the database's own clock (`now()`, `NOW(6)`), so a client whose clock
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

pub(crate) mod row_lock;
pub mod sqlite;
pub(crate) mod sqlite_wake;
mod urls;
pub mod wake;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;
use sqlx::{Connection, Row};

use tokio::sync::{OnceCell, watch};

use crate::boot_clock::BootInstant;
use crate::driver::{Acquire, ChangeFeeds, Driver, Holding, Lease, Upkeep};
use crate::drivers::batches::{Batches, Pending};
use crate::drivers::sql::row_lock::RowLocks;
use crate::drivers::sql::wake::{AdvisoryStatements, ServerLock, ServerLocks};
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
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const RELISTEN_MIN: Duration = Duration::from_millis(100);
const RELISTEN_MAX: Duration = Duration::from_secs(2);
/// Connections per sidecar: renewals of several locks, and acquisitions, in parallel.
const POOL_SIZE: u32 = 4;

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

    /// The statement extending `rows` renewals' rows (PostgreSQL: returning them).
    pub fn statement(&self, rows: usize) -> String {
        let (t, v) = (&self.table, self.values(rows));
        match self.dialect {
            Dialect::Postgres => format!(
                "UPDATE {t} AS l SET expires_at = now() + make_interval(secs => v.ttl / 1000.0) \
                 FROM {v} \
                 WHERE l.name = v.name AND l.holder = v.holder AND l.token = v.token \
                 AND l.expires_at > now() \
                 RETURNING l.name, l.holder, l.token"
            ),
            Dialect::MySql => format!(
                "UPDATE {t} AS l JOIN {v} \
                   ON l.name = v.name AND l.holder = v.holder AND l.token = v.token \
                 SET l.expires_at = NOW(6) + INTERVAL v.ttl MICROSECOND \
                 WHERE l.expires_at > NOW(6)"
            ),
        }
    }

    /// MySQL: the read of the rows [`Self::statement`] extended, with the same parameters.
    pub fn extended(&self, rows: usize) -> Option<String> {
        let (t, v) = (&self.table, self.values(rows));
        (self.dialect == Dialect::MySql).then(|| {
            format!(
                "SELECT l.name, l.holder, l.token FROM {t} AS l JOIN {v} \
                   ON l.name = v.name AND l.holder = v.holder AND l.token = v.token \
                 WHERE l.expires_at > NOW(6)"
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

/// Make `family`'s floor row where it is missing, at the highest token of the family's rows: 0
/// for a new family; for one whose floor row was deleted by hand, above every key still
/// recorded, so that a key taken for the first time never draws below them. True when made.
async fn make_floor(
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
    let highest: i64 = sqlx::query(&floor.highest)
        .bind(&plain)
        .bind(&hashed)
        .fetch_one(&mut *conn)
        .await
        .map_err(map_err)?
        .try_get("highest")
        .map_err(map_err)?;
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
fn taken(lock: &str, identity: &str, token: u64) -> Acquire {
    Acquire::Acquired(Lease {
        lock: lock.to_owned(),
        identity: identity.to_owned(),
        token,
    })
}

/// How many locks a MySQL driver remembers having found held ([`SqlDriver::poll_mysql`]).
const SEEN_HELD_REMEMBERED: usize = 4096;

/// How many seeded rows one MySQL `DELETE` names.
const SEEDED_DELETED_AT_ONCE: usize = 500;

/// Row-lock mode: delete the seeded rows of a family's keys left without a lease row, in the
/// sweep's transaction (see [`ForgetSeeded`]).
async fn forget_seeded(
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
        let r = qualified(&row_table(table));
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
                    release: format!(
                        "WITH released AS (\
                           UPDATE {t} SET holder = NULL, expires_at = now() \
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
                        // blocked step earlier), with how long after the start that was.
                        acquire: format!(
                            "WITH cleared AS MATERIALIZED (SELECT pg_advisory_unlock_all()), \
                             woken AS MATERIALIZED (SELECT pg_advisory_lock($4) FROM cleared) \
                             INSERT INTO {t} AS l (name, holder, token, expires_at) \
                             SELECT $1, $2, 1, clock_timestamp() + make_interval(secs => $3::bigint / 1000.0) FROM woken \
                             ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, token = l.token + 1, \
                             expires_at = EXCLUDED.expires_at \
                             WHERE l.holder IS NULL OR l.expires_at <= clock_timestamp() \
                             RETURNING token, \
                               CAST(EXTRACT(EPOCH FROM (l.expires_at - statement_timestamp())) * 1000000 AS BIGINT) \
                               - $3::bigint * 1000 AS blocked_us"
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
                // The row exists (seeded first) and the match is on the primary key, so InnoDB
                // takes a record lock only: no gap locks, none of their deadlocks.
                lock_row: format!("SELECT name FROM {r} WHERE name = ? FOR UPDATE NOWAIT"),
                // LAST_INSERT_ID(expr) hands the new token to this connection atomically.
                acquire: format!(
                    "UPDATE {t} SET holder = ?, token = LAST_INSERT_ID(token + 1), \
                       expires_at = NOW(6) + INTERVAL ? MICROSECOND \
                     WHERE name = ? AND (holder IS NULL OR expires_at <= NOW(6))"
                ),
                insert: Some(format!(
                    "INSERT IGNORE INTO {t} (name, holder, token, expires_at) \
                     VALUES (?, ?, 1, NOW(6) + INTERVAL ? MICROSECOND)"
                )),
                renew_many: RenewMany {
                    dialect: self,
                    table: t.clone(),
                },
                release: format!(
                    "UPDATE {t} SET holder = NULL, expires_at = NOW(6) \
                     WHERE name = ? AND holder = ? AND token = ?"
                ),
                observe: format!(
                    "SELECT holder, token, \
                       CAST(TIMESTAMPDIFF(MICROSECOND, NOW(6), expires_at) DIV 1000 AS SIGNED) AS remaining_ms \
                     FROM {t} WHERE name = ? AND holder IS NOT NULL AND expires_at > NOW(6)"
                ),
                delete_lock: format!(
                    "UPDATE {t} SET holder = NULL, expires_at = NOW(6) WHERE name = ?"
                ),
                delete_row: format!("DELETE FROM {r} WHERE name = ?"),
                key_floor: KeyFloor {
                    // LOCK IN SHARE MODE: MariaDB's spelling too. The ignored duplicate is a key
                    // whose row another session inserted first.
                    acquire: format!(
                        "INSERT IGNORE INTO {t} (name, holder, token, expires_at) \
                         SELECT ?, ?, LAST_INSERT_ID(f.token + 1), NOW(6) + INTERVAL ? MICROSECOND \
                         FROM {t} AS f WHERE f.name = ? LOCK IN SHARE MODE"
                    ),
                    ensure: format!(
                        "INSERT IGNORE INTO {t} (name, holder, token, expires_at) VALUES (?, NULL, ?, NOW(6))"
                    ),
                    read: format!("SELECT token FROM {t} WHERE name = ?"),
                    highest: format!(
                        "SELECT CAST(COALESCE(MAX(token), 0) AS SIGNED) AS highest FROM {t} \
                         WHERE name LIKE ? ESCAPE '|' OR name LIKE ? ESCAPE '|'"
                    ),
                    lock: format!("SELECT token FROM {t} WHERE name = ? FOR UPDATE"),
                    forget: ForgetIdle::MySql {
                        cutoff: "SET @leasehold_cutoff = NOW(6) - INTERVAL ? MICROSECOND".into(),
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
                         AND holder IS NOT NULL AND expires_at > NOW(6)"
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
            },
        }
    }

    /// Row-lock mode: open the holder's transaction with its session bounded by the server
    /// (several statements, sent as one unprepared batch).
    pub fn row_lock_begin(self, ttl: Duration) -> String {
        match self {
            // SET LOCAL: the bound ends with the transaction; the idle connection is unbounded.
            Dialect::Postgres => format!(
                "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {}",
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

pub struct SqlDriver {
    pub(crate) dialect: Dialect,
    pub(crate) pool: AnyPool,
    pub(crate) sql: Statements,
    mode: SqlMode,
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
const PEM_OPTIONS: [&str; 8] = [
    "sslrootcert",
    "ssl-root-cert",
    "sslca",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
];

/// `url` with every TLS option that carries PEM text (a Secret's, from a `DistributedLock`)
/// turned into the name of an in-memory file holding it: the database drivers read these
/// options as file names, and the sidecar's root filesystem is read-only. The files are
/// returned, to be kept open as long as connections may be made.
fn pem_text_to_files(url: &str) -> Result<(String, Vec<std::fs::File>)> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let invalid = |reason: String| Error::InvalidUrl {
        url: crate::redact::redact(url),
        reason,
    };
    let mut parsed = url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
    let inline = |(k, v): &(String, String)| {
        PEM_OPTIONS.contains(&k.as_str()) && v.trim_start().starts_with("-----BEGIN")
    };
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

pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

pub(crate) fn token(lease: &Lease) -> i64 {
    i64::try_from(lease.token).unwrap_or(i64::MAX)
}

/// The most renewals one batch carries: four parameters each, far under PostgreSQL's and
/// MySQL's 65,535.
pub(crate) const MAX_RENEW_BATCH: usize = 512;

/// A batch of renewals ([`RenewMany`]), [`padded`]: each renewal is answered with whether its
/// row came back extended.
async fn renew_batch(pool: AnyPool, many: Arc<RenewMany>, batch: RenewalBatch) {
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
            None => bound(&update).fetch_all(&pool).await?,
            Some(read_back) => {
                bound(&update).execute(&pool).await?;
                bound(read_back).fetch_all(&pool).await?
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
fn is_missing_table(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("42P01") | Some("42S02")))
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
        validate_sql_identifier("table name", table)?;
        if mode == SqlMode::RowLock {
            validate_sql_identifier("row-lock table name (table + \"_rows\")", &row_table(table))?;
        }
        if let Some(schema) = schema {
            validate_sql_identifier("schema name", schema)?;
        }
        let (url, pem_files) = pem_text_to_files(url)?;
        let url = url.as_str();
        sqlx::any::install_default_drivers();
        let pool = AnyPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(CONNECT_TIMEOUT)
            // sqlx pings a pooled connection before each use by default: a second round trip
            // for every statement, a hand-over's two included. A dead connection fails its
            // statement instead, which the engine counts as a backend error and tries again.
            .test_before_acquire(false)
            .connect_lazy(url)
            .map_err(|e| Error::InvalidUrl {
                url: crate::redact::redact(url),
                reason: e.to_string(),
            })?;
        let releases = Arc::new(ChangeFeeds::default());
        let sql = dialect.statements(schema, table);
        let server_lock = match (dialect, mode) {
            (Dialect::MySql, _) => Some(ServerLock::Named),
            (Dialect::Postgres, SqlMode::Lease) => sql.advisory.clone().map(ServerLock::Advisory),
            // Row-lock mode's holder keeps its row locked on a session of its own already;
            // its waiters hear `NOTIFY`.
            (Dialect::Postgres, SqlMode::RowLock) => None,
        };
        let server_locks = server_lock
            .map(|kind| ServerLocks::new(kind, url, table, &sql.observe, releases.clone()));
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
                sqlx::query(&self.sql.create_table)
                    .execute(&self.pool)
                    .await
                    .map_err(map_err)?;
                if self.mode == SqlMode::RowLock {
                    sqlx::query(&self.sql.create_row_table)
                        .execute(&self.pool)
                        .await
                        .map_err(map_err)?;
                }
                Ok::<_, Error>(())
            })
            .await?;
        Ok(())
    }

    /// Row-lock mode: insert the lock's row if absent.
    pub(crate) async fn seed_row(&self, lock: &str) -> Result<()> {
        sqlx::query(&self.sql.seed_row)
            .bind(lock)
            .execute(&self.pool)
            .await
            .map_err(map_err)?;
        Ok(())
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
        let mut conn = self.pool.acquire().await.map_err(map_err)?;
        let created = make_floor(&mut conn, floor, family).await?;
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

    /// A lock found free, yet not taken. For a family's key its floor row may be gone (deleted
    /// by hand; the acquisition reads it): put it back and try once more.
    async fn again_with_floor(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        let Some(family) = crate::names::family_of(lock) else {
            return Ok(Acquire::Busy(None));
        };
        self.ensure_floor(&self.sql.key_floor, family, true).await?;
        Ok(match self.acquire_row(lock, identity, ttl).await? {
            Some(token) => taken(lock, identity, token),
            None => Acquire::Busy(self.observe(lock).await?),
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
        let rows = query.fetch_all(&self.pool).await.map_err(map_err)?;
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
        let taken = sqlx::query(&self.sql.acquire)
            .bind(identity)
            .bind(micros(ttl))
            .bind(lock)
            .execute(&self.pool)
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
            let inserted = sqlx::query(&floor.acquire)
                .bind(lock)
                .bind(identity)
                .bind(micros(ttl))
                .bind(crate::names::key_floor_row(family))
                .execute(&self.pool)
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
        let inserted = sqlx::query(insert)
            .bind(lock)
            .bind(identity)
            .bind(micros(ttl))
            .execute(&self.pool)
            .await
            .map_err(map_err)?;
        Ok((inserted.rows_affected() == 1).then_some(1))
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
                    match listener.try_recv().await {
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
            (None, None) => match self.acquire_row(lock, identity, ttl).await? {
                Some(token) => taken(lock, identity, token),
                None => match self.observe(lock).await? {
                    None => self.again_with_floor(lock, identity, ttl).await?,
                    holder => Acquire::Busy(holder),
                },
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
            server.forget_counted(&lease.lock);
            if let Ok(false) = renewed {
                server.let_go(&lease.lock);
            }
        }
        renewed
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let server_lock = self.server_lock(&lease.lock);
        // PostgreSQL: on the advisory lock's session, which lets it go in the same statement.
        let released_there = match server_lock {
            Some(server) => server.release(lease).await,
            None => None,
        };
        // There, the server lock went in the same statement.
        let let_go = released_there.is_none();
        let released = match (released_there, &self.row_locks) {
            (Some(released), _) => released.map_err(map_err)?,
            (None, Some(row_locks)) => row_locks.release(self, lease).await?,
            (None, None) => self.release_row(&self.pool, lease).await?,
        };
        // Not held either way now: the next waiter goes.
        if let (true, Some(server)) = (let_go, server_lock) {
            server.let_go(&lease.lock);
        }
        if released {
            self.releases.bump(&lease.lock);
        }
        Ok(released)
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        self.ensure_tables().await?;
        let rows = sqlx::query(&self.sql.observe)
            .bind(lock)
            .fetch_all(&self.pool)
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
        let mut conn = self.pool.acquire().await.map_err(map_err)?;
        conn.ping().await.map_err(map_err)
    }
}

#[async_trait]
impl Upkeep for SqlDriver {
    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        self.ensure_tables().await?;
        let [plain, hashed] = crate::names::key_name_patterns(family);
        let held: i64 = sqlx::query(&self.sql.key_floor.count_held)
            .bind(&plain)
            .bind(&hashed)
            .fetch_one(&self.pool)
            .await
            .map_err(map_err)?
            .try_get("held")
            .map_err(map_err)?;
        Ok(Some(u64::try_from(held).unwrap_or(0)))
    }

    async fn forget_idle_keys(&self, family: &str, idle_for: Duration) -> Result<u64> {
        let floor = &self.sql.key_floor;
        self.ensure_tables().await?;
        let row = crate::names::key_floor_row(family);
        let [plain, hashed] = crate::names::key_name_patterns(family);
        let mut tx = self.pool.begin().await.map_err(map_err)?;
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
                let highest: i64 = sqlx::query(highest)
                    .bind(&plain)
                    .bind(&hashed)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(map_err)?
                    .try_get("highest")
                    .map_err(map_err)?;
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

    /// Create the lock table (and in row-lock mode the row table, seeded with `locks`) if
    /// absent; needs CREATE the first time only.
    /// In row-lock mode the row is held `FOR UPDATE` by this process's own transaction, which its
    /// DELETE (on another connection) would wait for: it is released first. A contender that
    /// takes the row meanwhile holds it alone, and the DELETE waits for its transaction in turn.
    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        if self.mode == SqlMode::RowLock {
            self.release(lease).await?;
        }
        self.deprovision(std::slice::from_ref(&lease.lock)).await
    }

    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        for lock in locks {
            for statement in [&self.sql.delete_lock, &self.sql.delete_row] {
                match sqlx::query(statement).bind(lock).execute(&self.pool).await {
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
