//! Requests sent together: a sidecar holding thousands of keys renews each of them every renew
//! interval, and one round trip per renewal would cost the backend a request each. Requests
//! that arrive within [`LINGER`] of each other go out as one batch, which the driver's `send`
//! carries out in one round trip and answers request by request.
//!
//! The wait costs a renewal at most [`LINGER`], far inside its budget, and nothing in safety:
//! the engine dates a claim from when it asked, and the backend's expiry, set later, only ends
//! later.

use std::future::Future;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::error::{Error, Result};

/// How long the first request of a batch waits for others.
pub const LINGER: Duration = Duration::from_millis(5);

/// One request of a batch, with where its answer goes.
pub(crate) struct Pending<R, A> {
    pub(crate) request: R,
    pub(crate) reply: oneshot::Sender<A>,
}

/// The queue requests go through; its task ends with the last sender.
pub(crate) struct Batches<R, A> {
    queue: mpsc::UnboundedSender<Pending<R, A>>,
}

impl<R: Send + 'static, A: Send + 'static> Batches<R, A> {
    /// Batches of at most `max` requests, each handed to `send` on a task of its own, so that
    /// a slow answer holds up only its own batch.
    pub(crate) fn new<F, Fut>(max: usize, send: F) -> Self
    where
        F: Fn(Vec<Pending<R, A>>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (queue, mut pending) = mpsc::unbounded_channel::<Pending<R, A>>();
        tokio::spawn(async move {
            while let Some(first) = pending.recv().await {
                let mut batch = vec![first];
                let until = Instant::now() + LINGER;
                while batch.len() < max {
                    match tokio::time::timeout_at(until, pending.recv()).await {
                        Ok(Some(next)) => batch.push(next),
                        Ok(None) | Err(_) => break,
                    }
                }
                tokio::spawn(send(batch));
            }
        });
        Self { queue }
    }

    /// `request`'s answer, once its batch is answered.
    pub(crate) async fn call(&self, request: R) -> Result<A> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Pending { request, reply })
            .map_err(|_| Error::Shutdown)?;
        answer.await.map_err(|_| Error::Shutdown)
    }
}
