//! `docs/reference/metrics.md` names exactly the metrics the sidecar registers: every one `/metrics`
//! describes, under the name a query uses (a counter's with `_total`).

use leasehold_sidecar::metrics::Metrics;
use leasehold_testkit::metrics_reference::{described, documented};

/// Every metric with a sample: a lock and a family served, and every hook called once.
async fn every_metric_sampled() -> String {
    use leasehold_lease::keyed::{FamilyConfig, KeyedFamily};
    use leasehold_lease::{Error, Event, EventKind, Lock, LockConfig, Telemetry};
    use std::time::{Duration, SystemTime};

    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let driver = leasehold_lease::connect(&leasehold_lease::BackendUrl::parse(&url).unwrap())
        .await
        .expect("sqlite");
    let metrics = std::sync::Arc::new(Metrics::new());
    let lock = Lock::start(
        driver.clone(),
        LockConfig::new("jobs", "pod-a", Duration::from_secs(15)),
        metrics.clone(),
    )
    .expect("lock");
    let family = KeyedFamily::new(
        driver,
        FamilyConfig::new("orders", "pod-a", Duration::from_secs(15)),
        metrics.clone(),
    )
    .expect("family");
    for kind in [EventKind::Acquired, EventKind::Lost, EventKind::Released] {
        let event = Event {
            kind,
            lock: "jobs".into(),
            token: 1,
            permit: 0,
            at: SystemTime::now(),
            reason: "test",
        };
        metrics.event(&event);
        metrics.key_event("orders", &event);
    }
    let error = Error::Timeout(Duration::from_secs(1));
    metrics.renewed("jobs", Duration::from_millis(1));
    metrics.backend_error("jobs", &error);
    metrics.key_renewed("orders", Duration::from_millis(1));
    metrics.key_backend_error("orders", &error);
    metrics.key_contended("orders");
    metrics.app_probed(false);
    let rendered = metrics.render(std::slice::from_ref(&lock), std::slice::from_ref(&family));
    lock.shutdown().await;
    family.shutdown().await;
    rendered
}

#[tokio::test]
async fn the_metrics_reference_names_exactly_the_sidecars_metrics() {
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/reference/metrics.md"
    ))
    .expect("docs/reference/metrics.md");
    let section = page
        .split("## The sidecar")
        .nth(1)
        .and_then(|rest| rest.split("## The operator").next())
        .expect("docs/reference/metrics.md has a section on the sidecar");
    let registered = described(&every_metric_sampled().await);
    assert_eq!(
        documented(section),
        registered,
        "docs/reference/metrics.md's sidecar tables against what the sidecar registers"
    );
}
