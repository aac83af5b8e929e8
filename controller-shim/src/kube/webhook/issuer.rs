//! The webhook's serving certificate, made and renewed by the controller: no manual step and
//! no cert-manager needed. The `kubernetes.io/tls` Secret the webhook serves from
//! ([`super::tls`]) also holds a CA of the controller's own (`ca.key`, and in `ca.crt` the
//! CAs to trust), and the controller keeps the `caBundle` of its Validating- and
//! MutatingWebhookConfiguration equal to `ca.crt`.
//!
//! Every replica runs this; writes carry the resourceVersion they read, so of two replicas
//! renewing at once one wins and the other reads the winner's on its next round.
//!
//! - A serving certificate is renewed when a third of its validity is left.
//! - The CA lives ten certificate lifetimes and is replaced when two are left, in two rounds:
//!   first the new CA joins `ca.crt` (so the caBundle trusts both), then, once every
//!   caBundle holds it, the serving certificate is signed by it. The old CA leaves `ca.crt`
//!   when it expires.
//! - A Secret without `ca.key` is someone else's (an operator's, cert-manager's): then this
//!   is not run (`--webhook-cert-issue` off) or leaves the Secret alone and says so.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use time::OffsetDateTime;
use tokio::sync::Notify;

const TLS_CRT: &str = "tls.crt";
const TLS_KEY: &str = "tls.key";
const CA_CRT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
/// The annotation naming the CA (by its certificate's digest) that signed `tls.crt`.
const SIGNED_BY: &str = "ustor-nbd.csi.mindsw.io/signed-by";
const CA_NAME: &str = "ustor-nbd.csi.mindsw.io webhook CA";
/// How often the Secret is looked at when nothing is due sooner.
const LOOK_EVERY: Duration = Duration::from_secs(60);
/// After a failed round.
const RETRY_AFTER: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct IssueSettings {
    /// The DNS names (and IP addresses) the serving certificate is for: the webhook
    /// Service's, `<service>.<namespace>.svc`.
    pub names: Vec<String>,
    /// How long a serving certificate is valid.
    pub validity: Duration,
    /// The name of the Validating- and MutatingWebhookConfiguration to keep trusting it.
    pub configuration: String,
}

/// Why a round of issuing failed; the next round tries again.
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error("Secret {namespace}/{name}: {source}")]
    Secret {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("making a certificate: {0}")]
    Make(#[from] rcgen::Error),
    #[error("Secret {name}'s {key}: {why}")]
    Unreadable {
        name: String,
        key: &'static str,
        why: String,
    },
    #[error("the caBundle of {kind} {name}: {source}")]
    Bundle {
        kind: &'static str,
        name: String,
        source: kube::Error,
    },
}

/// What the Secret holds, as far as issuing goes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    /// The CA that signs (`ca.key`'s certificate), PEM.
    ca: String,
    ca_key: String,
    /// Every CA to trust, the signing one first, PEM.
    trusted: Vec<String>,
    /// Seconds since the epoch.
    ca_expires: i64,
    leaf_expires: i64,
    /// Whether `tls.crt` was signed by `ca` (the annotation says).
    leaf_by_ca: bool,
}

/// What a round does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// A new CA and serving certificate, nothing to keep (no Secret yet).
    Fresh,
    /// A new CA joins the trusted ones; the serving certificate stays.
    NewCa,
    /// A new serving certificate from the signing CA.
    NewLeaf,
    Nothing,
}

fn step(now: i64, held: Option<&Held>, validity: i64) -> Step {
    let Some(h) = held else {
        return Step::Fresh;
    };
    if h.ca_expires - now < 2 * validity && h.trusted.len() == 1 {
        return Step::NewCa;
    }
    if !h.leaf_by_ca || h.leaf_expires - now < validity / 3 {
        return Step::NewLeaf;
    }
    Step::Nothing
}

/// Keeps the Secret `secret` in `namespace` holding a valid serving certificate and the
/// configurations trusting its CA, for as long as the controller runs.
pub async fn keep_issued(
    client: Client,
    namespace: String,
    secret: String,
    settings: IssueSettings,
) {
    let changed = Notify::new();
    let issuing = async {
        loop {
            let pause = match round(&client, &namespace, &secret, &settings).await {
                Ok(next) => next,
                Err(e) => {
                    tracing::warn!(error = %e, "webhook certificate: retrying");
                    RETRY_AFTER
                }
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = changed.notified() => {}
            }
        }
    };
    tokio::join!(
        issuing,
        watch_configuration::<ValidatingWebhookConfiguration>(
            &client,
            &settings.configuration,
            &changed
        ),
        watch_configuration::<MutatingWebhookConfiguration>(
            &client,
            &settings.configuration,
            &changed
        ),
    );
}

