//! A real `redis-server` on a free loopback port, with its own throwaway directory and an
//! append-only file, so that it can be killed and restarted with its data.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use super::server_process::ServerProcess;
use super::{free_port, require_binary};

pub struct RedisServer {
    process: ServerProcess,
    port: u16,
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
        let mut server = Self {
            process: ServerProcess::new("redis"),
            port: free_port(),
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

    fn spawn(&mut self) {
        let mut command = Command::new(require_binary("redis-server", "redis-server"));
        command
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(self.process.dir())
            .args(if self.durable {
                ["--appendonly", "yes", "--appendfsync", "always"]
            } else {
                ["--appendonly", "no", "--appendfsync", "no"]
            })
            .args(["--save", ""])
            .args(["--daemonize", "no"]);
        let port = self.port;
        self.process.spawn(command, move || ping(port));
    }

    /// `kill -9`: no shutdown save, only what the append-only file already has.
    pub fn kill(&mut self) {
        self.process.stop(None);
    }

    /// Start again on the same port with the same data directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

/// One raw `PING`, the protocol's own health check.
fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 16];
    s.write_all(b"PING\r\n").is_ok()
        && s.read(&mut buf)
            .map(|n| buf[..n].starts_with(b"+PONG"))
            .unwrap_or(false)
}
