//! The Redis family: one master ([`single`]), Redis Cluster (`cluster`), Sentinel
//! ([`sentinel`]), Redlock ([`redlock`]) and Tair ([`tair`]), with their URLs (`urls`). This
//! module holds what they share: the key layout, the Lua scripts, the client and its errors,
//! the release channel's listener, and the clean-up and warning helpers; calls that arrive
//! together go out as one (`acquisitions`, `renewals`, `releases`); `durability` tells a
//! master that loses no acknowledged write from one that can; `connection` replaces a
//! connection the server has fallen silent on.

pub(crate) mod acquisitions;
pub(crate) mod cluster;
pub(crate) mod connection;
pub(crate) mod durability;
pub use cluster::RedisClusterConfig;
pub use single::RedisDriver;
pub mod redlock;
pub(crate) mod releases;
pub(crate) mod renewals;
pub mod sentinel;
pub mod single;
pub mod tair;
mod urls;
pub use urls::RedisOptions;

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::ConnectionManagerConfig;

use crate::tls::Tls;
use redis::{Script, Value};

use crate::driver::{Acquire, ChangeFeeds, Holding, Lease};
/// How long a renewal waits for others to go out with it in one script call.
pub use crate::drivers::batches::LINGER as RENEWAL_LINGER;
use crate::drivers::redis::durability::Reading;
use crate::error::{Error, Result};

/// One Redis master: `redis://[user:password@]host[:port][/db][?prefix=NAME]`;
/// `rediss://...[&ca=PATH][&cert=PATH&key=PATH]` over TLS (the system's roots without `ca`).
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    pub url: url::Url,
    pub prefix: String,
    pub tls: Option<Tls>,
}

/// How long one Redis round trip may take before the connection is considered dead.
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Bounds of the pause between attempts to re-establish the release subscription.
const RESUBSCRIBE_MIN: Duration = Duration::from_millis(100);
const RESUBSCRIBE_MAX: Duration = Duration::from_secs(2);
/// How often the release subscription's connection is asked whether it still answers.
const SUBSCRIPTION_PING: Duration = Duration::from_secs(5);

/// KEYS: the epoch record, then for each lock in turn its lease, token counter, own counter (the
/// same as the token counter unless the lock is a family's key) and waiters mark
/// ([`KeyLayout::waiters`]). ARGV: how the server keeps its data ([`Keeping::argument`]), how long a key's own counter outlives its
/// last acquisition (ms), then for each lock in turn the identity, the ttl in ms, and "1" when
/// its records expire ([`KeyLayout::records_expire`]).
/// Returns, for each lock: the new token, {current value, remaining ms} when the lock is held,
/// or {false, remaining ms} while the server waits out a lease it may have lost.
///
/// Several locks in one call are acquired exactly as by one call each, back to back: the
/// epoch is checked once, when the first free lock is met ([`crate::drivers::redis::acquisitions`]
/// sends a master's concurrent acquisitions together). On a Redis Cluster a call carries one
/// lock, whose keys (its epoch record included) share its slot.
///
/// The epoch record holds the replication ID of the server the last acquisition ran on. A
/// restarted server and a promoted replica each have a new one; then a lease it granted may be
/// missing (a restart without its data, a replica that never received it), so no free lock is
/// granted for one lease (from the server's start when it was never promoted and has no record,
/// else from now; the start as `uptime_in_seconds` tells it, less the second by which it may
/// overstate the uptime: [`crate::drivers::redis::tair::started_at_most_ago_s`]), and the token
/// counters are raised above every token of earlier epochs (the floor: the server's clock in
/// microseconds, and at least [`FLOOR_STEP`] above the last floor). A durable server that was never
/// promoted, restarted on data it wrote itself, lost nothing: its new epoch begins at once,
/// tokens untouched. What it wrote itself the record tells by its keeper ([`Keeping`]): a replica
/// promoted and restarted before it served the record has another keeper than the master that
/// wrote it, and may lack that master's last writes, so it waits as a promoted replica does.
/// Whether the server that crashed was durable the record tells too (`durable`: its
/// incarnation and "1" or "0", written as an epoch begins, turned to "0" by an acquisition of a
/// free lock that finds the server not durable, and missing in records of earlier versions):
/// the restarted server's settings say nothing of the one before, which an operator may have
/// made durable only for the restart (`appendfsync everysec` turned to `always`), so a record
/// that does not say "1" of the incarnation it names waits. Naming the incarnation keeps a
/// sidecar of an earlier version, which writes a new epoch without the field, from passing the
/// field of the epoch before off as its own.
///
/// A family's keys draw their tokens from the family's counter ([`KeyLayout::counter`]), above
/// the key's own counter where one is left, and leave the token in the key's own counter for
/// [`KEY_COUNTER_RETENTION`]: so a key idle that long has no record left, and a sidecar of an
/// earlier version, which counts on the key's own counter alone, still draws above every
/// token given meanwhile, through a rolling upgrade.
///
/// On a Redis Cluster a family's key has a counter and an epoch record of its own (a script
/// touches one slot), and they expire ([`KeyLayout::records_expire`]): an idle key leaves
/// nothing. Both are kept for [`KEY_COUNTER_RETENTION`] after the key's last free acquisition,
/// and longer by as much as its token (or the epoch's floor) runs ahead of the server's clock
/// in microseconds. A counter that starts afresh starts at that clock, so it starts above every
/// token the key was given before its records expired, as long as the clock of the master
/// serving the slot is not a day behind the one that gave them. (A sidecar of a version before
/// this one starts such a counter at 1 on a durable master, so during a rolling upgrade from
/// one a key idle for a day may be given a lower token.)
///
/// An attempt that finds the lock held marks it as waited for, in the same step, so that the
/// release ([`RELEASE`]) publishes its notice: a release that nobody waits for publishes
/// nothing, and no sidecar's listener is sent it. The mark outlives a waiter's next attempt
/// (waiters try again at least once a lease, and every busy attempt sets it again).
///
/// A lock whose keys are not the script's own (a key of another type under the prefix, a
/// counter that is not a number) fails its own acquisition, with an error that names the keys
/// (`{false, false, why}`: an error reply inside the result fails the whole reply), and no
/// other: Redis keeps a script's writes made before a runtime error, so a whole call
/// failing would leave the leases its earlier acquisitions took held for nobody. A failed epoch
/// check still fails the whole call, before any lease is written: no lock is granted
/// unguarded.
/// The least step of a new epoch's token floor over the recorded one, when the server's clock
/// (in microseconds) is not past it already: one second of the clock. The floor follows the
/// clock, which every server reads, not the record, which a standby promoted before it caught
/// up (or a server restarted from older data) may have from an earlier epoch: a floor that ran
/// ahead of the clock, a large step over the record at each of several failovers close
/// together, would then come from that stale record alone and repeat one already used. The
/// step covers the tokens an epoch draws while the clock stands behind the record.
pub(crate) const FLOOR_STEP: i64 = 1_000_000;

