//! Redis Cluster: the Redis driver's scripts (see [`crate::drivers::redis`]), each routed to the
//! master of its keys' hash slot. A lock's keys (lease, token counter and, here, its epoch
//! record) carry the lock's name as a hash tag, so they share one slot and every script runs on
//! one master. The client follows `MOVED` and `ASK` while a slot migrates, and the new master of
//! a failed-over shard.
//!
//! What a move means for the lock:
//! - A slot migration carries the keys with their TTLs (`MIGRATE`), so a holder keeps its lease
//!   and its renewals go on against the new master.
//! - The epoch record moves with the lock. The new master has another replication ID and is
//!   another keeper ([`crate::drivers::redis::Keeping::DurableClusterNode`]), so on the next
//!   free acquisition it counts as a new epoch: it waits out one lease and raises the lock's
//!   counter above every earlier token, exactly as after a restart. A migration that lost
//!   nothing costs a free lock one lease at most.
//! - A failover of the lock's shard is a promoted replica: as behind Sentinel, it waits out one
//!   lease and raises the tokens, restarted before it served the lock or not.
//!
//! Release notices: a `PUBLISH` reaches every node of a cluster over the cluster bus, so one
//! pattern subscription on any reachable node hears every lock's releases.
//!
//! A connection the cluster falls silent on (a dropped NAT or conntrack entry, a node gone while
//! a Service sends new connections elsewhere) is made anew ([`Replaceable`]): redis-rs's cluster
//! client reconnects to a node when its connection is closed, and retries a command that timed
//! out on the very same connection.

use std::sync::Arc;

use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{RedisFuture, RedisResult, Value};
use tokio::sync::OnceCell;

use crate::drivers::redis::connection::counted;
use crate::drivers::redis::durability::Reading;
use crate::drivers::redis::{
    CONNECT_TIMEOUT, RESPONSE_TIMEOUT, certificates, evicts_lock_keys, info_field, map_err,
};
use crate::drivers::replaceable::{Outgoing, Part, Replaceable, WHOLE};
use crate::error::{Error, Result};
use crate::tls::Tls;

/// A Redis Cluster: `redis+cluster://[user:password@]host[:port][,host[:port]...][?prefix=NAME]`
/// (also spelled `redis-cluster://`), found from any node listed, one `redis://` URL each. A
/// lock's keys share one hash slot; the client follows `MOVED`, `ASK` and failovers.
/// `rediss+cluster://...[?ca=PATH][&cert=PATH&key=PATH]` over TLS to every node, as `rediss://`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisClusterConfig {
    pub nodes: Vec<url::Url>,
    pub prefix: String,
    pub tls: Option<Tls>,
}

/// How many times the client retries a command on `MOVED`, `ASK`, `TRYAGAIN` or a broken
/// connection before the error reaches the engine (which retries at its own pace).
const RETRIES: u32 = 3;

/// The cluster's connection, made on first use.
type LazyConnection = Arc<OnceCell<ClusterConnection>>;

/// The cluster client, and its connection once made: made on first use, so that an unreachable
/// cluster at start-up shows in readiness and answers, not as a start-up failure; and made
/// anew once a node falls silent on it.
pub(crate) struct Cluster {
    client: Arc<ClusterClient>,
    connections: Arc<Replaceable<LazyConnection>>,
}

