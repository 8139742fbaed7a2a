//! The pod-injection webhook's decision: which pods get the sidecar, and the JSON patch that adds
//! it. Pure functions over the pod and the names of the locks that exist; the HTTP side only
//! decodes the AdmissionReview, looks the locks up, and encodes the answer.
//!
//! A pod annotated `leasehold.dev/lock: a,b` gets one sidecar holding both locks
//! (`--resource NS/a,NS/b`), as a native sidecar (an init container with `restartPolicy:
//! Always`, so it starts before the app and stops after it) or, where configured, as a plain
//! container.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, ExecAction, HTTPGetAction,
    Lifecycle, LifecycleHandler, NodeSelectorTerm, ObjectFieldSelector, Pod, PodSpec, Probe,
    ResourceRequirements, SeccompProfile, SecurityContext, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::{Value, json};

use crate::lock_cache::LockCache;

/// The annotation that asks for the sidecar: one lock name, or several comma-separated.
pub const ANNOTATION: &str = "leasehold.dev/lock";
/// The injected container's name; a pod that has it is left alone.
pub const SIDECAR_NAME: &str = "leasehold-sidecar";
/// The annotation that opts a pod into backend-gated readiness (`"true"`): its sidecar's
/// `/readyz`, and so the pod, fails while the lock's backend is unreachable.
pub const READINESS_ANNOTATION: &str = "leasehold.dev/readiness-requires-backend";

/// The annotation that serves Dapr's lock API beside Leasehold's (`"true"`), on Dapr's own
/// loopback ports, so that an app written for Dapr's lock building block runs unchanged: each
/// named family of keyed locks is a Dapr lock store.
pub const DAPR_ANNOTATION: &str = "leasehold.dev/dapr-api";
/// The annotation that makes a pod's campaign-mode locks sit out while its app is unhealthy:
/// `PORT/PATH` (or `PORT`) of the app's HTTP health endpoint on the pod's loopback, or the same
/// after `https:`, `tcp:PORT` or `grpc:PORT[/SERVICE]` (the kubelet's kinds of probe), which the
/// sidecar asks every 5 s (`--app-health`), stepping down after three failures in a row.
pub const APP_HEALTH_ANNOTATION: &str = "leasehold.dev/app-health";

/// The annotation that starts the native sidecar before one of the pod's init containers
/// (its name), so that init container can take a lock (a migration run with `leasehold-sidecar
/// exec --via`); by default the sidecar comes after every init container the pod declares.
pub const START_BEFORE_ANNOTATION: &str = "leasehold.dev/start-before";

/// Dapr's default ports, which Dapr's SDKs use unless `DAPR_HTTP_PORT` / `DAPR_GRPC_PORT` say
/// otherwise.
pub const DAPR_HTTP_LISTEN: &str = "127.0.0.1:3500";
pub const DAPR_GRPC_LISTEN: &str = "127.0.0.1:50001";

/// What a named `DistributedLock` declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declares {
    Lock,
    /// A family of keyed locks (`spec.keys`).
    Family,
}

/// The label injected pods carry, so that a PodMonitor can select them (annotations cannot be
/// selected on).
pub const INJECTED_LABEL: &str = "leasehold.dev/injected";
/// Kubelet probes come to the pod IP; the lock API stays on loopback.
pub const PROBE_PORT: u16 = 4041;
/// The lock API's loopback port, the sidecar's default.
pub const API_PORT: u16 = 4040;
/// The annotations that move the sidecar's ports in one pod whose app already listens on
/// 4040 or 4041 (Spark's UI takes 4040): the lock API's loopback port, and the probe port
/// kubelet asks on the pod's IP.
pub const PORT_ANNOTATION: &str = "leasehold.dev/port";
pub const PROBE_PORT_ANNOTATION: &str = "leasehold.dev/probe-port";

/// The sidecar's ports in one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    /// The lock API, on the pod's loopback.
    pub api: u16,
    /// Health, readiness and metrics, on the pod's IP.
    pub probe: u16,
}

impl Default for Ports {
    fn default() -> Self {
        Self {
            api: API_PORT,
            probe: PROBE_PORT,
        }
    }
}

/// The user the image runs as (`USER` in the Dockerfile).
pub const IMAGE_USER: i64 = 65532;

/// How the sidecar is injected (the operator's flags; the chart's values).
#[derive(Debug, Clone, PartialEq)]
pub struct Injection {
    pub image: String,
    /// An init container with `restartPolicy: Always` (Kubernetes 1.29+); `false` appends a
    /// plain container for older clusters.
    pub native_sidecar: bool,
    /// The sidecar's requests and limits (a namespace quota on `limits.cpu` refuses pods
    /// whose containers set none).
    pub resources: ResourceRequirements,
    /// Pull secrets (in the pod's namespace) added to the pod for the sidecar's image, beside
    /// the pod's own.
    pub image_pull_secrets: Vec<String>,
    /// The CPU architectures the sidecar's image is built for (`kubernetes.io/arch` values):
    /// an injected pod is scheduled only on such nodes. Empty: any node.
    pub architectures: Vec<String>,
    /// The sidecar container's `imagePullPolicy`: `Always`, `IfNotPresent` or `Never`.
    pub image_pull_policy: String,
    /// The sidecar container's `runAsUser`; `None` leaves it to the platform (OpenShift assigns
    /// one from the namespace's range), `runAsNonRoot` keeping it off root.
    pub run_as_user: Option<i64>,
}

impl Injection {
    /// `image` with the default requests and limits and no extra pull secret.
    pub fn new(image: &str, native_sidecar: bool) -> Self {
        Self {
            image: image.to_owned(),
            native_sidecar,
            resources: resources(&Resources::default()),
            image_pull_secrets: Vec::new(),
            architectures: vec!["amd64".to_owned()],
            image_pull_policy: "IfNotPresent".to_owned(),
            run_as_user: Some(IMAGE_USER),
        }
    }
}

/// The sidecar's CPU and memory, as Kubernetes quantities.
#[derive(Debug, Clone, PartialEq)]
pub struct Resources {
    pub cpu_request: Option<String>,
    pub memory_request: Option<String>,
    /// None by default: a CPU limit throttles the sidecar under load, and a throttled holder
    /// renews late.
    pub cpu_limit: Option<String>,
    pub memory_limit: Option<String>,
}

