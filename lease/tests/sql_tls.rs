//! TLS to PostgreSQL: a plain-text client refused by a server that takes TLS only, a server
//! certificate from another CA refused by `verify-full`, a missing client certificate refused by
//! the server; and PEM text given inline (a Secret's) used through in-memory files, since the
//! sidecar's root filesystem is read-only.

use std::time::Duration;

use leasehold_lease::{Acquire, BackendUrl, connect};
use leasehold_testkit::{PostgresServer, write_test_certificates};

async fn outcome(url: &str) -> Result<Acquire, leasehold_lease::Error> {
    let driver = connect(&BackendUrl::parse(url).unwrap())
        .await
        .expect("the pool connects lazily");
    driver
        .try_acquire("tls", "pod-a", Duration::from_secs(5))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_refusals_and_inline_pem() {
    let server = PostgresServer::start_tls();
    let files = server.tls_files();
    let base = format!("postgres://postgres@127.0.0.1:{}/postgres", server.port());

    let plain = outcome(&format!("{base}?sslmode=disable"))
        .await
        .unwrap_err();
    assert!(plain.to_string().contains("no encryption"), "{plain}");

    let elsewhere = tempfile::tempdir().unwrap();
    write_test_certificates(elsewhere.path());
    let wrong_ca = outcome(&format!(
        "{base}?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        elsewhere.path().join("ca.crt").display(),
        files.client_cert.display(),
        files.client_key.display()
    ))
    .await
    .unwrap_err();
    assert!(
        leasehold_lease::tls::explain(&wrong_ca.to_string())
            .is_some_and(|cause| cause.contains("not signed by the CA given")),
        "{wrong_ca}"
    );

    let no_client = outcome(&format!(
        "{base}?sslmode=verify-full&sslrootcert={}",
        files.ca.display()
    ))
    .await
    .unwrap_err();
    assert!(no_client.to_string().contains("certificate"), "{no_client}");

    // The same settings as PEM text in the URL, as a DistributedLock's Secret gives them: the
    // key as `openssl pkcs12 -nodes` exports it, with attributes before its PEM header.
    let encoded =
        |text: &str| url::form_urlencoded::byte_serialize(text.as_bytes()).collect::<String>();
    let pem = |path: &std::path::Path| encoded(&std::fs::read_to_string(path).unwrap());
    let key = std::fs::read_to_string(&files.client_key).unwrap();
    let key = format!("Bag Attributes\n    localKeyID: 01 02 03\n{key}");
    let inline = format!(
        "{base}?sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        pem(&files.ca),
        pem(&files.client_cert),
        encoded(&key)
    );
    let shown = BackendUrl::parse(&inline).unwrap().to_string();
    assert!(
        !shown.contains("BEGIN") && !shown.contains("Bag") && shown.contains("sslkey=inline-pem"),
        "PEM text in the log line: {shown}"
    );
    assert!(matches!(
        outcome(&inline).await.unwrap(),
        Acquire::Acquired(_)
    ));
}

/// `verify-ca` checks the chain without the host name; the database driver builds that verifier
/// from the process's TLS provider, which the driver installs (ring) before it connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_verify_ca_takes_the_lock() {
    let server = PostgresServer::start_tls();
    let files = server.tls_files();
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=verify-ca&sslrootcert={}&sslcert={}&sslkey={}",
        server.port(),
        files.ca.display(),
        files.client_cert.display(),
        files.client_key.display()
    );
    assert!(matches!(outcome(&url).await.unwrap(), Acquire::Acquired(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_over_tls_refusals() {
    let server = leasehold_testkit::MariaDbServer::start_tls();
    let base = format!(
        "mysql://root@127.0.0.1:{}/{}",
        server.port(),
        leasehold_testkit::mariadb_server::DATABASE
    );
    // MariaDB turns a plain-text client away (10.11 says "Access denied" for it).
    let plain = outcome(&format!("{base}?ssl-mode=DISABLED")).await;
    assert!(plain.is_err(), "a plain-text client was let in: {plain:?}");
    let elsewhere = tempfile::tempdir().unwrap();
    write_test_certificates(elsewhere.path());
    let wrong_ca = outcome(&format!(
        "{base}?ssl-mode=VERIFY_IDENTITY&ssl-ca={}",
        elsewhere.path().join("ca.crt").display()
    ))
    .await
    .unwrap_err();
    assert!(
        leasehold_lease::tls::explain(&wrong_ca.to_string())
            .is_some_and(|cause| cause.contains("not signed by the CA given")),
        "{wrong_ca}"
    );
    assert!(matches!(
        outcome(&server.url()).await.unwrap(),
        Acquire::Acquired(_)
    ));
}
