//! What the daemon knows about the connections it handed to the kernel, and how it replaces
//! them when the export's server must see them anew.
//!
//! NBD servers (nbdkit, qemu-nbd, nbd-server) fix an export's size per connection at the
//! handshake and refuse I/O beyond it. After the export grows, the kernel's existing
//! connections can therefore not reach the new space; they must be replaced. The kernel only
//! takes new sockets into dead slots, so the old TCP connections are aborted by address
//! (recorded in the journal at attach and heal), and the device is reconnected.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use nbd::handshake::ExportInfo;
use nbd::sysfs::ProvenDevice;
use socket2::SockRef;

use crate::error::NodeError;
use crate::node::Node;
use crate::record::{Record, TcpConnection};

/// The TCP address pairs of `sockets` (unix sockets have none).
pub fn tcp_pairs(sockets: &[OwnedFd]) -> Vec<TcpConnection> {
    sockets
        .iter()
        .filter_map(|fd| {
            let s = SockRef::from(fd);
            let local = s.local_addr().ok()?.as_socket()?;
            let peer = s.peer_addr().ok()?.as_socket()?;
            let inode = nix::sys::stat::fstat(fd).ok().map(|st| st.st_ino);
            Some(TcpConnection { local, peer, inode })
        })
        .collect()
}

/// `known` and `fresh` together: what to journal before offering `fresh` to the kernel, so a
/// crash right after RECONFIGURE still leaves every connection the device may hold recorded.
pub fn union(known: &[TcpConnection], fresh: &[TcpConnection]) -> Vec<TcpConnection> {
    let mut all: Vec<TcpConnection> = known.iter().chain(fresh).copied().collect();
    all.sort();
    all.dedup();
    all
}

/// What the kernel says of each of `known`: `Some(true)` established, `Some(false)` closed,
/// `None` when it cannot tell (tcp_diag not loaded, or the query failed). The one place the
/// daemon asks; the helpers below read its answer.
pub fn states(known: &[TcpConnection]) -> Vec<Option<bool>> {
    known
        .iter()
        .map(|c| match nbd::sockdiag::tcp_established(c.local, c.peer) {
            Ok(state) => state,
            Err(e) => {
                tracing::debug!(error = %e, "cannot query a TCP state");
                None
            }
        })
        .collect()
}

/// Whether one of `known` may still carry I/O: `false` only when the kernel shows every one
/// closed (a device with live connections sends its I/O over them rather than waiting for a
/// reconnect). No TCP connections at all (unix sockets) cannot be asked after: `true`.
pub fn some_open(known: &[TcpConnection]) -> bool {
    let states = states(known);
    states.is_empty() || states.iter().any(|s| *s != Some(false))
}

/// Whether every one of `known` is established, as far as the kernel can tell (none at all:
/// `true`).
pub fn all_open(known: &[TcpConnection]) -> bool {
    liveness_of(&states(known)) != Liveness::SomeClosed
}

/// Of `known`, the connections still established: after a RECONFIGURE the kernel kept the
/// fresh sockets that found a dead slot and the live old ones; the others are closed (call
/// this after dropping our copies). If the kernel cannot tell, all are kept: an address that
/// no longer exists costs nothing later, a forgotten one could not be replaced.
pub fn still_established(known: &[TcpConnection]) -> Vec<TcpConnection> {
    let states = states(known);
    if states.contains(&None) {
        tracing::debug!("the kernel cannot tell TCP states; keeping every known connection");
        return known.to_vec();
    }
    known
        .iter()
        .zip(states)
        .filter(|(_, s)| *s == Some(true))
        .map(|(c, _)| *c)
        .collect()
}

/// What a device's journaled connections say about its slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Every connection is a TCP connection the kernel shows established.
    AllEstablished,
    /// At least one is provably closed: a slot is dead (its LINK_DEAD may have been missed).
    SomeClosed,
    /// Nothing provable: no TCP connections (unix sockets), or a kernel that cannot tell.
    Unknown,
}

