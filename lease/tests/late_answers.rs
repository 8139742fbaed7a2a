//! An acquisition whose answer comes after the engine stopped waiting for it may still have taken
//! the lock: SQLite's worker runs a statement it was handed whether or not anyone still waits,
//! and a command on the wire is carried out all the same. Such a late acquisition must be
//! adopted while its claim still stands, or given back, never left holding the lock for nobody
//! until its lease runs out (a conformance run on SQLite met exactly that: an owner released its
//! key and, taking it again, found its own earlier attempt in the way).
//!
//! The late answers come from [`FaultyDriver::delay_responses`] over a real SQLite file: the
//! backend carries each call out at once, and its answer reaches the engine later.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::keyed::{FamilyConfig, KeyAnswer, KeyedFamily};
use leasehold_lease::{Answer, Backend, BackendUrl, Driver, EventKind, Lock, LockConfig, Mode};
use leasehold_testkit::faulty::FaultyDriver;
use leasehold_testkit::{SqliteHarness, unique_lock};
use tokio::time::{Instant, sleep};

/// Renew interval 2 s: the engine waits that long for an answer.
const LEASE: Duration = Duration::from_secs(6);
/// Longer than the engine waits, far shorter than the lease.
const LATE: Duration = Duration::from_millis(2500);
const HOLD: Duration = Duration::from_secs(60);

async fn sqlite(harness: &SqliteHarness) -> Arc<dyn Backend> {
    let url = format!("sqlite://{}", harness.path().display());
    leasehold_lease::connect(&BackendUrl::parse(&url).expect("url"))
        .await
        .expect("driver")
}

/// A SQLite file, and a driver on it whose answers can be made late.
async fn late_sqlite() -> (SqliteHarness, Arc<FaultyDriver>) {
    let harness = SqliteHarness::new();
    let faulty = FaultyDriver::wrap(sqlite(&harness).await);
    (harness, faulty)
}

/// A pod's read-write family `name` of two permits on `driver`.
fn read_write_family(driver: Arc<dyn Backend>, name: &str, identity: &str) -> KeyedFamily {
    KeyedFamily::new(
        driver,
        FamilyConfig {
            permits: 2,
            read_write: true,
            ..FamilyConfig::new(name, identity, LEASE)
        },
        Arc::new(()),
    )
    .expect("family")
}

/// A lock `a` campaigns for through `faulty`, once it holds, and its token.
async fn campaigning_holder(faulty: &Arc<FaultyDriver>, name: &str) -> (Lock, u64) {
    let holder = Lock::start(
        faulty.clone(),
        LockConfig {
            mode: Mode::Campaign,
            ..LockConfig::new(name, "a", LEASE)
        },
        Arc::new(()),
    )
    .unwrap();
    let started = Instant::now();
    loop {
        if let Answer::Holder { token, .. } = holder.answer() {
            return (holder, token);
        }
        assert!(started.elapsed() < Duration::from_secs(5), "a never held");
        sleep(Duration::from_millis(10)).await;
    }
}

/// `lock` still holds `after` from now, and lost nothing meanwhile (`events`, its events since
/// before); then it is shut down.
async fn still_held_after(
    lock: &Lock,
    events: &mut tokio::sync::broadcast::Receiver<leasehold_lease::Event>,
    after: Duration,
) {
    sleep(after).await;
    assert!(
        lock.answer().is_holder(),
        "the lock was lost: {:?}",
        lock.snapshot()
    );
    while let Ok(event) = events.try_recv() {
        assert_ne!(event.kind, EventKind::Lost, "{event:?}");
    }
    lock.shutdown().await;
}

fn on_demand(driver: Arc<dyn Backend>, name: &str, identity: &str) -> Lock {
    let mut config = LockConfig::new(name, identity, LEASE);
    config.mode = Mode::OnDemand;
    Lock::start(driver, config, Arc::new(())).expect("lock")
}

/// A waiter still there when the late answer comes gets the lock it took, with that
/// acquisition's token, rather than a second attempt that finds the first in the way and waits
/// out its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_acquisition_is_adopted_while_its_claim_stands() {
    let (_harness, faulty) = late_sqlite().await;
    let name = unique_lock("late");
    let a = on_demand(faulty.clone(), &name, "a");
    faulty.delay_responses(LATE);
    let started = Instant::now();
    let answer = a.acquire(LEASE, HOLD).await.expect("acquire");
    faulty.delay_responses(Duration::ZERO);
    let Answer::Holder { token, .. } = answer else {
        panic!("the waiter did not get the lock its own attempt took: {answer:?}")
    };
    assert_eq!(
        token, 1,
        "a second acquisition was made: the first, answered late, was dropped"
    );
    assert!(
        started.elapsed() < LEASE,
        "took {:?}: the waiter waited out its own attempt's lease",
        started.elapsed()
    );
    assert!(a.release().await.expect("release"));
}

