//! CSI GroupController on the wire: group snapshots, through the same call wrapper as the
//! Controller's RPCs (one span, metric and error mapping for both services).

use csi_proto::csi::group_controller_server::GroupController;
use csi_proto::csi::group_controller_service_capability::rpc::Type as RpcCap;
use csi_proto::csi::group_controller_service_capability::{Rpc as RpcCapability, Type as CapType};
use csi_proto::csi::*;
use tonic::{Request, Response, Status};

use super::controller::{About, ControllerService, Subject};
use super::rpc::Rpc;

impl Subject for GroupControllerGetCapabilitiesRequest {
    fn about(&self) -> About<'_> {
        About::default()
    }
}

impl Subject for CreateVolumeGroupSnapshotRequest {
    fn about(&self) -> About<'_> {
        About::named(&self.name)
    }
}

impl Subject for DeleteVolumeGroupSnapshotRequest {
    fn about(&self) -> About<'_> {
        About {
            group_snapshot_id: &self.group_snapshot_id,
            ..About::default()
        }
    }
}

impl Subject for GetVolumeGroupSnapshotRequest {
    fn about(&self) -> About<'_> {
        About {
            group_snapshot_id: &self.group_snapshot_id,
            ..About::default()
        }
    }
}

#[tonic::async_trait]
impl GroupController for ControllerService {
    async fn group_controller_get_capabilities(
        &self,
        r: Request<GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<GroupControllerGetCapabilitiesResponse>, Status> {
        self.call(Rpc::GroupControllerGetCapabilities, r, |_, _| async {
            Ok(GroupControllerGetCapabilitiesResponse {
                capabilities: vec![GroupControllerServiceCapability {
                    r#type: Some(CapType::Rpc(RpcCapability {
                        r#type: RpcCap::CreateDeleteGetVolumeGroupSnapshot as i32,
                    })),
                }],
            })
        })
        .await
    }

    async fn create_volume_group_snapshot(
        &self,
        r: Request<CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<CreateVolumeGroupSnapshotResponse>, Status> {
        self.call(Rpc::CreateVolumeGroupSnapshot, r, |p, r| async move {
            p.create_group_snapshot(r).await
        })
        .await
    }

    async fn delete_volume_group_snapshot(
        &self,
        r: Request<DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<DeleteVolumeGroupSnapshotResponse>, Status> {
        self.call(Rpc::DeleteVolumeGroupSnapshot, r, |p, r| async move {
            p.delete_group_snapshot(r).await
        })
        .await
    }

    async fn get_volume_group_snapshot(
        &self,
        r: Request<GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<GetVolumeGroupSnapshotResponse>, Status> {
        self.call(Rpc::GetVolumeGroupSnapshot, r, |p, r| async move {
            p.get_group_snapshot(r).await
        })
        .await
    }
}
