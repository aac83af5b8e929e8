//! The host as the phase decisions see it, behind three narrow traits: [`Kernel`] (sysfs facts,
//! netlink verbs, and the dial that feeds CONNECT), [`Mounts`] (the mount table and the two
//! mount syscalls staging uses) and [`Tools`] (the blocking tools: probe, mkfs, grow, flush,
//! freeze). [`Node`](crate::node::Node) holds them as trait objects, given to
//! [`Node::new`](crate::node::Node::new) in a [`Host`]: [`Host::real`] wraps the `nbd` and
//! `mounts` crates, and the unit tests give recording fakes (the youki `Syscall` pattern), so
//! what stage and recovery decide for every phase is tested on the host. The VM tests remain
//! the truth about the kernel.
//!
//! Only what a decision needs is here: publish's bind mounts, healing's socket diagnostics
//! and the CLI's own sysfs reads go straight to the libraries.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use mounts::{Filesystem, MountOptions, MountTable, Probe};
use nbd::attach::{AttachOptions, Attached};
use nbd::dial::{DialOptions, Dialed};
use nbd::netlink::{NbdNetlink, ReconfigureRequest};
use nbd::sysfs::{ProvenDevice, Sysfs};
use nbd::{BackendId, DeviceIndex, NbdUri};

use crate::blockdev::{BlockdevError, UnreadableError};
use crate::openers::UdevLock;

#[cfg(test)]
pub(crate) mod fake;

/// A check made on the thread that sends a RECONFIGURE, right before the send (see
/// `nbd::netlink::NbdNetlink::reconfigure_when`). It may block: it runs on no runtime worker.
pub type SendGate = Box<dyn FnOnce() -> bool + Send>;

/// The kernel's nbd driver and the exports it is fed from. A [`ProvenDevice`] is made only by
/// [`Kernel::prove`] and [`Kernel::find`] (and an attach): acting on a device still needs proof.
///
/// The sysfs facts are read from a [`Sysfs`] by the provided methods, the same code for the
/// real host and the fake (which roots its `Sysfs` in a temporary directory: the `nbd` crate's
/// proof of a device is not faked). Implementors give [`Kernel::sysfs`] and the verbs.
#[tonic::async_trait]
pub trait Kernel: Send + Sync + 'static {
    /// Where the sysfs facts below are read; for those methods only, not a way round the
    /// trait's verbs.
    fn sysfs(&self) -> &Sysfs;
    /// Every `nbdN` the driver has created, in index order.
    fn devices(&self) -> Result<Vec<DeviceIndex>, nbd::Error> {
        self.sysfs().devices()
    }
    /// The identifier `index` carries, `None` when it carries none.
    fn backend(&self, index: DeviceIndex) -> Result<Option<String>, nbd::Error> {
        self.sysfs().backend(index)
    }
    /// Whether `index` is free: no identifier and nobody's connection (see
    /// [`Sysfs::in_use`]). A device attached by another tool carries no identifier but is
    /// not free: nothing may be written to it.
    fn is_free(&self, index: DeviceIndex) -> Result<bool, nbd::Error> {
        Ok(self.backend(index)?.is_none() && !self.sysfs().in_use(index)?)
    }
    /// `index`, shown to carry `expected`.
    fn prove(&self, index: DeviceIndex, expected: &BackendId) -> Result<ProvenDevice, nbd::Error> {
        self.sysfs().prove(index, expected)
    }
    /// The device carrying `identifier`, wherever it is.
    fn find(&self, identifier: &BackendId) -> Result<Option<ProvenDevice>, nbd::Error> {
        self.sysfs().find(identifier)
    }
    fn size_bytes(&self, index: DeviceIndex) -> Result<u64, nbd::Error> {
        self.sysfs().size_bytes(index)
    }
    /// The device node, e.g. `/dev/nbd3`.
    fn dev_path(&self, index: DeviceIndex) -> PathBuf {
        self.sysfs().dev_path(index)
    }
    /// Major and minor numbers of the device node (what the mount table names a filesystem's
    /// device by); `None` when there is no block device node.
    fn device_numbers(&self, index: DeviceIndex) -> Option<(u32, u32)>;
    fn scheduler(&self, index: DeviceIndex) -> Result<String, nbd::Error> {
        self.sysfs().scheduler(index)
    }
    fn set_scheduler(&self, index: DeviceIndex, scheduler: &str) -> Result<(), nbd::Error>;

    /// Dials the export and does the handshake, for a CONNECT to follow.
    async fn dial(&self, uri: &NbdUri, opts: &DialOptions) -> Result<Dialed, nbd::Error>;
    /// CONNECT with sockets already dialed, until the device is ready and proven.
    async fn attach(&self, dialed: Dialed, opts: &AttachOptions) -> Result<Attached, nbd::Error>;
    /// RECONFIGURE with fresh sockets (the kernel puts them into dead slots only).
    async fn reconnect(&self, device: &ProvenDevice, dialed: &Dialed) -> Result<(), nbd::Error>;
    /// RECONFIGURE to a new size, no sockets, sent only if `ready` holds when asked on the
    /// sending thread right before the send; `Ok(false)` when it did not and nothing was sent.
    async fn resize_when(
        &self,
        device: &ProvenDevice,
        bytes: u64,
        ready: SendGate,
    ) -> Result<bool, nbd::Error>;
    /// Waits until the device node exists and shows `bytes`.
    async fn wait_ready(
        &self,
        index: DeviceIndex,
        bytes: u64,
        timeout: Duration,
    ) -> Result<(), nbd::Error>;
    async fn disconnect(&self, device: &ProvenDevice) -> Result<(), nbd::Error>;
    /// Waits until the device carries no identifier any more.
    async fn wait_released(&self, index: DeviceIndex, timeout: Duration) -> Result<(), nbd::Error>;
}

