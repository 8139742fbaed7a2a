//! Where the webhook's serving certificate comes from, and how it reaches the TLS listener
//! without a restart:
//!
//! - **self-managed** (the default): every replica runs [`maintain`]. The bundle lives in one
//!   Secret in the operator's namespace; whoever finds it missing or due for rotation writes a
//!   new one with the `resourceVersion` it read, so concurrent replicas agree on a single CA (the
//!   loser of a conflict reads the winner's). Each replica then makes the webhook
//!   configuration's `caBundle` match the Secret's `ca.crt` and loads the Secret's certificate:
//!   one of a CA that joined the bundle moments ago only once the API server can have read it.
//! - **from files** (cert-manager, or any mounted `kubernetes.io/tls` Secret): [`follow_files`]
//!   reloads `tls.crt`/`tls.key` when they change; cert-manager's CA injector sets `caBundle`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use tokio::sync::watch;
use tokio_rustls::rustls;
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;

use crate::webhook_certs::{
    self, Bundle, CA_ADOPTED_UNTIL, CA_CRT, CA_KEY, Renewal, TLS_CRT, TLS_KEY,
};

/// How often a replica looks at the Secret and the webhook configuration. Rotation happens weeks
/// before expiry, so this only bounds how long a `helm upgrade` that blanked `caBundle` goes
/// unrepaired.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(30);
/// How long a new CA has been in the bundle before a certificate of it is served (while the
/// one served is good): the API server reads a new `caBundle` a moment after it is written.
pub const NEW_CA_SETTLING: time::Duration = time::Duration::seconds(60);
/// After a failure (API down, a lost write race), look again sooner.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(3);
/// How often mounted certificate files are compared with what is loaded.
pub const FILES_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Cert(#[from] webhook_certs::CertError),
    #[error("the serving certificate or key is unusable: {0}")]
    Unusable(String),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The certificate the TLS listener presents, swapped in place when it is renewed.
pub struct ServingCert {
    current: RwLock<Option<(Arc<CertifiedKey>, String)>>,
    loaded: watch::Sender<bool>,
    /// The presented certificate's end, in Unix seconds, for the expiry alert.
    expiry: prometheus_client::metrics::gauge::Gauge,
}

impl std::fmt::Debug for ServingCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingCert")
            .field("loaded", &*self.loaded.borrow())
            .finish()
    }
}

impl ServingCert {
    pub fn new() -> Arc<Self> {
        Self::with_expiry_gauge(Default::default())
    }

    /// Publishes the presented certificate's end on `expiry` (a metric of the operator).
    pub fn with_expiry_gauge(expiry: prometheus_client::metrics::gauge::Gauge) -> Arc<Self> {
        Arc::new(Self {
            current: RwLock::new(None),
            loaded: watch::channel(false).0,
            expiry,
        })
    }

    /// Present `cert_pem` (the chain) with `key_pem` from the next handshake on. Returns whether
    /// anything changed.
    pub fn load(&self, cert_pem: &str, key_pem: &str) -> Result<bool, TlsError> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        if let Some((_, loaded)) = &*self.current.read().unwrap()
            && loaded == cert_pem
        {
            return Ok(false);
        }
        let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TlsError::Unusable(format!("certificate: {e}")))?;
        if chain.is_empty() {
            return Err(TlsError::Unusable("no certificate in tls.crt".into()));
        }
        // The key's text is never part of an error message.
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|_| TlsError::Unusable("tls.key is not a PEM private key".into()))?;
        let signer = rustls::crypto::ring::sign::any_supported_type(&key)
            .map_err(|e| TlsError::Unusable(format!("key: {e}")))?;
        let certified = CertifiedKey::new(chain, signer);
        certified
            .keys_match()
            .map_err(|e| TlsError::Unusable(format!("tls.key does not match tls.crt: {e}")))?;
        let ends = crate::webhook_certs::not_after(cert_pem)?;
        *self.current.write().unwrap() = Some((Arc::new(certified), cert_pem.to_owned()));
        self.expiry.set(ends.unix_timestamp());
        self.loaded.send_replace(true);
        Ok(true)
    }

    /// Resolves once a certificate is loaded (the readiness latch waits on it).
    pub async fn wait_loaded(&self) {
        let mut loaded = self.loaded.subscribe();
        let _ = loaded.wait_for(|l| *l).await;
    }

    /// The PEM chain presented now.
    pub fn presented(&self) -> Option<String> {
        self.current
            .read()
            .unwrap()
            .as_ref()
            .map(|(_, pem)| pem.clone())
    }

    /// A rustls server configuration that always presents the current certificate.
    pub fn server_config(self: &Arc<Self>) -> rustls::ServerConfig {
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_no_client_auth()
        .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        config
    }
}