impl Cluster {
    /// Over TLS (`rediss://` nodes) every node the cluster names is verified against `tls`'s CA
    /// (else the system's roots), with its client certificate when given.
    pub(crate) fn new(nodes: &[url::Url], tls: Option<&Tls>) -> Result<Self> {
        let mut builder = ClusterClientBuilder::new(nodes.iter().map(url::Url::as_str))
            .connection_timeout(CONNECT_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .retries(RETRIES);
        if let Some(tls) = tls {
            builder = builder.certs(certificates(tls)?);
        }
        let client = builder.build().map_err(|e| Error::InvalidUrl {
            url: nodes
                .iter()
                .map(crate::redact::redact_url)
                .collect::<Vec<_>>()
                .join(","),
            reason: e.to_string(),
        })?;
        let connections = Replaceable::new(
            LazyConnection::default(),
            RESPONSE_TIMEOUT,
            "Redis Cluster",
            || Ok(LazyConnection::default()),
        );
        Ok(Self {
            client: Arc::new(client),
            connections: Arc::new(connections),
        })
    }

    /// The connection, made now if it was never made. Once made it reconnects by itself to a
    /// node whose connection closed: it asks the nodes it knows (and else the ones listed) for
    /// the slots again.
    pub(crate) async fn connection(&self) -> Result<ClusterLink> {
        let (generation, lazy) = self.connections.current(WHOLE);
        let conn = made(&self.client, &lazy).await?;
        Ok(ClusterLink {
            client: self.client.clone(),
            connections: self.connections.clone(),
            generation,
            lazy,
            conn,
        })
    }
}

/// `lazy`'s connection, made now if it was never made.
async fn made(client: &ClusterClient, lazy: &LazyConnection) -> Result<ClusterConnection> {
    lazy.get_or_try_init(|| async {
        tokio::time::timeout(CONNECT_TIMEOUT, client.get_async_connection())
            .await
            .map_err(|_| {
                Error::Unreachable(format!(
                    "no Redis Cluster node answered within {CONNECT_TIMEOUT:?}"
                ))
            })?
            .map_err(map_err)
    })
    .await
    .cloned()
}

/// The cluster's connection, whose requests tell [`Cluster`] how they ended: one unanswered
/// replaces the connection. Each lock's requests are a part of their own ([`Part`]): the lock's
/// master falling silent while the others answer shows in its own requests only.
#[derive(Clone)]
pub(crate) struct ClusterLink {
    client: Arc<ClusterClient>,
    connections: Arc<Replaceable<LazyConnection>>,
    generation: u64,
    lazy: LazyConnection,
    /// For what is not one lock's request (every master's settings, keyspace scans).
    pub(crate) conn: ClusterConnection,
}

impl ClusterLink {
    /// Ready for a request to `part`: on a new connection where a request abandoned on that
    /// part went unanswered for the response timeout.
    async fn refresh(&mut self, part: Part) -> RedisResult<()> {
        let (generation, lazy) = self.connections.current(part);
        if generation != self.generation {
            self.conn = made(&self.client, &lazy).await.map_err(|e| {
                redis::RedisError::from((
                    redis::ErrorKind::Io,
                    "no new connection to the Redis Cluster",
                    e.to_string(),
                ))
            })?;
            (self.generation, self.lazy) = (generation, lazy);
        }
        Ok(())
    }

    /// A request to `part` going out on the current connection.
    fn sent(&self, part: Part) -> Outgoing<'_, LazyConnection> {
        self.connections
            .sent_on(self.generation, self.lazy.clone(), part)
    }
}

/// The part of the cluster a request goes to: its first key's hash tag, which for a lock's
/// requests is the lock (`leasehold:{lock}:lease`). A script names its keys after their count
/// (`EVALSHA sha numkeys key...`), other commands first; one that names none, such as the
/// `SCRIPT LOAD` redis-rs sends to every node after a `NOSCRIPT`, is [`WHOLE`].
fn part_of(cmd: &redis::Cmd) -> Part {
    use std::hash::{Hash, Hasher};
    /// Commands whose first argument is a subcommand or a value, never a key.
    const KEYLESS: [&[u8]; 10] = [
        b"SCRIPT",
        b"CONFIG",
        b"CLIENT",
        b"CLUSTER",
        b"INFO",
        b"PING",
        b"FUNCTION",
        b"COMMAND",
        b"WAIT",
        b"ECHO",
    ];
    const SCRIPTS: [&[u8]; 6] = [
        b"EVALSHA",
        b"EVAL",
        b"FCALL",
        b"EVALSHA_RO",
        b"EVAL_RO",
        b"FCALL_RO",
    ];
    let arg = |i: usize| match cmd.args_iter().nth(i) {
        Some(redis::Arg::Simple(arg)) => Some(arg),
        _ => None,
    };
    let is = |name: &[u8], names: &[&[u8]]| names.iter().any(|n| name.eq_ignore_ascii_case(n));
    let key = match arg(0) {
        Some(name) if is(name, &SCRIPTS) => {
            let keys = arg(2).and_then(|n| std::str::from_utf8(n).ok()?.parse::<u32>().ok());
            arg(3).filter(|_| keys.unwrap_or(0) > 0)
        }
        Some(name) if is(name, &KEYLESS) => None,
        Some(_) => arg(1),
        None => None,
    };
    let Some(key) = key else { return WHOLE };
    let tag = hash_tag(key);
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    tag.hash(&mut hasher);
    // Never WHOLE itself: a lock's part is its own.
    hasher.finish().max(1)
}

/// The part of `key` Redis Cluster hashes for its slot: between the first `{` and the next `}`
/// when that is not empty, else the whole key.
fn hash_tag(key: &[u8]) -> &[u8] {
    let Some(open) = key.iter().position(|&b| b == b'{') else {
        return key;
    };
    match key[open + 1..].iter().position(|&b| b == b'}') {
        Some(len) if len > 0 => &key[open + 1..open + 1 + len],
        _ => key,
    }
}

