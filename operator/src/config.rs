//! The operator's configuration, read in one place: flags, each also an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

use crate::api_rate_limit;
use crate::webhook::{self, Injection, Resources};

/// Every address, IPv6 and IPv4 (IPv4 only where the kernel has no IPv6).
pub const DEFAULT_METRICS_LISTEN: &str = "[::]:8080";
/// The webhook's HTTPS port (the webhook Service's targetPort).
pub const DEFAULT_WEBHOOK_LISTEN: &str = "[::]:9443";
/// The names the chart gives the webhook's objects.
pub const DEFAULT_WEBHOOK_SERVICE: &str = "leasehold-webhook";
pub const DEFAULT_WEBHOOK_CONFIGURATION: &str = "leasehold";
pub const DEFAULT_WEBHOOK_SECRET: &str = "leasehold-webhook-tls";
/// The image injected as the sidecar, unless the chart says otherwise: the chart's default, a
/// name no registry serves (no image is published).
pub const DEFAULT_SIDECAR_IMAGE: &str =
    concat!("leasehold.invalid/leasehold:", env!("CARGO_PKG_VERSION"));

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

    /// Reconcile only the locks of these namespaces, comma-separated or repeated [default: all
    /// namespaces].
    #[arg(
        long = "watch-namespace",
        env = "LEASEHOLD_WATCH_NAMESPACE",
        value_delimiter = ',',
        value_parser = namespace_name
    )]
    pub watch_namespaces: Vec<String>,

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

    /// The sidecar's CPU request (a Kubernetes quantity; empty for none).
    #[arg(long, env = "LEASEHOLD_SIDECAR_CPU_REQUEST", default_value = webhook::DEFAULT_CPU_REQUEST, value_parser = quantity)]
    pub sidecar_cpu_request: String,

    /// The sidecar's memory request.
    #[arg(long, env = "LEASEHOLD_SIDECAR_MEMORY_REQUEST", default_value = webhook::DEFAULT_MEMORY_REQUEST, value_parser = quantity)]
    pub sidecar_memory_request: String,

    /// The sidecar's CPU limit [default: none, since a throttled holder renews late; set one
    /// where a namespace quota on limits.cpu requires it].
    #[arg(long, env = "LEASEHOLD_SIDECAR_CPU_LIMIT", default_value = "", value_parser = quantity)]
    pub sidecar_cpu_limit: String,

    /// The sidecar's memory limit.
    #[arg(long, env = "LEASEHOLD_SIDECAR_MEMORY_LIMIT", default_value = webhook::DEFAULT_MEMORY_LIMIT, value_parser = quantity)]
    pub sidecar_memory_limit: String,

    /// The injected sidecar's imagePullPolicy.
    #[arg(long, env = "LEASEHOLD_SIDECAR_IMAGE_PULL_POLICY", default_value = "IfNotPresent",
        value_parser = ["Always", "IfNotPresent", "Never"])]
    pub sidecar_image_pull_policy: String,

    /// Image pull secrets (names, in each injected pod's namespace) added to injected pods for
    /// the sidecar's image, beside the pod's own; comma-separated or repeated.
    #[arg(
        long,
        env = "LEASEHOLD_SIDECAR_IMAGE_PULL_SECRETS",
        value_delimiter = ','
    )]
    pub sidecar_image_pull_secret: Vec<String>,

    /// The CPU architectures the sidecar's image is built for (`kubernetes.io/arch` values,
    /// comma-separated): injected pods get a node affinity for them. Empty: any node, for a
    /// multi-architecture image.
    #[arg(
        long,
        env = "LEASEHOLD_SIDECAR_ARCHITECTURES",
        value_delimiter = ',',
        default_value = "amd64",
        value_parser = architecture
    )]
    pub sidecar_architectures: Vec<String>,

    /// The user the injected sidecar runs as (`runAsUser`), the image's own by default. Empty:
    /// none, where the platform assigns one from the namespace's range (OpenShift's restricted
    /// SCC refuses a user outside it); the sidecar still runs as non-root.
    #[arg(
        long,
        env = "LEASEHOLD_SIDECAR_RUN_AS_USER",
        default_value = "65532",
        value_parser = run_as_user
    )]
    pub sidecar_run_as_user: RunAsUser,

    /// Remove the operator's finalizer from every DistributedLock (of the --watch-namespace
    /// namespaces, or all), keeping their records, and exit: the chart's pre-delete hook, so that nothing stays
    /// Terminating once the operator is gone.
    #[arg(long)]
    pub release_finalizers: bool,

    /// With --release-finalizers: the operator's Deployment (in the pod's namespace), scaled to
    /// zero first, whose pods are waited out, so that no running operator adds its finalizer
    /// back.
    #[arg(long, requires = "operator_pods")]
    pub operator_deployment: Option<String>,

    /// With --operator-deployment: the label selector of its pods.
    #[arg(long, requires = "operator_deployment")]
    pub operator_pods: Option<String>,

    /// Requests per second the operator sends to the Kubernetes API, sustained (as client-go's
    /// QPS): a new leader, or many locks created at once, is paced instead of meeting the API
    /// server's fairness limits.
    #[arg(long, env = "LEASEHOLD_API_QPS", default_value_t = api_rate_limit::DEFAULT_QPS,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub api_qps: u32,

    /// Requests the operator may send to the Kubernetes API at once after a quiet spell.
    #[arg(long, env = "LEASEHOLD_API_BURST", default_value_t = api_rate_limit::DEFAULT_BURST,
        value_parser = clap::value_parser!(u32).range(1..))]
    pub api_burst: u32,

    /// Log format: text or json.
    #[arg(long, env = "LEASEHOLD_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
}

