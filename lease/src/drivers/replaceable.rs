//! A client connection that is replaced once the server falls silent on it.
//!
//! A server whose node died without closing anything, a dropped NAT or conntrack entry, or a
//! Service that now sends new connections to a replacement, leaves an open connection with
//! nothing coming back; clients reconnect when a connection is closed, not when it falls
//! silent, and every request on it times out until the kernel gives it up, about fifteen
//! minutes later. Here a request that timed out replaces the connection, and so does the next
//! request after one its caller stopped waiting for has gone the response timeout without any
//! answer on the connection since (callers cut calls short by their own budgets). Requests
//! still waiting on the old connection end with their own timeouts.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What part of the server a request goes to, where an answer from one part says nothing of
/// another: a cluster's connection reaches several nodes, and a lock's requests go to its own.
/// [`WHOLE`] for a connection to one server.
pub(crate) type Part = u64;

/// The part of a connection to one server: all of it.
pub(crate) const WHOLE: Part = 0;

/// The most parts with a request abandoned that are remembered; past this many, they are
/// forgotten, and the next abandoned requests counted afresh.
const ABANDONED_PARTS: usize = 4096;

/// The current connection of type `C` (cheap to clone: a handle on a shared connection), and
/// how to make another.
pub(crate) struct Replaceable<C> {
    make: Box<dyn Fn() -> Result<C, String> + Send + Sync>,
    /// How long a request waits for its answer: a connection that answered nothing for as long
    /// since a request went out on it has fallen silent.
    response_timeout: Duration,
    what: &'static str,
    current: Mutex<Current<C>>,
}

struct Current<C> {
    /// How many times the connection was replaced: a request's timeout replaces only the
    /// connection it went out on, not one another request's timeout already put in its place.
    generation: u64,
    connection: C,
    /// For each part, when the oldest request to it whose caller stopped waiting went out, if
    /// that part has answered nothing since.
    abandoned: HashMap<Part, Instant>,
}

impl<C: Clone> Replaceable<C> {
    /// `first`, replaced by `make`'s connections (which should connect lazily, on their first
    /// request, so that replacing one waits for nothing); `what` names the server in logs.
    pub(crate) fn new(
        first: C,
        response_timeout: Duration,
        what: &'static str,
        make: impl Fn() -> Result<C, String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            make: Box::new(make),
            response_timeout,
            what,
            current: Mutex::new(Current {
                generation: 0,
                connection: first,
                abandoned: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Current<C>> {
        self.current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The connection for a request going out now: a new one where a request abandoned on the
    /// current one has gone the response timeout without an answer. Say how the request ended
    /// with [`Outgoing::answered`] or [`Outgoing::timed_out`]; dropped without either, it counts
    /// as abandoned.
    pub(crate) fn outgoing(&self) -> Outgoing<'_, C> {
        let (generation, connection) = self.current(WHOLE);
        self.sent_on(generation, connection, WHOLE)
    }

    /// The current connection and its generation for a request to `part`, replaced first as
    /// [`Self::outgoing`] does where a request abandoned on that part has gone unanswered: for a
    /// request that goes out later ([`Self::sent_on`]), once the connection is ready.
    pub(crate) fn current(&self, part: Part) -> (u64, C) {
        let mut current = self.lock();
        if current
            .abandoned
            .get(&part)
            .is_some_and(|since| since.elapsed() >= self.response_timeout)
        {
            let generation = current.generation;
            self.replace(
                &mut current,
                generation,
                "a request abandoned without an answer",
            );
        }
        (current.generation, current.connection.clone())
    }

    /// A request to `part` going out now on `connection`, of generation `generation`.
    pub(crate) fn sent_on(&self, generation: u64, connection: C, part: Part) -> Outgoing<'_, C> {
        Outgoing {
            owner: self,
            generation,
            part,
            sent: Instant::now(),
            connection,
            ended: false,
        }
    }

    /// Replace connection `generation` if it is still the current one: a request on it got no
    /// answer in time.
    pub(crate) fn timed_out_on(&self, generation: u64) {
        let mut current = self.lock();
        self.replace(&mut current, generation, "a request timed out");
    }

    /// How many times the connection was replaced, after the check [`Self::outgoing`] makes: for
    /// a connection replaced elsewhere than here, as a Sentinel master's is, by asking the
    /// sentinels again.
    pub(crate) fn generation(&self) -> u64 {
        self.current(WHOLE).0
    }

    /// The current connection, for a use that is not a request (reading its settings).
    pub(crate) fn peek(&self) -> C {
        self.lock().connection.clone()
    }

    /// Replace connection `generation` if it is still the current one.
    fn replace(&self, current: &mut Current<C>, generation: u64, why: &str) {
        if current.generation != generation {
            return;
        }
        match (self.make)() {
            Ok(connection) => {
                tracing::debug!(server = self.what, why, "replacing a silent connection");
                *current = Current {
                    generation: generation + 1,
                    connection,
                    abandoned: HashMap::new(),
                };
            }
            Err(e) => {
                tracing::debug!(server = self.what, error = %e, "replacing a silent connection failed")
            }
        }
    }
}

/// One request on a [`Replaceable`]'s connection, from when it goes out to how it ended.
pub(crate) struct Outgoing<'a, C: Clone> {
    owner: &'a Replaceable<C>,
    generation: u64,
    part: Part,
    sent: Instant,
    pub(crate) connection: C,
    ended: bool,
}

impl<C: Clone> Outgoing<'_, C> {
    /// The server answered (an error reply is an answer too): its part of the connection is
    /// alive, and so is the answer to any request abandoned on that part.
    pub(crate) fn answered(mut self) {
        self.ended = true;
        let mut current = self.owner.lock();
        if current.generation == self.generation {
            current.abandoned.remove(&self.part);
        }
    }

