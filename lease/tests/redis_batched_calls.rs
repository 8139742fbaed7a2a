//! Acquisitions on one Redis master that are under way at once go out together, and so do
//! releases: many owners taking and giving back many keys cost the server few script calls
//! (and one epoch check per acquisitions' call), and every call is still answered for its own
//! lock, as it would be alone. Real servers.

use std::collections::HashMap;
use std::time::Duration;

use futures_util::FutureExt;
use leasehold_lease::{Acquire, Backend, Lease};
use leasehold_testkit::{RedisServer, command_calls, driver_for, unique_lock};

const TTL: Duration = Duration::from_secs(5);

/// `lock` taken for `identity`, which must find it free.
async fn acquired(driver: &dyn Backend, lock: &str, identity: &str) -> Lease {
    match driver.try_acquire(lock, identity, TTL).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        Acquire::Busy(holder) => panic!("{lock}: not acquired by {identity}, held by {holder:?}"),
        Acquire::Withheld(w) => panic!("withheld: {w:?}"),
    }
}

/// 30 free locks, one lock wanted by 10 identities at once, and one lock held before: 41
/// acquisitions at once, in far fewer script calls. Each free lock is granted with a token of
/// its own, exactly one of the 10 wins its lock and the other 9 are told who holds it, and the
/// lock held before stays its holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_at_once_go_in_few_calls_and_answer_each_for_its_lock() {
    let server = RedisServer::start();
    let driver = driver_for(&server.url()).await;
    let mut admin = server.admin().await;
    let held = unique_lock("held");
    let before = acquired(&*driver, &held, "pod-x").await;
    let contested = unique_lock("contested");
    let mut asked: Vec<(String, String)> = (0..30)
        .map(|i| (unique_lock(&format!("free-{i}")), "pod-a".to_owned()))
        .collect();
    asked.extend((0..10).map(|i| (contested.clone(), format!("pod-{i}"))));
    asked.push((held.clone(), "pod-y".to_owned()));

    let calls_before = command_calls(&mut admin, &["evalsha", "eval"]).await;
    let answers = futures_util::future::join_all(
        asked
            .iter()
            .map(|(lock, identity)| driver.try_acquire(lock, identity, TTL)),
    )
    .await;
    let calls = command_calls(&mut admin, &["evalsha", "eval"]).await - calls_before - 1;
    assert!(
        calls < 10,
        "{} acquisitions at once took {calls} script calls",
        asked.len()
    );

    let mut winners = HashMap::new();
    let mut busy = Vec::new();
    for ((lock, identity), answer) in asked.iter().zip(answers) {
        match answer.expect("acquire") {
            Acquire::Acquired(lease) => {
                assert_eq!((&lease.lock, &lease.identity), (lock, identity));
                assert!(
                    winners.insert(lock.clone(), lease).is_none(),
                    "{lock}: two winners"
                );
            }
            Acquire::Busy(holder) => busy.push((lock.clone(), holder)),
            Acquire::Withheld(w) => panic!("{lock}: withheld {w:?}"),
        }
    }
    assert_eq!(
        winners.len(),
        31,
        "every free lock and one contested: {winners:?}"
    );
    assert!(
        !winners.contains_key(&held),
        "a held lock was granted again"
    );
    let winner = &winners[&contested];
    assert_eq!(busy.len(), 10, "{busy:?}");
    for (lock, holder) in &busy {
        let holder = holder.as_ref().expect("the holder is named");
        if lock == &held {
            assert_eq!(
                (holder.identity.as_str(), holder.token),
                ("pod-x", before.token)
            );
        } else {
            assert_eq!(lock, &contested);
            assert_eq!(
                (&holder.identity, holder.token),
                (&winner.identity, winner.token)
            );
        }
    }
    for (lock, lease) in &winners {
        let value: String = redis::cmd("GET")
            .arg(format!("leasehold:{{{lock}}}:lease"))
            .query_async(&mut admin)
            .await
            .expect("GET");
        assert_eq!(
            value,
            format!("{}:{}", lease.token, lease.identity),
            "{lock}"
        );
        assert!(driver.release(lease).await.unwrap(), "{lock}");
    }
    assert!(driver.release(&before).await.unwrap());
}

