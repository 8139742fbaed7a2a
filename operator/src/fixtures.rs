//! Test fixtures in one place, in the kube-rs `controller-rs` style: [`Context::test`] gives a
//! context whose client talks to an [`ApiServerVerifier`], which plays the API server through
//! named [`Scenario`]s, checking every request the reconciler sends and answering it.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use kube::{Resource, ResourceExt};
use leasehold_crds::{Backend, CleanupPolicy, DistributedLock, RedisBackend, SecretKeyRef};
use serde_json::{Value, json};
use tower_test::mock;

use crate::metrics::Metrics;
use crate::reconcile::{Context, FINALIZER};

pub const NAMESPACE: &str = "team";
/// The Redis password of [`unreachable_redis_lock`]; it must never show up in a request.
pub const SECRET_PASSWORD: &str = "hunter2-do-not-log";

type ApiServerHandle = mock::Handle<Request<Body>, Response<Body>>;

pub struct ApiServerVerifier(ApiServerHandle);

/// What the API server should see, in order, for one reconciliation.
pub enum Scenario {
    /// A new lock gets the finalizer, and nothing else happens yet.
    FinalizerCreation(DistributedLock),
    /// The backend is provisioned: a ready status, then a `Provisioned` event.
    Provisioned(DistributedLock),
    /// The Secret is read, the backend does not answer: a failed status and a warning event,
    /// neither with the password in it.
    BackendUnreachable(DistributedLock),
    /// Only the status moves (observedGeneration); no event.
    StatusOnly(DistributedLock),
    /// A holder appeared in the backend: it shows in the status, with a `HolderChanged` event.
    HolderChanged(DistributedLock, &'static str),
    /// A family of keyed locks provisioned: the status counts its held keys and names no
    /// holder, with a `Provisioned` event.
    FamilyProvisioned(DistributedLock, i64),
    /// Only the family's count of held keys moves; no event.
    HeldKeysChanged(DistributedLock, i64),
    /// A lock of several permits provisioned with permit 0 held by this holder: the status
    /// names it and counts the permits held, with `Provisioned` and `HolderChanged` events.
    PermitsProvisioned(DistributedLock, &'static str, i64),
    /// Nothing at all: the status is already right.
    Nothing,
    /// The lock is being deleted with Retain: the finalizer goes, nothing else.
    RemoveFinalizer(DistributedLock),
    /// The lock is being deleted with Delete: a `CleanedUp` event, then the finalizer goes.
    CleanedUp(DistributedLock),
    /// The lock is being deleted with Delete while it has a holder: a `CleanupWaiting` warning,
    /// the `CleanedUp` condition says why, and the finalizer stays.
    CleanupWaits(DistributedLock),
    /// The same in a namespace being deleted: the API server refuses every event, as a real one
    /// does there; the clean-up gives up at once, says so in the status, and the finalizer goes.
    CleanupInTerminatingNamespace(DistributedLock),
    /// Delete on a backend that has not answered since the lock was deleted, past the deadline:
    /// given up, said in the status and an event, and the finalizer goes.
    CleanupPastItsDeadline(DistributedLock),
    /// The same before the deadline: the failure is in the status, the finalizer stays.
    CleanupFailsForNow(DistributedLock),
}

impl Context {
    /// A context whose API server is the returned verifier.
    pub fn test() -> (Arc<Self>, ApiServerVerifier) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(service, NAMESPACE);
        let ctx = Context::new(client, "operator-test-0", Arc::new(Metrics::new()));
        (Arc::new(ctx), ApiServerVerifier(handle))
    }
}

/// Fail a scenario that hangs instead of letting the test run forever.
pub async fn timeout_after_1s(server: tokio::task::JoinHandle<()>) {
    tokio::time::timeout(Duration::from_secs(1), server)
        .await
        .expect("the scenario did not finish: the reconciler sent fewer requests than expected")
        .expect("the scenario failed");
}

/// A lock whose records go with it (`cleanupPolicy: Delete`), so that it carries the finalizer.
pub fn lock(name: &str, backend: Backend) -> DistributedLock {
    let mut lock = leasehold_testkit::distributed_lock(NAMESPACE, name, backend);
    lock.spec.cleanup_policy = CleanupPolicy::Delete;
    lock.meta_mut().generation = Some(1);
    lock.meta_mut().resource_version = Some("100".into());
    lock
}

/// A lock on the Redis at `127.0.0.1:port`, without credentials.
pub fn redis_lock(name: &str, port: u16) -> DistributedLock {
    lock(
        name,
        Backend {
            redis: Some(RedisBackend {
                endpoints: vec![format!("127.0.0.1:{port}")],
                ..Default::default()
            }),
            ..Default::default()
        },
    )
}

/// A Redis lock on a loopback port nothing listens on, with its password in a Secret.
pub fn unreachable_redis_lock(name: &str) -> DistributedLock {
    let port = leasehold_testkit::free_port();
    lock(
        name,
        Backend {
            redis: Some(RedisBackend {
                endpoints: vec![format!("127.0.0.1:{port}")],
                password_secret_ref: Some(SecretKeyRef {
                    name: "redis-auth".into(),
                    key: "password".into(),
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
    )
}

/// `lock` as a family of keyed locks, with the default bounds.
pub fn family(mut lock: DistributedLock) -> DistributedLock {
    lock.spec.keys = Some(Default::default());
    lock
}

/// A lock of `permits` permits.
pub fn with_permits(mut lock: DistributedLock, permits: u32) -> DistributedLock {
    lock.spec.permits = Some(permits);
    lock
}

pub fn with_finalizer(mut lock: DistributedLock) -> DistributedLock {
    lock.meta_mut().finalizers = Some(vec![FINALIZER.into()]);
    lock
}

pub fn being_deleted(mut lock: DistributedLock, policy: CleanupPolicy) -> DistributedLock {
    lock.spec.cleanup_policy = policy;
    lock.meta_mut().deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()),
    );
    with_finalizer(lock)
}

/// The `CleanedUp` condition of a status sent.
fn cleaned_up(status: &Value) -> &Value {
    status["conditions"]
        .as_array()
        .and_then(|all| all.iter().find(|c| c["type"] == "CleanedUp"))
        .unwrap_or_else(|| panic!("no CleanedUp condition: {status}"))
}

fn path_of(lock: &DistributedLock) -> String {
    format!(
        "/apis/leasehold.dev/v1alpha1/namespaces/{NAMESPACE}/distributedlocks/{}",
        lock.name_any()
    )
}

impl ApiServerVerifier {
    /// Play `scenario` in a task; await it with [`timeout_after_1s`].
    pub fn run(self, scenario: Scenario) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut api = self;
            match scenario {
                Scenario::FinalizerCreation(lock) => api.finalizer_added(lock).await,
                Scenario::Provisioned(lock) => {
                    let status = api.status_patched(&lock).await;
                    assert_eq!(status["conditions"][0]["status"], "True", "{status}");
                    api.event(&lock, "Provisioned").await;
                }
                Scenario::BackendUnreachable(lock) => {
                    api.secret_read("redis-auth", "password", SECRET_PASSWORD)
                        .await;
                    let status = api.status_patched(&lock).await;
                    let condition = &status["conditions"][0];
                    assert_eq!(condition["status"], "False", "{status}");
                    assert_eq!(condition["reason"], "Unreachable", "{status}");
                    assert!(status.get("holder").is_none());
                    api.event(&lock, "BackendUnavailable").await;
                }
                Scenario::StatusOnly(lock) => {
                    let status = api.status_patched(&lock).await;
                    assert_eq!(status["observedGeneration"], json!(lock.meta().generation));
                }
                Scenario::HolderChanged(lock, holder) => {
                    let status = api.status_patched(&lock).await;
                    assert_eq!(status["holder"], holder, "{status}");
                    assert!(
                        status["fencingToken"].as_i64().is_some_and(|t| t > 0),
                        "{status}"
                    );
                    api.event(&lock, "HolderChanged").await;
                }
                Scenario::FamilyProvisioned(lock, held) => {
                    let status = api.status_patched(&lock).await;
                    assert_eq!(status["conditions"][0]["status"], "True", "{status}");
                    assert_eq!(status["heldKeys"], json!(held), "{status}");
                    assert!(status.get("holder").is_none(), "{status}");
                    api.event(&lock, "Provisioned").await;
                }
                Scenario::PermitsProvisioned(lock, holder, held) => {
                    let status = api.status_patched(&lock).await;
                    assert_eq!(status["conditions"][0]["status"], "True", "{status}");
                    assert_eq!(status["heldPermits"], json!(held), "{status}");
                    assert_eq!(status["holder"], holder, "{status}");
                    assert!(status.get("heldKeys").is_none(), "{status}");
                    api.event(&lock, "Provisioned").await;
                    api.event(&lock, "HolderChanged").await;
                }
                Scenario::HeldKeysChanged(lock, held) => {
                    let status = api.status_patched(&lock).await;
                    assert_eq!(status["heldKeys"], json!(held), "{status}");
                    api.nothing().await;
                }
                Scenario::Nothing => api.nothing().await,
                Scenario::RemoveFinalizer(lock) => api.finalizer_removed(lock).await,
                Scenario::CleanedUp(lock) => {
                    api.event(&lock, "CleanedUp").await;
                    api.finalizer_removed(lock).await;
                }
                Scenario::CleanupWaits(lock) => {
                    api.event(&lock, "CleanupWaiting").await;
                    api.namespace_read(false).await;
                    let status = api.status_patched(&lock).await;
                    assert_eq!(cleaned_up(&status)["type"], "CleanedUp", "{status}");
                    assert_eq!(cleaned_up(&status)["reason"], "HolderAlive", "{status}");
                }
                Scenario::CleanupInTerminatingNamespace(lock) => {
                    api.event_refused_in_terminating_namespace().await;
                    api.namespace_read(true).await;
                    let status = api.status_patched(&lock).await;
                    let condition = cleaned_up(&status);
                    assert_eq!(condition["reason"], "GaveUp", "{status}");
                    let message = condition["message"].as_str().unwrap();
                    assert!(
                        message.starts_with("the namespace is being deleted")
                            && message.contains("still holds the lock"),
                        "{message}"
                    );
                    api.event_refused_in_terminating_namespace().await;
                    api.finalizer_removed(lock).await;
                }
                Scenario::CleanupFailsForNow(lock) => {
                    api.secret_read("redis-auth", "password", SECRET_PASSWORD)
                        .await;
                    api.event(&lock, "CleanupFailed").await;
                    api.namespace_read(false).await;
                    let status = api.status_patched(&lock).await;
                    assert_eq!(cleaned_up(&status)["reason"], "CleanupFailed", "{status}");
                }
                Scenario::CleanupPastItsDeadline(lock) => {
                    // The clean-up takes the lock, which reads the Secret once.
                    api.secret_read("redis-auth", "password", SECRET_PASSWORD)
                        .await;
                    api.event(&lock, "CleanupFailed").await;
                    api.namespace_read(false).await;
                    let status = api.status_patched(&lock).await;
                    let message = cleaned_up(&status)["message"].as_str().unwrap();
                    assert!(message.starts_with("the clean-up was retried"), "{message}");
                    api.event(&lock, "CleanupAbandoned").await;
                    api.finalizer_removed(lock).await;
                }
            }
        })
    }

    async fn next(&mut self) -> (Request<Value>, mock::SendResponse<Response<Body>>) {
        let (request, send) = tokio::time::timeout(Duration::from_secs(5), self.0.next_request())
            .await
            .expect("the reconciler sent no request")
            .expect("the client is gone");
        let (parts, body) = request.into_parts();
        let bytes = http_body_util::BodyExt::collect(body)
            .await
            .unwrap()
            .to_bytes();
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains(SECRET_PASSWORD),
            "a secret went to the API server: {text}"
        );
        let value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        (Request::from_parts(parts, value), send)
    }

