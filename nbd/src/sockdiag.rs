//! Aborting one TCP connection by its address pair (`SOCK_DESTROY`, as `ss -K` does).
//!
//! The kernel holds the only reference to the sockets of a device attached by an earlier run
//! of the daemon. When they must be replaced (the export grew and its server keeps each
//! connection's size fixed), aborting them makes the kernel mark the links dead; the healer then
//! gives the device new connections. Needs `CONFIG_INET_DIAG_DESTROY` (set in the Debian,
//! Ubuntu and RED OS kernels) and the `tcp_diag` module, which the kernel loads on demand.

use std::collections::HashMap;
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
/// `NLMSG_DONE` from `linux/netlink.h`: the end of a dump.
const NLMSG_DONE: u16 = 3;
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
    // AF_INET (2), AF_INET6 (10) and IPPROTO_TCP (6) are libc's `c_int` constants: they fit
    // the request's u8 fields.
    #[allow(clippy::cast_possible_truncation)]
    let (family, protocol) = (family as u8, libc::IPPROTO_TCP as u8);
    let mut req = Vec::with_capacity(56);
    req.push(family); // sdiag_family
    req.push(protocol); // sdiag_protocol
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
    match exchange(SOCK_DESTROY, local, peer)? {
        Some(_) => Ok(true),
        None if handler_loaded()? => Ok(false),
        None => Err(no_handler("SOCK_DESTROY", local, peer)),
    }
}

/// What the kernel says of one TCP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Found {
        established: bool,
        /// The socket's inode (as `fstat` on a descriptor of it shows): with the address pair,
        /// what proves a socket is the one a device was given.
        inode: u64,
    },
    Absent,
    /// The kernel cannot tell: the `tcp_diag` module is not loaded, and the kernel answers
    /// ENOENT for every socket, the same answer as for a socket that does not exist.
    Unknown,
}

/// Looks up the TCP connection `local` ↔ `peer`.
pub fn lookup_tcp(local: SocketAddr, peer: SocketAddr) -> Result<Lookup, Error> {
    match exchange(SOCK_DIAG_BY_FAMILY, local, peer)? {
        Some(msg) => found(&msg).ok_or_else(|| Error::BadReply {
            op: "SOCK_DIAG",
            detail: format!("inet_diag_msg of {} bytes", msg.len()),
        }),
        None if handler_loaded()? => Ok(Lookup::Absent),
        None => Ok(Lookup::Unknown),
    }
}

/// What a `struct inet_diag_msg` says of its socket: the TCP state is its second byte, the
/// inode the u32 at offset 68 (after family, state, timer, retrans, the 48-byte socket id,
/// expires, rqueue, wqueue and uid). `None` for a message too short to be one.
fn found(msg: &[u8]) -> Option<Lookup> {
    let inode = msg.get(68..72)?;
    Some(Lookup::Found {
        established: msg[1] == TCP_ESTABLISHED,
        inode: u64::from(u32::from_ne_bytes([inode[0], inode[1], inode[2], inode[3]])),
    })
}

/// Whether the TCP connection `local` ↔ `peer` is established (held open by someone).
/// `None` when the kernel cannot tell (see [`Lookup::Unknown`]).
pub fn tcp_established(local: SocketAddr, peer: SocketAddr) -> Result<Option<bool>, Error> {
    Ok(lookup_tcp(local, peer)?.established())
}

impl Lookup {
    /// Whether the connection is established: an absent one is not, and `None` when the
    /// kernel cannot tell.
    pub fn established(self) -> Option<bool> {
        match self {
            Lookup::Found { established, .. } => Some(established),
            Lookup::Absent => Some(false),
            Lookup::Unknown => None,
        }
    }
}

fn no_handler(op: &'static str, local: SocketAddr, peer: SocketAddr) -> Error {
    Error::Kernel {
        op,
        device: format!("{local} -> {peer}"),
        errno: libc::ENOENT,
        message: "the kernel's TCP socket diagnostics are not loaded (modprobe tcp_diag)".into(),
    }
}