/// Nobody waits any more when the late answer comes (a try-lock answered "cannot tell"): what
/// the attempt took is given back at once, and another pod's waiter gets the lock long before
/// that lease would have run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_acquisition_nobody_waits_for_is_given_back() {
    let (harness, faulty) = late_sqlite().await;
    let name = unique_lock("late");
    let a = on_demand(faulty.clone(), &name, "a");
    let b = on_demand(sqlite(&harness).await, &name, "b");
    faulty.delay_responses(LATE);
    let sent = Instant::now();
    let answer = a.acquire(Duration::ZERO, HOLD).await.expect("acquire");
    assert_eq!(answer, Answer::Unknown, "a's try-lock could not tell");
    faulty.delay_responses(Duration::ZERO);
    // a's attempt took the lock in the file when it was sent; its lease would last until about
    // LEASE from then. Given back when its answer comes (LATE), b gets it before: b waits until
    // a second before that lease would end.
    let wait = (sent + LEASE - Duration::from_secs(1)).saturating_duration_since(Instant::now());
    let answer = b.acquire(wait, HOLD).await.expect("acquire");
    assert!(
        answer.is_holder(),
        "b did not get the lock within {wait:?}, a second before a's late attempt's lease would end: {answer:?} (that attempt kept it for nobody)"
    );
    assert!(!a.answer().is_holder(), "a claims a lock nobody asked for");
    assert!(b.release().await.expect("release"));
}

/// A key's hold that runs out while a renewal's answer is late is over for the key's status,
/// a reader's and a writer's: not "held" with no time left, while its release waits for that
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_hold_that_ran_out_during_a_late_renewal_is_not_held() {
    for write in [false, true] {
        let (_harness, faulty) = late_sqlite().await;
        let family = KeyedFamily::new(
            faulty.clone(),
            FamilyConfig {
                renew_interval: Duration::from_secs(1),
                read_write: write,
                ..FamilyConfig::new(&unique_lock("lapsing"), "pod-a", Duration::from_secs(3))
            },
            Arc::new(()),
        )
        .expect("family");
        faulty.stall_next_renewal_answer(Duration::from_millis(700));
        let hold = Duration::from_millis(1100);
        let answer = if write {
            family
                .acquire_write("order-1", "w1", Duration::ZERO, hold)
                .await
        } else {
            family.acquire("order-1", "w1", Duration::ZERO, hold).await
        }
        .expect("acquire");
        assert!(matches!(answer, KeyAnswer::Held { .. }), "{answer:?}");
        sleep(Duration::from_millis(1300)).await;
        let status = family.status("order-1", Some("w1")).expect("status");
        assert_eq!(
            status,
            KeyAnswer::NotHeld,
            "the hold ran out, yet the key's status (write: {write}) says {status:?}"
        );
        family.shutdown().await;
    }
}

/// The same for a lock: a hold that ran out while the engine waited for a renewal's late answer
/// is not "held" with no time left (a holder label, a metric, a stream's first state) while the
/// release waits for that answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locks_hold_that_ran_out_during_a_late_renewal_is_not_held() {
    let (_harness, faulty) = late_sqlite().await;
    let lock = Lock::start(
        faulty.clone(),
        LockConfig {
            renew_interval: Duration::from_secs(1),
            mode: Mode::OnDemand,
            ..LockConfig::new(&unique_lock("lapsing"), "pod-a", Duration::from_secs(3))
        },
        Arc::new(()),
    )
    .expect("lock");
    faulty.stall_next_renewal_answer(Duration::from_millis(700));
    let answer = lock
        .acquire(Duration::ZERO, Duration::from_millis(1100))
        .await
        .expect("acquire");
    assert!(answer.is_holder(), "{answer:?}");
    sleep(Duration::from_millis(1300)).await;
    let answer = lock.answer();
    assert_eq!(
        answer,
        Answer::NotHolder,
        "the hold ran out, yet the lock answers {answer:?}"
    );
    // Its claim stands until the lease is let go: an acquisition meanwhile takes it again.
    let again = lock
        .acquire(Duration::ZERO, Duration::from_secs(5))
        .await
        .expect("acquire again");
    assert!(again.is_holder(), "taken again: {again:?}");
    lock.shutdown().await;
}

