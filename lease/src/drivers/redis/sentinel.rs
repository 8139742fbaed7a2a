//! Redis behind Sentinel: the lease, token and scripts of [`crate::drivers::redis`], on whichever
//! server the sentinels name master, followed across failovers.
//!
//! Redis replicates asynchronously, so a failover can lose what the old master last wrote, and a
//! partitioned old master can go on taking writes from the clients on its side. Two things keep
//! two pods from both holding the lock:
//!
//! - **Acquisitions and renewals count only once a replica has them.** Each is followed by
//!   `WAIT min-replicas` (default 1); one the replicas did not confirm in time is an error, and an
//!   unconfirmed acquisition is given back. An old master cut off from its replicas therefore
//!   extends nobody's claim, and its holder stops claiming when its last confirmed lease runs out.
//!   Renewals that arrive together go out as one script call and one `WAIT`
//!   ([`crate::drivers::redis::renewals`]).
//! - **A promoted replica waits out one lease before it grants a free lock, and rebases the
//!   tokens**: the single master's epoch record ([`crate::drivers::redis::ACQUIRE`]), in which a promoted
//!   server is never durable. A lease the old master granted and the new one never received has
//!   ended by then, because its holder counts it from before the promotion; a lease that did
//!   reach the new master is renewed there as before. A promoted replica restarted before it
//!   served the lock is no longer promoted, yet waits the same: the record names the sentinels'
//!   configuration epoch it was written in, which the failover raised.
//!
//! - **The master is the one a majority of the configured sentinels names, lately.** Every
//!   sentinel is asked, and a server counts as master only while more than half of those listed
//!   name it; every call (acquisition, renewal, release) goes out only within [`CONFIRMED_FOR`]
//!   of a question that a majority answered so. A pod partitioned with the old master and a
//!   minority of the sentinels cannot hear a majority, so it forgets the master and stops
//!   renewing, and its claim ends within a lease, while the majority's side fails over (which
//!   takes Sentinel's `down-after-milliseconds` at least, then one lease on the promoted
//!   master). Each claim counts from the question, not from the call, so it ends before a
//!   master a later majority names can grant the lock. List every sentinel (not a Service in
//!   front of them): with a single one listed, its word is the majority.
//!
//! What it costs: after a failover, a free lock is granted one lease after the first attempt on
//! the new master, so takeover takes Sentinel's detection time plus one lease. Each acquisition
//! and renewal waits for one replica's acknowledgement, and the sentinels are asked every
//! [`MASTER_CHECK`] (by one task per driver, not per call).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{Script, Value};
use tokio::sync::watch;

use crate::boot_clock::BootInstant;
use crate::driver::{Acquire, ChangeFeeds, Driver, Holding, Lease, Upkeep};
use crate::drivers::redis::connection::counted;
use crate::drivers::redis::renewals::RenewalBatches;
use crate::drivers::redis::{self as single, KeyLayout};
use crate::drivers::replaceable::Replaceable;
use crate::error::{Error, Result};

/// Sentinel's own default port.
pub const DEFAULT_SENTINEL_PORT: u16 = 26379;
/// Replicas that must confirm each acquisition and renewal unless `?min-replicas=` says otherwise.
pub const DEFAULT_MIN_REPLICAS: u32 = 1;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the sentinels are asked whether the master moved, besides after every failure.
pub const MASTER_CHECK: Duration = Duration::from_secs(1);
/// How long a majority's naming of the master counts, from when it was asked: a call after
/// that asks the sentinels again first. Far below Sentinel's `down-after-milliseconds` (30 s by
/// default), the least time a failover takes.
pub const CONFIRMED_FOR: Duration = Duration::from_millis(1500);
/// How long one sentinel may take to answer before it counts as not answering.
const SENTINEL_ANSWER: Duration = Duration::from_secs(1);
/// The longest a `WAIT` for replicas may hold up the connection the driver's calls share.
const MAX_REPLICA_WAIT: Duration = Duration::from_millis(500);
/// The shortest: the replica receives a write only after the master's own fsync (with
/// `appendfsync always`), which a busy disk can stretch past 100 ms.
const MIN_REPLICA_WAIT: Duration = Duration::from_millis(250);
const RESUBSCRIBE_MIN: Duration = Duration::from_millis(100);
const RESUBSCRIBE_MAX: Duration = Duration::from_secs(2);

