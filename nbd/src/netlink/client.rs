//! A connection to the kernel's `nbd` generic-netlink family.
//!
//! Requests are sent from this process, which must own the socket descriptors they name: the
//! kernel resolves `NBD_SOCK_FD` in the sender's descriptor table and takes its own reference,
//! so callers close their copies once the request is acknowledged.

use neli::consts::nl::{NlmF, NlmsgerrAttr};
use neli::consts::socket::NlFamily;
use neli::err::RouterError;
use neli::genl::Genlmsghdr;
use neli::nl::NlPayload;
use neli::router::asynchronous::{NlRouter, NlRouterReceiverHandle};
use neli::utils::Groups;

use std::sync::Arc;

use super::consts::{NbdCmd, FAMILY_NAME, MCAST_GROUP};
use super::message::{self, ConnectRequest, DeviceStatus, NbdMessage, ReconfigureRequest};
use crate::identity::DeviceIndex;
use crate::sysfs::ProvenDevice;
use crate::Error;

/// A netlink socket bound to the `nbd` family. Cheap to share behind an `Arc`.
pub struct NbdNetlink {
    router: Arc<NlRouter>,
    family: u16,
}

impl std::fmt::Debug for NbdNetlink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdNetlink")
            .field("family", &self.family)
            .finish_non_exhaustive()
    }
}

impl NbdNetlink {
    /// Opens a socket and resolves the family. Fails with [`Error::ModuleNotLoaded`] when the
    /// kernel has no `nbd` family (module not loaded on kernels before 6.6, which do not
    /// autoload it on lookup).
    pub async fn open() -> Result<Self, Error> {
        let (router, _multicast) = NlRouter::connect(NlFamily::Generic, None, Groups::empty())
            .await
            .map_err(|e| Error::NetlinkSocket(e.to_string()))?;
        router
            .enable_ext_ack(true)
            .map_err(|e| Error::NetlinkSocket(e.to_string()))?;
        let family = resolve_family(&router).await?;
        Ok(Self {
            router: Arc::new(router),
            family,
        })
    }

    /// Attaches the given sockets to a device and returns its index. One attempt: EBUSY
    /// (device held open, or configured) and EINVAL on an explicit index (device still going
    /// down) are for the caller to judge and retry; see [`crate::attach`].
    pub async fn connect(&self, req: &ConnectRequest<'_>) -> Result<DeviceIndex, Error> {
        let msg = message::connect(req).map_err(|detail| Error::BadReply {
            op: "CONNECT",
            detail,
        })?;
        let device = req
            .index
            .map_or_else(|| "any free device".into(), |i| i.to_string());
        let replies = self.request("CONNECT", &device, msg).await?;
        let reply = replies.first().ok_or_else(|| Error::BadReply {
            op: "CONNECT",
            detail: "acknowledged without a reply carrying the index".into(),
        })?;
        message::parse_index(reply).map_err(|detail| Error::BadReply {
            op: "CONNECT",
            detail,
        })
    }

    /// Replaces dead connections of a device. The kernel checks that `identifier` matches the
    /// one the device was connected with, so this cannot act on another attachment's device.
    pub async fn reconfigure(&self, req: &ReconfigureRequest<'_>) -> Result<(), Error> {
        let msg = message::reconfigure(req).map_err(|detail| Error::BadReply {
            op: "RECONFIGURE",
            detail,
        })?;
        self.request("RECONFIGURE", &req.index.to_string(), msg)
            .await
            .map(drop)
    }

    /// RECONFIGURE sent only if `ready` holds, asked on the sending thread right before the
    /// send: nothing of this process runs between the check and the kernel's handling of the
    /// request. `Ok(false)` when it did not hold and nothing was sent. For a size change that
    /// must find the device idle (see [`NbdNetlink::request`]).
    pub async fn reconfigure_when(
        &self,
        req: &ReconfigureRequest<'_>,
        ready: impl FnOnce() -> bool + Send + 'static,
    ) -> Result<bool, Error> {
        let msg = message::reconfigure(req).map_err(|detail| Error::BadReply {
            op: "RECONFIGURE",
            detail,
        })?;
        Ok(self
            .request_when("RECONFIGURE", &req.index.to_string(), msg, ready)
            .await?
            .is_some())
    }

    /// Disconnects a device whose identity has been proven. I/O still in flight fails with
    /// EIO, so callers unmount and flush first.
    pub async fn disconnect(&self, device: &ProvenDevice) -> Result<(), Error> {
        let index = device.index();
        let msg = message::disconnect(index).map_err(|detail| Error::BadReply {
            op: "DISCONNECT",
            detail,
        })?;
        self.request("DISCONNECT", &index.to_string(), msg)
            .await
            .map(drop)
    }

    /// Status of one device, or of all devices the driver knows.
    pub async fn status(&self, index: Option<DeviceIndex>) -> Result<Vec<DeviceStatus>, Error> {
        let msg = message::status(index).map_err(|detail| Error::BadReply {
            op: "STATUS",
            detail,
        })?;
        let device = index.map_or_else(|| "all devices".into(), |i| i.to_string());
        let replies = self.request("STATUS", &device, msg).await?;
        let mut all = Vec::new();
        for reply in &replies {
            all.extend(
                message::parse_status(reply).map_err(|detail| Error::BadReply {
                    op: "STATUS",
                    detail,
                })?,
            );
        }
        Ok(all)
    }