/// How a master keeps its data, as the epoch check of [`ACQUIRE`] is told: whether its own
/// restarts lose nothing, and what tells a restart on data it wrote itself from one on data a
/// failover handed it (a replica promoted, then restarted before it served the lock: it
/// passes for a durable server restarted, yet may lack the old master's last acquisition).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Keeping {
    /// A crash may lose acknowledged writes, or nothing says otherwise: every new epoch waits.
    Lossy,
    /// `appendonly yes`, `appendfsync always`, and nothing to tell who kept the data: one
    /// server, Redlock's masters. `read_on`: [`Reading::on`].
    Durable { read_on: String },
    /// Durable behind Sentinel: the master's address and the sentinels' configuration epoch
    /// for it, which every failover raises (and a restart keeps). The epoch alone repeats when
    /// the sentinels are set up afresh; the address changes with every failover. A record
    /// missing is trusted only at epoch 0 (these sentinels never failed over): else the wait
    /// counts from the server's start.
    DurableBehindSentinel {
        address: String,
        failovers: u64,
        read_on: String,
    },
    /// Durable Redis Cluster nodes: the node's ID and configuration epoch, which the script
    /// reads (`CLUSTER MYID`, `CLUSTER INFO`), kept in `nodes.conf` across restarts and raised
    /// when a replica takes a shard over. A lock's record missing is trusted (idle records
    /// expire after a day, and a node just started would otherwise hold every such lock for a
    /// lease).
    DurableClusterNode { read_on: String },
}

impl Keeping {
    /// How a server keeps its data as a durability reading tells it: `durable` is the
    /// variant to take where the reading says durable.
    pub(crate) fn from_reading(reading: Reading, durable: impl FnOnce(String) -> Keeping) -> Self {
        if reading.durable {
            durable(reading.on)
        } else {
            Keeping::Lossy
        }
    }

    /// One keeping for a batch of acquisitions sent in one call: theirs where they agree on how
    /// the server keeps its data (each reading's incarnations count: each said durable on its
    /// own), else [`Keeping::Lossy`].
    pub(crate) fn for_batch<'a>(mut all: impl Iterator<Item = &'a Keeping>) -> Keeping {
        let Some(first) = all.next() else {
            return Keeping::Lossy;
        };
        let (kind, first_read_on) = first.split();
        let mut readings = vec![first_read_on];
        for other in all {
            let (other_kind, other_read_on) = other.split();
            if other_kind != kind {
                return Keeping::Lossy;
            }
            readings.push(other_read_on);
        }
        // A settled request's reading is the last word for it; for the others the joined
        // reading is then too: an incarnation none lists counts as not durable (safe, at worst
        // a wait).
        let settled = readings.iter().any(|r| r.starts_with('!'));
        let mut read_on: Vec<&str> = Vec::new();
        for replid in readings
            .iter()
            .flat_map(|r| r.trim_start_matches('!').split(','))
            .filter(|r| !r.is_empty())
        {
            if !read_on.contains(&replid) {
                read_on.push(replid);
            }
        }
        let read_on = read_on.join(",");
        kind.read_on(if settled {
            format!("!{read_on}")
        } else {
            read_on
        })
    }

    /// This keeping without its reading's incarnations, and them.
    fn split(&self) -> (Keeping, String) {
        match self {
            Keeping::Lossy => (Keeping::Lossy, String::new()),
            Keeping::Durable { read_on } => (
                Keeping::Durable {
                    read_on: String::new(),
                },
                read_on.clone(),
            ),
            Keeping::DurableBehindSentinel {
                address,
                failovers,
                read_on,
            } => (
                Keeping::DurableBehindSentinel {
                    address: address.clone(),
                    failovers: *failovers,
                    read_on: String::new(),
                },
                read_on.clone(),
            ),
            Keeping::DurableClusterNode { read_on } => (
                Keeping::DurableClusterNode {
                    read_on: String::new(),
                },
                read_on.clone(),
            ),
        }
    }

    /// This keeping as read on `incarnations`.
    fn read_on(self, incarnations: String) -> Keeping {
        match self {
            Keeping::Lossy => Keeping::Lossy,
            Keeping::Durable { .. } => Keeping::Durable {
                read_on: incarnations,
            },
            Keeping::DurableBehindSentinel {
                address, failovers, ..
            } => Keeping::DurableBehindSentinel {
                address,
                failovers,
                read_on: incarnations,
            },
            Keeping::DurableClusterNode { .. } => Keeping::DurableClusterNode {
                read_on: incarnations,
            },
        }
    }

    /// ARGV[1] of the epoch check: "0" (lossy), else "1" where a missing record is trusted and
    /// "2" where it is not, followed by the keeper ("cluster" for the script to read the node's
    /// own), then `|` and the incarnations the durability was read on ([`Reading::on`], `!`
    /// first where settled).
    pub(crate) fn argument(&self) -> String {
        match self {
            Keeping::Lossy => "0".to_owned(),
            Keeping::Durable { read_on } => format!("1|{read_on}"),
            Keeping::DurableBehindSentinel {
                address,
                failovers,
                read_on,
            } => format!(
                "{} sentinel {address} epoch {failovers}|{read_on}",
                if *failovers == 0 { 1 } else { 2 }
            ),
            Keeping::DurableClusterNode { read_on } => format!("1 cluster|{read_on}"),
        }
    }
}