/// A keyed owner told "cannot tell" asks again: it is never told that it holds the key itself,
/// elsewhere, and gets the key as soon as its earlier attempt has been given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_owner_never_meets_its_own_late_attempt() {
    let (_harness, faulty) = late_sqlite().await;
    let family = KeyedFamily::new(
        faulty.clone(),
        FamilyConfig::new(&unique_lock("latekeys"), "pod-a", LEASE),
        Arc::new(()),
    )
    .expect("family");
    faulty.delay_responses(LATE);
    let sent = Instant::now();
    let answer = family
        .acquire("order-1", "w1", Duration::ZERO, HOLD)
        .await
        .expect("acquire");
    assert_eq!(answer, KeyAnswer::Unknown);
    faulty.delay_responses(Duration::ZERO);
    // Free again once the late answer comes (LATE after sending), not once the late attempt's
    // lease ends (LEASE after sending).
    let free_by = sent + LEASE - Duration::from_secs(1);
    let token = loop {
        match family
            .acquire("order-1", "w1", Duration::ZERO, HOLD)
            .await
            .expect("acquire")
        {
            KeyAnswer::Held { token, .. } => break token,
            // Its earlier attempt is still being followed up in this pod.
            KeyAnswer::HeldByAnother { holder: None } => {}
            other => panic!("the owner's retry was told {other:?}"),
        }
        assert!(
            Instant::now() < free_by,
            "the key was not free again a second before the late attempt's lease would end"
        );
        sleep(Duration::from_millis(20)).await;
    };
    assert!(token > 1, "token {token}: the late attempt took token 1");
    family.shutdown().await;
}

/// A key whose hold lapses is given back by its engine, although the family lets go of the
/// engine's last handle as the engine begins that release: a release that reaches the backend
/// late (every call here takes 300 ms on its way) is still made, not cut short with the
/// engine's task, which would leave the key taken until its lease ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_hold_is_released_after_its_family_lets_go_of_the_engine() {
    let (harness, faulty) = late_sqlite().await;
    let name = unique_lock("lapsed");
    let pod_a = KeyedFamily::new(
        faulty.clone(),
        FamilyConfig::new(&name, "pod-a", LEASE),
        Arc::new(()),
    )
    .expect("family");
    let pod_b = KeyedFamily::new(
        sqlite(&harness).await,
        FamilyConfig::new(&name, "pod-b", LEASE),
        Arc::new(()),
    )
    .expect("family");
    let taken = Instant::now();
    let held = pod_a
        .acquire("order-1", "w1", Duration::ZERO, Duration::from_millis(300))
        .await
        .expect("acquire");
    assert!(matches!(held, KeyAnswer::Held { .. }), "{held:?}");
    faulty.delay_requests(Duration::from_millis(300));
    // Unreleased, the key would stay taken until its lease ran out, LEASE after it was taken.
    let answer = pod_b
        .acquire("order-1", "w2", LEASE * 2 / 3, HOLD)
        .await
        .expect("acquire");
    assert!(
        matches!(answer, KeyAnswer::Held { .. }),
        "the lapsed hold's key was not released: {answer:?} after {:?}",
        taken.elapsed()
    );
    assert!(taken.elapsed() < LEASE, "taken after {:?}", taken.elapsed());
    pod_b.shutdown().await;
}

/// A lease the backend counts from well before its acquisition was sent (PostgreSQL's woken
/// waiter: its row was taken in a blocking statement, and the engine claimed it later) is
/// renewed before its claim runs out, not a renew interval after the engine's own call, by
/// which time it would be gone: a holder told it holds would lose the lock moments later (a
/// PostgreSQL run of twenty contenders on a loaded machine met exactly that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_counted_from_before_its_acquisition_is_renewed_in_time() {
    let (_harness, faulty) = late_sqlite().await;
    let name = unique_lock("counted");
    // Of the 6 s claim, 1.4 s left when it is taken: less than the 2 s renew interval.
    faulty.count_acquisitions_earlier(LEASE * 3 / 4);
    let a = on_demand(faulty.clone(), &name, "a");
    let mut events = a.events();
    let answer = a.acquire(LEASE, HOLD).await.expect("acquire");
    let Answer::Holder { valid_for, .. } = answer else {
        panic!("a did not get the free lock: {answer:?}")
    };
    assert!(
        valid_for < LEASE / 4,
        "the claim was not counted early: {valid_for:?}"
    );
    still_held_after(&a, &mut events, LEASE / 2).await;
}

