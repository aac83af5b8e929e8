//! Probing, formatting and growing filesystems with the distribution's own tools.
//!
//! Formatting only ever happens on a device that `blkid` finds blank: a volume that already
//! holds a filesystem, a partition table, an LVM or LUKS header is never overwritten.

use std::fmt;
use std::path::Path;
use std::process::Command;
use std::str::FromStr;

use crate::Error;

/// The filesystems the driver formats and grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Filesystem {
    Ext4,
    Xfs,
}

impl Filesystem {
    pub fn name(self) -> &'static str {
        match self {
            Filesystem::Ext4 => "ext4",
            Filesystem::Xfs => "xfs",
        }
    }
}

impl fmt::Display for Filesystem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Filesystem {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ext4" => Ok(Filesystem::Ext4),
            "xfs" => Ok(Filesystem::Xfs),
            other => Err(Error::UnsupportedFilesystem(other.to_owned())),
        }
    }
}

/// What a device holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// No signature of any kind.
    Blank,
    /// A filesystem `blkid` names (`ext4`, `xfs`, `swap`, …).
    Filesystem(String),
    /// Something that is not a filesystem but is data: a partition table, LVM, LUKS, RAID.
    Other(String),
}

/// `blkid -p` (low-level probing, no cache) of `device`: its output, or `None` when it finds
/// nothing at all (exit 2 and no output).
fn blkid(device: &Path, args: &[&str]) -> Result<Option<String>, Error> {
    let out = Command::new("blkid")
        .arg("-p")
        .args(args)
        .arg(device)
        .output()
        .map_err(|source| Error::Spawn {
            tool: "blkid",
            source,
        })?;
    if out.status.code() == Some(2) && out.stdout.is_empty() {
        return Ok(None);
    }
    if !out.status.success() {
        return Err(tool_error("blkid", device, &out));
    }
    Ok(Some(String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// Probes the device directly (no cache), for filesystems and partition tables alike.
pub fn probe(device: &Path) -> Result<Probe, Error> {
    Ok(blkid(device, &["-o", "export"])?.map_or(Probe::Blank, |out| parse_probe(&out)))
}

fn parse_probe(export: &str) -> Probe {
    let mut kind = None;
    let mut usage = None;
    let mut pttype = None;
    for line in export.lines() {
        match line.split_once('=') {
            Some(("TYPE", v)) => kind = Some(v.to_owned()),
            Some(("USAGE", v)) => usage = Some(v.to_owned()),
            Some(("PTTYPE", v)) => pttype = Some(v.to_owned()),
            _ => {}
        }
    }
    match (kind, usage, pttype) {
        (Some(t), Some(u), _) if u == "filesystem" => Probe::Filesystem(t),
        (Some(t), _, _) => Probe::Other(t),
        (None, _, Some(pt)) => Probe::Other(format!("{pt} partition table")),
        (None, _, None) => Probe::Blank,
    }
}

/// The UUID of the filesystem on `device`, probed directly (no cache); `None` when the
/// device holds no filesystem with a UUID.
pub fn probe_uuid(device: &Path) -> Result<Option<String>, Error> {
    Ok(blkid(device, &["-o", "value", "-s", "UUID"])?
        .map(|out| out.trim().to_ascii_lowercase())
        .filter(|uuid| !uuid.is_empty()))
}

/// mkfs for `fs` with the given filesystem `uuid`, forcing over what is there when `force`.
fn mkfs(device: &Path, fs: Filesystem, uuid: &str, force: bool) -> Result<(), Error> {
    let mut cmd;
    let tool = match fs {
        Filesystem::Ext4 => {
            cmd = Command::new("mkfs.ext4");
            cmd.args(["-q", "-U", uuid]);
            if force {
                cmd.arg("-F");
            }
            "mkfs.ext4"
        }
        // Without -f, mkfs.xfs refuses on its own to overwrite anything it recognises.
        Filesystem::Xfs => {
            cmd = Command::new("mkfs.xfs");
            cmd.arg("-q").arg("-m").arg(format!("uuid={uuid}"));
            if force {
                cmd.arg("-f");
            }
            "mkfs.xfs"
        }
    };
    run(tool, cmd.arg(device), device)
}

/// Creates `fs` with filesystem UUID `uuid` on `device`, after checking once more that the
/// device is blank. The caller journals `uuid` first: it is how an interrupted format is
/// told apart from a filesystem someone else made.
pub fn make_filesystem(device: &Path, fs: Filesystem, uuid: &str) -> Result<(), Error> {
    match probe(device)? {
        Probe::Blank => {}
        Probe::Filesystem(found) | Probe::Other(found) => {
            return Err(Error::NotBlank {
                device: device.to_owned(),
                found,
            })
        }
    }
    mkfs(device, fs, uuid, false)
}

/// Formats again after an interrupted format, only if the filesystem there carries exactly
/// `uuid`, the one the caller journaled before its own mkfs: anything else may hold data.
pub fn redo_interrupted_format(device: &Path, fs: Filesystem, uuid: &str) -> Result<(), Error> {
    let found = probe_uuid(device)?;
    if found.as_deref() != Some(uuid.to_ascii_lowercase().as_str()) {
        return Err(Error::NotBlank {
            device: device.to_owned(),
            found: format!(
                "a filesystem with UUID {}, not the {uuid} this driver was formatting",
                found.as_deref().unwrap_or("(none)")
            ),
        });
    }
    mkfs(device, fs, uuid, true)
}

/// Grows the filesystem to the size of its device. ext4 grows through the device, xfs only
/// through its mount point; both are online and a no-op when there is nothing to grow.
pub fn grow(fs: Filesystem, device: &Path, mount_point: &Path) -> Result<(), Error> {
    match fs {
        Filesystem::Ext4 => run("resize2fs", Command::new("resize2fs").arg(device), device),
        Filesystem::Xfs => run(
            "xfs_growfs",
            Command::new("xfs_growfs").arg(mount_point),
            mount_point,
        ),
    }
}

fn run(tool: &'static str, cmd: &mut Command, target: &Path) -> Result<(), Error> {
    let out = cmd
        .output()
        .map_err(|source| Error::Spawn { tool, source })?;
    if out.status.success() {
        tracing::debug!(tool, target = %target.display(), "done");
        Ok(())
    } else {
        Err(tool_error(tool, target, &out))
    }
}

fn tool_error(tool: &'static str, target: &Path, out: &std::process::Output) -> Error {
    Error::Tool {
        tool,
        target: target.to_owned(),
        status: out.status.to_string(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_output_is_classified() {
        let cases = [
            (
                "DEVNAME=/dev/nbd0\nTYPE=ext4\nUSAGE=filesystem\n",
                Probe::Filesystem("ext4".into()),
            ),
            (
                "TYPE=LVM2_member\nUSAGE=raid\n",
                Probe::Other("LVM2_member".into()),
            ),
            (
                "TYPE=crypto_LUKS\nUSAGE=crypto\n",
                Probe::Other("crypto_LUKS".into()),
            ),
            (
                "PTTYPE=gpt\nPTUUID=x\n",
                Probe::Other("gpt partition table".into()),
            ),
            ("", Probe::Blank),
        ];
        for (output, want) in cases {
            assert_eq!(parse_probe(output), want, "{output:?}");
        }
    }

    #[test]
    fn filesystem_names() {
        assert_eq!("ext4".parse::<Filesystem>().unwrap(), Filesystem::Ext4);
        assert_eq!("xfs".parse::<Filesystem>().unwrap(), Filesystem::Xfs);
        assert!(
            matches!("btrfs".parse::<Filesystem>(), Err(Error::UnsupportedFilesystem(f)) if f == "btrfs")
        );
    }

    /// Real tools on a real (file-backed) image: mkfs refuses a second format.
    #[test]
    fn formats_blank_images_only() {
        if Command::new("mkfs.ext4").arg("-V").output().is_err() {
            panic!("mkfs.ext4 is missing: install e2fsprogs (see .ci/run)");
        }
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        assert_eq!(probe(&img).unwrap(), Probe::Blank);
        assert_eq!(probe_uuid(&img).unwrap(), None);
        let uuid = "0b5e1f3c-9a7d-4e2b-8c61-d2f0a4b7e913";
        make_filesystem(&img, Filesystem::Ext4, uuid).unwrap();
        assert_eq!(probe(&img).unwrap(), Probe::Filesystem("ext4".into()));
        assert_eq!(probe_uuid(&img).unwrap().as_deref(), Some(uuid));
        let err = make_filesystem(&img, Filesystem::Xfs, uuid).unwrap_err();
        assert!(
            matches!(err, Error::NotBlank { ref found, .. } if found == "ext4"),
            "{err}"
        );
        // An interrupted format is redone only over the filesystem it was making.
        redo_interrupted_format(&img, Filesystem::Ext4, uuid).unwrap();
        let other = "5d2c7a10-3b4e-4f6a-9e8d-1c0b2a394857";
        let err = redo_interrupted_format(&img, Filesystem::Ext4, other).unwrap_err();
        assert!(
            matches!(err, Error::NotBlank { ref found, .. } if found.contains(uuid)),
            "{err}"
        );
        assert_eq!(
            probe_uuid(&img).unwrap().as_deref(),
            Some(uuid),
            "untouched"
        );
    }
}
