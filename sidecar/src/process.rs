//! What every Leasehold process does the same way: log to stderr (text or JSON, filtered by
//! `RUST_LOG`), wait for SIGTERM or SIGINT, and know its host's name. The operator uses these
//! too.

/// Logs on stderr; `RUST_LOG` filters (default `info`).
pub fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.with_ansi(false).init();
    }
}

/// Resolves at SIGTERM or SIGINT, with the signal's name.
pub async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// The host's name (a pod's name in Kubernetes), or `fallback`.
pub fn hostname(fallback: &str) -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| fallback.to_owned())
}
