//! The node daemon while an export is down, against the real kernel: calls made during the
//! outage are answered, an unstage waits for the heal and loses nothing, a link that died while
//! the daemon was down is healed, an expansion whose server dies mid-call leaves nothing behind.
//! Ignored on the host; run in the VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking
#![allow(clippy::cast_possible_truncation)] // buffer sizes of a few MiB, on 64-bit guests

use csi_proto::csi::ProbeRequest;

mod common;
use common::prelude::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn unstage_during_an_outage_waits_for_the_heal_and_loses_nothing() {
    let (daemon, mut c) = start_node("outage").await;
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

/// A slow root disk holds up only the journal writes of the volume being written: while
/// each of one volume's writes takes 1.5 s, calls for another volume, and Probe, answer at
/// once (journal writes no longer hold the lock every call and the healer read records under).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_slow_journal_disk_holds_up_only_its_own_volume() {
    let mut daemon = NodeDaemon::new("slow-disk", CONFIG).unwrap();
    let mut c = daemon.start(Some("journal-slow-disk=pause(1500)")).await;
    let steady = Volume::new(&daemon, "steady", 32 * MIB, block());
    steady.up(&mut c).await;
    daemon.wait_paused("journal-slow-disk").await; // the mark of steady's own writes
    let slow = Volume::new(&daemon, "slow", 32 * MIB, block());
    let staging = {
        let mut c = c.clone();
        let req = slow.stage_req();
        tokio::spawn(async move { c.node.node_stage_volume(req).await })
    };
    daemon.wait_paused("journal-slow-disk").await;
    let mut slowest = Duration::ZERO;
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(3) {
        let started = Instant::now();
        c.node
            .node_get_volume_stats(stats_request(&steady.id, &steady.target))
            .await
            .unwrap();
        let ready = c
            .identity
            .probe(ProbeRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ready.ready, Some(true));
        slowest = slowest.max(started.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        slowest < Duration::from_millis(700),
        "calls for another volume waited {slowest:?} for the slow journal write"
    );
    staging.await.unwrap().unwrap();
    slow.publish(&mut c).await.unwrap();
    slow.down(&mut c).await;
    steady.down(&mut c).await;
    assert_clean(&daemon);
}

/// kubelet abandons a NodeUnstage at its deadline and calls again. The first call's unmount
/// still writes back to a dead server; the retries must neither find the mount gone and
/// DISCONNECT (losing the last writes) nor start a second teardown beside it: they wait for
/// the first. Once the server is back, everything written is on the export.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn an_abandoned_unstage_lets_go_of_nothing() {
    let (daemon, mut c) = start_node("abandoned").await;
    let mut vol = Volume::new(&daemon, "abandoned", 64 * MIB, ext4());
    vol.up(&mut c).await;
    let errors_before = kernel_io_errors();
    // Dirty pages only: nothing reaches the export before the unmount writes them back.
    let data = pattern(23, 0, 4 * MIB as usize);
    std::fs::write(vol.target.join("unsynced"), &data).unwrap();
    vol.unpublish(&mut c).await.unwrap();
    vol.server.kill();
    let device = vol.device(&daemon).unwrap();

    for attempt in 0..3 {
        let mut req = tonic::Request::new(unstage_request(&vol.id, &vol.staging));
        req.set_timeout(Duration::from_secs(3));
        let started = Instant::now();
        let e = c.node.node_unstage_volume(req).await.unwrap_err();
        assert!(
            matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
            "attempt {attempt}: {e:?}"
        );
        assert!(
            started.elapsed() >= Duration::from_secs(2),
            "attempt {attempt} answered early"
        );
        assert_eq!(
            vol.device(&daemon),
            Some(device),
            "attempt {attempt}: disconnected while the unmount was still writing back"
        );
    }
    vol.server.start().unwrap();
    let started = Instant::now();
    loop {
        let mut req = tonic::Request::new(unstage_request(&vol.id, &vol.staging));
        req.set_timeout(Duration::from_secs(10));
        match c.node.node_unstage_volume(req).await {
            Ok(_) => break,
            Err(_) if started.elapsed() < Duration::from_secs(60) => {
                tokio::time::sleep(Duration::from_millis(500)).await
            }
            Err(e) => panic!("NodeUnstage after the server came back: {e:?}"),
        }
    }
    assert_eq!(vol.device(&daemon), None);
    assert_eq!(
        kernel_io_errors(),
        errors_before,
        "no I/O error reached the kernel log"
    );

    // Every byte written before the outage is on the export.
    vol.up(&mut c).await;
    assert!(std::fs::read(vol.target.join("unsynced")).unwrap() == data);
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_link_that_died_while_the_daemon_was_down_is_reported_and_healed() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let (mut daemon, mut c) = start_node("unheard").await;
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

/// A pod that writes to a raw volume without pause: every write and its flush, from a thread
/// of its own, until `stop`. Returns the acknowledged writes (offset → seed), or the first
/// error.
fn raw_writer(
    target: std::path::PathBuf,
    span: u64,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Result<Vec<(u64, u64)>, String>> {
    const SLOT: u64 = 64 * 1024;
    std::thread::spawn(move || {
        let f = DirectFile::open(&target, true).map_err(|e| e.to_string())?;
        let mut acked = std::collections::BTreeMap::new();
        let mut seed = 1u64;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let offset = (seed >> 33) % (span / SLOT) * SLOT;
            f.write_at(&pattern(seed, offset, SLOT as usize), offset)
                .and_then(|()| f.sync())
                .map_err(|e| {
                    format!("write at {offset} after {} acknowledged: {e}", acked.len())
                })?;
            acked.insert(offset, seed);
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(acked.into_iter().collect())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn an_expansion_that_meets_a_dead_link_waits_for_the_heal_and_holds_up_nothing() {
    let mut daemon = NodeDaemon::new("expanddead", CONFIG).unwrap();
    // A window after the connections are replaced and before the size changes: the server
    // dies in it, with a pod's writes waiting for the link.
    let mut c = daemon.start(Some("expand-before-resize=pause(3000)")).await;
    let mut vol = Volume::new_on(&daemon, "expand-dead", 64 * MIB, block(), Listen::Tcp);
    vol.up(&mut c).await;
    let index = vol.device(&daemon).unwrap();
    let errors_before = kernel_io_errors();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = raw_writer(vol.target.clone(), 64 * MIB, std::sync::Arc::clone(&stop));

    vol.resize_backing(96 * MIB);
    let expand = {
        let mut node = c.node.clone();
        let req = expand_request(&vol.id, &vol.target, &vol.staging, (96 * MIB) as i64);
        tokio::spawn(async move { node.node_expand_volume(req).await })
    };
    daemon.wait_paused("expand-before-resize").await;
    vol.server.kill();
    // The window ends while the server is away. Since 6.9 a resize sent now would freeze
    // the queue behind the waiting writes, under the mutex the heal needs too, until the
    // dead-connection timeout (30 s) failed them.
    keeps_answering(&mut c, &vol, Duration::from_secs(5)).await;
    assert_eq!(
        Sysfs::default().size_bytes(index).unwrap(),
        64 * MIB,
        "no resize while the link is down"
    );
    vol.server.start().unwrap();
    let back = Instant::now();
    wait_condition(&mut c, &vol, false).await;
    let healed_in = back.elapsed();
    assert!(
        healed_in < Duration::from_secs(15),
        "healed {healed_in:?} after the server returned: something held the heal up"
    );
    let grown = tokio::time::timeout(Duration::from_secs(30), expand)
        .await
        .expect("NodeExpandVolume finishes once the link is back")
        .unwrap()
        .unwrap_or_else(|e| panic!("NodeExpandVolume across the outage: {e:?}"))
        .into_inner();
    assert_eq!(grown.capacity_bytes, (96 * MIB) as i64);
    assert_eq!(Sysfs::default().size_bytes(index).unwrap(), 96 * MIB);

    // The pod's writes went on through the outage: none failed, each is on the server.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let acked = writer
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("the pod's write failed: {e}"));
    assert!(
        acked.len() > 10,
        "the writer made progress: {}",
        acked.len()
    );
    for (offset, seed) in &acked {
        assert!(
            vol.read_backing(*offset, 64 * 1024) == pattern(*seed, *offset, 64 * 1024),
            "the write at {offset} is not on the server"
        );
    }
    assert_eq!(
        kernel_io_errors(),
        errors_before,
        "no I/O error in the kernel log"
    );
    block_round_trip(&vol, 90 * MIB, 7);
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

/// A server that stops reading while writes are in flight (a hung process: its kernel keeps
/// the connection and acknowledges, with the window shut) leaves the device's nbd sender
/// blocked on a full socket, holding the connection's send lock, and the unstage's DISCONNECT
/// is sent into it: it waits inside the kernel, under the mutex every nbd netlink request of
/// the machine takes. The daemon sends it from a thread and a netlink socket of its own, so
/// only the kernel holds anyone up, and only until the kernel gives up the stalled send
/// (EAGAIN, about 13 s after the stop with a 4 s request timeout). While the server is still
/// stopped the unstage answers, and a bystander whose connection was cut meanwhile is healed
/// (its RECONFIGURE waited for that mutex) with its write on its export.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_disconnect_on_a_stalled_socket_holds_up_no_other_volume() {
    const WRITERS: u64 = 8;
    const CHUNK: u64 = 4 * MIB;
    let mut daemon = NodeDaemon::new("stalled", CONFIG).unwrap();
    // The window between the unstage's flush and its DISCONNECT, where the server stalls.
    let mut c = daemon
        .start(Some("unstage-before-disconnect=pause(4000)"))
        .await;
    let vol = Volume::new_on(&daemon, "stalled", WRITERS * CHUNK, block(), Listen::Tcp);
    let other = Volume::new_on(&daemon, "bystander", 32 * MIB, block(), Listen::Tcp);
    vol.stage(&mut c).await.unwrap();
    other.up(&mut c).await;
    let device = format!("/dev/{}", vol.device(&daemon).unwrap().name());

    let unstage = {
        let (mut node, req) = (c.node.clone(), unstage_request(&vol.id, &vol.staging));
        tokio::spawn(async move {
            let started = Instant::now();
            (node.node_unstage_volume(req).await, started.elapsed())
        })
    };
    daemon.wait_paused("unstage-before-disconnect").await;
    let window = Instant::now();
    // Writers that are not the daemon's keep more in flight than both socket buffers hold,
    // until the device fails them.
    let writers: Vec<_> = (0..WRITERS)
        .map(|i| {
            let device = std::path::PathBuf::from(&device);
            std::thread::spawn(move || {
                let Ok(f) = DirectFile::open(&device, true) else {
                    return;
                };
                let data = pattern(40 + i, i * CHUNK, CHUNK as usize);
                while f.write_at(&data, i * CHUNK).is_ok() {}
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    vol.server.freeze(true);
    // The DISCONNECT is sent once the window ends, into a full socket.
    tokio::time::sleep(Duration::from_secs(5).saturating_sub(window.elapsed())).await;

    // The bystander loses its connection and must be healed meanwhile: a RECONFIGURE.
    for c in journal_record(&daemon, &other.id)["tcp"]
        .as_array()
        .unwrap()
    {
        let local: std::net::SocketAddr = c["local"].as_str().unwrap().parse().unwrap();
        let peer: std::net::SocketAddr = c["peer"].as_str().unwrap().parse().unwrap();
        assert!(nbd::sockdiag::destroy_tcp(peer, local).unwrap());
    }
    let healed = {
        let started = Instant::now();
        let io = tokio::task::spawn_blocking({
            let target = other.target.clone();
            move || {
                let f = DirectFile::open(&target, true)?;
                f.write_at(&pattern(41, 0, 256 * 1024), 0)?;
                f.sync()
            }
        });
        tokio::time::timeout(Duration::from_secs(45), io)
            .await
            .expect("the bystander's I/O waited on the stalled volume's DISCONNECT")
            .unwrap()
            .unwrap();
        started.elapsed()
    };
    let (answer, took) = tokio::time::timeout(Duration::from_secs(60), unstage)
        .await
        .expect("NodeUnstage of the stalled volume answers while its server is stopped")
        .unwrap();
    answer.unwrap_or_else(|e| panic!("NodeUnstage of the stalled volume: {e:?}"));
    eprintln!(
        "stalled DISCONNECT: unstage answered in {took:?}, the bystander healed in {healed:?}"
    );
    assert!(
        other.read_backing(0, 256 * 1024) == pattern(41, 0, 256 * 1024),
        "the bystander's write is not on its export"
    );

    vol.server.freeze(false);
    for w in writers {
        w.join().unwrap();
    }
    other.down(&mut c).await;
    assert_clean(&daemon);
}