/// A namespace's name (a DNS-1123 label), or empty for none.
fn namespace_name(value: &str) -> Result<String, String> {
    let valid = value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !value.starts_with('-')
        && !value.ends_with('-');
    if valid {
        Ok(value.to_owned())
    } else {
        Err(format!(
            "{value:?} is not a namespace name (lower-case letters, digits and '-', at most 63)"
        ))
    }
}

/// Whose locks the operator reconciles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watched {
    AllNamespaces,
    /// These namespaces', each once, in order.
    Namespaces(Vec<String>),
}

impl Watched {
    /// The namespaces named, empty names left out; none named is every namespace.
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Self {
        let mut names: Vec<String> = names
            .iter()
            .map(|n| n.as_ref().to_owned())
            .filter(|n| !n.is_empty())
            .collect();
        names.sort();
        names.dedup();
        if names.is_empty() {
            Self::AllNamespaces
        } else {
            Self::Namespaces(names)
        }
    }

    /// Each namespace watched, or `None` once for all of them.
    pub fn scopes(&self) -> Vec<Option<&str>> {
        match self {
            Self::AllNamespaces => vec![None],
            Self::Namespaces(names) => names.iter().map(|ns| Some(ns.as_str())).collect(),
        }
    }

    /// One API handle per watched namespace, or one over all of them.
    pub fn apis<K>(&self, client: &kube::Client) -> Vec<kube::Api<K>>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        self.scopes()
            .into_iter()
            .map(|scope| api_in(client, scope))
            .collect()
    }
}

/// An API handle on `K` in namespace `scope`, or over all namespaces.
pub fn api_in<K>(client: &kube::Client, scope: Option<&str>) -> kube::Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match scope {
        Some(ns) => kube::Api::namespaced(client.clone(), ns),
        None => kube::Api::all(client.clone()),
    }
}

/// A `kubernetes.io/arch` value (a label value), or empty for none.
fn architecture(value: &str) -> Result<String, String> {
    let valid = value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c))
        && !value.starts_with(['-', '_', '.'])
        && !value.ends_with(['-', '_', '.']);
    if valid {
        Ok(value.to_owned())
    } else {
        Err(format!(
            "{value:?} is not a kubernetes.io/arch value (e.g. amd64, arm64)"
        ))
    }
}

/// A Kubernetes quantity, or empty for none.
fn quantity(value: &str) -> Result<String, String> {
    if value.is_empty() || webhook::is_quantity(value) {
        Ok(value.to_owned())
    } else {
        Err(format!(
            "{value:?} is not a Kubernetes quantity (e.g. 10m, 0.5, 64Mi)"
        ))
    }
}

/// `--sidecar-run-as-user`: a user, or none (empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAsUser(pub Option<i64>);

fn run_as_user(value: &str) -> Result<RunAsUser, String> {
    if value.is_empty() {
        return Ok(RunAsUser(None));
    }
    match value.parse::<i64>() {
        Ok(uid) if (1..=i64::from(i32::MAX)).contains(&uid) => Ok(RunAsUser(Some(uid))),
        _ => Err(format!(
            "{value:?} is not a user id from 1 to {} (the sidecar never runs as root), nor empty",
            i32::MAX
        )),
    }
}

impl Config {
    /// Whose locks to reconcile (`--watch-namespace`).
    pub fn watched(&self) -> Watched {
        Watched::from_names(&self.watch_namespaces)
    }

