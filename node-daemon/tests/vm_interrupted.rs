//! Interrupted steps, against the real kernel: a stage that fails half-way, a format cut short
//! by a crash, a device lost mid-stage, an expansion cut short by a reboot, a staging mount gone
//! under a publish, a record rebuilt from kernel facts. Ignored on the host; run in the VM on
//! every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking
#![allow(clippy::cast_possible_truncation)] // buffer sizes of a few MiB, on 64-bit guests

mod common;
use common::prelude::*;

/// Arms `point`, makes `stage` hit it, and waits for the daemon to die there.
async fn crash_stage_at(daemon: &mut NodeDaemon, vol: &Volume, point: &str) {
    let mut armed = daemon.start(Some(point)).await;
    let answer = vol.stage(&mut armed).await;
    assert!(answer.is_err(), "the daemon dies mid-call, yet answered");
    let exit = daemon.wait_exit(Duration::from_secs(30));
    assert!(exit.is_some_and(|s| !s.success()), "crashed at {point}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_stage_that_fails_for_good_leaves_nothing_behind() {
    let (daemon, mut c) = start_node("undo").await;

    // The volume holds another filesystem than the one asked for.
    let wrong_fs = Volume::new(
        &daemon,
        "holds-ext4",
        64 * MIB,
        mount_capability("xfs", Mode::SingleNodeWriter),
    );
    mkfs_ext4(&wrong_fs.backing);
    let err = wrong_fs.stage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        wrong_fs.device(&daemon).is_none(),
        "the device was disconnected"
    );
    assert_clean(&daemon);

    // A mount option the filesystem refuses.
    let mut cap = ext4();
    if let Some(csi_proto::csi::volume_capability::AccessType::Mount(m)) = cap.access_type.as_mut()
    {
        m.mount_flags = vec!["data=bogus".into()];
    }
    let bad_option = Volume::new(&daemon, "bad-option", 64 * MIB, cap);
    let err = bad_option.stage(&mut c).await.unwrap_err();
    assert_ne!(err.code(), Code::Ok);
    assert!(
        !err.message().contains("bogus"),
        "mount flags stay out of messages: {}",
        err.message()
    );
    assert!(!is_mounted(&bad_option.staging));
    assert_clean(&daemon);

    // Something else is mounted on the staging path: refused, and that mount is left alone.
    let occupied = Volume::new(&daemon, "occupied", 64 * MIB, ext4());
    nix::mount::mount(
        Some("tmpfs"),
        &occupied.staging,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .unwrap();
    let err = occupied.stage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(is_mounted(&occupied.staging), "the foreign mount stays");
    mounts::ops::unmount(&occupied.staging).unwrap();
    assert_clean(&daemon);

    // A retriable failure keeps nothing either when no device was attached.
    let mut gone = Volume::new(&daemon, "gone", 64 * MIB, ext4());
    gone.server.kill();
    let err = gone.stage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{}", err.message());
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn an_interrupted_format_is_redone_only_over_its_own_filesystem() {
    let mut daemon = NodeDaemon::new("mkfs", CONFIG).unwrap();

    // mkfs finished, the crash came before the journal said so: redone, then staged.
    let ours = Volume::new(&daemon, "ours", 64 * MIB, ext4());
    crash_stage_at(&mut daemon, &ours, "stage-after-mkfs").await;
    let journaled = image_uuid(&ours.backing);
    assert_eq!(journaled.len(), 36, "mkfs ran with the journaled UUID");
    let mut c = daemon.start(None).await;
    ours.up(&mut c).await;
    write_and_check_file(&ours.target, "after", MIB as usize, 3);
    assert_eq!(image_uuid(&ours.backing), journaled);
    ours.down(&mut c).await;
    daemon.kill();

    // The crash came before mkfs; meanwhile the volume got a filesystem elsewhere (another
    // node staged it and wrote): that filesystem is never formatted over.
    let theirs = Volume::new(&daemon, "theirs", 64 * MIB, ext4());
    crash_stage_at(&mut daemon, &theirs, "stage-before-mkfs").await;
    mkfs_ext4(&theirs.backing);
    let foreign = image_uuid(&theirs.backing);
    let mut c = daemon.start(None).await;
    let err = theirs.stage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("refusing"), "{}", err.message());
    assert_eq!(image_uuid(&theirs.backing), foreign, "not reformatted");
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_device_lost_mid_stage_is_attached_again() {
    let mut daemon = NodeDaemon::new("lost", CONFIG).unwrap();
    let vol = Volume::new(&daemon, "lost-mid-stage", 64 * MIB, ext4());
    crash_stage_at(&mut daemon, &vol, "stage-after-connect").await;
    // Recovery takes the device into the record (phase Attached)…
    drop(daemon.start(None).await);
    daemon.kill();
    // …and then the node "rebooted": the device is gone.
    disconnect_behind_the_back(&vol, &daemon).await;
    let mut c = daemon.start(None).await;
    vol.up(&mut c).await;
    write_and_check_file(&vol.target, "data", MIB as usize, 4);
    vol.down(&mut c).await;
    assert_clean(&daemon);

    daemon.kill();

    // The same with the stage stopped just before mkfs (phase Formatting).
    let vol = Volume::new(&daemon, "lost-formatting", 64 * MIB, ext4());
    crash_stage_at(&mut daemon, &vol, "stage-before-mkfs").await;
    disconnect_behind_the_back(&vol, &daemon).await;
    let mut c = daemon.start(None).await;
    vol.up(&mut c).await;
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn an_expansion_cut_short_by_a_reboot_is_finished_by_the_next_stage() {
    let mut daemon = NodeDaemon::new("reboot-grow", CONFIG).unwrap();
    let vol = Volume::new_on(&daemon, "reboot-grow", 64 * MIB, ext4(), Listen::Tcp);
    let mut c = daemon.start(None).await;
    vol.up(&mut c).await;
    write_and_check_file(&vol.target, "data", MIB as usize, 40);
    vol.resize_backing(96 * MIB);
    daemon.kill();
    let mut armed = daemon.start(Some("expand-after-resize")).await;
    vol.expand(&mut armed, 96 * MIB)
        .await
        .expect_err("the daemon dies between resize and grow");
    assert!(daemon
        .wait_exit(Duration::from_secs(30))
        .is_some_and(|s| !s.success()));
    // The node "reboots": mounts and device are gone; the journal says Expanding.
    for path in [&vol.target, &vol.staging] {
        while mounts::ops::unmount(path).unwrap() {}
    }
    disconnect_behind_the_back(&vol, &daemon).await;
    let mut c = daemon.start(None).await;
    // kubelet stages and publishes again: attached anew, and the filesystem grown.
    vol.up(&mut c).await;
    let grown = fs_bytes(&vol.target);
    assert!(
        grown > 80 * MIB,
        "the interrupted expansion was finished: {} bytes",
        grown
    );
    assert!(
        std::fs::read(vol.target.join("data")).unwrap() == testkit::pattern(40, 0, MIB as usize)
    );
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn publish_mounts_a_lost_staging_mount_and_unstage_forgets_stale_targets() {
    let (daemon, mut c) = start_node("paths").await;
    let vol = Volume::new(&daemon, "remount", 64 * MIB, ext4());
    vol.up(&mut c).await;
    write_and_check_file(&vol.target, "kept", MIB as usize, 6);
    vol.unpublish(&mut c).await.unwrap();
    // Someone unmounted the staging path: publish must not bind the bare directory.
    mounts::ops::unmount(&vol.staging).unwrap();
    vol.publish(&mut c).await.unwrap();
    assert!(is_mounted(&vol.staging), "staging mounted again");
    assert!(std::fs::read(vol.target.join("kept")).unwrap() == pattern(6, 0, MIB as usize));

    // kubelet's orphan cleanup removed the pod's mount without NodeUnpublish.
    while mounts::ops::unmount(&vol.target).unwrap() {}
    vol.unstage(&mut c).await.unwrap();
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_rebuilt_record_takes_the_staging_path_kubelet_gives() {
    let (mut daemon, mut c) = start_node("rebuilt").await;
    let vol = Volume::new(&daemon, "rebuilt-vol", 64 * MIB, ext4());
    vol.up(&mut c).await;
    write_and_check_file(&vol.target, "kept", MIB as usize, 14);
    daemon.kill();
    // The journal entry is lost and the staging mount is gone: the pod's mount is the only
    // mount of the device left, and a rebuilt record can only guess.
    for f in daemon.journal_files() {
        std::fs::remove_file(f).unwrap();
    }
    mounts::ops::unmount(&vol.staging).unwrap();
    let mut c2 = daemon.start(None).await;
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(daemon.state_dir.join("recovery.json")).unwrap())
            .unwrap();
    assert_eq!(report["rebuilt"].as_array().unwrap().len(), 1, "{report}");
    drop(c);
    vol.unpublish(&mut c2).await.unwrap();
    vol.unstage(&mut c2).await.unwrap();
    assert_clean(&daemon);
    // The data made it to the export.
    vol.up(&mut c2).await;
    assert!(std::fs::read(vol.target.join("kept")).unwrap() == pattern(14, 0, MIB as usize));
    vol.down(&mut c2).await;
    assert_clean(&daemon);
}
