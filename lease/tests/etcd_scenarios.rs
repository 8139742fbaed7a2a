//! etcd's fair queue: a release wakes exactly one waiter, and hand-overs follow the queue; and
//! a connection the members fall silent on is replaced.

use leasehold_lease::etcd::{EtcdConfig, EtcdDriver};
use leasehold_testkit::conformance::{
    an_unknown_place_of_its_own_is_cleared, contenders,
    holder_renews_after_its_connections_fall_silent, one_release_wakes_exactly_one_waiter,
    waiters_further_back_poll_quietly,
};
use leasehold_testkit::{EtcdHarness, EtcdServer};

fn driver(server: &EtcdServer) -> EtcdDriver {
    driver_at(server.port())
}

/// A driver of etcd at `port` (a server's, or a fault proxy's before it).
fn driver_at(port: u16) -> EtcdDriver {
    EtcdDriver::connect(EtcdConfig {
        endpoints: vec![format!("127.0.0.1:{port}")],
        prefix: "leasehold".into(),
        user: None,
        tls: None,
    })
    .expect("driver")
}

/// A client of the test's own, to change keys behind the driver's back.
async fn raw_client(server: &EtcdServer) -> leasehold_lease::drivers::queue::etcd_rpc::EtcdClient {
    use leasehold_lease::drivers::queue::etcd_rpc::{Connect, EtcdClient};
    use std::time::Duration;
    EtcdClient::connect(Connect {
        endpoints: &[format!("127.0.0.1:{}", server.port())],
        tls: None,
        user: None,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
    })
    .await
    .expect("raw client")
}

