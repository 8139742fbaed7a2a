//! ZooKeeper's fair queue: a release wakes exactly one waiter, and hand-overs follow the queue.

use std::time::Duration;

use leasehold_lease::zookeeper::{ZooKeeperConfig, ZooKeeperDriver};
use leasehold_testkit::conformance::{
    an_unknown_place_of_its_own_is_cleared, contenders, one_release_wakes_exactly_one_waiter,
    waiters_further_back_poll_quietly,
};
use leasehold_testkit::{ZooKeeperHarness, ZooKeeperServer};

fn driver(server: &ZooKeeperServer) -> ZooKeeperDriver {
    ZooKeeperDriver::connect(ZooKeeperConfig {
        servers: format!("127.0.0.1:{}", server.port()),
        root: "/leasehold".into(),
        digest: None,
        tick_time: ZooKeeperServer::TICK_TIME,
        tls: None,
    })
    .expect("driver")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_release_wakes_exactly_one_of_fifty_waiters() {
    let server = ZooKeeperServer::start();
    one_release_wakes_exactly_one_waiter(|| driver(&server)).await;
}

/// Of three in the queue, the one at the back polls without costing ZooKeeper a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_further_back_cost_no_requests() {
    let server = ZooKeeperServer::start();
    waiters_further_back_poll_quietly(|| driver(&server), || server.packets_received()).await;
}

/// Twenty contenders, two hundred hand-overs. The token is the czxid of a contender's node, the order it joined the
/// queue in, so strictly increasing tokens (checked by `contenders`) mean the lock went round
/// in FIFO order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_contenders_two_hundred_handovers_in_fifo_order() {
    contenders(&mut ZooKeeperHarness::new(), 20, 10).await;
}

/// A server whose `minSessionTimeout` is above the lease keeps a crashed holder's node that
/// long: the lock says so (log, `/lock`, `/readyz`) instead of promising a takeover within the
/// lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_longer_than_the_lease_is_reported() {
    use std::time::Duration;
    let server =
        leasehold_testkit::ZooKeeperServer::start_with_min_session(Some(Duration::from_secs(4)));
    let url = leasehold_lease::BackendUrl::parse(&server.url()).unwrap();
    leasehold_testkit::conformance::an_enforced_lease_longer_than_configured_is_reported(
        leasehold_lease::connect(&url).await.unwrap(),
        Duration::from_secs(2),
        "4s",
    )
    .await;
}

/// A holder connected to a follower that a partition cuts off from its quorum: the follower goes
/// on answering reads for `syncLimit` ticks (5 s here) while the leader expires the holder's
/// session after the 2 s lease and the contender on the quorum's side takes the lock. The holder
/// must have stopped claiming by then: its renewals go through the leader (`sync`), which the
/// cut follower cannot reach, and its claim is dated from a sign of life the leader has seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_cut_off_from_its_quorum_cannot_extend_a_claim() {
    use std::sync::Arc;
    use std::time::Duration;

    use leasehold_lease::{BackendUrl, Lock, LockConfig};
    use leasehold_testkit::{ZooKeeperEnsemble, unique_lock, zookeeper_ensemble};
    use tokio::time::{Instant, sleep};

    const LEASE: Duration = Duration::from_secs(2);
    async fn lock(url: &str, name: &str, identity: &str) -> Lock {
        let driver = leasehold_lease::connect(&BackendUrl::parse(url).expect("url"))
            .await
            .expect("driver");
        Lock::start(driver, LockConfig::new(name, identity, LEASE), Arc::new(())).expect("lock")
    }

    let ensemble = tokio::task::spawn_blocking(ZooKeeperEnsemble::start)
        .await
        .expect("ensemble");
    let follower = ensemble.followers()[0];
    let quorum: Vec<usize> = (0..3).filter(|&i| i != follower).collect();
    let name = unique_lock("partitioned");
    let stale_side = lock(&ensemble.url(&[follower]), &name, "stale-side").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !stale_side.answer().is_holder() {
        assert!(Instant::now() < deadline, "the first holder never held");
        sleep(Duration::from_millis(20)).await;
    }
    let quorum_side = lock(&ensemble.url(&quorum), &name, "quorum-side").await;
    sleep(LEASE).await;
    // Read as the engine keeps it: an answer read at one instant is "unknown" while a renewal
    // on a loaded machine runs past its budget.
    assert!(
        leasehold_testkit::claims(&stale_side),
        "the holder lost its lock: {:?}",
        stale_side.snapshot()
    );
    assert!(
        !quorum_side.answer().is_holder(),
        "two holders before the cut"
    );

    ensemble.isolate(follower);
    let cut = Instant::now();
    let stale_window = ZooKeeperEnsemble::TICK_TIME * zookeeper_ensemble::SYNC_LIMIT_TICKS;
    let mut taken_over = None;
    while cut.elapsed() < stale_window + LEASE {
        // The quorum's side first: if it holds now and the other side still holds a moment
        // later, they overlapped.
        let quorum_holds = quorum_side.answer().is_holder();
        if quorum_holds {
            taken_over.get_or_insert(cut.elapsed());
        }
        assert!(
            !(quorum_holds && stale_side.answer().is_holder()),
            "two holders {:?} after the follower was cut off (the quorum's side took over \
             after {taken_over:?}; the cut follower still answers)",
            cut.elapsed()
        );
        sleep(Duration::from_millis(2)).await;
    }
    let taken_over = taken_over.unwrap_or_else(|| {
        panic!(
            "the quorum's side never took over; modes: {:?}",
            ensemble.modes()
        )
    });
    assert!(
        taken_over < stale_window,
        "the takeover ({taken_over:?}) came only after the follower stopped serving, so the \
         test proves nothing about it"
    );
    quorum_side.shutdown().await;
    stale_side.shutdown().await;
}

