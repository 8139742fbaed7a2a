//! The localhost HTTP API (docs/design.md, "The sidecar's HTTP contract"). Every answer is read from
//! the holder's in-memory snapshot; no request waits on the backend, except the long polls and
//! acquisitions that ask to wait.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use leasehold_lease::keyed::{KeyAnswer, KeyError, KeyRelease, KeyedFamily, KeysAnswer};
use leasehold_lease::{Answer, DEFAULT_HOLD, Lock, Mode, Snapshot};
use serde::Serialize;

use crate::hold_stream;
use crate::metrics::Metrics;

/// The longest `wait` a request may ask for; longer waits are refused, not truncated.
pub const MAX_WAIT: Duration = Duration::from_secs(300);
/// The longest `hold` an on-demand acquisition may ask for.
pub const MAX_HOLD: Duration = Duration::from_secs(24 * 3600);

/// A request the API refuses: a status and a message, sent as `{"error": message}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json(self.status, &serde_json::json!({ "error": self.message }))
    }
}

#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    /// In the order given on the command line; the first is the one `/lock` means. Behind a
    /// lock because `--resource` replaces a lock when its spec changes.
    locks: std::sync::RwLock<Vec<Lock>>,
    metrics: Arc<Metrics>,
    /// Whether `/readyz` fails while a backend is unreachable (`--readiness-requires-backend`).
    readiness_requires_backend: std::sync::atomic::AtomicBool,
    /// `--keyed`, or resources that declare `spec.keys`: families of keyed locks.
    families: std::sync::RwLock<Vec<KeyedFamily>>,
    /// Why each family's backend did not answer its last ping, by family name (`None`: it
    /// answered), kept by [`AppState::check_families`] while readiness requires the backend:
    /// a family holds no lease of its own to tell.
    family_errors: std::sync::RwLock<BTreeMap<String, Option<String>>>,
    /// `--resource`: the names of the locks and families in command-line order (`/lock` means
    /// the first that is a lock), known before any of them could be read.
    expected: Vec<String>,
    /// Those of `expected` not started yet, each with why: answered 503 with the reason.
    pending: std::sync::RwLock<BTreeMap<String, String>>,
    /// `POST /resign` was called: no lock is started or put in place any more.
    resigned: std::sync::atomic::AtomicBool,
    /// `--apps-stop-first`: this pod's apps have stopped by the time this process gets
    /// SIGTERM, so its leases are released at once then.
    apps_stop_first: std::sync::atomic::AtomicBool,
    /// When the last release is made of the leases let go once their answers ran out: the
    /// process waits for it before it exits.
    releases_due: std::sync::Mutex<Option<leasehold_lease::BootInstant>>,
    /// By lock, or by key and owner: taken by an exclusive hold (`?exclusive=true`) for as long
    /// as it lasts, so that two such holds take turns rather than share one acquisition.
    exclusive_holds: std::sync::Mutex<HashMap<HoldOf, Arc<tokio::sync::Mutex<()>>>>,
    /// `--app-health`: why the app is taken for unhealthy, while campaign-mode locks sit out;
    /// a lock put in place meanwhile starts sitting out.
    app_unhealthy: std::sync::Mutex<Option<String>>,
    /// Held while the app's health is changed and the locks told, and while a lock put in
    /// place is told the health it reads: one never overtakes the other.
    app_health_turn: tokio::sync::Mutex<()>,
}

/// Why locks or families are let go of for good ([`AppState::let_go`]): whether an app of this
/// pod may still act on an answer about them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LetGo {
    /// Their `DistributedLock` was deleted: the pod's apps run on.
    ResourceDeleted,
    /// The pod's preStop hook (`POST /resign`): it runs as the pod starts stopping, beside its
    /// apps' shutdown (a native sidecar's too), so they may still act on an answer.
    Resigned,
    /// The pod is stopping (SIGTERM): its apps have stopped by now only with
    /// `--apps-stop-first` (a native sidecar, which the kubelet signals after them).
    PodStopping,
    /// The pod's other containers have finished (`--exit-with-pod`).
    AppsFinished,
}

impl LetGo {
    /// The reason the `released` event gives.
    fn reason(self) -> &'static str {
        match self {
            LetGo::ResourceDeleted => "the DistributedLock was deleted",
            LetGo::Resigned => "resigned: the pod is stopping",
            LetGo::PodStopping => "shutting down",
            LetGo::AppsFinished => "the pod's apps have finished",
        }
    }
}

/// What an exclusive hold takes turns on: a lock of the pod's, or one owner's hold of a key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum HoldOf {
    Lock(String),
    Key {
        family: String,
        key: String,
        owner: String,
    },
}

