//! The operator's configuration, read in one place: flags, each also an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

pub const DEFAULT_METRICS_LISTEN: &str = "0.0.0.0:8080";
/// The webhook's HTTPS port (the webhook Service's targetPort).
pub const DEFAULT_WEBHOOK_LISTEN: &str = "0.0.0.0:9443";
/// The names the chart gives the webhook's objects.
pub const DEFAULT_WEBHOOK_SERVICE: &str = "leasehold-webhook";
pub const DEFAULT_WEBHOOK_CONFIGURATION: &str = "leasehold";
pub const DEFAULT_WEBHOOK_SECRET: &str = "leasehold-webhook-tls";
/// The image injected as the sidecar, unless the chart says otherwise.
pub const DEFAULT_SIDECAR_IMAGE: &str = concat!("leasehold/leasehold:", env!("CARGO_PKG_VERSION"));

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

    /// The injection webhook's HTTPS listener.
    #[arg(long, env = "LEASEHOLD_WEBHOOK_LISTEN", default_value = DEFAULT_WEBHOOK_LISTEN)]
    pub webhook_listen: SocketAddr,

    /// Serve the webhook with the certificate mounted here (tls.crt, tls.key; cert-manager),
    /// reloaded when it changes [default: generate a CA and certificate, rotate them, and set
    /// the webhook configuration's caBundle].
    #[arg(long, env = "LEASEHOLD_WEBHOOK_CERT_DIR")]
    pub webhook_cert_dir: Option<PathBuf>,

    /// The Service in front of the webhook (in the operator's namespace): the certificate's name.
    #[arg(long, env = "LEASEHOLD_WEBHOOK_SERVICE", default_value = DEFAULT_WEBHOOK_SERVICE)]
    pub webhook_service: String,

    /// The MutatingWebhookConfiguration whose caBundle the operator keeps current.
    #[arg(long, env = "LEASEHOLD_WEBHOOK_CONFIGURATION", default_value = DEFAULT_WEBHOOK_CONFIGURATION)]
    pub webhook_configuration: String,

    /// The Secret (in the operator's namespace) that holds the generated CA and certificate.
    #[arg(long, env = "LEASEHOLD_WEBHOOK_SECRET", default_value = DEFAULT_WEBHOOK_SECRET)]
    pub webhook_secret: String,

    /// The image injected as the sidecar.
    #[arg(long, env = "LEASEHOLD_SIDECAR_IMAGE", default_value = DEFAULT_SIDECAR_IMAGE)]
    pub sidecar_image: String,

    /// Inject a native sidecar (an init container with restartPolicy Always, Kubernetes 1.29+),
    /// or a plain container for older clusters.
    #[arg(long, env = "LEASEHOLD_SIDECAR_MODE", default_value = "native", value_parser = ["native", "container"])]
    pub sidecar_mode: String,

    /// Log format: text or json.
    #[arg(long, env = "LEASEHOLD_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
}