/// Wakes the issuing loop whenever the configuration `name` of kind `K` is created or changed.
/// Installing the driver creates the configurations without a caBundle (and re-applying their
/// manifest may empty it); until the next round fills it, their `Fail` webhook refuses the
/// driver's resources, so the round comes at once instead of up to [`LOOK_EVERY`] later.
/// A round that finds nothing to change writes nothing, so its own writes wake it once more
/// and no further.
async fn watch_configuration<K>(client: &Client, name: &str, changed: &Notify)
where
    K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + 'static,
{
    let api: Api<K> = Api::all(client.clone());
    let stream = crate::kube::watch_named(api, name).applied_objects();
    tokio::pin!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(_) => changed.notify_one(),
            Err(e) => {
                tracing::warn!(kind = %K::kind(&()), configuration = name, error = %e, "webhook configuration: watch failed; retrying")
            }
        }
    }
}

/// One look at the Secret and the configurations; how long until the next is due.
async fn round(
    client: &Client,
    namespace: &str,
    name: &str,
    settings: &IssueSettings,
) -> Result<Duration, IssueError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let secret_error = |source| IssueError::Secret {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        source,
    };
    let existing = api.get_opt(name).await.map_err(secret_error)?;
    let data = existing
        .as_ref()
        .and_then(|s| s.data.clone())
        .unwrap_or_default();
    if existing.is_some() && !data.contains_key(CA_KEY) {
        tracing::warn!(secret = name, "webhook certificate: the Secret has no {CA_KEY}: it is someone else's; leaving it alone");
        return Ok(LOOK_EVERY);
    }
    let held = existing
        .as_ref()
        .map(|s| {
            let signed_by = s
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SIGNED_BY))
                .map(String::as_str);
            read(name, &data, signed_by)
        })
        .transpose()?;
    let validity = i64::try_from(settings.validity.as_secs())
        .unwrap_or(i64::MAX)
        .max(3);
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let step = step(now, held.as_ref(), validity);
    // Only a Secret with a CA is renewed or left; anything else (Fresh) gets a new CA.
    let next = match (step, &held) {
        (Step::Nothing, Some(held)) => {
            trust(client, &settings.configuration, &held.trusted.concat()).await?;
            let renew_at = held.leaf_expires - validity / 3;
            let ca_at = held.ca_expires - 2 * validity;
            let due = renew_at.min(ca_at) - now;
            return Ok(Duration::from_secs(u64::try_from(due.max(1)).unwrap_or(1)).min(LOOK_EVERY));
        }
        (Step::NewLeaf, Some(held)) => {
            // Served only once every configuration trusts the CA that signs it.
            trust(client, &settings.configuration, &held.trusted.concat()).await?;
            let (crt, key) = new_leaf(&held.ca_key, settings, validity)?;
            let mut data = data;
            data.insert(TLS_CRT.into(), ByteString(crt.into_bytes()));
            data.insert(TLS_KEY.into(), ByteString(key.into_bytes()));
            // The CAs that expired are trusted no more.
            let live: Vec<String> = held
                .trusted
                .iter()
                .filter(|pem| expiry(pem).is_ok_and(|t| t > now))
                .cloned()
                .collect();
            data.insert(CA_CRT.into(), ByteString(live.concat().into_bytes()));
            let annotations = [(SIGNED_BY.to_owned(), digest(&held.ca))].into();
            tracing::info!(secret = name, "webhook certificate: renewed");
            write(&api, name, existing, data, annotations)
                .await
                .map_err(secret_error)?;
            Duration::from_secs(1)
        }
        (_, previous) => {
            let (ca, ca_key) = new_ca(validity)?;
            let mut trusted = vec![ca.clone()];
            if let Some(h) = previous {
                trusted.extend(h.trusted.iter().cloned());
            }
            let mut data = data;
            data.insert(CA_CRT.into(), ByteString(trusted.concat().into_bytes()));
            data.insert(CA_KEY.into(), ByteString(ca_key.clone().into_bytes()));
            let mut annotations = BTreeMap::new();
            if step == Step::Fresh {
                let (crt, key) = new_leaf(&ca_key, settings, validity)?;
                data.insert(TLS_CRT.into(), ByteString(crt.into_bytes()));
                data.insert(TLS_KEY.into(), ByteString(key.into_bytes()));
                annotations.insert(SIGNED_BY.to_owned(), digest(&ca));
            }
            tracing::info!(
                secret = name,
                first = step == Step::Fresh,
                "webhook certificate: a new CA"
            );
            write(&api, name, existing, data, annotations)
                .await
                .map_err(secret_error)?;
            Duration::from_secs(1)
        }
    };
    Ok(next)
}