impl Default for Resources {
    fn default() -> Self {
        Self {
            cpu_request: Some(DEFAULT_CPU_REQUEST.to_owned()),
            memory_request: Some(DEFAULT_MEMORY_REQUEST.to_owned()),
            cpu_limit: None,
            memory_limit: Some(DEFAULT_MEMORY_LIMIT.to_owned()),
        }
    }
}

pub const DEFAULT_CPU_REQUEST: &str = "10m";
pub const DEFAULT_MEMORY_REQUEST: &str = "16Mi";
pub const DEFAULT_MEMORY_LIMIT: &str = "64Mi";

/// Whether `value` is a Kubernetes quantity (`10m`, `0.5`, `64Mi`, `1e3`): checked when the
/// operator starts, since a bad one would get every annotated pod refused.
pub fn is_quantity(value: &str) -> bool {
    let number_end = value
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(value.len());
    let (number, suffix) = value.split_at(number_end);
    let number_ok = !number.is_empty()
        && number.matches('.').count() <= 1
        && number.chars().any(|c| c.is_ascii_digit());
    let suffix_ok = matches!(
        suffix,
        "" | "m" | "k" | "M" | "G" | "T" | "P" | "E" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei"
    ) || suffix.strip_prefix(['e', 'E']).is_some_and(|exp| {
        let digits = exp.strip_prefix(['+', '-']).unwrap_or(exp);
        !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
    });
    number_ok && suffix_ok
}

/// The container's resources from `r`.
pub fn resources(r: &Resources) -> ResourceRequirements {
    let pick = |pairs: [(&str, &Option<String>); 2]| {
        let map: std::collections::BTreeMap<String, Quantity> = pairs
            .into_iter()
            .filter_map(|(k, v)| Some((k.to_owned(), Quantity(v.clone()?))))
            .collect();
        (!map.is_empty()).then_some(map)
    };
    ResourceRequirements {
        requests: pick([("cpu", &r.cpu_request), ("memory", &r.memory_request)]),
        limits: pick([("cpu", &r.cpu_limit), ("memory", &r.memory_limit)]),
        ..ResourceRequirements::default()
    }
}

/// What the webhook answers for one pod.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Admit unchanged (no annotation, or already injected).
    Unchanged,
    /// Admit with these JSON-patch operations.
    Patch(Vec<Value>),
    /// Refuse, saying exactly what is wrong.
    Deny(String),
}

/// The most locks one pod's annotation may name: each is a lookup and two access reviews per
/// admission, and a lock engine in the sidecar.
pub const MAX_LOCKS_PER_POD: usize = 32;

/// The lock names of an annotation value: comma-separated Kubernetes object names, each once,
/// at most [`MAX_LOCKS_PER_POD`].
pub fn parse_annotation(value: &str) -> Result<Vec<String>, String> {
    let named = value.split(',').count();
    if named > MAX_LOCKS_PER_POD {
        return Err(format!(
            "annotation {ANNOTATION}: {named} locks named; a pod takes at most {MAX_LOCKS_PER_POD}"
        ));
    }
    let mut names = Vec::new();
    for raw in value.split(',') {
        let name = raw.trim();
        if name.is_empty() {
            return Err(format!(
                "annotation {ANNOTATION}={value:?}: an empty lock name; write one name or several separated by commas"
            ));
        }
        leasehold_lease::names::validate_lease_name(name).map_err(|e| {
            format!(
                "annotation {ANNOTATION}={value:?}: {name:?} is not a DistributedLock name: {e}"
            )
        })?;
        if names.iter().any(|n| n == name) {
            return Err(format!(
                "annotation {ANNOTATION}={value:?}: {name:?} is named twice"
            ));
        }
        names.push(name.to_owned());
    }
    Ok(names)
}

/// The lock names `pod` asks for, if it carries the annotation.
pub fn requested_locks(pod: &Pod) -> Option<Result<Vec<String>, String>> {
    let value = pod.metadata.annotations.as_ref()?.get(ANNOTATION)?;
    Some(parse_annotation(value))
}

/// Where the API server's ServiceAccount admission mounts a pod's service account token (and
/// the cluster's CA and the namespace).
pub const SERVICE_ACCOUNT_MOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The pod volume that gives the sidecar alone a token, in a pod that turns automounting off.
pub const TOKEN_VOLUME: &str = "leasehold-service-account-token";
/// How long the projected token is valid: the kubelet renews it at four fifths of this, and
/// the sidecar's client reads the file again. As the API server's own mounts ask.
const TOKEN_EXPIRATION_SECONDS: i64 = 3607;

/// Whether the sidecar needs a token of its own in `pod`: the pod, or its ServiceAccount, turns
/// automounting off, so no container has the token the sidecar reads its `DistributedLock`
/// with. The API server's ServiceAccount admission, which runs before admission webhooks,
/// mounts it into every container of a pod that gets one (and into the sidecar when it runs
/// again after the webhook's change), so a pod none of whose containers has it gets none.
fn needs_own_token(pod: &Pod) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    let mounted = all_containers(spec)
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .any(|m| m.mount_path.trim_end_matches('/') == SERVICE_ACCOUNT_MOUNT_PATH);
    spec.automount_service_account_token == Some(false) || !mounted
}

/// The projected volume of the sidecar's own token: what the API server mounts for a pod that
/// gets one (a bound token, the cluster's CA, the namespace), mounted in the sidecar alone, so
/// the app of a pod that turned its token off still has none.
fn token_volume() -> Value {
    json!({
        "name": TOKEN_VOLUME,
        "projected": {
            "defaultMode": 0o644,
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_EXPIRATION_SECONDS}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace",
                    "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
            ],
        },
    })
}

/// Why `pod` cannot get the sidecar's own token: a volume of its own has the name.
fn token_volume_taken(pod: &Pod) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    spec.volumes
        .iter()
        .flatten()
        .any(|v| v.name == TOKEN_VOLUME)
        .then(|| {
            format!(
                "annotation {ANNOTATION}: the pod turns its service account token off, and the injected sidecar mounts one of its own from the volume {TOKEN_VOLUME:?}, a name the pod already gives a volume of its own; rename that volume"
            )
        })
}

