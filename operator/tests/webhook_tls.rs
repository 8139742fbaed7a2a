//! The webhook's HTTPS: the self-managed CA and certificate kept in a Secret by racing replicas,
//! the `caBundle` they publish, rotation without a restart, certificates from files
//! (cert-manager), and real TLS handshakes against the listener. The Kubernetes API is the
//! in-memory one; everything else is real.

use std::sync::Arc;

use leasehold_operator::lock_cache::LockCache;
use leasehold_operator::webhook::Injection;
use leasehold_operator::webhook_certs::{CA_VALIDITY, Renewal, SERVING_VALIDITY};
use leasehold_operator::webhook_server;
use leasehold_operator::webhook_tls::{self, SelfManaged, ServingCert};
use leasehold_testkit::InMemoryApiServer;
use leasehold_testkit::in_memory_api_server::{
    DISTRIBUTED_LOCKS, MUTATING_WEBHOOK_CONFIGURATIONS, SECRETS,
};
use serde_json::{Value, json};
use support::{chart_webhook_configuration, der_of, from_base64, post};
use time::{Duration, OffsetDateTime};

mod support;

const NS: &str = "leasehold-system";
const SERVICE: &str = "leasehold-webhook";

fn settings() -> SelfManaged {
    SelfManaged {
        namespace: NS.into(),
        secret: "leasehold-webhook-tls".into(),
        service: SERVICE.into(),
        webhook_configuration: "leasehold".into(),
    }
}

/// The chart's configuration, with an unrelated webhook beside ours that must stay untouched;
/// the annotated pods' ServiceAccount may read their locks.
fn api_with_configuration() -> InMemoryApiServer {
    let api = InMemoryApiServer::new();
    support::grant_default_account_locks(&api, "team");
    api.put(
        MUTATING_WEBHOOK_CONFIGURATIONS,
        chart_webhook_configuration(&[json!(
            {"name": "other.example.com",
             "clientConfig": {"service": {"name": "other", "namespace": "elsewhere"},
                              "caBundle": "b3RoZXI="},
             "sideEffects": "None", "admissionReviewVersions": ["v1"]}
        )]),
    );
    api
}

fn secret_text(api: &InMemoryApiServer, key: &str) -> String {
    let secret = api
        .object(SECRETS, NS, "leasehold-webhook-tls")
        .expect("the Secret");
    let encoded = secret["data"][key].as_str().expect(key);
    from_base64(encoded)
}

fn configuration(api: &InMemoryApiServer) -> Value {
    api.object(MUTATING_WEBHOOK_CONFIGURATIONS, "", "leasehold")
        .unwrap()
}

fn published_ca(api: &InMemoryApiServer) -> String {
    let encoded = configuration(api)["webhooks"][0]["clientConfig"]["caBundle"]
        .as_str()
        .expect("caBundle set")
        .to_owned();
    from_base64(&encoded)
}

fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