/// Creates the Secret, or replaces it at the version read (a conflict: another replica wrote
/// first, and the next round reads what it wrote).
async fn write(
    api: &Api<Secret>,
    name: &str,
    existing: Option<Secret>,
    data: BTreeMap<String, ByteString>,
    annotations: BTreeMap<String, String>,
) -> Result<(), kube::Error> {
    match existing {
        None => {
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(name.to_owned()),
                    annotations: Some(annotations),
                    ..ObjectMeta::default()
                },
                type_: Some("kubernetes.io/tls".into()),
                data: Some(data),
                ..Secret::default()
            };
            match api.create(&PostParams::default(), &secret).await {
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                other => other.map(drop),
            }
        }
        Some(mut secret) => {
            secret.data = Some(data);
            let mut all = secret.metadata.annotations.take().unwrap_or_default();
            all.extend(annotations);
            secret.metadata.annotations = Some(all);
            match api.replace(name, &PostParams::default(), &secret).await {
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                other => other.map(drop),
            }
        }
    }
}

/// The caBundles of a webhook configuration's webhooks (validating and mutating ones differ
/// only in their webhooks' type).
trait Bundles {
    const KIND: &'static str;
    fn bundles(&mut self) -> Vec<&mut Option<ByteString>>;
}

/// Both kinds keep their caBundles at `webhooks[*].clientConfig.caBundle`.
macro_rules! bundles_of {
    ($kind:ident) => {
        impl Bundles for $kind {
            const KIND: &'static str = stringify!($kind);
            fn bundles(&mut self) -> Vec<&mut Option<ByteString>> {
                self.webhooks
                    .iter_mut()
                    .flatten()
                    .map(|h| &mut h.client_config.ca_bundle)
                    .collect()
            }
        }
    };
}
bundles_of!(ValidatingWebhookConfiguration);
bundles_of!(MutatingWebhookConfiguration);

/// Sets `bundle` as the caBundle of every webhook of both configurations named `name` (one
/// not there yet is skipped: it is applied later and looked at again next round).
async fn trust(client: &Client, name: &str, bundle: &str) -> Result<(), IssueError> {
    let bundle = ByteString(bundle.as_bytes().to_vec());
    trust_in::<ValidatingWebhookConfiguration>(client, name, &bundle).await?;
    trust_in::<MutatingWebhookConfiguration>(client, name, &bundle).await
}

async fn trust_in<K>(client: &Client, name: &str, bundle: &ByteString) -> Result<(), IssueError>
where
    K: Bundles
        + kube::Resource<Scope = k8s_openapi::ClusterResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned,
{
    let api: Api<K> = Api::all(client.clone());
    let failed = |source| IssueError::Bundle {
        kind: K::KIND,
        name: name.to_owned(),
        source,
    };
    let Some(mut config) = api.get_opt(name).await.map_err(failed)? else {
        return Ok(());
    };
    let mut changed = false;
    for ca_bundle in config.bundles() {
        if ca_bundle.as_ref() != Some(bundle) {
            *ca_bundle = Some(bundle.clone());
            changed = true;
        }
    }
    if changed {
        api.replace(name, &PostParams::default(), &config)
            .await
            .map_err(failed)?;
        tracing::info!(
            kind = K::KIND,
            configuration = name,
            "webhook CA bundle updated"
        );
    }
    Ok(())
}

fn read(
    name: &str,
    data: &BTreeMap<String, ByteString>,
    signed_by: Option<&str>,
) -> Result<Held, IssueError> {
    let text = |key: &'static str| -> Result<String, IssueError> {
        let bytes = data.get(key).ok_or_else(|| IssueError::Unreadable {
            name: name.to_owned(),
            key,
            why: "missing".into(),
        })?;
        String::from_utf8(bytes.0.clone()).map_err(|e| IssueError::Unreadable {
            name: name.to_owned(),
            key,
            why: e.to_string(),
        })
    };
    let unreadable = |key: &'static str| {
        move |why: String| IssueError::Unreadable {
            name: name.to_owned(),
            key,
            why,
        }
    };
    let trusted = split_pems(&text(CA_CRT)?);
    let ca = trusted
        .first()
        .cloned()
        .ok_or_else(|| unreadable(CA_CRT)("no certificate".into()))?;
    let leaf = text(TLS_CRT)?;
    Ok(Held {
        ca_expires: expiry(&ca).map_err(unreadable(CA_CRT))?,
        leaf_expires: expiry(&leaf).map_err(unreadable(TLS_CRT))?,
        ca_key: text(CA_KEY)?,
        trusted,
        leaf_by_ca: signed_by == Some(digest(&ca).as_str()),
        ca,
    })
}

