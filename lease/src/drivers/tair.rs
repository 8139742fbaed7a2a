//! Tair's versioned put, the seeds' fourth lock (`tair://`): the lease is an `exstrtype` value
//! whose version moves on every write, taken, renewed and released with the TairString
//! commands instead of Lua.
//!
//! - **Acquire**: `INCR` the lock's token counter (a plain key, kept for ever), then `EXSET lease
//!   "TOKEN:IDENTITY" PX ttl NX WITHVERSION`, which only succeeds on an absent (or expired) key.
//!   Two commands cannot make the token and the claim one atomic step, so the claim is checked
//!   (a `GET` of the counter pipelined after the `EXSET`): if the counter has moved past our
//!   token, a later token may already have held the lock, and ours would go backwards; the claim
//!   is undone (`EXCAD`) and counted as busy. The three go in one round trip: the `EXSET` names
//!   the token this driver expects the `INCR` to draw (one above the counter it last saw), and a
//!   claim under a wrong guess is undone and tried again with the counter's new value. A first
//!   acquisition of a lock draws its token alone first.
//!   While we hold, no later token can hold, so a claim that passes the check keeps tokens
//!   strictly increasing.
//!   The claim sets the key's version to TOKEN x 2^32 (`ABS`): TairString starts each new key at
//!   version 1, so without that a holder whose key expired and was taken again would find its
//!   old version on the new holder's key.
//! - **Renew**: `EXCAS lease VALUE VERSION PX ttl` with the version this holder last saw; the
//!   version moves on each renewal, and versions never repeat across holdings, so a holder
//!   whose version is stale has lost the lock.
//! - **Release**: `EXCAD lease VERSION`, pipelined with a notice on the release channel (as on
//!   Redis).
//! - **Observe**: `EXGET` and `PTTL`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use redis::Value;
use redis::aio::ConnectionManager;
use tokio::sync::watch;

use super::redis::{
    KeyLayout, client, connection, delete_keys, eviction_warning, lease_value, listen_for_releases,
    map_err, ms, parse_holding,
};
use crate::driver::{Acquire, ChangeFeeds, Driver, Holding, Lease};
use crate::error::{Error, Result};

/// How many times one acquisition guesses its token again after a wrong guess.
const CLAIM_ATTEMPTS: usize = 3;
/// The locks whose counters one driver remembers.
const MAX_REMEMBERED_COUNTERS: usize = 10_000;

/// The commands a server must have for `tair://`.
pub const TAIR_COMMANDS: [&str; 4] = ["EXSET", "EXGET", "EXCAS", "EXCAD"];

pub struct TairDriver {
    conn: ConnectionManager,
    keys: KeyLayout,
    /// The version of each holding's value, as this driver last wrote it: (lock, token).
    versions: Mutex<HashMap<(String, u64), i64>>,
    /// Each lock's token counter as this driver last saw it, to draw the next token in the
    /// claim's own round trip.
    counters: Mutex<HashMap<String, i64>>,
    releases: Arc<ChangeFeeds>,
    subscriber: tokio::task::JoinHandle<()>,
}

impl Drop for TairDriver {
    fn drop(&mut self) {
        self.subscriber.abort();
    }
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
    /// URL).
    pub fn connect(url: &url::Url, prefix: &str) -> Result<Self> {
        let client = client(url, None)?;
        let conn = connection(&client)?;
        let keys = KeyLayout::new(prefix);
        let releases = Arc::new(ChangeFeeds::default());
        let subscriber = tokio::spawn(listen_for_releases(client, keys.clone(), releases.clone()));
        Ok(Self {
            conn,
            keys,
            versions: Mutex::default(),
            counters: Mutex::default(),
            releases,
            subscriber,
        })
    }

    fn versions(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u64), i64>> {
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
        if counters.len() >= MAX_REMEMBERED_COUNTERS && !counters.contains_key(lock) {
            counters.clear();
        }
        counters.insert(lock.to_owned(), counter);
    }

    async fn announce_release(&self, lock: &str) -> Result<()> {
        let _: i64 = redis::cmd("PUBLISH")
            .arg(self.keys.released_channel(lock))
            .arg(1)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(tair_err)?;
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

/// The version a holding starts at: its token times 2^32, so that versions never repeat across
/// holdings. TairString starts every new key at version 1, and `EXCAS`/`EXCAD` compare the
/// version alone: a holder whose key expired and was taken again would otherwise renew or
/// delete the new holder's key once that key reached the same version, and both would claim
/// the lock. A holding would have to be renewed 2^32 times to reach the next token's versions.
fn first_version(token: u64) -> Result<i64> {
    token
        .checked_mul(1 << 32)
        .and_then(|v| i64::try_from(v).ok())
        .ok_or_else(|| {
            Error::Backend(format!(
                "token {token} is past the versions TairString can hold (2^31 acquisitions of one lock)"
            ))
        })
}

#[async_trait]
impl Driver for TairDriver {
    fn kind(&self) -> &'static str {
        "tair"
    }

    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        delete_keys(&mut self.conn.clone(), &self.keys, locks).await
    }

