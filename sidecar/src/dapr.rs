//! Dapr's distributed-lock API (alpha), so that clients written against Dapr work unchanged
//! (docs/design.md, "Keyed locks"): `store` is a keyed family, `resourceId` the key, `lockOwner`
//! the owner, `expiryInSeconds` the hold.
//!
//! - HTTP (`--dapr-http-listen`, Dapr's port 3500): `POST /v1.0-alpha1/lock/{store}`,
//!   `POST /v1.0-alpha1/unlock/{store}`, and the calls SDKs make first: `GET /v1.0/healthz`,
//!   `GET /v1.0/healthz/outbound` (the Python SDK waits for it before any gRPC call) and
//!   `GET /v1.0/metadata`.
//! - gRPC (`--dapr-grpc-listen`, Dapr's port 50001): `TryLockAlpha1` and `UnlockAlpha1` of
//!   `dapr.proto.runtime.v1.Dapr`. Their four messages are written out below with Dapr's field
//!   numbers (`dapr/proto/runtime/v1/dapr.proto`) rather than generated, as for etcd.
//!
//! As in Dapr, a try-lock never waits and is not re-entrant: a second try by the owner that
//! holds the key fails, and one unlock frees it. The expiry must end within the store's first
//! lease (its `leaseDuration` less the safety margin): a Dapr client has no way to learn of a
//! loss, so its lock is never left to depend on renewals. Unlike Dapr's Redis store, the answer is
//! self-fenced and the key's token rises with every holder (the keyed routes show it).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use leasehold_lease::keyed::{KeyAnswer, KeyError, KeyRelease, KeyedFamily, own_permit};
use serde::Deserialize;
use serde_json::json;

use crate::api::{AppState, MAX_HOLD};

/// The most characters of an unknown store's name an answer quotes.
const MAX_QUOTED_STORE: usize = 253;

/// Dapr's unlock statuses (`UnlockResponse.Status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum UnlockStatus {
    Success = 0,
    LockDoesNotExist = 1,
    LockBelongsToOthers = 2,
    InternalError = 3,
}

/// Why a Dapr call is refused: Dapr's error code and a message.
struct DaprError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl IntoResponse for DaprError {
    fn into_response(self) -> Response {
        (
            self.status,
            axum::Json(json!({ "errorCode": self.code, "message": self.message })),
        )
            .into_response()
    }
}

impl DaprError {
    fn malformed(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            code: "ERR_MALFORMED_REQUEST",
            message: message.into(),
        }
    }

    fn grpc(self) -> tonic::Status {
        match self.status {
            StatusCode::BAD_REQUEST => tonic::Status::invalid_argument(self.message),
            StatusCode::TOO_MANY_REQUESTS => tonic::Status::resource_exhausted(self.message),
            _ => tonic::Status::internal(self.message),
        }
    }
}

