//! `tair://` pointed at a plain Redis: every call fails with the missing commands named (the
//! operator's provisioning reports it), and nothing panics.

use std::time::Duration;

use leasehold_lease::{BackendUrl, Error, connect};
use leasehold_testkit::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_redis_behind_tair_is_named_as_such() {
    let plain = RedisServer::start();
    let url = format!("tair://127.0.0.1:{}", plain.port());
    let driver = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
    let provision = driver.provision(&["jobs".into()]).await.unwrap_err();
    let acquire = driver
        .try_acquire("jobs", "pod-a", Duration::from_secs(5))
        .await
        .unwrap_err();
    for error in [provision, acquire] {
        assert!(matches!(error, Error::Backend(_)), "{error:?}");
        let text = error.to_string();
        assert!(
            text.contains("EXSET") && text.contains("TairString module"),
            "{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_module_server_provisions_and_tokens_survive_a_restart() {
    let mut server = RedisServer::start_tair();
    let driver = connect(&BackendUrl::parse(&server.url()).unwrap())
        .await
        .unwrap();
    driver.provision(&["jobs".into()]).await.unwrap();
    let leasehold_lease::Acquire::Acquired(first) = driver
        .try_acquire("jobs", "pod-a", Duration::from_secs(5))
        .await
        .unwrap()
    else {
        panic!("not acquired")
    };
    assert!(driver.release(&first).await.unwrap());
    server.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let second = loop {
        match driver
            .try_acquire("jobs", "pod-b", Duration::from_secs(5))
            .await
        {
            Ok(leasehold_lease::Acquire::Acquired(lease)) => break lease,
            other => {
                assert!(std::time::Instant::now() < deadline, "{other:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert!(
        second.token > first.token,
        "{} after {}",
        second.token,
        first.token
    );
    let shown = BackendUrl::parse(&server.url()).unwrap().to_string();
    assert!(shown.starts_with("tair://127.0.0.1:"), "{shown}");
}

async fn acquired(
    driver: &dyn leasehold_lease::Backend,
    lock: &str,
    who: &str,
    ttl: Duration,
) -> leasehold_lease::Lease {
    match driver.try_acquire(lock, who, ttl).await.unwrap() {
        leasehold_lease::Acquire::Acquired(lease) => lease,
        busy => panic!("{who} could not take {lock}: {busy:?}"),
    }
}

/// A holder whose key expired and was taken by another can neither renew nor release the new
/// holder's key. TairString starts every new key at version 1, and `EXCAS`/`EXCAD` compare the
/// version alone: with versions that repeat across holdings, the stale holder's first-version
/// renewal succeeded on the new holder's first-version key, and both claimed the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_key_was_taken_again_cannot_renew_or_release_it() {
    let server = RedisServer::start_tair();
    let url = BackendUrl::parse(&server.url()).unwrap();
    let (a, b) = (connect(&url).await.unwrap(), connect(&url).await.unwrap());
    let short = Duration::from_millis(200);
    let long = Duration::from_secs(30);
    for (lock, stale_call) in [("renewed", "renew"), ("released", "release")] {
        let stale = acquired(&*a, lock, "a", short).await;
        tokio::time::sleep(short + Duration::from_millis(100)).await;
        let fresh = acquired(&*b, lock, "b", long).await;
        let stale_won = match stale_call {
            "renew" => a.renew(&stale, long).await.unwrap(),
            _ => a.release(&stale).await.unwrap(),
        };
        assert!(!stale_won, "a's {stale_call} went through on b's key");
        let holder = b.observe(lock).await.unwrap().expect("b still holds");
        assert_eq!((holder.identity.as_str(), holder.token), ("b", fresh.token));
        assert!(b.renew(&fresh, long).await.unwrap());
        assert!(b.release(&fresh).await.unwrap());
    }
}

/// A driver draws its token in the claim's own round trip, guessing one above the counter it
/// last saw. When others have drawn since, the guess is wrong: the claim under it is undone and
/// tried again, and the token it ends with is the one it drew, above everyone else's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_guess_is_undone_and_tried_again() {
    let server = RedisServer::start_tair();
    let url = BackendUrl::parse(&server.url()).unwrap();
    let (a, b) = (connect(&url).await.unwrap(), connect(&url).await.unwrap());
    let ttl = Duration::from_secs(30);
    let first = acquired(&*a, "guess", "a", ttl).await;
    assert!(a.release(&first).await.unwrap());
    let mut last = first.token;
    for _ in 0..5 {
        let lease = acquired(&*b, "guess", "b", ttl).await;
        assert!(lease.token > last);
        last = lease.token;
        assert!(b.release(&lease).await.unwrap());
    }
    // a last saw the counter at its own token: its guess is five behind.
    let again = acquired(&*a, "guess", "a", ttl).await;
    assert!(again.token > last, "{} after {last}", again.token);
    let holder = b.observe("guess").await.unwrap().expect("a holds");
    assert_eq!((holder.identity.as_str(), holder.token), ("a", again.token));
    assert!(a.renew(&again, ttl).await.unwrap());
    assert!(a.release(&again).await.unwrap());
}

/// A renewal whose answer was lost (a timeout, a reset connection) was carried out all the
/// same and raised the key's version: the holder's next renewal finds its own value at another
/// version, renews at that one (its expiry counted from the new call) and keeps the lock,
/// rather than give up a live lease that nobody could take or release until it ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_after_one_whose_answer_was_lost_keeps_the_lock() {
    let server = RedisServer::start_tair();
    let url = BackendUrl::parse(&server.url()).unwrap();
    let driver = connect(&url).await.unwrap();
    let ttl = Duration::from_secs(30);
    let lease = acquired(&*driver, "renewed", "a", ttl).await;
    let (mut raw, key, version) = renewed_behind_the_drivers_back(&server, "renewed").await;
    assert!(
        driver.renew(&lease, ttl).await.unwrap(),
        "a live lease given up after a renewal whose answer was lost"
    );
    let (_, renewed): (String, i64) = redis::cmd("EXGET")
        .arg(&key)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(
        renewed > version + 1,
        "the renewal was not sent again: version {renewed}"
    );
    assert!(driver.renew(&lease, ttl).await.unwrap());
    assert!(driver.release(&lease).await.unwrap(), "released");
    assert!(driver.observe("renewed").await.unwrap().is_none());
}

/// A renewal of `lock`'s lease carried out by the server whose answer never reached the
/// driver, made with a client of its own: the raw connection, the lease's key, and the
/// version the driver knows.
async fn renewed_behind_the_drivers_back(
    server: &RedisServer,
    lock: &str,
) -> (redis::aio::MultiplexedConnection, String, i64) {
    let mut raw = redis::Client::open(server.plain_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*{{{lock}}}:lease"))
        .query_async(&mut raw)
        .await
        .unwrap();
    let [key] = keys.as_slice() else {
        panic!("the lease's key: {keys:?}");
    };
    let (value, version): (String, i64) = redis::cmd("EXGET")
        .arg(key)
        .query_async(&mut raw)
        .await
        .unwrap();
    let _: redis::Value = redis::cmd("EXCAS")
        .arg(key)
        .arg(&value)
        .arg(version)
        .arg("PX")
        .arg(30_000)
        .query_async(&mut raw)
        .await
        .unwrap();
    (raw, key.clone(), version)
}

/// A release after a renewal whose answer was lost (the renewal timed out, or the caller gave
/// up waiting for it) frees the lock at once, rather than leave it to run out with nobody
/// holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_after_a_renewal_whose_answer_was_lost_frees_the_lock() {
    let server = RedisServer::start_tair();
    let url = BackendUrl::parse(&server.url()).unwrap();
    let driver = connect(&url).await.unwrap();
    let lease = acquired(&*driver, "released", "a", Duration::from_secs(30)).await;
    renewed_behind_the_drivers_back(&server, "released").await;
    assert!(
        driver.release(&lease).await.unwrap(),
        "a live lease not released after a renewal whose answer was lost"
    );
    assert!(driver.observe("released").await.unwrap().is_none());
}

/// The lease of the failover scenarios.
const FAILOVER_LEASE: Duration = Duration::from_secs(3);

fn server_command(server: &RedisServer, args: &[&str]) {
    let mut conn = redis::Client::open(server.plain_url())
        .unwrap()
        .get_connection()
        .unwrap();
    let mut command = redis::cmd(args[0]);
    for arg in &args[1..] {
        command.arg(*arg);
    }
    let _: redis::Value = command.query(&mut conn).unwrap();
}

/// After a failover, driver `b` asks for the lock `a` took at `sent` (token `taken`): it must
/// not get it while a's claim may stand (a lease from its call), and when it does, its token
/// is above a's.
async fn the_new_primary_waits_out_the_lease(
    b: &dyn leasehold_lease::Backend,
    lock: &str,
    sent: tokio::time::Instant,
    taken: u64,
) {
    let deadline = sent + FAILOVER_LEASE * 4;
    let lease = loop {
        match b.try_acquire(lock, "b", FAILOVER_LEASE).await {
            Ok(leasehold_lease::Acquire::Acquired(lease)) => break lease,
            other => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "b never got the lock: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let granted = tokio::time::Instant::now();
    assert!(
        granted >= sent + FAILOVER_LEASE,
        "the new primary granted the lock {:?} after a's acquisition, within a's lease: two holders",
        granted - sent
    );
    assert!(
        lease.token > taken,
        "b's token {} is not above a's {taken}",
        lease.token
    );
}

/// A durable Tair primary with a synced durable standby, and the address clients use: a proxy
/// to the primary that a failover can move (`tair://` URL).
fn primary_and_standby() -> (
    RedisServer,
    RedisServer,
    leasehold_testkit::FaultProxy,
    String,
) {
    let primary = RedisServer::start_tair();
    let standby = RedisServer::start_tair_replica_of(primary.port());
    standby.wait_until_synced();
    let endpoint = leasehold_testkit::FaultProxy::start(primary.port());
    let url = format!("tair://127.0.0.1:{}", endpoint.port);
    (primary, standby, endpoint, url)
}

/// A durable standby promoted behind the primary's address (a virtual IP, a proxy, a Service)
/// may lack the primary's last writes, the lease a holder still claims among them: it counts
/// as a new incarnation that may have lost data, not as a durable server that lost nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_durable_standby_waits_out_the_lease() {
    let (primary, standby, endpoint, url) = primary_and_standby();
    let a = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
    // The epoch record names the primary, on both servers.
    let first = acquired(&*a, "warm-up", "a", FAILOVER_LEASE).await;
    assert!(a.release(&first).await.unwrap());
    server_command(&primary, &["WAIT", "1", "10000"]);
    // The standby is promoted before a's claim reaches it; a takes the lock on the primary.
    server_command(&standby, &["REPLICAOF", "NO", "ONE"]);
    let sent = tokio::time::Instant::now();
    let taken = acquired(&*a, "failover", "a", FAILOVER_LEASE).await;
    endpoint.redirect(standby.port());
    let b = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
    the_new_primary_waits_out_the_lease(&*b, "failover", sent, taken.token).await;
}

/// Another server behind the address, one that keeps no data through a crash (a lossy
/// standby promoted, its data then lost; a server put in the old one's place) is asked whether
/// it is durable when its incarnation is learnt, not taken for durable because the server
/// before it answered so a moment ago: with nothing recorded on it, only a durable server
/// can be trusted to have held no lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_server_behind_the_address_is_asked_again_whether_it_is_durable() {
    let durable = RedisServer::start_tair();
    let lossy = RedisServer::start_tair_with(false);
    let endpoint = leasehold_testkit::FaultProxy::start(durable.port());
    let url = format!("tair://127.0.0.1:{}", endpoint.port);
    let a = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
    let b = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
    // b has just learnt that the server behind the address is durable.
    let first = acquired(&*b, "warm-up", "b", FAILOVER_LEASE).await;
    assert!(b.release(&first).await.unwrap());
    let sent = tokio::time::Instant::now();
    let taken = acquired(&*a, "moved", "a", FAILOVER_LEASE).await;
    endpoint.redirect(lossy.port());
    the_new_primary_waits_out_the_lease(&*b, "moved", sent, taken.token).await;
}

/// A failover and a failback with nothing acquired on the other side in between: the old
/// primary, promoted again, comes back with the other side's data (without the lease taken
/// on it after the first failover) and the epoch record it wrote itself. It is a new
/// incarnation all the same (a new replication ID), not the one the record names, also to a
/// driver whose connection to it stayed open throughout and that wrote nothing meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_promoted_again_after_a_failback_waits_out_the_lease() {
    // The address never moves: the failback happens behind it.
    let (primary, standby, _endpoint, url) = primary_and_standby();
    let a = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
    let c = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
    for (driver, who) in [(&a, "a"), (&c, "c")] {
        let first = acquired(&**driver, &format!("warm-up-{who}"), who, FAILOVER_LEASE).await;
        assert!(driver.release(&first).await.unwrap());
    }
    server_command(&primary, &["WAIT", "1", "10000"]);
    // The standby takes over; the old primary serves a moment longer (a's claim lands there
    // only), then follows the standby, which replaces its data.
    server_command(&standby, &["REPLICAOF", "NO", "ONE"]);
    let sent = tokio::time::Instant::now();
    let taken = acquired(&*a, "failback", "a", FAILOVER_LEASE).await;
    server_command(
        &primary,
        &["REPLICAOF", "127.0.0.1", &standby.port().to_string()],
    );
    primary.wait_until_synced();
    // Failback: the old primary is promoted again, behind the address that never moved.
    server_command(&primary, &["REPLICAOF", "NO", "ONE"]);
    the_new_primary_waits_out_the_lease(&*c, "failback", sent, taken.token).await;
}

/// A primary with a standby attached whose link has stopped carrying writes: a new epoch's
/// record (its floor) may not reach the standby, and a standby promoted without it would take
/// a floor from the record before it, below tokens this primary gave. So no lock is granted in
/// the new epoch until every attached standby has the record; once the link carries again,
/// grants resume, and the standby promoted after has the floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_epoch_grants_nothing_until_its_standbys_have_the_record() {
    use leasehold_testkit::FaultProxy;
    let old = RedisServer::start_tair();
    let mut promoted = RedisServer::start_tair_replica_of(old.port());
    promoted.wait_until_synced();
    let endpoint = FaultProxy::start(old.port());
    let url = format!("tair://127.0.0.1:{}", endpoint.port);
    let a = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
    let first = acquired(&*a, "warm-up", "a", FAILOVER_LEASE).await;
    assert!(a.release(&first).await.unwrap());
    server_command(&old, &["WAIT", "1", "10000"]);
    // The standby takes over; the old primary follows it through a link that is then cut.
    promoted.replicate_from(None);
    endpoint.redirect(promoted.port());
    let link = FaultProxy::start(promoted.port());
    let mut follower = old;
    follower.replicate_from(Some(link.port));
    follower.wait_until_synced();
    // The primary counts the follower as a standby in sync (`state=online`) only once it has
    // the follower's first acknowledgement, which may come after the follower's link is up: a
    // cut before it would leave no standby attached in sync, and nothing to wait for.
    let listed_online = std::time::Instant::now();
    while !leasehold_testkit::redis_server::info(promoted.port(), "replication")
        .lines()
        .any(|line| line.starts_with("slave") && line.contains("state=online"))
    {
        assert!(
            listed_online.elapsed() < Duration::from_secs(30),
            "the new primary never listed its follower in sync"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    link.cut();
    let b = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
    let deadline = tokio::time::Instant::now() + FAILOVER_LEASE * 3;
    while tokio::time::Instant::now() < deadline {
        // b writes the record first; c, started later, finds it written and waits all the same.
        let c = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
        for (driver, who) in [(&b, "b"), (&c, "c")] {
            if let Ok(leasehold_lease::Acquire::Acquired(lease)) =
                driver.try_acquire("epoch", who, FAILOVER_LEASE).await
            {
                panic!(
                    "granted {lease:?} in a new epoch whose record the attached standby may lack"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    link.restore();
    // Granted once the standby has the record and the new epoch's wait is over.
    let deadline = tokio::time::Instant::now() + FAILOVER_LEASE * 4;
    let held = loop {
        match b.try_acquire("epoch", "b", FAILOVER_LEASE).await {
            Ok(leasehold_lease::Acquire::Acquired(lease)) => break lease,
            other => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no grant once the standby caught up: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert!(held.token > first.token);
    drop(promoted);
}

/// Drivers that find a lock's counter below the epoch's floor raise it to the floor one at a
/// time, each while its claim is held. Raises made at once added up and put the counter as far
/// above the floor as it was below: ahead of the clock, from which the next epoch's floor comes,
/// so that tokens went back after the next failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drivers_raising_a_counter_to_the_floor_at_once_do_not_add_up() {
    const FLOOR: i64 = 1_000_000_000_000;
    const DRIVERS: usize = 8;
    let server = RedisServer::start_tair();
    // The record of another incarnation of this durable, never promoted server: the drivers
    // keep its floor, far above the counters.
    let floor = FLOOR.to_string();
    server_command(
        &server,
        &[
            "HSET",
            "leasehold:epoch:tair",
            "replid",
            "elsewhere",
            "since",
            "0",
            "floor",
            &floor,
            "durable",
            "elsewhere 1",
        ],
    );
    let url = BackendUrl::parse(&server.url()).unwrap();
    let mut drivers = Vec::new();
    for _ in 0..DRIVERS {
        drivers.push(std::sync::Arc::new(connect(&url).await.unwrap()));
    }
    for round in 0..20 {
        let lock = format!("raised-{round}");
        let takers: Vec<_> = drivers
            .iter()
            .enumerate()
            .map(|(i, driver)| {
                let (driver, lock) = (driver.clone(), lock.clone());
                tokio::spawn(async move {
                    // Each takes the lock once, and gives it back at once.
                    loop {
                        match driver
                            .try_acquire(&lock, &format!("d{i}"), Duration::from_secs(30))
                            .await
                            .unwrap()
                        {
                            leasehold_lease::Acquire::Acquired(lease) => {
                                assert!(driver.release(&lease).await.unwrap());
                                return lease.token;
                            }
                            _ => tokio::time::sleep(Duration::from_millis(1)).await,
                        }
                    }
                })
            })
            .collect();
        for taker in takers {
            let token = taker.await.unwrap();
            let above = token as i64 - FLOOR;
            assert!(
                (1..=1_000).contains(&above),
                "{lock}: token {token} is {above} above the floor: raises added up"
            );
        }
    }
}
