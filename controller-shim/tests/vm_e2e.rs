//! End to end on a real kernel: the controller provisions from its local backend, the node
//! daemon attaches. Ignored on the host; run in the VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking

use std::collections::HashMap;
use std::path::Path;

use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::volume_content_source::{SnapshotSource, Type as SourceType};
use csi_proto::csi::*;
use testkit::controller::ControllerProcess;
use testkit::csi::*;
use testkit::daemon::NodeDaemon;
use testkit::placement::{place, remove};

const MIB: i64 = 1 << 20;

fn ext4() -> VolumeCapability {
    mount_capability("ext4", Mode::SingleNodeWriter)
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
    let placed = place(&mut ctrl, &mut node, &daemon, &src, ext4())
        .await
        .unwrap();
    assert!(
        src.volume_context["nbdUri"].starts_with("nbd://127.0.0.1:"),
        "{:?}",
        src.volume_context
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
    let placed_restored = place(&mut ctrl, &mut node, &daemon, &restored, ext4())
        .await
        .unwrap();
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

    remove(&mut ctrl, &mut node, &daemon, &placed_restored)
        .await
        .unwrap();
    remove(&mut ctrl, &mut node, &daemon, &placed)
        .await
        .unwrap();
    ctrl.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id,
    })
    .await
    .unwrap();
    assert!(daemon.journal_files().is_empty());
}