/// The mount table and the mount syscalls of staging and teardown. Called from the blocking
/// pool where they can block (an unmount flushing to a dead export).
pub trait Mounts: Send + Sync + 'static {
    /// `/proc/self/mountinfo`, now.
    fn table(&self) -> Result<MountTable, mounts::Error>;
    fn mount_filesystem(
        &self,
        dev: &Path,
        target: &Path,
        fs: &str,
        opts: &MountOptions,
    ) -> Result<(), mounts::Error>;
    /// Unmounts the top mount at `target`; `false` when nothing was mounted there.
    fn unmount(&self, target: &Path) -> Result<bool, mounts::Error>;
}

/// The tools that read or write a device or a filesystem. All of them block while the link
/// is down: called through [`crate::node::off_runtime`] only.
pub trait Tools: Send + Sync + 'static {
    /// Drops the device's page cache (another node may have written it), then says what it
    /// holds. A device is [`Probe::Blank`] only when its edges read (see
    /// [`crate::blockdev::read_edges`]); a device that cannot be read is an error.
    fn probe(&self, dev: &Path) -> Result<Probe, crate::error::NodeError>;
    fn make_filesystem(&self, dev: &Path, fs: Filesystem, uuid: &str) -> Result<(), mounts::Error>;
    fn redo_interrupted_format(
        &self,
        dev: &Path,
        fs: Filesystem,
        uuid: &str,
    ) -> Result<(), mounts::Error>;
    fn grow(&self, fs: Filesystem, dev: &Path, mount_point: &Path) -> Result<(), mounts::Error>;
    fn flush(&self, dev: &Path) -> Result<(), BlockdevError>;
    fn freeze(&self, mount_point: &Path) -> Result<(), BlockdevError>;
    fn thaw(&self, mount_point: &Path) -> Result<(), BlockdevError>;
    /// Whether the device reads its last 4 KiB of `size` (see [`crate::blockdev::serves_size`]).
    fn serves_size(&self, dev: &Path, size: u64) -> Result<bool, UnreadableError>;
    /// Waits until nothing but this daemon has the device open and udev has no event queued,
    /// then holds the device's lock that keeps udev's probes off it (see
    /// [`crate::openers::wait_unused`]); the holders left at the deadline otherwise.
    fn wait_unused(&self, dev: &Path, within: Duration) -> Result<UdevLock, Vec<String>>;
}

/// What [`crate::node::Node`] reaches the host through.
#[derive(Clone)]
pub struct Host {
    pub kernel: Arc<dyn Kernel>,
    pub mounts: Arc<dyn Mounts>,
    pub tools: Arc<dyn Tools>,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host").finish_non_exhaustive()
    }
}

impl Host {
    /// This machine: the nbd netlink family, `/sys/block`, `/proc/self/mountinfo`, the tools.
    pub fn real(nl: NbdNetlink, sysfs: Sysfs) -> Self {
        Self {
            kernel: Arc::new(NbdKernel { nl, sysfs }),
            mounts: Arc::new(HostMounts),
            tools: Arc::new(HostTools),
        }
    }
}

/// [`Kernel`] of this machine.
#[derive(Debug)]
pub struct NbdKernel {
    nl: NbdNetlink,
    sysfs: Sysfs,
}

#[tonic::async_trait]
impl Kernel for NbdKernel {
    fn sysfs(&self) -> &Sysfs {
        &self.sysfs
    }

    fn device_numbers(&self, index: DeviceIndex) -> Option<(u32, u32)> {
        crate::node::device_numbers(&self.sysfs.dev_path(index))
    }

    fn set_scheduler(&self, index: DeviceIndex, scheduler: &str) -> Result<(), nbd::Error> {
        self.sysfs.set_scheduler(index, scheduler)
    }

    async fn dial(&self, uri: &NbdUri, opts: &DialOptions) -> Result<Dialed, nbd::Error> {
        nbd::dial::dial(uri, opts).await
    }