/// Whether the kernel answers socket-diagnostic requests about TCP at all. Asked by looking
/// up a loopback connection made for the purpose: found means the handler is there. A
/// positive answer is remembered (modules are not unloaded under a running daemon).
fn handler_loaded() -> Result<bool, Error> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static LOADED: AtomicBool = AtomicBool::new(false);
    if LOADED.load(Ordering::Relaxed) {
        return Ok(true);
    }
    let io_err = |e: io::Error| Error::Internal(format!("loopback probe for sock_diag: {e}"));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io_err)?;
    let client =
        std::net::TcpStream::connect(listener.local_addr().map_err(io_err)?).map_err(io_err)?;
    let (local, peer) = (
        client.local_addr().map_err(io_err)?,
        client.peer_addr().map_err(io_err)?,
    );
    let loaded = exchange(SOCK_DIAG_BY_FAMILY, local, peer)?.is_some();
    LOADED.store(loaded, Ordering::Relaxed);
    Ok(loaded)
}

/// Every TCP socket the kernel has, by address pair, from one dump: what a caller that asks
/// about hundreds of connections at once (a restart, a sweep) reads instead of asking the
/// kernel once per connection.
#[derive(Debug, Default)]
pub struct TcpTable {
    sockets: HashMap<(SocketAddr, SocketAddr), Lookup>,
}

impl TcpTable {
    /// [`lookup_tcp`], answered from the dump.
    pub fn lookup(&self, local: SocketAddr, peer: SocketAddr) -> Lookup {
        self.sockets
            .get(&(local, peer))
            .copied()
            .unwrap_or(Lookup::Absent)
    }
}

/// Dumps every TCP socket (IPv4 and IPv6). `None` when the kernel cannot tell (see
/// [`Lookup::Unknown`]).
pub fn tcp_table() -> Result<Option<TcpTable>, Error> {
    let mut table = TcpTable::default();
    for family in [libc::AF_INET, libc::AF_INET6] {
        if !dump(family, &mut table)? {
            return Ok(None);
        }
    }
    Ok(Some(table))
}

/// One family's TCP sockets into `table`; `false` when the kernel has no TCP diagnostics.
fn dump(family: libc::c_int, table: &mut TcpTable) -> Result<bool, Error> {
    let netlink = |e: &dyn std::fmt::Display| Error::NetlinkSocket(format!("sock_diag dump: {e}"));
    let socket = NlSocketHandle::connect(NlFamily::SockOrInetDiag, None, Groups::empty())
        .map_err(|e| netlink(&e))?;
    // Any address pair of the family: a dump ignores the socket id.
    let any = match family {
        libc::AF_INET => SocketAddr::from(([0, 0, 0, 0], 0)),
        _ => SocketAddr::from(([0u16; 8], 0)),
    };
    let msg = NlmsghdrBuilder::default()
        .nl_type(SOCK_DIAG_BY_FAMILY)
        .nl_flags(NlmF::REQUEST | NlmF::DUMP)
        .nl_payload(NlPayload::Payload(Buffer::from(request(any, any)?)))
        .build()
        .map_err(|e| netlink(&e))?;
    socket.send(&msg).map_err(|e| netlink(&e))?;
    loop {
        let (replies, _) = socket.recv::<u16, Buffer>().map_err(|e| netlink(&e))?;
        for reply in replies {
            let reply = reply.map_err(|e| netlink(&e))?;
            if *reply.nl_type() == NLMSG_DONE {
                return Ok(true);
            }
            match reply.nl_payload() {
                NlPayload::Payload(p) => {
                    if let Some((pair, lookup)) = parse_diag_msg(p.as_ref()) {
                        table.sockets.insert(pair, lookup);
                    }
                }
                NlPayload::Err(e) if -*e.error() == libc::ENOENT => return Ok(false),
                NlPayload::Err(e) => {
                    let errno = -*e.error();
                    return Err(Error::Kernel {
                        op: "SOCK_DIAG dump",
                        device: "every TCP socket".into(),
                        errno,
                        message: io::Error::from_raw_os_error(errno).to_string(),
                    });
                }
                _ => {}
            }
        }
    }
}