impl AppState {
    /// Wait up to `wait` for the exclusive holds of `of` before this one to end; `None` when
    /// they have not. The turn is this hold's until the guard is dropped.
    async fn exclusive_turn(
        &self,
        of: HoldOf,
        wait: Duration,
    ) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        let slot = {
            let mut holds = self
                .inner
                .exclusive_holds
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            // A slot only the map refers to has nobody holding or awaiting it: keys and owners
            // come and go, and their slots with them.
            holds.retain(|_, slot| Arc::strong_count(slot) > 1);
            holds.entry(of).or_default().clone()
        };
        tokio::time::timeout(wait, slot.lock_owned()).await.ok()
    }

    /// The owner's turn on each of `keys` of `family` (in byte order, as several keys are taken,
    /// so that two such waits never wait on each other), by `deadline`; else the key whose turn
    /// did not come, with the answer that says so (another exclusive hold of the owner has it).
    async fn key_turns(
        &self,
        family: &KeyedFamily,
        keys: &[String],
        owner: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Vec<tokio::sync::OwnedMutexGuard<()>>, (String, KeyAnswer)> {
        let mut order: Vec<&String> = keys.iter().collect();
        order.sort();
        order.dedup();
        let mut turns = Vec::with_capacity(order.len());
        for key in order {
            let of = HoldOf::Key {
                family: family.name().to_owned(),
                key: key.clone(),
                owner: owner.to_owned(),
            };
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.exclusive_turn(of, left).await {
                Some(turn) => turns.push(turn),
                None => {
                    let holder = Some(family.qualified(owner));
                    return Err((key.clone(), KeyAnswer::HeldByAnother { holder }));
                }
            }
        }
        Ok(turns)
    }

    pub fn new(locks: Vec<Lock>, metrics: Arc<Metrics>) -> Self {
        Self {
            inner: Arc::new(Inner {
                locks: std::sync::RwLock::new(locks),
                metrics,
                readiness_requires_backend: std::sync::atomic::AtomicBool::new(false),
                families: std::sync::RwLock::new(Vec::new()),
                family_errors: std::sync::RwLock::new(BTreeMap::new()),
                expected: Vec::new(),
                pending: std::sync::RwLock::new(BTreeMap::new()),
                resigned: std::sync::atomic::AtomicBool::new(false),
                apps_stop_first: std::sync::atomic::AtomicBool::new(false),
                releases_due: std::sync::Mutex::new(None),
                exclusive_holds: std::sync::Mutex::new(HashMap::new()),
                app_unhealthy: std::sync::Mutex::new(None),
                app_health_turn: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// The same state, serving `families` too. Call before the state is shared.
    pub fn with_families(self, families: Vec<KeyedFamily>) -> Self {
        *self
            .inner
            .families
            .write()
            .unwrap_or_else(|e| e.into_inner()) = families;
        self
    }

    /// The same state, serving the locks and families `names` (in command-line order) once
    /// they are started; until then each answers 503 with `reason`. Call before the state is
    /// shared.
    pub fn expecting(self, names: Vec<String>, reason: &str) -> Self {
        let mut inner = Arc::try_unwrap(self.inner)
            .unwrap_or_else(|_| panic!("expecting on a state already shared"));
        inner.pending = std::sync::RwLock::new(
            names
                .iter()
                .map(|name| (name.clone(), reason.to_owned()))
                .collect(),
        );
        inner.expected = names;
        Self {
            inner: Arc::new(inner),
        }
    }

    pub fn families(&self) -> Vec<KeyedFamily> {
        self.inner
            .families
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Why the lock or family `name` is not started yet, if it is not.
    pub fn pending_reason(&self, name: &str) -> Option<String> {
        self.inner
            .pending
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// Every lock or family not started yet, with why.
    pub fn pending(&self) -> Vec<(String, String)> {
        self.inner
            .pending
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(name, reason)| (name.clone(), reason.clone()))
            .collect()
    }

    /// Say why `name` cannot be started yet; it answers 503 with `reason` until it is.
    pub fn set_pending(&self, name: &str, reason: String) {
        self.inner
            .pending
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), reason);
    }

    /// Serve a lock that has been started, in the place of its pending entry. `Err` once the
    /// sidecar has resigned: the caller shuts the lock down instead.
    pub fn install_lock(&self, lock: Lock) -> Result<(), Lock> {
        let name = lock.name().to_owned();
        if let Some(old) = self.replace(lock)? {
            // Not expected: a lock is installed once, and replaced by `replace` afterwards.
            tracing::warn!(lock = %name, "a lock was installed twice; the first is shut down");
            tokio::spawn(async move { old.shutdown().await });
        }
        self.clear_pending(&name);
        Ok(())
    }

    /// Serve a family that has been started, in the place of its pending entry; as
    /// [`AppState::install_lock`].
    pub fn install_family(&self, family: KeyedFamily) -> Result<(), KeyedFamily> {
        let name = family.name().to_owned();
        let mut families = self
            .inner
            .families
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if self.has_resigned() {
            return Err(family);
        }
        families.push(family);
        drop(families);
        self.clear_pending(&name);
        Ok(())
    }

    fn clear_pending(&self, name: &str) {
        self.inner
            .pending
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
    }

    /// Whether `POST /resign` has been called.
    pub fn has_resigned(&self) -> bool {
        self.inner
            .resigned
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    fn not_started(&self, name: &str) -> Option<ApiError> {
        self.pending_reason(name).map(|reason| {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{name} is not started yet: {reason}"),
            )
        })
    }

    /// The family a `/locks/{name}/...` route names, when it names one rather than a lock.
    fn family_named(&self, name: Option<&Path<String>>) -> Option<KeyedFamily> {
        let Path(name) = name?;
        self.families().into_iter().find(|f| f.name() == name)
    }

    fn family(&self, name: &str) -> Result<KeyedFamily, ApiError> {
        let families = self.families();
        if let Some(family) = families.iter().find(|f| f.name() == name) {
            return Ok(family.clone());
        }
        if let Some(error) = self.not_started(name) {
            return Err(error);
        }
        let known: Vec<&str> = families.iter().map(|f| f.name()).collect();
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "no keyed family named {name:?} here; this sidecar serves: {}",
                if known.is_empty() {
                    "none (start it with --keyed FAMILY)".to_owned()
                } else {
                    known.join(", ")
                }
            ),
        ))
    }

    /// Let `/readyz` fail while a backend is unreachable (by default it does not: see
    /// [`readyz`]).
    pub fn set_readiness_requires_backend(&self, requires: bool) {
        self.inner
            .readiness_requires_backend
            .store(requires, std::sync::atomic::Ordering::Relaxed);
    }

    /// Ping every family's backend each `every` (at most `patience` each), for `/readyz`,
    /// for as long as the process runs. A family not answered yet counts as not reached.
    pub async fn check_families(&self, every: Duration, patience: Duration) {
        loop {
            // A family let go of (its resource deleted, its backend moved) is no backend this
            // pod needs.
            let families: Vec<KeyedFamily> = self
                .families()
                .into_iter()
                .filter(|f| !f.is_stopped())
                .collect();
            let answers = futures_util::future::join_all(families.iter().map(|family| async {
                let error = match tokio::time::timeout(patience, family.ping()).await {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some(format!("no answer to a ping within {patience:?}")),
                };
                (family.name().to_owned(), error)
            }))
            .await;
            *self
                .inner
                .family_errors
                .write()
                .unwrap_or_else(|e| e.into_inner()) = answers.into_iter().collect();
            tokio::time::sleep(every).await;
        }
    }

    /// The families whose backend did not answer the last ping (or was not pinged yet), with
    /// why, once [`AppState::check_families`] runs; none otherwise.
    fn unreachable_families(&self) -> Vec<(String, String)> {
        let errors = self
            .inner
            .family_errors
            .read()
            .unwrap_or_else(|e| e.into_inner());
        self.families()
            .iter()
            .filter(|family| !family.is_stopped())
            .filter_map(|family| match errors.get(family.name()) {
                Some(None) => None,
                Some(Some(error)) => Some((family.name().to_owned(), error.clone())),
                None => Some((
                    family.name().to_owned(),
                    "backend not reached yet".to_owned(),
                )),
            })
            .collect()
    }

    /// `--apps-stop-first`: see [`AppState::let_go`].
    pub fn set_apps_stop_first(&self, first: bool) {
        self.inner
            .apps_stop_first
            .store(first, std::sync::atomic::Ordering::Relaxed);
    }

    /// Let go of `locks` and `families` for good. When no app of this pod can act on an answer
    /// any more ([`LetGo`]), each lease is released at once. Otherwise each lock and key stops
    /// being claimed at once, and its lease is released only once the last answer about it
    /// has run out, so that nobody else holds it meanwhile; the process waits for those
    /// releases before it exits ([`AppState::releases_due`]).
    pub async fn let_go(&self, locks: &[Lock], families: &[KeyedFamily], why: LetGo) {
        let apps_stopped = match why {
            LetGo::ResourceDeleted | LetGo::Resigned => false,
            LetGo::PodStopping => self
                .inner
                .apps_stop_first
                .load(std::sync::atomic::Ordering::Relaxed),
            LetGo::AppsFinished => true,
        };
        if apps_stopped {
            futures_util::future::join_all(locks.iter().map(Lock::shutdown)).await;
            futures_util::future::join_all(families.iter().map(KeyedFamily::shutdown)).await;
            return;
        }
        let locks_released =
            futures_util::future::join_all(locks.iter().map(|l| l.retire_for(why.reason()))).await;
        // Stopped, not only retired: no key is taken while the last answers run out.
        let keys_released =
            futures_util::future::join_all(families.iter().map(KeyedFamily::stop)).await;
        self.note_releases_due(
            locks_released
                .into_iter()
                .chain(keys_released)
                .flatten()
                .max(),
        );
    }

    /// A lease let go of is released at `at`, once the last answer about it has run out.
    pub fn note_releases_due(&self, at: Option<leasehold_lease::BootInstant>) {
        let mut due = self
            .inner
            .releases_due
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *due = (*due).max(at);
    }

    /// When the last lease let go by [`AppState::let_go`] is released, if one still waits for
    /// its answers to run out.
    pub fn releases_due(&self) -> Option<leasehold_lease::BootInstant> {
        *self
            .inner
            .releases_due
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Why campaign-mode locks sit out (`--app-health` found the app unhealthy), if they do.
    pub fn app_unhealthy(&self) -> Option<String> {
        self.inner
            .app_unhealthy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The turn to change the app's health and tell the locks, or to tell a lock just put in
    /// place the health as it is ([`AppState::set_app_unhealthy`]).
    pub async fn app_health_turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.inner.app_health_turn.lock().await
    }

    /// The app is unhealthy for `reason`, or healthy (`None`): set before the locks sit out or
    /// come back, in the [`AppState::app_health_turn`], so that a lock put in place meanwhile
    /// is told too, in the order the changes were made.
    pub fn set_app_unhealthy(&self, reason: Option<String>) {
        *self
            .inner
            .app_unhealthy
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = reason;
    }

    pub fn locks(&self) -> Vec<Lock> {
        self.inner
            .locks
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Put `lock` in the place of the lock of the same name; the old one is returned for the
    /// caller to shut down (after the new one is answering, so that `/lock` never 404s). `Err`
    /// once the sidecar has resigned, checked under the same guard `POST /resign` reads the
    /// locks through, so that no lock put in place escapes its stepping down.
    pub fn replace(&self, lock: Lock) -> Result<Option<Lock>, Lock> {
        let mut locks = self.inner.locks.write().unwrap_or_else(|e| e.into_inner());
        if self.has_resigned() {
            return Err(lock);
        }
        Ok(match locks.iter_mut().find(|l| l.name() == lock.name()) {
            Some(slot) => Some(std::mem::replace(slot, lock)),
            None => {
                locks.push(lock);
                None
            }
        })
    }

    fn lock(&self, name: Option<Path<String>>) -> Result<Lock, ApiError> {
        let locks = self.locks();
        let named = |name: &str| locks.iter().find(|l| l.name() == name).cloned();
        match name {
            // The first lock on the command line; one not started yet may be it.
            None if !self.inner.expected.is_empty() => {
                for name in &self.inner.expected {
                    if let Some(lock) = named(name) {
                        return Ok(lock);
                    }
                    if let Some(error) = self.not_started(name) {
                        return Err(error);
                    }
                }
                Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "no lock is configured (every resource is a family of keyed locks)",
                ))
            }
            None => locks
                .first()
                .cloned()
                .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "no lock is configured")),
            Some(Path(name)) => named(&name).ok_or_else(|| {
                self.not_started(&name).unwrap_or_else(|| {
                    let known: Vec<&str> = locks.iter().map(Lock::name).collect();
                    ApiError::new(
                        StatusCode::NOT_FOUND,
                        format!(
                            "no lock named {name:?} here; this sidecar holds: {}",
                            known.join(", ")
                        ),
                    )
                })
            }),
        }
    }
}

/// The lock API, for loopback.
pub fn lock_api(state: AppState) -> Router {
    Router::new()
        .route("/lock", get(status))
        .route("/lock/events", get(events))
        .route("/lock/acquire", post(acquire))
        .route("/lock/release", post(release))
        .route("/lock/hold", post(hold))
        .route("/locks/{name}", get(status))
        .route("/locks/{name}/events", get(events))
        .route("/locks/{name}/acquire", post(acquire))
        .route("/locks/{name}/release", post(release))
        .route("/locks/{name}/hold", post(hold))
        .route("/locks/{name}/force-release", post(force_release))
        .route("/locks/{family}/extend", post(keys_extend))
        .route("/locks/{family}/keys/{key}", get(key_status))
        .route("/locks/{family}/keys/{key}/acquire", post(key_acquire))
        .route("/locks/{family}/keys/{key}/release", post(key_release))
        .route("/locks/{family}/keys/{key}/extend", post(key_extend))
        .route("/locks/{family}/keys/{key}/hold", post(key_hold))
        .route("/locks/{family}/keys/{key}/events", get(key_events))
        .route(
            "/locks/{family}/keys/{key}/force-release",
            post(key_force_release),
        )
        .route("/resign", post(resign))
        .merge(probe_api())
        .fallback(not_found)
        .layer(axum::middleware::map_response(json_refusal))
        .with_state(state)
}

/// A refusal made before any handler ran (axum's own: a path that is not UTF-8, a method the
/// route does not take) is plain text or empty; it is sent as every other refusal is, a JSON
/// `{"error": ...}`, with its status and headers (`Allow` among them) kept.
async fn json_refusal(response: Response) -> Response {
    refusal_as_json(response, |message| serde_json::json!({ "error": message })).await
}

/// `response` as it is, unless it is a 4xx or 5xx that is not JSON: then `body(message)`, the
/// message being the refusal's text, or for a method not allowed the methods that are.
pub async fn refusal_as_json(
    response: Response,
    body: impl FnOnce(String) -> serde_json::Value,
) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, refusal) = response.into_parts();
    // axum's refusals are a line; a longer body is not one of them and is cut.
    let text = axum::body::to_bytes(refusal, 4096)
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_owned())
        .unwrap_or_default();
    let message = match parts.headers.get(header::ALLOW) {
        Some(allow) if status == StatusCode::METHOD_NOT_ALLOWED => format!(
            "method not allowed; this route takes: {}",
            String::from_utf8_lossy(allow.as_bytes())
        ),
        _ if text.is_empty() => status
            .canonical_reason()
            .unwrap_or("refused")
            .to_lowercase(),
        _ => text,
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    let bytes = serde_json::to_vec(&body(message)).unwrap_or_default();
    Response::from_parts(parts, axum::body::Body::from(bytes))
}

