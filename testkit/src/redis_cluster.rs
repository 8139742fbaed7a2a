//! A Redis Cluster of three durable masters, each a real `redis-server --cluster-enabled yes` on
//! a free loopback port (and a free cluster bus port) with its own throwaway directory. The
//! slots are split in three ranges, as `redis-cli --cluster create` splits them; a test moves
//! a lock's slot from one master to another with the commands `redis-cli --cluster reshard`
//! sends (`SETSLOT IMPORTING`/`MIGRATING`, `MIGRATE`, `SETSLOT NODE`).

use std::time::{Duration, Instant};

use super::redis_server::RedisServer;

const SET_UP_TIMEOUT: Duration = Duration::from_secs(30);
const SLOTS: u16 = 16384;
/// Redis abandons a manual failover after 5 s; one not done by then is asked for again.
const MANUAL_FAILOVER_RETRY: Duration = Duration::from_secs(6);

pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

/// [`RedisCluster::start_tls`], as a server the conformance suite runs on.
pub struct TlsRedisCluster(pub RedisCluster);

impl super::BackendServer for TlsRedisCluster {
    fn start() -> Self {
        Self(RedisCluster::start_tls())
    }
    fn url(&self) -> String {
        self.0.url()
    }
    fn kill(&mut self) {
        self.0.kill();
    }
    fn restart(&mut self) {
        self.0.restart();
    }
}

impl RedisCluster {
    /// Three masters, each with a third of the slots; returns once every node sees all of them.
    pub fn start() -> Self {
        Self::assemble((0..3).map(|_| RedisServer::start_cluster_node()).collect())
    }

    /// Three masters that serve clients over TLS only to those with a client certificate, and
    /// speak TLS among themselves; [`RedisCluster::url`] is then `rediss+cluster://` with the
    /// CA and the client's pair.
    pub fn start_tls() -> Self {
        let first = RedisServer::start_tls_cluster_node(None);
        let mut nodes: Vec<RedisServer> = (0..2)
            .map(|_| RedisServer::start_tls_cluster_node(Some(&first)))
            .collect();
        nodes.insert(0, first);
        Self::assemble(nodes)
    }

