//! One attachment, as the journal keeps it: enough to find, prove, repair and undo
//! everything the daemon did for a volume on this node.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nbd::{BackendId, DeviceIndex};
use serde::{Deserialize, Serialize};

use crate::ids::VolumeId;
use crate::volumes::lifecycle::Owner;

/// Bumped on any change a previous version could misread.
pub const SCHEMA: u32 = 1;

/// The phase and the targets' phases are private: only [`crate::volumes::lifecycle`] changes
/// them (it holds the [`Owner`] their setters ask for), journaling each change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub schema: u32,
    pub volume_id: VolumeId,
    /// What the device carries in `/sys/block/nbdN/backend`.
    #[serde(with = "backend_id")]
    pub identifier: BackendId,
    /// Where the data lives. `None` only for a record rebuilt from kernel facts after its
    /// journal entry was lost: the next call that carries a context fills it in.
    pub export: Option<Export>,
    /// `N` of `/dev/nbdN`, once CONNECT has answered.
    #[serde(with = "device_index")]
    pub device: Option<DeviceIndex>,
    /// The staging path kubelet gave NodeStage. `None` only for a rebuilt block volume.
    pub staging_path: Option<PathBuf>,
    pub access: Access,
    pub mode: AccessMode,
    phase: Phase,
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
    /// What the export offered at CONNECT: healing splices in only an export that still
    /// offers it (see [`crate::connections::splice_refusal`]). `None` in records journaled
    /// before it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attached_with: Option<AttachedWith>,
    /// The export's server refused this node's grant: the volume was published elsewhere.
    /// Never healed or attached again under this record; NodeUnpublish and NodeUnstage
    /// clean up what is left (see [`crate::fence`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fenced: Option<Fenced>,
}

/// When and why a volume was fenced on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fenced {
    /// Seconds since the Unix epoch.
    pub at: u64,
    /// The server's refusal, as it worded it.
    pub refusal: String,
}

/// The export's transmission flags and the device's connection count at CONNECT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachedWith {
    /// NBD transmission flags, as the handshake gave them.
    pub flags: u16,
    pub connections: usize,
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
    /// Where the TLS material NodeStage's secrets delivered is kept (see [`crate::stage_tls`]):
    /// every dial of the volume reads it there. `None`: the node's own files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_tls: Option<std::path::PathBuf>,
    /// The node's fencing grant from ControllerPublishVolume (see [`nbd::grant`]): a
    /// credential, kept only here and in the root-only journal.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "grant")]
    pub grant: Option<nbd::Grant>,
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
    phase: TargetPhase,
}

impl Target {
    /// A target found mounted (a record rebuilt from kernel facts, a guessed staging path
    /// that is a pod's mount): published already.
    pub fn published(read_only: bool) -> Self {
        Self {
            read_only,
            phase: TargetPhase::Published,
        }
    }

    pub fn phase(&self) -> TargetPhase {
        self.phase
    }

