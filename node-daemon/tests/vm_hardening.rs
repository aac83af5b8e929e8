//! The node daemon on its worst days, against the real kernel: an export that vanishes during a
//! call, a stage that fails half-way, a format interrupted by a crash, a device lost mid-stage,
//! a staging mount gone under a publish, an export that shrank. Ignored on the host; run in the
//! VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking

use std::path::Path;
use std::time::{Duration, Instant};

use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::ProbeRequest;
use nbd::netlink::NbdNetlink;
use nbd::sysfs::Sysfs;
use nbd::BackendId;
use testkit::csi::*;
use testkit::daemon::NodeDaemon;
use testkit::{kernel_io_errors, pattern, DirectFile, Listen};
use tonic::Code;

mod common;
use common::*;

/// The filesystem UUID of an image file, as blkid reads it.
fn image_uuid(image: &Path) -> String {
    let out = std::process::Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "UUID"])
        .arg(image)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Disconnects a volume's device behind the daemon's back, as a reboot or an operator would.
async fn disconnect_behind_the_back(vol: &Volume, daemon: &NodeDaemon) {
    let sysfs = Sysfs::default();
    let index = vol.device(daemon).expect("the volume has a device");
    let id = BackendId::new(sysfs.backend(index).unwrap().unwrap()).unwrap();
    let proven = sysfs.prove(index, &id).unwrap();
    NbdNetlink::open()
        .await
        .unwrap()
        .disconnect(&proven)
        .await
        .unwrap();
    nbd::attach::wait_released(&sysfs, index, Duration::from_secs(30))
        .await
        .unwrap();
}

/// The fields of one entry in the journal's native protocol: `NAME=value` lines, or `NAME`,
/// a 64-bit little-endian length and that many bytes of value.
fn journal_fields(mut data: &[u8]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    while let Some(end) = data.iter().position(|b| *b == b'=' || *b == b'\n') {
        let name = String::from_utf8_lossy(&data[..end]).into_owned();
        let value;
        if data[end] == b'=' {
            let stop = data[end..].iter().position(|b| *b == b'\n').unwrap() + end;
            value = data[end + 1..stop].to_vec();
            data = &data[stop + 1..];
        } else {
            let len = u64::from_le_bytes(data[end + 1..end + 9].try_into().unwrap()) as usize;
            value = data[end + 9..end + 9 + len].to_vec();
            data = &data[end + 9 + len + 1..];
        }
        out.push((name, String::from_utf8_lossy(&value).into_owned()));
    }
    out
}

