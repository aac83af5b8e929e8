//! End to end on a real kernel: the controller provisions from its local backend, the node
//! daemon attaches. Ignored on the host; run in the VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking

use std::path::Path;

use csi_proto::csi::volume_capability::access_mode::Mode;
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
            volume_content_source: source,
            ..create_volume_request(name, bytes, ext4())
        };
    let src = created_volume(&mut ctrl, create("pvc-src", 64 * MIB, None)).await;
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

    let snap = created_snapshot(&mut ctrl, &src.volume_id, "snap-e2e").await;

    // Restored into a larger volume: the data is there and the filesystem has the new size.
    let restored = created_volume(
        &mut ctrl,
        create("pvc-restored", 128 * MIB, from_snapshot(&snap.snapshot_id)),
    )
    .await;
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
        .controller_expand_volume(controller_expand_request(
            &src.volume_id,
            96 * MIB,
            Some(ext4()),
        ))
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
    ctrl.delete_snapshot(delete_snapshot_request(&snap.snapshot_id))
        .await
        .unwrap();
    assert!(daemon.journal_files().is_empty());
}
