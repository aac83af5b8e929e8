//! The driver's access-mode rules over the generated types, in one place so that the node and
//! the controller cannot disagree: a filesystem lives on one node; several nodes only for block
//! volumes (live migration of VM disks), and never "several nodes, one writer", which a block
//! device cannot enforce. Block volumes use ReadWriteOncePod for one pod and ReadWriteMany for
//! live migration, as the guide says: ReadWriteOnce would let several pods of a node write one
//! raw disk unawares, and ReadOnlyMany is not offered.

use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::volume_capability::{AccessType, MountVolume};
use csi_proto::csi::VolumeCapability;

/// How the volume is accessed, once the rules allow it.
#[derive(Debug, Clone, Copy)]
pub enum Shape<'a> {
    Block,
    Mount(&'a MountVolume),
}

pub fn multi_node(mode: Mode) -> bool {
    matches!(
        mode,
        Mode::MultiNodeReaderOnly | Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter
    )
}

/// Checks a capability against the rules; the error is a message for INVALID_ARGUMENT.
pub fn check(cap: &VolumeCapability) -> Result<(Mode, Shape<'_>), String> {
    let mode = cap
        .access_mode
        .as_ref()
        .map(|m| m.mode())
        .filter(|m| *m != Mode::Unknown)
        .ok_or("volume_capability.access_mode is required")?;
    match &cap.access_type {
        None => Err("volume_capability needs access_type block or mount".into()),
        Some(AccessType::Mount(_)) if multi_node(mode) => Err(
            "a filesystem volume can be used on one node only: ReadWriteMany and ReadOnlyMany need volumeMode: Block"
                .into(),
        ),
        Some(AccessType::Mount(m)) => Ok((mode, Shape::Mount(m))),
        Some(AccessType::Block(_)) => match mode {
            Mode::SingleNodeSingleWriter | Mode::SingleNodeReaderOnly | Mode::MultiNodeMultiWriter => {
                Ok((mode, Shape::Block))
            }
            Mode::MultiNodeSingleWriter => Err(
                "MULTI_NODE_SINGLE_WRITER is not supported for block volumes: use MULTI_NODE_MULTI_WRITER (ReadWriteMany) for VM live migration"
                    .into(),
            ),
            Mode::SingleNodeWriter | Mode::SingleNodeMultiWriter => Err(
                "ReadWriteOnce is not offered for block volumes: use ReadWriteOncePod (SINGLE_NODE_SINGLE_WRITER) for one pod, or ReadWriteMany (MULTI_NODE_MULTI_WRITER) for VM live migration"
                    .into(),
            ),
            Mode::MultiNodeReaderOnly | Mode::Unknown => Err(
                "ReadOnlyMany is not offered for block volumes: use ReadWriteOncePod (SINGLE_NODE_SINGLE_WRITER) and publish read-only"
                    .into(),
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi_proto::csi::volume_capability::{AccessMode, BlockVolume};

    fn block(mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_type: Some(AccessType::Block(BlockVolume {})),
            access_mode: Some(AccessMode { mode: mode as i32 }),
        }
    }

    #[test]
    fn block_volumes_take_the_guides_modes_only() {
        for ok in [
            Mode::SingleNodeSingleWriter,
            Mode::MultiNodeMultiWriter,
            Mode::SingleNodeReaderOnly,
        ] {
            assert!(check(&block(ok)).is_ok(), "{ok:?}");
        }
        for (refused, says) in [
            (Mode::SingleNodeWriter, "ReadWriteOncePod"),
            (Mode::SingleNodeMultiWriter, "ReadWriteOncePod"),
            (Mode::MultiNodeReaderOnly, "ReadWriteOncePod"),
            (Mode::MultiNodeSingleWriter, "MULTI_NODE_MULTI_WRITER"),
        ] {
            let err = check(&block(refused)).unwrap_err();
            assert!(err.contains(says), "{refused:?}: {err}");
        }
    }
}