/// Health, readiness and metrics: what kubelet and Prometheus ask for on the pod IP. Nothing
/// here changes or reveals more than the metrics do; the lock routes stay on loopback.
pub fn probe_api() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
}

pub fn probe_router(state: AppState) -> Router {
    probe_api()
        .fallback(not_found)
        .layer(axum::middleware::map_response(json_refusal))
        .with_state(state)
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct LockStatus<'a> {
    lock: &'a str,
    holder: bool,
    identity: &'a str,
    current_holder: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fencing_token: Option<u64>,
    /// Of a lock of several permits: the permit held (fence with it and the token), and how
    /// many the lock has.
    #[serde(skip_serializing_if = "Option::is_none")]
    permit: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    permits: Option<u32>,
    valid_for_ms: u64,
    backend: &'static str,
    mode: &'static str,
    since: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    released: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    warning: Option<&'a str>,
    /// Why a free lock is not granted yet (a guard of the backend's), while it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
    /// When grants resume, from now, when the backend said.
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_ms: Option<u64>,
}

pub(crate) fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

fn status_code(answer: Answer) -> StatusCode {
    match answer {
        Answer::Holder { .. } => StatusCode::OK,
        Answer::NotHolder => StatusCode::CONFLICT,
        Answer::Unknown => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The answer for one lock as it stands now, with `answer` decided once so that status code and
/// body agree.
fn lock_response(
    lock: &Lock,
    snapshot: &Snapshot,
    answer: Answer,
    released: Option<bool>,
) -> Response {
    let (token, valid_for) = match answer {
        Answer::Holder {
            token, valid_for, ..
        } => (Some(token), valid_for),
        _ => (None, Duration::ZERO),
    };
    let current_holder = match answer {
        Answer::Unknown => None,
        _ => snapshot
            .current_holder
            .as_ref()
            .map(|h| h.identity.as_str()),
    };
    let withheld = match answer {
        Answer::NotHolder => snapshot.withheld.as_ref(),
        _ => None,
    };
    let permits = lock.has_had_permits().then(|| lock.permits());
    let body = LockStatus {
        lock: lock.name(),
        holder: answer.is_holder(),
        identity: &lock.config().identity,
        current_holder,
        fencing_token: token,
        permit: permits.and(answer.holding()).map(|(permit, _)| permit),
        permits,
        valid_for_ms: valid_for.as_millis() as u64,
        backend: lock.backend(),
        mode: lock.config().mode.as_str(),
        since: rfc3339(snapshot.since),
        released,
        error: snapshot.backend_error.as_deref(),
        warning: snapshot.warning.as_deref(),
        // Sitting out (the app is unhealthy) says why before a backend's guard does.
        reason: match answer {
            Answer::NotHolder => snapshot.sitting_out.as_deref(),
            _ => None,
        }
        .or(withheld.map(|w| w.reason.as_str())),
        retry_after_ms: withheld
            .and_then(|w| w.until)
            .map(|until| until.remaining().as_millis() as u64),
    };
    json(status_code(answer), &body)
}

fn current(lock: &Lock, released: Option<bool>) -> Response {
    let snapshot = lock.snapshot();
    // A holding whose hold ran out (its release waiting on a renewal's late answer) is over.
    let answer = answered_now(&snapshot, snapshot.answer());
    lock_response(lock, &snapshot, answer, released)
}

fn json(status: StatusCode, body: &impl Serialize) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => (status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// Query parameters: only the named ones, each a duration below its bound.
fn durations(
    query: &HashMap<String, String>,
    allowed: &[(&str, Duration)],
) -> Result<HashMap<String, Duration>, ApiError> {
    let mut out = HashMap::new();
    for (key, value) in query {
        let Some((_, max)) = allowed.iter().find(|(name, _)| name == key) else {
            let names: Vec<&str> = allowed.iter().map(|(n, _)| *n).collect();
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "unknown parameter {key:?}; this route takes: {}",
                    if names.is_empty() {
                        "none".to_owned()
                    } else {
                        names.join(", ")
                    }
                ),
            ));
        };
        let d = parse_duration(value).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("{key}={value:?} is not a duration ({e}); use e.g. 10s or 500ms"),
            )
        })?;
        if d > *max {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "{key}={value} is longer than the limit of {}",
                    humantime::format_duration(*max)
                ),
            ));
        }
        out.insert(key.clone(), d);
    }
    Ok(out)
}

/// A duration in the form the API documents (docs/reference/openapi.yaml, `Duration`): `0`, or numbers
/// each followed by a unit, with no space (`500ms`, `1m30s`, `1.5h`). humantime alone also takes
/// spaces inside and around (`1 0s` is ten seconds), which a client cannot mean.
fn parse_duration(value: &str) -> Result<Duration, String> {
    fn well_formed(value: &str) -> bool {
        if value == "0" {
            return true;
        }
        let mut rest = value;
        let take = |rest: &mut &str, f: fn(char) -> bool| {
            let end = rest.find(|c| !f(c)).unwrap_or(rest.len());
            let (taken, left) = rest.split_at(end);
            *rest = left;
            !taken.is_empty()
        };
        while !rest.is_empty() {
            if !take(&mut rest, |c| c.is_ascii_digit()) {
                return false;
            }
            if let Some(fraction) = rest.strip_prefix('.') {
                rest = fraction;
                if !take(&mut rest, |c| c.is_ascii_digit()) {
                    return false;
                }
            }
            if !take(&mut rest, |c| c.is_ascii_alphabetic() || c == 'µ') {
                return false;
            }
        }
        !value.is_empty()
    }
    if !well_formed(value) {
        return Err("numbers each followed by a unit, with no space".into());
    }
    humantime::parse_duration(value).map_err(|e| e.to_string())
}

/// The shortest `hold`: an answer is counted in whole milliseconds (`validForMs`), so a shorter
/// hold would take the lock only to answer that it is not held and let it go.
const MIN_HOLD: Duration = Duration::from_millis(1);

/// How long a key's status waits for the backend's count of permits held before it answers
/// without it: the owner's own answer is the caller's, and is never held up by the backend.
const PERMITS_READ_BOUND: Duration = Duration::from_millis(500);

/// `hold` (default [`DEFAULT_HOLD`]), which must be at least [`MIN_HOLD`].
fn hold_param(params: &HashMap<String, Duration>) -> Result<Duration, ApiError> {
    let hold = params.get("hold").copied().unwrap_or(DEFAULT_HOLD);
    if hold < MIN_HOLD {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "hold must be at least 1ms",
        ));
    }
    Ok(hold)
}

async fn status(
    State(state): State<AppState>,
    name: Option<Path<String>>,
    QueryOnce(query): QueryOnce,
) -> Result<Response, ApiError> {
    let lock = state.lock(name)?;
    let params = durations(&query, &[("wait", MAX_WAIT)])?;
    if let Some(wait) = params.get("wait") {
        lock.wait_for_holder(*wait).await;
    }
    Ok(current(&lock, None))
}

/// A 400 for a campaign-mode lock, which the sidecar takes by itself: `instead` says what the
/// app does instead.
fn on_demand_only(lock: &Lock, instead: &str) -> Result<(), ApiError> {
    if lock.config().mode == Mode::Campaign {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "lock {:?} is in campaign mode: the sidecar takes it by itself; {instead}, \
                 or run with --mode on-demand",
                lock.name()
            ),
        ));
    }
    Ok(())
}

async fn acquire(
    State(state): State<AppState>,
    name: Option<Path<String>>,
    QueryOnce(query): QueryOnce,
) -> Result<Response, ApiError> {
    if let Some(family) = state.family_named(name.as_ref()) {
        return keys_acquire(family, query).await;
    }
    let lock = state.lock(name)?;
    on_demand_only(&lock, "use GET /lock?wait=... to wait for it")?;
    let params = durations(&query, &[("wait", MAX_WAIT), ("hold", MAX_HOLD)])?;
    let wait = params.get("wait").copied().unwrap_or(Duration::ZERO);
    let hold = hold_param(&params)?;
    let answer = lock
        .acquire(wait, hold)
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    // The answer this acquisition got, not the state a moment later: another call of this pod
    // may have taken the lock since, and a refused call holds nothing (its app would act while
    // the other call's release frees the lock).
    let snapshot = lock.snapshot();
    let answer = answered_now(&snapshot, answer);
    Ok(lock_response(&lock, &snapshot, answer, None))
}

/// An acquisition's `answer` as it stands now, its handler having run a moment after the
/// engine answered: a holding's validity counted down to now (never longer than answered),
/// and not held once the holding it got has ended (lost, its hold lapsed, or another token).
/// A backend error since does not turn it into "unknown": the acquisition was counted, and an
/// app answered otherwise would leave its count held for nobody.
fn answered_now(snapshot: &Snapshot, answer: Answer) -> Answer {
    let Answer::Holder {
        token,
        permit,
        valid_for,
    } = answer
    else {
        return answer;
    };
    let left = snapshot
        .held
        .as_ref()
        .filter(|held| (held.token, held.permit) == (token, permit))
        .map(|held| held.answered_until().remaining())
        .unwrap_or_default();
    if left.is_zero() {
        return Answer::NotHolder;
    }
    Answer::Holder {
        token,
        permit,
        valid_for: valid_for.min(left),
    }
}

