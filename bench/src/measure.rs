//! What the sections share: the processes they start, the HTTP load generator, the
//! raw Redis lock every Redis-family baseline uses, latencies and CPU counted.

use super::*;

/// The idle-waiter measurement: how many waiters, on which leases (a short one, and the default
/// 15 s), renewing every third of the lease, measured for at least 15 s and 5 renew intervals.
pub(crate) const IDLE_WAITERS: usize = 100;
pub(crate) const IDLE_LEASES: [Duration; 2] = [Duration::from_secs(3), Duration::from_secs(15)];
pub(crate) const IDLE_MEASURE: Duration = Duration::from_secs(15);

/// 100 idle waiters behind one holder, on each of `IDLE_LEASES`: what they cost the backend, in
/// requests it received. One line per lease.
pub(crate) async fn idle_waiters(
    connect: impl Fn() -> Arc<dyn Backend>,
    received: impl AsyncFn() -> u64,
) -> Vec<String> {
    let mut lines = Vec::new();
    for lease in IDLE_LEASES {
        lines.push(idle_waiters_on(&connect, &received, lease).await);
    }
    lines
}

pub(crate) async fn idle_waiters_on(
    connect: &impl Fn() -> Arc<dyn Backend>,
    received: &impl AsyncFn() -> u64,
    lease: Duration,
) -> String {
    let renew = lease / 3;
    let measure = IDLE_MEASURE.max(renew * 5);
    let lock = format!("idle-{}s", lease.as_secs());
    let config = |id: String| LockConfig {
        renew_interval: renew,
        mode: Mode::Campaign,
        ..LockConfig::new(&lock, &id, lease)
    };
    let holder = Lock::start(connect(), config("holder".into()), Arc::new(())).expect("holder");
    while !holder.answer().is_holder() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let waiters: Vec<Lock> = (0..IDLE_WAITERS)
        .map(|i| Lock::start(connect(), config(format!("w{i}")), Arc::new(())).expect("waiter"))
        .collect();
    tokio::time::sleep(lease * 2).await;
    let before = received().await;
    tokio::time::sleep(measure).await;
    let requests = received().await - before;
    assert!(waiters.iter().all(|w| !w.answer().is_holder()));
    for waiter in waiters {
        waiter.shutdown().await;
    }
    holder.shutdown().await;
    let intervals = measure.as_secs_f64() / renew.as_secs_f64();
    format!(
        "{:>7.1} requests/s = {:.2} per waiter per renew interval (lease {lease:?}, renew {renew:?})",
        requests as f64 / measure.as_secs_f64(),
        requests as f64 / IDLE_WAITERS as f64 / intervals
    )
}

pub(crate) fn sibling_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let path = exe.with_file_name(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/bench",
        path.display()
    );
    path
}

