//! Redis, single master ([`crate::redlock`] spans several). The lease is one key, `SET NX PX` inside an acquire script that also
//! takes the fencing token from a per-lock `INCR` counter, so a token is only ever handed out
//! together with the key. Renew and release are scripts that compare the stored value (token and
//! identity) before they touch the key. A release publishes on a channel that waiters listen to.
//!
//! Keys use a hash tag on the lock name (`leasehold:{jobs}:lease`, `leasehold:{jobs}:token`) so
//! both keys of a lock land in one slot of a Redis Cluster, which this driver also serves
//! (`redis+cluster://`, see [`crate::drivers::redis::cluster`]).
//!
//! Restarts: a server without persistence (or one that lost the last second of `appendfsync
//! everysec`) comes back without leases their holders still claim, and without their token
//! counters. The acquire script's epoch record (see [`ACQUIRE`]) makes such a server wait out
//! one lease before it grants a free lock, and raises the counters above every earlier token; a
//! durable server (`appendfsync always`) lost nothing and goes on at once.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::Script;
use redis::Value;
use tokio::sync::watch;

use crate::driver::{Acquire, ChangeFeeds, Driver, Holding, Lease, Upkeep};
use crate::drivers::redis::acquisitions::AcquisitionBatches;
use crate::drivers::redis::connection::ServerConnection;
use crate::drivers::redis::durability::Durability;
use crate::drivers::redis::releases::ReleaseBatches;
use crate::drivers::redis::renewals::RenewalBatches;
use crate::drivers::redis::{
    ACQUIRE, KEY_COUNTER_RETENTION, Keeping, KeyLayout, OBSERVE, RELEASE, RENEW, acquired,
    acquisition, client, connection, delete_keys, durability_unread, explain, held_key_leases,
    lease_value, listen_for_releases_on, lock_key_warnings, ms, only_result, parse_value_and_pttl,
    released_one, releases_of,
};
use crate::error::{Error, Result};
use crate::tls::Tls;

pub struct RedisDriver {
    target: Target,
    /// Over TLS: a timeout then most likely means no TLS on the other side.
    tls: bool,
    keys: KeyLayout,
    durability: Durability,
    acquire: Script,
    renew: Script,
    release: Script,
    observe: Script,
    releases: Arc<ChangeFeeds>,
    subscriber: tokio::task::JoinHandle<()>,
    /// On one master, renewals go out together ([`crate::drivers::redis::renewals`]).
    renewals: Option<RenewalBatches>,
    /// On one master, acquisitions under way at once go out together
    /// ([`crate::drivers::redis::acquisitions`]).
    acquisitions: Option<AcquisitionBatches>,
    /// On one master, releases under way at once go out together
    /// ([`crate::drivers::redis::releases`]).
    release_batches: Option<ReleaseBatches>,
}

/// One master, or a Redis Cluster.
enum Target {
    Single(ServerConnection),
    Cluster(Box<crate::drivers::redis::cluster::Cluster>),
}

/// A connection to either: a cluster's routes each script to its keys' master.
#[derive(Clone)]
enum Connection {
    Single(ServerConnection),
    Cluster(crate::drivers::redis::cluster::ClusterLink),
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

impl Drop for RedisDriver {
    fn drop(&mut self) {
        self.subscriber.abort();
    }
}

impl RedisDriver {
    /// [`map_err`], and over TLS a timeout explained: a plain-text server may never answer a
    /// TLS handshake (it waits for the end of a command line that never comes).
    fn error(&self, e: redis::RedisError) -> Error {
        explain(e, self.tls)
    }

    /// Set up the connection lazily: an unreachable Redis at start-up is reported by the lease
    /// loop and readiness, not by a crash.
    pub fn connect(url: &url::Url, prefix: &str, tls: Option<&Tls>) -> Result<Self> {
        let client = client(url, tls)?;
        let target = Target::Single(connection(&client)?);
        Ok(Self::with(
            target,
            tls.is_some(),
            KeyLayout::new(prefix),
            vec![client],
        ))
    }

