//! Redlock: one lock across N >= 3 independent Redis masters, held while a majority holds it.
//!
//! - **Acquire** in two phases, each sent to every master at once with a short per-master
//!   timeout, so a dead master costs that timeout and not the lease:
//!   1. `SET lease PENDING NX PX ttl`, answered with the master's token counter;
//!   2. on the masters that granted it, where the key is still PENDING: rewrite it to
//!      `TOKEN:IDENTITY` (keeping its TTL) and raise the counter to TOKEN, where
//!      TOKEN = 1 + the largest counter phase 1 saw.
//!
//!   The lock is ours when phase 2 succeeded on a majority and the time spent is well inside the
//!   TTL (validity = ttl - elapsed - drift). Otherwise every master is undone.
//! - **Why tokens strictly increase with a minority down**: the previous holder's token was
//!   written to the counters of a majority (phase 2) before it claimed, and every majority shares a
//!   master with every other. That master's counter was raised before its lease key was freed, and
//!   this acquisition read it after the key was free, so TOKEN exceeds the previous one.
//! - **A master that restarted** without its data, or that is not durable (`appendonly yes`
//!   with `appendfsync always`), may have lost a holder's lease and counter: phase 1 checks its
//!   epoch as single Redis does, so it grants nothing for one lease after its start and answers
//!   a counter raised above every token it gave before (the epoch's floor, its clock in
//!   microseconds). A durable master keeps both and grants at once.
//! - **Renew** extends the key on every master and needs a majority; **release** goes to all.
//! - Clocks: each master expires keys by its own clock; the drift allowance (1 % + 2 ms) is
//!   below the holder's own safety margin, so the holder stops claiming before the first master
//!   can free the key.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::join_all;
use redis::aio::ConnectionManagerConfig;
use redis::{Script, Value};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::driver::{Acquire, ChangeFeeds, Driver, Holding, Lease, Upkeep};
use crate::drivers::redis::connection::ServerConnection;
use crate::drivers::redis::durability::Durability;
use crate::drivers::redis::renewals::RenewalBatches;
use crate::drivers::redis::{
    KEY_COUNTER_RETENTION, Keeping, KeyLayout, OBSERVE, RELEASE, durability_unread, lease_value,
    listen_for_releases, map_err, ms, parse_value_and_pttl, released_one,
};
use crate::error::{Error, Result};

/// N >= 3 independent masters: `redlock://[user:password@]host:port,host:port,host:port[/db][?prefix=NAME]`,
/// one `redis://` URL each; `redlocks://` over TLS, as `rediss://`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedlockConfig {
    pub masters: Vec<url::Url>,
    pub prefix: String,
    pub tls: Option<crate::tls::Tls>,
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Bounds of one master's share of an operation: small against the lease, so that a dead
/// master does not eat the lease (Redlock's "a few milliseconds to tens").
const MIN_MASTER_TIMEOUT: Duration = Duration::from_millis(50);
const MAX_MASTER_TIMEOUT: Duration = Duration::from_millis(500);
const MAX_DELAY: Duration = Duration::from_secs(1);
/// Redlock's clock drift allowance: 1 % of the TTL plus 2 ms.
const DRIFT_FACTOR: u32 = 100;
const DRIFT_FLOOR: Duration = Duration::from_millis(2);

/// KEYS: the master's epoch record, lease, token counter, the lock's own counter (the same
/// unless the lock is a family's key: see [`crate::drivers::redis::ACQUIRE`]). ARGV: how the
/// master keeps its data ([`crate::drivers::redis::Keeping::argument`]), pending value, ttl ms.
/// Returns the largest counter (at least the epoch's floor) when the key was set, {current
/// value, remaining ms} when held, or {false, remaining ms} while the master waits out a lease
/// it may have lost: a master restarted without its data (or with it, but not durable) grants
/// nothing for one lease, and raises its floor above every token it gave before, as single
/// Redis does ([`crate::drivers::redis::ACQUIRE`]'s epoch check, the same Lua). Without that, a
/// majority that restarted empty one after another while a lock was held would grant it again,
/// with a token counted from nothing.
const PHASE_1: &str = concat!(
    crate::drivers::redis::epoch_check!(),
    r"
local current = redis.call('GET', KEYS[2])
if current then
  return {current, redis.call('PTTL', KEYS[2])}
end
check_epoch()
local left = guarded and since + tonumber(ARGV[3]) * 1000 - now or 0
if left > 0 then
  return {false, math.ceil(left / 1000)}
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return math.max(floor, tonumber(redis.call('GET', KEYS[3]) or '0'),
  tonumber(redis.call('GET', KEYS[4]) or '0'))
"
);