/// A backend that counts every lease from before the call (a Sentinel majority's answer, a
/// ZooKeeper session's last sign of life) under a renew interval that leaves less of the claim
/// than that: each renewal is due while enough of its claim is left, not a renew interval after
/// the last renewal's call, by which time the claim would have run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_of_a_lease_counted_from_before_each_call_come_in_time() {
    let (_harness, faulty) = late_sqlite().await;
    let name = unique_lock("counted");
    let lease = Duration::from_secs(6);
    // Each claim: 6 s less the margin, counted 2.6 s before its call: 3.3 s, under the 3.6 s
    // renew interval.
    faulty.count_every_call_earlier(Duration::from_millis(2600));
    let a = Lock::start(
        faulty.clone(),
        LockConfig {
            mode: Mode::Campaign,
            renew_interval: Duration::from_millis(3600),
            ..LockConfig::new(&name, "a", lease)
        },
        Arc::new(()),
    )
    .expect("lock");
    let mut events = a.events();
    let started = Instant::now();
    while !a.answer().is_holder() {
        assert!(started.elapsed() < Duration::from_secs(5), "a never held");
        sleep(Duration::from_millis(10)).await;
    }
    still_held_after(&a, &mut events, lease).await;
}

/// A backend that dates every call back nearly a whole lease leaves each claim too short to
/// renew in time: the lock is renewed at most every quarter of a renew interval, not asked
/// again at once over and over, and loses its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_too_short_to_renew_are_not_renewed_over_and_over() {
    let (_harness, faulty) = late_sqlite().await;
    let lease = Duration::from_secs(6);
    faulty.count_every_call_earlier(Duration::from_millis(5500));
    let a = Lock::start(
        faulty.clone(),
        LockConfig {
            mode: Mode::Campaign,
            renew_interval: Duration::from_secs(2),
            ..LockConfig::new(&unique_lock("short"), "a", lease)
        },
        Arc::new(()),
    )
    .expect("lock");
    sleep(Duration::from_secs(2)).await;
    let renewals = faulty.renewals();
    assert!(
        renewals <= 6,
        "{renewals} renewals in 2 s, at most one per half second"
    );
    a.shutdown().await;
}

/// A retired lock never releases: its lease stays in the backend until its last answer has run
/// out, even when the engine was inside a renewal that did not answer when it was asked to
/// retire (the retirement then waits, and the lock is shut down with it still queued). After
/// that the lease is released, so that the lock does not wait out the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retired_lock_keeps_its_lease_until_its_last_answer_ran_out() {
    let (harness, faulty) = late_sqlite().await;
    let lock = unique_lock("retired");
    let (holder, _) = campaigning_holder(&faulty, &lock).await;
    // The next renewal does not answer: the engine is inside it when asked to retire.
    faulty.stall_renewals(true);
    sleep(Duration::from_millis(2100)).await;
    let Answer::Holder {
        token, valid_for, ..
    } = holder.answer()
    else {
        panic!("a lost the lock: {:?}", holder.answer());
    };
    let answered_until = Instant::now() + valid_for;
    holder.retire().await;
    let observer = sqlite(&harness).await;
    while Instant::now() < answered_until {
        let seen = observer.observe(&lock).await.unwrap();
        assert_eq!(
            seen.as_ref().map(|h| (h.identity.as_str(), h.token)),
            Some(("a", token)),
            "{:?} before a's last answer ran out",
            answered_until - Instant::now()
        );
        sleep(Duration::from_millis(50)).await;
    }
    // Released then, well before the lease would have run out.
    let deadline = Instant::now() + Duration::from_secs(2);
    while observer.observe(&lock).await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "the retired lease was never released"
        );
        sleep(Duration::from_millis(50)).await;
    }
}

/// Over the next lease and two seconds, `holder`'s claim of token `first` runs out, is never
/// answered as held again (a later holding has a higher token), and its loss is told in
/// `events`; then the holder is shut down.
async fn claim_runs_out_and_never_resumes(
    holder: &Lock,
    first: u64,
    events: &mut tokio::sync::broadcast::Receiver<leasehold_lease::Event>,
) {
    let (mut lapsed, until) = (false, Instant::now() + LEASE + Duration::from_secs(2));
    while Instant::now() < until {
        match holder.answer() {
            Answer::Holder { token, .. } => assert!(
                !lapsed || token > first,
                "the claim of token {first} resumed after it had run out"
            ),
            _ => lapsed = true,
        }
        sleep(Duration::from_millis(5)).await;
    }
    assert!(lapsed, "the stalled renewal never let the claim run out");
    let mut lost = false;
    while let Ok(event) = events.try_recv() {
        lost |= event.kind == EventKind::Lost && event.token == first;
    }
    assert!(lost, "no loss of token {first} was told");
    holder.shutdown().await;
}

/// A renewal answered in time but read only after the claim it renews ran out (the engine's
/// task stalled in between) does not resume that claim: the holder has answered "not held"
/// since, and on a fair-queue backend the next in line may hold by then. The lease is lost, and
/// the lock is only held again through a new acquisition, with a higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_read_after_its_claim_ran_out_does_not_resume_it() {
    let (_harness, faulty) = late_sqlite().await;
    let name = unique_lock("stalled");
    let (holder, first) = campaigning_holder(&faulty, &name).await;
    let mut events = holder.events();
    // The next renewal (due 2 s after the acquisition) is read 4.9 s after its answer: past
    // the claim it renews (6 s from the acquisition, less the margin), within the claim it
    // would give (6 s from the renewal).
    faulty.stall_next_renewal_answer(Duration::from_millis(4900));
    claim_runs_out_and_never_resumes(&holder, first, &mut events).await;
}