/// The kernel's TCP sockets, dumped once for a pass over every device (a restart's refresh,
/// the sweep): one netlink exchange instead of one per connection. `None` when the kernel
/// cannot tell.
pub fn tcp_snapshot() -> Option<nbd::sockdiag::TcpTable> {
    nbd::sockdiag::tcp_table().unwrap_or_else(|e| {
        tracing::debug!(error = %e, "cannot dump the TCP sockets");
        None
    })
}

/// What `known` says of a device's slots, answered from a [`tcp_snapshot`].
pub fn liveness_in(
    snapshot: Option<&nbd::sockdiag::TcpTable>,
    known: &[TcpConnection],
) -> Liveness {
    let states: Vec<Option<bool>> = known
        .iter()
        .map(|c| snapshot.and_then(|t| t.lookup(c.local, c.peer).established()))
        .collect();
    liveness_of(&states)
}

fn liveness_of(states: &[Option<bool>]) -> Liveness {
    if states.contains(&Some(false)) {
        Liveness::SomeClosed
    } else if !states.is_empty() && states.iter().all(|s| *s == Some(true)) {
        Liveness::AllEstablished
    } else {
        Liveness::Unknown
    }
}

/// Replacing a device's connections could not go on.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionsError {
    /// The device is being disconnected: it must not get new connections.
    #[error("volume {volume} is being detached")]
    Detaching { volume: String },
    #[error(
        "the kernel's TCP socket diagnostics are not loaded (modprobe tcp_diag): cannot tell which connections are the device's"
    )]
    NoSocketDiagnostics,
    /// The re-dialed export is not the one under the device (a failover or a restore gave
    /// another image): splicing it in would put it under a live filesystem.
    #[error(
        "the export of volume {volume} came back different: it {}; not reconnecting the device to it \
         (retrying with back-off, in case the server comes back as it was)",
        differences.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", and it ")
    )]
    ExportChanged {
        volume: String,
        differences: Vec<Difference>,
    },
}

/// How a re-dialed export differs from what the device was attached with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Difference {
    Smaller { export: u64, device: u64 },
    ReadOnly { now: bool },
    LostFlush,
    LostFua,
    LostMultiConn { connections: usize },
}

impl Difference {
    /// The metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Difference::Smaller { .. } => "smaller",
            Difference::ReadOnly { .. } => "read_only",
            Difference::LostFlush => "flush",
            Difference::LostFua => "fua",
            Difference::LostMultiConn { .. } => "multi_conn",
        }
    }
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Difference::Smaller { export, device } => {
                write!(f, "is {export} bytes, smaller than the device's {device}")
            }
            Difference::ReadOnly { now: true } => write!(f, "is read-only, the device was writable"),
            Difference::ReadOnly { now: false } => {
                write!(f, "is writable, the device was attached read-only")
            }
            Difference::LostFlush => write!(f, "no longer accepts flush (SEND_FLUSH)"),
            Difference::LostFua => write!(f, "no longer accepts forced unit access (SEND_FUA)"),
            Difference::LostMultiConn { connections } => write!(
                f,
                "no longer allows several connections (CAN_MULTI_CONN), and the device has {connections}"
            ),
        }
    }
}

/// What makes a re-dialed export unfit to be spliced under the device: smaller than the
/// device, another read-only flag, flush or FUA gone where the device was attached with them,
/// or CAN_MULTI_CONN gone where the device has several connections. Empty when it is fit.
/// A record journaled before the flags were is checked for size (and connections) only.
pub fn splice_refusal(record: &Record, device_bytes: u64, info: &ExportInfo) -> Vec<Difference> {
    use nbd::protocol::TransmissionFlags as F;
    let mut differences = Vec::new();
    if info.size < device_bytes {
        differences.push(Difference::Smaller {
            export: info.size,
            device: device_bytes,
        });
    }
    let connections = record
        .attached_with
        .map(|a| a.connections)
        .or_else(|| record.export.as_ref().map(|e| usize::from(e.connections)))
        .unwrap_or(1);
    if let Some(was) = record.attached_with.map(|a| F::from_bits_retain(a.flags)) {
        let now = info.flags;
        if was.contains(F::READ_ONLY) != now.contains(F::READ_ONLY) {
            differences.push(Difference::ReadOnly {
                now: now.contains(F::READ_ONLY),
            });
        }
        if was.contains(F::SEND_FLUSH) && !now.contains(F::SEND_FLUSH) {
            differences.push(Difference::LostFlush);
        }
        if was.contains(F::SEND_FUA) && !now.contains(F::SEND_FUA) {
            differences.push(Difference::LostFua);
        }
    }
    if connections > 1 && !info.flags.contains(F::CAN_MULTI_CONN) {
        differences.push(Difference::LostMultiConn { connections });
    }
    differences
}