/// On-demand: acquire, waiting up to `wait`, and hold for as long as the connection stays open
/// (an event stream, [`crate::hold_stream`]); a lock not acquired is answered as `acquire`
/// answers it. A family's name holds the keys of `keys=...` together ([`keys_hold`]). With
/// `exclusive=true` the hold also waits for the other exclusive holds of this pod to end, rather
/// than sharing the pod's acquisition with them (`leasehold exec --via`).
async fn hold(
    State(state): State<AppState>,
    name: Option<Path<String>>,
    QueryOnce(mut query): QueryOnce,
) -> Result<Response, ApiError> {
    if let Some(family) = state.family_named(name.as_ref()) {
        return keys_hold(&state, family, query).await;
    }
    let lock = state.lock(name)?;
    on_demand_only(&lock, "follow it with GET /lock/events")?;
    let exclusive = exclusive_param(&mut query)?;
    let params = durations(&query, &[("wait", MAX_WAIT)])?;
    let wait = params.get("wait").copied().unwrap_or(Duration::ZERO);
    let deadline = tokio::time::Instant::now() + wait;
    let turn = if exclusive {
        match state
            .exclusive_turn(HoldOf::Lock(lock.name().to_owned()), wait)
            .await
        {
            Some(turn) => Some(turn),
            // Another exclusive hold of this pod has it: not this caller's.
            None => {
                return Ok(lock_response(
                    &lock,
                    &lock.snapshot(),
                    Answer::NotHolder,
                    None,
                ));
            }
        }
    } else {
        None
    };
    let answer = lock
        .acquire(
            deadline.saturating_duration_since(tokio::time::Instant::now()),
            hold_stream::bound_hold(lock.config().lease_duration),
        )
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    let Answer::Holder { token, permit, .. } = answer else {
        // The answer the acquisition got, not the state a moment later (another call may
        // have taken the lock since).
        return Ok(lock_response(&lock, &lock.snapshot(), answer, None));
    };
    let mut about = serde_json::Map::new();
    about.insert("lock".into(), lock.name().into());
    Ok(hold_stream::respond(
        hold_stream::Bound::Lock {
            lock,
            permit,
            token,
        },
        about,
        turn.into_iter().collect(),
    ))
}

async fn release(
    State(state): State<AppState>,
    name: Option<Path<String>>,
    QueryOnce(query): QueryOnce,
) -> Result<Response, ApiError> {
    if let Some(family) = state.family_named(name.as_ref()) {
        return keys_release(family, query).await;
    }
    let lock = state.lock(name)?;
    let mut query = query;
    // `token=T[&permit=P]`: only while the lock is held as its answer said, so that a release
    // sent late (the lease lost and taken again since) gives nothing of a later holding up.
    let holding = match query.contains_key("token") {
        true => {
            let token = token_param(&mut query)?;
            let permit = permit_param(&mut query, lock.name(), lock.has_had_permits())?;
            Some((permit.unwrap_or(0), token))
        }
        false if query.contains_key("permit") => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "permit names a holding with its token: &token=T&permit=P",
            ));
        }
        false => None,
    };
    durations(&query, &[])?;
    let released = match holding {
        Some(holding) => lock.release_if(holding).await,
        None => lock.release().await,
    }
    .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    // 200 when something was released, 409 when this pod held nothing (or not that holding);
    // the body shows the state.
    let mut response = current(&lock, Some(released));
    *response.status_mut() = released_status(released);
    Ok(response)
}

/// 200 when a release or force-release ended a holding, 409 when there was none to end.
fn released_status(released: bool) -> StatusCode {
    if released {
        StatusCode::OK
    } else {
        StatusCode::CONFLICT
    }
}

/// `token=T` (a fencing token, required), taken out of `query`.
fn token_param(query: &mut HashMap<String, String>) -> Result<u64, ApiError> {
    let token = query.remove("token").ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "token is required: the fencing token of the holding to end (as /lock or the key's GET answers it)",
        )
    })?;
    token.parse().map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("token={token:?} is not a fencing token (a whole number)"),
        )
    })
}

/// The `permit` of a force-release on `name`: two permits may hold one token on some backends,
/// so a semaphore's holding is named with its permit (`has_permits`), and anything else has
/// none to name.
fn permit_param(
    query: &mut HashMap<String, String>,
    name: &str,
    has_permits: bool,
) -> Result<Option<u32>, ApiError> {
    let permit = match query.remove("permit") {
        None => None,
        Some(permit) => Some(
            permit
                .parse::<u32>()
                .ok()
                .filter(|p| *p < leasehold_lease::keyed::MAX_PERMITS)
                .ok_or_else(|| {
                    ApiError::new(
                        StatusCode::BAD_REQUEST,
                        format!(
                            "permit={permit:?} is not a permit a lock or a key can have (0 to {})",
                            leasehold_lease::keyed::MAX_PERMITS - 1
                        ),
                    )
                })?,
        ),
    };
    match (permit, has_permits) {
        (None, true) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "{name:?} has permits: name the holding's permit too, &permit=P (its answer says it)"
            ),
        )),
        (Some(_), false) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("{name:?} has no permits: leave permit out"),
        )),
        _ => Ok(permit),
    }
}

/// `/locks/{name}/force-release?token=T[&permit=P]`: a person ends this pod's holding of the
/// lock (on a lock of several permits, of permit `P`), if it is the one with that token, as the `leasehold.dev/force-release` annotation does for a
/// sidecar that follows its lock: the sidecar stops claiming at once (409 from then on), and
/// releases once the last answer it gave has run out, so that nobody else holds meanwhile. A
/// campaign-mode holder then sits out its cool-down. 200 when the holding ended, 409 when the
/// token is not this pod's current holding (nothing changes).
async fn force_release(
    State(state): State<AppState>,
    Path(name): Path<String>,
    QueryOnce(mut query): QueryOnce,
) -> Result<Response, ApiError> {
    if state.family_named(Some(&Path(name.clone()))).is_some() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "{name:?} is a family: a key's holding is force-released at /locks/{name}/keys/KEY/force-release?token=T"
            ),
        ));
    }
    let lock = state.lock(Some(Path(name)))?;
    let token = token_param(&mut query)?;
    let permit = permit_param(&mut query, lock.name(), lock.has_had_permits())?;
    durations(&query, &[])?;
    let released = lock
        .force_release(permit, token)
        .await
        .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
    if released {
        tracing::warn!(
            lock = lock.name(),
            token,
            "force-released through the lock API"
        );
    }
    let mut response = current(&lock, Some(released));
    *response.status_mut() = released_status(released);
    Ok(response)
}

/// `/locks/{family}/keys/{key}/force-release?token=T[&permit=P]`: a person ends the holding of
/// the key with that token in this pod, whoever its owner (on a semaphore, of permit `P`), as
/// [`force_release`] does for a lock: 200 when it ended, 409 when no holding of the key in
/// this pod has that token.
async fn key_force_release(
    State(state): State<AppState>,
    Path((family, key)): Path<(String, String)>,
    QueryOnce(mut query): QueryOnce,
) -> Result<Response, ApiError> {
    let family = &state.family(&family)?;
    let token = token_param(&mut query)?;
    let permit = permit_param(&mut query, family.name(), family.has_had_permits())?;
    durations(&query, &[])?;
    let released = family
        .force_release(&key, permit, token)
        .await
        .map_err(key_error)?;
    if released {
        tracing::warn!(
            family = family.name(),
            key,
            token,
            "force-released through the lock API"
        );
    }
    let answer = family.status(&key, None).map_err(key_error)?;
    let (_, mut body) = key_body(family, &key, None, &answer, StatusCode::OK, None);
    body.released = Some(released);
    if !released {
        body.reason = Some(format!(
            "no holding of {key:?} in this pod has token {token}; nothing was released"
        ));
    }
    Ok(json(released_status(released), &body))
}

/// The answer for one key, as the keyed routes send it.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct KeyStatus<'a> {
    family: &'a str,
    key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    owner: Option<&'a str>,
    holder: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    current_holder: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fencing_token: Option<u64>,
    valid_for_ms: u64,
    holds: u32,
    /// A semaphore's permits, the one this owner holds, and (on `GET`) how many are held now
    /// across every pod.
    #[serde(skip_serializing_if = "Option::is_none")]
    permits: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    permit: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    permits_held: Option<u32>,
    /// `write` for a writer's holding of a read-write lock.
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<&'static str>,
    backend: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    released: Option<bool>,
    /// Why a free key is not granted yet (a guard of the backend's).
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    /// When grants resume, from now, when the backend said.
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_ms: Option<u64>,
}

fn key_response(
    family: &KeyedFamily,
    key: &str,
    owner: Option<&str>,
    answer: &KeyAnswer,
    not_held: StatusCode,
) -> Response {
    key_response_with(family, key, owner, answer, not_held, None)
}

/// [`key_response`], with how many of a semaphore's permits are held now.
fn key_response_with(
    family: &KeyedFamily,
    key: &str,
    owner: Option<&str>,
    answer: &KeyAnswer,
    not_held: StatusCode,
    permits_held: Option<u32>,
) -> Response {
    let (status, body) = key_body(family, key, owner, answer, not_held, permits_held);
    json(status, &body)
}

/// One key's answer and the status it is sent with.
fn key_body<'a>(
    family: &'a KeyedFamily,
    key: &'a str,
    owner: Option<&'a str>,
    answer: &KeyAnswer,
    not_held: StatusCode,
    permits_held: Option<u32>,
) -> (StatusCode, KeyStatus<'a>) {
    let permits = family.permits();
    let semaphore = family.has_had_permits();
    let mut body = KeyStatus {
        family: family.name(),
        key,
        owner,
        holder: false,
        current_holder: None,
        fencing_token: None,
        valid_for_ms: 0,
        holds: 0,
        permits: semaphore.then_some(permits),
        permit: None,
        permits_held,
        mode: None,
        backend: family.backend(),
        released: None,
        reason: None,
        retry_after_ms: None,
    };
    let status = match answer {
        KeyAnswer::Held {
            token,
            valid_for,
            holds,
            permit,
            writer,
        } => {
            body.holder = true;
            body.mode = writer.then_some("write");
            body.fencing_token = Some(*token);
            body.valid_for_ms = valid_for.as_millis() as u64;
            body.holds = *holds;
            body.permit = semaphore.then_some(*permit);
            StatusCode::OK
        }
        KeyAnswer::HeldByAnother { holder } => {
            body.current_holder = holder.clone();
            StatusCode::CONFLICT
        }
        KeyAnswer::Withheld { reason, resume_in } => {
            body.reason = Some(reason.clone());
            body.retry_after_ms = resume_in.map(|left| left.as_millis() as u64);
            StatusCode::CONFLICT
        }
        KeyAnswer::NotHeld => not_held,
        KeyAnswer::Unknown => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, body)
}

