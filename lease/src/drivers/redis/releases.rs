//! Releases on one Redis master sent together ([`crate::drivers::batches`], without a wait, as
//! acquisitions are): one call of [`RELEASE`] for every release that arrived while the last
//! call was out. Each lease is compared and deleted exactly as a call of its own would. Not on
//! a Redis Cluster, where one script may touch keys of one slot only.
//!
//! A release is made even when its caller stops waiting for the answer: a lease left behind
//! would keep its key from everyone until it runs out.

use redis::Script;

use crate::driver::Lease;
use crate::drivers::batches::{Batches, Gather, Pending, one_each};
use crate::drivers::redis::connection::ServerConnection;
use crate::drivers::redis::{KeyLayout, RELEASE, releases_of};
use crate::error::Result;

/// The most releases one script call carries.
const MAX_BATCH: usize = 256;

/// A release's answer (true when the lease was still its holder's and is gone); the server's
/// own error is left to the driver to read.
pub(crate) type Answer = std::result::Result<bool, redis::RedisError>;

/// The queue the releases of one master go through.
pub(crate) struct ReleaseBatches {
    batches: Batches<Lease, Result<Answer>>,
}

impl ReleaseBatches {
    pub(crate) fn new(conn: ServerConnection, keys: KeyLayout) -> Self {
        let script = Script::new(RELEASE);
        Self {
            batches: Batches::gathered(Gather::WhileBusy, MAX_BATCH, move |batch| {
                send(batch, script.clone(), conn.clone(), keys.clone())
            }),
        }
    }

    pub(crate) async fn release(&self, lease: &Lease) -> Result<Answer> {
        self.batches.call(lease.clone()).await?
    }
}

async fn send(
    batch: Vec<Pending<Lease, Result<Answer>>>,
    script: Script,
    mut conn: ServerConnection,
    keys: KeyLayout,
) {
    let leases: Vec<&Lease> = batch.iter().map(|p| &p.request).collect();
    let reply = releases_of(&script, &keys, &leases)
        .invoke_async::<Vec<i64>>(&mut conn)
        .await;
    drop(leases);
    let Some((batch, released)) = one_each(batch, reply.map_err(Err), "releases") else {
        return;
    };
    for (pending, released) in batch.into_iter().zip(released) {
        let _ = pending.reply.send(Ok(Ok(released == 1)));
    }
}