    /// For the lifecycle only.
    pub(crate) fn with_phase(read_only: bool, phase: TargetPhase, _: &Owner) -> Self {
        Self { read_only, phase }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetPhase {
    Publishing,
    Published,
    Unpublishing,
}

impl Record {
    /// A new attachment, before CONNECT: the first phase of every staging.
    pub fn attaching(
        volume_id: VolumeId,
        identifier: BackendId,
        export: Export,
        staging_path: PathBuf,
        access: Access,
        mode: AccessMode,
    ) -> Self {
        Self {
            schema: SCHEMA,
            volume_id,
            identifier,
            export: Some(export),
            device: None,
            staging_path: Some(staging_path),
            access,
            mode,
            phase: Phase::Attaching,
            size_bytes: None,
            targets: BTreeMap::new(),
            fs_uuid: None,
            rebuilt: false,
            tcp: Vec::new(),
            tls: None,
            attached_with: None,
            fenced: None,
        }
    }

    /// A record rebuilt from kernel facts for a device the journal lost: staged, with what
    /// the mount table says, marked as rebuilt so the CO's word replaces the guesses.
    pub fn rebuilt(
        volume_id: VolumeId,
        identifier: BackendId,
        device: DeviceIndex,
        staging_path: Option<PathBuf>,
        access: Access,
        targets: BTreeMap<PathBuf, Target>,
        size_bytes: Option<u64>,
    ) -> Self {
        Self {
            schema: SCHEMA,
            volume_id,
            identifier,
            export: None,
            device: Some(device),
            staging_path,
            access,
            mode: AccessMode::SingleNodeWriter,
            phase: Phase::Staged,
            size_bytes,
            targets,
            fs_uuid: None,
            rebuilt: true,
            tcp: Vec::new(),
            tls: None,
            attached_with: None,
            fenced: None,
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// For the lifecycle only, which checks the transition and journals it.
    pub(crate) fn set_phase(&mut self, phase: Phase, _: &Owner) {
        self.phase = phase;
    }

    /// A record in another phase, for tests that need one.
    #[cfg(test)]
    pub(crate) fn in_phase(mut self, phase: Phase) -> Self {
        self.phase = phase;
        self
    }

    pub fn device_index(&self) -> Option<DeviceIndex> {
        self.device
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

/// A [`BackendId`] as the journal keeps it: a plain string.
mod backend_id {
    use nbd::BackendId;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(id: &BackendId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(id.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BackendId, D::Error> {
        BackendId::new(String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// A grant as the journal keeps it: its token, or nothing.
mod grant {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(grant: &Option<nbd::Grant>, s: S) -> Result<S::Ok, S::Error> {
        match grant {
            Some(g) => s.serialize_some(g.token()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<nbd::Grant>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|t| nbd::Grant::new(t).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// A [`DeviceIndex`] as the journal keeps it: `N` of `/dev/nbdN`, or null.
mod device_index {
    use nbd::DeviceIndex;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(index: &Option<DeviceIndex>, s: S) -> Result<S::Ok, S::Error> {
        match index {
            Some(DeviceIndex(n)) => s.serialize_some(n),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DeviceIndex>, D::Error> {
        Ok(Option::<u32>::deserialize(d)?.map(DeviceIndex))
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
            volume_id: VolumeId::parse("pvc-1").unwrap(),
            identifier: BackendId::new("ustor:n:pvc-1:00").unwrap(),
            export: Some(Export {
                uri: "nbd://h:10809/x".into(),
                connections: 2,
                tls_profile: None,
                stage_tls: None,
                grant: Some(nbd::Grant::new("0f3a9c").unwrap()),
            }),
            device: Some(DeviceIndex(3)),
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
            attached_with: Some(AttachedWith {
                flags: 0x010d,
                connections: 2,
            }),
            fenced: Some(Fenced {
                at: 1_796_000_000,
                refusal: "no live grant".into(),
            }),
        };
        let json = serde_json::to_value(&r).unwrap();
        // The journal keeps the grant's token (healing dials with it); Debug never shows it.
        assert_eq!(json["export"]["grant"], "0f3a9c");
        assert!(!format!("{r:?}").contains("0f3a9c"));
        assert_eq!(json["fenced"]["refusal"], "no live grant");
        assert_eq!(json["attached_with"]["flags"], 0x010d);
        assert_eq!(json["attached_with"]["connections"], 2);
        assert_eq!(json["phase"]["step"], "expanding");
        assert_eq!(json["access"]["kind"], "mount");
        assert_eq!(json["mode"], "SINGLE_NODE_WRITER");
        assert_eq!(json["volume_id"], "pvc-1");
        assert_eq!(json["identifier"], "ustor:n:pvc-1:00");
        assert_eq!(json["device"], 3);
        let back: Record = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);
    }

    /// A record exactly as version 0.3 wrote it (before ids were typed) loads, and is written
    /// back byte for byte.
    #[test]
    fn a_record_of_the_previous_version_loads() {
        let old = r#"{
  "schema": 1,
  "volume_id": "pvc-7",
  "identifier": "ustor:node-a:pvc-7:0011223344556677",
  "export": {
    "uri": "nbd://10.0.0.2:10809/pvc-7",
    "connections": 2
  },
  "device": 4,
  "staging_path": "/var/lib/kubelet/plugins/kubernetes.io/csi/ustor/staging/pvc-7",
  "access": {
    "kind": "mount",
    "fs": "ext4",
    "flags": []
  },
  "mode": "SINGLE_NODE_WRITER",
  "phase": {
    "step": "staged"
  },
  "size_bytes": 1073741824,
  "targets": {
    "/var/lib/kubelet/pods/p/volumes/v/mount": {
      "read_only": false,
      "phase": "published"
    }
  },
  "tcp": []
}"#;
        let r: Record = serde_json::from_str(old).unwrap();
        assert_eq!(r.volume_id.as_str(), "pvc-7");
        assert_eq!(r.identifier.as_str(), "ustor:node-a:pvc-7:0011223344556677");
        assert_eq!(r.device, Some(DeviceIndex(4)));
        assert_eq!(r.phase(), Phase::Staged);
        assert_eq!(
            r.targets.values().next().map(Target::phase),
            Some(TargetPhase::Published)
        );
        assert_eq!(serde_json::to_string_pretty(&r).unwrap(), old);
        let unattached = old.replace("\"device\": 4", "\"device\": null");
        let r: Record = serde_json::from_str(&unattached).unwrap();
        assert_eq!(r.device, None);
        for bad in [
            old.replace("\"pvc-7\",\n", "\"\",\n"),
            old.replace("ustor:node-a:pvc-7:0011223344556677", "has space"),
        ] {
            assert!(serde_json::from_str::<Record>(&bad).is_err(), "{bad}");
        }
    }
}
