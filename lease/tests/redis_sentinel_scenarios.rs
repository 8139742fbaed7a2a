//! Redis behind Sentinel through failovers, on a real master, replica and sentinel: what a
//! promoted replica that never received the holder's lease does, and what an acquisition that
//! no replica confirmed does.

use std::time::Duration;

use leasehold_lease::Acquire;
use leasehold_testkit::{
    FaultyDriver, RedisSentinelSet, campaign, claims, driver_for, unique_lock,
};
use tokio::time::{Instant, sleep};

/// The replica stops receiving (its link is cut), the holder takes the lock on the master alone
/// (`min-replicas=0`), the holder is cut off from Redis (a partition, a long pause),
/// and the master dies: the sentinel promotes a replica that has neither the lease nor the token
/// the holder got, while the holder still claims the lock for the rest of its lease. A new
/// contender must not hold before that claim has ended, and must get a greater token. Without
/// the epoch record, the contender takes the lock as soon as the replica is promoted, with the
/// same token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_without_the_lease_hands_the_lock_on_only_after_the_old_claim() {
    a_lease_lost_in_a_failover_is_waited_out(Before::Nothing, After::Nothing).await;
}

/// The same, with the promoted replica made durable and restarted on its own data before any
/// lock call reached it: it then looks like a durable master restarted, which lost nothing and
/// grants at once. It is not one: its data came from the old master, without the holder's
/// lease. The epoch record it has (written by the old master, and replicated) names another
/// keeper (the sentinels' configuration epoch, raised by the failover), so it waits out a lease
/// as a promoted replica does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_restarted_before_it_served_the_lock_waits_out_the_old_claim() {
    a_lease_lost_in_a_failover_is_waited_out(Before::RecordReplicated, After::RestartedDurable)
        .await;
}

/// The same without an epoch record on the replica (the old master's first acquisition never
/// reached it): a master with no record that the sentinels named after a failover counts its
/// wait from its own start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_restarted_without_a_record_waits_out_the_old_claim() {
    a_lease_lost_in_a_failover_is_waited_out(Before::Nothing, After::RestartedDurable).await;
}

/// What the replica has before its link is cut.
enum Before {
    Nothing,
    /// The epoch record, from an acquisition of another lock.
    RecordReplicated,
}

/// What happens to the promoted replica before the contender's first call.
enum After {
    Nothing,
    RestartedDurable,
}

