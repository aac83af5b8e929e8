//! The whole attach, reconnect and detach sequences, shared by the node daemon and `nbdctl`.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::dial::{self, DialOptions, Dialed};
use crate::handshake::ExportInfo;
use crate::identity::{BackendId, DeviceIndex};
use crate::netlink::{ConnectRequest, NbdNetlink, ReconfigureRequest};
use crate::protocol::TransmissionFlags;
use crate::sysfs::{ProvenDevice, Sysfs};
use crate::uri::NbdUri;
use crate::Error;

/// How long I/O waits for a dead connection to be replaced before it fails, unless told
/// otherwise: long enough to ride out a server restart or failover, the daemon's restart and
/// a network flap; the one default of the library, `nbdctl` and the node daemon.
pub const DEFAULT_DEAD_CONN_TIMEOUT: Duration = Duration::from_secs(300);

/// Per-request timeout unless told otherwise. A request in flight when its connection dies is
/// sent again only when this expires, however soon the link is healed: measured in the VM, a
/// 1 s server outage stalled a writer 30.3 s with 30 s, 1.9 s with 2 s. 10 s keeps that stall
/// under the 30 s disk timeout of Linux guests (60 s for Windows), so a VM never sees its disk
/// fail for a short outage; a healthy server slower than 10 s costs a reconnect and a resend,
/// not an error.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(10);

/// How to attach an export.
#[derive(Debug, Clone)]
pub struct AttachOptions {
    /// What the device will carry in `/sys/block/nbdN/backend`.
    pub identifier: BackendId,
    /// A specific device, or `None` for any free one.
    pub index: Option<DeviceIndex>,
    pub dial: DialOptions,
    /// Per-request timeout. When it fires the kernel marks the connection dead and requeues
    /// the request, which then waits for RECONFIGURE: a stalled server is healed like a dead one.
    pub io_timeout: Option<Duration>,
    /// How long I/O waits for RECONFIGURE after a link dies before failing with EIO.
    pub dead_conn_timeout: Duration,
    /// Logical block size; `None` picks the smallest the export and the kernel both accept.
    pub block_size: Option<u32>,
    /// I/O scheduler to select; `None` leaves the kernel's choice.
    pub scheduler: Option<String>,
    /// How long to wait for the device node and its size after CONNECT.
    pub ready_timeout: Duration,
    /// Attach read-only whatever the export allows: the kernel then refuses writes to the
    /// device (CONNECT with the READ_ONLY transmission flag).
    pub read_only: bool,
}

impl AttachOptions {
    pub fn new(identifier: BackendId) -> Self {
        Self {
            identifier,
            index: None,
            dial: DialOptions::default(),
            io_timeout: Some(DEFAULT_IO_TIMEOUT),
            dead_conn_timeout: DEFAULT_DEAD_CONN_TIMEOUT,
            block_size: None,
            scheduler: Some("none".into()),
            ready_timeout: Duration::from_secs(10),
            read_only: false,
        }
    }
}

/// An attached export.
#[derive(Debug)]
pub struct Attached {
    pub device: ProvenDevice,
    pub info: ExportInfo,
    /// Our copies of the sockets handed to the kernel, one per connection. The kernel holds
    /// its own references: dropping these does not touch the device. Callers read what they
    /// need (addresses) and drop them.
    pub sockets: Vec<OwnedFd>,
}

/// Dials the export, hands the sockets to the kernel, waits for the device, and proves it
/// carries our identifier. On failure after CONNECT, a device proven ours is disconnected
/// again so nothing half-attached is left behind.
pub async fn attach(
    nl: &NbdNetlink,
    sysfs: &Sysfs,
    uri: &NbdUri,
    opts: &AttachOptions,
) -> Result<Attached, Error> {
    let dialed = dial::dial(uri, &opts.dial).await?;
    attach_dialed(nl, sysfs, dialed, opts).await
}

