//! The pool the lock statements of PostgreSQL and MySQL/MariaDB go out on, with a time limit on
//! every answer.
//!
//! A server whose node died without closing anything, or a dropped NAT or conntrack entry, leaves
//! connections open with nothing coming back; sqlx waits on them without end, and tests a
//! connection returned to the pool with a ping that has no time limit either. One such
//! connection would hold one of the pool's few slots until the kernel gives it up, about fifteen
//! minutes later. Here a statement waits at most [`RESPONSE_TIMEOUT`], and a connection whose
//! statement timed out, or whose caller stopped waiting for it, is closed rather than returned.
//! The pool itself is [`Replaceable`]: the connections idle beside a silent one were opened
//! through the same path and are likely silent too, so a timeout replaces the pool, and the next
//! statements go out on connections made anew rather than time out on each idle one in turn.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::any::{AnyArguments, AnyPoolOptions, AnyQueryResult, AnyRow};
use sqlx::pool::PoolConnection;
use sqlx::{Any, AnyConnection, AnyPool};

use crate::drivers::replaceable::{Outgoing, Replaceable, WHOLE};
use crate::error::Error;

/// How long a statement waits for the server's answer. A lock statement answers in milliseconds;
/// one blocked inside the server behind another session's row lock is ended by the server
/// sooner ([`super::POOL_LOCK_WAIT`]).
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A statement with its parameters bound.
pub(crate) type AnyQuery<'q> = sqlx::query::Query<'q, Any, AnyArguments<'q>>;

/// The connections statements go out on; cheap to clone (clones share the pool, and replace it
/// together).
#[derive(Clone)]
pub(crate) struct StatementPool {
    pools: Arc<Replaceable<AnyPool>>,
}

impl StatementPool {
    /// A pool of `options`' connecting lazily to `url`.
    pub(crate) fn connect_lazy(options: AnyPoolOptions, url: &str) -> Result<Self, sqlx::Error> {
        let first = options.clone().connect_lazy(url)?;
        let url = url.to_owned();
        let make = move || {
            options
                .clone()
                .connect_lazy(&url)
                .map_err(|e| e.to_string())
        };
        Ok(Self {
            pools: Arc::new(Replaceable::new(first, RESPONSE_TIMEOUT, "database", make)),
        })
    }

    /// A connection of the pool's for one statement or several (a transaction).
    pub(crate) async fn session(&self) -> Result<PooledSession<'_>, sqlx::Error> {
        let (generation, pool) = self.pools.current(WHOLE);
        match pool.acquire().await {
            Ok(connection) => Ok(PooledSession {
                request: Some(self.pools.sent_on(generation, pool, WHOLE)),
                connection: Some(connection),
                answer_pending: false,
            }),
            Err(e) => {
                // Every connection is taken, and none came back for as long: they may be waiting
                // on a silent server (sqlx's test of a returned connection has no time limit).
                if matches!(e, sqlx::Error::PoolTimedOut) {
                    self.pools.timed_out_on(generation);
                }
                Err(e)
            }
        }
    }

    pub(crate) async fn execute(&self, query: AnyQuery<'_>) -> Result<AnyQueryResult, sqlx::Error> {
        self.session().await?.run(|c| query.execute(c)).await
    }

    pub(crate) async fn fetch_all(&self, query: AnyQuery<'_>) -> Result<Vec<AnyRow>, sqlx::Error> {
        self.session().await?.run(|c| query.fetch_all(c)).await
    }

    pub(crate) async fn fetch_one(&self, query: AnyQuery<'_>) -> Result<AnyRow, sqlx::Error> {
        self.session().await?.run(|c| query.fetch_one(c)).await
    }

    pub(crate) async fn fetch_optional(
        &self,
        query: AnyQuery<'_>,
    ) -> Result<Option<AnyRow>, sqlx::Error> {
        self.session().await?.run(|c| query.fetch_optional(c)).await
    }
}

/// One connection taken from a [`StatementPool`]. Dropped while a statement on it waits for its
/// answer (timed out, or its caller stopped waiting), it is closed, not returned.
pub(crate) struct PooledSession<'p> {
    /// The pool's part in this session: told how it ended when the session does.
    request: Option<Outgoing<'p, AnyPool>>,
    connection: Option<PoolConnection<Any>>,
    answer_pending: bool,
}

impl PooledSession<'_> {
    /// The connection, taken out of the pool for good (the pool makes another).
    pub(crate) fn detach(mut self) -> AnyConnection {
        if let Some(request) = self.request.take() {
            request.unsent();
        }
        self.connection
            .take()
            .expect("a pooled connection")
            .detach()
    }

    /// `statements` on this connection, answered within [`RESPONSE_TIMEOUT`].
    pub(crate) async fn run<'c, T, E, F>(
        &'c mut self,
        statements: impl FnOnce(&'c mut AnyConnection) -> F,
    ) -> Result<T, E>
    where
        F: Future<Output = Result<T, E>> + 'c,
        E: Unanswered,
    {
        self.run_within(RESPONSE_TIMEOUT, statements).await
    }

    /// `statements` on this connection, answered within `limit`.
    pub(crate) async fn run_within<'c, T, E, F>(
        &'c mut self,
        limit: Duration,
        statements: impl FnOnce(&'c mut AnyConnection) -> F,
    ) -> Result<T, E>
    where
        F: Future<Output = Result<T, E>> + 'c,
        E: Unanswered,
    {
        let Self {
            request,
            connection,
            answer_pending,
        } = self;
        let connection = connection.as_deref_mut().expect("a pooled connection");
        *answer_pending = true;
        let answer = tokio::time::timeout(limit, statements(connection)).await;
        match answer {
            Ok(answer) => {
                *answer_pending = false;
                answer
            }
            Err(_) => {
                if let Some(request) = request.take() {
                    request.timed_out();
                }
                // Still pending: the connection is closed when the session is dropped.
                Err(E::unanswered(limit))
            }
        }
    }
}

impl Drop for PooledSession<'_> {
    fn drop(&mut self) {
        if !self.answer_pending {
            if let Some(request) = self.request.take() {
                request.answered();
            }
            return;
        }
        if let Some(connection) = self.connection.take() {
            tracing::debug!("closing a database connection left without an answer");
            // Detached, the connection is dropped without the pool's test, which on a silent
            // connection would wait as long as the statement did; the pool makes another.
            drop(connection.detach());
        }
        // Dropped unanswered, the request counts as abandoned on the pool: the pool is replaced
        // if nothing answers on it for the response timeout.
    }
}

/// `statements` on a connection of its own (outside the pool), answered within `limit`: one the
/// server fell silent on fails, and its caller drops the connection.
pub(crate) async fn answered<T, E: Unanswered>(
    limit: Duration,
    statements: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    tokio::time::timeout(limit, statements)
        .await
        .unwrap_or_else(|_| Err(E::unanswered(limit)))
}

/// An error for a statement the server left unanswered past its time limit.
pub(crate) trait Unanswered {
    fn unanswered(limit: Duration) -> Self;
}

impl Unanswered for sqlx::Error {
    fn unanswered(limit: Duration) -> Self {
        sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the database did not answer within {limit:?}"),
        ))
    }
}

impl Unanswered for Error {
    fn unanswered(limit: Duration) -> Self {
        Error::Unreachable(format!("the database did not answer within {limit:?}"))
    }
}
