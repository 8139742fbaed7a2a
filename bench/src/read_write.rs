//! `read-write`: sixteen owners on one key of four permits of a read-write family, reading only
//! and then one acquisition in ten writing, beside the same owners on a semaphore's key of four
//! permits, on Redis, PostgreSQL, etcd and ZooKeeper.

use super::*;

/// The key's permits (readers at once); the owners are [`KEYED_OWNERS`].
const PERMITS: u32 = 4;
/// How long an owner waits for the key before the run counts it as stuck.
const WAIT: Duration = Duration::from_secs(30);

/// Acquire+release cycles per second of `KEYED_OWNERS` owners of `family` on one key, for
/// `KEYED_DURATION`: every `write_every`-th acquisition of an owner writes (0: none does).
async fn cycles(family: &leasehold_lease::keyed::KeyedFamily, write_every: u64) -> f64 {
    owners_cycling(|i, start| {
        let family = family.clone();
        async move {
            let owner = format!("worker-{i}");
            let mut cycles = 0u64;
            while start.elapsed() < KEYED_DURATION {
                // Owners write at different turns, so that writes spread over the run.
                let writes = write_every > 0 && (cycles + i as u64).is_multiple_of(write_every);
                let answer = if writes {
                    family.acquire_write("doc", &owner, WAIT, LEASE).await
                } else {
                    family.acquire("doc", &owner, WAIT, LEASE).await
                }
                .expect("acquire");
                assert!(
                    matches!(answer, leasehold_lease::keyed::KeyAnswer::Held { .. }),
                    "{answer:?}"
                );
                family.release("doc", &owner).await.expect("release");
                cycles += 1;
            }
            cycles
        }
    })
    .await
}

pub(crate) async fn read_write_section() {
    use leasehold_lease::keyed::{FamilyConfig, KeyedFamily};
    println!(
        "## read-write locks: {KEYED_OWNERS} owners of one sidecar cycling acquire+release on one key of {PERMITS} permits ({KEYED_DURATION:?}, best of {ROUNDS}, alternating): a semaphore's key, a read-write key read only, and one acquisition in ten writing"
    );
    let backends = KeyedBackends::start();
    for (name, driver) in backends.drivers().await {
        let family = |family: &str, read_write: bool| {
            KeyedFamily::new(
                driver.clone(),
                FamilyConfig {
                    permits: PERMITS,
                    read_write,
                    ..FamilyConfig::new(family, "bench", LEASE)
                },
                Arc::new(()),
            )
            .expect("family")
        };
        let (semaphore, read_write) = (family("semaphore", false), family("readwrite", true));
        let mut best = [0.0f64; 3];
        for _ in 0..ROUNDS {
            best[0] = best[0].max(cycles(&semaphore, 0).await);
            best[1] = best[1].max(cycles(&read_write, 0).await);
            best[2] = best[2].max(cycles(&read_write, 10).await);
        }
        println!(
            "  {name:<9} semaphore {:>7.0} cycles/s   read-write, reads {:>7.0} cycles/s ({:.0} %)   one in ten writes {:>7.0} cycles/s ({:.0} %)",
            best[0],
            best[1],
            100.0 * best[1] / best[0],
            best[2],
            100.0 * best[2] / best[0],
        );
        semaphore.shutdown().await;
        read_write.shutdown().await;
    }
}
