//! A TCP proxy in front of a real NBD server that can break the link the ways the field does:
//! a reply the kernel did not ask for (what the kernel's "Unexpected reply" / "Double reply"
//! drops look like) and a network that silently stops delivering (a cut cable).
//!
//! Forwarding is byte-for-byte. An injected reply is written between two forwarded chunks; on
//! loopback the server's 16-byte write replies arrive whole, so it does not split one.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use nbd::NbdUri;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// NBD_SIMPLE_REPLY_MAGIC.
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

#[derive(Debug)]
struct Link {
    to_client: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    blackholed: Arc<AtomicBool>,
}

#[derive(Debug, Default)]
struct Links {
    open: Mutex<Vec<Link>>,
    accepted: AtomicUsize,
}

#[derive(Debug)]
pub struct NbdProxy {
    addr: SocketAddr,
    links: Arc<Links>,
    accept: JoinHandle<()>,
}

impl NbdProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let links = Arc::new(Links::default());
        let accept = {
            let links = Arc::clone(&links);
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    links.accepted.fetch_add(1, Ordering::SeqCst);
                    let (mut client_r, client_w) = client.into_split();
                    let (mut server_r, mut server_w) = server.into_split();
                    let to_client = Arc::new(tokio::sync::Mutex::new(client_w));
                    let blackholed = Arc::new(AtomicBool::new(false));
                    links
                        .open
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(Link {
                            to_client: Arc::clone(&to_client),
                            blackholed: Arc::clone(&blackholed),
                        });
                    let hole = Arc::clone(&blackholed);
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 256 * 1024];
                        while let Ok(n) = client_r.read(&mut buf).await {
                            if n == 0 {
                                break;
                            }
                            // A cut network: the bytes are accepted here and never delivered.
                            if !hole.load(Ordering::SeqCst)
                                && server_w.write_all(&buf[..n]).await.is_err()
                            {
                                break;
                            }
                        }
                    });
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 256 * 1024];
                        while let Ok(n) = server_r.read(&mut buf).await {
                            if n == 0 || blackholed.load(Ordering::SeqCst) {
                                if n == 0 {
                                    break;
                                }
                                continue;
                            }
                            if to_client.lock().await.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    });
                }
            })
        };
        Ok(Self {
            addr,
            links,
            accept,
        })
    }

    pub fn uri(&self, export: &str) -> NbdUri {
        NbdUri::tcp("127.0.0.1", self.addr.port(), export)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.links.accepted.load(Ordering::SeqCst)
    }

    fn current(&self) -> Vec<(Arc<tokio::sync::Mutex<OwnedWriteHalf>>, Arc<AtomicBool>)> {
        self.links
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|l| (Arc::clone(&l.to_client), Arc::clone(&l.blackholed)))
            .collect()
    }

    /// Sends every open connection a reply to a request that was never made.
    pub async fn inject_unexpected_reply(&self) {
        let mut reply = Vec::with_capacity(16);
        reply.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        reply.extend_from_slice(&0u32.to_be_bytes());
        reply.extend_from_slice(&u64::MAX.to_be_bytes());
        for (to_client, _) in self.current() {
            let _ = to_client.lock().await.write_all(&reply).await;
        }
    }

    /// From now on, nothing passes on the connections open now (new ones work).
    pub fn blackhole_open_connections(&self) {
        for (_, hole) in self.current() {
            hole.store(true, Ordering::SeqCst);
        }
    }
}

impl Drop for NbdProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
