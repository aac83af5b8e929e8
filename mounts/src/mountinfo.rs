//! `/proc/self/mountinfo`, parsed.
//!
//! Written by hand rather than taken from `procfs`: the kernel escapes space, tab, newline and
//! backslash in paths as octal (`\040`), and a parser that keeps the escapes would never match
//! a target path that contains one.

use std::path::{Path, PathBuf};

use crate::Error;

/// One mount, as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub id: u32,
    pub parent: u32,
    /// `st_dev` of the filesystem: for a block-device filesystem, the device's numbers.
    pub major: u32,
    pub minor: u32,
    /// The directory (or file) of the filesystem mounted here; `/nbd0` for a bind mount of
    /// `/dev/nbd0` out of devtmpfs.
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`, `ro`, `nosuid`, …).
    pub options: Vec<String>,
    pub fs_type: String,
    pub source: String,
}

impl MountEntry {
    pub fn read_only(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }
}

/// A snapshot of the mount table.
#[derive(Debug, Clone, Default)]
pub struct MountTable(pub Vec<MountEntry>);

impl MountTable {
    pub const PATH: &'static str = "/proc/self/mountinfo";

    pub fn read() -> Result<Self, Error> {
        let text = std::fs::read_to_string(Self::PATH).map_err(|source| Error::Read {
            path: Self::PATH.into(),
            source,
        })?;
        Self::parse(&text)
    }

    pub fn parse(text: &str) -> Result<Self, Error> {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(n, l)| {
                parse_line(l).map_err(|reason| Error::MountInfo {
                    line: n + 1,
                    reason,
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(MountTable)
    }

    /// Mounts whose mount point is `path`, innermost (last mounted) last.
    pub fn at<'a>(&'a self, path: &'a Path) -> impl Iterator<Item = &'a MountEntry> + 'a {
        self.0.iter().filter(move |m| m.mount_point == path)
    }

    pub fn is_mount_point(&self, path: &Path) -> bool {
        self.at(path).next().is_some()
    }

    /// Filesystems living on the block device `major:minor`, wherever mounted.
    pub fn of_device(&self, major: u32, minor: u32) -> impl Iterator<Item = &MountEntry> + '_ {
        self.0
            .iter()
            .filter(move |m| m.major == major && m.minor == minor)
    }

    /// Bind mounts of the device node `/dev/<name>` itself (raw block publishing): devtmpfs
    /// mounts whose root is `/<name>`.
    pub fn of_device_node<'a>(
        &'a self,
        name: &'a str,
    ) -> impl Iterator<Item = &'a MountEntry> + 'a {
        self.0.iter().filter(move |m| {
            m.fs_type == "devtmpfs"
                && m.root.as_os_str().as_encoded_bytes().strip_prefix(b"/") == Some(name.as_bytes())
        })
    }
}

fn parse_line(line: &str) -> Result<MountEntry, String> {
    let (pre, post) = line
        .split_once(" - ")
        .ok_or_else(|| "no \" - \" separator".to_owned())?;
    let pre: Vec<&str> = pre.split(' ').collect();
    let post: Vec<&str> = post.split(' ').collect();
    if pre.len() < 6 || post.len() < 2 {
        return Err(format!("too few fields in {line:?}"));
    }
    let num = |s: &str, what: &str| s.parse::<u32>().map_err(|_| format!("bad {what} {s:?}"));
    let (major, minor) = pre[2]
        .split_once(':')
        .ok_or_else(|| format!("bad major:minor {:?}", pre[2]))?;
    Ok(MountEntry {
        id: num(pre[0], "mount id")?,
        parent: num(pre[1], "parent id")?,
        major: num(major, "major")?,
        minor: num(minor, "minor")?,
        root: unescape(pre[3]).into(),
        mount_point: unescape(pre[4]).into(),
        options: pre[5].split(',').map(str::to_owned).collect(),
        fs_type: post[0].to_owned(),
        source: unescape(post[1]),
    })
}

/// Undoes the kernel's `\ooo` octal escaping of path characters.
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
25 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw,size=8104748k
310 22 43:0 / /var/lib/kubelet/plugins/kubernetes.io/csi/ustor-nbd.csi.mindsw.io/abc/globalmount rw,relatime shared:160 - ext4 /dev/nbd0 rw
320 22 43:0 / /var/lib/kubelet/pods/p1/volumes/kubernetes.io~csi/pvc-1/mount ro,relatime shared:160 - ext4 /dev/nbd0 rw
330 22 0:5 /nbd1 /var/lib/kubelet/pods/p2/volumeDevices/kubernetes.io~csi/pvc-2 rw,nosuid shared:2 - devtmpfs udev rw
331 22 0:5 /nbd10 /var/lib/kubelet/pods/p3/volumeDevices/kubernetes.io~csi/pvc-3 rw,nosuid shared:2 - devtmpfs udev rw
340 22 43:2 / /mnt/with\\040space rw master:3 propagate_from:1 - xfs /dev/nbd2 rw,attr2
";

    #[test]
    fn parses_fields_and_escapes() {
        let t = MountTable::parse(SAMPLE).unwrap();
        assert_eq!(t.0.len(), 7);
        let m = &t.0[2];
        assert_eq!((m.id, m.parent, m.major, m.minor), (310, 22, 43, 0));
        assert_eq!(m.fs_type, "ext4");
        assert_eq!(m.source, "/dev/nbd0");
        assert!(!m.read_only());
        assert!(t.0[3].read_only());
        let spaced = Path::new("/mnt/with space");
        assert!(t.is_mount_point(spaced));
        assert_eq!(t.at(spaced).next().unwrap().fs_type, "xfs");
    }

    #[test]
    fn finds_mounts_of_a_device_and_its_node() {
        let t = MountTable::parse(SAMPLE).unwrap();
        assert_eq!(t.of_device(43, 0).count(), 2);
        assert_eq!(t.of_device(43, 1).count(), 0);
        let nodes: Vec<_> = t.of_device_node("nbd1").map(|m| m.id).collect();
        assert_eq!(nodes, vec![330], "nbd1 must not match nbd10");
    }

    #[test]
    fn malformed_lines_are_errors_with_a_line_number() {
        let err = MountTable::parse("22 1 259:2 / / rw\n").unwrap_err();
        assert!(matches!(err, Error::MountInfo { line: 1, .. }), "{err}");
        let err = MountTable::parse(&format!("{SAMPLE}x y z:w / / rw - ext4 a b\n")).unwrap_err();
        assert!(matches!(err, Error::MountInfo { line: 8, .. }), "{err}");
    }

    #[test]
    fn unescape_handles_edges() {
        assert_eq!(unescape(r"a\040b\011c"), "a b\tc");
        assert_eq!(unescape(r"trailing\04"), r"trailing\04");
        assert_eq!(unescape(r"back\134slash"), r"back\slash");
    }
}