    async fn request(
        &self,
        op: &'static str,
        device: &str,
        msg: NbdMessage,
    ) -> Result<Vec<NbdMessage>, Error> {
        Ok(self
            .request_when(op, device, msg, || true)
            .await?
            .unwrap_or_default())
    }

    /// Sends `msg` if `ready` holds on the sending thread; `None` when it did not.
    async fn request_when(
        &self,
        op: &'static str,
        device: &str,
        msg: NbdMessage,
        ready: impl FnOnce() -> bool + Send + 'static,
    ) -> Result<Option<Vec<NbdMessage>>, Error> {
        // The kernel runs nbd's handler inside our `sendmsg`, under the genl mutex every nbd
        // request of the machine shares, and a handler can wait there for tens of seconds: a
        // size RECONFIGURE freezes the queue until the I/O in flight ends (6.9 and later),
        // DISCONNECT sends on a socket that may be stalled. So the send runs on a blocking
        // thread: a runtime worker never waits for the kernel; the reply is awaited here.
        let (router, family) = (Arc::clone(&self.router), self.family);
        let runtime = tokio::runtime::Handle::current();
        let sent: Option<NlRouterReceiverHandle<u16, NbdMessage>> =
            tokio::task::spawn_blocking(move || {
                ready()
                    .then(|| {
                        runtime.block_on(router.send(family, NlmF::ACK, NlPayload::Payload(msg)))
                    })
                    .transpose()
            })
            .await
            .map_err(|e| Error::NetlinkSocket(format!("sending {op}: the sending thread: {e}")))?
            .map_err(|e| Error::NetlinkSocket(format!("sending {op}: {e}")))?;
        let Some(mut recv) = sent else {
            return Ok(None);
        };
        let mut replies = Vec::new();
        while let Some(next) = recv.next::<u16, NbdMessage>().await {
            match next {
                Ok(m) => {
                    if let Some(payload) = m.get_payload() {
                        replies.push(payload.clone());
                    }
                }
                Err(RouterError::Nlmsgerr(e)) => {
                    let message = e
                        .ext_ack()
                        .get_attr_handle()
                        .get_attr_payload_as_with_len::<String>(NlmsgerrAttr::Msg)
                        .unwrap_or_default();
                    return Err(Error::Kernel {
                        op,
                        device: device.to_owned(),
                        errno: -*e.error(),
                        message,
                    });
                }
                Err(e) => return Err(Error::NetlinkSocket(format!("{op} reply: {e}"))),
            }
        }
        Ok(Some(replies))
    }
}

async fn resolve_family(router: &NlRouter) -> Result<u16, Error> {
    router
        .resolve_genl_family(FAMILY_NAME)
        .await
        .map_err(|e| match e {
            RouterError::Nlmsgerr(ref m) if -*m.error() == libc::ENOENT => Error::ModuleNotLoaded,
            RouterError::Msg(_) => Error::ModuleNotLoaded,
            other => Error::NetlinkSocket(format!("resolving family {FAMILY_NAME:?}: {other}")),
        })
}

/// `NBD_CMD_LINK_DEAD` announcements: a device lost a connection and its I/O now waits for
/// RECONFIGURE, up to its dead-connection timeout.
pub struct LinkDeadEvents {
    _router: NlRouter,
    multicast: NlRouterReceiverHandle<u16, Genlmsghdr<u8, u16>>,
}

impl std::fmt::Debug for LinkDeadEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkDeadEvents").finish_non_exhaustive()
    }
}

impl LinkDeadEvents {
    /// Joins the family's multicast group. Only events after this call are seen.
    pub async fn subscribe() -> Result<Self, Error> {
        let (router, multicast) = NlRouter::connect(NlFamily::Generic, None, Groups::empty())
            .await
            .map_err(|e| Error::NetlinkSocket(e.to_string()))?;
        resolve_family(&router).await?;
        let group = router
            .resolve_nl_mcast_group(FAMILY_NAME, MCAST_GROUP)
            .await
            .map_err(|e| Error::NetlinkSocket(format!("resolving {MCAST_GROUP:?}: {e}")))?;
        router
            .add_mcast_membership(Groups::new_groups(&[group]))
            .map_err(|e| Error::NetlinkSocket(format!("joining {MCAST_GROUP:?}: {e}")))?;
        Ok(Self {
            _router: router,
            multicast,
        })
    }

    /// The next device whose link died. `None` when the socket is closed.
    pub async fn next(&mut self) -> Option<Result<DeviceIndex, Error>> {
        loop {
            let msg = match self.multicast.next::<u16, NbdMessage>().await? {
                Ok(m) => m,
                Err(e) => return Some(Err(Error::NetlinkSocket(format!("LINK_DEAD stream: {e}")))),
            };
            let Some(payload) = msg.get_payload() else {
                continue;
            };
            if *payload.cmd() != NbdCmd::LinkDead {
                continue;
            }
            return Some(
                message::parse_index(payload).map_err(|detail| Error::BadReply {
                    op: "LINK_DEAD",
                    detail,
                }),
            );
        }
    }
}
