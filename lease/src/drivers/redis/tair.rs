//! Tair's versioned put, the seeds' fourth lock (`tair://`): the lease is an `exstrtype` value
//! whose version moves on every write, taken, renewed and released with the TairString
//! commands instead of Lua.
//!
//! - **Acquire**: `EXSET lease "TOKEN:IDENTITY" PX ttl NX ABS VERSION WITHVERSION`, which only
//!   succeeds on an absent (or expired) key, then `INCR` of the lock's token counter (a plain
//!   key, kept for ever for a declared lock; a family's key's expires, see [`CounterKept`]), in
//!   one round trip. The `EXSET` names the token this driver expects
//!   the `INCR` to draw (one above the counter it last saw; a first attempt on a lock reads the
//!   counter first). When the draw is the token guessed, the counter stood one below it when
//!   the claim had already landed: every token drawn before the claim is smaller, and every
//!   later holder draws after this one, so tokens strictly increase. A claim under a wrong
//!   guess is undone (`EXCAD`) and tried again above the counter's new value.
//!   The claim sets the key's version from the token (`ABS`, see [`first_version`]):
//!   TairString starts each new key at version 1, so without that a holder whose key expired
//!   and was taken again would find its old version on the new holder's key.
//! - **Renew**: `EXCAS lease VALUE VERSION PX ttl` with the version this holder last saw; the
//!   version moves on each renewal, and versions never repeat across holdings, so a holder
//!   whose version is stale has lost the lock.
//! - **Release**: `EXCAD lease VERSION`, pipelined with a notice on the release channel (as on
//!   Redis).
//! - **Observe**: `EXGET` and `PTTL`.
//!
//! **Restarts and failovers.** A server without persistence (or with `appendfsync everysec`)
//! comes back without leases their holders still claim, and without the token counters; a
//! promoted standby may lack the last writes of the primary it replaces, durable or not. As on
//! Redis ([`crate::drivers::redis::ACQUIRE`]), such a server grants no free lock for one lease and raises
//! the counters above every earlier token; without Lua the driver does it itself. It learns the
//! server's incarnation (its replication ID, new at every start and every promotion, failbacks
//! included), and every claim carries an `INFO replication` in its round trip: a claim that
//! landed on another incarnation (a reconnect to a restarted server, a standby promoted behind
//! the same address, a primary demoted and promoted again under an open connection) is undone,
//! and the new incarnation is checked before the next claim. A replica is never taken for an
//! incarnation. The epoch record `PREFIX:epoch:tair` holds the incarnation the last check ran
//! on, from when it grants (`since`) and its token floor.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::Value;
use tokio::sync::watch;

use crate::driver::{Acquire, ChangeFeeds, Driver, Holding, Lease, Pruned, Upkeep};
use crate::drivers::redis::FLOOR_STEP;
use crate::drivers::redis::connection::ServerConnection;
use crate::drivers::redis::durability::Durability;
use crate::drivers::redis::{
    KEY_COUNTER_RETENTION, KeyLayout, client, connection, delete_keys, held_key_leases, info_field,
    lease_value, listen_for_releases, lock_key_warnings, map_err, ms, parse_holding, passing,
};
use crate::error::{Error, Result};

/// Tair, or Redis with the TairString module, locked with its versioned put
/// (`EXSET`/`EXCAS`/`EXCAD`): `tair://[user:password@]host[:port][/db][?prefix=NAME]`;
/// `tairs://...[&ca=PATH][&cert=PATH&key=PATH]` over TLS, as `rediss://`. `url` is the
/// `redis://` (or `rediss://`) URL that reaches it.
#[derive(Clone, PartialEq, Eq)]
pub struct TairConfig {
    pub url: url::Url,
    pub prefix: String,
    pub tls: Option<crate::tls::Tls>,
}

/// How many claims one acquisition sends: a wrong token guess, an incarnation not yet checked and
/// a counter below the epoch's floor each cost one more.
const CLAIM_ATTEMPTS: usize = 5;
/// How long an epoch's check waits for the attached standbys to acknowledge its record.
const STANDBY_WAIT: Duration = Duration::from_millis(200);
/// How long a server that refuses `INFO` (no restart guard) goes before it is asked again.
const INFO_REFUSED_RECHECK: Duration = Duration::from_secs(60);
/// Holdings of one lock between two repeats of a version (see [`first_version`]): the last
/// place's first version, (2^31 - 1) x 2^32, leaves 2^32 renewals below `i64::MAX`.
const VERSION_CYCLE: u64 = (1 << 31) - 1;
/// The locks whose counters one driver remembers.
const MAX_REMEMBERED_COUNTERS: usize = 10_000;

/// The commands a server must have for `tair://`.
pub const TAIR_COMMANDS: [&str; 4] = ["EXSET", "EXGET", "EXCAS", "EXCAD"];

pub struct TairDriver {
    conn: ServerConnection,
    keys: KeyLayout,
    /// The version of each holding's value, as this driver last wrote it: (lock, token).
    versions: Mutex<Versions>,
    /// Each lock's token counter as this driver last saw it, to draw the next token in the
    /// claim's own round trip.
    counters: Mutex<HashMap<String, i64>>,
    /// The incarnation of the server this driver's connection was last checked on.
    epoch: Mutex<Guard>,
    durability: Durability,
    releases: Arc<ChangeFeeds>,
    subscriber: tokio::task::JoinHandle<()>,
    /// To open [`TairDriver::raiser`].
    client: redis::Client,
    /// A connection of the counters' raises alone: `WATCH` holds for a whole connection, so no
    /// other call may share it. Opened at the first raise, and again after one failed or was cut
    /// short.
    raiser: tokio::sync::Mutex<Option<redis::aio::MultiplexedConnection>>,
}

impl Drop for TairDriver {
    fn drop(&mut self) {
        self.subscriber.abort();
    }
}

