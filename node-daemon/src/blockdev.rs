//! The block layer's own read-only switch for a device (BLKROSET), which every opener of the
//! device obeys. A read-only bind mount of a device node does not stop writes to the device.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// An ioctl or open on a device (or a mount point) that failed, with the OS error.
#[derive(Debug, thiserror::Error)]
#[error("{op} {}: {source}", path.display())]
pub struct BlockdevError {
    pub op: &'static str,
    pub path: PathBuf,
    pub source: std::io::Error,
}

impl BlockdevError {
    fn at<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |source| Self {
            op,
            path: path.to_owned(),
            source,
        }
    }

    fn errno<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(nix::errno::Errno) -> Self + 'a {
        move |errno| Self::at(op, path)(errno.into())
    }
}

// BLKROSET and BLKROGET from linux/fs.h: _IO(0x12, 93) and _IO(0x12, 94), taking an int.
nix::ioctl_write_ptr_bad!(blkroset, 0x125d, libc::c_int);
nix::ioctl_read_bad!(blkroget, 0x125e, libc::c_int);

/// Sets or clears the device's read-only flag, if it is not already as asked. Opening the
/// device does no I/O, but call it off the runtime all the same: it is a device.
pub fn set_read_only(dev: &Path, read_only: bool) -> Result<(), BlockdevError> {
    let file = std::fs::File::open(dev).map_err(BlockdevError::at("opening", dev))?;
    let mut current: libc::c_int = 0;
    // SAFETY: BLKROGET writes one int through the pointer, which outlives the call.
    unsafe { blkroget(file.as_raw_fd(), &mut current) }
        .map_err(BlockdevError::errno("reading the read-only flag of", dev))?;
    if (current != 0) == read_only {
        return Ok(());
    }
    let flag: libc::c_int = read_only.into();
    // SAFETY: BLKROSET reads one int through the pointer, which outlives the call.
    unsafe { blkroset(file.as_raw_fd(), &flag) }
        .map_err(BlockdevError::errno("setting the read-only flag of", dev))?;
    tracing::info!(device = %dev.display(), read_only, "block device read-only flag set");
    Ok(())
}

// BLKFLSBUF from linux/fs.h: _IO(0x12, 97).
nix::ioctl_none_bad!(blkflsbuf, 0x1261);

/// Writes back and drops what the page cache holds of the device, so the next probe reads
/// the export itself: another node may have written the volume since this node last read
/// it, and a stale cached "blank" must never lead to a format.
pub fn drop_cache(dev: &Path) -> Result<(), BlockdevError> {
    let file = std::fs::File::open(dev).map_err(BlockdevError::at("opening", dev))?;
    // SAFETY: BLKFLSBUF takes no argument.
    unsafe { blkflsbuf(file.as_raw_fd()) }
        .map_err(BlockdevError::errno("dropping the page cache of", dev))?;
    Ok(())
}

// FIFREEZE and FITHAW from linux/fs.h: _IOWR('X', 119, int) and _IOWR('X', 120, int).
nix::ioctl_readwrite_bad!(fifreeze, 0xC004_5877, libc::c_int);
nix::ioctl_readwrite_bad!(fithaw, 0xC004_5878, libc::c_int);

/// Freezes the filesystem mounted at `mount_point`: writes everything dirty and holds new
/// writes until [`thaw`]. Blocks on the device: call it through `off_runtime`.
pub fn freeze(mount_point: &Path) -> Result<(), BlockdevError> {
    let dir =
        std::fs::File::open(mount_point).map_err(BlockdevError::at("opening", mount_point))?;
    let mut unused: libc::c_int = 0;
    // SAFETY: FIFREEZE ignores its argument; the pointer is valid for the call.
    unsafe { fifreeze(dir.as_raw_fd(), &mut unused) }
        .map_err(BlockdevError::errno("freezing", mount_point))?;
    Ok(())
}

