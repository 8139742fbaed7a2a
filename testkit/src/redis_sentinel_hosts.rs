//! Redis Sentinel spread over test hosts ([`TestNetwork`]): four data servers (a master and
//! three replicas) and three sentinels (quorum two), each on a host of its own, plus hosts for
//! the sidecars. The sentinels hand out the servers' own addresses, which every host reaches,
//! so a partition can split the set the way a real network does: the master with one replica,
//! one sentinel and some clients on one side, the rest on the other. The majority's sentinels
//! then promote a replica that the other remaining replica follows, so both sides have a master
//! that `WAIT 1` confirms writes on: what a client trusting one sentinel holds on twice.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::redis_sentinel::{MASTER_NAME, command_at as query};
use super::redis_server::{field, info_at};
use super::require_binary;
use super::server_process::ServerProcess;
use super::test_network::TestNetwork;

const SERVERS: usize = 4;
const SENTINELS: usize = 3;
const REDIS_PORT: u16 = 6379;
const SENTINEL_PORT: u16 = 26379;
/// As in [`super::RedisSentinelSet`]: shorter made a freshly promoted master look down.
const DOWN_AFTER: Duration = Duration::from_millis(2500);
/// Also how soon a sentinel may try a failover of the same master again (twice this).
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(6);
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

pub struct RedisSentinelHosts {
    servers: Vec<ServerProcess>,
    sentinels: Vec<ServerProcess>,
    /// Declared last: the namespaces outlive the processes on them.
    network: Arc<TestNetwork>,
}

fn server_host(i: usize) -> String {
    format!("redis-{i}")
}

fn sentinel_host(i: usize) -> String {
    format!("sentinel-{i}")
}

impl RedisSentinelHosts {
    /// The set, settled (every sentinel names server 0, whose replicas all confirm writes), on
    /// a network that also has a host for each of `clients`.
    pub fn start(clients: &[String]) -> Self {
        let names: Vec<String> = (0..SERVERS)
            .map(server_host)
            .chain((0..SENTINELS).map(sentinel_host))
            .chain(clients.iter().cloned())
            .collect();
        let network = Arc::new(TestNetwork::start(&names));
        let mut set = Self {
            servers: (0..SERVERS).map(|_| ServerProcess::new("redis")).collect(),
            sentinels: (0..SENTINELS)
                .map(|_| ServerProcess::new("redis-sentinel"))
                .collect(),
            network,
        };
        for i in 0..SERVERS {
            set.spawn_server(i);
        }
        for i in 0..SENTINELS {
            set.spawn_sentinel(i);
        }
        set.settle();
        set
    }

    pub fn network(&self) -> &Arc<TestNetwork> {
        &self.network
    }

    fn server_ip(&self, i: usize) -> String {
        self.network.ip(&server_host(i)).to_string()
    }

    fn spawn_server(&mut self, i: usize) {
        let host = server_host(i);
        let ip = self.server_ip(i);
        let mut command = self
            .network
            .command(&host, require_binary("redis-server", "redis-server"));
        command
            .args(["--port", &REDIS_PORT.to_string(), "--bind", &ip])
            // Bound to a host's address with no password: every client is on the test network.
            .args(["--protected-mode", "no"])
            .arg("--dir")
            .arg(self.servers[i].dir())
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .args(["--save", ""])
            .args(["--repl-diskless-sync-delay", "0", "--daemonize", "no"]);
        if i > 0 {
            command.args(["--replicaof", &self.server_ip(0), &REDIS_PORT.to_string()]);
        }
        let url = format!("redis://{ip}:{REDIS_PORT}");
        self.servers[i].spawn(command, move || query(&url, &["PING"]).is_ok());
    }