/// The code of the error the epoch check raises when it meets a new incarnation of the server
/// and is told the server is durable by a reading made on another ([`Reading::on`]): the
/// reading may be of settings the restart dropped. No lease, token or epoch record is written
/// (a batch's busy locks met before keep their waiters marks); the caller reads the durability
/// again and tries once more with that reading settled ([`durability::Reading::settled`]),
/// which the check does not refuse: an incarnation it does not list counts as not durable. A string, not an error table: servers before Redis 7 cannot
/// report a table's text.
pub(crate) const DURABILITY_UNREAD: &str = "LEASEHOLD_DURABILITY_UNREAD";

/// Whether `e` is the epoch check's [`DURABILITY_UNREAD`] (by its text: the server wraps a
/// script's error in one of its own).
pub(crate) fn durability_unread(e: &redis::RedisError) -> bool {
    e.to_string().contains(DURABILITY_UNREAD)
}

/// The epoch check of [`ACQUIRE`] and of Redlock's first phase ([`crate::drivers::redis::redlock`]),
/// as Lua that defines `clock()`, `check_epoch()` and the state they set (`guarded`, `since`,
/// `now`, `floor`): KEYS[1] is the epoch record, ARGV[1] [`Keeping::argument`]. A macro, so
/// that both scripts are one literal each (`concat!`).
macro_rules! epoch_check {
    () => {
        r"
local checked, guarded, since, now, floor = false, false, 0, 0, 0
local kept, read_on = string.match(ARGV[1], '^([^|]*)|?(.*)$')
local settled = string.sub(read_on, 1, 1) == '!'
if settled then
  read_on = string.sub(read_on, 2)
end
local keeping, kept_by = string.sub(kept, 1, 1), string.sub(kept, 3)
local durable = keeping ~= '0'
local function clock()
  if now == 0 then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return now
end
local function keeper()
  if kept_by ~= 'cluster' then
    return kept_by
  end
  local node, cluster = redis.pcall('CLUSTER', 'MYID'), redis.pcall('CLUSTER', 'INFO')
  local epoch = type(cluster) == 'string' and string.match(cluster, 'cluster_my_epoch:(%d+)')
  if type(node) ~= 'string' or not epoch then
    return false
  end
  return 'cluster node ' .. node .. ' epoch ' .. epoch
end
local function check_epoch()
  checked = 'pending'
  local replication = redis.pcall('INFO', 'replication')
  local replid = type(replication) == 'string' and string.match(replication, 'master_replid:(%w+)')
  if not replid then
    checked = true
    return
  end
  guarded = true
  local promoted = string.match(replication, 'second_repl_offset:(-?%d+)') ~= '-1'
  clock()
  local epoch = redis.call('HMGET', KEYS[1], 'replid', 'since', 'floor', 'keeper', 'durable')
  since = tonumber(epoch[2]) or 0
  floor = tonumber(epoch[3]) or 0
  if epoch[1] ~= replid then
    if durable and not string.find(',' .. read_on .. ',', ',' .. replid .. ',', 1, true) then
      if not settled then
        error('LEASEHOLD_DURABILITY_UNREAD durability was not read on incarnation ' .. replid)
      end
      durable = false
    end
    local keeps = keeper()
    local own_data = (not epoch[1] or epoch[5] == epoch[1] .. ' 1') and (keeps == '' or (keeps and
      (epoch[1] and epoch[4] == epoch[1] .. ' ' .. keeps or not epoch[1] and keeping == '1')))
    if promoted or not durable or not own_data then
      if epoch[1] or promoted then
        since = now
      else
        local uptime = string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)')
        since = now - math.max(tonumber(uptime) - 1, 0) * 1000000
      end
      floor = math.max(now, floor + 1000000)
    end
    redis.call('HSET', KEYS[1], 'replid', replid, 'since', string.format('%d', since),
      'floor', string.format('%d', floor), 'keeper', replid .. ' ' .. (keeps or ''),
      'durable', replid .. (durable and ' 1' or ' 0'))
  elseif not durable and epoch[5] == replid .. ' 1' then
    redis.call('HSET', KEYS[1], 'durable', replid .. ' 0')
  end
  checked = true
end
"
    };
}
pub(crate) use epoch_check;

pub(crate) const ACQUIRE: &str = concat!(
    epoch_check!(),
    r"
local function keep_records(counter, ahead)
  local keep = string.format('%d', tonumber(ARGV[2]) + math.max(0, math.ceil((ahead - clock()) / 1000)))
  redis.call('PEXPIRE', counter, keep)
  redis.call('PEXPIRE', KEYS[1], keep)
end
local function acquire(i)
  local lease, counter, own, waiters = KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i], KEYS[4 * i + 1]
  local identity, ttl = ARGV[3 * i], tonumber(ARGV[3 * i + 1])
  local expires = ARGV[3 * i + 2] == '1'
  local current = redis.call('GET', lease)
  if current then
    redis.call('SET', waiters, '1', 'PX', ttl * 2)
    return {current, redis.call('PTTL', lease)}
  else
    if not checked then
      check_epoch()
    end
    local left = guarded and since + ttl * 1000 - now or 0
    if left > 0 then
      if expires then
        keep_records(counter, floor)
      end
      return {false, math.ceil(left / 1000)}
    else
      local least = floor
      local keyed = own ~= counter
      if keyed then
        least = math.max(least, tonumber(redis.call('GET', own) or '0'))
      end
      local token = redis.call('INCR', counter)
      if expires and token == 1 then
        least = math.max(least, clock())
      end
      if token <= least then
        token = least + 1
        redis.call('SET', counter, string.format('%d', token))
      end
      if keyed then
        redis.call('SET', own, string.format('%d', token), 'PX', ARGV[2])
      end
      if expires then
        keep_records(counter, math.max(token, floor))
      end
      redis.call('SET', lease, string.format('%d', token) .. ':' .. identity, 'NX', 'PX', ttl)
      return token
    end
  end
