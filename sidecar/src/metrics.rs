//! Prometheus metrics, fed by the lease engine's telemetry hooks.

use std::time::Duration;

use leasehold_lease::{Error, Event, EventKind, Lock, Telemetry};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LockLabel {
    lock: String,
}

/// What a lock is, for joins in alerts and dashboards (an on-demand lock without a holder is
/// normal; a campaign lock without one is not).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InfoLabels {
    lock: String,
    backend: &'static str,
    mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    lock: String,
    reason: &'static str,
}

fn renew_histogram() -> Histogram {
    // 0.5 ms .. ~4 s
    Histogram::new(exponential_buckets(0.0005, 2.0, 14))
}

pub struct Metrics {
    registry: Registry,
    holder: Family<LockLabel, Gauge>,
    fencing_token: Family<LockLabel, Gauge>,
    acquisitions: Family<LockLabel, Counter>,
    losses: Family<LockLabel, Counter>,
    releases: Family<LockLabel, Counter>,
    renew_seconds: Family<LockLabel, Histogram, fn() -> Histogram>,
    backend_errors: Family<ErrorLabels, Counter>,
    info: Family<InfoLabels, Gauge>,
    lease_seconds: Family<LockLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("leasehold");
        let holder = Family::<LockLabel, Gauge>::default();
        let fencing_token = Family::<LockLabel, Gauge>::default();
        let acquisitions = Family::<LockLabel, Counter>::default();
        let losses = Family::<LockLabel, Counter>::default();
        let releases = Family::<LockLabel, Counter>::default();
        let renew_seconds = Family::<LockLabel, Histogram, fn() -> Histogram>::new_with_constructor(
            renew_histogram,
        );
        let backend_errors = Family::<ErrorLabels, Counter>::default();
        let info = Family::<InfoLabels, Gauge>::default();
        let lease_seconds = Family::default();
        registry.register(
            "lock_info",
            "1 for each lock this sidecar serves, with its backend and mode",
            info.clone(),
        );
        registry.register(
            "lease_duration_seconds",
            "The lock's lease duration",
            lease_seconds.clone(),
        );
        registry.register(
            "holder",
            "1 while this process holds the lock",
            holder.clone(),
        );
        registry.register(
            "fencing_token",
            "The fencing token of the current holding (0 when not holder)",
            fencing_token.clone(),
        );
        registry.register("acquisitions", "Leases acquired", acquisitions.clone());
        registry.register(
            "losses",
            "Leases lost without releasing (expired, taken over, backend down)",
            losses.clone(),
        );
        registry.register("releases", "Leases released voluntarily", releases.clone());
        registry.register(
            "renew_duration_seconds",
            "Latency of successful lease renewals",
            renew_seconds.clone(),
        );
        registry.register(
            "backend_errors",
            "Failed backend calls, by reason",
            backend_errors.clone(),
        );
        Self {
            registry,
            holder,
            fencing_token,
            acquisitions,
            losses,
            releases,
            renew_seconds,
            backend_errors,
            info,
            lease_seconds,
        }
    }

    /// Create every per-lock series up front, so dashboards see zeros rather than gaps.
    pub fn register_lock(&self, lock: &str) {
        let label = LockLabel {
            lock: lock.to_owned(),
        };
        let _ = self.holder.get_or_create(&label);
        let _ = self.fencing_token.get_or_create(&label);
        let _ = self.acquisitions.get_or_create(&label);
        let _ = self.losses.get_or_create(&label);
        let _ = self.releases.get_or_create(&label);
        let _ = self.renew_seconds.get_or_create(&label);
    }

    /// The text exposition, with the holder gauges read from the locks at scrape time (a paused
    /// process must not report a stale 1).
    pub fn render(&self, locks: &[Lock]) -> String {
        for lock in locks {
            let label = LockLabel {
                lock: lock.name().to_owned(),
            };
            let (holder, token) = match lock.answer() {
                leasehold_lease::Answer::Holder { token, .. } => (1, token as i64),
                _ => (0, 0),
            };
            self.holder.get_or_create(&label).set(holder);
            self.fencing_token.get_or_create(&label).set(token);
            let config = lock.config();
            self.lease_seconds
                .get_or_create(&label)
                .set(config.lease_duration.as_secs_f64());
            self.info
                .get_or_create(&InfoLabels {
                    lock: label.lock,
                    backend: lock.backend(),
                    mode: config.mode.as_str(),
                })
                .set(1);
        }
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Telemetry for Metrics {
    fn event(&self, event: &Event) {
        let label = LockLabel {
            lock: event.lock.clone(),
        };
        match event.kind {
            EventKind::Acquired => self.acquisitions.get_or_create(&label).inc(),
            EventKind::Lost => self.losses.get_or_create(&label).inc(),
            EventKind::Released => self.releases.get_or_create(&label).inc(),
        };
    }

    fn renewed(&self, lock: &str, latency: Duration) {
        self.renew_seconds
            .get_or_create(&LockLabel {
                lock: lock.to_owned(),
            })
            .observe(latency.as_secs_f64());
    }

    fn backend_error(&self, lock: &str, error: &Error) {
        self.backend_errors
            .get_or_create(&ErrorLabels {
                lock: lock.to_owned(),
                reason: error.label(),
            })
            .inc();
    }
}