/// [`attach`] for sockets already dialed: for callers that record something about the
/// connections (their addresses) before the kernel gets them.
pub async fn attach_dialed(
    nl: &NbdNetlink,
    sysfs: &Sysfs,
    dialed: Dialed,
    opts: &AttachOptions,
) -> Result<Attached, Error> {
    let block_size = kernel_block_size(&dialed.info, opts.block_size)?;
    let index = connect(nl, sysfs, opts, &dialed.info, block_size, &dialed.sockets).await?;
    match settle(sysfs, index, &dialed.info, opts).await {
        Ok(device) => Ok(Attached {
            device,
            info: dialed.info,
            sockets: dialed.sockets,
        }),
        Err(e) => {
            // Our copies would only keep the sockets of a failed device alive.
            drop(dialed.sockets);
            if let Ok(device) = sysfs.prove(index, &opts.identifier) {
                if let Err(undo) = nl.disconnect(&device).await {
                    tracing::warn!(%index, error = %undo, "could not undo a failed attach");
                }
            }
            Err(e)
        }
    }
}

/// How long CONNECT keeps retrying a device that is transiently busy (udev or blkid holding
/// it open) or still going down after a previous disconnect.
const CONNECT_RETRY_FOR: Duration = Duration::from_secs(10);

async fn connect(
    nl: &NbdNetlink,
    sysfs: &Sysfs,
    opts: &AttachOptions,
    info: &ExportInfo,
    block_size: u64,
    sockets: &[OwnedFd],
) -> Result<DeviceIndex, Error> {
    let borrowed: Vec<_> = sockets.iter().map(|s| s.as_fd()).collect();
    let request = ConnectRequest {
        index: opts.index,
        size_bytes: info.size,
        block_size,
        server_flags: if opts.read_only {
            info.flags | TransmissionFlags::READ_ONLY
        } else {
            info.flags
        },
        timeout: opts.io_timeout,
        dead_conn_timeout: opts.dead_conn_timeout,
        client_flags: 0,
        identifier: &opts.identifier,
        sockets: &borrowed,
    };
    let started = Instant::now();
    let mut pause = Duration::from_millis(20);
    loop {
        match nl.connect(&request).await {
            Err(e) if transient(sysfs, &e, opts.index) && started.elapsed() < CONNECT_RETRY_FOR => {
                tracing::debug!(error = %e, ?pause, "CONNECT refused for now; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(500));
            }
            result => return result,
        }
    }
}

/// Whether a refused CONNECT may succeed if retried. Only an explicit index can be refused
/// (for "any", the kernel moves on to another device by itself). EBUSY on a device that
/// carries a backend identifier means it is configured, by us or someone else: final.
fn transient(sysfs: &Sysfs, e: &Error, index: Option<DeviceIndex>) -> bool {
    let Some(index) = index else {
        return false;
    };
    match e.errno() {
        Some(libc::EBUSY) => matches!(sysfs.backend(index), Ok(None)),
        Some(libc::EINVAL) => true,
        _ => false,
    }
}

async fn settle(
    sysfs: &Sysfs,
    index: DeviceIndex,
    info: &ExportInfo,
    opts: &AttachOptions,
) -> Result<ProvenDevice, Error> {
    sysfs
        .wait_ready(index, info.size, opts.ready_timeout)
        .await?;
    let device = sysfs.prove(index, &opts.identifier)?;
    if let Some(scheduler) = &opts.scheduler {
        // Switching freezes the queue (tens of ms): skip it when the device already has it,
        // as a device keeps its scheduler across attachments.
        if sysfs.scheduler(index).ok().as_deref() != Some(scheduler.as_str()) {
            sysfs.set_scheduler(index, scheduler)?;
        }
    }
    Ok(device)
}

/// Redials the export and gives the device fresh sockets under its own identifier. The
/// kernel puts them into dead slots only, in order, and drops the rest, so live connections
/// are left alone. Returns our copies of the new sockets (see [`Attached::sockets`]).
pub async fn reconnect(
    nl: &NbdNetlink,
    uri: &NbdUri,
    device: &ProvenDevice,
    dial_opts: &DialOptions,
) -> Result<Dialed, Error> {
    let dialed = dial::dial(uri, dial_opts).await?;
    reconnect_dialed(nl, device, &dialed).await?;
    Ok(dialed)
}

/// [`reconnect`] for sockets already dialed.
pub async fn reconnect_dialed(
    nl: &NbdNetlink,
    device: &ProvenDevice,
    dialed: &Dialed,
) -> Result<(), Error> {
    let borrowed: Vec<_> = dialed.sockets.iter().map(|s| s.as_fd()).collect();
    nl.reconfigure(&ReconfigureRequest {
        index: device.index(),
        identifier: device.identifier(),
        sockets: &borrowed,
        size_bytes: None,
        dead_conn_timeout: None,
    })
    .await
}

/// Disconnects the device after proving it carries `identifier`, then waits until the kernel
/// has let go of its configuration.
pub async fn detach(
    nl: &NbdNetlink,
    sysfs: &Sysfs,
    index: DeviceIndex,
    identifier: &BackendId,
    timeout: Duration,
) -> Result<(), Error> {
    let device = sysfs.prove(index, identifier)?;
    nl.disconnect(&device).await?;
    wait_released(sysfs, index, timeout).await
}

/// Waits until the device no longer carries a backend identifier.
pub async fn wait_released(
    sysfs: &Sysfs,
    index: DeviceIndex,
    timeout: Duration,
) -> Result<(), Error> {
    let started = Instant::now();
    loop {
        let backend = sysfs.backend(index)?;
        if backend.is_none() {
            return Ok(());
        }
        if started.elapsed() >= timeout {
            return Err(Error::NotReady {
                device: index,
                waited: timeout,
                reason: format!("still carries {backend:?} after DISCONNECT"),
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The logical block size to give the kernel: a power of two between 512 and the page size,
/// no smaller than the export's minimum.
pub fn kernel_block_size(info: &ExportInfo, requested: Option<u32>) -> Result<u64, Error> {
    let page = page_size();
    let minimum = info.block_sizes.map_or(1, |b| b.minimum);
    let chosen = requested.unwrap_or_else(|| minimum.max(512));
    let ok = chosen.is_power_of_two() && (512..=page).contains(&chosen) && chosen >= minimum;
    if !ok {
        return Err(Error::UnsupportedBlockSize(format!(
            "block size {chosen} with export minimum {minimum} and page size {page}"
        )));
    }
    Ok(u64::from(chosen))
}

fn page_size() -> u32 {
    // SAFETY: sysconf has no preconditions and only reads a system constant.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u32::try_from(size).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handshake::BlockSizes;
    use crate::protocol::TransmissionFlags;

    fn info(minimum: Option<u32>) -> ExportInfo {
        ExportInfo {
            size: 1 << 20,
            flags: TransmissionFlags::HAS_FLAGS,
            block_sizes: minimum.map(|minimum| BlockSizes {
                minimum,
                preferred: 4096,
                maximum: 1 << 25,
            }),
            tls: None,
        }
    }

    #[test]
    fn block_size_choice() {
        assert_eq!(kernel_block_size(&info(None), None).unwrap(), 512);
        assert_eq!(kernel_block_size(&info(Some(1)), None).unwrap(), 512);
        assert_eq!(kernel_block_size(&info(Some(4096)), None).unwrap(), 4096);
        assert_eq!(
            kernel_block_size(&info(Some(512)), Some(4096)).unwrap(),
            4096
        );
        assert!(kernel_block_size(&info(Some(65536)), None).is_err());
        assert!(kernel_block_size(&info(Some(4096)), Some(512)).is_err());
        assert!(kernel_block_size(&info(None), Some(1000)).is_err());
        assert!(kernel_block_size(&info(None), Some(256)).is_err());
    }
}
