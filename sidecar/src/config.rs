//! Configuration, read in one place: flags, each also readable from `LEASEHOLD_<FLAG>`.
//! A bad value exits with status 2 and one line naming the flag and the value.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use leasehold_lease::keyed::{FamilyConfig, collides_with_family};
use leasehold_lease::{BackendUrl, DEFAULT_BACKEND, LockConfig, Mode};

pub use crate::from_resource::ResourceRef;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:4040";
pub const DEFAULT_LEASE_DURATION: &str = "15s";
/// Exit status for bad configuration, as docs/design.md requires.
pub const EXIT_BAD_CONFIG: u8 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "leasehold-sidecar",
    version,
    about = "Holds a distributed lock and answers on localhost: GET /lock -> 200 holder, 409 not, 503 unknown."
)]
struct Args {
    /// The lock to hold (repeatable, or comma-separated, for several locks).
    #[arg(
        long = "lock",
        env = "LEASEHOLD_LOCK",
        value_name = "NAME",
        value_delimiter = ','
    )]
    locks: Vec<String>,

    /// A family of keyed locks (repeatable, or comma-separated): workers take keys chosen at run
    /// time, each for a per-request owner, at /locks/FAMILY/keys/KEY/acquire?owner=...
    #[arg(
        long = "keyed",
        env = "LEASEHOLD_KEYED",
        value_name = "FAMILY",
        value_delimiter = ','
    )]
    families: Vec<String>,

    /// How many keys of one family this sidecar may hold at once.
    #[arg(long, env = "LEASEHOLD_MAX_KEYS", value_name = "N",
          default_value_t = leasehold_lease::keyed::DEFAULT_MAX_KEYS,
          value_parser = clap::value_parser!(usize))]
    max_keys: usize,

    /// How many holders one key of a family has at once: a semaphore of N permits, each with
    /// its own fencing token (1: one holder at a time). Without --keyed, how many each --lock
    /// has.
    #[arg(long, env = "LEASEHOLD_PERMITS", value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32))]
    permits: u32,

    /// Keys of the families have readers and writers: every acquisition reads (up to
    /// --permits readers at once) and `mode=write` holds a key alone; at most 16 permits.
    #[arg(long, env = "LEASEHOLD_READ_WRITE")]
    read_write: bool,

    /// sqlite://PATH, redis://[user:pass@]host:port[/db], redlock://h:p,h:p,h:p,
    /// postgres://.. or mysql://..[?mode=lease|row-lock], etcd://h:p[,h:p] (etcds://...?ca=&cert=&key= for TLS), zk://h:p[,h:p]/PATH.
    /// Parsed after clap, so that an error shows the URL with its password redacted.
    #[arg(long, env = "LEASEHOLD_BACKEND", value_name = "URL", default_value = DEFAULT_BACKEND,
          hide_env_values = true)]
    backend: String,

    /// Who this holder is; without `/` where families are served [default: the hostname].
    #[arg(long, env = "LEASEHOLD_IDENTITY", value_name = "ID")]
    identity: Option<String>,

    /// Address of the lock API; loopback only.
    #[arg(long, env = "LEASEHOLD_LISTEN", value_name = "ADDR", default_value = DEFAULT_LISTEN,
          value_parser = parse_loopback)]
    listen: SocketAddr,

    /// Serve Dapr's lock API over HTTP here (loopback; Dapr's own port is 127.0.0.1:3500): a
    /// --keyed family is a Dapr lock store.
    #[arg(long, env = "LEASEHOLD_DAPR_HTTP_LISTEN", value_name = "ADDR", value_parser = parse_loopback)]
    dapr_http_listen: Option<SocketAddr>,

    /// Serve Dapr's gRPC lock calls (TryLockAlpha1, UnlockAlpha1) here (loopback; Dapr's own
    /// port is 127.0.0.1:50001).
    #[arg(long, env = "LEASEHOLD_DAPR_GRPC_LISTEN", value_name = "ADDR", value_parser = parse_loopback)]
    dapr_grpc_listen: Option<SocketAddr>,

    /// Address for /healthz, /readyz and /metrics only, for kubelet probes and Prometheus (which
    /// come to the pod IP).
    #[arg(long, env = "LEASEHOLD_PROBE_LISTEN", value_name = "ADDR")]
    probe_listen: Option<SocketAddr>,

    /// Let /readyz fail while a lock's backend is unreachable (a family's backend is pinged
    /// every 5 s). Off by default: a native
    /// sidecar's readiness is the pod's, so a backend outage would take the app out of its
    /// Services; the lock's own answer already says 503.
    #[arg(long, env = "LEASEHOLD_READINESS_REQUIRES_BACKEND")]
    readiness_requires_backend: bool,

    /// How long a lease lasts without renewal, e.g. 15s or 500ms.
    #[arg(long, env = "LEASEHOLD_LEASE_DURATION", value_name = "DURATION",
          default_value = DEFAULT_LEASE_DURATION, value_parser = parse_duration)]
    lease_duration: Duration,

    /// How often the holder renews [default: a third of the lease].
    #[arg(long, env = "LEASEHOLD_RENEW_INTERVAL", value_name = "DURATION", value_parser = parse_duration)]
    renew_interval: Option<Duration>,

    /// campaign: always try to hold the lock. on-demand: hold it only after POST /lock/acquire.
    #[arg(
        long,
        env = "LEASEHOLD_MODE",
        value_name = "MODE",
        default_value = "campaign"
    )]
    mode: Mode,

    /// Read the lock from a DistributedLock and the Secrets it references, and follow its
    /// changes (repeatable, or comma-separated). Replaces --lock, --keyed, --backend,
    /// --lease-duration, --renew-interval, --mode, --permits, --read-write and --max-keys
    /// (the resource's `spec.keys.maxHeldPerPod`).
    #[arg(long = "resource", env = "LEASEHOLD_RESOURCE", value_name = "NS/NAME", value_delimiter = ',',
          conflicts_with_all = ["locks", "families", "backend", "lease_duration", "renew_interval", "mode", "provision", "permits", "read_write", "max_keys"])]
    resources: Vec<String>,

    /// With --resource: how often the Secrets a DistributedLock references are read again, so
    /// that a rotated password or certificate reaches the backend before the old one is
    /// revoked.
    #[arg(long, env = "LEASEHOLD_SECRET_RECHECK", value_name = "DURATION", default_value = "30s",
          value_parser = parse_duration, requires = "resources")]
    secret_recheck: Duration,

    /// Create the backend's lock table (if absent) and exit: 0 when done, 1 with the reason.
    #[arg(long, env = "LEASEHOLD_PROVISION")]
    provision: bool,

    /// Ask the sidecar running on --listen to step down from every lock for good
    /// (POST /resign), then exit: 0 when it did. For the pod's preStop hook.
    #[arg(long, env = "LEASEHOLD_RESIGN", conflicts_with_all = ["locks", "resources", "provision"])]
    resign: bool,

    /// This pod's apps have stopped by the time this process gets SIGTERM: a native sidecar,
    /// which the kubelet signals after the pod's other containers. Its leases are then released
    /// at once. Without it, each lock and key stops being claimed at once and is released only
    /// once the last answer given about it (its validForMs) has run out, and the process exits
    /// after that: nobody else holds a lock while an app may still act on an answer. --resign
    /// (the preStop hook, which runs beside the apps' shutdown) always waits so.
    #[arg(long, env = "LEASEHOLD_APPS_STOP_FIRST", conflicts_with_all = ["resign", "provision"])]
    apps_stop_first: bool,

    /// Run as the plain container CONTAINER of a pod (clusters without native sidecars): step
    /// down and exit once the pod's other containers have finished for good, so that a Job's
    /// pod completes. Reads this pod (named by --identity) through the Kubernetes API.
    #[arg(long, env = "LEASEHOLD_EXIT_WITH_POD", value_name = "CONTAINER",
          conflicts_with_all = ["resign", "provision"])]
    exit_with_pod: Option<String>,

    /// The app's health endpoint on loopback: http://127.0.0.1:PORT/PATH (healthy when it
    /// answers 200-399), https://127.0.0.1:PORT/PATH (the same over TLS, the certificate not
    /// verified), tcp://127.0.0.1:PORT (a connection opens) or grpc://127.0.0.1:PORT[/SERVICE]
    /// (the gRPC health check answers SERVING). While it fails --app-health-failures probes in
    /// a row, campaign-mode locks sit out (step down, and campaign again once it is healthy).
    #[arg(long, env = "LEASEHOLD_APP_HEALTH", value_name = "URL")]
    app_health: Option<String>,

    /// How often the app's health endpoint is asked, and how long an answer may take.
    #[arg(long, env = "LEASEHOLD_APP_HEALTH_PERIOD", value_name = "DURATION", default_value = "5s",
          value_parser = parse_duration, requires = "app_health")]
    app_health_period: Duration,

    /// How many failed probes in a row make the locks sit out.
    #[arg(
        long,
        env = "LEASEHOLD_APP_HEALTH_FAILURES",
        value_name = "N",
        default_value_t = 3,
        requires = "app_health"
    )]
    app_health_failures: u32,

    /// Log format: text or json.
    #[arg(long, env = "LEASEHOLD_LOG_FORMAT", value_name = "FORMAT", default_value = "text",
          value_parser = ["text", "json"])]
    log_format: String,
}