/// A lease shorter than three of the ensemble's ticks is refused with the reason, before any
/// request: its claims, dated from what the leader has surely heard of, would run out between
/// renewals.
#[tokio::test]
async fn a_lease_too_short_for_the_tick_is_refused() {
    use leasehold_lease::Driver;
    use std::time::Duration;
    let driver = ZooKeeperDriver::connect(ZooKeeperConfig {
        servers: "127.0.0.1:1".into(),
        root: "/leasehold".into(),
        digest: None,
        tick_time: Duration::from_secs(2),
        tls: None,
    })
    .expect("driver");
    let error = driver
        .try_acquire("jobs", "a", Duration::from_secs(5))
        .await
        .expect_err("a 5 s lease at a 2 s tick");
    let text = error.to_string();
    assert!(text.contains("at least 3 ticks (6s"), "{text}");
    // Six seconds are enough at that tick: the refusal comes only from the unreachable server.
    let error = driver
        .try_acquire("jobs", "a", Duration::from_secs(6))
        .await
        .expect_err("nothing listens");
    assert!(!error.to_string().contains("ticks"), "{error}");
}

/// Attempts that the engine gives up while the server is down each leave a `create` queued in
/// the client, and each lands once the session reconnects. One place in the queue must stay
/// this process's and the others be deleted; otherwise the extra ones, which the driver no
/// longer knows of, stand ahead of its place until they are abandoned four leases later (found
/// by the waiters' safety check: after a ZooKeeper restart, seconds with nobody holding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_given_up_while_the_server_is_down_leave_one_place() {
    use std::time::Duration;

    use leasehold_lease::{Acquire, Driver};
    use leasehold_testkit::unique_lock;
    use tokio::time::{Instant, sleep, timeout};

    let mut server = ZooKeeperServer::start();
    let lease = Duration::from_secs(6);
    let lock = unique_lock("restart-places");
    let (a, b) = (driver(&server), driver(&server));
    let Acquire::Acquired(lb) = b.try_acquire(&lock, "b", lease).await.expect("b") else {
        panic!("b did not acquire a free lock")
    };
    // a's session, with the lease's timeout, opened by a holding of another lock.
    let other = unique_lock("restart-places-other");
    let Acquire::Acquired(lo) = a.try_acquire(&other, "a", lease).await.expect("a") else {
        panic!("a did not acquire a free lock")
    };
    assert!(a.release(&lo).await.expect("release"));

    server.kill();
    for _ in 0..4 {
        let attempt = timeout(Duration::from_millis(100), a.try_acquire(&lock, "a", lease)).await;
        assert!(attempt.is_err() || attempt.is_ok_and(|r| r.is_err()));
    }
    tokio::task::block_in_place(|| server.restart());

    let reconnected = Instant::now() + Duration::from_secs(10);
    while !matches!(b.release(&lb).await, Ok(true)) {
        assert!(
            Instant::now() < reconnected,
            "b never released after the restart"
        );
        sleep(Duration::from_millis(100)).await;
    }
    // a's place is now first: a holds within a poll or two, not four leases later.
    let taken = Instant::now() + Duration::from_secs(3);
    loop {
        match a.try_acquire(&lock, "a", lease).await {
            Ok(Acquire::Acquired(la)) => {
                assert!(la.token > lb.token);
                break;
            }
            other => assert!(
                Instant::now() < taken,
                "a is still queued behind places of its own it no longer knows of: {other:?}"
            ),
        }
        sleep(Duration::from_millis(100)).await;
    }
}

