#![forbid(unsafe_code)]
//! The Leasehold lease engine.
//!
//! - [`Driver`]: what the engine calls, one atomic compare-and-set per call, one implementation per backend
//!   ([`sqlite::SqliteDriver`], [`redis::RedisDriver`], [`redlock::RedlockDriver`],
//!   [`sql::SqlDriver`] for PostgreSQL and MySQL/MariaDB, [`etcd::EtcdDriver`],
//!   [`zookeeper::ZooKeeperDriver`], [`kubernetes::KubernetesLeaseDriver`]).
//! - [`Lock`]: the holder state machine shared by all drivers: campaign or on-demand acquisition,
//!   renewal, release, wake-ups, and self-fencing.
//! - [`connect`]: a driver from a [`BackendUrl`].
//! - [`drivers`]: one folder per backend family (Redis and its kin, SQL, the fair queue) and the
//!   Kubernetes Lease; the engine (this folder) imports them, and they import only the trait,
//!   the error type and the name rules.
//! - Test support (real backend servers, fault wrappers, the conformance suite) is the
//!   `leasehold-testkit` crate; the `test-hooks` feature exposes what only it calls.

mod backend_url;
pub mod boot_clock;
mod commands;
mod driver;
pub mod drivers;
mod error;
mod holder;
pub mod keyed;
pub mod names;
mod records;
mod redact;
pub mod tls;

pub use drivers::kubernetes;
pub use drivers::queue::{etcd, zookeeper};
pub use drivers::redis::{self, redlock, sentinel as redis_sentinel, tair};
pub use drivers::sql::{self, sqlite};

use std::sync::Arc;

pub use backend_url::{
    BackendUrl, DEFAULT_BACKEND, DEFAULT_TABLE, EtcdConfig, KubernetesConfig, Login,
    RedisClusterConfig, RedisConfig, RedisOptions, RedlockConfig, SentinelConfig, SqlConfig,
    SqlServer, SqliteConfig, TairConfig, ZooKeeperConfig,
};
pub use boot_clock::BootInstant;
pub use driver::{
    Acquire, Backend, ChangeFeeds, Driver, Holding, Lease, Provisioned, RESTART_GUARD, Upkeep,
    Withheld,
};
pub use error::{Error, Result};
pub use holder::{
    Answer, DEFAULT_HOLD, Event, EventKind, Held, Lock, LockConfig, MAX_LEASE_DURATION,
    MIN_LEASE_DURATION, Mode, SHUTDOWN_RELEASE_TIMEOUT, Snapshot, Telemetry, WithheldUntil,
    safety_margin,
};
pub use records::{RECORDS_DELETER, delete_records};
pub use redact::redact;

/// Open the driver a backend URL names. Network backends connect lazily, so an unreachable
/// server shows up in readiness and answers, not as a start-up failure.
pub async fn connect(url: &BackendUrl) -> Result<Arc<dyn Backend>> {
    Ok(match url {
        BackendUrl::Sqlite(c) => Arc::new(sqlite::SqliteDriver::open(&c.path, &c.table).await?),
        BackendUrl::Redis(c) => Arc::new(redis::RedisDriver::connect(
            &c.url,
            &c.prefix,
            c.tls.as_ref(),
        )?),
        BackendUrl::RedisSentinel(c) => Arc::new(redis_sentinel::RedisSentinelDriver::connect(c)),
        BackendUrl::RedisCluster(c) => Arc::new(redis::RedisDriver::connect_cluster(
            &c.nodes,
            &c.prefix,
            c.tls.as_ref(),
        )?),
        BackendUrl::Tair(c) => Arc::new(tair::TairDriver::connect(
            &c.url,
            &c.prefix,
            c.tls.as_ref(),
        )?),
        BackendUrl::Redlock(c) => Arc::new(redlock::RedlockDriver::connect(
            &c.masters,
            &c.prefix,
            c.tls.as_ref(),
        )?),
        BackendUrl::Etcd(c) => Arc::new(etcd::EtcdDriver::connect(c.clone())?),
        BackendUrl::ZooKeeper(c) => Arc::new(zookeeper::ZooKeeperDriver::connect(c.clone())?),
        BackendUrl::Kubernetes(c) => Arc::new(
            kubernetes::KubernetesLeaseDriver::connect(c.namespace.as_deref())
                .await?
                .yielding_to_preferred_holder(c.yield_to_preferred_holder),
        ),
        BackendUrl::Sql(c) => Arc::new(sql::SqlDriver::connect(
            c.dialect,
            c.url.as_str(),
            c.schema.as_deref(),
            &c.table,
            c.mode,
        )?),
    })
}
