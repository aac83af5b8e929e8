//! CSI Controller on the wire: each RPC names what its request is about and hands it to the
//! domain ([`Provisioner`]) through [`ControllerService::call`], the one place that opens
//! the call's span, counts it, maps its error ([`super::status`]) and logs a failure.

use std::future::Future;
use std::sync::Arc;

use csi_proto::csi::controller_server::Controller;
use csi_proto::csi::controller_service_capability::rpc::Type as RpcCap;
use csi_proto::csi::controller_service_capability::{Rpc as RpcCapability, Type as CapType};
use csi_proto::csi::*;
use tonic::{Request, Response, Status};
use tracing::field::Empty;
use tracing::Instrument;

use super::codes;
use super::rpc::Rpc;
use crate::error::Error;
use crate::metrics::ControllerMetrics;
use crate::provision::Provisioner;

#[derive(Debug)]
pub struct ControllerService {
    provisioner: Arc<Provisioner>,
    metrics: Arc<ControllerMetrics>,
}

/// What a request is about, for its span: the ids and names it carries (empty when none).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct About<'a> {
    pub name: &'a str,
    pub volume_id: &'a str,
    pub snapshot_id: &'a str,
    pub group_snapshot_id: &'a str,
    pub node: &'a str,
}

/// A request that names what it is about.
pub(super) trait Subject {
    fn about(&self) -> About<'_>;
}

impl ControllerService {
    pub fn new(provisioner: Provisioner, metrics: Arc<ControllerMetrics>) -> Self {
        Self {
            provisioner: Arc::new(provisioner),
            metrics,
        }
    }

    /// Runs one RPC: in a span naming it and what it is about, counted with its latency and
    /// code, its error mapped by the status table and logged once.
    ///
    /// The work runs as a task of its own, which finishes even when the CO gives the call up
    /// (tonic drops the handler at the deadline): an unpublish dropped mid-way would release
    /// the image's lock with its revoke half done, and a publish with its grant made but not
    /// recorded. The retry waits for the image's lock and finds the work finished.
    pub(super) async fn call<R: Subject, T, F>(
        &self,
        rpc: Rpc,
        request: Request<R>,
        work: impl FnOnce(Arc<Provisioner>, R) -> F,
    ) -> Result<Response<T>, Status>
    where
        F: Future<Output = Result<T, Error>> + Send + 'static,
        T: Send + 'static,
    {
        let request = request.into_inner();
        let about = request.about();
        let span = tracing::info_span!(
            "csi",
            op = rpc.name(),
            name = Empty,
            volume_id = Empty,
            snapshot_id = Empty,
            group_snapshot_id = Empty,
            node = Empty
        );
        for (field, value) in [
            ("name", about.name),
            ("volume_id", about.volume_id),
            ("snapshot_id", about.snapshot_id),
            ("group_snapshot_id", about.group_snapshot_id),
            ("node", about.node),
        ] {
            if !value.is_empty() {
                span.record(field, value);
            }
        }
        let started = std::time::Instant::now();
        let (provisioner, metrics) = (Arc::clone(&self.provisioner), Arc::clone(&self.metrics));
        let work = work(provisioner, request);
        let task = tokio::spawn(async move {
            let result = work.instrument(span.clone()).await;
            let answer = result.map(Response::new).map_err(|e| {
                let status = codes::status(rpc, &e);
                span.in_scope(|| {
                    tracing::warn!(code = ?status.code(), message = status.message(), "failed");
                });
                status
            });
            let code = answer
                .as_ref()
                .map_or_else(Status::code, |_| tonic::Code::Ok);
            metrics
                .calls
                .observe(rpc.name(), code, started.elapsed().as_secs_f64());
            answer
        });
        // A panic in the work is the call's panic, as it was before the work had a task.
        task.await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }
}

/// The RPCs this controller serves, as ControllerGetCapabilities lists them.
const CAPABILITIES: [RpcCap; 14] = [
    RpcCap::CreateDeleteVolume,
    RpcCap::PublishUnpublishVolume,
    RpcCap::ListVolumes,
    RpcCap::ListVolumesPublishedNodes,
    RpcCap::GetVolume,
    RpcCap::VolumeCondition,
    RpcCap::ModifyVolume,
    RpcCap::GetCapacity,
    RpcCap::CreateDeleteSnapshot,
    RpcCap::ListSnapshots,
    RpcCap::CloneVolume,
    RpcCap::ExpandVolume,
    RpcCap::PublishReadonly,
    RpcCap::SingleNodeMultiWriter,
];

fn capability_of(rpc: RpcCap) -> ControllerServiceCapability {
    ControllerServiceCapability {
        r#type: Some(CapType::Rpc(RpcCapability { r#type: rpc as i32 })),
    }
}

impl<'a> About<'a> {
    pub(super) fn named(name: &'a str) -> Self {
        Self {
            name,
            ..Self::default()
        }
    }

    fn volume(volume_id: &'a str) -> Self {
        Self {
            volume_id,
            ..Self::default()
        }
    }

