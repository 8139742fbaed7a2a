//! docs/reference/openapi.yaml against the sidecar: the document is valid OpenAPI 3.1, it lists exactly
//! the routes the sidecar serves, and schemathesis (from PyPI, a client nobody on this project
//! wrote) fuzzes every route it lists against a running sidecar on SQLite and on Redis: no 5xx,
//! every answer's status, content type and body as documented, and afterwards the sidecar
//! still serving and a key held before the run still held by its owner with the same token.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use leasehold_e2e::{Sidecar, eventually};
use leasehold_testkit::free_port;

fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository")
}

fn document() -> PathBuf {
    repository().join("docs/reference/openapi.yaml")
}

/// A program of the tests' venv, which scripts/install-test-deps gives
/// tests/openapi/requirements.txt.
fn venv_program(name: &str) -> PathBuf {
    let venv = std::env::var("LEASEHOLD_VENV").unwrap_or_else(|_| "/var/tmp/leasehold-venv".into());
    let program = Path::new(&venv).join("bin").join(name);
    let runs = Command::new(&program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        runs,
        "{} does not run: run scripts/install-test-deps (scripts/test does), which installs \
         tests/openapi/requirements.txt into the venv",
        program.display()
    );
    program
}

/// `(method, path)` of every operation the document lists.
fn documented_routes() -> BTreeSet<(String, String)> {
    let text = std::fs::read_to_string(document()).expect("docs/reference/openapi.yaml");
    let doc: serde_json::Value =
        serde_yaml::from_str(&text).expect("docs/reference/openapi.yaml is YAML");
    let mut routes = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in METHODS {
            if item.get(method).is_some() {
                routes.insert((method.to_owned(), path.clone()));
            }
        }
    }
    routes
}

const METHODS: [&str; 5] = ["get", "post", "put", "delete", "patch"];

/// `(method, path)` of every `.route("PATH", METHOD(...)[.METHOD(...)])` in the sidecar's
/// sources.
fn served_routes() -> BTreeSet<(String, String)> {
    let mut routes = BTreeSet::new();
    let sources = repository().join("sidecar/src");
    for entry in std::fs::read_dir(&sources).expect("sidecar/src") {
        let file = entry.expect("a directory entry").path();
        if file.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let source = std::fs::read_to_string(&file).expect("a source file");
        for call in source.split(".route(").skip(1) {
            let Some(rest) = call.trim_start().strip_prefix('"') else {
                continue;
            };
            let (path, rest) = rest.split_once('"').expect("a route's closing quote");
            // The method router: the call's second argument, up to its closing parenthesis.
            let mut depth = 1;
            let end = rest
                .char_indices()
                .find(|&(_, c)| {
                    depth += match c {
                        '(' => 1,
                        ')' => -1,
                        _ => 0,
                    };
                    depth == 0
                })
                .map_or(rest.len(), |(at, _)| at);
            let router = &rest[..end];
            let mut found = false;
            for method in METHODS {
                let called = router.match_indices(&format!("{method}(")).any(|(at, _)| {
                    router[..at]
                        .chars()
                        .next_back()
                        .is_none_or(|c| !c.is_alphanumeric() && c != '_')
                });
                if called {
                    routes.insert((method.to_owned(), path.to_owned()));
                    found = true;
                }
            }
            assert!(
                found,
                "{}: route {path} has a method router this test does not read: {router}",
                file.display()
            );
        }
    }
    routes
}

#[test]
fn the_openapi_document_lists_exactly_the_routes_the_sidecar_serves() {
    let documented = documented_routes();
    let served = served_routes();
    assert!(served.len() >= 20, "the routers were not read: {served:?}");
    let undocumented: Vec<_> = served.difference(&documented).collect();
    let not_served: Vec<_> = documented.difference(&served).collect();
    assert!(
        undocumented.is_empty() && not_served.is_empty(),
        "served but not in docs/reference/openapi.yaml: {undocumented:?}; in docs/reference/openapi.yaml but not \
         served: {not_served:?}"
    );
}