/// Redials the export of `record` and offers its device the new sockets, journaling their
/// addresses ahead and the ones the kernel kept after. The shared step of healing and of
/// replacing connections. Takes no volume lock: it needs only the identifier, which the
/// kernel checks again on RECONFIGURE, and the volume's link lock, which no one holds
/// across device I/O.
pub async fn offer_new_connections(
    node: &Node,
    record: &Record,
    device: &ProvenDevice,
) -> Result<(), NodeError> {
    let export = crate::node::known_export(record)?;
    let uri = crate::node::export_uri(&export)?;
    let started = Instant::now();
    let dialed = nbd::dial::dial(&uri, &node.dial_options(&export)?).await?;
    let volume = record.volume_id.as_str();
    // Each step's time since the dial began: a splice that waits (for the link lock, or for
    // the kernel's genl mutex behind a resize) shows where.
    let since = || crate::healer::millis(started.elapsed());
    tracing::debug!(%volume, device = %device.index(), dial_ms = since(), "dialed; offering new connections");
    let differences = splice_refusal(
        record,
        node.kernel.size_bytes(device.index())?,
        &dialed.info,
    );
    if !differences.is_empty() {
        for d in &differences {
            node.metrics.splice_refused(d.kind());
        }
        return Err(ConnectionsError::ExportChanged {
            volume: volume.to_owned(),
            differences,
        }
        .into());
    }
    let _link = node.link_locks.lock(volume).await;
    tracing::debug!(%volume, at_ms = since(), "link lock taken");
    if node.is_detaching(volume) {
        return Err(ConnectionsError::Detaching {
            volume: volume.to_owned(),
        }
        .into());
    }
    // Proven again under the link lock: the device may have been detached while we dialed.
    let device = node.kernel.prove(device.index(), device.identifier())?;
    let fresh = tcp_pairs(&dialed.sockets);
    let known = node.connections_of(volume);
    if !fresh.is_empty() {
        node.set_tcp(volume, &record.identifier, union(&known, &fresh))?;
    }
    let offered = node.kernel.reconnect(&device, &dialed).await;
    tracing::debug!(%volume, at_ms = since(), ok = offered.is_ok(), "RECONFIGURE with new sockets returned");
    // Unix sockets the kernel took are kept; every other copy is closed here.
    node.held
        .offered(volume, record.identifier.as_str(), dialed.sockets);
    let known = node.connections_of(volume);
    node.set_tcp(volume, &record.identifier, still_established(&known))?;
    offered.map_err(NodeError::from)
}

/// Aborts every recorded connection of a device, so the kernel marks them dead. Only
/// sockets proven to be the device's are touched: the address pair and the inode the socket
/// had when it was handed to the kernel must both match what the kernel reports now.
pub fn abort_all(tcp: &[TcpConnection]) -> Result<usize, NodeError> {
    use nbd::sockdiag::{lookup_tcp, Lookup};
    let mut aborted = 0;
    for c in tcp {
        match lookup_tcp(c.local, c.peer)? {
            Lookup::Found { inode, .. } if Some(inode) == c.inode => {
                if nbd::sockdiag::destroy_tcp(c.local, c.peer)? {
                    aborted += 1;
                }
            }
            Lookup::Found { .. } => tracing::warn!(
                local = %c.local,
                peer = %c.peer,
                "a connection at a recorded address is not the device's (another socket, or no recorded inode): left alone"
            ),
            Lookup::Absent => {}
            Lookup::Unknown => return Err(ConnectionsError::NoSocketDiagnostics.into()),
        }
    }
    Ok(aborted)
}

