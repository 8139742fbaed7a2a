//! One driver per backend, each behind [`crate::Driver`]: an atomic compare-and-set per call.
//! Nothing here knows about the holder state machine or the CRD. Each backend's URL grammar
//! sits beside its driver, built on [`url_parts`]; the dispatch over schemes
//! ([`crate::backend_url`]) and the engine import drivers, never the other way round.
//!
//! - [`redis`]: a single master, and beside it every backend that speaks Redis's protocol:
//!   Sentinel, Cluster, Redlock over several masters, Tair's versioned put.
//! - [`sql`]: PostgreSQL and MySQL/MariaDB (lease and row-lock modes, and the wake-ups the
//!   servers' own locks give), and SQLite.
//! - [`queue`]: the fair queue (one contender's place, waiting or holding) on its two
//!   transports, etcd and ZooKeeper.
//! - [`kubernetes`]: a `coordination.k8s.io/v1` Lease.
//! - `batches`: calls that arrive together go out as one (renewals, acquisitions, releases).
//! - `replaceable`: a connection replaced once the server falls silent on it (Redis, etcd, the
//!   PostgreSQL and MySQL pool).
//! - [`url_parts`]: host lists, credentials, prefixes and URL errors, for every backend's URLs.

pub(crate) mod batches;
pub mod kubernetes;
pub mod queue;
pub mod redis;
pub(crate) mod replaceable;
pub mod sql;
pub(crate) mod url_parts;