#[test]
fn the_openapi_document_is_valid_openapi() {
    let output = Command::new(venv_program("openapi-spec-validator"))
        .arg(document())
        .output()
        .expect("run openapi-spec-validator");
    assert!(
        output.status.success(),
        "docs/reference/openapi.yaml is not valid OpenAPI: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The seed schemathesis generates from: a fixed one, so that the suite sends the same requests
/// each run; `LEASEHOLD_SCHEMATHESIS_SEED` to explore others (or replay one a failure printed).
fn seed() -> u64 {
    std::env::var("LEASEHOLD_SCHEMATHESIS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_128)
}

/// Run schemathesis on the `operations` operations `filter` selects, against `url`; panics with
/// its report unless it tested each of them and every check passed. Returns its summary line.
fn schemathesis(
    url: &str,
    filter: &[&str],
    operations: usize,
    seed: u64,
    sidecar: &Sidecar,
) -> String {
    let openapi = repository().join("tests/openapi");
    let workdir = tempfile::tempdir().expect("a working directory");
    let output = Command::new(venv_program("schemathesis"))
        .arg("--config-file")
        .arg(openapi.join("schemathesis.toml"))
        .arg("run")
        .arg(document())
        .args(["--url", url])
        .args(filter)
        .args(["--checks", "all"])
        // A schema cannot say that `wait` is at most 5m or which owner holds a key, so valid
        // requests are refused (400, 409) as documented; status_code_conformance checks that.
        .args(["--exclude-checks", "positive_data_acceptance"])
        .args(["--seed", &seed.to_string()])
        .arg("--no-color")
        // Hypothesis keeps its example database in the working directory.
        .current_dir(workdir.path())
        .env("PYTHONPATH", &openapi)
        .env("SCHEMATHESIS_HOOKS", "hooks")
        .env("NO_COLOR", "1")
        .output()
        .expect("run schemathesis");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "schemathesis found failures (seed {seed}; replay with LEASEHOLD_SCHEMATHESIS_SEED={seed}):\n\
         {report}{}\nsidecar log:\n{}",
        String::from_utf8_lossy(&output.stderr),
        sidecar.log()
    );
    let count = |label: &str| {
        report
            .lines()
            .find_map(|l| l.trim().strip_prefix(label))
            .and_then(|rest| rest.trim().split('/').next()?.trim().parse::<usize>().ok())
    };
    assert_eq!(
        (count("Selected:"), count("Tested:")),
        (Some(operations), Some(operations)),
        "schemathesis did not test each of the {operations} operations: {report}"
    );
    let summary = report
        .lines()
        .skip_while(|l| !l.contains("Test cases:"))
        .nth(1)
        .unwrap_or_default()
        .trim()
        .to_owned();
    assert!(
        summary.contains("generated") && !summary.starts_with("0 generated"),
        "schemathesis ran no test case: {report}"
    );
    summary
}

fn schemathesis_fuzzes_every_route(backend: &str) {
    let (dapr_port, probe_port) = (free_port(), free_port());
    let sidecar = Sidecar::start(
        "fuzzed",
        backend,
        // The names tests/openapi/schemathesis.toml gives schemathesis.
        "jobs",
        &[
            "--mode",
            "on-demand",
            "--keyed",
            "orders",
            "--max-keys",
            "256",
            "--dapr-http-listen",
            &format!("127.0.0.1:{dapr_port}"),
            "--probe-listen",
            &format!("127.0.0.1:{probe_port}"),
        ],
    );
    // A key held by an owner nobody else names: requests for it by other owners, which the
    // fuzzing makes ("guard" is among the keys it is given), must change nothing.
    let owner = format!("guard-{:016x}", rand::random::<u64>());
    let guard = format!("/locks/orders/keys/guard?owner={owner}");
    let taken = sidecar.post(&format!(
        "/locks/orders/keys/guard/acquire?owner={owner}&hold=1h"
    ));
    let token = taken.token();
    let seed = seed();
    let lock_api = format!("http://{}", sidecar.addr);
    let mut summaries = vec![
        (
            "lock API",
            schemathesis(
                &lock_api,
                &["--exclude-path-regex", "^/(v1|resign)|/force-release$"],
                20,
                seed,
                &sidecar,
            ),
        ),
        (
            "probe listener",
            schemathesis(
                &format!("http://127.0.0.1:{probe_port}"),
                &["--include-path-regex", "^/(healthz|readyz|metrics)$"],
                3,
                seed,
                &sidecar,
            ),
        ),
        (
            "Dapr HTTP API",
            schemathesis(
                &format!("http://127.0.0.1:{dapr_port}"),
                &["--include-path-regex", "^/v1"],
                5,
                seed,
                &sidecar,
            ),
        ),
    ];
    let after = sidecar.get(&guard);
    assert_eq!(
        (after.status, after.json()["fencingToken"].as_u64()),
        (200, Some(token)),
        "the guard key changed hands during the fuzzing (seed {seed}): {}",
        after.body
    );
    // After the guard is checked: a force-release ends a holding whoever its owner, and the
    // fuzzing may name the guard's token.
    summaries.push((
        "force-release",
        schemathesis(
            &lock_api,
            &["--include-path-regex", "/force-release$"],
            2,
            seed,
            &sidecar,
        ),
    ));
    // Last, as it steps down from the locks for good.
    summaries.push((
        "resign",
        schemathesis(&lock_api, &["--include-path", "/resign"], 1, seed, &sidecar),
    ));
    eventually(
        Duration::from_secs(5),
        "the resigned lock answers 409",
        || sidecar.get("/lock").status == 409,
    );
    assert_eq!(sidecar.get("/healthz").status, 200);
    let after = sidecar.get(&guard);
    assert_eq!(after.token(), token, "resigning touched a family's key");
    for (what, summary) in summaries {
        eprintln!("schemathesis on {backend}, {what} (seed {seed}): {summary}");
    }
}

#[test]
fn schemathesis_finds_no_failure_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    schemathesis_fuzzes_every_route(&format!(
        "sqlite://{}",
        dir.path().join("fuzzed.db").display()
    ));
}

leasehold_e2e::on_each_server! {
    schemathesis_fuzzes_every_route:
    schemathesis_finds_no_failure_on_redis: RedisServer,
}
