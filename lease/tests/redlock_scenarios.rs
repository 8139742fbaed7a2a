//! Redlock with a minority of its masters crashing and coming back while clients work, and
//! with a client's connections to its masters falling silent.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use leasehold_lease::{Answer, Lock, LockConfig, Mode};
use leasehold_testkit::conformance::{LEASE, RENEW, SLACK, contenders_under_faults};
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
    contenders_under_faults(&mut h, 6, 8).await;
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

/// Masters without durable data that restart one after another while a lock is held come back
/// empty, a majority of them: the lease and the token counter are gone from those. Each sits
/// out one lease after its start, so nobody takes the lock while its holder's claim stands, and
/// the next token is above the holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_majority_restarted_empty_grants_no_held_lock_and_no_lower_token() {
    use leasehold_lease::Acquire;
    let h = RedlockHarness::not_durable();
    let driver = h.driver().await;
    let lock = unique_lock("empty");
    let lease = Duration::from_secs(3);
    // Masters just started sit out one lease too (they cannot tell a start from a restart).
    let started = tokio::time::Instant::now();
    let (a, sent) = loop {
        let sent = tokio::time::Instant::now();
        if let Acquire::Acquired(a) = driver.try_acquire(&lock, "a", lease).await.unwrap() {
            break (a, sent);
        }
        assert!(
            started.elapsed() < lease + SLACK,
            "a never took the free lock"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let a_claims_until = sent + lease - leasehold_lease::safety_margin(lease);
    for i in 0..REDLOCK_MASTERS / 2 + 1 {
        h.masters.lock().unwrap()[i].restart();
    }
    let restarted = tokio::time::Instant::now();
    let b = loop {
        let asked = tokio::time::Instant::now();
        // A restarted master's first answers may be errors (its old connection): not taken.
        if let Ok(Acquire::Acquired(b)) = driver.try_acquire(&lock, "b", lease).await {
            assert!(
                asked >= a_claims_until,
                "b took the lock {:?} before a's claim (token {}) ended, with token {}",
                a_claims_until - asked,
                a.token,
                b.token
            );
            break b;
        }
        assert!(
            restarted.elapsed() < lease * 3 + SLACK,
            "b never took the lock once a's lease had run out"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        b.token > a.token,
        "b's token {} is not above a's {} after the restarts",
        b.token,
        a.token
    );
}

/// The connections a contender has to every master fall silent without being closed (a NAT or
/// conntrack entry gone): its calls on them are cut short at the master timeout, unanswered.
/// The next call after a response timeout goes out on new connections, so the contender takes
/// the lock once the holder releases it; kept on the silent connections, every attempt failed
/// until the kernel gave them up, a quarter of an hour later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contender_whose_connections_fall_silent_takes_the_lock_on_new_ones() {
    use leasehold_lease::Acquire;
    use leasehold_testkit::{FaultProxy, RedisServer, driver_for};
    let masters: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let proxies: Vec<FaultProxy> = masters
        .iter()
        .map(|m| FaultProxy::start(m.port()))
        .collect();
    let join = |ports: Vec<u16>| {
        let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        format!("redlock://{}", hosts.join(","))
    };
    let holder = driver_for(&join(masters.iter().map(RedisServer::port).collect())).await;
    let contender = driver_for(&join(proxies.iter().map(|p| p.port).collect())).await;
    let lock = unique_lock("silent");
    let ttl = Duration::from_secs(5);
    let Acquire::Acquired(lease) = holder.try_acquire(&lock, "a", ttl).await.unwrap() else {
        panic!("a free lock");
    };
    assert!(matches!(
        contender.try_acquire(&lock, "b", ttl).await.unwrap(),
        Acquire::Busy(_)
    ));
    for proxy in &proxies {
        proxy.strand();
    }
    assert!(holder.release(&lease).await.unwrap());
    let start = tokio::time::Instant::now();
    loop {
        match contender.try_acquire(&lock, "b", ttl).await {
            Ok(Acquire::Acquired(taken)) => {
                assert!(taken.token > lease.token, "{taken:?} after {lease:?}");
                break;
            }
            other => assert!(
                start.elapsed() < Duration::from_secs(5),
                "the contender never took the released lock: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
