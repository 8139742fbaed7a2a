//! One driver per backend, each behind [`crate::Driver`]: an atomic compare-and-set per call.
//! Nothing here knows about URLs, resources or the holder state machine; those import drivers,
//! never the other way round.
//!
//! - [`redis`]: a single master, and beside it every backend that speaks Redis's protocol:
//!   Sentinel, Cluster, Redlock over several masters, Tair's versioned put.
//! - [`sql`]: PostgreSQL and MySQL/MariaDB (lease and row-lock modes, and the wake-ups the
//!   servers' own locks give), and SQLite.
//! - [`queue`]: the fair queue (one contender's place, waiting or holding) on its two
//!   transports, etcd and ZooKeeper.
//! - [`kubernetes`]: a `coordination.k8s.io/v1` Lease.
//! - `batches`: calls that arrive together go out as one (renewals, acquisitions, releases).

pub(crate) mod batches;
pub mod kubernetes;
pub mod queue;
pub mod redis;
pub mod sql;
