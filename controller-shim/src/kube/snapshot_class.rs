//! The VolumeSnapshotClass `csi-mind-ustor`, which every StorageClass of ours names. It exists
//! only while some module serves the `snapshot.storage.k8s.io` API: until then nothing fails,
//! and the class is created once the API appears (checked every `poll`).

use std::time::Duration;

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::Api;

use super::{Context, GlueError, SNAPSHOT_CLASS};
use csi_common::DRIVER_NAME;

const GROUP_VERSION: &str = "snapshot.storage.k8s.io/v1";

/// Whether the snapshot API is served, and the class created when it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotApi {
    NotServed,
    ClassPresent,
}

pub async fn ensure(ctx: &Context) -> Result<SnapshotApi, GlueError> {
    let resources = match ctx.client.list_api_group_resources(GROUP_VERSION).await {
        Ok(list) => list,
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(SnapshotApi::NotServed),
        Err(e) => return Err(e.into()),
    };
    if !resources
        .resources
        .iter()
        .any(|r| r.kind == "VolumeSnapshotClass")
    {
        return Ok(SnapshotApi::NotServed);
    }
    let gvk = GroupVersionKind::gvk("snapshot.storage.k8s.io", "v1", "VolumeSnapshotClass");
    let resource = ApiResource::from_gvk(&gvk);
    let api: Api<DynamicObject> = Api::all_with(ctx.client.clone(), &resource);
    if api.get_opt(SNAPSHOT_CLASS).await?.is_none() {
        let mut class = DynamicObject::new(SNAPSHOT_CLASS, &resource);
        class.data = serde_json::json!({ "driver": DRIVER_NAME, "deletionPolicy": "Delete" });
        match api.create(&ctx.post_params(), &class).await {
            Ok(_) => tracing::info!(class = SNAPSHOT_CLASS, "VolumeSnapshotClass created"),
            // Another writer was quicker: the class exists, which is all that matters.
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(SnapshotApi::ClassPresent)
}

/// Keeps the class present for as long as the task runs.
pub async fn run(ctx: std::sync::Arc<Context>, poll: Duration) {
    let mut last = None;
    loop {
        if !ctx.leader.is_leader() {
            tokio::time::sleep(poll).await;
            continue;
        }
        match ensure(&ctx).await {
            Ok(state) => {
                if last != Some(state) {
                    tracing::info!(?state, "snapshot API");
                    last = Some(state);
                }
            }
            Err(e) => tracing::warn!(error = %e, "VolumeSnapshotClass check failed; retrying"),
        }
        tokio::time::sleep(poll).await;
    }
}