/// A release not done at once (etcd down, or the call given up while etcd was silent) is done
/// once etcd answers again: within `bound`, `let-go`'s key leaves the queue while `kept`'s
/// stays (renewed meanwhile: it keeps the process's etcd lease alive, with which a key left
/// behind would stand), and another driver then takes `let-go` at once.
async fn the_released_key_goes(
    server: &EtcdServer,
    holder: &EtcdDriver,
    kept: &leasehold_lease::Lease,
    ttl: std::time::Duration,
    bound: std::time::Duration,
) {
    use leasehold_lease::drivers::queue::etcd_rpc::RangeRequest;
    use leasehold_lease::{Acquire, Driver};
    let raw = raw_client(server).await;
    let started = tokio::time::Instant::now();
    loop {
        let keys: Vec<String> = raw
            .range(RangeRequest::prefix("leasehold/"))
            .await
            .map(|r| {
                r.kvs
                    .iter()
                    .map(|kv| String::from_utf8_lossy(&kv.key).into_owned())
                    .collect()
            })
            .unwrap_or_default();
        if keys.iter().all(|k| !k.starts_with("leasehold/let-go/")) {
            assert!(
                keys.iter().any(|k| k.starts_with("leasehold/kept/")),
                "the kept lock's key went too: {keys:?}"
            );
            break;
        }
        let _ = holder.renew(kept, ttl).await;
        assert!(
            started.elapsed() < bound,
            "the released key is still queued, held for nobody: {keys:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let other = driver(server);
    assert!(matches!(
        other.try_acquire("let-go", "b", ttl).await.unwrap(),
        Acquire::Acquired(_)
    ));
    assert!(holder.renew(kept, ttl).await.unwrap(), "the kept lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_release_wakes_exactly_one_of_fifty_waiters() {
    let server = EtcdServer::start();
    one_release_wakes_exactly_one_waiter(|| driver(&server)).await;
}

/// Of three in the queue, the one at the back polls without costing etcd a message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_further_back_cost_no_requests() {
    let server = EtcdServer::start();
    waiters_further_back_poll_quietly(|| driver(&server), || server.messages_received()).await;
}

/// A free lock costs etcd two requests to take (one transaction that puts the key and reads the
/// queue around it, and the keep-alive that shows the lease still there before the claim) and
/// one to give back (the key's delete), after the process's first acquisition, which also grants
/// the process's etcd lease. It took four before the put and the queue read were one
/// transaction, and three while each key had an etcd lease of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_lock_costs_two_requests_to_take_and_one_to_release() {
    use leasehold_lease::{Acquire, Driver};
    let server = EtcdServer::start();
    let driver = driver(&server);
    driver.ping().await.expect("etcd answers");
    for round in 0..3 {
        let before = server.messages_received();
        let Acquire::Acquired(lease) = driver
            // The process's etcd lease is kept alive every half of it: a minute keeps its
            // keep-alives out of the three rounds' counts on a slow machine.
            .try_acquire("free", "a", std::time::Duration::from_secs(60))
            .await
            .expect("acquire")
        else {
            panic!("round {round}: the lock is not free");
        };
        let taken = server.messages_received() - before;
        assert!(driver.release(&lease).await.expect("release"));
        let released = server.messages_received() - before - taken;
        let grant = u64::from(round == 0);
        assert_eq!(
            (taken, released),
            (2 + grant, 1),
            "round {round}: requests to take, to release"
        );
    }
}

/// Each keep-alive and each watch opens a gRPC stream, and ends it once answered or given up.
/// Dropping the answers alone left the stream open at both ends: one more per renewal, without
/// end (54 open streams after 50 s of a 3 s lease, each about 9 KB in the sidecar).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_and_watches_leave_no_stream_open() {
    use leasehold_lease::{Acquire, Driver};
    use std::time::Duration;
    let server = EtcdServer::start();
    let (holder, waiter) = (driver(&server), driver(&server));
    let ttl = Duration::from_secs(10);
    let Acquire::Acquired(lease) = holder
        .try_acquire("streams", "a", ttl)
        .await
        .expect("acquire")
    else {
        panic!("the lock is free");
    };
    for _ in 0..20 {
        assert!(holder.renew(&lease, ttl).await.expect("renew"));
    }
    // A waiter watches the holder's key until the release wakes it.
    assert!(matches!(
        waiter.try_acquire("streams", "b", ttl).await.expect("wait"),
        Acquire::Busy(_)
    ));
    let mut changes = waiter.changes("streams").expect("etcd wakes its waiters");
    assert!(holder.release(&lease).await.expect("release"));
    tokio::time::timeout(Duration::from_secs(10), changes.changed())
        .await
        .expect("the release wakes the waiter")
        .expect("feed open");
    let Acquire::Acquired(next) = waiter.try_acquire("streams", "b", ttl).await.expect("take")
    else {
        panic!("released: the waiter is next");
    };
    assert!(waiter.release(&next).await.expect("release"));
    // The server ends a stream shortly after its client closes it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let open = loop {
        let open = (
            server.open_streams("LeaseKeepAlive"),
            server.open_streams("Watch"),
        );
        if open == (0, 0) || tokio::time::Instant::now() > deadline {
            break open;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(open, (0, 0), "keep-alive and watch streams left open");
}

/// Twenty contenders, two hundred hand-overs. The token is the create revision of a contender's
/// key, the order it joined the
/// queue in, so strictly increasing tokens (checked by `contenders`) mean the lock went round
/// in FIFO order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_contenders_two_hundred_handovers_in_fifo_order() {
    contenders(&mut EtcdHarness::new(), 20, 10).await;
}