    fn on_node(self, node: &'a str) -> Self {
        Self { node, ..self }
    }
}

impl Subject for CreateVolumeRequest {
    fn about(&self) -> About<'_> {
        About::named(&self.name)
    }
}

impl Subject for DeleteVolumeRequest {
    fn about(&self) -> About<'_> {
        About::volume(&self.volume_id)
    }
}

impl Subject for ControllerPublishVolumeRequest {
    fn about(&self) -> About<'_> {
        About::volume(&self.volume_id).on_node(&self.node_id)
    }
}

impl Subject for ControllerUnpublishVolumeRequest {
    fn about(&self) -> About<'_> {
        About::volume(&self.volume_id).on_node(&self.node_id)
    }
}

impl Subject for ValidateVolumeCapabilitiesRequest {
    fn about(&self) -> About<'_> {
        About::volume(&self.volume_id)
    }
}

impl Subject for ControllerExpandVolumeRequest {
    fn about(&self) -> About<'_> {
        About::volume(&self.volume_id)
    }
}

impl Subject for ControllerGetVolumeRequest {
    fn about(&self) -> About<'_> {
        About::volume(&self.volume_id)
    }
}

impl Subject for ControllerModifyVolumeRequest {
    fn about(&self) -> About<'_> {
        About::volume(&self.volume_id)
    }
}

/// Requests about no one object.
impl Subject for ListVolumesRequest {
    fn about(&self) -> About<'_> {
        About::default()
    }
}

impl Subject for GetCapacityRequest {
    fn about(&self) -> About<'_> {
        About::default()
    }
}

impl Subject for ControllerGetCapabilitiesRequest {
    fn about(&self) -> About<'_> {
        About::default()
    }
}

impl Subject for CreateSnapshotRequest {
    fn about(&self) -> About<'_> {
        About {
            volume_id: &self.source_volume_id,
            ..About::named(&self.name)
        }
    }
}

impl Subject for DeleteSnapshotRequest {
    fn about(&self) -> About<'_> {
        About {
            snapshot_id: &self.snapshot_id,
            ..About::default()
        }
    }
}

impl Subject for ListSnapshotsRequest {
    fn about(&self) -> About<'_> {
        About {
            snapshot_id: &self.snapshot_id,
            ..About::volume(&self.source_volume_id)
        }
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        r: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        self.call(Rpc::CreateVolume, r, |p, r| async move {
            p.create_volume(r).await
        })
        .await
    }

    async fn delete_volume(
        &self,
        r: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        self.call(Rpc::DeleteVolume, r, |p, r| async move {
            p.delete_volume(r).await
        })
        .await
    }

    async fn controller_publish_volume(
        &self,
        r: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        self.call(Rpc::ControllerPublishVolume, r, |p, r| async move {
            p.publish(r).await
        })
        .await
    }

    async fn controller_unpublish_volume(
        &self,
        r: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        self.call(Rpc::ControllerUnpublishVolume, r, |p, r| async move {
            p.unpublish(r).await
        })
        .await
    }

    async fn validate_volume_capabilities(
        &self,
        r: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        self.call(Rpc::ValidateVolumeCapabilities, r, |p, r| async move {
            p.validate_capabilities(r).await
        })
        .await
    }

    async fn get_capacity(
        &self,
        r: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        self.call(
            Rpc::GetCapacity,
            r,
            |p, r| async move { p.capacity(r).await },
        )
        .await
    }

    async fn controller_get_capabilities(
        &self,
        r: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        self.call(Rpc::ControllerGetCapabilities, r, |_, _| async {
            Ok(ControllerGetCapabilitiesResponse {
                capabilities: CAPABILITIES.into_iter().map(capability_of).collect(),
            })
        })
        .await
    }

    async fn create_snapshot(
        &self,
        r: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        self.call(Rpc::CreateSnapshot, r, |p, r| async move {
            p.create_snapshot(r).await
        })
        .await
    }

    async fn delete_snapshot(
        &self,
        r: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        self.call(Rpc::DeleteSnapshot, r, |p, r| async move {
            p.delete_snapshot(r).await
        })
        .await
    }

    async fn list_snapshots(
        &self,
        r: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        self.call(Rpc::ListSnapshots, r, |p, r| async move {
            p.list_snapshots(r).await
        })
        .await
    }

    async fn controller_expand_volume(
        &self,
        r: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        self.call(Rpc::ControllerExpandVolume, r, |p, r| async move {
            p.expand_volume(r).await
        })
        .await
    }

    async fn list_volumes(
        &self,
        r: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        self.call(Rpc::ListVolumes, r, |p, r| async move {
            p.list_volumes(r).await
        })
        .await
    }

    async fn controller_get_volume(
        &self,
        r: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        self.call(Rpc::ControllerGetVolume, r, |p, r| async move {
            p.get_volume(r).await
        })
        .await
    }

    async fn controller_modify_volume(
        &self,
        r: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        self.call(Rpc::ControllerModifyVolume, r, |p, r| async move {
            p.modify_volume(r).await
        })
        .await
    }
}
