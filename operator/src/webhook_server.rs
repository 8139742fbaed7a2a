//! The injection webhook over HTTPS: `POST /mutate` takes an AdmissionReview of a pod and answers
//! with [`crate::webhook::review`]. Every replica serves it (not only the leader), so the
//! webhook Service can spread calls and survive a replica's restart.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use k8s_openapi::api::core::v1::Pod;
use kube::core::admission::AdmissionReview;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::lock_cache::LockCache;
use crate::metrics::Metrics;
use crate::webhook::{self, Injection};
use crate::webhook_tls::ServingCert;

/// The path the MutatingWebhookConfiguration calls.
pub const MUTATE_PATH: &str = "/mutate";
/// The API server gives up after the webhook's `timeoutSeconds` (at most 30 s); a client that has
/// not finished its handshake or headers by then is not the API server.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may sit between requests (hyper's header-read timeout also bounds the
/// idle wait of a kept-alive connection). The API server keeps idle connections to a webhook in
/// its pool for 90 s; closing them earlier makes it reuse a connection that is being closed, and
/// an admission fails now and then during normal operation.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Clone)]
struct Webhook {
    client: kube::Client,
    locks: LockCache,
    injection: Arc<Injection>,
    metrics: Arc<Metrics>,
}

/// The webhook's routes (plain HTTP; [`serve`] puts TLS in front), finding pods' locks in
/// `locks` first.
pub fn router(
    client: kube::Client,
    locks: LockCache,
    injection: Injection,
    metrics: Arc<Metrics>,
) -> Router {
    Router::new()
        .route(MUTATE_PATH, post(mutate))
        .with_state(Webhook {
            client,
            locks,
            injection: Arc::new(injection),
            metrics,
        })
}

async fn mutate(State(hook): State<Webhook>, body: axum::body::Bytes) -> Response {
    // Decoded by hand so that a malformed review gets a reason, not axum's generic rejection.
    let review: AdmissionReview<Pod> = match serde_json::from_slice(&body) {
        Ok(review) => review,
        Err(e) => {
            hook.metrics.admitted("malformed");
            return (
                StatusCode::BAD_REQUEST,
                axum::Json(serde_json::json!({
                    "error": format!("the body is not an AdmissionReview of a Pod: {e}")
                })),
            )
                .into_response();
        }
    };
    let answer = webhook::review(&hook.client, &hook.locks, &hook.injection, review).await;
    hook.metrics.admitted(result_of(&answer));
    axum::Json(answer).into_response()
}

/// The metric label for an answer.
fn result_of(answer: &serde_json::Value) -> &'static str {
    let response = &answer["response"];
    if response["allowed"] == false {
        "denied"
    } else if response["patch"].is_string() {
        "injected"
    } else {
        "unchanged"
    }
}

/// Serve `router` over TLS with the certificate `serving` presents at each handshake, until
/// `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    serving: Arc<ServingCert>,
    router: Router,
    shutdown: impl Future<Output = ()>,
) {
    let acceptor = TlsAcceptor::from(Arc::new(serving.server_config()));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "webhook: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        // A TLS handshake and each answer go out in several records: without TCP_NODELAY the
        // later ones wait for the API server's delayed acknowledgement.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "webhook: TCP_NODELAY could not be set");
        }
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "webhook: TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            let served = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(IDLE_TIMEOUT)
                .serve_connection(TokioIo::new(tls), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "webhook: connection ended with an error");
            }
        });
    }
}
