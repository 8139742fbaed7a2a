//! `keyed` and `keyed-many`: a family of keyed locks against the backend's raw protocol, and one
//! sidecar holding ten thousand keys.

use super::*;

/// Keyed locks: concurrent owners, each cycling on a key of its own, and how long each run is.
pub(crate) const KEYED_OWNERS: usize = 16;
pub(crate) const KEYED_DURATION: Duration = Duration::from_secs(3);

/// One sidecar holding this many keys of one family at once, its requests counted this long.
pub(crate) const MANY_KEYS: usize = 10_000;
pub(crate) const MANY_KEYS_MEASURE: Duration = Duration::from_secs(15);

/// Redis, PostgreSQL, etcd and ZooKeeper, started for a section that compares keyed
/// primitives on each; kept running while the section uses their drivers.
pub(crate) struct KeyedBackends {
    redis: RedisServer,
    postgres: PostgresServer,
    etcd: leasehold_testkit::EtcdServer,
    zookeeper: leasehold_testkit::ZooKeeperServer,
}

impl KeyedBackends {
    pub(crate) fn start() -> Self {
        Self {
            redis: redis_without_persistence(),
            postgres: PostgresServer::start(),
            etcd: leasehold_testkit::EtcdServer::start(),
            zookeeper: leasehold_testkit::ZooKeeperServer::start(),
        }
    }

    /// Each backend's name and URL.
    pub(crate) fn urls(&self) -> [(&'static str, String); 4] {
        [
            ("redis", self.redis.url()),
            ("postgres", self.postgres.url()),
            ("etcd", self.etcd.url()),
            ("zookeeper", self.zookeeper.url()),
        ]
    }

    /// Each backend's name and a driver connected to it.
    pub(crate) async fn drivers(&self) -> Vec<(&'static str, Arc<dyn Backend>)> {
        let mut drivers = Vec::new();
        for (name, url) in self.urls() {
            drivers.push((name, connect_driver(name, &url).await));
        }
        drivers
    }
}

/// A driver connected to backend `name` at `url`.
pub(crate) async fn connect_driver(name: &str, url: &str) -> Arc<dyn Backend> {
    let url = leasehold_lease::BackendUrl::parse(url).expect("url");
    leasehold_lease::connect(&url).await.expect(name)
}

/// Acquire+release cycles per second of `KEYED_OWNERS` owners of one sidecar's family, each on
/// a key of its own, for `KEYED_DURATION`.
pub(crate) async fn keyed_cycles(family: &leasehold_lease::keyed::KeyedFamily) -> f64 {
    owners_taking_keys(family, |i| format!("order-{i}"), Duration::ZERO).await
}

/// Acquire+release cycles per second of `KEYED_OWNERS` owners of `family`, owner `i` on
/// `key(i)`, each acquisition waiting up to `wait`, for `KEYED_DURATION`.
pub(crate) async fn owners_taking_keys(
    family: &leasehold_lease::keyed::KeyedFamily,
    key: fn(usize) -> String,
    wait: Duration,
) -> f64 {
    owners_cycling(|i, start| {
        let family = family.clone();
        async move {
            let (key, owner) = (key(i), format!("worker-{i}"));
            let mut cycles = 0u64;
            while start.elapsed() < KEYED_DURATION {
                let answer = family
                    .acquire(&key, &owner, wait, LEASE)
                    .await
                    .expect("acquire");
                assert!(
                    matches!(answer, leasehold_lease::keyed::KeyAnswer::Held { .. }),
                    "{key}: {answer:?}"
                );
                family.release(&key, &owner).await.expect("release");
                cycles += 1;
            }
            cycles
        }
    })
    .await
}

/// The same load on the family's driver alone, without the engine a key's holding runs: where
/// the family's gap to raw lies, in the driver's calls or around them.
pub(crate) async fn keyed_driver_cycles(
    family: &leasehold_lease::keyed::KeyedFamily,
    driver: Arc<dyn Backend>,
) -> f64 {
    owners_cycling(|i, start| {
        let driver = driver.clone();
        let lock = family.backend_name(&format!("order-{i}")).expect("key");
        async move {
            let owner = format!("bench/worker-{i}");
            let mut cycles = 0u64;
            while start.elapsed() < KEYED_DURATION {
                let lease = match driver
                    .try_acquire(&lock, &owner, LEASE)
                    .await
                    .expect("acquire")
                {
                    Acquire::Acquired(lease) => lease,
                    Acquire::Busy(h) => panic!("{lock}: busy {h:?}"),
                    Acquire::Withheld(w) => panic!("{lock}: withheld {w:?}"),
                };
                assert!(driver.release(&lease).await.expect("release"));
                cycles += 1;
            }
            cycles
        }
    })
    .await
}

/// The same load on raw Redis: `SET NX PX` and the compare-and-delete script, one key per owner,
/// on one multiplexed connection (as the driver has).
pub(crate) async fn keyed_redis_raw_cycles(url: &str) -> f64 {
    let client = redis::Client::open(url).expect("client");
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    owners_cycling(|i, start| {
        let mut conn = conn.clone();
        async move {
            let release = redis::Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            );
            let (key, owner) = (format!("raw:order-{i}"), format!("worker-{i}"));
            let mut cycles = 0u64;
            while start.elapsed() < KEYED_DURATION {
                let set: Option<String> = set_nx_px(&key, &owner)
                    .query_async(&mut conn)
                    .await
                    .expect("SET");
                assert!(set.is_some(), "{key}: SET NX failed");
                let deleted: i64 = release
                    .key(&key)
                    .arg(&owner)
                    .invoke_async(&mut conn)
                    .await
                    .expect("EVAL");
                assert_eq!(deleted, 1);
                cycles += 1;
            }
            cycles
        }
    })
    .await
}

