//! The TairString module for a test `redis-server`, built once per test process from
//! `../shared/vendor/TairString` (beside the repository) with the C compiler, as the vendor
//! README says, or taken from `LEASEHOLD_TAIRSTRING_MODULE`. Anything missing fails the run
//! with what to do.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

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
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/vendor/TairString");
    assert!(
        source.join("src/tairstring.c").is_file(),
        "the TairString sources are missing at {}: the tests of tair:// build the module from \
         ../shared/vendor/TairString beside the repository; put it there, or set \
         LEASEHOLD_TAIRSTRING_MODULE to a built tairstring_module.so",
        source.display()
    );
    let dir = std::env::temp_dir().join(format!("leasehold-tairstring-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("module dir");
    let module = dir.join("tairstring_module.so");
    let built = Command::new("cc")
        .args(["-O2", "-fPIC", "-shared", "-std=gnu99"])
        .arg(format!("-I{}", source.join("dep").display()))
        .arg(format!("-I{}", source.join("src").display()))
        .arg(source.join("src/tairstring.c"))
        .arg(source.join("dep/util.c"))
        .arg("-o")
        .arg(&module)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run cc to build the TairString module ({e}): apt-get install gcc")
        });
    assert!(
        built.status.success(),
        "building the TairString module failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    module
}
