//! The gate in front of nbdkit: one connection's NBD handshake, read option by option, so no
//! export is opened without a live grant. The node dials `<image>@<token>`; the gate checks
//! the token against the image's grants as stored now, and forwards the option to nbdkit
//! with the name rewritten to `<image>`, or refuses it itself. After the handshake it copies
//! both ways, registered in [`Sessions`] so a revoke can cut it.
//!
//! Options the gate cannot check are answered here, never forwarded: after STARTTLS it could
//! not read the name any more, and LIST would name every image. A read-only grant is served
//! by the read-only nbdkit ([`upstream`](super::upstream)).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use nbd::protocol::{opt, rep, OPT_REPLY_MAGIC};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

use super::sessions::{Registration, Sessions};
use super::upstream::{Sockets, Upstream, OPT_STRUCTURED_REPLY};
use super::wire::{expect_magic, io, read_len, read_option, send_option, write_reply, MAX_LEN};
use crate::backend::grants::split_export_name;
use crate::backend::local::LocalError;
use crate::backend::Grant;
use crate::metrics::GateMetrics;

/// Option codes the client crate does not name.
const OPT_LIST: u32 = 3;
const OPT_INFO: u32 = 6;

/// A handshake that takes longer holds a connection for nothing.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(30);
/// How long a cut connection waits for nbdkit to finish what was forwarded before the cut.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

/// What a node without a live grant is told (the node daemon tells it from an outage).
pub const REFUSAL: &str =
    "no live grant for this node: the volume is published elsewhere or was unpublished";

/// Where the gate reads grants: the store the backend writes them to, read anew for every
/// handshake.
pub trait GrantLookup: Send + Sync + std::fmt::Debug {
    /// The live grants of `image` (none for an image without metadata).
    fn grants(&self, image: &str) -> Result<BTreeMap<String, Grant>, LocalError>;
}

/// Why a connection through the gate ended early. Logged only: no RPC answers with it.
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    #[error("cannot reach nbdkit at {}: {source}", socket.display())]
    Upstream {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("{during}: {source}")]
    Io {
        during: &'static str,
        source: std::io::Error,
    },
    #[error("{during}: bad magic {got:#018x}")]
    BadMagic { during: &'static str, got: u64 },
    #[error("{during}: {len} bytes, more than the {MAX_LEN} allowed")]
    Oversized { during: &'static str, len: u32 },
    #[error("the handshake took longer than {HANDSHAKE_DEADLINE:?}")]
    Deadline,
    #[error("reading the grants of {image}: {source}")]
    Grants { image: String, source: LocalError },
    #[error("the read-only nbdkit does not greet or negotiate as the writable one does")]
    UpstreamsDiffer,
}

/// Why a handshake was refused, as the metric labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The name carries no token.
    NoToken,
    /// The name is not an image name.
    BadName,
    /// No live grant of the image has that token.
    NoGrant,
}

impl Refusal {
    fn as_str(self) -> &'static str {
        match self {
            Refusal::NoToken => "no_token",
            Refusal::BadName => "bad_name",
            Refusal::NoGrant => "no_grant",
        }
    }
}

enum Admission {
    Granted {
        image: String,
        read_only: bool,
        registration: Registration,
    },
    Refused,
}

#[derive(Debug)]
pub struct Gate {
    pub lookup: Arc<dyn GrantLookup>,
    pub sessions: Arc<Sessions>,
    pub metrics: Arc<GateMetrics>,
    /// nbdkit's unix sockets.
    pub upstreams: Sockets,
}

impl Gate {
    /// Serves one client connection to its end.
    pub async fn serve(&self, mut client: TcpStream, peer: SocketAddr) -> Result<(), GateError> {
        let _ = client.set_nodelay(true);
        let handshake = self.handshake(&mut client, peer);
        let Some((registration, server)) = tokio::time::timeout(HANDSHAKE_DEADLINE, handshake)
            .await
            .map_err(|_| GateError::Deadline)??
        else {
            return Ok(());
        };
        relay(client, server, registration).await;
        Ok(())
    }

