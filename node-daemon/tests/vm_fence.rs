//! Fencing, with two node daemons as two nodes and the controller's local backend, whose
//! export gate lets a node in only with a live grant: a node that lost its attachment while
//! cut off must not write a single block once the volume is published elsewhere. Ignored on
//! the host; run in the VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::prelude::*;
use csi_proto::csi::controller_client::ControllerClient;
use testkit::controller::ControllerProcess;
use testkit::wait::eventually;
use tonic::transport::Channel;

const SIZE: u64 = 64 * MIB;
/// How much each writer writes at a time.
const CHUNK: usize = 1 << 20;
/// Where the cut-off node leaves dirty pages, and where a direct write of it waits.
const DIRTY_AT: u64 = 8 * MIB;
const LATE_AT: u64 = 16 * MIB;
/// Where the second node writes once the gate has cut it off while connected.
const CUT_AT: u64 = 32 * MIB;

/// One node's view of the volume: its daemon, clients and kubelet-shaped paths.
struct NodeSide {
    daemon: NodeDaemon,
    clients: NodeClients,
    staging: PathBuf,
    target: PathBuf,
}

impl NodeSide {
    async fn start(name: &str) -> Self {
        Self::start_armed(name, None).await
    }

    /// A node whose daemon runs with `failpoints` armed.
    async fn start_armed(name: &str, failpoints: Option<&str>) -> Self {
        let mut daemon = NodeDaemon::new(name, CONFIG).unwrap();
        let clients = daemon.start(failpoints).await;
        let staging = daemon.scratch().join("staging/fenced");
        let target = daemon.scratch().join("pods/p/volumeDevices/fenced");
        // kubelet makes the staging directory and the target's parent.
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        Self {
            daemon,
            clients,
            staging,
            target,
        }
    }

    /// ControllerPublish to this node, then NodeStage and NodePublish with its context.
    async fn attach(&mut self, ctrl: &mut ControllerClient<Channel>, volume: &str) {
        let context = published_to(ctrl, volume, &self.daemon.node_id, block()).await;
        let mut stage = stage_request(volume, &self.staging, block(), "");
        stage.volume_context.clear();
        stage.publish_context = context.clone();
        self.clients.node.node_stage_volume(stage).await.unwrap();
        let mut publish = publish_request(volume, &self.staging, &self.target, block(), "", false);
        publish.volume_context.clear();
        publish.publish_context = context;
        self.clients
            .node
            .node_publish_volume(publish)
            .await
            .unwrap();
    }

    /// Waits until the volume condition says fenced.
    async fn wait_fenced(&mut self, volume: &str) -> String {
        let node = self.clients.node.clone();
        let target = self.target.clone();
        eventually(
            "the volume condition says fenced",
            Duration::from_secs(60),
            || {
                let mut node = node.clone();
                let target = target.clone();
                async move {
                    let stats = node
                        .node_get_volume_stats(stats_request(volume, &target))
                        .await
                        .ok()?
                        .into_inner();
                    let c = stats.volume_condition?;
                    (c.abnormal && c.message.contains("fenced")).then_some(c.message)
                }
            },
        )
        .await
    }

    async fn detach(&mut self, volume: &str) {
        self.clients
            .node
            .node_unpublish_volume(unpublish_request(volume, &self.target))
            .await
            .unwrap();
        self.clients
            .node
            .node_unstage_volume(unstage_request(volume, &self.staging))
            .await
            .unwrap();
        assert_clean(&self.daemon);
    }

    /// The TCP connections of the volume's device, as the daemon journaled them.
    fn connections(&self, volume: &str) -> Vec<(std::net::SocketAddr, std::net::SocketAddr)> {
        journal_record(&self.daemon, volume)["tcp"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["local"].as_str().unwrap().parse().unwrap(),
                    c["peer"].as_str().unwrap().parse().unwrap(),
                )
            })
            .collect()
    }
}

/// ControllerPublishVolume of `volume` to `node`: the publish context, with its grant.
async fn published_to(
    ctrl: &mut ControllerClient<Channel>,
    volume: &str,
    node: &str,
    cap: csi_proto::csi::VolumeCapability,
) -> std::collections::HashMap<String, String> {
    let context = ctrl
        .controller_publish_volume(controller_publish_request(volume, node, cap))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert!(
        context.contains_key("nbdGrant"),
        "no grant in the publish context: {:?}",
        context.keys()
    );
    context
}

fn read_image(image: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    std::fs::File::open(image)
        .unwrap()
        .read_exact_at(&mut buf, offset)
        .unwrap();
    buf
}

/// Runs blocking I/O that must fail (on a fenced device) on its own thread, so a hang would
/// fail the test instead of stopping it.
async fn fails_soon(what: &str, io: impl FnOnce() -> std::io::Result<()> + Send + 'static) {
    let outcome = tokio::time::timeout(Duration::from_secs(30), tokio::task::spawn_blocking(io))
        .await
        .unwrap_or_else(|_| panic!("{what} hung on a fenced device"))
        .unwrap();
    assert!(outcome.is_err(), "{what} succeeded on a fenced device");
}

