//! Redlock with a minority of its masters crashing and coming back while clients work.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use leasehold_lease::{Answer, Lock, LockConfig, Mode};
use leasehold_testkit::conformance::{LEASE, RENEW, SLACK, contenders};
use leasehold_testkit::{Harness, REDLOCK_MASTERS, RedlockHarness, unique_lock};

/// Crash two masters at a time (always a minority), restart them, move on to another pair, until
/// told to stop. Returns how many crashes it caused.
/// Sets its flag when dropped, so that a failed assertion also stops the crashing thread: the
/// runtime waits for its blocking threads on shutdown, and a thread that never stops would turn
/// the failure into a hang.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn crash_minorities(h: &RedlockHarness, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<usize> {
    let masters = h.masters.clone();
    tokio::task::spawn_blocking(move || {
        let mut crashes = 0;
        let mut round = 0;
        while !stop.load(Ordering::SeqCst) {
            let pair = [round % REDLOCK_MASTERS, (round + 2) % REDLOCK_MASTERS];
            for &i in &pair {
                masters.lock().unwrap()[i].kill();
                crashes += 1;
            }
            std::thread::sleep(Duration::from_millis(400));
            for &i in &pair {
                masters.lock().unwrap()[i].restart();
            }
            std::thread::sleep(Duration::from_millis(200));
            round += 1;
        }
        crashes
    })
}

/// Hand-overs go on with no overlap and strictly increasing tokens while two of the five
/// masters keep crashing and restarting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contenders_while_a_minority_crashes() {
    let mut h = RedlockHarness::new();
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_on_panic = StopOnDrop(stop.clone());
    let chaos = crash_minorities(&h, stop.clone());
    contenders(&mut h, 6, 8).await;
    stop.store(true, Ordering::SeqCst);
    let crashes = chaos.await.expect("chaos");
    assert!(crashes >= 4, "only {crashes} master crashes happened");
}

/// Minority crashes never give two holders, tokens never go back, and a holder is there once
/// the crashes stop. Renewal needs a majority only, so the holder usually keeps its lease
/// throughout; on this 2-core machine it sometimes does not (a renewal needs all three
/// surviving masters while two are down, each within its timeout), and b then takes over
/// legitimately. How often the holder lost its claim is printed, not asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minority_crashes_never_give_two_holders() {
    let h = RedlockHarness::new();
    let lock = unique_lock("steady");
    let config = |identity| LockConfig {
        renew_interval: RENEW,
        mode: Mode::Campaign,
        ..LockConfig::new(&lock, identity, LEASE)
    };
    let a = Lock::start(h.driver().await, config("a"), Arc::new(())).expect("a");
    let deadline = tokio::time::Instant::now() + SLACK;
    while !a.answer().is_holder() {
        assert!(tokio::time::Instant::now() < deadline, "a never held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let Answer::Holder { token: first, .. } = a.answer() else {
        unreachable!()
    };
    let b = Lock::start(h.driver().await, config("b"), Arc::new(())).expect("b");
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_on_panic = StopOnDrop(stop.clone());
    let chaos = crash_minorities(&h, stop.clone());
    let (mut a_not_holding, mut b_holding, mut samples) = (0, 0, 0);
    let mut highest = first;
    let until = tokio::time::Instant::now() + Duration::from_secs(4);
    while tokio::time::Instant::now() < until {
        // Both claims judged at one instant: their self-fenced deadlines, not two reads apart.
        let now = leasehold_lease::BootInstant::now();
        let (sa, sb) = (a.snapshot().answer_at(now), b.snapshot().answer_at(now));
        assert!(
            !(sa.is_holder() && sb.is_holder()),
            "two holders: {sa:?} {sb:?}"
        );
        for answer in [&sa, &sb] {
            if let Answer::Holder { token, .. } = answer {
                assert!(*token >= highest, "token went from {highest} to {token}");
                highest = *token;
            }
        }
        a_not_holding += usize::from(!sa.is_holder());
        b_holding += usize::from(sb.is_holder());
        samples += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::SeqCst);
    chaos.await.expect("chaos");
    let deadline = tokio::time::Instant::now() + LEASE + RENEW + SLACK;
    while !(a.answer().is_holder() || b.answer().is_holder()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no holder after the crashes"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!(
        "during the crashes, a did not claim in {a_not_holding} of {samples} samples and b held in {b_holding}; \
         tokens {first} to {highest}"
    );
}