/// A lock's parent created on demand (a keyed family's key, chosen at run time) is a container
/// node: once its last contender's node is gone, the server deletes it, so keys do not pile up
/// in the ensemble's memory. The next holder's token, a czxid, is still greater. A parent
/// provisioned up front (a declared lock) is persistent and stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keys_parent_is_deleted_and_its_tokens_still_rise() {
    use leasehold_lease::{Acquire, Driver, Upkeep};
    use std::time::Duration;
    let server = ZooKeeperServer::start();
    let driver = driver(&server);
    let lease = Duration::from_secs(2);
    let take = |lock: &'static str| {
        let driver = &driver;
        async move {
            match driver.try_acquire(lock, "pod-a", lease).await.unwrap() {
                Acquire::Acquired(held) => {
                    assert!(driver.release(&held).await.unwrap());
                    held.token
                }
                Acquire::Busy(holder) => panic!("{lock} busy: {holder:?}"),
                Acquire::Withheld(w) => panic!("withheld: {w:?}"),
            }
        }
    };
    let (key, declared) = ("orders.keys.order-1234", "leader");
    driver.provision(&[declared.to_owned()]).await.unwrap();
    let first = take(key).await;
    take(declared).await;

    let zk = zookeeper_client::Client::connect(&format!("127.0.0.1:{}", server.port()))
        .await
        .unwrap();
    let exists = |path: String| {
        let zk = zk.clone();
        async move { zk.check_stat(&path).await.unwrap().is_some() }
    };
    let began = std::time::Instant::now();
    while exists(format!("/leasehold/{key}")).await {
        assert!(
            began.elapsed() < Duration::from_secs(20),
            "the idle key's parent is still there"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        exists(format!("/leasehold/{declared}")).await,
        "a provisioned lock's parent stays"
    );
    assert!(exists("/leasehold".into()).await, "the root stays");

    let second = take(key).await;
    assert!(second > first, "token {second} after {first}");
}

/// A waiter's node is told apart by its name, not its sequence number: once the lock's records
/// are deleted (its parent with them), the parent made again numbers its children from 0, and
/// another client's node first in line may carry the waiter's old number. The waiter's next
/// attempt finds its place gone; it does not hold beside that node's owner with an older token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_place_was_deleted_does_not_hold_beside_a_node_of_its_number() {
    use leasehold_lease::{Acquire, Driver, Upkeep};
    let server = ZooKeeperServer::start();
    let (holder, waiter, x, y) = (
        driver(&server),
        driver(&server),
        driver(&server),
        driver(&server),
    );
    let lease = Duration::from_secs(5);
    let lock = "numbered";
    // The holder's node is 0, the waiter's 1.
    let Acquire::Acquired(_) = holder.try_acquire(lock, "holder", lease).await.unwrap() else {
        panic!("the holder");
    };
    let Acquire::Busy(_) = waiter.try_acquire(lock, "waiter", lease).await.unwrap() else {
        panic!("the waiter waits");
    };
    holder.deprovision(&[lock.to_owned()]).await.unwrap();
    // The parent made again: x's node is 0, y's 1; x leaves and y's node is first.
    let Acquire::Acquired(x_lease) = x.try_acquire(lock, "x", lease).await.unwrap() else {
        panic!("x takes the lock made again");
    };
    let Acquire::Busy(_) = y.try_acquire(lock, "y", lease).await.unwrap() else {
        panic!("y waits behind x");
    };
    assert!(x.release(&x_lease).await.unwrap());
    let Acquire::Acquired(y_lease) = y.try_acquire(lock, "y", lease).await.unwrap() else {
        panic!("y is first");
    };
    match waiter.try_acquire(lock, "waiter", lease).await.unwrap() {
        Acquire::Acquired(w) => panic!(
            "the waiter holds (token {}) beside y (token {}) on a deleted place's number",
            w.token, y_lease.token
        ),
        Acquire::Busy(_) | Acquire::Withheld(_) => {}
    }
    assert!(y.renew(&y_lease, lease).await.unwrap(), "y still holds");
}

