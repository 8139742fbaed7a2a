//! `drivers`: acquire+release cycles per driver against the raw protocol on one connection, and
//! hand-over latency, for Redis, Redlock and SQLite.

use super::*;

/// The raw blocking lock on Redis: `SET NX PX`, and a waiter that blocks in `BLPOP` on a signal
/// list the holder pushes to after its `DEL`, then takes the key. Timed from the holder's
/// release being sent to the waiter's `SET` succeeding.
pub(crate) async fn redis_raw_blocking_handovers(url: &str) -> Vec<Duration> {
    let client = redis::Client::open(url).expect("client");
    let mut sessions = Vec::new();
    for _ in 0..2 {
        sessions.push(
            client
                .get_multiplexed_async_connection()
                .await
                .expect("connect"),
        );
    }
    let take = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        async move {
            set_nx_px("raw-blocking", "bench")
                .query_async::<Option<String>>(&mut conn)
                .await
                .expect("SET")
                .is_some()
        }
    };
    let _: () = redis::cmd("DEL")
        .arg("raw-blocking")
        .arg("raw-blocking:signal")
        .query_async(&mut sessions[0])
        .await
        .expect("DEL");
    assert!(take(&mut sessions[0]).await);
    let mut latencies = Vec::new();
    for round in 0..HANDOVERS {
        let (h, w) = (round % 2, (round + 1) % 2);
        let mut holder = sessions[h].clone();
        let mut waiter = sessions[w].clone();
        let waiting = async {
            loop {
                if take(&mut waiter).await {
                    return Instant::now();
                }
                let _: Option<(String, String)> = redis::cmd("BLPOP")
                    .arg("raw-blocking:signal")
                    .arg(5)
                    .query_async(&mut waiter)
                    .await
                    .expect("BLPOP");
            }
        };
        let giving = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let released = Instant::now();
            let _: () = redis::pipe()
                .cmd("DEL")
                .arg("raw-blocking")
                .ignore()
                .cmd("LPUSH")
                .arg("raw-blocking:signal")
                .arg(1)
                .ignore()
                .query_async(&mut holder)
                .await
                .expect("release");
            released
        };
        let (held, released) = tokio::join!(waiting, giving);
        latencies.push(held - released);
        let _: () = redis::cmd("DEL")
            .arg("raw-blocking:signal")
            .query_async(&mut sessions[0])
            .await
            .expect("DEL");
    }
    latencies.sort();
    latencies
}

