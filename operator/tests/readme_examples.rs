//! The README's example locks are real: each parses as a DistributedLock, resolves to a backend
//! (with stand-in Secret values), and together they cover every backend.

use std::collections::BTreeSet;

use leasehold_crds::DistributedLock;
use leasehold_lease::resource::{self, SecretValues};

fn examples() -> Vec<DistributedLock> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let section = readme
        .split("### One example per backend")
        .nth(1)
        .expect("the README has its examples section");
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
fn every_readme_example_resolves_and_every_backend_has_one() {
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
        "redlock",
        "postgres",
        "mysql",
        "sqlite",
        "zookeeper",
        "etcd",
    ]
    .into();
    assert_eq!(kinds, expected);
}
