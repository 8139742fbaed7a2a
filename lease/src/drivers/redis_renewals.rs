//! Renewals on one Redis master sent together: a sidecar holding thousands of keys renews each
//! of them every renew interval, and one script call per renewal would cost Redis a request
//! each. Renewals that arrive within [`LINGER`] of each other go out as one script call, which
//! checks and extends each lease exactly as [`crate::drivers::redis::RENEW`] does alone.
//!
//! The wait costs a renewal at most [`LINGER`], far inside its budget, and nothing in safety:
//! the engine dates a claim from when it asked, and the server's expiry, set later, only ends
//! later. Behind Sentinel, the replicas' confirmation (`WAIT`) is asked once per batch too.
//! Not on a Redis Cluster, where one script may touch keys of one slot only.

use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::error::{Error, Result};

/// How long the first renewal of a batch waits for others.
pub const LINGER: Duration = Duration::from_millis(5);

/// The most renewals one script call carries.
pub(crate) const MAX_BATCH: usize = 512;

/// KEYS: leases. ARGV: for each lease in turn, its expected value and the new ttl in ms.
/// Returns, for each lease, 1 when it was extended.
const RENEW_MANY: &str = r"
local renewed = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[2 * i - 1] then
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
    reply: oneshot::Sender<Result<Answer>>,
}

/// The queue the renewals of one master go through; its task ends with the last sender.
pub(crate) struct RenewalBatches {
    queue: mpsc::UnboundedSender<Renewal>,
}

impl RenewalBatches {
    /// Batches on `conn`; each batch is confirmed by `replicas` replicas (`WAIT`) when that is
    /// not 0.
    pub(crate) fn new<C>(conn: C, replicas: u32) -> Self
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let (queue, renewals) = mpsc::unbounded_channel();
        tokio::spawn(gather(renewals, conn, replicas));
        Self { queue }
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
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Renewal {
                key,
                value,
                ttl_ms,
                confirm_within,
                reply,
            })
            .map_err(|_| Error::Shutdown)?;
        answer.await.map_err(|_| Error::Shutdown)?
    }
}

/// Gather renewals into batches; each batch is sent on its own, so that a slow answer holds up
/// only its own renewals.
async fn gather<C>(mut renewals: mpsc::UnboundedReceiver<Renewal>, conn: C, replicas: u32)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let script = Script::new(RENEW_MANY);
    while let Some(first) = renewals.recv().await {
        let mut batch = vec![first];
        let until = Instant::now() + LINGER;
        while batch.len() < MAX_BATCH {
            match tokio::time::timeout_at(until, renewals.recv()).await {
                Ok(Some(renewal)) => batch.push(renewal),
                Ok(None) | Err(_) => break,
            }
        }
        tokio::spawn(send(batch, script.clone(), conn.clone(), replicas));
    }
}

/// One script call for the batch, then (when replicas are asked for and a lease was extended)
/// one `WAIT` for all of it.
async fn send<C>(batch: Vec<Renewal>, script: Script, mut conn: C, replicas: u32)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let mut call = script.prepare_invoke();
    for renewal in &batch {
        call.key(&renewal.key);
    }
    for renewal in &batch {
        call.arg(&renewal.value).arg(renewal.ttl_ms);
    }
    let renewed: Vec<i64> = match call.invoke_async::<Vec<i64>>(&mut conn).await {
        Ok(renewed) if renewed.len() == batch.len() => renewed,
        Ok(renewed) => {
            let error = Error::Backend(format!(
                "a batch of {} renewals was answered with {} results",
                batch.len(),
                renewed.len()
            ));
            return answer_all(batch, Err(error));
        }
        Err(e) => return answer_all(batch, Ok(Err(e))),
    };
    let mut confirmed_by = None;
    if replicas > 0 && renewed.contains(&1) {
        let within = batch
            .iter()
            .map(|r| r.confirm_within)
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
    for (renewal, renewed) in batch.into_iter().zip(renewed) {
        let _ = renewal.reply.send(Ok(Ok(Renewed {
            extended: renewed == 1,
            confirmed_by,
        })));
    }
}

fn answer_all(batch: Vec<Renewal>, answer: Result<Answer>) {
    for renewal in batch {
        let _ = renewal.reply.send(answer.clone());
    }
}
