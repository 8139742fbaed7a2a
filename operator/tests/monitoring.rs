//! The chart's monitoring, rendered as Helm renders it: the PrometheusRule's alerts pass
//! `promtool check rules` and their unit tests (`promtool test rules`,
//! charts/tests/alerts_test.yaml); the PodMonitor and ServiceMonitor select what the webhook and
//! the chart really create (kubernetes-validate has no schema for prometheus-operator's kinds,
//! so their required fields are checked here); the Grafana dashboard is valid JSON whose queries
//! parse and name only metrics the sidecar and the operator export.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use serde_yaml::Value;
use support::{chart, root};

mod support;

fn rendered() -> Vec<Value> {
    rendered_with(&[])
}

/// The chart with every monitoring option on, then `sets` (`--set K=V` each).
fn rendered_with(sets: &[&str]) -> Vec<Value> {
    let values = root().join("charts/leasehold/ci/monitoring-values.yaml");
    let values = values.display().to_string();
    let mut args = vec!["render", "-f", &values];
    for set in sets {
        args.extend(["--set", set]);
    }
    let (ok, text) = chart(&args);
    assert!(ok, "helm render failed: {text}");
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect()
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .collect();
    assert_eq!(found.len(), 1, "one {kind}");
    found[0]
}

fn promtool(args: &[&str], dir: &Path) -> String {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "promtool is needed (apt-get install prometheus; scripts/install-test-deps): {e}"
            )
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "promtool {args:?}:\n{text}");
    text
}