    fn spawn_sentinel(&mut self, i: usize) {
        let ip = self.network.ip(&sentinel_host(i)).to_string();
        let config = format!(
            "port {SENTINEL_PORT}\n\
             bind {ip}\n\
             protected-mode no\n\
             dir {}\n\
             sentinel monitor {MASTER_NAME} {} {REDIS_PORT} 2\n\
             sentinel down-after-milliseconds {MASTER_NAME} {}\n\
             sentinel failover-timeout {MASTER_NAME} {}\n\
             sentinel parallel-syncs {MASTER_NAME} {}\n",
            self.sentinels[i].dir().display(),
            self.server_ip(0),
            DOWN_AFTER.as_millis(),
            FAILOVER_TIMEOUT.as_millis(),
            SERVERS - 1,
        );
        // Sentinel rewrites its configuration file as it learns.
        let path = self.sentinels[i].dir().join("sentinel.conf");
        std::fs::write(&path, config).expect("sentinel.conf");
        let mut command = self.network.command(
            &sentinel_host(i),
            require_binary("redis-server", "redis-server"),
        );
        command.arg(&path).arg("--sentinel");
        let url = format!("redis://{ip}:{SENTINEL_PORT}");
        self.sentinels[i].spawn(command, move || query(&url, &["PING"]).is_ok());
    }

