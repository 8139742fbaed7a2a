//! A connection to one Redis server, replaced when the server falls silent on it
//! ([`Replaceable`]). redis-rs's `ConnectionManager` reconnects when its connection is closed,
//! not when it falls silent: a timeout is not a dropped connection to it.

use std::sync::Arc;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

use crate::drivers::redis::map_err;
use crate::drivers::replaceable::{Outgoing, Replaceable};
use crate::error::Result;

/// Cheap to clone: clones share the current connection and replace it together.
#[derive(Clone)]
pub(crate) struct ServerConnection {
    connections: Arc<Replaceable<ConnectionManager>>,
}

impl ServerConnection {
    /// Connects lazily, on the first request; `config` must set a response timeout, since that
    /// is what tells a silent connection.
    pub(crate) fn new(client: redis::Client, config: ConnectionManagerConfig) -> Result<Self> {
        let response_timeout = config
            .response_timeout()
            .expect("a Redis connection with a response timeout");
        let first = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(map_err)?;
        let make = move || {
            ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                .map_err(|e| e.to_string())
        };
        Ok(Self {
            connections: Arc::new(Replaceable::new(first, response_timeout, "Redis", make)),
        })
    }
}

impl ConnectionLike for ServerConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let mut request = self.connections.outgoing();
            let result = request.connection.req_packed_command(cmd).await;
            ended(request, &result);
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
            let mut request = self.connections.outgoing();
            let result = request
                .connection
                .req_packed_commands(pipeline, offset, count)
                .await;
            ended(request, &result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.connections.peek().get_db()
    }
}

/// Tell `request`'s connection how it ended: the client's response timeout means the server left
/// it unanswered; anything else, an error reply included, is an answer.
pub(crate) fn ended<C: Clone, T>(request: Outgoing<'_, C>, result: &RedisResult<T>) {
    match result {
        Err(e) if e.is_timeout() => request.timed_out(),
        _ => request.answered(),
    }
}
