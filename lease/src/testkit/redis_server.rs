//! A real `redis-server` on a free loopback port, with its own throwaway directory and an
//! append-only file, so that it can be killed and restarted with its data.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, require_binary};

const START_TIMEOUT: Duration = Duration::from_secs(15);

pub struct RedisServer {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    durable: bool,
}

impl RedisServer {
    /// Start a server with `appendonly yes` and `appendfsync always`: every acknowledged write,
    /// the token counter included, survives `kill -9`.
    pub fn start() -> Self {
        Self::start_with(true)
    }

    /// `durable: false`: no append-only file, for throughput baselines where fsync would
    /// dominate both sides of the comparison.
    pub fn start_with(durable: bool) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("leasehold-redis-")
            .tempdir()
            .expect("temp dir");
        let mut server = Self {
            port: free_port(),
            dir,
            child: None,
            durable,
        };
        server.spawn();
        server
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    fn spawn(&mut self) {
        let binary = require_binary("redis-server", "redis-server");
        let log = self.dir.path().join("redis.log");
        let child = Command::new(binary)
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(if self.durable {
                ["--appendonly", "yes", "--appendfsync", "always"]
            } else {
                ["--appendonly", "no", "--appendfsync", "no"]
            })
            .args(["--save", ""])
            .args(["--daemonize", "no"])
            .arg("--logfile")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = std::fs::read_to_string(&log).unwrap_or_default();
        panic!(
            "redis-server did not answer on port {} within {START_TIMEOUT:?}; its log:\n{log}",
            self.port
        );
    }

    /// One raw `PING`, the protocol's own health check.
    fn ping(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut buf = [0u8; 16];
        s.write_all(b"PING\r\n").is_ok()
            && s.read(&mut buf)
                .map(|n| buf[..n].starts_with(b"+PONG"))
                .unwrap_or(false)
    }

    /// `kill -9`: no shutdown save, only what the append-only file already has.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start again on the same port with the same data directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
