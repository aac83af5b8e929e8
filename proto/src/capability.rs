//! The driver's access-mode rules over the generated types, in one place so that the node and
//! the controller cannot disagree: a filesystem lives on one node; several nodes only for block
//! volumes (live migration of VM disks), and never "several nodes, one writer", which a block
//! device cannot enforce.

use crate::csi::volume_capability::access_mode::Mode;
use crate::csi::volume_capability::{AccessType, MountVolume};
use crate::csi::VolumeCapability;

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
        Some(AccessType::Block(_)) if mode == Mode::MultiNodeSingleWriter => Err(
            "MULTI_NODE_SINGLE_WRITER is not supported for block volumes: use MULTI_NODE_MULTI_WRITER (ReadWriteMany) for VM live migration"
                .into(),
        ),
        Some(AccessType::Block(_)) => Ok((mode, Shape::Block)),
    }
}