/// The answer of a call on several keys: each key's, and for an acquisition refused, the key
/// that could not be taken.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct KeysStatus<'a> {
    family: &'a str,
    owner: &'a str,
    /// Whether the owner holds every key named.
    holder: bool,
    /// The least validity among the keys: how long the owner may act on all of them.
    valid_for_ms: u64,
    keys: Vec<KeyStatus<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    blocked_by: Option<KeyStatus<'a>>,
    backend: &'static str,
}

impl<'a> KeysStatus<'a> {
    fn new(family: &'a KeyedFamily, owner: &'a str) -> Self {
        Self {
            family: family.name(),
            owner,
            holder: false,
            valid_for_ms: 0,
            keys: Vec::new(),
            blocked_by: None,
            backend: family.backend(),
        }
    }

    /// Every key held: 200 with each key's token, else `refused`'s status.
    fn held(
        mut self,
        family: &'a KeyedFamily,
        answers: &'a [(String, KeyAnswer)],
        not_held: StatusCode,
    ) -> Response {
        let mut status = StatusCode::OK;
        for (key, answer) in answers {
            let (key_status, body) =
                key_body(family, key, Some(self.owner), answer, not_held, None);
            if key_status != StatusCode::OK && status == StatusCode::OK {
                status = key_status;
            }
            self.keys.push(body);
        }
        self.holder = status == StatusCode::OK;
        if self.holder {
            self.valid_for_ms = self.keys.iter().map(|k| k.valid_for_ms).min().unwrap_or(0);
        }
        json(status, &self)
    }
}

/// The query as a map, or a 400 for a parameter named twice (decoded names compared), which a
/// map would keep only the last of (`owner=a&owner=b` would act for `b` alone; `keys=a&keys=b`
/// would take `b` alone, and answer 200 to a client that believes it has both).
fn once_each(pairs: Vec<(String, String)>) -> Result<HashMap<String, String>, ApiError> {
    let mut query = HashMap::with_capacity(pairs.len());
    for (name, value) in pairs {
        if query.contains_key(&name) {
            let hint = if name == "keys" {
                "; name several keys in one: keys=a,b,c"
            } else {
                ""
            };
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("{name} is given twice{hint}"),
            ));
        }
        query.insert(name, value);
    }
    Ok(query)
}

/// The query string as a map, each parameter named at most once ([`once_each`]).
struct QueryOnce(HashMap<String, String>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for QueryOnce {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let Query(pairs) = Query::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        once_each(pairs)
            .map(Self)
            .map_err(IntoResponse::into_response)
    }
}

/// `keys=a,b,c`: the keys of a call on several keys of a family.
fn keys_param(query: &mut HashMap<String, String>) -> Result<Vec<String>, ApiError> {
    let keys = query.remove("keys").ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "keys is required on a family's route: the keys to take together, comma-separated \
             (e.g. ?keys=order-1,order-2), or use /locks/FAMILY/keys/KEY/... for one key",
        )
    })?;
    Ok(keys.split(',').map(str::to_owned).collect())
}

/// `/locks/{family}/acquire?keys=...[&mode=read|write]`: every key or none.
async fn keys_acquire(
    family: KeyedFamily,
    mut query: HashMap<String, String>,
) -> Result<Response, ApiError> {
    let keys = keys_param(&mut query)?;
    let mode = mode_param(&mut query)?;
    let (owner, params) = key_query(query, &[("wait", MAX_WAIT), ("hold", MAX_HOLD)], false)?;
    let owner = owner.unwrap_or_default();
    let wait = params.get("wait").copied().unwrap_or(Duration::ZERO);
    let hold = hold_param(&params)?;
    let answer = match mode {
        None => family.acquire_all(&keys, &owner, wait, hold).await,
        Some(Access::Read) => family.acquire_all_read(&keys, &owner, wait, hold).await,
        Some(Access::Write) => family.acquire_all_write(&keys, &owner, wait, hold).await,
    }
    .map_err(key_error)?;
    Ok(match answer {
        KeysAnswer::Held(answers) => {
            KeysStatus::new(&family, &owner).held(&family, &answers, StatusCode::CONFLICT)
        }
        KeysAnswer::NotTaken { key, answer } => keys_not_taken(&family, &owner, &key, &answer),
    })
}

/// Several keys not taken: the key that blocked them, and why.
fn keys_not_taken(family: &KeyedFamily, owner: &str, key: &str, answer: &KeyAnswer) -> Response {
    let (status, blocked) = key_body(family, key, Some(owner), answer, StatusCode::CONFLICT, None);
    let body = KeysStatus {
        blocked_by: Some(blocked),
        ..KeysStatus::new(family, owner)
    };
    json(status, &body)
}

/// `/locks/{family}/hold?keys=...[&mode=read|write]`: every key or none, held for as long as
/// the connection stays open (an event stream, [`crate::hold_stream`]); keys not taken are
/// answered as `acquire` answers them. With `exclusive=true` the hold first waits (within `wait`) for the
/// owner's other exclusive holds of each key to end, taking each key's turn in the keys' byte
/// order, as the keys themselves are taken, so that two such holds never wait on each other
/// (`leasehold exec --via` with several `--keyed`).
async fn keys_hold(
    state: &AppState,
    family: KeyedFamily,
    mut query: HashMap<String, String>,
) -> Result<Response, ApiError> {
    let exclusive = exclusive_param(&mut query)?;
    let keys = keys_param(&mut query)?;
    let mode = mode_param(&mut query)?;
    let (owner, params) = key_query(query, &[("wait", MAX_WAIT)], false)?;
    let owner = owner.unwrap_or_default();
    let wait = params.get("wait").copied().unwrap_or(Duration::ZERO);
    let hold = hold_stream::bound_hold(family.config().lease_duration);
    let deadline = tokio::time::Instant::now() + wait;
    let mut turns = Vec::new();
    if exclusive {
        // Checked before waiting for a turn, so that a bad request is a 400 at once.
        family
            .check_acquisition(&keys, &owner, mode.is_some())
            .map_err(key_error)?;
        match state.key_turns(&family, &keys, &owner, deadline).await {
            Ok(taken) => turns = taken,
            Err((key, answer)) => return Ok(keys_not_taken(&family, &owner, &key, &answer)),
        }
    }
    let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
    let (answer, holdings) = match mode {
        Some(Access::Write) => family
            .acquire_all_write_holdings(&keys, &owner, wait, hold)
            .await
            .map(|(answer, holdings)| (answer, Some(holdings))),
        Some(Access::Read) => family
            .acquire_all_read(&keys, &owner, wait, hold)
            .await
            .map(|answer| (answer, None)),
        None => family
            .acquire_all(&keys, &owner, wait, hold)
            .await
            .map(|answer| (answer, None)),
    }
    .map_err(key_error)?;
    let answers = match answer {
        KeysAnswer::Held(answers) => answers,
        KeysAnswer::NotTaken { key, answer } => {
            return Ok(keys_not_taken(&family, &owner, &key, &answer));
        }
    };
    // A key the owner writes (it became the key's writer meanwhile, and acquired its write
    // lock again): a stream of reads cannot follow it, and every key is given back.
    if holdings.is_none()
        && answers
            .iter()
            .any(|(_, answer)| matches!(answer, KeyAnswer::Held { writer: true, .. }))
    {
        // Each acquisition just made, exactly, on a task of its own that a hang-up cannot
        // cut short: the write lock's count and the other keys' go back to what they were.
        let (family, owner) = (family.clone(), owner.clone());
        let _ = tokio::spawn(async move {
            for (key, answer) in answers {
                if let KeyAnswer::Held { writer: true, .. } = answer {
                    let _ = family.release(&key, &owner).await;
                } else if let KeyAnswer::Held { permit, token, .. } = answer
                    && let Some(lock) = family.holding_on_permit(&key, permit, &owner)
                {
                    let _ = lock
                        .release_if(leasehold_lease::keyed::own_permit(token))
                        .await;
                }
            }
        })
        .await;
        return Err(owner_writes());
    }
    let mut held = Vec::with_capacity(answers.len());
    let mut named = Vec::with_capacity(answers.len());
    for (key, answer) in answers {
        let KeyAnswer::Held { token, permit, .. } = answer else {
            continue;
        };
        let mut entry = serde_json::Map::new();
        entry.insert("key".into(), key.as_str().into());
        entry.insert("fencingToken".into(), token.into());
        if family.has_had_permits() {
            entry.insert("permit".into(), permit.into());
        }
        named.push(serde_json::Value::Object(entry));
        held.push((key, permit, token));
    }
    let mut about = serde_json::Map::new();
    about.insert("family".into(), family.name().into());
    about.insert("owner".into(), owner.as_str().into());
    about.insert("keys".into(), named.into());
    let bound = match holdings {
        Some(holdings) => {
            about.insert("mode".into(), "write".into());
            hold_stream::Bound::Writes { family, holdings }
        }
        None => hold_stream::Bound::Keys {
            family,
            owner,
            keys: held,
        },
    };
    Ok(hold_stream::respond(bound, about, turns))
}

