//! `--app-health URL`: step down when the app is unhealthy. The sidecar asks the app's own
//! health endpoint every `--app-health-period`; after `--app-health-failures` failures in a row
//! each campaign-mode lock sits out ([`Lock::sit_out`]): answers say "not holder" with the
//! reason at once, a lease held is released once the last answer's validity has run out, and
//! the lock is not campaigned for until the app answers healthy again. So a crash-looping app
//! stops keeping its peers from the lock, as a dead pod would. On-demand locks are the app's
//! own to release and are left alone.
//!
//! A probe asks what the kubelet's probe of the same kind asks, on loopback: `http://` and
//! `https://` a GET, healthy when answered 200 to 399 (an HTTPS certificate is not verified, as
//! the kubelet does not verify it); `tcp://` a connection that opens; `grpc://` the gRPC health
//! protocol's `Check`, healthy when it answers `SERVING`. Each within the period.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::{Lock, Mode};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};

use crate::api::AppState;
use crate::metrics::Metrics;

/// What a probe asks of the app.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Probe {
    /// A GET of `path` (`/path?query`), over TLS when `tls`.
    Http { tls: bool, path: String },
    /// A TCP connection.
    Tcp,
    /// `grpc.health.v1.Health/Check` of `service` (empty: the server as a whole).
    Grpc { service: String },
}

/// The app's health endpoint and how it is judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppHealth {
    /// The URL as given, for messages.
    url: String,
    /// `HOST:PORT`.
    authority: String,
    probe: Probe,
    pub period: Duration,
    pub failures: u32,
}

impl AppHealth {
    /// `http://HOST:PORT/PATH`, `https://HOST:PORT/PATH`, `tcp://HOST:PORT` or
    /// `grpc://HOST:PORT[/SERVICE]`, the host on loopback (`127.0.0.1`, `localhost` or `[::1]`):
    /// the app runs in the sidecar's pod, or beside it.
    pub fn parse(raw: &str, period: Duration, failures: u32) -> Result<Self, String> {
        let bad = || {
            format!(
                "{raw:?} is not http://HOST:PORT/PATH, https://HOST:PORT/PATH, tcp://HOST:PORT or grpc://HOST:PORT[/SERVICE] on loopback (the app's health endpoint)"
            )
        };
        let (scheme, rest) = raw.split_once("://").ok_or_else(bad)?;
        let (authority, path) = match rest.find('/') {
            Some(at) => (&rest[..at], &rest[at..]),
            None => (rest, ""),
        };
        let Some((host, port)) = authority.rsplit_once(':') else {
            return Err(bad());
        };
        let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
        let loopback = matches!(host, "127.0.0.1" | "localhost" | "[::1]");
        if !port_ok || !loopback {
            return Err(bad());
        }
        let probe = match scheme {
            "http" | "https" if path.bytes().all(|b| b.is_ascii_graphic() && b != b'#') => {
                Probe::Http {
                    tls: scheme == "https",
                    path: if path.is_empty() { "/" } else { path }.to_owned(),
                }
            }
            "tcp" if matches!(path, "" | "/") => Probe::Tcp,
            // A service name is a protobuf full name (`package.Service`).
            "grpc"
                if path
                    .bytes()
                    .skip(1)
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) =>
            {
                Probe::Grpc {
                    service: path.get(1..).unwrap_or_default().to_owned(),
                }
            }
            _ => return Err(bad()),
        };
        if failures == 0 {
            return Err("--app-health-failures must be at least 1".into());
        }
        if period.is_zero() {
            return Err("--app-health-period must be above zero".into());
        }
        Ok(Self {
            url: raw.to_owned(),
            authority: authority.to_owned(),
            probe,
            period,
            failures,
        })
    }

    /// One probe: `Ok` when healthy, else why not.
    async fn probe(&self) -> Result<(), String> {
        let ask = async {
            let connect = || async {
                TcpStream::connect(&self.authority)
                    .await
                    .map_err(|e| format!("cannot connect: {e}"))
            };
            match &self.probe {
                Probe::Tcp => connect().await.map(drop),
                Probe::Http { tls: false, path } => self.get(connect().await?, path).await,
                Probe::Http { tls: true, path } => {
                    let conn = tls_connect(connect().await?, &self.authority).await?;
                    self.get(conn, path).await
                }
                Probe::Grpc { service } => grpc_check(&self.authority, service).await,
            }
        };
        match tokio::time::timeout(self.period, ask).await {
            Ok(outcome) => outcome,
            Err(_) => Err(format!("no answer within {:?}", self.period)),
        }
    }

    /// A GET of `path` on `conn`, healthy when answered 200 to 399.
    async fn get<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        mut conn: S,
        path: &str,
    ) -> Result<(), String> {
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: leasehold-sidecar\r\nConnection: close\r\n\r\n",
            self.authority
        );
        conn.write_all(request.as_bytes())
            .await
            .map_err(|e| format!("cannot send: {e}"))?;
        let mut reader = BufReader::new(conn);
        // An interim answer (1xx, such as 103 Early Hints) is skipped, as the kubelet does.
        let status = loop {
            let mut status_line = String::new();
            reader
                .read_line(&mut status_line)
                .await
                .map_err(|e| format!("no answer: {e}"))?;
            let mut words = status_line.split_whitespace();
            let status = match (words.next(), words.next()) {
                (Some(version), Some(code)) if version.starts_with("HTTP/1.") => {
                    code.parse::<u16>().ok()
                }
                _ => None,
            }
            .ok_or_else(|| format!("not an HTTP answer: {:?}", status_line.trim_end()))?;
            if !(100..200).contains(&status) {
                break status;
            }
            loop {
                let mut header = String::new();
                let read = reader
                    .read_line(&mut header)
                    .await
                    .map_err(|e| format!("no answer: {e}"))?;
                if read == 0 || header.trim_end().is_empty() {
                    break;
                }
            }
        };
        if (200..400).contains(&status) {
            Ok(())
        } else {
            Err(format!("answered {status}"))
        }
    }
}