#[derive(Debug, Clone)]
pub struct Config {
    /// `--resign`: tell the sidecar on `listen` to step down, and exit.
    pub resign_only: bool,
    /// `--resource`: the locks come from these DistributedLocks (and `locks` is empty).
    pub resources: Vec<ResourceRef>,
    /// `--secret-recheck`: how often those locks' Secrets are read again.
    pub secret_recheck: Duration,
    /// Who this holder is (the pod name in a cluster).
    pub identity: String,
    /// Provision the backend (seeding rows for `locks`) and exit, instead of holding locks.
    pub provision_only: bool,
    /// `--exit-with-pod`: this sidecar's container name in the pod named `identity`.
    pub exit_with_pod: Option<String>,
    /// `--apps-stop-first`: leases are released at once on SIGTERM.
    pub apps_stop_first: bool,
    pub locks: Vec<LockConfig>,
    /// `--keyed`: families of keyed locks on the same backend.
    pub families: Vec<FamilyConfig>,
    pub backend: BackendUrl,
    pub listen: SocketAddr,
    pub probe_listen: Option<SocketAddr>,
    /// Dapr's lock API, over HTTP and over gRPC.
    pub dapr_http_listen: Option<SocketAddr>,
    pub dapr_grpc_listen: Option<SocketAddr>,
    /// `/readyz` fails while a backend is unreachable (opt-in).
    pub readiness_requires_backend: bool,
    /// `--app-health`: campaign-mode locks sit out while the app is unhealthy.
    pub app_health: Option<crate::app_health::AppHealth>,
    pub json_logs: bool,
}

