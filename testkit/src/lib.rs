//! Test fixtures, in one place: real backend servers on free loopback ports with throwaway data
//! directories, a fault-injecting driver wrapper, a TCP proxy that partitions links, test hosts
//! in network namespaces for partitions a proxy cannot place, and the conformance suite every
//! driver passes.
//! A missing server binary fails loudly with the package to install; nothing is skipped.

pub mod conformance;
pub mod etcd_server;
pub mod fault_proxy;
pub mod faulty;
pub mod in_memory_api_server;
pub mod mariadb_server;
pub mod metrics_reference;
pub mod postgres_server;
pub mod redis_cluster;
pub mod redis_sentinel;
pub mod redis_sentinel_hosts;
pub mod redis_server;
mod server_process;
mod server_side_apply;
pub mod tair_pair;
pub mod tairstring;
pub mod test_network;
pub mod zookeeper_ensemble;
pub mod zookeeper_server;

use std::net::TcpListener;
use std::path::PathBuf;

pub use conformance::{
    BackendServer, EtcdHarness, Harness, KubernetesHarness, MariaDbHarness, PostgresHarness,
    REDLOCK_MASTERS, RedisHarness, RedisSentinelHarness, RedlockHarness, ServerHarness,
    SqliteHarness, ZooKeeperHarness,
};
pub use etcd_server::EtcdServer;
pub use fault_proxy::FaultProxy;
pub use faulty::FaultyDriver;
pub use in_memory_api_server::InMemoryApiServer;
pub use mariadb_server::MariaDbServer;
pub use postgres_server::PostgresServer;
pub use redis_cluster::{RedisCluster, TlsRedisCluster};
pub use redis_sentinel::{RedisSentinelSet, TlsRedisSentinelSet};
pub use redis_sentinel_hosts::RedisSentinelHosts;
pub use redis_server::{RedisServer, command_calls, until_pattern_subscribers};
pub use tair_pair::TairPair;
pub use test_network::{Forward, TestNetwork};
pub use zookeeper_ensemble::ZooKeeperEnsemble;
pub use zookeeper_server::ZooKeeperServer;

/// A driver for `url`, through the same parsing and `connect` as the sidecar.
pub async fn driver_for(url: &str) -> std::sync::Arc<dyn leasehold_lease::Backend> {
    leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(url).expect("url"))
        .await
        .expect("driver")
}

/// A lock that campaigns for `lock` as `identity`, renewing ten times a lease.
pub fn campaign(
    driver: std::sync::Arc<dyn leasehold_lease::Backend>,
    lock: &str,
    identity: &str,
    lease: std::time::Duration,
) -> leasehold_lease::Lock {
    let config = leasehold_lease::LockConfig {
        renew_interval: lease / 10,
        mode: leasehold_lease::Mode::Campaign,
        ..leasehold_lease::LockConfig::new(lock, identity, lease)
    };
    leasehold_lease::Lock::start(driver, config, std::sync::Arc::new(())).expect("start lock")
}

/// Whether `lock` still counts itself holder: its self-fence deadline has not passed, whether or
/// not it can reach the backend to say so (a holder that cannot answers 503, but an app may
/// still be acting on its last 200).
pub fn claims(lock: &leasehold_lease::Lock) -> bool {
    lock.snapshot()
        .held
        .is_some_and(|held| held.valid_until > leasehold_lease::BootInstant::now())
}

/// A `DistributedLock` NAMESPACE/NAME on `backend`, as a user would write it (15 s lease, 5 s
/// renew interval, the defaults otherwise), with the uid `uid-NAME` the API server would give.
pub fn distributed_lock(
    namespace: &str,
    name: &str,
    backend: leasehold_crds::Backend,
) -> leasehold_crds::DistributedLock {
    let mut lock = leasehold_crds::DistributedLock::new(
        name,
        leasehold_crds::DistributedLockSpec {
            backend,
            lease_duration: "15s".into(),
            renew_interval: None,
            mode: Default::default(),
            cleanup_policy: Default::default(),
            holder_label: None,
            keys: None,
            permits: None,
        },
    );
    lock.metadata.namespace = Some(namespace.into());
    lock.metadata.uid = Some(format!("uid-{name}"));
    lock
}

