//! `--app-health URL`: step down when the app is unhealthy. The sidecar asks the app's own
//! health endpoint every `--app-health-period`; after `--app-health-failures` failures in a row
//! each campaign-mode lock sits out ([`Lock::sit_out`]): answers say "not holder" with the
//! reason at once, a lease held is released once the last answer's validity has run out, and
//! the lock is not campaigned for until the app answers healthy again. So a crash-looping app
//! stops keeping its peers from the lock, as a dead pod would. On-demand locks are the app's
//! own to release and are left alone.
//!
//! A probe is an HTTP GET on loopback, healthy when answered 200 to 399 within the period (as
//! the kubelet judges an `httpGet` probe).

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::{Lock, Mode};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::api::AppState;
use crate::metrics::Metrics;

/// The app's health endpoint and how it is judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppHealth {
    /// `HOST:PORT`.
    authority: String,
    /// `/path?query`.
    path: String,
    pub period: Duration,
    pub failures: u32,
}

impl AppHealth {
    /// `http://HOST:PORT/PATH`, the host on loopback (`127.0.0.1`, `localhost` or `[::1]`):
    /// the app runs in the sidecar's pod, or beside it.
    pub fn parse(raw: &str, period: Duration, failures: u32) -> Result<Self, String> {
        let bad = || {
            format!("{raw:?} is not http://HOST:PORT/PATH on loopback (the app's health endpoint)")
        };
        let rest = raw.strip_prefix("http://").ok_or_else(bad)?;
        let (authority, path) = match rest.find('/') {
            Some(at) => (&rest[..at], &rest[at..]),
            None => (rest, "/"),
        };
        let Some((host, port)) = authority.rsplit_once(':') else {
            return Err(bad());
        };
        let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
        let loopback = matches!(host, "127.0.0.1" | "localhost" | "[::1]");
        let path_ok = path.bytes().all(|b| b.is_ascii_graphic() && b != b'#');
        if !port_ok || !loopback || !path_ok {
            return Err(bad());
        }
        if failures == 0 {
            return Err("--app-health-failures must be at least 1".into());
        }
        if period.is_zero() {
            return Err("--app-health-period must be above zero".into());
        }
        Ok(Self {
            authority: authority.to_owned(),
            path: path.to_owned(),
            period,
            failures,
        })
    }

    /// One probe: `Ok` when healthy, else why not.
    async fn probe(&self) -> Result<(), String> {
        let ask = async {
            let mut conn = TcpStream::connect(&self.authority)
                .await
                .map_err(|e| format!("cannot connect: {e}"))?;
            let request = format!(
                "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: leasehold-sidecar\r\nConnection: close\r\n\r\n",
                self.path, self.authority
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
        };
        match tokio::time::timeout(self.period, ask).await {
            Ok(outcome) => outcome,
            Err(_) => Err(format!("no answer within {:?}", self.period)),
        }
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
                        "the app is unhealthy ({failed_in_a_row} probes of {}{} failed in a row, the last: {why})",
                        health.authority, health.path
                    );
                    // Every time: a lock put in place since (a spec change) sits out too. All at
                    // once: an engine answers between backend calls, which may each take a renew
                    // interval.
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
        assert_eq!(health.path, "/healthz?full=1");
        assert_eq!(
            AppHealth::parse("http://localhost:9000", period, 3)
                .unwrap()
                .path,
            "/"
        );
        assert!(AppHealth::parse("http://[::1]:8080/", period, 3).is_ok());
        for bad in [
            "127.0.0.1:8080/healthz",
            "https://127.0.0.1:8080/",
            "http://127.0.0.1/healthz",
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