/// What `redis+sentinel://` names.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelConfig {
    /// `host:port` of each sentinel, asked in order.
    pub sentinels: Vec<String>,
    /// The name the sentinels monitor the master under.
    pub master_name: String,
    /// `redis://[user:password@]127.0.0.1/db`: the master's credentials and database; its
    /// address is what the sentinels say.
    pub master: url::Url,
    pub prefix: String,
    /// Replicas that must confirm each acquisition and renewal (`WAIT`).
    pub min_replicas: u32,
    /// TLS to the sentinels and to the master they name (`rediss+sentinel://`), with one CA
    /// and client pair for both, as a deployment with `tls-replication yes` has.
    pub tls: Option<crate::tls::Tls>,
    /// The sentinels' own credentials (`requirepass`/ACL user on the sentinels), which are not
    /// the master's: `sentinel-username` and `sentinel-password`.
    pub sentinel_auth: Option<SentinelAuth>,
}

/// A sentinel's username (empty: the default user) and password.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelAuth {
    pub username: String,
    pub password: String,
}

impl SentinelConfig {
    /// `redis://` (or over TLS `rediss://`) to `host:port`, with the sentinels' credentials.
    fn sentinel_url(&self, sentinel: &str) -> std::result::Result<url::Url, url::ParseError> {
        let scheme = if self.tls.is_some() {
            "rediss"
        } else {
            "redis"
        };
        let mut url = url::Url::parse(&format!("{scheme}://{sentinel}"))?;
        if let Some(auth) = &self.sentinel_auth {
            let _ = crate::drivers::url_parts::set_login(&mut url, &auth.username, &auth.password);
        }
        Ok(url)
    }
}

/// The master the sentinels name, and one shared connection to it.
pub struct SentinelMaster {
    config: SentinelConfig,
    current: tokio::sync::Mutex<Option<Master>>,
    /// One connection per sentinel, kept while it works.
    sentinels: Mutex<Vec<Option<MultiplexedConnection>>>,
    /// The master a majority of the sentinels named last, and when they were asked (on the
    /// boot clock, which counts a suspend).
    confirmed: Mutex<Option<(Named, BootInstant)>>,
    /// Whether a sentinel's refusal to tell the master's configuration epoch was logged.
    epoch_refusal_told: std::sync::atomic::AtomicBool,
}

/// A master as the sentinels name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Named {
    /// `host:port`.
    pub address: String,
    /// The sentinels' configuration epoch for the master (`config-epoch`): every failover
    /// raises it, so a master restarted on data a failover handed it is told from one
    /// restarted on its own ([`crate::drivers::redis::Keeping::DurableBehindSentinel`]). The
    /// highest the sentinels of the majority gave; `None` where one would not tell (`SENTINEL
    /// MASTER` refused to the sentinels' user), and the master then counts as one that may
    /// lose data.
    pub failovers: Option<u64>,
}

#[derive(Clone)]
struct Master {
    /// When a majority was last asked and named this master, as the call that took this clone
    /// found it: the claim a call on it gives counts from then at the latest.
    confirmed_asked: BootInstant,
    /// The sentinels' configuration epoch as that question gave it.
    failovers: Option<u64>,
    address: String,
    client: redis::Client,
    conn: MasterConnection,
    /// Renewals on this master go out together, with one `WAIT` for each batch
    /// ([`crate::drivers::redis::renewals`]).
    renewals: Arc<RenewalBatches>,
}

/// The master's connection, whose requests tell how they ended: once a request cut short by its
/// caller has had no answer on it for the response timeout, the master has fallen silent, and
/// the next call asks the sentinels again ([`SentinelMaster::master`]), on a new connection. A
/// timeout does so at once ([`means_another_master`]). Never replaced under a call: a `WAIT`
/// counts the writes of its own connection, so a call's writes and its `WAIT` share one.
#[derive(Clone)]
struct MasterConnection {
    conn: MultiplexedConnection,
    requests: Arc<Replaceable<()>>,
}