/// `/locks/{family}/release?keys=...`: one release of each key; 200 when each was released.
async fn keys_release(
    family: KeyedFamily,
    mut query: HashMap<String, String>,
) -> Result<Response, ApiError> {
    let keys = keys_param(&mut query)?;
    let (owner, _) = key_query(query, &[], false)?;
    let owner = owner.unwrap_or_default();
    let released = family.release_all(&keys, &owner).await.map_err(key_error)?;
    let mut body = KeysStatus::new(&family, &owner);
    let mut status = StatusCode::OK;
    for (key, release) in &released {
        let answer = match release {
            KeyRelease::Released { .. } => family.status(key, Some(&owner)).map_err(key_error)?,
            KeyRelease::HeldByAnother { holder } => {
                status = StatusCode::CONFLICT;
                KeyAnswer::HeldByAnother {
                    holder: Some(holder.clone()),
                }
            }
            KeyRelease::NotHeld => {
                status = StatusCode::CONFLICT;
                KeyAnswer::NotHeld
            }
        };
        let (_, mut key_status) = key_body(
            &family,
            key,
            Some(&owner),
            &answer,
            StatusCode::NOT_FOUND,
            None,
        );
        key_status.released = Some(matches!(release, KeyRelease::Released { .. }));
        if let KeyRelease::Released { holds } = release
            && !key_status.holder
        {
            key_status.holds = *holds;
        }
        body.keys.push(key_status);
    }
    body.holder = body.keys.iter().all(|k| k.holder);
    Ok(json(status, &body))
}

/// `/locks/{family}/extend?keys=...`: each key's hold at least `hold` from now; 200 when the
/// owner holds every one.
async fn keys_extend(
    State(state): State<AppState>,
    Path(family): Path<String>,
    QueryOnce(mut query): QueryOnce,
) -> Result<Response, ApiError> {
    let family = state.family(&family)?;
    let keys = keys_param(&mut query)?;
    let (owner, params) = key_query(query, &[("hold", MAX_HOLD)], false)?;
    let owner = owner.unwrap_or_default();
    let hold = hold_param(&params)?;
    let answers = family
        .extend_all(&keys, &owner, hold)
        .await
        .map_err(key_error)?;
    Ok(KeysStatus::new(&family, &owner).held(&family, &answers, StatusCode::NOT_FOUND))
}

fn key_error(error: KeyError) -> ApiError {
    let status = match error {
        KeyError::BadKey { .. }
        | KeyError::BadOwner(_)
        | KeyError::BadKeys(_)
        | KeyError::BadMode(_) => StatusCode::BAD_REQUEST,
        KeyError::TooManyKeys(_) => StatusCode::TOO_MANY_REQUESTS,
        KeyError::Lock(_) | KeyError::Stopped(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    ApiError::new(status, error.to_string())
}

/// A keyed route's query: `owner` (required unless `optional_owner`) and the named durations.
fn key_query(
    mut query: HashMap<String, String>,
    allowed: &[(&str, Duration)],
    optional_owner: bool,
) -> Result<(Option<String>, HashMap<String, Duration>), ApiError> {
    let owner = query.remove("owner");
    if owner.is_none() && !optional_owner {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "owner is required: the worker's own id for this request (e.g. ?owner=req-42)",
        ));
    }
    Ok((owner, durations(&query, allowed)?))
}

async fn key_status(
    State(state): State<AppState>,
    Path((family, key)): Path<(String, String)>,
    QueryOnce(query): QueryOnce,
) -> Result<Response, ApiError> {
    let family = &state.family(&family)?;
    let (owner, _) = key_query(query, &[], true)?;
    // Bad input is refused before the backend is asked anything.
    family.status(&key, owner.as_deref()).map_err(key_error)?;
    // A semaphore's holders in every pod: one backend read per permit, left out when the
    // backend cannot answer in time (the owner's own answer needs no read).
    let permits_held = if family.has_had_permits() {
        match tokio::time::timeout(PERMITS_READ_BOUND, family.observe_permits(&key)).await {
            Ok(Ok(holders)) => Some(holders.len() as u32),
            Ok(Err(e)) => {
                tracing::debug!(family = family.name(), error = %e, "could not count the permits held");
                None
            }
            Err(_) => {
                tracing::debug!(
                    family = family.name(),
                    "the permits held were not read within {PERMITS_READ_BOUND:?}"
                );
                None
            }
        }
    } else {
        None
    };
    // The owner's answer as it stands once the count is read: a hold may have ended meanwhile.
    let answer = family.status(&key, owner.as_deref()).map_err(key_error)?;
    Ok(key_response_with(
        family,
        &key,
        owner.as_deref(),
        &answer,
        StatusCode::CONFLICT,
        permits_held,
    ))
}

/// How a read-write lock's key is taken (`mode=`).
enum Access {
    Read,
    Write,
}

/// `exclusive=true|false`, taken out of `query`.
fn exclusive_param(query: &mut HashMap<String, String>) -> Result<bool, ApiError> {
    match query.remove("exclusive").as_deref() {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "exclusive={:?}: use true or false",
                other.chars().take(64).collect::<String>()
            ),
        )),
    }
}

/// `mode=read|write`, taken out of `query`; `None` without one.
fn mode_param(query: &mut HashMap<String, String>) -> Result<Option<Access>, ApiError> {
    match query.remove("mode").as_deref() {
        None => Ok(None),
        Some("read") => Ok(Some(Access::Read)),
        Some("write") => Ok(Some(Access::Write)),
        Some(other) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "mode={:?} is not a mode: read (share the key with other readers) or write (hold it alone); there is no upgrade",
                other.chars().take(64).collect::<String>()
            ),
        )),
    }
}

async fn key_acquire(
    State(state): State<AppState>,
    Path((family, key)): Path<(String, String)>,
    QueryOnce(mut query): QueryOnce,
) -> Result<Response, ApiError> {
    let family = &state.family(&family)?;
    let mode = mode_param(&mut query)?;
    let (owner, params) = key_query(query, &[("wait", MAX_WAIT), ("hold", MAX_HOLD)], false)?;
    let owner = owner.unwrap_or_default();
    let wait = params.get("wait").copied().unwrap_or(Duration::ZERO);
    let hold = hold_param(&params)?;
    let answer = match mode {
        None => family.acquire(&key, &owner, wait, hold).await,
        Some(Access::Read) => family.acquire_read(&key, &owner, wait, hold).await,
        Some(Access::Write) => family.acquire_write(&key, &owner, wait, hold).await,
    }
    .map_err(key_error)?;
    Ok(key_response(
        family,
        &key,
        Some(&owner),
        &answer,
        StatusCode::CONFLICT,
    ))
}

async fn key_release(
    State(state): State<AppState>,
    Path((family, key)): Path<(String, String)>,
    QueryOnce(query): QueryOnce,
) -> Result<Response, ApiError> {
    let family = &state.family(&family)?;
    let (owner, _) = key_query(query, &[], false)?;
    let owner = owner.unwrap_or_default();
    let released = family.release(&key, &owner).await.map_err(key_error)?;
    let answer = match &released {
        // 200 whatever the backend can tell of the acquisitions left: this one is given up, and
        // a release sent again on a 503 would give up the next one too.
        KeyRelease::Released { holds } => {
            let answer = family.status(&key, Some(&owner)).map_err(key_error)?;
            let (_, mut body) = key_body(
                family,
                &key,
                Some(&owner),
                &answer,
                StatusCode::NOT_FOUND,
                None,
            );
            if !body.holder {
                body.holds = *holds;
            }
            return Ok(json(StatusCode::OK, &body));
        }
        KeyRelease::HeldByAnother { holder } => KeyAnswer::HeldByAnother {
            holder: Some(holder.clone()),
        },
        KeyRelease::NotHeld => KeyAnswer::NotHeld,
    };
    Ok(key_response(
        family,
        &key,
        Some(&owner),
        &answer,
        StatusCode::NOT_FOUND,
    ))
}

async fn key_extend(
    State(state): State<AppState>,
    Path((family, key)): Path<(String, String)>,
    QueryOnce(query): QueryOnce,
) -> Result<Response, ApiError> {
    let family = &state.family(&family)?;
    let (owner, params) = key_query(query, &[("hold", MAX_HOLD)], false)?;
    let owner = owner.unwrap_or_default();
    let hold = hold_param(&params)?;
    let answer = family.extend(&key, &owner, hold).await.map_err(key_error)?;
    Ok(key_response(
        family,
        &key,
        Some(&owner),
        &answer,
        StatusCode::NOT_FOUND,
    ))
}

/// Take `key` for `owner`, waiting up to `wait`, and hold it for as long as the connection
/// stays open (an event stream, [`crate::hold_stream`]); a key not taken is answered as
/// `acquire` answers it. With `exclusive=true` the hold first waits (within `wait`) for the
/// owner's other exclusive holds of the key to end, rather than re-enter its holding
/// (`leasehold exec --via --keyed`).
async fn key_hold(
    State(state): State<AppState>,
    Path((family, key)): Path<(String, String)>,
    QueryOnce(mut query): QueryOnce,
) -> Result<Response, ApiError> {
    let family = state.family(&family)?;
    let mode = mode_param(&mut query)?;
    let exclusive = exclusive_param(&mut query)?;
    let (owner, params) = key_query(query, &[("wait", MAX_WAIT)], false)?;
    let owner = owner.unwrap_or_default();
    let wait = params.get("wait").copied().unwrap_or(Duration::ZERO);
    // Checked before waiting for a turn, so that a bad request is a 400 at once.
    family
        .check_acquisition(std::slice::from_ref(&key), &owner, mode.is_some())
        .map_err(key_error)?;
    if !matches!(mode, Some(Access::Write)) && family.writes(&key, &owner) {
        return Err(owner_writes());
    }
    let not_taken = |answer: &KeyAnswer| {
        key_response(&family, &key, Some(&owner), answer, StatusCode::CONFLICT)
    };
    let deadline = tokio::time::Instant::now() + wait;
    let turns = if exclusive {
        match state
            .key_turns(&family, std::slice::from_ref(&key), &owner, deadline)
            .await
        {
            Ok(turns) => turns,
            Err((_, answer)) => return Ok(not_taken(&answer)),
        }
    } else {
        Vec::new()
    };
    let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
    let hold = hold_stream::bound_hold(family.config().lease_duration);
    let (answer, write_holding) = match mode {
        Some(Access::Write) => family.acquire_write_holding(&key, &owner, wait, hold).await,
        Some(Access::Read) => family
            .acquire_read(&key, &owner, wait, hold)
            .await
            .map(|answer| (answer, None)),
        None => family
            .acquire(&key, &owner, wait, hold)
            .await
            .map(|answer| (answer, None)),
    }
    .map_err(key_error)?;
    let KeyAnswer::Held {
        token,
        permit,
        writer,
        ..
    } = answer
    else {
        return Ok(not_taken(&answer));
    };
    let bound = match write_holding {
        // The write lock this acquisition is of, followed part by part.
        Some(holding) => hold_stream::Bound::Write {
            family: family.clone(),
            holding,
            token,
        },
        // The owner writes the key (it became the writer meanwhile): a read's stream cannot
        // follow a write lock, and the acquisition is given back.
        None if writer => {
            family.release(&key, &owner).await.map_err(key_error)?;
            return Err(owner_writes());
        }
        None => hold_stream::Bound::Key {
            family: family.clone(),
            key: key.clone(),
            owner: owner.clone(),
            permit,
            token,
        },
    };
    let mut about = serde_json::Map::new();
    about.insert("family".into(), family.name().into());
    about.insert("key".into(), key.as_str().into());
    about.insert("owner".into(), owner.as_str().into());
    if family.has_had_permits() {
        about.insert("permit".into(), permit.into());
    }
    if writer {
        about.insert("mode".into(), "write".into());
    }
    Ok(hold_stream::respond(bound, about, turns))
}