/// TLS on `conn` to `authority`, whatever certificate the app shows: the kubelet does not verify
/// an HTTPS probe's certificate either, and the app is on loopback, which nobody else can answer
/// for. The handshake's own signatures are still checked.
async fn tls_connect(
    conn: TcpStream,
    authority: &str,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    let host = authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let name = ServerName::try_from(host.to_owned()).map_err(|e| format!("TLS: {e}"))?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, conn)
        .await
        .map_err(|e| format!("TLS handshake failed: {e}"))
}

/// Accepts the app's certificate unseen (see [`tls_connect`]).
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.0.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `grpc.health.v1.HealthCheckRequest`.
#[derive(Clone, PartialEq, prost::Message)]
struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    service: String,
}

/// `grpc.health.v1.HealthCheckResponse`.
#[derive(Clone, PartialEq, prost::Message)]
struct HealthCheckResponse {
    #[prost(int32, tag = "1")]
    status: i32,
}

/// `HealthCheckResponse.ServingStatus`'s names, by number.
fn serving_status(status: i32) -> &'static str {
    match status {
        0 => "UNKNOWN",
        1 => "SERVING",
        2 => "NOT_SERVING",
        3 => "SERVICE_UNKNOWN",
        _ => "an unknown status",
    }
}

/// The gRPC health protocol's `Check` of `service` at `authority`, on a connection of its own
/// (as the kubelet's probe): healthy when `SERVING`.
async fn grpc_check(authority: &str, service: &str) -> Result<(), String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{authority}"))
        .map_err(|e| format!("not a gRPC endpoint: {e}"))?
        .connect()
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    let answer = grpc
        .unary(
            tonic::Request::new(HealthCheckRequest {
                service: service.to_owned(),
            }),
            http::uri::PathAndQuery::from_static("/grpc.health.v1.Health/Check"),
            tonic_prost::ProstCodec::<HealthCheckRequest, HealthCheckResponse>::default(),
        )
        .await
        .map_err(|status| format!("answered {:?}: {}", status.code(), status.message()))?;
    match answer.into_inner().status {
        1 => Ok(()),
        status => Err(format!("answered {}", serving_status(status))),
    }
}