    /// Three masters and a replica of each (`CLUSTER REPLICATE`), so that a shard can fail
    /// over; returns once every node sees all six and each replica is in sync.
    pub fn start_with_replicas() -> Self {
        let mut cluster = Self::start();
        let masters: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| command(n.port(), &["CLUSTER", "MYID"]).expect("myid"))
            .collect();
        for master in masters {
            let replica = RedisServer::start_cluster_node();
            let bus = replica.cluster_port().expect("a cluster node");
            command(
                cluster.nodes[0].port(),
                &[
                    "CLUSTER",
                    "MEET",
                    "127.0.0.1",
                    &replica.port().to_string(),
                    &bus.to_string(),
                ],
            )
            .expect("meet");
            // A node can be made a replica only once it knows its master.
            wait_until(
                || command(replica.port(), &["CLUSTER", "REPLICATE", &master]).is_ok(),
                || format!("the new node never learnt of master {master}"),
            );
            cluster.nodes.push(replica);
        }
        cluster.wait_until_ok();
        wait_until(
            || cluster.replicas_in_sync(),
            || format!("the replicas did not sync within {SET_UP_TIMEOUT:?}"),
        );
        cluster
    }

    /// Whether every replica's link to its master is up.
    fn replicas_in_sync(&self) -> bool {
        self.nodes.iter().all(|n| {
            let replication = super::redis_server::info(n.port(), "replication");
            replication.contains("role:master") || replication.contains("master_link_status:up")
        })
    }

    /// The indices of the nodes that are masters now, each by its own account (`INFO`): right
    /// after a failover another node's view may still call the old master one.
    pub fn masters(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                super::redis_server::info(self.nodes[i].port(), "replication")
                    .contains("role:master")
            })
            .collect()
    }

    /// The node whose `ip:port@bus` address a `CLUSTER NODES` line shows.
    fn index_of(&self, address: &str) -> Option<usize> {
        let port: u16 = address.split(['@', ':']).nth(1)?.parse().ok()?;
        self.nodes.iter().position(|n| n.port() == port)
    }

    /// A manual failover of `slot`'s shard (`CLUSTER FAILOVER` on its replica: the replica
    /// catches up with its master first, then takes over), as an operator runs before
    /// maintenance of a master; returns once every node routes the slot to the promoted replica
    /// and the old master follows it.
    pub fn fail_over_shard(&self, slot: u16) {
        // A replica that is not in sync (a restart a moment ago) would not be promoted.
        wait_until(
            || self.replicas_in_sync(),
            || "the replicas are not in sync".into(),
        );
        let master = self.owner_of(slot);
        let master_id = command(self.nodes[master].port(), &["CLUSTER", "MYID"]).expect("myid");
        let replica = self
            .nodes
            .iter()
            .position(|n| {
                super::redis_server::info(n.port(), "replication").contains("role:slave")
                    && command(n.port(), &["CLUSTER", "NODES"]).is_ok_and(|nodes| {
                        nodes
                            .lines()
                            .any(|line| line.contains("myself") && line.contains(&master_id))
                    })
            })
            .expect("a replica of the slot's master");
        // A manual failover that does not complete in Redis's own 5 s (the master and the
        // replica must agree on the replication offset) is abandoned by Redis: ask again.
        let mut asked = None::<Instant>;
        wait_until(
            || {
                if self.owner_of(slot) == replica {
                    return true;
                }
                if asked.is_none_or(|at| at.elapsed() > MANUAL_FAILOVER_RETRY) {
                    let _ = command(self.nodes[replica].port(), &["CLUSTER", "FAILOVER"]);
                    asked = Some(Instant::now());
                }
                false
            },
            || {
                format!(
                    "node {replica} did not take slot {slot}'s shard over from node {master}; the cluster:\n{}\nthe replica:\n{}",
                    command(self.nodes[0].port(), &["CLUSTER", "NODES"]).unwrap_or_default(),
                    super::redis_server::info(self.nodes[replica].port(), "replication")
                )
            },
        );
        wait_until(
            || self.replicas_in_sync(),
            || {
                format!(
                    "the old master of slot {slot} did not follow its replica: {}",
                    super::redis_server::info(self.nodes[master].port(), "replication")
                )
            },
        );
    }

    fn assemble(nodes: Vec<RedisServer>) -> Self {
        let cluster = Self { nodes };
        let third = SLOTS / 3;
        let ranges = [
            (0, third),
            (third + 1, 2 * third + 1),
            (2 * third + 2, SLOTS - 1),
        ];
        for (node, (from, to)) in cluster.nodes.iter().zip(ranges) {
            command(
                node.port(),
                &[
                    "CLUSTER",
                    "ADDSLOTSRANGE",
                    &from.to_string(),
                    &to.to_string(),
                ],
            )
            .expect("assign slots");
        }
        let first = cluster.nodes[0].port();
        for node in &cluster.nodes[1..] {
            let bus = node.cluster_port().expect("a cluster node");
            command(
                first,
                &[
                    "CLUSTER",
                    "MEET",
                    "127.0.0.1",
                    &node.port().to_string(),
                    &bus.to_string(),
                ],
            )
            .expect("meet");
        }
        cluster.wait_until_ok();
        cluster
    }

    /// `redis+cluster://` naming every node, or over TLS `rediss+cluster://` naming their TLS
    /// ports, with the CA and the client's certificate.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.client_port()))
            .collect();
        if self.nodes[0].tls_port().is_none() {
            return format!("redis+cluster://{}", hosts.join(","));
        }
        let files = self.nodes[0].tls_files();
        format!(
            "rediss+cluster://{}?ca={}&cert={}&key={}",
            hosts.join(","),
            files.ca.display(),
            files.client_cert.display(),
            files.client_key.display()
        )
    }

    /// `kill -9` every node: the cluster is down.
    pub fn kill(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
    }

    /// Every node again, on its data and its `nodes.conf`; returns once the cluster serves.
    pub fn restart(&mut self) {
        for node in &mut self.nodes {
            node.restart();
        }
        self.wait_until_ok();
    }

    /// `kill -9` one node and start it again on its data and its `nodes.conf`; returns once
    /// the cluster serves.
    pub fn restart_node(&mut self, node: usize) {
        self.nodes[node].restart();
        self.wait_until_ok();
    }

    fn wait_until_ok(&self) {
        let ok = |port: u16| {
            command(port, &["CLUSTER", "INFO"]).is_ok_and(|info| {
                info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_slots_assigned:{SLOTS}"))
                    && info.contains(&format!("cluster_known_nodes:{}", self.nodes.len()))
            })
        };
        wait_until(
            || self.nodes.iter().all(|n| ok(n.port())),
            || {
                format!(
                    "the Redis Cluster did not come up within {SET_UP_TIMEOUT:?}: {:?}",
                    command(self.nodes[0].port(), &["CLUSTER", "INFO"])
                )
            },
        );
    }

    /// The hash slot of `key`.
    pub fn slot_of(&self, key: &str) -> u16 {
        command(self.nodes[0].port(), &["CLUSTER", "KEYSLOT", key])
            .expect("keyslot")
            .parse()
            .expect("a slot number")
    }

    /// The slots that hold a lock's keys (a key with a hash tag), on any master, lowest first.
    pub fn lock_slots(&self) -> Vec<u16> {
        let mut slots: Vec<u16> = self
            .nodes
            .iter()
            .flat_map(|node| {
                redis::cmd("KEYS")
                    .arg("*{*}*")
                    .query::<Vec<String>>(&mut connection(node.port()).expect("connect"))
                    .expect("keys")
            })
            .map(|key| self.slot_of(&key))
            .collect();
        slots.sort_unstable();
        slots.dedup();
        slots
    }

    /// The index of the node that serves `slot` now, as the first node sees it. While a
    /// failover is under way the first node can see the shard's master and replica both as
    /// replicas, and nobody serving the slot, for a moment: that is waited out.
    pub fn owner_of(&self, slot: u16) -> usize {
        let mut owner = None;
        wait_until(
            || {
                owner = self.serving(slot);
                owner.is_some()
            },
            || {
                format!(
                    "no node serves slot {slot}:\n{}",
                    command(self.nodes[0].port(), &["CLUSTER", "NODES"]).unwrap_or_default()
                )
            },
        );
        owner.expect("a node serves the slot")
    }

    fn serving(&self, slot: u16) -> Option<usize> {
        let nodes = command(self.nodes[0].port(), &["CLUSTER", "NODES"]).expect("cluster nodes");
        nodes.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let address = fields.get(1)?;
            let serves = fields.iter().skip(8).any(|range| {
                let (from, to) = range.split_once('-').unwrap_or((range, range));
                matches!((from.parse::<u16>(), to.parse::<u16>()), (Ok(f), Ok(t)) if (f..=t).contains(&slot))
            });
            serves.then(|| self.index_of(address).expect("a node of this cluster"))
        })
    }

    /// Move `slot`, with its keys, to node `to`, as `redis-cli --cluster reshard` does; returns
    /// once every node routes it there.
    pub fn migrate_slot(&self, slot: u16, to: usize) {
        let from = self.owner_of(slot);
        assert_ne!(from, to, "slot {slot} is already on node {to}");
        let (source, target) = (self.nodes[from].port(), self.nodes[to].port());
        let id = |port: u16| command(port, &["CLUSTER", "MYID"]).expect("myid");
        let (source_id, target_id) = (id(source), id(target));
        let slot_text = slot.to_string();
        command(
            target,
            &["CLUSTER", "SETSLOT", &slot_text, "IMPORTING", &source_id],
        )
        .expect("importing");
        command(
            source,
            &["CLUSTER", "SETSLOT", &slot_text, "MIGRATING", &target_id],
        )
        .expect("migrating");
        loop {
            let keys = keys_in_slot(source, slot);
            if keys.is_empty() {
                break;
            }
            let mut migrate = redis::cmd("MIGRATE");
            migrate
                .arg("127.0.0.1")
                .arg(target)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys);
            let _: redis::Value = migrate
                .query(&mut connection(source).expect("connect"))
                .expect("migrate");
        }
        // Only masters take `SETSLOT`; replicas learn from their masters.
        let masters = self.masters();
        for port in std::iter::once(target)
            .chain(std::iter::once(source))
            .chain(masters.iter().map(|&m| self.nodes[m].port()))
        {
            command(
                port,
                &["CLUSTER", "SETSLOT", &slot_text, "NODE", &target_id],
            )
            .expect("setslot node");
        }
        wait_until(
            || self.owner_of(slot) == to,
            || format!("slot {slot} did not move"),
        );
    }
}

/// Poll `done` until it holds; past [`SET_UP_TIMEOUT`], fail with what `failure` says then.
fn wait_until(mut done: impl FnMut() -> bool, failure: impl Fn() -> String) {
    let began = Instant::now();
    while !done() {
        assert!(began.elapsed() < SET_UP_TIMEOUT, "{}", failure());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn connection(port: u16) -> redis::RedisResult<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))?
        .get_connection_with_timeout(Duration::from_secs(2))
}

/// One command on one node, its answer as text (simple and bulk strings, numbers).
pub fn command(port: u16, args: &[&str]) -> redis::RedisResult<String> {
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    let value: redis::Value = cmd.query(&mut connection(port)?)?;
    Ok(match value {
        redis::Value::Int(n) => n.to_string(),
        other => redis::from_redis_value(other)?,
    })
}

fn keys_in_slot(port: u16, slot: u16) -> Vec<String> {
    redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(100)
        .query(&mut connection(port).expect("connect"))
        .expect("getkeysinslot")
}