pub(crate) struct Process(pub(crate) Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn rss_kib(pid: u32) -> u64 {
    proc_status_kib(pid, "VmRSS:")
}

/// The most memory the process has had resident.
pub(crate) fn peak_rss_kib(pid: u32) -> u64 {
    proc_status_kib(pid, "VmHWM:")
}

fn proc_status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

pub(crate) async fn wait_until_serving(addr: SocketAddr, path: &str, want: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(mut conn) = TcpStream::connect(addr).await {
            let mut reader = BufReader::new(&mut conn);
            if get(&mut reader, path)
                .await
                .is_ok_and(|status| status == want)
            {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{addr}{path} never answered {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One keep-alive request; returns the status. Minimal on purpose: the client's own cost is
/// the same for both servers.
pub(crate) async fn get(conn: &mut BufReader<&mut TcpStream>, path: &str) -> std::io::Result<u16> {
    request(conn, "GET", path).await
}

pub(crate) async fn request(
    conn: &mut BufReader<&mut TcpStream>,
    method: &str,
    path: &str,
) -> std::io::Result<u16> {
    Ok(request_with_body(conn, method, path, "").await?.0)
}

/// One keep-alive request with a JSON `body` (none when empty); the status and the answer's
/// body.
pub(crate) async fn request_with_body(
    conn: &mut BufReader<&mut TcpStream>,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<(u16, String)> {
    let content_type = if body.is_empty() {
        ""
    } else {
        "Content-Type: application/json\r\n"
    };
    conn.get_mut()
        .write_all(
            format!(
                "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{content_type}Content-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await?;
    let mut line = String::new();
    conn.read_line(&mut line).await?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("bad status line"))?;
    let mut length = 0usize;
    loop {
        line.clear();
        conn.read_line(&mut line).await?;
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut answer = vec![0; length];
    conn.read_exact(&mut answer).await?;
    Ok((status, String::from_utf8_lossy(&answer).into_owned()))
}

pub(crate) async fn requests_per_second(addr: SocketAddr, path: &'static str, expect: u16) -> f64 {
    let deadline = Instant::now() + HTTP_DURATION;
    let mut tasks = Vec::new();
    for _ in 0..HTTP_CONNECTIONS {
        tasks.push(tokio::spawn(async move {
            let mut conn = TcpStream::connect(addr).await.expect("connect");
            conn.set_nodelay(true).ok();
            let mut reader = BufReader::new(&mut conn);
            let mut done = 0u64;
            while Instant::now() < deadline {
                let status = get(&mut reader, path).await.expect("request");
                assert_eq!(status, expect, "unexpected status from {path}");
                done += 1;
            }
            done
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("load task");
    }
    total as f64 / HTTP_DURATION.as_secs_f64()
}

/// Redis without an append-only file (fsync would dominate both sides of a comparison), once it
/// has been up for a lease: until then it grants no free lock, since it cannot tell its start
/// from a restart that lost leases their holders still claim (`drivers/redis/mod.rs`).
pub(crate) fn redis_without_persistence() -> RedisServer {
    let redis = RedisServer::start_with(false);
    tokio::task::block_in_place(|| redis.wait_until_up_for(LEASE));
    redis
}

pub(crate) async fn driver_cycles(driver: &dyn Backend) -> f64 {
    let start = Instant::now();
    for i in 0..CYCLES {
        let lease = match driver
            .try_acquire("cycles", "bench", LEASE)
            .await
            .expect("acquire")
        {
            Acquire::Acquired(lease) => lease,
            Acquire::Busy(h) => panic!("cycle {i}: busy {h:?}"),
            Acquire::Withheld(w) => panic!("cycle {i}: withheld {w:?}"),
        };
        assert!(driver.release(&lease).await.expect("release"));
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// The raw lock's take: `SET key value NX PX lease`, answered `OK` or nil.
pub(crate) fn set_nx_px(key: &str, value: &str) -> redis::Cmd {
    let mut set = redis::cmd("SET");
    set.arg(key)
        .arg(value)
        .arg("NX")
        .arg("PX")
        .arg(LEASE.as_millis() as u64);
    set
}

pub(crate) async fn redis_raw_cycles(url: &str) -> f64 {
    redis_raw_cycles_confirmed(url, 0).await
}

/// The raw lock (`SET NX PX`, the compare-and-delete script), each `SET` confirmed by
/// `replicas` replicas (`WAIT`) when that is not 0.
pub(crate) async fn redis_raw_cycles_confirmed(url: &str, replicas: i64) -> f64 {
    let client = redis::Client::open(url).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    raw_lock_cycles(&mut conn, replicas).await
}

/// The raw lock's cycles on `conn` (one server, or a cluster client that routes each command
/// to its key's master), each `SET` confirmed by `replicas` replicas when that is not 0.
pub(crate) async fn raw_lock_cycles(
    conn: &mut impl redis::aio::ConnectionLike,
    replicas: i64,
) -> f64 {
    let release = redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    );
    let start = Instant::now();
    for i in 0..CYCLES {
        let set: Option<String> = set_nx_px("raw", "bench")
            .query_async(conn)
            .await
            .expect("SET");
        assert!(set.is_some(), "cycle {i}: SET NX failed");
        if replicas > 0 {
            let acked: i64 = redis::cmd("WAIT")
                .arg(replicas)
                .arg(500)
                .query_async(conn)
                .await
                .expect("WAIT");
            assert!(acked >= replicas, "cycle {i}: {acked} replicas confirmed");
        }
        let deleted: i64 = release
            .key("raw")
            .arg("bench")
            .invoke_async(conn)
            .await
            .expect("EVAL");
        assert_eq!(deleted, 1);
    }
    CYCLES as f64 / start.elapsed().as_secs_f64()
}

/// Two on-demand holders, each on its own connection, hand the lock back and forth; the time
/// from the holder's release call to the waiter holding.
pub(crate) async fn handover_latencies(a: Arc<dyn Backend>, b: Arc<dyn Backend>) -> Vec<Duration> {
    let config = |id: &str| LockConfig {
        mode: Mode::OnDemand,
        ..LockConfig::new("handover", id, LEASE)
    };
    let locks = [
        Lock::start(a, config("a"), Arc::new(())).expect("lock a"),
        Lock::start(b, config("b"), Arc::new(())).expect("lock b"),
    ];
    let hold = Duration::from_secs(300);
    assert!(
        locks[0]
            .acquire(Duration::from_secs(30), hold)
            .await
            .unwrap()
            .is_holder()
    );
    let mut latencies = Vec::new();
    for round in 0..HANDOVERS {
        let (holder, waiter) = (&locks[round % 2], locks[(round + 1) % 2].clone());
        let waiting = tokio::spawn(async move {
            let answer = waiter.acquire(Duration::from_secs(60), hold).await.unwrap();
            (answer, Instant::now())
        });
        // Let the waiter's attempt fail and settle into waiting, then release at a random
        // point of its polling cycle, as a real release would.
        let settle: u64 = rand::Rng::random_range(&mut rand::rng(), 100..1100);
        tokio::time::sleep(Duration::from_millis(settle)).await;
        let released = Instant::now();
        assert!(holder.release().await.unwrap());
        let (answer, held) = waiting.await.unwrap();
        assert!(
            matches!(answer, Answer::Holder { .. }),
            "round {round}: {answer:?}"
        );
        latencies.push(held - released);
    }
    for lock in &locks {
        lock.shutdown().await;
    }
    latencies.sort();
    latencies
}

pub(crate) fn describe(latencies: &[Duration]) -> String {
    let pick = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    format!(
        "median {:>8.2} ms   p90 {:>8.2} ms   max {:>8.2} ms",
        pick(0.5).as_secs_f64() * 1e3,
        pick(0.9).as_secs_f64() * 1e3,
        pick(1.0).as_secs_f64() * 1e3
    )
}

/// [`KEYED_OWNERS`] owners at once, each a task running `owner(i, start)` (its cycles until
/// [`KEYED_DURATION`] after `start`, counted): all their cycles per second.
pub(crate) async fn owners_cycling<F, Fut>(owner: F) -> f64
where
    F: Fn(usize, Instant) -> Fut,
    Fut: std::future::Future<Output = u64> + Send + 'static,
{
    let start = Instant::now();
    let owners: Vec<_> = (0..KEYED_OWNERS)
        .map(|i| tokio::spawn(owner(i, start)))
        .collect();
    let mut total = 0;
    for owner in owners {
        total += owner.await.expect("owner");
    }
    total as f64 / start.elapsed().as_secs_f64()
}

/// The CPU time this process (the load and the family or driver it drives) has used, user
/// and system, all threads (`/proc/self/stat`, in clock ticks of 10 ms).
pub(crate) fn process_cpu_seconds() -> f64 {
    cpu_seconds("/proc/self/stat")
}

/// The CPU time process `pid` has used, user and system, all threads.
pub(crate) fn cpu_seconds_of(pid: u32) -> f64 {
    cpu_seconds(&format!("/proc/{pid}/stat"))
}

fn cpu_seconds(stat_file: &str) -> f64 {
    const TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string(stat_file).expect(stat_file);
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .expect("stat")
        .1
        .split_whitespace()
        .collect();
    // utime and stime are the stat file's 14th and 15th fields; the 3rd is fields[0] here.
    let ticks: u64 = fields[11..13]
        .iter()
        .map(|f| f.parse::<u64>().expect("ticks"))
        .sum();
    ticks as f64 / TICKS_PER_SECOND
}

/// The CPU time Redis has used, user and system (`INFO cpu`).
pub(crate) async fn redis_cpu_seconds(conn: &mut redis::aio::MultiplexedConnection) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(conn)
        .await
        .expect("INFO");
    ["used_cpu_user", "used_cpu_sys"]
        .iter()
        .filter_map(|name| field(&info, name)?.parse::<f64>().ok())
        .sum()
}

/// Redis's counts of the commands it has run (those inside scripts included) and of the
/// script calls (`EVALSHA`, one round trip each).
pub(crate) async fn redis_commands(conn: &mut redis::aio::MultiplexedConnection) -> (u64, u64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    let calls = |line: &str| -> u64 {
        line.split_once("calls=")
            .and_then(|(_, rest)| rest.split(',').next()?.parse().ok())
            .unwrap_or(0)
    };
    let total = info
        .lines()
        .filter(|l| l.starts_with("cmdstat_"))
        .map(calls)
        .sum();
    let scripts = info
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .map(calls)
        .sum();
    (total, scripts)
}