impl ResolvesServerCert for ServingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current
            .read()
            .unwrap()
            .as_ref()
            .map(|(k, _)| k.clone())
    }
}

/// What the self-managed mode works on.
#[derive(Debug, Clone)]
pub struct SelfManaged {
    /// The operator's namespace: the Secret and the webhook Service live there.
    pub namespace: String,
    pub secret: String,
    pub service: String,
    /// The MutatingWebhookConfiguration whose entries pointing at `service` get the `caBundle`.
    pub webhook_configuration: String,
}

/// What one pass did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Pass {
    /// The bundle this replica wrote, if it (re)issued one.
    pub renewed: Option<Renewal>,
    /// A new certificate was loaded into the listener.
    pub reloaded: bool,
    /// How many webhook entries got a new `caBundle`.
    pub ca_bundles_patched: usize,
    /// The webhook configuration does not exist (yet): nothing to patch.
    pub configuration_missing: bool,
}

/// Keep the Secret, the listener and the `caBundle` in step, forever.
pub async fn maintain(client: kube::Client, settings: SelfManaged, serving: Arc<ServingCert>) {
    loop {
        let pause = match pass(
            &client,
            &settings,
            &serving,
            time::OffsetDateTime::now_utc(),
        )
        .await
        {
            Ok(done) => {
                if let Some(why) = done.renewed {
                    tracing::info!(?why, secret = %settings.secret, "webhook certificate issued");
                }
                if done.ca_bundles_patched > 0 {
                    tracing::info!(
                        configuration = %settings.webhook_configuration,
                        webhooks = done.ca_bundles_patched,
                        "webhook caBundle updated"
                    );
                }
                if done.configuration_missing {
                    tracing::warn!(
                        configuration = %settings.webhook_configuration,
                        "the MutatingWebhookConfiguration does not exist; no caBundle to set"
                    );
                }
                CHECK_INTERVAL
            }
            Err(e) => {
                tracing::warn!(error = %e, "webhook certificate: will try again");
                RETRY_INTERVAL
            }
        };
        tokio::time::sleep(pause).await;
    }
}