end
local function unusable(i, failure)
  local found, seen = {}, {}
  for k = 4 * i - 2, 4 * i + 1 do
    local key = KEYS[k]
    if not seen[key] then
      seen[key] = true
      local kind = redis.call('TYPE', key)['ok']
      if kind ~= 'string' and kind ~= 'none' then
        table.insert(found, key .. ' is a ' .. kind)
      elseif kind == 'string' and (k == 4 * i - 1 or k == 4 * i)
          and not tonumber(redis.call('GET', key)) then
        table.insert(found, key .. ' is not a number')
      end
    end
  end
  if #found == 0 then
    -- Not this lock's keys (a replica's READONLY, a server out of memory): the whole call fails,
    -- as such a failure fails every write of it.
    error(failure)
  end
  local reason = type(failure) == 'table' and (failure.err or failure.ok) or tostring(failure)
  return {false, false, 'a key of this lock is not one Leasehold wrote (' ..
    table.concat(found, ', ') .. '): ' .. reason}
end
local results = {}
for i = 1, (#KEYS - 1) / 4 do
  local ok, result = pcall(acquire, i)
  if ok then
    results[i] = result
  elseif checked == 'pending' then
    error(result)
  else
    results[i] = unusable(i, result)
  end
end
return results
"
);

/// One acquisition of an [`ACQUIRE`] call.
pub(crate) struct Acquisition<'a> {
    pub(crate) lock: &'a str,
    pub(crate) identity: &'a str,
    pub(crate) ttl: Duration,
}

/// An invocation of [`ACQUIRE`] for `locks`, all of whose keys share one epoch record (one
/// master; on a cluster, one lock).
pub(crate) fn acquisitions<'a>(
    acquire: &'a Script,
    keys: &KeyLayout,
    locks: &[Acquisition<'_>],
    keeping: &Keeping,
) -> redis::ScriptInvocation<'a> {
    let mut invocation = acquire.prepare_invoke();
    if let Some(first) = locks.first() {
        invocation.key(keys.epoch_of(first.lock));
    }
    invocation
        .arg(keeping.argument())
        .arg(ms(KEY_COUNTER_RETENTION));
    for acquisition in locks {
        let lock = acquisition.lock;
        invocation
            .key(keys.lease(lock))
            .key(keys.counter(lock))
            .key(keys.token(lock))
            .key(keys.waiters(lock))
            .arg(acquisition.identity)
            .arg(ms(acquisition.ttl))
            .arg(if keys.records_expire(lock) { "1" } else { "0" });
    }
    invocation
}

/// An invocation of [`ACQUIRE`] for `lock` alone.
pub(crate) fn acquisition<'a>(
    acquire: &'a Script,
    keys: &KeyLayout,
    lock: &str,
    identity: &str,
    ttl: Duration,
    keeping: &Keeping,
) -> redis::ScriptInvocation<'a> {
    let one = Acquisition {
        lock,
        identity,
        ttl,
    };
    acquisitions(acquire, keys, &[one], keeping)
}

/// What one acquisition of an [`ACQUIRE`] call came to; an error for a lock whose keys the
/// script cannot use.
pub(crate) fn acquired(lock: &str, identity: &str, result: &Value) -> Result<Acquire> {
    Ok(match result {
        Value::Int(token) if *token > 0 => Acquire::Acquired(Lease {
            lock: lock.to_owned(),
            identity: identity.to_owned(),
            token: *token as u64,
        }),
        Value::Array(items) => match items.as_slice() {
            [Value::Nil, Value::Nil, Value::BulkString(why)] => {
                return Err(Error::Backend(format!(
                    "lock {lock}: {}",
                    String::from_utf8_lossy(why)
                )));
            }
            // The epoch guard: free, not granted for this many more milliseconds.
            [Value::Nil, Value::Int(ms)] => Acquire::Withheld(crate::driver::Withheld {
                reason: crate::driver::RESTART_GUARD.to_owned(),
                resume_in: Some(Duration::from_millis((*ms).max(0) as u64)),
            }),
            _ => Acquire::Busy(parse_value_and_pttl(result)),
        },
        other => Acquire::Busy(parse_value_and_pttl(other)),
    })
}

/// The one result of an [`ACQUIRE`] call for one lock.
pub(crate) fn only_result(reply: Value) -> Result<Value> {
    match reply {
        Value::Array(mut results) if results.len() == 1 => Ok(results.remove(0)),
        other => Err(Error::Backend(format!(
            "the acquire script answered {other:?} for one lock"
        ))),
    }
}

/// How long a family key's own token counter outlives the key's last acquisition (see
/// [`ACQUIRE`]): the time a family's sidecars may run versions from before and after family
/// counters side by side, and the time after which an idle key leaves nothing in Redis.
pub const KEY_COUNTER_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Whether an error says nothing about the server's settings or rights, only that it cannot
/// answer now: the connection failed or timed out, or the server is loading its data, running
/// someone's long script (`BUSY`), failing over, or telling a cluster client to try again.
pub(crate) fn passing(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || e.code() == Some("BUSY")
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
            )
        )
}