/// The family serving lock store `store`. One not started yet is answered as a failure of the
/// call (`code`), with the reason: it is a store, served once its resource can be used.
fn family(state: &AppState, store: &str, code: &'static str) -> Result<KeyedFamily, DaprError> {
    if let Some(family) = state.families().into_iter().find(|f| f.name() == store) {
        return Ok(family);
    }
    // A family's name is short (a Kubernetes name): a longer one is quoted in part, so that an
    // answer stays small enough for a gRPC status header.
    let store = match store.char_indices().nth(MAX_QUOTED_STORE) {
        Some((end, _)) => &format!("{}... ({} bytes)", &store[..end], store.len()),
        None => store,
    };
    if let Some(reason) = state.pending_reason(store) {
        return Err(DaprError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            code,
            message: format!("lock store {store} is not started yet: {reason}"),
        });
    }
    Err(DaprError {
        status: StatusCode::BAD_REQUEST,
        code: "ERR_LOCK_STORE_NOT_FOUND",
        message: format!(
            "lock store {store} is not found; this sidecar serves the keyed families: {}",
            state
                .families()
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

fn key_error(error: KeyError) -> DaprError {
    match error {
        e @ (KeyError::Lock(_) | KeyError::Stopped(_)) => DaprError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            code: "ERR_TRY_LOCK",
            message: e.to_string(),
        },
        // The pod's budget of keys is spent, by any of its callers: a well-formed request that
        // may succeed later, as the keyed routes' 429 says.
        e @ KeyError::TooManyKeys(_) => DaprError {
            status: StatusCode::TOO_MANY_REQUESTS,
            code: "ERR_TRY_LOCK",
            message: e.to_string(),
        },
        other => DaprError::malformed(other.to_string()),
    }
}

async fn try_lock(
    state: &AppState,
    store: &str,
    resource_id: &str,
    owner: &str,
    expiry_in_seconds: i64,
) -> Result<bool, DaprError> {
    let family = family(state, store, "ERR_TRY_LOCK")?;
    let hold = u64::try_from(expiry_in_seconds)
        .ok()
        .filter(|s| *s >= 1)
        .map(Duration::from_secs)
        .filter(|h| *h <= MAX_HOLD)
        .ok_or_else(|| {
            DaprError::malformed(format!(
                "expiryInSeconds must be from 1 to {}, got {expiry_in_seconds}",
                MAX_HOLD.as_secs()
            ))
        })?;
    // A Dapr client cannot learn that its lock was lost: it holds until its expiry as far as it
    // knows. So the expiry must end within the key's first lease, which the backend keeps
    // whatever happens to this sidecar or its connection; longer, the lock would depend on
    // renewals, and a sidecar or backend failing for a lease would pass it to another client
    // while this one still believed it held it.
    let lease = family.config().lease_duration;
    let covered = lease.saturating_sub(leasehold_lease::safety_margin(lease));
    if hold > covered {
        return Err(DaprError::malformed(format!(
            "expiryInSeconds {expiry_in_seconds} is longer than lock store {store}'s lease covers \
             ({} s of its {lease:?} lease): a lock held longer would depend on renewals, and a \
             failure of this sidecar or of the backend for a lease would pass it to another \
             client while this one still believed it held it. Ask for at most {} s, or give the \
             store a leaseDuration longer than the longest expiry",
            covered.as_secs(),
            covered.as_secs()
        )));
    }
    let started = std::time::Instant::now();
    let answer = family
        .try_acquire_once(resource_id, owner, hold)
        .await
        .map_err(key_error)?;
    match answer {
        // The claim must cover the whole expiry as the client counts it (from before its call):
        // a backend that counts the lease from an earlier moment than the call (a Sentinel
        // majority's answer, a ZooKeeper heartbeat) leaves less of it.
        KeyAnswer::Held {
            valid_for,
            permit,
            token,
            ..
        } if !covers_expiry(&family, resource_id, owner, (permit, token), started, hold) => {
            // This acquisition's holding exactly (another call of the owner's may hold another
            // permit of a semaphore), on a task of its own that a hang-up cannot cut short.
            let (key, owner) = (resource_id.to_owned(), owner.to_owned());
            let given_back = tokio::spawn(async move {
                match family.holding_on_permit(&key, permit, &owner) {
                    Some(lock) => lock.release_if(own_permit(token)).await.unwrap_or(false),
                    None => true, // its hold lapsed meanwhile
                }
            })
            .await
            .unwrap_or(false);
            let given_back = if given_back {
                "given back".to_owned()
            } else {
                format!("could not be given back: it stays held for at most {expiry_in_seconds} s")
            };
            Err(DaprError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                code: "ERR_TRY_LOCK",
                message: format!(
                    "the lock was taken with a claim of {valid_for:?}, answered {:?} after the \
                     call: it does not cover the expiry of {expiry_in_seconds} s from the call, \
                     and {given_back}; ask for a shorter expiry, or again",
                    started.elapsed()
                ),
            })
        }
        KeyAnswer::Held { .. } => Ok(true),
        KeyAnswer::HeldByAnother { .. } | KeyAnswer::Withheld { .. } | KeyAnswer::NotHeld => {
            Ok(false)
        }
        KeyAnswer::Unknown => Err(DaprError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            code: "ERR_TRY_LOCK",
            message: format!("the {} backend cannot be reached", family.backend()),
        }),
    }
}