/// One look: renew the Secret's bundle if due, load it, publish its CA.
pub async fn pass(
    client: &kube::Client,
    settings: &SelfManaged,
    serving: &ServingCert,
    now: time::OffsetDateTime,
) -> Result<Pass, TlsError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &settings.namespace);
    let existing = secrets.get_opt(&settings.secret).await?;
    let current = existing.as_ref().and_then(bundle_of);
    let dns_names = webhook_certs::service_dns_names(&settings.service, &settings.namespace);
    let mut done = Pass::default();
    let bundle = match webhook_certs::renew(current.as_ref(), &dns_names, now)? {
        None => current.expect("renew answers None only for a current bundle"),
        Some((bundle, why)) => {
            // A Secret deleted (or spoiled) under running replicas: they present certificates of
            // the CA published until now until they load the new one, so it stays trusted.
            let bundle = match why {
                Renewal::Created => match published_ca_bundle(client, settings).await {
                    Ok(Some(published)) => {
                        webhook_certs::trusting_published(bundle, &published, now)
                    }
                    Ok(None) => bundle,
                    // Not worth going without a certificate for: the replicas reload a moment
                    // later than the API server trusts the new CA.
                    Err(e) => {
                        tracing::warn!(error = %e, "the published caBundle cannot be read; a new CA replaces it");
                        bundle
                    }
                },
                _ => bundle,
            };
            // A lost race is an error: the next pass reads the winner's bundle.
            write_secret(&secrets, settings, existing, &bundle).await?;
            done.renewed = Some(why);
            bundle
        }
    };
    let published = publish_ca_bundle(client, settings, &bundle.ca_bundle).await;
    // The API server trusts a new CA only once it has read the caBundle naming it, a moment
    // after it is written: until then (and while the bundle cannot be written) the listener
    // keeps its certificate of the old CA, while that one is good.
    let settled = match &published {
        // Published before this pass, and the CA not new: the API server has read it.
        Ok(Some(0)) => webhook_certs::issued_at(&bundle.ca_bundle)
            .is_ok_and(|issued| now - issued >= NEW_CA_SETTLING),
        Ok(Some(_)) | Err(_) => false,
        Ok(None) => true,
    };
    let current_good = serving
        .presented()
        .and_then(|pem| webhook_certs::not_after(&pem).ok())
        .is_some_and(|end| end - now > NEW_CA_SETTLING);
    if settled || !current_good {
        done.reloaded = serving.load(&bundle.cert, &bundle.key)?;
    }
    match published? {
        Some(patched) => done.ca_bundles_patched = patched,
        None => done.configuration_missing = true,
    }
    Ok(done)
}

fn bundle_of(secret: &Secret) -> Option<Bundle> {
    let data = secret.data.as_ref()?;
    let text = |key: &str| {
        data.get(key)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
    };
    Some(Bundle {
        ca_bundle: text(CA_CRT)?,
        ca_key: text(CA_KEY)?,
        cert: text(TLS_CRT)?,
        key: text(TLS_KEY)?,
        // Unreadable, the CAs taken over go at once rather than never.
        adopted_until: text(CA_ADOPTED_UNTIL).map(|until| {
            until
                .trim()
                .parse::<i64>()
                .ok()
                .and_then(|secs| time::OffsetDateTime::from_unix_timestamp(secs).ok())
                .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
        }),
    })
}

async fn write_secret(
    secrets: &Api<Secret>,
    settings: &SelfManaged,
    existing: Option<Secret>,
    bundle: &Bundle,
) -> Result<(), kube::Error> {
    let adopted_until = bundle
        .adopted_until
        .map(|until| until.unix_timestamp().to_string());
    let data = [
        (CA_CRT, Some(&bundle.ca_bundle)),
        (CA_KEY, Some(&bundle.ca_key)),
        (TLS_CRT, Some(&bundle.cert)),
        (TLS_KEY, Some(&bundle.key)),
        (CA_ADOPTED_UNTIL, adopted_until.as_ref()),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k.to_owned(), ByteString(v?.as_bytes().to_vec()))))
    .collect();
    let params = PostParams {
        field_manager: Some(crate::reconcile::MANAGER.to_owned()),
        ..PostParams::default()
    };
    match existing {
        Some(mut secret) => {
            // Replace with the resourceVersion read: a concurrent writer makes this a 409.
            secret.data = Some(data);
            secret.string_data = None;
            secrets
                .replace(&settings.secret, &params, &secret)
                .await
                .map(drop)
        }
        None => {
            let secret = Secret {
                metadata: kube::api::ObjectMeta {
                    name: Some(settings.secret.clone()),
                    namespace: Some(settings.namespace.clone()),
                    labels: Some(
                        [(
                            "app.kubernetes.io/managed-by".to_owned(),
                            "leasehold".to_owned(),
                        )]
                        .into(),
                    ),
                    ..Default::default()
                },
                type_: Some("kubernetes.io/tls".to_owned()),
                data: Some(data),
                ..Secret::default()
            };
            secrets.create(&params, &secret).await.map(drop)
        }
    }
}

