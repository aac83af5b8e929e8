//! NBD over TLS with the kernel owning the data path: STARTTLS and the TLS handshake in user
//! space (rustls), the rest of the NBD handshake inside TLS, then the session's keys installed on
//! the socket as kernel TLS (the `ktls` crate: `TCP_ULP "tls"`, `SOL_TLS` TX and RX) before the
//! socket goes to the nbd driver. From then on the kernel encrypts and decrypts; no process sits
//! in the data path.
//!
//! Only AES-GCM suites are offered: they are what the kernel's TLS implements on every supported
//! line (with the `tls`, `gcm` and AES modules). TLS 1.3 is preferred. A record the kernel
//! cannot take as data after the handover (a KeyUpdate, a late session ticket) ends the
//! connection, which the healer treats as any dead link: redial, new handshake, RECONFIGURE.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;

use crate::handshake::{self, ExportInfo};
use crate::uri::NbdUri;
use crate::Error;

/// Where the TLS material of a connection lives. The files are read at every dial, so a
/// certificate replaced on disk is used from the next connection on (a restart is not needed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM bundle of the CAs that sign the servers' certificates.
    pub ca: PathBuf,
    /// PEM client certificate chain and its key, when the server wants client authentication.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    /// The name the server's certificate must carry; the URI's host when `None`.
    pub server_name: Option<String>,
}

/// Why a TLS dial failed before the socket could be handed over.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {what} {path}: {reason}")]
    Material {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("the TLS configuration is unusable: {0}")]
    Config(String),
    #[error("{0:?} is not a valid TLS server name")]
    ServerName(String),
    #[error("an nbds:// URI needs TLS material: a node-stage secret with ca.crt (the StorageClass names it), or tls-ca-file in the node's configuration")]
    NotConfigured,
    #[error("TLS handshake: {0}")]
    Handshake(std::io::Error),
    #[error(
        "installing kernel TLS on the socket (are the tls and AES-GCM modules loadable?): {0}"
    )]
    Kernel(String),
    #[error("the server sent {0} bytes before any request: not a socket the kernel can take")]
    Unexpected(usize),
}

impl TlsFiles {
    /// A client configuration from the files as they are now.
    fn client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        let mut roots = RootCertStore::empty();
        for cert in read_certs(&self.ca, "CA bundle")? {
            roots
                .add(cert)
                .map_err(|e| material("CA bundle", &self.ca, e))?;
        }
        let provider = Arc::new(aes_gcm_only());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_root_certificates(roots);
        let mut config = match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(key)) => {
                let chain = read_certs(cert, "client certificate")?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| material("client key", key, e))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| TlsError::Config(e.to_string()))?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => {
                return Err(TlsError::Config(
                    "a client certificate needs its key, and a key its certificate".into(),
                ))
            }
        };
        // What lets the keys be installed in the kernel after the handshake.
        config.enable_secret_extraction = true;
        Ok(Arc::new(config))
    }
}

fn material(what: &'static str, path: &Path, e: impl std::fmt::Display) -> TlsError {
    TlsError::Material {
        what,
        path: path.to_owned(),
        reason: e.to_string(),
    }
}

fn read_certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| material(what, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| material(what, path, e))?;
    if certs.is_empty() {
        return Err(material(what, path, "no certificate in the file"));
    }
    Ok(certs)
}

/// ring's provider with the AES-GCM suites only (the kernel has no ChaCha20 on older lines).
fn aes_gcm_only() -> rustls::crypto::CryptoProvider {
    use rustls::crypto::ring::cipher_suite::*;
    rustls::crypto::CryptoProvider {
        cipher_suites: vec![
            TLS13_AES_128_GCM_SHA256,
            TLS13_AES_256_GCM_SHA384,
            TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
            TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        ],
        ..rustls::crypto::ring::default_provider()
    }
}

/// One TLS connection to `uri`'s server at `host`: greeting, STARTTLS, TLS handshake, the
/// export chosen inside TLS, kernel TLS installed. Returns a socket ready for the kernel.
pub(crate) async fn handshake(
    uri: &NbdUri,
    grant: Option<&crate::Grant>,
    host: &str,
    mut tcp: TcpStream,
    files: &TlsFiles,
) -> Result<(ExportInfo, OwnedFd), Error> {
    let tls_error = |source: TlsError| Error::Tls {
        uri: uri.to_string(),
        source,
    };
    let handshake_error = |source| Error::Handshake {
        uri: uri.to_string(),
        source,
    };
    let config = files.client_config().map_err(tls_error)?;
    let name = files.server_name.clone().unwrap_or_else(|| host.to_owned());
    let server_name =
        ServerName::try_from(name.clone()).map_err(|_| tls_error(TlsError::ServerName(name)))?;

    let greeting = handshake::greet(&mut tcp).await.map_err(handshake_error)?;
    handshake::start_tls(&mut tcp, &greeting)
        .await
        .map_err(handshake_error)?;
    // The cork lets ktls stop rustls at a record boundary, so nothing the kernel must decrypt
    // is left in user space.
    let mut tls = tokio_rustls::TlsConnector::from(config)
        .connect(server_name, ktls::CorkStream::new(tcp))
        .await
        .map_err(|e| tls_error(TlsError::Handshake(e)))?;
    let mut info = handshake::select_export(&mut tls, &greeting, uri.export(), grant)
        .await
        .map_err(handshake_error)?;
    let session = &tls.get_ref().1;
    info.tls = Some(crate::handshake::TlsSession {
        version: session
            .protocol_version()
            .and_then(|v| v.as_str())
            .unwrap_or("unknown"),
        cipher: session
            .negotiated_cipher_suite()
            .and_then(|s| s.suite().as_str())
            .unwrap_or("unknown"),
    });
    let ktls = ktls::config_ktls_client(tls)
        .await
        .map_err(|e| tls_error(TlsError::Kernel(e.to_string())))?;
    let (drained, tcp) = ktls.into_raw();
    if let Some(extra) = drained.filter(|d| !d.is_empty()) {
        return Err(tls_error(TlsError::Unexpected(extra.len())));
    }
    let std = tcp.into_std().map_err(|source| Error::Connect {
        uri: uri.to_string(),
        source,
    })?;
    Ok((info, std.into()))
}
