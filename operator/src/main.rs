#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;
use leasehold_operator::config::Config;
use leasehold_operator::metrics::Metrics;
use leasehold_operator::reconcile::{self, Context};
use leasehold_operator::{election, server};
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

    let leadership = election::campaign(client.clone(), &election_namespace, &identity)
        .map_err(|e| format!("cannot start the leader election: {e}"))?;
    ready.store(true, Ordering::SeqCst);
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