/// Probe for as long as the sidecar runs, making the campaign-mode locks sit out while the app
/// is unhealthy and come back once it is healthy again.
pub async fn watch(health: AppHealth, state: AppState, metrics: Arc<Metrics>) {
    let mut failed_in_a_row = 0u32;
    let mut sitting_out = false;
    let mut ticks = tokio::time::interval(health.period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let outcome = health.probe().await;
        metrics.app_probed(outcome.is_ok());
        let campaigning = || {
            state
                .locks()
                .into_iter()
                .filter(|lock| lock.config().mode == Mode::Campaign)
                .collect::<Vec<Lock>>()
        };
        match outcome {
            Ok(()) => {
                failed_in_a_row = 0;
                if sitting_out {
                    tracing::info!("the app is healthy again: campaigning");
                    let _turn = state.app_health_turn().await;
                    state.set_app_unhealthy(None);
                    futures_util::future::join_all(
                        campaigning().iter().map(|lock| lock.come_back()),
                    )
                    .await;
                    sitting_out = false;
                    metrics.app_sitting_out(false);
                }
            }
            Err(why) => {
                failed_in_a_row = failed_in_a_row.saturating_add(1);
                tracing::debug!(failed_in_a_row, why, "the app's health probe failed");
                if failed_in_a_row >= health.failures {
                    let reason = format!(
                        "the app is unhealthy ({failed_in_a_row} probes of {} failed in a row, the last: {why})",
                        health.url
                    );
                    // A lock put in place from now on (a spec change) starts sitting out; and
                    // every time, since one may have started just before. All at once: an engine
                    // answers between backend calls, which may each take a renew interval.
                    let _turn = state.app_health_turn().await;
                    state.set_app_unhealthy(Some(reason.clone()));
                    futures_util::future::join_all(
                        campaigning().iter().map(|lock| lock.sit_out(&reason)),
                    )
                    .await;
                    sitting_out = true;
                    metrics.app_sitting_out(true);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_is_an_http_url_with_a_port() {
        let period = Duration::from_secs(5);
        let health = AppHealth::parse("http://127.0.0.1:8080/healthz?full=1", period, 3).unwrap();
        assert_eq!(health.authority, "127.0.0.1:8080");
        let http = |path: &str| Probe::Http {
            tls: false,
            path: path.into(),
        };
        assert_eq!(health.probe, http("/healthz?full=1"));
        let probe = |url| AppHealth::parse(url, period, 3).map(|h| h.probe);
        assert_eq!(probe("http://localhost:9000"), Ok(http("/")));
        assert_eq!(probe("http://[::1]:8080/"), Ok(http("/")));
        assert_eq!(
            probe("https://127.0.0.1:8443/ready"),
            Ok(Probe::Http {
                tls: true,
                path: "/ready".into()
            })
        );
        assert_eq!(probe("tcp://127.0.0.1:5432"), Ok(Probe::Tcp));
        assert_eq!(probe("tcp://localhost:5432/"), Ok(Probe::Tcp));
        let grpc = |service: &str| {
            Ok(Probe::Grpc {
                service: service.into(),
            })
        };
        assert_eq!(probe("grpc://127.0.0.1:9090"), grpc(""));
        assert_eq!(probe("grpc://[::1]:9090/"), grpc(""));
        assert_eq!(
            probe("grpc://127.0.0.1:9090/shop.v1.Orders"),
            grpc("shop.v1.Orders")
        );
        for bad in [
            "127.0.0.1:8080/healthz",
            "ftp://127.0.0.1:8080/",
            "http://127.0.0.1/healthz",
            "tcp://127.0.0.1:5432/healthz",
            "grpc://127.0.0.1:9090/a/b",
            "grpc://127.0.0.1:9090/a b",
            "grpc://app.example:9090",
            "tcp://10.0.0.7:5432",
            "http://:8080/",
            "http://u@127.0.0.1:8080/",
            "http://127.0.0.1:8080/a b",
            "http://127.0.0.1:8080/a\tb",
            "http://127.0.0.1:0/",
            "http://app.example:8080/healthz",
        ] {
            assert!(AppHealth::parse(bad, period, 3).is_err(), "{bad}");
        }
        assert!(AppHealth::parse("http://127.0.0.1:8080/", period, 0).is_err());
    }
}
