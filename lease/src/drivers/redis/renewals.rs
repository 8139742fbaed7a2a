//! Renewals on one Redis master sent together ([`crate::drivers::batches`]): one script call,
//! which checks and extends each lease exactly as [`crate::drivers::redis::RENEW`] does alone.
//! Behind Sentinel, the replicas' confirmation (`WAIT`) is asked once per batch too. Not on a
//! Redis Cluster, where one script may touch keys of one slot only.

use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;

use crate::drivers::batches::{Batches, Pending, answer_all, one_each};
use crate::error::Result;

/// The most renewals one script call carries.
pub(crate) const MAX_BATCH: usize = 512;

/// KEYS: leases. ARGV: for each lease in turn, its expected value and the new ttl in ms.
/// Returns, for each lease, 1 when it was extended.
const RENEW_MANY: &str = r"
local renewed = {}
for i, key in ipairs(KEYS) do
  -- pcall: a key of another type (changed by hand) is not renewed, the batch's others are.
  if redis.pcall('GET', key) == ARGV[2 * i - 1] then
    renewed[i] = redis.call('PEXPIRE', key, ARGV[2 * i])
  else
    renewed[i] = 0
  end
end
return renewed
";

/// What one renewal of a batch came to.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Renewed {
    /// The lease still held the value and was extended.
    pub(crate) extended: bool,
    /// How many replicas confirmed the batch's writes (`WAIT`), when the batches ask for any.
    pub(crate) confirmed_by: Option<i64>,
}

/// A renewal's answer: the server's own error is left to the driver to read (a Sentinel driver
/// leaves a master that turned replica).
pub(crate) type Answer = std::result::Result<Renewed, redis::RedisError>;

struct Renewal {
    key: String,
    value: String,
    ttl_ms: u64,
    /// How long the batch's `WAIT` may take for this renewal.
    confirm_within: Duration,
}

/// The queue the renewals of one master go through.
pub(crate) struct RenewalBatches {
    batches: Batches<Renewal, Result<Answer>>,
}

impl RenewalBatches {
    /// Batches on `conn`; each batch is confirmed by `replicas` replicas (`WAIT`) when that is
    /// not 0.
    pub(crate) fn new<C>(conn: C, replicas: u32) -> Self
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let script = Script::new(RENEW_MANY);
        Self {
            batches: Batches::new(MAX_BATCH, move |batch| {
                send(batch, script.clone(), conn.clone(), replicas)
            }),
        }
    }

    /// Extend `key` to `ttl_ms` if it still holds `value`; a confirmation by replicas waits at
    /// most `confirm_within` (the least of a batch's).
    pub(crate) async fn renew(
        &self,
        key: String,
        value: String,
        ttl_ms: u64,
        confirm_within: Duration,
    ) -> Result<Answer> {
        self.batches
            .call(Renewal {
                key,
                value,
                ttl_ms,
                confirm_within,
            })
            .await?
    }
}

/// One script call for the batch, then (when replicas are asked for and a lease was extended)
/// one `WAIT` for all of it.
async fn send<C>(
    batch: Vec<Pending<Renewal, Result<Answer>>>,
    script: Script,
    mut conn: C,
    replicas: u32,
) where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let mut call = script.prepare_invoke();
    for pending in &batch {
        call.key(&pending.request.key);
    }
    for pending in &batch {
        call.arg(&pending.request.value).arg(pending.request.ttl_ms);
    }
    let reply = call.invoke_async::<Vec<i64>>(&mut conn).await;
    let Some((batch, renewed)) = one_each(batch, reply.map_err(Err), "renewals") else {
        return;
    };
    let mut confirmed_by = None;
    if replicas > 0 && renewed.contains(&1) {
        let within = batch
            .iter()
            .map(|p| p.request.confirm_within)
            .min()
            .unwrap_or_default();
        match redis::cmd("WAIT")
            .arg(replicas)
            .arg(within.as_millis() as u64)
            .query_async::<i64>(&mut conn)
            .await
        {
            Ok(acked) => confirmed_by = Some(acked),
            Err(e) => return answer_all(batch, Ok(Err(e))),
        }
    }
    for (pending, renewed) in batch.into_iter().zip(renewed) {
        let _ = pending.reply.send(Ok(Ok(Renewed {
            extended: renewed == 1,
            confirmed_by,
        })));
    }
}