/// A hold, not to write, by an owner that writes the key: its stream would follow a read.
fn owner_writes() -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "the owner writes this key: hold it with mode=write",
    )
}

/// Follow `key`'s holders, in any pod ([`crate::key_events`]).
async fn key_events(
    State(state): State<AppState>,
    Path((family, key)): Path<(String, String)>,
    QueryOnce(query): QueryOnce,
) -> Result<Response, ApiError> {
    let family = state.family(&family)?;
    durations(&query, &[])?;
    crate::key_events::respond(family, key).map_err(key_error)
}

/// Step down from every lock for good: release each and stop campaigning, while the process
/// keeps answering (409) until it is stopped. The pod's preStop hook (`--resign`).
async fn resign(
    State(state): State<AppState>,
    QueryOnce(query): QueryOnce,
) -> Result<Response, ApiError> {
    durations(&query, &[])?;
    // First, so that no lock still starting (or restarting with a changed spec) begins to
    // campaign after the locks below have stepped down.
    state
        .inner
        .resigned
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let locks = state.locks();
    state.let_go(&locks, &[], LetGo::Resigned).await;
    let names: Vec<&str> = locks.iter().map(Lock::name).collect();
    Ok(json(
        StatusCode::OK,
        &serde_json::json!({ "resigned": names }),
    ))
}

async fn events(
    State(state): State<AppState>,
    name: Option<Path<String>>,
    QueryOnce(query): QueryOnce,
) -> Result<Response, ApiError> {
    let lock = state.lock(name)?;
    durations(&query, &[])?;
    Ok(crate::lock_events::respond(lock))
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state
            .inner
            .metrics
            .render(&state.locks(), &state.families()),
    )
        .into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready once the lock API serves. A backend outage fails readiness only when asked for
