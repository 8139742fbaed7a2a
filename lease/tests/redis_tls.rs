//! TLS to Redis, the refusals: a server whose certificate another CA signed, a server that asks
//! for a client certificate the client does not have, and a plain-text server behind a
//! `rediss://` URL. Each is an error that says which, from the driver's calls, never a panic or
//! a start-up failure (the sidecar's readiness and `/lock` carry it).

use std::time::Duration;

use leasehold_lease::{BackendUrl, Error, connect};
use leasehold_testkit::{RedisServer, write_test_certificates};

async fn first_error(url: &str) -> String {
    let driver = connect(&BackendUrl::parse(url).unwrap())
        .await
        .expect("a TLS driver connects lazily, like the others");
    match driver
        .try_acquire("tls-refusal", "pod-a", Duration::from_secs(5))
        .await
    {
        Err(Error::Unreachable(message)) => message,
        other => panic!("expected the server to be unreachable over TLS, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tls_failure_says_which_it_is() {
    let server = RedisServer::start_tls();
    let port = server.tls_port().unwrap();
    let files = server.tls_files();
    let elsewhere = tempfile::tempdir().unwrap();
    write_test_certificates(elsewhere.path());

    let wrong_ca = first_error(&format!(
        "rediss://127.0.0.1:{port}?ca={}&cert={}&key={}",
        elsewhere.path().join("ca.crt").display(),
        files.client_cert.display(),
        files.client_key.display()
    ))
    .await;
    assert!(
        wrong_ca.contains("not signed by the CA given"),
        "{wrong_ca}"
    );

    // Under TLS 1.3 the server's "certificate required" alert may reach the client only as a
    // reset or a closed connection, whichever it reads first: it is an error either way, and
    // never mistaken for another cause.
    let no_client_certificate = first_error(&format!(
        "rediss://127.0.0.1:{port}?ca={}",
        files.ca.display()
    ))
    .await;
    assert!(
        leasehold_lease::tls::explain(&no_client_certificate)
            .is_none_or(|cause| cause.contains("asks for a client certificate")),
        "{no_client_certificate}"
    );

    let plain_text = first_error(&format!(
        "rediss://127.0.0.1:{}?ca={}",
        server.port(),
        files.ca.display()
    ))
    .await;
    // A plain-text Redis either answers the ClientHello with an error line (not TLS) or waits
    // for the end of a command line that never comes: both are told as such.
    assert!(
        plain_text.contains("does not speak TLS")
            || plain_text.contains("a plain-text server behind a TLS URL"),
        "{plain_text}"
    );

    // And the right settings work, on the same server.
    let driver = connect(&BackendUrl::parse(&server.url()).unwrap())
        .await
        .unwrap();
    assert!(matches!(
        driver
            .try_acquire("tls-refusal", "pod-a", Duration::from_secs(5))
            .await
            .unwrap(),
        leasehold_lease::Acquire::Acquired(_)
    ));
}

#[test]
fn tls_options_belong_to_tls_schemes() {
    let refused = BackendUrl::parse("redis://r:6379?ca=/ca.crt")
        .unwrap_err()
        .to_string();
    assert!(refused.contains("use rediss://"), "{refused}");
    let half = BackendUrl::parse("rediss://r:6379?cert=/c.crt")
        .unwrap_err()
        .to_string();
    assert!(half.contains("cert and key go together"), "{half}");
    let shown = BackendUrl::parse("rediss://u:secret@r:6379/2?ca=/tls/ca.crt&prefix=team")
        .unwrap()
        .to_string();
    assert!(
        shown.starts_with("rediss://u:***@r:6379/2") && shown.contains("ca /tls/ca.crt"),
        "{shown}"
    );
    let redlock = BackendUrl::parse("redlocks://a:1,b:1,c:1?ca=/tls/ca.crt").unwrap();
    let BackendUrl::Redlock(leasehold_lease::RedlockConfig { masters, tls, .. }) = redlock else {
        panic!()
    };
    assert!(masters.iter().all(|m| m.scheme() == "rediss"));
    assert!(tls.is_some_and(|t| t.ca.is_some()));
}

/// Redlock over TLS: three masters trusted through one CA, each asking for the client's
/// certificate; the lock is taken, renewed and released on a majority, with tokens rising.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_over_tls() {
    let first = RedisServer::start_tls();
    let masters = [
        RedisServer::start_tls_like(&first),
        RedisServer::start_tls_like(&first),
    ];
    let files = first.tls_files();
    let hosts: Vec<String> = std::iter::once(&first)
        .chain(&masters)
        .map(|m| format!("127.0.0.1:{}", m.tls_port().unwrap()))
        .collect();
    let url = format!(
        "redlocks://{}?ca={}&cert={}&key={}",
        hosts.join(","),
        files.ca.display(),
        files.client_cert.display(),
        files.client_key.display()
    );
    let driver = connect(&BackendUrl::parse(&url).unwrap()).await.unwrap();
    let mut last = 0;
    for round in 0..3 {
        let leasehold_lease::Acquire::Acquired(lease) = driver
            .try_acquire(
                "redlock-tls",
                &format!("pod-{round}"),
                Duration::from_secs(5),
            )
            .await
            .unwrap()
        else {
            panic!("round {round}: the free lock was not acquired")
        };
        assert!(
            lease.token > last,
            "round {round}: {} after {last}",
            lease.token
        );
        last = lease.token;
        assert!(driver.renew(&lease, Duration::from_secs(5)).await.unwrap());
        assert!(driver.release(&lease).await.unwrap());
    }
}