#[test]
fn the_alerts_pass_promtool_and_their_unit_tests() {
    let docs = rendered();
    let rule = one(&docs, "PrometheusRule");
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(
        rule["metadata"]["labels"]["release"], "kube-prometheus-stack",
        "the chosen labels reach the rule"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("rules.yaml"),
        serde_yaml::to_string(&rule["spec"]).unwrap(),
    )
    .unwrap();
    let checked = promtool(&["check", "rules", "rules.yaml"], dir.path());
    assert!(checked.contains("SUCCESS: 7 rules found"), "{checked}");
    std::fs::copy(
        root().join("charts/tests/alerts_test.yaml"),
        dir.path().join("alerts_test.yaml"),
    )
    .unwrap();
    let tested = promtool(&["test", "rules", "alerts_test.yaml"], dir.path());
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// The alerts named in a rendered PrometheusRule.
fn alert_names(docs: &[Value]) -> Vec<String> {
    one(docs, "PrometheusRule")["spec"]["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap().iter())
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect()
}

/// `absent(up{job=...})` fires for ever where nothing scrapes the operator: it is only rendered
/// with the chart's ServiceMonitor, and the other alerts stay.
#[test]
fn the_operator_down_alert_needs_the_service_monitor() {
    let with = alert_names(&rendered());
    assert!(
        with.iter().any(|a| a == "LeaseholdOperatorDown"),
        "{with:?}"
    );
    let without = alert_names(&rendered_with(&["monitoring.serviceMonitor.enabled=false"]));
    assert!(
        !without.iter().any(|a| a == "LeaseholdOperatorDown"),
        "{without:?}"
    );
    assert_eq!(without.len(), with.len() - 1, "{without:?}");
}

#[test]
fn the_monitors_select_the_injected_sidecars_and_the_operators_metrics() {
    let docs = rendered();
    let pods = one(&docs, "PodMonitor");
    assert_eq!(pods["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(pods["spec"]["namespaceSelector"]["any"], true);
    assert_eq!(
        pods["spec"]["selector"]["matchLabels"][leasehold_operator::webhook::INJECTED_LABEL],
        "true",
        "the label the webhook puts on injected pods"
    );
    // The port the injected sidecar names, serving /metrics on the pod IP.
    let endpoint = &pods["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["port"], "leasehold-probe");
    assert_eq!(endpoint["path"], "/metrics");
    let sidecar = serde_json::to_value(leasehold_operator::webhook::sidecar(
        "team",
        &["jobs".to_owned()],
        &leasehold_operator::webhook::Injection::new("leasehold/leasehold:0.1.0", true),
        leasehold_operator::webhook::Ports::default(),
    ))
    .unwrap();
    assert_eq!(sidecar["ports"][0]["name"], "leasehold-probe");
    assert!(
        sidecar["args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--probe-listen"),
        "{sidecar}"
    );

    let service_monitor = one(&docs, "ServiceMonitor");
    let selector = service_monitor["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .unwrap();
    let services: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == "Service")
        .filter(|s| {
            selector
                .iter()
                .all(|(k, v)| s["metadata"]["labels"].get(k) == Some(v))
        })
        .collect();
    assert_eq!(services.len(), 1, "exactly the metrics Service is selected");
    let port = &service_monitor["spec"]["endpoints"][0]["port"];
    assert!(
        services[0]["spec"]["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|p| &p["name"] == port),
        "the ServiceMonitor's port {port:?} is on the Service"
    );
    // The operator alert's job is that Service's name, as prometheus-operator sets it.
    let rule = serde_yaml::to_string(&one(&docs, "PrometheusRule")["spec"]).unwrap();
    let job = services[0]["metadata"]["name"].as_str().unwrap();
    assert!(rule.contains(&format!("job=\"{job}\"")), "{rule}");
}

/// Every metric name a query mentions (`leasehold_...`, histogram suffixes removed).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("leasehold_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let name = &expr[start..end];
        names.insert(name.trim_end_matches("_bucket").to_owned());
        i = end;
    }
    names
}

/// The metric names the sidecar (with one lock and one keyed family) and the operator export.
async fn exported_names() -> BTreeSet<String> {
    let harness = leasehold_testkit::SqliteHarness::new();
    let driver = leasehold_testkit::Harness::driver(&harness).await;
    let lock = leasehold_lease::Lock::start(
        driver,
        leasehold_lease::LockConfig::new("jobs", "pod-a", std::time::Duration::from_secs(5)),
        Arc::new(()),
    )
    .unwrap();
    let family = leasehold_lease::keyed::KeyedFamily::new(
        leasehold_testkit::Harness::driver(&harness).await,
        leasehold_lease::keyed::FamilyConfig::new(
            "orders",
            "pod-a",
            std::time::Duration::from_secs(5),
        ),
        Arc::new(()),
    )
    .unwrap();
    let sidecar = leasehold_sidecar::metrics::Metrics::new();
    sidecar.register_lock("jobs");
    leasehold_lease::Telemetry::key_backend_error(
        &sidecar,
        "orders",
        &leasehold_lease::Error::Unreachable("down".into()),
    );
    // Families with no series yet are not exported at all: give each one.
    leasehold_lease::Telemetry::backend_error(
        &sidecar,
        "jobs",
        &leasehold_lease::Error::Unreachable("down".into()),
    );
    let operator = leasehold_operator::metrics::Metrics::new();
    operator.admitted("injected");
    operator.reconciled(std::time::Duration::from_millis(1), Some("kube"));
    let text = sidecar.render(std::slice::from_ref(&lock), std::slice::from_ref(&family))
        + &operator.render();
    lock.shutdown().await;
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .flat_map(|name| {
            // OpenMetrics names counters without `_total` in TYPE lines.
            [name.to_owned(), format!("{name}_total")]
        })
        .collect()
}

#[tokio::test]
async fn the_dashboard_is_valid_and_queries_only_exported_metrics() {
    let docs = rendered();
    let config_map = one(&docs, "ConfigMap");
    assert_eq!(config_map["metadata"]["labels"]["grafana_dashboard"], "1");
    let text = config_map["data"]["leasehold.json"].as_str().unwrap();
    assert_eq!(
        text.trim(),
        std::fs::read_to_string(root().join("charts/leasehold/files/dashboard.json"))
            .unwrap()
            .trim(),
        "the ConfigMap carries the dashboard file unchanged"
    );
    let dashboard: serde_json::Value = serde_json::from_str(text).expect("dashboard JSON");
    assert_eq!(dashboard["uid"], "leasehold-locks");
    let panels = dashboard["panels"].as_array().unwrap();
    assert!(panels.len() >= 5);
    let mut exprs = Vec::new();
    for panel in panels {
        let targets = panel["targets"].as_array().expect("panel targets");
        assert!(!targets.is_empty(), "{} has no query", panel["title"]);
        for target in targets {
            exprs.push(target["expr"].as_str().expect("a PromQL expr").to_owned());
        }
        let grid = &panel["gridPos"];
        assert!(grid["w"].as_u64().unwrap() > 0 && grid["h"].as_u64().unwrap() > 0);
    }
    for variable in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(query) = variable["definition"].as_str() {
            exprs.push(
                query
                    .trim_start_matches("label_values(")
                    .rsplit_once(',')
                    .unwrap()
                    .0
                    .to_owned(),
            );
        }
    }
    // Every query parses: promtool checks them as recording rules, with the dashboard's
    // variables as Grafana would fill them for "All".
    let rules = serde_json::json!({"groups": [{"name": "dashboard", "rules": exprs.iter().enumerate()
        .map(|(i, e)| serde_json::json!({"record": format!("dashboard:query{i}"),
            "expr": e.replace("$namespace", ".*").replace("$lock", ".*")}))
        .collect::<Vec<_>>()}]});
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("dashboard.yaml"),
        serde_yaml::to_string(&rules).unwrap(),
    )
    .unwrap();
    promtool(&["check", "rules", "dashboard.yaml"], dir.path());

    let exported = exported_names().await;
    let rule = serde_yaml::to_string(&one(&docs, "PrometheusRule")["spec"]).unwrap();
    for name in exprs
        .iter()
        .flat_map(|e| metric_names(e))
        .chain(metric_names(&rule))
    {
        assert!(
            exported.contains(&name),
            "{name} is queried but not exported; exported: {exported:?}"
        );
    }
}
