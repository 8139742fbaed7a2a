//! The process's life: start the locks, serve, and on SIGTERM or SIGINT (or, with
//! `--exit-with-pod`, once the pod's other containers have finished) release every lease
//! before exiting, within a second.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::keyed::KeyedFamily;
use leasehold_lease::{Lock, SHUTDOWN_RELEASE_TIMEOUT, connect};
use tokio::net::TcpListener;

use crate::api::{AppState, LetGo, lock_api, probe_router};
use crate::config::Config;
use crate::from_resource;
use crate::metrics::Metrics;

/// After the leases are released, how long open connections (long polls, event streams) get
/// before the process exits anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_millis(150);

/// With `--readiness-requires-backend`, how often each family's backend is pinged for
/// `/readyz`, and how long a ping may take before it counts as unanswered: a few seconds, as a
/// kubelet probes every ten by default.
const FAMILY_CHECK_EVERY: Duration = Duration::from_secs(5);
const FAMILY_CHECK_PATIENCE: Duration = Duration::from_secs(2);

pub async fn run(config: Config) -> Result<(), String> {
    if config.resign_only {
        return resign(config.listen).await;
    }
    let metrics = Arc::new(Metrics::new());
    let (state, followers) = if config.resources.is_empty() {
        match start_from_flags(&config, &metrics).await? {
            Some((locks, families)) => (
                AppState::new(locks, metrics.clone()).with_families(families),
                Vec::new(),
            ),
            None => return Ok(()),
        }
    } else {
        start_from_resources(&config, &metrics).await?
    };
    // With --resource, what each resource declares is known only once it is read: a Dapr
    // store that turns out to be a lock is answered as not found.
    if config.resources.is_empty()
        && state.families().is_empty()
        && (config.dapr_http_listen.is_some() || config.dapr_grpc_listen.is_some())
    {
        return Err("--dapr-http-listen/--dapr-grpc-listen: Dapr's lock API serves families of keyed locks (each is a lock store), and none of the --resource locks declares spec.keys".into());
    }
    state.set_readiness_requires_backend(config.readiness_requires_backend);
    let family_checks = config.readiness_requires_backend.then(|| {
        let state = state.clone();
        tokio::spawn(async move {
            state
                .check_families(FAMILY_CHECK_EVERY, FAMILY_CHECK_PATIENCE)
                .await
        })
    });
    state.set_apps_stop_first(config.apps_stop_first);
    let locks = state.locks();
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let probe_listener = match config.probe_listen {
        Some(addr) => Some(
            leasehold_process::listen(addr)
                .await
                .map_err(|e| format!("cannot listen on {addr} for probes: {e}"))?,
        ),
        None => None,
    };
    let dapr_http = bind(config.dapr_http_listen, "Dapr's HTTP lock API").await?;
    let dapr_grpc = bind(config.dapr_grpc_listen, "Dapr's gRPC lock API").await?;
    tracing::info!(listen = %config.listen, probe_listen = ?config.probe_listen,
        dapr_http_listen = ?config.dapr_http_listen, dapr_grpc_listen = ?config.dapr_grpc_listen,
        locks = locks.len(), families = state.families().len(), "leasehold sidecar started");

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let api = tokio::spawn(
        axum::serve(
            leasehold_process::without_delay(listener),
            lock_api(state.clone()),
        )
        .with_graceful_shutdown(stopped(stop_rx.clone()))
        .into_future(),
    );
    let probes = probe_listener.map(|l| {
        tokio::spawn(
            axum::serve(
                leasehold_process::without_delay(l),
                probe_router(state.clone()),
            )
            .with_graceful_shutdown(stopped(stop_rx.clone()))
            .into_future(),
        )
    });

    let dapr_http = dapr_http.map(|l| {
        tokio::spawn(
            axum::serve(
                leasehold_process::without_delay(l),
                crate::dapr::http_api(state.clone()),
            )
            .with_graceful_shutdown(stopped(stop_rx.clone()))
            .into_future(),
        )
    });
    let dapr_grpc = dapr_grpc.map(|l| {
        let service = crate::dapr::GrpcService::new(state.clone());
        let stop = stopped(stop_rx.clone());
        tokio::spawn(async move {
            let incoming = crate::dapr::grpc_incoming(l);
            if let Err(e) = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, stop)
                .await
            {
                tracing::error!(error = %e, "Dapr's gRPC lock API stopped");
            }
        })
    });

    let app_health = config.app_health.clone().map(|health| {
        tokio::spawn(crate::app_health::watch(
            health,
            state.clone(),
            metrics.clone(),
        ))
    });

    let pod_finished = async {
        match &config.exit_with_pod {
            Some(own) => match kube::Client::try_default().await {
                Ok(client) => {
                    let namespace = client.default_namespace().to_owned();
                    crate::pod_exit::wait(client, &namespace, &config.identity, own).await
                }
                Err(e) => {
                    tracing::error!(error = %e, "--exit-with-pod: no Kubernetes API configuration; the sidecar will not exit with the pod");
                    std::future::pending().await
                }
            },
            None => std::future::pending().await,
        }
    };
    let (signal, why) = tokio::select! {
        signal = leasehold_process::shutdown_signal() => (signal, LetGo::PodStopping),
        () = pod_finished => ("the pod's other containers have finished", LetGo::AppsFinished),
    };
    tracing::info!(signal, "shutting down: releasing leases");
    // Stop following resources (no lock may be swapped in now), then release first: waiters
    // elsewhere take over while this process is still draining.
    for follower in &followers {
        follower.abort();
    }
    // An aborted task still being polled on another thread may yet put a lock in place:
    // waiting for each to end makes the list below the last word.
    for follower in followers {
        let _ = follower.await;
    }
    if let Some(checks) = family_checks {
        checks.abort();
    }
    // No lock comes back from sitting out while they are being released.
    if let Some(app_health) = app_health {
        app_health.abort();
        let _ = app_health.await;
    }
    state.let_go(&state.locks(), &state.families(), why).await;
    // The lock API keeps answering (not held) while the last answers run out.
    if let Some(due) = state.releases_due() {
        let released = due.to_tokio() + SHUTDOWN_RELEASE_TIMEOUT + Duration::from_millis(50);
        tracing::info!(
            in_ms = due.remaining().as_millis() as u64,
            "the leases are released once the last answers given about them have run out"
        );
        tokio::select! {
            () = tokio::time::sleep_until(released) => {}
            signal = leasehold_process::shutdown_signal() => {
                tracing::warn!(signal, "stopping now: the leases not released yet run out on their own");
            }
        }
    }
    stop_tx.send_replace(true);
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, api).await;
    if let Some(probes) = probes {
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, probes).await;
    }
    if let Some(server) = dapr_http {
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, server).await;
    }
    if let Some(server) = dapr_grpc {
        let _ = tokio::time::timeout(DRAIN_TIMEOUT, server).await;
    }
    tracing::info!("stopped");
    Ok(())
}

