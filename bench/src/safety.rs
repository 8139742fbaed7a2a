//! `safety`: the multi-process safety check per driver, briefly (`scripts/soak` runs it longer).

use super::*;

/// How long the benchmark runs the safety check per driver (`scripts/soak` runs it longer).
pub(crate) const SAFETY_DURATION: Duration = Duration::from_secs(30);

/// The multi-process safety check per driver: hand-overs, faults, overlaps (must be 0) and the
/// longest time without a holder.
pub(crate) async fn safety_section() {
    use leasehold_e2e::safety::{self, Scenario, Target};
    println!(
        "## safety check: 3 sidecars, random kill/pause/restart/partition, {SAFETY_DURATION:?} per driver (lease {:?}, renew {:?})",
        safety::LEASE,
        safety::RENEW
    );
    for target in Target::ALL {
        let seed = rand::random();
        let report = tokio::task::spawn_blocking(move || {
            safety::run(Scenario::campaign(target), SAFETY_DURATION, 3, seed)
        })
        .await
        .expect("safety run");
        println!("  {}", report.summary());
        for violation in &report.violations {
            println!("    VIOLATION {violation}");
        }
    }
}
