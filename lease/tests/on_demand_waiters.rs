//! On-demand waiters that are gone must not get, keep or block the lock: a client that gave up
//! on a long wait (its request dropped) never holds the lock for its `hold`, and a try-lock, a
//! keyed wait whose client hung up, or an attempt answered after its wait ended leaves no place
//! in a fair queue (etcd, ZooKeeper) for the next real waiter to queue behind. And holds keep
//! their word: a re-entrant acquisition or an extension never shortens an earlier hold, and an
//! answer is never valid past its hold. Real servers; one test per backend where the fault
//! applies.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::keyed::{FamilyConfig, KeyAnswer, KeyRelease, KeyedFamily};
use leasehold_lease::{Answer, BackendUrl, Lock, LockConfig, Mode};
use leasehold_testkit::faulty::FaultyDriver;
use leasehold_testkit::{EtcdServer, RedisServer, ZooKeeperServer, unique_lock};
use tokio::time::{Instant, sleep, sleep_until};

const LEASE: Duration = Duration::from_secs(3);
const HOLD: Duration = Duration::from_secs(60);

async fn driver(url: &str) -> Arc<dyn leasehold_lease::Backend> {
    leasehold_lease::connect(&BackendUrl::parse(url).expect("url"))
        .await
        .expect("driver")
}

async fn lock(url: &str, name: &str, identity: &str) -> Lock {
    let driver = driver(url).await;
    let mut config = LockConfig::new(name, identity, LEASE);
    config.mode = Mode::OnDemand;
    Lock::start(driver, config, Arc::new(())).expect("lock")
}

async fn holds(lock: &Lock, wait: Duration) -> bool {
    lock.acquire(wait, HOLD).await.expect("acquire").is_holder()
}

/// `acquire?wait=30s&hold=1h` from a client that gives up after half a second: when the holder
/// releases, that pod must not take the lock for nobody, and another pod's waiter gets it.
async fn a_waiter_whose_client_left_never_holds(url: &str) {
    let name = unique_lock("gone");
    let (a, b, c) = (
        lock(url, &name, "a").await,
        lock(url, &name, "b").await,
        lock(url, &name, "c").await,
    );
    assert!(holds(&a, Duration::ZERO).await, "a takes the free lock");
    let gone = {
        let b = b.clone();
        tokio::spawn(async move {
            b.acquire(Duration::from_secs(30), Duration::from_secs(3600))
                .await
        })
    };
    sleep(Duration::from_millis(500)).await;
    gone.abort(); // the HTTP client hung up: its request, and its reply channel, are dropped
    let _ = gone.await;
    let waiting = {
        let c = c.clone();
        tokio::spawn(async move { holds(&c, Duration::from_secs(10)).await })
    };
    sleep(Duration::from_millis(300)).await;
    assert!(a.release().await.expect("release"));
    assert!(
        waiting.await.expect("c's wait"),
        "c waited 10 s for a free lock: b's departed waiter took it"
    );
    assert!(!b.answer().is_holder(), "b holds the lock for nobody");
    assert_eq!(b.snapshot().holds, 0);
}