    async fn attach(&self, dialed: Dialed, opts: &AttachOptions) -> Result<Attached, nbd::Error> {
        nbd::attach::attach_dialed(&self.nl, &self.sysfs, dialed, opts).await
    }

    async fn reconnect(&self, device: &ProvenDevice, dialed: &Dialed) -> Result<(), nbd::Error> {
        nbd::attach::reconnect_dialed(&self.nl, device, dialed).await
    }

    async fn resize_when(
        &self,
        device: &ProvenDevice,
        bytes: u64,
        ready: SendGate,
    ) -> Result<bool, nbd::Error> {
        let request = ReconfigureRequest {
            index: device.index(),
            identifier: device.identifier(),
            sockets: &[],
            size_bytes: Some(bytes),
            dead_conn_timeout: None,
        };
        self.nl.reconfigure_when(&request, ready).await
    }

    async fn wait_ready(
        &self,
        index: DeviceIndex,
        bytes: u64,
        timeout: Duration,
    ) -> Result<(), nbd::Error> {
        self.sysfs.wait_ready(index, bytes, timeout).await
    }

    /// The kernel handles DISCONNECT inside the sending `sendmsg`, where it can wait on a
    /// stalled socket (sending NBD_CMD_DISC to a server that stopped reading). So it is sent
    /// from a thread and a netlink socket of its own: neither a runtime worker nor the socket
    /// every other volume's RECONFIGURE goes through waits with it.
    async fn disconnect(&self, device: &ProvenDevice) -> Result<(), nbd::Error> {
        let device = device.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("nbd-disconnect".into())
            .spawn(move || {
                let result = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| {
                        nbd::Error::NetlinkSocket(format!("a runtime for DISCONNECT: {e}"))
                    })
                    .and_then(|rt| {
                        rt.block_on(async { NbdNetlink::open().await?.disconnect(&device).await })
                    });
                let _ = tx.send(result);
            })
            .map_err(|e| nbd::Error::NetlinkSocket(format!("a thread for DISCONNECT: {e}")))?;
        rx.await.map_err(|_| {
            nbd::Error::NetlinkSocket("the DISCONNECT thread ended without an answer".into())
        })?
    }

    async fn wait_released(&self, index: DeviceIndex, timeout: Duration) -> Result<(), nbd::Error> {
        nbd::attach::wait_released(&self.sysfs, index, timeout).await
    }
}

/// [`Mounts`] of this machine.
#[derive(Debug)]
pub struct HostMounts;

impl Mounts for HostMounts {
    fn table(&self) -> Result<MountTable, mounts::Error> {
        MountTable::read()
    }

    fn mount_filesystem(
        &self,
        dev: &Path,
        target: &Path,
        fs: &str,
        opts: &MountOptions,
    ) -> Result<(), mounts::Error> {
        mounts::ops::mount_filesystem(dev, target, fs, opts)
    }

    fn unmount(&self, target: &Path) -> Result<bool, mounts::Error> {
        mounts::ops::unmount(target)
    }
}

/// [`Tools`] of this machine.
#[derive(Debug)]
pub struct HostTools;

impl Tools for HostTools {
    fn probe(&self, dev: &Path) -> Result<Probe, crate::error::NodeError> {
        crate::blockdev::drop_cache(dev)?;
        crate::blockdev::read_edges(dev)?;
        let found = mounts::format::probe(dev)?;
        if found == Probe::Blank {
            // blkid says "nothing" also when its own reads failed: the edges must still read.
            crate::blockdev::read_edges(dev)?;
        }
        Ok(found)
    }

    fn make_filesystem(&self, dev: &Path, fs: Filesystem, uuid: &str) -> Result<(), mounts::Error> {
        mounts::format::make_filesystem(dev, fs, uuid)
    }

    fn redo_interrupted_format(
        &self,
        dev: &Path,
        fs: Filesystem,
        uuid: &str,
    ) -> Result<(), mounts::Error> {
        mounts::format::redo_interrupted_format(dev, fs, uuid)
    }

    fn grow(&self, fs: Filesystem, dev: &Path, mount_point: &Path) -> Result<(), mounts::Error> {
        mounts::format::grow(fs, dev, mount_point)
    }

    fn flush(&self, dev: &Path) -> Result<(), BlockdevError> {
        crate::blockdev::flush(dev)
    }

    fn freeze(&self, mount_point: &Path) -> Result<(), BlockdevError> {
        crate::blockdev::freeze(mount_point)
    }

    fn thaw(&self, mount_point: &Path) -> Result<(), BlockdevError> {
        crate::blockdev::thaw(mount_point)
    }

    fn serves_size(&self, dev: &Path, size: u64) -> Result<bool, UnreadableError> {
        crate::blockdev::serves_size(dev, size)
    }

    fn wait_unused(&self, dev: &Path, within: Duration) -> Result<UdevLock, Vec<String>> {
        crate::openers::wait_unused(dev, within)
    }
}