/// Whether `owner`'s `holding` of `key` stands, read now, until `hold` after `started` (when the
/// client's expiry began, as far as this sidecar knows), and that moment is still ahead: a lock
/// whose expiry has passed by the answer is no lock to the client. The claim is read before
/// the time elapsed, so that the sum errs short.
fn covers_expiry(
    family: &KeyedFamily,
    key: &str,
    owner: &str,
    (permit, token): (u32, u64),
    started: std::time::Instant,
    hold: Duration,
) -> bool {
    let Some(lock) = family.holding_on_permit(key, permit, owner) else {
        return false;
    };
    let valid_for = match lock.answer() {
        leasehold_lease::Answer::Holder {
            token: held,
            valid_for,
            ..
        } if held == token => valid_for,
        _ => return false,
    };
    let elapsed = started.elapsed();
    elapsed < hold && valid_for + elapsed >= hold
}

async fn unlock(
    state: &AppState,
    store: &str,
    resource_id: &str,
    owner: &str,
) -> Result<UnlockStatus, DaprError> {
    let family = family(state, store, "ERR_UNLOCK")?;
    Ok(match family.release(resource_id, owner).await {
        Ok(KeyRelease::Released { .. }) => UnlockStatus::Success,
        // Not held in this pod: held in another (its owner's sidecar alone may release it),
        // or by nobody, as the backend says. A record of the caller's own is a holding this
        // sidecar has let go of (stopping, force-released, its expiry just past) that the
        // backend keeps until its lease runs out: the caller's lock no longer exists, and no
        // other owner holds it.
        Ok(KeyRelease::NotHeld) => match family.observe_permits(resource_id).await {
            Ok(holders) => {
                let own = family.qualified(owner);
                if holders.iter().all(|h| h.identity == own) {
                    UnlockStatus::LockDoesNotExist
                } else {
                    UnlockStatus::LockBelongsToOthers
                }
            }
            Err(e) => {
                tracing::warn!(store, error = %e, "Dapr unlock could not read the lock's holder");
                UnlockStatus::InternalError
            }
        },
        Ok(KeyRelease::HeldByAnother { .. }) => UnlockStatus::LockBelongsToOthers,
        Err(KeyError::Lock(e)) => {
            tracing::warn!(store, error = %e, "Dapr unlock failed");
            UnlockStatus::InternalError
        }
        Err(other) => return Err(key_error(other)),
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct HttpLockRequest {
    resource_id: String,
    lock_owner: String,
    expiry_in_seconds: i64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct HttpUnlockRequest {
    resource_id: String,
    lock_owner: String,
}

/// The body as JSON, with a Dapr-style error naming what is wrong.
fn body<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, DaprError> {
    serde_json::from_slice(bytes).map_err(|e| DaprError::malformed(format!("malformed body: {e}")))
}

async fn http_lock(
    State(state): State<AppState>,
    Path(store): Path<String>,
    bytes: axum::body::Bytes,
) -> Result<Response, DaprError> {
    let request: HttpLockRequest = body(&bytes)?;
    let success = try_lock(
        &state,
        &store,
        &request.resource_id,
        &request.lock_owner,
        request.expiry_in_seconds,
    )
    .await?;
    Ok(axum::Json(json!({ "success": success })).into_response())
}

async fn http_unlock(
    State(state): State<AppState>,
    Path(store): Path<String>,
    bytes: axum::body::Bytes,
) -> Result<Response, DaprError> {
    let request: HttpUnlockRequest = body(&bytes)?;
    let status = unlock(&state, &store, &request.resource_id, &request.lock_owner).await?;
    Ok(axum::Json(json!({ "status": status as i32 })).into_response())
}

async fn metadata(State(state): State<AppState>) -> Response {
    let components: Vec<_> = state
        .families()
        .iter()
        .map(|f| json!({ "name": f.name(), "type": format!("lock.leasehold.{}", f.backend()), "version": "v1" }))
        .collect();
    axum::Json(json!({
        "id": state.families().first().map(|f| f.identity().to_owned()),
        "runtimeVersion": concat!("leasehold-", env!("CARGO_PKG_VERSION")),
        "components": components,
    }))
    .into_response()
}

/// Dapr's HTTP lock API and the health and metadata calls SDKs make first.
pub fn http_api(state: AppState) -> Router {
    Router::new()
        .route("/v1.0/healthz", get(|| async { StatusCode::NO_CONTENT }))
        .route(
            "/v1.0/healthz/outbound",
            get(|| async { StatusCode::NO_CONTENT }),
        )
        .route("/v1.0/metadata", get(metadata))
        .route("/v1.0-alpha1/lock/{store}", post(http_lock))
        .route("/v1.0-alpha1/unlock/{store}", post(http_unlock))
        .layer(axum::middleware::map_response(dapr_refusal))
        .with_state(state)
}

/// A refusal made before any handler ran (a store name that is not UTF-8, a method the route
/// does not take, a route not served), in Dapr's error shape as every other refusal here.
async fn dapr_refusal(response: Response) -> Response {
    crate::api::refusal_as_json(
        response,
        |message| json!({ "errorCode": "ERR_MALFORMED_REQUEST", "message": message }),
    )
    .await
}

/// `dapr.proto.runtime.v1.TryLockRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TryLockRequest {
    #[prost(string, tag = "1")]
    pub store_name: String,
    #[prost(string, tag = "2")]
    pub resource_id: String,
    #[prost(string, tag = "3")]
    pub lock_owner: String,
    #[prost(int32, tag = "4")]
    pub expiry_in_seconds: i32,
}

/// `dapr.proto.runtime.v1.TryLockResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TryLockResponse {
    #[prost(bool, tag = "1")]
    pub success: bool,
}

/// `dapr.proto.runtime.v1.UnlockRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UnlockRequest {
    #[prost(string, tag = "1")]
    pub store_name: String,
    #[prost(string, tag = "2")]
    pub resource_id: String,
    #[prost(string, tag = "3")]
    pub lock_owner: String,
}

/// `dapr.proto.runtime.v1.UnlockResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UnlockResponse {
    #[prost(int32, tag = "1")]
    pub status: i32,
}

