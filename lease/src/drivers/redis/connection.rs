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
            let request = self.connections.outgoing();
            let mut conn = request.connection.clone();
            counted(request, conn.req_packed_command(cmd)).await
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let request = self.connections.outgoing();
            let mut conn = request.connection.clone();
            counted(request, conn.req_packed_commands(pipeline, offset, count)).await
        })
    }

    fn get_db(&self) -> i64 {
        self.connections.peek().get_db()
    }
}

/// `answer` to `request`, told to its connection as it ends: the client's response timeout
/// means the server left it unanswered; a reply, an error reply included, is an answer. An
/// error of the client's own (the connection closed or refused, no connection to the node)
/// says nothing of the server: a request abandoned earlier stays unanswered.
pub(crate) async fn counted<C: Clone, T>(
    request: Outgoing<'_, C>,
    answer: impl Future<Output = RedisResult<T>>,
) -> RedisResult<T> {
    let result = answer.await;
    match &result {
        Err(e) if e.is_timeout() => request.timed_out(),
        Err(e) if !replied(e) => request.unsent(),
        _ => request.answered(),
    }
    result
}

/// Whether `e` carries the server's reply, rather than an error the client met on its own.
fn replied(e: &redis::RedisError) -> bool {
    use redis::ErrorKind;
    !matches!(
        e.kind(),
        ErrorKind::Io
            | ErrorKind::Client
            | ErrorKind::ClusterConnectionNotFound
            | ErrorKind::InvalidClientConfig
            | ErrorKind::MasterNameNotFoundBySentinel
            | ErrorKind::NoValidReplicasFoundBySentinel
            | ErrorKind::EmptySentinelList
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A request abandoned on a connection, then one that ends with `error`: is the connection
    /// replaced once the response timeout has passed?
    async fn replaced_after(error: redis::RedisError) -> bool {
        let timeout = Duration::from_millis(50);
        let connections = Replaceable::new(0u32, timeout, "test", || Ok(1));
        drop(connections.outgoing());
        let _ = counted(connections.outgoing(), async { Err::<(), _>(error) }).await;
        tokio::time::sleep(timeout * 2).await;
        connections.outgoing().connection == 1
    }

    #[tokio::test]
    async fn only_a_reply_from_the_server_answers_a_request_abandoned_before() {
        let closed = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(
            replaced_after(closed.into()).await,
            "a connection closed is no sign of life from the server"
        );
        let reply = redis::RedisError::from((redis::ErrorKind::Extension, "ERR", "a reply".into()));
        assert!(!replaced_after(reply).await, "an error reply is an answer");
    }
}