/// Why the sidecar may not serve `pod`: on the node's network, its lock API's loopback is the
/// node's, open to every pod on the host network and every process of the node.
fn on_host_network(pod: &Pod) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    (spec.host_network == Some(true)).then(|| {
        format!(
            "annotation {ANNOTATION}: the pod sets hostNetwork: true, and the injected sidecar's lock API listens on the pod's loopback, which on the host network is the node's, open to every pod on the host network and every process of the node; run the pod on its own network"
        )
    })
}

/// Whether the pod has native sidecars of its own (init containers that keep running), which
/// the kubelet stops after the sidecar injected behind them.
fn has_native_sidecars(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|spec| spec.init_containers.as_ref())
        .is_some_and(|inits| {
            inits
                .iter()
                .any(|c| c.restart_policy.as_deref() == Some("Always"))
        })
}

fn already_injected(pod: &Pod) -> bool {
    let Some(spec) = &pod.spec else { return false };
    all_containers(spec).any(|c| c.name == SIDECAR_NAME)
}

/// A `"true"`/`"false"` annotation of `pod`, `false` when absent.
fn flag_annotation(pod: &Pod, annotation: &str) -> Result<bool, String> {
    let value = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotation));
    match value.map(String::as_str) {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(format!(
            "annotation {annotation}={other:?}: expected \"true\" or \"false\""
        )),
    }
}

/// Where the native sidecar goes among the pod's init containers: before the one
/// [`START_BEFORE_ANNOTATION`] names (its index), or after them all (`None`). Refused when no
/// init container has that name, or when the sidecar is a plain container, which starts only
/// after every init container has finished.
fn start_before(pod: &Pod, native_sidecar: bool) -> Result<Option<usize>, String> {
    let Some(name) = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(START_BEFORE_ANNOTATION))
    else {
        return Ok(None);
    };
    if !native_sidecar {
        return Err(format!(
            "annotation {START_BEFORE_ANNOTATION}={name:?}: the sidecar is injected as a plain container here (the chart's sidecar.mode=container), which starts after every init container; init containers can take a lock only from a native sidecar (Kubernetes 1.29 and later)"
        ));
    }
    let init = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_deref())
        .unwrap_or_default();
    match init.iter().position(|c| c.name == *name) {
        Some(index) => Ok(Some(index)),
        None if init.is_empty() => Err(format!(
            "annotation {START_BEFORE_ANNOTATION}={name:?}: the pod has no init containers; name the init container the sidecar must start before, or leave the annotation out"
        )),
        None => {
            let names: Vec<&str> = init.iter().map(|c| c.name.as_str()).collect();
            Err(format!(
                "annotation {START_BEFORE_ANNOTATION}={name:?}: the pod has no init container of that name (it has {names:?}); name the init container the sidecar must start before"
            ))
        }
    }
}

/// The app's health endpoint that [`APP_HEALTH_ANNOTATION`] names, as the sidecar's URL.
fn app_health_annotation(pod: &Pod) -> Result<Option<String>, String> {
    let Some(value) = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(APP_HEALTH_ANNOTATION))
    else {
        return Ok(None);
    };
    let refused = || {
        format!(
            "annotation {APP_HEALTH_ANNOTATION}={value:?}: expected PORT/PATH of the app's health endpoint, e.g. \"8080/healthz\" (or \"https:8443/healthz\", \"tcp:5432\", \"grpc:9090\")"
        )
    };
    let (scheme, endpoint) = match value.split_once(':') {
        Some((scheme @ ("https" | "tcp" | "grpc"), endpoint)) => (scheme, endpoint),
        Some(_) => return Err(refused()),
        None => ("http", value.as_str()),
    };
    let (port, path) = match endpoint.find('/') {
        Some(at) => (&endpoint[..at], &endpoint[at..]),
        None => (endpoint, ""),
    };
    let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
    let path_ok = path.bytes().all(|b| b.is_ascii_graphic() && b != b'#');
    if !port_ok || !path_ok {
        return Err(refused());
    }
    let path = match (scheme, path) {
        ("http" | "https", "") => "/",
        _ => path,
    };
    // The sidecar checks the rest (a TCP probe has no path, a gRPC service is a name) at start;
    // refused here, so that a pod is not admitted with a sidecar that would not start.
    let url = format!("{scheme}://127.0.0.1:{port}{path}");
    match scheme {
        "tcp" if !path.is_empty() => Err(refused()),
        "grpc"
            if !path
                .bytes()
                .skip(1)
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) =>
        {
            Err(refused())
        }
        _ => Ok(Some(url)),
    }
}

/// The sidecar's ports in `pod`: the defaults, or what [`PORT_ANNOTATION`] and
/// [`PROBE_PORT_ANNOTATION`] say; refused when they are not ports, or collide with each other
/// or with Dapr's ports when the pod asks for Dapr's API.
fn ports_annotation(pod: &Pod, dapr: bool) -> Result<Ports, String> {
    let annotations = pod.metadata.annotations.as_ref();
    let port = |annotation: &str, default: u16| -> Result<u16, String> {
        match annotations.and_then(|a| a.get(annotation)) {
            None => Ok(default),
            Some(value) => value.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
                format!("annotation {annotation}={value:?}: expected a port number, 1 to 65535")
            }),
        }
    };
    let ports = Ports {
        api: port(PORT_ANNOTATION, API_PORT)?,
        probe: port(PROBE_PORT_ANNOTATION, PROBE_PORT)?,
    };
    if ports.api == ports.probe {
        return Err(format!(
            "annotations {PORT_ANNOTATION} and {PROBE_PORT_ANNOTATION}: the lock API and the probes need two ports, both are {}",
            ports.api
        ));
    }
    if dapr
        && let Some(taken) = [ports.api, ports.probe]
            .into_iter()
            .find(|p| dapr_ports().contains(p))
    {
        return Err(format!(
            "annotations {PORT_ANNOTATION}/{PROBE_PORT_ANNOTATION}: port {taken} is Dapr's, which {DAPR_ANNOTATION}=\"true\" serves on"
        ));
    }
    Ok(ports)
}

/// The ports Dapr's APIs listen on when the sidecar serves them.
fn dapr_ports() -> Vec<u16> {
    [DAPR_HTTP_LISTEN, DAPR_GRPC_LISTEN]
        .into_iter()
        .filter_map(|listen| listen.rsplit(':').next()?.parse().ok())
        .collect()
}