/// A try-lock (`wait=0`) that finds the lock held leaves the queue at once: when the holder
/// releases, the waiter behind it takes over at once (bounded at two leases, room for a stalled
/// machine), not after the try-lock's place expires (four leases).
async fn a_try_lock_leaves_no_place_in_the_queue(url: &str) {
    let name = unique_lock("try");
    let (a, b, c) = (
        lock(url, &name, "a").await,
        lock(url, &name, "b").await,
        lock(url, &name, "c").await,
    );
    assert!(holds(&a, Duration::ZERO).await);
    assert_eq!(
        b.acquire(Duration::ZERO, HOLD).await.expect("try"),
        Answer::NotHolder,
        "a try-lock on a held lock"
    );
    // Let b's engine finish its attempt and step back before c queues.
    sleep(Duration::from_millis(300)).await;
    let waiting = {
        let c = c.clone();
        tokio::spawn(async move {
            let asked = Instant::now();
            let held = holds(&c, Duration::from_secs(20)).await;
            (held, asked.elapsed())
        })
    };
    sleep(Duration::from_millis(500)).await;
    let released = Instant::now();
    assert!(a.release().await.expect("release"));
    let (held, _) = waiting.await.expect("c's wait");
    assert!(held, "c never got the released lock");
    let took = released.elapsed();
    assert!(
        took < 2 * LEASE,
        "c took over {took:?} after the release: it queued behind b's abandoned try-lock"
    );
    assert!(!b.answer().is_holder());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_departed_waiter() {
    let server = RedisServer::start();
    a_waiter_whose_client_left_never_holds(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_departed_waiter() {
    let server = EtcdServer::start();
    a_waiter_whose_client_left_never_holds(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_try_lock() {
    let server = EtcdServer::start();
    a_try_lock_leaves_no_place_in_the_queue(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_departed_waiter() {
    let server = ZooKeeperServer::start();
    a_waiter_whose_client_left_never_holds(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_try_lock() {
    let server = ZooKeeperServer::start();
    a_try_lock_leaves_no_place_in_the_queue(&server.url()).await;
}

/// A re-entrant acquisition (the pod already holds) whose client hung up while the engine was
/// busy, its command still queued: it must not be counted, or the pod keeps the lock for its
/// `hold` after every real holder released (found by the waiters' safety check: a token given
/// again after every worker that had it released it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_departed_reentrant_acquisition_is_not_counted() {
    let server = RedisServer::start();
    let inner = driver(&server.url()).await;
    let faulty = FaultyDriver::wrap(inner);
    let mut config = LockConfig::new(&unique_lock("gone-reentrant"), "a", LEASE);
    config.mode = Mode::OnDemand;
    let renew = config.renew_interval;
    let a = Lock::start(faulty.clone(), config, Arc::new(())).expect("lock");
    assert!(holds(&a, Duration::ZERO).await, "a takes the free lock");
    // The next renewal keeps the engine busy for 600 ms from when it is sent, which is waited
    // for rather than guessed.
    let renewals = faulty.renewals();
    faulty.delay_responses(Duration::from_millis(600));
    let waiting = Instant::now();
    while faulty.renewals() == renewals {
        assert!(waiting.elapsed() < renew * 3, "no renewal was sent");
        sleep(Duration::from_millis(5)).await;
    }
    let gone = {
        let a = a.clone();
        tokio::spawn(async move { a.acquire(Duration::ZERO, HOLD).await })
    };
    sleep(Duration::from_millis(100)).await;
    gone.abort(); // hung up while its command waited for the busy engine
    let _ = gone.await;
    faulty.delay_responses(Duration::ZERO);
    assert!(a.release().await.expect("release"));
    assert_eq!(
        a.snapshot().holds,
        0,
        "the departed client's acquisition was counted"
    );
    assert!(!a.answer().is_holder(), "a holds the lock for nobody");
}

/// A re-entrant acquisition whose answer was sent but never read (its client hung up in the
/// moment between) gives its count back: the pod does not keep the lock for that hold, for
/// nobody, once the real holder releases. On one thread, the caller's task is woken after the
/// engine's publication of the count and is cancelled before it runs.
#[tokio::test(flavor = "current_thread")]
async fn an_answer_its_caller_never_read_gives_its_count_back() {
    let harness = leasehold_testkit::SqliteHarness::new();
    let url = format!("sqlite://{}", harness.path().display());
    let a = lock(&url, &unique_lock("unread"), "a").await;
    assert!(holds(&a, Duration::ZERO).await, "a takes the free lock");
    let gone = {
        let a = a.clone();
        tokio::spawn(async move { a.acquire(Duration::ZERO, HOLD).await })
    };
    // The engine counts the hold, publishes it and sends the answer with no pause between:
    // woken by the publication first, a task that waits for it runs before the caller reads
    // its answer (tasks woken run in turn; the test's own body would run only after them).
    let hang_up = gone.abort_handle();
    let mut counts = a.watch();
    tokio::spawn(async move {
        while counts.borrow_and_update().holds < 2 {
            counts.changed().await.expect("the engine runs");
        }
        hang_up.abort();
    })
    .await
    .unwrap();
    assert!(
        gone.await.unwrap_err().is_cancelled(),
        "the caller read its answer first"
    );
    assert!(a.release().await.expect("release"));
    let deadline = Instant::now() + LEASE;
    while a.answer().is_holder() || a.snapshot().holds > 0 {
        assert!(
            Instant::now() < deadline,
            "a holds the lock for nobody ({} holds)",
            a.snapshot().holds
        );
        sleep(Duration::from_millis(20)).await;
    }
}

/// An acquisition whose every waiter went while it ran (the client hung up) is given back at
/// once, and no reader of the lock is told in between that the pod holds it: a `GET /lock` of
/// the pod told so would count on a whole claim that the release ends at once. Every event
/// the lock emits is followed by a read of its answer, as a reader woken by it would make.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_for_nobody_is_never_shown_as_held() {
    use leasehold_lease::{Event, Snapshot, Telemetry};
    use std::sync::{Mutex, OnceLock};
    #[derive(Default)]
    struct Reader {
        state: OnceLock<tokio::sync::watch::Receiver<Snapshot>>,
        seen: Mutex<Vec<(String, Answer)>>,
    }
    impl Telemetry for Reader {
        fn event(&self, event: &Event) {
            if let Some(state) = self.state.get() {
                let answer = state.borrow().answer();
                let seen = format!("{:?}", event.kind);
                self.seen.lock().unwrap().push((seen, answer));
            }
        }
    }
    let harness = leasehold_testkit::SqliteHarness::new();
    let url = format!("sqlite://{}", harness.path().display());
    let faulty = FaultyDriver::wrap(driver(&url).await);
    let name = unique_lock("for-nobody");
    let mut config = LockConfig::new(&name, "a", LEASE);
    config.mode = Mode::OnDemand;
    let reader = Arc::new(Reader::default());
    let a = Lock::start(faulty.clone(), config, reader.clone()).expect("lock");
    reader.state.set(a.watch()).unwrap();
    faulty.delay_responses(Duration::from_millis(400));
    let gone = {
        let a = a.clone();
        tokio::spawn(async move { a.acquire(Duration::from_secs(5), HOLD).await })
    };
    sleep(Duration::from_millis(100)).await;
    gone.abort(); // hung up while the attempt was on its way
    let _ = gone.await;
    sleep(Duration::from_millis(800)).await;
    faulty.delay_responses(Duration::ZERO);
    let b = lock(&url, &name, "b").await;
    assert!(
        holds(&b, Duration::from_secs(2)).await,
        "b takes the lock given back"
    );
    let seen = reader.seen.lock().unwrap().clone();
    assert!(
        seen.iter().all(|(_, answer)| !answer.is_holder()),
        "a reader was told a holds the lock it gave back at once: {seen:?}"
    );
    // Nor is its end told of: listeners see every `released` after its `acquired`.
    assert!(seen.is_empty(), "events of a lease never told of: {seen:?}");
}

/// Waiters answered together are told one validity, which counts every waiter's hold: one
/// that goes between the count and its answer must not cut the hold short under the others,
/// who may act for as long as they were told. Here the waiter with the long hold goes as the
/// lock is taken (its acquisition dropped by the lock's own event hook, on the engine's task),
/// and the one with a 1 s hold was told the longer validity: no other pod takes the lock
/// before that validity has run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_gone_as_the_lock_is_taken_does_not_cut_the_others_answer_short() {
    use leasehold_lease::{Event, EventKind, Telemetry};
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Mutex;
    type Acquisition = Pin<Box<dyn Future<Output = leasehold_lease::Result<Answer>> + Send>>;
    #[derive(Default)]
    struct Drops(Mutex<Option<Acquisition>>);
    impl Telemetry for Drops {
        fn event(&self, event: &Event) {
            if event.kind == EventKind::Acquired {
                drop(self.0.lock().unwrap().take());
            }
        }
    }
    let harness = leasehold_testkit::SqliteHarness::new();
    let url = format!("sqlite://{}", harness.path().display());
    let name = unique_lock("gone-as-taken");
    let b = lock(&url, &name, "b").await;
    assert!(holds(&b, Duration::ZERO).await, "b holds first");
    let drops = Arc::new(Drops::default());
    let mut config = LockConfig::new(&name, "a", LEASE);
    config.mode = Mode::OnDemand;
    let a = Lock::start(driver(&url).await, config, drops.clone()).expect("lock");
    // The long hold's waiter: its command queued, its acquisition kept by the hook.
    let mut long: Acquisition = {
        let a = a.clone();
        Box::pin(async move { a.acquire(Duration::from_secs(10), HOLD).await })
    };
    assert!(futures_util::poll!(long.as_mut()).is_pending());
    *drops.0.lock().unwrap() = Some(long);
    let short = {
        let a = a.clone();
        tokio::spawn(async move {
            let answer = a
                .acquire(Duration::from_secs(10), Duration::from_secs(1))
                .await;
            (Instant::now(), answer)
        })
    };
    sleep(Duration::from_millis(200)).await;
    assert!(b.release().await.expect("b lets go"));
    let (told_at, told) = short.await.unwrap();
    let told = told.expect("answered");
    let Answer::Holder { valid_for, .. } = told else {
        panic!("the short waiter was not given the lock: {told:?}");
    };
    let c = lock(&url, &name, "c").await;
    let taken = holds(&c, valid_for + Duration::from_secs(2)).await;
    assert!(
        !taken || Instant::now() >= told_at + valid_for,
        "c took the lock {:?} before the end of the answer a's waiter was given ({valid_for:?})",
        (told_at + valid_for).saturating_duration_since(Instant::now())
    );
}

/// Two attempts by one identity at once, on a lock whose queue already holds that identity's
/// place, are granted once: the other is told the lock is busy. Both used to find the place
/// first in line and both answer "acquired"; an engine that released what one of them took (an
/// answer that came too late, followed up in the background while the engine sent another for
/// a new waiter) then deleted the place under the other, which claimed the lock until its next
/// renewal while the next in line took it (the `zookeeper+waiters` soak: two holders for 5 ms).
async fn one_identitys_attempts_at_once_are_granted_once(url: &str) {
    use leasehold_lease::Acquire;
    let (a, b) = (driver(url).await, driver(url).await);
    let name = unique_lock("at-once");
    let Acquire::Acquired(held) = b.try_acquire(&name, "b", LEASE).await.expect("b") else {
        panic!("b could not take the free lock");
    };
    // a queues behind b, then b lets go.
    assert!(matches!(
        a.try_acquire(&name, "a", LEASE).await.expect("a queues"),
        Acquire::Busy(_)
    ));
    assert!(b.release(&held).await.expect("release"));
    let (first, second) = tokio::join!(
        a.try_acquire(&name, "a", LEASE),
        a.try_acquire(&name, "a", LEASE)
    );
    let granted = [first.expect("first"), second.expect("second")]
        .into_iter()
        .filter(|answer| matches!(answer, Acquire::Acquired(_)))
        .count();
    assert_eq!(
        granted, 1,
        "two attempts at once by one identity were granted {granted} times"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_one_identitys_attempts_at_once_are_granted_once() {
    let server = ZooKeeperServer::start();
    one_identitys_attempts_at_once_are_granted_once(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_one_identitys_attempts_at_once_are_granted_once() {
    let server = EtcdServer::start();
    one_identitys_attempts_at_once_are_granted_once(&server.url()).await;
}

/// A try-lock (no wait) that finds the lock held subscribes to no release notice: nobody would
/// be left to wake. A subscription costs a feed, and on PostgreSQL and MySQL/MariaDB it is what
/// starts a waiter's blocking statement: a session for every refused try-lock (Dapr's `TryLock`
/// never waits). A wait, however short, still subscribes.
#[tokio::test]
async fn a_refused_try_lock_subscribes_to_no_release_notice() {
    let redis = RedisServer::start();
    let name = unique_lock("try");
    let holder = lock(&redis.url(), &name, "a").await;
    assert!(
        holds(&holder, Duration::ZERO).await,
        "a takes the free lock"
    );
    let faulty = FaultyDriver::wrap(driver(&redis.url()).await);
    let mut config = LockConfig::new(&name, "b", LEASE);
    config.mode = Mode::OnDemand;
    let trying = Lock::start(faulty.clone(), config, Arc::new(())).expect("lock");
    for _ in 0..3 {
        assert!(!holds(&trying, Duration::ZERO).await, "b took a held lock");
    }
    assert_eq!(faulty.subscriptions(), 0, "a try-lock subscribed");
    assert!(
        !holds(&trying, Duration::from_millis(300)).await,
        "b took a held lock"
    );
    assert!(faulty.subscriptions() > 0, "a waiter did not subscribe");
}

fn family(driver: Arc<dyn leasehold_lease::Backend>, name: &str, identity: &str) -> KeyedFamily {
    KeyedFamily::new(
        driver,
        FamilyConfig::new(name, identity, LEASE),
        Arc::new(()),
    )
    .expect("family")
}

async fn holds_key(family: &KeyedFamily, owner: &str, wait: Duration) -> bool {
    matches!(
        family
            .acquire("k1", owner, wait, HOLD)
            .await
            .expect("acquire"),
        KeyAnswer::Held { .. }
    )
}

/// p1 holds the key and `leave` makes p2's wait end without it; once p1 releases, p3's waiter
/// takes the key at once (bounded at two leases), not behind a place p2 left standing in the
/// queue (which the backend gives up four leases after p2's last ask).
async fn after_a_keyed_wait_ends_the_next_waiter_takes_over(
    url: &str,
    p2_driver: Arc<dyn leasehold_lease::Backend>,
    leave: impl AsyncFnOnce(&KeyedFamily),
) {
    let name = unique_lock("keyedgone");
    let p1 = family(driver(url).await, &name, "p1");
    let p3 = family(driver(url).await, &name, "p3");
    assert!(
        holds_key(&p1, "h", Duration::ZERO).await,
        "p1 takes the free key"
    );
    // p2's sidecar stays up, its session with it, after its wait ends.
    let p2 = family(p2_driver, &name, "p2");
    leave(&p2).await;
    let waiting = tokio::spawn(async move {
        let held = holds_key(&p3, "c", Duration::from_secs(20)).await;
        (held, Instant::now())
    });
    sleep(Duration::from_millis(300)).await;
    assert_eq!(
        p1.release("k1", "h").await.expect("release"),
        KeyRelease::Released { holds: 0 }
    );
    let released = Instant::now();
    let (held, at) = waiting.await.expect("p3's wait");
    assert!(held, "p3 waited 20 s for a free key");
    let took = at.saturating_duration_since(released);
    assert!(
        took < 2 * LEASE,
        "p3 took the key {took:?} after the release: it queued behind p2's abandoned place"
    );
    drop(p2);
}

/// The client of a keyed wait hangs up: its request, and the acquisition running on its task,
/// are dropped mid-wait.
async fn the_client_hangs_up(p2: &KeyedFamily) {
    let p2 = p2.clone();
    let gone =
        tokio::spawn(async move { p2.acquire("k1", "a", Duration::from_secs(60), HOLD).await });
    sleep(Duration::from_millis(500)).await;
    gone.abort();
    let _ = gone.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_keyed_wait_whose_client_hung_up_leaves_the_queue() {
    let server = EtcdServer::start();
    let p2 = driver(&server.url()).await;
    after_a_keyed_wait_ends_the_next_waiter_takes_over(&server.url(), p2, the_client_hangs_up)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_a_keyed_wait_whose_client_hung_up_leaves_the_queue() {
    let server = ZooKeeperServer::start();
    let p2 = driver(&server.url()).await;
    after_a_keyed_wait_ends_the_next_waiter_takes_over(&server.url(), p2, the_client_hangs_up)
        .await;
}

/// A keyed wait of one second whose attempt reaches the backend only after it ended (`faulty`
/// is p2's driver; it delays p2's calls, not its leaving the queue): the attempt takes a place
/// in the queue after the engine left it, and its answer (busy) comes to nobody. Returns once
/// the attempt has landed and been answered, its place ahead of any waiter that comes next.
fn the_wait_ends_before_its_attempt_lands(
    faulty: Arc<FaultyDriver>,
) -> impl AsyncFnOnce(&KeyedFamily) {
    const LATE: Duration = Duration::from_millis(2500);
    async move |p2: &KeyedFamily| {
        faulty.delay_requests(LATE);
        let asked = Instant::now();
        let answer = p2
            .acquire("k1", "a", Duration::from_secs(1), HOLD)
            .await
            .expect("acquire");
        faulty.delay_requests(Duration::ZERO);
        assert!(
            !matches!(answer, KeyAnswer::Held { .. }),
            "p2 took a held key"
        );
        sleep_until(asked + LATE + Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_keyed_attempt_answered_after_its_wait_leaves_the_queue() {
    let server = EtcdServer::start();
    let faulty = FaultyDriver::wrap(driver(&server.url()).await);
    let leave = the_wait_ends_before_its_attempt_lands(faulty.clone());
    after_a_keyed_wait_ends_the_next_waiter_takes_over(&server.url(), faulty, leave).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_a_keyed_attempt_answered_after_its_wait_leaves_the_queue() {
    let server = ZooKeeperServer::start();
    let faulty = FaultyDriver::wrap(driver(&server.url()).await);
    let leave = the_wait_ends_before_its_attempt_lands(faulty.clone());
    after_a_keyed_wait_ends_the_next_waiter_takes_over(&server.url(), faulty, leave).await;
}

/// A re-entrant acquisition with a shorter hold than an earlier one keeps the lock until the
/// longer hold ends: the earlier acquisition's caller counts on it. Releasing one of two
/// acquisitions keeps the lock; releasing both frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_shorter_reentrant_hold_keeps_the_longer_one() {
    let server = RedisServer::start();
    let name = unique_lock("reentrant-hold");
    let (a, b) = (
        lock(&server.url(), &name, "a").await,
        lock(&server.url(), &name, "b").await,
    );
    assert!(
        a.acquire(Duration::ZERO, Duration::from_secs(600))
            .await
            .expect("acquire")
            .is_holder()
    );
    assert!(
        a.acquire(Duration::ZERO, Duration::from_secs(1))
            .await
            .expect("acquire again")
            .is_holder()
    );
    sleep(Duration::from_millis(1500)).await;
    assert!(a.answer().is_holder(), "a stepped down at the shorter hold");
    assert!(
        !holds(&b, Duration::ZERO).await,
        "b took the lock while a's first acquisition held it"
    );
    assert!(a.release().await.expect("release one"));
    assert!(a.answer().is_holder(), "one release of two freed the lock");
    assert!(a.release().await.expect("release the other"));
    assert!(!a.answer().is_holder());
    assert!(
        holds(&b, Duration::from_secs(2)).await,
        "b takes the freed lock"
    );
}

/// An extension never shortens a hold: `extend` with a shorter hold than is left keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_shorter_extension_keeps_the_hold() {
    let server = RedisServer::start();
    let name = unique_lock("extend-hold");
    let (a, b) = (
        lock(&server.url(), &name, "a").await,
        lock(&server.url(), &name, "b").await,
    );
    assert!(holds(&a, Duration::ZERO).await);
    assert!(
        a.extend(Duration::from_secs(1))
            .await
            .expect("extend")
            .is_holder()
    );
    sleep(Duration::from_millis(1500)).await;
    assert!(a.answer().is_holder(), "a shorter extension cut the hold");
    assert!(!holds(&b, Duration::ZERO).await, "b took a held lock");
}

/// Every holder's answer is valid no longer than its hold: an app that budgets its work by
/// `validForMs` stops before the sidecar releases, and before anyone else can hold. On the
/// lock and on a family's key: the acquisition's answer, the status read later, and the next
/// holder, who gets the lock only after the validity promised has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_an_answers_validity_ends_with_its_hold() {
    let server = RedisServer::start();
    let hold = Duration::from_millis(1000);
    let name = unique_lock("valid-hold");
    let (a, b) = (
        lock(&server.url(), &name, "a").await,
        lock(&server.url(), &name, "b").await,
    );
    let asked = Instant::now();
    let Answer::Holder { valid_for, .. } = a.acquire(Duration::ZERO, hold).await.expect("a") else {
        panic!("a could not take the free lock");
    };
    assert!(
        valid_for <= hold,
        "valid for {valid_for:?}, past the {hold:?} hold"
    );
    let Answer::Holder {
        valid_for: later, ..
    } = a.answer()
    else {
        panic!("a lost the lock");
    };
    assert!(
        later <= hold,
        "a's status: valid for {later:?}, past its hold"
    );
    let promised_until = asked + valid_for;
    assert!(
        holds(&b, Duration::from_secs(5)).await,
        "b takes the lock after a's hold"
    );
    assert!(
        Instant::now() >= promised_until,
        "b holds while a's answer is still valid"
    );

    let keys = unique_lock("valid-hold-keys");
    let (p1, p2) = (
        family(driver(&server.url()).await, &keys, "p1"),
        family(driver(&server.url()).await, &keys, "p2"),
    );
    let asked = Instant::now();
    let KeyAnswer::Held { valid_for, .. } = p1
        .acquire("k1", "w1", Duration::ZERO, hold)
        .await
        .expect("p1")
    else {
        panic!("p1 could not take the free key");
    };
    assert!(
        valid_for <= hold,
        "key valid for {valid_for:?}, past the {hold:?} hold"
    );
    let KeyAnswer::Held {
        valid_for: later, ..
    } = p1.status("k1", Some("w1")).expect("status")
    else {
        panic!("p1 lost the key");
    };
    assert!(
        later <= hold,
        "the key's status: valid for {later:?}, past its hold"
    );
    let promised_until = asked + valid_for;
    assert!(
        matches!(
            p2.acquire("k1", "w2", Duration::from_secs(5), HOLD)
                .await
                .expect("p2"),
            KeyAnswer::Held { .. }
        ),
        "p2 takes the key after p1's hold"
    );
    assert!(
        Instant::now() >= promised_until,
        "p2 holds while p1's answer is still valid"
    );
}

/// A release or an extension made for one holding (by its token) leaves a later holding of the
/// same lock alone: a connection-bound hold whose lease was lost, and taken again by another
/// acquisition meanwhile, gives nothing of that acquisition up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_release_or_extension_for_an_earlier_holding_leaves_a_later_one_alone() {
    let server = RedisServer::start();
    let a = lock(&server.url(), &unique_lock("by-token"), "a").await;
    let Answer::Holder { token: first, .. } = a.acquire(Duration::ZERO, HOLD).await.unwrap() else {
        panic!("a takes the free lock");
    };
    assert!(a.release().await.unwrap());
    let Answer::Holder { token: second, .. } = a
        .acquire(Duration::from_secs(5), Duration::from_secs(2))
        .await
        .unwrap()
    else {
        panic!("a takes the lock again");
    };
    assert!(second > first);
    let hold_until = a.snapshot().held.unwrap().hold_until;
    a.extend_if((0, first), HOLD).await.unwrap();
    assert_eq!(
        a.snapshot().held.unwrap().hold_until,
        hold_until,
        "an extension for the first holding moved the second's hold"
    );
    assert!(
        !a.release_if((0, first)).await.unwrap(),
        "a release for the first holding was carried out"
    );
    assert_eq!(a.answer().token(), Some(second));
    assert_eq!(a.snapshot().holds, 1);
    a.extend_if((0, second), HOLD).await.unwrap();
    assert!(a.snapshot().held.unwrap().hold_until > hold_until);
    assert!(a.release_if((0, second)).await.unwrap());
    assert!(!a.answer().is_holder());
}

/// An extension applies while the claim stands, even when the last renewal failed (the
/// backend's address refuses connections: answers say "unknown"): a connection-bound hold
/// moved on at every renew interval is not dropped because one extension met an outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_an_extension_applies_while_the_claim_stands_through_an_outage() {
    let server = RedisServer::start();
    let proxy = leasehold_testkit::FaultProxy::start(server.port());
    let url = format!("redis://127.0.0.1:{}", proxy.port);
    let a = lock(&url, &unique_lock("outage"), "a").await;
    let Answer::Holder { token, .. } = a
        .acquire(Duration::ZERO, Duration::from_secs(10))
        .await
        .unwrap()
    else {
        panic!("a takes the free lock");
    };
    // Nothing listens there: every call fails at once.
    proxy.redirect(leasehold_testkit::free_port());
    let deadline = Instant::now() + LEASE;
    while a.snapshot().backend_error.is_none() {
        assert!(Instant::now() < deadline, "no renewal failed");
        sleep(Duration::from_millis(20)).await;
    }
    let before = a.snapshot().held.expect("the claim stands");
    assert_eq!(a.answer(), Answer::Unknown);
    a.extend_if((0, token), HOLD).await.unwrap();
    let extended = a.snapshot().held.expect("the claim stands");
    assert!(
        extended.hold_until.unwrap() > before.hold_until.unwrap() + Duration::from_secs(30),
        "the hold was not moved during the outage"
    );
    assert_eq!(
        extended.valid_until, before.valid_until,
        "an extension never moves the claim"
    );
}

/// A force-released on-demand holding says "not holder" at once; an acquisition that follows
/// is answered within its own wait (busy until the delayed release, not held back by a
/// cool-down), and one that waits takes the lock after the release with a higher token. A
/// token that is not the holding's changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_force_released_holding_answers_the_next_acquisition_within_its_wait() {
    let server = RedisServer::start();
    let a = lock(&server.url(), &unique_lock("forced"), "a").await;
    let Answer::Holder { token, .. } = a.acquire(Duration::ZERO, HOLD).await.unwrap() else {
        panic!("a takes the free lock");
    };
    assert!(!a.force_release(None, token + 1).await.unwrap());
    assert_eq!(a.answer().token(), Some(token));
    assert!(a.force_release(None, token).await.unwrap());
    assert!(!a.answer().is_holder());
    let tried = tokio::time::timeout(Duration::from_secs(2), a.acquire(Duration::ZERO, HOLD))
        .await
        .expect("a try-lock was not answered within its wait")
        .unwrap();
    assert!(
        !tried.is_holder(),
        "taken again before the release: {tried:?}"
    );
    let again = a
        .acquire(LEASE * 3, HOLD)
        .await
        .unwrap()
        .token()
        .expect("taken again once released");
    assert!(again > token, "{again} after {token}");
}

/// A read-write family's pods count different permits (`permits` changing): pod b's readers
/// hold permits 0 to 3, and pod a's writer (2 permits) probes permits 2 and up, finding 2 and 3
/// held, when its client hangs up with the probes' answers on the way. Each probe runs to its
/// end all the same and leaves the queues: once b's readers are gone, b's writer takes the key
/// within a lease, not behind a probe's place standing first for nobody until the backend gives
/// it up (four leases after it was put).
async fn a_writers_probes_leave_no_place_when_its_client_hangs_up(url: &str) {
    let name = unique_lock("probes");
    let read_write = |driver, identity, permits| {
        KeyedFamily::new(
            driver,
            FamilyConfig {
                permits,
                read_write: true,
                ..FamilyConfig::new(&name, identity, LEASE)
            },
            Arc::new(()),
        )
        .expect("family")
    };
    let faulty = FaultyDriver::wrap(driver(url).await);
    let a = read_write(faulty.clone(), "pod-a", 2);
    let b = read_write(driver(url).await, "pod-b", 4);
    for reader in ["r0", "r1", "r2", "r3"] {
        assert!(
            matches!(
                b.acquire("doc", reader, Duration::ZERO, HOLD).await,
                Ok(KeyAnswer::Held { .. })
            ),
            "{reader} reads the free key"
        );
    }
    faulty.delay_answers_to(" probe", Duration::from_secs(1));
    let mut probed = faulty.delayed_answers();
    let gone = {
        let a = a.clone();
        tokio::spawn(async move {
            a.acquire_write("doc", "w", Duration::from_secs(60), HOLD)
                .await
        })
    };
    // Permits 2 to 15 probed: their places are put, and their answers on the way.
    tokio::time::timeout(Duration::from_secs(10), probed.wait_for(|&n| n >= 14))
        .await
        .expect("the writer's probes reached the backend")
        .expect("probes counted");
    gone.abort(); // the HTTP client hung up: the acquisition and its probes' callers are dropped
    let _ = gone.await;
    for reader in ["r0", "r1", "r2", "r3"] {
        assert_eq!(
            b.release("doc", reader).await.expect("release"),
            KeyRelease::Released { holds: 0 }
        );
    }
    let released = Instant::now();
    let write = b
        .acquire_write("doc", "w", 2 * LEASE, HOLD)
        .await
        .expect("b's writer");
    assert!(
        matches!(write, KeyAnswer::Held { .. }),
        "b's writer waited {:?} and was answered {write:?}: a probe's place stood first",
        released.elapsed()
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_a_writers_probes_leave_no_place_when_its_client_hangs_up() {
    let server = EtcdServer::start();
    a_writers_probes_leave_no_place_when_its_client_hangs_up(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_a_writers_probes_leave_no_place_when_its_client_hangs_up() {
    let server = ZooKeeperServer::start();
    a_writers_probes_leave_no_place_when_its_client_hangs_up(&server.url()).await;
}

/// A read-write family of two permits on a SQLite file of its own (kept while the directory is).
async fn sqlite_read_write_family() -> (tempfile::TempDir, KeyedFamily) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let family = KeyedFamily::new(
        driver(&url).await,
        FamilyConfig {
            permits: 2,
            read_write: true,
            ..FamilyConfig::new(&unique_lock("docs"), "pod-a", LEASE)
        },
        Arc::new(()),
    )
    .expect("family");
    (dir, family)
}

/// A read of several keys waiting while its owner comes to write one of them: when its turn
/// comes that key is refused (no downgrade within one call), nothing is held, and the owner's
/// write lock keeps every acquisition it had, so that one release leaves it writing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_of_several_keys_whose_owner_came_to_write_one_leaves_the_write_lock_whole() {
    use leasehold_lease::keyed::KeysAnswer;
    let (_dir, family) = sqlite_read_write_family().await;
    let held = |answer: KeyAnswer| matches!(answer, KeyAnswer::Held { .. });
    let wait = Duration::from_secs(10);
    assert!(held(
        family.acquire_write("a", "p", wait, HOLD).await.unwrap()
    ));
    let reading = {
        let family = family.clone();
        let keys = vec!["a".to_owned(), "b".to_owned()];
        tokio::spawn(async move { family.acquire_all_read(&keys, "o", wait, HOLD).await })
    };
    // Waiting for a by now, past its check of the keys the owner writes.
    sleep(Duration::from_secs(1)).await;
    assert!(!reading.is_finished(), "the read did not wait for a");
    for _ in 0..2 {
        assert!(held(
            family.acquire_write("b", "o", wait, HOLD).await.unwrap()
        ));
    }
    family.release("a", "p").await.unwrap();
    let read = reading.await.unwrap();
    assert!(
        !matches!(read, Ok(KeysAnswer::Held(_))),
        "a read of several keys was answered holding a key its owner writes: {read:?}"
    );
    assert!(
        !held(family.status("a", Some("o")).unwrap()),
        "a is kept though the read was refused"
    );
    assert!(matches!(
        family.release("b", "o").await.unwrap(),
        KeyRelease::Released { holds: 1 }
    ));
    assert!(family.writes("b", "o"), "o's write lock of b ended early");
}

/// A write lock whose hold ran out with nobody asking after it is forgotten with its parts: the
/// pod's answer for the key, asked without an owner, is then a later reader's, not the old
/// write lock's "not held".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_lock_whose_hold_ran_out_leaves_the_keys_answer_to_its_readers() {
    let (_dir, family) = sqlite_read_write_family().await;
    let held = |answer: KeyAnswer| matches!(answer, KeyAnswer::Held { .. });
    let hold = Duration::from_millis(300);
    assert!(held(
        family
            .acquire_write("k", "w", Duration::ZERO, hold)
            .await
            .unwrap()
    ));
    let deadline = Instant::now() + LEASE;
    while family.tracked_keys() > 0 {
        assert!(
            Instant::now() < deadline,
            "the write lock's parts were kept"
        );
        sleep(Duration::from_millis(50)).await;
    }
    assert!(!family.writes("k", "w"));
    assert!(held(
        family
            .acquire_read("k", "r", Duration::from_secs(5), HOLD)
            .await
            .unwrap()
    ));
    let answer = family.status("k", None).unwrap();
    assert!(
        held(answer.clone()),
        "the key's answer is {answer:?} while r reads it"
    );
}

/// A family's permits raised while an owner waits for its one permit: the permit added is the
/// waiter's as soon as it is there, not left to owners that come later while the waiter waits
/// on for the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_from_before_the_permits_were_raised_takes_a_permit_added() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let family = KeyedFamily::new(
        driver(&url).await,
        FamilyConfig::new(&unique_lock("raised"), "pod-a", LEASE),
        Arc::new(()),
    )
    .unwrap();
    let first = family
        .acquire("k", "h", Duration::ZERO, HOLD)
        .await
        .unwrap();
    assert!(
        matches!(first, KeyAnswer::Held { permit: 0, .. }),
        "{first:?}"
    );
    let waiter = {
        let family = family.clone();
        tokio::spawn(async move {
            family
                .acquire("k", "w", Duration::from_secs(30), HOLD)
                .await
        })
    };
    sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "w waits while h holds the one permit"
    );
    family
        .reconfigure(FamilyConfig {
            permits: 2,
            ..family.config()
        })
        .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("w still waits for permit 0 while permit 1 is free")
        .unwrap()
        .unwrap();
    assert!(
        matches!(answer, KeyAnswer::Held { permit: 1, .. }),
        "{answer:?}"
    );
    assert!(matches!(
        family.status("k", Some("h")).unwrap(),
        KeyAnswer::Held { permit: 0, .. }
    ));
}

/// A family shut down (its sidecar stopping) releases its keys together: one at a time, the
/// last of many would still be claimed, and renewed for apps already gone, long after the
/// first, past the second the sidecar has to exit in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_family_shut_down_releases_its_keys_together() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let faulty = FaultyDriver::wrap(driver(&url).await);
    let family = KeyedFamily::new(
        faulty.clone(),
        FamilyConfig::new(&unique_lock("stopping"), "pod-a", LEASE),
        Arc::new(()),
    )
    .unwrap();
    for key in 0..20 {
        let answer = family
            .acquire(&format!("k{key}"), "o", Duration::ZERO, HOLD)
            .await
            .unwrap();
        assert!(matches!(answer, KeyAnswer::Held { .. }), "{answer:?}");
    }
    // Every backend call takes half a second from now on (renewals still answered well
    // within the lease).
    faulty.delay_requests(Duration::from_millis(500));
    let began = Instant::now();
    family.shutdown().await;
    let took = began.elapsed();
    // One after another they take at least ten seconds; together, half a second and the
    // releases' own writes (each a SQLite commit), however loaded the machine's disk.
    assert!(
        took < Duration::from_secs(5),
        "twenty keys released in {took:?}: one after another"
    );
    for key in 0..20 {
        assert!(matches!(
            family.status(&format!("k{key}"), Some("o")).unwrap(),
            KeyAnswer::NotHeld
        ));
    }
}