#[tokio::test]
async fn racing_replicas_agree_on_one_ca_and_publish_it() {
    let api = api_with_configuration();
    let (a, b) = (ServingCert::new(), ServingCert::new());
    let (client_a, client_b) = (
        support::operator_client(&api),
        support::operator_client(&api),
    );
    let (t, settings) = (now(), settings());
    let (first_a, first_b) = tokio::join!(
        webhook_tls::pass(&client_a, &settings, &a, t),
        webhook_tls::pass(&client_b, &settings, &b, t),
    );
    // Both may have found no Secret; only one create wins, the other's next pass reads it.
    let winners = [&first_a, &first_b]
        .iter()
        .filter(|r| {
            r.as_ref()
                .is_ok_and(|p| p.renewed == Some(Renewal::Created))
        })
        .count();
    assert_eq!(winners, 1, "{first_a:?} {first_b:?}");
    for (client, serving) in [(&client_a, &a), (&client_b, &b)] {
        webhook_tls::pass(client, &settings, serving, t)
            .await
            .unwrap();
    }
    let cert = secret_text(&api, "tls.crt");
    assert_eq!(a.presented().as_deref(), Some(cert.as_str()));
    assert_eq!(b.presented().as_deref(), Some(cert.as_str()));
    let secret = api.object(SECRETS, NS, "leasehold-webhook-tls").unwrap();
    assert_eq!(secret["type"], "kubernetes.io/tls");
    assert!(secret_text(&api, "tls.key").contains("PRIVATE KEY"));
    assert!(secret_text(&api, "ca.key").contains("PRIVATE KEY"));

    assert_eq!(published_ca(&api), secret_text(&api, "ca.crt"));
    let config = configuration(&api);
    assert_eq!(
        config["webhooks"][1]["clientConfig"]["caBundle"], "b3RoZXI=",
        "another product's webhook is left alone"
    );
    assert_eq!(
        config["webhooks"][0]["futureField"]["kept"], true,
        "fields unknown to this build survive the update"
    );

    let settled = webhook_tls::pass(&client_a, &settings, &a, t)
        .await
        .unwrap();
    assert_eq!(settled, webhook_tls::Pass::default(), "nothing left to do");
}

#[tokio::test]
async fn a_blanked_ca_bundle_is_restored() {
    let api = api_with_configuration();
    let serving = ServingCert::new();
    let client = support::operator_client(&api);
    webhook_tls::pass(&client, &settings(), &serving, now())
        .await
        .unwrap();
    // `helm upgrade` re-applies the configuration without the caBundle.
    let mut blank = configuration(&api);
    blank["webhooks"][0]["clientConfig"]
        .as_object_mut()
        .unwrap()
        .remove("caBundle");
    api.put(MUTATING_WEBHOOK_CONFIGURATIONS, blank);
    let pass = webhook_tls::pass(&client, &settings(), &serving, now())
        .await
        .unwrap();
    assert_eq!(pass.ca_bundles_patched, 1);
    assert_eq!(pass.renewed, None);
    assert_eq!(published_ca(&api), secret_text(&api, "ca.crt"));
}

#[tokio::test]
async fn a_missing_configuration_is_reported_and_the_certificate_still_served() {
    let api = InMemoryApiServer::new();
    let serving = ServingCert::new();
    let pass = webhook_tls::pass(
        &support::operator_client(&api),
        &settings(),
        &serving,
        now(),
    )
    .await
    .unwrap();
    assert!(pass.configuration_missing);
    assert!(serving.presented().is_some());
}

#[tokio::test]
async fn an_unreachable_api_is_an_error_and_nothing_is_loaded() {
    let api = InMemoryApiServer::new();
    api.set_down(true);
    let serving = ServingCert::new();
    let error = webhook_tls::pass(
        &support::operator_client(&api),
        &settings(),
        &serving,
        now(),
    )
    .await
    .unwrap_err();
    assert!(matches!(error, webhook_tls::TlsError::Kube(_)), "{error}");
    assert!(serving.presented().is_none());
}

fn review_of_annotated_pod() -> String {
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "3f1c", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "team", "operation": "CREATE", "userInfo": {},
            "object": leasehold_testkit::with_service_account_token(json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "app-1", "namespace": "team",
                             "annotations": {"leasehold.dev/lock": "nightly-report"}},
                "spec": {"containers": [{"name": "app", "image": "example/app:1"}]}
            }))
        }
    })
    .to_string()
}