/// KEYS: lease, token counter, the lock's own counter. ARGV: pending value, final value, token,
/// how long a family key's own counter is kept (ms). Returns 1 when done.
const PHASE_2: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[3]) then
  redis.call('SET', KEYS[2], ARGV[3])
end
if KEYS[3] ~= KEYS[2] then
  redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
end
return 1
";

struct Master {
    conn: ServerConnection,
    /// `host:port`, naming it to its durability check.
    name: String,
    /// Whether it loses no acknowledged write (its epoch check's argument).
    durability: Durability,
    subscriber: tokio::task::JoinHandle<()>,
    /// Renewals on this master go out together ([`crate::drivers::redis::renewals`]).
    renewals: RenewalBatches,
}

pub struct RedlockDriver {
    masters: Vec<Master>,
    keys: KeyLayout,
    phase_1: Script,
    phase_2: Script,
    release: Script,
    observe: Script,
    releases: Arc<ChangeFeeds>,
}

impl Drop for RedlockDriver {
    fn drop(&mut self) {
        for master in &self.masters {
            master.subscriber.abort();
        }
    }
}

/// `call` on one master, failed as a timeout once `timeout` has passed.
async fn within<T>(timeout: Duration, call: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or(Err(Error::Timeout(timeout)))
}

fn master_timeout(ttl: Duration) -> Duration {
    (ttl / 10).clamp(MIN_MASTER_TIMEOUT, MAX_MASTER_TIMEOUT)
}

/// What one master answered, or why it did not.
type Reply = std::result::Result<Value, Error>;