/// A server without an append-only file, up for less than a lease, may have lost leases its
/// holders still claim: no free lock is granted, for any acquisition of a batch, not only
/// the one that checked the epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_on_a_server_that_may_have_lost_leases_grants_nothing() {
    let server = RedisServer::start_with(false);
    let driver = driver_for(&server.url()).await;
    let locks: Vec<String> = (0..20)
        .map(|i| unique_lock(&format!("young-{i}")))
        .collect();
    let answers = futures_util::future::join_all(
        locks
            .iter()
            .map(|lock| driver.try_acquire(lock, "pod-a", Duration::from_secs(30))),
    )
    .await;
    for (lock, answer) in locks.iter().zip(answers) {
        match answer.expect("acquire") {
            // Each says why, and when grants resume: within the 30 s lease.
            Acquire::Withheld(withheld) => {
                assert_eq!(withheld.reason, leasehold_lease::RESTART_GUARD);
                assert!(
                    withheld
                        .resume_in
                        .is_some_and(|left| left <= Duration::from_secs(30)),
                    "{lock}: {withheld:?}"
                );
            }
            other => panic!("{lock}: granted by a server that may have lost leases: {other:?}"),
        }
    }
}

/// 30 leases released at once with two that are no longer their holders' (one taken over, one
/// already released): few script calls; each of the 30 is released, the other two are told
/// so and leave the lock as it is; the waiter of a lock whose release it waited for hears the
/// notice, and only the locks someone waited for are announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_at_once_go_in_few_calls_and_answer_each_for_its_lease() {
    let server = RedisServer::start();
    let driver = driver_for(&server.url()).await;
    let mut admin = server.admin().await;
    let mut leases = Vec::new();
    for i in 0..30 {
        let lock = unique_lock(&format!("held-{i}"));
        leases.push(acquired(&*driver, &lock, "pod-a").await);
    }
    // A waiter on the first lock marks it waited for; its release must wake it.
    let waited = leases[0].lock.clone();
    let mut changes = driver.changes(&waited).expect("redis has change feeds");
    changes.borrow_and_update();
    assert!(matches!(
        driver.try_acquire(&waited, "pod-b", TTL).await.unwrap(),
        Acquire::Busy(Some(_))
    ));
    // A lease already released, and one whose lock is now another's.
    let gone = leases.pop().unwrap();
    assert!(driver.release(&gone).await.unwrap());
    let overtaken = leases.pop().unwrap();
    assert!(driver.release(&overtaken).await.unwrap());
    let other = acquired(&*driver, &overtaken.lock, "pod-c").await;
    let notices_before = command_calls(&mut admin, &["publish"]).await;
    let calls_before = command_calls(&mut admin, &["evalsha", "eval"]).await;
    let mut releases = leases.clone();
    releases.push(gone.clone());
    releases.push(overtaken.clone());
    let answers =
        futures_util::future::join_all(releases.iter().map(|lease| driver.release(lease))).await;
    let calls = command_calls(&mut admin, &["evalsha", "eval"]).await - calls_before - 1;
    assert!(
        calls < 10,
        "{} releases at once took {calls} script calls",
        releases.len()
    );
    for (lease, answer) in releases.iter().zip(answers) {
        let released = answer.expect("release");
        assert_eq!(
            released,
            leases.contains(lease),
            "{}: released {released}",
            lease.lock
        );
        let value: Option<String> = redis::cmd("GET")
            .arg(format!("leasehold:{{{}}}:lease", lease.lock))
            .query_async(&mut admin)
            .await
            .expect("GET");
        if lease == &overtaken {
            assert_eq!(value, Some(format!("{}:pod-c", other.token)));
        } else {
            assert_eq!(value, None, "{}", lease.lock);
        }
    }
    let notices = command_calls(&mut admin, &["publish"]).await - notices_before;
    assert_eq!(notices, 1, "only the lock waited for is announced");
    tokio::time::timeout(Duration::from_secs(5), changes.changed())
        .await
        .expect("the waiter hears the release")
        .expect("feed open");
}