async fn a_lease_lost_in_a_failover_is_waited_out(before: Before, after: After) {
    let mut set = RedisSentinelSet::start();
    let url = format!("{}?min-replicas=0", set.url());
    let lock = unique_lock("failover");
    // Longer than detection plus promotion (and a restart), so that the old holder still claims
    // when the new master first serves.
    let lease = Duration::from_secs(10);

    if let Before::RecordReplicated = before {
        let driver = driver_for(&set.url()).await;
        let earlier = unique_lock("earlier");
        let Acquire::Acquired(held) = driver.try_acquire(&earlier, "w", lease).await.unwrap()
        else {
            panic!("a fresh lock on a fresh durable master is free");
        };
        assert!(driver.release(&held).await.unwrap());
    }
    set.replication_link.cut();
    let a_driver = FaultyDriver::wrap(driver_for(&url).await);
    let a = campaign(a_driver.clone(), &lock, "a", lease);
    let start = Instant::now();
    while !a.answer().is_holder() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "a never held: {:?}",
            a.answer()
        );
        sleep(Duration::from_millis(10)).await;
    }
    let a_token = a.answer().token().expect("a holds");

    a_driver.cut_off(true);
    let killed = Instant::now();
    tokio::task::block_in_place(|| {
        set.fail_over();
        if let After::RestartedDurable = after {
            set.restart_promoted_as_durable();
        }
    });
    let serving = killed.elapsed();
    let b = campaign(driver_for(&url).await, &lock, "b", lease);

    let mut a_last_claimed = None;
    let b_token = loop {
        let (a_claims, b_answer) = (claims(&a), b.answer());
        assert!(
            !(a_claims && b_answer.is_holder()),
            "two holders after the failover: a claims {:?}, b answers {b_answer:?}",
            a.snapshot().held
        );
        if a_claims {
            a_last_claimed = Some(killed.elapsed());
        }
        if let Some(token) = b_answer.token() {
            break token;
        }
        assert!(
            killed.elapsed() < serving + lease * 3,
            "b never took over after the failover ({serving:?} to serve): {b_answer:?}, {:?}; \
             on the new master, epoch {:?}, lease {:?}",
            b.snapshot(),
            set.on_master(&["HGETALL", "leasehold:epoch"]),
            set.on_master(&["GET", &format!("leasehold:{{{lock}}}:lease")]),
        );
        sleep(Duration::from_millis(5)).await;
    };
    let b_held = killed.elapsed();
    assert!(
        a_last_claimed.is_some_and(|t| t > serving),
        "the old holder still claimed when the new master first served (the case under test): \
         last claimed at {a_last_claimed:?}, serving at {serving:?}"
    );
    assert!(
        b_token > a_token,
        "token {b_token} after the failover, {a_token} before"
    );
    assert!(!claims(&a));
    println!(
        "serving after {serving:?}; a claimed until {a_last_claimed:?}; b held at {b_held:?} with token {b_token} (a had {a_token})"
    );
    if let After::RestartedDurable = after {
        // The record is now the new master's own: restarted again on it, with no failover, it
        // lost nothing and grants a free lock at once.
        tokio::task::block_in_place(|| set.restart_promoted_as_durable());
        let driver = driver_for(&url).await;
        let fresh = unique_lock("fresh");
        let began = Instant::now();
        loop {
            match driver.try_acquire(&fresh, "c", lease).await {
                Ok(Acquire::Acquired(_)) => break,
                Ok(other) => panic!(
                    "a durable master restarted on its own record, with no failover, withholds \
                     a free lock: {other:?}; epoch {:?}",
                    set.on_master(&["HGETALL", "leasehold:epoch"])
                ),
                // The connection to the restarted master, made again.
                Err(e) => {
                    assert!(began.elapsed() < Duration::from_secs(10), "{e}");
                    sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// With the replica's link cut, an acquisition `WAIT` cannot confirm is an error that says so,
/// and it is given back: once replication is back, another client takes the lock at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_no_replica_confirms_is_not_held() {
    let set = RedisSentinelSet::start();
    let lock = unique_lock("unconfirmed");
    let (a, b) = (driver_for(&set.url()).await, driver_for(&set.url()).await);
    set.replication_link.cut();
    let error = a
        .try_acquire(&lock, "a", Duration::from_secs(1))
        .await
        .expect_err("an acquisition no replica confirmed");
    assert!(
        error
            .to_string()
            .contains("confirmed by 0 of the 1 replica(s) min-replicas asks for"),
        "{error}"
    );
    assert_eq!(b.observe(&lock).await.expect("observe"), None);

    set.replication_link.restore();
    let start = Instant::now();
    loop {
        match b.try_acquire(&lock, "b", Duration::from_secs(1)).await {
            Ok(leasehold_lease::Acquire::Acquired(_)) => break,
            Ok(other) => panic!("b could not take the lock a gave back: {other:?}"),
            // Until the replica has caught up again.
            Err(e) => assert!(
                start.elapsed() < Duration::from_secs(20),
                "replication never came back: {e}"
            ),
        }
        sleep(Duration::from_millis(100)).await;
    }
}

/// Over TLS (`rediss+sentinel://`, the sentinel asking for its own password): the master dies,
/// the sentinel promotes the replica, which it names by its TLS port, the old master rejoins
/// as its replica over TLS, and the holder follows the failover. Its lease was confirmed by the
/// replica, so it keeps the lock on the new master, and the next holder's token is greater.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_the_holder_follows_a_failover_to_the_promoted_replica() {
    let mut set = tokio::task::block_in_place(RedisSentinelSet::start_tls);
    let url = set.url();
    assert!(url.starts_with("rediss+sentinel://"), "{url}");
    let lock = unique_lock("tls-failover");
    // Longer than detection, promotion and the old master's rejoining together.
    let lease = Duration::from_secs(20);
    let a = campaign(driver_for(&url).await, &lock, "a", lease);
    let start = Instant::now();
    let a_token = loop {
        if let Some(token) = a.answer().token() {
            break token;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "a never held: {:?}",
            a.answer()
        );
        sleep(Duration::from_millis(10)).await;
    };
    // The old master back as the new one's replica: each renewal waits for a replica's
    // confirmation (`min-replicas` 1), so without one the holder could not renew.
    let new_master = tokio::task::block_in_place(|| set.fail_over_and_rejoin());
    let lease_key = format!("leasehold:{{{lock}}}:lease");
    let followed = Instant::now();
    // a renews on the promoted replica: its lease is there, under its name.
    while !set
        .on_master(&["GET", &lease_key])
        .is_ok_and(|lease| lease.contains('a'))
        || !a.answer().is_holder()
    {
        assert!(
            followed.elapsed() < lease * 2,
            "a did not follow the failover to server {new_master}: {:?}, lease there {:?}",
            a.answer(),
            set.on_master(&["GET", &lease_key])
        );
        sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(a.answer().token(), Some(a_token), "the same holding");
    a.shutdown().await;
    let b = campaign(driver_for(&url).await, &lock, "b", lease);
    let handed = Instant::now();
    let b_token = loop {
        if let Some(token) = b.answer().token() {
            break token;
        }
        assert!(
            handed.elapsed() < lease * 3,
            "b never held on the new master: {:?}",
            b.answer()
        );
        sleep(Duration::from_millis(10)).await;
    };
    assert!(b_token > a_token, "token {b_token} after {a_token}");
    b.shutdown().await;
}

/// A pod that hears only a minority of the sentinels (it is partitioned with one of three,
/// while its master and the master's replica still serve it) stops holding within the lease:
/// the majority, on the other side, may be failing over. With two of the three it holds on,
/// and once a majority answers again it holds again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_hears_only_a_minority_of_the_sentinels_stops_within_the_lease() {
    use leasehold_lease::redis_sentinel::CONFIRMED_FOR;
    use leasehold_testkit::FaultProxy;
    let set = RedisSentinelSet::start_with_three_sentinels();
    let proxies: Vec<FaultProxy> = set
        .sentinel_ports()
        .into_iter()
        .map(FaultProxy::start)
        .collect();
    let ports: Vec<u16> = proxies.iter().map(|p| p.port).collect();
    let url = RedisSentinelSet::url_of(&ports);
    let lock = unique_lock("minority");
    let lease = Duration::from_secs(3);
    let a = campaign(driver_for(&url).await, &lock, "a", lease);
    let holds = async |within: Duration| {
        let start = Instant::now();
        while !a.answer().is_holder() {
            assert!(start.elapsed() < within, "a never held: {:?}", a.answer());
            sleep(Duration::from_millis(10)).await;
        }
        a.answer().token().expect("a holds")
    };
    let token = holds(Duration::from_secs(10)).await;

    proxies[2].cut();
    sleep(lease + Duration::from_secs(1)).await;
    // Still claiming, with the same token: its renewals went through. (Its answer may be
    // "unknown" at this instant, while a renewal runs past its budget on a slow machine.)
    let held = a.snapshot().held;
    assert!(
        leasehold_testkit::claims(&a) && held.as_ref().map(|h| h.token) == Some(token),
        "two of three sentinels are a majority: {held:?}, {:?}",
        a.answer()
    );

    proxies[1].cut();
    let cut = Instant::now();
    while a.answer().is_holder() {
        assert!(
            cut.elapsed() < lease + CONFIRMED_FOR + Duration::from_millis(500),
            "a still holds {:?} after {:?}, hearing one sentinel of three",
            a.answer(),
            cut.elapsed()
        );
        sleep(Duration::from_millis(10)).await;
    }

    proxies[1].restore();
    holds(Duration::from_secs(10)).await;
    drop(set);
}

/// A claim counts from the question whose majority named the master, not from the call: a
/// majority that names another master later can only follow that question, so the claim ends
/// before the other master can grant the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_counts_from_the_sentinels_answer_not_from_the_call() {
    use leasehold_lease::boot_clock::BootInstant;
    let set = RedisSentinelSet::start();
    let driver = driver_for(&set.url()).await;
    let ttl = Duration::from_secs(10);
    let Acquire::Acquired(first) = driver
        .try_acquire(&unique_lock("asked"), "a", ttl)
        .await
        .unwrap()
    else {
        panic!("the lock is not free");
    };
    // The majority's answer this call used was asked before it was sent.
    let sent = BootInstant::now();
    let Acquire::Acquired(lease) = driver
        .try_acquire(&unique_lock("asked"), "a", ttl)
        .await
        .unwrap()
    else {
        panic!("the lock is not free");
    };
    let counted = driver.counted_from(&lease, sent);
    assert!(counted < sent, "counted from {counted:?}, sent at {sent:?}");
    assert!(
        sent.saturating_duration_since(counted) <= leasehold_lease::redis_sentinel::CONFIRMED_FOR,
        "counted from {counted:?}, sent at {sent:?}"
    );
    assert!(driver.release(&lease).await.unwrap());
    assert!(driver.release(&first).await.unwrap());
    // Released, nothing is kept for it: a late question about it counts from the earliest.
    assert_eq!(
        driver.counted_from(&lease, sent),
        sent - leasehold_lease::redis_sentinel::CONFIRMED_FOR
    );
}
