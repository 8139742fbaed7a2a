//! A real `redis-server` on a free loopback port, with its own throwaway directory and an
//! append-only file, so that it can be killed and restarted with its data.
//!
//! [`RedisServer::start_tls`] also serves TLS on a port of its own (Debian's build has TLS), with
//! a CA of its own and a client certificate asked of every client; the plain port stays, for
//! the health check and for the "plain-text server behind a TLS URL" case.

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
    /// The TLS port, when serving TLS.
    tls_port: Option<u16>,
    /// The TairString module, loaded for `tair://`.
    module: Option<std::path::PathBuf>,
    /// The port this server replicates from at start (`--replicaof`).
    replica_of: Option<u16>,
    /// A Redis Cluster node: its cluster bus port.
    cluster_port: Option<u16>,
    /// How long the next start spends loading each key of its snapshot (`key-load-delay`).
    load_delay_per_key: Option<Duration>,
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
        Self::unstarted("redis", durable).started()
    }

    /// Durable, with the TairString module loaded; [`RedisServer::url`] is then `tair://`.
    pub fn start_tair() -> Self {
        Self::start_tair_with(true)
    }

    /// With the TairString module; `durable: false` for throughput baselines.
    pub fn start_tair_with(durable: bool) -> Self {
        Self {
            module: Some(super::tairstring::module()),
            ..Self::unstarted("redis", durable)
        }
        .started()
    }

    /// Durable, with the TairString module, and serving TLS too; [`RedisServer::url`] is then
    /// `tairs://` on the TLS port, with the CA and the client's certificate.
    pub fn start_tair_tls() -> Self {
        Self {
            module: Some(super::tairstring::module()),
            ..Self::unstarted("redis", true)
        }
        .serving_tls(None)
        .started()
    }

    /// Durable, and serving TLS too; [`RedisServer::url`] is then the TLS one, with the
    /// client's certificate.
    pub fn start_tls() -> Self {
        Self::unstarted("redis", true).serving_tls(None).started()
    }

    /// Like [`RedisServer::start_tls`], with `other`'s CA and certificates: the masters of a
    /// Redlock over TLS, trusted through one CA.
    pub fn start_tls_like(other: &RedisServer) -> Self {
        Self::unstarted("redis", true)
            .serving_tls(Some(other))
            .started()
    }

    /// A replica of whatever listens on `port` (a master, or a proxy to one), without an
    /// append-only file: it acknowledges what it received without waiting for its disk (on a
    /// loaded machine an fsync alone can outlast a `WAIT`), and a restart syncs it again from its
    /// master.
    pub fn start_replica_of(port: u16) -> Self {
        Self {
            replica_of: Some(port),
            ..Self::unstarted("redis-replica", false)
        }
        .started()
    }

    /// A standby of a Tair master on `port`, with the TairString module, durable
    /// (`appendfsync always`) as a standby that must pass for a durable master once promoted.
    pub fn start_tair_replica_of(port: u16) -> Self {
        Self {
            replica_of: Some(port),
            module: Some(super::tairstring::module()),
            ..Self::unstarted("redis-replica", true)
        }
        .started()
    }

    /// Wait until this replica's link to its master is up (synced).
    pub fn wait_until_synced(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while field(&info(self.port, "replication"), "master_link_status") != Some("up") {
            assert!(
                std::time::Instant::now() < deadline,
                "the replica on {} never synced with its master",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// [`RedisServer::start_replica_of`] a TLS master's TLS port (or a proxy to it), serving
    /// TLS too, with `master`'s certificates: it replicates over TLS (`tls-replication yes`).
    pub fn start_tls_replica_of(port: u16, master: &RedisServer) -> Self {
        Self {
            replica_of: Some(port),
            ..Self::unstarted("redis-replica", false)
        }
        .serving_tls(Some(master))
        .started()
    }

    /// The port clients use: the TLS one when serving TLS.
    pub fn client_port(&self) -> u16 {
        self.tls_port.unwrap_or(self.port)
    }

    /// A durable node of a Redis Cluster, with no slots yet (see
    /// [`super::redis_cluster::RedisCluster`]).
    pub fn start_cluster_node() -> Self {
        Self {
            cluster_port: Some(free_port()),
            ..Self::unstarted("redis-cluster", true)
        }
        .started()
    }

    /// A cluster node that serves clients over TLS and speaks TLS on its cluster bus
    /// (`--tls-cluster yes`): TLS clients are told the nodes' TLS ports, and the plain port
    /// stays for the harness's own commands. The certificates are `like`'s, so that one CA
    /// signs every node, or new ones for the first node.
    pub fn start_tls_cluster_node(like: Option<&RedisServer>) -> Self {
        Self {
            cluster_port: Some(free_port()),
            ..Self::unstarted("redis-cluster", true)
        }
        .serving_tls(like)
        .started()
    }

    /// A plain server on a free port, not yet started: the constructors above set what differs.
    fn unstarted(kind: &'static str, durable: bool) -> Self {
        Self {
            process: ServerProcess::new(kind),
            port: free_port(),
            durable,
            tls_port: None,
            module: None,
            replica_of: None,
            cluster_port: None,
            load_delay_per_key: None,
        }
    }

    /// Serving TLS too, on a port of its own, with `like`'s CA and certificates, or new ones.
    fn serving_tls(mut self, like: Option<&RedisServer>) -> Self {
        self.tls_port = Some(free_port());
        match like {
            Some(other) => other.share_certificates_with(&self),
            None => super::write_test_certificates(self.process.dir()),
        }
        self
    }

    fn started(mut self) -> Self {
        self.spawn();
        self
    }

    /// Copy this server's CA, server and client pairs into `other`'s directory.
    fn share_certificates_with(&self, other: &RedisServer) {
        for file in [
            "ca.crt",
            "server.crt",
            "server.key",
            "client.crt",
            "client.key",
        ] {
            std::fs::copy(
                self.process.dir().join(file),
                other.process.dir().join(file),
            )
            .expect(file);
        }
    }

    /// Wait until the server has been up for `lease`. A server without an append-only file
    /// synced on every write grants a free lock only then: it cannot tell its first start from
    /// a restart that lost the leases its holders still claim (see `drivers/redis/mod.rs`).
    pub fn wait_until_up_for(&self, lease: Duration) {
        // One more: the drivers count the uptime's whole seconds less one (see
        // `drivers::redis::tair::started_at_most_ago_s`).
        let seconds = lease.as_secs_f64().ceil() as u64 + 1;
        while field(&info(self.port, "server"), "uptime_in_seconds")
            .and_then(|up| up.parse::<u64>().ok())
            .is_none_or(|up| up < seconds)
        {
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The plain-text port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A cluster node's cluster bus port.
    pub fn cluster_port(&self) -> Option<u16> {
        self.cluster_port
    }

    /// The TLS port, when serving TLS.
    pub fn tls_port(&self) -> Option<u16> {
        self.tls_port
    }

    /// The CA and the client pair, for a TLS server.
    pub fn tls_files(&self) -> super::TlsFiles {
        super::TlsFiles::in_dir(self.process.dir())
    }

    /// `redis://` on the plain port, or for a TLS server `rediss://` on its TLS port with the
    /// CA and the client's certificate.
    pub fn url(&self) -> String {
        let scheme = if self.module.is_some() {
            "tair"
        } else {
            "redis"
        };
        match self.tls_port {
            None => format!("{scheme}://127.0.0.1:{}", self.port),
            Some(port) => {
                let files = self.tls_files();
                format!(
                    "{scheme}s://127.0.0.1:{port}?ca={}&cert={}&key={}",
                    files.ca.display(),
                    files.client_cert.display(),
                    files.client_key.display()
                )
            }
        }
    }

    /// `redis://` on the plain port.
    pub fn plain_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// A connection on the plain port, for a test's or a benchmark's own commands (counts,
    /// records, ACLs).
    pub async fn admin(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.plain_url())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connect")
    }

    /// How many of the server's clients hold a pattern subscription (`CLIENT LIST`'s `psub`):
    /// a driver's release listener counts once its `PSUBSCRIBE` is made.
    pub async fn pattern_subscribers(&self) -> usize {
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut self.admin().await)
            .await
            .expect("CLIENT LIST");
        clients
            .lines()
            .filter(|client| {
                client
                    .split_whitespace()
                    .any(|field| field.starts_with("psub=") && field != "psub=0")
            })
            .count()
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
            // A replica that (re)connects is synced at once, not after the default 5 s wait for
            // more replicas.
            .args(["--repl-diskless-sync-delay", "0"])
            .args(["--daemonize", "no"]);
        if let Some(master) = self.replica_of {
            command.args(["--replicaof", "127.0.0.1", &master.to_string()]);
        }
        if let Some(bus) = self.cluster_port {
            // The node's view of the cluster lives in its directory, so a restart rejoins.
            command
                .args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-port", &bus.to_string()])
                .args(["--cluster-node-timeout", "2000"]);
        }
        if let Some(module) = &self.module {
            command.arg("--loadmodule").arg(module);
        }
        if let Some(delay) = self.load_delay_per_key.take() {
            // Loading slowly, and answering `LOADING` meanwhile (the server only looks at its
            // clients between chunks of this many bytes of the file).
            command
                .args(["--key-load-delay", &delay.as_micros().to_string()])
                .args(["--loading-process-events-interval-bytes", "1024"]);
        }
        if let Some(tls_port) = self.tls_port {
            let dir = self.process.dir();
            command
                .args(["--tls-port", &tls_port.to_string()])
                .arg("--tls-cert-file")
                .arg(dir.join("server.crt"))
                .arg("--tls-key-file")
                .arg(dir.join("server.key"))
                .arg("--tls-ca-cert-file")
                .arg(dir.join("ca.crt"))
                .args(["--tls-auth-clients", "yes"])
                // Replication, and a cluster's bus, over TLS too; their outgoing links present
                // the client certificate (the server's is for serving only).
                .args(["--tls-replication", "yes"])
                .arg("--tls-client-cert-file")
                .arg(dir.join("client.crt"))
                .arg("--tls-client-key-file")
                .arg(dir.join("client.key"));
            if self.cluster_port.is_some() {
                command.args(["--tls-cluster", "yes"]);
            }
        }
        let port = self.port;
        self.process.spawn(command, move || ping(port));
    }

    /// Follow the server on `master` (`REPLICAOF`), or be promoted (`REPLICAOF NO ONE`), now
    /// and after every restart.
    pub fn replicate_from(&mut self, master: Option<u16>) {
        let mut conn = redis::Client::open(self.plain_url())
            .expect("client")
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("connect");
        let mut command = redis::cmd("REPLICAOF");
        match master {
            Some(port) => command.arg("127.0.0.1").arg(port),
            None => command.arg("NO").arg("ONE"),
        };
        let _: redis::Value = command.query(&mut conn).expect("REPLICAOF");
        self.replica_of = master;
    }

    /// Made durable while it runs (`appendonly yes`, `appendfsync always`), as an operator
    /// turns persistence on, and started so from then on; returns once the append-only file
    /// holds the whole dataset.
    pub fn make_durable(&mut self) {
        self.make_durable_until_restart();
        self.durable = true;
    }

    /// Made durable while it runs by `CONFIG SET` alone, not in its configuration: a restart
    /// brings it back as it was started. Returns once the append-only file holds the whole
    /// dataset.
    pub fn make_durable_until_restart(&mut self) {
        self.append_until_restart("always");
    }

    /// An append-only file synced once a second (`appendfsync everysec`) by `CONFIG SET` while
    /// it runs: a crash may lose the last second's writes, so not durable. Returns once the
    /// file holds the whole dataset.
    pub fn append_every_second_until_restart(&mut self) {
        self.append_until_restart("everysec");
    }

    /// `kill -9`, then start again on the same data directory with durable settings in its
    /// configuration, as an operator restarts a server to turn persistence on: it loads the
    /// append-only file it had, if any.
    pub fn restart_durable(&mut self) {
        self.kill();
        self.durable = true;
        self.spawn();
    }

    fn append_until_restart(&mut self, fsync: &str) {
        let mut conn = redis::Client::open(self.plain_url())
            .expect("client")
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("connect");
        for (name, value) in [("appendfsync", fsync), ("appendonly", "yes")] {
            let _: redis::Value = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query(&mut conn)
                .expect("CONFIG SET");
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let persistence = info(self.port, "persistence");
            if field(&persistence, "aof_enabled") == Some("1")
                && field(&persistence, "aof_rewrite_in_progress") == Some("0")
                && field(&persistence, "aof_rewrite_scheduled") == Some("0")
                && field(&persistence, "aof_last_bgrewrite_status") == Some("ok")
            {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the append-only file was not written within 30 s: {persistence}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
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

    /// `kill -9`, then start again loading the snapshot in the data directory (`SAVE` wrote
    /// it; a server without an append-only file loads it at start) at `per_key` a key, as a
    /// large dataset loads: until it is loaded, every command is answered `LOADING`. Returns
    /// once the server is loaded.
    pub fn restart_loading_slowly(&mut self, per_key: Duration) {
        self.load_delay_per_key = Some(per_key);
        self.restart();
    }
}

/// `INFO section` of the server on `port`, or nothing when it does not answer.
pub fn info(port: u16, section: &str) -> String {
    info_at(&format!("redis://127.0.0.1:{port}"), section)
}

/// `INFO section` of the server at `url`, or nothing when it does not answer.
pub fn info_at(url: &str, section: &str) -> String {
    let Ok(client) = redis::Client::open(url) else {
        return String::new();
    };
    let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(1)) else {
        return String::new();
    };
    if conn.set_read_timeout(Some(Duration::from_secs(2))).is_err() {
        return String::new();
    }
    redis::cmd("INFO")
        .arg(section)
        .query::<String>(&mut conn)
        .unwrap_or_default()
}

/// How many times the server has run `commands` (`INFO commandstats`; commands run inside
/// scripts count too).
pub async fn command_calls(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    commands: &[&str],
) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    info.lines()
        .filter(|l| {
            commands
                .iter()
                .any(|c| l.starts_with(&format!("cmdstat_{c}:")))
        })
        .filter_map(|l| {
            l.split_once("calls=")?
                .1
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

pub use leasehold_lease::redis::info_field as field;

/// One raw `PING`, the protocol's own health check.
pub(super) fn ping(port: u16) -> bool {
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

/// Whether at least `n` clients of `servers` hold a pattern subscription within `bound`. A test
/// waits on the server for the release listeners, not on a waiter's feed: the listener wakes
/// only the feeds that exist when it subscribes, which may be before the test's.
pub async fn until_pattern_subscribers(
    servers: &[&RedisServer],
    n: usize,
    bound: Duration,
) -> bool {
    let start = tokio::time::Instant::now();
    loop {
        let mut subscribers = 0;
        for server in servers {
            subscribers += server.pattern_subscribers().await;
        }
        if subscribers >= n {
            return true;
        }
        if start.elapsed() > bound {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
