//! What the operator's test binaries share: running `charts/check.py` (Helm's engine and the
//! Kubernetes schemas) with the venv that scripts/install-chart-tools makes, and calling the
//! webhook over TLS as the API server does.

#![allow(dead_code)] // each test binary uses its own part

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;

/// The chart's MutatingWebhookConfiguration (`leasehold`, calling Service `leasehold-webhook` in
/// `leasehold-system`), with `others` webhooks after ours.
pub fn chart_webhook_configuration(others: &[serde_json::Value]) -> serde_json::Value {
    let mut webhooks = vec![serde_json::json!({
        "name": "inject.leasehold.dev",
        "clientConfig": {"service": {"name": "leasehold-webhook", "namespace": "leasehold-system",
                                     "path": "/mutate"}},
        "sideEffects": "None", "admissionReviewVersions": ["v1"],
        "futureField": {"kept": true}
    })];
    webhooks.extend_from_slice(others);
    serde_json::json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "leasehold"},
        "webhooks": webhooks
    })
}

/// `encoded` (base64, as Kubernetes writes bytes in JSON) as text.
pub fn from_base64(encoded: &str) -> String {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .unwrap_or_else(|e| panic!("not base64 ({e}): {encoded}"));
    String::from_utf8(bytes).expect("UTF-8 text")
}

/// The name the API server calls the webhook Service by (the certificate's first name).
pub const HOST: &str = "leasehold-webhook.leasehold-system.svc";

pub fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `charts/check.py ARGS` with the venv's python: (succeeded, stdout and stderr).
pub fn chart(args: &[&str]) -> (bool, String) {
    let python = std::env::var("LEASEHOLD_VENV")
        .map(|v| format!("{v}/bin/python"))
        .unwrap_or_else(|_| "/var/tmp/leasehold-venv/bin/python".to_owned());
    assert!(
        Path::new(&python).exists(),
        "{python} is missing: run scripts/install-chart-tools (or scripts/install-test-deps), \
         which creates the venv with helm-python-sdk and kubernetes-validate"
    );
    let output = Command::new(&python)
        .arg(root().join("charts/check.py"))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

/// The API server's clock, moved on with the test's simulated time.
#[derive(Debug)]
pub struct ClockAt(OffsetDateTime);

impl rustls::time_provider::TimeProvider for ClockAt {
    fn current_time(&self) -> Option<rustls_pki_types::UnixTime> {
        Some(rustls_pki_types::UnixTime::since_unix_epoch(
            std::time::Duration::from_secs(self.0.unix_timestamp() as u64),
        ))
    }
}

/// A TLS client that trusts only `ca_pem`, with its clock at `at`.
pub fn connector(ca_pem: &str, at: OffsetDateTime) -> tokio_rustls::TlsConnector {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_details(
        Arc::new(rustls::crypto::ring::default_provider()),
        Arc::new(ClockAt(at)),
    )
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// POST `body` to `/mutate` over TLS, as the API server would: (status, body, the certificate
/// the server presented).
pub async fn post(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    at: OffsetDateTime,
    body: &str,
) -> Result<(u16, String, Vec<u8>), std::io::Error> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls_pki_types::ServerName::try_from(HOST).unwrap();
    let mut tls = connector(ca_pem, at).connect(name, tcp).await?;
    let presented = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    let request = format!(
        "POST /mutate HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    tls.read_to_string(&mut response).await?;
    let status = response[9..12].parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body, presented))
}

/// POST `body` to `/mutate` on an open connection, keeping it open: (status, body).
pub async fn post_kept_alive(
    tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    body: &str,
) -> std::io::Result<(u16, String)> {
    let request = format!(
        "POST /mutate HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(request.as_bytes()).await?;
    // Read the head, then exactly Content-Length bytes of body.
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        if tls.read(&mut byte).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .expect("a Content-Length");
    let mut body = vec![0u8; length];
    tls.read_exact(&mut body).await?;
    Ok((
        head[9..12].parse().unwrap(),
        String::from_utf8_lossy(&body).into_owned(),
    ))
}

pub fn der_of(pem: &str) -> Vec<u8> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .to_vec()
}

/// The operator's ServiceAccount, as the API server names the user.
pub const OPERATOR_USER: &str = "system:serviceaccount:leasehold-system:leasehold-operator";

/// What the installed manifest (`operator/config/leasehold.yaml`, the chart rendered with its
/// defaults) lets ServiceAccount `name` of `namespace` do: the rules of every Role and
/// ClusterRole bound to it, each inside its RoleBinding's namespace or cluster-wide.
pub fn chart_grants(
    namespace: &str,
    name: &str,
) -> Vec<leasehold_testkit::in_memory_api_server::Grant> {
    let text = std::fs::read_to_string(root().join("operator/config/leasehold.yaml"))
        .expect("operator/config/leasehold.yaml");
    grants_in(&text, namespace, name)
}

