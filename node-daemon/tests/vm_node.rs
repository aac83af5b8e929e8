//! The node daemon against the real kernel, driven through its CSI socket as kubelet drives
//! it. Ignored on the host; run in the VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking
#![allow(clippy::cast_possible_truncation)] // buffer sizes of a few MiB, on 64-bit guests

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use csi_proto::csi::{NodeGetCapabilitiesRequest, NodeGetInfoRequest};
use mounts::MountTable;

mod common;
use common::prelude::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn lifecycle_ext4_xfs_and_block_leaves_nothing_behind() {
    let (daemon, mut c) = start_node("life").await;

    let caps = c
        .node
        .node_get_capabilities(NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(caps.capabilities.len(), 5);
    let info = c
        .node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "life");
    let nbds_max: i64 = std::fs::read_to_string("/sys/module/nbd/parameters/nbds_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        info.max_volumes_per_node, nbds_max,
        "nbds_max of the module"
    );
    assert_eq!(
        info.accessible_topology.unwrap().segments["topology.ustor-nbd.csi.mindsw.io/data-plane"],
        "true"
    );
    let socket_mode = std::fs::metadata(&daemon.socket).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&socket_mode.permissions()) & 0o777,
        0o600
    );

    for (name, cap, size) in [
        ("vol-ext4", ext4(), 64 * MIB),
        (
            "vol-xfs",
            mount_capability("xfs", Mode::SingleNodeWriter),
            512 * MIB,
        ),
        ("vol-block", block(), 64 * MIB),
    ] {
        let vol = Volume::new(&daemon, name, size, cap);
        vol.up(&mut c).await;
        // Idempotent repeats.
        vol.stage(&mut c).await.unwrap();
        vol.publish(&mut c).await.unwrap();
        let device = vol
            .device(&daemon)
            .expect("a device carries the volume's identifier");
        assert_eq!(Sysfs::default().scheduler(device).unwrap(), "none");
        if name == "vol-block" {
            block_round_trip(&vol, 4 * MIB, 1);
        } else {
            assert!(is_mounted(&vol.staging) && is_mounted(&vol.target));
            write_and_check_file(&vol.target, "hello", 3 * MIB as usize, 2);
            let fs = mounts::format::probe(&Sysfs::default().dev_path(device)).unwrap();
            assert_eq!(
                fs,
                mounts::Probe::Filesystem(name.trim_start_matches("vol-").into())
            );
        }
        vol.down(&mut c).await;
        // Idempotent repeats of the teardown.
        vol.unpublish(&mut c).await.unwrap();
        vol.unstage(&mut c).await.unwrap();
        assert!(
            !vol.target.exists(),
            "the plugin removes what it created at the target"
        );
        assert!(!is_mounted(&vol.staging));
        assert_eq!(vol.device(&daemon), None);
    }
    assert_clean(&daemon);

    // Kubelet's plugin registration answers on its own socket.
    let channel = testkit::csi::connect(
        &daemon
            .registration_dir
            .join("ustor-nbd.csi.mindsw.io-reg.sock"),
    )
    .await
    .unwrap();
    let info = csi_proto::registration::registration_client::RegistrationClient::new(channel)
        .get_info(csi_proto::registration::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (info.r#type.as_str(), info.name.as_str()),
        ("CSIPlugin", "ustor-nbd.csi.mindsw.io")
    );
    assert_eq!(Path::new(&info.endpoint), daemon.socket);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn seed_v021_unstage_after_restart_detaches_only_its_own_device() {
    let (mut daemon, mut c) = start_node("v021").await;
    let first = Volume::new(
        &daemon,
        "blk-first",
        32 * MIB,
        block_capability(Mode::SingleNodeSingleWriter),
    );
    let second = Volume::new(
        &daemon,
        "blk-second",
        32 * MIB,
        block_capability(Mode::SingleNodeSingleWriter),
    );
    first.up(&mut c).await;
    second.up(&mut c).await;
    let (d1, d2) = (
        first.device(&daemon).unwrap(),
        second.device(&daemon).unwrap(),
    );
    assert_ne!(d1, d2);

    daemon.kill();
    let mut c = daemon.start(None).await;
    second.down(&mut c).await;

    assert_eq!(
        second.device(&daemon),
        None,
        "the second volume's device is gone"
    );
    assert_eq!(
        first.device(&daemon),
        Some(d1),
        "the first volume keeps its device"
    );
    block_round_trip(&first, 0, 21);
    block_round_trip(&first, 16 * MIB, 22);
    first.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn seed_v022_expand_after_restart_uses_the_staging_path() {
    let (mut daemon, mut c) = start_node("v022").await;
    let fs_vol = Volume::new_on(&daemon, "grow-ext4", 64 * MIB, ext4(), Listen::Tcp);
    let blk_vol = Volume::new_on(&daemon, "grow-block", 64 * MIB, block(), Listen::Tcp);
    fs_vol.up(&mut c).await;
    blk_vol.up(&mut c).await;
    let before = mounts::usage::usage(&fs_vol.target).unwrap().bytes_total;

    daemon.kill();
    let mut c = daemon.start(None).await;
    for vol in [&fs_vol, &blk_vol] {
        vol.resize_backing(128 * MIB);
        // Kubelet names the pod's path; the daemon must grow through its staging path.
        let r = c
            .node
            .node_expand_volume(expand_request(
                &vol.id,
                &vol.target,
                &vol.staging,
                (128 * MIB) as i64,
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.capacity_bytes, (128 * MIB) as i64);
    }
    let after = mounts::usage::usage(&fs_vol.target).unwrap().bytes_total;
    assert!(after > before + 50 * MIB, "ext4 grew: {before} -> {after}");
    let dev = blk_vol.device(&daemon).unwrap();
    assert_eq!(Sysfs::default().size_bytes(dev).unwrap(), 128 * MIB);
    let size_through_target = std::fs::File::open(&blk_vol.target)
        .and_then(|mut f| std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0)))
        .unwrap();
    assert_eq!(
        size_through_target,
        128 * MIB,
        "the pod's block device shows the new size"
    );
    write_and_check_file(&fs_vol.target, "after-grow", 80 * MIB as usize, 3);

    fs_vol.down(&mut c).await;
    blk_vol.down(&mut c).await;
    assert!(!is_mounted(&fs_vol.staging));
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn kill_9_under_load_loses_no_io() {
    let (mut daemon, mut c) = start_node("load").await;
    let vol = Volume::new(&daemon, "busy", 128 * MIB, ext4());
    vol.up(&mut c).await;

    let file = vol.target.join("stream");
    let written = Arc::new(AtomicU64::new(0));
    let writer = {
        let (file, written) = (file.clone(), Arc::clone(&written));
        std::thread::spawn(move || -> std::io::Result<()> {
            let f = std::fs::File::create(&file)?;
            for chunk in 0..48u64 {
                f.write_all_at(&pattern(9, chunk * MIB, MIB as usize), chunk * MIB)?;
                f.sync_data()?;
                written.store(chunk + 1, Ordering::SeqCst);
            }
            Ok(())
        })
    };
    while written.load(Ordering::SeqCst) < 4 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    daemon.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut c = daemon.start(None).await;
    assert!(
        written.load(Ordering::SeqCst) < 48,
        "the writer was still running across the restart"
    );
    tokio::task::spawn_blocking(move || writer.join().unwrap())
        .await
        .unwrap()
        .expect("no I/O error");
    let data = std::fs::read(&file).unwrap();
    for chunk in 0..48u64 {
        let range = (chunk * MIB) as usize..((chunk + 1) * MIB) as usize;
        assert!(
            data[range] == pattern(9, chunk * MIB, MIB as usize)[..],
            "chunk {chunk} intact"
        );
    }
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

/// Calls that a crash point interrupts, in lifecycle order.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Call {
    Stage,
    Publish,
    Expand,
    Unpublish,
    Unstage,
}

async fn call(vol: &Volume, c: &mut NodeClients, which: Call) -> Result<(), tonic::Status> {
    match which {
        Call::Stage => vol.stage(c).await,
        Call::Publish => vol.publish(c).await,
        Call::Expand => vol.expand(c, 96 * MIB).await,
        Call::Unpublish => vol.unpublish(c).await,
        Call::Unstage => vol.unstage(c).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn crash_at_every_journal_step_converges() {
    let points: &[(Call, &str, bool)] = &[
        (Call::Stage, "journal-before-rename", false),
        (Call::Stage, "stage-before-connect", false),
        (Call::Stage, "stage-after-connect", false),
        (Call::Stage, "stage-before-mkfs", false),
        (Call::Stage, "stage-after-mkfs", false),
        (Call::Stage, "stage-after-mount", false),
        (Call::Stage, "stage-after-connect", true),
        (Call::Publish, "publish-after-journal", false),
        (Call::Publish, "publish-after-mount", false),
        (Call::Publish, "publish-after-mount", true),
        (Call::Expand, "expand-while-frozen", false),
        (Call::Expand, "expand-after-resize", false),
        (Call::Expand, "expand-after-grow", false),
        (Call::Unpublish, "unpublish-after-journal", false),
        (Call::Unpublish, "unpublish-after-unmount", true),
        (Call::Unstage, "unstage-after-journal", false),
        (Call::Unstage, "unstage-after-unmount", false),
        (Call::Unstage, "unstage-after-disconnect", false),
        (Call::Unstage, "unstage-after-disconnect", true),
    ];
    let lifecycle = [
        Call::Stage,
        Call::Publish,
        Call::Expand,
        Call::Unpublish,
        Call::Unstage,
    ];
    for (n, &(crash_call, point, is_block)) in points.iter().enumerate() {
        let mut daemon = NodeDaemon::new(&format!("crash{n}"), CONFIG).unwrap();
        let cap = if is_block { block() } else { ext4() };
        let vol = Volume::new_on(&daemon, &format!("crash-{n}"), 64 * MIB, cap, Listen::Tcp);
        let mut c = daemon.start(None).await;
        for step in lifecycle {
            if step == Call::Expand {
                vol.resize_backing(96 * MIB);
            }
            if step == crash_call {
                daemon.kill();
                let mut armed = daemon.start(Some(point)).await;
                let err = call(&vol, &mut armed, step)
                    .await
                    .expect_err("the daemon dies mid-call");
                assert_ne!(err.code(), Code::Ok);
                let exit = daemon.wait_exit(Duration::from_secs(30));
                assert!(
                    exit.is_some_and(|s| !s.success()),
                    "{point}: the daemon crashed at the point"
                );
                c = daemon.start(None).await;
                call(&vol, &mut c, step).await.unwrap_or_else(|e| {
                    panic!("{point}: repeating {step:?} after the crash: {e:?}")
                });
            } else {
                call(&vol, &mut c, step)
                    .await
                    .unwrap_or_else(|e| panic!("{point}: {step:?}: {e:?}"));
            }
            if step == Call::Publish && !is_block {
                write_and_check_file(&vol.target, "data", MIB as usize, n as u64);
            }
            if step == Call::Expand {
                let dev = vol.device(&daemon).unwrap();
                assert_eq!(
                    Sysfs::default().size_bytes(dev).unwrap(),
                    96 * MIB,
                    "{point}"
                );
            }
        }
        assert_clean(&daemon);
        daemon.kill();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn server_restart_is_healed_and_reported_in_stats() {
    let (daemon, mut c) = start_node("heal").await;
    let mut vol = Volume::new(&daemon, "flaky", 64 * MIB, block());
    vol.up(&mut c).await;
    let condition = |c: &mut NodeClients, vol: &Volume| {
        let mut node = c.node.clone();
        let req = stats_request(&vol.id, &vol.target);
        async move {
            let r = node.node_get_volume_stats(req).await.unwrap().into_inner();
            assert!(!r.usage.is_empty(), "usage is always reported");
            r.volume_condition.unwrap()
        }
    };
    assert!(!condition(&mut c, &vol).await.abnormal);

    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let (target, done) = (vol.target.clone(), Arc::clone(&done));
        std::thread::spawn(move || -> std::io::Result<u64> {
            let f = DirectFile::open(&target, true)?;
            let mut n = 0u64;
            while !done.load(Ordering::SeqCst) {
                let offset = (n % 256) * 64 * 1024;
                f.write_at(&pattern(n, offset, 64 * 1024), offset)?;
                n += 1;
            }
            f.sync()?;
            Ok(n)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    vol.server.kill();
    let started = Instant::now();
    loop {
        let cond = condition(&mut c, &vol).await;
        if cond.abnormal {
            assert!(cond.message.contains("lost"), "{}", cond.message);
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "condition never turned abnormal"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    vol.server.start().unwrap();
    let started = Instant::now();
    while condition(&mut c, &vol).await.abnormal {
        assert!(started.elapsed() < Duration::from_secs(60), "never healed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    done.store(true, Ordering::SeqCst);
    let writes = tokio::task::spawn_blocking(move || writer.join().unwrap())
        .await
        .unwrap()
        .expect("no I/O error across the server restart");
    assert!(writes > 0);
    block_round_trip(&vol, 20 * MIB, 66);
    let metrics = daemon.scrape().await;
    assert!(
        metrics.contains("ustor_csi_node_link_dead_events_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"ustor_csi_node_link_heals_total{result="ok"}"#),
        "{metrics}"
    );
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn rwx_block_is_staged_on_two_nodes_rwx_mount_is_refused() {
    let mut node_a = NodeDaemon::new("node-a", CONFIG).unwrap();
    let mut node_b = NodeDaemon::new("node-b", CONFIG).unwrap();
    let mut a = node_a.start(None).await;
    let mut b = node_b.start(None).await;
    let rwx = block_capability(Mode::MultiNodeMultiWriter);
    let vol_a = Volume::new(&node_a, "vm-disk", 64 * MIB, rwx.clone());
    // Node b attaches the same export, under the same volume id.
    let vol_b = Volume {
        id: vol_a.id.clone(),
        backing: vol_a.backing.clone(),
        server: NbdServer::nbdkit(
            Listen::Unix,
            &["file", &format!("file={}", vol_a.backing.display())],
        )
        .unwrap(),
        staging: node_b.scratch().join("staging-vm-disk"),
        target: node_b.scratch().join("target-vm-disk"),
        cap: rwx,
        connections: None,
        tls: false,
        tls_profile: None,
        via: None,
    };
    std::fs::create_dir_all(&vol_b.staging).unwrap();
    vol_a.up(&mut a).await;
    vol_b.up(&mut b).await;
    let (da, db) = (
        vol_a.device(&node_a).unwrap(),
        vol_b.device(&node_b).unwrap(),
    );
    assert_ne!(da, db, "two attachments, two devices");
    // A write through one node's device is read through the other's.
    let data = pattern(77, 0, 128 * 1024);
    DirectFile::open(&vol_a.target, true)
        .unwrap()
        .write_at(&data, MIB)
        .unwrap();
    assert!(
        DirectFile::open(&vol_b.target, false)
            .unwrap()
            .read_at(data.len(), MIB)
            .unwrap()
            == data
    );
    vol_b.down(&mut b).await;
    assert_eq!(
        vol_a.device(&node_a),
        Some(da),
        "node a's attachment is untouched"
    );
    vol_a.down(&mut a).await;
    assert_clean(&node_a);
    assert_clean(&node_b);

    let rwx_mount = Volume::new(
        &node_a,
        "rwx-fs",
        16 * MIB,
        mount_capability("ext4", Mode::MultiNodeMultiWriter),
    );
    let err = rwx_mount.stage(&mut a).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("volumeMode: Block"),
        "{}",
        err.message()
    );
    assert_clean(&node_a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn bad_input_gets_the_spec_code_and_changes_nothing() {
    let (daemon, mut c) = start_node("bad").await;
    let vol = Volume::new(&daemon, "good", 16 * MIB, ext4());
    let uri = vol.uri();
    let staging = vol.staging.clone();

    let mut cases: Vec<(&str, csi_proto::csi::NodeStageVolumeRequest, Code)> = Vec::new();
    let base = || stage_request("good", &staging, ext4(), &uri);
    let mut r = base();
    r.volume_id.clear();
    cases.push(("missing volume id", r, Code::InvalidArgument));
    let mut r = base();
    r.staging_target_path.clear();
    cases.push(("missing staging path", r, Code::InvalidArgument));
    let mut r = base();
    r.volume_capability = None;
    cases.push(("missing capability", r, Code::InvalidArgument));
    let mut r = base();
    r.staging_target_path = "relative/path".into();
    cases.push(("relative path", r, Code::InvalidArgument));
    let mut r = base();
    r.staging_target_path = format!("{}/../escape", staging.display());
    cases.push(("dot-dot path", r, Code::InvalidArgument));
    cases.push((
        "unknown fsType",
        stage_request(
            "good",
            &staging,
            mount_capability("zfs", Mode::SingleNodeWriter),
            &uri,
        ),
        Code::InvalidArgument,
    ));
    cases.push((
        "bad nbdUri",
        stage_request("good", &staging, ext4(), "nbds+unix:///x?socket=/s"),
        Code::InvalidArgument,
    ));
    // This daemon has no TLS files: refused before anything is dialed.
    cases.push((
        "nbds:// without TLS settings",
        stage_request("good", &staging, ext4(), "nbds://host/x"),
        Code::FailedPrecondition,
    ));
    let mut r = base();
    r.volume_context.insert("nbdConnection".into(), "2".into());
    cases.push(("unknown context key", r, Code::InvalidArgument));
    cases.push((
        "unknown export",
        stage_request(
            "good",
            &staging,
            ext4(),
            "nbd+unix:///?socket=/nonexistent.sock",
        ),
        Code::Unavailable,
    ));
    for (what, req, code) in cases {
        let err = c.node.node_stage_volume(req).await.expect_err(what);
        assert_eq!(err.code(), code, "{what}: {}", err.message());
        assert!(
            !err.message().is_empty(),
            "{what}: a message an operator can act on"
        );
    }
    assert_clean(&daemon);

    let err = vol.publish(&mut c).await.unwrap_err();
    assert_eq!(
        err.code(),
        Code::FailedPrecondition,
        "publish before stage: {}",
        err.message()
    );
    assert!(!vol.target.exists());
    vol.unstage(&mut c)
        .await
        .expect("unstage of an unknown volume is OK");
    vol.unpublish(&mut c)
        .await
        .expect("unpublish of an unknown volume is OK");
    let err = c
        .node
        .node_get_volume_stats(stats_request("good", &vol.staging))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .node
        .node_expand_volume(expand_request("good", &vol.staging, &vol.staging, 0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);

    // Staged once; then conflicting repeats.
    vol.stage(&mut c).await.unwrap();
    let other = daemon.scratch().join("other-staging");
    std::fs::create_dir_all(&other).unwrap();
    let err = c
        .node
        .node_stage_volume(stage_request("good", &other, ext4(), &uri))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    let err = c
        .node
        .node_stage_volume(stage_request(
            "good",
            &staging,
            mount_capability("xfs", Mode::SingleNodeWriter),
            &uri,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    let err = c
        .node
        .node_get_volume_stats(stats_request("good", &other))
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Code::NotFound,
        "stats of a path that is not the volume's"
    );

    // RWOP: a second target on the same node is refused.
    let rwop = Volume::new(
        &daemon,
        "rwop",
        16 * MIB,
        mount_capability("ext4", Mode::SingleNodeSingleWriter),
    );
    rwop.up(&mut c).await;
    let second = daemon.scratch().join("pods/pod-2/volumes/rwop/mount");
    std::fs::create_dir_all(second.parent().unwrap()).unwrap();
    let err = rwop.publish_at(&mut c, &second, false).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    // Unstage while published is refused and detaches nothing.
    let err = rwop.unstage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(rwop.device(&daemon).is_some());

    rwop.down(&mut c).await;
    vol.unstage(&mut c).await.unwrap();
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn data_is_never_reformatted_restored_volumes_grow_readonly_is_honoured() {
    let (daemon, mut c) = start_node("fsguard").await;
    let mut cap = ext4();
    if let Some(csi_proto::csi::volume_capability::AccessType::Mount(m)) = cap.access_type.as_mut()
    {
        m.mount_flags = vec!["noatime".into()];
    }
    let vol = Volume::new(&daemon, "keeper", 64 * MIB, cap);
    vol.up(&mut c).await;
    write_and_check_file(&vol.target, "keep", MIB as usize, 5);
    let table = MountTable::read().unwrap();
    let staging_mount = table.at(&vol.staging).last().unwrap();
    assert!(
        staging_mount.options.iter().any(|o| o == "noatime"),
        "{:?}",
        staging_mount.options
    );
    let stats = c
        .node
        .node_get_volume_stats(stats_request(&vol.id, &vol.target))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.usage.len(), 2, "bytes and inodes");
    assert!(stats.usage.iter().all(|u| u.total > 0 && u.used > 0));
    vol.down(&mut c).await;

    // As a volume restored from a snapshot into a larger volume: data, and more room.
    vol.resize_backing(128 * MIB);
    vol.up(&mut c).await;
    assert!(
        std::fs::read(vol.target.join("keep")).unwrap() == pattern(5, 0, MIB as usize),
        "not reformatted"
    );
    let total = mounts::usage::usage(&vol.target).unwrap().bytes_total;
    assert!(
        total > 100 * MIB,
        "the filesystem grew to its device at stage: {total}"
    );

    // A second, read-only publish of the same volume.
    let ro_target = daemon.scratch().join("pods/pod-ro/volumes/keeper/mount");
    std::fs::create_dir_all(ro_target.parent().unwrap()).unwrap();
    vol.publish_at(&mut c, &ro_target, true).await.unwrap();
    let err = std::fs::write(ro_target.join("nope"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    assert!(std::fs::read(ro_target.join("keep")).is_ok());
    c.node
        .node_unpublish_volume(unpublish_request(&vol.id, &ro_target))
        .await
        .unwrap();
    vol.down(&mut c).await;

    // A device that holds another filesystem is refused, not formatted.
    let other = Volume::new(
        &daemon,
        "holds-ext4",
        64 * MIB,
        mount_capability("xfs", Mode::SingleNodeWriter),
    );
    mkfs_ext4(&other.backing);
    let err = other.stage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("holds ext4"), "{}", err.message());
    other.unstage(&mut c).await.unwrap();
    let probe = std::process::Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE"])
        .arg(&other.backing)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&probe.stdout).trim(),
        "ext4",
        "untouched"
    );
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn another_call_on_a_busy_volume_is_aborted_and_a_retry_joins_the_first() {
    let mut daemon =
        NodeDaemon::new("busy", "call-patience-secs = 1\ndial-timeout-secs = 6\n").unwrap();
    let c = daemon.start(None).await;
    // An export that accepts the connection and never speaks: the first call waits for its dial.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let uri = format!("nbd://127.0.0.1:{}/x", silent.local_addr().unwrap().port());
    let staging = daemon.scratch().join("staging-busy");
    std::fs::create_dir_all(&staging).unwrap();
    let stage = |c: &NodeClients| {
        let (mut node, req) = (
            c.node.clone(),
            stage_request("slow", &staging, block(), &uri),
        );
        tokio::spawn(async move { node.node_stage_volume(req).await })
    };
    let first = stage(&c);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Another operation on the volume waits call-patience, then is ABORTED.
    let started = Instant::now();
    let err = c
        .node
        .clone()
        .node_unstage_volume(unstage_request("slow", &staging))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{}", err.message());
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    // The same call again (kubelet's retry) joins the running one and gets its answer.
    let retry = stage(&c);
    let first = first.await.unwrap().unwrap_err();
    assert_eq!(first.code(), Code::Unavailable, "{}", first.message());
    let retry = retry.await.unwrap().unwrap_err();
    assert_eq!(
        (retry.code(), retry.message()),
        (first.code(), first.message()),
        "the retry's answer is the first call's"
    );
    assert_clean(&daemon);
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_torn_record_is_quarantined_and_rebuilt_from_kernel_facts() {
    let (mut daemon, mut c) = start_node("torn").await;
    let vol = Volume::new(&daemon, "torn-vol", 64 * MIB, ext4());
    vol.up(&mut c).await;
    write_and_check_file(&vol.target, "before", MIB as usize, 8);
    daemon.kill();
    let record = daemon.journal_files().pop().unwrap();
    let bytes = std::fs::read(&record).unwrap();
    std::fs::write(&record, &bytes[..bytes.len() / 2]).unwrap();

    let mut c = daemon.start(None).await;
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(daemon.state_dir.join("recovery.json")).unwrap())
            .unwrap();
    assert_eq!(
        report["quarantined"].as_array().unwrap().len(),
        1,
        "{report}"
    );
    assert_eq!(report["rebuilt"].as_array().unwrap().len(), 1, "{report}");
    assert!(
        std::fs::read_dir(daemon.state_dir.join("quarantine"))
            .unwrap()
            .count()
            == 1
    );
    // The next publish brings the export back into the record; then the usual teardown.
    vol.publish(&mut c).await.unwrap();
    assert!(std::fs::read(vol.target.join("before")).unwrap() == pattern(8, 0, MIB as usize));
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn links_the_kernel_drops_or_the_network_swallows_are_healed() {
    const TOTAL: u64 = 24 * MIB;
    const CHUNK: usize = 64 * 1024;
    let (daemon, mut c) = start_node("drops").await;
    let backing = daemon.scratch().join("drops.img");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let server = NbdServer::nbdkit(
        Listen::Tcp,
        &["file", &format!("file={}", backing.display())],
    )
    .unwrap();
    let nbd::uri::Endpoint::Tcp { port, .. } = server.uri().endpoint().clone() else {
        unreachable!()
    };
    let proxy = testkit::proxy::NbdProxy::start(([127, 0, 0, 1], port).into())
        .await
        .unwrap();
    let uri = proxy.uri("").to_string();
    let cap = block();
    let staging = daemon.scratch().join("staging-drops");
    let target = daemon.scratch().join("publish/drops");
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    c.node
        .node_stage_volume(stage_request("drops", &staging, cap.clone(), &uri))
        .await
        .unwrap();
    c.node
        .node_publish_volume(publish_request(
            "drops", &staging, &target, cap, &uri, false,
        ))
        .await
        .unwrap();
    assert_eq!(proxy.accepted(), 1);

    let written = Arc::new(AtomicU64::new(0));
    let writer = {
        let (target, written) = (target.clone(), Arc::clone(&written));
        std::thread::spawn(move || -> std::io::Result<()> {
            let f = DirectFile::open(&target, true)?;
            let mut offset = 0;
            while offset < TOTAL {
                f.write_at(&pattern(4, offset, CHUNK), offset)?;
                offset += CHUNK as u64;
                written.store(offset, Ordering::SeqCst);
                // Slow enough that both faults land while it writes.
                std::thread::sleep(Duration::from_millis(2));
            }
            f.sync()
        })
    };
    let wait_for = |bytes: u64| {
        let written = Arc::clone(&written);
        async move {
            while written.load(Ordering::SeqCst) < bytes {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    wait_for(2 * MIB).await;
    // "Unexpected reply": the kernel kills the connection itself.
    proxy.inject_unexpected_reply().await;
    heal_wait(&mut c, &proxy, &target, 2).await;
    wait_for(10 * MIB).await;
    // A network that swallows everything: requests time out, the kernel gives up the link.
    proxy.blackhole_open_connections();
    heal_wait(&mut c, &proxy, &target, 3).await;

    tokio::task::spawn_blocking(move || writer.join().unwrap())
        .await
        .unwrap()
        .expect("the writer saw no I/O error");
    let mut data = vec![0u8; TOTAL as usize];
    std::fs::File::open(&backing)
        .unwrap()
        .read_exact_at(&mut data, 0)
        .unwrap();
    for offset in (0..TOTAL).step_by(CHUNK) {
        let o = offset as usize;
        assert!(
            data[o..o + CHUNK] == pattern(4, offset, CHUNK)[..],
            "data at {offset}"
        );
    }
    c.node
        .node_unpublish_volume(unpublish_request("drops", &target))
        .await
        .unwrap();
    c.node
        .node_unstage_volume(unstage_request("drops", &staging))
        .await
        .unwrap();
    assert_clean(&daemon);
}

/// Waits until the proxy has seen `connections` connections (the healer redialled) and the
/// volume's condition is normal again.
async fn heal_wait(
    c: &mut NodeClients,
    proxy: &testkit::proxy::NbdProxy,
    target: &Path,
    connections: usize,
) {
    let started = Instant::now();
    loop {
        let r = c
            .node
            .node_get_volume_stats(stats_request("drops", target))
            .await
            .unwrap()
            .into_inner();
        if proxy.accepted() >= connections && !r.volume_condition.unwrap().abnormal {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "not healed (proxy accepted {} connections)",
            proxy.accepted()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_device_lost_or_taken_over_is_reported_and_never_detached() {
    use nbd::attach::{self, AttachOptions};
    use nbd::netlink::NbdNetlink;
    let (daemon, mut c) = start_node("owner").await;
    let vol = Volume::new(&daemon, "victim", 32 * MIB, block());
    vol.up(&mut c).await;
    let index = vol.device(&daemon).unwrap();
    let sysfs = Sysfs::default();
    let ours = sysfs.backend(index).unwrap().unwrap();
    let condition = |c: &mut NodeClients| {
        let mut node = c.node.clone();
        let req = stats_request("victim", &vol.target);
        async move {
            node.node_get_volume_stats(req)
                .await
                .unwrap()
                .into_inner()
                .volume_condition
                .unwrap()
        }
    };

    // Someone detaches the device behind the daemon's back.
    let nl = NbdNetlink::open().await.unwrap();
    attach::detach(
        &nl,
        &sysfs,
        index,
        &nbd::BackendId::new(ours.clone()).unwrap(),
        Duration::from_secs(10),
    )
    .await
    .unwrap_or_else(|e| {
        // The pod's bind mount keeps the device open; its configuration goes at the last close.
        panic!("detaching behind the daemon's back: {e}")
    });
    let cond = condition(&mut c).await;
    assert!(cond.abnormal, "{}", cond.message);

    // ... and another attachment takes the same device number.
    let stranger = NbdServer::nbdkit(Listen::Unix, &["memory", "8M"]).unwrap();
    let mut opts = AttachOptions::new(nbd::BackendId::new("someone-else:1").unwrap());
    opts.index = Some(index);
    let foreign = attach::attach(&nl, &sysfs, &stranger.uri(), &opts)
        .await
        .unwrap();
    let cond = condition(&mut c).await;
    assert!(
        cond.abnormal && cond.message.contains("someone-else"),
        "{}",
        cond.message
    );

    // Teardown of the volume must not touch the stranger's device.
    vol.unpublish(&mut c).await.unwrap();
    vol.unstage(&mut c).await.unwrap();
    assert_eq!(
        sysfs.backend(index).unwrap().as_deref(),
        Some("someone-else:1"),
        "the stranger keeps its device"
    );
    assert_clean(&daemon);
    attach::detach(
        &nl,
        &sysfs,
        foreign.device.index(),
        foreign.device.identifier(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
}