/// A TLS member refuses a client with no certificate (under TLS 1.3 the client may learn no
/// more than that the transport failed), a client refuses a member whose certificate its CA did not
/// sign and says so, and a CA file that cannot be read is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_refusals_say_why() {
    let server = EtcdServer::start_tls();
    let files = server.tls_files();
    let attempt = |url: String| async move {
        let url = leasehold_lease::BackendUrl::parse(&url).expect("url");
        let driver = leasehold_lease::connect(&url).await.expect("driver");
        driver
            .try_acquire("tls", "me", std::time::Duration::from_secs(5))
            .await
    };

    let no_certificate = format!(
        "etcds://127.0.0.1:{}?ca={}",
        server.port(),
        files.ca.display()
    );
    let e = attempt(no_certificate)
        .await
        .expect_err("no client certificate");
    // The member's refusal reaches the client as its alert (BadCertificate), the connection
    // closing, or a broken pipe, depending on when the client writes and reads after its
    // handshake: the error text cannot promise more than a transport failure.
    assert!(
        e.to_string().contains("transport") || e.to_string().contains("connection"),
        "{e}"
    );

    let stranger = EtcdServer::start_tls();
    let wrong_ca = format!(
        "etcds://127.0.0.1:{}?ca={}&cert={}&key={}",
        server.port(),
        stranger.tls_files().ca.display(),
        files.client_cert.display(),
        files.client_key.display()
    );
    let e = attempt(wrong_ca).await.expect_err("a stranger's CA");
    assert!(e.to_string().contains("invalid peer certificate"), "{e}");

    let missing = format!("etcds://127.0.0.1:{}?ca=/nonexistent/ca.crt", server.port());
    let e = attempt(missing).await.expect_err("no CA file");
    assert!(e.to_string().contains("/nonexistent/ca.crt"), "{e}");

    // And the right files work.
    assert!(matches!(
        attempt(server.url()).await.expect("over TLS"),
        leasehold_lease::Acquire::Acquired(_)
    ));
}

/// The lock's keys deleted behind the drivers' backs (`etcdctl del --prefix`), while the holder's
/// etcd lease lives on: the next contender acquires, and the old holder's next renew must fail
/// rather than keep both claiming with different tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_key_was_deleted_stops_claiming() {
    use leasehold_lease::drivers::queue::etcd_rpc::DeleteRangeRequest;
    use leasehold_lease::{Acquire, Driver};
    use std::time::Duration;

    let server = EtcdServer::start();
    let (a, b) = (driver(&server), driver(&server));
    let lease = Duration::from_secs(5);
    let Acquire::Acquired(la) = a.try_acquire("deleted", "a", lease).await.unwrap() else {
        panic!("a did not acquire")
    };
    let raw = raw_client(&server).await;
    // `leasehold/` up to `leasehold0`: every key of every lock, as `etcdctl del --prefix`.
    raw.delete_range(DeleteRangeRequest {
        key: b"leasehold/".to_vec(),
        range_end: b"leasehold0".to_vec(),
        prev_kv: false,
    })
    .await
    .expect("range delete");
    let Acquire::Acquired(lb) = b.try_acquire("deleted", "b", lease).await.unwrap() else {
        panic!("b did not acquire the emptied lock")
    };
    assert!(lb.token > la.token);
    assert!(
        !a.renew(&la, lease).await.unwrap(),
        "a kept renewing after its key was deleted: two holders"
    );
    assert!(b.renew(&lb, lease).await.unwrap(), "b is the one holder");
}

/// Renewals that arrive together check their keys in one transaction beside one keep-alive of
/// the process's etcd lease, and each is answered for its own key: forty renewals, every fourth
/// of whose keys was deleted behind the driver's back, cost etcd a transaction and a keep-alive
/// per batch and a delete per deleted key, where each renewal sent a transaction and a
/// keep-alive of its own (90 messages with the revokes), and then a keep-alive each (50).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_at_once_check_their_keys_in_one_transaction() {
    use leasehold_lease::drivers::queue::etcd_rpc::DeleteRangeRequest;
    use leasehold_lease::{Acquire, Driver};
    use std::time::Duration;

    const LOCKS: usize = 40;
    let server = EtcdServer::start();
    let holder = driver(&server);
    let ttl = Duration::from_secs(10);
    let mut leases = Vec::new();
    for i in 0..LOCKS {
        let Acquire::Acquired(lease) = holder
            .try_acquire(&format!("k{i}"), "a", ttl)
            .await
            .unwrap()
        else {
            panic!("k{i} is free");
        };
        leases.push(lease);
    }
    let raw = raw_client(&server).await;
    for i in (0..LOCKS).step_by(4) {
        // `leasehold/kI/` up to `leasehold/kI0`: the lock's keys only.
        raw.delete_range(DeleteRangeRequest {
            key: format!("leasehold/k{i}/").into_bytes(),
            range_end: format!("leasehold/k{i}0").into_bytes(),
            prev_kv: false,
        })
        .await
        .expect("delete");
    }
    let before = server.messages_received();
    let renewed =
        futures_util::future::join_all(leases.iter().map(|lease| holder.renew(lease, ttl))).await;
    let sent = server.messages_received() - before;
    for (i, renewed) in renewed.into_iter().enumerate() {
        assert_eq!(
            renewed.expect("renew"),
            i % 4 != 0,
            "k{i}: renewed only where its key is still there"
        );
    }
    let deleted = LOCKS.div_ceil(4) as u64;
    // Three batches at most, on a loaded machine, and a keeper's keep-alive.
    assert!(
        sent <= deleted + 2 * 3 + 1,
        "{sent} messages for {LOCKS} renewals ({deleted} of deleted keys)"
    );
}

