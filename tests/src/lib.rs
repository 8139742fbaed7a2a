#![forbid(unsafe_code)]
//! Fixtures for the end-to-end suites: real `leasehold-sidecar` processes on free ports, a tiny
//! HTTP/1.1 client that can also send malformed requests, and signals; a fault-injecting TCP
//! proxy ([`fault_proxy`]), a cluster of the in-memory API and the operator for sidecars that
//! follow a `DistributedLock` ([`cluster`]), and the multi-process safety checks, of a lock
//! ([`safety`]), of a family of keyed locks ([`keyed_safety`]) and of the commands
//! `leasehold-sidecar exec` runs ([`exec_safety`]).

pub use leasehold_testkit::fault_proxy;
pub mod cluster;
pub mod exec_safety;
pub mod keyed_safety;
pub mod safety;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use leasehold_testkit::{Forward, TestNetwork, free_port};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

pub use leasehold_testkit::{
    EtcdServer, MariaDbServer, PostgresServer, RedisServer, ZooKeeperServer, require_binary,
    unique_lock,
};

/// One test per backend server: each starts its own server, then runs `scenario` on the
/// server's URL with the options given (such as `"?mode=row-lock"`).
///
/// ```ignore
/// leasehold_e2e::on_each_server! {
///     crash_takeover:
///     redis_crash_takeover: RedisServer,
///     postgres_row_lock_crash_takeover: PostgresServer "?mode=row-lock",
/// }
/// ```
#[macro_export]
macro_rules! on_each_server {
    ($scenario:ident: $($(#[$meta:meta])* $test:ident: $server:ident $($options:literal)?),+ $(,)?) => {
        $(
            $(#[$meta])*
            #[test]
            fn $test() {
                let server = $crate::$server::start();
                $scenario(&(server.url() + concat!("" $(, $options)?)));
            }
        )+
    };
}

/// The libfaketime library, preloaded directly rather than through the `faketime` wrapper: the
/// wrapper keeps a semaphore and a shared-memory segment named after its PID in /dev/shm, which
/// a killed sidecar never removes, and a later wrapper given the same PID then refuses to start
/// ("sem_open: File exists").
pub fn libfaketime() -> PathBuf {
    let multiarch = ["x86_64-linux-gnu", "aarch64-linux-gnu"];
    multiarch
        .iter()
        .map(|arch| PathBuf::from(format!("/usr/lib/{arch}/faketime/libfaketime.so.1")))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime.so.1 was not found. Install it with `apt-get install -y faketime` \
                 (scripts/test does this), then run the tests again."
            )
        })
}

/// The sidecar binary beside this executable (target/<profile>/ for a binary, its parent for a
/// test in target/<profile>/deps/), or `LEASEHOLD_SIDECAR_BIN`.
pub fn sidecar_binary() -> PathBuf {
    workspace_binary("leasehold-sidecar", "LEASEHOLD_SIDECAR_BIN")
}

/// The operator binary, found as [`sidecar_binary`] is, or `LEASEHOLD_OPERATOR_BIN`.
pub fn operator_binary() -> PathBuf {
    workspace_binary("leasehold-operator", "LEASEHOLD_OPERATOR_BIN")
}

pub(crate) fn workspace_binary(name: &str, variable: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(variable) {
        return path.into();
    }
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("executable directory");
    let candidates = [Some(dir), dir.parent()];
    candidates
        .into_iter()
        .flatten()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is missing beside {}: build it with `cargo test --workspace --no-run` (scripts/test does), or `cargo build --bins`",
                exe.display()
            )
        })
}

/// One HTTP exchange's result.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    /// The fencing token of a 200 `/lock` answer.
    pub fn token(&self) -> u64 {
        assert_eq!(self.status, 200, "not holder: {}", self.body);
        self.json()["fencingToken"].as_u64().expect("fencingToken")
    }
}

/// Send raw bytes, read until the server closes; parse the status line and the body. An
/// answer still open after 30 s (an event stream's keep-alives) is a `TimedOut` error.
pub fn raw_http(addr: SocketAddr, request: &[u8]) -> std::io::Result<Reply> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.write_all(request)?;
    let mut raw = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no end to the answer within 30 s: {}",
                    String::from_utf8_lossy(&raw)
                ),
            ));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut chunk)? {
            0 => break,
            n => raw.extend_from_slice(&chunk[..n]),
        }
    }
    parse_reply(&raw)
}

