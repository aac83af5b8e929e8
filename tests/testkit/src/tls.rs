//! Certificates made for a test: a CA, a server certificate for loopback signed by it (laid out
//! as nbdkit's `--tls-certificates` directory wants), and a client certificate.

use std::io;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// A directory of PEM files: `ca-cert.pem`, `server-cert.pem`, `server-key.pem`,
/// `client-cert.pem`, `client-key.pem`.
#[derive(Debug)]
pub struct TestPki {
    dir: tempfile::TempDir,
}

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl TestPki {
    /// A CA named `ca_name` and certificates for 127.0.0.1/localhost and a client.
    pub fn new(ca_name: &str) -> io::Result<Self> {
        Self::build(ca_name, false)
    }

    /// As [`TestPki::new`], but the server's certificate expired years ago.
    pub fn with_expired_server(ca_name: &str) -> io::Result<Self> {
        Self::build(ca_name, true)
    }

    fn build(ca_name: &str, expired_server: bool) -> io::Result<Self> {
        let dir = tempfile::Builder::new().prefix("pki").tempdir()?;
        let ca_key = KeyPair::generate().map_err(other)?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(other)?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, ca_name);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).map_err(other)?;
        std::fs::write(dir.path().join("ca-cert.pem"), ca_cert.pem())?;
        let issuer = Issuer::new(ca, ca_key);

        for (name, sans, usage) in [
            (
                "server",
                vec!["127.0.0.1".to_owned(), "localhost".to_owned()],
                ExtendedKeyUsagePurpose::ServerAuth,
            ),
            (
                "client",
                vec!["client".to_owned()],
                ExtendedKeyUsagePurpose::ClientAuth,
            ),
        ] {
            let key = KeyPair::generate().map_err(other)?;
            let mut params = CertificateParams::new(sans).map_err(other)?;
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![usage];
            if expired_server && name == "server" {
                params.not_before = rcgen::date_time_ymd(2020, 1, 1);
                params.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }
            let cert = params.signed_by(&key, &issuer).map_err(other)?;
            std::fs::write(dir.path().join(format!("{name}-cert.pem")), cert.pem())?;
            std::fs::write(
                dir.path().join(format!("{name}-key.pem")),
                key.serialize_pem(),
            )?;
        }
        Ok(Self { dir })
    }

    /// The directory for nbdkit's `--tls-certificates`.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// nbdkit options that require TLS with these certificates, clients' included.
    pub fn nbdkit_args(&self) -> [String; 3] {
        [
            "--tls=require".to_owned(),
            format!("--tls-certificates={}", self.dir().display()),
            "--tls-verify-peer".to_owned(),
        ]
    }

    /// Replaces this directory's files with `other`'s (a certificate rotation in place).
    pub fn replace_with(&self, other: &TestPki) -> io::Result<()> {
        for name in [
            "ca-cert.pem",
            "server-cert.pem",
            "server-key.pem",
            "client-cert.pem",
            "client-key.pem",
        ] {
            std::fs::copy(other.file(name), self.file(name))?;
        }
        Ok(())
    }

    /// A `[tls-profile.<name>]` table of the node configuration with these files.
    pub fn profile_config(&self, name: &str) -> String {
        format!("[tls-profile.{name}]\n{}", self.file_keys(""))
    }

    /// Node configuration lines (TOML) pointing the daemon at the CA and client files.
    pub fn node_config(&self) -> String {
        self.file_keys("tls-")
    }

    /// `<prefix>ca-file`, `<prefix>cert-file` and `<prefix>key-file` lines naming these files.
    fn file_keys(&self, prefix: &str) -> String {
        format!(
            "{prefix}ca-file = \"{}\"\n{prefix}cert-file = \"{}\"\n{prefix}key-file = \"{}\"\n",
            self.file("ca-cert.pem").display(),
            self.file("client-cert.pem").display(),
            self.file("client-key.pem").display()
        )
    }
}

/// AES-128-GCM sealing throughput on one thread in MiB/s (ring, 16 KiB records as TLS sends
/// them): the crypto ceiling a TLS data path on this machine cannot exceed per core.
pub fn aes_gcm_seal_mib_per_s(total: usize) -> f64 {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};
    const RECORD: usize = 16 << 10;
    let key = LessSafeKey::new(
        UnboundKey::new(&AES_128_GCM, &[7u8; 16]).unwrap_or_else(|e| panic!("{e}")),
    );
    let mut record = vec![0x5au8; RECORD];
    let started = std::time::Instant::now();
    for seq in 0..(total / RECORD) as u64 {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&seq.to_be_bytes());
        let tag = key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::empty(),
                &mut record,
            )
            .unwrap_or_else(|e| panic!("{e}"));
        let _ = std::hint::black_box(tag);
    }
    (total >> 20) as f64 / started.elapsed().as_secs_f64()
}
