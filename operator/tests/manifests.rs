//! The kustomize bases render (with the real `kubectl kustomize`), include the generated CRD
//! unchanged, and keep the security promises: least-privilege RBAC, non-root read-only
//! containers.

use std::path::Path;
use std::process::Command;

use serde_yaml::Value;

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
        "Service",
    ] {
        assert_eq!(of_kind(&docs, kind).len(), 1, "{kind}");
    }
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
    let docs = render("operator/config");
    for doc in of_kind(&docs, "ClusterRole")
        .into_iter()
        .chain(of_kind(&docs, "Role"))
    {
        for rule in doc["rules"].as_sequence().unwrap() {
            for field in ["apiGroups", "resources", "verbs"] {
                assert!(
                    !strings(&rule[field]).contains(&"*"),
                    "wildcard in {rule:?}"
                );
            }
            let resources = strings(&rule["resources"]);
            let verbs = strings(&rule["verbs"]);
            if resources.contains(&"secrets") {
                assert_eq!(
                    verbs,
                    ["get"],
                    "the operator reads only the Secrets it is pointed at"
                );
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
    let sidecar = render("operator/config/sidecar-rbac");
    let role = of_kind(&sidecar, "Role")[0];
    for rule in role["rules"].as_sequence().unwrap() {
        let resources = strings(&rule["resources"]);
        let verbs = strings(&rule["verbs"]);
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
    let docs = render("operator/config");
    let deployment = of_kind(&docs, "Deployment")[0];
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
