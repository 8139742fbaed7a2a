//! `tair://` pointed at a plain Redis: every call fails with the missing commands named (the
//! operator's provisioning reports it), and nothing panics.

use std::time::Duration;

use leasehold_lease::testkit::RedisServer;
use leasehold_lease::{BackendUrl, Error, connect};

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
    driver: &dyn leasehold_lease::Driver,
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