/// Each holding's version, and until when its lease runs at most. A holding whose engine lost
/// it without a word to the driver (renewals that failed until its lease ran out) is dropped
/// as the map grows ([`Pruned`]): keyed locks are named at run time, without bound.
#[derive(Default)]
struct Versions {
    by_holding: Pruned<(String, u64), Versioned>,
}

#[derive(Clone, Copy)]
struct Versioned {
    version: i64,
    /// The lease written with this version ends by then, or before: this is taken once the
    /// write has been answered, and a holding is dropped only once it has passed.
    until: Instant,
}

impl Versions {
    fn wrote(&mut self, holding: (String, u64), version: i64, ttl: Duration) {
        let now = Instant::now();
        self.by_holding.prune(|v| v.until > now);
        self.by_holding.insert(
            holding,
            Versioned {
                version,
                until: now + ttl,
            },
        );
    }

    fn get(&self, holding: &(String, u64)) -> Option<i64> {
        self.by_holding.get(holding).map(|v| v.version)
    }

    fn remove(&mut self, holding: &(String, u64)) -> Option<i64> {
        self.by_holding.remove(holding).map(|v| v.version)
    }
}

/// Whether the server refused `INFO` for good (renamed, or not permitted to the
/// lock's user), so that the driver goes without a restart guard. A server that only cannot
/// answer now (loading its data after a restart, failing over, busy with a script) refused
/// nothing: taken for a refusal, it left the driver unguarded for [`INFO_REFUSED_RECHECK`],
/// in which a restart that lost a lease could hand the lock to a second holder.
fn refuses_info(e: &redis::RedisError) -> bool {
    matches!(e.kind(), redis::ErrorKind::Server(_)) && !passing(e)
}

/// What the driver knows of the server's incarnation.
enum Guard {
    /// Not checked on the current connection yet.
    Unknown,
    /// Checked: claims are on this incarnation while each claim's `INFO replication` says so.
    Known(Arc<Epoch>),
    /// The server refuses `INFO`: no guard, and the lock's warnings say so.
    Refused(Instant),
}

/// One incarnation of the server, as the epoch record describes it.
#[derive(Clone, Debug)]
struct Epoch {
    /// The incarnation: the server's replication ID when it was checked.
    replid: String,
    /// The server's clock (µs) from which it may lack leases: no free lock before one lease on.
    since_us: i64,
    /// Every token of this incarnation is above it.
    floor: i64,
    /// The server's clock (µs) when `learned`, to tell its time later without asking.
    server_us: i64,
    learned: Instant,
}

impl Epoch {
    /// Whether `info` (`INFO replication`, answered in a claim's round trip) is this
    /// incarnation's, as a primary.
    fn is_current(&self, info: &Value) -> bool {
        <String as redis::FromRedisValue>::from_redis_value_ref(info)
            .ok()
            .and_then(|info| Replication::read(&info).ok())
            .is_some_and(|now| now.replid == self.replid)
    }

    /// How long a free lock is still not granted under a lease of `ttl`.
    fn waiting(&self, ttl: Duration) -> Option<Duration> {
        let now = self.server_us + self.learned.elapsed().as_micros() as i64;
        let left = self.since_us + ttl.as_micros() as i64 - now;
        (left > 0).then(|| Duration::from_micros(left as u64))
    }
}

/// The epoch record's fields: the incarnation, `since`, the floor, and whether an incarnation
/// kept its data ("INCARNATION 1": durable as it began, and found so by every check since; a
/// field naming another incarnation was left by a driver of an earlier version, which writes
/// no such field, and says nothing).
type EpochRecord = (Option<String>, Option<i64>, Option<i64>, Option<String>);

/// What `INFO replication` tells of the server's incarnation.
struct Replication {
    /// `master_replid`: new at every start and every promotion.
    replid: String,
    /// `second_repl_offset` is set: a standby promoted since it started.
    promoted: bool,
}

impl Replication {
    /// The incarnation of a master; a replica is none (its writes fail, and once promoted it is
    /// a new one), and a server that names no role or no replication ID is an error.
    fn read(info: &str) -> Result<Self> {
        match info_field(info, "role") {
            Some("master") => {}
            Some(_) => {
                return Err(Error::Unreachable(
                    "the server is a replica: tair:// needs the primary".into(),
                ));
            }
            None => {
                return Err(Error::Backend(
                    "INFO replication names no role: the driver cannot tell a primary".into(),
                ));
            }
        }
        let replid = info_field(info, "master_replid")
            .ok_or_else(|| Error::Backend("INFO replication names no master_replid".into()))?;
        Ok(Self {
            replid: replid.to_owned(),
            promoted: info_field(info, "second_repl_offset").is_some_and(|o| o != "-1"),
        })
    }
}

/// The standbys that `INFO replication` lists in sync (`state=online`).
fn standbys_in_sync(replication: &str) -> usize {
    replication
        .lines()
        .filter(|line| line.starts_with("slave") && line.contains(":ip="))
        .filter(|line| {
            line.split([':', ','])
                .any(|part| part.trim() == "state=online")
        })
        .count()
}

/// The epoch record's `durable` field for `replid`: the incarnation it speaks of, and "1" or
/// "0".
fn durable_field(replid: &str, durable: bool) -> String {
    format!("{replid} {}", u8::from(durable))
}

/// `TIME`'s answer in microseconds.
fn micros(time: &[String]) -> Result<i64> {
    match time {
        [secs, us] => match (secs.parse::<i64>(), us.parse::<i64>()) {
            (Ok(secs), Ok(us)) => Ok(secs * 1_000_000 + us),
            _ => Err(Error::Backend(format!("TIME answered {time:?}"))),
        },
        _ => Err(Error::Backend(format!("TIME answered {time:?}"))),
    }
}

