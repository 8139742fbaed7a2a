//! The webhook's certificates when nobody else provides them: a CA of the operator's own and a
//! serving certificate for the webhook Service, both rotated before they expire. Pure functions
//! of the current bundle and the time; `webhook_tls` stores the bundle in a Secret and publishes
//! the CA as the webhook configuration's `caBundle`.
//!
//! Rotation never leaves a window in which the API server distrusts a replica: a new CA is
//! published next to the old one (`ca.crt` holds both until the old one expires), and a serving
//! certificate is re-issued well before its end, so replicas that reload a little late still
//! present a certificate that is valid and trusted.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

/// The CA lives two years and is replaced 90 days before its end.
pub const CA_VALIDITY: Duration = Duration::days(730);
pub const CA_RENEW_BEFORE: Duration = Duration::days(90);
/// Serving certificates live 90 days and are replaced 30 days before their end.
pub const SERVING_VALIDITY: Duration = Duration::days(90);
pub const SERVING_RENEW_BEFORE: Duration = Duration::days(30);
/// Clock skew between the operator and the API server: certificates start a little in the past.
const BACKDATE: Duration = Duration::minutes(5);

/// The Secret's keys (a `kubernetes.io/tls` Secret, plus the CA).
pub const TLS_CRT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";
/// Every CA still trusted, the current one first: what the API server gets as `caBundle`.
pub const CA_CRT: &str = "ca.crt";
/// The current CA's key; it signs the next serving certificate.
pub const CA_KEY: &str = "ca.key";
/// When the CAs taken over from the published `caBundle` leave the bundle (Unix seconds).
pub const CA_ADOPTED_UNTIL: &str = "ca-adopted-until";
/// How long a bundle made anew keeps trusting the CAs published before it: long past every
/// replica's reload (a new CA settles for a minute, and each replica looks every 30 s), and no
/// longer, as nobody here holds their keys (a Secret deleted for a leaked key must not keep
/// its CA trusted).
pub const ADOPTED_KEPT: Duration = Duration::minutes(10);

/// The certificates and keys, in PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct Bundle {
    pub ca_bundle: String,
    pub ca_key: String,
    pub cert: String,
    pub key: String,
    /// Until when the CAs after the first, taken over from the published `caBundle` as the
    /// bundle was made anew ([`trusting_published`]), stay in it.
    pub adopted_until: Option<OffsetDateTime>,
}

impl std::fmt::Debug for Bundle {
    // Keys never reach a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bundle")
            .field("ca_bundle", &self.ca_bundle)
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

/// Why a bundle was (re)issued; also the log line's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// No usable bundle: a new CA and certificate.
    Created,
    /// The CA nears its end: a new CA beside the old, and a certificate from it.
    CaRotated,
    /// The serving certificate nears its end, or names other hosts, or is not from the CA.
    CertRotated,
    /// Only an expired CA was dropped from the trusted list.
    BundlePruned,
}

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("cannot generate a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("not a certificate in PEM: {0}")]
    Parse(String),
}

/// The DNS names a Service is reached by from the API server.
pub fn service_dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
        format!("{service}.{namespace}"),
        service.to_owned(),
    ]
}

