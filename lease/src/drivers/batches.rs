//! Requests sent together: a sidecar holding thousands of keys renews each of them every renew
//! interval, and one round trip per renewal would cost the backend a request each. Requests
//! that arrive within [`LINGER`] of each other go out as one batch, which the driver's `send`
//! carries out in one round trip and answers request by request.
//!
//! The wait costs a renewal at most [`LINGER`], far inside its budget, and nothing in safety:
//! the engine dates a claim from when it asked, and the backend's expiry, set later, only ends
//! later.
//!
//! Acquisitions cannot wait that long (a hand-over would), so their batches do not linger: a
//! request goes out at once unless [`IN_FLIGHT`] batches are on their way, and then goes out
//! with the others that arrived meanwhile, as soon as one of those is answered
//! ([`Gather::WhileBusy`]).

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
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

/// How many batches gathered [`Gather::WhileBusy`] may be out at once: one gathering while one
/// is answered.
const IN_FLIGHT: usize = 2;

/// How a batch is gathered.
#[derive(Clone, Copy)]
pub(crate) enum Gather {
    /// The first request waits [`LINGER`] for others; batches go out side by side.
    Linger,
    /// No wait: at most [`IN_FLIGHT`] batches out at a time, each of the requests that arrived
    /// while the others were out.
    WhileBusy,
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
        Self::gathered(Gather::Linger, max, send)
    }

    pub(crate) fn gathered<F, Fut>(gather: Gather, max: usize, send: F) -> Self
    where
        F: Fn(Vec<Pending<R, A>>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (queue, mut pending) = mpsc::unbounded_channel::<Pending<R, A>>();
        tokio::spawn(async move {
            match gather {
                Gather::Linger => {
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
                }
                Gather::WhileBusy => {
                    // The batches out are driven here, not on tasks of their own: one task
                    // less to wake for every batch, where a batch is a round trip or two.
                    let mut out = FuturesUnordered::new();
                    loop {
                        tokio::select! {
                            biased;
                            Some(()) = out.next(), if !out.is_empty() => {}
                            first = pending.recv(), if out.len() < IN_FLIGHT => {
                                let Some(first) = first else { break };
                                // The requests that arrived while the batches before were
                                // out go together.
                                let mut batch = vec![first];
                                while batch.len() < max {
                                    match pending.try_recv() {
                                        Ok(next) => batch.push(next),
                                        Err(_) => break,
                                    }
                                }
                                out.push(send(batch));
                            }
                        }
                    }
                    while out.next().await.is_some() {}
                }
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

/// The requests of one batch.
pub(crate) type Batch<R, A> = Vec<Pending<R, A>>;

/// A batch, and one result for each of its requests, in order.
pub(crate) type WithResults<R, A, T> = (Batch<R, A>, Vec<T>);

/// Give every request of `batch` the same answer: the batch failed as a whole.
pub(crate) fn answer_all<R, A: Clone>(batch: Batch<R, A>, answer: A) {
    for pending in batch {
        let _ = pending.reply.send(answer.clone());
    }
}

/// The batch with one result per request, in order; or `None` once every request has been told
/// why there are none: the call failed (each request is answered with `failed`), or its results
/// do not match the requests in number (each is answered with an error naming `what`).
pub(crate) fn one_each<R, A: Clone, T>(
    batch: Batch<R, Result<A>>,
    results: std::result::Result<Vec<T>, A>,
    what: &str,
) -> Option<WithResults<R, Result<A>, T>> {
    match results {
        Ok(results) if results.len() == batch.len() => Some((batch, results)),
        Ok(results) => {
            let error = Error::Backend(format!(
                "a batch of {} {what} was answered with {} results",
                batch.len(),
                results.len()
            ));
            answer_all(batch, Err(error));
            None
        }
        Err(failed) => {
            answer_all(batch, Ok(failed));
            None
        }
    }
}
