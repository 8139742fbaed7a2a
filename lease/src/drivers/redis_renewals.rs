//! Renewals on one Redis master sent together: a sidecar holding thousands of keys renews each
//! of them every renew interval, and one script call per renewal would cost Redis a request
//! each. Renewals that arrive within [`LINGER`] of each other go out as one script call, which
//! checks and extends each lease exactly as [`crate::drivers::redis::RENEW`] does alone.
//!
//! The wait costs a renewal at most [`LINGER`], far inside its budget, and nothing in safety:
//! the engine dates a claim from when it asked, and the server's expiry, set later, only ends
//! later. Not on a Redis Cluster, where one script may touch keys of one slot only.

use std::sync::Arc;
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionManager;
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

/// How a Redis error reads for the driver that owns the batches.
pub(crate) type Explain = Arc<dyn Fn(redis::RedisError) -> Error + Send + Sync>;

struct Renewal {
    key: String,
    value: String,
    ttl_ms: u64,
    reply: oneshot::Sender<Result<bool>>,
}

/// The queue the renewals of one master go through; its task ends with the last sender.
pub(crate) struct RenewalBatches {
    queue: mpsc::UnboundedSender<Renewal>,
}

impl RenewalBatches {
    pub(crate) fn new(conn: ConnectionManager, explain: Explain) -> Self {
        let (queue, renewals) = mpsc::unbounded_channel();
        tokio::spawn(gather(renewals, conn, explain));
        Self { queue }
    }

    /// Extend `key` to `ttl_ms` if it still holds `value`.
    pub(crate) async fn renew(&self, key: String, value: String, ttl_ms: u64) -> Result<bool> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Renewal {
                key,
                value,
                ttl_ms,
                reply,
            })
            .map_err(|_| Error::Shutdown)?;
        answer.await.map_err(|_| Error::Shutdown)?
    }
}

/// Gather renewals into batches; each batch is sent on its own, so that a slow answer holds up
/// only its own renewals.
async fn gather(
    mut renewals: mpsc::UnboundedReceiver<Renewal>,
    conn: ConnectionManager,
    explain: Explain,
) {
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
        tokio::spawn(send(batch, script.clone(), conn.clone(), explain.clone()));
    }
}

async fn send(batch: Vec<Renewal>, script: Script, mut conn: ConnectionManager, explain: Explain) {
    let mut call = script.prepare_invoke();
    for renewal in &batch {
        call.key(&renewal.key);
    }
    for renewal in &batch {
        call.arg(&renewal.value).arg(renewal.ttl_ms);
    }
    let renewed: std::result::Result<Vec<i64>, Error> =
        call.invoke_async(&mut conn).await.map_err(|e| explain(e));
    match renewed {
        Ok(renewed) if renewed.len() == batch.len() => {
            for (renewal, renewed) in batch.into_iter().zip(renewed) {
                let _ = renewal.reply.send(Ok(renewed == 1));
            }
        }
        Ok(renewed) => {
            let error = Error::Backend(format!(
                "a batch of {} renewals was answered with {} results",
                batch.len(),
                renewed.len()
            ));
            for renewal in batch {
                let _ = renewal.reply.send(Err(error.clone()));
            }
        }
        Err(error) => {
            for renewal in batch {
                let _ = renewal.reply.send(Err(error.clone()));
            }
        }
    }
}
