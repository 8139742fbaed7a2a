//! `sql`: PostgreSQL and MySQL/MariaDB in both modes against the same statements raw and a
//! hand-written lock, hand-overs against the servers' own blocking locks, and idle waiters.

use super::*;

/// The raw baseline for a SQL database: the lease-table statements a hand-written lock would
/// issue (insert the row, delete it where the holder matches), in a loop on one connection.
pub(crate) async fn sql_raw_cycles(dialect: Dialect, url: &str) -> f64 {
    use sqlx::Connection;
    sqlx::any::install_default_drivers();
    let mut conn = sqlx::AnyConnection::connect(url).await.expect("connect");
    let (create, insert, delete) = match dialect {
        Dialect::Postgres => (
            "CREATE TABLE IF NOT EXISTS raw_locks (name VARCHAR(253) PRIMARY KEY, holder VARCHAR(253), expires_at TIMESTAMPTZ NOT NULL)",
            "INSERT INTO raw_locks (name, holder, expires_at) VALUES ($1, $2, now() + interval '15 seconds')",
            "DELETE FROM raw_locks WHERE name = $1 AND holder = $2",
        ),
        Dialect::MySql => (
            "CREATE TABLE IF NOT EXISTS raw_locks (name VARCHAR(253) NOT NULL PRIMARY KEY, holder VARCHAR(253), expires_at DATETIME(6) NOT NULL) ENGINE=InnoDB",
            "INSERT INTO raw_locks (name, holder, expires_at) VALUES (?, ?, NOW(6) + INTERVAL 15 SECOND)",
            "DELETE FROM raw_locks WHERE name = ? AND holder = ?",
        ),
    };
    sqlx::query(create)
        .execute(&mut conn)
        .await
        .expect("create");
    let start = Instant::now();
    for _ in 0..CYCLES {
        sqlx::query(insert)
            .bind("raw")
            .bind("bench")
            .execute(&mut conn)
            .await
            .expect("insert");
        sqlx::query(delete)
            .bind("raw")
            .bind("bench")
            .execute(&mut conn)
            .await
            .expect("delete");
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The hand-written row lock: `BEGIN`, `SELECT ... FOR UPDATE NOWAIT` on a seeded row,
/// `COMMIT`, in a loop on one connection.
pub(crate) async fn sql_raw_row_lock_cycles(dialect: Dialect, url: &str) -> f64 {
    use sqlx::{Connection, Executor};
    sqlx::any::install_default_drivers();
    let sql = dialect.statements(None, "leasehold_locks");
    let mut conn = sqlx::AnyConnection::connect(url).await.expect("connect");
    for setup in [&sql.create_row_table, &sql.seed_row] {
        sqlx::query(setup)
            .bind("raw-row")
            .execute(&mut conn)
            .await
            .expect("setup");
    }
    let start = Instant::now();
    for _ in 0..CYCLES {
        conn.execute("BEGIN").await.expect("begin");
        let rows = sqlx::query(&sql.lock_row)
            .bind("raw-row")
            .fetch_all(&mut conn)
            .await
            .expect("lock");
        assert_eq!(rows.len(), 1);
        conn.execute("COMMIT").await.expect("commit");
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The driver's own statements for one acquire+release cycle, issued raw (lease mode on one
/// connection; row-lock mode on a transaction connection plus one for the fence): what is left
/// between this and the driver is the driver's overhead (pool, bookkeeping).
pub(crate) async fn sql_same_statements_cycles(dialect: Dialect, url: &str, mode: SqlMode) -> f64 {
    use sqlx::{Connection, Executor, Row};
    sqlx::any::install_default_drivers();
    let sql = dialect.statements(None, "leasehold_locks");
    let lock = format!("same-sql-{}", mode.as_str());
    let mut conn = sqlx::AnyConnection::connect(url).await.expect("connect");
    let mut tx = sqlx::AnyConnection::connect(url).await.expect("connect");
    for setup in [&sql.create_table, &sql.create_row_table] {
        sqlx::query(setup).execute(&mut conn).await.expect("create");
    }
    sqlx::query(&sql.seed_row)
        .bind(&lock)
        .execute(&mut conn)
        .await
        .expect("seed");
    let ttl_ms = LEASE.as_millis() as i64;
    let start = Instant::now();
    for _ in 0..CYCLES {
        if mode == SqlMode::RowLock {
            sqlx::query(&sql.observe)
                .bind(&lock)
                .fetch_all(&mut conn)
                .await
                .expect("observe");
            tx.execute(&*dialect.row_lock_begin(LEASE))
                .await
                .expect("begin");
            sqlx::query(&sql.lock_row)
                .bind(&lock)
                .fetch_all(&mut tx)
                .await
                .expect("lock row");
        }
        let token: i64 = match dialect {
            Dialect::Postgres => {
                let rows = sqlx::query(&sql.acquire)
                    .bind(&lock)
                    .bind("bench")
                    .bind(ttl_ms)
                    .fetch_all(&mut conn)
                    .await
                    .expect("acquire");
                rows.first()
                    .map(|r| r.get::<i64, _>("token"))
                    .expect("acquired")
            }
            Dialect::MySql => {
                let done = sqlx::query(&sql.acquire)
                    .bind("bench")
                    .bind(ttl_ms * 1000)
                    .bind(&lock)
                    .execute(&mut conn)
                    .await
                    .expect("acquire");
                match done.last_insert_id() {
                    Some(token) if done.rows_affected() == 1 => token,
                    _ => {
                        let insert = sql.insert.as_deref().expect("insert");
                        sqlx::query(insert)
                            .bind(&lock)
                            .bind("bench")
                            .bind(ttl_ms * 1000)
                            .execute(&mut conn)
                            .await
                            .expect("insert");
                        1
                    }
                }
            }
        };
        let release = sqlx::query(&sql.release)
            .bind(&lock)
            .bind("bench")
            .bind(token);
        let on = match mode {
            SqlMode::Lease => &mut conn,
            SqlMode::RowLock => &mut tx,
        };
        match dialect {
            Dialect::Postgres => drop(release.fetch_all(&mut *on).await.expect("release")),
            Dialect::MySql => drop(release.execute(&mut *on).await.expect("release")),
        }
        if mode == SqlMode::RowLock {
            tx.execute("COMMIT").await.expect("commit");
        }
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

pub(crate) async fn sql_section() {
    let postgres = PostgresServer::start();
    let mariadb = MariaDbServer::start();
    for (dialect, url) in [
        (Dialect::Postgres, postgres.url()),
        (Dialect::MySql, mariadb.url()),
    ] {
        let name = dialect.as_str();
        for mode in [SqlMode::Lease, SqlMode::RowLock] {
            let wakeup = match (dialect, mode) {
                (Dialect::Postgres, SqlMode::Lease) => "advisory lock",
                (Dialect::Postgres, SqlMode::RowLock) => "LISTEN/NOTIFY",
                (Dialect::MySql, _) => "named locks",
            };
            let connect = || -> Arc<dyn Backend> {
                Arc::new(
                    SqlDriver::connect(dialect, &url, None, "leasehold_locks", mode)
                        .expect("driver"),
                )
            };
            let driver = connect();
            let (mut raw, mut same, mut ours) = (0.0f64, 0.0f64, 0.0f64);
            for _ in 0..ROUNDS {
                raw = raw.max(match mode {
                    SqlMode::Lease => sql_raw_cycles(dialect, &url).await,
                    SqlMode::RowLock => sql_raw_row_lock_cycles(dialect, &url).await,
                });
                same = same.max(sql_same_statements_cycles(dialect, &url, mode).await);
                ours = ours.max(driver_cycles(&*driver).await);
            }
            let (raw_name, mode_name) = match mode {
                SqlMode::Lease => ("raw INSERT + DELETE", "lease mode"),
                SqlMode::RowLock => ("raw FOR UPDATE + COMMIT", "row-lock mode"),
            };
            println!("  {name:<8} {raw_name:<28}: {raw:>9.0} cycles/s");
            println!("  {name:<8} {mode_name}: driver's statements raw : {same:>9.0} cycles/s");
            println!(
                "  {name:<8} {mode_name}: SqlDriver                : {ours:>9.0} cycles/s  ({:.0} % of the same statements raw, {:.0} % of the hand-written lock)",
                100.0 * ours / same,
                100.0 * ours / raw
            );
            let latency = handover_latencies(connect(), connect()).await;
            println!(
                "  {name:<8} {mode_name}: hand-over, {wakeup:<13}: {}",
                describe(&latency)
            );
        }
        // The best blocking locks of the same server, for the hand-overs above.
        for (what, setup, take, give) in blocking_locks(dialect) {
            let latency = raw_blocking_handovers(&url, setup, take, give).await;
            println!(
                "  {name:<8} raw blocking hand-over, {what:<17}: {}",
                describe(&latency)
            );
        }
    }
    mysql_idle_waiters(&mariadb.url()).await;
}

/// 100 idle waiters on one MySQL lock, in both modes, counted by the server's own `Questions`
/// (every statement a client sent). Before named-lock wake-ups a waiter read the row five
/// times per renew interval; each waiter here is a process of its own (its own driver), with
/// its pool's connection and its named-lock session.
pub(crate) async fn mysql_idle_waiters(url: &str) {
    use sqlx::Connection;
    sqlx::any::install_default_drivers();
    let admin = tokio::sync::Mutex::new(sqlx::AnyConnection::connect(url).await.expect("connect"));
    // Two sessions per waiter: more than MariaDB's default of 151.
    sqlx::query("SET GLOBAL max_connections = 1000")
        .execute(&mut *admin.lock().await)
        .await
        .expect("max_connections");
    for mode in [SqlMode::Lease, SqlMode::RowLock] {
        let questions =
            async || mariadb_server::status(&mut *admin.lock().await, "Questions").await;
        let connect = || -> Arc<dyn Backend> {
            Arc::new(
                SqlDriver::connect(Dialect::MySql, url, None, "leasehold_locks", mode)
                    .expect("driver"),
            )
        };
        let mode_name = match mode {
            SqlMode::Lease => "lease mode",
            SqlMode::RowLock => "row-lock mode",
        };
        for idle in idle_waiters(connect, &questions).await {
            println!("  mysql    {mode_name}: {IDLE_WAITERS} idle waiters + holder: {idle}");
        }
        // What one poll of a waiter costs, which it sent five times per renew interval before.
        let (holder, waiter) = (connect(), connect());
        let lock = format!("poll-cost-{}", mode_name.replace(' ', "-"));
        let Acquire::Acquired(lease) = holder.try_acquire(&lock, "holder", LEASE).await.unwrap()
        else {
            panic!("{lock} is not free");
        };
        let busy = async || {
            let attempt = waiter.try_acquire(&lock, "waiter", LEASE).await.unwrap();
            assert!(matches!(attempt, Acquire::Busy(_)), "{attempt:?}");
        };
        busy().await; // the waiter's first use makes sure of the tables
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = questions().await;
        busy().await;
        // Less the second `SHOW`, which counts itself.
        let poll = questions().await - before - 1;
        holder.release(&lease).await.expect("release");
        println!(
            "  mysql    {mode_name}: one poll of a waiter: {poll} statements (polling five times per renew interval, as a waiter without named-lock wake-ups would: {} per waiter)",
            5 * poll
        );
    }
}

/// A server's own blocking locks, as (name, set-up, take, give) statements: the waiter blocks
/// in `take` until the holder's `give`.
pub(crate) type BlockingLock = (
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
    &'static [&'static str],
);

pub(crate) fn blocking_locks(dialect: Dialect) -> Vec<BlockingLock> {
    const ROW: &[&str] = &[
        "CREATE TABLE IF NOT EXISTS leasehold_bench_row (id INT PRIMARY KEY, n INT NOT NULL)",
        "DELETE FROM leasehold_bench_row",
        "INSERT INTO leasehold_bench_row VALUES (1, 0)",
    ];
    const FOR_UPDATE: &[&str] = &[
        "BEGIN",
        "SELECT n FROM leasehold_bench_row WHERE id = 1 FOR UPDATE",
    ];
    match dialect {
        Dialect::Postgres => vec![
            (
                "pg_advisory_lock",
                &[],
                &["SELECT pg_advisory_lock(4242)"],
                &["SELECT pg_advisory_unlock(4242)"],
            ),
            ("SELECT FOR UPDATE", ROW, FOR_UPDATE, &["COMMIT"]),
        ],
        Dialect::MySql => vec![
            (
                "GET_LOCK",
                &[],
                &["SELECT GET_LOCK('leasehold_bench', 60)"],
                &["SELECT RELEASE_LOCK('leasehold_bench')"],
            ),
            ("SELECT FOR UPDATE", ROW, FOR_UPDATE, &["COMMIT"]),
        ],
    }
}

pub(crate) async fn run_statements(
    conn: &mut sqlx::AnyConnection,
    statements: &'static [&'static str],
) {
    for statement in statements {
        sqlx::raw_sql(statement)
            .execute(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
}

/// Two sessions hand a server's own blocking lock back and forth: the time from the holder's
/// `give` being sent to the blocked waiter's `take` returning.
pub(crate) async fn raw_blocking_handovers(
    url: &str,
    setup: &'static [&'static str],
    take: &'static [&'static str],
    give: &'static [&'static str],
) -> Vec<Duration> {
    use sqlx::Connection;
    sqlx::any::install_default_drivers();
    let mut a = sqlx::AnyConnection::connect(url).await.expect("connect");
    let mut b = sqlx::AnyConnection::connect(url).await.expect("connect");
    run_statements(&mut a, setup).await;
    run_statements(&mut a, take).await;
    let mut latencies = Vec::new();
    for round in 0..HANDOVERS {
        let (holder, waiter) = if round % 2 == 0 {
            (&mut a, &mut b)
        } else {
            (&mut b, &mut a)
        };
        // Polled side by side in one task: the waiter blocks in the server, and the holder
        // gives the lock up once the waiter is surely blocked.
        let waiting = async {
            run_statements(waiter, take).await;
            Instant::now()
        };
        let giving = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let released = Instant::now();
            run_statements(holder, give).await;
            released
        };
        let (held, released) = tokio::join!(waiting, giving);
        latencies.push(held - released);
    }
    latencies.sort();
    latencies
}
