//! What the node daemon refuses or keeps true, against the real kernel: no shrinking and one
//! volume per export, read-only block volumes, XFS clones beside their source, the `none` I/O
//! scheduler, symlinked kubelet directories, unknown volumes, unix-socket growth only through
//! held connections. Ignored on the host; run in the VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking
#![allow(clippy::cast_possible_truncation)] // buffer sizes of a few MiB, on 64-bit guests

use std::path::Path;

mod common;
use common::prelude::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn expansion_never_shrinks_and_one_export_has_one_volume() {
    let (daemon, mut c) = start_node("sizes").await;
    let mut vol = Volume::new_on(&daemon, "shrunk", 64 * MIB, block(), Listen::Tcp);
    vol.up(&mut c).await;
    block_round_trip(&vol, 60 * MIB, 8);
    let index = vol.device(&daemon).unwrap();
    vol.resize_backing(32 * MIB);
    vol.server.start().unwrap();
    let err = c
        .node
        .node_expand_volume(expand_request(&vol.id, &vol.target, &vol.staging, 0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("shrink"), "{}", err.message());
    assert_eq!(
        Sysfs::default().size_bytes(index).unwrap(),
        64 * MIB,
        "size kept"
    );
    vol.resize_backing(64 * MIB);

    // A second volume id naming the same export (a static PV) is refused while it is staged.
    let alias = "alias-of-shrunk";
    let staging = daemon.scratch().join("alias-staging");
    std::fs::create_dir_all(&staging).unwrap();
    for cap in [ext4(), block()] {
        let err = c
            .node
            .node_stage_volume(stage_request(alias, &staging, cap, &vol.uri()))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
        assert!(err.message().contains(&vol.id), "{}", err.message());
    }
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn read_only_means_read_only_for_block_volumes() {
    let (daemon, mut c) = start_node("ro").await;
    let sysfs = Sysfs::default();

    // A read-only publish of a writable attachment: the device refuses writes meanwhile.
    let vol = Volume::new(&daemon, "ro-publish", 32 * MIB, block());
    vol.stage(&mut c).await.unwrap();
    vol.publish_at(&mut c, &vol.target, true).await.unwrap();
    let index = vol.device(&daemon).unwrap();
    assert!(sysfs.read_only(index).unwrap());
    let err = DirectFile::open(&vol.target, true)
        .and_then(|f| f.write_at(&pattern(1, 0, 4096), 0))
        .unwrap_err();
    assert!(
        [Some(libc::EPERM), Some(libc::EROFS), Some(libc::EACCES)].contains(&err.raw_os_error()),
        "{err}"
    );
    vol.unpublish(&mut c).await.unwrap();
    assert!(
        !sysfs.read_only(index).unwrap(),
        "writable again with no read-only pod"
    );
    vol.publish(&mut c).await.unwrap();
    block_round_trip(&vol, 0, 2);
    vol.down(&mut c).await;

    // A read-only access mode: the whole attachment is read-only from CONNECT on.
    let ro = Volume::new(
        &daemon,
        "ro-mode",
        32 * MIB,
        block_capability(Mode::SingleNodeReaderOnly),
    );
    ro.up(&mut c).await;
    assert!(sysfs.read_only(ro.device(&daemon).unwrap()).unwrap());
    assert!(DirectFile::open(&ro.target, true)
        .and_then(|f| f.write_at(&pattern(1, 0, 4096), 0))
        .is_err());
    ro.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn xfs_clones_mount_beside_their_source() {
    let (daemon, mut c) = start_node("clone").await;
    let cap = mount_capability("xfs", Mode::SingleNodeWriter);
    let source = Volume::new(&daemon, "xfs-source", 320 * MIB, cap.clone());
    source.up(&mut c).await;
    write_and_check_file(&source.target, "cloned", MIB as usize, 9);
    std::process::Command::new("sync").status().unwrap();
    source.unpublish(&mut c).await.unwrap();
    source.unstage(&mut c).await.unwrap();
    let clone = Volume::new(&daemon, "xfs-clone", 320 * MIB, cap);
    sparse_copy(&source.backing, &clone.backing);
    assert_eq!(image_uuid(&source.backing), image_uuid(&clone.backing));
    source.up(&mut c).await;
    clone.up(&mut c).await;
    assert!(std::fs::read(clone.target.join("cloned")).unwrap() == pattern(9, 0, MIB as usize));
    clone.down(&mut c).await;
    source.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_changed_io_scheduler_is_set_back_to_none() {
    let (mut daemon, mut c) = start_node("sched").await;
    let vol = Volume::new(&daemon, "sched", 32 * MIB, block());
    vol.up(&mut c).await;
    let sysfs = Sysfs::default();
    let index = vol.device(&daemon).unwrap();
    assert_eq!(sysfs.scheduler(index).unwrap(), "none");

    // With the daemon stopped, `status` shows the change.
    daemon.kill();
    // kyber: a scheduler other than none that both kernel lines have (as a module).
    sysfs.set_scheduler(index, "kyber").unwrap();
    let (code, status) = status_of(&daemon);
    assert_eq!(code, 1, "a changed scheduler is a problem: {status}");
    assert_eq!(
        device_row(&status, &vol.id)["scheduler"],
        "kyber",
        "{status}"
    );

    // The running daemon puts none back.
    let mut c = daemon.start(None).await;
    let started = Instant::now();
    while sysfs.scheduler(index).unwrap() != "none" {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "never set back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(daemon
        .scrape()
        .await
        .contains("ustor_csi_node_scheduler_resets_total 1"));
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

/// The mount table, for counting stacked mounts.
struct MountTableView(mounts::MountTable);

impl MountTableView {
    fn read() -> Self {
        Self(mounts::MountTable::read().unwrap())
    }

    fn count_at(&self, path: &Path) -> usize {
        self.0.at(path).count()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_symlinked_kubelet_directory_behaves_like_a_real_one() {
    let (mut daemon, mut c) = start_node("symlink").await;
    let real = daemon.scratch().join("data-disk/kubelet");
    std::fs::create_dir_all(&real).unwrap();
    let link = daemon.scratch().join("var-lib-kubelet");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let mut vols = Vec::new();
    for (id, cap) in [("sym-ext4", ext4()), ("sym-block", block())] {
        let mut vol = Volume::new(&daemon, id, 64 * MIB, cap);
        let staging = link.join(format!("plugins/{id}/globalmount"));
        let target = link.join(format!("pods/p/volumes/{id}/mount"));
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        (vol.staging, vol.target) = (staging, target);
        vol.up(&mut c).await;
        // Repeats are idempotent: no second mount stacks on the first.
        vol.stage(&mut c).await.unwrap();
        vol.publish(&mut c).await.unwrap();
        vols.push(vol);
    }
    let real = std::fs::canonicalize(&real).unwrap();
    let table = MountTableView::read();
    for vol in &vols {
        let target = real.join(vol.target.strip_prefix(&link).unwrap());
        assert_eq!(table.count_at(&target), 1, "{}", target.display());
    }
    write_and_check_file(&vols[0].target, "through-the-link", MIB as usize, 12);
    block_round_trip(&vols[1], 0, 13);
    // A restart sees its own mounts as its own.
    daemon.kill();
    let mut c = daemon.start(None).await;
    for vol in &vols {
        vol.down(&mut c).await;
    }
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn unknown_volumes_are_not_found_and_block_takes_the_guides_modes() {
    let (daemon, mut c) = start_node("codes").await;
    // csi-sanity: an unknown volume is NOT_FOUND, whatever its path.
    let err = c
        .node
        .node_get_volume_stats(csi_proto::csi::NodeGetVolumeStatsRequest {
            volume_id: "nobody".into(),
            volume_path: "some/relative/path".into(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{}", err.message());
    let mut expand = expand_request("nobody", Path::new("/x"), Path::new("/y"), 0);
    expand.volume_path = "relative".into();
    let err = c.node.node_expand_volume(expand.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{}", err.message());
    // csi-sanity: but a missing path is a malformed request, checked before the volume.
    let err = c
        .node
        .node_get_volume_stats(csi_proto::csi::NodeGetVolumeStatsRequest {
            volume_id: "nobody".into(),
            volume_path: String::new(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    expand.volume_path = String::new();
    let err = c.node.node_expand_volume(expand).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());

    // Block volumes: ReadWriteOncePod or ReadWriteMany; the refusal says what to use.
    let vol = Volume::new(&daemon, "rwo-block", 16 * MIB, block());
    for mode in [Mode::SingleNodeWriter, Mode::MultiNodeReaderOnly] {
        let err = c
            .node
            .node_stage_volume(stage_request(
                &vol.id,
                &vol.staging,
                block_capability(mode),
                &vol.uri(),
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{mode:?}");
        assert!(
            err.message().contains("ReadWriteOncePod"),
            "{}",
            err.message()
        );
    }
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_unix_socket_export_grows_through_held_connections_and_never_beyond_them() {
    let (mut daemon, mut c) = start_node("unserved").await;
    // nbdkit serves each connection the size it had at the handshake. Over a unix socket the
    // daemon replaces a device's connections through the copies it holds of them.
    let vol = Volume::new(&daemon, "unix-grow", 64 * MIB, ext4()).with_connections(2);
    vol.up(&mut c).await;
    write_and_check_file(&vol.target, "before", MIB as usize, 30);
    let index = vol.device(&daemon).unwrap();
    vol.resize_backing(96 * MIB);
    vol.expand(&mut c, 96 * MIB)
        .await
        .unwrap_or_else(|e| panic!("expand over held unix connections: {e:?}"));
    assert_eq!(Sysfs::default().size_bytes(index).unwrap(), 96 * MIB);
    let grown = fs_bytes(&vol.target);
    assert!(grown > 80 * MIB, "the filesystem grew: {} bytes", grown);
    write_and_check_file(&vol.target, "after", 20 * MIB as usize, 31);
    assert!(
        std::fs::read(vol.target.join("before")).unwrap() == testkit::pattern(30, 0, MIB as usize)
    );

    // A daemon restarted outside systemd has no descriptor store: it cannot replace the
    // connections, and the device keeps the size they serve.
    daemon.kill();
    let mut c = daemon.start(None).await;
    vol.resize_backing(128 * MIB);
    let err = vol.expand(&mut c, 128 * MIB).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("old size"), "{}", err.message());
    assert_eq!(
        Sysfs::default().size_bytes(index).unwrap(),
        96 * MIB,
        "the device never claims space it cannot serve"
    );
    assert!(
        std::fs::read(vol.target.join("after")).unwrap()
            == testkit::pattern(31, 0, 20 * MIB as usize)
    );
    vol.down(&mut c).await;
    assert_clean(&daemon);
}
