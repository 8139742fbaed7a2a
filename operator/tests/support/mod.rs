//! What the manifest and README tests share: running `charts/check.py` (Helm's engine and the
//! Kubernetes schemas) with the venv that scripts/install-chart-tools makes.

#![allow(dead_code)] // each test binary uses its own part

use std::path::Path;
use std::process::Command;

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
