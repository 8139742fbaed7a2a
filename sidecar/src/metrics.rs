//! Prometheus metrics, fed by the lease engine's telemetry hooks.

use std::time::Duration;

use leasehold_lease::keyed::KeyedFamily;
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

/// A keyed family: its keys are never labels (they are chosen at run time, without bound).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FamilyLabel {
    family: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FamilyErrorLabels {
    family: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FamilyInfoLabels {
    family: String,
    backend: &'static str,
}

/// The per-family series, all labelled `family` only.
struct KeyedMetrics {
    info: Family<FamilyInfoLabels, Gauge>,
    held: Family<FamilyLabel, Gauge>,
    waiting: Family<FamilyLabel, Gauge>,
    max_keys: Family<FamilyLabel, Gauge>,
    acquisitions: Family<FamilyLabel, Counter>,
    contended: Family<FamilyLabel, Counter>,
    losses: Family<FamilyLabel, Counter>,
    releases: Family<FamilyLabel, Counter>,
    renew_seconds: Family<FamilyLabel, Histogram, fn() -> Histogram>,
    backend_errors: Family<FamilyErrorLabels, Counter>,
}

impl KeyedMetrics {
    fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            info: Family::default(),
            held: Family::default(),
            waiting: Family::default(),
            max_keys: Family::default(),
            acquisitions: Family::default(),
            contended: Family::default(),
            losses: Family::default(),
            releases: Family::default(),
            renew_seconds: Family::new_with_constructor(renew_histogram),
            backend_errors: Family::default(),
        };
        let keyed = registry.sub_registry_with_prefix("keyed");
        keyed.register(
            "family_info",
            "1 for each family of keyed locks this sidecar serves, with its backend",
            metrics.info.clone(),
        );
        keyed.register(
            "held_keys",
            "Keys of the family that this pod's owners hold now",
            metrics.held.clone(),
        );
        keyed.register(
            "waiting_owners",
            "Owners of this pod waiting for a key of the family now",
            metrics.waiting.clone(),
        );
        keyed.register(
            "max_keys",
            "How many keys of the family one sidecar may hold at once",
            metrics.max_keys.clone(),
        );
        keyed.register(
            "acquisitions",
            "Keys acquired (a re-entrant acquisition counts once)",
            metrics.acquisitions.clone(),
        );
        keyed.register(
            "contended",
            "Acquisitions refused because another owner held the key",
            metrics.contended.clone(),
        );
        keyed.register(
            "losses",
            "Keys lost without releasing (hold lapsed, lease expired, backend down)",
            metrics.losses.clone(),
        );
        keyed.register("releases", "Keys released", metrics.releases.clone());
        keyed.register(
            "renew_duration_seconds",
            "Latency of successful renewals of held keys",
            metrics.renew_seconds.clone(),
        );
        keyed.register(
            "backend_errors",
            "Failed backend calls for the family's keys, by reason",
            metrics.backend_errors.clone(),
        );
        metrics
    }

    fn label(family: &str) -> FamilyLabel {
        FamilyLabel {
            family: family.to_owned(),
        }
    }

    /// Create every per-family series up front, so dashboards see zeros rather than gaps.
    fn register_family(&self, family: &str) {
        let label = Self::label(family);
        let _ = self.acquisitions.get_or_create(&label);
        let _ = self.contended.get_or_create(&label);
        let _ = self.losses.get_or_create(&label);
        let _ = self.releases.get_or_create(&label);
        let _ = self.renew_seconds.get_or_create(&label);
    }

    fn read(&self, family: &KeyedFamily) {
        let config = family.config();
        let label = Self::label(family.name());
        self.register_family(family.name());
        self.held
            .get_or_create(&label)
            .set(family.held_keys() as i64);
        self.waiting
            .get_or_create(&label)
            .set(family.waiting_owners() as i64);
        self.max_keys
            .get_or_create(&label)
            .set(config.max_keys as i64);
        self.info
            .get_or_create(&FamilyInfoLabels {
                family: label.family,
                backend: family.backend(),
            })
            .set(1);
    }
}

