//! One driver per backend, each behind [`crate::Driver`]: an atomic compare-and-set per call.
//! Nothing here knows about URLs, resources or the holder state machine; those import drivers,
//! never the other way round.

pub(crate) mod batches;
pub mod etcd;
pub mod etcd_rpc;
pub mod kubernetes;
pub(crate) mod queue_slot;
pub mod redis;
pub(crate) mod redis_acquisitions;
pub(crate) mod redis_cluster;
pub(crate) mod redis_releases;
pub(crate) mod redis_renewals;
pub mod redis_sentinel;
pub mod redlock;
pub mod sql;
pub(crate) mod sql_row_lock;
pub mod sql_wake;
pub mod sqlite;
pub(crate) mod sqlite_wake;
pub mod tair;
pub mod zookeeper;
