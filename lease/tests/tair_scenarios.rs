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
