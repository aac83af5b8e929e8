//! A provisioned volume placed on a node the way Kubernetes does it: ControllerPublish, then
//! NodeStage and NodePublish on kubelet-shaped paths; and taken away in reverse.

use std::path::PathBuf;

use csi_proto::csi::controller_client::ControllerClient;
use csi_proto::csi::{Volume, VolumeCapability};
use tonic::transport::Channel;

use crate::csi::{
    controller_publish_request, controller_unpublish_request, delete_volume_request,
    publish_request, stage_request, unpublish_request, unstage_request, NodeClients,
};
use crate::daemon::NodeDaemon;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Clone)]
pub struct Placed {
    pub volume_id: String,
    pub capability: VolumeCapability,
    pub staging: PathBuf,
    pub target: PathBuf,
}

pub async fn place(
    ctrl: &mut ControllerClient<Channel>,
    node: &mut NodeClients,
    daemon: &NodeDaemon,
    volume: &Volume,
    capability: VolumeCapability,
) -> Result<Placed, Error> {
    let mut request =
        controller_publish_request(&volume.volume_id, &daemon.node_id, capability.clone());
    request.volume_context = volume.volume_context.clone();
    let publish_context = ctrl
        .controller_publish_volume(request)
        .await?
        .into_inner()
        .publish_context;
    let name = volume
        .volume_id
        .rsplit(':')
        .next()
        .unwrap_or("volume")
        .to_owned();
    let staging = daemon.scratch().join(format!(
        "plugins/kubernetes.io/csi/ustor-nbd.csi.mindsw.io/{name}/globalmount"
    ));
    let target = daemon.scratch().join(format!(
        "pods/pod-{name}/volumes/kubernetes.io~csi/{name}/mount"
    ));
    std::fs::create_dir_all(&staging)?;
    std::fs::create_dir_all(target.parent().ok_or("target has a parent")?)?;
    let mut stage = stage_request(&volume.volume_id, &staging, capability.clone(), "");
    stage.volume_context = volume.volume_context.clone();
    stage.publish_context = publish_context.clone();
    node.node.node_stage_volume(stage).await?;
    let mut publish = publish_request(
        &volume.volume_id,
        &staging,
        &target,
        capability.clone(),
        "",
        false,
    );
    publish.volume_context = volume.volume_context.clone();
    publish.publish_context = publish_context;
    node.node.node_publish_volume(publish).await?;
    Ok(Placed {
        volume_id: volume.volume_id.clone(),
        capability,
        staging,
        target,
    })
}

/// NodeUnpublish, NodeUnstage, ControllerUnpublish: the volume is kept.
pub async fn unplace(
    ctrl: &mut ControllerClient<Channel>,
    node: &mut NodeClients,
    daemon: &NodeDaemon,
    placed: &Placed,
) -> Result<(), Error> {
    node.node
        .node_unpublish_volume(unpublish_request(&placed.volume_id, &placed.target))
        .await?;
    node.node
        .node_unstage_volume(unstage_request(&placed.volume_id, &placed.staging))
        .await?;
    ctrl.controller_unpublish_volume(controller_unpublish_request(
        &placed.volume_id,
        &daemon.node_id,
    ))
    .await?;
    Ok(())
}

/// [`unplace`], then DeleteVolume.
pub async fn remove(
    ctrl: &mut ControllerClient<Channel>,
    node: &mut NodeClients,
    daemon: &NodeDaemon,
    placed: &Placed,
) -> Result<(), Error> {
    unplace(ctrl, node, daemon, placed).await?;
    ctrl.delete_volume(delete_volume_request(&placed.volume_id))
        .await?;
    Ok(())
}