/// The two lock calls of Dapr's runtime service; every other call is `UNIMPLEMENTED`.
#[derive(Clone)]
pub struct GrpcService {
    state: AppState,
}

impl GrpcService {
    pub fn new(state: AppState) -> Self {
        Self { state }
    }
}

impl tonic::server::NamedService for GrpcService {
    const NAME: &'static str = "dapr.proto.runtime.v1.Dapr";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

struct TryLockCall(AppState);

impl tonic::server::UnaryService<TryLockRequest> for TryLockCall {
    type Response = TryLockResponse;
    type Future = BoxFuture<Result<tonic::Response<TryLockResponse>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<TryLockRequest>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            let r = request.into_inner();
            let success = try_lock(
                &state,
                &r.store_name,
                &r.resource_id,
                &r.lock_owner,
                i64::from(r.expiry_in_seconds),
            )
            .await
            .map_err(DaprError::grpc)?;
            Ok(tonic::Response::new(TryLockResponse { success }))
        })
    }
}

struct UnlockCall(AppState);

impl tonic::server::UnaryService<UnlockRequest> for UnlockCall {
    type Response = UnlockResponse;
    type Future = BoxFuture<Result<tonic::Response<UnlockResponse>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<UnlockRequest>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            let r = request.into_inner();
            let status = unlock(&state, &r.store_name, &r.resource_id, &r.lock_owner)
                .await
                .map_err(DaprError::grpc)?;
            Ok(tonic::Response::new(UnlockResponse {
                status: status as i32,
            }))
        })
    }
}