/// What to store now: `None` when `current` serves `dns_names` well past `now`.
pub fn renew(
    current: Option<&Bundle>,
    dns_names: &[String],
    now: OffsetDateTime,
) -> Result<Option<(Bundle, Renewal)>, CertError> {
    let Some(current) = current.filter(|b| usable(b, now)) else {
        let ca = new_ca(now)?;
        return Ok(Some((
            issue(&ca, vec![ca.cert.clone()], dns_names, now)?,
            Renewal::Created,
        )));
    };
    let cas = pem_blocks(&current.ca_bundle);
    // The CAs taken over when the bundle was made anew have served their time: the bundle's
    // own CA alone.
    if current.adopted_until.is_some_and(|until| now >= until) {
        let mut pruned = current.clone();
        pruned.ca_bundle = cas[0].clone();
        pruned.adopted_until = None;
        return Ok(Some((pruned, Renewal::BundlePruned)));
    }
    let trusted: Vec<String> = cas
        .iter()
        .filter(|pem| not_after(pem).is_ok_and(|end| end > now))
        .cloned()
        .collect();
    let ca_end = not_after(&cas[0])?;
    if ca_end - now < CA_RENEW_BEFORE {
        let ca = new_ca(now)?;
        let mut bundle = vec![ca.cert.clone()];
        bundle.extend(trusted);
        return Ok(Some((
            issue(&ca, bundle, dns_names, now)?,
            Renewal::CaRotated,
        )));
    }
    let ca = Ca {
        cert: cas[0].clone(),
        key: current.ca_key.clone(),
    };
    if !serves(current, &cas[0], dns_names, now)? {
        return Ok(Some((
            issue(&ca, trusted, dns_names, now)?,
            Renewal::CertRotated,
        )));
    }
    if trusted.len() < cas.len() {
        let mut pruned = current.clone();
        pruned.ca_bundle = trusted.concat();
        return Ok(Some((pruned, Renewal::BundlePruned)));
    }
    Ok(None)
}

struct Ca {
    cert: String,
    key: String,
}

/// A bundle worth keeping: its CA parses, has not expired, and its key is there.
fn usable(bundle: &Bundle, now: OffsetDateTime) -> bool {
    let cas = pem_blocks(&bundle.ca_bundle);
    !cas.is_empty()
        && not_after(&cas[0]).is_ok_and(|end| end > now)
        && KeyPair::from_pem(&bundle.ca_key).is_ok()
}