#[tokio::test]
async fn the_listener_serves_admission_reviews_and_picks_up_a_rotated_certificate() {
    let api = api_with_configuration();
    api.put(
        DISTRIBUTED_LOCKS,
        json!({"apiVersion": "leasehold.dev/v1alpha1", "kind": "DistributedLock",
               "metadata": {"name": "nightly-report", "namespace": "team"},
               "spec": {"backend": {"kubernetes": {}}}}),
    );
    let client = support::operator_client(&api);
    let serving = ServingCert::new();
    let t = now();
    webhook_tls::pass(&client, &settings(), &serving, t)
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = Arc::new(leasehold_operator::metrics::Metrics::new());
    let router = webhook_server::router(
        client.clone(),
        LockCache::none(),
        Injection::new("leasehold/leasehold:0.1.0", true),
        metrics.clone(),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(webhook_server::serve(
        listener,
        serving.clone(),
        router,
        async {
            let _ = stopped.await;
        },
    ));

    let ca = published_ca(&api);
    let (status, body, presented) = post(addr, &ca, t, &review_of_annotated_pod())
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["response"]["uid"], "3f1c");
    assert_eq!(answer["response"]["allowed"], true);
    assert_eq!(answer["response"]["patchType"], "JSONPatch");
    assert!(
        answer["response"]["patch"].is_string(),
        "base64 on the wire"
    );
    assert_eq!(presented, der_of(&secret_text(&api, "tls.crt")));

    let (status, body, _) = post(addr, &ca, t, "{\"kind\": 3}").await.unwrap();
    assert_eq!(status, 400);
    assert!(body.contains("not an AdmissionReview"), "{body}");

    let stranger = webhook_certs_of_another_ca();
    let refused = post(addr, &stranger, t, &review_of_annotated_pod()).await;
    assert!(
        refused.is_err(),
        "a client trusting another CA must refuse the handshake"
    );

    // Sixty-one days on, the certificate is re-issued; the running listener presents it.
    let later = t + SERVING_VALIDITY - Duration::days(29);
    let pass = webhook_tls::pass(&client, &settings(), &serving, later)
        .await
        .unwrap();
    assert_eq!(pass.renewed, Some(Renewal::CertRotated));
    assert!(pass.reloaded);
    let (status, _, presented) = post(addr, &ca, later, &review_of_annotated_pod())
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(presented, der_of(&secret_text(&api, "tls.crt")));

    // Near the CA's end a new CA joins the bundle. The old CA stays in it, so a replica that
    // has not reloaded yet is still trusted; the new certificate is trusted through the new CA.
    let late = t + CA_VALIDITY - Duration::days(60);
    let pass = webhook_tls::pass(&client, &settings(), &serving, late)
        .await
        .unwrap();
    assert_eq!(pass.renewed, Some(Renewal::CaRotated));
    assert_eq!(pass.ca_bundles_patched, 1);
    let bundle = published_ca(&api);
    assert!(bundle.ends_with(&ca), "the old CA stays trusted: {bundle}");
    assert_eq!(bundle.matches("BEGIN CERTIFICATE").count(), 2);
    let (status, _, presented) = post(addr, &bundle, late, &review_of_annotated_pod())
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert_eq!(presented, der_of(&secret_text(&api, "tls.crt")));

    let counted = metrics.render();
    assert!(
        counted.contains("leasehold_operator_admissions_total{result=\"injected\"} 3"),
        "{counted}"
    );
    assert!(
        counted.contains("leasehold_operator_admissions_total{result=\"malformed\"} 1"),
        "{counted}"
    );

    stop.send(()).unwrap();
    server.await.unwrap();
}

