#![forbid(unsafe_code)]
//! The Leasehold sidecar: configuration, the localhost HTTP API, metrics and the process's life
//! (start, readiness, shutdown on signals; what it shares with the operator is `leasehold-process`).

pub mod api;
pub mod app_health;
pub mod config;
pub mod dapr;
pub mod exec;
pub mod from_resource;
pub mod hold_stream;
pub mod holder_label;
pub mod key_events;
pub mod lock_events;
pub mod metrics;
pub mod pod_exit;
pub mod run;
#[cfg(test)]
mod test_support;