impl MasterConnection {
    fn new(conn: MultiplexedConnection) -> Self {
        let requests = Replaceable::new((), RESPONSE_TIMEOUT, "Redis master", || Ok(()));
        Self {
            conn,
            requests: Arc::new(requests),
        }
    }
}

impl redis::aio::ConnectionLike for MasterConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        Box::pin(async move {
            counted(self.requests.outgoing(), self.conn.req_packed_command(cmd)).await
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            counted(
                self.requests.outgoing(),
                self.conn.req_packed_commands(pipeline, offset, count),
            )
            .await
        })
    }

    fn get_db(&self) -> i64 {
        self.conn.get_db()
    }
}

fn connection_config() -> redis::AsyncConnectionConfig {
    redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
}

impl SentinelMaster {
    pub fn new(config: SentinelConfig) -> Self {
        let sentinels = Mutex::new(vec![None; config.sentinels.len()]);
        Self {
            config,
            current: tokio::sync::Mutex::new(None),
            sentinels,
            confirmed: Mutex::new(None),
            epoch_refusal_told: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The master, as more than half of the configured sentinels name it now: all are asked
    /// at once, each for at most [`SENTINEL_ANSWER`], and the answer comes as soon as a
    /// majority agrees on its address (a silent sentinel costs nothing then).
    pub async fn named_master(&self) -> Result<(Named, BootInstant)> {
        use futures_util::stream::FuturesUnordered;
        let asked = BootInstant::now();
        let majority = self.config.sentinels.len() / 2 + 1;
        let mut answers: FuturesUnordered<_> = self
            .config
            .sentinels
            .iter()
            .enumerate()
            .map(|(i, sentinel)| async move {
                let answer =
                    tokio::time::timeout(SENTINEL_ANSWER, self.ask_sentinel(i, sentinel)).await;
                (i, sentinel, answer)
            })
            .collect();
        let mut votes: Vec<(Named, usize)> = Vec::new();
        let mut failures = Vec::new();
        while let Some((i, sentinel, answer)) = answers.next().await {
            match answer {
                Ok(Ok(Some(named))) => {
                    match votes.iter_mut().find(|(n, _)| n.address == named.address) {
                        Some((n, count)) => {
                            *count += 1;
                            n.failovers = merged_failovers(n.failovers, named.failovers);
                        }
                        None => votes.push((named, 1)),
                    }
                }
                Ok(Ok(None)) => failures.push(format!(
                    "{sentinel} does not monitor a master named {:?}",
                    self.config.master_name
                )),
                Ok(Err(e)) => {
                    self.sentinels.lock().expect("sentinels")[i] = None;
                    failures.push(format!("{sentinel}: {e}"));
                }
                Err(_) => {
                    self.sentinels.lock().expect("sentinels")[i] = None;
                    failures.push(format!("{sentinel}: no answer within {SENTINEL_ANSWER:?}"));
                }
            }
            if votes.iter().any(|(_, count)| *count >= majority) {
                break;
            }
        }
        // Questions overlap (the follower's and a call's): an answer never replaces a later
        // question's.
        let mut confirmed = self.confirmed.lock().expect("confirmed");
        let later = confirmed.as_ref().is_none_or(|(_, last)| asked >= *last);
        if let Some((named, _)) = votes.iter().find(|(_, count)| *count >= majority) {
            if later {
                *confirmed = Some((named.clone(), asked));
            }
            return Ok((named.clone(), asked));
        }
        if later {
            *confirmed = None;
        }
        drop(confirmed);
        let named: Vec<String> = votes
            .iter()
            .map(|(named, count)| format!("{count} named {}", named.address))
            .collect();
        Err(Error::Unreachable(format!(
            "no majority ({majority} of {}) of the sentinels names the master {:?}{}{}",
            self.config.sentinels.len(),
            self.config.master_name,
            if named.is_empty() {
                String::new()
            } else {
                format!(" ({})", named.join(", "))
            },
            if failures.is_empty() {
                String::new()
            } else {
                format!(": {}", failures.join("; "))
            }
        )))
    }

    /// When a majority that named `address` master was asked, if within `fresh`, and the
    /// configuration epoch it gave.
    fn confirmed(&self, address: &str, fresh: Duration) -> Option<(BootInstant, Option<u64>)> {
        self.confirmed
            .lock()
            .expect("confirmed")
            .as_ref()
            .filter(|(named, asked)| {
                named.address == address
                    && BootInstant::now().saturating_duration_since(*asked) < fresh
            })
            .map(|(named, asked)| (*asked, named.failovers))
    }

    async fn ask_sentinel(&self, i: usize, sentinel: &str) -> redis::RedisResult<Option<Named>> {
        let cached = self.sentinels.lock().expect("sentinels")[i].clone();
        let mut conn = match cached {
            Some(conn) => conn,
            None => {
                let url = self.config.sentinel_url(sentinel).map_err(|e| {
                    redis::RedisError::from((
                        redis::ErrorKind::InvalidClientConfig,
                        "a sentinel's address",
                        e.to_string(),
                    ))
                })?;
                let client = single::client(&url, self.config.tls.as_ref()).map_err(|e| {
                    redis::RedisError::from((
                        redis::ErrorKind::InvalidClientConfig,
                        "the sentinels' TLS settings",
                        e.to_string(),
                    ))
                })?;
                let conn = client
                    .get_multiplexed_async_connection_with_config(&connection_config())
                    .await?;
                self.sentinels.lock().expect("sentinels")[i] = Some(conn.clone());
                conn
            }
        };
        // One round trip, answered in one turn of the sentinel: the address (which names the
        // promoted replica as soon as it is promoted), then the epoch it was named in, which
        // can only be as new. A sentinel user refused `SENTINEL MASTER` still names the master.
        type Replies = (
            redis::RedisResult<Option<(String, u16)>>,
            redis::RedisResult<Value>,
        );
        let (address, master): Replies = redis::pipe()
            .ignore_errors()
            .cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.config.master_name)
            .cmd("SENTINEL")
            .arg("master")
            .arg(&self.config.master_name)
            .query_async(&mut conn)
            .await?;
        let Some((host, port)) = address? else {
            return Ok(None);
        };
        let failovers = master.ok().and_then(config_epoch);
        if failovers.is_none()
            && !self
                .epoch_refusal_told
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                sentinel,
                "the sentinel does not tell the master's config-epoch (SENTINEL MASTER): the master counts as one that may lose data, and a free lock waits out a lease after each of its restarts"
            );
        }
        Ok(Some(Named {
            address: match host.contains(':') {
                true => format!("[{host}]:{port}"),
                false => format!("{host}:{port}"),
            },
            failovers,
        }))
    }

    /// The current master's connection, while a majority of the sentinels names it lately;
    /// found (or confirmed) through the sentinels otherwise. Forgotten when no majority names
    /// it.
    async fn master(&self) -> Result<Master> {
        self.master_within(CONFIRMED_FOR).await
    }

    /// The same, with a majority's naming no older than `fresh`: a call whose claim counts from
    /// the question ([`Driver::counted_from`]) asks for one recent against its lease.
    async fn master_within(&self, fresh: Duration) -> Result<Master> {
        let mut current = self.current.lock().await;
        // Replaced in the requests' books (a timeout, or a request cut short and unanswered
        // since for the response timeout): the master fell silent on its connection.
        if let Some(master) = current.take_if(|master| master.conn.requests.generation() != 0) {
            tracing::info!(master = %master.address, "the Redis master fell silent; asking the sentinels again");
        }
        if let Some(master) = &*current
            && let Some((asked, failovers)) = self.confirmed(&master.address, fresh)
        {
            return Ok(Master {
                confirmed_asked: asked,
                failovers,
                ..master.clone()
            });
        }
        let (Named { address, failovers }, confirmed_asked) = match self.named_master().await {
            Ok(named) => named,
            Err(e) => {
                if let Some(master) = current.take() {
                    tracing::warn!(master = %master.address, error = %e, "no majority of the sentinels names the Redis master: leaving it");
                }
                return Err(e);
            }
        };
        if let Some(master) = &*current {
            if master.address == address {
                return Ok(Master {
                    confirmed_asked,
                    failovers,
                    ..master.clone()
                });
            }
            tracing::info!(from = %master.address, to = %address, "the sentinels name a new Redis master");
            *current = None;
        }
        let mut url = self.config.master.clone();
        let (host, port) = address
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.trim_matches(['[', ']']), p.parse::<u16>().ok()?)))
            .ok_or_else(|| Error::Backend(format!("the sentinels named {address:?}")))?;
        url.set_host(Some(host))
            .map_err(|e| Error::Backend(format!("the sentinels named {address:?}: {e}")))?;
        let _ = url.set_port(Some(port));
        let unreachable = |e: redis::RedisError| {
            Error::Unreachable(format!("the master {address} the sentinels name: {e}"))
        };
        let client = single::client(&url, self.config.tls.as_ref())?;
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&connection_config())
            .await
            .map_err(unreachable)?;
        // During a failover the sentinels may still name a server that has become a replica.
        let role: Vec<Value> = redis::cmd("ROLE")
            .query_async(&mut conn)
            .await
            .map_err(unreachable)?;
        if !matches!(role.first(), Some(Value::BulkString(r)) if r == b"master") {
            return Err(Error::Unreachable(format!(
                "the sentinels name {address} master of {:?}, but it is not (a failover in progress)",
                self.config.master_name
            )));
        }
        let conn = MasterConnection::new(conn);
        let renewals = Arc::new(RenewalBatches::new(conn.clone(), self.config.min_replicas));
        let master = Master {
            confirmed_asked,
            failovers,
            address,
            client,
            conn,
            renewals,
        };
        *current = Some(master.clone());
        Ok(master)
    }

    /// Drop the connection to `address` (if it is still the current one), so that the next call
    /// asks the sentinels again.
    async fn forget(&self, address: &str) {
        let mut current = self.current.lock().await;
        if current.as_ref().is_some_and(|m| m.address == address) {
            tracing::info!(
                master = address,
                "leaving the Redis master; asking the sentinels again"
            );
            *current = None;
        }
    }
}