    /// The handshake up to transmission: the grant's registration and nbdkit's connection,
    /// or `None` when the connection is to be closed.
    async fn handshake(
        &self,
        client: &mut TcpStream,
        peer: SocketAddr,
    ) -> Result<Option<(Registration, UnixStream)>, GateError> {
        let mut server = Upstream::open(&self.upstreams).await?;
        client
            .write_all(server.greeting())
            .await
            .map_err(io("greeting"))?;
        let flags = client.read_u32().await.map_err(io("client flags"))?;
        server.send_flags(flags).await?;
        loop {
            let (option, data) = read_option(client).await?;
            match option {
                opt::GO | OPT_INFO => {
                    let Some(request) = NamedOption::parse(&data) else {
                        reply(client, option, rep::ERR_INVALID, "malformed option").await?;
                        continue;
                    };
                    match self.admit(&request.name, peer)? {
                        Admission::Refused => {
                            reply(client, option, rep::ERR_POLICY, REFUSAL).await?;
                        }
                        Admission::Granted {
                            image,
                            read_only,
                            registration,
                        } => {
                            server.serve(&self.upstreams, read_only).await?;
                            let renamed = request.renamed(&image);
                            send_option(server.stream(), option, &renamed).await?;
                            let acked = relay_replies(server.stream(), client, option).await?;
                            if option == opt::GO && acked {
                                return Ok(Some((registration, server.into_stream())));
                            }
                        }
                    }
                }
                opt::EXPORT_NAME => {
                    let name = String::from_utf8_lossy(&data).into_owned();
                    // EXPORT_NAME has no error reply: a refusal hangs up.
                    let Admission::Granted {
                        image,
                        read_only,
                        registration,
                    } = self.admit(&name, peer)?
                    else {
                        return Ok(None);
                    };
                    server.serve(&self.upstreams, read_only).await?;
                    send_option(server.stream(), option, image.as_bytes()).await?;
                    return Ok(Some((registration, server.into_stream())));
                }
                opt::ABORT => {
                    reply(client, option, rep::ACK, "").await?;
                    return Ok(None);
                }
                OPT_STRUCTURED_REPLY => {
                    send_option(server.stream(), option, &data).await?;
                    if relay_replies(server.stream(), client, option).await? {
                        server.structured();
                    }
                }
                opt::STARTTLS => {
                    let why = "STARTTLS is not offered: the gate must read the export name";
                    reply(client, option, rep::ERR_POLICY, why).await?;
                }
                OPT_LIST => {
                    reply(client, option, rep::ERR_POLICY, "exports are not listed").await?;
                }
                _ => reply(client, option, rep::ERR_UNSUP, "").await?,
            }
        }
    }

    /// Whether `name` (`<image>@<token>`) opens an export now. A granted connection is
    /// registered before the grants are read the second time: a revoke that removes the
    /// grant after that read finds the registration and cuts it.
    fn admit(&self, name: &str, peer: SocketAddr) -> Result<Admission, GateError> {
        let (image, token) = split_export_name(name);
        let refused = |reason: Refusal, node: Option<&str>| {
            self.metrics.refused(reason.as_str());
            // Never the token: it is a credential.
            tracing::warn!(
                image,
                node = node.unwrap_or("unknown"),
                %peer,
                reason = reason.as_str(),
                "NBD handshake refused: no live grant"
            );
            Ok(Admission::Refused)
        };
        let Some(token) = token else {
            return refused(Refusal::NoToken, None);
        };
        if crate::ids::valid_image(image).is_err() {
            return refused(Refusal::BadName, None);
        }
        let Some((node, grant)) = self.holder(image, token)? else {
            return refused(Refusal::NoGrant, None);
        };
        let registration = self.sessions.register(image, &node);
        if self.holder(image, token)?.map(|(n, _)| n).as_deref() != Some(node.as_str()) {
            return refused(Refusal::NoGrant, Some(&node));
        }
        tracing::debug!(image, node, %peer, read_only = grant.readonly, "NBD handshake admitted");
        Ok(Admission::Granted {
            image: image.to_owned(),
            read_only: grant.readonly,
            registration,
        })
    }

