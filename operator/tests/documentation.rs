//! The documentation's examples are real: each example lock in `docs/reference/crd.md` parses as a
//! DistributedLock, resolves to a backend (with stand-in Secret values), and together they cover
//! every backend; the complete Helm example of `docs/operations/install.md` validates against the
//! Kubernetes schemas, its Deployment gets the sidecar from the webhook, and its Role grants what
//! that sidecar does. Every relative link in the README and under `docs/` resolves, and
//! `docs/reference/metrics.md` names exactly the operator's metrics.

use std::collections::{BTreeMap, BTreeSet};

use support::chart;

mod support;

use leasehold_crds::DistributedLock;
use leasehold_resource::{self as resource, SecretValues};
use leasehold_testkit::metrics_reference::{described, documented};

/// A page of the documentation, by its path from the repository's root.
fn page(path: &str) -> String {
    std::fs::read_to_string(support::root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn examples() -> Vec<DistributedLock> {
    let crd = page("docs/reference/crd.md");
    let section = crd
        .split("## One example per backend")
        .nth(1)
        .expect("docs/reference/crd.md has its examples section");
    let yaml = section
        .split("```yaml")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("a yaml block");
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("a DistributedLock"))
        .collect()
}

#[test]
fn every_documented_example_resolves_and_every_cluster_backend_has_one() {
    let mut kinds = BTreeSet::new();
    for lock in examples() {
        let mut secrets = SecretValues::new();
        for r in resource::secret_refs(&lock) {
            secrets.insert((r.name.clone(), r.key.clone()), "user:stand-in".into());
        }
        let resolved = resource::resolve(&lock, &secrets)
            .unwrap_or_else(|e| panic!("{}: {e}", lock.metadata.name.as_deref().unwrap_or("?")));
        kinds.insert(resolved.backend.kind());
    }
    let expected: BTreeSet<&str> = [
        "kubernetes",
        "redis",
        "redis-sentinel",
        "redlock",
        "postgres",
        "mysql",
        "tair",
        "zookeeper",
        "etcd",
    ]
    .into();
    assert_eq!(kinds, expected);
}

/// The complete example of `docs/operations/install.md`: its YAML documents.
fn helm_example() -> (String, Vec<serde_json::Value>) {
    let yaml = page("docs/operations/install.md")
        .split("```yaml")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("docs/operations/install.md's complete example")
        .to_owned();
    let docs = serde_yaml::Deserializer::from_str(&yaml)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
        .collect();
    (yaml, docs)
}

fn kind<'a>(docs: &'a [serde_json::Value], kind: &str) -> &'a serde_json::Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in the complete example"))
}

#[test]
fn the_complete_helm_example_is_valid_and_gets_its_sidecar() {
    use leasehold_operator::webhook::{self, Decision, Injection};
    let (yaml, docs) = helm_example();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &yaml).unwrap();
    let (ok, text) = chart(&["validate-file", &file.path().display().to_string()]);
    assert!(ok, "{text}");
    assert!(text.contains("Deployment/report-runner: valid"), "{text}");

    let lock: DistributedLock =
        serde_json::from_value(kind(&docs, "DistributedLock").clone()).unwrap();
    resource::resolve(&lock, &SecretValues::new()).unwrap();
    let name = lock.metadata.name.clone().unwrap();
    let namespace = lock.metadata.namespace.clone().unwrap();

    // The Deployment's pod, as the webhook sees it.
    let template = &kind(&docs, "Deployment")["spec"]["template"];
    let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": template["metadata"].clone(), "spec": template["spec"].clone()});
    let mut pod = leasehold_testkit::with_service_account_token(pod);
    pod["metadata"]["name"] = "report-runner-7c9d-x2".into();
    let typed: k8s_openapi::api::core::v1::Pod = serde_json::from_value(pod.clone()).unwrap();
    let injection = Injection::new("leasehold/leasehold:0.1.0", true);
    let Decision::Patch(ops) = webhook::decide(
        &typed,
        &namespace,
        &BTreeMap::from([(name.clone(), webhook::Declares::Lock)]),
        &injection,
    ) else {
        panic!("the example's pod is not injected");
    };
    let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(ops)).unwrap();
    json_patch::patch(&mut pod, &patch).unwrap();
    let sidecar = &pod["spec"]["initContainers"][0];
    let args: Vec<&str> = sidecar["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let wanted = format!("{namespace}/{name}");
    assert!(args.contains(&wanted.as_str()), "{args:?}");

    // The Role grants what that sidecar does, to the Deployment's ServiceAccount.
    let role = kind(&docs, "Role");
    let grants = |resource: &str, verb: &str, named: &str| {
        role["rules"].as_array().unwrap().iter().any(|rule| {
            let has = |field: &str, value: &str| {
                rule[field]
                    .as_array()
                    .is_some_and(|v| v.iter().any(|x| x == value))
            };
            has("resources", resource)
                && has("verbs", verb)
                && (rule["resourceNames"].is_null() || has("resourceNames", named))
        })
    };
    for verb in ["get", "list", "watch"] {
        assert!(
            grants("distributedlocks", verb, &name),
            "{verb} distributedlocks"
        );
    }
    for verb in ["create", "get", "watch", "update"] {
        assert!(grants("leases", verb, &name), "{verb} leases");
    }
    let binding = kind(&docs, "RoleBinding");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    assert_eq!(
        binding["subjects"][0]["name"],
        template["spec"]["serviceAccountName"]
    );
}

