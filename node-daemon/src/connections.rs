//! What the daemon knows about the connections it handed to the kernel, and how it replaces
//! them when the export's server must see them anew.
//!
//! NBD servers (nbdkit, qemu-nbd, nbd-server) fix an export's size per connection at the
//! handshake and refuse I/O beyond it. After the export grows, the kernel's existing
//! connections can therefore not reach the new space; they must be replaced. The kernel only
//! takes new sockets into dead slots, so the old TCP connections are aborted by address
//! (recorded in the journal at attach and heal), and the device is reconnected.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::{Duration, Instant};

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

pub fn liveness(known: &[TcpConnection]) -> Liveness {
    let states = states(known);
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
    let dialed = nbd::dial::dial(&uri, &node.dial_options(&export)?).await?;
    let volume = record.volume_id.as_str();
    let _link = node.link_locks.lock(volume).await;
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

/// Whether the device can read its last 4 KiB, bypassing the page cache: the server serves
/// the whole (new) size on the device's connections. Blocks while the link is down: call it
/// through [`crate::node::off_runtime`].
pub fn serves_size(dev: &Path, size: u64) -> bool {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    const BLOCK: usize = 4096;
    if size < BLOCK as u64 {
        return true;
    }
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
    else {
        return false;
    };
    // O_DIRECT wants an aligned buffer: over-allocate and read into an aligned window.
    let mut storage = vec![0u8; 2 * BLOCK];
    let start = storage.as_ptr().align_offset(BLOCK);
    file.read_exact_at(&mut storage[start..start + BLOCK], size - BLOCK as u64)
        .is_ok()
}

/// How long replacing the connections may take before expansion gives up.
pub const REPLACE_WITHIN: Duration = Duration::from_secs(30);

pub fn deadline() -> Instant {
    Instant::now() + REPLACE_WITHIN
}