/// (`--readiness-requires-backend`; a family's backend is then pinged every few seconds,
/// [`AppState::check_families`]): a native sidecar's readiness is the pod's, and a Redis blip
/// must not empty the app's Services; `/lock` already answers 503 while it lasts. Either way the
/// body names the locks whose backend is unreachable, and the lease warnings.
async fn readyz(State(state): State<AppState>) -> Response {
    let mut unreachable = Vec::new();
    let mut warnings = Vec::new();
    for lock in state.locks() {
        let s = lock.snapshot();
        if !s.ready() {
            let error = s
                .backend_error
                .as_deref()
                .unwrap_or("backend not reached yet");
            unreachable.push((lock.name().to_owned(), error.to_owned()));
        }
        if let Some(warning) = s.warning {
            warnings.push((lock.name().to_owned(), warning));
        }
        if let Some(withheld) = s.withheld {
            warnings.push((
                lock.name().to_owned(),
                format!("not granted yet: {}", withheld.reason),
            ));
        }
    }
    // A lock or family not started (its resource missing or unreadable, its backend not
    // opened) is a backend not reached, for readiness.
    for (name, reason) in state.pending() {
        unreachable.push((name, format!("not started: {reason}")));
    }
    let gated = state
        .inner
        .readiness_requires_backend
        .load(std::sync::atomic::Ordering::Relaxed);
    if gated {
        unreachable.extend(state.unreachable_families());
    }
    if gated && !unreachable.is_empty() {
        let locks: Vec<serde_json::Value> = unreachable
            .iter()
            .map(|(lock, error)| serde_json::json!({ "lock": lock, "error": error }))
            .collect();
        return json(
            StatusCode::SERVICE_UNAVAILABLE,
            &serde_json::json!({ "ready": false, "locks": locks }),
        );
    }
    // Ready, with what the operator of the cluster should know.
    let mut body = String::from("ready\n");
    for (lock, error) in &unreachable {
        body.push_str(&format!("backend unreachable: lock {lock}: {error}\n"));
    }
    for (lock, warning) in &warnings {
        body.push_str(&format!("warning: lock {lock}: {warning}\n"));
    }
    (StatusCode::OK, body).into_response()
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "no such route; try GET /lock, GET /locks/{name}, GET /healthz, GET /readyz, GET /metrics",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::sqlite_backend;
    use leasehold_lease::LockConfig;
    use leasehold_testkit::faulty::FaultyDriver;
    use tower::ServiceExt;

    async fn post(router: &Router, uri: &str) -> (StatusCode, serde_json::Value) {
        answer_of(router.clone().oneshot(request(uri)).await.unwrap()).await
    }

    fn request(uri: &str) -> axum::http::Request<axum::body::Body> {
        axum::http::Request::post(uri)
            .body(axum::body::Body::empty())
            .unwrap()
    }

    /// The lock API of one family on `driver`.
    fn family_api(
        driver: Arc<dyn leasehold_lease::Backend>,
        config: leasehold_lease::keyed::FamilyConfig,
    ) -> (KeyedFamily, Router) {
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let family = KeyedFamily::new(driver, config, metrics.clone()).unwrap();
        let router =
            lock_api(AppState::new(Vec::new(), metrics).with_families(vec![family.clone()]));
        (family, router)
    }

    async fn answer_of(response: Response) -> (StatusCode, serde_json::Value) {
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, serde_json::from_slice(&body).unwrap())
    }

    /// An acquisition's answer as its handler sends it: counted down to then, never lengthened
    /// by a later, longer hold, and not held once the lock holds another token.
    #[test]
    fn an_answer_sent_a_moment_later_is_counted_down_to_then() {
        use leasehold_lease::{BootInstant, Held};
        let now = BootInstant::now();
        let snapshot = |token, left: Duration| Snapshot {
            held: Some(Held {
                token,
                permit: 0,
                valid_until: now + left,
                acquired_at: std::time::SystemTime::now(),
                hold_until: None,
            }),
            current_holder: None,
            backend_error: None,
            contacted: true,
            since: std::time::SystemTime::now(),
            holds: 1,
            warning: None,
            withheld: None,
            sitting_out: None,
        };
        let answered = |valid_for| Answer::Holder {
            token: 7,
            permit: 0,
            valid_for,
        };
        let valid_for = |answer: Answer| match answer {
            Answer::Holder { valid_for, .. } => valid_for,
            other => panic!("not held: {other:?}"),
        };
        let secs = Duration::from_secs;
        assert!(valid_for(answered_now(&snapshot(7, secs(4)), answered(secs(10)))) <= secs(4));
        assert!(valid_for(answered_now(&snapshot(7, secs(20)), answered(secs(3)))) <= secs(3));
        assert!(matches!(
            answered_now(&snapshot(8, secs(10)), answered(secs(10))),
            Answer::NotHolder
        ));
        assert!(matches!(
            answered_now(
                &Snapshot {
                    held: None,
                    ..snapshot(7, secs(1))
                },
                answered(secs(1))
            ),
            Answer::NotHolder
        ));
        // A backend error since: still the holding it was counted for.
        let failing = Snapshot {
            backend_error: Some("timed out".into()),
            ..snapshot(7, secs(4))
        };
        assert!(valid_for(answered_now(&failing, answered(secs(10)))) <= secs(4));
    }

    /// An acquisition refused while the lock was busy is answered as refused, even when another
    /// call of the same pod takes the lock before the refused call's handler reads the lock.
    #[tokio::test]
    async fn an_acquisition_is_answered_with_its_own_outcome_not_the_state_a_moment_later() {
        let dir = tempfile::tempdir().unwrap();
        let backend = sqlite_backend(&dir).await;
        let faulty = FaultyDriver::wrap(backend.clone());
        let lease = Duration::from_secs(10);
        let mut config = LockConfig::new("jobs", "pod-a", lease);
        config.mode = Mode::OnDemand;
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let lock = Lock::start(faulty.clone(), config, metrics.clone()).unwrap();
        let router = lock_api(AppState::new(vec![lock], metrics));

        // Another process holds the lock when the first call asks without waiting.
        let Ok(leasehold_lease::Acquire::Acquired(other)) =
            backend.try_acquire("jobs", "pod-b", lease).await
        else {
            panic!("pod-b did not take the free lock");
        };
        let mut refused = Box::pin(router.clone().oneshot(request("/lock/acquire?wait=0")));
        // Polled once (exactly: a zero timeout may poll it again once other tasks ran): the
        // call is with the engine, whose answer its handler reads only later.
        let first = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(refused.as_mut().poll(cx).is_pending())
        })
        .await;
        assert!(first, "answered before the engine had the call");
        while faulty.answered("jobs", "pod-a") == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The backend refused it; pod-b lets go, and a second call of this pod takes the lock.
        assert!(backend.release(&other).await.unwrap());
        let (status, taken) = post(&router, "/lock/acquire?wait=10s&hold=10s").await;
        assert_eq!(status, StatusCode::OK, "{taken}");
        assert_eq!(taken["holder"], true, "{taken}");

        let (status, answer) = answer_of(refused.await.unwrap()).await;
        assert_eq!(
            (status, &answer["holder"]),
            (StatusCode::CONFLICT, &serde_json::json!(false)),
            "a call the backend refused was answered {status} {answer}: its app would act as \
             the holder while it holds no acquisition (the other call's release frees the lock)"
        );
        // The lock is this pod's for the call that took it, once.
        let (status, released) = post(&router, "/lock/release").await;
        assert_eq!(status, StatusCode::OK, "{released}");
        assert_eq!(released["holder"], false, "{released}");
    }

    /// A hold that runs out while a renewal's answer is late is over for `GET /lock` too: not a
    /// 200 saying "holder" with no time left, which an app that goes by the status would take
    /// for a holding while the lease is released behind it.
    #[tokio::test]
    async fn a_hold_that_ran_out_during_a_late_renewal_is_not_answered_as_held() {
        let dir = tempfile::tempdir().unwrap();
        let backend = sqlite_backend(&dir).await;
        let faulty = FaultyDriver::wrap(backend);
        let mut config = LockConfig::new("jobs", "pod-a", Duration::from_secs(3));
        config.mode = Mode::OnDemand;
        config.renew_interval = Duration::from_secs(1);
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let lock = Lock::start(faulty.clone(), config, metrics.clone()).unwrap();
        let router = lock_api(AppState::new(vec![lock], metrics));
        faulty.stall_next_renewal_answer(Duration::from_millis(700));
        let (status, taken) = post(&router, "/lock/acquire?wait=0&hold=1100ms").await;
        assert_eq!(status, StatusCode::OK, "{taken}");
        tokio::time::sleep(Duration::from_millis(1300)).await;
        let get = axum::http::Request::get("/lock")
            .body(axum::body::Body::empty())
            .unwrap();
        let (status, answer) = answer_of(router.clone().oneshot(get).await.unwrap()).await;
        assert_eq!(
            (status, &answer["holder"]),
            (StatusCode::CONFLICT, &serde_json::json!(false)),
            "the hold ran out, yet GET /lock answered {status} {answer}"
        );
    }

    /// A release that names its holding's token gives nothing of a later holding up: sent late,
    /// once the lease was lost and taken again, it is a 409 and the later holding stays.
    #[tokio::test]
    async fn a_release_naming_an_earlier_token_leaves_a_later_holding() {
        let dir = tempfile::tempdir().unwrap();
        let backend = sqlite_backend(&dir).await;
        let mut config = LockConfig::new("jobs", "pod-a", Duration::from_secs(10));
        config.mode = Mode::OnDemand;
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let lock = Lock::start(backend, config, metrics.clone()).unwrap();
        let router = lock_api(AppState::new(vec![lock.clone()], metrics));
        let token = |answer: &serde_json::Value| answer["fencingToken"].as_u64().unwrap();

        let (status, first) = post(&router, "/lock/acquire?wait=0&hold=1s").await;
        assert_eq!(status, StatusCode::OK, "{first}");
        // The holding ends (as a lost lease does: released once its answer has run out) and
        // the pod takes the lock again.
        assert!(lock.force_release(None, token(&first)).await.unwrap());
        let (status, second) = post(&router, "/lock/acquire?wait=5s&hold=10s").await;
        assert_eq!(status, StatusCode::OK, "{second}");
        assert!(token(&second) > token(&first));

        let late = format!("/lock/release?token={}", token(&first));
        let (status, kept) = post(&router, &late).await;
        assert_eq!(status, StatusCode::CONFLICT, "{kept}");
        assert_eq!(
            kept["holder"], true,
            "the later holding was given up: {kept}"
        );
        for bad in ["/lock/release?permit=0", "/lock/release?token=x"] {
            let (status, refused) = post(&router, bad).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {refused}");
        }
        let own = format!("/lock/release?token={}", token(&second));
        let (status, released) = post(&router, &own).await;
        assert_eq!(status, StatusCode::OK, "{released}");
        assert_eq!(released["holder"], false, "{released}");
    }

    /// A key acquired twice, released once while the backend cannot be reached: the release
    /// took effect (one acquisition less), so it is a 200 with the acquisitions left, not a
    /// 503 that tells the app to send it again (which would give up the last acquisition).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_release_of_one_acquisition_is_told_while_the_backend_cannot_be_reached() {
        let dir = tempfile::tempdir().unwrap();
        let faulty = FaultyDriver::wrap(sqlite_backend(&dir).await);
        let mut config =
            leasehold_lease::keyed::FamilyConfig::new("orders", "pod-a", Duration::from_secs(3));
        config.renew_interval = Duration::from_millis(500);
        let (family, router) = family_api(faulty.clone(), config);
        for _ in 0..2 {
            let (status, taken) = post(&router, "/locks/orders/keys/k/acquire?owner=o").await;
            assert_eq!(status, StatusCode::OK, "{taken}");
        }
        faulty.cut_off(true);
        let started = tokio::time::Instant::now();
        while !matches!(
            family.status("k", Some("o")),
            Ok(leasehold_lease::keyed::KeyAnswer::Unknown)
        ) {
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "a renewal never failed"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (status, released) = post(&router, "/locks/orders/keys/k/release?owner=o").await;
        assert_eq!(
            (status, &released["holds"]),
            (StatusCode::OK, &serde_json::json!(1)),
            "{released}"
        );
        faulty.cut_off(false);
    }

    /// A semaphore key's status waits a bounded time for the backend's count of permits held,
    /// and answers as the owner's hold stands then: a hold that ended while the count was read
    /// is not answered as held.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_status_is_not_held_up_by_the_count_of_permits_held() {
        let dir = tempfile::tempdir().unwrap();
        let faulty = FaultyDriver::wrap(sqlite_backend(&dir).await);
        let mut config =
            leasehold_lease::keyed::FamilyConfig::new("orders", "pod-a", Duration::from_secs(30));
        config.permits = 2;
        let (_family, router) = family_api(faulty.clone(), config);
        let hold = Duration::from_millis(300);
        let (status, taken) =
            post(&router, "/locks/orders/keys/k/acquire?owner=o&hold=300ms").await;
        assert_eq!(status, StatusCode::OK, "{taken}");
        let taken_at = tokio::time::Instant::now();
        faulty.delay_requests(Duration::from_secs(3));
        let asked = axum::http::Request::get("/locks/orders/keys/k?owner=o")
            .body(axum::body::Body::empty())
            .unwrap();
        let (_, answer) = answer_of(router.clone().oneshot(asked).await.unwrap()).await;
        let answered = taken_at.elapsed();
        faulty.delay_requests(Duration::ZERO);
        assert!(
            answered < Duration::from_secs(2),
            "the status waited {answered:?} for the backend"
        );
        assert!(
            answer["holder"] != true || answered < hold,
            "answered held {answered:?} after a hold of {hold:?} was taken: {answer}"
        );
    }

    /// A hold shorter than a millisecond is refused before anything is taken: granted, it would
    /// have run out by the answer, which would say "held by another" of a lock taken and given
    /// back.
    #[tokio::test]
    async fn a_hold_below_a_millisecond_is_refused_and_takes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let faulty = FaultyDriver::wrap(sqlite_backend(&dir).await);
        let mut config = LockConfig::new("jobs", "pod-a", Duration::from_secs(10));
        config.mode = Mode::OnDemand;
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let lock = Lock::start(faulty.clone(), config, metrics.clone()).unwrap();
        let router = lock_api(AppState::new(vec![lock], metrics));
        for hold in ["1ns", "999us", "0s"] {
            let (status, refused) = post(&router, &format!("/lock/acquire?hold={hold}")).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "hold={hold}: {refused}");
        }
        assert_eq!(faulty.answered("jobs", "pod-a"), 0, "the backend was asked");
        let (status, taken) = post(&router, "/lock/acquire?hold=1ms").await;
        assert_eq!(status, StatusCode::OK, "{taken}");
    }

    /// An exclusive hold waits for the owner's earlier exclusive hold of the key to end; a
    /// request it would refuse anyway (a key named twice, a mode on a family that has none) is
    /// a 400 at once, not a 409 after the wait.
    #[tokio::test]
    async fn a_bad_exclusive_hold_is_refused_before_its_turn() {
        let dir = tempfile::tempdir().unwrap();
        let config =
            leasehold_lease::keyed::FamilyConfig::new("orders", "pod-a", Duration::from_secs(10));
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let family = KeyedFamily::new(sqlite_backend(&dir).await, config, metrics.clone()).unwrap();
        let router = lock_api(AppState::new(Vec::new(), metrics).with_families(vec![family]));
        let open = router
            .clone()
            .oneshot(request("/locks/orders/hold?keys=a&owner=o&exclusive=true"))
            .await
            .unwrap();
        assert_eq!(open.status(), StatusCode::OK);
        for bad in [
            "/locks/orders/hold?keys=a,a&owner=o&exclusive=true&wait=3s",
            "/locks/orders/keys/a/hold?owner=o&exclusive=true&mode=write&wait=3s",
            "/locks/orders/hold?keys=a&owner=o&exclusive=true&mode=read&wait=3s",
        ] {
            let asked = tokio::time::Instant::now();
            let (status, refused) = post(&router, bad).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {refused}");
            assert!(
                asked.elapsed() < Duration::from_secs(2),
                "{bad} was refused only after its wait"
            );
        }
        drop(open);
    }

    #[test]
    fn durations_are_taken_in_the_documented_form_only() {
        for (value, expected) in [
            ("0", Duration::ZERO),
            ("500ms", Duration::from_millis(500)),
            ("1m30s", Duration::from_secs(90)),
            ("1.5s", Duration::from_millis(1500)),
            ("2min", Duration::from_secs(120)),
            ("3µs", Duration::from_micros(3)),
        ] {
            assert_eq!(parse_duration(value), Ok(expected), "{value}");
        }
        for value in [
            "",
            " ",
            "1 s",
            " 1s",
            "1s ",
            "1 0s",
            "1.s",
            ".5s",
            "1",
            "s",
            "1s-",
            "1s 2m",
            "+1s",
            "1sx",
            "10parsecs",
        ] {
            assert!(parse_duration(value).is_err(), "{value:?} was taken");
        }
    }
}
