#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Parser;
use leasehold_operator::api_rate_limit::ApiRateLimitLayer;
use leasehold_operator::config::Config;
use leasehold_operator::lock_cache::LockCache;
use leasehold_operator::metrics::Metrics;
use leasehold_operator::reconcile::{self, Context};
use leasehold_operator::webhook_tls::{self, SelfManaged, ServingCert};
use leasehold_operator::{election, server, webhook_server};
use leasehold_process::{hostname, init_logging, listen, shutdown_signal};

/// How long the webhook keeps answering after SIGTERM (not ready meanwhile): Services and the
/// API server's endpoints take a few seconds to drop a terminating pod. The chart's
/// terminationGracePeriodSeconds (30 s) leaves room for it after the reconciles' drain
/// ([`election::DRAIN_PATIENCE`]).
const WEBHOOK_DRAIN: Duration = Duration::from_secs(5);
/// How long the uninstall hook waits for the operator's pods to go (their grace period is 30 s
/// by default; the hook's Job gives up at 300 s).
const STOP_PATIENCE: Duration = Duration::from_secs(180);

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let config = Config::parse();
    init_logging(config.log_format == "json");
    leasehold_lease::tls::use_ring_provider();
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
    let api = kube::Config::infer()
        .await
        .map_err(|e| format!("no Kubernetes API configuration: {e}"))?;
    // A client not paced with the reconciler's, for what must not queue behind a resync of
    // thousands of locks: an admission's few requests (the API server's timeout for the
    // webhook is 5 s, or pods are refused), the leader election's renewals (a renewal late by
    // its lease deposes the leader, and the standby resyncs every lock into the same queue),
    // and the webhook certificate's upkeep. Each makes a few requests a minute.
    let unpaced_client = kube::client::ClientBuilder::try_from(api.clone())
        .map_err(|e| format!("cannot build the Kubernetes API client: {e}"))?
        .build();
    let client = kube::client::ClientBuilder::try_from(api)
        .map_err(|e| format!("cannot build the Kubernetes API client: {e}"))?
        .with_layer(&ApiRateLimitLayer::new(config.api_qps, config.api_burst))
        .build();
    if config.release_finalizers {
        use leasehold_operator::uninstall;
        let deployment = match (&config.operator_deployment, &config.operator_pods) {
            (Some(name), Some(pods)) => Some(uninstall::OperatorDeployment {
                namespace: config
                    .election_namespace
                    .clone()
                    .unwrap_or_else(|| client.default_namespace().to_owned()),
                name: name.clone(),
                pods: pods.clone(),
            }),
            _ => None,
        };
        let watched = config.watched();
        let hook = uninstall::release_every_finalizer(
            &client,
            deployment.as_ref(),
            &watched,
            STOP_PATIENCE,
        );
        let released = tokio::select! {
            released = hook => released?,
            // The Job's deadline, or a person: the operator must not stay scaled to zero.
            signal = shutdown_signal() => {
                let stopped = format!("stopped by {signal} before the finalizers were released");
                return Err(match &deployment {
                    Some(deployment) => uninstall::scaled_back(&client, deployment, stopped).await,
                    None => stopped,
                });
            }
        };
        println!(
            "released the finalizer of {} DistributedLock(s); their records are kept",
            released.len()
        );
        return Ok(ExitCode::SUCCESS);
    }
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
    let listener = listen(config.metrics_listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.metrics_listen))?;
    let health = server::Health {
        metrics: metrics.clone(),
        ready: ready.clone(),
    };
    tokio::spawn(async move {
        axum::serve(
            leasehold_process::without_delay(listener),
            server::router(health),
        )
        .await
    });

    let (serving, webhook_ended) = start_webhook(
        &config,
        &unpaced_client,
        &election_namespace,
        metrics.clone(),
    )
    .await?;
    let leadership = election::campaign(unpaced_client.clone(), &election_namespace, &identity)
        .map_err(|e| format!("cannot start the leader election: {e}"))?;
    // Ready once the webhook presents a certificate: the Service must not send admission
    // reviews to a replica that would fail every handshake.
    let turn_ready = tokio::spawn({
        let ready = ready.clone();
        async move {
            serving.wait_loaded().await;
            ready.store(true, Ordering::SeqCst);
        }
    });
    let ctx = Arc::new(Context::new(client, &identity, metrics.clone()));
    let mut stop = std::pin::pin!(async move {
        tokio::select! {
            signal = shutdown_signal() => Stop::Signal(signal),
            task = webhook_ended => Stop::TaskEnded(task),
        }
    });
    let exit = loop {
        tracing::info!(%identity, namespace = %election_namespace, "waiting to lead");
        tokio::select! {
            () = election::elected(&leadership) => {}
            stop = &mut stop => break stop.announce(),
        }
        metrics.set_leader(true);
        tracing::info!(%identity, "elected: reconciling");
        let end = election::reconcile_while_leading(
            |stop| {
                tokio::spawn(reconcile::run(ctx.clone(), config.watched(), async {
                    let _ = stop.await;
                }))
            },
            election::deposed(&leadership),
            &mut stop,
            election::DRAIN_PATIENCE,
        )
        .await;
        metrics.set_leader(false);
        match end {
            election::TermEnd::Signalled(stop) => break stop.announce(),
            // The webhook (served by every replica) keeps answering: only reconciling stops.
            election::TermEnd::Deposed => tracing::warn!(
                "lost the leader election: reconciling stopped; standing by, the webhook serves on"
            ),
            // Restarted by the kubelet, the replica stands for election again; meanwhile a
            // standby leads at once rather than after the Lease runs out.
            election::TermEnd::ControllerEnded => {
                break Stop::TaskEnded("the reconciler").announce();
            }
        }
    };
    // Hand the leadership over at once, then keep answering admission reviews while the
    // endpoints drop this replica: the API server sends them here until then.
    leadership.shutdown().await;
    turn_ready.abort();
    ready.store(false, Ordering::SeqCst);
    tokio::time::sleep(WEBHOOK_DRAIN).await;
    Ok(exit)
}