/// Every container of the pod, its init containers (native sidecars among them) too.
fn all_containers(spec: &PodSpec) -> impl Iterator<Item = &Container> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
}

/// Why the sidecar cannot listen in `pod`: a container of the pod declares a port that the
/// sidecar takes in the pod's network (its lock API, its probes, Dapr's ports when it serves
/// them). Containers share the network, so one of the two would fail to listen: an app that
/// starts second crash-loops, a sidecar that starts second never turns ready.
fn port_taken(pod: &Pod, ports: Ports, dapr: bool) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    let mut ours = vec![
        (ports.api, "lock API", Some(PORT_ANNOTATION)),
        (ports.probe, "probes", Some(PROBE_PORT_ANNOTATION)),
    ];
    if dapr {
        ours.extend(
            dapr_ports()
                .into_iter()
                .map(|port| (port, "Dapr API", None)),
        );
    }
    for container in all_containers(spec) {
        for declared in container.ports.iter().flatten() {
            if declared.protocol.as_deref().unwrap_or("TCP") != "TCP" {
                continue;
            }
            let Some((port, what, annotation)) = ours
                .iter()
                .find(|(port, ..)| i32::from(*port) == declared.container_port)
            else {
                continue;
            };
            let fix = match annotation {
                Some(annotation) => {
                    format!("set annotation {annotation} to a port no container of the pod uses")
                }
                None => format!("move the container's port, or leave {DAPR_ANNOTATION} off"),
            };
            return Some(format!(
                "annotation {ANNOTATION}: container {:?} declares port {port}, which the injected sidecar's {what} listens on in the pod's network, so one of the two could not listen; {fix}",
                container.name
            ));
        }
    }
    None
}

/// The CPU the sidecar of a Guaranteed pod is given (as request and limit) when no CPU limit is
/// configured: ten times its usual request, as a limit throttles a holder that renews late.
pub const GUARANTEED_CPU: &str = "100m";

/// Whether `pod` is of the Guaranteed QoS class: every container, init containers too, has CPU
/// and memory limits, and requests equal to them (or none, which the API server sets to them).
/// A sidecar with other requests than limits would turn it Burstable: no exclusive CPUs under
/// the static CPU manager, and an earlier rank for eviction and the out-of-memory killer.
fn guaranteed(pod: &Pod) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    all_containers(spec).all(|container| {
        let Some(resources) = container.resources.as_ref() else {
            return false;
        };
        ["cpu", "memory"].into_iter().all(|name| {
            let limit = resources.limits.as_ref().and_then(|l| l.get(name));
            let request = resources.requests.as_ref().and_then(|r| r.get(name));
            match (limit, request) {
                (Some(_), None) => true,
                (Some(limit), Some(request)) => same_quantity(&limit.0, &request.0),
                (None, _) => false,
            }
        })
    })
}

/// Whether two Kubernetes quantities are the same amount (`1` and `1000m`, `1Gi` and
/// `1073741824`).
fn same_quantity(a: &str, b: &str) -> bool {
    match (quantity_value(a), quantity_value(b)) {
        (Some(a), Some(b)) => (a - b).abs() <= a.abs().max(b.abs()) * 1e-12,
        _ => a == b,
    }
}

/// A quantity's amount, for comparing two.
fn quantity_value(quantity: &str) -> Option<f64> {
    let split = quantity
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '+' | '-')))
        .unwrap_or(quantity.len());
    let (number, suffix) = quantity.split_at(split);
    let number: f64 = number.parse().ok()?;
    let scale = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024f64,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        exponent => 10f64.powi(exponent.strip_prefix(['e', 'E'])?.parse().ok()?),
    };
    Some(number * scale)
}

/// The sidecar's resources in a Guaranteed pod: requests equal to limits, the configured CPU
/// limit (else [`GUARANTEED_CPU`]) and memory limit (else its request, or the default limit
/// when that is smaller).
fn guaranteed_resources(configured: &ResourceRequirements) -> ResourceRequirements {
    let get = |map: &Option<std::collections::BTreeMap<String, Quantity>>, name: &str| {
        map.as_ref().and_then(|m| m.get(name)).cloned()
    };
    let cpu = get(&configured.limits, "cpu").unwrap_or_else(|| Quantity(GUARANTEED_CPU.into()));
    let memory = get(&configured.limits, "memory")
        .or_else(|| {
            get(&configured.requests, "memory").filter(|request| {
                quantity_value(&request.0)
                    .zip(quantity_value(DEFAULT_MEMORY_LIMIT))
                    .is_some_and(|(request, default)| request >= default)
            })
        })
        .unwrap_or_else(|| Quantity(DEFAULT_MEMORY_LIMIT.into()));
    let both: std::collections::BTreeMap<String, Quantity> =
        [("cpu".to_owned(), cpu), ("memory".to_owned(), memory)].into();
    ResourceRequirements {
        requests: Some(both.clone()),
        limits: Some(both),
        ..configured.clone()
    }
}

