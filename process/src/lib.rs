#![forbid(unsafe_code)]
//! What every Leasehold process does the same way: log to stderr (text or JSON, filtered by
//! `RUST_LOG`), wait for SIGTERM or SIGINT, know its host's name, and listen on every address
//! family the host has, serving each connection without Nagle's delay, and end at once when its
//! runtime is stuck ([`watchdog`]). The sidecar and the operator both use it, so that neither
//! links the other.

pub mod watchdog;

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

/// Every address, IPv6 and IPv4: the default of the listeners that pods' peers reach (probes,
/// metrics, the webhook), so that IPv6-only and dual-stack clusters reach them as IPv4 ones do.
pub const ANY_ADDRESS: std::net::Ipv6Addr = std::net::Ipv6Addr::UNSPECIFIED;

/// A listener on `addr`. `[::]` takes IPv4 too (as IPv4-mapped addresses, Linux's default);
/// where the kernel has no IPv6 at all, it falls back to `0.0.0.0` on the same port.
pub async fn listen(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    match tokio::net::TcpListener::bind(addr).await {
        Err(e) if addr.ip() == std::net::IpAddr::V6(ANY_ADDRESS) => {
            let v4 = std::net::SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, addr.port()));
            tracing::info!(%addr, error = %e, fallback = %v4, "no IPv6 here: listening on IPv4 only");
            tokio::net::TcpListener::bind(v4).await
        }
        bound => bound,
    }
}

/// A listener as the servers take it: each accepted connection with `TCP_NODELAY`. A response
/// goes out in several small writes (HTTP/2's HEADERS, DATA and trailers frames; TLS records),
/// and with Nagle's algorithm each small write after the first waits for the peer's
/// acknowledgement, which Linux delays up to 40 ms when the peer has nothing to send back.
pub type NoDelayListener =
    axum::serve::TapIo<tokio::net::TcpListener, fn(&mut tokio::net::TcpStream)>;

/// `listener`, whose accepted connections get `TCP_NODELAY` ([`NoDelayListener`]).
pub fn without_delay(listener: tokio::net::TcpListener) -> NoDelayListener {
    use axum::serve::ListenerExt;
    fn no_delay(tcp: &mut tokio::net::TcpStream) {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY could not be set; the connection is served as it is");
        }
    }
    listener.tap_io(no_delay as fn(&mut tokio::net::TcpStream))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every connection the HTTP servers accept has `TCP_NODELAY`.
    #[tokio::test]
    async fn accepted_connections_do_not_wait_for_acknowledgements() {
        use axum::serve::Listener;
        let mut http = without_delay(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
        let addr = http.local_addr().unwrap();
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = http.accept().await;
        assert!(
            accepted.nodelay().unwrap(),
            "an HTTP connection without TCP_NODELAY"
        );
    }

    /// The default listeners take IPv4 peers as well as IPv6 ones (kubelet probes come over
    /// whichever family the pod has).
    #[tokio::test]
    async fn any_address_takes_ipv4_and_ipv6_peers() {
        let listener = listen((ANY_ADDRESS, 0).into()).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let accept = tokio::spawn(async move {
            for _ in 0..2 {
                listener.accept().await.unwrap();
            }
        });
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("an IPv4 peer");
        // A machine without IPv6 has fallen back to IPv4 only; then there is no ::1 to try.
        if tokio::net::TcpStream::connect(("::1", port)).await.is_err() {
            assert!(
                tokio::net::TcpListener::bind("[::1]:0").await.is_err(),
                "this machine has IPv6, but the listener did not take an IPv6 peer"
            );
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap();
        }
        accept.await.unwrap();
    }
}
