//! End to end on a real kernel: the controller provisions from its local backend, the node
//! daemon attaches. Ignored on the host; run in the VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking

use std::collections::HashMap;
use std::path::Path;

use csi_proto::csi::controller_client::ControllerClient;
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::volume_content_source::{SnapshotSource, Type as SourceType};
use csi_proto::csi::*;
use testkit::controller::ControllerProcess;
use testkit::csi::*;
use testkit::daemon::NodeDaemon;
use tonic::transport::Channel;

const MIB: i64 = 1 << 20;

fn ext4() -> VolumeCapability {
    mount_capability("ext4", Mode::SingleNodeWriter)
}

struct Placed {
    id: String,
    context: HashMap<String, String>,
    publish: HashMap<String, String>,
    staging: std::path::PathBuf,
    target: std::path::PathBuf,
}

/// ControllerPublish, NodeStage, NodePublish: a volume as a pod sees it.
async fn place(
    ctrl: &mut ControllerClient<Channel>,
    node: &mut NodeClients,
    daemon: &NodeDaemon,
    v: &Volume,
) -> Placed {
    let publish = ctrl
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: daemon.node_id.clone(),
            volume_capability: Some(ext4()),
            readonly: false,
            volume_context: v.volume_context.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    let name = v.volume_id.rsplit(':').next().unwrap().to_owned();
    let staging = daemon.scratch().join(format!("staging/{name}"));
    let target = daemon.scratch().join(format!("pods/{name}/mount"));
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let mut stage = stage_request(&v.volume_id, &staging, ext4(), "");
    stage.volume_context = v.volume_context.clone();
    stage.publish_context = publish.clone();
    node.node.node_stage_volume(stage).await.unwrap();
    let mut req = publish_request(&v.volume_id, &staging, &target, ext4(), "", false);
    req.volume_context = v.volume_context.clone();
    req.publish_context = publish.clone();
    node.node.node_publish_volume(req).await.unwrap();
    Placed {
        id: v.volume_id.clone(),
        context: v.volume_context.clone(),
        publish,
        staging,
        target,
    }
}

async fn remove(
    ctrl: &mut ControllerClient<Channel>,
    node: &mut NodeClients,
    daemon: &NodeDaemon,
    p: &Placed,
) {
    node.node
        .node_unpublish_volume(unpublish_request(&p.id, &p.target))
        .await
        .unwrap();
    node.node
        .node_unstage_volume(unstage_request(&p.id, &p.staging))
        .await
        .unwrap();
    ctrl.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
        volume_id: p.id.clone(),
        node_id: daemon.node_id.clone(),
    })
    .await
    .unwrap();
    ctrl.delete_volume(DeleteVolumeRequest {
        volume_id: p.id.clone(),
    })
    .await
    .unwrap();
}

fn total_mib(path: &Path) -> u64 {
    mounts::usage::usage(path).unwrap().bytes_total >> 20
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn create_stage_write_snapshot_restore_larger_expand() {
    let (_controller, mut ctrl) = ControllerProcess::start("e2e").await.unwrap();
    let mut daemon = NodeDaemon::new("e2e-node", "io-timeout-secs = 4\n").unwrap();
    let mut node = daemon.start(None).await;

    let create =
        |name: &str, bytes: i64, source: Option<VolumeContentSource>| CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: bytes,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![ext4()],
            parameters: HashMap::new(),
            volume_content_source: source,
            accessibility_requirements: None,
        };
    let src = ctrl
        .create_volume(create("pvc-src", 64 * MIB, None))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let placed = place(&mut ctrl, &mut node, &daemon, &src).await;
    assert!(
        placed.publish["nbdUri"].starts_with("nbd://127.0.0.1:"),
        "{:?}",
        placed.context
    );
    let data = testkit::pattern(11, 0, 4 << 20);
    std::fs::write(placed.target.join("data.bin"), &data).unwrap();
    std::fs::File::open(placed.target.join("data.bin"))
        .unwrap()
        .sync_all()
        .unwrap();
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };

    let snap = ctrl
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: src.volume_id.clone(),
            name: "snap-e2e".into(),
            parameters: HashMap::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();

    // Restored into a larger volume: the data is there and the filesystem has the new size.
    let restored = ctrl
        .create_volume(create(
            "pvc-restored",
            128 * MIB,
            Some(VolumeContentSource {
                r#type: Some(SourceType::Snapshot(SnapshotSource {
                    snapshot_id: snap.snapshot_id.clone(),
                })),
            }),
        ))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let placed_restored = place(&mut ctrl, &mut node, &daemon, &restored).await;
    assert!(std::fs::read(placed_restored.target.join("data.bin")).unwrap() == data);
    assert!(
        total_mib(&placed_restored.target) > 100,
        "grown at stage: {} MiB",
        total_mib(&placed_restored.target)
    );

    // Online expansion of the source through controller and node.
    let before = total_mib(&placed.target);
    let r = ctrl
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: src.volume_id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 96 * MIB,
                limit_bytes: 0,
            }),
            volume_capability: Some(ext4()),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.node_expansion_required);
    node.node
        .node_expand_volume(expand_request(
            &src.volume_id,
            &placed.target,
            &placed.staging,
            96 * MIB,
        ))
        .await
        .unwrap();
    assert!(
        total_mib(&placed.target) > before + 20,
        "{before} -> {}",
        total_mib(&placed.target)
    );
    assert!(std::fs::read(placed.target.join("data.bin")).unwrap() == data);

    remove(&mut ctrl, &mut node, &daemon, &placed_restored).await;
    remove(&mut ctrl, &mut node, &daemon, &placed).await;
    ctrl.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id,
    })
    .await
    .unwrap();
    assert!(daemon.journal_files().is_empty());
}