/// The engine's task stalls after it read a renewal's answer in time and before it published
/// the claim renewed (a throttled CPU): the claim it renews runs out meanwhile, and a reader
/// has been answered "not held". The renewal must not bring that claim back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_published_after_its_claim_ran_out_does_not_resume_it() {
    /// Stalls the engine's thread at its first renewal, after the answer was read.
    struct StallsAtFirstRenewal(std::sync::atomic::AtomicBool);
    impl leasehold_lease::Telemetry for StallsAtFirstRenewal {
        fn renewed(&self, _lock: &str, _latency: Duration) {
            if !self.0.swap(true, std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(4900));
            }
        }
    }
    let (_harness, faulty) = late_sqlite().await;
    let name = unique_lock("stalled-publish");
    let holder = Lock::start(
        faulty.clone(),
        LockConfig {
            mode: Mode::Campaign,
            ..LockConfig::new(&name, "a", LEASE)
        },
        Arc::new(StallsAtFirstRenewal(Default::default())),
    )
    .unwrap();
    let mut events = holder.events();
    let started = Instant::now();
    let first = loop {
        if let Answer::Holder { token, .. } = holder.answer() {
            break token;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "a never held");
        sleep(Duration::from_millis(10)).await;
    };
    // The first renewal is due 2 s after the acquisition and read in time; its publication
    // comes 4.9 s later, past the claim it renews (6 s from the acquisition, less the margin).
    claim_runs_out_and_never_resumes(&holder, first, &mut events).await;
}

/// A reader whose client hangs up while its permit above 0 is being checked against the key's
/// write gate gives the permit back, rather than keep it for nobody until its hold ends (a
/// writer would wait that long). The reader's calls reach the backend 400 ms late here, so the
/// hang-up falls between its permit's grant and the gate's probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_hangs_up_while_its_permit_is_checked_gives_it_back() {
    let (_harness, faulty) = late_sqlite().await;
    let family = read_write_family(faulty.clone(), &unique_lock("readers"), "pod-a");
    let first = family
        .acquire_read("doc", "r1", Duration::ZERO, HOLD)
        .await
        .expect("r1 reads");
    assert!(
        matches!(first, KeyAnswer::Held { permit: 0, .. }),
        "{first:?}"
    );
    let permit = family.permit_backend_name("doc", 1).expect("name");
    faulty.delay_requests(Duration::from_millis(400));
    let reading = tokio::spawn({
        let family = family.clone();
        async move { family.acquire_read("doc", "r2", Duration::ZERO, HOLD).await }
    });
    let started = Instant::now();
    while faulty.answered(&permit, "pod-a/r2") == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "r2 never took permit 1"
        );
        sleep(Duration::from_millis(2)).await;
    }
    reading.abort();
    faulty.delay_requests(Duration::ZERO);
    let given_back = Instant::now();
    while faulty.observe(&permit).await.expect("observe").is_some() {
        assert!(
            given_back.elapsed() < LEASE / 2,
            "permit 1 is still held {:?} after its reader hung up",
            given_back.elapsed()
        );
        sleep(Duration::from_millis(20)).await;
    }
    family.shutdown().await;
}

/// A reader whose answer was sent the moment its client hung up, and never read, gives its
/// permit back rather than keep it for nobody until its hold ends (a writer would wait that
/// long). On one thread, a task woken by the gate probe's release (the last call before the
/// answer is sent) runs before the reader's caller, and cancels it.
#[tokio::test(flavor = "current_thread")]
async fn a_reader_whose_answer_was_never_read_gives_its_permit_back() {
    let harness = SqliteHarness::new();
    let faulty = FaultyDriver::wrap(sqlite(&harness).await);
    let family = read_write_family(faulty.clone(), &unique_lock("unread"), "pod-a");
    let first = family
        .acquire_read("doc", "r1", Duration::ZERO, HOLD)
        .await
        .expect("r1 reads");
    assert!(
        matches!(first, KeyAnswer::Held { permit: 0, .. }),
        "{first:?}"
    );
    let permit = family.permit_backend_name("doc", 1).expect("name");
    let mut releases = faulty.releases();
    let reading = tokio::spawn({
        let family = family.clone();
        async move { family.acquire_read("doc", "r2", Duration::ZERO, HOLD).await }
    });
    let hang_up = reading.abort_handle();
    tokio::spawn(async move {
        releases.changed().await.expect("the driver is kept");
        hang_up.abort();
    })
    .await
    .unwrap();
    assert!(
        reading.await.unwrap_err().is_cancelled(),
        "r2 read its answer first"
    );
    let given_back = Instant::now();
    while faulty.observe(&permit).await.expect("observe").is_some() {
        assert!(
            given_back.elapsed() < LEASE / 2,
            "permit 1 is still held {:?} after its reader hung up",
            given_back.elapsed()
        );
        sleep(Duration::from_millis(20)).await;
    }
    family.shutdown().await;
}

