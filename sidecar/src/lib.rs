#![forbid(unsafe_code)]
//! The Leasehold sidecar: configuration, the localhost HTTP API, metrics and the process's life
//! (start, readiness, shutdown on signals).

pub mod api;
pub mod config;
pub mod dapr;
pub mod from_resource;
pub mod metrics;
pub mod pod_exit;
pub mod process;
pub mod run;
