//! mount(2) and umount(2), one call each.

use std::path::Path;

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::options::MountOptions;
use crate::Error;

/// Mounts the filesystem on `device` at `target`.
pub fn mount_filesystem(
    device: &Path,
    target: &Path,
    fs_type: &str,
    opts: &MountOptions,
) -> Result<(), Error> {
    let data = opts.data_string();
    mount(
        Some(device),
        target,
        Some(fs_type),
        opts.flags,
        data.as_deref(),
    )
    .map_err(|source| Error::Syscall {
        op: "mount",
        target: target.to_owned(),
        source,
    })?;
    tracing::debug!(device = %device.display(), target = %target.display(), fs_type, "mounted");
    Ok(())
}

/// Bind-mounts `source` (a directory, or a device node) onto `target`. A read-only bind
/// needs a second, remounting call: the kernel ignores MS_RDONLY on the first.
pub fn bind(source: &Path, target: &Path, read_only: bool) -> Result<(), Error> {
    let syscall = |source| Error::Syscall {
        op: "bind mount",
        target: target.to_owned(),
        source,
    };
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(syscall)?;
    if read_only {
        let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
        if let Err(e) = mount(None::<&str>, target, None::<&str>, flags, None::<&str>) {
            // Never leave a writable bind where a read-only one was asked for.
            let _ = umount2(target, MntFlags::empty());
            return Err(syscall(e));
        }
    }
    tracing::debug!(source = %source.display(), target = %target.display(), read_only, "bind mounted");
    Ok(())
}

/// Unmounts `target`. Returns `false` when nothing was mounted there (or it does not
/// exist), so callers can be idempotent without a separate check.
pub fn unmount(target: &Path) -> Result<bool, Error> {
    match umount2(target, MntFlags::UMOUNT_NOFOLLOW) {
        Ok(()) => {
            tracing::debug!(target = %target.display(), "unmounted");
            Ok(true)
        }
        Err(Errno::EINVAL | Errno::ENOENT) => Ok(false),
        Err(source) => Err(Error::Syscall {
            op: "unmount",
            target: target.to_owned(),
            source,
        }),
    }
}