/// What the chart rendered by Helm with its defaults, hooks included, lets ServiceAccount
/// `name` of `namespace` do (needs the chart tools, as `chart` does).
pub fn rendered_chart_grants(
    namespace: &str,
    name: &str,
) -> Vec<leasehold_testkit::in_memory_api_server::Grant> {
    grants_in(&rendered_chart(), namespace, name)
}

/// The chart rendered by Helm with its defaults, hooks included, as YAML.
pub fn rendered_chart() -> String {
    rendered_chart_with(&[])
}

/// The chart rendered by Helm with `args` (`--set K=V`, `-f FILE`), hooks included, as YAML.
pub fn rendered_chart_with(args: &[&str]) -> String {
    let (ok, text) = chart(&[&["render"], args].concat());
    assert!(ok, "helm render failed: {text}");
    text
}

/// What manifest `text` lets ServiceAccount `name` of `namespace` do.
pub fn grants_of(
    text: &str,
    namespace: &str,
    name: &str,
) -> Vec<leasehold_testkit::in_memory_api_server::Grant> {
    grants_in(text, namespace, name)
}

/// The objects of manifest `text`.
pub fn objects(text: &str) -> Vec<serde_json::Value> {
    use serde::Deserialize;
    serde_yaml::Deserializer::from_str(text)
        .map(|document| serde_json::Value::deserialize(document).expect("a YAML document"))
        .filter(|object| !object.is_null())
        .collect()
}

/// The rules bound to ServiceAccount `name` of `namespace` in the manifest `text`.
fn grants_in(
    text: &str,
    namespace: &str,
    name: &str,
) -> Vec<leasehold_testkit::in_memory_api_server::Grant> {
    use leasehold_testkit::in_memory_api_server::Grant;
    let objects = objects(text);
    let find = |kind: &str, role: &str, role_namespace: Option<&str>| {
        objects
            .iter()
            .find(|o| {
                o["kind"] == kind
                    && o["metadata"]["name"] == role
                    && role_namespace.is_none_or(|ns| o["metadata"]["namespace"] == ns)
            })
            .unwrap_or_else(|| panic!("the manifest binds a missing {kind} {role}"))
    };
    let mut grants = Vec::new();
    for binding in &objects {
        let scope = match binding["kind"].as_str() {
            Some("ClusterRoleBinding") => None,
            Some("RoleBinding") => Some(
                binding["metadata"]["namespace"]
                    .as_str()
                    .expect("a RoleBinding's namespace")
                    .to_owned(),
            ),
            _ => continue,
        };
        let bound = binding["subjects"].as_array().is_some_and(|subjects| {
            subjects.iter().any(|s| {
                s["kind"] == "ServiceAccount" && s["name"] == name && s["namespace"] == namespace
            })
        });
        if !bound {
            continue;
        }
        let role_ref = &binding["roleRef"];
        let role_name = role_ref["name"].as_str().expect("roleRef.name");
        let role = match role_ref["kind"].as_str() {
            Some("ClusterRole") => find("ClusterRole", role_name, None),
            _ => find("Role", role_name, scope.as_deref()),
        };
        for rule in role["rules"].as_array().into_iter().flatten() {
            grants.push(Grant {
                namespace: scope.clone(),
                rule: rule.clone(),
            });
        }
    }
    assert!(
        !grants.is_empty(),
        "the manifest grants {namespace}/{name} nothing"
    );
    grants
}

/// A client of `api` that may do what the chart lets the operator's ServiceAccount do, and no
/// more: a request outside its RBAC rules gets the real API server's 403.
/// Give `subject` (a user or a group) exactly `verbs` on the locks of `namespace`, or on those
/// of them named `names` when there are some.
pub fn grant_on_locks(
    api: &leasehold_testkit::InMemoryApiServer,
    subject: &str,
    namespace: &str,
    names: &[&str],
    verbs: &[&str],
) {
    let mut rule = serde_json::json!({"apiGroups": ["leasehold.dev"],
                                      "resources": ["distributedlocks"], "verbs": verbs});
    if !names.is_empty() {
        rule["resourceNames"] = serde_json::json!(names);
    }
    api.grant(
        subject,
        vec![leasehold_testkit::in_memory_api_server::Grant {
            namespace: Some(namespace.into()),
            rule,
        }],
    );
}

/// Let the ServiceAccount `default` of `namespace` read the locks there, as an app's Role does
/// (`operator/config/sidecar-rbac/role.yaml`): what the webhook checks before injecting.
pub fn grant_default_account_locks(api: &leasehold_testkit::InMemoryApiServer, namespace: &str) {
    grant_on_locks(
        api,
        &format!("system:serviceaccount:{namespace}:default"),
        namespace,
        &[],
        &["get", "list", "watch"],
    );
}

pub fn operator_client(api: &leasehold_testkit::InMemoryApiServer) -> kube::Client {
    api.grant(
        OPERATOR_USER,
        chart_grants("leasehold-system", "leasehold-operator"),
    );
    api.client_as(OPERATOR_USER)
}
