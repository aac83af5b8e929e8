//! CSI Node over gRPC: validate, call the node, map the error. One tracing span per call,
//! carrying the volume id and, once known, the device.

use std::sync::Arc;

use csi_proto::csi::node_server::Node as NodeApi;
use csi_proto::csi::node_service_capability::rpc::Type as Rpc;
use csi_proto::csi::node_service_capability::{Rpc as RpcCap, Type as CapType};
use csi_proto::csi::volume_usage::Unit;
use csi_proto::csi::*;
use futures::FutureExt;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::config::TOPOLOGY_KEY;
use crate::error::NodeError;
use crate::ids::VolumeId;
use crate::node::Node;
use crate::request::{
    abs_path, capability, export, has_export, lookup_path, resolved, RequestError,
};
use crate::service::codes::{self, Rpc as Call};
use crate::service::inflight::Inflight;
use crate::stage_tls::StageTls;
use crate::volumes::{ExpandRequest, PublishRequest, StageRequest, Usage};

#[derive(Debug)]
pub struct NodeService {
    node: Arc<Node>,
    /// The calls that change a volume, each running as a task that outlives its caller.
    stages: Inflight<NodeStageVolumeResponse>,
    unstages: Inflight<NodeUnstageVolumeResponse>,
    publishes: Inflight<NodePublishVolumeResponse>,
    unpublishes: Inflight<NodeUnpublishVolumeResponse>,
    expansions: Inflight<NodeExpandVolumeResponse>,
}

impl NodeService {
    pub fn new(node: Arc<Node>) -> Self {
        Self {
            node,
            stages: Inflight::default(),
            unstages: Inflight::default(),
            publishes: Inflight::default(),
            unpublishes: Inflight::default(),
            expansions: Inflight::default(),
        }
    }

    /// Runs one call inside its span (see [`NodeService::answer`]).
    async fn call<T, F>(&self, rpc: Call, volume_id: &str, f: F) -> Result<Response<T>, Status>
    where
        F: std::future::Future<Output = Result<T, NodeError>>,
    {
        let span = call_span(rpc, volume_id);
        let started = std::time::Instant::now();
        let result = f.instrument(span.clone()).await;
        let result = result.map_err(|e| codes::status(rpc, &e));
        self.answer(rpc, volume_id, span, started, result)
    }

    /// Runs a call that changes a volume as a task of its own (see [`crate::service::inflight`]): a caller
    /// that gives up (kubelet's deadline) leaves it running with the volume's lock until its
    /// work is done, and a retry with the same `path` joins it.
    async fn call_owned<T, F>(
        &self,
        rpc: Call,
        inflight: &Inflight<T>,
        volume_id: &str,
        path: &str,
        f: F,
    ) -> Result<Response<T>, Status>
    where
        T: Clone + Send + Sync + 'static,
        F: std::future::Future<Output = Result<T, NodeError>> + Send + 'static,
    {
        let span = call_span(rpc, volume_id);
        let started = std::time::Instant::now();
        let work = f
            .map(move |r| r.map_err(|e| codes::status(rpc, &e)))
            .instrument(span.clone());
        let result = inflight.run(format!("{volume_id}\0{path}"), work).await;
        self.answer(rpc, volume_id, span, started, result)
    }

    /// Records the call's metrics and the device the volume ended up on, and logs a failure
    /// once, here. The code comes from the one table ([`codes`]).
    fn answer<T>(
        &self,
        rpc: Call,
        volume_id: &str,
        span: tracing::Span,
        started: std::time::Instant,
        result: Result<T, Status>,
    ) -> Result<Response<T>, Status> {
        let op = rpc.name();
        let code = match &result {
            Ok(_) => tonic::Code::Ok,
            Err(status) => status.code(),
        };
        self.node
            .metrics
            .observe_call(op, code, started.elapsed().as_secs_f64());
        if let Some(index) = self.node.record(volume_id).and_then(|r| r.device) {
            span.record("device", index.to_string());
        }
        let _enter = span.enter();
        match result {
            Ok(v) => {
                tracing::debug!("ok");
                Ok(Response::new(v))
            }
            Err(status) => {
                tracing::warn!(code = ?status.code(), message = status.message(), "failed");
                Err(status)
            }
        }
    }
}

fn call_span(rpc: Call, volume_id: &str) -> tracing::Span {
    tracing::info_span!(
        "csi",
        op = rpc.name(),
        volume_id,
        device = tracing::field::Empty
    )
}

fn capability_of(rpc: Rpc) -> NodeServiceCapability {
    NodeServiceCapability {
        r#type: Some(CapType::Rpc(RpcCap { r#type: rpc as i32 })),
    }
}