impl redis::aio::ConnectionLike for ClusterLink {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let part = part_of(cmd);
            self.refresh(part).await?;
            let mut conn = self.conn.clone();
            counted(self.sent(part), conn.req_packed_command(cmd)).await
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let part = pipeline.cmd_iter().next().map_or(WHOLE, part_of);
            self.refresh(part).await?;
            let mut conn = self.conn.clone();
            counted(
                self.sent(part),
                conn.req_packed_commands(pipeline, offset, count),
            )
            .await
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

/// `command`'s answer from every master, by address.
async fn from_every_master(
    conn: &mut ClusterConnection,
    command: redis::Cmd,
) -> RedisResult<Vec<(String, Value)>> {
    let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
    Ok(match conn.route_command(command, routing).await? {
        Value::Map(answers) => answers
            .into_iter()
            .map(|(node, answer)| (redis::from_redis_value(node).unwrap_or_default(), answer))
            .collect(),
        single => vec![(String::new(), single)],
    })
}

/// A connection to one node of the cluster, by its address: every command and pipeline goes
/// there, whatever its keys' slots, as a `SCAN` of that node's keyspace needs.
pub(crate) struct OneNode {
    conn: ClusterConnection,
    route: SingleNodeRoutingInfo,
}

impl redis::aio::ConnectionLike for OneNode {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> RedisFuture<'a, Value> {
        let routing = RoutingInfo::SingleNode(self.route.clone());
        Box::pin(self.conn.route_command(cmd.clone(), routing))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(
            self.conn
                .route_pipeline(pipeline.clone(), offset, count, self.route.clone()),
        )
    }

    fn get_db(&self) -> i64 {
        0
    }
}

/// A connection to each master the cluster has now.
pub(crate) async fn every_master(conn: &ClusterConnection) -> Result<Vec<OneNode>> {
    let answers = from_every_master(&mut conn.clone(), redis::cmd("PING"))
        .await
        .map_err(map_err)?;
    answers
        .into_iter()
        .map(|(node, _)| {
            // A cluster of one master answers without naming it.
            let route = if node.is_empty() {
                SingleNodeRoutingInfo::RandomPrimary
            } else {
                let (host, port) = node
                    .rsplit_once(':')
                    .and_then(|(host, port)| Some((host, port.parse().ok()?)))
                    .ok_or_else(|| {
                        Error::Backend(format!("a cluster node named {node:?}, not host:port"))
                    })?;
                SingleNodeRoutingInfo::ByAddress {
                    host: host
                        .trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_owned(),
                    port,
                }
            };
            Ok(OneNode {
                conn: conn.clone(),
                route,
            })
        })
        .collect()
}

fn config_get(name: &str) -> redis::Cmd {
    let mut command = redis::cmd("CONFIG");
    command.arg("GET").arg(name);
    command
}

/// A setting's value on every master (`None` where CONFIG is refused or renamed).
async fn setting_on_every_master(
    conn: &mut ClusterConnection,
    name: &str,
) -> RedisResult<Vec<(String, Option<String>)>> {
    Ok(from_every_master(conn, config_get(name))
        .await?
        .into_iter()
        .map(|(node, answer)| {
            let value = redis::from_redis_value::<Vec<String>>(answer)
                .ok()
                .and_then(|pair| pair.into_iter().nth(1));
            (node, value)
        })
        .collect())
}

/// Which masters lose no acknowledged write in a crash (see
/// [`crate::drivers::redis::Durability`]): the incarnations of those that are durable, each
/// read before its settings. The epoch check takes the master serving a lock's slot for durable
/// only when it is among them, so a master down or not durable when this is read holds up no
/// other master's locks: it waits, at its next change of epoch, as a master that may have lost
/// data does.
pub(crate) async fn durable_masters(conn: &mut ClusterConnection) -> Reading {
    let mut info = redis::cmd("INFO");
    info.arg("replication");
    let incarnations: Vec<(String, String)> = from_every_master(conn, info)
        .await
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(node, answer)| Some((node, redis::from_redis_value::<String>(answer).ok()?)))
        // A node a stale slot map takes for a master may be a replica by now, which tells its
        // master's ID: not one whose settings this reading is of.
        .filter(|(_, info)| info_field(info, "role") == Some("master"))
        .filter_map(|(node, info)| Some((node, info_field(&info, "master_replid")?.to_owned())))
        .collect();
    let (Ok(appendonly), Ok(fsync), Ok(during_rewrites)) = (
        setting_on_every_master(conn, "appendonly").await,
        setting_on_every_master(conn, "appendfsync").await,
        setting_on_every_master(conn, "no-appendfsync-on-rewrite").await,
    ) else {
        return Reading::default();
    };
    let setting = |of: &[(String, Option<String>)], node: &str| {
        of.iter()
            .find(|(answered, _)| answered == node)
            .and_then(|(_, value)| value.clone())
    };
    let durable: Vec<&str> = incarnations
        .iter()
        .filter(|(node, _)| {
            crate::drivers::redis::durability::durable_settings(
                setting(&appendonly, node).as_deref(),
                setting(&fsync, node).as_deref(),
                setting(&during_rewrites, node).as_deref(),
            )
        })
        .map(|(_, replid)| replid.as_str())
        .collect();
    Reading {
        durable: !durable.is_empty(),
        on: durable.join(","),
    }
}

