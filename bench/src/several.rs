//! `several`: owners taking three keys at once (all or nothing), beside the same owners taking
//! the same three keys one by one, on Redis, PostgreSQL, etcd and ZooKeeper.

use super::*;

use leasehold_lease::keyed::{FamilyConfig, KeyAnswer, KeyedFamily, KeysAnswer};

/// Keys per acquisition.
const KEYS: usize = 3;

/// Cycles per second of [`KEYED_OWNERS`] owners each taking its own [`KEYS`] keys and giving
/// them back: at once (`together`) or one acquisition and one release per key.
async fn cycles(family: &KeyedFamily, together: bool) -> f64 {
    owners_cycling(|i, start| {
        let family = family.clone();
        async move {
            let keys: Vec<String> = (0..KEYS).map(|k| format!("order-{i}-{k}")).collect();
            let owner = format!("worker-{i}");
            let mut cycles = 0u64;
            while start.elapsed() < KEYED_DURATION {
                if together {
                    let answer = family
                        .acquire_all(&keys, &owner, Duration::ZERO, LEASE)
                        .await
                        .expect("acquire");
                    assert!(matches!(answer, KeysAnswer::Held(_)), "{answer:?}");
                    family.release_all(&keys, &owner).await.expect("release");
                } else {
                    for key in &keys {
                        let answer = family
                            .acquire(key, &owner, Duration::ZERO, LEASE)
                            .await
                            .expect("acquire");
                        assert!(matches!(answer, KeyAnswer::Held { .. }), "{answer:?}");
                    }
                    for key in &keys {
                        family.release(key, &owner).await.expect("release");
                    }
                }
                cycles += 1;
            }
            cycles
        }
    })
    .await
}

pub(crate) async fn several_section() {
    println!(
        "## several keys at once: {KEYED_OWNERS} owners of one sidecar, each taking its own {KEYS} keys and giving them back ({KEYED_DURATION:?}, best of {ROUNDS}, alternating): all or nothing in one call, beside {KEYS} acquisitions and {KEYS} releases"
    );
    let backends = KeyedBackends::start();
    for (name, driver) in backends.drivers().await {
        let family = KeyedFamily::new(
            driver,
            FamilyConfig::new("several", "bench", LEASE),
            Arc::new(()),
        )
        .expect("family");
        let (mut together, mut apart) = (0.0f64, 0.0f64);
        for _ in 0..ROUNDS {
            apart = apart.max(cycles(&family, false).await);
            together = together.max(cycles(&family, true).await);
        }
        println!(
            "  {name:<9} {KEYS} keys at once {together:>7.0} cycles/s   one by one {apart:>7.0} cycles/s   ({:.0} %)",
            100.0 * together / apart,
        );
        family.shutdown().await;
    }
}