/// `pod` (JSON) as admission webhooks see it on a real cluster: the API server's ServiceAccount
/// admission, which runs before them, has mounted the service account token (a projected
/// volume) into every container the pod has, unless the pod turns automounting off.
pub fn with_service_account_token(mut pod: serde_json::Value) -> serde_json::Value {
    const VOLUME: &str = "kube-api-access-x7k2p";
    if pod["spec"]["automountServiceAccountToken"] == false {
        return pod;
    }
    for list in ["containers", "initContainers"] {
        if let Some(containers) = pod["spec"]
            .get_mut(list)
            .and_then(serde_json::Value::as_array_mut)
        {
            for container in containers {
                let mount = serde_json::json!({"name": VOLUME, "readOnly": true,
                    "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"});
                match container["volumeMounts"].as_array_mut() {
                    Some(mounts) => mounts.push(mount),
                    None => container["volumeMounts"] = serde_json::json!([mount]),
                }
            }
        }
    }
    let volume = serde_json::json!({"name": VOLUME, "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace",
            "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}});
    match pod["spec"]["volumes"].as_array_mut() {
        Some(volumes) => volumes.push(volume),
        None => pod["spec"]["volumes"] = serde_json::json!([volume]),
    }
    pod
}

/// A TCP port that was free on loopback a moment ago, and that nothing else will be given.
///
/// The ports come from below the kernel's ephemeral range, and none is handed out twice in one
/// process. A port the kernel picks for `bind(0)` comes from the same range as every outgoing
/// connection's local port, so a server killed and restarted on it can find it taken: a Redis
/// Cluster node's bus port was, by a peer redialling it during the outage.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(usize::MAX);
    let ports = reserved_test_ports();
    let span = ports.len();
    // Each process starts at its own place, so test binaries and soaks running side by side
    // rarely probe the same ports.
    let seed = std::process::id() as usize * 7919
        + std::time::UNIX_EPOCH
            .elapsed()
            .map_or(0, |d| d.subsec_nanos() as usize);
    let _ = NEXT.compare_exchange(
        usize::MAX,
        seed % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span {
        let port = ports.start + (NEXT.fetch_add(1, Ordering::Relaxed) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {ports:?}")
}

/// Loopback ports for test servers: the 12,000 below the kernel's ephemeral range.
fn reserved_test_ports() -> std::ops::Range<u16> {
    const SPAN: u16 = 12_000;
    const LINUX_DEFAULT_EPHEMERAL_START: u16 = 32_768;
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(LINUX_DEFAULT_EPHEMERAL_START);
    let start = ephemeral_start.saturating_sub(SPAN).max(1024);
    start..ephemeral_start.max(start + 1000)
}

/// Find a server binary, or fail the test with what to install.
pub fn require_binary(name: &str, debian_package: &str) -> PathBuf {
    let search = std::env::var_os("PATH").unwrap_or_default();
    let extra = ["/usr/sbin", "/usr/bin", "/usr/local/bin"];
    std::env::split_paths(&search)
        .chain(extra.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{name}` was not found. Install it with `apt-get install -y {debian_package}` \
                 (scripts/test does this), then run the tests again."
            )
        })
}

/// A lock name unique to one test, so tests sharing a backend never collide.
pub fn unique_lock(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The PEM files of a TLS test server, in its throwaway directory.
pub struct TlsFiles {
    pub ca: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TlsFiles {
    /// The files [`write_test_certificates`] wrote in `dir`.
    pub fn in_dir(dir: &std::path::Path) -> Self {
        Self {
            ca: dir.join("ca.crt"),
            client_cert: dir.join("client.crt"),
            client_key: dir.join("client.key"),
        }
    }
}

/// A CA of the test's own, and a server (for 127.0.0.1 and localhost) and a client certificate
/// signed by it, as PEM files in `dir` (see [`TlsFiles::in_dir`]).
pub fn write_test_certificates(dir: &std::path::Path) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };
    let write = |name: &str, pem: String| std::fs::write(dir.join(name), pem).expect(name);
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(DnType::CommonName, "leasehold test CA");
    write("ca.crt", ca.self_signed(&ca_key).expect("CA").pem());
    let issuer = Issuer::new(ca, ca_key);
    let leaf = |file: &str, names: Vec<String>, usage: ExtendedKeyUsagePurpose| {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(names).expect("names");
        params.distinguished_name.push(DnType::CommonName, file);
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &issuer).expect("sign");
        write(&format!("{file}.crt"), cert.pem());
        write(&format!("{file}.key"), key.serialize_pem());
    };
    leaf(
        "server",
        vec!["127.0.0.1".into(), "localhost".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    leaf("client", vec![], ExtendedKeyUsagePurpose::ClientAuth);
}