/// Every key a process queues, of every lock, is bound to one etcd lease (per lease length):
/// the keys of a sidecar holding many keyed locks are kept alive together. A released key goes
/// by its own delete, and the lease, with the process's other keys, lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processs_keys_share_one_etcd_lease() {
    use leasehold_lease::drivers::queue::etcd_rpc::RangeRequest;
    use leasehold_lease::{Acquire, Driver};
    use std::time::Duration;

    let server = EtcdServer::start();
    let (holder, waiter) = (driver(&server), driver(&server));
    let ttl = Duration::from_secs(10);
    let mut leases = Vec::new();
    for i in 0..10 {
        let Acquire::Acquired(lease) = holder
            .try_acquire(&format!("orders.keys.o-{i}"), "a", ttl)
            .await
            .unwrap()
        else {
            panic!("o-{i} is free");
        };
        leases.push(lease);
    }
    // A waiter in another process, queued behind one of them.
    assert!(matches!(
        waiter
            .try_acquire("orders.keys.o-0", "b", ttl)
            .await
            .unwrap(),
        Acquire::Busy(Some(_))
    ));
    let raw = raw_client(&server).await;
    let keys = async || {
        raw.range(RangeRequest::prefix("leasehold/"))
            .await
            .expect("range")
            .kvs
    };
    let all = keys().await;
    assert_eq!(all.len(), 11, "ten holders' keys and a waiter's");
    let holders_lease = all
        .iter()
        .find(|kv| kv.value == b"a")
        .map(|kv| kv.lease)
        .unwrap();
    for kv in &all {
        let mine = kv.value == b"a";
        assert_eq!(
            kv.lease == holders_lease,
            mine,
            "{}: bound to {:x}, the holder's lease is {holders_lease:x}",
            String::from_utf8_lossy(&kv.key),
            kv.lease
        );
    }
    assert!(holder.release(&leases[5]).await.unwrap());
    let left = keys().await;
    assert_eq!(left.len(), 10, "the released key went");
    for lease in leases.iter().filter(|l| l.lock != leases[5].lock) {
        assert!(holder.renew(lease, ttl).await.unwrap(), "{}", lease.lock);
    }
}

/// A release etcd does not answer (etcd is down) is done once etcd answers again: the key does
/// not stand in the queue for as long as the process's lease lives, which its other keys keep
/// alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_etcd_missed_is_done_once_it_answers() {
    use leasehold_lease::{Acquire, Driver};
    use std::time::Duration;

    let mut server = EtcdServer::start();
    let holder = driver(&server);
    // Long enough for the kill, the restart and the keeper's next round (half a lease apart)
    // inside one lease.
    let ttl = Duration::from_secs(20);
    let take = async |lock: &str| match holder.try_acquire(lock, "a", ttl).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        busy => panic!("{lock}: {busy:?}"),
    };
    let (kept, let_go) = (take("kept").await, take("let-go").await);
    tokio::task::block_in_place(|| server.kill());
    assert!(
        holder.release(&let_go).await.is_err(),
        "a release etcd never saw reported done"
    );
    tokio::task::block_in_place(|| server.restart());
    // Freed for others before the lease would have run out.
    the_released_key_goes(&server, &holder, &kept, ttl, ttl).await;
}

