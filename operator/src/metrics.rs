//! The operator's Prometheus metrics: reconciliations by outcome, failures by error variant,
//! how long reconciliations take, and the webhook's answers.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabel {
    error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

pub struct Metrics {
    registry: Registry,
    admissions: Family<ResultLabel, Counter>,
    reconciliations: Counter,
    failures: Family<ErrorLabel, Counter>,
    duration: Histogram,
    leader: Gauge,
    certificate_expiry: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("leasehold_operator");
        let reconciliations = Counter::default();
        let failures = Family::<ErrorLabel, Counter>::default();
        // 1 ms .. ~16 s
        let duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        let leader = Gauge::default();
        let admissions = Family::<ResultLabel, Counter>::default();
        let certificate_expiry = Gauge::default();
        registry.register(
            "webhook_certificate_expiry_timestamp_seconds",
            "When the webhook's serving certificate ends (Unix seconds; 0 before one is loaded)",
            certificate_expiry.clone(),
        );
        registry.register(
            "admissions",
            "Pods the injection webhook answered for, by result (injected, unchanged, denied, malformed)",
            admissions.clone(),
        );
        registry.register(
            "reconciliations",
            "Reconciliations run",
            reconciliations.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Reconciliations that failed, by error (kube, backend, finalizer)",
            failures.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "How long one reconciliation took",
            duration.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica is the elected leader",
            leader.clone(),
        );
        Self {
            registry,
            admissions,
            reconciliations,
            failures,
            duration,
            leader,
            certificate_expiry,
        }
    }

    /// The gauge the webhook's serving certificate publishes its end on.
    pub fn certificate_expiry(&self) -> Gauge {
        self.certificate_expiry.clone()
    }

    pub fn reconciled(&self, took: Duration, error: Option<&'static str>) {
        self.reconciliations.inc();
        self.duration.observe(took.as_secs_f64());
        if let Some(error) = error {
            self.failures.get_or_create(&ErrorLabel { error }).inc();
        }
    }

    /// One webhook answer: `injected`, `unchanged`, `denied` or `malformed`.
    pub fn admitted(&self, result: &'static str) {
        self.admissions.get_or_create(&ResultLabel { result }).inc();
    }

    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("metrics encode");
        out
    }
}
