//! Acquisitions on one Redis master sent together ([`crate::drivers::batches`], without a
//! wait): one call of the acquire script for every acquisition that arrived while the last
//! call was out. The script acquires each lock exactly as a call of its own would, and checks
//! the server's epoch (its `INFO`, the costliest part) once per call, so a sidecar whose many
//! owners take many keys at once pays for it once per batch. Not on a Redis Cluster, where one
//! script may touch keys of one slot only.

use std::time::Duration;

use redis::{Script, Value};

use crate::drivers::batches::{Batches, Gather, Pending, one_each};
use crate::drivers::redis::connection::ServerConnection;
use crate::drivers::redis::{ACQUIRE, Acquisition, Keeping, KeyLayout, acquisitions};
use crate::error::Result;

/// The most acquisitions one script call carries.
const MAX_BATCH: usize = 256;

/// An acquisition's result as the script gave it; the server's own error is left to the
/// driver to read.
pub(crate) type Answer = std::result::Result<Value, redis::RedisError>;

struct Request {
    lock: String,
    identity: String,
    ttl: Duration,
    keeping: Keeping,
}

/// The queue the acquisitions of one master go through.
pub(crate) struct AcquisitionBatches {
    batches: Batches<Request, Result<Answer>>,
}

impl AcquisitionBatches {
    pub(crate) fn new(conn: ServerConnection, keys: KeyLayout) -> Self {
        let script = Script::new(ACQUIRE);
        Self {
            batches: Batches::gathered(Gather::WhileBusy, MAX_BATCH, move |batch| {
                send(batch, script.clone(), conn.clone(), keys.clone())
            }),
        }
    }

    /// The script's result for `lock`: a token, or who holds it. `keeping`: how the master keeps
    /// its data (a batch's requests' together: [`Keeping::for_batch`]).
    pub(crate) async fn acquire(
        &self,
        lock: &str,
        identity: &str,
        ttl: Duration,
        keeping: Keeping,
    ) -> Result<Answer> {
        self.batches
            .call(Request {
                lock: lock.to_owned(),
                identity: identity.to_owned(),
                ttl,
                keeping,
            })
            .await?
    }
}

async fn send(
    batch: Vec<Pending<Request, Result<Answer>>>,
    script: Script,
    mut conn: ServerConnection,
    keys: KeyLayout,
) {
    // An attempt nobody waits for any more is not made: it would take a lock for no one.
    let batch: Vec<_> = batch.into_iter().filter(|p| !p.reply.is_closed()).collect();
    if batch.is_empty() {
        return;
    }
    let keeping = Keeping::for_batch(batch.iter().map(|p| &p.request.keeping));
    let locks: Vec<Acquisition<'_>> = batch
        .iter()
        .map(|p| Acquisition {
            lock: &p.request.lock,
            identity: &p.request.identity,
            ttl: p.request.ttl,
        })
        .collect();
    let reply = acquisitions(&script, &keys, &locks, &keeping)
        .invoke_async::<Vec<Value>>(&mut conn)
        .await;
    drop(locks);
    let Some((batch, results)) = one_each(batch, reply.map_err(Err), "acquisitions") else {
        return;
    };
    for (pending, result) in batch.into_iter().zip(results) {
        let _ = pending.reply.send(Ok(Ok(result)));
    }
}