/// The serving certificate is from `ca_pem`, names exactly `dns_names`, has its key, and has more
/// than `SERVING_RENEW_BEFORE` left.
fn serves(
    bundle: &Bundle,
    ca_pem: &str,
    dns_names: &[String],
    now: OffsetDateTime,
) -> Result<bool, CertError> {
    if KeyPair::from_pem(&bundle.key).is_err() {
        return Ok(false);
    }
    let Ok(cert_der) = der(&bundle.cert) else {
        return Ok(false);
    };
    let ca_der = der(ca_pem)?;
    let (_, ca) =
        X509Certificate::from_der(&ca_der).map_err(|e| CertError::Parse(e.to_string()))?;
    let Ok((_, cert)) = X509Certificate::from_der(&cert_der) else {
        return Ok(false);
    };
    if cert.verify_signature(Some(ca.public_key())).is_err() {
        return Ok(false);
    }
    let end = OffsetDateTime::from_unix_timestamp(cert.validity().not_after.timestamp())
        .map_err(|e| CertError::Parse(e.to_string()))?;
    if end - now < SERVING_RENEW_BEFORE {
        return Ok(false);
    }
    let mut names: Vec<String> = match cert.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::DNSName(d) => Some((*d).to_owned()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    let mut wanted = dns_names.to_vec();
    names.sort();
    wanted.sort();
    Ok(names == wanted)
}

fn new_ca(now: OffsetDateTime) -> Result<Ca, CertError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(
        DnType::CommonName,
        format!("leasehold-webhook-ca-{}", now.unix_timestamp()),
    );
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.not_before = now - BACKDATE;
    params.not_after = now + CA_VALIDITY;
    let cert = params.self_signed(&key)?;
    Ok(Ca {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// A serving certificate for `dns_names` from `ca`, never outliving it.
fn issue(
    ca: &Ca,
    ca_bundle: Vec<String>,
    dns_names: &[String],
    now: OffsetDateTime,
) -> Result<Bundle, CertError> {
    let ca_key = KeyPair::from_pem(&ca.key)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert, ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(dns_names.to_vec())?;
    let mut name = DistinguishedName::new();
    name.push(
        DnType::CommonName,
        dns_names.first().cloned().unwrap_or_default(),
    );
    params.distinguished_name = name;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = now - BACKDATE;
    params.not_after = (now + SERVING_VALIDITY).min(not_after(&ca.cert)?);
    let cert = params.signed_by(&key, &issuer)?;
    Ok(Bundle {
        ca_bundle: ca_bundle.concat(),
        ca_key: ca.key.clone(),
        cert: cert.pem(),
        key: key.serialize_pem(),
        adopted_until: None,
    })
}

/// `bundle`, made anew (its Secret gone or unusable), trusting also the CAs `published` until
/// now, while they are good, for [`ADOPTED_KEPT`]: the replicas present certificates of those
/// until they load the new one, once the API server has read the new CA, as after a rotation.
pub fn trusting_published(mut bundle: Bundle, published: &str, now: OffsetDateTime) -> Bundle {
    let mut cas = pem_blocks(&bundle.ca_bundle);
    let own = cas.len();
    for ca in pem_blocks(published) {
        if !cas.contains(&ca) && not_after(&ca).is_ok_and(|end| end > now) {
            cas.push(ca);
        }
    }
    if cas.len() > own {
        bundle.adopted_until = Some(now + ADOPTED_KEPT);
    }
    bundle.ca_bundle = cas.concat();
    bundle
}

/// When the first certificate of a PEM chain ends.
pub fn not_after(pem: &str) -> Result<OffsetDateTime, CertError> {
    let der = der(pem)?;
    let (_, cert) = X509Certificate::from_der(&der).map_err(|e| CertError::Parse(e.to_string()))?;
    OffsetDateTime::from_unix_timestamp(cert.validity().not_after.timestamp())
        .map_err(|e| CertError::Parse(e.to_string()))
}

/// When the first certificate of a PEM chain was issued here (its start, which is backdated).
pub fn issued_at(pem: &str) -> Result<OffsetDateTime, CertError> {
    let der = der(pem)?;
    let (_, cert) = X509Certificate::from_der(&der).map_err(|e| CertError::Parse(e.to_string()))?;
    OffsetDateTime::from_unix_timestamp(cert.validity().not_before.timestamp())
        .map(|start| start + BACKDATE)
        .map_err(|e| CertError::Parse(e.to_string()))
}

fn der(pem: &str) -> Result<Vec<u8>, CertError> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes())
        .map(|c| c.to_vec())
        .map_err(|e| CertError::Parse(e.to_string()))
}

/// Each `-----BEGIN CERTIFICATE-----` block of `pem`, as its own PEM text.
fn pem_blocks(pem: &str) -> Vec<String> {
    const END: &str = "-----END CERTIFICATE-----";
    pem.split_inclusive(END)
        .filter_map(|chunk| {
            let start = chunk.find("-----BEGIN CERTIFICATE-----")?;
            chunk
                .ends_with(END)
                .then(|| format!("{}\n", &chunk[start..]))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        service_dns_names("leasehold-webhook", "leasehold-system")
    }

    fn t0() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    #[test]
    fn a_new_bundle_is_a_ca_and_a_certificate_from_it_for_the_service() {
        let (bundle, why) = renew(None, &names(), t0()).unwrap().unwrap();
        assert_eq!(why, Renewal::Created);
        assert_eq!(pem_blocks(&bundle.ca_bundle).len(), 1);
        assert_eq!(
            not_after(&bundle.cert).unwrap(),
            t0() + SERVING_VALIDITY,
            "90 days"
        );
        assert!(serves(&bundle, &bundle.ca_bundle, &names(), t0()).unwrap());
        assert!(
            !format!("{bundle:?}").contains("PRIVATE KEY"),
            "keys stay out of Debug"
        );
        assert_eq!(
            renew(Some(&bundle), &names(), t0()).unwrap(),
            None,
            "settled"
        );
        assert_eq!(
            renew(Some(&bundle), &names(), t0() + Duration::days(59)).unwrap(),
            None,
            "31 days left is enough"
        );
    }

    #[test]
    fn the_serving_certificate_is_reissued_from_the_same_ca_before_it_ends() {
        let (first, _) = renew(None, &names(), t0()).unwrap().unwrap();
        let later = t0() + Duration::days(61);
        let (second, why) = renew(Some(&first), &names(), later).unwrap().unwrap();
        assert_eq!(why, Renewal::CertRotated);
        assert_eq!(second.ca_bundle, first.ca_bundle, "same CA, same caBundle");
        assert_ne!(second.cert, first.cert);
        assert_eq!(not_after(&second.cert).unwrap(), later + SERVING_VALIDITY);
        assert_eq!(renew(Some(&second), &names(), later).unwrap(), None);
    }

    #[test]
    fn other_service_names_or_a_foreign_certificate_mean_a_new_certificate() {
        let (bundle, _) = renew(None, &names(), t0()).unwrap().unwrap();
        let moved = service_dns_names("leasehold-webhook", "elsewhere");
        let (_, why) = renew(Some(&bundle), &moved, t0()).unwrap().unwrap();
        assert_eq!(why, Renewal::CertRotated);

        let (other, _) = renew(None, &names(), t0()).unwrap().unwrap();
        let mut mixed = bundle.clone();
        mixed.cert = other.cert;
        mixed.key = other.key;
        let (fixed, why) = renew(Some(&mixed), &names(), t0()).unwrap().unwrap();
        assert_eq!(
            why,
            Renewal::CertRotated,
            "a certificate the CA did not sign"
        );
        assert!(serves(&fixed, &pem_blocks(&fixed.ca_bundle)[0], &names(), t0()).unwrap());
    }

    #[test]
    fn the_ca_rotates_with_the_old_one_still_trusted_until_it_ends() {
        let (first, _) = renew(None, &names(), t0()).unwrap().unwrap();
        let late = t0() + CA_VALIDITY - Duration::days(60);
        // The serving certificate was rotated along the way; what matters here is the CA.
        let (rotated, why) = renew(Some(&first), &names(), late).unwrap().unwrap();
        assert_eq!(why, Renewal::CaRotated);
        let cas = pem_blocks(&rotated.ca_bundle);
        assert_eq!(cas.len(), 2, "new CA first, old CA kept");
        assert_eq!(cas[1], first.ca_bundle);
        assert!(serves(&rotated, &cas[0], &names(), late).unwrap());
        assert_eq!(renew(Some(&rotated), &names(), late).unwrap(), None);

        // By the old CA's end the certificate is due too; the new one drops the old CA.
        let after_old_ca = t0() + CA_VALIDITY + Duration::days(1);
        let (pruned, why) = renew(Some(&rotated), &names(), after_old_ca)
            .unwrap()
            .unwrap();
        assert_eq!(why, Renewal::CertRotated);
        assert_eq!(pem_blocks(&pruned.ca_bundle), vec![cas[0].clone()]);
    }

    #[test]
    fn an_expired_ca_alone_is_dropped_from_the_bundle() {
        let (long_gone, _) = renew(None, &names(), t0() - CA_VALIDITY - Duration::days(5))
            .unwrap()
            .unwrap();
        let (current, _) = renew(None, &names(), t0()).unwrap().unwrap();
        let mut stale = current.clone();
        stale.ca_bundle = format!("{}{}", current.ca_bundle, long_gone.ca_bundle);
        let (pruned, why) = renew(Some(&stale), &names(), t0()).unwrap().unwrap();
        assert_eq!(why, Renewal::BundlePruned);
        assert_eq!(pruned, current, "the certificate and keys are kept");
    }

    #[test]
    fn garbage_or_an_expired_ca_starts_over() {
        let garbage = Bundle {
            ca_bundle: "not a certificate".into(),
            ca_key: String::new(),
            cert: String::new(),
            key: String::new(),
            adopted_until: None,
        };
        let (_, why) = renew(Some(&garbage), &names(), t0()).unwrap().unwrap();
        assert_eq!(why, Renewal::Created);
        let (bundle, _) = renew(None, &names(), t0()).unwrap().unwrap();
        let (_, why) = renew(
            Some(&bundle),
            &names(),
            t0() + CA_VALIDITY + Duration::days(1),
        )
        .unwrap()
        .unwrap();
        assert_eq!(why, Renewal::Created);
    }
}