    /// `redis+sentinel://` listing every sentinel.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = (0..SENTINELS)
            .map(|i| format!("{}:{SENTINEL_PORT}", self.network.ip(&sentinel_host(i))))
            .collect();
        format!("redis+sentinel://{}/{MASTER_NAME}", hosts.join(","))
    }

    /// The server each sentinel names master (`None` for one that does not answer).
    fn namings(&self) -> Vec<Option<usize>> {
        (0..SENTINELS)
            .map(|i| {
                let ip = self.network.ip(&sentinel_host(i));
                let reply = query(
                    &format!("redis://{ip}:{SENTINEL_PORT}"),
                    &["SENTINEL", "get-master-addr-by-name", MASTER_NAME],
                )
                .ok()?;
                (0..SERVERS).find(|&s| reply.contains(&format!("\"{}\"", self.server_ip(s))))
            })
            .collect()
    }

    /// The server every sentinel names master, when they agree.
    pub fn master(&self) -> Option<usize> {
        let namings = self.namings();
        let first = namings[0]?;
        namings.iter().all(|n| *n == Some(first)).then_some(first)
    }

    /// Split the set: the master, the replica after it and one sentinel, with the hosts in
    /// `with_master`, cut off from every other host of the network, for `length`; then healed
    /// and settled again. A failover on the far side takes [`DOWN_AFTER`] and about a second
    /// more, so a shorter split tests the side without a master, a longer one both masters.
    pub fn split(&self, with_master: &[&str], length: Duration) {
        let master = self.master().unwrap_or(0);
        let (replica, sentinel) = (
            server_host((master + 1) % SERVERS),
            sentinel_host(master % 3),
        );
        let master_host = server_host(master);
        let mut minority: Vec<&str> = vec![&master_host, &replica, &sentinel];
        minority.extend_from_slice(with_master);
        let majority: Vec<&str> = self
            .network
            .hosts()
            .filter(|h| !minority.contains(h))
            .collect();
        self.network.cut(&minority, &majority);
        std::thread::sleep(length);
        self.network.heal();
        self.settle();
    }

    /// Cut `host` off from every server and sentinel for `length`, then heal.
    pub fn isolate(&self, host: &str, length: Duration) {
        let set: Vec<String> = (0..SERVERS)
            .map(server_host)
            .chain((0..SENTINELS).map(sentinel_host))
            .collect();
        let set: Vec<&str> = set.iter().map(String::as_str).collect();
        self.network.cut(&[host], &set);
        std::thread::sleep(length);
        self.network.heal();
    }

    /// Wait until every sentinel names one master and every other server replicates from it
    /// and confirms writes. A server left behind (a master of the minority, a replica still
    /// following it) is made to follow the named master, as the sentinels would a few seconds
    /// later; only once they agree and none is failing over, so that no failover in progress
    /// is overruled.
    pub fn settle(&self) {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            if let Some(master) = self.master().filter(|_| !self.failing_over()) {
                let master_ip = self.server_ip(master);
                let mut in_sync = 0;
                for s in (0..SERVERS).filter(|&s| s != master) {
                    let replication = self.info(s, "replication");
                    let follows = field(&replication, "master_host") == Some(master_ip.as_str())
                        && replication.contains("role:slave");
                    if !follows && !replication.is_empty() {
                        let _ =
                            self.on_server(s, &["REPLICAOF", &master_ip, &REDIS_PORT.to_string()]);
                    } else if replication.contains("master_link_status:up") {
                        in_sync += 1;
                    }
                }
                if in_sync == SERVERS - 1 && self.confirms(master) && self.sentinels_see_all() {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the Sentinel set did not settle within {SETTLE_TIMEOUT:?}: sentinels name {:?}; \
                 the logs:\n{}",
                self.namings(),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A connection to sentinel `i`, with the fixtures' timeouts.
    fn sentinel(&self, i: usize) -> redis::RedisResult<redis::Connection> {
        let ip = self.network.ip(&sentinel_host(i));
        let client = redis::Client::open(format!("redis://{ip}:{SENTINEL_PORT}"))?;
        let conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
        conn.set_read_timeout(Some(Duration::from_secs(2)))?;
        Ok(conn)
    }

    /// Whether any sentinel is in the middle of a failover (or cannot say).
    fn failing_over(&self) -> bool {
        (0..SENTINELS).any(|i| {
            let flags = || -> redis::RedisResult<String> {
                let mut conn = self.sentinel(i)?;
                let master: std::collections::HashMap<String, String> = redis::cmd("SENTINEL")
                    .arg("master")
                    .arg(MASTER_NAME)
                    .query(&mut conn)?;
                Ok(master.get("flags").cloned().unwrap_or_default())
            };
            flags().map_or(true, |f| f.contains("failover"))
        })
    }

    /// Whether every sentinel sees every replica healthy and knows the other sentinels: what
    /// it takes to fail over at the next split.
    fn sentinels_see_all(&self) -> bool {
        (0..SENTINELS).all(|i| {
            let view = || -> redis::RedisResult<bool> {
                let mut conn = self.sentinel(i)?;
                type Entries = Vec<std::collections::HashMap<String, String>>;
                let replicas: Entries = redis::cmd("SENTINEL")
                    .arg("replicas")
                    .arg(MASTER_NAME)
                    .query(&mut conn)?;
                let sentinels: Entries = redis::cmd("SENTINEL")
                    .arg("sentinels")
                    .arg(MASTER_NAME)
                    .query(&mut conn)?;
                let healthy = |e: &std::collections::HashMap<String, String>, flags: &str| {
                    e.get("flags").map(String::as_str) == Some(flags)
                };
                Ok(
                    replicas.iter().filter(|r| healthy(r, "slave")).count() == SERVERS - 1
                        && sentinels.iter().filter(|s| healthy(s, "sentinel")).count()
                            == SENTINELS - 1,
                )
            };
            view().unwrap_or(false)
        })
    }

    /// Whether writes to `master` are streamed to all its replicas and confirmed (`WAIT`): two
    /// writes in a row, since the first may be confirmed by a full sync's snapshot before the
    /// stream has started (see `RedisSentinelSet`'s check of the same).
    fn confirms(&self, master: usize) -> bool {
        let confirmed = || -> redis::RedisResult<bool> {
            let client = redis::Client::open(self.server_url(master))?;
            let mut conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
            for _ in 0..2 {
                redis::cmd("INCR")
                    .arg("leasehold-test:replication-check")
                    .query::<i64>(&mut conn)?;
                let acked: i64 = redis::cmd("WAIT")
                    .arg(SERVERS - 1)
                    .arg(500)
                    .query(&mut conn)?;
                if acked < (SERVERS - 1) as i64 {
                    return Ok(false);
                }
            }
            Ok(true)
        };
        confirmed().unwrap_or(false)
    }

    fn server_url(&self, i: usize) -> String {
        format!("redis://{}:{REDIS_PORT}", self.server_ip(i))
    }

    fn info(&self, i: usize, section: &str) -> String {
        info_at(&self.server_url(i), section)
    }

    /// One command to server `i`, its reply in Rust's debug form.
    pub fn on_server(&self, i: usize, args: &[&str]) -> redis::RedisResult<String> {
        query(&self.server_url(i), args)
    }

    /// The logs of every server and sentinel, for a failure's message.
    pub fn logs(&self) -> String {
        let servers = self
            .servers
            .iter()
            .enumerate()
            .map(|(i, s)| (server_host(i), s));
        let sentinels = self
            .sentinels
            .iter()
            .enumerate()
            .map(|(i, s)| (sentinel_host(i), s));
        servers
            .chain(sentinels)
            .map(|(host, s)| format!("--- {host}\n{}", s.log()))
            .collect()
    }
}
