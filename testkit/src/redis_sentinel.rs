//! Redis as Sentinel runs it: a master, a replica, and one sentinel (or three, with a quorum of
//! two) watching them, each a real `redis-server` on a free loopback port with its own
//! throwaway directory.
//!
//! The replica reaches the first master through a [`FaultProxy`], so that a test can cut
//! replication and make the master's last writes the ones a failover loses. The sentinel fails
//! over 2.5 seconds after the master stops answering (`down-after-milliseconds 2500`). Its
//! `failover-timeout` is long because that is also how long it waits before it re-points a
//! replica that follows another address than the master's (the proxy's) at the master itself.

use std::process::Command;
use std::time::{Duration, Instant};

use super::fault_proxy::FaultProxy;
use super::redis_server::{RedisServer, field, info};
use super::server_process::ServerProcess;
use super::{free_port, require_binary};

/// The name the sentinel monitors the master under.
pub const MASTER_NAME: &str = "leasehold-test";
/// How long the master may not answer before the sentinel fails over. A second is too tight:
/// a freshly promoted master that answers the sentinel's first pings late (it is busy syncing
/// the old master back in) was taken for down and failed over again, leaving no replica for
/// ten seconds.
const DOWN_AFTER: Duration = Duration::from_millis(2500);
const SET_UP_TIMEOUT: Duration = Duration::from_secs(30);

pub struct RedisSentinelSet {
    /// The data servers: `[0]` starts as the master, `[1]` as its replica.
    pub servers: Vec<RedisServer>,
    /// The replica's link to the first master.
    pub replication_link: FaultProxy,
    /// The sentinels, each with its port; the first one answers the harness's own questions.
    sentinels: Vec<(ServerProcess, u16)>,
    /// Over TLS: the sentinel's TLS port (it asks for a client certificate and a password, and
    /// reaches the servers over TLS too).
    sentinel_tls_port: Option<u16>,
}

/// The TLS sentinel's `requirepass`: the driver sends it as `sentinel-password`.
pub const SENTINEL_PASSWORD: &str = "sentinel-only-secret";

impl RedisSentinelSet {
    /// Start the master, its replica and the sentinel (all durable: a fresh durable master
    /// grants at once); return once the sentinel knows the replica, so that it can fail over.
    pub fn start() -> Self {
        let master = RedisServer::start();
        let replication_link = FaultProxy::start(master.port());
        let replica = RedisServer::start_replica_of(replication_link.port);
        Self::assemble(master, replica, replication_link, None, 1)
    }

    /// The same with three sentinels, any two of which make a quorum and a majority.
    pub fn start_with_three_sentinels() -> Self {
        let master = RedisServer::start();
        let replication_link = FaultProxy::start(master.port());
        let replica = RedisServer::start_replica_of(replication_link.port);
        Self::assemble(master, replica, replication_link, None, 3)
    }

    /// The same, over TLS everywhere: clients, replication, and the sentinel's links to the
    /// servers; the sentinel also asks its clients for a password ([`SENTINEL_PASSWORD`]).
    /// [`RedisSentinelSet::url`] is then `rediss+sentinel://` with the CA, the client's pair and
    /// the sentinel's password.
    pub fn start_tls() -> Self {
        let master = RedisServer::start_tls();
        let replication_link = FaultProxy::start(master.client_port());
        let replica = RedisServer::start_tls_replica_of(replication_link.port, &master);
        Self::assemble(master, replica, replication_link, Some(free_port()), 1)
    }

    fn assemble(
        master: RedisServer,
        replica: RedisServer,
        replication_link: FaultProxy,
        sentinel_tls_port: Option<u16>,
        sentinels: usize,
    ) -> Self {
        let mut set = Self {
            servers: vec![master, replica],
            replication_link,
            sentinels: (0..sentinels)
                .map(|_| (ServerProcess::new("redis-sentinel"), free_port()))
                .collect(),
            sentinel_tls_port,
        };
        set.wait_for("the replica to confirm writes", |s| s.replica_confirms(0));
        for i in 0..sentinels {
            set.spawn_sentinel(i, sentinels / 2 + 1);
        }
        set.wait_for("the sentinel to know the replica", |s| {
            s.sentinel_command(&["SENTINEL", "replicas", MASTER_NAME])
                .is_ok_and(|reply| reply.contains(&s.servers[1].client_port().to_string()))
        });
        set
    }