/// A new CA is trusted by the API server only once it has read the `caBundle` that names it, a
/// moment after it is written (and never, should the write keep failing): the listener keeps
/// presenting its certificate of the old CA, while that one is good, until the new CA has been
/// in the published bundle for a while.
#[tokio::test]
async fn a_certificate_of_a_new_ca_is_served_once_the_api_server_can_trust_it() {
    use leasehold_operator::webhook_certs::CA_RENEW_BEFORE;
    let api = api_with_configuration();
    let client = support::operator_client(&api);
    let serving = ServingCert::new();
    let t = now();
    webhook_tls::pass(&client, &settings(), &serving, t)
        .await
        .unwrap();
    // A fresh certificate of the first CA, a little before the CA is due.
    let before = t + CA_VALIDITY - CA_RENEW_BEFORE - Duration::days(5);
    let pass = webhook_tls::pass(&client, &settings(), &serving, before)
        .await
        .unwrap();
    assert_eq!(pass.renewed, Some(Renewal::CertRotated));
    let old_cert = secret_text(&api, "tls.crt");
    assert_eq!(serving.presented().as_deref(), Some(old_cert.as_str()));

    let due = t + CA_VALIDITY - CA_RENEW_BEFORE + Duration::days(1);
    let pass = webhook_tls::pass(&client, &settings(), &serving, due)
        .await
        .unwrap();
    assert_eq!(pass.renewed, Some(Renewal::CaRotated));
    assert_eq!(pass.ca_bundles_patched, 1);
    assert!(
        !pass.reloaded,
        "a certificate of a CA published just now was served"
    );
    assert_eq!(serving.presented().as_deref(), Some(old_cert.as_str()));

    let later = due + webhook_tls::NEW_CA_SETTLING + Duration::seconds(1);
    let pass = webhook_tls::pass(&client, &settings(), &serving, later)
        .await
        .unwrap();
    assert!(pass.reloaded);
    assert_eq!(
        serving.presented().as_deref(),
        Some(secret_text(&api, "tls.crt").as_str())
    );
}

/// The Secret deleted under running replicas (or spoiled): the new CA is published beside the
/// one their certificates are of, so the API server goes on trusting them until they load a
/// certificate of the new CA, once it has settled, as after a rotation; then the old CA goes.
#[tokio::test]
async fn a_secret_made_anew_keeps_the_published_ca_trusted_until_replicas_reload() {
    let api = api_with_configuration();
    let client = support::operator_client(&api);
    let (a, b) = (ServingCert::new(), ServingCert::new());
    let t = now();
    for serving in [&a, &b] {
        webhook_tls::pass(&client, &settings(), serving, t)
            .await
            .unwrap();
    }
    let old_ca = published_ca(&api);
    let old_cert = secret_text(&api, "tls.crt");
    assert!(api.remove(SECRETS, NS, "leasehold-webhook-tls"));

    let soon = t + Duration::seconds(1);
    let pass = webhook_tls::pass(&client, &settings(), &a, soon)
        .await
        .unwrap();
    assert_eq!(pass.renewed, Some(Renewal::Created));
    assert_eq!(pass.ca_bundles_patched, 1);
    let published = published_ca(&api);
    assert!(
        published.contains(old_ca.trim()),
        "the CA the replicas' certificates are of is no longer published: the API server refuses them until they reload"
    );
    assert_eq!(published, secret_text(&api, "ca.crt"));
    assert_ne!(published.trim(), old_ca.trim(), "a new CA is published too");
    for serving in [&a, &b] {
        assert_eq!(serving.presented().as_deref(), Some(old_cert.as_str()));
    }

    let later = soon + webhook_tls::NEW_CA_SETTLING + Duration::seconds(1);
    for serving in [&a, &b] {
        let pass = webhook_tls::pass(&client, &settings(), serving, later)
            .await
            .unwrap();
        assert!(pass.reloaded);
        assert_eq!(
            serving.presented().as_deref(),
            Some(secret_text(&api, "tls.crt").as_str())
        );
    }
    // Nobody holds the old CA's key any more (the Secret may have gone for a leaked one): it is
    // trusted no longer than the replicas need it.
    let done = soon + leasehold_operator::webhook_certs::ADOPTED_KEPT + Duration::seconds(1);
    let pass = webhook_tls::pass(&client, &settings(), &a, done)
        .await
        .unwrap();
    assert_eq!(pass.renewed, Some(Renewal::BundlePruned));
    let published = published_ca(&api);
    assert!(
        !published.contains(old_ca.trim()),
        "the old CA is still trusted"
    );
    assert_eq!(published, secret_text(&api, "ca.crt"));
    let secret = api.object(SECRETS, NS, "leasehold-webhook-tls").unwrap();
    assert!(secret["data"].get("ca-adopted-until").is_none(), "{secret}");
}

