//! The webhook's serving certificate, from a `kubernetes.io/tls` Secret (`tls.crt`,
//! `tls.key`) in the driver's namespace, swapped in whenever the Secret changes: a renewed
//! certificate needs no restart. Until the Secret is read, TLS handshakes fail (and the API
//! server applies the webhook's failure policy).

use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

#[derive(Debug, Default)]
pub struct CertSlot(RwLock<Option<Arc<CertifiedKey>>>);

impl ResolvesServerCert for CertSlot {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl CertSlot {
    /// Installs the pair, or says what is wrong with it (the old pair stays).
    pub fn load(&self, cert_pem: &[u8], key_pem: &[u8]) -> Result<(), String> {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("tls.crt: {e}"))?;
        if chain.is_empty() {
            return Err("tls.crt holds no certificate".into());
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("tls.key: {e}"))?;
        let signer = rustls::crypto::ring::sign::any_supported_type(&key)
            .map_err(|e| format!("tls.key: {e}"))?;
        let pair = CertifiedKey::new(chain, signer);
        pair.keys_match()
            .map_err(|e| format!("tls.crt and tls.key: {e}"))?;
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(pair));
        Ok(())
    }
}

/// Keeps `slot` loaded from the Secret `name` until aborted.
pub async fn follow_secret(client: Client, namespace: String, name: String, slot: Arc<CertSlot>) {
    let api: Api<Secret> = Api::namespaced(client, &namespace);
    let stream = crate::kube::watch_named(api, &name).applied_objects();
    tokio::pin!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(secret) => {
                let data = secret.data.unwrap_or_default();
                let (cert, key) = (data.get("tls.crt"), data.get("tls.key"));
                let result = match (cert, key) {
                    (Some(c), Some(k)) => slot.load(&c.0, &k.0),
                    _ => Err("the Secret needs tls.crt and tls.key".into()),
                };
                match result {
                    Ok(()) => tracing::info!(secret = %name, "webhook certificate loaded"),
                    Err(e) => {
                        tracing::error!(secret = %name, error = %e, "webhook certificate not usable")
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "webhook certificate Secret watch; retrying"),
        }
    }
}
