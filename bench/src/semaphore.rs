//! `semaphore`: a key of four permits under sixteen owners, beside the same owners on one key
//! without permits (a mutual exclusion lock, contended) and on a key each (uncontended), on
//! Redis, PostgreSQL, etcd and ZooKeeper.

use super::*;

/// The semaphore's permits; the owners are [`KEYED_OWNERS`].
const PERMITS: u32 = 4;
/// How long an owner waits for a permit or the key before the run counts it as stuck.
const WAIT: Duration = Duration::from_secs(30);

/// Acquire+release cycles per second of `KEYED_OWNERS` owners of `family`, all on one key when
/// `shared`, else each on a key of its own, for `KEYED_DURATION`.
async fn cycles_on(family: &leasehold_lease::keyed::KeyedFamily, shared: bool) -> f64 {
    let key: fn(usize) -> String = if shared {
        |_| "pool".to_owned()
    } else {
        |i| format!("pool-{i}")
    };
    owners_taking_keys(family, key, WAIT).await
}

pub(crate) async fn semaphore_section() {
    use leasehold_lease::keyed::{FamilyConfig, KeyedFamily};
    println!(
        "## semaphores: {KEYED_OWNERS} owners of one sidecar cycling acquire+release ({KEYED_DURATION:?}, best of {ROUNDS}, alternating): one key of {PERMITS} permits, beside one key without permits and a key per owner"
    );
    let backends = KeyedBackends::start();
    for (name, driver) in backends.drivers().await {
        let family = |family: &str, permits: u32| {
            KeyedFamily::new(
                driver.clone(),
                FamilyConfig {
                    permits,
                    ..FamilyConfig::new(family, "bench", LEASE)
                },
                Arc::new(()),
            )
            .expect("family")
        };
        let (mutex, semaphore) = (family("mutex", 1), family("semaphore", PERMITS));
        // Best of each: a key per owner, one key, one key of PERMITS permits.
        let mut best = [0.0f64; 3];
        for _ in 0..ROUNDS {
            best[0] = best[0].max(cycles_on(&mutex, false).await);
            best[1] = best[1].max(cycles_on(&mutex, true).await);
            best[2] = best[2].max(cycles_on(&semaphore, true).await);
        }
        println!(
            "  {name:<9} a key per owner {:>7.0} cycles/s   one key {:>7.0} cycles/s   one key of {PERMITS} permits {:>7.0} cycles/s ({:.0} % of one key, {:.0} % of a key per owner; target 70 %)",
            best[0],
            best[1],
            best[2],
            100.0 * best[2] / best[1],
            100.0 * best[2] / best[0],
        );
        mutex.shutdown().await;
        semaphore.shutdown().await;
    }
}