/// A CA nobody in these tests trusts.
fn webhook_certs_of_another_ca() -> String {
    let (bundle, _) = leasehold_operator::webhook_certs::renew(None, &["x".into()], now())
        .unwrap()
        .unwrap();
    bundle.ca_bundle
}

#[tokio::test]
async fn certificates_from_files_are_reloaded_when_they_change() {
    let dir = tempfile::tempdir().unwrap();
    let names = leasehold_operator::webhook_certs::service_dns_names(SERVICE, NS);
    let issue = || {
        leasehold_operator::webhook_certs::renew(None, &names, now())
            .unwrap()
            .unwrap()
            .0
    };
    let write = |cert: &str, key: &str| {
        std::fs::write(dir.path().join("tls.crt"), cert).unwrap();
        std::fs::write(dir.path().join("tls.key"), key).unwrap();
    };
    let serving = ServingCert::new();
    let missing = webhook_tls::load_files(dir.path(), &serving)
        .await
        .unwrap_err();
    assert!(missing.to_string().contains("tls.crt"), "{missing}");

    let first = issue();
    write(&first.cert, &first.key);
    assert!(webhook_tls::load_files(dir.path(), &serving).await.unwrap());
    assert!(
        !webhook_tls::load_files(dir.path(), &serving).await.unwrap(),
        "unchanged files are not reloaded"
    );

    // cert-manager renews: the new pair is served.
    let second = issue();
    write(&second.cert, &second.key);
    assert!(webhook_tls::load_files(dir.path(), &serving).await.unwrap());
    assert_eq!(serving.presented().as_deref(), Some(second.cert.as_str()));

    // A half-written pair (a new certificate with the old key) is refused; the last good pair
    // stays in service, and the error does not quote the key.
    let third = issue();
    write(&third.cert, &second.key);
    let mismatch = webhook_tls::load_files(dir.path(), &serving)
        .await
        .unwrap_err();
    assert!(
        mismatch.to_string().contains("does not match"),
        "{mismatch}"
    );
    assert!(!mismatch.to_string().contains("PRIVATE"), "{mismatch}");
    assert_eq!(serving.presented().as_deref(), Some(second.cert.as_str()));
}

/// The API server keeps idle connections to a webhook for 90 s and reuses them: one left idle
/// past hyper's old 10 s header timeout still answers the next review.
#[tokio::test]
async fn an_idle_kept_alive_connection_still_answers() {
    let api = api_with_configuration();
    let client = support::operator_client(&api);
    let serving = ServingCert::new();
    let t = now();
    webhook_tls::pass(&client, &settings(), &serving, t)
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = webhook_server::router(
        client,
        LockCache::none(),
        Injection::new("leasehold/leasehold:0.1.0", true),
        Arc::new(leasehold_operator::metrics::Metrics::new()),
    );
    tokio::spawn(webhook_server::serve(
        listener,
        serving,
        router,
        std::future::pending(),
    ));
    let ca = published_ca(&api);
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from(support::HOST).unwrap();
    let mut tls = support::connector(&ca, t).connect(name, tcp).await.unwrap();
    let review = review_of_annotated_pod();
    let (status, _) = support::post_kept_alive(&mut tls, &review).await.unwrap();
    assert_eq!(status, 200);
    tokio::time::sleep(std::time::Duration::from_secs(12)).await;
    let (status, body) = support::post_kept_alive(&mut tls, &review)
        .await
        .expect("the idle connection was closed");
    assert_eq!(status, 200, "{body}");
    assert!(webhook_server::IDLE_TIMEOUT > std::time::Duration::from_secs(90));
}
