//! The TairString commands for a test `redis-server`: the module `leasehold-tairstring-fake`
//! (a test double written in this repository, see `tairstring-fake/src/lib.rs`), built once
//! per test process with cargo into the target directory the tests run from, or a real module
//! given as `LEASEHOLD_TAIRSTRING_MODULE`. Anything missing fails the run with what to do.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The crate that builds the test double.
const FAKE_CRATE: &str = "leasehold-tairstring-fake";
/// The library cargo writes for it.
const FAKE_LIBRARY: &str = "libleasehold_tairstring_fake.so";

/// The module's path, built on first use.
pub fn module() -> PathBuf {
    static MODULE: OnceLock<PathBuf> = OnceLock::new();
    MODULE.get_or_init(build).clone()
}

fn build() -> PathBuf {
    if let Ok(given) = std::env::var("LEASEHOLD_TAIRSTRING_MODULE") {
        let given = PathBuf::from(given);
        assert!(
            given.is_file(),
            "LEASEHOLD_TAIRSTRING_MODULE={} is not a file",
            given.display()
        );
        return given;
    }
    let target = target_dir();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    // The cargo that runs the tests, where it says which; up to date, this is a no-op.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let built = Command::new(cargo)
        .args(["build", "--quiet", "--locked", "-p", FAKE_CRATE])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .output()
        .unwrap_or_else(|e| panic!("cannot run cargo to build {FAKE_CRATE}: {e}"));
    assert!(
        built.status.success(),
        "building the TairString test double ({FAKE_CRATE}) failed; its bindings need libclang \
         (scripts/install-test-deps installs libclang-dev):\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let module = target.join("debug").join(FAKE_LIBRARY);
    assert!(module.is_file(), "cargo built no {}", module.display());
    module
}

/// The target directory of the running executable (a test, or the benchmark).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running executable's path");
    target_dir_of(&exe).unwrap_or_else(|| {
        panic!(
            "{} is not inside a cargo target directory: build the TairString test double \
             with `cargo build -p {FAKE_CRATE}` and set LEASEHOLD_TAIRSTRING_MODULE to its \
             {FAKE_LIBRARY}",
            exe.display()
        )
    })
}

/// The nearest ancestor of `exe` that cargo marked as a target directory: by `CACHEDIR.TAG`,
/// which cargo writes only into a directory it creates (not into one made beforehand, as CI
/// makes its shared cache), or by `.rustc_info.json`, which it writes into every one.
fn target_dir_of(exe: &Path) -> Option<PathBuf> {
    exe.ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").is_file() || dir.join(".rustc_info.json").is_file())
        .map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_directory_made_before_cargo_ran_is_found() {
        let root = tempfile::tempdir().unwrap();
        let deps = root.path().join("debug/deps");
        std::fs::create_dir_all(&deps).unwrap();
        let exe = deps.join("tair_scenarios-0123abcd");
        assert_eq!(target_dir_of(&exe), None);
        std::fs::write(root.path().join(".rustc_info.json"), "{}").unwrap();
        assert_eq!(target_dir_of(&exe).as_deref(), Some(root.path()));
    }
}
