//! Aborting one TCP connection by its address pair (`SOCK_DESTROY`, as `ss -K` does).
//!
//! The kernel holds the only reference to the sockets of a device attached by an earlier run
//! of the daemon. When they must be replaced (the export grew and its server keeps each
//! connection's size fixed), aborting them makes the kernel mark the links dead; the healer then
//! gives the device new connections. Needs `CONFIG_INET_DIAG_DESTROY` (set in the Debian,
//! Ubuntu and RED OS kernels) and the `tcp_diag` module, which the kernel loads on demand.

use std::io;
use std::net::{IpAddr, SocketAddr};

use neli::consts::nl::NlmF;
use neli::consts::socket::NlFamily;
use neli::nl::{NlPayload, NlmsghdrBuilder};
use neli::socket::synchronous::NlSocketHandle;
use neli::types::Buffer;
use neli::utils::Groups;

use crate::Error;

/// `SOCK_DIAG_BY_FAMILY` and `SOCK_DESTROY` from `linux/sock_diag.h`.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
/// `TCP_ESTABLISHED` from `net/tcp_states.h`.
const TCP_ESTABLISHED: u8 = 1;
/// `INET_DIAG_NOCOOKIE`: match by addresses only.
const NO_COOKIE: u32 = !0;

/// `struct inet_diag_req_v2` for one TCP socket, as the kernel lays it out: ports and
/// addresses in network byte order, the rest in host order.
fn request(local: SocketAddr, peer: SocketAddr) -> Result<Vec<u8>, Error> {
    let family = match (local.ip(), peer.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
        _ => {
            return Err(Error::Internal(format!(
                "mixed address families {local} / {peer}"
            )))
        }
    };
    let addr = |ip: IpAddr| -> [u8; 16] {
        let mut out = [0u8; 16];
        match ip {
            IpAddr::V4(v4) => out[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => out.copy_from_slice(&v6.octets()),
        }
        out
    };
    let mut req = Vec::with_capacity(56);
    req.push(family as u8); // sdiag_family
    req.push(libc::IPPROTO_TCP as u8); // sdiag_protocol
    req.push(0); // idiag_ext
    req.push(0); // pad
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // idiag_states: any
    req.extend_from_slice(&local.port().to_be_bytes()); // idiag_sport
    req.extend_from_slice(&peer.port().to_be_bytes()); // idiag_dport
    req.extend_from_slice(&addr(local.ip())); // idiag_src
    req.extend_from_slice(&addr(peer.ip())); // idiag_dst
    req.extend_from_slice(&0u32.to_ne_bytes()); // idiag_if
    req.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    req.extend_from_slice(&NO_COOKIE.to_ne_bytes());
    Ok(req)
}

/// Aborts the TCP connection `local` ↔ `peer`. `Ok(false)` when no such connection exists
/// (it already went away).
pub fn destroy_tcp(local: SocketAddr, peer: SocketAddr) -> Result<bool, Error> {
    Ok(exchange(SOCK_DESTROY, local, peer)?.is_some())
}

/// Whether the TCP connection `local` ↔ `peer` is established (held open by someone).
pub fn tcp_established(local: SocketAddr, peer: SocketAddr) -> Result<bool, Error> {
    // The reply is a `struct inet_diag_msg`, whose second byte is the TCP state.
    Ok(
        exchange(SOCK_DIAG_BY_FAMILY, local, peer)?.and_then(|msg| msg.get(1).copied())
            == Some(TCP_ESTABLISHED),
    )
}

/// One request about one socket. `None` when the kernel has no such socket; otherwise the
/// reply's payload (empty for a bare acknowledgement).
fn exchange(kind: u16, local: SocketAddr, peer: SocketAddr) -> Result<Option<Vec<u8>>, Error> {
    let netlink = |e: &dyn std::fmt::Display| Error::NetlinkSocket(format!("sock_diag: {e}"));
    let socket = NlSocketHandle::connect(NlFamily::SockOrInetDiag, None, Groups::empty())
        .map_err(|e| netlink(&e))?;
    let msg = NlmsghdrBuilder::default()
        .nl_type(kind)
        .nl_flags(NlmF::REQUEST | NlmF::ACK)
        .nl_payload(NlPayload::Payload(Buffer::from(request(local, peer)?)))
        .build()
        .map_err(|e| netlink(&e))?;
    socket.send(&msg).map_err(|e| netlink(&e))?;
    let mut payload = None;
    loop {
        let (replies, _) = socket.recv::<u16, Buffer>().map_err(|e| netlink(&e))?;
        for reply in replies {
            let reply = reply.map_err(|e| netlink(&e))?;
            match reply.nl_payload() {
                NlPayload::Payload(p) => payload = Some(p.as_ref().to_vec()),
                NlPayload::Ack(_) => return Ok(Some(payload.unwrap_or_default())),
                NlPayload::Err(e) => {
                    let errno = -*e.error();
                    return match errno {
                        libc::ENOENT => Ok(None),
                        _ => Err(Error::Kernel {
                            op: if kind == SOCK_DESTROY {
                                "SOCK_DESTROY"
                            } else {
                                "SOCK_DIAG"
                            },
                            device: format!("{local} -> {peer}"),
                            errno,
                            message: io::Error::from_raw_os_error(errno).to_string(),
                        }),
                    };
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_layout() {
        let req = request(
            "10.0.0.1:40000".parse().unwrap(),
            "10.0.0.2:10809".parse().unwrap(),
        )
        .unwrap();
        assert_eq!(req.len(), 56, "sizeof(struct inet_diag_req_v2)");
        assert_eq!(req[0], libc::AF_INET as u8);
        assert_eq!(&req[8..10], &40000u16.to_be_bytes());
        assert_eq!(&req[10..12], &10809u16.to_be_bytes());
        assert_eq!(&req[12..16], &[10, 0, 0, 1]);
        assert_eq!(&req[28..32], &[10, 0, 0, 2]);
        assert!(request("10.0.0.1:1".parse().unwrap(), "[::1]:2".parse().unwrap()).is_err());
    }

    /// A real loopback connection, aborted by address: the peer sees it reset.
    #[test]
    fn destroys_a_real_connection_or_reports_why_not() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let (local, peer) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        if let Ok(established) = tcp_established(local, peer) {
            assert!(established);
        }
        match destroy_tcp(local, peer) {
            Ok(found) => {
                assert!(found);
                assert!(!tcp_established(local, peer).unwrap(), "aborted");
                let mut buf = [0u8; 1];
                assert!(
                    matches!(server.read(&mut buf), Ok(0) | Err(_)),
                    "the peer sees the abort"
                );
                assert!(!destroy_tcp(local, peer).unwrap(), "gone the second time");
            }
            // Unprivileged hosts or kernels without INET_DIAG_DESTROY: the error must say so.
            Err(Error::Kernel { errno, .. }) => assert!(
                [libc::EPERM, libc::EOPNOTSUPP].contains(&errno),
                "unexpected errno {errno}"
            ),
            Err(other) => panic!("{other}"),
        }
    }
}