/// KEYS: lease, then the lock's records that expire ([`KeyLayout::records_expire`]: its epoch
/// record and counter), if any. ARGV: expected value, ttl ms, and with records how long they
/// are kept (ms). Returns 1 when renewed.
///
/// A renewal keeps such records at least [`KEY_COUNTER_RETENTION`] ahead, as an acquisition
/// does: a key held longer than that would otherwise lose them while held, and a promoted
/// replica restarted on its own data would find no record to doubt and grant the key at once
/// beside its holder. A record gone already is not made up.
pub(crate) const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  local renewed = redis.call('PEXPIRE', KEYS[1], ARGV[2])
  for i = 2, #KEYS do
    local left = redis.call('PTTL', KEYS[i])
    if left >= 0 and left < tonumber(ARGV[3]) then
      redis.call('PEXPIRE', KEYS[i], ARGV[3])
    end
  end
  return renewed
end
return 0
";

/// KEYS: for each lease in turn, the lease, then the lock's waiters mark where the
/// acquisitions set one ([`ACQUIRE`]): every lease with its mark, or none with one. ARGV: for
/// each lease in turn, its expected value and the lock's release channel. Returns, for each
/// lease, 1 when it was released.
///
/// The notice is published only when an attempt found the lock held since the last release
/// (the mark, taken down here), or when the caller passes no mark (Redlock, whose acquisitions
/// set none): every sidecar listens to every lock's notices, so a notice that nobody waits for
/// costs each of them a message. Several leases in one call are released exactly as by one call
/// each ([`crate::drivers::redis::releases`] sends a master's concurrent releases together).
///
/// A notice the server refuses (an ACL without the release channels) does not fail the
/// release: the deletion has been made, and a script that stopped there would leave the rest
/// of its leases held while reporting all of them failed. Waiters then learn at their next poll.
pub(crate) const RELEASE: &str = r"
local marked = #KEYS == #ARGV
local stride = marked and 2 or 1
local released = {}
for i = 1, #ARGV / 2 do
  local lease, value = KEYS[stride * i - stride + 1], ARGV[2 * i - 1]
  -- pcall: a key of another type (changed by hand) is not released, the call's others are.
  if redis.pcall('GET', lease) == value then
    -- The lease is there, so a mark was too when two keys go.
    if not marked then
      redis.call('DEL', lease)
      redis.pcall('PUBLISH', ARGV[2 * i], value)
    elseif redis.call('DEL', lease, KEYS[stride * i]) == 2 then
      redis.pcall('PUBLISH', ARGV[2 * i], value)
    end
    released[i] = 1
  else
    released[i] = 0
  end
end
return released
";

/// An invocation of [`RELEASE`] for `leases`, each with its lock's waiters mark.
pub(crate) fn releases_of<'a>(
    release: &'a Script,
    keys: &KeyLayout,
    leases: &[&Lease],
) -> redis::ScriptInvocation<'a> {
    let mut invocation = release.prepare_invoke();
    for lease in leases {
        invocation
            .key(keys.lease(&lease.lock))
            .key(keys.waiters(&lease.lock))
            .arg(lease_value(lease))
            .arg(keys.released_channel(&lease.lock));
    }
    invocation
}

/// Whether the one lease of a [`RELEASE`] call was released.
pub(crate) fn released_one(reply: &Value) -> bool {
    matches!(reply, Value::Array(results) if matches!(results.as_slice(), [Value::Int(1)]))
}

/// KEYS: lease. Returns {value, remaining ms}, or false when free.
pub(crate) const OBSERVE: &str = r"
local current = redis.call('GET', KEYS[1])
if current then
  return {current, redis.call('PTTL', KEYS[1])}
end
return false
";

/// Where a lock's keys and channel live.
#[derive(Clone)]
pub struct KeyLayout {
    prefix: String,
    /// In a Redis Cluster each lock has its own epoch record, in its own slot: a script may
    /// touch only keys of one slot.
    epoch_per_lock: bool,
}

impl KeyLayout {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            epoch_per_lock: false,
        }
    }
    /// The layout on a Redis Cluster.
    pub fn for_cluster(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            epoch_per_lock: true,
        }
    }
    pub fn lease(&self, lock: &str) -> String {
        format!("{}:{{{lock}}}:lease", self.prefix)
    }
    /// The lock's own token counter.
    pub fn token(&self, lock: &str) -> String {
        format!("{}:{{{lock}}}:token", self.prefix)
    }
    /// Set while an acquisition has found the lock held: the release publishes its notice.
    pub fn waiters(&self, lock: &str) -> String {
        format!("{}:{{{lock}}}:waiters", self.prefix)
    }
    /// The counter `lock`'s tokens are drawn from: for a family's key, the family's, so that a
    /// key nobody holds has no record left (its lease key expires or is deleted), while its
    /// tokens still rise; for any other lock, and for every lock on a Redis Cluster (a script
    /// may only touch keys of one slot, and a family's keys are spread over the slots), the
    /// lock's own.
    pub fn counter(&self, lock: &str) -> String {
        match crate::names::family_of(lock) {
            Some(family) if !self.epoch_per_lock => {
                format!("{}:{{{family}}}:keytokens", self.prefix)
            }
            _ => self.token(lock),
        }
    }
    /// Whether `lock`'s counter and epoch record expire once it is idle (see [`ACQUIRE`]): a
    /// family's key on a Redis Cluster, where they are the key's own. Elsewhere a family's keys
    /// share their family's, and a declared lock keeps its own for good.
    pub fn records_expire(&self, lock: &str) -> bool {
        self.epoch_per_lock && crate::names::family_of(lock).is_some()
    }
    /// The prefix's epoch record (see [`ACQUIRE`]).
    pub fn epoch(&self) -> String {
        format!("{}:epoch", self.prefix)
    }
    /// The epoch record `lock`'s acquisitions check: the prefix's, or on a cluster the lock's.
    pub fn epoch_of(&self, lock: &str) -> String {
        if self.epoch_per_lock {
            format!("{}:{{{lock}}}:epoch", self.prefix)
        } else {
            self.epoch()
        }
    }
    /// The Tair driver's epoch record (see [`crate::drivers::redis::tair`]): its own, kept by the
    /// driver's commands where the acquire script keeps Redis's.
    pub fn tair_epoch(&self) -> String {
        format!("{}:epoch:tair", self.prefix)
    }
    pub fn released_channel(&self, lock: &str) -> String {
        format!("{}:released:{lock}", self.prefix)
    }
    pub(crate) fn released_pattern(&self) -> String {
        format!("{}:released:*", self.prefix)
    }
    pub(crate) fn lock_of_channel<'a>(&self, channel: &'a str) -> Option<&'a str> {
        channel
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix(":released:")
    }
}