/// The epoch after a check on a server whose incarnation is `replid`, up for `uptime_s`, at
/// `now` (µs), given the record's (replid, since, floor, durable field): the same rule as
/// Redis's acquire script. A durable server that was never promoted,
/// restarted after an incarnation that was durable too, lost nothing; one that may have lost
/// data (not durable, restarted after an incarnation that was not, which the restarted server's
/// settings do not tell, or `promoted` from a standby, which may lack the old primary's last
/// writes however it persists its own) grants no free lock for a lease (from its start when it
/// was never promoted and nothing was recorded before it, else from now: behind one endpoint a
/// standby may have taken over from a master that served until a moment ago), and its tokens
/// start above every earlier one. The last of the three is whether to write the record again,
/// and with which durability (`Some`): when the incarnation changed (as it is found now), or
/// was durable and is found not to be.
fn next_epoch(
    record: (Option<&str>, Option<i64>, Option<i64>, Option<&str>),
    replid: &str,
    promoted: bool,
    uptime_s: i64,
    now: i64,
    durable: bool,
) -> (i64, i64, Option<bool>) {
    let (recorded, since, floor) = (record.0, record.1.unwrap_or(0), record.2.unwrap_or(0));
    // A field of another incarnation than the record names says nothing ([`EpochRecord`]).
    let was_durable = recorded
        .zip(record.3)
        .is_some_and(|(recorded, field)| field == durable_field(recorded, true));
    if recorded == Some(replid) {
        return (since, floor, (was_durable && !durable).then_some(false));
    }
    if durable && !promoted && (recorded.is_none() || was_durable) {
        return (since, floor, Some(durable));
    }
    let since = if recorded.is_some() || promoted {
        now
    } else {
        now - started_at_most_ago_s(uptime_s) * 1_000_000
    };
    (since, now.max(floor + FLOOR_STEP), Some(durable))
}

/// How many whole seconds ago, at most, a server that reports `uptime_s` surely started.
/// `uptime_in_seconds` is the difference of two whole wall-clock seconds (now's and the
/// start's), so it may exceed the time up by almost a second: a server started at x.9 s reports
/// 1 at x+1.0 s. Counting from `uptime_s` would end a restarted server's wait up to a second
/// early, while a holder that renewed just before the crash still claims (two holders in the
/// suite's Tair restart check).
pub(crate) fn started_at_most_ago_s(uptime_s: i64) -> i64 {
    (uptime_s - 1).max(0)
}

/// What a server without the TairString commands means.
fn lacking(commands: &str) -> Error {
    Error::Backend(format!(
        "the server lacks {commands}: tair:// needs Tair or Redis with the TairString module loaded (a plain Redis is redis://)"
    ))
}

/// [`map_err`], with an unknown command said in words.
fn tair_err(e: redis::RedisError) -> Error {
    let text = e.to_string();
    if text.contains("unknown command") {
        return lacking(&TAIR_COMMANDS.join(", "));
    }
    map_err(e)
}

impl TairDriver {
    /// Connect lazily to the Tair (or Redis with the TairString module) at `url` (a `redis://`
    /// URL, or over TLS a `rediss://` one with `tls`'s CA and client pair).
    pub fn connect(url: &url::Url, prefix: &str, tls: Option<&crate::tls::Tls>) -> Result<Self> {
        let client = client(url, tls)?;
        let conn = connection(&client)?;
        let keys = KeyLayout::new(prefix);
        let releases = Arc::new(ChangeFeeds::default());
        let subscriber = tokio::spawn(listen_for_releases(
            client.clone(),
            keys.clone(),
            releases.clone(),
        ));
        Ok(Self {
            conn,
            keys,
            versions: Mutex::default(),
            counters: Mutex::default(),
            epoch: Mutex::new(Guard::Unknown),
            durability: Durability::default(),
            releases,
            subscriber,
            client,
            raiser: tokio::sync::Mutex::default(),
        })
    }