impl RedlockDriver {
    /// Connect lazily to every master (each a `redis://` URL, or `rediss://` with `tls`).
    pub fn connect(
        masters: &[url::Url],
        prefix: &str,
        tls: Option<&crate::tls::Tls>,
    ) -> Result<Self> {
        if masters.len() < 3 {
            return Err(Error::InvalidConfig {
                field: "backend",
                reason: format!("Redlock needs at least 3 masters, got {}", masters.len()),
            });
        }
        let keys = KeyLayout::new(prefix);
        let releases = Arc::new(ChangeFeeds::default());
        let masters = masters
            .iter()
            .map(|url| {
                let client = crate::drivers::redis::client(url, tls)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(MAX_MASTER_TIMEOUT))
                    .set_number_of_retries(1)
                    .set_max_delay(MAX_DELAY);
                let conn = ServerConnection::new(client.clone(), config)?;
                let subscriber =
                    tokio::spawn(listen_for_releases(client, keys.clone(), releases.clone()));
                let renewals = RenewalBatches::new(conn.clone(), 0);
                Ok(Master {
                    conn,
                    name: format!(
                        "{}:{}",
                        url.host_str().unwrap_or_default(),
                        url.port().unwrap_or(6379)
                    ),
                    durability: Durability::default(),
                    subscriber,
                    renewals,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            masters,
            keys,
            phase_1: Script::new(PHASE_1),
            phase_2: Script::new(PHASE_2),
            release: Script::new(RELEASE),
            observe: Script::new(OBSERVE),
            releases,
        })
    }

    fn quorum(&self) -> usize {
        self.masters.len() / 2 + 1
    }

    /// Run one script invocation on the chosen masters at once, each bounded by `timeout`.
    async fn on_masters(
        &self,
        which: &[usize],
        timeout: Duration,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Vec<Reply> {
        join_all(which.iter().map(|&i| {
            let mut conn = self.masters[i].conn.clone();
            async move {
                within(timeout, async {
                    invocation
                        .invoke_async::<Value>(&mut conn)
                        .await
                        .map_err(map_err)
                })
                .await
            }
        }))
        .await
    }

    fn all(&self) -> Vec<usize> {
        (0..self.masters.len()).collect()
    }

    /// Too few masters answered to decide either way.
    fn no_quorum<T>(&self, answered: usize, replies: &[Result<T>]) -> Error {
        let why = replies
            .iter()
            .find_map(|r| r.as_ref().err())
            .map_or_else(String::new, |e| format!(" ({e})"));
        Error::Unreachable(format!(
            "only {answered} of {} Redlock masters answered, {} needed{why}",
            self.masters.len(),
            self.quorum()
        ))
    }

    /// Take back whatever `value` holds on every master (a failed or late acquisition).
    async fn undo(&self, lock: &str, value: &str, ttl: Duration) {
        let mut release = self.release.prepare_invoke();
        release
            .key(self.keys.lease(lock))
            .arg(value)
            .arg(self.keys.released_channel(lock));
        self.on_masters(&self.all(), master_timeout(ttl), &release)
            .await;
    }

    /// The holder a majority agrees on, from `{value, pttl}` replies.
    fn majority_holder(&self, replies: &[Reply]) -> Option<Holding> {
        let holdings: Vec<Holding> = replies
            .iter()
            .filter_map(|r| r.as_ref().ok().and_then(parse_value_and_pttl))
            .collect();
        holdings.iter().find_map(|candidate| {
            let agreeing: Vec<&Holding> = holdings
                .iter()
                .filter(|h| h.identity == candidate.identity && h.token == candidate.token)
                .collect();
            (agreeing.len() >= self.quorum()).then(|| Holding {
                expires_in: agreeing.iter().filter_map(|h| h.expires_in).min(),
                ..candidate.clone()
            })
        })
    }
}

#[async_trait]
impl Driver for RedlockDriver {
    fn kind(&self) -> &'static str {
        "redlock"
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        let started = Instant::now();
        let timeout = master_timeout(ttl);
        // Not a valid `TOKEN:IDENTITY`, so observers see a pending acquisition as no holder.
        let pending = format!("pending-{:016x}:{identity}", rand::random::<u64>());
        let replies: Vec<Reply> = join_all(self.masters.iter().map(|master| {
            let mut conn = master.conn.clone();
            let pending = &pending;
            within(timeout, async move {
                let mut reread = false;
                loop {
                    let reading = master
                        .durability
                        .of_or_fresh(&mut conn, &master.name, reread)
                        .await
                        .map_err(map_err)?;
                    let keeping =
                        Keeping::from_reading(reading, |read_on| Keeping::Durable { read_on });
                    let mut phase_1 = self.phase_1.prepare_invoke();
                    phase_1
                        .key(self.keys.epoch_of(lock))
                        .key(self.keys.lease(lock))
                        .key(self.keys.counter(lock))
                        .key(self.keys.token(lock))
                        .arg(keeping.argument())
                        .arg(pending)
                        .arg(ms(ttl));
                    match phase_1.invoke_async::<Value>(&mut conn).await {
                        // The master is another incarnation than its durability was read on.
                        Err(e) if durability_unread(&e) && !reread => reread = true,
                        answer => return answer.map_err(map_err),
                    }
                }
            })
        }))
        .await;
        let mut granted = Vec::new();
        let mut counter_max = 0u64;
        for (i, reply) in replies.iter().enumerate() {
            if let Ok(Value::Int(counter)) = reply {
                granted.push(i);
                counter_max = counter_max.max(u64::try_from(*counter).unwrap_or(0));
            }
        }
        if granted.len() < self.quorum() {
            if !granted.is_empty() {
                self.undo(lock, &pending, ttl).await;
            }
            let answered = replies.iter().filter(|r| r.is_ok()).count();
            if answered < self.quorum() {
                return Err(self.no_quorum(answered, &replies));
            }
            return Ok(Acquire::Busy(self.majority_holder(&replies)));
        }

        let lease = Lease {
            lock: lock.to_owned(),
            identity: identity.to_owned(),
            token: counter_max + 1,
        };
        let value = lease_value(&lease);
        let mut phase_2 = self.phase_2.prepare_invoke();
        phase_2
            .key(self.keys.lease(lock))
            .key(self.keys.counter(lock))
            .key(self.keys.token(lock))
            .arg(&pending)
            .arg(&value)
            .arg(lease.token)
            .arg(ms(KEY_COUNTER_RETENTION));
        let confirmed = self
            .on_masters(&granted, timeout, &phase_2)
            .await
            .iter()
            .filter(|r| matches!(r, Ok(Value::Int(1))))
            .count();
        let drift = ttl / DRIFT_FACTOR + DRIFT_FLOOR;
        let in_time = started.elapsed() + drift < ttl;
        if confirmed >= self.quorum() && in_time {
            return Ok(Acquire::Acquired(lease));
        }
        self.undo(lock, &pending, ttl).await;
        self.undo(lock, &value, ttl).await;
        if in_time {
            Ok(Acquire::Busy(None))
        } else {
            Err(Error::Timeout(started.elapsed()))
        }
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let (key, value) = (self.keys.lease(&lease.lock), lease_value(lease));
        let timeout = master_timeout(ttl);
        let replies: Vec<Result<bool>> = join_all(self.masters.iter().map(|master| {
            let (key, value) = (key.clone(), value.clone());
            within(timeout, async move {
                let renewal = master.renewals.renew(key, value, ms(ttl), Duration::ZERO);
                renewal.await?.map(|r| r.extended).map_err(map_err)
            })
        }))
        .await;
        let renewed = replies.iter().filter(|r| matches!(r, Ok(true))).count();
        let answered = replies.iter().filter(|r| r.is_ok()).count();
        if renewed >= self.quorum() {
            Ok(true)
        } else if renewed + (self.masters.len() - answered) < self.quorum() {
            // Enough masters said "not yours" that no answer from the rest could make a majority.
            Ok(false)
        } else {
            Err(self.no_quorum(answered, &replies))
        }
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let mut release = self.release.prepare_invoke();
        release
            .key(self.keys.lease(&lease.lock))
            .arg(lease_value(lease))
            .arg(self.keys.released_channel(&lease.lock));
        let replies = self
            .on_masters(&self.all(), MAX_MASTER_TIMEOUT, &release)
            .await;
        let released = replies
            .iter()
            .filter(|r| matches!(r, Ok(reply) if released_one(reply)))
            .count();
        if released == 0 && replies.iter().all(|r| r.is_err()) {
            return Err(self.no_quorum(0, &replies));
        }
        if released > 0 {
            self.releases.bump(&lease.lock);
        }
        Ok(released > 0)
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        let mut observe = self.observe.prepare_invoke();
        observe.key(self.keys.lease(lock));
        let replies = self
            .on_masters(&self.all(), MAX_MASTER_TIMEOUT, &observe)
            .await;
        let answered = replies.iter().filter(|r| r.is_ok()).count();
        if answered < self.quorum() {
            return Err(self.no_quorum(answered, &replies));
        }
        Ok(self.majority_holder(&replies))
    }

    fn changes(&self, lock: &str) -> Option<watch::Receiver<u64>> {
        Some(self.releases.subscribe(lock))
    }

    async fn ping(&self) -> Result<()> {
        let pings = join_all(self.masters.iter().map(|master| {
            let mut conn = master.conn.clone();
            async move {
                tokio::time::timeout(
                    MAX_MASTER_TIMEOUT,
                    redis::cmd("PING").query_async::<String>(&mut conn),
                )
                .await
                .map_err(|_| Error::Timeout(MAX_MASTER_TIMEOUT))
                .and_then(|r| r.map(|_| Value::Okay).map_err(map_err))
            }
        }))
        .await;
        let answered = pings.iter().filter(|r| r.is_ok()).count();
        if answered < self.quorum() {
            return Err(self.no_quorum(answered, &pings));
        }
        Ok(())
    }
}

#[async_trait]
impl Upkeep for RedlockDriver {
    /// Every master must forget the lock, or its counter would outvote a fresh start later.
    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        for master in &self.masters {
            crate::drivers::redis::delete_keys(&mut master.conn.clone(), &self.keys, locks).await?;
        }
        Ok(())
    }

