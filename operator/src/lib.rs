#![forbid(unsafe_code)]
//! The Leasehold operator. [`reconcile`] drives each `DistributedLock`: finalizer,
//! provisioning through [`backends`], status and events decided in [`status`]; [`election`]
//! makes one replica the reconciler; [`server`] serves metrics and probes; [`webhook`] decides
//! the sidecar injection from the locks [`lock_cache`] keeps, [`webhook_server`] serves it over HTTPS with the certificate that
//! [`webhook_tls`] keeps current ([`webhook_certs`] issues and rotates it); [`uninstall`] lets
//! every lock go when the operator is removed; [`api_rate_limit`] paces its API requests.

pub mod api_rate_limit;
pub mod backends;
pub mod config;
pub mod election;
pub mod error;
#[cfg(test)]
pub mod fixtures;
pub mod lock_cache;
pub mod metrics;
pub mod reconcile;
pub mod server;
pub mod status;
pub mod uninstall;
pub mod webhook;
pub mod webhook_certs;
pub mod webhook_server;
pub mod webhook_tls;