    /// Raise `lock`'s counter to `floor` unless it is there already, and say where it stands
    /// (`None`: not known, the counter gone or moving; the next claim draws again). Compared
    /// and set (`WATCH`, `MULTI`), not added to: two drivers adding what each found missing, or
    /// one that adds late (paused past its claim while another raised), would put the counter
    /// as far above the floor as it was below, ahead of the clock from which the next epoch's
    /// floor comes, and tokens would go back after the next failover. A family key's counter
    /// keeps expiring (`keep`), as its claims keep it.
    async fn raise_counter(
        &self,
        lock: &str,
        floor: i64,
        keep: Option<&CounterKept>,
    ) -> Result<Option<i64>> {
        let mut raiser = self.raiser.lock().await;
        // Out of its place while in use, and put back only after a raise that ended: a raise
        // cut short leaves a `WATCH` on it, or a server that fell silent, so it goes.
        let mut conn = match raiser.take() {
            Some(conn) => conn,
            None => {
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(crate::drivers::redis::CONNECT_TIMEOUT))
                    .set_response_timeout(Some(crate::drivers::redis::RESPONSE_TIMEOUT));
                self.client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map_err(tair_err)?
            }
        };
        let conn = &mut conn;
        let key = self.keys.token(lock);
        let raised: redis::RedisResult<Option<i64>> = async {
            for _ in 0..CLAIM_ATTEMPTS {
                let (): () = redis::cmd("WATCH").arg(&key).query_async(conn).await?;
                let counter: Option<i64> = redis::cmd("GET").arg(&key).query_async(conn).await?;
                if counter.is_none_or(|counter| counter >= floor) {
                    let (): () = redis::cmd("UNWATCH").query_async(conn).await?;
                    return Ok(counter);
                }
                let mut raise = redis::pipe();
                raise.atomic().cmd("SET").arg(&key).arg(floor).ignore();
                if let Some(keep) = keep {
                    raise.cmd("PEXPIRE").arg(&key).arg(keep.for_ms).ignore();
                }
                let done: Value = raise.query_async(conn).await?;
                if done != Value::Nil {
                    return Ok(Some(floor));
                }
                // Drawn from or raised meanwhile: look again.
            }
            // Others keep drawing: the next claim draws again, above the floor or not.
            Ok(None)
        }
        .await;
        if raised.is_ok() {
            *raiser = Some(conn.clone());
        }
        raised.map_err(tair_err)
    }

    fn versions(&self) -> std::sync::MutexGuard<'_, Versions> {
        self.versions.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn predicted_token(&self, lock: &str) -> Option<i64> {
        let counters = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        counters.get(lock).map(|c| c + 1)
    }

    fn saw_counter(&self, lock: &str, counter: i64) {
        let mut counters = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        // A guess is only worth a round trip: a driver that has seen more locks than this
        // forgets them all rather than grow.
        if let Some(known) = counters.get_mut(lock) {
            *known = counter;
            return;
        }
        if counters.len() >= MAX_REMEMBERED_COUNTERS {
            counters.clear();
        }
        counters.insert(lock.to_owned(), counter);
    }

    /// `EXCAD` of `version` with the release notice in one round trip; should the delete fail,
    /// waiters woken for nothing find the lock held and wait again. True when deleted. A notice
    /// the server refuses (an ACL without the release channels) leaves waiters to their next
    /// poll, and the deletion stands.
    async fn delete_and_announce(
        &self,
        conn: &mut ServerConnection,
        lock: &str,
        version: i64,
    ) -> Result<bool> {
        let (deleted, _): (redis::RedisResult<i64>, redis::RedisResult<i64>) = redis::pipe()
            .cmd("EXCAD")
            .arg(self.keys.lease(lock))
            .arg(version)
            .cmd("PUBLISH")
            .arg(self.keys.released_channel(lock))
            .arg(1)
            .ignore_errors()
            .query_async(conn)
            .await
            .map_err(|e| self.call_failed(e))?;
        Ok(deleted.map_err(|e| self.call_failed(e))? == 1)
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, Guard> {
        self.epoch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`tair_err`] for a lock call: a server that turned replica under the checked connection
    /// (a failover that kept it open) is a new incarnation once it is promoted again, so the
    /// connection is checked again before the next claim.
    fn call_failed(&self, e: redis::RedisError) -> Error {
        if e.code() == Some("READONLY") {
            *self.guard() = Guard::Unknown;
        }
        tair_err(e)
    }

    /// The incarnation the connection is checked on; `None` where the server refuses the check.
    async fn epoch(&self, conn: &mut ServerConnection) -> Result<Option<Arc<Epoch>>> {
        match &*self.guard() {
            Guard::Known(epoch) => return Ok(Some(Arc::clone(epoch))),
            Guard::Refused(at) if at.elapsed() < INFO_REFUSED_RECHECK => return Ok(None),
            _ => {}
        }
        let learned = self.learn(conn).await?.map(Arc::new);
        *self.guard() = match &learned {
            Some(epoch) => Guard::Known(Arc::clone(epoch)),
            None => Guard::Refused(Instant::now()),
        };
        Ok(learned)
    }

    /// Check the server's incarnation on the current connection and bring the epoch record up
    /// to date.
    async fn learn(&self, conn: &mut ServerConnection) -> Result<Option<Epoch>> {
        for _ in 0..3 {
            let info: String = match redis::cmd("INFO")
                .arg("replication")
                .query_async(conn)
                .await
            {
                Ok(info) => info,
                Err(e) if refuses_info(&e) => return Ok(None),
                Err(e) => return Err(tair_err(e)),
            };
            let expected = Replication::read(&info)?.replid;
            // Read, not cached: a new incarnation may be another server (a standby promoted
            // behind the address), of which the answer about the one before says nothing.
            let durable = self
                .durability
                .read(conn, "")
                .await
                .map_err(tair_err)?
                .durable;
            // The facts in one round trip: they are about one connection, so one incarnation,
            // even if the connection was replaced since the first INFO.
            let checked: redis::RedisResult<(String, String, Vec<String>, EpochRecord)> =
                redis::pipe()
                    .cmd("INFO")
                    .arg("replication")
                    .cmd("INFO")
                    .arg("server")
                    .cmd("TIME")
                    .cmd("HMGET")
                    .arg(self.keys.tair_epoch())
                    .arg("replid")
                    .arg("since")
                    .arg("floor")
                    .arg("durable")
                    .query_async(conn)
                    .await;
            let (replication, info, time, record) = match checked {
                Ok(checked) => checked,
                Err(e) if refuses_info(&e) => return Ok(None),
                Err(e) => return Err(tair_err(e)),
            };
            let replication_info = replication;
            let replication = Replication::read(&replication_info)?;
            if replication.replid != expected {
                continue;
            }
            let learned = Instant::now();
            let now = micros(&time)?;
            let uptime = info_field(&info, "uptime_in_seconds")
                .and_then(|u| u.parse().ok())
                .unwrap_or(0);
            let (since, floor, written) = next_epoch(
                (record.0.as_deref(), record.1, record.2, record.3.as_deref()),
                &expected,
                replication.promoted,
                uptime,
                now,
                durable,
            );
            // With standbys in sync, the record is written where they are waited for.
            let standbys = standbys_in_sync(&replication_info);
            if let Some(kept) = written
                && standbys == 0
            {
                let _: () = redis::cmd("HSET")
                    .arg(self.keys.tair_epoch())
                    .arg("replid")
                    .arg(&expected)
                    .arg("since")
                    .arg(since)
                    .arg("floor")
                    .arg(floor)
                    .arg("durable")
                    .arg(durable_field(&expected, kept))
                    .query_async(conn)
                    .await
                    .map_err(tair_err)?;
            }
            // Whether the incarnation was durable is written only where it changed: a
            // driver whose reading is older must not turn another's "0" back into "1".
            self.standbys_have_the_record(conn, standbys, (&expected, since, floor, written))
                .await?;
            return Ok(Some(Epoch {
                replid: expected,
                since_us: since,
                floor,
                server_us: now,
                learned,
            }));
        }
        Err(Error::Unreachable(
            "the server changed three times while the driver read which one it is".into(),
        ))
    }

    /// Every healthy standby of the primary has its epoch record (`WAIT`): a standby promoted
    /// without the record would take its floor from the record before, below tokens this epoch
    /// gives. The record is written again first, so that the wait, which counts this
    /// connection's writes, covers it whoever wrote it first. Until they have it, nothing is
    /// granted (the next acquisition checks again). Waited for: every standby in sync
    /// (`state=online`), a cut one too until the primary drops it (`repl-timeout`); one still
    /// in its first sync gets the record with the rest of the stream. A server that refuses
    /// `WAIT` goes on without it, as before. Whether the incarnation was durable is written
    /// only when given (`Some`: this driver found it changed).
    async fn standbys_have_the_record(
        &self,
        conn: &mut ServerConnection,
        healthy: usize,
        record: (&str, i64, i64, Option<bool>),
    ) -> Result<()> {
        if healthy == 0 {
            return Ok(());
        }
        let (replid, since, floor, durable) = record;
        let mut write = redis::cmd("HSET");
        write
            .arg(self.keys.tair_epoch())
            .arg("replid")
            .arg(replid)
            .arg("since")
            .arg(since)
            .arg("floor")
            .arg(floor);
        if let Some(durable) = durable {
            write.arg("durable").arg(durable_field(replid, durable));
        }
        let waited: redis::RedisResult<(i64,)> = redis::pipe()
            .add_command(write)
            .ignore()
            .cmd("WAIT")
            .arg(healthy)
            .arg(ms(STANDBY_WAIT))
            .query_async(conn)
            .await;
        let acknowledged = match waited {
            Ok((acknowledged,)) => acknowledged,
            Err(e) if refuses_info(&e) => {
                tracing::warn!(error = %e, "the server refuses WAIT: a standby promoted before it has the epoch record could repeat tokens");
                return Ok(());
            }
            Err(e) => return Err(tair_err(e)),
        };
        if acknowledged < healthy as i64 {
            return Err(Error::Unreachable(format!(
                "{acknowledged} of the primary's {healthy} standbys in sync acknowledged its epoch record within {STANDBY_WAIT:?}: no lock is granted until every one has it (a standby promoted without it could repeat tokens)"
            )));
        }
        Ok(())
    }

    /// A server without the TairString commands answers every lock call with an unknown
    /// command: say which are missing, once, in words.
    async fn missing_commands(&self) -> Result<Vec<&'static str>> {
        let mut missing = Vec::new();
        for command in TAIR_COMMANDS {
            let info: Value = redis::cmd("COMMAND")
                .arg("INFO")
                .arg(command)
                .query_async(&mut self.conn.clone())
                .await
                .map_err(map_err)?;
            let known = match info {
                Value::Array(items) => items.first().is_some_and(|i| *i != Value::Nil),
                _ => false,
            };
            if !known {
                missing.push(command);
            }
        }
        Ok(missing)
    }
}