/// The configuration epoch of two sentinels that name one master: the higher (a sentinel that
/// has not heard of the last failover gives a lower one), and nothing where either would not
/// tell, so that one lagging sentinel beside refusing ones never speaks for the majority.
fn merged_failovers(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    a.zip(b).map(|(a, b)| a.max(b))
}

/// `config-epoch` of a `SENTINEL MASTER` answer (field names and values in turn, or a map).
fn config_epoch(master: Value) -> Option<u64> {
    redis::from_redis_value::<std::collections::HashMap<String, String>>(master)
        .ok()?
        .get("config-epoch")?
        .parse()
        .ok()
}

/// Whether `e` means that this server is no longer (or not yet) the master to talk to.
fn means_another_master(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"))
}

pub struct RedisSentinelDriver {
    master: Arc<SentinelMaster>,
    keys: KeyLayout,
    durability: crate::drivers::redis::durability::Durability,
    min_replicas: u32,
    acquire: Script,
    release: Script,
    observe: Script,
    releases: Arc<ChangeFeeds>,
    follower: tokio::task::JoinHandle<()>,
    /// For each lock acquired or renewed here, the token of that holding and when the majority
    /// that named the master of its last such call was asked ([`Driver::counted_from`]).
    counted: Mutex<std::collections::HashMap<String, (u64, BootInstant)>>,
}

