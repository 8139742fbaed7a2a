//! TLS settings shared by the drivers that speak it (etcd, Redis, Redlock): PEM documents from
//! files named on the command line or from a Secret's keys, the `ca`/`cert`/`key` URL options,
//! and failures told apart for the people who must fix them.

use std::path::PathBuf;
use std::sync::Arc;

use crate::error::{Error, Result};

/// Makes ring the process's TLS provider, once; later calls do nothing. Some dependencies
/// (the Redis and ZooKeeper clients, kube's HTTPS) build their TLS settings from the process's
/// provider, and rustls has none of its own when two are compiled in, as they are here:
/// zookeeper-client's TLS brings aws-lc-rs beside the ring everything else is built on.
pub fn use_ring_provider() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // An error means another provider was installed first, which serves as well.
        let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    });
}

/// A PEM document: a file named on the command line (read when the driver connects), or the
/// text of a Secret key.
#[derive(Clone, PartialEq, Eq)]
pub enum Pem {
    File(PathBuf),
    Text(String),
}

impl Pem {
    pub fn read(&self, field: &'static str) -> Result<String> {
        match self {
            Pem::Text(text) => Ok(text.clone()),
            Pem::File(path) => std::fs::read_to_string(path).map_err(|e| Error::InvalidConfig {
                field,
                reason: format!("reading {}: {e}", path.display()),
            }),
        }
    }

    /// The file's path, for logs; PEM text from a Secret is never shown.
    pub fn file(&self) -> Option<&std::path::Path> {
        match self {
            Pem::File(path) => Some(path),
            Pem::Text(_) => None,
        }
    }
}

/// TLS to a server: the CA to verify it against (`None`: the system's roots, as managed
/// services need), and a client certificate and key for servers that ask for one.
#[derive(Clone, PartialEq, Eq)]
pub struct Tls {
    pub ca: Option<Pem>,
    pub client: Option<(Pem, Pem)>,
}

impl Tls {
    /// The documents given as files, by their URL option's name (`ca`, `cert`, `key`), for logs:
    /// PEM text from a Secret is never shown.
    pub fn files(&self) -> impl Iterator<Item = (&'static str, &std::path::Path)> {
        pem_files(self.ca.as_ref(), self.client.as_ref())
    }
}

/// The documents among a CA and a client certificate and key that are given as files, by
/// their URL option's name (`ca`, `cert`, `key`), for logs: PEM text from a Secret is never
/// shown.
pub(crate) fn pem_files<'a>(
    ca: Option<&'a Pem>,
    client: Option<&'a (Pem, Pem)>,
) -> impl Iterator<Item = (&'static str, &'a std::path::Path)> {
    std::iter::once(("ca", ca))
        .chain(
            client
                .into_iter()
                .flat_map(|(c, k)| [("cert", Some(c)), ("key", Some(k))]),
        )
        .filter_map(|(name, pem)| Some((name, pem?.file()?)))
}

/// The `ca`, `cert` and `key` URL options gathered while parsing a URL.
#[derive(Default)]
pub struct TlsOptions {
    pub ca: Option<Pem>,
    pub cert: Option<Pem>,
    pub key: Option<Pem>,
}

impl TlsOptions {
    /// Take `key=value` if it is one of the TLS options.
    pub fn take(&mut self, key: &str, value: &str) -> bool {
        let file = || Some(Pem::File(PathBuf::from(value)));
        match key {
            "ca" => self.ca = file(),
            "cert" => self.cert = file(),
            "key" => self.key = file(),
            _ => return false,
        }
        true
    }