/// The "most dangerous day": A is cut off with dirty pages, the volume is detached
/// from it by force and attached to B, then A's network comes back. A is refused, fenced
/// and cleaned up; not one byte A wrote after the revocation is on the export; B's data is
/// intact. Then B is unpublished while connected: the gate cuts its open connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_node_that_lost_its_attachment_writes_nothing_more() {
    let (controller, mut ctrl) = ControllerProcess::start("fence").await.unwrap();
    let volume = created_volume(
        &mut ctrl,
        create_volume_request("pvc-fence", SIZE as i64, block()),
    )
    .await
    .volume_id;
    let image_name = volume.rsplit(':').next().unwrap().to_owned();
    let image = controller.store.join("images").join(&image_name);
    let mut a = NodeSide::start("node-a").await;
    let mut b = NodeSide::start("node-b").await;

    // A writes durably.
    a.attach(&mut ctrl, &volume).await;
    let durable = pattern(1, 0, CHUNK);
    let direct = DirectFile::open(&a.target, true).unwrap();
    direct.write_at(&durable, 0).unwrap();
    direct.sync().unwrap();
    assert!(read_image(&image, 0, durable.len()) == durable);

    // A is cut off: its daemon hears nothing, and the server side resets its connections.
    a.daemon.freeze(true);
    let cut = a.connections(&volume);
    assert!(!cut.is_empty(), "A's device journaled no connections");
    for (local, peer) in &cut {
        assert!(
            nbd::sockdiag::destroy_tcp(*peer, *local).unwrap(),
            "no server-side socket for {local} → {peer}"
        );
    }
    // Its pod goes on writing: dirty pages (held open, as the last close of a block device
    // writes them back), and a direct write that waits in the kernel for the link.
    let buffered = std::fs::OpenOptions::new()
        .write(true)
        .open(&a.target)
        .unwrap();
    buffered
        .write_all_at(&pattern(2, DIRTY_AT, CHUNK), DIRTY_AT)
        .unwrap();
    let waiting = DirectFile::open(&a.target, true).unwrap();
    let in_flight = tokio::task::spawn_blocking(move || {
        waiting.write_at(&pattern(4, LATE_AT, CHUNK), LATE_AT)?;
        waiting.sync()
    });

    // The volume is detached from A by force and attached to B, which writes over A's data.
    ctrl.controller_unpublish_volume(controller_unpublish_request(&volume, "node-a"))
        .await
        .unwrap();
    b.attach(&mut ctrl, &volume).await;
    let from_b = pattern(3, 0, CHUNK);
    let b_direct = DirectFile::open(&b.target, true).unwrap();
    b_direct.write_at(&from_b, 0).unwrap();
    b_direct.sync().unwrap();

    // A's network comes back: it is refused, and says so.
    a.daemon.freeze(false);
    let condition = a.wait_fenced(&volume).await;
    assert!(condition.contains("grant"), "{condition}");
    // What waited fails, and whatever A still tries fails too.
    let waited = tokio::time::timeout(Duration::from_secs(30), in_flight)
        .await
        .expect("A's waiting write hung after the fence")
        .unwrap();
    assert!(
        waited.is_err(),
        "A's waiting write succeeded after the fence"
    );
    let over_b = pattern(5, 0, CHUNK);
    fails_soon("A's write after the fence", move || {
        direct.write_at(&over_b, 0)?;
        direct.sync()
    })
    .await;
    fails_soon("writing back A's dirty pages", move || buffered.sync_all()).await;

    // On the export: B's data, and nothing of what A wrote after the revocation.
    assert!(
        read_image(&image, 0, from_b.len()) == from_b,
        "B's data on the export was overwritten"
    );
    assert!(
        b_direct.read_at(from_b.len(), 0).unwrap() == from_b,
        "B reads back other data than it wrote"
    );
    for (what, at) in [
        ("A's dirty pages", DIRTY_AT),
        ("A's waiting write", LATE_AT),
    ] {
        assert!(
            read_image(&image, at, CHUNK).iter().all(|&b| b == 0),
            "{what} reached the export after the revocation"
        );
    }

    // A reports it: metric and status, and the CO can clean it up.
    let metrics = a.daemon.scrape().await;
    assert!(
        metrics.contains("ustor_csi_node_fenced_volumes_total 1"),
        "{metrics}"
    );
    let (code, status) = status_of(&a.daemon);
    assert_ne!(code, 0, "status exits 0 with a fenced volume: {status}");
    assert!(status.to_string().contains("fenced"), "{status}");
    a.detach(&volume).await;

    // B is unpublished while its connections are up: the gate cuts them, and B is fenced too.
    ctrl.controller_unpublish_volume(controller_unpublish_request(&volume, "node-b"))
        .await
        .unwrap();
    b.wait_fenced(&volume).await;
    let after_cut = pattern(6, CUT_AT, CHUNK);
    fails_soon("B's write after its grant was revoked", move || {
        b_direct.write_at(&after_cut, CUT_AT)?;
        b_direct.sync()
    })
    .await;
    assert!(
        read_image(&image, CUT_AT, CHUNK).iter().all(|&b| b == 0),
        "B's write reached the export after its grant was revoked"
    );
    b.detach(&volume).await;
    ctrl.delete_volume(delete_volume_request(&volume))
        .await
        .unwrap();
}