/// Thaws a filesystem [`freeze`] froze. One that is not frozen is left as it is (the call
/// is how recovery makes sure a crash between freeze and thaw leaves nothing frozen).
pub fn thaw(mount_point: &Path) -> Result<(), BlockdevError> {
    let dir =
        std::fs::File::open(mount_point).map_err(BlockdevError::at("opening", mount_point))?;
    let mut unused: libc::c_int = 0;
    // SAFETY: FITHAW ignores its argument; the pointer is valid for the call.
    match unsafe { fithaw(dir.as_raw_fd(), &mut unused) } {
        Ok(_) | Err(nix::errno::Errno::EINVAL) => Ok(()),
        Err(e) => Err(BlockdevError::errno("thawing", mount_point)(e)),
    }
}

/// Flushes what the page cache holds for a raw block device down to the export. Blocks
/// while the link is down: call it through `off_runtime`.
pub fn flush(dev: &Path) -> Result<(), BlockdevError> {
    std::fs::OpenOptions::new()
        .read(true)
        .open(dev)
        .and_then(|f| f.sync_all())
        .map_err(BlockdevError::at("flushing", dev))
}

/// A read of a device, bypassing the page cache, that failed: the export is there but its
/// data cannot be read (a degraded backend, a link healing mid-call). Never a sign that
/// the device is blank.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} could not be read at {offset}+{len} ({source}): the export's server may be degraded; \
     nothing is formatted, resized or detached until it reads again",
    device.display()
)]
pub struct UnreadableError {
    pub device: PathBuf,
    pub offset: u64,
    pub len: usize,
    pub source: std::io::Error,
}

/// How much of each end of a device [`read_edges`] reads: every signature `blkid` looks for
/// (superblocks, partition tables and their backups, LVM, LUKS, RAID) lies within it.
pub const EDGE: usize = 1 << 20;

const DIRECT_ALIGN: usize = 4096;

/// Reads `len` bytes at `offset` with O_DIRECT: from the export, not from the page cache.
/// Blocks while the link is down: call it through `off_runtime`.
pub fn read_direct(dev: &Path, offset: u64, len: usize) -> Result<(), UnreadableError> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let failed = |source| UnreadableError {
        device: dev.to_owned(),
        offset,
        len,
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .map_err(failed)?;
    // O_DIRECT wants an aligned buffer: over-allocate and read into an aligned window.
    let mut storage = vec![0u8; len + DIRECT_ALIGN];
    let start = storage.as_ptr().align_offset(DIRECT_ALIGN);
    file.read_exact_at(&mut storage[start..start + len], offset)
        .map_err(failed)
}

/// Reads the first and the last [`EDGE`] of the device with O_DIRECT. What `blkid` decides
/// from is readable only if this succeeds: `blkid -p` exits 2 both when it finds nothing and
/// when it cannot read, so a device is called blank only between two such reads.
pub fn read_edges(dev: &Path) -> Result<(), UnreadableError> {
    use std::io::{Seek, SeekFrom};
    let size = std::fs::File::open(dev)
        .and_then(|mut f| f.seek(SeekFrom::End(0)))
        .map_err(|source| UnreadableError {
            device: dev.to_owned(),
            offset: 0,
            len: 0,
            source,
        })?;
    let aligned = size - size % DIRECT_ALIGN as u64;
    let len = usize::try_from(aligned).map_or(EDGE, |s| s.min(EDGE));
    if len == 0 {
        return Ok(());
    }
    read_direct(dev, 0, len)?;
    read_direct(dev, aligned - len as u64, len)
}

/// Whether the device reads its last 4 KiB of `size`, bypassing the page cache: the server
/// serves the whole (new) size on the device's connections. A server that does not answers
/// that read with an error, as a degraded one does any read: the first 4 KiB tell them apart,
/// and a device that cannot read those is [`UnreadableError`], not "too small".
pub fn serves_size(dev: &Path, size: u64) -> Result<bool, UnreadableError> {
    const BLOCK: usize = DIRECT_ALIGN;
    if size < BLOCK as u64 {
        return Ok(true);
    }
    if read_direct(dev, size - BLOCK as u64, BLOCK).is_ok() {
        return Ok(true);
    }
    read_direct(dev, 0, BLOCK)?;
    Ok(false)
}