/// The server's clock in microseconds, as the checked epoch tells it; where the server refuses
/// the check, this machine's clock (a family key's counter only needs a clock within a day of
/// the server's, see [`CounterKept`]).
fn server_clock(epoch: Option<&Epoch>) -> i64 {
    match epoch {
        Some(epoch) => epoch.server_us + epoch.learned.elapsed().as_micros() as i64,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64),
    }
}

/// A family's key has a token counter of its own (keys are chosen at run time, without bound),
/// and it expires: [`KEY_COUNTER_RETENTION`] after the key's last claim, later by as much as
/// the token runs ahead of the clock (a floor raised by restarts), so that an idle key leaves
/// nothing. A counter that is gone starts again at the clock in microseconds (`SET NX`, in the
/// claim's round trip), which by then is past every token it gave; a counter that is there is
/// left alone. A sidecar of a version before this one starts such a counter at 1: during a
/// rolling upgrade from one, a key idle for a day may be given a token below its earlier ones.
struct CounterKept {
    /// What a counter that is gone starts at: the clock, or above it the counter's value as
    /// last seen (which a counter that really expired has long passed).
    start: i64,
    for_ms: u64,
}

impl CounterKept {
    /// For a claim of `token` at `now`, in an epoch whose tokens are above `floor` (the tokens
    /// that run ahead of the clock are the floor's and those drawn just after it).
    fn at(now: i64, token: i64, floor: i64) -> Self {
        let ahead_ms = ((token.max(floor) - now).max(0) as u64).div_ceil(1000);
        Self {
            start: now.max(token - 1),
            for_ms: ms(KEY_COUNTER_RETENTION) + ahead_ms,
        }
    }
}

/// The version a holding starts at: its token's place in a cycle of 2^31 - 1 holdings, times 2^32,
/// so that versions do not repeat across holdings. TairString starts every new key at version
/// 1, and `EXCAS`/`EXCAD` compare the version alone: a holder whose key expired and was taken
/// again would otherwise renew or delete the new holder's key once that key reached the same
/// version, and both would claim the lock. Within one epoch a version comes back only after
/// 2^31 - 1 holdings of the lock, or a holding renewed 2^32 times; tokens below 2^31 keep the
/// version TOKEN x 2^32. A restarted server's tokens start at its clock in microseconds, far
/// past 2^31, hence the cycle (the holders of the epoch before have stopped claiming by the
/// time the new one grants).
fn first_version(token: u64) -> i64 {
    (((token.max(1) - 1) % VERSION_CYCLE + 1) << 32) as i64
}