    /// The node whose live grant of `image` has `token`, and the grant.
    fn holder(&self, image: &str, token: &str) -> Result<Option<(String, Grant)>, GateError> {
        let grants = self
            .lookup
            .grants(image)
            .map_err(|source| GateError::Grants {
                image: image.to_owned(),
                source,
            })?;
        Ok(grants.into_iter().find(|(_, g)| g.token.matches(token)))
    }
}

/// Copies both ways until either side ends, or until the grant is revoked: then the node's
/// socket is closed at once, and nbdkit is given until [`DRAIN_DEADLINE`] to finish what was
/// forwarded before, so a revoke returns after the last write it let through.
async fn relay(mut client: TcpStream, mut server: UnixStream, mut registration: Registration) {
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        () = registration.cut() => {
            drop(client);
            let _ = server.shutdown().await;
            let mut sink = tokio::io::sink();
            let drain = tokio::io::copy(&mut server, &mut sink);
            let _ = tokio::time::timeout(DRAIN_DEADLINE, drain).await;
        }
    }
    drop(registration);
}

/// The data of GO and INFO: the export name, then the information requests.
struct NamedOption {
    name: String,
    /// What follows the name (the count and the requests), forwarded as it came.
    rest: Vec<u8>,
}

impl NamedOption {
    fn parse(data: &[u8]) -> Option<Self> {
        let len = u32::from_be_bytes(data.get(..4)?.try_into().ok()?);
        let end = 4usize.checked_add(usize::try_from(len).ok()?)?;
        let name = std::str::from_utf8(data.get(4..end)?).ok()?.to_owned();
        let rest = data.get(end..)?.to_vec();
        // The request count, and two bytes per request.
        let count = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?);
        (rest.len() == 2 + 2 * usize::from(count)).then_some(Self { name, rest })
    }

    /// The same option for the export `name`.
    fn renamed(&self, name: &str) -> Vec<u8> {
        let mut data = Vec::with_capacity(4 + name.len() + self.rest.len());
        // An image name is at most 128 bytes.
        data.extend_from_slice(&u32::try_from(name.len()).unwrap_or(u32::MAX).to_be_bytes());
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&self.rest);
        data
    }
}

async fn reply(
    client: &mut TcpStream,
    option: u32,
    kind: u32,
    message: &str,
) -> Result<(), GateError> {
    write_reply(client, option, kind, message.as_bytes()).await
}

/// Relays nbdkit's replies to `option` up to its final one: whether that was an ACK.
async fn relay_replies(
    server: &mut UnixStream,
    client: &mut TcpStream,
    option: u32,
) -> Result<bool, GateError> {
    const DURING: &str = "nbdkit's option reply";
    loop {
        expect_magic(server, OPT_REPLY_MAGIC, DURING).await?;
        let replied = server.read_u32().await.map_err(io(DURING))?;
        let kind = server.read_u32().await.map_err(io(DURING))?;
        let data = read_len(server, DURING).await?;
        write_reply(client, replied, kind, &data).await?;
        if kind == rep::ACK {
            return Ok(true);
        }
        if kind & rep::FLAG_ERROR != 0 || replied != option {
            return Ok(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_renamed_go_keeps_its_requests_and_fixes_the_length() {
        let mut data = 9u32.to_be_bytes().to_vec();
        data.extend_from_slice(b"pvc-1@tok");
        data.extend_from_slice(&1u16.to_be_bytes());
        data.extend_from_slice(&3u16.to_be_bytes());
        let parsed = NamedOption::parse(&data).unwrap();
        assert_eq!(parsed.name, "pvc-1@tok");
        let renamed = parsed.renamed("pvc-1");
        let mut expected = 5u32.to_be_bytes().to_vec();
        expected.extend_from_slice(b"pvc-1");
        expected.extend_from_slice(&[0, 1, 0, 3]);
        assert_eq!(renamed, expected);
        assert!(
            NamedOption::parse(&data[..data.len() - 1]).is_none(),
            "short"
        );
        assert!(
            NamedOption::parse(&[0, 0, 0, 200, b'a']).is_none(),
            "name past the end"
        );
    }
}