/// The same load on raw PostgreSQL: insert the key's row, delete it where the owner matches, on
/// a pool as large as the driver's.
pub(crate) async fn keyed_postgres_raw_cycles(url: &str) -> f64 {
    sqlx::any::install_default_drivers();
    let pool = sqlx::any::AnyPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .expect("pool");
    sqlx::query("CREATE TABLE IF NOT EXISTS raw_keys (name VARCHAR(253) PRIMARY KEY, holder VARCHAR(253), expires_at TIMESTAMPTZ NOT NULL)")
        .execute(&pool)
        .await
        .expect("create");
    owners_cycling(|i, start| {
        let pool = pool.clone();
        async move {
            let (key, owner) = (format!("order-{i}"), format!("worker-{i}"));
            let mut cycles = 0u64;
            while start.elapsed() < KEYED_DURATION {
                sqlx::query("INSERT INTO raw_keys (name, holder, expires_at) VALUES ($1, $2, now() + interval '15 seconds')")
                    .bind(&key)
                    .bind(&owner)
                    .execute(&pool)
                    .await
                    .expect("insert");
                sqlx::query("DELETE FROM raw_keys WHERE name = $1 AND holder = $2")
                    .bind(&key)
                    .bind(&owner)
                    .execute(&pool)
                    .await
                    .expect("delete");
                cycles += 1;
            }
            cycles
        }
    })
    .await
}

pub(crate) async fn keyed_section() {
    use leasehold_lease::keyed::{FamilyConfig, KeyedFamily};
    println!(
        "## keyed locks: {KEYED_OWNERS} owners of one sidecar, each cycling acquire+release on a key of its own ({KEYED_DURATION:?}, best of {ROUNDS}, alternating)"
    );
    let family = |driver: Arc<dyn Backend>| {
        KeyedFamily::new(
            driver,
            FamilyConfig::new("orders", "bench", LEASE),
            Arc::new(()),
        )
        .expect("family")
    };
    let redis = redis_without_persistence();
    let driver =
        leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&redis.url()).expect("url"))
            .await
            .expect("redis");
    let keyed = family(driver.clone());
    let mut admin = redis.admin().await;
    // Best rate of each; over all rounds, the server's CPU (s), the cycles, and the calls and
    // commands the server ran.
    let mut runs = [(0.0f64, 0.0f64, 0.0f64, 0u64, 0u64, 0.0f64); 3];
    for _ in 0..ROUNDS {
        for (i, run) in runs.iter_mut().enumerate() {
            let own_cpu = process_cpu_seconds();
            let cpu = redis_cpu_seconds(&mut admin).await;
            let (commands, scripts) = redis_commands(&mut admin).await;
            let rate = match i {
                0 => keyed_redis_raw_cycles(&redis.url()).await,
                1 => keyed_driver_cycles(&keyed, driver.clone()).await,
                _ => keyed_cycles(&keyed).await,
            };
            run.0 = run.0.max(rate);
            run.1 += redis_cpu_seconds(&mut admin).await - cpu;
            run.5 += process_cpu_seconds() - own_cpu;
            run.2 += rate * KEYED_DURATION.as_secs_f64();
            let (commands_after, scripts_after) = redis_commands(&mut admin).await;
            run.3 += scripts_after - scripts;
            // Less the INFO calls that read the counters.
            run.4 += commands_after - commands - 2;
        }
    }
    let raw = runs[0].0;
    for (run, label) in runs.iter().zip([
        "raw SET NX PX + EVAL del",
        "driver calls alone      ",
        "keyed family            ",
    ]) {
        println!(
            "  redis    {label} : {:>8.0} cycles/s  ({:>3.0} %)   server CPU {:>5.1} µs/cycle, client CPU {:>5.1} µs/cycle, {:.2} script calls and {:.1} commands a cycle",
            run.0,
            100.0 * run.0 / raw,
            1e6 * run.1 / run.2,
            1e6 * run.5 / run.2,
            run.3 as f64 / run.2,
            run.4 as f64 / run.2,
        );
    }
    println!(
        "  target: the keyed family at least 0.9x the driver's calls alone; achieved {:.2}x",
        runs[2].0 / runs[1].0
    );
    keyed.shutdown().await;

    let postgres = PostgresServer::start();
    let driver = leasehold_lease::connect(
        &leasehold_lease::BackendUrl::parse(&postgres.url()).expect("url"),
    )
    .await
    .expect("postgres");
    let keyed = family(driver);
    let (mut raw, mut ours) = (0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(keyed_postgres_raw_cycles(&postgres.url()).await);
        ours = ours.max(keyed_cycles(&keyed).await);
    }
    println!("  postgres raw INSERT + DELETE, 4 connections: {raw:>6.0} cycles/s");
    println!(
        "  postgres keyed family, 4 connections     : {ours:>6.0} cycles/s  ({:.0} %)",
        100.0 * ours / raw
    );
    keyed.shutdown().await;
}

