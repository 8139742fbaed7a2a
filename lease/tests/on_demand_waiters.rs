//! On-demand waiters that are gone must not get, keep or block the lock: a client that gave up
//! on a long wait (its request dropped) never holds the lock for its `hold`, and a try-lock that
//! found the lock held leaves no place in a fair queue (etcd, ZooKeeper) for the next real waiter
//! to queue behind. Real servers; one test per backend where the fault applies.

use std::sync::Arc;
use std::time::Duration;

use leasehold_lease::testkit::faulty::FaultyDriver;
use leasehold_lease::testkit::{EtcdServer, RedisServer, ZooKeeperServer, unique_lock};
use leasehold_lease::{Answer, BackendUrl, Lock, LockConfig, Mode};
use tokio::time::{Instant, sleep};

const LEASE: Duration = Duration::from_secs(3);
const HOLD: Duration = Duration::from_secs(60);

async fn driver(url: &str) -> Arc<dyn leasehold_lease::Driver> {
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
/// releases, the waiter behind it takes over within a lease, not after the try-lock's place
/// expires (three leases).
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
        took < LEASE,
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
    use leasehold_lease::testkit::faulty::FaultyDriver;

    let server = RedisServer::start();
    let inner = driver(&server.url()).await;
    let faulty = FaultyDriver::wrap(inner);
    let mut config = LockConfig::new(&unique_lock("gone-reentrant"), "a", LEASE);
    config.mode = Mode::OnDemand;
    let renew = config.renew_interval;
    let a = Lock::start(faulty.clone(), config, Arc::new(())).expect("lock");
    assert!(holds(&a, Duration::ZERO).await, "a takes the free lock");
    let acquired = Instant::now();
    // The next renewal keeps the engine busy for 600 ms, from one renew interval on.
    faulty.delay_responses(Duration::from_millis(600));
    sleep(
        (acquired + renew + Duration::from_millis(100)).saturating_duration_since(Instant::now()),
    )
    .await;
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