/// The PEM blocks of a bundle, each with its END line.
fn split_pems(bundle: &str) -> Vec<String> {
    const END: &str = "-----END CERTIFICATE-----";
    bundle
        .split_inclusive(END)
        .map(str::trim)
        .filter(|b| b.ends_with(END))
        .map(|b| format!("{b}\n"))
        .collect()
}

/// When the certificate in `pem` expires, in seconds since the epoch.
fn expiry(pem: &str) -> Result<i64, String> {
    let (_, block) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).map_err(|e| e.to_string())?;
    let cert = block.parse_x509().map_err(|e| e.to_string())?;
    Ok(cert.validity().not_after.timestamp())
}

/// Names a CA certificate: the first 16 hex digits of its PEM's SHA-256.
fn digest(pem: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, pem.trim().as_bytes());
    d.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

fn ca_params(not_after: OffsetDateTime) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.not_before = OffsetDateTime::now_utc() - time::Duration::minutes(5);
    params.not_after = not_after;
    params
}

/// A new CA living ten serving certificates' lifetimes: its certificate and key, PEM.
fn new_ca(validity: i64) -> Result<(String, String), rcgen::Error> {
    let key = KeyPair::generate()?;
    let params = ca_params(OffsetDateTime::now_utc() + time::Duration::seconds(10 * validity));
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A serving certificate for the settings' names, signed with the CA's key `ca_key`.
fn new_leaf(
    ca_key: &str,
    settings: &IssueSettings,
    validity: i64,
) -> Result<(String, String), IssueError> {
    let ca_key = KeyPair::from_pem(ca_key)?;
    // A signature takes the issuer's name, key usages and key: the CA's as `new_ca` made
    // them (its dates are not part of it).
    let issuer = Issuer::new(ca_params(OffsetDateTime::now_utc()), ca_key);
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(settings.names.clone())?;
    params.not_before = OffsetDateTime::now_utc() - time::Duration::minutes(5);
    params.not_after = OffsetDateTime::now_utc() + time::Duration::seconds(validity);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(ca_expires: i64, leaf_expires: i64, leaf_by_ca: bool, cas: usize) -> Held {
        Held {
            ca: "ca".into(),
            ca_key: "key".into(),
            trusted: vec!["ca".into(); cas],
            ca_expires,
            leaf_expires,
            leaf_by_ca,
        }
    }

    #[test]
    fn each_round_does_what_is_due() {
        let v = 90;
        assert_eq!(step(0, None, v), Step::Fresh);
        assert_eq!(step(0, Some(&held(900, 90, true, 1)), v), Step::Nothing);
        assert_eq!(
            step(61, Some(&held(900, 90, true, 1)), v),
            Step::NewLeaf,
            "a third left"
        );
        assert_eq!(
            step(0, Some(&held(900, 90, false, 2)), v),
            Step::NewLeaf,
            "signed by the old CA"
        );
        assert_eq!(
            step(721, Some(&held(900, 900, true, 1)), v),
            Step::NewCa,
            "two lifetimes left"
        );
        assert_eq!(
            step(721, Some(&held(900, 900, true, 2)), v),
            Step::Nothing,
            "the new CA is trusted already; the leaf follows when due"
        );
    }

    #[test]
    fn a_leaf_names_its_ca_and_the_service() {
        let (ca, ca_key) = new_ca(3600).unwrap();
        let settings = IssueSettings {
            names: vec!["csi-controller-webhook.ns.svc".into(), "127.0.0.1".into()],
            validity: Duration::from_secs(3600),
            configuration: "c".into(),
        };
        let (leaf, _) = new_leaf(&ca_key, &settings, 3600).unwrap();
        let (_, ca_block) = x509_parser::pem::parse_x509_pem(ca.as_bytes()).unwrap();
        let (_, leaf_block) = x509_parser::pem::parse_x509_pem(leaf.as_bytes()).unwrap();
        let ca_cert = ca_block.parse_x509().unwrap();
        let leaf_cert = leaf_block.parse_x509().unwrap();
        // The signature itself is checked by the API server (kube_webhook).
        assert_eq!(leaf_cert.issuer(), ca_cert.subject());
        assert!(ca_cert.is_ca() && !leaf_cert.is_ca());
        let names = format!(
            "{:?}",
            leaf_cert.subject_alternative_name().unwrap().unwrap().value
        );
        assert!(
            names.contains("csi-controller-webhook.ns.svc") && names.contains("127"),
            "{names}"
        );
        let left = expiry(&leaf).unwrap() - OffsetDateTime::now_utc().unix_timestamp();
        assert!((3500..=3600).contains(&left), "{left}");
        assert_eq!(
            split_pems(&format!("{ca}{leaf}")),
            vec![ca.clone(), leaf.clone()]
        );
    }
}