/// One sidecar process holding `MANY_KEYS` keys of a family on Redis: its memory, idle and
/// loaded, and the Redis commands per second that keeping the keys costs, beside the least
/// it could cost with one renewal per key per renew interval.
pub(crate) async fn many_keys_section() {
    println!(
        "## keyed locks: one sidecar holding {MANY_KEYS} keys of one family (lease {LEASE:?}, renewals every {:?})",
        LEASE / 3
    );
    let redis = redis_without_persistence();
    let conn = redis.admin().await;
    let [commands, scripts] = many_keys_on(&redis.url(), "Redis", async || {
        let (commands, scripts) = redis_commands(&mut conn.clone()).await;
        // Less this count's own INFO call.
        [commands.saturating_sub(1), scripts]
    })
    .await;
    println!(
        "  Redis requests/s keeping them: {scripts:.0} script calls (one renewal per key per interval would be {:.0}; renewals within {:?} of each other go in one call), {commands:.0} commands run inside them and beside",
        MANY_KEYS as f64 / (LEASE / 3).as_secs_f64(),
        leasehold_lease::redis::RENEWAL_LINGER
    );
    let postgres = PostgresServer::start();
    let admin = {
        use sqlx::Connection;
        sqlx::any::install_default_drivers();
        let mut admin = sqlx::AnyConnection::connect(&postgres.url())
            .await
            .expect("connect");
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&mut admin)
            .await
            .expect("pg_stat_statements");
        tokio::sync::Mutex::new(admin)
    };
    let [statements, renewals] = many_keys_on(&postgres.url(), "PostgreSQL", async || {
        use sqlx::Row;
        let row = sqlx::query(
            "SELECT CAST(COALESCE(SUM(calls), 0) AS BIGINT) AS every, \
               CAST(COALESCE(SUM(calls) FILTER (WHERE query LIKE 'UPDATE %SET expires_at%'), 0) AS BIGINT) AS renewals \
             FROM pg_stat_statements",
        )
        .fetch_one(&mut *admin.lock().await)
        .await
        .expect("pg_stat_statements");
        let count = |column: &str| row.try_get::<i64, _>(column).expect("count") as u64;
        // Less this count's own query.
        [count("every").saturating_sub(1), count("renewals")]
    })
    .await;
    println!(
        "  PostgreSQL statements/s keeping them: {renewals:.0} renewal statements (one renewal per key per interval would be {:.0}; renewals within {:?} of each other go in one statement), {statements:.0} statements in all",
        MANY_KEYS as f64 / (LEASE / 3).as_secs_f64(),
        leasehold_lease::redis::RENEWAL_LINGER
    );
    drop(postgres);

    let mariadb = MariaDbServer::start();
    let admin = {
        use sqlx::Connection;
        tokio::sync::Mutex::new(
            sqlx::AnyConnection::connect(&mariadb.url())
                .await
                .expect("connect"),
        )
    };
    // Statements the clients sent (`Questions`), and the most sessions open at once.
    let [statements, _] = many_keys_on(&mariadb.url(), "MariaDB", async || {
        let mut admin = admin.lock().await;
        // Less these two statements.
        let questions = mariadb_server::status(&mut admin, "Questions")
            .await
            .saturating_sub(2);
        [questions, 0]
    })
    .await;
    let sessions = mariadb_server::status(&mut *admin.lock().await, "Max_used_connections").await;
    println!(
        "  MariaDB statements/s keeping them: {statements:.0} (one renewal per key per interval would be {:.0}); the most sessions open at once: {sessions} (the sidecar's pool, its named-lock sessions, this bench's own)",
        MANY_KEYS as f64 / (LEASE / 3).as_secs_f64(),
    );
    drop(mariadb);

    let zookeeper = leasehold_testkit::ZooKeeperServer::start();
    let [requests] = many_keys_on(&zookeeper.url(), "ZooKeeper", async || {
        [zookeeper.packets_received()]
    })
    .await;
    println!(
        "  ZooKeeper requests/s keeping them: {requests:.0} (a sync and a read per key per interval would be {:.0}; renewals within {:?} of each other take one sync and one multiRead)",
        2.0 * MANY_KEYS as f64 / (LEASE / 3).as_secs_f64(),
        leasehold_lease::redis::RENEWAL_LINGER
    );
    drop(zookeeper);

    let etcd = leasehold_testkit::EtcdServer::start();
    let [messages] = many_keys_on(&etcd.url(), "etcd", async || [etcd.messages_received()]).await;
    println!(
        "  etcd requests/s keeping them: {messages:.0} gRPC messages (one keep-alive per key per interval would be {:.0}; the sidecar's keys share one etcd lease, and renewals within {:?} of each other take one read and one keep-alive)",
        MANY_KEYS as f64 / (LEASE / 3).as_secs_f64(),
        leasehold_lease::redis::RENEWAL_LINGER
    );
}