/// What to do instead of running.
#[derive(Debug)]
pub enum Exit {
    /// --help or --version: print to stdout, exit 0.
    Info(String),
    /// Bad configuration: one line for stderr, exit 2.
    BadConfig(String),
}

impl Config {
    pub fn from_env_and_args() -> Result<Self, Exit> {
        Self::parse_from(std::env::args_os())
    }

    pub fn parse_from<I, T>(args: I) -> Result<Self, Exit>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let args = Args::try_parse_from(args).map_err(|e| match e.kind() {
            clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                Exit::Info(e.to_string())
            }
            // One line: clap's first paragraph (a missing argument is named on the lines
            // after "not provided:").
            _ => Exit::BadConfig({
                let message = e.to_string();
                let first: Vec<&str> = message
                    .lines()
                    .map(str::trim)
                    .take_while(|line| !line.is_empty())
                    .collect();
                if first.is_empty() {
                    "error: invalid arguments".to_owned()
                } else {
                    first.join(" ")
                }
            }),
        })?;
        Self::from_args(args)
    }

    fn from_args(args: Args) -> Result<Self, Exit> {
        let bad = |flag: &str, value: &str, reason: &dyn std::fmt::Display| {
            Exit::BadConfig(format!(
                "error: invalid value '{value}' for '--{flag}': {reason}"
            ))
        };
        let mut resources: Vec<ResourceRef> = Vec::new();
        for raw in &args.resources {
            let r: ResourceRef = raw.parse().map_err(|e: String| bad("resource", raw, &e))?;
            if resources.contains(&r) {
                return Err(bad("resource", raw, &"the resource is named twice"));
            }
            // The lock API names locks without their namespace (`/locks/jobs`).
            if let Some(other) = resources.iter().find(|o| o.name == r.name) {
                return Err(bad(
                    "resource",
                    raw,
                    &format_args!(
                        "{other} has the same name, and the lock API names locks without their namespace"
                    ),
                ));
            }
            resources.push(r);
        }
        let backend = BackendUrl::parse(&args.backend).map_err(|e| match e {
            leasehold_lease::Error::InvalidUrl { url, reason } => bad("backend", &url, &reason),
            other => bad("backend", &leasehold_lease::redact(&args.backend), &other),
        })?;
        // --provision takes the locks whose rows it seeds (row-lock mode), and needs none.
        if args.locks.is_empty()
            && args.families.is_empty()
            && !args.provision
            && resources.is_empty()
            && !args.resign
        {
            return Err(Exit::BadConfig(
                "error: --lock NAME, --keyed FAMILY (or LEASEHOLD_LOCK, LEASEHOLD_KEYED) or --resource NAMESPACE/NAME is required"
                    .into(),
            ));
        }
        let identity = args
            .identity
            .unwrap_or_else(|| leasehold_process::hostname("leasehold"));
        // With --resource the locks are validated later; the identity is checked here.
        if let Err(leasehold_lease::Error::InvalidConfig {
            field: "identity",
            reason,
        }) = LockConfig::new("identity-check", &identity, Duration::from_secs(15)).validate()
        {
            return Err(bad("identity", &identity, &reason));
        }
        let renew_interval = args.renew_interval.unwrap_or(args.lease_duration / 3);
        // The lock engine names the setting it refuses; each maps to the flag of the same name.
        let invalid_setting = |field: &str, reason: &str| {
            let value = match field {
                "identity" => identity.clone(),
                "lease-duration" => humantime::format_duration(args.lease_duration).to_string(),
                "permits" => args.permits.to_string(),
                _ => humantime::format_duration(renew_interval).to_string(),
            };
            bad(field, &value, &reason)
        };
        if !(1..=leasehold_lease::keyed::MAX_PERMITS).contains(&args.permits) {
            return Err(bad(
                "permits",
                &args.permits.to_string(),
                &format!(
                    "a lock or a key has 1 to {} permits",
                    leasehold_lease::keyed::MAX_PERMITS
                ),
            ));
        }
        let mut locks: Vec<LockConfig> = Vec::new();
        for name in &args.locks {
            if locks.iter().any(|l| &l.name == name) {
                return Err(bad("lock", name, &"the lock is named twice"));
            }
            // Beside families, --permits is theirs (as it was before locks had permits): a lock
            // of several permits runs in a sidecar without families.
            let lock = LockConfig {
                renew_interval,
                mode: args.mode,
                permits: match args.families.is_empty() {
                    true => args.permits,
                    false => 1,
                },
                ..LockConfig::new(name, &identity, args.lease_duration)
            };
            if let Err(e) = leasehold_lease::names::validate_lock_name(name) {
                return Err(bad("lock", name, &e));
            }
            match lock.validate() {
                Ok(()) => {}
                Err(leasehold_lease::Error::InvalidConfig {
                    field: "lock",
                    reason,
                }) => return Err(bad("lock", name, &reason)),
                Err(leasehold_lease::Error::InvalidConfig { field, reason }) => {
                    return Err(invalid_setting(field, &reason));
                }
                Err(other) => return Err(bad("lock", name, &other)),
            }
            locks.push(lock);
        }
        let mut families: Vec<FamilyConfig> = Vec::new();
        if args.read_write && args.families.is_empty() {
            return Err(bad(
                "read-write",
                "true",
                &"readers and writers are for keyed families (--keyed)",
            ));
        }
        for name in &args.families {
            if families.iter().any(|f| &f.name == name) || locks.iter().any(|l| &l.name == name) {
                return Err(bad("keyed", name, &"the name is given twice"));
            }
            if let Some(lock) = locks.iter().find(|l| collides_with_family(&l.name, name)) {
                return Err(bad(
                    "keyed",
                    name,
                    &format!(
                        "the lock {:?} would share the backend with its keys",
                        lock.name
                    ),
                ));
            }
            if let Err(e) = leasehold_lease::names::validate_lock_name(name) {
                return Err(bad("keyed", name, &e));
            }
            if args.max_keys == 0 {
                return Err(bad("max-keys", "0", &"must be at least 1"));
            }
            if args.read_write && args.permits > leasehold_lease::keyed::MAX_READ_WRITE_PERMITS {
                return Err(bad(
                    "permits",
                    &args.permits.to_string(),
                    &format!(
                        "a read-write family's key has 1 to {} permits",
                        leasehold_lease::keyed::MAX_READ_WRITE_PERMITS
                    ),
                ));
            }
            families.push(FamilyConfig {
                renew_interval,
                max_keys: args.max_keys,
                permits: args.permits,
                read_write: args.read_write,
                ..FamilyConfig::new(name, &identity, args.lease_duration)
            });
        }
        if !families.is_empty()
            && let Err(leasehold_lease::Error::InvalidConfig { field, reason }) =
                leasehold_lease::keyed::validate_family_identity(&identity)
        {
            return Err(bad(field, &identity, &reason));
        }
        if !families.is_empty() && args.locks.is_empty() {
            // The lease settings are checked once per lock above; with families alone, here.
            if let Err(leasehold_lease::Error::InvalidConfig { field, reason }) = (LockConfig {
                renew_interval,
                ..LockConfig::new(&families[0].name, &identity, args.lease_duration)
            })
            .validate()
            {
                return Err(invalid_setting(field, &reason));
            }
        }
        for (flag, dapr) in [
            ("dapr-http-listen", args.dapr_http_listen),
            ("dapr-grpc-listen", args.dapr_grpc_listen),
        ] {
            let Some(addr) = dapr else { continue };
            // With --resource, which resources are families is known once they are read.
            if families.is_empty() && args.resources.is_empty() {
                return Err(bad(
                    flag,
                    &addr.to_string(),
                    &"Dapr's lock API serves keyed families: add --keyed FAMILY (its lock store)",
                ));
            }
            let taken = [Some(args.listen), args.probe_listen]
                .into_iter()
                .flatten()
                .chain(
                    (flag == "dapr-grpc-listen")
                        .then_some(args.dapr_http_listen)
                        .flatten(),
                );
            if taken.into_iter().any(|a| a == addr) {
                return Err(bad(
                    flag,
                    &addr.to_string(),
                    &"the address is already in use by another flag",
                ));
            }
        }
        if let Some(probe) = args.probe_listen
            && probe == args.listen
        {
            return Err(bad(
                "probe-listen",
                &probe.to_string(),
                &"the same as --listen",
            ));
        }
        let app_health = match &args.app_health {
            Some(url) => Some(
                crate::app_health::AppHealth::parse(
                    url,
                    args.app_health_period,
                    args.app_health_failures,
                )
                .map_err(|e| bad("app-health", url, &e))?,
            ),
            None => None,
        };
        Ok(Self {
            resign_only: args.resign,
            resources,
            secret_recheck: args.secret_recheck,
            identity,
            provision_only: args.provision,
            exit_with_pod: args.exit_with_pod,
            apps_stop_first: args.apps_stop_first,
            locks,
            families,
            backend,
            listen: args.listen,
            probe_listen: args.probe_listen,
            dapr_http_listen: args.dapr_http_listen,
            dapr_grpc_listen: args.dapr_grpc_listen,
            readiness_requires_backend: args.readiness_requires_backend,
            app_health,
            json_logs: args.log_format == "json",
        })
    }
}

