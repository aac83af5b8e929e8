//! A CSI client over a unix socket, as kubelet and the sidecars talk to the driver, and
//! request builders for the usual shapes: the node's as kubelet sends them, the controller's
//! as the provisioning sidecars send them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use csi_proto::csi::controller_client::ControllerClient;
use csi_proto::csi::identity_client::IdentityClient;
use csi_proto::csi::node_client::NodeClient;
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use csi_proto::csi::volume_content_source::{SnapshotSource, Type as SourceType, VolumeSource};
use csi_proto::csi::*;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

/// Connects to the gRPC server on the unix socket at `path`.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_owned();
    // The URI is required by the API but unused: the connector dials the socket.
    Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
}

/// Connects to a server that is still starting: retries until `timeout`, then panics.
pub async fn wait_connect(path: &Path, timeout: std::time::Duration) -> Channel {
    let started = std::time::Instant::now();
    loop {
        if let Ok(channel) = connect(path).await {
            return channel;
        }
        assert!(
            started.elapsed() < timeout,
            "nothing answered on {} within {timeout:?}",
            path.display()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Identity and Node clients on one channel.
#[derive(Debug, Clone)]
pub struct NodeClients {
    pub identity: IdentityClient<Channel>,
    pub node: NodeClient<Channel>,
}

impl NodeClients {
    pub async fn connect(path: &Path) -> Result<Self, tonic::transport::Error> {
        let channel = connect(path).await?;
        Ok(Self {
            identity: IdentityClient::new(channel.clone()),
            node: NodeClient::new(channel),
        })
    }
}

pub fn mount_capability(fs: &str, mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: Vec::new(),
            volume_mount_group: String::new(),
        })),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

pub fn block_capability(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

pub fn context(uri: &str) -> HashMap<String, String> {
    [("nbdUri".to_owned(), uri.to_owned())].into()
}

pub fn stage_request(
    volume: &str,
    staging: &Path,
    cap: VolumeCapability,
    uri: &str,
) -> NodeStageVolumeRequest {
    NodeStageVolumeRequest {
        volume_id: volume.into(),
        publish_context: HashMap::new(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap),
        secrets: HashMap::new(),
        volume_context: context(uri),
    }
}

pub fn publish_request(
    volume: &str,
    staging: &Path,
    target: &Path,
    cap: VolumeCapability,
    uri: &str,
    readonly: bool,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: volume.into(),
        publish_context: HashMap::new(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap),
        readonly,
        volume_context: context(uri),
    }
}

pub fn unpublish_request(volume: &str, target: &Path) -> NodeUnpublishVolumeRequest {
    NodeUnpublishVolumeRequest {
        volume_id: volume.into(),
        target_path: target.display().to_string(),
    }
}

pub fn unstage_request(volume: &str, staging: &Path) -> NodeUnstageVolumeRequest {
    NodeUnstageVolumeRequest {
        volume_id: volume.into(),
        staging_target_path: staging.display().to_string(),
    }
}

pub fn expand_request(
    volume: &str,
    path: &Path,
    staging: &Path,
    required: i64,
) -> NodeExpandVolumeRequest {
    NodeExpandVolumeRequest {
        volume_id: volume.into(),
        volume_path: path.display().to_string(),
        capacity_range: Some(CapacityRange {
            required_bytes: required,
            limit_bytes: 0,
        }),
        staging_target_path: staging.display().to_string(),
        volume_capability: None,
        secrets: HashMap::new(),
    }
}

pub fn stats_request(volume: &str, path: &Path) -> NodeGetVolumeStatsRequest {
    NodeGetVolumeStatsRequest {
        volume_id: volume.into(),
        volume_path: path.display().to_string(),
        staging_target_path: String::new(),
    }
}

/// At least `required` bytes, no limit.
pub fn capacity(required: i64) -> Option<CapacityRange> {
    Some(CapacityRange {
        required_bytes: required,
        limit_bytes: 0,
    })
}

/// CreateVolume of `name` with at least `required` bytes for `cap`: no parameters, no source.
pub fn create_volume_request(
    name: &str,
    required: i64,
    cap: VolumeCapability,
) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: capacity(required),
        volume_capabilities: vec![cap],
        ..Default::default()
    }
}

/// A volume's content restored from the snapshot `snapshot_id`.
pub fn from_snapshot(snapshot_id: &str) -> Option<VolumeContentSource> {
    Some(VolumeContentSource {
        r#type: Some(SourceType::Snapshot(SnapshotSource {
            snapshot_id: snapshot_id.into(),
        })),
    })
}

/// A volume's content cloned from the volume `volume_id`.
pub fn from_volume(volume_id: &str) -> Option<VolumeContentSource> {
    Some(VolumeContentSource {
        r#type: Some(SourceType::Volume(VolumeSource {
            volume_id: volume_id.into(),
        })),
    })
}

/// CreateSnapshot `name` of the volume `source`, no parameters.
pub fn snapshot_request(source: &str, name: &str) -> CreateSnapshotRequest {
    CreateSnapshotRequest {
        source_volume_id: source.into(),
        name: name.into(),
        parameters: HashMap::new(),
    }
}

/// ControllerPublishVolume of `volume` to `node` for `cap`, read-write, no volume context.
pub fn controller_publish_request(
    volume: &str,
    node: &str,
    cap: VolumeCapability,
) -> ControllerPublishVolumeRequest {
    ControllerPublishVolumeRequest {
        volume_id: volume.into(),
        node_id: node.into(),
        volume_capability: Some(cap),
        ..Default::default()
    }
}

pub fn controller_unpublish_request(volume: &str, node: &str) -> ControllerUnpublishVolumeRequest {
    ControllerUnpublishVolumeRequest {
        volume_id: volume.into(),
        node_id: node.into(),
    }
}

/// ControllerExpandVolume of `volume` to at least `required` bytes.
pub fn controller_expand_request(
    volume: &str,
    required: i64,
    cap: Option<VolumeCapability>,
) -> ControllerExpandVolumeRequest {
    ControllerExpandVolumeRequest {
        volume_id: volume.into(),
        capacity_range: capacity(required),
        volume_capability: cap,
    }
}

pub fn delete_volume_request(volume: &str) -> DeleteVolumeRequest {
    DeleteVolumeRequest {
        volume_id: volume.into(),
    }
}

pub fn delete_snapshot_request(snapshot: &str) -> DeleteSnapshotRequest {
    DeleteSnapshotRequest {
        snapshot_id: snapshot.into(),
    }
}

/// CreateVolume that must succeed: the volume made, or a panic naming the request's name.
pub async fn created_volume(
    ctrl: &mut ControllerClient<Channel>,
    request: CreateVolumeRequest,
) -> Volume {
    let name = request.name.clone();
    ctrl.create_volume(request)
        .await
        .unwrap_or_else(|e| panic!("CreateVolume {name}: {e:?}"))
        .into_inner()
        .volume
        .unwrap_or_else(|| panic!("CreateVolume {name}: answered without a volume"))
}

/// CreateSnapshot `name` of `source` that must succeed: the snapshot made.
pub async fn created_snapshot(
    ctrl: &mut ControllerClient<Channel>,
    source: &str,
    name: &str,
) -> Snapshot {
    ctrl.create_snapshot(snapshot_request(source, name))
        .await
        .unwrap_or_else(|e| panic!("CreateSnapshot {name}: {e:?}"))
        .into_inner()
        .snapshot
        .unwrap_or_else(|| panic!("CreateSnapshot {name}: answered without a snapshot"))
}