/// A client that gives up: `POST path`, and close the connection unread once `patience` has
/// passed. `Ok(None)` when it hung up before any byte of the answer came.
pub fn post_or_hang_up(
    addr: SocketAddr,
    path: &str,
    patience: Duration,
) -> std::io::Result<Option<Reply>> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(patience))?;
    stream.write_all(
        format!("POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
            .as_bytes(),
    )?;
    let mut raw = Vec::new();
    match stream.read_to_end(&mut raw) {
        Ok(_) => parse_reply(&raw).map(Some),
        Err(e)
            if raw.is_empty()
                && matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
        {
            Ok(None)
        }
        // Part of the answer came before the patience ran out: the rest follows at once.
        Err(_) => {
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            stream.read_to_end(&mut raw)?;
            parse_reply(&raw).map(Some)
        }
    }
}

fn parse_reply(raw: &[u8]) -> std::io::Result<Reply> {
    let text = String::from_utf8_lossy(raw);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status line in {text:?}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok(Reply { status, body })
}

/// An event stream (`POST .../hold`, `GET .../events`): its events as they come, read by a
/// thread of its own, until the connection is closed ([`EventStream::close`], or dropped).
pub struct EventStream {
    events: std::sync::mpsc::Receiver<StreamEvent>,
    connection: TcpStream,
}

/// One event of an [`EventStream`]: its kind, its body, and when it was read.
#[derive(Debug)]
pub struct StreamEvent {
    pub kind: String,
    pub body: serde_json::Value,
    pub at: std::time::Instant,
}

impl EventStream {
    /// `POST path` and, when the answer is 200, its event stream; any other answer as a reply.
    pub fn post(addr: SocketAddr, path: &str) -> Result<Self, Reply> {
        Self::open(addr, "POST", path)
    }

    /// `GET path`, as [`EventStream::post`].
    pub fn get(addr: SocketAddr, path: &str) -> Result<Self, Reply> {
        Self::open(addr, "GET", path)
    }

