//! The queue of an app's commands to one lock's task: one sender (the lock, shared by its
//! callers), one receiver (the task).
//!
//! Built here rather than taken from tokio's `mpsc`, whose channel allocates about 800 bytes up
//! front (cache-padded counters and a first block of 32 slots): a sidecar holding 10,000 keyed
//! locks paid 8 MB for queues that each carry one or two commands in their life. This one costs
//! a mutex, a queue and a `Notify`.
//!
//! It keeps `mpsc`'s guarantees that the engine relies on: a send fails once the task has ended
//! (its receiver dropped), and commands sent but not taken by then are dropped with it, so that
//! their callers' reply channels close instead of waiting forever. It is unbounded: each
//! command comes from a caller that waits for its reply, so the queue is no longer than the
//! requests in flight.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

struct Queue<T> {
    items: VecDeque<T>,
    /// The receiver has been dropped: sends fail.
    receiver_gone: bool,
    /// The sender has been dropped: once drained, `recv` answers `None`.
    sender_gone: bool,
}

struct Shared<T> {
    queue: Mutex<Queue<T>>,
    /// One permit per wake-up of the single receiver.
    ready: Notify,
}

impl<T> Shared<T> {
    fn queue(&self) -> MutexGuard<'_, Queue<T>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub(crate) struct Sender<T>(Arc<Shared<T>>);

pub(crate) struct Receiver<T>(Arc<Shared<T>>);

/// The receiver has ended; the command is given back.
#[derive(Debug)]
pub(crate) struct Closed<T>(pub(crate) T);

pub(crate) fn channel<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        queue: Mutex::new(Queue {
            items: VecDeque::new(),
            receiver_gone: false,
            sender_gone: false,
        }),
        ready: Notify::new(),
    });
    (Sender(shared.clone()), Receiver(shared))
}

impl<T> Sender<T> {
    pub(crate) fn send(&self, item: T) -> Result<(), Closed<T>> {
        {
            let mut queue = self.0.queue();
            if queue.receiver_gone {
                return Err(Closed(item));
            }
            queue.items.push_back(item);
        }
        self.0.ready.notify_one();
        Ok(())
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        self.0.queue().sender_gone = true;
        self.0.ready.notify_one();
    }
}

impl<T> Receiver<T> {
    /// The next command, or `None` once the sender is gone and the queue is empty.
    /// Cancel-safe: a command is taken only by the call that returns it, and a wake-up left by
    /// a cancelled call stays as `Notify`'s permit.
    pub(crate) async fn recv(&mut self) -> Option<T> {
        loop {
            {
                let mut queue = self.0.queue();
                if let Some(item) = queue.items.pop_front() {
                    return Some(item);
                }
                if queue.sender_gone {
                    return None;
                }
            }
            self.0.ready.notified().await;
        }
    }
}

impl<T> Receiver<T> {
    /// Take the first queued command that `pick` wants, without waiting.
    pub(crate) fn take_queued(&mut self, pick: impl Fn(&T) -> bool) -> Option<T> {
        let mut queue = self.0.queue();
        let at = queue.items.iter().position(pick)?;
        queue.items.remove(at)
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let dropped = {
            let mut queue = self.0.queue();
            queue.receiver_gone = true;
            std::mem::take(&mut queue.items)
        };
        // Outside the lock: a command's drop closes its caller's reply channel.
        drop(dropped);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::oneshot;
    use tokio::time::timeout;

    use super::*;

    #[tokio::test]
    async fn commands_arrive_in_order_and_end_when_the_sender_is_gone() {
        let (tx, mut rx) = channel();
        tx.send(1).unwrap();
        tx.send(2).unwrap();
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(rx.recv().await, Some(2));
        let waiting = tokio::spawn(async move {
            let third = rx.recv().await;
            (third, rx.recv().await)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "the sender is left: recv must wait");
        // Sent just before the sender goes: still delivered, and only then the end.
        tx.send(3).unwrap();
        drop(tx);
        let ended = timeout(Duration::from_secs(5), waiting).await;
        assert_eq!(
            ended.expect("woken by the sender's drop").unwrap(),
            (Some(3), None)
        );
    }

    #[tokio::test]
    async fn a_waiting_receiver_is_woken_by_a_send() {
        let (tx, mut rx) = channel();
        let waiting = tokio::spawn(async move { rx.recv().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.send(7).unwrap();
        let got = timeout(Duration::from_secs(5), waiting).await;
        assert_eq!(got.expect("woken").unwrap(), Some(7));
    }

    #[tokio::test]
    async fn a_cancelled_wait_loses_no_command() {
        use futures_util::FutureExt;
        let (tx, mut rx) = channel();
        {
            // Waiting, then woken by a send, then cancelled before it runs again: as the
            // engine's select drops it when a timer wins the same poll.
            let mut waiting = Box::pin(rx.recv());
            assert!((&mut waiting).now_or_never().is_none());
            tx.send("first").unwrap();
        }
        tx.send("second").unwrap();
        for expected in ["first", "second"] {
            let got = timeout(Duration::from_secs(5), rx.recv()).await;
            assert_eq!(got.expect("not lost"), Some(expected));
        }
        // Nothing left over: a further wait waits.
        assert!(timeout(Duration::from_millis(20), rx.recv()).await.is_err());
    }

    #[tokio::test]
    async fn after_the_receiver_ends_sends_fail_and_queued_callers_hear_of_it() {
        let (tx, rx) = channel();
        let (reply, answer) = oneshot::channel::<()>();
        tx.send(reply).unwrap();
        drop(rx);
        assert!(
            answer.await.is_err(),
            "a queued command's reply channel closes with the receiver"
        );
        let (reply, _answer) = oneshot::channel::<()>();
        assert!(tx.send(reply).is_err());
    }
}