/// How many locks' confirmation instants are kept before those older than a minute go (a lock
/// released drops its own; one left to expire is dropped so).
const COUNTED_KEPT: usize = 4096;

impl Drop for RedisSentinelDriver {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

impl RedisSentinelDriver {
    /// Nothing is contacted yet: an unreachable Sentinel shows in readiness, not as a crash.
    pub fn connect(config: &SentinelConfig) -> Self {
        if config.sentinels.len() < 3 {
            tracing::warn!(
                sentinels = config.sentinels.len(),
                "fewer than three sentinels are listed: the master is whatever they name, and a pod partitioned with them and the old master is not stopped; list every sentinel (not one Service in front of them)"
            );
        }
        let keys = KeyLayout::new(&config.prefix);
        let master = Arc::new(SentinelMaster::new(config.clone()));
        let releases = Arc::new(ChangeFeeds::default());
        let follower = tokio::spawn(follow_master(
            master.clone(),
            keys.clone(),
            releases.clone(),
        ));
        Self {
            durability: crate::drivers::redis::durability::Durability::default(),
            master,
            keys,
            min_replicas: config.min_replicas,
            acquire: Script::new(single::ACQUIRE),
            release: Script::new(single::RELEASE),
            observe: Script::new(single::OBSERVE),
            releases,
            follower,
            counted: Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// A call on `master` gave `lock` a lease: it counts from the majority's question at the
    /// latest.
    fn count_from_confirmation(&self, lease: &Lease, master: &Master) {
        let mut counted = self.counted.lock().expect("counted");
        if counted.len() >= COUNTED_KEPT {
            let now = BootInstant::now();
            counted.retain(|_, (_, asked)| {
                now.saturating_duration_since(*asked) < Duration::from_secs(60)
            });
        }
        counted.insert(lease.lock.clone(), (lease.token, master.confirmed_asked));
    }

    /// A failed call: forget a master that no longer serves, then say what failed.
    async fn failed(&self, master: &Master, e: redis::RedisError) -> Error {
        if means_another_master(&e) {
            self.master.forget(&master.address).await;
        }
        single::map_err(e)
    }

    /// `WAIT` until `min_replicas` replicas have every write so far on this connection; an error
    /// when they do not within [`replica_wait`].
    async fn replicated(&self, master: &Master, ttl: Duration, what: &str) -> Result<()> {
        if self.min_replicas == 0 {
            return Ok(());
        }
        let wait = replica_wait(ttl);
        let mut conn = master.conn.clone();
        let acked: i64 = match redis::cmd("WAIT")
            .arg(self.min_replicas)
            .arg(single::ms(wait))
            .query_async(&mut conn)
            .await
        {
            Ok(acked) => acked,
            Err(e) => return Err(self.failed(master, e).await),
        };
        self.confirmed(master, acked, wait, what)
    }

    /// An error unless `acked` replicas are as many as `min_replicas` asks for.
    fn confirmed(&self, master: &Master, acked: i64, wait: Duration, what: &str) -> Result<()> {
        if acked >= i64::from(self.min_replicas) {
            return Ok(());
        }
        Err(Error::Unreachable(format!(
            "the {what} was confirmed by {acked} of the {} replica(s) min-replicas asks for within \
             {wait:?}: the master {} has too few replicas in sync, and a failover could lose it",
            self.min_replicas, master.address
        )))
    }
}

/// How old a majority's naming of the master may be for a call giving a lease of `ttl`: a
/// quarter of it, at most [`CONFIRMED_FOR`]. The claim counts from the question, so that much of
/// the lease is spent before the call.
fn confirmation_window(ttl: Duration) -> Duration {
    (ttl / 4).min(CONFIRMED_FOR)
}

/// How long the replicas may take to confirm a write under a lease of `ttl`: a quarter of it,
/// within 250-500 ms.
fn replica_wait(ttl: Duration) -> Duration {
    (ttl / 4).clamp(MIN_REPLICA_WAIT, MAX_REPLICA_WAIT)
}

#[async_trait]
impl Driver for RedisSentinelDriver {
    fn kind(&self) -> &'static str {
        "redis-sentinel"
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        let master = self.master.master_within(confirmation_window(ttl)).await?;
        let mut reread = false;
        let reply: Value = loop {
            let mut conn = master.conn.clone();
            let reading = self
                .durability
                .of_or_fresh(&mut conn, &master.address, reread)
                .await;
            let reading = match reading {
                Ok(reading) => reading,
                Err(e) => return Err(self.failed(&master, e).await),
            };
            let keeping =
                single::Keeping::from_reading(reading, |read_on| match master.failovers {
                    Some(failovers) => single::Keeping::DurableBehindSentinel {
                        address: master.address.clone(),
                        failovers,
                        read_on,
                    },
                    None => single::Keeping::Lossy,
                });
            match single::acquisition(&self.acquire, &self.keys, lock, identity, ttl, &keeping)
                .invoke_async(&mut master.conn.clone())
                .await
            {
                Ok(reply) => break reply,
                // The master is another incarnation than its durability was read on.
                Err(e) if crate::drivers::redis::durability_unread(&e) && !reread => {
                    reread = true;
                }
                Err(e) => return Err(self.failed(&master, e).await),
            }
        };
        let lease = match single::acquired(lock, identity, &single::only_result(reply)?)? {
            Acquire::Acquired(lease) => lease,
            busy => return Ok(busy),
        };
        if let Err(e) = self.replicated(&master, ttl, "acquisition").await {
            // Not held, so not kept: give it back (if this fails too, it expires).
            let _ = self.release(&lease).await;
            return Err(e);
        }
        self.count_from_confirmation(&lease, &master);
        Ok(Acquire::Acquired(lease))
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let master = self.master.master_within(confirmation_window(ttl)).await?;
        let wait = replica_wait(ttl);
        let answer = master
            .renewals
            .renew(
                self.keys.lease(&lease.lock),
                single::lease_value(lease),
                single::ms(ttl),
                wait,
            )
            .await?;
        let renewed = match answer {
            Ok(renewed) => renewed,
            Err(e) => return Err(self.failed(&master, e).await),
        };
        if !renewed.extended {
            return Ok(false);
        }
        match renewed.confirmed_by {
            Some(acked) => self.confirmed(&master, acked, wait, "renewal")?,
            None if self.min_replicas > 0 => {
                return Err(Error::Backend(
                    "a renewal batch extended a lease without asking the replicas".into(),
                ));
            }
            None => {}
        }
        self.count_from_confirmation(lease, &master);
        Ok(true)
    }

    /// No later than the question whose majority named the master the call went to: a holder
    /// that heard the majority at that moment has its claim end one lease after it, before a
    /// master that a majority named later (after a failover) can grant the lock, since two
    /// majorities share a sentinel that changed its answer in between.
    fn counted_from(&self, lease: &Lease, sent: BootInstant) -> BootInstant {
        let counted = self.counted.lock().expect("counted");
        match counted.get(&lease.lock) {
            Some((token, asked)) if *token == lease.token => sent.min(*asked),
            // Not this holding's (another holding of the lock here replaced the entry): from
            // the send less the oldest a majority's naming may be, never later than the truth.
            _ => sent - CONFIRMED_FOR,
        }
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        {
            let mut counted = self.counted.lock().expect("counted");
            if counted
                .get(&lease.lock)
                .is_some_and(|(token, _)| *token == lease.token)
            {
                counted.remove(&lease.lock);
            }
        }
        let master = self.master.master().await?;
        match single::releases_of(&self.release, &self.keys, &[lease])
            .invoke_async::<Value>(&mut master.conn.clone())
            .await
        {
            Ok(reply) => Ok(single::released_one(&reply)),
            Err(e) => Err(self.failed(&master, e).await),
        }
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        let master = self.master.master().await?;
        match self
            .observe
            .key(self.keys.lease(lock))
            .invoke_async::<Value>(&mut master.conn.clone())
            .await
        {
            Ok(reply) => Ok(single::parse_value_and_pttl(&reply)),
            Err(e) => Err(self.failed(&master, e).await),
        }
    }

    fn changes(&self, lock: &str) -> Option<watch::Receiver<u64>> {
        Some(self.releases.subscribe(lock))
    }

    async fn ping(&self) -> Result<()> {
        let master = self.master.master().await?;
        match redis::cmd("PING")
            .query_async::<String>(&mut master.conn.clone())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => Err(self.failed(&master, e).await),
        }
    }
}

#[async_trait]
impl Upkeep for RedisSentinelDriver {
    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        let master = self.master.master().await?;
        let mut conn = master.conn.clone();
        match single::delete_keys(&mut conn, &self.keys, locks).await {
            Err(Error::Unreachable(m)) => {
                self.master.forget(&master.address).await;
                Err(Error::Unreachable(m))
            }
            other => other,
        }
    }

