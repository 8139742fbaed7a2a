//! What a fresh machine with only the Rust toolchain needs to build Leasehold: nothing else.
//! `scripts/test` also sets `PROTOC` to a path that does not exist, so a build script that runs
//! protoc fails the build even where one is installed; this checks the lock file and the
//! scripts, so that the reason is named.

use std::path::Path;

fn workspace_file(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Crates whose build scripts run protoc or link a system library that Debian does not ship
/// with the toolchain.
const NEED_SYSTEM_PACKAGES: &[(&str, &str)] = &[
    ("prost-build", "runs protoc"),
    ("tonic-build", "runs protoc"),
    ("tonic-prost-build", "runs protoc"),
    ("protobuf-codegen", "runs protoc"),
    ("openssl-sys", "links libssl (libssl-dev)"),
];

#[test]
fn no_dependency_needs_a_system_package() {
    let lock = workspace_file("Cargo.lock");
    let offenders: Vec<String> = NEED_SYSTEM_PACKAGES
        .iter()
        .filter(|(name, _)| lock.contains(&format!("name = \"{name}\"\n")))
        .map(|(name, why)| format!("{name} ({why})"))
        .collect();
    assert!(
        offenders.is_empty(),
        "Cargo.lock has crates that need more than Rust on a fresh machine: {offenders:?}"
    );
}

#[test]
fn set_up_scripts_install_no_protoc() {
    for file in [
        "scripts/sidecar",
        "scripts/test",
        "scripts/install-test-deps",
        "Dockerfile",
    ] {
        let text = workspace_file(file);
        assert!(
            !text.contains("protobuf-compiler") && !text.contains("libprotobuf"),
            "{file} installs protoc, which the build no longer needs"
        );
    }
    assert!(workspace_file("scripts/test").contains("PROTOC=/nonexistent"));
}
