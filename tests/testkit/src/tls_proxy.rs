//! An NBD proxy that terminates TLS in front of a plaintext nbdkit: the one thing nbdkit cannot
//! do is send a TLS 1.3 KeyUpdate when a test asks, and a KeyUpdate is a record kernel TLS
//! on 6.1 and 6.12 cannot take. The proxy passes the newstyle greeting through, answers the
//! client's `NBD_OPT_STARTTLS` itself, does the TLS handshake as the server (rustls, with the
//! test PKI's server certificate), and then relays the decrypted option haggling and
//! transmission to nbdkit byte for byte.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use nbd::NbdUri;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

use crate::tls::TestPki;

const OPTION_MAGIC: u64 = 0x4948_4156_454F_5054; // "IHAVEOPT"
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const OPT_STARTTLS: u32 = 5;
const REP_ACK: u32 = 1;

#[derive(Debug)]
pub struct TlsTerminatingProxy {
    addr: SocketAddr,
    key_updates: broadcast::Sender<()>,
    accepted: Arc<AtomicUsize>,
    accept: JoinHandle<()>,
}

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl TlsTerminatingProxy {
    /// Listens on a loopback port; every client is relayed to `upstream` (plaintext NBD).
    pub async fn start(upstream: SocketAddr, pki: &TestPki) -> io::Result<Self> {
        let certs = CertificateDer::pem_file_iter(pki.file("server-cert.pem"))
            .map_err(other)?
            .collect::<Result<Vec<_>, _>>()
            .map_err(other)?;
        let key = PrivateKeyDer::from_pem_file(pki.file("server-key.pem")).map_err(other)?;
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(other)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(other)?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (key_updates, _) = broadcast::channel(4);
        let accepted = Arc::new(AtomicUsize::new(0));
        let accept = {
            let (key_updates, accepted) = (key_updates.clone(), Arc::clone(&accepted));
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let (acceptor, updates) = (acceptor.clone(), key_updates.subscribe());
                    tokio::spawn(async move {
                        let _ = relay(client, upstream, acceptor, updates).await;
                    });
                }
            })
        };
        Ok(Self {
            addr,
            key_updates,
            accepted,
            accept,
        })
    }

    /// `nbds://` for `export` through this proxy.
    pub fn uri(&self, export: &str) -> NbdUri {
        NbdUri::tcp("127.0.0.1", self.addr.port(), export).with_tls()
    }

    /// Every open connection sends a KeyUpdate now.
    pub fn key_update(&self) {
        let _ = self.key_updates.send(());
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for TlsTerminatingProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn relay(
    mut client: TcpStream,
    upstream: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    mut key_updates: broadcast::Receiver<()>,
) -> io::Result<()> {
    let mut server = TcpStream::connect(upstream).await?;
    // Greeting (magic, IHAVEOPT, handshake flags) down, client flags up.
    let mut greeting = [0u8; 18];
    server.read_exact(&mut greeting).await?;
    client.write_all(&greeting).await?;
    let mut flags = [0u8; 4];
    client.read_exact(&mut flags).await?;
    server.write_all(&flags).await?;
    // The client's first option must be STARTTLS: acknowledged here, not forwarded.
    let mut header = [0u8; 16];
    client.read_exact(&mut header).await?;
    let magic = u64::from_be_bytes(header[..8].try_into().map_err(other)?);
    let option = u32::from_be_bytes(header[8..12].try_into().map_err(other)?);
    if magic != OPTION_MAGIC || option != OPT_STARTTLS {
        return Err(other(format!("expected STARTTLS, got option {option}")));
    }
    let mut ack = Vec::with_capacity(20);
    ack.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    ack.extend_from_slice(&OPT_STARTTLS.to_be_bytes());
    ack.extend_from_slice(&REP_ACK.to_be_bytes());
    ack.extend_from_slice(&0u32.to_be_bytes());
    client.write_all(&ack).await?;
    let mut tls = acceptor.accept(client).await?;

    let (mut from_client, mut from_server) = (vec![0u8; 1 << 17], vec![0u8; 1 << 17]);
    loop {
        tokio::select! {
            n = tls.read(&mut from_client) => {
                let n = n?;
                if n == 0 { return Ok(()); }
                server.write_all(&from_client[..n]).await?;
            }
            n = server.read(&mut from_server) => {
                let n = n?;
                if n == 0 { return Ok(()); }
                tls.write_all(&from_server[..n]).await?;
                tls.flush().await?;
            }
            update = key_updates.recv() => {
                if update.is_ok() {
                    tls.get_mut().1.refresh_traffic_keys().map_err(other)?;
                    tls.flush().await?;
                }
            }
        }
    }
}