/// A reader whose permit's renewal fails while the permit is checked against the key's write
/// gate is answered "cannot tell", and gives the permit back: an owner told its read was not
/// taken (a multi-key read undoes the rest on that answer) must not keep it until its hold
/// ends, with writers kept out all that time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_whose_permit_is_in_doubt_after_the_gate_check_gives_it_back() {
    let (_harness, faulty) = late_sqlite().await;
    let family = read_write_family(faulty.clone(), &unique_lock("doubted"), "pod-a");
    let first = family
        .acquire_read("doc", "r1", Duration::ZERO, HOLD)
        .await
        .expect("r1 reads");
    assert!(
        matches!(first, KeyAnswer::Held { permit: 0, .. }),
        "{first:?}"
    );
    // r2 takes permit 1; the gate's probe answers 3.5 s later, past the permit's first
    // renewal (2 s in), which fails.
    faulty.delay_answers_to(" probe", Duration::from_millis(3500));
    let mut probed = faulty.delayed_answers();
    let reading = tokio::spawn({
        let family = family.clone();
        async move { family.acquire_read("doc", "r2", Duration::ZERO, HOLD).await }
    });
    tokio::time::timeout(Duration::from_secs(10), probed.changed())
        .await
        .expect("r2 probes the gate")
        .expect("the driver is kept");
    faulty.fail_renewals(true);
    let answer = reading.await.expect("r2's read").expect("answered");
    assert!(
        family.holding_on_permit("doc", 1, "r2").is_none(),
        "r2 keeps permit 1 after its read was answered {answer:?}"
    );
    assert!(
        !matches!(answer, KeyAnswer::Held { .. }),
        "r2 was told it holds while its permit's renewal failed: {answer:?}"
    );
    faulty.fail_renewals(false);
    family.shutdown().await;
}

/// A writer of another pod whose owner looks like the name of a probe of the write gate
/// (`w#probe`) is a writer all the same: waiting for a reader to leave, it keeps new readers
/// out, who take no permit meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_named_like_a_probe_keeps_readers_out() {
    let harness = SqliteHarness::new();
    let faulty = FaultyDriver::wrap(sqlite(&harness).await);
    let name = unique_lock("probe-named");
    let family = read_write_family(faulty.clone(), &name, "pod-a");
    let writer = read_write_family(sqlite(&harness).await, &name, "pod-b");
    let first = family
        .acquire_read("doc", "r1", Duration::ZERO, HOLD)
        .await
        .expect("r1 reads");
    assert!(matches!(first, KeyAnswer::Held { .. }), "{first:?}");
    let writing = tokio::spawn({
        let writer = writer.clone();
        async move {
            writer
                .acquire_write("doc", "w#probe", Duration::from_secs(10), HOLD)
                .await
        }
    });
    let gate = family.permit_backend_name("doc", u32::MAX).expect("name");
    let started = Instant::now();
    while faulty.observe(&gate).await.expect("observe").is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the writer never took the gate"
        );
        sleep(Duration::from_millis(5)).await;
    }
    let refused = family
        .acquire_read("doc", "r2", Duration::ZERO, HOLD)
        .await
        .expect("r2 asks");
    assert!(!matches!(refused, KeyAnswer::Held { .. }), "{refused:?}");
    let permit = family.permit_backend_name("doc", 1).expect("name");
    assert_eq!(
        faulty.answered(&permit, "pod-a/r2"),
        0,
        "r2 took a permit while a writer waited at the gate"
    );
    assert!(matches!(
        family.release("doc", "r1").await.expect("release"),
        leasehold_lease::keyed::KeyRelease::Released { .. }
    ));
    let written = writing.await.unwrap().expect("w writes");
    assert!(matches!(written, KeyAnswer::Held { .. }), "{written:?}");
    writer.shutdown().await;
    family.shutdown().await;
}

