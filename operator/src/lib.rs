#![forbid(unsafe_code)]
//! The Leasehold operator. [`reconcile`] drives each `DistributedLock`: finalizer,
//! provisioning through [`backends`], status and events decided in [`status`]; [`election`]
//! makes one replica the reconciler; [`server`] serves metrics and probes; [`webhook`] decides
//! the sidecar injection.

pub mod backends;
pub mod config;
pub mod election;
pub mod error;
#[cfg(test)]
pub mod fixtures;
pub mod metrics;
pub mod reconcile;
pub mod server;
pub mod status;
pub mod webhook;