    fn open(addr: SocketAddr, method: &str, path: &str) -> Result<Self, Reply> {
        use std::io::BufRead;
        let mut connection =
            TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect");
        connection
            .write_all(
                format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
                    .as_bytes(),
            )
            .expect("send");
        let mut reader = std::io::BufReader::new(connection.try_clone().expect("clone"));
        let mut head = String::new();
        while !head.ends_with("\r\n\r\n") {
            if reader.read_line(&mut head).expect("the answer's head") == 0 {
                panic!("the connection closed in the answer's head: {head:?}");
            }
        }
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {head:?}"));
        if status != 200 {
            let mut body = String::new();
            let _ = reader.read_to_string(&mut body);
            return Err(Reply { status, body });
        }
        assert!(
            head.to_ascii_lowercase().contains("text/event-stream"),
            "not an event stream: {head}"
        );
        let (tx, events) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // Chunk sizes come on lines of their own; an event's lines are whole.
            let mut kind = None;
            for line in reader.lines() {
                let Ok(line) = line else { return };
                if let Some(k) = line.strip_prefix("event: ") {
                    kind = Some(k.to_owned());
                } else if let Some(data) = line.strip_prefix("data: ") {
                    let body = serde_json::from_str(data)
                        .unwrap_or_else(|e| panic!("event data not JSON ({e}): {data}"));
                    let event = StreamEvent {
                        kind: kind.take().unwrap_or_default(),
                        body,
                        at: std::time::Instant::now(),
                    };
                    if tx.send(event).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Self { events, connection })
    }

    /// The next event, waiting up to `within`: its kind and its body.
    pub fn next(&self, within: Duration) -> StreamEvent {
        self.events
            .recv_timeout(within)
            .unwrap_or_else(|e| panic!("no event within {within:?}: {e}"))
    }

    /// The next event if one came already.
    pub fn try_next(&self) -> Option<StreamEvent> {
        self.events.try_recv().ok()
    }

    /// Close the connection, as an app that exits does.
    pub fn close(self) {}
}

impl Drop for EventStream {
    /// The reading thread keeps a copy of the socket: shut it down, so that the server sees the
    /// connection end.
    fn drop(&mut self) {
        let _ = self.connection.shutdown(std::net::Shutdown::Both);
    }
}

pub fn http(addr: SocketAddr, method: &str, path: &str) -> std::io::Result<Reply> {
    raw_http(
        addr,
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
            .as_bytes(),
    )
}

/// A request with a JSON body.
pub fn http_with_body(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<Reply> {
    raw_http(
        addr,
        format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
}

/// Where a sidecar runs: on this machine, or on a test host of a [`TestNetwork`] (its lock API
/// then reached through a forwarding port here, as it listens on the host's loopback).
#[derive(Clone)]
pub enum Placement {
    Here,
    On(std::sync::Arc<TestNetwork>, String),
}

pub struct Sidecar {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub identity: String,
    log: tempfile::NamedTempFile,
    _forward: Option<Forward>,
}

impl Sidecar {
    /// Start a sidecar and wait until its API answers.
    pub fn start(identity: &str, backend: &str, lock: &str, extra: &[&str]) -> Self {
        Self::start_with_env(identity, backend, lock, extra, &[])
    }

    pub fn start_with_env(
        identity: &str,
        backend: &str,
        lock: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let args = [["--lock", lock, "--backend", backend].as_slice(), extra].concat();
        Self::spawn(&Placement::Here, identity, &args, env)
    }

    /// [`Sidecar::start`], placed.
    pub fn start_on(
        placement: &Placement,
        identity: &str,
        backend: &str,
        lock: &str,
        extra: &[&str],
    ) -> Self {
        let args = [["--lock", lock, "--backend", backend].as_slice(), extra].concat();
        Self::spawn(placement, identity, &args, &[])
    }

    /// [`Sidecar::start`] listening on `port`: a sidecar started again where the one before it
    /// listened, as a restarted container's does.
    pub fn start_at(port: u16, identity: &str, backend: &str, lock: &str, extra: &[&str]) -> Self {
        let args = [["--lock", lock, "--backend", backend].as_slice(), extra].concat();
        Self::spawn_at(&Placement::Here, identity, &args, &[], port)
    }

    /// A sidecar of one keyed family and no lock.
    pub fn start_keyed(identity: &str, backend: &str, family: &str) -> Self {
        Self::start_keyed_with(identity, backend, family, &[])
    }

    /// [`Sidecar::start_keyed`] with `extra` flags.
    pub fn start_keyed_with(identity: &str, backend: &str, family: &str, extra: &[&str]) -> Self {
        let args = [["--keyed", family, "--backend", backend].as_slice(), extra].concat();
        Self::spawn(&Placement::Here, identity, &args, &[])
    }

    /// A sidecar whose lock comes from a `DistributedLock` (`--resource NAMESPACE/NAME`) on the
    /// API server that `KUBECONFIG` in `env` names.
    pub fn start_from_resource(identity: &str, resource: &str, env: &[(&str, &str)]) -> Self {
        Self::spawn(&Placement::Here, identity, &["--resource", resource], env)
    }

    fn spawn(placement: &Placement, identity: &str, args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::spawn_at(placement, identity, args, env, free_port())
    }

    fn spawn_at(
        placement: &Placement,
        identity: &str,
        args: &[&str],
        env: &[(&str, &str)],
        port: u16,
    ) -> Self {
        let log = tempfile::NamedTempFile::new().expect("log file");
        let (mut command, forward) = match placement {
            Placement::Here => (Command::new(sidecar_binary()), None),
            Placement::On(network, host) => (
                network.command(host, sidecar_binary()),
                Some(network.forward(host, port)),
            ),
        };
        // A process group of its own, so that kill9 also reaches anything the sidecar started:
        // an orphan would keep running, and loading the machine, through every later test.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let child = command
            .args(args)
            .args(["--identity", identity])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            // LEASEHOLD_SIDECAR_LOG=leasehold_lease=debug, say, to follow a driver's calls.
            .env(
                "RUST_LOG",
                std::env::var("LEASEHOLD_SIDECAR_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.reopen().expect("log"))
            .spawn()
            .expect("start leasehold-sidecar");
        let sidecar = Self {
            child: Some(child),
            addr: forward
                .as_ref()
                .map_or(SocketAddr::from(([127, 0, 0, 1], port)), |f| f.addr),
            identity: identity.to_owned(),
            log,
            _forward: forward,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while http(sidecar.addr, "GET", "/healthz").is_err() {
            assert!(
                Instant::now() < deadline,
                "sidecar {identity} did not start; its log:\n{}",
                sidecar.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        sidecar
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    pub fn get(&self, path: &str) -> Reply {
        http(self.addr, "GET", path)
            .unwrap_or_else(|e| panic!("GET {path} on {}: {e}", self.identity))
    }

    pub fn post(&self, path: &str) -> Reply {
        http(self.addr, "POST", path)
            .unwrap_or_else(|e| panic!("POST {path} on {}: {e}", self.identity))
    }

    pub fn is_holder(&self) -> bool {
        self.get("/lock").status == 200
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().expect("running").id() as i32)
    }

    pub fn signal(&self, signal: Signal) {
        kill(self.pid(), signal).expect("signal");
    }

    /// `kill -9`: no release, no goodbye.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            let _ = child.kill();
            let _ = child.wait();
            // A sidecar run under libfaketime made these; a killed process never removes them.
            for leftover in ["faketime_shm", "sem.faketime_sem"] {
                let _ = std::fs::remove_file(format!("/dev/shm/{leftover}_{}", child.id()));
            }
        }
    }

    /// Wait for the process to exit; `None` if it is still running after `within`.
    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            let child = self.child.as_mut()?;
            if let Some(status) = child.try_wait().expect("try_wait") {
                self.child = None;
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            let _ = nix::sys::signal::killpg(Pid::from_raw(child.id() as i32), Signal::SIGCONT);
        }
        self.kill9();
        // To read what a sidecar did after its test has gone: LEASEHOLD_TEST_LOGS=DIR keeps
        // every sidecar's log there, named after its identity and port.
        if let Some(dir) = std::env::var_os("LEASEHOLD_TEST_LOGS") {
            let kept = std::path::Path::new(&dir).join(format!(
                "{}-{}.log",
                self.identity,
                self.addr.port()
            ));
            let _ = std::fs::create_dir_all(&dir);
            let _ = std::fs::copy(self.log.path(), kept);
        }
    }
}

/// How long a bounded safety check runs: `variable`'s whole seconds when it is set, else
/// `default_secs`.
pub fn check_duration(variable: &str, default_secs: u64) -> Duration {
    let secs = std::env::var(variable)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_secs);
    Duration::from_secs(secs)
}

/// A safety check's verdict on one run: panics unless it found no violation under enough faults
/// to mean anything (five at least). Prints the run's summary either way.
pub fn assert_safe_under_faults(
    summary: &str,
    violations: &[String],
    faults: &std::collections::BTreeMap<&'static str, usize>,
) {
    eprintln!("{summary}");
    assert!(
        violations.is_empty(),
        "{summary}:\n{}",
        violations.join("\n")
    );
    assert!(
        faults.values().sum::<usize>() >= 5,
        "too few faults to mean anything: {faults:?} ({summary})"
    );
}

/// A holder handing over: `old`'s `/lock` is asked until `stepped_down` says of an answer that
/// it has let go, then `new`'s until it holds, each within `within`. Panics if `new` held before
/// the last of `old`'s holder answers had run out (its `validForMs`, counted from before the
/// request, on this process's clock). Returns when `old` was seen to let go.
pub fn hands_over(
    old: &Sidecar,
    new: &Sidecar,
    within: Duration,
    stepped_down: impl Fn(&Reply) -> bool,
) -> Instant {
    let mut last_valid_until = Instant::now();
    eventually(within, "the holder lets go", || {
        let asked = Instant::now();
        let reply = old.get("/lock");
        if reply.status == 200 {
            let valid_for = reply.json()["validForMs"].as_u64().unwrap_or(0);
            last_valid_until = asked + Duration::from_millis(valid_for);
        }
        stepped_down(&reply)
    });
    let let_go = Instant::now();
    eventually(within, "the next holder takes the lock", || new.is_holder());
    let taken = Instant::now();
    assert!(
        taken >= last_valid_until,
        "the next holder held {:?} before the last answer of the one before ran out",
        last_valid_until - taken
    );
    let_go
}

pub fn eventually(within: Duration, what: &str, check: impl FnMut() -> bool) -> Duration {
    eventually_or(within, what, check, String::new)
}

/// [`eventually`], with `context` (the sidecars' logs, say) in the panic message.
pub fn eventually_or(
    within: Duration,
    what: &str,
    mut check: impl FnMut() -> bool,
    context: impl Fn() -> String,
) -> Duration {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < within,
            "not within {within:?}: {what}{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    start.elapsed()
}

/// Of several sidecars, the one that answers 200 now; panics if more than one does.
pub fn sole_holder(sidecars: &[&Sidecar]) -> Option<usize> {
    let holders: Vec<usize> = sidecars
        .iter()
        .enumerate()
        .filter(|(_, s)| s.is_holder())
        .map(|(i, _)| i)
        .collect();
    assert!(
        holders.len() <= 1,
        "two sidecars answer 200 at once: {holders:?}"
    );
    holders.first().copied()
}