/// A writer's parts taken while its acquisition still waits (for a reader to leave) are not a
/// holding its owner is told of: asked meanwhile, the owner does not hold the key. Should the
/// acquisition be given up (its client hung up), the parts go back, and an answer given from
/// one of them would outlive it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writers_parts_taken_while_it_waits_are_not_told_as_held() {
    let harness = SqliteHarness::new();
    let family = read_write_family(sqlite(&harness).await, &unique_lock("parts"), "pod-a");
    for reader in ["r1", "r2"] {
        let read = family
            .acquire_read("doc", reader, Duration::ZERO, HOLD)
            .await
            .expect("read");
        assert!(matches!(read, KeyAnswer::Held { .. }), "{reader}: {read:?}");
    }
    let writing = tokio::spawn({
        let family = family.clone();
        async move {
            family
                .acquire_write("doc", "w", Duration::from_secs(10), HOLD)
                .await
        }
    });
    let gate = family.permit_backend_name("doc", u32::MAX).expect("name");
    let backend = sqlite(&harness).await;
    let started = Instant::now();
    while backend.observe(&gate).await.expect("observe").is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the writer never took the gate"
        );
        sleep(Duration::from_millis(5)).await;
    }
    // r1 leaves: the writer takes permit 0 and waits for r2's permit 1.
    family.release("doc", "r1").await.expect("release");
    let permit0 = family.permit_backend_name("doc", 0).expect("name");
    while backend
        .observe(&permit0)
        .await
        .expect("observe")
        .is_none_or(|h| !h.identity.ends_with("/w"))
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the writer never took permit 0"
        );
        sleep(Duration::from_millis(5)).await;
    }
    let told = family.status("doc", Some("w")).expect("status");
    assert!(
        !matches!(told, KeyAnswer::Held { .. }),
        "a writer still waiting is told it holds: {told:?}"
    );
    // Nor does the owner's release, sent before the write was answered, give up a part of it:
    // the write would be answered held with one of its permits going back.
    let released = family.release("doc", "w").await.expect("release");
    assert!(
        matches!(released, leasehold_lease::keyed::KeyRelease::NotHeld),
        "a release of a writer still waiting gave up one of its parts: {released:?}"
    );
    assert!(!writing.is_finished(), "the writer did not wait for r2");
    family.release("doc", "r2").await.expect("release");
    let written = writing.await.unwrap().expect("w writes");
    assert!(matches!(written, KeyAnswer::Held { .. }), "{written:?}");
    let told = family.status("doc", Some("w")).expect("status");
    assert!(matches!(told, KeyAnswer::Held { .. }), "{told:?}");
    family.shutdown().await;
}

/// An app counts its answer's `validForMs` from when it reads it, a moment after the engine
/// computed it: a hold that runs out is released only after that moment's margin, as every
/// other let-go is, so that nobody else holds while the app's reading of its answer stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_that_ran_out_is_released_after_the_margin_for_an_answer_read_late() {
    let harness = SqliteHarness::new();
    let backend = sqlite(&harness).await;
    let name = unique_lock("hold-lapse");
    // A long lease for a wide margin (610 ms): a read delay of half of it is covered.
    let lease = Duration::from_secs(30);
    let margin = leasehold_lease::safety_margin(lease);
    let mut config = LockConfig::new(&name, "a", lease);
    config.mode = Mode::OnDemand;
    let a = Lock::start(backend.clone(), config, Arc::new(())).expect("lock");
    let sent = Instant::now();
    let answer = a
        .acquire(Duration::ZERO, Duration::from_millis(300))
        .await
        .expect("acquire");
    let read = Instant::now();
    let Answer::Holder { valid_for, .. } = answer else {
        panic!("a did not take the free lock: {answer:?}");
    };
    // The app, reading its answer up to half the margin late, acts until then. Counted from
    // before the call, which the answer's validity is not older than: this test's own task,
    // slow to read the answer on a loaded machine, must not count as the app's delay.
    let app_acts_until = sent + valid_for + margin / 2;
    let taken = loop {
        if let Ok(leasehold_lease::Acquire::Acquired(_)) =
            backend.try_acquire(&name, "b", lease).await
        {
            break Instant::now();
        }
        assert!(
            read.elapsed() < Duration::from_secs(10),
            "b never took the lock"
        );
        sleep(Duration::from_millis(2)).await;
    };
    assert!(
        taken >= app_acts_until,
        "b took the lock {:?} before the end of a's answer read {:?} late",
        app_acts_until - taken,
        margin / 2
    );
}