/// A driver that gave up its session (its client found it expired) while the server still
/// keeps it, and the session's node with it: that node counts for nothing to the driver. A
/// waiter whose node comes first is not granted the lock through its new session, nor is a
/// holder's claim extended through it: the server ends the old session on its own clock, and
/// the next in line then takes the lock while such a claim would still run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_a_session_given_up_grants_and_extends_nothing() {
    use leasehold_lease::{Acquire, Driver};
    let server = ZooKeeperServer::start();
    let (holder, waiter, other) = (driver(&server), driver(&server), driver(&server));
    let lease = Duration::from_secs(5);
    let lock = "given-up";
    let Acquire::Acquired(first) = holder.try_acquire(lock, "holder", lease).await.unwrap() else {
        panic!("the holder");
    };
    let Acquire::Busy(_) = waiter.try_acquire(lock, "waiter", lease).await.unwrap() else {
        panic!("the waiter waits");
    };
    // The holder's session is given up; the holder renews through its next one.
    let holders_old_session = holder.give_up_a_session_the_server_keeps().await;
    let renewed = holder.renew(&first, lease).await;
    assert!(
        !matches!(renewed, Ok(true)),
        "a claim was extended through a session that does not keep its node"
    );
    drop(holders_old_session);
    // The waiter, now first in line, gives its session up before it asks again.
    let waiters_old_session = waiter.give_up_a_session_the_server_keeps().await;
    if let Ok(Acquire::Acquired(w)) = waiter.try_acquire(lock, "waiter", lease).await {
        panic!(
            "granted (token {}) on a node of a session the driver gave up, which the server ends on its own clock",
            w.token
        );
    }
    drop(waiters_old_session);
    // Both sessions ended: the lock is free for the next.
    let deadline = tokio::time::Instant::now() + lease * 2;
    loop {
        match other.try_acquire(lock, "other", lease).await.unwrap() {
            Acquire::Acquired(_) => break,
            refused => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the lock stayed taken: {refused:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// An acquisition dropped while its node is being created (the engine's time budget, a client
/// that hung up), its wait then abandoned: the node leaves the queue as soon as it is created,
/// rather than stand first in line, asked by nobody, for four leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_dropped_while_its_node_is_created_leaves_no_node_behind() {
    use leasehold_lease::{Acquire, Driver};
    use leasehold_testkit::conformance::a_place_put_for_a_dropped_acquisition_leaves_the_line;
    let server = ZooKeeperServer::start();
    let lease = Duration::from_secs(10);
    let dropped = driver(&server);
    // The session opened first, so that the attempt below stops in the node's creation.
    let Acquire::Acquired(warm) = dropped.try_acquire("warm", "a", lease).await.unwrap() else {
        panic!("the warm-up lock");
    };
    assert!(dropped.release(&warm).await.unwrap());
    a_place_put_for_a_dropped_acquisition_leaves_the_line(
        &dropped,
        &driver(&server),
        "dropped",
        lease,
    )
    .await;
}

/// Over TLS, each way of getting it wrong is refused with its cause named (the client library
/// only retries until its timeout): a server certificate another CA signed, no client
/// certificate for a server that asks for one, a plain-text port behind `zks://`. The right
/// settings then work against the same server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_mistakes_are_refused_with_their_cause() {
    use leasehold_testkit::driver_for;
    let server = tokio::task::block_in_place(ZooKeeperServer::start_tls);
    let url = server.url();
    let files = server.tls_files();
    let elsewhere = tempfile::tempdir().unwrap();
    leasehold_testkit::write_test_certificates(elsewhere.path());
    let other_ca = url.replace(
        &format!("ca={}", files.ca.display()),
        &format!("ca={}", elsewhere.path().join("ca.crt").display()),
    );
    let no_client_pair = url
        .split("&cert=")
        .next()
        .expect("url with a client pair")
        .to_owned();
    let plain_port = url.replace(
        &format!(":{}/", server.tls_port().unwrap()),
        &format!(":{}/", server.port()),
    );
    for (wrong, cause) in [
        (&other_ca, "not signed by the CA given"),
        (&no_client_pair, "client certificate"),
        (&plain_port, "does not speak TLS"),
    ] {
        assert_ne!(wrong, &url);
        let driver = driver_for(wrong).await;
        match driver
            .try_acquire("tls-refusal", "a", Duration::from_secs(5))
            .await
        {
            Err(leasehold_lease::Error::Unreachable(message)) => {
                assert!(message.contains(cause), "{wrong}: {message}")
            }
            other => {
                panic!("{wrong}: expected ZooKeeper to be unreachable over TLS, got {other:?}")
            }
        }
    }
    let driver = driver_for(&url).await;
    assert!(matches!(
        driver
            .try_acquire("tls-refusal", "a", Duration::from_secs(5))
            .await
            .expect("the right CA and client pair"),
        leasehold_lease::Acquire::Acquired(_)
    ));
}

/// A place on the driver's own session that the driver does not know of (a create whose answer
/// never came back, as after a server restart) is cleared once first in line
/// ([`an_unknown_place_of_its_own_is_cleared`]): left, it keeps every waiter, its owner
/// included, from the lock until the owner's session ends.
async fn an_unknown_place_is_cleared(owner_waits: bool) {
    let server = ZooKeeperServer::start();
    an_unknown_place_of_its_own_is_cleared(|| driver(&server), owner_waits).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_place_of_the_drivers_own_session_is_cleared_by_its_next_attempt() {
    an_unknown_place_is_cleared(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_place_of_an_idle_drivers_session_is_cleared_when_it_observes() {
    an_unknown_place_is_cleared(false).await;
}

/// Renewals that arrive at once are checked with one `sync` and one `multiRead`: 40 at once,
/// every fourth of whose nodes was deleted behind the driver's back, take a handful of requests
/// (a `sync` and a read each, 80, before), and each is answered for its own node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_at_once_take_one_sync_and_one_read_and_answer_each_for_its_node() {
    use leasehold_lease::{Acquire, Driver};
    const LOCKS: usize = 40;
    const TTL: Duration = Duration::from_secs(10);
    let server = ZooKeeperServer::start();
    let driver = driver(&server);
    let mut leases = Vec::new();
    for i in 0..LOCKS {
        let lock = format!("renew-{i}");
        match driver
            .try_acquire(&lock, "pod-a", TTL)
            .await
            .expect("acquire")
        {
            Acquire::Acquired(lease) => leases.push(lease),
            Acquire::Busy(holding) => panic!("{lock}: busy {holding:?}"),
            Acquire::Withheld(w) => panic!("withheld: {w:?}"),
        }
    }
    let admin = zookeeper_client::Client::connect(&format!("127.0.0.1:{}", server.port()))
        .await
        .expect("admin client");
    for i in (0..LOCKS).step_by(4) {
        let parent = format!("/leasehold/renew-{i}");
        for child in admin.list_children(&parent).await.expect("children") {
            admin
                .delete(&format!("{parent}/{child}"), None)
                .await
                .expect("delete");
        }
    }
    let before = server.packets_received();
    let answers =
        futures_util::future::join_all(leases.iter().map(|lease| driver.renew(lease, TTL))).await;
    let requests = server.packets_received() - before;
    for (i, answer) in answers.into_iter().enumerate() {
        assert_eq!(answer.expect("renew"), i % 4 != 0, "renew-{i}");
    }
    assert!(
        requests <= 8,
        "{requests} requests for {LOCKS} renewals at once"
    );
}

/// A place is created on the session chosen for it, and that session must outlive it: another
/// acquisition with another lease, made while the place was being created and nothing else was
/// held, opened a session of its own in its place; the first acquisition then dated its claim
/// on the new session, and the old one, closed once nothing used it, took the place with it
/// while its owner still claimed the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_place_being_created_keeps_its_session() {
    use leasehold_lease::{Acquire, Driver};
    let server = ZooKeeperServer::start();
    let (a, b) = (driver(&server), driver(&server));
    let (first, second) = (
        leasehold_testkit::unique_lock("created-on"),
        leasehold_testkit::unique_lock("longer"),
    );
    let (lease, longer) = (Duration::from_secs(4), Duration::from_secs(6));
    let gate = a.hold_creates();
    let taking = {
        let (a, first) = (std::sync::Arc::new(a), first.clone());
        let taker = a.clone();
        (
            a,
            tokio::spawn(async move { taker.try_acquire(&first, "a", lease).await }),
        )
    };
    let (a, taking) = taking;
    // The first create has chosen its session; the second acquisition, with another lease,
    // chooses one while the first is still being created.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second_taking = {
        let (a, second) = (a.clone(), second.clone());
        tokio::spawn(async move { a.try_acquire(&second, "a", longer).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    gate.add_permits(2);
    let Acquire::Acquired(held) = taking.await.unwrap().expect("the first acquisition") else {
        panic!("a could not take the free lock");
    };
    let _ = second_taking.await.unwrap();
    // a claims the lock for its lease: nobody else takes it meanwhile.
    let until = tokio::time::Instant::now() + lease / 2;
    while tokio::time::Instant::now() < until {
        match b
            .try_acquire(&first, "b", lease)
            .await
            .expect("b's attempt")
        {
            Acquire::Acquired(_) => {
                panic!("b took the lock while a held it (token {})", held.token)
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert!(
        a.renew(&held, lease).await.expect("a's renewal"),
        "a lost its place"
    );
}

/// A node given up while ZooKeeper could not be reached (a release whose delete failed, the
/// session kept across the reconnect) is deleted even when its process makes no call that
/// would: one that only renews other locks, or none. Otherwise it stands first in line and
/// every other pod waits for as long as the process lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_given_up_unreached_is_deleted_without_another_call() {
    use leasehold_lease::{Acquire, Driver};
    let server = ZooKeeperServer::start();
    let (a, b) = (driver(&server), driver(&server));
    let lock = leasehold_testkit::unique_lock("given-up");
    let lease = Duration::from_secs(3);
    let Acquire::Acquired(held) = b.try_acquire(&lock, "b", lease).await.expect("b") else {
        panic!("b could not take the free lock");
    };
    let left = a
        .place_unknown_to_the_driver(&lock, "a", lease)
        .await
        .expect("a place");
    a.gave_up_unreached(&left);
    assert!(b.release(&held).await.expect("b's release"));
    assert!(matches!(
        b.try_acquire(&lock, "b", lease).await.expect("b"),
        Acquire::Busy(_)
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match b.try_acquire(&lock, "b", lease).await.expect("b") {
            Acquire::Acquired(_) => break,
            _ => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "a's node, given up, still stands first in line"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A create whose answer never came may land after the sweep of orphans first looked for it:
/// forwarded by a server the client then lost, it commits once the leader has it, and a listing
/// through a server that has not heard of it finds nothing. The driver looks for its protected
/// prefix again until it can no longer land; otherwise the node, of a session that lives on,
/// stands first in line while no call of its process touches the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_that_lands_after_the_sweep_looked_is_deleted() {
    use leasehold_lease::{Acquire, Driver};
    let server = ZooKeeperServer::start();
    let (a, b) = (driver(&server), driver(&server));
    let lock = leasehold_testkit::unique_lock("late-create");
    let lease = Duration::from_secs(3);
    let Acquire::Acquired(held) = b.try_acquire(&lock, "b", lease).await.expect("b") else {
        panic!("b could not take the free lock");
    };
    // a's session is open (it holds another lock), as it is when a create of its is lost.
    let other = leasehold_testkit::unique_lock("other");
    let Acquire::Acquired(_kept) = a.try_acquire(&other, "a", lease).await.expect("a") else {
        panic!("a could not take a free lock");
    };
    let prefix = a.create_answered_never(&lock);
    // The sweep (every second) looks for it and finds nothing.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    a.create_landing_late(&prefix, "a", lease)
        .await
        .expect("the late create");
    assert!(b.release(&held).await.expect("b's release"));
    let landed = tokio::time::Instant::now();
    loop {
        match b.try_acquire(&lock, "b", lease).await.expect("b") {
            Acquire::Acquired(_) => break,
            _ => {
                assert!(
                    landed.elapsed() < Duration::from_secs(5),
                    "a's late node still stands first in line after {:?}",
                    landed.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The engine dates a claim from what the driver counts it from. A place gone between its
/// answer and that question (its session ended meanwhile) has no sign of life the leader saw
/// to count from: the claim it dates is none, rather than one counted from the request's
/// sending, which is later than the leader's count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_place_gone_since_its_answer_dates_no_claim() {
    use leasehold_lease::{Acquire, BootInstant, Driver};
    let server = ZooKeeperServer::start();
    let holder = driver(&server);
    let lease = Duration::from_secs(3);
    let sent = BootInstant::now();
    let lock = leasehold_testkit::unique_lock("gone");
    let Acquire::Acquired(held) = holder.try_acquire(&lock, "a", lease).await.expect("a") else {
        panic!("a could not take the free lock");
    };
    assert!(holder.counted_from(&held, sent) <= sent);
    assert!(holder.release(&held).await.expect("released"));
    assert!(
        holder.counted_from(&held, sent) + lease <= sent,
        "a place gone dates a claim"
    );
}