#[async_trait]
impl Driver for TairDriver {
    fn kind(&self) -> &'static str {
        "tair"
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        let mut conn = self.conn.clone();
        let mut epoch = self.epoch(&mut conn).await?;
        let expires = crate::names::family_of(lock).is_some();
        // The token is one above the counter as this driver last saw it, most likely. A first
        // attempt on a lock reads the counter first; a family's key without one will start it
        // at the clock.
        let mut token = match self.predicted_token(lock) {
            Some(token) => token,
            None => {
                let counter: Option<i64> = redis::cmd("GET")
                    .arg(self.keys.token(lock))
                    .query_async(&mut conn)
                    .await
                    .map_err(tair_err)?;
                match counter {
                    Some(counter) => counter + 1,
                    None if expires => server_clock(epoch.as_deref()) + 1,
                    None => 1,
                }
            }
        };
        for _ in 0..CLAIM_ATTEMPTS {
            if let Some(left) = epoch.as_ref().and_then(|e| e.waiting(ttl)) {
                // A server that may have lost leases their holders still claim: a held lock is
                // busy as ever, a free one is not granted yet.
                return Ok(match self.observe(lock).await? {
                    Some(holder) => Acquire::Busy(Some(holder)),
                    None => Acquire::Withheld(crate::driver::Withheld {
                        reason: crate::driver::RESTART_GUARD.to_owned(),
                        resume_in: Some(left),
                    }),
                });
            }
            let lease = Lease {
                lock: lock.to_owned(),
                identity: identity.to_owned(),
                token: token as u64,
            };
            // The server's incarnation (unless it refuses the guard), the claim under the
            // guessed token, and the draw after it, in one round trip; for a family's key, its
            // counter started at the clock should it be gone, and kept a while after the draw.
            let mut pipe = redis::pipe();
            if epoch.is_some() {
                pipe.cmd("INFO").arg("replication");
            }
            let kept = expires.then(|| {
                let floor = epoch.as_ref().map_or(0, |e| e.floor);
                CounterKept::at(server_clock(epoch.as_deref()), token, floor)
            });
            if let Some(kept) = &kept {
                pipe.cmd("SET")
                    .arg(self.keys.token(lock))
                    .arg(kept.start)
                    .arg("NX")
                    .arg("PX")
                    .arg(kept.for_ms)
                    .ignore();
            }
            pipe.cmd("EXSET")
                .arg(self.keys.lease(lock))
                .arg(lease_value(&lease))
                .arg("PX")
                .arg(ms(ttl))
                .arg("NX")
                .arg("ABS")
                .arg(first_version(lease.token))
                .arg("WITHVERSION")
                .cmd("INCR")
                .arg(self.keys.token(lock));
            if let Some(kept) = &kept {
                pipe.cmd("PEXPIRE")
                    .arg(self.keys.token(lock))
                    .arg(kept.for_ms)
                    .ignore();
            }
            let replies: Vec<Value> = pipe
                .query_async(&mut conn)
                .await
                .map_err(|e| self.call_failed(e))?;
            let (name, set, drawn) = match (&epoch, replies.as_slice()) {
                (Some(_), [name, set, drawn]) => (Some(name), set, drawn),
                (None, [set, drawn]) => (None, set, drawn),
                _ => {
                    return Err(Error::Backend(format!(
                        "the claim's pipeline answered {replies:?}"
                    )));
                }
            };
            let ours =
                <i64 as redis::FromRedisValue>::from_redis_value_ref(drawn).map_err(|e| {
                    Error::Backend(format!("the claim's pipeline answered {replies:?}: {e}"))
                })?;
            self.saw_counter(lock, ours);
            let claimed = match set {
                Value::Int(version) => Some(*version),
                _ => None,
            };
            if let (Some(checked), Some(info)) = (&epoch, name)
                && !checked.is_current(info)
            {
                // Another incarnation than the one checked: a restarted or promoted server.
                if let Some(version) = claimed {
                    self.delete_and_announce(&mut conn, lock, version).await?;
                }
                *self.guard() = Guard::Unknown;
                epoch = self.epoch(&mut conn).await?;
                token = ours + 1;
                continue;
            }
            let Some(version) = claimed else {
                return Ok(Acquire::Busy(self.observe(lock).await?));
            };
            // The draw came after the claim: when it is the token guessed, every token drawn
            // before the claim is below it, and every later holder draws after this one.
            let floor = epoch.as_ref().map_or(0, |e| e.floor);
            if ours == token && ours > floor {
                self.versions()
                    .wrote((lock.to_owned(), lease.token), version, ttl);
                return Ok(Acquire::Acquired(lease));
            }
            // A claim under a token that is not ours (the guess was wrong: an earlier holder
            // may have drawn it), or one below the epoch's floor (the counter may have gone
            // back with the server's data): undone, never held.
            let mut next = ours;
            if ours <= floor {
                // Raised while the claim is held, so that other drivers seldom find the
                // counter below the floor meanwhile.
                let raised = self.raise_counter(lock, floor, kept.as_ref()).await;
                // Undone whatever the raise's fate: the claim is never held.
                self.delete_and_announce(&mut conn, lock, version).await?;
                if let Some(counter) = raised? {
                    next = counter;
                    self.saw_counter(lock, next);
                }
            } else {
                self.delete_and_announce(&mut conn, lock, version).await?;
            }
            token = next + 1;
        }
        Ok(Acquire::Busy(None))
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let key = (lease.lock.clone(), lease.token);
        let Some(mut version) = self.versions().get(&key) else {
            return Ok(false);
        };
        let value = lease_value(lease);
        let mut resent = false;
        loop {
            let reply: Value = redis::cmd("EXCAS")
                .arg(self.keys.lease(&lease.lock))
                .arg(&value)
                .arg(version)
                .arg("PX")
                .arg(ms(ttl))
                .query_async(&mut self.conn.clone())
                .await
                .map_err(|e| self.call_failed(e))?;
            let Value::Array(items) = reply else {
                // -1: the key is gone.
                self.versions().remove(&key);
                return Ok(false);
            };
            match (items.first(), items.get(1), items.get(2)) {
                (Some(Value::Okay), _, Some(Value::Int(next))) => {
                    self.versions().wrote(key, *next, ttl);
                    return Ok(true);
                }
                // Another version of this lease's own value: a renewal whose answer was lost
                // (a timeout, a reset connection) was carried out and raised the version. Sent
                // again at that version, so that the key's expiry counts from this call, as
                // its claim does. Values name the token, which no other holding has.
                (_, Some(Value::BulkString(held)), Some(Value::Int(current)))
                    if !resent && held.as_slice() == value.as_bytes() =>
                {
                    version = *current;
                    resent = true;
                }
                // Another holder's value.
                _ => {
                    self.versions().remove(&key);
                    return Ok(false);
                }
            }
        }
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let key = (lease.lock.clone(), lease.token);
        let Some(version) = self.versions().remove(&key) else {
            return Ok(false);
        };
        let mut conn = self.conn.clone();
        if self
            .delete_and_announce(&mut conn, &lease.lock, version)
            .await?
        {
            return Ok(true);
        }
        // Another version: a renewal whose answer was lost (a timeout, a reset connection) may
        // have been carried out and raised it. Where the key still holds this lease's own value
        // (values name the token, which no other holding has), it goes at the version it has.
        let got: Value = redis::cmd("EXGET")
            .arg(self.keys.lease(&lease.lock))
            .query_async(&mut conn)
            .await
            .map_err(|e| self.call_failed(e))?;
        match got {
            Value::Array(items) => match (items.first(), items.get(1)) {
                (Some(Value::BulkString(held)), Some(Value::Int(current)))
                    if held.as_slice() == lease_value(lease).as_bytes() =>
                {
                    self.delete_and_announce(&mut conn, &lease.lock, *current)
                        .await
                }
                _ => Ok(false),
            },
            _ => Ok(false),
        }
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        let mut conn = self.conn.clone();
        let (got, pttl): (Value, i64) = redis::pipe()
            .cmd("EXGET")
            .arg(self.keys.lease(lock))
            .cmd("PTTL")
            .arg(self.keys.lease(lock))
            .query_async(&mut conn)
            .await
            .map_err(tair_err)?;
        Ok(match got {
            Value::Array(items) => match items.first() {
                Some(Value::BulkString(value)) => parse_holding(value, pttl),
                _ => None,
            },
            _ => None,
        })
    }

    fn changes(&self, lock: &str) -> Option<watch::Receiver<u64>> {
        Some(self.releases.subscribe(lock))
    }

    async fn ping(&self) -> Result<()> {
        let _: String = redis::cmd("PING")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(map_err)?;
        Ok(())
    }
}