    /// A Redis Cluster found from `nodes` (`redis+cluster://`, over TLS `rediss+cluster://`);
    /// connects lazily, as [`RedisDriver::connect`] does. Release notices come from any node
    /// that answers.
    pub fn connect_cluster(nodes: &[url::Url], prefix: &str, tls: Option<&Tls>) -> Result<Self> {
        let target = Target::Cluster(Box::new(crate::drivers::redis::cluster::Cluster::new(
            nodes, tls,
        )?));
        let clients = nodes
            .iter()
            .map(|node| client(node, tls))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::with(
            target,
            tls.is_some(),
            KeyLayout::for_cluster(prefix),
            clients,
        ))
    }

    /// The driver on `target`, listening for release notices on the first of `clients` that
    /// answers.
    fn with(target: Target, tls: bool, keys: KeyLayout, clients: Vec<redis::Client>) -> Self {
        let releases = Arc::new(ChangeFeeds::default());
        let subscriber = tokio::spawn(listen_for_releases_on(
            clients,
            keys.clone(),
            releases.clone(),
        ));
        let (renewals, acquisitions, release_batches) = match &target {
            Target::Single(conn) => (
                Some(RenewalBatches::new(conn.clone(), 0)),
                Some(AcquisitionBatches::new(conn.clone(), keys.clone())),
                Some(ReleaseBatches::new(conn.clone(), keys.clone())),
            ),
            Target::Cluster(_) => (None, None, None),
        };
        Self {
            renewals,
            acquisitions,
            release_batches,
            target,
            tls,
            keys,
            durability: Durability::default(),
            acquire: Script::new(ACQUIRE),
            renew: Script::new(RENEW),
            release: Script::new(RELEASE),
            observe: Script::new(OBSERVE),
            releases,
            subscriber,
        }
    }

    async fn connection(&self) -> Result<Connection> {
        match &self.target {
            Target::Single(conn) => Ok(Connection::Single(conn.clone())),
            Target::Cluster(cluster) => Ok(Connection::Cluster(cluster.connection().await?)),
        }
    }

    /// How the server keeps its data, as cached, or read now where `fresh`
    /// ([`Durability::of_or_fresh`]).
    async fn keeping(&self, conn: &mut Connection, fresh: bool) -> Result<Keeping> {
        Ok(match conn {
            Connection::Single(_) => Keeping::from_reading(
                self.durability
                    .of_or_fresh(conn, "", fresh)
                    .await
                    .map_err(|e| self.error(e))?,
                |read_on| Keeping::Durable { read_on },
            ),
            Connection::Cluster(cluster) => Keeping::from_reading(
                self.durability
                    .of_cluster_or_fresh(&mut cluster.conn, fresh)
                    .await,
                |read_on| Keeping::DurableClusterNode { read_on },
            ),
        })
    }

    /// One acquisition attempt on `conn`, as [`Driver::try_acquire`] makes it, with the
    /// server's durability read now where `fresh`.
    async fn acquire_once(
        &self,
        conn: &mut Connection,
        lock: &str,
        identity: &str,
        ttl: Duration,
        fresh: bool,
    ) -> Result<std::result::Result<Value, redis::RedisError>> {
        let keeping = self.keeping(conn, fresh).await?;
        Ok(match &self.acquisitions {
            Some(batches) => batches.acquire(lock, identity, ttl, keeping).await?,
            None => match acquisition(&self.acquire, &self.keys, lock, identity, ttl, &keeping)
                .invoke_async::<Value>(conn)
                .await
            {
                Ok(reply) => Ok(only_result(reply)?),
                Err(e) => Err(e),
            },
        })
    }
}