/// Acquisitions of many keys answered slowly, all under way at once, are bounded by the
/// family's `max_keys` together: the keys held never exceed it, and the places of those
/// refused, or given back, serve the next acquisitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_under_way_together_count_against_the_most_keys_held() {
    let (_harness, faulty) = late_sqlite().await;
    let family = KeyedFamily::new(
        faulty.clone(),
        FamilyConfig {
            max_keys: 2,
            ..FamilyConfig::new(&unique_lock("bounded"), "pod-a", LEASE)
        },
        Arc::new(()),
    )
    .expect("family");
    faulty.delay_requests(Duration::from_millis(300));
    let answers = futures_util::future::join_all((0..6).map(|i| {
        let family = family.clone();
        async move {
            family
                .acquire(&format!("k{i}"), "o", Duration::from_secs(5), HOLD)
                .await
        }
    }))
    .await;
    let held: Vec<usize> = (0..6)
        .filter(|&i| matches!(answers[i], Ok(KeyAnswer::Held { .. })))
        .collect();
    assert_eq!(
        held.len(),
        2,
        "{} of 6 keys held at once in a family of at most 2: {answers:?}",
        held.len()
    );
    assert!(
        answers.iter().all(|a| matches!(
            a,
            Ok(KeyAnswer::Held { .. }) | Err(leasehold_lease::keyed::KeyError::TooManyKeys(2))
        )),
        "{answers:?}"
    );
    assert_eq!(family.held_keys(), 2);
    faulty.delay_requests(Duration::ZERO);
    family
        .release(&format!("k{}", held[0]), "o")
        .await
        .expect("released");
    let next = family.acquire("next", "o", Duration::ZERO, HOLD).await;
    assert!(matches!(next, Ok(KeyAnswer::Held { .. })), "{next:?}");
    let over = family.acquire("over", "o", Duration::ZERO, HOLD).await;
    assert!(
        matches!(over, Err(leasehold_lease::keyed::KeyError::TooManyKeys(2))),
        "{over:?}"
    );
    family.shutdown().await;
}

/// A hold that ended while a renewal was out is not revived by an extension read after it: the
/// app has been answered "not held" since the hold's end, and an extension then finds nothing
/// held (a 404 through the API), as for any owner that does not hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extension_after_the_hold_ended_during_a_renewal_does_not_revive_it() {
    let (_harness, faulty) = late_sqlite().await;
    let lock = Lock::start(
        faulty.clone(),
        LockConfig {
            mode: Mode::OnDemand,
            renew_interval: Duration::from_secs(2),
            ..LockConfig::new(&unique_lock("revived"), "a", LEASE)
        },
        Arc::new(()),
    )
    .expect("lock");
    let answer = lock
        .acquire(Duration::from_secs(5), Duration::from_millis(2500))
        .await
        .expect("acquire");
    assert!(answer.is_holder(), "{answer:?}");
    // The renewal 2 s in does not answer (the engine waits 2 s for it); the hold ends 0.5 s
    // into it.
    faulty.stall_renewals(true);
    sleep(Duration::from_secs(3)).await;
    assert!(!lock.answer().is_holder(), "held past its hold");
    // Answered "unknown" either way (the renewal just failed): the next renewal, once the
    // backend answers again, or the lapse, says whether the holding went on.
    lock.extend(HOLD).await.expect("extend");
    faulty.stall_renewals(false);
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(4) {
        assert!(
            !lock.answer().is_holder(),
            "held again after its hold ended: {:?}",
            lock.snapshot().held
        );
        sleep(Duration::from_millis(20)).await;
    }
    lock.shutdown().await;
}

/// A key granted while its family stops (its resource deleted, its backend moved) is in place
/// before the acquisition sees the stop, and another call of its owner's may read it as held
/// meanwhile: it is let go as the stop lets go of every key, once the answer it was granted
/// with has run out, not at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_granted_as_its_family_stops_is_kept_until_its_answer_ran_out() {
    let (harness, faulty) = late_sqlite().await;
    let name = unique_lock("stopping");
    let family = KeyedFamily::new(
        faulty.clone(),
        FamilyConfig::new(&name, "pod-a", LEASE),
        Arc::new(()),
    )
    .expect("family");
    let key = family.backend_name("order-1").expect("a key");
    // The backend grants the key at once; its answer comes back late.
    faulty.delay_answers_to("/w1", Duration::from_millis(300));
    let mut delayed = faulty.delayed_answers();
    let acquiring = tokio::spawn({
        let family = family.clone();
        async move { family.acquire("order-1", "w1", Duration::ZERO, HOLD).await }
    });
    delayed.wait_for(|n| *n > 0).await.expect("the answers");
    family.stop().await;
    let refused = acquiring.await.expect("the acquisition");
    assert!(
        matches!(refused, Err(leasehold_lease::keyed::KeyError::Stopped(_))),
        "{refused:?}"
    );
    let observer = sqlite(&harness).await;
    let seen = observer.observe(&key).await.expect("observe");
    assert_eq!(
        seen.map(|h| h.identity),
        Some("pod-a/w1".to_owned()),
        "the key was released at once, while an answer about it may stand"
    );
}