    /// How the webhook injects the sidecar.
    pub fn injection(&self) -> Injection {
        let set = |v: &String| (!v.is_empty()).then(|| v.clone());
        Injection {
            image: self.sidecar_image.clone(),
            native_sidecar: self.sidecar_mode == "native",
            resources: webhook::resources(&Resources {
                cpu_request: set(&self.sidecar_cpu_request),
                memory_request: set(&self.sidecar_memory_request),
                cpu_limit: set(&self.sidecar_cpu_limit),
                memory_limit: set(&self.sidecar_memory_limit),
            }),
            architectures: self
                .sidecar_architectures
                .iter()
                .filter(|a| !a.is_empty())
                .cloned()
                .collect(),
            image_pull_policy: self.sidecar_image_pull_policy.clone(),
            run_as_user: self.sidecar_run_as_user.0,
            image_pull_secrets: self
                .sidecar_image_pull_secret
                .iter()
                .filter(|n| !n.is_empty())
                .cloned()
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sidecar_resources_and_pull_secrets_come_from_flags() {
        let config = Config::try_parse_from([
            "leasehold-operator",
            "--sidecar-cpu-limit=",
            "--sidecar-memory-limit=128Mi",
            "--sidecar-cpu-request=",
            "--sidecar-image-pull-secret=a,b",
        ])
        .unwrap();
        let injection = config.injection();
        let r = &injection.resources;
        assert!(r.requests.as_ref().unwrap().get("cpu").is_none());
        assert_eq!(r.requests.as_ref().unwrap()["memory"].0, "16Mi");
        assert_eq!(r.limits.as_ref().unwrap()["memory"].0, "128Mi");
        assert!(r.limits.as_ref().unwrap().get("cpu").is_none());
        assert_eq!(injection.image_pull_secrets, ["a", "b"]);
        let error = Config::try_parse_from(["leasehold-operator", "--sidecar-cpu-limit=lots"])
            .unwrap_err()
            .to_string();
        assert!(error.contains("not a Kubernetes quantity"), "{error}");
    }

    #[test]
    fn the_sidecars_architectures_come_from_flags() {
        let parse = |args: &[&str]| {
            Config::try_parse_from([&["leasehold-operator"], args].concat())
                .map(|c| c.injection().architectures)
        };
        assert_eq!(parse(&[]).unwrap(), ["amd64"]);
        assert_eq!(
            parse(&["--sidecar-architectures=amd64,arm64"]).unwrap(),
            ["amd64", "arm64"]
        );
        assert!(
            parse(&["--sidecar-architectures="]).unwrap().is_empty(),
            "empty: any node"
        );
        let error = parse(&["--sidecar-architectures=AMD 64"])
            .unwrap_err()
            .to_string();
        assert!(error.contains("not a kubernetes.io/arch value"), "{error}");
    }

    #[test]
    fn the_sidecars_user_comes_from_a_flag_and_may_be_left_to_the_platform() {
        let parse = |args: &[&str]| {
            Config::try_parse_from([&["leasehold-operator"], args].concat())
                .map(|c| c.injection().run_as_user)
        };
        assert_eq!(parse(&[]).unwrap(), Some(65532));
        assert_eq!(
            parse(&["--sidecar-run-as-user=1000680000"]).unwrap(),
            Some(1000680000)
        );
        assert_eq!(parse(&["--sidecar-run-as-user="]).unwrap(), None);
        for refused in ["0", "-1", "root", "4294967296"] {
            let error = parse(&[&format!("--sidecar-run-as-user={refused}")])
                .unwrap_err()
                .to_string();
            assert!(error.contains("never runs as root"), "{refused}: {error}");
        }
    }

    #[test]
    fn the_watched_namespaces_come_from_flags() {
        let parse = |args: &[&str]| {
            Config::try_parse_from([&["leasehold-operator"], args].concat()).map(|c| c.watched())
        };
        assert_eq!(parse(&[]).unwrap(), Watched::AllNamespaces);
        assert_eq!(
            parse(&[
                "--watch-namespace=team-b,team-a",
                "--watch-namespace=team-a"
            ])
            .unwrap(),
            Watched::Namespaces(vec!["team-a".into(), "team-b".into()])
        );
        assert_eq!(
            parse(&["--watch-namespace="]).unwrap(),
            Watched::AllNamespaces
        );
        let error = parse(&["--watch-namespace=team-a,Team_B"])
            .unwrap_err()
            .to_string();
        assert!(error.contains("not a namespace name"), "{error}");
    }
}
