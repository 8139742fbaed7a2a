//! A machine suspended for longer than the lease (a laptop lid, a paused VM, a host that
//! snapshots its guests): the backend's clock went on, so the lock may belong to someone else by
//! the time this process runs again, and it must not say "you are the holder" for a moment
//! longer. A test cannot suspend the machine it runs on; `simulate_suspend` moves this process's
//! boot clock ahead while tokio's monotonic clock stands still, which is exactly what a resume
//! looks like from inside. Its own test binary, because the jump is process-wide.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::boot_clock::simulate_suspend;
use leasehold_lease::{Answer, BackendUrl, Lock, LockConfig};
use tokio::time::{Instant, sleep};

const LEASE: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_resumed_after_a_suspend_longer_than_its_lease_stops_claiming_at_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let driver = leasehold_lease::connect(&BackendUrl::parse(&url).expect("url"))
        .await
        .expect("driver");
    let lock = Lock::start(
        driver,
        LockConfig::new("suspended", "laptop", LEASE),
        Arc::new(()),
    )
    .expect("lock");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lock.answer().is_holder() {
        assert!(Instant::now() < deadline, "never acquired");
        sleep(Duration::from_millis(10)).await;
    }
    let Answer::Holder { valid_for, .. } = lock.answer() else {
        unreachable!()
    };
    assert!(valid_for > Duration::from_secs(1), "{valid_for:?}");

    simulate_suspend(LEASE * 2);
    // Read before the holder task has had any chance to run again, as an app's request that
    // arrives first thing after the resume would.
    let answer = lock.answer();
    assert!(
        !answer.is_holder(),
        "the lease ran out during the suspend, yet the lock still answers {answer:?}"
    );
    lock.shutdown().await;
}