/// Decide for `pod` in `namespace`, given which DistributedLocks exist there and what each
/// declares.
pub fn decide(
    pod: &Pod,
    namespace: &str,
    existing: &BTreeMap<String, Declares>,
    injection: &Injection,
) -> Decision {
    let locks = match requested_locks(pod) {
        None => return Decision::Unchanged,
        Some(Err(message)) => return Decision::Deny(message),
        Some(Ok(locks)) => locks,
    };
    if already_injected(pod) {
        return Decision::Unchanged;
    }
    // A lock not found (not created yet: Helm and Argo CD create custom resources after
    // Deployments) or not looked up (the API server did not answer) is injected all the same:
    // the sidecar answers 503 with the reason until the lock exists, and takes it then.
    if let Some(reason) = on_host_network(pod) {
        return Decision::Deny(reason);
    }
    let own_token = needs_own_token(pod);
    if own_token && let Some(reason) = token_volume_taken(pod) {
        return Decision::Deny(reason);
    }
    let (gated, dapr) = match (
        flag_annotation(pod, READINESS_ANNOTATION),
        flag_annotation(pod, DAPR_ANNOTATION),
    ) {
        (Ok(gated), Ok(dapr)) => (gated, dapr),
        (Err(message), _) | (_, Err(message)) => return Decision::Deny(message),
    };
    let ports = match ports_annotation(pod, dapr) {
        Ok(ports) => ports,
        Err(message) => return Decision::Deny(message),
    };
    if let Some(reason) = port_taken(pod, ports, dapr) {
        return Decision::Deny(reason);
    }
    let mut container = sidecar(namespace, &locks, injection, ports);
    if guaranteed(pod) {
        container.resources = Some(guaranteed_resources(&injection.resources));
    }
    if own_token {
        container.volume_mounts = Some(vec![VolumeMount {
            name: TOKEN_VOLUME.to_owned(),
            mount_path: SERVICE_ACCOUNT_MOUNT_PATH.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        }]);
    }
    // Only when every lock named is known to declare none: one not found may be a family.
    if dapr
        && locks.iter().all(|l| existing.contains_key(l))
        && !locks
            .iter()
            .any(|l| existing.get(l) == Some(&Declares::Family))
    {
        return Decision::Deny(format!(
            "annotation {DAPR_ANNOTATION}=\"true\": Dapr's lock API serves families of keyed locks (each is a lock store), and none of {} declares spec.keys",
            locks.join(", ")
        ));
    }
    let app_health = match app_health_annotation(pod) {
        Ok(app_health) => app_health,
        Err(message) => return Decision::Deny(message),
    };
    let before = match start_before(pod, injection.native_sidecar) {
        Ok(before) => before,
        Err(message) => return Decision::Deny(message),
    };
    if let Some(args) = &mut container.args {
        if gated {
            args.push("--readiness-requires-backend".to_owned());
        }
        if let Some(url) = app_health {
            args.extend(["--app-health".to_owned(), url]);
        }
        if dapr {
            args.extend(
                [
                    "--dapr-http-listen",
                    DAPR_HTTP_LISTEN,
                    "--dapr-grpc-listen",
                    DAPR_GRPC_LISTEN,
                ]
                .map(str::to_owned),
            );
        }
    }
    if let Some(args) = &mut container.args {
        if injection.native_sidecar {
            // The kubelet signals a native sidecar (SIGTERM) only once the app's containers
            // have exited: no app is left to act on an answer, and the leases are released at
            // once. Its preStop hook runs earlier, beside the app's shutdown (`/resign` then
            // releases each lease only once its last answer has run out). Native sidecars
            // declared before this one are stopped after it, and may act on answers still:
            // with any, each lease waits out its last answer on SIGTERM as well. So does a
            // sidecar started before an init container: the kubelet signals it while that init
            // container may still run, and acts on its lock.
            if !has_native_sidecars(pod) && before.is_none() {
                args.push("--apps-stop-first".to_owned());
            }
        } else {
            // A plain container keeps a Job's pod running until it exits: it exits once the
            // pod's other containers have finished (a native sidecar is stopped by the
            // kubelet).
            args.extend(["--exit-with-pod".to_owned(), SIDECAR_NAME.to_owned()]);
        }
    }
    let mut value = serde_json::to_value(&container).expect("a container serializes");
    let spec = pod.spec.as_ref();
    let (list, present) = if injection.native_sidecar {
        value["restartPolicy"] = json!("Always");
        (
            "initContainers",
            spec.and_then(|s| s.init_containers.as_ref()).is_some(),
        )
    } else {
        ("containers", true)
    };
    let op = if let Some(index) = before {
        json!({"op": "add", "path": format!("/spec/{list}/{index}"), "value": value})
    } else if present {
        json!({"op": "add", "path": format!("/spec/{list}/-"), "value": value})
    } else {
        json!({"op": "add", "path": format!("/spec/{list}"), "value": [value]})
    };
    let label = if pod.metadata.labels.is_some() {
        // A JSON pointer writes the label's "/" as "~1".
        let key = INJECTED_LABEL.replace('~', "~0").replace('/', "~1");
        json!({"op": "add", "path": format!("/metadata/labels/{key}"), "value": "true"})
    } else {
        json!({"op": "add", "path": "/metadata/labels", "value": {INJECTED_LABEL: "true"}})
    };
    let mut ops = vec![op, label];
    if own_token {
        ops.push(if spec.and_then(|s| s.volumes.as_ref()).is_some() {
            json!({"op": "add", "path": "/spec/volumes/-", "value": token_volume()})
        } else {
            json!({"op": "add", "path": "/spec/volumes", "value": [token_volume()]})
        });
    }
    let present: Vec<&str> = spec
        .and_then(|s| s.image_pull_secrets.as_ref())
        .map(|l| l.iter().map(|r| r.name.as_str()).collect())
        .unwrap_or_default();
    let missing: Vec<&String> = injection
        .image_pull_secrets
        .iter()
        .filter(|name| !present.contains(&name.as_str()))
        .collect();
    if !missing.is_empty() {
        if spec.and_then(|s| s.image_pull_secrets.as_ref()).is_some() {
            ops.extend(missing.iter().map(|name| {
                json!({"op": "add", "path": "/spec/imagePullSecrets/-", "value": {"name": name}})
            }));
        } else {
            let list: Vec<Value> = missing.iter().map(|name| json!({"name": name})).collect();
            ops.push(json!({"op": "add", "path": "/spec/imagePullSecrets", "value": list}));
        }
    }
    match node_ops(pod, &injection.architectures) {
        Ok(more) => ops.extend(more),
        Err(reason) => return Decision::Deny(reason),
    }
    Decision::Patch(ops)
}

/// The label nodes carry their operating system in.
const OS_LABEL: &str = "kubernetes.io/os";
/// The operating system the sidecar's image runs on.
const IMAGE_OS: &str = "linux";
/// The label nodes carry their CPU architecture in.
const ARCH_LABEL: &str = "kubernetes.io/arch";

