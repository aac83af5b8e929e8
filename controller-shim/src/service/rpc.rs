//! The controller's RPCs, by the names the spec, the logs and the metrics use.

/// One RPC of the CSI Controller or GroupController service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rpc {
    CreateVolume,
    DeleteVolume,
    ControllerPublishVolume,
    ControllerUnpublishVolume,
    ValidateVolumeCapabilities,
    GetCapacity,
    ControllerGetCapabilities,
    CreateSnapshot,
    DeleteSnapshot,
    ListSnapshots,
    ControllerExpandVolume,
    ListVolumes,
    ControllerGetVolume,
    ControllerModifyVolume,
    GroupControllerGetCapabilities,
    CreateVolumeGroupSnapshot,
    DeleteVolumeGroupSnapshot,
    GetVolumeGroupSnapshot,
}

impl Rpc {
    pub fn name(self) -> &'static str {
        match self {
            Rpc::CreateVolume => "CreateVolume",
            Rpc::DeleteVolume => "DeleteVolume",
            Rpc::ControllerPublishVolume => "ControllerPublishVolume",
            Rpc::ControllerUnpublishVolume => "ControllerUnpublishVolume",
            Rpc::ValidateVolumeCapabilities => "ValidateVolumeCapabilities",
            Rpc::GetCapacity => "GetCapacity",
            Rpc::ControllerGetCapabilities => "ControllerGetCapabilities",
            Rpc::CreateSnapshot => "CreateSnapshot",
            Rpc::DeleteSnapshot => "DeleteSnapshot",
            Rpc::ListSnapshots => "ListSnapshots",
            Rpc::ControllerExpandVolume => "ControllerExpandVolume",
            Rpc::ListVolumes => "ListVolumes",
            Rpc::ControllerGetVolume => "ControllerGetVolume",
            Rpc::ControllerModifyVolume => "ControllerModifyVolume",
            Rpc::GroupControllerGetCapabilities => "GroupControllerGetCapabilities",
            Rpc::CreateVolumeGroupSnapshot => "CreateVolumeGroupSnapshot",
            Rpc::DeleteVolumeGroupSnapshot => "DeleteVolumeGroupSnapshot",
            Rpc::GetVolumeGroupSnapshot => "GetVolumeGroupSnapshot",
        }
    }
}