/// The single driver's warnings (eviction, `INFO` refused), asked of every master and naming
/// the ones they concern.
pub(crate) async fn warnings(conn: &mut ClusterConnection) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let mut policies = setting_on_every_master(conn, "maxmemory-policy")
        .await
        .map_err(map_err)?;
    // A master that refuses CONFIG (managed Redis) tells its policy in `INFO memory`.
    if policies.iter().any(|(_, policy)| policy.is_none()) {
        let mut info = redis::cmd("INFO");
        info.arg("memory");
        let answers = from_every_master(conn, info).await.map_err(map_err)?;
        for (node, policy) in policies.iter_mut().filter(|(_, p)| p.is_none()) {
            *policy = answers
                .iter()
                .find(|(answered, _)| answered == node)
                .and_then(|(_, answer)| redis::from_redis_value::<String>(answer.clone()).ok())
                .and_then(|info| info_field(&info, "maxmemory_policy").map(str::to_owned));
        }
    }
    for (node, policy) in policies {
        if let Some(policy) = policy.filter(|p| evicts_lock_keys(p)) {
            warnings.push(format!(
                "master {node}: maxmemory-policy is {policy}: Redis may evict lock keys under memory \
                 pressure; use noeviction (a volatile-* policy evicts leases, which expire)"
            ));
        }
    }
    let mut info = redis::cmd("INFO");
    info.arg("replication");
    let answers = from_every_master(conn, info).await.map_err(map_err)?;
    for (node, answer) in answers {
        if let Value::ServerError(e) = answer {
            warnings.push(format!(
                "master {node}: INFO is refused ({}): a restart or failover that loses a held \
                 lease goes unnoticed, and another pod may then take the lock while its holder \
                 still claims it; let the lock's Redis user run INFO",
                e.details().unwrap_or_default()
            ));
        }
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hash_tag_is_what_redis_hashes() {
        assert_eq!(hash_tag(b"leasehold:{jobs}:lease"), b"jobs");
        assert_eq!(
            hash_tag(b"{}:lease"),
            b"{}:lease",
            "an empty tag hashes the whole key"
        );
        assert_eq!(hash_tag(b"plain"), b"plain");
        assert_eq!(hash_tag(b"a{b"), b"a{b");
    }

    #[test]
    fn a_locks_requests_are_one_part_and_another_locks_another() {
        let script = |key: &str| {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg("0123abcd")
                .arg(2)
                .arg(key)
                .arg(format!("{key}:token"))
                .arg("holder");
            cmd
        };
        let lease = part_of(&script("leasehold:{jobs}:lease"));
        let mut get = redis::cmd("GET");
        get.arg("leasehold:{jobs}:token");
        assert_eq!(part_of(&get), lease, "the lock's keys share its part");
        assert_ne!(part_of(&script("leasehold:{other}:lease")), lease);
        assert_ne!(lease, WHOLE);
        let mut none = redis::cmd("EVALSHA");
        none.arg("0123abcd").arg(0).arg("holder");
        assert_eq!(part_of(&none), WHOLE, "a script with no keys");
        assert_eq!(part_of(&redis::cmd("PING")), WHOLE);
        let mut load = redis::cmd("script");
        load.arg("LOAD").arg("return 1");
        assert_eq!(part_of(&load), WHOLE, "a subcommand is not a key");
        let mut read_only = redis::cmd("EVALSHA_RO");
        read_only
            .arg("0123abcd")
            .arg(1)
            .arg("leasehold:{jobs}:lease");
        assert_eq!(part_of(&read_only), lease);
    }
}