#[tonic::async_trait]
impl NodeApi for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let r = request.into_inner();
        let (node, volume_id, path) = (
            Arc::clone(&self.node),
            r.volume_id.clone(),
            r.staging_target_path.clone(),
        );
        self.call_owned(
            Call::NodeStage,
            &self.stages,
            &volume_id,
            &path,
            async move {
                let req = StageRequest {
                    volume: VolumeId::parse(&r.volume_id)?,
                    staging_path: resolved(abs_path(
                        "staging_target_path",
                        &r.staging_target_path,
                    )?),
                    capability: capability(r.volume_capability.as_ref())?,
                    export: export(&r.publish_context, &r.volume_context)?,
                    tls: StageTls::from_secrets(&r.secrets)?,
                };
                node.stage(req).await.map(|()| NodeStageVolumeResponse {})
            },
        )
        .await
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let r = request.into_inner();
        let (node, volume_id, path) = (
            Arc::clone(&self.node),
            r.volume_id.clone(),
            r.staging_target_path.clone(),
        );
        self.call_owned(
            Call::NodeUnstage,
            &self.unstages,
            &volume_id,
            &path,
            async move {
                let volume = VolumeId::parse(&r.volume_id)?;
                let staging = resolved(abs_path("staging_target_path", &r.staging_target_path)?);
                node.unstage(&volume, &staging)
                    .await
                    .map(|()| NodeUnstageVolumeResponse {})
            },
        )
        .await
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let r = request.into_inner();
        let (node, volume_id, path) = (
            Arc::clone(&self.node),
            r.volume_id.clone(),
            r.target_path.clone(),
        );
        self.call_owned(
            Call::NodePublish,
            &self.publishes,
            &volume_id,
            &path,
            async move {
                let req = PublishRequest {
                    volume: VolumeId::parse(&r.volume_id)?,
                    staging_path: resolved(abs_path(
                        "staging_target_path",
                        &r.staging_target_path,
                    )?),
                    target: resolved(abs_path("target_path", &r.target_path)?),
                    capability: capability(r.volume_capability.as_ref())?,
                    read_only: r.readonly,
                    export: if has_export(&r.publish_context, &r.volume_context) {
                        Some(export(&r.publish_context, &r.volume_context)?)
                    } else {
                        None
                    },
                };
                node.publish(req)
                    .await
                    .map(|()| NodePublishVolumeResponse {})
            },
        )
        .await
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let r = request.into_inner();
        let (node, volume_id, path) = (
            Arc::clone(&self.node),
            r.volume_id.clone(),
            r.target_path.clone(),
        );
        self.call_owned(
            Call::NodeUnpublish,
            &self.unpublishes,
            &volume_id,
            &path,
            async move {
                let volume = VolumeId::parse(&r.volume_id)?;
                let target = resolved(abs_path("target_path", &r.target_path)?);
                node.unpublish(&volume, &target)
                    .await
                    .map(|()| NodeUnpublishVolumeResponse {})
            },
        )
        .await
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let r = request.into_inner();
        self.call(Call::NodeGetVolumeStats, &r.volume_id, async {
            let volume = VolumeId::parse(&r.volume_id)?;
            // A missing field is INVALID_ARGUMENT; then an unknown volume is NOT_FOUND, and so
            // is a path that is not the volume's.
            let path = lookup_path("volume_path", &r.volume_path)?;
            self.node.require_known(&volume)?;
            let stats = self.node.stats(&volume, &path).await?;
            let usage = match stats.usage {
                Usage::Filesystem(u) => vec![
                    VolumeUsage {
                        available: u.bytes_available as i64,
                        total: u.bytes_total as i64,
                        used: u.bytes_used as i64,
                        unit: Unit::Bytes as i32,
                    },
                    VolumeUsage {
                        available: u.inodes_free as i64,
                        total: u.inodes_total as i64,
                        used: u.inodes_used as i64,
                        unit: Unit::Inodes as i32,
                    },
                ],
                Usage::Block { bytes } => vec![VolumeUsage {
                    available: 0,
                    total: bytes as i64,
                    used: 0,
                    unit: Unit::Bytes as i32,
                }],
            };
            Ok(NodeGetVolumeStatsResponse {
                usage,
                volume_condition: Some(VolumeCondition {
                    abnormal: stats.abnormal,
                    message: stats.message,
                }),
            })
        })
        .await
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let r = request.into_inner();
        let (node, volume_id) = (Arc::clone(&self.node), r.volume_id.clone());
        let path = format!(
            "{}\0{:?}",
            r.volume_path,
            r.capacity_range.as_ref().map(|c| c.required_bytes)
        );
        self.call_owned(
            Call::NodeExpand,
            &self.expansions,
            &volume_id,
            &path,
            async move {
                let required = r.capacity_range.as_ref().map(|c| c.required_bytes);
                if required.is_some_and(|b| b < 0) {
                    return Err(RequestError::NegativeCapacity.into());
                }
                if let Some(cap) = r.volume_capability.as_ref() {
                    capability(Some(cap))?;
                }
                let volume = VolumeId::parse(&r.volume_id)?;
                let volume_path = lookup_path("volume_path", &r.volume_path)?;
                node.require_known(&volume)?;
                let req = ExpandRequest {
                    volume,
                    volume_path,
                    required_bytes: required.filter(|b| *b > 0).map(|b| b as u64),
                    tls: StageTls::from_secrets(&r.secrets)?,
                };
                let bytes = node.expand(req).await?;
                Ok(NodeExpandVolumeResponse {
                    capacity_bytes: bytes as i64,
                })
            },
        )
        .await
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: [
                Rpc::StageUnstageVolume,
                Rpc::GetVolumeStats,
                Rpc::ExpandVolume,
                Rpc::VolumeCondition,
                Rpc::SingleNodeMultiWriter,
            ]
            .into_iter()
            .map(capability_of)
            .collect(),
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        let max = self.node.settings.max_volumes.unwrap_or_else(|| {
            crate::device_budget::DeviceBudget::read(
                std::path::Path::new("/sys/module"),
                &nbd::sysfs::Sysfs::default(),
            )
            .map_or(0, |b| {
                i64::try_from(b.for_this_driver()).unwrap_or(i64::MAX)
            })
        });
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node.settings.node_id.clone(),
            max_volumes_per_node: max,
            accessible_topology: Some(Topology {
                segments: [(TOPOLOGY_KEY.to_owned(), "true".to_owned())].into(),
            }),
        }))
    }
}