/// A `struct inet_diag_msg`'s address pair (the socket id: ports and addresses in network
/// byte order, after family, state, timer and retrans) and what [`found`] reads of it.
fn parse_diag_msg(msg: &[u8]) -> Option<((SocketAddr, SocketAddr), Lookup)> {
    let lookup = found(msg)?;
    let port = |at: usize| u16::from_be_bytes([msg[at], msg[at + 1]]);
    let ip = |at: usize| -> Option<IpAddr> {
        match i32::from(msg[0]) {
            libc::AF_INET => Some(IpAddr::from(<[u8; 4]>::try_from(&msg[at..at + 4]).ok()?)),
            libc::AF_INET6 => Some(IpAddr::from(<[u8; 16]>::try_from(&msg[at..at + 16]).ok()?)),
            _ => None,
        }
    };
    let local = SocketAddr::new(ip(8)?, port(4));
    let peer = SocketAddr::new(ip(24)?, port(6));
    Some(((local, peer), lookup))
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
        assert_eq!(i32::from(req[0]), libc::AF_INET);
        assert_eq!(&req[8..10], &40000u16.to_be_bytes());
        assert_eq!(&req[10..12], &10809u16.to_be_bytes());
        assert_eq!(&req[12..16], &[10, 0, 0, 1]);
        assert_eq!(&req[28..32], &[10, 0, 0, 2]);
        assert!(request("10.0.0.1:1".parse().unwrap(), "[::1]:2".parse().unwrap()).is_err());
    }

    /// The dump finds a real connection with the state and inode the one-socket lookup gives.
    #[test]
    fn the_dump_agrees_with_the_lookup() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let _server = listener.accept().unwrap();
        let (local, peer) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        let (Ok(Some(table)), Ok(single)) = (tcp_table(), lookup_tcp(local, peer)) else {
            // Unprivileged hosts or kernels without tcp_diag: nothing to compare.
            return;
        };
        assert!(
            matches!(
                single,
                Lookup::Found {
                    established: true,
                    ..
                }
            ),
            "{single:?}"
        );
        assert_eq!(table.lookup(local, peer), single);
        assert_eq!(table.lookup(peer, local), lookup_tcp(peer, local).unwrap());
        let unused = SocketAddr::from(([127, 0, 0, 1], 1));
        assert_eq!(table.lookup(unused, peer), Lookup::Absent);
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
            assert_ne!(established, Some(false), "the connection is established");
        }
        if let Ok(Lookup::Found { inode, .. }) = lookup_tcp(local, peer) {
            use std::os::unix::fs::MetadataExt;
            let fd = std::os::fd::AsFd::as_fd(&client)
                .try_clone_to_owned()
                .unwrap();
            let ino = std::fs::File::from(fd).metadata().unwrap().ino();
            assert_eq!(inode, ino, "the kernel's inode is the descriptor's");
        }
        match destroy_tcp(local, peer) {
            Ok(found) => {
                assert!(found);
                assert_eq!(
                    tcp_established(local, peer).unwrap(),
                    Some(false),
                    "aborted"
                );
                let mut buf = [0u8; 1];
                assert!(
                    matches!(server.read(&mut buf), Ok(0) | Err(_)),
                    "the peer sees the abort"
                );
                assert!(!destroy_tcp(local, peer).unwrap(), "gone the second time");
            }
            // Unprivileged hosts, kernels without INET_DIAG_DESTROY or without tcp_diag: the
            // error must say so.
            Err(Error::Kernel { errno, .. }) => assert!(
                [libc::EPERM, libc::EOPNOTSUPP, libc::ENOENT].contains(&errno),
                "unexpected errno {errno}"
            ),
            Err(other) => panic!("{other}"),
        }
    }
}