    /// The holding's lease is released, matched as a release is: the deletion itself (the
    /// token counter stays, the waiters' mark goes with the lease).
    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        crate::driver::deleted_as_released(lease, self.release(lease).await?)
    }

    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        let master = self.master.master().await?;
        let held = single::held_key_leases(&mut master.conn.clone(), &self.keys, family).await;
        if let Err(Error::Unreachable(_)) = &held {
            self.master.forget(&master.address).await;
        }
        Ok(Some(held?.len() as u64))
    }

    async fn warnings(&self) -> Result<Vec<String>> {
        let master = self.master.master().await?;
        single::lock_key_warnings(&mut master.conn.clone()).await
    }
}

/// Listen for releases on the current master, and move to the next master as soon as the
/// sentinels name another one, or subscribe again once the subscription falls silent (waking
/// every waiter either way, since a release may have been missed).
async fn follow_master(master: Arc<SentinelMaster>, keys: KeyLayout, feeds: Arc<ChangeFeeds>) {
    let mut pause = RESUBSCRIBE_MIN;
    let mut refusal_told = false;
    loop {
        let subscribed = tokio::time::timeout(CONNECT_TIMEOUT, async {
            let current = master.master().await.map_err(|e| e.to_string())?;
            let mut pubsub = current
                .client
                .get_async_pubsub()
                .await
                .map_err(|e| e.to_string())?;
            if let Err(e) = pubsub.psubscribe(keys.released_pattern()).await {
                crate::drivers::redis::subscription_failed(&e, &keys, &mut refusal_told);
                return Err(e.to_string());
            }
            Ok::<_, String>((current.address, pubsub))
        })
        .await;
        match subscribed {
            Ok(Ok((address, pubsub))) => {
                pause = RESUBSCRIBE_MIN;
                feeds.bump_all();
                let moved = async {
                    let mut check = tokio::time::interval(MASTER_CHECK);
                    loop {
                        check.tick().await;
                        match master.named_master().await {
                            Ok((named, _)) if named.address != address => {
                                tracing::info!(from = %address, to = %named.address, "the sentinels name a new Redis master");
                                master.forget(&address).await;
                                return;
                            }
                            Ok(_) => {}
                            // No majority names it: calls stop going to it at once.
                            Err(e) => {
                                tracing::warn!(master = %address, error = %e, "no majority of the sentinels names the Redis master: leaving it");
                                master.forget(&address).await;
                                return;
                            }
                        }
                    }
                };
                crate::drivers::redis::hear_releases(pubsub, &keys, &feeds, moved).await;
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "redis release subscription failed"),
            Err(_) => tracing::debug!("redis release subscription timed out"),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RESUBSCRIBE_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::IntoConnectionInfo;

    /// `SENTINEL MASTER` answers as RESP2 gives them (field names and values in turn) and as
    /// RESP3 does (a map); an answer without the field tells nothing.
    #[test]
    fn the_config_epoch_is_read_from_either_protocol() {
        let text = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let flat = Value::Array(vec![
            text("name"),
            text("leasehold"),
            text("config-epoch"),
            text("7"),
            text("flags"),
            text("master"),
        ]);
        assert_eq!(config_epoch(flat), Some(7));
        let map = Value::Map(vec![
            (text("name"), text("leasehold")),
            (text("config-epoch"), Value::Int(12)),
        ]);
        assert_eq!(config_epoch(map), Some(12));
        assert_eq!(
            config_epoch(Value::Array(vec![text("name"), text("x")])),
            None
        );
        assert_eq!(config_epoch(Value::Nil), None);
    }

    /// Of a majority, the highest epoch any gave, unless one would not tell.
    #[test]
    fn a_sentinel_that_does_not_tell_the_epoch_leaves_it_untold() {
        assert_eq!(merged_failovers(Some(3), Some(5)), Some(5));
        assert_eq!(merged_failovers(Some(5), Some(3)), Some(5));
        assert_eq!(merged_failovers(Some(5), None), None);
        assert_eq!(merged_failovers(None, Some(5)), None);
    }

    /// The sentinels' user and password reach the client byte for byte, whatever they contain:
    /// the client percent-decodes the URL's user information.
    #[test]
    fn sentinel_credentials_reach_the_client_as_written() {
        let config = SentinelConfig::from_parts(
            &["s-0".to_owned()],
            "locks",
            None,
            crate::Login {
                user: Some("ops%41@x"),
                password: Some("p%41ss:/?#"),
            },
            crate::RedisOptions::default(),
        )
        .unwrap();
        let url = config.sentinel_url("s-0:26379").unwrap();
        let info = url.into_connection_info().unwrap();
        assert_eq!(info.redis_settings().username(), Some("ops%41@x"));
        assert_eq!(info.redis_settings().password(), Some("p%41ss:/?#"));
    }
}