    fn spawn_sentinel(&mut self, i: usize, quorum: usize) {
        let port = self.sentinels[i].1;
        let mut config = format!(
            "port {port}\n\
             bind 127.0.0.1\n\
             dir {}\n\
             sentinel monitor {MASTER_NAME} 127.0.0.1 {} {quorum}\n\
             sentinel down-after-milliseconds {MASTER_NAME} {}\n\
             sentinel failover-timeout {MASTER_NAME} 120000\n",
            self.sentinels[i].0.dir().display(),
            self.servers[0].client_port(),
            DOWN_AFTER.as_millis(),
        );
        if let Some(tls_port) = self.sentinel_tls_port {
            let files = self.servers[0].tls_files();
            let certificates = files.ca.parent().expect("the certificates' directory");
            config.push_str(&format!(
                "tls-port {tls_port}\n\
                 tls-cert-file {dir}/server.crt\n\
                 tls-key-file {dir}/server.key\n\
                 tls-ca-cert-file {dir}/ca.crt\n\
                 tls-client-cert-file {dir}/client.crt\n\
                 tls-client-key-file {dir}/client.key\n\
                 tls-auth-clients yes\n\
                 tls-replication yes\n\
                 requirepass {SENTINEL_PASSWORD}\n",
                dir = certificates.display(),
            ));
        }
        // Sentinel rewrites its configuration file as it learns, so it lives in the throwaway
        // directory.
        let path = self.sentinels[i].0.dir().join("sentinel.conf");
        std::fs::write(&path, config).expect("sentinel.conf");
        let mut command = Command::new(require_binary("redis-server", "redis-server"));
        command.arg(&path).arg("--sentinel");
        let url = self.sentinel_plain_url_at(port);
        self.sentinels[i]
            .0
            .spawn(command, move || command_at(&url, &["PING"]).is_ok());
    }