fn parse_duration(raw: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(raw)
        .map_err(|e| format!("{e}; expected a duration such as 15s or 500ms"))?;
    if d.is_zero() {
        return Err("must be above zero".into());
    }
    Ok(d)
}

/// The lock API must not be reachable from outside the pod: anyone who can reach it can
/// release the lock.
fn parse_loopback(raw: &str) -> Result<SocketAddr, String> {
    let addr: SocketAddr = raw
        .parse()
        .map_err(|e| format!("{e}; expected IP:PORT such as 127.0.0.1:4040"))?;
    if !addr.ip().is_loopback() {
        return Err(
            "the lock API listens on loopback only (127.0.0.1 or [::1]); \
                    use --probe-listen for kubelet probes"
                .into(),
        );
    }
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, Exit> {
        Config::parse_from(std::iter::once("leasehold-sidecar").chain(args.iter().copied()))
    }

    fn bad(args: &[&str]) -> String {
        match parse(args) {
            Err(Exit::BadConfig(line)) => {
                assert!(!line.contains('\n'), "more than one line: {line}");
                line
            }
            other => panic!("expected a bad config for {args:?}, got {other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let c = parse(&["--lock", "jobs"]).unwrap();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.backend.kind(), "sqlite");
        let l = &c.locks[0];
        assert_eq!(l.lease_duration, Duration::from_secs(15));
        assert_eq!(l.renew_interval, Duration::from_secs(5));
        assert_eq!(l.mode, Mode::Campaign);
        assert!(!l.identity.is_empty());
    }

    #[test]
    fn several_locks() {
        let c = parse(&["--lock", "a,b", "--lock", "c", "--mode", "on-demand"]).unwrap();
        let names: Vec<_> = c.locks.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(c.locks.iter().all(|l| l.mode == Mode::OnDemand));
    }

    #[test]
    fn bad_values_name_the_flag_and_value() {
        let cases: &[(&[&str], &str)] = &[
            (&["--lock", "jobs", "--lease-duration", "soon"], "soon"),
            (&["--lock", "jobs", "--lease-duration", "0s"], "0s"),
            (
                &["--lock", "jobs", "--renew-interval", "20s"],
                "--renew-interval",
            ),
            (
                &["--lock", "jobs", "--lease-duration", "50ms"],
                "--lease-duration",
            ),
            (&["--lock", "bad name"], "bad name"),
            (&["--lock", "jobs", "--backend", "mongo://x"], "mongo://x"),
            (
                &["--lock", "jobs", "--backend", "redis://h:xx"],
                "redis://h:xx",
            ),
            (
                &["--lock", "jobs", "--listen", "0.0.0.0:4040"],
                "0.0.0.0:4040",
            ),
            (&["--lock", "jobs", "--listen", "nope"], "nope"),
            (&["--lock", "jobs", "--mode", "greedy"], "greedy"),
            (&["--lock", "jobs", "--nosuch"], "--nosuch"),
            (&["--keyed", "orders", "--permits", "0"], "--permits"),
            (&["--keyed", "orders", "--permits", "257"], "--permits"),
            (&["--lock", "jobs", "--permits", "0"], "--permits"),
            (
                &["--lock", &"j".repeat(220), "--permits", "3"],
                "names them as a family",
            ),
            (&["--lock", "jobs", "--read-write"], "--read-write"),
            (
                &["--keyed", "docs", "--read-write", "--permits", "17"],
                "--permits",
            ),
            (&["--lock", "a,a"], "'a'"),
            (&["--lock", "jobs", "--resource", "ns/x"], "--resource"),
            (&["--resource", "ns/x", "--permits", "3"], "--permits"),
            (&["--keyed", "orders", "--identity", "a/b"], "--identity"),
            (&["--resource", "ns/x", "--max-keys", "5"], "--max-keys"),
            (&["--resource", "ns"], "NAMESPACE/NAME"),
            (&["--resource", "Ns/x"], "Ns/x"),
            (&["--resource", "ns/x,ns/x"], "twice"),
            (&["--resource", "a/jobs,b/jobs"], "a/jobs has the same name"),
            (
                &["--resource", "ns/x", "--backend", "redis://h"],
                "--backend",
            ),
            (&[], "--lock"),
            (
                &["--lock", "jobs", "--identity", &"x".repeat(300)],
                "--identity",
            ),
        ];
        for (args, needle) in cases {
            let line = bad(args);
            assert!(line.contains(needle), "{args:?}: {line}");
        }
    }

    #[test]
    fn permits_apply_to_the_families_or_without_them_to_the_locks() {
        let c = parse(&["--lock", "workers", "--permits", "3"]).unwrap();
        assert_eq!(c.locks[0].permits, 3);
        let c = parse(&["--keyed", "pool", "--permits", "3"]).unwrap();
        assert_eq!(c.families[0].permits, 3);
        let c = parse(&["--lock", "leader", "--keyed", "pool", "--permits", "3"]).unwrap();
        assert_eq!((c.locks[0].permits, c.families[0].permits), (1, 3));
    }

    #[test]
    fn resources_replace_the_lock_flags() {
        let c = parse(&[
            "--resource",
            "team/jobs,team/reports",
            "--identity",
            "pod-0",
        ])
        .unwrap();
        let names: Vec<String> = c.resources.iter().map(ToString::to_string).collect();
        assert_eq!(names, ["team/jobs", "team/reports"]);
        assert_eq!(c.identity, "pod-0");
        assert!(c.locks.is_empty());
    }

    #[test]
    fn passwords_stay_out_of_errors() {
        let line = bad(&["--lock", "j", "--backend", "redis://:hunter2@h/x"]);
        assert!(!line.contains("hunter2"), "{line}");
    }
}