/// The value stored under the lease key: the token first, so identities may contain anything.
pub fn lease_value(lease: &Lease) -> String {
    format!("{}:{}", lease.token, lease.identity)
}

/// A field of an `INFO` answer.
pub fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

pub(crate) fn parse_holding(value: &[u8], pttl: i64) -> Option<Holding> {
    let value = std::str::from_utf8(value).ok()?;
    let (token, identity) = value.split_once(':')?;
    Some(Holding {
        identity: identity.to_owned(),
        token: token.parse().ok()?,
        expires_in: (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
    })
}

pub(crate) fn parse_value_and_pttl(value: &Value) -> Option<Holding> {
    match value {
        Value::Array(items) => match items.as_slice() {
            [Value::BulkString(v), Value::Int(pttl)] => parse_holding(v, *pttl),
            _ => None,
        },
        _ => None,
    }
}

/// A Redis error as the driver reports it; over TLS, a timeout most likely means no TLS on
/// the other side.
pub(crate) fn explain(e: redis::RedisError, tls: bool) -> Error {
    match map_err(e) {
        Error::Unreachable(message) if tls && message.contains("timed out") => {
            Error::Unreachable(format!(
                "{message} (no answer over TLS in time: a plain-text server behind a TLS URL, or one that does not answer)"
            ))
        }
        other => other,
    }
}

pub(crate) fn map_err(e: redis::RedisError) -> Error {
    if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() || e.is_timeout() {
        // A TLS failure is an I/O error too: say which one it is.
        Error::Unreachable(crate::tls::with_cause(e.to_string()))
    } else {
        Error::Backend(e.to_string())
    }
}

/// A client for `url`: over TLS (`rediss://`) with `tls`'s CA (else the system's roots) and
/// client pair when given. The PEM documents are read now, so a missing file says so at start.
pub(crate) fn client(url: &url::Url, tls: Option<&Tls>) -> Result<redis::Client> {
    let invalid = |reason: String| Error::InvalidUrl {
        url: crate::redact::redact_url(url),
        reason,
    };
    let Some(tls) = tls else {
        crate::tls::use_ring_provider();
        return redis::Client::open(url.as_str()).map_err(|e| invalid(e.to_string()));
    };
    redis::Client::build_with_tls(url.as_str(), certificates(tls)?)
        .map_err(|e| invalid(e.to_string()))
}

/// `tls`'s PEM documents as the client takes them, read now.
pub(crate) fn certificates(tls: &Tls) -> Result<redis::TlsCertificates> {
    crate::tls::use_ring_provider();
    let client_tls = match &tls.client {
        Some((cert, key)) => Some(redis::ClientTlsConfig {
            client_cert: cert.read("cert")?.into_bytes(),
            client_key: key.read("key")?.into_bytes(),
        }),
        None => None,
    };
    let root_cert = match &tls.ca {
        Some(ca) => Some(ca.read("ca")?.into_bytes()),
        None => None,
    };
    Ok(redis::TlsCertificates {
        client_tls,
        root_cert,
    })
}

pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// The lazily connecting, reconnecting connection of a single-server driver (Redis, Tair).
pub(crate) fn connection(client: &redis::Client) -> Result<connection::ServerConnection> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
        .set_number_of_retries(2)
        .set_max_delay(RESUBSCRIBE_MAX);
    connection::ServerConnection::new(client.clone(), config)
}

/// One pattern subscription per process carries every lock's release notices. When it breaks it
/// is re-established, and every waiter is woken, since a release may have been missed meanwhile.
pub(crate) async fn listen_for_releases(
    client: redis::Client,
    keys: KeyLayout,
    feeds: Arc<ChangeFeeds>,
) {
    listen_for_releases_on(vec![client], keys, feeds).await;
}

/// [`listen_for_releases`] on the first of `clients` that answers, trying the next when one
/// fails: the nodes of a Redis Cluster, any of which hears every `PUBLISH`.
pub(crate) async fn listen_for_releases_on(
    clients: Vec<redis::Client>,
    keys: KeyLayout,
    feeds: Arc<ChangeFeeds>,
) {
    let mut pause = RESUBSCRIBE_MIN;
    let mut refusal_told = false;
    for client in clients.iter().cycle() {
        let subscribed = tokio::time::timeout(CONNECT_TIMEOUT, async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.psubscribe(keys.released_pattern()).await?;
            Ok::<_, redis::RedisError>(pubsub)
        })
        .await;
        match subscribed {
            Ok(Ok(pubsub)) => {
                pause = RESUBSCRIBE_MIN;
                feeds.bump_all();
                hear_releases(pubsub, &keys, &feeds, std::future::pending()).await;
            }
            Ok(Err(e)) => subscription_failed(&e, &keys, &mut refusal_told),
            Err(_) => tracing::debug!("redis release subscription timed out"),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RESUBSCRIBE_MAX);
    }
}

