//! One attachment, as the journal keeps it: enough to find, prove, repair and undo
//! everything the daemon did for a volume on this node.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Bumped on any change a previous version could misread.
pub const SCHEMA: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub schema: u32,
    pub volume_id: String,
    /// What the device carries in `/sys/block/nbdN/backend`.
    pub identifier: String,
    /// Where the data lives. `None` only for a record rebuilt from kernel facts after its
    /// journal entry was lost: the next call that carries a context fills it in.
    pub export: Option<Export>,
    /// `N` of `/dev/nbdN`, once CONNECT has answered.
    pub device: Option<u32>,
    /// The staging path kubelet gave NodeStage. `None` only for a rebuilt block volume.
    pub staging_path: Option<PathBuf>,
    pub access: Access,
    pub mode: AccessMode,
    pub phase: Phase,
    /// Size of the device as last attached or expanded.
    pub size_bytes: Option<u64>,
    /// Publish targets, by path.
    pub targets: BTreeMap<PathBuf, Target>,
    /// The UUID given to mkfs, journaled before it runs: an interrupted format is redone
    /// only over a filesystem that carries exactly this UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_uuid: Option<String>,
    /// Rebuilt from kernel facts after its journal entry was lost: the staging path and
    /// access were inferred, and the CO's word replaces them at the next call.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rebuilt: bool,
    /// The device's TCP connections as last known (empty for unix-socket exports): what lets a
    /// later daemon abort them by address when they must be replaced.
    #[serde(default)]
    pub tcp: Vec<TcpConnection>,
    /// The TLS session of the device's connections when attached (`TLSv1_3
    /// TLS13_AES_256_GCM_SHA384`), kernel TLS since; `None` for plaintext exports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TcpConnection {
    pub local: std::net::SocketAddr,
    pub peer: std::net::SocketAddr,
    /// The socket's inode when it was handed to the kernel: with the address pair, what
    /// proves a connection found later is still the device's (a port can be reused by
    /// another process's connection to the same server). `None` in records of older versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inode: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Export {
    pub uri: String,
    pub connections: u8,
    /// The node's `[tls-profile.<name>]` an `nbds://` export is dialed with; the node's
    /// default TLS settings when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_profile: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Access {
    Block,
    /// `flags` may hold sensitive values: the journal is root-only and never logged.
    Mount {
        fs: String,
        flags: Vec<String>,
    },
}

impl Access {
    pub fn is_block(&self) -> bool {
        matches!(self, Access::Block)
    }
}

/// For messages and logs: the kind and filesystem, never the mount flags (they may carry
/// secrets).
impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Access::Block => f.write_str("raw block"),
            Access::Mount { fs, .. } => write!(f, "{fs} filesystem"),
        }
    }
}

/// CSI access modes, by their spec names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    MultiNodeMultiWriter,
}

impl AccessMode {
    pub fn multi_node(self) -> bool {
        matches!(
            self,
            AccessMode::MultiNodeReaderOnly
                | AccessMode::MultiNodeSingleWriter
                | AccessMode::MultiNodeMultiWriter
        )
    }

    /// Modes that allow one publish target only (one workload on this node).
    pub fn single_target(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeSingleWriter | AccessMode::SingleNodeReaderOnly
        )
    }

    pub fn read_only(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeReaderOnly | AccessMode::MultiNodeReaderOnly
        )
    }
}

/// Where staging stands. Each step is journaled before it is taken, so after a crash the
/// phase says which step may have been half done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum Phase {
    /// CONNECT may have been sent: the device is found by identifier, if it exists.
    Attaching,
    /// The device exists and carries the identifier.
    Attached,
    /// mkfs with the journaled `fs_uuid` may have started on a device that was blank before
    /// it: redone only over a filesystem with that UUID.
    Formatting,
    /// The staging mount may or may not exist.
    Mounting,
    Staged,
    /// RECONFIGURE to this size and a filesystem grow may be under way.
    Expanding {
        to_bytes: u64,
    },
    /// Teardown started: staging unmount, then DISCONNECT.
    Unstaging,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    pub read_only: bool,
    pub phase: TargetPhase,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetPhase {
    Publishing,
    Published,
    Unpublishing,
}

impl Record {
    pub fn device_index(&self) -> Option<nbd::DeviceIndex> {
        self.device.map(nbd::DeviceIndex)
    }

    /// Whether the staging path and capability were inferred from kernel facts (the journal
    /// entry was lost) rather than told by the CO.
    pub fn inferred(&self) -> bool {
        self.rebuilt || self.export.is_none()
    }

    pub fn is_staging_path(&self, path: &Path) -> bool {
        self.staging_path.as_deref() == Some(path)
    }

    /// Whether `path` is a path of this volume: its staging path or one of its targets.
    pub fn owns_path(&self, path: &Path) -> bool {
        self.is_staging_path(path) || self.targets.contains_key(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_is_shown_without_its_mount_flags() {
        let a = Access::Mount {
            fs: "ext4".into(),
            flags: vec!["password=hunter2".into()],
        };
        assert_eq!(a.to_string(), "ext4 filesystem");
        assert_eq!(Access::Block.to_string(), "raw block");
    }

    #[test]
    fn json_shape_is_stable() {
        let mut targets = BTreeMap::new();
        targets.insert(
            PathBuf::from("/var/lib/kubelet/pods/p/volumes/v/mount"),
            Target {
                read_only: true,
                phase: TargetPhase::Published,
            },
        );
        let r = Record {
            schema: SCHEMA,
            volume_id: "pvc-1".into(),
            identifier: "ustor:n:pvc-1:00".into(),
            export: Some(Export {
                uri: "nbd://h:10809/x".into(),
                connections: 2,
                tls_profile: None,
            }),
            device: Some(3),
            staging_path: Some("/stage".into()),
            access: Access::Mount {
                fs: "xfs".into(),
                flags: vec!["noatime".into()],
            },
            mode: AccessMode::SingleNodeWriter,
            phase: Phase::Expanding { to_bytes: 1 << 30 },
            size_bytes: Some(1 << 29),
            targets,
            fs_uuid: Some("0b5e1f3c-9a7d-4e2b-8c61-d2f0a4b7e913".into()),
            rebuilt: false,
            tcp: vec![TcpConnection {
                local: "10.0.0.1:40000".parse().unwrap(),
                peer: "10.0.0.2:10809".parse().unwrap(),
                inode: Some(4242),
            }],
            tls: Some("TLSv1_3 TLS13_AES_128_GCM_SHA256".into()),
        };
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["phase"]["step"], "expanding");
        assert_eq!(json["access"]["kind"], "mount");
        assert_eq!(json["mode"], "SINGLE_NODE_WRITER");
        let back: Record = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);
    }
}