#[async_trait]
impl Driver for RedisDriver {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn try_acquire(&self, lock: &str, identity: &str, ttl: Duration) -> Result<Acquire> {
        let mut conn = self.connection().await?;
        let mut answer = self
            .acquire_once(&mut conn, lock, identity, ttl, false)
            .await?;
        if matches!(&answer, Err(e) if durability_unread(e)) {
            // The server is another incarnation than the durability reading was made on.
            answer = self
                .acquire_once(&mut conn, lock, identity, ttl, true)
                .await?;
        }
        let result = answer.map_err(|e| self.error(e))?;
        acquired(lock, identity, &result)
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<bool> {
        if let Some(renewals) = &self.renewals {
            let key = self.keys.lease(&lease.lock);
            let answer = renewals
                .renew(key, lease_value(lease), ms(ttl), Duration::ZERO)
                .await?;
            return answer.map(|r| r.extended).map_err(|e| self.error(e));
        }
        let mut conn = self.connection().await?;
        let renewal = |records: bool| {
            let mut renewal = self.renew.prepare_invoke();
            renewal
                .key(self.keys.lease(&lease.lock))
                .arg(lease_value(lease))
                .arg(ms(ttl));
            if records {
                renewal
                    .key(self.keys.epoch_of(&lease.lock))
                    .key(self.keys.counter(&lease.lock))
                    .arg(ms(KEY_COUNTER_RETENTION));
            }
            renewal
        };
        let records = self.keys.records_expire(&lease.lock);
        let renewed: redis::RedisResult<i64> = renewal(records).invoke_async(&mut conn).await;
        let renewed = match renewed {
            // A slot being migrated answers a call on several of its keys, some of them not
            // there (records gone already), TRYAGAIN on both nodes: the lease alone follows
            // the migration, and its records are kept at a later renewal.
            Err(e)
                if records
                    && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain) =>
            {
                renewal(false).invoke_async(&mut conn).await
            }
            other => other,
        };
        Ok(renewed.map_err(|e| self.error(e))? == 1)
    }

    async fn release(&self, lease: &Lease) -> Result<bool> {
        if let Some(batches) = &self.release_batches {
            return batches.release(lease).await?.map_err(|e| self.error(e));
        }
        let mut conn = self.connection().await?;
        let reply: Value = releases_of(&self.release, &self.keys, &[lease])
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.error(e))?;
        Ok(released_one(&reply))
    }

    async fn observe(&self, lock: &str) -> Result<Option<Holding>> {
        let mut conn = self.connection().await?;
        let reply: Value = self
            .observe
            .key(self.keys.lease(lock))
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.error(e))?;
        Ok(parse_value_and_pttl(&reply))
    }

    fn changes(&self, lock: &str) -> Option<watch::Receiver<u64>> {
        Some(self.releases.subscribe(lock))
    }

    async fn ping(&self) -> Result<()> {
        let mut conn = self.connection().await?;
        // A cluster answers from every node: any answer will do.
        let _: Value = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(|e| self.error(e))?;
        Ok(())
    }
}

#[async_trait]
impl Upkeep for RedisDriver {
    async fn deprovision(&self, locks: &[String]) -> Result<()> {
        delete_keys(&mut self.connection().await?, &self.keys, locks).await
    }

    /// The holding's lease is released, matched as a release is: the deletion itself (the
    /// token counter stays, the waiters' mark goes with the lease).
    async fn deprovision_held(&self, lease: &Lease) -> Result<()> {
        crate::driver::deleted_as_released(lease, self.release(lease).await?)
    }

    async fn warnings(&self) -> Result<Vec<String>> {
        match self.connection().await? {
            Connection::Cluster(mut cluster) => {
                crate::drivers::redis::cluster::warnings(&mut cluster.conn).await
            }
            mut single => lock_key_warnings(&mut single).await,
        }
    }

    /// On a cluster, each master's keyspace in turn: a family's keys are spread over the slots.
    /// A key whose slot moves while the masters are read may be counted twice or not at all.
    async fn count_held_keys(&self, family: &str) -> Result<Option<u64>> {
        let held = match &self.target {
            Target::Single(conn) => held_key_leases(&mut conn.clone(), &self.keys, family)
                .await?
                .len(),
            Target::Cluster(cluster) => {
                let conn = cluster.connection().await?;
                let mut held = 0;
                for mut master in crate::drivers::redis::cluster::every_master(&conn.conn).await? {
                    held += held_key_leases(&mut master, &self.keys, family)
                        .await?
                        .len();
                }
                held
            }
        };
        Ok(Some(held as u64))
    }
}
