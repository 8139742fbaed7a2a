//! A real single-member `etcd` on free loopback ports (client and peer), with its own throwaway
//! data directory, so that it can be killed and restarted with its data.
//!
//! Elections are tuned for one member on loopback (10 ms heartbeat, 100 ms election timeout),
//! which also brings etcd's minimum lease TTL down to one second, the suite's lease.
//!
//! [`EtcdServer::start_tls`] serves clients over TLS only and asks each for a certificate
//! signed by a CA of its own. Health and metrics are on a plain-HTTP port of their own either way.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use super::server_process::ServerProcess;
use super::{free_port, require_binary};

pub struct EtcdServer {
    process: ServerProcess,
    port: u16,
    peer_port: u16,
    metrics_port: u16,
    tls: bool,
}

pub use super::TlsFiles as EtcdTlsFiles;

impl EtcdServer {
    pub fn start() -> Self {
        Self::start_with(false)
    }

    /// Clients over TLS, each with a certificate from [`EtcdServer::tls_files`].
    pub fn start_tls() -> Self {
        Self::start_with(true)
    }

    fn start_with(tls: bool) -> Self {
        let mut server = Self {
            process: ServerProcess::new("etcd"),
            port: free_port(),
            peer_port: free_port(),
            metrics_port: free_port(),
            tls,
        };
        if tls {
            super::write_test_certificates(server.process.dir());
        }
        server.spawn();
        server
    }

    /// The CA and the client pair, for a TLS server.
    pub fn tls_files(&self) -> EtcdTlsFiles {
        super::TlsFiles::in_dir(self.process.dir())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The backend URL, with the client's certificate for a TLS server.
    pub fn url(&self) -> String {
        if self.tls {
            let files = self.tls_files();
            format!(
                "etcds://127.0.0.1:{}?ca={}&cert={}&key={}",
                self.port,
                files.ca.display(),
                files.client_cert.display(),
                files.client_key.display()
            )
        } else {
            format!("etcd://127.0.0.1:{}", self.port)
        }
    }

    fn spawn(&mut self) {
        let scheme = if self.tls { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let metrics = format!("http://127.0.0.1:{}", self.metrics_port);
        let mut command = Command::new(require_binary("etcd", "etcd-server"));
        if self.tls {
            let dir = self.process.dir();
            command
                .arg("--cert-file")
                .arg(dir.join("server.crt"))
                .arg("--key-file")
                .arg(dir.join("server.key"))
                .arg("--trusted-ca-file")
                .arg(dir.join("ca.crt"))
                .arg("--client-cert-auth");
        }
        command
            .args(["--listen-metrics-urls", &metrics])
            .args(["--name", "leasehold-test"])
            .arg("--data-dir")
            .arg(self.process.dir().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("leasehold-test={peer}")])
            .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
            .args(["--log-level", "warn"]);
        let port = self.metrics_port;
        self.process.spawn(command, move || healthy(port));
    }

    /// `kill -9`: whatever the write-ahead log has survives.
    pub fn kill(&mut self) {
        self.process.stop(None);
    }

    /// Start again on the same ports with the same data directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// gRPC messages the server has received so far, over every service and stream
    /// (`grpc_server_msg_received_total` summed from its metrics).
    pub fn messages_received(&self) -> u64 {
        let metrics = get(self.metrics_port, "/metrics");
        metric_total(&metrics, "grpc_server_msg_received_total", "")
    }

    /// Streams of the gRPC method `method` (`LeaseKeepAlive`, `Watch`) the server has started
    /// and not yet ended (`grpc_server_started_total` less `grpc_server_handled_total`).
    pub fn open_streams(&self, method: &str) -> u64 {
        let metrics = get(self.metrics_port, "/metrics");
        let label = format!("grpc_method=\"{method}\"");
        metric_total(&metrics, "grpc_server_started_total", &label).saturating_sub(metric_total(
            &metrics,
            "grpc_server_handled_total",
            &label,
        ))
    }
}

/// The sum of the series of the metric `name` whose labels contain `label` (every series when
/// it is empty), from a Prometheus text page.
fn metric_total(metrics: &str, name: &str, label: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in `dir`.
/// etcd's own health endpoint: healthy once it has a leader.
fn healthy(port: u16) -> bool {
    get(port, "/health").contains("\"health\":\"true\"")
}

/// A plain HTTP GET on the metrics port; empty when it fails.
fn get(port: u16, path: &str) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    let mut reply = String::new();
    if s.write_all(request.as_bytes()).is_ok() {
        let _ = s.read_to_string(&mut reply);
    }
    reply
}