/// A release whose caller stops waiting right after asking is still made, all of it (here the
/// server's first answer, `NOSCRIPT`, then loading the release script and calling it again):
/// a lease left behind would keep its lock from everyone until it ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_abandoned_by_its_caller_is_still_made() {
    let server = RedisServer::start();
    let driver = driver_for(&server.url()).await;
    let mut admin = server.admin().await;
    let lock = unique_lock("abandoned");
    let lease = acquired(&*driver, &lock, "pod-a").await;
    // Without scripts loaded, the release's first call is refused, and the rest of the release
    // needs the caller's future (or what carries on for it).
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut admin)
        .await
        .expect("SCRIPT FLUSH");
    // Polled once, then dropped.
    assert!(
        driver.release(&lease).now_or_never().is_none(),
        "the release was answered at its first poll"
    );
    let key = format!("leasehold:{{{lock}}}:lease");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let exists: bool = redis::cmd("EXISTS")
            .arg(&key)
            .query_async(&mut admin)
            .await
            .expect("EXISTS");
        if !exists {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the abandoned release was never made"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A lock whose keys Leasehold did not write (here a lease key that is a hash) fails its own
/// acquisition, with the key named, and no other: every lock that shared its script call is
/// granted to its caller, and no lease is left held for a caller that was told it failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_with_foreign_keys_fails_alone_in_its_batch() {
    let server = RedisServer::start();
    let driver = driver_for(&server.url()).await;
    let mut admin = server.admin().await;
    let locks: Vec<String> = (0..40)
        .map(|i| unique_lock(&format!("batch-{i}")))
        .collect();
    let poisoned = &locks[20];
    let poisoned_key = format!("leasehold:{{{poisoned}}}:lease");
    let _: () = redis::cmd("HSET")
        .arg(&poisoned_key)
        .arg("field")
        .arg("value")
        .query_async(&mut admin)
        .await
        .expect("HSET");
    let answers = futures_util::future::join_all(
        locks
            .iter()
            .map(|lock| driver.try_acquire(lock, "pod-a", TTL)),
    )
    .await;
    for (lock, answer) in locks.iter().zip(answers) {
        let key = format!("leasehold:{{{lock}}}:lease");
        if lock == poisoned {
            let error = answer.expect_err("a lease key that is a hash was used");
            assert!(
                error.to_string().contains(&poisoned_key),
                "the error does not name the key: {error}"
            );
            continue;
        }
        match answer {
            Ok(Acquire::Acquired(lease)) => {
                let value: String = redis::cmd("GET")
                    .arg(&key)
                    .query_async(&mut admin)
                    .await
                    .expect("GET");
                assert_eq!(value, format!("{}:pod-a", lease.token), "{lock}");
            }
            other => {
                let exists: bool = redis::cmd("EXISTS")
                    .arg(&key)
                    .query_async(&mut admin)
                    .await
                    .expect("EXISTS");
                panic!("{lock} was not granted ({other:?}); its lease left in place: {exists}");
            }
        }
    }
}

/// A lease key that is no longer a string (changed by hand) fails its own lock's renewal and
/// release alone: the other locks renewed or released in the same call are answered for
/// themselves, rather than every lock of the batch failing (and lapsing) with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_key_of_another_type_fails_its_own_lock_alone_in_a_batch() {
    let server = RedisServer::start();
    let driver = driver_for(&server.url()).await;
    let mut admin = server.admin().await;
    let mut leases = Vec::new();
    for i in 0..20 {
        leases.push(acquired(&*driver, &unique_lock(&format!("batched-{i}")), "pod-a").await);
    }
    let broken = leases[7].lock.clone();
    let key = format!("leasehold:{{{broken}}}:lease");
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut admin)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("by")
        .arg("hand")
        .query_async(&mut admin)
        .await
        .unwrap();

    let calls_before = command_calls(&mut admin, &["evalsha", "eval"]).await;
    let renewed =
        futures_util::future::join_all(leases.iter().map(|lease| driver.renew(lease, TTL))).await;
    let calls = command_calls(&mut admin, &["evalsha", "eval"]).await - calls_before - 1;
    assert!(calls < 10, "20 renewals at once took {calls} script calls");
    for (lease, renewed) in leases.iter().zip(&renewed) {
        let expected = lease.lock != broken;
        assert!(
            matches!(renewed, Ok(r) if *r == expected),
            "{}: renewed {renewed:?}",
            lease.lock
        );
    }
    let released =
        futures_util::future::join_all(leases.iter().map(|lease| driver.release(lease))).await;
    for (lease, released) in leases.iter().zip(&released) {
        let expected = lease.lock != broken;
        assert!(
            matches!(released, Ok(r) if *r == expected),
            "{}: released {released:?}",
            lease.lock
        );
    }
}