    async fn warnings(&self) -> Result<Vec<String>> {
        Ok(eviction_warning(&mut self.conn.clone())
            .await?
            .into_iter()
            .collect())
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        let mut conn = self.conn.clone();
        // The token is one above the counter as this driver last saw it, most likely: drawn in
        // the same round trip as the claim. A first attempt on a lock draws it alone first.
        let (mut token, mut drawn) = match self.predicted_token(lock) {
            Some(token) => (token, None),
            None => {
                let token: i64 = redis::cmd("INCR")
                    .arg(self.keys.token(lock))
                    .query_async(&mut conn)
                    .await
                    .map_err(tair_err)?;
                (token, Some(token))
            }
        };
        for _ in 0..CLAIM_ATTEMPTS {
            let lease = Lease {
                lock: lock.to_owned(),
                identity: identity.to_owned(),
                token: token as u64,
            };
            // The draw (unless done), the claim, and the counter's check in one round trip;
            // the check is harmless when the claim fails.
            let mut pipe = redis::pipe();
            if drawn.is_none() {
                pipe.cmd("INCR").arg(self.keys.token(lock));
            }
            pipe.cmd("EXSET")
                .arg(self.keys.lease(lock))
                .arg(lease_value(&lease))
                .arg("PX")
                .arg(ms(ttl))
                .arg("NX")
                .arg("ABS")
                .arg(first_version(lease.token)?)
                .arg("WITHVERSION")
                .cmd("GET")
                .arg(self.keys.token(lock));
            let replies: Vec<Value> = pipe.query_async(&mut conn).await.map_err(tair_err)?;
            let int = |v: &Value| {
                <i64 as redis::FromRedisValue>::from_redis_value_ref(v).map_err(|e| {
                    Error::Backend(format!("the claim's pipeline answered {replies:?}: {e}"))
                })
            };
            let (ours, set, now) = match (drawn, replies.as_slice()) {
                (None, [incr, set, get]) => (int(incr)?, set.clone(), int(get)?),
                (Some(ours), [set, get]) => (ours, set.clone(), int(get)?),
                _ => {
                    return Err(Error::Backend(format!(
                        "the claim's pipeline answered {replies:?}"
                    )));
                }
            };
            self.saw_counter(lock, now);
            let Value::Int(version) = set else {
                return Ok(Acquire::Busy(self.observe(lock).await?));
            };
            if ours == token && now == token {
                self.versions()
                    .insert((lock.to_owned(), lease.token), version);
                return Ok(Acquire::Acquired(lease));
            }
            // A claim under a token that is not ours (the guess was wrong), or one a later
            // token was drawn after (it may have held already): undone, never held.
            let _: i64 = redis::cmd("EXCAD")
                .arg(self.keys.lease(lock))
                .arg(version)
                .query_async(&mut conn)
                .await
                .map_err(tair_err)?;
            self.announce_release(lock).await?;
            if ours == token {
                return Ok(Acquire::Busy(None));
            }
            // The token we did draw is lost; guess again from where the counter is.
            (token, drawn) = (now + 1, None);
        }
        Ok(Acquire::Busy(None))
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        let key = (lease.lock.clone(), lease.token);
        let Some(version) = self.versions().get(&key).copied() else {
            return Ok(false);
        };
        let reply: Value = redis::cmd("EXCAS")
            .arg(self.keys.lease(&lease.lock))
            .arg(lease_value(lease))
            .arg(version)
            .arg("PX")
            .arg(ms(ttl))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(tair_err)?;
        match reply {
            Value::Array(items) if items.first() == Some(&Value::Okay) => {
                let Some(Value::Int(next)) = items.get(2) else {
                    return Err(Error::Backend(format!("EXCAS answered {items:?}")));
                };
                self.versions().insert(key, *next);
                Ok(true)
            }
            // -1: the key is gone; otherwise another version, another holder.
            _ => {
                self.versions().remove(&key);
                Ok(false)
            }
        }
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        let key = (lease.lock.clone(), lease.token);
        let Some(version) = self.versions().remove(&key) else {
            return Ok(false);
        };
        // The notice goes with the delete in one round trip; should the delete fail, waiters
        // woken for nothing find the lock held and wait again.
        let (deleted, _): (i64, i64) = redis::pipe()
            .cmd("EXCAD")
            .arg(self.keys.lease(&lease.lock))
            .arg(version)
            .cmd("PUBLISH")
            .arg(self.keys.released_channel(&lease.lock))
            .arg(1)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(tair_err)?;
        Ok(deleted == 1)
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
