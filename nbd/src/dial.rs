//! Dialing an export: connect, handshake under a deadline, and return blocking sockets ready to
//! be handed to the kernel.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tokio::net::{TcpStream, UnixStream};
use tokio::task::JoinSet;

use crate::grant::Grant;
use crate::handshake::{self, ExportInfo};
use crate::tls::TlsFiles;
use crate::uri::{Endpoint, NbdUri};
use crate::Error;

/// The kernel refuses more sockets than this makes sense for; it is also the range the CSI
/// parameter `nbdConnections` accepts.
pub const MAX_CONNECTIONS: u8 = 16;

/// How to dial an export.
#[derive(Debug, Clone)]
pub struct DialOptions {
    /// Bound on connect plus handshake, per connection.
    pub deadline: Duration,
    /// Connections wanted; more than one only if the export advertises CAN_MULTI_CONN.
    pub connections: u8,
    /// TLS material for `nbds://` exports (ignored by plaintext ones).
    pub tls: Option<Arc<TlsFiles>>,
    /// The node's fencing grant for the export, asked for as `<export>@<token>`.
    pub grant: Option<Grant>,
}

impl Default for DialOptions {
    fn default() -> Self {
        Self {
            deadline: Duration::from_secs(10),
            connections: 1,
            tls: None,
            grant: None,
        }
    }
}

/// Sockets that completed the handshake for one export, all seeing the same export.
#[derive(Debug)]
pub struct Dialed {
    pub info: ExportInfo,
    pub sockets: Vec<OwnedFd>,
}

/// Dials `uri` and negotiates `opts.connections` connections. If more than one is wanted and
/// the export does not advertise CAN_MULTI_CONN, one connection is returned with a warning:
/// the kernel would refuse several, and a volume on one connection still works.
pub async fn dial(uri: &NbdUri, opts: &DialOptions) -> Result<Dialed, Error> {
    if opts.connections == 0 || opts.connections > MAX_CONNECTIONS {
        return Err(Error::InvalidConnections(opts.connections));
    }
    let (info, first) = dial_one(uri, opts).await?;
    let mut sockets = vec![first];
    let wanted = if opts.connections > 1 && !info.multi_conn() {
        tracing::warn!(
            %uri,
            wanted = opts.connections,
            "export does not advertise CAN_MULTI_CONN; using one connection"
        );
        1
    } else {
        opts.connections
    };

    let mut rest = JoinSet::new();
    for _ in 1..wanted {
        let uri = uri.clone();
        let opts = opts.clone();
        rest.spawn(async move { dial_one(&uri, &opts).await });
    }
    while let Some(joined) = rest.join_next().await {
        let (other, socket) = joined.map_err(|e| Error::Internal(e.to_string()))??;
        if other.size != info.size || other.flags != info.flags {
            return Err(Error::ExportChanged {
                first: Box::new(info),
                later: Box::new(other),
            });
        }
        sockets.push(socket);
    }
    Ok(Dialed { info, sockets })
}

/// One connection: connect and handshake (with TLS for `nbds://`) within `opts.deadline`.
pub async fn dial_one(uri: &NbdUri, opts: &DialOptions) -> Result<(ExportInfo, OwnedFd), Error> {
    let deadline = opts.deadline;
    let grant = opts.grant.as_ref();
    // The TLS files an nbds:// export needs, checked before anything is dialed: no server
    // answer can make up for their absence.
    let tls = match (uri.tls(), opts.tls.as_deref()) {
        (true, None) => {
            return Err(Error::Tls {
                uri: uri.to_string(),
                source: crate::tls::TlsError::NotConfigured,
            })
        }
        (true, files) => files,
        (false, _) => None,
    };
    let connect_error = |source: std::io::Error| Error::Connect {
        uri: uri.to_string(),
        source,
    };
    let attempt = async {
        let (info, fd): (ExportInfo, OwnedFd) = match uri.endpoint() {
            Endpoint::Tcp { host, port } => {
                let mut stream = TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(connect_error)?;
                tune_tcp(&stream).map_err(connect_error)?;
                if let Some(files) = tls {
                    crate::tls::handshake(uri, grant, host, stream, files).await?
                } else {
                    let info = negotiate(uri, grant, &mut stream).await?;
                    (info, stream.into_std().map_err(connect_error)?.into())
                }
            }
            Endpoint::Unix { socket } => {
                let mut stream = UnixStream::connect(socket).await.map_err(connect_error)?;
                let info = negotiate(uri, grant, &mut stream).await?;
                (info, stream.into_std().map_err(connect_error)?.into())
            }
        };
        Ok((info, blocking(fd)?))
    };
    tokio::time::timeout(deadline, attempt)
        .await
        .map_err(|_| Error::DialTimeout {
            uri: uri.to_string(),
            deadline,
        })?
}

async fn negotiate<S>(
    uri: &NbdUri,
    grant: Option<&Grant>,
    stream: &mut S,
) -> Result<ExportInfo, Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    handshake::negotiate(stream, uri.export(), grant)
        .await
        .map_err(|source| Error::Handshake {
            uri: uri.to_string(),
            source,
        })
}

/// Requests are small and latency-bound, and a silently cut network must surface as a dead
/// link (so it gets healed) rather than a hang: no Nagle, and keepalive probes.
fn tune_tcp(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let keepalive = TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    SockRef::from(stream).set_tcp_keepalive(&keepalive)
}

/// The kernel drives the socket itself; clear the O_NONBLOCK tokio set so the file the kernel
/// inherits behaves like the one nbd-client hands over.
fn blocking(fd: OwnedFd) -> Result<OwnedFd, Error> {
    SockRef::from(&fd)
        .set_nonblocking(false)
        .map_err(|e| Error::Internal(format!("clearing O_NONBLOCK: {e}")))?;
    Ok(fd)
}