/// The operations that keep `pod` on nodes the sidecar's image runs on: Linux nodes of one of
/// `architectures` (any architecture if empty). A required node affinity term, added to each
/// of the pod's own terms (terms are alternatives, so each must carry it) or as the only one.
/// Windows nodes are not always tainted (AKS), and a pod scheduled there could never start the
/// sidecar. A pod that could run nowhere else (a Windows pod, a node selector naming another
/// system or architecture, every required term ruling the image's nodes out) is refused with
/// the reason, rather than left pending or failing to start.
fn node_ops(pod: &Pod, architectures: &[String]) -> Result<Vec<Value>, String> {
    let spec = pod.spec.as_ref();
    if let Some(os) = spec.and_then(|s| s.os.as_ref())
        && os.name != IMAGE_OS
    {
        return Err(format!(
            "annotation {ANNOTATION}: the pod runs on {} (spec.os.name), and the sidecar's image runs on {IMAGE_OS} only",
            os.name
        ));
    }
    let os = [IMAGE_OS.to_owned()];
    let mut needed: Vec<(&str, &[String])> = vec![(OS_LABEL, &os)];
    if !architectures.is_empty() {
        needed.push((ARCH_LABEL, architectures));
    }
    let image_nodes = needed
        .iter()
        .map(|(label, values)| format!("{label} {}", values.join(", ")))
        .collect::<Vec<_>>()
        .join("; ");
    for (label, values) in &needed {
        if let Some(wanted) = spec
            .and_then(|s| s.node_selector.as_ref())
            .and_then(|n| n.get(*label))
            && !values.contains(wanted)
        {
            return Err(format!(
                "annotation {ANNOTATION}: the pod's nodeSelector asks for {label}={wanted}, and the sidecar's image runs on {label} {} only",
                values.join(", ")
            ));
        }
    }
    let expressions: Vec<Value> = needed
        .iter()
        .map(|(label, values)| json!({"key": label, "operator": "In", "values": values}))
        .collect();
    let term = json!({ "matchExpressions": expressions });
    let affinity = spec.and_then(|s| s.affinity.as_ref());
    let node_affinity = affinity.and_then(|a| a.node_affinity.as_ref());
    let required = node_affinity.and_then(|n| {
        n.required_during_scheduling_ignored_during_execution
            .as_ref()
    });
    // Each term gains the requirement: a pod whose every term then rules out the image's nodes
    // would stay pending for ever.
    if let Some(required) = required
        && !required.node_selector_terms.is_empty()
        && !required.node_selector_terms.iter().any(|term| {
            needed
                .iter()
                .all(|(label, values)| values.iter().any(|v| term_allows(term, label, v)))
        })
    {
        return Err(format!(
            "annotation {ANNOTATION}: every term of the pod's required node affinity rules out the nodes the sidecar's image runs on ({image_nodes})"
        ));
    }
    const REQUIRED: &str =
        "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution";
    Ok(match (affinity, node_affinity, required) {
        (None, _, _) => vec![json!({"op": "add", "path": "/spec/affinity",
            "value": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                {"nodeSelectorTerms": [term]}}}})],
        (Some(_), None, _) => vec![json!({"op": "add", "path": "/spec/affinity/nodeAffinity",
            "value": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}})],
        (Some(_), Some(_), None) => vec![json!({"op": "add", "path": REQUIRED,
            "value": {"nodeSelectorTerms": [term]}})],
        (Some(_), Some(_), Some(required)) if required.node_selector_terms.is_empty() => {
            vec![
                json!({"op": "add", "path": format!("{REQUIRED}/nodeSelectorTerms"), "value": [term]}),
            ]
        }
        (Some(_), Some(_), Some(required)) => required
            .node_selector_terms
            .iter()
            .enumerate()
            .flat_map(|(i, t)| {
                let path = format!("{REQUIRED}/nodeSelectorTerms/{i}/matchExpressions");
                if t.match_expressions.is_some() {
                    expressions
                        .iter()
                        .map(|e| json!({"op": "add", "path": format!("{path}/-"), "value": e}))
                        .collect()
                } else {
                    vec![json!({"op": "add", "path": path, "value": expressions})]
                }
            })
            .collect(),
    })
}

/// Whether node selector `term` lets a node whose `label` is `value` in, as far as its
/// expressions on `label` say (every expression of a term must hold).
fn term_allows(term: &NodeSelectorTerm, label: &str, value: &str) -> bool {
    term.match_expressions
        .iter()
        .flatten()
        .filter(|e| e.key == label)
        .all(|e| {
            let named = e.values.iter().flatten().any(|v| v == value);
            match e.operator.as_str() {
                "In" => named,
                "NotIn" => !named,
                "DoesNotExist" => false,
                _ => true,
            }
        })
}

/// The sidecar container for `locks` in `namespace`.
pub fn sidecar(
    namespace: &str,
    locks: &[String],
    injection: &Injection,
    ports: Ports,
) -> Container {
    let resources: Vec<String> = locks.iter().map(|l| format!("{namespace}/{l}")).collect();
    let http = |path: &str| HTTPGetAction {
        path: Some(path.to_owned()),
        port: IntOrString::Int(i32::from(ports.probe)),
        ..HTTPGetAction::default()
    };
    let mut env = vec![EnvVar {
        name: "LEASEHOLD_IDENTITY".to_owned(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: "metadata.name".to_owned(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }];
    if ports.api != API_PORT {
        // An environment variable, not a flag: the preStop hook's `--resign` reads it too.
        env.push(EnvVar {
            name: "LEASEHOLD_LISTEN".to_owned(),
            value: Some(format!("127.0.0.1:{}", ports.api)),
            ..EnvVar::default()
        });
    }
    Container {
        name: SIDECAR_NAME.to_owned(),
        image: Some(injection.image.clone()),
        image_pull_policy: Some(injection.image_pull_policy.clone()),
        command: Some(vec!["/leasehold-sidecar".to_owned()]),
        args: Some(vec![
            "--resource".to_owned(),
            resources.join(","),
            "--probe-listen".to_owned(),
            format!("[::]:{}", ports.probe),
            "--log-format".to_owned(),
            "json".to_owned(),
        ]),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            name: Some("leasehold-probe".to_owned()),
            container_port: i32::from(ports.probe),
            ..ContainerPort::default()
        }]),
        // The app's containers start once the lock API answers (kubelet waits for a native
        // sidecar's startup probe before it starts the next container).
        startup_probe: Some(Probe {
            http_get: Some(http("/healthz")),
            period_seconds: Some(1),
            failure_threshold: Some(30),
            ..Probe::default()
        }),
        // Ready once the lock API serves; a backend outage does not take the pod out of its
        // Services (the sidecar's /readyz ignores it unless --readiness-requires-backend).
        readiness_probe: Some(Probe {
            http_get: Some(http("/readyz")),
            period_seconds: Some(5),
            ..Probe::default()
        }),
        // No liveness probe: the kubelet kills a container whose probe fails while the app
        // runs, through the preStop hook below, and a native sidecar (`--apps-stop-first`)
        // would release at once. The sidecar's watchdog ends a stuck process instead,
        // releasing nothing (each lease runs out on its backend).
        liveness_probe: None,
        // The preStop steps down from every lock for good (`POST /resign` on the loopback API)
        // as soon as the pod starts terminating, a native sidecar's too, while the app may still
        // be draining: each lease is then released once the last answer given has run out.
        lifecycle: Some(Lifecycle {
            pre_stop: Some(LifecycleHandler {
                exec: Some(ExecAction {
                    command: Some(vec!["/leasehold-sidecar".to_owned(), "--resign".to_owned()]),
                }),
                ..LifecycleHandler::default()
            }),
            ..Lifecycle::default()
        }),
        resources: Some(injection.resources.clone()),
        // Everything Pod Security's `restricted` profile asks of a container, so that the
        // injected pod is admitted wherever the app alone would be.
        security_context: Some(SecurityContext {
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                ..SeccompProfile::default()
            }),
            run_as_non_root: Some(true),
            run_as_user: injection.run_as_user,
            read_only_root_filesystem: Some(true),
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}

