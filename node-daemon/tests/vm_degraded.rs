//! The node daemon against a storage server's bad days, on the real kernel: reads that fail
//! while writes succeed, an export that comes back smaller or read-only, an expansion to a
//! size the kernel cannot take, a repeated NodeStage of a volume in use, and devices that
//! other tools attached. Each is a way today's servers lose data or strand a volume; each
//! test fails without the fix it guards. Ignored on the host; run in the VM on every kernel
//! line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;
use common::prelude::*;

/// The volume condition NodeGetVolumeStats reports: (abnormal, message).
async fn condition(c: &mut NodeClients, vol: &Volume) -> (bool, String) {
    let r = c
        .node
        .node_get_volume_stats(stats_request(&vol.id, &vol.target))
        .await
        .unwrap()
        .into_inner();
    let cond = r.volume_condition.unwrap();
    (cond.abnormal, cond.message)
}

/// Waits up to `within` for the volume condition to satisfy `want`; the last one seen.
async fn condition_until(
    c: &mut NodeClients,
    vol: &Volume,
    within: Duration,
    want: impl Fn(bool, &str) -> bool,
) -> (bool, String) {
    let started = Instant::now();
    loop {
        let (abnormal, message) = condition(c, vol).await;
        if want(abnormal, &message) || started.elapsed() > within {
            return (abnormal, message);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A volume holding a filesystem whose server cannot read (a degraded backend) is never
/// taken for blank: NodeStage answers UNAVAILABLE and keeps its state, nothing is formatted,
/// and once reads work the same filesystem is staged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_read_error_is_not_a_blank_device() {
    let (daemon, mut c) = start_node("read-errors").await;
    let failing = daemon.scratch().join("reads-fail");
    std::fs::write(&failing, b"").unwrap();
    let vol = Volume::with_failing_reads(&daemon, "degraded", 64 * MIB, ext4(), &failing);
    mkfs_ext4(&vol.backing);
    let uuid = image_uuid(&vol.backing);
    assert!(!uuid.is_empty());

    for _ in 0..2 {
        let e = vol.stage(&mut c).await.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        assert!(e.message().contains("could not be read"), "{e:?}");
        assert_eq!(
            image_uuid(&vol.backing),
            uuid,
            "the filesystem was overwritten"
        );
        let record = journal_record(&daemon, &vol.id);
        assert_eq!(
            record["phase"]["step"], "attached",
            "kept for the retry: {record}"
        );
    }

    // The server reads again: the retry stages the filesystem that was there.
    std::fs::remove_file(&failing).unwrap();
    vol.up(&mut c).await;
    assert_eq!(image_uuid(&vol.backing), uuid);
    write_and_check_file(&vol.target, "after", 64 * 1024, 5);
    vol.down(&mut c).await;
    assert_eq!(image_uuid(&vol.backing), uuid);
    assert_clean(&daemon);
}

/// After a failover or a restore, the healer splices in only an export that can stand in
/// for the one under the device: a smaller or a read-only one is refused (no RECONFIGURE,
/// condition abnormal naming why, a metric), and retried until the right one is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn the_healer_splices_in_only_an_export_like_the_one_it_lost() {
    // Long enough a dead-connection timeout that I/O waits through every refusal below.
    let mut daemon = NodeDaemon::new(
        "splice",
        &CONFIG.replace(
            "dead-conn-timeout-secs = 30",
            "dead-conn-timeout-secs = 120",
        ),
    )
    .unwrap();
    let mut c = daemon.start(None).await;
    let mut vol = Volume::new_on(&daemon, "spliced", 64 * MIB, ext4(), Listen::Tcp);
    vol.up(&mut c).await;
    write_and_check_file(&vol.target, "before", 256 * 1024, 11);
    nix::unistd::sync();
    let right: Vec<String> = Volume::file_args(&vol.backing);
    let smaller = daemon.scratch().join("restored-smaller.img");
    std::fs::File::create(&smaller)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    let smaller_args = Volume::file_args(&smaller);
    let read_only: Vec<String> = ["-r".to_owned()].into_iter().chain(right.clone()).collect();

    for (args, why, kind) in [
        (&smaller_args, "smaller than the device's", "smaller"),
        (&read_only, "is read-only", "read_only"),
    ] {
        vol.server.kill();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        vol.server.restart_with(&args).unwrap();
        let (abnormal, message) = condition_until(&mut c, &vol, Duration::from_secs(10), |a, m| {
            a && m.contains(why)
        })
        .await;
        assert!(abnormal && message.contains(why), "{why}: {message}");
        let metrics = daemon.scrape().await;
        assert!(
            metrics.contains(&format!(
                "ustor_csi_node_splice_refusals_total{{difference=\"{kind}\"}}"
            )),
            "{metrics}"
        );
        // Still refused a little later: retried, never spliced.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (abnormal, message) = condition(&mut c, &vol).await;
        assert!(abnormal && message.contains(why), "{why}, later: {message}");
    }
    assert_eq!(
        std::fs::metadata(&smaller).unwrap().len(),
        32 * MIB,
        "nothing was written to the wrong image"
    );
    assert_eq!(
        testkit::read_at(&smaller, 0, 1 << 20),
        vec![0; 1 << 20],
        "nothing was written to the wrong image"
    );

    // The right export is back: healed, and the data is all there.
    vol.server.kill();
    let args: Vec<&str> = right.iter().map(String::as_str).collect();
    vol.server.restart_with(&args).unwrap();
    let (abnormal, message) =
        condition_until(&mut c, &vol, Duration::from_secs(15), |a, _| !a).await;
    assert!(!abnormal, "healed once the right export is back: {message}");
    let errors_before = kernel_io_errors();
    write_and_check_file(&vol.target, "after", 256 * 1024, 12);
    assert_eq!(
        std::fs::read(vol.target.join("before")).unwrap(),
        pattern(11, 0, 256 * 1024)
    );
    assert_eq!(kernel_io_errors(), errors_before, "no I/O failed");
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

/// An expansion that fails leaves the volume usable: an export grown to a size the kernel
/// cannot take (not a multiple of 512) is refused before any resize, the record is `Staged`
/// at its old size, and a new pod can publish it; the next expansion works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_failed_expansion_leaves_the_volume_usable() {
    let (daemon, mut c) = start_node("failed-expand").await;
    let vol = Volume::new_on(&daemon, "grow-bad", 64 * MIB, ext4(), Listen::Tcp);
    vol.up(&mut c).await;
    let before = fs_bytes(&vol.target);
    vol.resize_backing(96 * MIB + 1000);
    let e = vol.expand(&mut c, 96 * MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("not a positive multiple of 512"),
        "{e:?}"
    );
    let record = journal_record(&daemon, &vol.id);
    assert_eq!(record["phase"]["step"], "staged", "{record}");
    assert_eq!(record["size_bytes"], 64 * MIB, "{record}");
    let index = vol.device(&daemon).unwrap();
    assert_eq!(Sysfs::default().size_bytes(index).unwrap(), 64 * MIB);

    // A second pod gets the volume.
    let second = daemon.scratch().join("pods/pod-2/volumes/grow-bad/mount");
    std::fs::create_dir_all(second.parent().unwrap()).unwrap();
    vol.publish_at(&mut c, &second, false).await.unwrap();
    write_and_check_file(&second, "from-pod-2", 64 * 1024, 3);

    // The storage gets it right: the next expansion works.
    vol.resize_backing(96 * MIB);
    vol.expand(&mut c, 96 * MIB).await.unwrap();
    assert!(fs_bytes(&vol.target) > before);
    c.node
        .node_unpublish_volume(unpublish_request(&vol.id, &second))
        .await
        .unwrap();
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

/// kubelet repeats NodeStage for a volume its pods use (after a restart). When the staging
/// path cannot be mounted again (something else sits on it) the call fails, but however
/// often it is repeated it never unmounts or detaches the volume under its pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_repeated_stage_never_tears_down_a_volume_in_use() {
    let (daemon, mut c) = start_node("in-use").await;
    let vol = Volume::new(&daemon, "in-use", 64 * MIB, ext4());
    vol.up(&mut c).await;
    let device = vol.device(&daemon).unwrap();
    // The staging mount is lost (the pod's bind mount keeps the filesystem) and something
    // else is mounted there.
    while mounts::ops::unmount(&vol.staging).unwrap() {}
    nix::mount::mount(
        Some("tmpfs"),
        &vol.staging,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .unwrap();
    for attempt in 0..3 {
        let e = vol.stage(&mut c).await.unwrap_err();
        assert_eq!(
            e.code(),
            Code::FailedPrecondition,
            "attempt {attempt}: {e:?}"
        );
        assert!(
            e.message().contains("already has something else mounted"),
            "{e:?}"
        );
        assert_eq!(
            vol.device(&daemon),
            Some(device),
            "attempt {attempt}: detached under the pod"
        );
        write_and_check_file(&vol.target, &format!("still-{attempt}"), 64 * 1024, attempt);
        let record = journal_record(&daemon, &vol.id);
        assert!(
            record["targets"].as_object().is_some_and(|t| !t.is_empty()),
            "{record}"
        );
    }
    // Once the path is free, NodeStage mounts it again.
    while mounts::ops::unmount(&vol.staging).unwrap() {}
    vol.stage(&mut c).await.unwrap();
    assert!(is_mounted(&vol.staging));
    assert!(vol.staging.join("still-2").exists());
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

/// A device another tool attached (`nbd-client`, by ioctl) carries no identifier but is in
/// use: the daemon never writes to it (its I/O scheduler stays as its owner set it), and
/// never counts it free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn devices_other_tools_attached_are_left_alone() {
    let sysfs = Sysfs::default();
    let backing = tempfile::NamedTempFile::new().unwrap();
    backing.as_file().set_len(32 * MIB).unwrap();
    let path = format!("file={}", backing.path().display());
    let server = NbdServer::nbdkit(Listen::Tcp, &["file", &path]).unwrap();
    let port = server.tcp_port().unwrap();
    let foreign = testkit::nbd_client::free_device(&sysfs);
    testkit::nbd_client::attach(&sysfs, foreign, "", port, &["-L"], 32 * MIB).await;
    assert_eq!(
        sysfs.backend(foreign).unwrap(),
        None,
        "nbd-client sets no identifier"
    );
    sysfs.set_scheduler(foreign, "kyber").unwrap();

    let (daemon, mut c) = start_node("foreign").await;
    // The scheduler is told the devices left to this driver: nbds_max less the one taken.
    let nbds_max: i64 = std::fs::read_to_string("/sys/module/nbd/parameters/nbds_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let info = c
        .node
        .node_get_info(csi_proto::csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.max_volumes_per_node, nbds_max - 1);
    // Start-up presets idle devices; the sweep repeats it every 10 s.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(
        sysfs.scheduler(foreign).unwrap(),
        "kyber",
        "a foreign device was written to"
    );
    // And a stage takes another device.
    let vol = Volume::new(&daemon, "beside-foreign", 32 * MIB, block());
    vol.up(&mut c).await;
    assert_ne!(vol.device(&daemon), Some(foreign));
    vol.down(&mut c).await;
    assert_eq!(sysfs.scheduler(foreign).unwrap(), "kyber");
    testkit::nbd_client::detach(&sysfs, foreign).await;
    assert_clean(&daemon);
}
