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

use socket2::SockRef;

use crate::error::NodeError;
use crate::record::TcpConnection;

/// The TCP address pairs of `sockets` (unix sockets have none).
pub fn tcp_pairs(sockets: &[OwnedFd]) -> Vec<TcpConnection> {
    sockets
        .iter()
        .filter_map(|fd| {
            let s = SockRef::from(fd);
            let local = s.local_addr().ok()?.as_socket()?;
            let peer = s.peer_addr().ok()?.as_socket()?;
            Some(TcpConnection { local, peer })
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

/// Of `known` and `fresh`, the connections still established: after a RECONFIGURE the kernel
/// kept the fresh sockets that found a dead slot and the live old ones; the others are closed
/// (call this after dropping our copies). If the kernel cannot be asked, all are kept: an
/// address that no longer exists costs nothing later, a forgotten one could not be replaced.
pub fn still_established(known: &[TcpConnection], fresh: &[TcpConnection]) -> Vec<TcpConnection> {
    let all = union(known, fresh);
    let mut live = Vec::with_capacity(all.len());
    for c in &all {
        match nbd::sockdiag::tcp_established(c.local, c.peer) {
            Ok(true) => live.push(*c),
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(error = %e, "cannot query TCP states; keeping every known connection");
                return all;
            }
        }
    }
    live
}

/// Redials `record`'s export and offers the device the new sockets, journaling their
/// addresses ahead and the ones the kernel kept after. The shared step of healing and of
/// replacing connections.
pub async fn offer_new_connections(
    node: &crate::node::Node,
    record: &mut crate::record::Record,
    device: &nbd::sysfs::ProvenDevice,
) -> Result<(), NodeError> {
    let export = record.export.clone().ok_or_else(|| {
        NodeError::FailedPrecondition(format!(
            "the export of volume {} is not known yet",
            record.volume_id
        ))
    })?;
    let uri = crate::node::export_uri(&export)?;
    let dialed = nbd::dial::dial(&uri, &node.dial_options(&export)).await?;
    let fresh = tcp_pairs(&dialed.sockets);
    if !fresh.is_empty() {
        record.tcp = union(&record.tcp, &fresh);
        node.save(record)?;
    }
    let offered = nbd::attach::reconnect_dialed(&node.nl, device, &dialed).await;
    drop(dialed);
    let live = still_established(&record.tcp, &[]);
    if live != record.tcp {
        record.tcp = live;
        node.save(record)?;
    }
    offered.map_err(NodeError::from)
}

/// Aborts every recorded connection of a device, so the kernel marks them dead.
pub fn abort_all(tcp: &[TcpConnection]) -> Result<usize, NodeError> {
    let mut aborted = 0;
    for c in tcp {
        if nbd::sockdiag::destroy_tcp(c.local, c.peer)? {
            aborted += 1;
        }
    }
    Ok(aborted)
}

/// Whether the device can read its last 4 KiB, bypassing the page cache: the server serves
/// the whole (new) size on the device's connections.
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