    /// The TLS settings of a URL whose scheme asks for TLS (`secure`), or none; `reason` says
    /// what is wrong.
    pub fn finish(
        self,
        secure: bool,
        tls_scheme: &str,
    ) -> std::result::Result<Option<Tls>, String> {
        let client = match (self.cert, self.key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => return Err("cert and key go together: the client certificate and its key".into()),
        };
        match (secure, self.ca, client) {
            (false, None, None) => Ok(None),
            (false, ..) => Err(format!(
                "ca, cert and key are TLS options: use {tls_scheme}"
            )),
            (true, ca, client) => Ok(Some(Tls { ca, client })),
        }
    }
}

/// What a TLS failure means, in words, for the usual causes; appended to the error so that a
/// readiness failure says which of them it is.
pub fn explain(error: &str) -> Option<&'static str> {
    let causes: [(&[&str], &str); 5] = [
        (
            &["UnknownIssuer", "unknown issuer", "BadSignature"],
            "the server's certificate is not signed by the CA given (ca=, or ca.crt in the Secret)",
        ),
        (
            &["Expired", "expired"],
            "a certificate has expired (the server's, or this client's as the server says)",
        ),
        (
            &["NotValidForName", "not valid for name"],
            "the server's certificate does not name the host in the URL",
        ),
        (
            &[
                "CertificateRequired",
                "certificate required",
                "HandshakeFailure",
                "BadCertificate",
                "UnknownCA",
            ],
            "the server asks for a client certificate this client does not have, or does not accept the one it sent (cert= and key=, or tls.crt and tls.key)",
        ),
        (
            &[
                "InvalidContentType",
                "corrupt message",
                "InvalidMessage",
                "wrong version number",
                // A plain-text ZooKeeper closes the connection on a TLS greeting.
                "handshake eof",
            ],
            "the server does not speak TLS on this port: a plain-text server behind a TLS URL",
        ),
    ];
    causes
        .into_iter()
        .find(|(needles, _)| needles.iter().any(|n| error.contains(n)))
        .map(|(_, cause)| cause)
}

/// `message` with the [`explain`]ed cause, if there is one.
pub fn with_cause(message: String) -> String {
    match explain(&message) {
        Some(cause) => format!("{message} ({cause})"),
        None => message,
    }
}

/// Why a TLS session with `host:port` under `tls` fails, by one handshake made as a client with
/// these settings would make it (ring, the CA given, the client pair if any), and a short read
/// after it, since under TLS 1.3 a server refuses a client certificate only once the client has
/// finished. `None`: the handshake succeeded, or the server could not be reached at all.
pub async fn handshake_failure(host: &str, port: u16, tls: &Tls) -> Option<String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::AsyncReadExt;
    use tokio_rustls::rustls;

    const STEP: std::time::Duration = std::time::Duration::from_secs(1);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    if let Some(ca) = &tls.ca {
        for cert in CertificateDer::pem_slice_iter(ca.read("ca").ok()?.as_bytes()) {
            roots.add(cert.ok()?).ok()?;
        }
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(roots);
    let config = match &tls.client {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_slice_iter(cert.read("cert").ok()?.as_bytes())
                .collect::<std::result::Result<Vec<_>, _>>()
                .ok()?;
            let key = PrivateKeyDer::from_pem_slice(key.read("key").ok()?.as_bytes()).ok()?;
            builder.with_client_auth_cert(chain, key).ok()?
        }
        None => builder.with_no_client_auth(),
    };
    let name = ServerName::try_from(host.to_owned()).ok()?;
    let tcp = tokio::time::timeout(STEP, tokio::net::TcpStream::connect((host, port)))
        .await
        .ok()?
        .ok()?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let mut stream = match tokio::time::timeout(STEP, connector.connect(name, tcp)).await {
        Err(_) => return Some("the TLS handshake did not finish".into()),
        Ok(Err(e)) => return Some(with_cause(e.to_string())),
        Ok(Ok(stream)) => stream,
    };
    let mut byte = [0u8; 1];
    match tokio::time::timeout(STEP / 4, stream.read(&mut byte)).await {
        Ok(Err(e)) => Some(with_cause(e.to_string())),
        _ => None,
    }
}