    fn reply(send: mock::SendResponse<Response<Body>>, code: StatusCode, body: &Value) {
        send.send_response(
            Response::builder()
                .status(code)
                .body(Body::from(serde_json::to_vec(body).unwrap()))
                .unwrap(),
        );
    }

    async fn finalizer_added(&mut self, mut lock: DistributedLock) {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(request.uri().path(), path_of(&lock));
        let ops = request.body().to_string();
        assert!(ops.contains(FINALIZER) && ops.contains("\"add\""), "{ops}");
        lock.meta_mut().finalizers = Some(vec![FINALIZER.into()]);
        Self::reply(send, StatusCode::OK, &serde_json::to_value(&lock).unwrap());
    }

    async fn finalizer_removed(&mut self, mut lock: DistributedLock) {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(request.uri().path(), path_of(&lock));
        let ops = request.body().to_string();
        assert!(ops.contains("\"remove\""), "{ops}");
        lock.meta_mut().finalizers = None;
        Self::reply(send, StatusCode::OK, &serde_json::to_value(&lock).unwrap());
    }

    /// A server-side apply of the status; returns the status sent.
    async fn status_patched(&mut self, lock: &DistributedLock) -> Value {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH);
        assert_eq!(request.uri().path(), format!("{}/status", path_of(lock)));
        let query = request.uri().query().unwrap_or_default();
        assert!(
            query.contains("fieldManager=leasehold-operator") && query.contains("force=true"),
            "{query}"
        );
        let sent = request.body().clone();
        assert_eq!(sent["kind"], "DistributedLock");
        let mut answered = serde_json::to_value(lock).unwrap();
        answered["status"] = sent["status"].clone();
        Self::reply(send, StatusCode::OK, &answered);
        sent["status"].clone()
    }

    async fn event(&mut self, lock: &DistributedLock, reason: &str) {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::POST);
        assert_eq!(
            request.uri().path(),
            format!("/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events")
        );
        let event = request.body().clone();
        assert_eq!(event["reason"], reason, "{event}");
        assert_eq!(event["regarding"]["name"], lock.name_any());
        Self::reply(send, StatusCode::CREATED, &event);
    }

    /// An event POST refused as a real API server refuses any new object in a namespace being
    /// deleted.
    async fn event_refused_in_terminating_namespace(&mut self) {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::POST);
        assert!(
            request.uri().path().ends_with("/events"),
            "{}",
            request.uri()
        );
        Self::reply(
            send,
            StatusCode::FORBIDDEN,
            &json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("events.events.k8s.io is forbidden: unable to create new content in namespace {NAMESPACE} because it is being terminated"),
                "reason": "Forbidden", "code": 403,
                "details": {"kind": "events.events.k8s.io",
                            "causes": [{"reason": "NamespaceTerminating",
                                        "message": format!("namespace {NAMESPACE} is being terminated"),
                                        "field": "metadata.namespace"}]},
            }),
        );
    }

    async fn namespace_read(&mut self, terminating: bool) {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::GET);
        assert_eq!(
            request.uri().path(),
            format!("/api/v1/namespaces/{NAMESPACE}")
        );
        let mut namespace = json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": NAMESPACE},
            "status": {"phase": if terminating { "Terminating" } else { "Active" }},
        });
        if terminating {
            namespace["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        Self::reply(send, StatusCode::OK, &namespace);
    }

    async fn secret_read(&mut self, name: &str, key: &str, value: &str) {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::GET);
        assert_eq!(
            request.uri().path(),
            format!("/api/v1/namespaces/{NAMESPACE}/secrets/{name}")
        );
        let encoded = k8s_openapi::ByteString(value.as_bytes().to_vec());
        let secret = json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": NAMESPACE, "annotations": {
                leasehold_resource::ALLOWED_HOSTS_ANNOTATION: "127.0.0.1",
            }},
            "data": {key: encoded},
        });
        Self::reply(send, StatusCode::OK, &secret);
    }

    async fn nothing(&mut self) {
        let extra = tokio::time::timeout(Duration::from_millis(300), self.0.next_request()).await;
        if let Ok(Some((request, _))) = extra {
            panic!(
                "expected no request, got {} {}",
                request.method(),
                request.uri()
            );
        }
    }
}