/// Answer one AdmissionReview with the JSON to send back: look up the locks the pod names (in
/// its namespace) and decide. Unreadable reviews are refused with the reason; a lock that cannot
/// be looked up is injected unchecked (the sidecar waits for it).
pub async fn review(
    client: &kube::Client,
    locks: &LockCache,
    injection: &Injection,
    review: kube::core::admission::AdmissionReview<Pod>,
) -> Value {
    let mut answer = decide_review(client, locks, injection, review).await;
    // kube-core serializes the patch as an array of numbers (kube-rs issue #1781); the API
    // server reads `[]byte` as base64, so the wire form is written here.
    let patch = answer.response.as_mut().and_then(|r| r.patch.take());
    let mut wire = serde_json::to_value(&answer).expect("an AdmissionReview serializes");
    if let Some(bytes) = patch {
        wire["response"]["patch"] =
            serde_json::to_value(k8s_openapi::ByteString(bytes)).expect("bytes serialize");
    }
    wire
}

async fn decide_review(
    client: &kube::Client,
    cache: &LockCache,
    injection: &Injection,
    review: kube::core::admission::AdmissionReview<Pod>,
) -> kube::core::admission::AdmissionReview<kube::core::DynamicObject> {
    use kube::core::admission::{AdmissionRequest, AdmissionResponse};
    let request: AdmissionRequest<Pod> = match review.try_into() {
        Ok(request) => request,
        Err(e) => {
            return AdmissionResponse::invalid(format!("not an AdmissionReview request: {e}"))
                .into_review();
        }
    };
    let response = AdmissionResponse::from(&request);
    let Some(pod) = &request.object else {
        return response.into_review();
    };
    let namespace = request
        .namespace
        .clone()
        .or_else(|| pod.metadata.namespace.clone())
        .unwrap_or_else(|| "default".to_owned());
    let mut existing = BTreeMap::new();
    if let Some(Ok(locks)) = requested_locks(pod) {
        let api: kube::Api<leasehold_crds::DistributedLock> =
            kube::Api::namespaced(client.clone(), &namespace);
        // The watch's copy when it has the lock; else the API server (a lock created a moment
        // ago, or the watch still starting), every lock at once and within a budget, so that a
        // slow API server does not make the webhook miss its own deadline.
        let looked_up = futures_util::future::join_all(locks.into_iter().map(|lock| {
            let (api, namespace) = (&api, &namespace);
            async move {
                let found = match cache.get(namespace, &lock) {
                    Some(cached) => Ok(Some(cached)),
                    None => match tokio::time::timeout(LOOK_UP_BUDGET, api.get_opt(&lock)).await {
                        Ok(found) => found
                            .map(|found| found.map(Arc::new))
                            .map_err(|e| e.to_string()),
                        Err(_) => Err(format!(
                            "the API server did not answer within {LOOK_UP_BUDGET:?}"
                        )),
                    },
                };
                (lock, found)
            }
        }))
        .await;
        for (lock, found) in looked_up {
            match found {
                // A lock the CRD's rule refuses (one created without the rule in place).
                Ok(Some(found)) if found.spec.backend.sqlite.is_some() => {
                    return response
                        .deny(format!(
                            "DistributedLock {namespace}/{lock}: {}",
                            leasehold_resource::SQLITE_IN_A_CLUSTER
                        ))
                        .into_review();
                }
                Ok(Some(found)) => {
                    let declares = if found.spec.keys.is_some() {
                        Declares::Family
                    } else {
                        Declares::Lock
                    };
                    existing.insert(lock, declares);
                }
                Ok(None) => {}
                // Injected all the same: the sidecar reads the lock itself and says why it
                // cannot while it cannot; refusing here would refuse every annotated pod for
                // an API hiccup, whatever the failure policy says.
                Err(e) => {
                    tracing::warn!(namespace = %namespace, lock = %lock, error = %e,
                        "cannot look up the DistributedLock; injecting the sidecar without checking it");
                }
            }
        }
    }
    match decide(pod, &namespace, &existing, injection) {
        Decision::Unchanged => response.into_review(),
        Decision::Deny(message) => response.deny(message).into_review(),
        Decision::Patch(ops) => {
            let locks = requested_locks(pod)
                .and_then(Result::ok)
                .unwrap_or_default();
            // A plain container exits with a pod that finishes (a Job's) by watching the pod:
            // without that right the sidecar never sees it finish, and the Job never completes.
            let follows_pod = !injection.native_sidecar
                && pod
                    .spec
                    .as_ref()
                    .and_then(|spec| spec.restart_policy.as_deref())
                    .is_some_and(|policy| policy == "Never" || policy == "OnFailure");
            if let Some(message) =
                unreadable_lock(client, pod, &namespace, &locks, follows_pod).await
            {
                return response.deny(message).into_review();
            }
            let patch: json_patch::Patch =
                serde_json::from_value(Value::Array(ops)).expect("our operations are a JSON patch");
            match response.with_patch(patch) {
                Ok(patched) => patched.into_review(),
                Err(e) => AdmissionResponse::invalid(format!("cannot encode the patch: {e}"))
                    .into_review(),
            }
        }
    }
}

