#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;
use leasehold_operator::config::Config;
use leasehold_operator::metrics::Metrics;
use leasehold_operator::reconcile::{self, Context};
use leasehold_operator::webhook_tls::{self, SelfManaged, ServingCert};
use leasehold_operator::{election, server, webhook_server};
use leasehold_sidecar::process::{hostname, init_logging, shutdown_signal};

/// Exit status when leadership is lost: the pod restarts as a standby with fresh caches.
const EXIT_DEPOSED: u8 = 3;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let config = Config::parse();
    init_logging(config.log_format == "json");
    match run(config).await {
        Ok(code) => code,
        Err(message) => {
            tracing::error!("{message}");
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: Config) -> Result<ExitCode, String> {
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("no Kubernetes API configuration: {e}"))?;
    let identity = config
        .identity
        .clone()
        .unwrap_or_else(|| hostname("leasehold-operator"));
    let election_namespace = config
        .election_namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let metrics = Arc::new(Metrics::new());
    let ready = Arc::new(AtomicBool::new(false));
    let listener = tokio::net::TcpListener::bind(config.metrics_listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.metrics_listen))?;
    let health = server::Health {
        metrics: metrics.clone(),
        ready: ready.clone(),
    };
    tokio::spawn(async move { axum::serve(listener, server::router(health)).await });

    let serving = start_webhook(&config, &client, &election_namespace, metrics.clone()).await?;
    let leadership = election::campaign(client.clone(), &election_namespace, &identity)
        .map_err(|e| format!("cannot start the leader election: {e}"))?;
    // Ready once the webhook presents a certificate: the Service must not send admission
    // reviews to a replica that would fail every handshake.
    tokio::spawn({
        let ready = ready.clone();
        async move {
            serving.wait_loaded().await;
            ready.store(true, Ordering::SeqCst);
        }
    });
    tracing::info!(%identity, namespace = %election_namespace, "waiting to lead");
    tokio::select! {
        () = election::elected(&leadership) => {}
        signal = shutdown_signal() => {
            tracing::info!(signal, "stopping before being elected");
            leadership.shutdown().await;
            return Ok(ExitCode::SUCCESS);
        }
    }
    metrics.set_leader(true);
    tracing::info!(%identity, "elected: reconciling");

    let ctx = Arc::new(Context::new(client, &identity, metrics.clone()));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let controller = tokio::spawn(reconcile::run(ctx, config.watch_namespace.clone(), async {
        let _ = stop_rx.await;
    }));
    let code = tokio::select! {
        signal = shutdown_signal() => {
            tracing::info!(signal, "shutting down");
            ExitCode::SUCCESS
        }
        () = election::deposed(&leadership) => {
            tracing::error!("lost the leader election: stopping so that only the new leader reconciles");
            ExitCode::from(EXIT_DEPOSED)
        }
    };
    let _ = stop_tx.send(());
    let _ = controller.await;
    metrics.set_leader(false);
    leadership.shutdown().await;
    Ok(code)
}

/// Listen for admission reviews on every replica, with a certificate from files (cert-manager)
/// or one this operator issues and keeps current.
async fn start_webhook(
    config: &Config,
    client: &kube::Client,
    namespace: &str,
    metrics: Arc<Metrics>,
) -> Result<Arc<ServingCert>, String> {
    let listener = tokio::net::TcpListener::bind(config.webhook_listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.webhook_listen))?;
    let serving = ServingCert::with_expiry_gauge(metrics.certificate_expiry());
    match &config.webhook_cert_dir {
        Some(dir) => {
            tokio::spawn(webhook_tls::follow_files(dir.clone(), serving.clone()));
        }
        None => {
            let settings = SelfManaged {
                namespace: namespace.to_owned(),
                secret: config.webhook_secret.clone(),
                service: config.webhook_service.clone(),
                webhook_configuration: config.webhook_configuration.clone(),
            };
            tokio::spawn(webhook_tls::maintain(
                client.clone(),
                settings,
                serving.clone(),
            ));
        }
    }
    let injection = config.injection();
    let router = webhook_server::router(client.clone(), injection, metrics);
    tokio::spawn(webhook_server::serve(
        listener,
        serving.clone(),
        router,
        std::future::pending(),
    ));
    Ok(serving)
}