/// One sidecar on `backend` takes `MANY_KEYS` keys of a family over `KEYED_OWNERS`
/// connections and keeps them: prints how long taking them took and its memory, idle and
/// holding them, and answers the backend's request counters (`count`, each counting up) per
/// second in the steady state.
pub(crate) async fn many_keys_on<const N: usize>(
    backend: &str,
    name: &str,
    count: impl AsyncFn() -> [u64; N],
) -> [f64; N] {
    let port = free_port();
    let sidecar = Process(
        Command::new(sibling_binary("leasehold-sidecar"))
            .args(["--keyed", "orders", "--identity", "bench"])
            .args(["--max-keys", &MANY_KEYS.to_string()])
            .args(["--backend", backend])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start sidecar"),
    );
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    wait_until_serving(addr, "/locks/orders/keys/probe", 409).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_rss = rss_kib(sidecar.0.id());

    let started = Instant::now();
    let workers: Vec<_> = (0..KEYED_OWNERS)
        .map(|w| {
            tokio::spawn(async move {
                let mut conn = TcpStream::connect(addr).await.expect("connect");
                let mut reader = BufReader::new(&mut conn);
                for i in (w..MANY_KEYS).step_by(KEYED_OWNERS) {
                    let path =
                        format!("/locks/orders/keys/order-{i}/acquire?owner=req-{i}&hold=1h");
                    let status = request(&mut reader, "POST", &path).await.expect("acquire");
                    assert_eq!(status, 200, "{path}");
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.expect("worker");
    }
    let took = started.elapsed();
    // Past the first renewals of every key, so that what is counted is the steady state.
    tokio::time::sleep(LEASE / 3 + Duration::from_secs(1)).await;
    let before = count().await;
    let measure = Instant::now();
    tokio::time::sleep(MANY_KEYS_MEASURE).await;
    let after = count().await;
    let seconds = measure.elapsed().as_secs_f64();
    let held_rss = rss_kib(sidecar.0.id());
    println!(
        "  {name}: acquiring {MANY_KEYS} keys over {KEYED_OWNERS} connections: {:.1} s ({:.0} keys/s)",
        took.as_secs_f64(),
        MANY_KEYS as f64 / took.as_secs_f64()
    );
    println!(
        "  {name}: sidecar RSS: idle {:.1} MiB, holding {MANY_KEYS} keys {:.1} MiB (target under 64 MiB)",
        idle_rss as f64 / 1024.0,
        held_rss as f64 / 1024.0
    );
    std::array::from_fn(|i| (after[i] - before[i]) as f64 / seconds)
}