/// Hear the release notices on `pubsub` (subscribed), until it closes, falls silent or `until`
/// ends. A subscription hears nothing while nobody releases, so only an unanswered ping tells a
/// connection that has fallen silent from a quiet one.
pub(crate) async fn hear_releases(
    pubsub: redis::aio::PubSub,
    keys: &KeyLayout,
    feeds: &ChangeFeeds,
    until: impl std::future::Future<Output = ()>,
) {
    let (mut sink, mut messages) = pubsub.split();
    let notices = async {
        while let Some(msg) = messages.next().await {
            if let Some(lock) = keys.lock_of_channel(msg.get_channel_name()) {
                feeds.bump(lock);
            }
        }
    };
    let answers = async {
        loop {
            tokio::time::sleep(SUBSCRIPTION_PING).await;
            match tokio::time::timeout(RESPONSE_TIMEOUT, sink.ping::<Value>()).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return e.to_string(),
                Err(_) => return "no answer to a ping".to_string(),
            }
        }
    };
    tokio::select! {
        () = notices => tracing::debug!("redis release subscription closed; re-subscribing"),
        failed = answers => tracing::debug!(
            error = %failed,
            "redis release subscription fell silent; re-subscribing"
        ),
        () = until => {}
    }
}

/// Tells of a subscription to the release notices that failed: a refusal by the server (an ACL
/// without the release channels) once, as a warning saying what to grant, since every waiter
/// then learns of a release only at its next poll; a connection lost at debug level.
pub(crate) fn subscription_failed(e: &redis::RedisError, keys: &KeyLayout, told: &mut bool) {
    let refused = matches!(
        e.kind(),
        redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm)
    );
    if refused && !std::mem::replace(told, true) {
        let pattern = keys.released_pattern();
        tracing::warn!(
            error = %e,
            "the Redis user may not subscribe to {pattern}: waiters learn of releases at their \
             next poll (a renew interval) instead of at once; grant the user the channels \
             `&{pattern}`"
        );
    } else {
        tracing::debug!(error = %e, "redis release subscription failed");
    }
}

/// Remove the lease keys of `locks` from one master.
pub(crate) async fn delete_keys(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    keys: &KeyLayout,
    locks: &[String],
) -> Result<()> {
    for lock in locks {
        // The token counter stays: a lock created again under the name continues above it.
        let _: i64 = redis::cmd("DEL")
            .arg(keys.lease(lock))
            .arg(keys.waiters(lock))
            .query_async(conn)
            .await
            .map_err(map_err)?;
    }
    Ok(())
}