/// A release whose caller stops waiting (the engine bounds its let-go to a fraction of a second)
/// while etcd does not answer still deletes the key once etcd answers again; the process's
/// other keys keep its etcd lease alive, so a key left behind would be first in the queue, held
/// for nobody, until the process ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_given_up_while_etcd_is_silent_is_done_once_it_answers() {
    use leasehold_lease::{Acquire, Driver};
    use leasehold_testkit::FaultProxy;
    use std::time::Duration;

    let server = EtcdServer::start();
    let proxy = FaultProxy::start(server.port());
    let holder = driver_at(proxy.port);
    let ttl = Duration::from_secs(10);
    let take = async |lock: &str| match holder.try_acquire(lock, "a", ttl).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        busy => panic!("{lock}: {busy:?}"),
    };
    let (kept, let_go) = (take("kept").await, take("let-go").await);
    proxy.cut();
    assert!(
        tokio::time::timeout(Duration::from_millis(600), holder.release(&let_go))
            .await
            .is_err(),
        "a release through a cut link answered"
    );
    proxy.restore();
    the_released_key_goes(&server, &holder, &kept, ttl, ttl * 2).await;
}

/// An acquisition dropped while its key is being put (the engine's time budget, a client that
/// hung up), its wait then abandoned: the key leaves the queue as soon as it is put, rather than
/// stand first in line, asked by nobody, for four leases. And an acquisition by the same
/// identity meanwhile waits for that put rather than put a second key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_dropped_while_its_key_is_put_leaves_no_key_behind() {
    use futures_util::FutureExt;
    use leasehold_lease::drivers::queue::etcd_rpc::RangeRequest;
    use leasehold_lease::{Acquire, Driver};
    use leasehold_testkit::conformance::a_place_put_for_a_dropped_acquisition_leaves_the_line;
    use std::time::Duration;

    let server = EtcdServer::start();
    let ttl = Duration::from_secs(10);
    let raw = raw_client(&server).await;
    let keys = async |lock: &str| {
        raw.range(RangeRequest::prefix(&format!("leasehold/{lock}/")))
            .await
            .unwrap()
            .kvs
            .len()
    };

    // A first acquisition opens the session (an etcd lease) and puts the key: round trips.
    a_place_put_for_a_dropped_acquisition_leaves_the_line(
        &driver(&server),
        &driver(&server),
        "dropped",
        ttl,
    )
    .await;

    let retried = driver(&server);
    assert!(
        retried
            .try_acquire("retried", "a", ttl)
            .now_or_never()
            .is_none()
    );
    match retried.try_acquire("retried", "a", ttl).await.unwrap() {
        Acquire::Acquired(_) => {}
        refused => panic!("the retry is refused: {refused:?}"),
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(keys("retried").await, 1, "one identity put two keys");
}

/// etcd counts leases in whole seconds: a 1.5 s lease is a 2 s etcd lease, which a crashed
/// holder keeps; the lock says so rather than promise a takeover within 1.5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_longer_than_the_lease_is_reported() {
    let server = EtcdServer::start();
    leasehold_testkit::conformance::an_enforced_lease_longer_than_configured_is_reported(
        std::sync::Arc::new(driver(&server)),
        std::time::Duration::from_millis(1500),
        "2s",
    )
    .await;
}

