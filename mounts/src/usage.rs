//! Space and inode usage of a mounted filesystem.

use std::path::Path;

use nix::sys::statvfs::statvfs;

use crate::Error;

/// Figures for NodeGetVolumeStats, in bytes and inodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub bytes_total: u64,
    pub bytes_available: u64,
    pub bytes_used: u64,
    pub inodes_total: u64,
    pub inodes_free: u64,
    pub inodes_used: u64,
}

pub fn usage(path: &Path) -> Result<Usage, Error> {
    let s = statvfs(path).map_err(|source| Error::Syscall {
        op: "statvfs",
        target: path.to_owned(),
        source,
    })?;
    let frag = s.fragment_size();
    let total = s.blocks() * frag;
    let free = s.blocks_free() * frag;
    Ok(Usage {
        bytes_total: total,
        // What an unprivileged writer can still use: reserved blocks are not available.
        bytes_available: s.blocks_available() * frag,
        bytes_used: total.saturating_sub(free),
        inodes_total: s.files(),
        inodes_free: s.files_free(),
        inodes_used: s.files().saturating_sub(s.files_free()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_of_a_real_directory_adds_up() {
        let dir = tempfile::tempdir().unwrap();
        let u = usage(dir.path()).unwrap();
        assert!(u.bytes_total > 0);
        assert!(u.bytes_available <= u.bytes_total);
        assert_eq!(u.bytes_used, u.bytes_total - (u.bytes_total - u.bytes_used));
        assert!(u.inodes_used <= u.inodes_total);
    }
}