/// How long replacing the connections may take before expansion gives up.
pub const REPLACE_WITHIN: Duration = Duration::from_secs(30);

pub fn deadline() -> Instant {
    Instant::now() + REPLACE_WITHIN
}

#[cfg(test)]
mod tests {
    use nbd::protocol::TransmissionFlags as F;

    use super::*;
    use crate::ids::{Identifier, VolumeId};
    use crate::record::{Access, AccessMode, AttachedWith, Export};

    fn record(attached: Option<(F, usize)>, connections: u8) -> Record {
        let volume = VolumeId::parse("pvc-1").unwrap();
        let mut r = Record::attaching(
            volume.clone(),
            Identifier::new_attachment("node-a", &volume).unwrap(),
            Export {
                uri: "nbd://h/x".into(),
                connections,
                tls_profile: None,
                stage_tls: None,
                grant: None,
            },
            "/staging".into(),
            Access::Block,
            AccessMode::SingleNodeWriter,
        );
        r.attached_with = attached.map(|(flags, connections)| AttachedWith {
            flags: flags.bits(),
            connections,
        });
        r
    }

    fn export(size: u64, flags: F) -> ExportInfo {
        ExportInfo {
            size,
            flags,
            block_sizes: None,
            tls: None,
        }
    }

    fn kinds(d: &[Difference]) -> Vec<&'static str> {
        d.iter().map(Difference::kind).collect()
    }

    const FULL: F = F::HAS_FLAGS
        .union(F::SEND_FLUSH)
        .union(F::SEND_FUA)
        .union(F::CAN_MULTI_CONN);

    #[test]
    fn the_same_or_a_grown_export_is_spliced() {
        let r = record(Some((FULL, 4)), 4);
        assert!(splice_refusal(&r, 1 << 30, &export(1 << 30, FULL)).is_empty());
        assert!(splice_refusal(&r, 1 << 30, &export(2 << 30, FULL)).is_empty());
        // Gaining a flag is no reason to refuse.
        let single = record(Some((F::HAS_FLAGS, 1)), 1);
        assert!(splice_refusal(&single, 1 << 30, &export(1 << 30, FULL)).is_empty());
    }

    #[test]
    fn each_difference_is_named() {
        let r = record(Some((FULL, 4)), 4);
        let smaller = splice_refusal(&r, 1 << 30, &export((1 << 30) - 512, FULL));
        assert_eq!(kinds(&smaller), ["smaller"]);
        assert!(smaller[0].to_string().contains("1073741312 bytes"));
        let ro = splice_refusal(&r, 1 << 30, &export(1 << 30, FULL | F::READ_ONLY));
        assert_eq!(kinds(&ro), ["read_only"]);
        let bare = splice_refusal(&r, 1 << 30, &export(1 << 30, F::HAS_FLAGS));
        assert_eq!(kinds(&bare), ["flush", "fua", "multi_conn"]);
        let writable = record(Some((FULL | F::READ_ONLY, 1)), 1);
        assert_eq!(
            kinds(&splice_refusal(&writable, 1 << 30, &export(1 << 30, FULL))),
            ["read_only"]
        );
    }

    #[test]
    fn a_record_without_flags_is_checked_for_size_and_connections() {
        let old = record(None, 2);
        assert!(splice_refusal(
            &old,
            1 << 30,
            &export(1 << 30, F::HAS_FLAGS | F::CAN_MULTI_CONN)
        )
        .is_empty());
        assert_eq!(
            kinds(&splice_refusal(
                &old,
                1 << 30,
                &export(1 << 29, F::HAS_FLAGS)
            )),
            ["smaller", "multi_conn"]
        );
    }

    #[test]
    fn the_message_names_every_difference() {
        let e = ConnectionsError::ExportChanged {
            volume: "pvc-1".into(),
            differences: vec![Difference::ReadOnly { now: true }, Difference::LostFlush],
        };
        assert_eq!(
            e.to_string(),
            "the export of volume pvc-1 came back different: it is read-only, the device was writable, \
             and it no longer accepts flush (SEND_FLUSH); not reconnecting the device to it (retrying \
             with back-off, in case the server comes back as it was)"
        );
    }
}