    /// Released on every master, each matched as a release is: a master where another holder
    /// took the lock meanwhile keeps that holder's lease, so no majority is taken from under
    /// it while the deletion goes from master to master.
    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        crate::driver::deleted_as_released(lease, self.release(lease).await?)
    }

    /// A key is held where a majority of the masters has its lease; masters that do not
    /// answer count as not having it, and without a majority answering nothing is counted.
    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        let listed = join_all(self.masters.iter().map(|master| {
            let mut conn = master.conn.clone();
            async move {
                tokio::time::timeout(
                    MAX_MASTER_TIMEOUT,
                    crate::drivers::redis::held_key_leases(&mut conn, &self.keys, family),
                )
                .await
                .map_err(|_| Error::Timeout(MAX_MASTER_TIMEOUT))
                .and_then(|held| held)
            }
        }))
        .await;
        let answered: Vec<_> = listed.iter().filter_map(|l| l.as_ref().ok()).collect();
        if answered.len() < self.quorum() {
            return Err(self.no_quorum(answered.len(), &listed));
        }
        let mut votes: std::collections::HashMap<&str, usize> = Default::default();
        for key in answered.iter().flat_map(|held| held.iter()) {
            *votes.entry(key).or_default() += 1;
        }
        Ok(Some(
            votes.values().filter(|&&n| n >= self.quorum()).count() as u64,
        ))
    }

    async fn warnings(&self) -> Result<Vec<String>> {
        let mut warnings = Vec::new();
        for (i, master) in self.masters.iter().enumerate() {
            // Each master's restart guard needs INFO, as single Redis's does.
            if let Ok(found) =
                crate::drivers::redis::lock_key_warnings(&mut master.conn.clone()).await
            {
                warnings.extend(found.into_iter().map(|w| format!("master {}: {w}", i + 1)));
            }
        }
        Ok(warnings)
    }
}