/// The Secret of `docs/operations/secrets.md` is opened to the server of the example lock that
/// uses it, and to nothing else.
#[test]
fn the_documented_secret_is_opened_to_its_example_lock() {
    let secrets = page("docs/operations/secrets.md");
    let yaml = secrets
        .split("## Their owner decides where they go")
        .nth(1)
        .and_then(|s| s.split("```yaml").nth(1))
        .and_then(|s| s.split("```").next())
        .expect("docs/operations/secrets.md shows an opened Secret");
    let secret: k8s_openapi::api::core::v1::Secret = serde_yaml::from_str(yaml).unwrap();
    let name = secret.metadata.name.as_deref().unwrap();
    let allowed = secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(resource::ALLOWED_HOSTS_ANNOTATION))
        .map(String::as_str);
    let users: Vec<DistributedLock> = examples()
        .into_iter()
        .filter(|lock| resource::secret_refs(lock).iter().any(|r| r.name == name))
        .collect();
    assert!(!users.is_empty(), "no example lock uses Secret {name}");
    for lock in users {
        resource::check_secret_allowed(name, allowed, &resource::backend_endpoints(&lock)).unwrap();
    }
    assert!(
        resource::check_secret_allowed(name, allowed, &["attacker.example:6379".into()]).is_err()
    );
}

/// Every relative link in the README and under `docs/` names a file that exists (anchors aside).
#[test]
fn every_relative_link_in_the_readme_and_docs_resolves() {
    let root = support::root();
    let mut pages = vec![root.join("README.md")];
    let mut folders = vec![root.join("docs")];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).expect("docs/") {
            let path = entry.unwrap().path();
            if path.is_dir() {
                folders.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                pages.push(path);
            }
        }
    }
    assert!(pages.len() > 10, "the pages were not found: {pages:?}");
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        // `[text](target)`: the target runs to the closing parenthesis.
        for (at, _) in text.match_indices("](") {
            let rest = &text[at + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = rest[..end].split('#').next().unwrap_or_default();
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let resolved = page.parent().unwrap().join(target);
            if !resolved.exists() {
                broken.push(format!("{}: {target}", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "links to nothing: {broken:#?}");
}

/// `docs/reference/metrics.md` names exactly the metrics the operator registers, under the names a query
/// uses (a counter's with `_total`).
#[test]
fn the_metrics_reference_names_exactly_the_operators_metrics() {
    let page = page("docs/reference/metrics.md");
    let section = page
        .split("## The operator")
        .nth(1)
        .expect("docs/reference/metrics.md has a section on the operator");
    // Every family with a sample: an admission and a failed reconciliation counted.
    let metrics = leasehold_operator::metrics::Metrics::new();
    metrics.admitted("injected");
    metrics.reconciled(std::time::Duration::from_millis(1), Some("kube"));
    let registered = described(&metrics.render());
    assert!(!registered.is_empty(), "the operator described no metric");
    assert_eq!(documented(section), registered);
}