/// How long the webhook waits for the API server's answers on the pod's rights: well inside the
/// API server's 5 s for the whole admission (`timeoutSeconds`), after which the pod is admitted
/// unchecked rather than refused for the webhook's own slowness.
const ACCESS_REVIEW_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);

/// How long the look-ups of a pod's locks missing from the webhook's copy may take together: a
/// lock not read by then is injected unchecked, as one the API server would not give. With
/// [`ACCESS_REVIEW_BUDGET`], the webhook answers well within the API server's deadline for it
/// (`timeoutSeconds: 5`).
const LOOK_UP_BUDGET: std::time::Duration = std::time::Duration::from_secs(1);

/// Why the pod's ServiceAccount may not read one of `locks` as its sidecar does (`list` and
/// `watch`, by name: it follows its lock with a watch restricted to the name), asked of the API
/// server (a LocalSubjectAccessReview per lock and verb, all at once, which weighs every binding:
/// the account's, its groups', cluster-wide ones). Its sidecar could not read the lock and would
/// only answer 503, so the pod is refused with what to grant. `None` when it may, or when the
/// API server does not say within [`ACCESS_REVIEW_BUDGET`] (the pod is then admitted, and its
/// sidecar says why it cannot read the lock while it cannot). With `follows_pod` (a plain
/// container in a pod that finishes), also whether it may list and watch the namespace's pods,
/// as the sidecar does to exit once the pod's other containers have finished.
async fn unreadable_lock(
    client: &kube::Client,
    pod: &Pod,
    namespace: &str,
    locks: &[String],
    follows_pod: bool,
) -> Option<String> {
    use k8s_openapi::api::authorization::v1::{
        LocalSubjectAccessReview, ResourceAttributes, SubjectAccessReviewSpec,
    };
    use kube::Resource;
    let account = pod
        .spec
        .as_ref()
        .and_then(|spec| {
            spec.service_account_name
                .clone()
                .or_else(|| spec.service_account.clone())
        })
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "default".to_owned());
    let reviews: kube::Api<LocalSubjectAccessReview> =
        kube::Api::namespaced(client.clone(), namespace);
    // `lock` `None`: the namespace's pods (their names are generated, so not by name).
    let ask = |lock: Option<&String>, verb: &'static str| {
        let (group, resource) = match lock {
            Some(_) => (
                leasehold_crds::DistributedLock::group(&()).into_owned(),
                leasehold_crds::DistributedLock::plural(&()).into_owned(),
            ),
            None => (String::new(), "pods".to_owned()),
        };
        let review = LocalSubjectAccessReview {
            metadata: kube::api::ObjectMeta {
                namespace: Some(namespace.to_owned()),
                ..Default::default()
            },
            spec: SubjectAccessReviewSpec {
                user: Some(format!("system:serviceaccount:{namespace}:{account}")),
                // The groups every ServiceAccount token carries, which bindings may name.
                groups: Some(vec![
                    "system:serviceaccounts".to_owned(),
                    format!("system:serviceaccounts:{namespace}"),
                    "system:authenticated".to_owned(),
                ]),
                resource_attributes: Some(ResourceAttributes {
                    namespace: Some(namespace.to_owned()),
                    verb: Some(verb.to_owned()),
                    group: Some(group),
                    resource: Some(resource),
                    name: lock.cloned(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            status: None,
        };
        let reviews = reviews.clone();
        let lock = lock.cloned();
        async move {
            let answer = reviews
                .create(&kube::api::PostParams::default(), &review)
                .await;
            (lock, verb, answer)
        }
    };
    let pods = follows_pod.then_some(None);
    let asked = futures_util::future::join_all(
        locks
            .iter()
            .map(Some)
            .chain(pods)
            .flat_map(|lock| [ask(lock, "list"), ask(lock, "watch")]),
    );
    let Ok(answers) = tokio::time::timeout(ACCESS_REVIEW_BUDGET, asked).await else {
        tracing::warn!(namespace, budget = ?ACCESS_REVIEW_BUDGET,
            "the API server did not say in time whether the pod may read its locks; injecting the sidecar without checking");
        return None;
    };
    let mut refused = Vec::new();
    for (lock, verb, answer) in answers {
        match answer {
            Ok(answer) => {
                if let Some(status) = answer.status.filter(|status| !status.allowed) {
                    let why = status.reason.filter(|reason| !reason.is_empty());
                    refused.push((lock, verb, why));
                }
            }
            Err(e) => {
                tracing::warn!(namespace, lock = ?lock, error = %e,
                    "cannot ask whether the pod may read its DistributedLock; injecting the sidecar without checking");
                return None;
            }
        }
    }
    // The locks first: a sidecar that cannot read its lock can do nothing at all.
    refused.sort_by_key(|(lock, _, _)| lock.is_none());
    let (lock, _, why) = refused.first()?;
    let verbs: Vec<&str> = refused
        .iter()
        .filter(|(other, _, _)| other == lock)
        .map(|(_, verb, _)| *verb)
        .collect();
    let why = why
        .as_ref()
        .map(|reason| format!(" ({reason})"))
        .unwrap_or_default();
    let verbs = verbs.join(" and ");
    Some(match lock {
        Some(lock) => format!(
            "ServiceAccount {namespace}/{account} may not {verbs} DistributedLock {namespace}/{lock}{why}: \
             its sidecar follows the lock with a watch and could only answer 503. Grant it get, \
             list and watch on the lock (a Role and a RoleBinding, as operator/config/sidecar-rbac/ \
             shows); the pod's controller creates the pod again, after its backoff"
        ),
        None => format!(
            "ServiceAccount {namespace}/{account} may not {verbs} pods in {namespace}{why}: the \
             sidecar, a plain container here (sidecar mode container), exits once the pod's \
             other containers have finished by watching its pod, and without it the pod would \
             never complete. Grant it get, list and watch on pods (a Role and a RoleBinding, as \
             operator/config/sidecar-rbac/ shows); the pod's controller creates the pod again, \
             after its backoff"
        ),
    })
}