    /// The request never went out on the connection (none could be had), or ended on an error
    /// the client met on its own: it says nothing of the server.
    pub(crate) fn unsent(mut self) {
        self.ended = true;
    }

    /// No answer within the response timeout: the connection is replaced.
    pub(crate) fn timed_out(mut self) {
        self.ended = true;
        self.owner.timed_out_on(self.generation);
    }
}

impl<C: Clone> Drop for Outgoing<'_, C> {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let mut current = self.owner.lock();
        if current.generation != self.generation {
            return;
        }
        if current.abandoned.len() >= ABANDONED_PARTS && !current.abandoned.contains_key(&self.part)
        {
            current.abandoned.clear();
        }
        current.abandoned.entry(self.part).or_insert(self.sent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Connections numbered in the order they were made.
    fn numbered(timeout: Duration) -> (Replaceable<u32>, Arc<AtomicU32>) {
        let made = Arc::new(AtomicU32::new(0));
        let counter = made.clone();
        let replaceable = Replaceable::new(0, timeout, "test", move || {
            Ok(counter.fetch_add(1, Ordering::SeqCst) + 1)
        });
        (replaceable, made)
    }

    #[test]
    fn a_timeout_replaces_the_connection_it_met_once() {
        let (connections, _) = numbered(Duration::from_secs(5));
        let (a, b) = (connections.outgoing(), connections.outgoing());
        assert_eq!((a.connection, b.connection), (0, 0));
        a.timed_out();
        // The other request on the same connection times out too: it replaces nothing more.
        b.timed_out();
        let c = connections.outgoing();
        assert_eq!(c.connection, 1);
        c.answered();
    }

    #[test]
    fn an_abandoned_request_replaces_the_connection_only_after_the_timeout_unanswered() {
        let timeout = Duration::from_millis(50);
        let (connections, _) = numbered(timeout);
        drop(connections.outgoing());
        let next = connections.outgoing();
        assert_eq!(next.connection, 0, "not before the timeout");
        next.answered();
        // An answer since: the abandoned request was answered too.
        std::thread::sleep(timeout * 2);
        let later = connections.outgoing();
        assert_eq!(later.connection, 0, "answered since");
        drop(later);
        std::thread::sleep(timeout * 2);
        assert_eq!(connections.outgoing().connection, 1, "silent since");
    }

    #[test]
    fn an_answer_from_another_part_leaves_an_abandoned_request_unanswered() {
        let timeout = Duration::from_millis(50);
        let (connections, _) = numbered(timeout);
        let (generation, connection) = connections.current(1);
        drop(connections.sent_on(generation, connection, 1));
        let (generation, connection) = connections.current(2);
        connections.sent_on(generation, connection, 2).answered();
        std::thread::sleep(timeout * 2);
        assert_eq!(
            connections.current(2).1,
            0,
            "part 2 answered: nothing to replace"
        );
        assert_eq!(connections.generation(), 0);
        assert_eq!(connections.current(1).1, 1, "part 1 stayed silent");
        assert_eq!(connections.generation(), 1);
    }

    #[test]
    fn an_answer_on_a_replaced_connection_leaves_the_new_one_alone() {
        let timeout = Duration::from_millis(50);
        let (connections, made) = numbered(timeout);
        let old = connections.outgoing();
        connections.outgoing().timed_out();
        drop(connections.outgoing()); // abandoned on the new connection
        old.answered();
        std::thread::sleep(timeout * 2);
        assert_eq!(connections.outgoing().connection, 2);
        assert_eq!(made.load(Ordering::SeqCst), 2);
    }
}