fn renew_histogram() -> Histogram {
    // 0.5 ms .. ~4 s
    Histogram::new(exponential_buckets(0.0005, 2.0, 14))
}

pub struct Metrics {
    registry: Registry,
    holder: Family<LockLabel, Gauge>,
    permits: Family<LockLabel, Gauge>,
    fencing_token: Family<LockLabel, Gauge>,
    acquisitions: Family<LockLabel, Counter>,
    losses: Family<LockLabel, Counter>,
    releases: Family<LockLabel, Counter>,
    renew_seconds: Family<LockLabel, Histogram, fn() -> Histogram>,
    backend_errors: Family<ErrorLabels, Counter>,
    info: Family<InfoLabels, Gauge>,
    lease_seconds: Family<LockLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    keyed: KeyedMetrics,
    app_healthy: Gauge,
    app_probe_failures: Counter,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("leasehold");
        let holder = Family::<LockLabel, Gauge>::default();
        let permits = Family::<LockLabel, Gauge>::default();
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
            "lock_permits",
            "How many processes may hold the lock at once: its permits, or more while this sidecar holds a permit above a lowered count (a holding is never revoked by a lowering)",
            permits.clone(),
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
        let keyed = KeyedMetrics::register(&mut registry);
        let app_healthy = Gauge::default();
        app_healthy.set(1);
        registry.register(
            "app_healthy",
            "0 while the app's health probe (--app-health) fails enough in a row that campaign-mode locks sit out; 1 otherwise",
            app_healthy.clone(),
        );
        let app_probe_failures = Counter::default();
        registry.register(
            "app_probe_failures",
            "Failed probes of the app's health endpoint (--app-health)",
            app_probe_failures.clone(),
        );
        Self {
            registry,
            keyed,
            app_healthy,
            app_probe_failures,
            holder,
            permits,
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

    /// A probe of the app's health endpoint passed or failed.
    pub fn app_probed(&self, healthy: bool) {
        if !healthy {
            self.app_probe_failures.inc();
        }
    }

    /// Whether the locks sit out for the app's health.
    pub fn app_sitting_out(&self, sitting_out: bool) {
        self.app_healthy.set(i64::from(!sitting_out));
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
    /// process must not report a stale 1), and the families' gauges from the families.
    pub fn render(&self, locks: &[Lock], families: &[KeyedFamily]) -> String {
        for family in families {
            self.keyed.read(family);
        }
        for lock in locks {
            let label = LockLabel {
                lock: lock.name().to_owned(),
            };
            let (holder, token, above) = match lock.answer() {
                leasehold_lease::Answer::Holder { token, permit, .. } => {
                    (1, token as i64, permit.saturating_add(1))
                }
                _ => (0, 0, 0),
            };
            self.holder.get_or_create(&label).set(holder);
            // A holding on a permit above a lowered count is kept until it ends: until then
            // the lock admits as many holders as that permit's number says.
            self.permits
                .get_or_create(&label)
                .set(i64::from(lock.permits().max(above)));
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

    fn key_event(&self, family: &str, event: &Event) {
        let label = KeyedMetrics::label(family);
        let counter = match event.kind {
            EventKind::Acquired => &self.keyed.acquisitions,
            EventKind::Lost => &self.keyed.losses,
            EventKind::Released => &self.keyed.releases,
        };
        counter.get_or_create(&label).inc();
    }

    fn key_renewed(&self, family: &str, latency: Duration) {
        self.keyed
            .renew_seconds
            .get_or_create(&KeyedMetrics::label(family))
            .observe(latency.as_secs_f64());
    }

    fn key_backend_error(&self, family: &str, error: &Error) {
        self.keyed
            .backend_errors
            .get_or_create(&FamilyErrorLabels {
                family: family.to_owned(),
                reason: error.label(),
            })
            .inc();
    }

    fn key_contended(&self, family: &str) {
        self.keyed
            .contended
            .get_or_create(&KeyedMetrics::label(family))
            .inc();
    }
}