impl<B> tower::Service<http::Request<B>> for GrpcService
where
    B: axum::body::HttpBody + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let state = self.state.clone();
        match request.uri().path() {
            "/dapr.proto.runtime.v1.Dapr/TryLockAlpha1" => Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                Ok(grpc.unary(TryLockCall(state), request).await)
            }),
            "/dapr.proto.runtime.v1.Dapr/UnlockAlpha1" => Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                Ok(grpc.unary(UnlockCall(state), request).await)
            }),
            other => {
                let message = format!(
                    "{other} is not served: this sidecar answers Dapr's TryLockAlpha1 and UnlockAlpha1 only"
                );
                Box::pin(async move { Ok(tonic::Status::unimplemented(message).into_http()) })
            }
        }
    }
}

/// `listener` as tonic's incoming connections, each with `TCP_NODELAY`
/// ([`leasehold_process::NoDelayListener`] says why): tonic sets it only on the sockets it binds
/// and accepts itself.
pub fn grpc_incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_testkit::faulty::FaultyDriver;

    /// A try-lock whose backend call outlasts the client's expiry does not tell the client it
    /// holds a lock whose expiry, counted from its call, has passed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_try_lock_answered_after_its_expiry_is_not_a_success() {
        let dir = tempfile::tempdir().unwrap();
        let faulty = FaultyDriver::wrap(crate::test_support::sqlite_backend(&dir).await);
        let config =
            leasehold_lease::keyed::FamilyConfig::new("store", "pod-a", Duration::from_secs(10));
        let metrics = std::sync::Arc::new(crate::metrics::Metrics::new());
        let family = KeyedFamily::new(faulty.clone(), config, metrics.clone()).unwrap();
        let state = AppState::new(Vec::new(), metrics).with_families(vec![family]);
        faulty.delay_requests(Duration::from_millis(1500));
        let answer = try_lock(&state, "store", "r", "o", 1).await;
        assert!(
            !matches!(answer, Ok(true)),
            "a try-lock answered 1.5 s into a 1 s expiry succeeded"
        );
        faulty.delay_requests(Duration::ZERO);
        assert!(matches!(
            try_lock(&state, "store", "r2", "o", 1).await,
            Ok(true)
        ));
    }

    /// An unlock by the owner whose holding this sidecar has let go of (stopping here), while
    /// the backend keeps its record until the lease runs out, is told its lock does not exist:
    /// nobody else holds it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unlock_of_a_holding_let_go_is_told_the_lock_does_not_exist() {
        let dir = tempfile::tempdir().unwrap();
        let backend = crate::test_support::sqlite_backend(&dir).await;
        let config =
            leasehold_lease::keyed::FamilyConfig::new("store", "pod-a", Duration::from_secs(10));
        let metrics = std::sync::Arc::new(crate::metrics::Metrics::new());
        let family = KeyedFamily::new(backend, config, metrics.clone()).unwrap();
        let state = AppState::new(Vec::new(), metrics).with_families(vec![family.clone()]);
        assert!(matches!(
            try_lock(&state, "store", "r", "o", 5).await,
            Ok(true)
        ));
        family.stop().await;
        let holders = family.observe_permits("r").await.unwrap();
        assert_eq!(holders.len(), 1, "the backend still keeps the record");
        let status = unlock(&state, "store", "r", "o").await;
        assert!(
            matches!(status, Ok(UnlockStatus::LockDoesNotExist)),
            "the owner's unlock after its holding was let go: {:?}",
            status.map_err(|e| e.message)
        );
        let status = unlock(&state, "store", "r", "another").await;
        assert!(
            matches!(status, Ok(UnlockStatus::LockBelongsToOthers)),
            "another owner's unlock of the record: {:?}",
            status.map_err(|e| e.message)
        );
    }

    /// Every connection Dapr's gRPC server accepts has `TCP_NODELAY`.
    #[tokio::test]
    async fn accepted_grpc_connections_do_not_wait_for_acknowledgements() {
        use futures_util::StreamExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut grpc = super::grpc_incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = grpc.next().await.expect("a connection").expect("accepted");
        assert!(
            accepted.nodelay().unwrap(),
            "a gRPC connection without TCP_NODELAY"
        );
    }
}
