//! A connection to one Redis server that is replaced when the server leaves a request
//! unanswered.
//!
//! redis-rs's `ConnectionManager` reconnects when its connection is closed, but not when the
//! connection falls silent: a server whose node died without closing anything, or a Service
//! that now sends new connections to a replacement, leaves the old connection open with nothing
//! coming back, and every request on it times out until the kernel gives it up, about fifteen
//! minutes later. Here a request that times out replaces the connection, and so does the next
//! request after one its caller stopped waiting for (Redlock cuts each master's call short)
//! has gone a response timeout without an answer on the connection since. Requests still
//! waiting on the old connection end with their own timeouts.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};

use crate::drivers::redis::map_err;
use crate::error::Result;

/// Cheap to clone: clones share the current connection and replace it together.
#[derive(Clone)]
pub(crate) struct ServerConnection {
    shared: Arc<Shared>,
}

struct Shared {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// How long a request waits for its answer: a connection that answered nothing for as long
    /// since a request went out on it has fallen silent.
    response_timeout: Duration,
    current: Mutex<Current>,
}

struct Current {
    /// How many times the connection was replaced: a request's timeout replaces only the
    /// connection it went out on, not one another request's timeout already put in its place.
    generation: u64,
    manager: ConnectionManager,
    /// When the oldest request whose caller stopped waiting went out, if the connection has
    /// answered nothing since. Answers come in the order requests went out, so any later
    /// answer says that one was answered too.
    abandoned_since: Option<Instant>,
}

impl ServerConnection {
    /// Connects lazily, on the first request; `config` must set a response timeout, since that
    /// is what tells a silent connection.
    pub(crate) fn new(client: redis::Client, config: ConnectionManagerConfig) -> Result<Self> {
        let response_timeout = config
            .response_timeout()
            .expect("a Redis connection with a response timeout");
        let manager = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(map_err)?;
        Ok(Self {
            shared: Arc::new(Shared {
                client,
                config,
                response_timeout,
                current: Mutex::new(Current {
                    generation: 0,
                    manager,
                    abandoned_since: None,
                }),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Current> {
        self.shared
            .current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The connection a request goes out on now: a new one where a request abandoned on the
    /// current one has gone a response timeout without an answer.
    fn current(&self) -> (u64, ConnectionManager) {
        let mut current = self.lock();
        if current
            .abandoned_since
            .is_some_and(|since| since.elapsed() >= self.shared.response_timeout)
        {
            let generation = current.generation;
            self.replace(&mut current, generation, "an abandoned request");
        }
        (current.generation, current.manager.clone())
    }

    /// Replace connection `generation` if it is still the current one. Lazily: nothing is sent
    /// before the next request, and a connection that cannot be set up says so there.
    fn replace(&self, current: &mut Current, generation: u64, unanswered: &str) {
        if current.generation != generation {
            return;
        }
        match ConnectionManager::new_lazy_with_config(
            self.shared.client.clone(),
            self.shared.config.clone(),
        ) {
            Ok(manager) => {
                tracing::debug!(
                    request = unanswered,
                    "a Redis connection left a request unanswered: replacing it"
                );
                *current = Current {
                    generation: generation + 1,
                    manager,
                    abandoned_since: None,
                };
            }
            Err(e) => tracing::debug!(error = %e, "replacing a silent Redis connection failed"),
        }
    }
}

/// One request on connection `generation`, from when it goes out to its answer; dropped before
/// that, it marks the connection as owing an answer.
struct Request<'a> {
    connection: &'a ServerConnection,
    generation: u64,
    sent: Instant,
    answered: bool,
}

impl<'a> Request<'a> {
    fn new(connection: &'a ServerConnection, generation: u64) -> Self {
        Self {
            connection,
            generation,
            sent: Instant::now(),
            answered: false,
        }
    }

    /// The request ended with `result`: a timeout replaces the connection; anything else is an
    /// answer from it.
    fn ended<T>(mut self, result: &std::result::Result<T, RedisError>) {
        self.answered = true;
        let mut current = self.connection.lock();
        match result {
            Err(e) if e.is_timeout() => {
                self.connection
                    .replace(&mut current, self.generation, "a request timed out");
            }
            _ if current.generation == self.generation => current.abandoned_since = None,
            _ => {}
        }
    }
}

impl Drop for Request<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let mut current = self.connection.lock();
        if current.generation == self.generation && current.abandoned_since.is_none() {
            current.abandoned_since = Some(self.sent);
        }
    }
}

impl ConnectionLike for ServerConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut manager) = self.current();
            let request = Request::new(self, generation);
            let result = manager.req_packed_command(cmd).await;
            request.ended(&result);
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut manager) = self.current();
            let request = Request::new(self, generation);
            let result = manager.req_packed_commands(pipeline, offset, count).await;
            request.ended(&result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.current().1.get_db()
    }
}