/// Arms `point`, makes `stage` hit it, and waits for the daemon to die there.
async fn crash_stage_at(daemon: &mut NodeDaemon, vol: &Volume, point: &str) {
    let mut armed = daemon.start(Some(point)).await;
    vol.stage(&mut armed)
        .await
        .expect_err("the daemon dies mid-call");
    let exit = daemon.wait_exit(Duration::from_secs(30));
    assert!(exit.is_some_and(|s| !s.success()), "crashed at {point}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn unstage_during_an_outage_waits_for_the_heal_and_loses_nothing() {
    let mut daemon = NodeDaemon::new("outage", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
    let mut vol = Volume::new(&daemon, "dirty", 64 * MIB, ext4());
    let other = Volume::new(&daemon, "bystander", 32 * MIB, block());
    vol.up(&mut c).await;
    other.up(&mut c).await;
    let errors_before = kernel_io_errors();

    // Dirty pages only: nothing reaches the export before the unmount flushes them.
    let data = pattern(91, 0, 4 * MIB as usize);
    std::fs::write(vol.target.join("unsynced"), &data).unwrap();
    vol.unpublish(&mut c).await.unwrap();
    vol.server.kill();

    let unstage = {
        let (mut node, req) = (c.node.clone(), unstage_request(&vol.id, &vol.staging));
        tokio::spawn(async move {
            let started = Instant::now();
            (node.node_unstage_volume(req).await, started.elapsed())
        })
    };
    // While the unmount waits on the dead link, everything else is answered promptly.
    let outage = Instant::now();
    let mut slowest = Duration::ZERO;
    while outage.elapsed() < Duration::from_secs(3) {
        let started = Instant::now();
        let probe = c
            .identity
            .probe(ProbeRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(probe.ready, Some(true));
        c.node
            .node_get_volume_stats(stats_request(&other.id, &other.target))
            .await
            .unwrap();
        block_round_trip(&other, 0, 17);
        slowest = slowest.max(started.elapsed());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        slowest < Duration::from_secs(1),
        "calls took up to {slowest:?} during the outage"
    );
    assert!(!unstage.is_finished(), "the unmount waits for the export");
    vol.server.start().unwrap();
    let (result, took) = tokio::time::timeout(Duration::from_secs(60), unstage)
        .await
        .expect("NodeUnstage finishes once the export is back")
        .unwrap();
    result.unwrap_or_else(|e| panic!("NodeUnstage during the outage: {e:?}"));
    assert!(took >= Duration::from_secs(3), "{took:?}");
    assert_eq!(
        kernel_io_errors(),
        errors_before,
        "no I/O error reached the kernel log"
    );

    // Every byte written before the outage is on the export.
    vol.up(&mut c).await;
    assert!(std::fs::read(vol.target.join("unsynced")).unwrap() == data);
    vol.down(&mut c).await;
    other.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_stage_that_fails_for_good_leaves_nothing_behind() {
    let mut daemon = NodeDaemon::new("undo", CONFIG).unwrap();
    let mut c = daemon.start(None).await;

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
    let mut daemon = NodeDaemon::new("paths", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
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
async fn expansion_never_shrinks_and_one_export_has_one_volume() {
    let mut daemon = NodeDaemon::new("sizes", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
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
    let mut daemon = NodeDaemon::new("ro", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
    let sysfs = Sysfs::default();

    // A read-only publish of a writable attachment: the device refuses writes meanwhile.
    let vol = Volume::new(&daemon, "ro-publish", 32 * MIB, block());
    vol.stage(&mut c).await.unwrap();
    c.node
        .node_publish_volume(publish_request(
            &vol.id,
            &vol.staging,
            &vol.target,
            vol.cap.clone(),
            &vol.uri(),
            true,
        ))
        .await
        .unwrap();
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
    let mut daemon = NodeDaemon::new("clone", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
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
    let mut daemon = NodeDaemon::new("sched", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_symlinked_kubelet_directory_behaves_like_a_real_one() {
    let mut daemon = NodeDaemon::new("symlink", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
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
async fn a_rebuilt_record_takes_the_staging_path_kubelet_gives() {
    let mut daemon = NodeDaemon::new("rebuilt", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
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
async fn a_link_that_died_while_the_daemon_was_down_is_reported_and_healed() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut daemon = NodeDaemon::new("unheard", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
    let mut vol = Volume::new_on(&daemon, "unheard", 64 * MIB, block(), Listen::Tcp);
    vol.up(&mut c).await;
    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let (target, done) = (vol.target.clone(), Arc::clone(&done));
        std::thread::spawn(move || -> std::io::Result<u64> {
            let f = DirectFile::open(&target, true)?;
            let mut n = 0u64;
            while !done.load(Ordering::SeqCst) {
                f.write_at(&pattern(n, 0, 64 * 1024), (n % 256) * 64 * 1024)?;
                n += 1;
            }
            f.sync()?;
            Ok(n)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The link dies while nobody listens for its LINK_DEAD.
    daemon.kill();
    vol.server.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let mut c = daemon.start(None).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "start-up does not wait for the dead link"
    );
    let condition = |c: &mut NodeClients| {
        let mut node = c.node.clone();
        let req = stats_request(&vol.id, &vol.target);
        async move {
            node.node_get_volume_stats(req)
                .await
                .unwrap()
                .into_inner()
                .volume_condition
                .unwrap()
        }
    };
    let waiting = Instant::now();
    loop {
        let cond = condition(&mut c).await;
        if cond.abnormal {
            assert!(cond.message.contains("lost"), "{}", cond.message);
            break;
        }
        assert!(
            waiting.elapsed() < Duration::from_secs(20),
            "the dead link was never reported"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    vol.server.start().unwrap();
    let healing = Instant::now();
    while condition(&mut c).await.abnormal {
        assert!(healing.elapsed() < Duration::from_secs(30), "never healed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    done.store(true, Ordering::SeqCst);
    let writes = tokio::task::spawn_blocking(move || writer.join().unwrap())
        .await
        .unwrap()
        .expect("no I/O error across the unheard link loss");
    assert!(writes > 0);
    block_round_trip(&vol, 8 * MIB, 21);
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn unknown_volumes_are_not_found_and_block_takes_the_guides_modes() {
    let mut daemon = NodeDaemon::new("codes", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
    // csi-sanity: an unknown volume is NOT_FOUND whatever else is wrong with the request.
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
    let err = c.node.node_expand_volume(expand).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{}", err.message());

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
async fn systemd_hears_ready_status_and_watchdog_keep_alives() {
    use std::os::unix::net::UnixDatagram;
    let mut daemon = NodeDaemon::new("notify", CONFIG).unwrap();
    let socket = daemon.scratch().join("notify.sock");
    let listener = UnixDatagram::bind(&socket).unwrap();
    listener
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // The journal's socket, as systemd-journald binds it (the guest runs no journald).
    std::fs::create_dir_all("/run/systemd/journal").unwrap();
    let _ = std::fs::remove_file("/run/systemd/journal/socket");
    let journal = UnixDatagram::bind("/run/systemd/journal/socket").unwrap();
    journal
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    // Read all along, as journald does: a full queue would block the daemon's logging.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let done = std::sync::Arc::clone(&done);
        std::thread::spawn(move || {
            let mut entries = Vec::new();
            let mut entry = vec![0u8; 65536];
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(n) = journal.recv(&mut entry) {
                    entries.push(journal_fields(&entry[..n]));
                }
            }
            entries
        })
    };
    daemon.env = vec![
        ("NOTIFY_SOCKET".into(), socket.display().to_string()),
        ("WATCHDOG_USEC".into(), "1000000".into()),
        ("JOURNAL_STREAM".into(), "8:1234".into()),
    ];
    let mut c = daemon.start(None).await;
    // READY=1 comes once recovery is done, before any volume of this test is attached.
    let mut buf = [0u8; 4096];
    let n = listener.recv(&mut buf).unwrap();
    let mut messages = vec![String::from_utf8_lossy(&buf[..n]).into_owned()];
    let vol = Volume::new(&daemon, "notified", 16 * MIB, block());
    vol.up(&mut c).await;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        let n = listener.recv(&mut buf).unwrap();
        messages.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    if !(messages[0].contains("READY=1") && messages[0].contains("0 volume(s) attached")) {
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let entries = reader.join().unwrap();
        panic!("{messages:?}; journal: {entries:?}");
    }
    let keep_alives = messages.iter().filter(|m| m.contains("WATCHDOG=1")).count();
    assert!(keep_alives >= 3, "every half second: {messages:?}");
    assert!(
        messages.iter().any(|m| m.contains("1 volume(s) attached")),
        "{messages:?}"
    );
    // A stopped daemon sends nothing: the keep-alive is not a timer of its own.
    let pid = std::process::Command::new("pidof")
        .arg("ustor-csi-node")
        .output()
        .unwrap();
    let pid: i32 = String::from_utf8_lossy(&pid.stdout).trim().parse().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    while listener
        .set_read_timeout(Some(Duration::from_millis(100)))
        .is_ok()
        && listener.recv(&mut buf).is_ok()
    {}
    listener
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    assert!(
        listener.recv(&mut buf).is_err(),
        "no keep-alive while stopped"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    vol.down(&mut c).await;
    // Log entries reached the journal with the volume id as a field of their own.
    daemon.kill();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let entries = reader.join().unwrap();
    std::fs::remove_file("/run/systemd/journal/socket").unwrap();
    let field = |e: &Vec<(String, String)>, name: &str| {
        e.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    };
    assert!(
        entries.iter().any(|e| {
            field(e, "VOLUME_ID").as_deref() == Some("notified")
                && field(e, "SYSLOG_IDENTIFIER").as_deref() == Some("ustor-csi-node")
        }),
        "no journal entry carries VOLUME_ID=notified: {entries:?}"
    );
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_unix_socket_export_grows_through_held_connections_and_never_beyond_them() {
    let mut daemon = NodeDaemon::new("unserved", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
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

/// Probe and NodeGetVolumeStats are answered within a second, for `during`.
async fn keeps_answering(c: &mut testkit::csi::NodeClients, vol: &Volume, during: Duration) {
    let started = Instant::now();
    while started.elapsed() < during {
        promptly("Probe", c.identity.probe(ProbeRequest {}))
            .await
            .unwrap();
        promptly(
            "NodeGetVolumeStats",
            c.node
                .node_get_volume_stats(stats_request(&vol.id, &vol.target)),
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_unix_socket_expansion_whose_server_dies_mid_call_answers_and_leaves_nothing_behind() {
    let mut daemon = NodeDaemon::new("unixdown", CONFIG).unwrap();
    // A window with the filesystem frozen, before the held connections are shut down and new
    // ones offered: the server is killed in it.
    let mut c = daemon.start(Some("expand-while-frozen=pause(3000)")).await;
    let mut vol = Volume::new(&daemon, "unix-down", 64 * MIB, ext4()).with_connections(2);
    vol.up(&mut c).await;
    write_and_check_file(&vol.target, "before", 2 * MIB as usize, 40);
    let index = vol.device(&daemon).unwrap();
    let errors_before = kernel_io_errors();
    let expand_to = {
        let node = c.node.clone();
        let (id, target, staging) = (vol.id.clone(), vol.target.clone(), vol.staging.clone());
        move |bytes: u64| {
            let mut node = node.clone();
            let req = expand_request(&id, &target, &staging, bytes as i64);
            tokio::spawn(async move { node.node_expand_volume(req).await })
        }
    };

    // 1. The server comes back while the call still offers connections: the call completes.
    vol.resize_backing(96 * MIB);
    let expand = expand_to(96 * MIB);
    daemon.wait_paused("expand-while-frozen").await;
    vol.server.kill();
    keeps_answering(&mut c, &vol, Duration::from_secs(5)).await;
    assert!(!expand.is_finished(), "the expansion waits for the export");
    vol.server.start().unwrap();
    let grown = tokio::time::timeout(Duration::from_secs(60), expand)
        .await
        .expect("NodeExpandVolume finishes once the server is back")
        .unwrap()
        .unwrap_or_else(|e| panic!("NodeExpandVolume across the outage: {e:?}"))
        .into_inner();
    assert_eq!(grown.capacity_bytes, (96 * MIB) as i64);
    assert_eq!(Sysfs::default().size_bytes(index).unwrap(), 96 * MIB);
    assert!(fs_bytes(&vol.target) > 80 * MIB, "the filesystem grew");
    write_and_check_file(&vol.target, "grown", 20 * MIB as usize, 41);

    // 2. The server stays away: the call gives up once it has offered connections for
    // REPLACE_WITHIN (30 s), and the daemon answers all along. The thaw that follows writes
    // ext4's superblock, which waits for the export like any write: the server returns after
    // the give-up, and the call then ends UNAVAILABLE with the device at its old size.
    wait_condition(&mut c, &vol, false).await;
    vol.resize_backing(128 * MIB);
    let expand = expand_to(128 * MIB);
    daemon.wait_paused("expand-while-frozen").await;
    vol.server.kill();
    let killed = Instant::now();
    keeps_answering(&mut c, &vol, Duration::from_secs(35)).await;
    vol.server.start().unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(30), expand)
        .await
        .expect("NodeExpandVolume gives up")
        .unwrap()
        .unwrap_err();
    let took = killed.elapsed();
    assert_eq!(refused.code(), Code::Unavailable, "{}", refused.message());
    assert!(
        refused.message().contains("size is unchanged"),
        "{}",
        refused.message()
    );
    assert!(
        took < Duration::from_secs(50),
        "answered {took:?} after the server died"
    );
    assert_eq!(
        Sysfs::default().size_bytes(index).unwrap(),
        96 * MIB,
        "the device never claims space no connection serves"
    );

    // The link heals, the filesystem is thawed and writable, and the next NodeExpand (kubelet
    // retries) finishes the growth.
    wait_condition(&mut c, &vol, false).await;
    write_and_check_file(&vol.target, "healed", 2 * MIB as usize, 42);
    vol.expand(&mut c, 128 * MIB)
        .await
        .unwrap_or_else(|e| panic!("NodeExpandVolume retried after the outage: {e:?}"));
    assert_eq!(Sysfs::default().size_bytes(index).unwrap(), 128 * MIB);
    assert!(fs_bytes(&vol.target) > 110 * MIB, "the filesystem grew");
    assert_eq!(
        kernel_io_errors(),
        errors_before,
        "no I/O error in the kernel log"
    );

    // Everything written is intact, and teardown leaves nothing attached or mounted.
    for (name, seed, len) in [
        ("before", 40, 2 * MIB),
        ("grown", 41, 20 * MIB),
        ("healed", 42, 2 * MIB),
    ] {
        assert!(
            std::fs::read(vol.target.join(name)).unwrap() == pattern(seed, 0, len as usize),
            "{name} is intact"
        );
    }
    vol.down(&mut c).await;
    let (code, status) = status_of(&daemon);
    assert_eq!(code, 0, "status is clean after teardown: {status}");
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn status_names_every_disagreement_and_exits_accordingly() {
    let mut daemon = NodeDaemon::new("status", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
    let fs_vol = Volume::new_on(&daemon, "st-fs", 64 * MIB, ext4(), Listen::Tcp);
    let blk_vol = Volume::new(&daemon, "st-blk", 32 * MIB, block());
    fs_vol.up(&mut c).await;
    blk_vol.up(&mut c).await;
    // Someone else's device beside ours: shown, and not a problem.
    let stranger = testkit::NbdServer::nbdkit(Listen::Unix, &["memory", "8M"]).unwrap();
    let nl = NbdNetlink::open().await.unwrap();
    let sysfs = Sysfs::default();
    let foreign = nbd::attach::attach(
        &nl,
        &sysfs,
        &stranger.uri(),
        &nbd::attach::AttachOptions::new(BackendId::new("someone-else:1").unwrap()),
    )
    .await
    .unwrap();

    let (code, st) = status_of(&daemon);
    assert_eq!(code, 0, "consistent: {st}");
    assert_eq!(st["schema"], 1);
    assert_eq!(st["daemon_running"], true);
    let row = device_row(&st, "st-fs");
    assert_eq!(row["owner"], "ours");
    assert_eq!(row["link"], "up", "{row}");
    assert_eq!(row["access"], "ext4 filesystem");
    let mounted = row["mounted_at"].to_string();
    assert!(
        mounted.contains("globalmount") && mounted.contains("pods/pod-1"),
        "{mounted}"
    );
    let foreign_row = st["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["backend"] == "someone-else:1")
        .unwrap();
    assert_eq!(foreign_row["owner"], "foreign");
    assert!(foreign_row["problems"].as_array().unwrap().is_empty());

    // Stuck states, with the daemon stopped: a lost staging mount, a device detached behind
    // the journal's back, a lost record.
    daemon.kill();
    mounts::ops::unmount(&fs_vol.staging).unwrap();
    let (code, st) = status_of(&daemon);
    assert_eq!(code, 1);
    assert_eq!(st["daemon_running"], false);
    assert!(
        device_row(&st, "st-fs")["problems"]
            .to_string()
            .contains("staging mount missing"),
        "{st}"
    );
    disconnect_behind_the_back(&blk_vol, &daemon).await;
    let (_, st) = status_of(&daemon);
    let orphans = st["records_without_device"].as_array().unwrap();
    assert_eq!(orphans.len(), 1, "{st}");
    assert!(
        orphans[0]["problems"]
            .to_string()
            .contains("the kernel has no device with its identifier"),
        "{st}"
    );
    let fs_record = daemon
        .journal_files()
        .into_iter()
        .find(|p| p.to_string_lossy().contains("st-fs"))
        .unwrap();
    std::fs::remove_file(fs_record).unwrap();
    let (code, st) = status_of(&daemon);
    assert_eq!(code, 1);
    let row = st["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["owner"] == "ours")
        .unwrap();
    assert!(
        row["problems"].to_string().contains("no journal record"),
        "{row}"
    );
    // The daemon rebuilds what it can; the CO's calls clean up the rest.
    let mut c = daemon.start(None).await;
    fs_vol.unpublish(&mut c).await.unwrap();
    fs_vol.unstage(&mut c).await.unwrap();
    blk_vol.unpublish(&mut c).await.unwrap();
    blk_vol.unstage(&mut c).await.unwrap();
    nbd::attach::detach(
        &nl,
        &sysfs,
        foreign.device.index(),
        foreign.device.identifier(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let (code, st) = status_of(&daemon);
    assert_eq!(code, 0, "clean again: {st}");
    assert_clean(&daemon);
}

/// `ustor-csi-node repair [--apply]` of `daemon`'s state: exit code and output.
fn repair_of(daemon: &NodeDaemon, apply: bool) -> (i32, String) {
    let mut cmd = std::process::Command::new(testkit::daemon::binary());
    cmd.args(["repair", "--node-id", &daemon.node_id, "--state-dir"])
        .arg(&daemon.state_dir)
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", daemon.socket.display()));
    if apply {
        cmd.arg("--apply");
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn repair_cleans_what_status_flags_and_nothing_else() {
    let mut daemon = NodeDaemon::new("repair", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
    let unrecorded = Volume::new(&daemon, "rp-unrecorded", 32 * MIB, block());
    let gone = Volume::new(&daemon, "rp-gone", 32 * MIB, block());
    let in_use = Volume::new(&daemon, "rp-in-use", 32 * MIB, block());
    for v in [&unrecorded, &gone, &in_use] {
        v.up(&mut c).await;
    }
    daemon.kill();
    // The seeds' stuck states: a device whose record is lost and that nobody uses any more; a
    // record whose device went away under its pod's bind mount; a device of ours, record
    // lost, still in use by a pod.
    let remove_record = |daemon: &NodeDaemon, id: &str| {
        let f = daemon
            .journal_files()
            .into_iter()
            .find(|p| p.to_string_lossy().contains(id))
            .unwrap();
        std::fs::remove_file(f).unwrap();
    };
    remove_record(&daemon, "rp-unrecorded");
    while mounts::ops::unmount(&unrecorded.target).unwrap() {}
    disconnect_behind_the_back(&gone, &daemon).await;
    remove_record(&daemon, "rp-in-use");
    let (code, before) = status_of(&daemon);
    assert_eq!(code, 1, "{before}");

    // A dry run says what it would do, and does nothing.
    let (code, plan) = repair_of(&daemon, false);
    assert_eq!(code, 0, "{plan}");
    assert!(plan.contains("would disconnect"), "{plan}");
    assert!(plan.contains("would unmount"), "{plan}");
    assert!(
        plan.contains("would forget the journal record of rp-gone"),
        "{plan}"
    );
    assert!(
        plan.contains("would leave"),
        "the device in use is left alone: {plan}"
    );
    assert_eq!(status_of(&daemon).1, before, "a dry run changes nothing");

    // Not while the daemon runs.
    let c2 = daemon.start(None).await;
    let (code, refused) = repair_of(&daemon, true);
    assert_ne!(code, 0, "{refused}");
    assert!(refused.contains("stop it first"), "{refused}");
    drop(c2);
    daemon.kill();
    // The daemon's start rebuilt the records of the devices it found; lose them again.
    remove_record(&daemon, "rp-unrecorded");
    remove_record(&daemon, "rp-in-use");

    let (code, done) = repair_of(&daemon, true);
    assert_eq!(code, 0, "{done}");
    assert!(
        unrecorded.device(&daemon).is_none(),
        "unused device disconnected: {done}"
    );
    assert!(
        in_use.device(&daemon).is_some(),
        "the device in use stays: {done}"
    );
    assert!(!is_mounted(&gone.target), "stale bind mount gone: {done}");
    let (_, after) = status_of(&daemon);
    assert!(
        after["records_without_device"]
            .as_array()
            .unwrap()
            .is_empty(),
        "{after}"
    );
    // What is left is the device in use, which kubelet unstages through the daemon.
    let mut c = daemon.start(None).await;
    in_use.down(&mut c).await;
    let (code, clean) = status_of(&daemon);
    assert_eq!(code, 0, "{clean}");
    assert_clean(&daemon);
}

/// Runs `call`, fails the test when it took a second or more, and returns its result.
async fn promptly<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    let started = Instant::now();
    let out = call.await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "{what} took {took:?} during the outage"
    );
    out
}

/// Waits until NodeGetVolumeStats reports the volume's condition as `abnormal`.
async fn wait_condition(c: &mut testkit::csi::NodeClients, vol: &Volume, abnormal: bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = c
            .node
            .node_get_volume_stats(stats_request(&vol.id, &vol.target))
            .await
            .unwrap()
            .into_inner();
        let condition = stats.volume_condition.unwrap();
        if condition.abnormal == abnormal {
            return condition.message;
        }
        assert!(Instant::now() < deadline, "condition stays {condition:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn calls_made_while_the_export_is_down_answer_and_an_expansion_outlives_it() {
    let mut daemon = NodeDaemon::new("downcalls", CONFIG).unwrap();
    // A window between the resize and the filesystem's growth, to take the export away in.
    let mut c = daemon.start(Some("expand-after-resize=pause(2000)")).await;
    let mut vol = Volume::new_on(&daemon, "downcalls", 64 * MIB, ext4(), Listen::Tcp);
    vol.up(&mut c).await;
    write_and_check_file(&vol.target, "before", 2 * MIB as usize, 5);
    let index = vol.device(&daemon).unwrap();
    let errors_before = kernel_io_errors();

    // The export goes away; the kernel reports the dead link and the daemon says so.
    vol.server.kill();
    let message = wait_condition(&mut c, &vol, true).await;
    assert!(message.contains("reconnecting"), "{message}");

    // Every call is answered within a second, and none needs the export.
    let stats = promptly(
        "NodeGetVolumeStats",
        c.node
            .node_get_volume_stats(stats_request(&vol.id, &vol.target)),
    )
    .await
    .unwrap()
    .into_inner();
    assert!(
        stats.usage[0].total > 0,
        "usage is reported during an outage: {stats:?}"
    );
    let second = daemon
        .scratch()
        .join("pods/pod-2/volumes/kubernetes.io~csi/downcalls/mount");
    std::fs::create_dir_all(second.parent().unwrap()).unwrap();
    let publish = publish_request(
        &vol.id,
        &vol.staging,
        &second,
        vol.cap.clone(),
        &vol.uri(),
        false,
    );
    promptly("NodePublishVolume", c.node.node_publish_volume(publish))
        .await
        .unwrap();
    assert!(is_mounted(&second));
    promptly(
        "NodeUnpublishVolume",
        c.node
            .node_unpublish_volume(unpublish_request(&vol.id, &second)),
    )
    .await
    .unwrap();
    assert!(!is_mounted(&second));
    vol.resize_backing(96 * MIB);
    let refused = promptly(
        "NodeExpandVolume",
        c.node.node_expand_volume(expand_request(
            &vol.id,
            &vol.target,
            &vol.staging,
            (96 * MIB) as i64,
        )),
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{}", refused.message());
    assert_eq!(Sysfs::default().size_bytes(index).unwrap(), 64 * MIB);
    promptly("Probe", c.identity.probe(ProbeRequest {}))
        .await
        .unwrap();

    vol.server.start().unwrap();
    wait_condition(&mut c, &vol, false).await;

    // Now the export dies between the resize and the filesystem's growth: the growth waits
    // for the heal and completes; the daemon answers meanwhile.
    let expand = {
        let mut node = c.node.clone();
        let req = expand_request(&vol.id, &vol.target, &vol.staging, (96 * MIB) as i64);
        tokio::spawn(async move { node.node_expand_volume(req).await })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while Sysfs::default().size_bytes(index).unwrap() != 96 * MIB {
        assert!(Instant::now() < deadline, "the device never grew");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    vol.server.kill();
    keeps_answering(&mut c, &vol, Duration::from_secs(3)).await;
    assert!(!expand.is_finished(), "the growth waits for the export");
    vol.server.start().unwrap();
    let grown = tokio::time::timeout(Duration::from_secs(60), expand)
        .await
        .expect("NodeExpandVolume finishes once the export is back")
        .unwrap()
        .unwrap_or_else(|e| panic!("NodeExpandVolume across an outage: {e:?}"))
        .into_inner();
    assert_eq!(grown.capacity_bytes, (96 * MIB) as i64);
    let usage = mounts::usage::usage(&vol.target).unwrap();
    assert!(
        usage.bytes_total > 80 * MIB,
        "the filesystem grew: {usage:?}"
    );
    assert_eq!(
        kernel_io_errors(),
        errors_before,
        "no I/O error in the kernel log"
    );

    // What was written before either outage is intact, and the volume works.
    vol.unpublish(&mut c).await.unwrap();
    vol.unstage(&mut c).await.unwrap();
    vol.up(&mut c).await;
    let before = std::fs::read(vol.target.join("before")).unwrap();
    assert!(
        before == pattern(5, 0, 2 * MIB as usize),
        "data from before the outages"
    );
    write_and_check_file(&vol.target, "after", 2 * MIB as usize, 6);
    vol.down(&mut c).await;
    assert_clean(&daemon);
}