/// Why a replica stops.
enum Stop {
    /// Told to: the signal's name.
    Signal(&'static str),
    /// A task ended on its own (a panic, say): which. A replica whose webhook's server or
    /// certificate upkeep ended would stay live and ready while refusing admission reviews or
    /// serving an expiring certificate, and one whose reconciler ended would lead without
    /// reconciling; it exits and the kubelet restarts it.
    TaskEnded(&'static str),
}

impl Stop {
    /// Log why the replica stops; the process's exit code.
    fn announce(self) -> ExitCode {
        match self {
            Stop::Signal(signal) => {
                tracing::info!(signal, "shutting down");
                ExitCode::SUCCESS
            }
            Stop::TaskEnded(task) => {
                tracing::error!(
                    task,
                    "ended on its own: handing the leadership over and exiting"
                );
                ExitCode::FAILURE
            }
        }
    }
}

/// Listen for admission reviews on every replica, with a certificate from files (cert-manager)
/// or one this operator issues and keeps current. With the certificate, a future that ends if
/// the webhook's server or the certificate's upkeep ends, naming it.
async fn start_webhook(
    config: &Config,
    unpaced_client: &kube::Client,
    namespace: &str,
    metrics: Arc<Metrics>,
) -> Result<(Arc<ServingCert>, impl Future<Output = &'static str>), String> {
    let listener = listen(config.webhook_listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.webhook_listen))?;
    let serving = ServingCert::with_expiry_gauge(metrics.certificate_expiry());
    let upkeep = match &config.webhook_cert_dir {
        Some(dir) => tokio::spawn(webhook_tls::follow_files(dir.clone(), serving.clone())),
        None => {
            let settings = SelfManaged {
                namespace: namespace.to_owned(),
                secret: config.webhook_secret.clone(),
                service: config.webhook_service.clone(),
                webhook_configuration: config.webhook_configuration.clone(),
            };
            tokio::spawn(webhook_tls::maintain(
                unpaced_client.clone(),
                settings,
                serving.clone(),
            ))
        }
    };
    let injection = config.injection();
    let locks = LockCache::start(unpaced_client, &config.watched());
    let router = webhook_server::router(unpaced_client.clone(), locks, injection, metrics);
    let server = tokio::spawn(webhook_server::serve(
        listener,
        serving.clone(),
        router,
        std::future::pending(),
    ));
    let ended = async move {
        tokio::select! {
            _ = server => "the webhook's server",
            _ = upkeep => "the webhook certificate's upkeep",
        }
    };
    Ok((serving, ended))
}
