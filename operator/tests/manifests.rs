//! The Helm chart and the kustomize bases: the chart lints, renders and validates against the
//! Kubernetes schemas with Helm's own engine (`charts/check.py`, helm-python-sdk and
//! kubernetes-validate), the kustomize bases render with the real `kubectl kustomize`, both ship
//! the generated CRD unchanged, and both keep the security promises: least-privilege RBAC,
//! non-root read-only containers, a webhook that only annotated pods outside the operator's
//! namespace and kube-system reach.

use std::path::Path;
use std::process::Command;

use serde_yaml::Value;
use support::{chart, root};

mod support;

fn render(dir: &str) -> Vec<Value> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let output = Command::new("kubectl")
        .arg("kustomize")
        .arg(root.join(dir))
        .output()
        .unwrap_or_else(|e| panic!("kubectl is needed to render {dir} (install kubectl): {e}"));
    assert!(
        output.status.success(),
        "kubectl kustomize {dir} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect()
}

fn ci_values(name: &str) -> String {
    root()
        .join("charts/leasehold/ci")
        .join(name)
        .display()
        .to_string()
}

/// The chart rendered with `args` (`-f FILE`, `--set K=V`).
fn render_chart(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["render"];
    all.extend_from_slice(args);
    let (ok, text) = chart(&all);
    assert!(ok, "helm render failed: {text}");
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .collect()
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_sequence()
        .map(|s| s.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

#[test]
fn the_operator_base_renders_with_the_generated_crd() {
    let docs = render("operator/config");
    let crds = of_kind(&docs, "CustomResourceDefinition");
    assert_eq!(crds.len(), 1);
    let generated: Value = serde_yaml::from_str(&leasehold_crds_yaml()).unwrap();
    let mut rendered = crds[0].clone();
    // kustomize adds the common label; everything else must be the generated CRD.
    rendered["metadata"]
        .as_mapping_mut()
        .unwrap()
        .remove("labels");
    // Compared with numbers as numbers: kubectl writes `15` where the generator wrote `15.0`.
    assert!(
        numbers_as_f64(rendered) == numbers_as_f64(generated),
        "operator/config's CRD differs from crds/distributedlock.yaml"
    );
    for kind in [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "MutatingWebhookConfiguration",
        "PodDisruptionBudget",
    ] {
        assert_eq!(of_kind(&docs, kind).len(), 1, "{kind}");
    }
    assert_eq!(of_kind(&docs, "Service").len(), 2, "webhook and metrics");
}

#[test]
fn the_chart_ships_the_generated_crd_byte_for_byte() {
    let shipped =
        std::fs::read_to_string(root().join("charts/leasehold/crds/distributedlock.yaml")).unwrap();
    assert!(
        shipped == leasehold_crds_yaml(),
        "charts/leasehold/crds/distributedlock.yaml differs from crds/distributedlock.yaml: \
         cp crds/distributedlock.yaml charts/leasehold/crds/"
    );
}

#[test]
fn the_chart_lints_and_validates_against_the_kubernetes_schemas() {
    let variants = [
        "default-values.yaml",
        "cert-manager-values.yaml",
        "older-cluster-values.yaml",
        "monitoring-values.yaml",
        "watch-namespace-values.yaml",
        "reachability-values.yaml",
        "platform-values.yaml",
    ];
    let files: Vec<String> = variants.iter().map(|v| ci_values(v)).collect();
    let mut lint = vec!["lint"];
    lint.extend(files.iter().map(String::as_str));
    let (ok, text) = chart(&lint);
    assert!(ok, "helm lint --strict: {text}");
    for file in &files {
        let (ok, text) = chart(&["validate", "-f", file]);
        assert!(ok, "{file}: {text}");
        // Every object was looked at, the CRD included.
        assert!(
            text.contains("Deployment/leasehold-operator: valid"),
            "{text}"
        );
        assert!(
            text.contains("CustomResourceDefinition/distributedlocks.leasehold.dev: valid"),
            "{text}"
        );
        assert!(!text.contains("INVALID"), "{text}");
    }
}

#[test]
fn bad_values_are_refused_by_the_schema_with_the_key_named() {
    for (set, key) in [
        ("webhook.failurePolicy=Sometimes", "/webhook/failurePolicy"),
        ("sidecar.mode=daemon", "/sidecar/mode"),
        ("operator.replicas=0", "/operator/replicas"),
        (
            "webhook.excludeNamespaces[0]=Not_A_Namespace",
            "/webhook/excludeNamespaces/0",
        ),
        ("webhook.typo=1", "typo"),
        // The webhook's own look-ups take up to 3 s; under 5 s the API server would give up on
        // it first and refuse annotated pods.
        ("webhook.timeoutSeconds=3", "/webhook/timeoutSeconds"),
    ] {
        let (ok, text) = chart(&["schema", "--set", set]);
        assert!(!ok, "{set} was accepted");
        assert!(text.contains(key), "{set}: {text}");
    }
    let (ok, text) = chart(&["schema", "--set", "webhook.failurePolicy=Ignore"]);
    assert!(ok, "{text}");
}

#[test]
fn the_kustomize_copy_of_the_chart_is_current() {
    let (ok, text) = chart(&["--no-hooks", "render"]);
    assert!(ok, "{text}");
    let committed = std::fs::read_to_string(root().join("operator/config/leasehold.yaml")).unwrap();
    let body = committed
        .lines()
        .skip_while(|l| l.starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        body.trim_end() == text.trim_end(),
        "operator/config/leasehold.yaml is stale: run charts/check.py kustomize"
    );
}

fn webhook_of(docs: &[Value]) -> &Value {
    let configurations = of_kind(docs, "MutatingWebhookConfiguration");
    assert_eq!(configurations.len(), 1);
    let webhooks = configurations[0]["webhooks"].as_sequence().unwrap();
    assert_eq!(webhooks.len(), 1);
    &webhooks[0]
}

/// The operator's arguments in the chart's Deployment, which its own flag parser must accept.
fn operator_args(docs: &[Value]) -> Vec<String> {
    use clap::Parser;
    let deployment = of_kind(docs, "Deployment")[0];
    let args: Vec<String> =
        strings(&deployment["spec"]["template"]["spec"]["containers"][0]["args"])
            .into_iter()
            .map(str::to_owned)
            .collect();
    let argv = std::iter::once("leasehold-operator".to_owned()).chain(args.clone());
    if let Err(e) = leasehold_operator::config::Config::try_parse_from(argv) {
        panic!("the operator refuses the chart's arguments {args:?}: {e}");
    }
    args
}

#[test]
fn only_annotated_pods_outside_the_operator_and_kube_system_reach_the_webhook() {
    let docs = render_chart(&["--set", "webhook.excludeNamespaces={batch,no,on}"]);
    let webhook = webhook_of(&docs);
    assert_eq!(webhook["failurePolicy"].as_str(), Some("Fail"));
    assert_eq!(webhook["sideEffects"].as_str(), Some("None"));
    assert_eq!(
        webhook["clientConfig"]["service"]["path"].as_str(),
        Some(leasehold_operator::webhook_server::MUTATE_PATH)
    );
    assert_eq!(
        webhook["clientConfig"]["service"]["name"].as_str(),
        Some("leasehold-webhook")
    );
    let rule = &webhook["rules"][0];
    assert_eq!(strings(&rule["resources"]), ["pods"]);
    assert_eq!(strings(&rule["operations"]), ["CREATE"]);
    let excluded = &webhook["namespaceSelector"]["matchExpressions"][0];
    assert_eq!(
        excluded["key"].as_str(),
        Some("kubernetes.io/metadata.name")
    );
    assert_eq!(excluded["operator"].as_str(), Some("NotIn"));
    assert_eq!(
        strings(&excluded["values"]),
        ["leasehold-system", "kube-system", "batch", "no", "on"],
        "namespace names are strings, never booleans"
    );
    let condition = webhook["matchConditions"][0]["expression"]
        .as_str()
        .unwrap();
    assert!(
        condition.contains(&format!("'{}'", leasehold_operator::webhook::ANNOTATION)),
        "{condition}"
    );
    // The operator is told the names the chart gave, and issues its own certificate.
    let args = operator_args(&docs);
    for wanted in [
        "--webhook-service=leasehold-webhook",
        "--webhook-configuration=leasehold",
        "--webhook-secret=leasehold-webhook-tls",
        "--sidecar-mode=native",
        "--sidecar-image=leasehold.invalid/leasehold:0.1.0",
    ] {
        assert!(args.iter().any(|a| a == wanted), "{wanted} not in {args:?}");
    }
    assert!(of_kind(&docs, "Certificate").is_empty());

    let older = render_chart(&["-f", &ci_values("older-cluster-values.yaml")]);
    let webhook = webhook_of(&older);
    assert_eq!(webhook["failurePolicy"].as_str(), Some("Ignore"));
    assert!(webhook["matchConditions"].is_null());
    assert_eq!(
        webhook["objectSelector"]["matchLabels"]["leasehold.dev/inject"].as_str(),
        Some("true")
    );
    assert!(operator_args(&older).contains(&"--sidecar-mode=container".to_owned()));
    // Without match conditions or a selector, every pod created in the cluster would wait on
    // the webhook: refused with what to set.
    let (ok, text) = chart(&["render", "--set", "webhook.matchConditions=false"]);
    assert!(
        !ok && text.contains("needs a webhook.objectSelector"),
        "{text}"
    );
    // Watched namespaces scope it as well.
    let scoped = render_chart(&[
        "--set",
        "webhook.matchConditions=false",
        "--set",
        "operator.watchNamespaces={team}",
    ]);
    assert!(webhook_of(&scoped)["matchConditions"].is_null());
    assert!(
        of_kind(&older, "PodDisruptionBudget").is_empty(),
        "no PDB for one replica: it would block every drain"
    );
}

/// The PodDisruptionBudget guards evictions only; the replicas must also be on different nodes
/// whenever the cluster has several, or one node's loss takes every webhook replica.
#[test]
fn webhook_replicas_are_spread_over_nodes() {
    let docs = render_chart(&[]);
    let deployment = of_kind(&docs, "Deployment")[0];
    let spec = &deployment["spec"]["template"]["spec"];
    let spread = &spec["topologySpreadConstraints"][0];
    assert_eq!(
        spread["topologyKey"].as_str(),
        Some("kubernetes.io/hostname")
    );
    assert_eq!(spread["whenUnsatisfiable"].as_str(), Some("DoNotSchedule"));
    assert_eq!(spread["maxSkew"].as_i64(), Some(1));
    // A tainted node (a control plane) is no empty domain that would hold a replica Pending,
    // and a rollout's surge pod is spread among its own ReplicaSet's pods only.
    assert_eq!(spread["nodeTaintsPolicy"].as_str(), Some("Honor"));
    assert_eq!(strings(&spread["matchLabelKeys"]), ["pod-template-hash"]);
    assert_eq!(
        spread["labelSelector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );
    let zones = &spec["topologySpreadConstraints"][1];
    assert_eq!(
        zones["topologyKey"].as_str(),
        Some("topology.kubernetes.io/zone")
    );
    assert_eq!(
        zones["whenUnsatisfiable"].as_str(),
        Some("ScheduleAnyway"),
        "a cluster in one zone, or with unlabelled nodes, still schedules both replicas"
    );
    let budget = of_kind(&docs, "PodDisruptionBudget");
    assert_eq!(budget.len(), 1);
    assert_eq!(
        budget[0]["spec"]["unhealthyPodEvictionPolicy"].as_str(),
        Some("AlwaysAllow"),
        "replicas that crash-loop must not hold every node drain"
    );
}

#[test]
fn with_cert_manager_the_certificate_is_mounted_and_the_operator_writes_neither_secret_nor_webhook()
{
    let docs = render_chart(&["-f", &ci_values("cert-manager-values.yaml")]);
    let named = |kind: &str, name: &str| {
        of_kind(&docs, kind)
            .into_iter()
            .find(|d| d["metadata"]["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    };
    assert_eq!(of_kind(&docs, "Certificate").len(), 2);
    let certificate = named("Certificate", "leasehold-webhook");
    assert_eq!(
        certificate["spec"]["secretName"].as_str(),
        Some("leasehold-webhook-tls")
    );
    assert_eq!(
        strings(&certificate["spec"]["dnsNames"]),
        [
            "leasehold-webhook.leasehold-system.svc",
            "leasehold-webhook.leasehold-system.svc.cluster.local"
        ]
    );
    // The standard chain: self-signed issuer, CA certificate, CA issuer, serving certificate.
    // The caBundle cert-manager injects is then the CA, the same across serving renewals.
    let ca_issuer = named(
        "Issuer",
        certificate["spec"]["issuerRef"]["name"].as_str().unwrap(),
    );
    let ca = named("Certificate", "leasehold-webhook-ca");
    assert_eq!(ca["spec"]["isCA"], Value::Bool(true));
    assert_eq!(
        ca_issuer["spec"]["ca"]["secretName"],
        ca["spec"]["secretName"]
    );
    let self_signed = named("Issuer", ca["spec"]["issuerRef"]["name"].as_str().unwrap());
    assert!(
        self_signed["spec"]["selfSigned"].is_mapping(),
        "{self_signed:?}"
    );
    assert_ne!(ca["spec"]["secretName"], certificate["spec"]["secretName"]);
    let configuration = of_kind(&docs, "MutatingWebhookConfiguration")[0];
    assert_eq!(
        configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].as_str(),
        Some("leasehold-system/leasehold-webhook"),
        "cert-manager's CA injector names the Certificate"
    );
    let args = operator_args(&docs);
    assert!(args.contains(&"--webhook-cert-dir=/etc/leasehold/webhook-tls".to_owned()));
    assert!(!args.iter().any(|a| a.starts_with("--webhook-secret")));
    let pod = &of_kind(&docs, "Deployment")[0]["spec"]["template"]["spec"];
    assert_eq!(
        pod["volumes"][0]["secret"]["secretName"].as_str(),
        Some("leasehold-webhook-tls")
    );
    assert_eq!(
        pod["containers"][0]["volumeMounts"][0]["readOnly"],
        Value::Bool(true)
    );
    for role in of_kind(&docs, "ClusterRole")
        .into_iter()
        .chain(of_kind(&docs, "Role"))
    {
        for rule in role["rules"].as_sequence().unwrap() {
            let resources = strings(&rule["resources"]);
            assert!(
                !resources.contains(&"mutatingwebhookconfigurations"),
                "{rule:?}"
            );
            if resources.contains(&"secrets") {
                assert_eq!(strings(&rule["verbs"]), ["get"], "{rule:?}");
            }
        }
    }

    let existing = render_chart(&[
        "-f",
        &ci_values("cert-manager-values.yaml"),
        "--set",
        "webhook.certManager.issuerRef.name=corp-ca",
        "--set",
        "webhook.certManager.issuerRef.kind=ClusterIssuer",
    ]);
    assert!(of_kind(&existing, "Issuer").is_empty());
    assert_eq!(of_kind(&existing, "Certificate").len(), 1);
    let certificate = of_kind(&existing, "Certificate")[0];
    assert_eq!(
        certificate["spec"]["issuerRef"]["kind"].as_str(),
        Some("ClusterIssuer")
    );
}

fn numbers_as_f64(v: Value) -> Value {
    match v {
        Value::Number(n) => Value::Number(n.as_f64().unwrap_or(f64::NAN).into()),
        Value::Sequence(s) => Value::Sequence(s.into_iter().map(numbers_as_f64).collect()),
        Value::Mapping(m) => {
            Value::Mapping(m.into_iter().map(|(k, v)| (k, numbers_as_f64(v))).collect())
        }
        other => other,
    }
}

fn leasehold_crds_yaml() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/distributedlock.yaml");
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn rbac_is_least_privilege() {
    let variants = [
        render("operator/config"),
        render_chart(&[]),
        render_chart(&["-f", &ci_values("cert-manager-values.yaml")]),
    ];
    for docs in &variants {
        operator_rbac_is_least_privilege(docs);
    }
    sidecar_rbac_is_least_privilege();
}

fn operator_rbac_is_least_privilege(docs: &[Value]) {
    for doc in of_kind(docs, "ClusterRole")
        .into_iter()
        .chain(of_kind(docs, "Role"))
    {
        let cluster_wide = doc["kind"].as_str() == Some("ClusterRole");
        for rule in doc["rules"].as_sequence().unwrap() {
            for field in ["apiGroups", "resources", "verbs"] {
                assert!(
                    !strings(&rule[field]).contains(&"*"),
                    "wildcard in {rule:?}"
                );
            }
            let resources = strings(&rule["resources"]);
            let verbs = strings(&rule["verbs"]);
            let named = !strings(&rule["resourceNames"]).is_empty();
            if resources.contains(&"secrets") && cluster_wide {
                assert_eq!(
                    verbs,
                    ["get"],
                    "the operator reads only the Secrets it is pointed at"
                );
            }
            if resources.contains(&"secrets") && !cluster_wide {
                // Its own webhook Secret: created (RBAC cannot name what does not exist yet),
                // then read and updated by name only.
                assert!(verbs == ["create"] || named, "{rule:?}");
            }
            if resources.contains(&"mutatingwebhookconfigurations") {
                assert!(named, "only its own webhook configuration: {rule:?}");
                assert_eq!(verbs, ["get", "update"]);
            }
            if resources.iter().any(|r| r.ends_with("/status")) {
                assert_eq!(verbs, ["patch"]);
            }
            assert!(
                !verbs.contains(&"escalate")
                    && !verbs.contains(&"bind")
                    && !verbs.contains(&"impersonate")
            );
        }
    }
}

fn sidecar_rbac_is_least_privilege() {
    let sidecar = render("operator/config/sidecar-rbac");
    let role = of_kind(&sidecar, "Role")[0];
    for rule in role["rules"].as_sequence().unwrap() {
        let resources = strings(&rule["resources"]);
        let verbs = strings(&rule["verbs"]);
        // Pods are read only in container mode (the rule is left to add, commented): with
        // native sidecars, the default, no pod of the namespace is the sidecar's to read.
        assert!(!resources.contains(&"pods"), "{rule:?}");
        // Everything but creating a Lease is limited to named objects.
        if verbs != ["create"] {
            assert!(
                !strings(&rule["resourceNames"]).is_empty(),
                "unnamed access: {rule:?}"
            );
        }
        if resources.contains(&"secrets") {
            assert_eq!(verbs, ["get"]);
        }
        assert!(
            !verbs.contains(&"delete") && !verbs.contains(&"patch"),
            "{rule:?}"
        );
    }
}

#[test]
fn the_operator_runs_non_root_on_a_read_only_root() {
    for docs in [
        render("operator/config"),
        render_chart(&["-f", &ci_values("cert-manager-values.yaml")]),
    ] {
        operator_runs_non_root_on_a_read_only_root(&docs);
    }
}

fn operator_runs_non_root_on_a_read_only_root(docs: &[Value]) {
    let deployment = of_kind(docs, "Deployment")[0];
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], Value::Bool(true));
    assert_eq!(
        pod["serviceAccountName"].as_str(),
        Some("leasehold-operator")
    );
    for container in pod["containers"].as_sequence().unwrap() {
        let sc = &container["securityContext"];
        assert_eq!(sc["readOnlyRootFilesystem"], Value::Bool(true));
        assert_eq!(sc["allowPrivilegeEscalation"], Value::Bool(false));
        assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"]);
        assert!(
            container["resources"]["limits"]["memory"]
                .as_str()
                .is_some()
        );
        assert_eq!(
            container["readinessProbe"]["httpGet"]["path"].as_str(),
            Some("/readyz")
        );
    }
}

/// Native sidecars need Kubernetes 1.29: on 1.28 the chart refuses the default mode with what
/// to set instead, and installs in container mode. (Helm's lint, the one place its offline
/// engine takes a cluster version, reports a template's `fail` without failing.)
#[test]
fn kubernetes_1_28_is_told_to_use_container_mode() {
    let refusal = "sidecar.mode=native needs Kubernetes 1.29 or later";
    let (_, text) = chart(&[
        "--kube-version",
        "1.28.5",
        "lint",
        &ci_values("default-values.yaml"),
    ]);
    assert!(text.contains(refusal), "{text}");
    assert!(text.contains("set sidecar.mode=container"), "{text}");
    for (version, values) in [
        ("1.28.5", "older-cluster-values.yaml"),
        ("1.29.0", "default-values.yaml"),
    ] {
        let (ok, text) = chart(&["--kube-version", version, "lint", &ci_values(values)]);
        assert!(ok && !text.contains(refusal), "{version} {values}: {text}");
    }
}

/// `helm uninstall` first stops the operator, then releases every lock's finalizer (records
/// kept), with RBAC that exists only while it runs; the kustomize copy, which `kubectl apply` would run at once, has no hook.
#[test]
fn uninstalling_releases_the_finalizers_first() {
    let docs = render_chart(&[]);
    let job = of_kind(&docs, "Job")
        .into_iter()
        .find(|j| j["metadata"]["name"].as_str() == Some("leasehold-operator-uninstall"))
        .expect("the uninstall Job");
    assert_eq!(
        job["metadata"]["annotations"]["helm.sh/hook"].as_str(),
        Some("pre-delete")
    );
    let container = &job["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        strings(&container["args"])[0],
        "--release-finalizers",
        "{container:?}"
    );
    assert_eq!(
        container["securityContext"]["readOnlyRootFilesystem"].as_bool(),
        Some(true)
    );
    // It stops the operator first (a running operator adds its finalizer back), by the
    // Deployment's name and its pods' labels.
    let args = strings(&container["args"]);
    assert!(
        args.contains(&"--operator-deployment=leasehold-operator"),
        "{args:?}"
    );
    let deployment = of_kind(&docs, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"].as_str() == Some("leasehold-operator"))
        .expect("the operator's Deployment");
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    let selector = args
        .iter()
        .find_map(|a| a.strip_prefix("--operator-pods="))
        .expect("--operator-pods");
    for requirement in selector.split(',') {
        let (key, value) = requirement.split_once('=').expect("key=value");
        assert_eq!(
            labels[key].as_str(),
            Some(value),
            "{selector} against {labels:?}"
        );
    }
    for kind in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ] {
        let hooked = of_kind(&docs, kind).into_iter().any(|d| {
            d["metadata"]["name"].as_str() == Some("leasehold-operator-uninstall")
                && d["metadata"]["annotations"]["helm.sh/hook"].as_str() == Some("pre-delete")
        });
        assert!(hooked, "no pre-delete {kind}");
    }
    let kustomize = render("operator/config");
    assert!(
        !kustomize
            .iter()
            .any(|d| d["metadata"]["name"].as_str() == Some("leasehold-operator-uninstall")),
        "a hook in the kustomize copy would run at apply time"
    );
    let off = render_chart(&["--set", "uninstall.releaseFinalizers=false"]);
    assert!(of_kind(&off, "Job").is_empty());
}

/// Where the API server cannot reach pod IPs (an overlay CNI on EKS), a private control plane
/// reaches only some ports (GKE), or a namespace denies ingress by default, the webhook is
/// reachable by values: the node's network (with cluster DNS kept), a priority class, and a
/// NetworkPolicy admitting the webhook and metrics ports only. None of it by default.
#[test]
fn the_webhook_is_reachable_by_values_where_pod_ips_are_not() {
    let kind = |docs: &[Value], kind: &str| -> Option<Value> {
        docs.iter().find(|d| d["kind"] == kind).cloned()
    };
    let default = render_chart(&[]);
    let pod = &kind(&default, "Deployment").unwrap()["spec"]["template"]["spec"];
    assert!(
        pod["hostNetwork"].is_null() && pod["priorityClassName"].is_null(),
        "{pod:?}"
    );
    assert!(kind(&default, "NetworkPolicy").is_none());

    let reachable = render_chart(&["-f", &ci_values("reachability-values.yaml")]);
    let deployment = kind(&reachable, "Deployment").unwrap();
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
    assert_eq!(pod["priorityClassName"], "system-cluster-critical");
    // On the node's ports a surge pod would find no node free: replicas are replaced one by one.
    let rolling = &deployment["spec"]["strategy"]["rollingUpdate"];
    assert_eq!(
        (&rolling["maxSurge"], &rolling["maxUnavailable"]),
        (&Value::from(0), &Value::from(1))
    );
    assert!(
        kind(&default, "Deployment").unwrap()["spec"]["strategy"].is_null(),
        "on the pod network a rollout surges"
    );
    let single = render_chart(&[
        "-f",
        &ci_values("reachability-values.yaml"),
        "--set",
        "operator.replicas=1",
    ]);
    assert!(
        kind(&single, "Deployment").unwrap()["spec"]["strategy"].is_null(),
        "a single replica surges, or every rollout would take the webhook down"
    );
    let args = serde_yaml::to_string(&pod["containers"][0]["args"]).unwrap();
    assert!(args.contains("--webhook-listen=[::]:9443"), "{args}");
    assert!(args.contains("--metrics-listen=[::]:18080"), "{args}");
    let policy = kind(&reachable, "NetworkPolicy").expect("a NetworkPolicy");
    assert_eq!(policy["spec"]["policyTypes"][0], "Ingress");
    assert!(policy["spec"]["policyTypes"][1].is_null(), "ingress only");
    let ingress = policy["spec"]["ingress"].as_sequence().unwrap();
    assert_eq!(ingress[0]["ports"][0]["port"], 9443);
    assert_eq!(ingress[0]["from"][0]["ipBlock"]["cidr"], "10.0.0.0/8");
    assert_eq!(ingress[1]["ports"][0]["port"], 18080);
    assert!(ingress[1]["from"].is_null(), "metrics from any source");
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );

    // The kubelet's port on the node's network is refused with the reason.
    let (ok, text) = chart(&[
        "render",
        "--set",
        "operator.hostNetwork=true",
        "--set",
        "webhook.port=10250",
    ]);
    assert!(!ok && text.contains("10250 is the kubelet's"), "{text}");
}

/// As a subchart, the chart gets its parent's `global` values, which its schema accepts; a
/// dashboard without extra labels still renders valid labels.
#[test]
fn the_chart_works_as_a_subchart_and_without_dashboard_labels() {
    let (ok, text) = chart(&["schema", "--set", "global.imageRegistry=registry.example"]);
    assert!(ok, "the schema refuses a parent's global values: {text}");
    let docs = render_chart(&[
        "--set",
        "monitoring.grafanaDashboard.enabled=true",
        "--set",
        "monitoring.grafanaDashboard.labels=null",
    ]);
    let dashboard = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["data"]["leasehold.json"].is_string())
        .or_else(|| docs.iter().find(|d| d["kind"] == "ConfigMap"))
        .expect("the dashboard's ConfigMap");
    assert!(
        dashboard["metadata"]["labels"].is_mapping(),
        "{:?}",
        dashboard["metadata"]
    );
}

/// No image is published: the chart's default names a registry no one can run (the `.invalid`
/// domain never resolves), for the operator and the injected sidecar alike, so that an install
/// left at it pulls nobody's image. A name on a public registry could be taken by anyone.
#[test]
fn the_default_image_names_a_registry_that_cannot_exist() {
    let docs = render_chart(&[]);
    let deployment = of_kind(&docs, "Deployment")[0];
    let image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap()
        .to_owned();
    let registry = image.split('/').next().unwrap();
    assert!(registry.ends_with(".invalid"), "{image}");
    assert!(
        operator_args(&docs).contains(&format!("--sidecar-image={image}")),
        "{:?}",
        operator_args(&docs)
    );
    assert!(
        leasehold_operator::config::DEFAULT_SIDECAR_IMAGE == image,
        "the operator's own default, {}, is not the chart's, {image}",
        leasehold_operator::config::DEFAULT_SIDECAR_IMAGE
    );
}

/// A digest pins the image of the operator and of the injected sidecar alike; the sidecar's
/// pull policy follows the chart's unless set on its own, and a digest that is not one is
/// refused by the schema.
#[test]
fn a_digest_pins_both_images_and_the_sidecars_pull_policy_is_a_value() {
    let digest = format!("sha256:{}", "ab".repeat(32));
    let docs = render_chart(&["--set", &format!("image.digest={digest}")]);
    let deployment = of_kind(&docs, "Deployment")[0];
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let pinned = format!("leasehold.invalid/leasehold@{digest}");
    assert_eq!(container["image"].as_str(), Some(pinned.as_str()));
    let args = operator_args(&docs);
    assert!(
        args.contains(&format!("--sidecar-image={pinned}")),
        "{args:?}"
    );
    assert!(
        args.contains(&"--sidecar-image-pull-policy=IfNotPresent".to_owned()),
        "{args:?}"
    );
    let docs = render_chart(&[
        "--set",
        "image.pullPolicy=Always",
        "--set",
        "sidecar.imagePullPolicy=Never",
    ]);
    let args = operator_args(&docs);
    assert!(
        args.contains(&"--sidecar-image-pull-policy=Never".to_owned()),
        "{args:?}"
    );
    let (ok, text) = chart(&["schema", "--set", "image.digest=latest"]);
    assert!(!ok && text.contains("image/digest"), "{text}");
}

/// The sidecar's user is a value: the image's by default, any (a large OpenShift range's
/// included, written whole), or none, left to the platform; root is refused by the schema.
#[test]
fn the_sidecars_user_is_a_value_that_may_be_left_to_the_platform() {
    let user_arg = |set: &[&str]| {
        operator_args(&render_chart(set))
            .into_iter()
            .filter(|a| a.starts_with("--sidecar-run-as-user="))
            .collect::<Vec<_>>()
    };
    assert_eq!(user_arg(&[]), ["--sidecar-run-as-user=65532"]);
    assert_eq!(
        user_arg(&["--set", "sidecar.runAsUser=1000680000"]),
        ["--sidecar-run-as-user=1000680000"]
    );
    assert_eq!(
        user_arg(&["--set", "sidecar.runAsUser=null"]),
        ["--sidecar-run-as-user="]
    );
    let (ok, text) = chart(&["schema", "--set", "sidecar.runAsUser=0"]);
    assert!(!ok && text.contains("runAsUser"), "{text}");
}

/// The operator's pods, the Deployment's and the uninstall Job's, run only on nodes of the
/// image's architectures (a replica on another would crash-loop, and with the webhook failing
/// closed refuse annotated pods) unless `operator.affinity` says where; their user is a value
/// that may be left to the platform, as the sidecar's.
#[test]
fn the_operators_pods_run_on_the_images_architectures_as_a_user_that_may_be_left_to_the_platform() {
    let pods = |set: &[&str]| -> Vec<Value> {
        let docs = render_chart(set);
        ["Deployment", "Job"]
            .iter()
            .map(|kind| of_kind(&docs, kind)[0]["spec"]["template"]["spec"].clone())
            .collect()
    };
    for pod in pods(&[]) {
        let terms = &pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        let expression = &terms[0]["matchExpressions"][0];
        assert_eq!(
            expression["key"].as_str(),
            Some("kubernetes.io/arch"),
            "{pod:?}"
        );
        assert_eq!(expression["operator"].as_str(), Some("In"));
        assert_eq!(strings(&expression["values"]), ["amd64"]);
        assert_eq!(
            pod["nodeSelector"]["kubernetes.io/os"].as_str(),
            Some("linux"),
            "Windows nodes of a mixed cluster are not always tainted: {pod:?}"
        );
        assert_eq!(pod["securityContext"]["runAsUser"].as_u64(), Some(65532));
        assert_eq!(pod["securityContext"]["runAsNonRoot"], Value::Bool(true));
    }
    for pod in pods(&["-f", &ci_values("platform-values.yaml")]) {
        let node_affinity = &pod["affinity"]["nodeAffinity"];
        assert!(
            node_affinity["requiredDuringSchedulingIgnoredDuringExecution"].is_null()
                && node_affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"]
                    .as_u64()
                    == Some(50),
            "an affinity of the user's own is kept as it is: {pod:?}"
        );
        assert_eq!(pod["tolerations"][0]["value"].as_str(), Some("infra"));
        let anti_affinity = &pod["affinity"]["podAntiAffinity"];
        let is_job = pod["restartPolicy"].as_str() == Some("Never");
        assert_eq!(
            anti_affinity.is_null(),
            is_job,
            "the Job, which stops the replicas, is not kept off their nodes: {pod:?}"
        );
        assert!(pod["securityContext"]["runAsUser"].is_null(), "{pod:?}");
        assert_eq!(pod["securityContext"]["runAsNonRoot"], Value::Bool(true));
    }
    let dir = tempfile::tempdir().unwrap();
    let any_architecture = dir.path().join("values.yaml");
    std::fs::write(&any_architecture, "image:\n  architectures: []\n").unwrap();
    for pod in pods(&["-f", any_architecture.to_str().unwrap()]) {
        assert!(
            pod["affinity"].is_null(),
            "a multi-architecture image runs anywhere: {pod:?}"
        );
    }
    // An architecture named in the nodeSelector is the user's choice (an image of their own).
    for pod in pods(&["--set", "operator.nodeSelector.kubernetes\\.io/arch=arm64"]) {
        assert_eq!(
            pod["nodeSelector"]["kubernetes.io/arch"].as_str(),
            Some("arm64"),
            "{pod:?}"
        );
        assert!(pod["affinity"].is_null(), "{pod:?}");
    }
    let (ok, text) = chart(&["schema", "--set", "operator.runAsUser=0"]);
    assert!(!ok && text.contains("runAsUser"), "{text}");
}

/// The ValidatingAdmissionPolicy named `name`, checked to be bound to deny.
fn admission_policy<'a>(docs: &'a [Value], name: &str) -> &'a Value {
    let named = |kind: &str| {
        *of_kind(docs, kind)
            .iter()
            .find(|d| d["metadata"]["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    };
    let binding = named("ValidatingAdmissionPolicyBinding");
    assert_eq!(binding["spec"]["policyName"].as_str(), Some(name));
    assert_eq!(strings(&binding["spec"]["validationActions"]), ["Deny"]);
    named("ValidatingAdmissionPolicy")
}

/// The policy that narrows the operator's rights on Leases, evaluated offline as the API server
/// runs it: the operator's ServiceAccount creates, changes and deletes the Leases Leasehold
/// makes (labelled) and its election Lease, and no other program's (a node's heartbeat, an
/// app's leader election); other users are not its business.
#[test]
fn the_lease_policy_keeps_the_operator_to_the_leases_leasehold_makes() {
    use kube_cel::{AdmissionRequest, VapEvaluator, VapExpression};
    let docs = render_chart(&[]);
    let policy = admission_policy(&docs, "leasehold-leases");
    // Map keys escaped as kube-cel escapes object keys (see the holder-label policy's test).
    let label = "app.kubernetes.io/managed-by";
    let escaped_label = label
        .replace('.', "__dot__")
        .replace('/', "__slash__")
        .replace('-', "__dash__");
    let expressions = |list: &Value| -> Vec<VapExpression> {
        list.as_sequence()
            .unwrap()
            .iter()
            .map(|e| VapExpression {
                expression: e["expression"]
                    .as_str()
                    .unwrap()
                    .replace(&format!("'{label}'"), &format!("'{escaped_label}'")),
                message: e["message"].as_str().map(str::to_owned),
                message_expression: None,
            })
            .collect()
    };
    let conditions = expressions(&policy["spec"]["matchConditions"]);
    let validations = expressions(&policy["spec"]["validations"]);
    let lease = |namespace: &str, name: &str, managed: bool| {
        let mut lease = serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": "x"}},
            "spec": {"holderIdentity": "pod-a"}
        });
        if managed {
            lease["metadata"]["labels"][label] = "leasehold".into();
        }
        lease
    };
    // (whether the policy applies, whether every validation passes)
    let judge = |user: &str,
                 operation: &str,
                 old: Option<&serde_json::Value>,
                 new: Option<&serde_json::Value>| {
        let of = |o: Option<&serde_json::Value>| o.cloned().unwrap_or(serde_json::Value::Null);
        let target = new.or(old).unwrap();
        let evaluator = VapEvaluator::builder()
            .object(of(new))
            .old_object(of(old))
            .request(AdmissionRequest {
                operation: operation.into(),
                username: user.into(),
                namespace: target["metadata"]["namespace"].as_str().unwrap().into(),
                name: target["metadata"]["name"].as_str().unwrap().into(),
                ..Default::default()
            })
            .build();
        let matched = evaluator.evaluate(&conditions).iter().all(|r| r.passed);
        let passed = evaluator.evaluate(&validations).iter().all(|r| r.passed);
        (matched, passed)
    };
    let operator = "system:serviceaccount:leasehold-system:leasehold-operator";
    let uninstall = "system:serviceaccount:leasehold-system:leasehold-operator-uninstall";
    let ours = lease("team", "orders", true);
    let renewed = {
        let mut renewed = ours.clone();
        renewed["spec"]["holderIdentity"] = "pod-b".into();
        renewed
    };
    assert_eq!(judge(operator, "CREATE", None, Some(&ours)), (true, true));
    assert_eq!(
        judge(operator, "UPDATE", Some(&ours), Some(&renewed)),
        (true, true)
    );
    assert_eq!(judge(operator, "DELETE", Some(&ours), None), (true, true));
    assert_eq!(
        judge(uninstall, "UPDATE", Some(&ours), Some(&renewed)),
        (true, true)
    );
    let heartbeat = lease("kube-node-lease", "node-1", false);
    let election = lease("payments", "payments-leader", false);
    for other in [&heartbeat, &election] {
        let mut taken = other.clone();
        taken["spec"]["holderIdentity"] = "leasehold".into();
        assert_eq!(
            judge(operator, "UPDATE", Some(other), Some(&taken)),
            (true, false),
            "{other}"
        );
        assert_eq!(
            judge(operator, "DELETE", Some(other), None),
            (true, false),
            "{other}"
        );
        assert_eq!(
            judge(operator, "CREATE", None, Some(other)),
            (true, false),
            "{other}"
        );
        assert_eq!(
            judge(uninstall, "UPDATE", Some(other), Some(&taken)),
            (true, false),
            "{other}"
        );
        // Labelling another program's Lease on the way is no way in.
        let mut labelled = taken.clone();
        labelled["metadata"]["labels"][label] = "leasehold".into();
        assert_eq!(
            judge(operator, "UPDATE", Some(other), Some(&labelled)),
            (true, false),
            "{other}"
        );
    }
    // Nor is taking the label off one of Leasehold's.
    let unlabelled = lease("team", "orders", false);
    assert_eq!(
        judge(operator, "UPDATE", Some(&ours), Some(&unlabelled)),
        (true, false)
    );
    // The operator's election Lease, and everybody else, are not the policy's business.
    let own = lease("leasehold-system", "leasehold-operator", false);
    let applies =
        |user: &str, lease: &serde_json::Value| judge(user, "UPDATE", Some(lease), Some(lease)).0;
    assert!(!applies(operator, &own));
    assert!(!applies("system:serviceaccount:team:runner", &election));
    assert!(!applies("system:node:node-1", &heartbeat));
    let (ok, text) = chart(&["render", "--set", "leasePolicy.enabled=false"]);
    assert!(ok && !text.contains("leasehold-leases"), "{text}");
}

/// The policy that narrows `patch` on pods, which `spec.holderLabel` asks of the pods'
/// ServiceAccounts, evaluated offline as the API server runs it: on a pod that takes a lock, a
/// ServiceAccount of its namespace may set or clear the holder label and change nothing else;
/// users, other namespaces' ServiceAccounts and pods without a lock are not its business.
#[test]
fn the_holder_label_policy_lets_a_pods_service_account_change_that_label_alone() {
    use kube_cel::{AdmissionRequest, VapEvaluator, VapExpression};
    let docs = render_chart(&[]);
    let policy = admission_policy(&docs, "leasehold-holder-label");
    // kube-cel's evaluator escapes every object key as the API server escapes declared field
    // names (`.` as `__dot__`, `/` as `__slash__`), map keys included, which the API server
    // leaves as they are: the policy's label and annotation keys are written the same way here.
    let escaped = |expression: &str| {
        [
            "leasehold.dev/lock",
            "leasehold.dev/holder",
            "holder.leasehold.dev/",
            "permit.holder.leasehold.dev/",
        ]
        .iter()
        .fold(expression.to_owned(), |e, key| {
            let escaped = key.replace('.', "__dot__").replace('/', "__slash__");
            e.replace(&format!("'{key}'"), &format!("'{escaped}'"))
        })
    };
    let expressions = |list: &Value| -> Vec<VapExpression> {
        list.as_sequence()
            .unwrap()
            .iter()
            .map(|e| VapExpression {
                expression: escaped(e["expression"].as_str().unwrap()),
                message: e["message"].as_str().map(str::to_owned),
                message_expression: None,
            })
            .collect()
    };
    let conditions = expressions(&policy["spec"]["matchConditions"]);
    let validations = expressions(&policy["spec"]["validations"]);
    let old = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "runner-1", "namespace": "reports",
                     "labels": {"app": "runner", "leasehold.dev/holder": "false"},
                     "annotations": {"leasehold.dev/lock": "nightly"}},
        "spec": {"containers": [{"name": "app", "image": "example/app:1"}]}
    });
    // (whether the policy applies, whether every validation passes)
    let judge = |user: &str, old: &serde_json::Value, new: &serde_json::Value| {
        let evaluator = VapEvaluator::builder()
            .object(new.clone())
            .old_object(old.clone())
            .request(AdmissionRequest {
                operation: "UPDATE".into(),
                username: user.into(),
                namespace: "reports".into(),
                ..Default::default()
            })
            .build();
        let matched = evaluator.evaluate(&conditions).iter().all(|r| r.passed);
        let passed = evaluator.evaluate(&validations).iter().all(|r| r.passed);
        (matched, passed)
    };
    let own = "system:serviceaccount:reports:runner";
    let with = |change: &dyn Fn(&mut serde_json::Value)| {
        let mut new = old.clone();
        change(&mut new);
        new
    };
    let labelled = with(&|p| p["metadata"]["labels"]["leasehold.dev/holder"] = "true".into());
    assert_eq!(judge(own, &old, &labelled), (true, true), "set the label");
    let cleared = with(&|p| {
        p["metadata"]["labels"]
            .as_object_mut()
            .unwrap()
            .remove("leasehold.dev/holder");
    });
    assert_eq!(judge(own, &old, &cleared), (true, true), "remove the label");
    // A pod that takes several locks: a label per lock.
    let per_lock = with(&|p| {
        p["metadata"]["labels"]["holder.leasehold.dev/nightly"] = "true".into();
        p["metadata"]["labels"]["holder.leasehold.dev/weekly"] = "false".into();
    });
    assert_eq!(
        judge(own, &old, &per_lock),
        (true, true),
        "a lock's own label"
    );
    assert_eq!(
        judge(own, &per_lock, &old),
        (true, true),
        "remove a lock's own label"
    );
    // The permit a holder holds, named beside its label.
    let permit_named = with(&|p| {
        p["metadata"]["labels"]["leasehold.dev/holder"] = "true".into();
        p["metadata"]["annotations"]["permit.holder.leasehold.dev/nightly"] = "1".into();
    });
    assert_eq!(
        judge(own, &old, &permit_named),
        (true, true),
        "name the permit held"
    );
    assert_eq!(
        judge(own, &permit_named, &old),
        (true, true),
        "remove the permit's name"
    );
    for (what, change) in [
        (
            "a container's image",
            &(|p: &mut serde_json::Value| {
                p["spec"]["containers"][0]["image"] = "attacker/app:1".into()
            }) as &dyn Fn(&mut serde_json::Value),
        ),
        ("another label", &|p| {
            p["metadata"]["labels"]["app"] = "other".into()
        }),
        ("a new label", &|p| {
            p["metadata"]["labels"]["tier"] = "web".into()
        }),
        ("an annotation", &|p| {
            p["metadata"]["annotations"]["leasehold.dev/lock"] = "other".into()
        }),
        ("the lock's annotation removed", &|p| {
            p["metadata"]["annotations"]
                .as_object_mut()
                .unwrap()
                .remove("leasehold.dev/lock");
        }),
        ("a new annotation", &|p| {
            p["metadata"]["annotations"]["example.com/note"] = "x".into()
        }),
        ("a holder label's key as an annotation", &|p| {
            p["metadata"]["annotations"]["holder.leasehold.dev/nightly"] = "true".into()
        }),
        ("a permit's annotation that names no permit", &|p| {
            p["metadata"]["annotations"]["permit.holder.leasehold.dev/nightly"] =
                "x".repeat(4).into()
        }),
        ("a finalizer", &|p| {
            p["metadata"]["finalizers"] = serde_json::json!(["x/y"])
        }),
    ] {
        assert_eq!(judge(own, &old, &with(change)), (true, false), "{what}");
    }
    // Not the policy's business: a person, another namespace's ServiceAccount, a pod that
    // takes no lock.
    let image = with(&|p| p["spec"]["containers"][0]["image"] = "example/app:2".into());
    assert!(!judge("jane@example.com", &old, &image).0);
    assert!(!judge("system:serviceaccount:ci:deployer", &old, &image).0);
    let mut plain = old.clone();
    plain["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("annotations");
    assert!(!judge(own, &plain, &plain).0);
}