/// Set `caBundle` on every webhook of the configuration that calls our Service. `None` when the
/// configuration does not exist. Read and replaced as raw JSON, so fields newer than this build's
/// API types survive.
fn webhook_configurations(client: &kube::Client) -> Api<DynamicObject> {
    let resource = ApiResource {
        group: "admissionregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "admissionregistration.k8s.io/v1".into(),
        kind: "MutatingWebhookConfiguration".into(),
        plural: "mutatingwebhookconfigurations".into(),
    };
    Api::all_with(client.clone(), &resource)
}

/// Whether `webhook`, of the webhook configuration, calls this operator's webhook Service
/// (another product's webhooks in the same configuration are left alone).
fn calls_this_service(webhook: &serde_json::Value, settings: &SelfManaged) -> bool {
    let service = &webhook["clientConfig"]["service"];
    service["name"] == settings.service.as_str()
        && service["namespace"] == settings.namespace.as_str()
}

/// The `caBundle` the webhook configuration gives for this Service now, if any.
async fn published_ca_bundle(
    client: &kube::Client,
    settings: &SelfManaged,
) -> Result<Option<String>, kube::Error> {
    let api = webhook_configurations(client);
    let Some(configuration) = api.get_opt(&settings.webhook_configuration).await? else {
        return Ok(None);
    };
    let published = configuration
        .data
        .get("webhooks")
        .and_then(|w| w.as_array())
        .into_iter()
        .flatten()
        .filter(|webhook| calls_this_service(webhook, settings))
        .filter_map(|webhook| {
            serde_json::from_value::<ByteString>(webhook["clientConfig"]["caBundle"].clone()).ok()
        })
        .filter_map(|bytes| String::from_utf8(bytes.0).ok())
        .collect::<Vec<String>>()
        .concat();
    Ok(Some(published))
}

async fn publish_ca_bundle(
    client: &kube::Client,
    settings: &SelfManaged,
    ca_bundle: &str,
) -> Result<Option<usize>, kube::Error> {
    let api = webhook_configurations(client);
    let Some(mut configuration) = api.get_opt(&settings.webhook_configuration).await? else {
        return Ok(None);
    };
    let wanted =
        serde_json::to_value(ByteString(ca_bundle.as_bytes().to_vec())).expect("bytes serialize");
    let mut patched = 0;
    if let Some(webhooks) = configuration
        .data
        .get_mut("webhooks")
        .and_then(|w| w.as_array_mut())
    {
        for webhook in webhooks {
            if calls_this_service(webhook, settings)
                && webhook["clientConfig"]["caBundle"] != wanted
            {
                webhook["clientConfig"]["caBundle"] = wanted.clone();
                patched += 1;
            }
        }
    }
    if patched > 0 {
        api.replace(
            &settings.webhook_configuration,
            &PostParams {
                field_manager: Some(crate::reconcile::MANAGER.to_owned()),
                ..PostParams::default()
            },
            &configuration,
        )
        .await?;
    }
    Ok(Some(patched))
}

/// Serve the certificate mounted in `dir` (`tls.crt`, `tls.key`), reloading it when it changes.
pub async fn follow_files(dir: PathBuf, serving: Arc<ServingCert>) {
    loop {
        match load_files(&dir, &serving).await {
            Ok(true) => tracing::info!(dir = %dir.display(), "webhook certificate loaded"),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "webhook certificate files"),
        }
        tokio::time::sleep(FILES_INTERVAL).await;
    }
}

/// Load `dir`'s certificate if it differs from the one presented.
pub async fn load_files(dir: &Path, serving: &ServingCert) -> Result<bool, TlsError> {
    let read = |name: &str| {
        let path = dir.join(name);
        async move {
            tokio::fs::read_to_string(&path)
                .await
                .map_err(|source| TlsError::Read { path, source })
        }
    };
    let cert = read(TLS_CRT).await?;
    let key = read(TLS_KEY).await?;
    serving.load(&cert, &key)
}