#[async_trait]
impl Upkeep for TairDriver {
    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        delete_keys(&mut self.conn.clone(), &self.keys, locks).await
    }

    /// The holding's lease is released, matched as a release is: the deletion itself (the
    /// token counter stays).
    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        crate::driver::deleted_as_released(lease, self.release(lease).await?)
    }

    async fn warnings(&self) -> Result<Vec<String>> {
        lock_key_warnings(&mut self.conn.clone()).await
    }

    /// The lease keys are named as on Redis, so the same `SCAN` finds them; a released key is
    /// deleted (`EXCAD`) and an expired one is gone.
    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        let held = held_key_leases(&mut self.conn.clone(), &self.keys, family).await?;
        Ok(Some(held.len() as u64))
    }

    /// Provisioning checks the server has the commands (the operator reports it).
    async fn provision(&self, _locks: &[String]) -> Result<()> {
        let missing = self.missing_commands().await?;
        if missing.is_empty() {
            Ok(())
        } else {
            Err(lacking(&missing.join(", ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_refusal_for_good_leaves_the_driver_unguarded() {
        let reply = |line: &str| {
            redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
                .and_then(Value::extract_error)
                .expect_err("an error reply")
        };
        for refusal in [
            "NOPERM User lock has no permissions to run the 'info' command",
            "ERR unknown command 'INFO', with args beginning with: 'server'",
        ] {
            assert!(refuses_info(&reply(refusal)), "{refusal}");
        }
        for passing in [
            "LOADING Redis is loading the dataset in memory",
            "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "TRYAGAIN Multiple keys request during rehashing of slot",
        ] {
            assert!(!refuses_info(&reply(passing)), "{passing}");
        }
    }

    #[test]
    fn holdings_whose_lease_ran_out_are_dropped_as_the_map_grows() {
        let mut versions = Versions::default();
        // Lost without a word to the driver: their leases are over.
        for token in 0..100 {
            versions.wrote(("orders.keys.lost".into(), token), 7, Duration::ZERO);
        }
        // Live ones, written while the map keeps doubling.
        for token in 0..100 {
            versions.wrote(
                ("orders.keys.live".into(), token),
                9,
                Duration::from_secs(60),
            );
        }
        assert!(
            versions.by_holding.len() < 150,
            "{} holdings kept",
            versions.by_holding.len()
        );
        for token in 0..100 {
            assert_eq!(versions.get(&("orders.keys.live".into(), token)), Some(9));
        }
        assert_eq!(versions.remove(&("orders.keys.live".into(), 3)), Some(9));
        assert_eq!(versions.get(&("orders.keys.live".into(), 3)), None);
    }

    #[test]
    fn versions_fit_and_repeat_only_after_a_cycle_of_holdings() {
        assert_eq!(first_version(1), 1 << 32);
        // Every place's first version, the last included, is positive and leaves room for
        // 2^32 renewals: TairString refuses a version that is not.
        for token in [VERSION_CYCLE - 1, VERSION_CYCLE, 1 << 31, u64::MAX] {
            let version = first_version(token);
            assert!(
                version > 0 && version.checked_add(u32::MAX as i64).is_some(),
                "{token}: {version}"
            );
        }
        assert_eq!(first_version(VERSION_CYCLE), (VERSION_CYCLE as i64) << 32);
        assert_eq!(first_version(VERSION_CYCLE + 1), 1 << 32);
        // A rebased token (the server's clock in microseconds) still has room for 2^32
        // renewals below i64::MAX.
        let rebased = first_version(1_795_000_000_000_000);
        assert!(rebased > 0 && rebased.checked_add(u32::MAX as i64).is_some());
        assert_ne!(
            first_version(1_795_000_000_000_000),
            first_version(1_795_000_000_000_001)
        );
    }

    #[test]
    fn standbys_waited_for_are_those_in_sync() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:4\r\n\
            slave0:ip=10.0.0.1,port=6379,state=online,offset=100,lag=0\r\n\
            slave1:ip=10.0.0.2,port=6379,state=online,offset=90,lag=1\r\n\
            slave2:ip=10.0.0.3,port=6379,state=wait_bgsave,offset=0,lag=0\r\n\
            slave3:ip=10.0.0.4,port=6379,state=online,offset=5,lag=37\r\n\
            master_replid:abc\r\n";
        assert_eq!(standbys_in_sync(info), 3);
        assert_eq!(standbys_in_sync("role:master\r\nconnected_slaves:0\r\n"), 0);
    }

    /// Standbys promoted a few seconds apart, the last one lagging: its record lacks the floor
    /// its primary set. Its floor must still be above every token of that primary's epoch,
    /// which only the clock can tell it: a floor that ran ahead of the clock (a large step over
    /// the record at each promotion) would come from the stale record alone, and repeat one
    /// already used.
    #[test]
    fn a_lagging_standby_promoted_after_others_still_floors_above_every_token() {
        let start = 1_800_000_000_000_000;
        let second = 1_000_000;
        let floor_at = |record: i64, now: i64| {
            next_epoch(
                (Some("old"), Some(1), Some(record), Some("old 1")),
                "new",
                true,
                100,
                now,
                true,
            )
            .1
        };
        let first = floor_at(start, start + 2 * second);
        let current = floor_at(first, start + 4 * second);
        // The primary of the current epoch drew a thousand tokens on a key before it failed.
        let drawn = current + 1_000;
        let lagging = floor_at(first, start + 6 * second);
        assert!(
            lagging > drawn,
            "a floor of {lagging} after tokens up to {drawn} (floors {first}, {current})"
        );
    }

    #[test]
    fn an_epoch_waits_and_rebases_only_where_data_may_be_lost() {
        let now = 1_800_000_000_000_000;
        let a = (Some("a"), Some(5), Some(7));
        let a_now = (Some("a"), Some(5), Some(now));
        let none = (None, None, None);
        // (record, whether its incarnation was durable, the incarnation now, promoted, uptime,
        // durable now) and the epoch: (since, floor, the durability written with the record
        // where it is written again).
        #[allow(clippy::type_complexity)]
        let cases: [(_, bool, &str, bool, i64, bool, (i64, i64, Option<bool>)); 11] = [
            // The same incarnation: as recorded, written again only when a durable one is
            // found not to be.
            (a, false, "a", false, 100, false, (5, 7, None)),
            (a, true, "a", false, 100, true, (5, 7, None)),
            (a, true, "a", false, 100, false, (5, 7, Some(false))),
            // Durable and never promoted, after a durable incarnation (or none recorded):
            // nothing lost, nothing changes but the incarnation.
            (a, true, "b", false, 100, true, (5, 7, Some(true))),
            (none, false, "b", false, 100, true, (0, 0, Some(true))),
            // Durable now, after an incarnation that was not (made durable for the restart):
            // what the one before lost is gone, so from now, and a floor above the last.
            (
                a_now,
                false,
                "b",
                false,
                100,
                true,
                (now, now + FLOOR_STEP, Some(true)),
            ),
            // Not durable, nothing recorded: from the server's start, which the whole seconds
            // of its uptime may overstate by almost one.
            (
                none,
                false,
                "b",
                false,
                100,
                false,
                (now - 99_000_000, now, Some(false)),
            ),
            (none, false, "b", false, 1, false, (now, now, Some(false))),
            // Not durable, another incarnation recorded: from now, and a floor above the last.
            (
                a_now,
                true,
                "b",
                false,
                100,
                false,
                (now, now + FLOOR_STEP, Some(false)),
            ),
            // A promoted standby, however durable: from now (it served as a replica until a
            // moment ago, whatever its uptime), and a floor above the last.
            (
                a_now,
                true,
                "b",
                true,
                100,
                true,
                (now, now + FLOOR_STEP, Some(true)),
            ),
            (none, false, "b", true, 100, true, (now, now, Some(true))),
        ];
        for (record, was_durable, replid, promoted, uptime, durable, epoch) in cases {
            let (recorded, since, floor) = record;
            let field = recorded.map(|recorded| durable_field(recorded, was_durable));
            assert_eq!(
                next_epoch(
                    (recorded, since, floor, field.as_deref()),
                    replid,
                    promoted,
                    uptime,
                    now,
                    durable
                ),
                epoch,
                "{record:?} (durable: {was_durable}), now {replid} promoted {promoted} up {uptime} s durable {durable}"
            );
        }
        // A field of another incarnation than the record's says nothing of it.
        assert_eq!(
            next_epoch(
                (Some("a"), Some(5), Some(now), Some("before-a 1")),
                "b",
                false,
                100,
                now,
                true
            ),
            (now, now + FLOOR_STEP, Some(true))
        );
    }

    #[test]
    fn info_fields_are_read_by_name() {
        let info = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc123\r\nuptime_in_seconds:42\r\n";
        assert_eq!(info_field(info, "run_id"), Some("abc123"));
        assert_eq!(info_field(info, "uptime_in_seconds"), Some("42"));
        assert_eq!(info_field(info, "run"), None);
    }
}
