//! A cluster for sidecars that follow a `DistributedLock` (`--resource`): the in-memory
//! Kubernetes API served over HTTP (the one fake of the suites, since no API server runs here),
//! a kubeconfig naming it, and the real operator binary reconciling the lock: its finalizer, and
//! the clean-up of a `cleanupPolicy: Delete` lock's records once nobody holds it.
//!
//! The fake evaluates none of the CRD's CEL rules, so an edit of the backend goes through, as
//! it would with a CRD installed without them: the sidecars' own guard (step down on the old
//! backend, wait out its lease, then campaign on the new one) is what the safety check then
//! exercises.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use leasehold_testkit::in_memory_api_server::DISTRIBUTED_LOCKS;
use leasehold_testkit::{InMemoryApiServer, free_port};
use serde_json::{Value, json};

use crate::operator_binary;

pub const NAMESPACE: &str = "team";
const OPERATOR_NAMESPACE: &str = "leasehold-system";
const FINALIZED_WITHIN: Duration = Duration::from_secs(30);
/// The operator deletes a lock's records once nobody holds it, then lets the object go.
const DELETED_WITHIN: Duration = Duration::from_secs(60);

pub struct Cluster {
    /// Serves the API to the operator and the sidecars.
    _runtime: tokio::runtime::Runtime,
    pub api: InMemoryApiServer,
    dir: tempfile::TempDir,
    operator: Child,
    /// The lock's name, and how many times it was created (each time with a new uid).
    name: String,
    incarnation: u32,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.operator.kill();
        let _ = self.operator.wait();
    }
}

impl Cluster {
    /// Serve the API, start the operator, and create `name` in [`NAMESPACE`] with `spec`; ready
    /// once the operator has put its finalizer on the lock.
    pub fn start(name: &str, spec: Value) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let api = InMemoryApiServer::new();
        let dir = tempfile::tempdir().expect("temp dir");
        runtime.block_on(api.listen_with_kubeconfig(&dir.path().join("kubeconfig"), NAMESPACE));
        let log = std::fs::File::create(dir.path().join("operator.log")).expect("operator log");
        let operator = Command::new(operator_binary())
            .env("KUBECONFIG", dir.path().join("kubeconfig"))
            .env("POD_NAMESPACE", OPERATOR_NAMESPACE)
            .env("POD_NAME", "leasehold-operator-0")
            .env("RUST_LOG", "info")
            .args([
                &format!("--metrics-listen=127.0.0.1:{}", free_port()),
                &format!("--webhook-listen=127.0.0.1:{}", free_port()),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start leasehold-operator");
        let mut cluster = Self {
            _runtime: runtime,
            api,
            dir,
            operator,
            name: name.to_owned(),
            incarnation: 0,
        };
        cluster.create(spec);
        cluster
    }

    /// `NAMESPACE/NAME`, as `--resource` takes it.
    pub fn resource(&self) -> String {
        format!("{NAMESPACE}/{}", self.name)
    }

    /// The environment a sidecar needs to reach this cluster.
    pub fn env(&self) -> Vec<(String, String)> {
        let kubeconfig = self.dir.path().join("kubeconfig");
        vec![("KUBECONFIG".into(), kubeconfig.display().to_string())]
    }

    pub fn operator_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("operator.log")).unwrap_or_default()
    }

    fn lock(&self) -> Option<Value> {
        self.api.object(DISTRIBUTED_LOCKS, NAMESPACE, &self.name)
    }

    /// Create the lock anew (a new uid, as a real API server gives) and wait for the operator's
    /// finalizer, so that deleting it goes through the operator's clean-up.
    fn create(&mut self, spec: Value) {
        self.incarnation += 1;
        self.put_lock(&self.name, self.incarnation, spec);
    }

    /// Create another lock, `name`, in [`NAMESPACE`] beside the first; ready once the operator
    /// has put its finalizer on it. `--resource` takes both as `NAMESPACE/FIRST,NAMESPACE/NAME`.
    pub fn add_lock(&self, name: &str, spec: Value) {
        self.put_lock(name, 1, spec);
    }

    fn put_lock(&self, name: &str, incarnation: u32, spec: Value) {
        self.api.put(
            DISTRIBUTED_LOCKS,
            json!({
                "apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
                "metadata": {"name": name, "namespace": NAMESPACE,
                             "uid": format!("{name}-{incarnation}")},
                "spec": spec,
            }),
        );
        let deadline = Instant::now() + FINALIZED_WITHIN;
        while !self
            .api
            .object(DISTRIBUTED_LOCKS, NAMESPACE, name)
            .is_some_and(|l| {
                l["metadata"]["finalizers"]
                    .as_array()
                    .is_some_and(|f| !f.is_empty())
            })
        {
            assert!(
                Instant::now() < deadline,
                "the operator put no finalizer on {NAMESPACE}/{name} within {FINALIZED_WITHIN:?}; its log:\n{}",
                self.operator_log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Set an annotation on the lock, as `kubectl annotate` would.
    pub fn annotate(&self, key: &str, value: &str) {
        let mut lock = self.lock().expect("the lock exists");
        lock["metadata"]["annotations"][key] = json!(value);
        self.api.put(DISTRIBUTED_LOCKS, lock);
    }

    /// The lock's annotation `key`, if it carries one.
    pub fn annotation(&self, key: &str) -> Option<String> {
        self.lock()?["metadata"]["annotations"][key]
            .as_str()
            .map(str::to_owned)
    }

    /// The reasons of the Events the operator recorded about the lock.
    pub fn event_reasons(&self) -> Vec<String> {
        self.api
            .objects(leasehold_testkit::in_memory_api_server::EVENTS)
            .into_iter()
            .filter(|e| e["regarding"]["name"] == self.name.as_str())
            .filter_map(|e| e["reason"].as_str().map(str::to_owned))
            .collect()
    }

    /// Change the lock's spec in place, as `kubectl edit` would.
    pub fn edit(&self, change: impl FnOnce(&mut Value)) {
        let mut lock = self.lock().expect("the lock exists");
        change(&mut lock["spec"]);
        self.api.put(DISTRIBUTED_LOCKS, lock);
    }

    /// Delete the lock and wait until the operator has cleaned up its records and let it go,
    /// then create it again with the spec it had. `Err` when the operator did not finish.
    pub fn delete_and_recreate(&mut self) -> Result<Duration, String> {
        let spec = self.lock().expect("the lock exists")["spec"].clone();
        let started = Instant::now();
        assert!(self.api.remove(DISTRIBUTED_LOCKS, NAMESPACE, &self.name));
        while self.lock().is_some() {
            if started.elapsed() > DELETED_WITHIN {
                return Err(format!(
                    "the operator had not deleted {} {DELETED_WITHIN:?} after the delete (status {})",
                    self.resource(),
                    self.lock()
                        .map(|l| l["status"].to_string())
                        .unwrap_or_default()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let took = started.elapsed();
        self.create(spec);
        Ok(took)
    }
}