/// A network driver connects on its first call: a ping as the lock or family starts opens the
/// connection, so that the first acquisition (often asked with no wait) does not pay for a
/// handshake or a new session.
pub(crate) fn open_connection_early(driver: &Arc<dyn leasehold_lease::Backend>) {
    let driver = driver.clone();
    tokio::spawn(async move {
        if let Err(e) = driver.ping().await {
            tracing::debug!(error = %e, "the backend did not answer a first ping");
        }
    });
}

/// A listener on `addr`, when one is asked for.
async fn bind(
    addr: Option<std::net::SocketAddr>,
    what: &str,
) -> Result<Option<TcpListener>, String> {
    match addr {
        None => Ok(None),
        Some(addr) => TcpListener::bind(addr)
            .await
            .map(Some)
            .map_err(|e| format!("cannot listen on {addr} for {what}: {e}")),
    }
}

/// `--lock`, `--keyed` and `--backend`. `None`: `--provision` did its work and the process is
/// done.
async fn start_from_flags(
    config: &Config,
    metrics: &Arc<Metrics>,
) -> Result<Option<(Vec<Lock>, Vec<KeyedFamily>)>, String> {
    let driver = connect(&config.backend)
        .await
        .map_err(|e| format!("cannot open backend {}: {e}", config.backend))?;
    if config.provision_only {
        let names: Vec<String> = config.locks.iter().map(|l| l.name.clone()).collect();
        driver
            .provision(&names)
            .await
            .map_err(|e| format!("cannot provision {}: {e}", config.backend))?;
        tracing::info!(backend = %config.backend, "provisioned");
        println!("provisioned {}", config.backend);
        return Ok(None);
    }
    open_connection_early(&driver);
    for lock in &config.locks {
        metrics.register_lock(&lock.name);
    }
    tracing::info!(backend = %config.backend, "backend configured by flags");
    let locks = config
        .locks
        .iter()
        .map(|lock| Lock::start(driver.clone(), lock.clone(), metrics.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let families = config
        .families
        .iter()
        .map(|family| KeyedFamily::new(driver.clone(), family.clone(), metrics.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    Ok(Some((locks, families)))
}

/// `--resource`: each lock from its DistributedLock, each followed for changes. Nothing here
/// waits for the API server: the listeners bind at once, and each lock answers 503 with the
/// reason until its resource can be read and started (a DistributedLock created after the pod,
/// a Secret or a permission still missing, an API server not reached yet).
async fn start_from_resources(
    config: &Config,
    metrics: &Arc<Metrics>,
) -> Result<(AppState, Vec<tokio::task::JoinHandle<()>>), String> {
    let names = config.resources.iter().map(|r| r.name.clone()).collect();
    let state = AppState::new(Vec::new(), metrics.clone())
        .expecting(names, "its DistributedLock is being read");
    let client = match kube::Client::try_default().await {
        Ok(client) => client,
        Err(e) => {
            // No service account token mounted, no KUBECONFIG: nothing will change that while
            // the process runs, so it says why on every answer rather than restart in a loop
            // that keeps the pod's app from starting.
            let reason = format!(
                "--resource needs the Kubernetes API (in-cluster service account token or KUBECONFIG): {e}"
            );
            tracing::error!(error = %reason, "no lock can be started");
            for r in &config.resources {
                state.set_pending(&r.name, reason.clone());
            }
            return Ok((state, Vec::new()));
        }
    };
    let followers = config
        .resources
        .iter()
        .map(|r| {
            let holder_label = crate::holder_label::labels_for(&r.name, config.resources.len())
                .map(|labels| {
                    let (asked, enabled) = tokio::sync::watch::channel(false);
                    tokio::spawn(crate::holder_label::follow(
                        client.clone(),
                        r.namespace.clone(),
                        config.identity.clone(),
                        r.name.clone(),
                        labels,
                        state.clone(),
                        enabled,
                    ));
                    asked
                });
            tokio::spawn(from_resource::follow(
                client.clone(),
                r.clone(),
                config.identity.clone(),
                state.clone(),
                metrics.clone(),
                config.secret_recheck,
                holder_label,
            ))
        })
        .collect();
    Ok((state, followers))
}

/// `--resign`: `POST /resign` to the sidecar on `listen`. The image has no curl, and the lock API
/// is on loopback, which only a command inside the pod reaches.
async fn resign(listen: std::net::SocketAddr) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(listen).await?;
        stream
            .write_all(b"POST /resign HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| format!("the sidecar on {listen} did not answer within 10 s"))?
        .map_err(|e| format!("cannot reach the sidecar on {listen}: {e}"))?;
    let answer = String::from_utf8_lossy(&answer);
    if answer.starts_with("HTTP/1.1 200") {
        println!("resigned");
        Ok(())
    } else {
        Err(format!(
            "the sidecar on {listen} answered: {}",
            answer.lines().next().unwrap_or("nothing")
        ))
    }
}