/// A NodeStage cut short by the storage: A has dialed the export (and was let in), but the
/// kernel does not have the sockets yet, when the volume is detached from A by force (the
/// gate revokes the grant and cuts A's connections, as a server that dies mid-call would) and
/// attached to B, which writes. A's stage goes on with dead sockets: its heal is refused, and
/// A must fence the volume instead of taking a device it cannot read for blank and formatting
/// it. The call fails naming the fence, its retry (kubelet's) fails the same way, not one
/// byte of the export changes, and NodeUnstage leaves A clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_stage_whose_grant_is_revoked_mid_call_formats_nothing() {
    let (controller, mut ctrl) = ControllerProcess::start("fence-stage").await.unwrap();
    let volume = created_volume(
        &mut ctrl,
        create_volume_request("pvc-fence-stage", SIZE as i64, ext4()),
    )
    .await
    .volume_id;
    let image_name = volume.rsplit(':').next().unwrap().to_owned();
    let image = controller.store.join("images").join(&image_name);
    let mut a = NodeSide::start_armed("node-a", Some("stage-before-connect=pause(6000)")).await;
    let mut b = NodeSide::start("node-b").await;

    // A's NodeStage (a filesystem volume, so a format decision follows the attach) stops in
    // the window between its dial and CONNECT.
    let context = published_to(&mut ctrl, &volume, &a.daemon.node_id, ext4()).await;
    let mut stage = stage_request(&volume, &a.staging, ext4(), "");
    stage.volume_context.clear();
    stage.publish_context = context;
    let staging = {
        let (mut node, stage) = (a.clients.node.clone(), stage.clone());
        tokio::spawn(async move { node.node_stage_volume(stage).await })
    };
    a.daemon.wait_paused("stage-before-connect").await;

    // Detached from A by force mid-call, attached to B, which writes its data at both ends
    // of the device: where a filesystem's superblocks would go.
    ctrl.controller_unpublish_volume(controller_unpublish_request(&volume, "node-a"))
        .await
        .unwrap();
    b.attach(&mut ctrl, &volume).await;
    let b_direct = DirectFile::open(&b.target, true).unwrap();
    for (seed, at) in [(7, 0), (8, SIZE - CHUNK as u64)] {
        b_direct.write_at(&pattern(seed, at, CHUNK), at).unwrap();
    }
    b_direct.sync().unwrap();
    let exported = std::fs::read(&image).unwrap();

    // A's stage goes on with the sockets the gate cut, and must fail on the fence.
    let answer = tokio::time::timeout(Duration::from_secs(90), staging)
        .await
        .expect("A's NodeStage answers")
        .unwrap();
    let e = answer.expect_err("A staged a volume whose grant was revoked mid-call");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("fenced"), "{e:?}");
    let metrics = a.daemon.scrape().await;
    assert!(
        metrics.contains("ustor_csi_node_fenced_volumes_total 1"),
        "{metrics}"
    );
    // kubelet calls again with the same (revoked) publish context: refused again.
    let e = a
        .clients
        .node
        .node_stage_volume(stage)
        .await
        .expect_err("A's retried NodeStage staged a revoked volume");
    assert_ne!(e.code(), Code::Ok);
    assert!(
        e.message().contains("grant") || e.message().contains("fenced"),
        "{e:?}"
    );
    assert!(
        std::fs::read(&image).unwrap() == exported,
        "A changed the export after its grant was revoked"
    );
    a.clients
        .node
        .node_unstage_volume(unstage_request(&volume, &a.staging))
        .await
        .unwrap();
    assert_clean(&a.daemon);

    // B was never disturbed.
    for (seed, at) in [(7, 0), (8, SIZE - CHUNK as u64)] {
        assert!(
            b_direct.read_at(CHUNK, at).unwrap() == pattern(seed, at, CHUNK),
            "B reads back other data than it wrote at {at}"
        );
    }
    // Closed first: an open device keeps its publish target busy.
    drop(b_direct);
    b.detach(&volume).await;
    ctrl.controller_unpublish_volume(controller_unpublish_request(&volume, "node-b"))
        .await
        .unwrap();
    ctrl.delete_volume(delete_volume_request(&volume))
        .await
        .unwrap();
}
