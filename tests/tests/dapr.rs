//! Dapr's lock API, driven by Dapr's official Python SDK from PyPI, unmodified
//! (`tests/dapr/lock_client.py`): a client that nobody on this project wrote. The sidecar serves
//! the SDK's health check over HTTP and its `TryLockAlpha1`/`UnlockAlpha1` calls over gRPC, on
//! Redis and on PostgreSQL.

use std::path::{Path, PathBuf};
use std::process::Command;

use leasehold_e2e::{Sidecar, unique_lock};
use leasehold_testkit::free_port;

/// The venv's python, which scripts/install-test-deps gives Dapr's SDK.
fn python() -> PathBuf {
    let venv = std::env::var("LEASEHOLD_VENV").unwrap_or_else(|_| "/var/tmp/leasehold-venv".into());
    let python = Path::new(&venv).join("bin/python");
    let has_sdk = Command::new(&python)
        .args(["-c", "import dapr.clients"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        has_sdk,
        "{} cannot import Dapr's SDK: run scripts/install-test-deps (scripts/test does), which \
         installs tests/dapr/requirements.txt into the venv",
        python.display()
    );
    python
}

fn dapr_sdk_drives_the_lock_api(backend: &str) {
    let family = unique_lock("orders");
    let (http_port, grpc_port) = (free_port(), free_port());
    let sidecar = Sidecar::start(
        "pod-a",
        backend,
        &unique_lock("plain"),
        &[
            "--keyed",
            &family,
            "--dapr-http-listen",
            &format!("127.0.0.1:{http_port}"),
            "--dapr-grpc-listen",
            &format!("127.0.0.1:{grpc_port}"),
        ],
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("dapr/lock_client.py");
    let output = Command::new(python())
        .arg(&script)
        .args([family.as_str(), "order-1234"])
        .env("DAPR_RUNTIME_HOST", "127.0.0.1")
        .env("DAPR_HTTP_PORT", http_port.to_string())
        .env("DAPR_GRPC_PORT", grpc_port.to_string())
        .env("DAPR_HEALTH_TIMEOUT", "10")
        .output()
        .expect("run the Dapr SDK client");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the Dapr SDK client failed: {stdout}{}\nsidecar log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        sidecar.log()
    );
    let seen: serde_json::Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    // Dapr's UnlockResponse.Status: 0 success, 1 lock does not exist, 2 belongs to others.
    let expected = serde_json::json!({
        "first": true,
        "other_owner": false,
        "same_owner_again": false,
        "unlock_by_other": 2,
        "unlock": 0,
        "unlock_again": 1,
        "after_release": true,
        "scoped": true,
        "after_scope": true,
        "beyond_lease": "StatusCode.INVALID_ARGUMENT",
        "unknown_store": "StatusCode.INVALID_ARGUMENT",
    });
    assert_eq!(seen, expected, "sidecar log:\n{}", sidecar.log());
    // What the SDK took is a keyed lock like any other: worker-2 holds it, with a token.
    let held = sidecar.get(&format!("/locks/{family}/keys/order-1234?owner=worker-2"));
    assert_eq!(held.status, 200, "{}", held.body);
    assert!(held.json()["fencingToken"].as_u64().unwrap() > 0);

    // Dapr's HTTP lock API, with Dapr's bodies and status codes.
    let lock = |body: &str| {
        leasehold_e2e::http_with_body(
            ([127, 0, 0, 1], http_port).into(),
            "POST",
            &format!("/v1.0-alpha1/lock/{family}"),
            body,
        )
        .expect("lock over HTTP")
    };
    let taken = lock(r#"{"resourceId":"order-9","lockOwner":"w1","expiryInSeconds":10}"#);
    assert_eq!(
        (taken.status, taken.json()["success"].as_bool()),
        (200, Some(true))
    );
    let refused = lock(r#"{"resourceId":"order-9","lockOwner":"w2","expiryInSeconds":10}"#);
    assert_eq!(refused.json()["success"], false);
    // Held through another sidecar of the family: an unlock here, by any owner, belongs to
    // others (only the holder's sidecar releases it); a resource nobody holds does not exist.
    let elsewhere_port = free_port();
    let elsewhere = Sidecar::start(
        "pod-b",
        backend,
        &unique_lock("plain"),
        &[
            "--keyed",
            &family,
            "--dapr-http-listen",
            &format!("127.0.0.1:{elsewhere_port}"),
            "--max-keys",
            "1",
        ],
    );
    for (resource, status) in [("order-9", 2), ("order-11", 1)] {
        let reply = leasehold_e2e::http_with_body(
            ([127, 0, 0, 1], elsewhere_port).into(),
            "POST",
            &format!("/v1.0-alpha1/unlock/{family}"),
            &format!(r#"{{"resourceId":"{resource}","lockOwner":"w1"}}"#),
        )
        .expect("unlock through the other sidecar");
        assert_eq!(
            (reply.status, reply.json()["status"].as_i64()),
            (200, Some(status)),
            "{resource}: {}\n{}",
            reply.body,
            elsewhere.log()
        );
    }
    // A pod whose budget of keys is spent answers as the keyed routes do (429: try again
    // later), not as if the request were malformed, and its held key stays held.
    let lock_elsewhere = |resource: &str| {
        leasehold_e2e::http_with_body(
            ([127, 0, 0, 1], elsewhere_port).into(),
            "POST",
            &format!("/v1.0-alpha1/lock/{family}"),
            &format!(r#"{{"resourceId":"{resource}","lockOwner":"w3","expiryInSeconds":10}}"#),
        )
        .expect("lock through the other sidecar")
    };
    let first = lock_elsewhere("order-20");
    assert_eq!(first.json()["success"], true, "{}", first.body);
    let over = lock_elsewhere("order-21");
    assert_eq!(
        (over.status, over.json()["errorCode"].as_str()),
        (429, Some("ERR_TRY_LOCK")),
        "{}",
        over.body
    );
    assert_eq!(
        lock(r#"{"resourceId":"order-20","lockOwner":"w4","expiryInSeconds":10}"#).json()["success"],
        false
    );
    // An expiry the store's lease does not cover is refused, and says why.
    let long = lock(r#"{"resourceId":"order-10","lockOwner":"w2","expiryInSeconds":3600}"#);
    assert_eq!(long.status, 400, "{}", long.body);
    assert!(long.body.contains("Ask for at most"), "{}", long.body);
    for bad in [
        r#"{"resourceId":"order-9","lockOwner":"w2","expiryInSeconds":0}"#,
        r#"{"resourceId":"order-9","lockOwner":"w2"}"#,
        r#"{"resourceId":"bad key","lockOwner":"w2","expiryInSeconds":5}"#,
        "not json",
    ] {
        let reply = lock(bad);
        assert_eq!(reply.status, 400, "{bad}: {}", reply.body);
        assert_eq!(reply.json()["errorCode"], "ERR_MALFORMED_REQUEST", "{bad}");
    }
    // An unknown store's name is quoted in part: a long one keeps the answer short.
    let long_store = "s".repeat(10_000);
    let unknown = leasehold_e2e::http_with_body(
        ([127, 0, 0, 1], http_port).into(),
        "POST",
        &format!("/v1.0-alpha1/lock/{long_store}"),
        r#"{"resourceId":"order-9","lockOwner":"w2","expiryInSeconds":5}"#,
    )
    .expect("an answer");
    assert_eq!(
        (unknown.status, unknown.json()["errorCode"].as_str()),
        (400, Some("ERR_LOCK_STORE_NOT_FOUND"))
    );
    assert!(unknown.body.len() < 1024, "{} bytes", unknown.body.len());
    // Refused before any handler runs (a store name that is not UTF-8, a method the route does
    // not take), still in Dapr's shape.
    let wrong_method = format!("/v1.0-alpha1/lock/{family}");
    for (method, path, status) in [
        ("POST", "/v1.0-alpha1/lock/%ff", 400),
        ("GET", wrong_method.as_str(), 405),
    ] {
        let reply = leasehold_e2e::http(([127, 0, 0, 1], http_port).into(), method, path)
            .expect("an answer");
        assert_eq!(reply.status, status, "{method} {path}: {}", reply.body);
        assert_eq!(
            reply.json()["errorCode"],
            "ERR_MALFORMED_REQUEST",
            "{method} {path}"
        );
    }
    let unlock = leasehold_e2e::http_with_body(
        ([127, 0, 0, 1], http_port).into(),
        "POST",
        &format!("/v1.0-alpha1/unlock/{family}"),
        r#"{"resourceId":"order-9","lockOwner":"w1"}"#,
    )
    .expect("unlock over HTTP");
    assert_eq!(
        (unlock.status, unlock.json()["status"].as_i64()),
        (200, Some(0))
    );
}

leasehold_e2e::on_each_server! {
    dapr_sdk_drives_the_lock_api:
    the_dapr_python_sdk_locks_on_redis: RedisServer,
    the_dapr_python_sdk_locks_on_postgres: PostgresServer,
}