/// A key under the driver's own session that the driver does not know of (a put answered too
/// late to be waited for, landing after the delete that gave it up) is cleared once first in
/// line ([`an_unknown_place_of_its_own_is_cleared`]).
async fn an_unknown_key_is_cleared(owner_waits: bool) {
    let server = EtcdServer::start();
    an_unknown_place_of_its_own_is_cleared(|| driver(&server), owner_waits).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_key_of_the_drivers_own_session_is_cleared_by_its_next_attempt() {
    an_unknown_key_is_cleared(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_key_of_an_idle_drivers_session_is_cleared_when_it_observes() {
    an_unknown_key_is_cleared(false).await;
}

/// A put whose answer never came may land after the delete that gave it up (etcd may apply a
/// proposal it has answered with a timeout, once a leader commits it). Its key, under the
/// session the process's other keys keep alive, would stand first in line for nobody until the
/// process touched that lock again: the driver deletes the name again at its keeper's rounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_that_lands_after_its_clean_up_is_deleted_again() {
    use leasehold_lease::drivers::queue::etcd_rpc::{PutRequest, RangeRequest};
    use leasehold_lease::{Acquire, Driver};
    use leasehold_testkit::FaultProxy;
    use std::time::{Duration, Instant};

    let server = EtcdServer::start();
    let proxy = FaultProxy::start(server.port());
    let holder = driver_at(proxy.port);
    let ttl = Duration::from_secs(4);
    let kept = match holder.try_acquire("kept", "a", ttl).await.unwrap() {
        Acquire::Acquired(lease) => lease,
        busy => panic!("kept: {busy:?}"),
    };
    // The server behind the address goes away (a listener that closes every connection it
    // accepts takes its place): the put and its clean-up delete both fail.
    let closing = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closing_port = closing.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for connection in closing.incoming() {
            drop(connection);
        }
    });
    proxy.redirect(closing_port);
    assert!(
        holder.try_acquire("late", "a", ttl).await.is_err(),
        "an acquisition with no server behind the address answered"
    );
    proxy.redirect(server.port());
    let renew_kept = async || {
        let deadline = Instant::now() + ttl / 2;
        while !matches!(holder.renew(&kept, ttl).await, Ok(true)) {
            assert!(Instant::now() < deadline, "kept was not renewed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    // Two keeper rounds (half a TTL apart) pass, with their retries of the failed delete.
    for _ in 0..5 {
        renew_kept().await;
        tokio::time::sleep(ttl / 4).await;
    }

    // The put lands now: the name the driver gave it (its session's id and the second number it
    // drew, after `kept`'s) under that session.
    let raw = raw_client(&server).await;
    let kept_key = raw
        .range(RangeRequest::prefix("leasehold/kept/"))
        .await
        .unwrap()
        .kvs
        .into_iter()
        .next()
        .expect("kept's key");
    let kept_name = String::from_utf8(kept_key.key).unwrap();
    let session = kept_name
        .strip_prefix("leasehold/kept/")
        .and_then(|rest| rest.strip_suffix("-0"))
        .unwrap_or_else(|| panic!("kept's key is not SESSION-0: {kept_name}"));
    let late_key = format!("leasehold/late/{session}-1");
    raw.put(PutRequest {
        key: late_key.clone().into_bytes(),
        value: b"a".to_vec(),
        lease: kept_key.lease,
    })
    .await
    .unwrap();

    // Gone by the keeper's next rounds, while `kept` is renewed meanwhile.
    let landed = Instant::now();
    loop {
        let left = raw
            .range(RangeRequest::prefix("leasehold/late/"))
            .await
            .unwrap()
            .kvs
            .len();
        if left == 0 {
            break;
        }
        assert!(
            landed.elapsed() < ttl * 2,
            "the late put's key {late_key} still stood first in line for nobody {:?} after it landed",
            landed.elapsed()
        );
        renew_kept().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    match driver(&server).try_acquire("late", "b", ttl).await.unwrap() {
        Acquire::Acquired(_) => {}
        busy => panic!("late is not free: {busy:?}"),
    }
}

/// A holder whose channel the member falls silent on renews on a new one within its lease
/// ([`holder_renews_after_its_connections_fall_silent`]): tonic's channel reconnects when its
/// connection is closed, not when it falls silent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_channel_falls_silent_renews_on_a_new_one() {
    let server = EtcdServer::start();
    let proxy = leasehold_testkit::FaultProxy::start(server.port());
    let driver = std::sync::Arc::new(driver_at(proxy.port));
    holder_renews_after_its_connections_fall_silent(driver, &[&proxy]).await;
}