/// The lease keys of `family`'s keys that one server holds now. `SCAN` walks the whole keyspace
/// (a family's keys are spread over it), in pages, and may name a key twice or one that has
/// just expired; `EXISTS` then counts those still there.
pub(crate) async fn held_key_leases(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    keys: &KeyLayout,
    family: &str,
) -> Result<std::collections::HashSet<String>> {
    const PAGE: usize = 1000;
    // `.key[sh].`: both infixes, `names::PLAIN_KEY_INFIX` and `HASHED_KEY_INFIX`. Lock names
    // hold none of the glob's special characters.
    let pattern = keys.lease(&format!("{family}.key[sh].*"));
    let mut seen = std::collections::HashSet::new();
    let mut cursor = 0u64;
    loop {
        let (next, page): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(PAGE)
            .query_async(conn)
            .await
            .map_err(map_err)?;
        seen.extend(page);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    let seen: Vec<String> = seen.into_iter().collect();
    let mut held = std::collections::HashSet::new();
    for chunk in seen.chunks(PAGE) {
        let mut pipe = redis::pipe();
        for key in chunk {
            pipe.exists(key);
        }
        let present: Vec<bool> = pipe.query_async(conn).await.map_err(map_err)?;
        held.extend(
            chunk
                .iter()
                .zip(present)
                .filter(|(_, present)| *present)
                .map(|(key, _)| key.clone()),
        );
    }
    Ok(held)
}

/// Warnings about a master's settings that endanger locks: it may evict lock keys under memory
/// pressure, or this user may not run `INFO`, without which a restart or failover that lost a
/// held lease goes unnoticed.
pub(crate) async fn lock_key_warnings(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
) -> Result<Vec<String>> {
    let mut warnings: Vec<String> = eviction_warning(conn).await?.into_iter().collect();
    let info: redis::RedisResult<String> = redis::cmd("INFO")
        .arg("replication")
        .query_async(conn)
        .await;
    warnings.extend(replication_warning(info)?);
    Ok(warnings)
}

/// A warning when the answer to `INFO replication` leaves the restart guard without the
/// server's replication ID: refused (an ACL), or answered without `master_replid` (a proxy
/// that makes its own answer up).
fn replication_warning(info: redis::RedisResult<String>) -> Result<Option<String>> {
    const UNGUARDED: &str = "a restart or failover that loses a held lease goes unnoticed, and \
        another pod may then take the lock while its holder still claims it";
    match info {
        Ok(info) if info_field(&info, "master_replid").is_some() => Ok(None),
        Ok(_) => Ok(Some(format!(
            "INFO replication names no master_replid (a proxy's answer?): {UNGUARDED}; point \
             the lock at the server itself"
        ))),
        Err(e) if matches!(e.kind(), redis::ErrorKind::Server(_)) => Ok(Some(format!(
            "INFO is refused ({e}): {UNGUARDED}; let the lock's Redis user run INFO"
        ))),
        Err(e) => Err(map_err(e)),
    }
}

/// A warning when the master may evict lock keys under memory pressure: an evicted lease frees
/// the lock while its holder still claims it, and an evicted counter restarts the tokens.
pub(crate) async fn eviction_warning(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
) -> Result<Option<String>> {
    let reply: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(conn)
        .await;
    let policy = match reply {
        Ok(pair) => pair.get(1).cloned().unwrap_or_default(),
        // CONFIG is often renamed or forbidden on managed Redis (whose default policies evict):
        // `INFO memory` tells the policy too, to a user that may run INFO, as a lock's must.
        Err(e)
            if matches!(
                e.kind(),
                redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
            ) =>
        {
            let info: redis::RedisResult<String> =
                redis::cmd("INFO").arg("memory").query_async(conn).await;
            match info {
                Ok(info) => info_field(&info, "maxmemory_policy")
                    .unwrap_or_default()
                    .to_owned(),
                Err(e) if matches!(e.kind(), redis::ErrorKind::Server(_)) => return Ok(None),
                Err(e) => return Err(map_err(e)),
            }
        }
        Err(e) => return Err(map_err(e)),
    };
    Ok(evicts_lock_keys(&policy).then(|| {
        format!(
            "maxmemory-policy is {policy}: Redis may evict lock keys under memory pressure; \
             use noeviction (a volatile-* policy evicts leases, which expire)"
        )
    }))
}

/// `allkeys-*` evicts any key, including the token counters (which have no TTL); the
/// `volatile-*` policies can evict a held lease.
pub(crate) fn evicts_lock_keys(policy: &str) -> bool {
    policy != "noeviction" && !policy.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The script steps the floor as the Tair driver does (one constant, two languages).
    #[test]
    fn the_scripts_floor_step_is_the_drivers() {
        assert!(
            ACQUIRE.contains(&format!("floor = math.max(now, floor + {FLOOR_STEP})")),
            "ACQUIRE's floor step is not FLOOR_STEP"
        );
    }

    /// A batch's acquisitions keep their durability readings' incarnations together, so that
    /// requests read on either side of a re-read do not make a durable server's batch lossy;
    /// acquisitions that disagree on how the server keeps its data are lossy.
    #[test]
    fn a_batch_keeps_every_readings_incarnations() {
        let durable = |read_on: &str| Keeping::Durable {
            read_on: read_on.to_owned(),
        };
        let batch = [durable("x"), durable(""), durable("y"), durable("x")];
        assert_eq!(Keeping::for_batch(batch.iter()), durable("x,y"));
        assert_eq!(Keeping::for_batch(batch.iter()).argument(), "1|x,y");
        let settled = [durable("x"), durable("!y")];
        assert_eq!(Keeping::for_batch(settled.iter()), durable("!x,y"));
        let mixed = [durable("x"), Keeping::Lossy];
        assert_eq!(Keeping::for_batch(mixed.iter()), Keeping::Lossy);
        let sentinel = |failovers| Keeping::DurableBehindSentinel {
            address: "h:1".into(),
            failovers,
            read_on: "x".into(),
        };
        assert_eq!(
            Keeping::for_batch([sentinel(1), sentinel(2)].iter()),
            Keeping::Lossy
        );
        assert_eq!(sentinel(3).argument(), "2 sentinel h:1 epoch 3|x");
        assert_eq!(Keeping::Lossy.argument(), "0");
    }

    /// The guard's warnings: none where `INFO` names the replication ID; one where it is
    /// refused or names none.
    #[test]
    fn info_without_a_replication_id_is_warned_of() {
        let answered = |info: &str| replication_warning(Ok(info.to_owned())).unwrap();
        assert_eq!(
            answered("# Replication\r\nrole:master\r\nmaster_replid:3f2a\r\n"),
            None
        );
        let made_up = answered("# Replication\r\nrole:master\r\nconnected_slaves:0\r\n");
        assert!(
            made_up.is_some_and(|w| w.contains("names no master_replid")),
            "an answer without the ID"
        );
        let refused = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm),
            "NOPERM",
        ));
        assert!(
            replication_warning(Err(refused))
                .unwrap()
                .is_some_and(|w| w.contains("INFO is refused"))
        );
    }

    #[test]
    fn key_layout() {
        let k = KeyLayout::new("leasehold");
        assert_eq!(k.lease("jobs"), "leasehold:{jobs}:lease");
        assert_eq!(k.token("jobs"), "leasehold:{jobs}:token");
        assert_eq!(k.epoch(), "leasehold:epoch");
        assert_eq!(k.epoch_of("jobs"), "leasehold:epoch");
        let cluster = KeyLayout::for_cluster("leasehold");
        assert_eq!(cluster.epoch_of("jobs"), "leasehold:{jobs}:epoch");
        assert_eq!(cluster.lease("jobs"), k.lease("jobs"));
        assert_eq!(k.released_channel("jobs"), "leasehold:released:jobs");
        assert_eq!(k.lock_of_channel("leasehold:released:jobs"), Some("jobs"));
        assert_eq!(k.lock_of_channel("other:released:jobs"), None);
        // A family's keys share its counter, except on a cluster.
        assert_eq!(k.counter("jobs"), k.token("jobs"));
        assert_eq!(k.counter("orders.keys.o-1"), "leasehold:{orders}:keytokens");
        assert_eq!(k.counter("orders.keyh.ab12"), k.counter("orders.keys.o-2"));
        assert_eq!(
            cluster.counter("orders.keys.o-1"),
            cluster.token("orders.keys.o-1")
        );
    }

    #[test]
    fn holding_values() {
        let h = parse_holding(b"42:pod-a:with:colons", 1500).unwrap();
        assert_eq!(h.token, 42);
        assert_eq!(h.identity, "pod-a:with:colons");
        assert_eq!(h.expires_in, Some(Duration::from_millis(1500)));
        assert!(parse_holding(b"nonsense", 1).is_none());
        assert_eq!(parse_holding(b"1:a", -1).unwrap().expires_in, None);
    }
}