    fn wait_for(&self, what: &str, done: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + SET_UP_TIMEOUT;
        while !done(self) {
            assert!(
                Instant::now() < deadline,
                "Redis Sentinel set-up: waited {SET_UP_TIMEOUT:?} for {what}; the first sentinel's log:\n{}",
                self.sentinels[0].0.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis+sentinel://` listing every sentinel; over TLS `rediss+sentinel://` to the
    /// sentinel's TLS port, with the CA, the client's pair and the sentinel's password.
    pub fn url(&self) -> String {
        let Some(tls_port) = self.sentinel_tls_port else {
            return Self::url_of(&self.sentinel_ports());
        };
        let files = self.servers[0].tls_files();
        format!(
            "rediss+sentinel://127.0.0.1:{tls_port}/{MASTER_NAME}?ca={}&cert={}&key={}&sentinel-password={SENTINEL_PASSWORD}",
            files.ca.display(),
            files.client_cert.display(),
            files.client_key.display()
        )
    }

    /// `redis+sentinel://` listing the sentinels on `ports` (for instance proxies to them).
    pub fn url_of(ports: &[u16]) -> String {
        let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        format!("redis+sentinel://{}/{MASTER_NAME}", hosts.join(","))
    }

    /// The first sentinel's port.
    pub fn sentinel_port(&self) -> u16 {
        self.sentinels[0].1
    }

    /// Every sentinel's port.
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|(_, port)| *port).collect()
    }

    /// Which of [`Self::servers`] the sentinel names master now.
    pub fn master(&self) -> Option<usize> {
        let reply = self
            .sentinel_command(&["SENTINEL", "get-master-addr-by-name", MASTER_NAME])
            .ok()?;
        self.servers
            .iter()
            .position(|s| reply.contains(&format!("\"{}\"", s.client_port())))
    }

    /// `kill -9` the master and wait until the sentinel has promoted the other server and that
    /// server says it is master. Returns the new master's index.
    pub fn fail_over(&mut self) -> usize {
        let old = self.master().expect("the sentinel names a master");
        self.servers[old].kill();
        let new = 1 - old;
        self.wait_for("the sentinel to promote the replica", |s| {
            s.master() == Some(new)
                && info(s.servers[new].port(), "replication").contains("role:master")
        });
        new
    }

    /// Restart the master the sentinel named after a failover, as a durable master (its
    /// append-only file written first), on its own data; returns once it serves again. The
    /// sentinel does not notice: it is back well within `down-after-milliseconds`.
    pub fn restart_promoted_as_durable(&mut self) {
        let master = self.master().expect("the sentinel names a master");
        let server = &mut self.servers[master];
        server.replicate_from(None);
        server.make_durable();
        server.restart();
        self.wait_for("the restarted master to serve as master", |s| {
            s.master() == Some(master)
                && info(s.servers[master].port(), "replication").contains("role:master")
        });
    }

    /// A whole failover, as production goes through it: [`Self::fail_over`], then the old
    /// master back on its data and made a replica of the new one (as the sentinel would do a
    /// few seconds later), in sync. Returns the new master's index.
    pub fn fail_over_and_rejoin(&mut self) -> usize {
        let old = self.master().expect("the sentinel names a master");
        let new = self.fail_over();
        self.servers[old].restart();
        let new_port = self.servers[new].client_port().to_string();
        command(
            self.servers[old].port(),
            &["REPLICAOF", "127.0.0.1", &new_port],
        )
        .expect("make the old master a replica");
        self.wait_for("the old master to rejoin as a replica in sync", |s| {
            let replication = info(s.servers[old].port(), "replication");
            field(&replication, "master_port") == Some(new_port.as_str())
                && replication.contains("master_link_status:up")
        });
        let old_port = self.servers[old].client_port().to_string();
        self.wait_for("the sentinel to see the rejoined replica healthy", |s| {
            s.replica_flags(&old_port).as_deref() == Some("slave")
        });
        self.wait_for("the rejoined replica to confirm writes", |s| {
            s.replica_confirms(new)
        });
        new
    }

    /// Whether writes to `master` are streamed to its replica and confirmed (`WAIT 1`). A
    /// replica whose link is up is not yet enough: after a diskless full sync, Redis 7 streams
    /// writes to it only once it has acknowledged the load, and an acknowledgement that reaches
    /// the master before the master has marked the transfer done is not taken as one; the
    /// stream then starts at the replica's next periodic acknowledgement, up to a second
    /// later, and every `WAIT` until then times out. One confirmed write does not show the
    /// stream: a write made before the sync's snapshot is confirmed by the load itself. So two
    /// in a row: the second is made after the first was confirmed, after the load, and reaches
    /// the replica only through the stream.
    fn replica_confirms(&self, master: usize) -> bool {
        let confirmed = || -> redis::RedisResult<bool> {
            let client =
                redis::Client::open(format!("redis://127.0.0.1:{}", self.servers[master].port()))?;
            let mut conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
            for _ in 0..2 {
                redis::cmd("INCR")
                    .arg("leasehold-test:replication-check")
                    .query::<i64>(&mut conn)?;
                let acked: i64 = redis::cmd("WAIT").arg(1).arg(200).query(&mut conn)?;
                if acked < 1 {
                    return Ok(false);
                }
            }
            Ok(true)
        };
        confirmed().unwrap_or(false)
    }

    /// The sentinel's flags for the replica on `port` (`slave` when healthy).
    fn replica_flags(&self, port: &str) -> Option<String> {
        let client = redis::Client::open(self.sentinel_plain_url()).ok()?;
        let mut conn = client
            .get_connection_with_timeout(Duration::from_secs(1))
            .ok()?;
        let replicas: Vec<std::collections::HashMap<String, String>> = redis::cmd("SENTINEL")
            .arg("replicas")
            .arg(MASTER_NAME)
            .query(&mut conn)
            .ok()?;
        replicas
            .into_iter()
            .find(|r| r.get("port").map(String::as_str) == Some(port))
            .and_then(|r| r.get("flags").cloned())
    }

    /// One command to the server the sentinel names master, its reply in Rust's debug form.
    pub fn on_master(&self, args: &[&str]) -> redis::RedisResult<String> {
        let master = self.master().expect("the sentinel names a master");
        command(self.servers[master].port(), args)
    }

    /// One command to the sentinel, its reply in Rust's debug form.
    fn sentinel_command(&self, args: &[&str]) -> redis::RedisResult<String> {
        command_at(&self.sentinel_plain_url(), args)
    }

    /// The first sentinel's plain port, with its password when it asks for one.
    fn sentinel_plain_url(&self) -> String {
        self.sentinel_plain_url_at(self.sentinel_port())
    }

    fn sentinel_plain_url_at(&self, port: u16) -> String {
        match self.sentinel_tls_port {
            Some(_) => format!("redis://:{SENTINEL_PASSWORD}@127.0.0.1:{port}"),
            None => format!("redis://127.0.0.1:{port}"),
        }
    }
}

/// One command to the server on `port`, its reply in Rust's debug form.
fn command(port: u16, args: &[&str]) -> redis::RedisResult<String> {
    command_at(&format!("redis://127.0.0.1:{port}"), args)
}

pub(crate) fn command_at(url: &str, args: &[&str]) -> redis::RedisResult<String> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    let reply: redis::Value = cmd.query(&mut conn)?;
    Ok(format!("{reply:?}"))
}

/// [`RedisSentinelSet::start_tls`], as a server the conformance suite runs on.
pub struct TlsRedisSentinelSet(pub RedisSentinelSet);

impl super::conformance::BackendServer for TlsRedisSentinelSet {
    fn start() -> Self {
        Self(RedisSentinelSet::start_tls())
    }
    fn url(&self) -> String {
        self.0.url()
    }
    fn kill(&mut self) {
        super::conformance::BackendServer::kill(&mut self.0);
    }
    fn restart(&mut self) {
        super::conformance::BackendServer::restart(&mut self.0);
    }
}

impl super::conformance::BackendServer for RedisSentinelSet {
    fn start() -> Self {
        RedisSentinelSet::start()
    }
    fn url(&self) -> String {
        RedisSentinelSet::url(self)
    }
    /// The whole data tier down: no server left to fail over to.
    fn kill(&mut self) {
        for server in &mut self.servers {
            server.kill();
        }
    }
    /// The master first, so that the sentinel sees it back before the replica could be
    /// promoted.
    fn restart(&mut self) {
        for server in &mut self.servers {
            server.restart();
        }
    }
}