/// The raw Redlock a hand-written client does: `SET NX PX` on every master at once, a majority
/// needed, then the compare-and-delete script on every master at once. With `tokens`, it also
/// mints a fencing token as the driver must: the first round's script answers each master's
/// counter beside the `SET`, and a second round, on the masters that granted, raises their
/// counters to one above the largest seen before the lock counts as taken.
pub(crate) async fn redlock_raw_cycles(masters: &[url::Url], tokens: bool) -> f64 {
    let mut conns = Vec::new();
    for url in masters {
        let client = redis::Client::open(url.as_str()).expect("client");
        conns.push(
            client
                .get_multiplexed_async_connection()
                .await
                .expect("connect"),
        );
    }
    let release = redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    );
    let set_and_read_counter = redis::Script::new(
        "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
         return tonumber(redis.call('GET', KEYS[2]) or '0') end return -1",
    );
    let raise_counter = redis::Script::new(
        "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end \
         if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then \
         redis.call('SET', KEYS[2], ARGV[2]) end return 1",
    );
    let quorum = masters.len() / 2 + 1;
    let start = Instant::now();
    for i in 0..CYCLES {
        let set = futures_util::future::join_all(conns.iter().map(|conn| {
            let mut conn = conn.clone();
            let set_and_read_counter = &set_and_read_counter;
            async move {
                if tokens {
                    let counter: i64 = set_and_read_counter
                        .key("raw")
                        .key("raw:token")
                        .arg("bench")
                        .arg(LEASE.as_millis() as u64)
                        .invoke_async(&mut conn)
                        .await?;
                    Ok((counter >= 0).then_some(counter))
                } else {
                    set_nx_px("raw", "bench")
                        .query_async::<Option<String>>(&mut conn)
                        .await
                        .map(|set| set.map(|_| 0))
                }
            }
        }))
        .await;
        let granted: Vec<(usize, i64)> = set
            .iter()
            .enumerate()
            .filter_map(|(m, r)| match r {
                Ok(Some(counter)) => Some((m, *counter)),
                _ => None,
            })
            .collect();
        assert!(
            granted.len() >= quorum,
            "cycle {i}: only {} masters",
            granted.len()
        );
        if tokens {
            let token = 1 + granted.iter().map(|(_, c)| *c).max().unwrap_or(0);
            let raised = futures_util::future::join_all(granted.iter().map(|(m, _)| {
                let mut conn = conns[*m].clone();
                let raise_counter = &raise_counter;
                async move {
                    raise_counter
                        .key("raw")
                        .key("raw:token")
                        .arg("bench")
                        .arg(token)
                        .invoke_async::<i64>(&mut conn)
                        .await
                }
            }))
            .await;
            let raised = raised.iter().filter(|r| matches!(r, Ok(1))).count();
            assert!(
                raised >= quorum,
                "cycle {i}: token on only {raised} masters"
            );
        }
        futures_util::future::join_all(conns.iter().map(|conn| {
            let mut conn = conn.clone();
            let release = &release;
            async move {
                release
                    .key("raw")
                    .arg("bench")
                    .invoke_async::<i64>(&mut conn)
                    .await
            }
        }))
        .await;
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

pub(crate) async fn sqlite_raw_cycles(path: &std::path::Path) -> f64 {
    use sqlx::Connection;
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Full);
    let mut conn = sqlx::SqliteConnection::connect_with(&options)
        .await
        .expect("connect");
    sqlx::query("CREATE TABLE IF NOT EXISTS raw_locks (name TEXT PRIMARY KEY, holder TEXT, expires_at_ms INTEGER)")
        .execute(&mut conn)
        .await
        .expect("create");
    let start = Instant::now();
    for _ in 0..CYCLES {
        sqlx::query(
            "INSERT INTO raw_locks (name, holder, expires_at_ms) VALUES ('raw', 'bench', 0)",
        )
        .execute(&mut conn)
        .await
        .expect("insert");
        sqlx::query("DELETE FROM raw_locks WHERE name = 'raw' AND holder = 'bench'")
            .execute(&mut conn)
            .await
            .expect("delete");
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

pub(crate) async fn driver_section() {
    println!(
        "## acquire+release cycles ({CYCLES} sequential cycles on one client, best of {ROUNDS}, alternating)"
    );
    let redis = redis_without_persistence();
    let url = url::Url::parse(&redis.url()).expect("url");
    let driver =
        leasehold_lease::redis::RedisDriver::connect(&url, "leasehold", None).expect("driver");
    let (mut raw, mut ours) = (0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(redis_raw_cycles(&redis.url()).await);
        ours = ours.max(driver_cycles(&driver).await);
    }
    println!("  redis  raw SET NX PX + EVAL del : {raw:>9.0} cycles/s");
    println!(
        "  redis  RedisDriver              : {ours:>9.0} cycles/s  ({:.0} %)",
        100.0 * ours / raw
    );

    let masters: Vec<RedisServer> = (0..REDLOCK_MASTERS)
        .map(|_| RedisServer::start_with(false))
        .collect();
    // Without persistence, each master grants no free lock until it has been up for a lease
    // (it cannot tell its start from a restart that lost leases), as on single Redis.
    tokio::task::block_in_place(|| {
        for master in &masters {
            master.wait_until_up_for(LEASE);
        }
    });
    let urls: Vec<url::Url> = masters
        .iter()
        .map(|m| url::Url::parse(&m.url()).expect("url"))
        .collect();
    let driver = leasehold_lease::redlock::RedlockDriver::connect(&urls, "leasehold", None)
        .expect("redlock");
    let (mut raw, mut with_tokens, mut ours) = (0.0f64, 0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(redlock_raw_cycles(&urls, false).await);
        with_tokens = with_tokens.max(redlock_raw_cycles(&urls, true).await);
        ours = ours.max(driver_cycles(&driver).await);
    }
    println!("  redlock raw SET NX + del, 5 masters: {raw:>6.0} cycles/s");
    println!(
        "  redlock raw, with a token round   : {with_tokens:>6.0} cycles/s  ({:.0} %; the counters read with the SET, raised on a majority before holding)",
        100.0 * with_tokens / raw
    );
    println!(
        "  redlock RedlockDriver, 5 masters  : {ours:>6.0} cycles/s  ({:.0} % of raw, {:.0} % of raw with the token round)",
        100.0 * ours / raw,
        100.0 * ours / with_tokens
    );
    drop(masters);

    let sqlite = SqliteHarness::new();
    let driver = leasehold_lease::sqlite::SqliteDriver::open(&sqlite.path(), "leasehold_locks")
        .await
        .expect("sqlite");
    let (mut raw, mut ours) = (0.0f64, 0.0f64);
    for _ in 0..ROUNDS {
        raw = raw.max(sqlite_raw_cycles(&sqlite.dir_path().join("raw.db")).await);
        ours = ours.max(driver_cycles(&driver).await);
    }
    println!("  sqlite raw INSERT + DELETE      : {raw:>9.0} cycles/s");
    println!(
        "  sqlite SqliteDriver             : {ours:>9.0} cycles/s  ({:.0} %)",
        100.0 * ours / raw
    );

    println!(
        "## graceful hand-over, release -> waiter holds ({HANDOVERS} rounds, lease {LEASE:?})"
    );
    let durable = RedisServer::start();
    let url = url::Url::parse(&durable.url()).expect("url");
    let connect = || -> Arc<dyn Backend> {
        Arc::new(
            leasehold_lease::redis::RedisDriver::connect(&url, "leasehold", None).expect("driver"),
        )
    };
    let redis_latency = handover_latencies(connect(), connect()).await;
    println!(
        "  redis  (pub/sub wake-up)        : {}",
        describe(&redis_latency)
    );
    let redis_raw = redis_raw_blocking_handovers(&durable.url()).await;
    println!(
        "  redis  raw BLPOP-signalled lock : {}",
        describe(&redis_raw)
    );
    let open = || async {
        Arc::new(
            leasehold_lease::sqlite::SqliteDriver::open(&sqlite.path(), "leasehold_locks")
                .await
                .expect("sqlite"),
        ) as Arc<dyn Backend>
    };
    let sqlite_latency = handover_latencies(open().await, open().await).await;
    println!(
        "  sqlite (wake files, two drivers): {}",
        describe(&sqlite_latency)
    );
}
