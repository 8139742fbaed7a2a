//! The operator's configuration, read in one place: flags, each also an environment variable.

use std::net::SocketAddr;

use clap::Parser;

pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:8080";

#[derive(Debug, Clone, Parser)]
#[command(
    name = "leasehold-operator",
    version,
    about = "Reconciles DistributedLock resources: provisions backends, reports holders and health, cleans up."
)]
pub struct Config {
    /// /metrics, /healthz and /readyz.
    #[arg(long, env = "LEASEHOLD_METRICS_LISTEN", default_value = DEFAULT_METRICS_LISTEN)]
    pub metrics_listen: SocketAddr,

    /// Reconcile only the locks of this namespace [default: all namespaces].
    #[arg(long, env = "LEASEHOLD_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,

    /// Where the replicas elect their leader [default: the pod's namespace].
    #[arg(long, env = "POD_NAMESPACE")]
    pub election_namespace: Option<String>,

    /// This replica's name in the election and in events [default: the hostname].
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,

    /// Log format: text or json.
    #[arg(long, env = "LEASEHOLD_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
}
