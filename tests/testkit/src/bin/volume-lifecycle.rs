//! The main job: one volume through its whole life on a real kernel, as Kubernetes would drive
//! it. Starts the controller (local backend with its own NBD export server) and the node
//! daemon, then provisions, attaches, writes, survives a `kill -9` of the node daemon,
//! expands, snapshots, restores into a larger volume, and tears everything down, printing each
//! step and what the node's `status` command shows. Run by `tests/vm/run --demo` in the VM.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::*;
use testkit::controller::ControllerProcess;
use testkit::csi::*;
use testkit::daemon::NodeDaemon;
use testkit::placement::{place, remove, Error};

const MIB: i64 = 1 << 20;

fn step(what: &str) {
    println!("\n== {what}");
}

fn status(daemon: &NodeDaemon) -> Result<(), Error> {
    let out = Command::new(testkit::daemon::binary())
        .args(["status", "--state-dir"])
        .arg(&daemon.state_dir)
        .args(["--node-id", &daemon.node_id])
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", daemon.socket.display()))
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    Ok(())
}

fn df(path: &Path) -> Result<String, Error> {
    let u = mounts::usage::usage(path)?;
    Ok(format!(
        "{} MiB total, {} MiB used",
        u.bytes_total >> 20,
        u.bytes_used >> 20
    ))
}

fn capability() -> VolumeCapability {
    mount_capability("ext4", Mode::SingleNodeWriter)
}

fn create(name: &str, bytes: i64, source: Option<VolumeContentSource>) -> CreateVolumeRequest {
    CreateVolumeRequest {
        volume_content_source: source,
        ..create_volume_request(name, bytes, capability())
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let started = Instant::now();

    step("the controller (ustor-csi-controller serve --backend local) and its NBD export server");
    let (_controller, mut ctrl) = ControllerProcess::start("demo").await?;
    step("the node daemon (ustor-csi-node serve)");
    let mut daemon = NodeDaemon::new("demo-node", "")?;
    let mut node = daemon.start(None).await;
    println!("ready on {}", daemon.socket.display());

    step("CreateVolume pvc-demo, 128 MiB, ext4");
    let volume = ctrl
        .create_volume(create("pvc-demo", 128 * MIB, None))
        .await?
        .into_inner()
        .volume
        .ok_or("volume")?;
    println!(
        "{} -> {}",
        volume.volume_id, volume.volume_context["nbdUri"]
    );

    step("ControllerPublish, NodeStage (attach, format the blank device, mount), NodePublish");
    let placed = place(&mut ctrl, &mut node, &daemon, &volume, capability()).await?;
    status(&daemon)?;
    let data = testkit::pattern(1, 0, 8 << 20);
    std::fs::write(placed.target.join("hello.bin"), &data)?;
    std::fs::File::open(placed.target.join("hello.bin"))?.sync_all()?;
    println!("wrote 8 MiB in the pod's mount: {}", df(&placed.target)?);

    step("the node daemon is killed (-9) and restarted: the volume keeps working");
    daemon.kill();
    let mut node = daemon.start(None).await;
    assert!(std::fs::read(placed.target.join("hello.bin"))? == data);
    println!("data intact after the restart");

    step("ControllerExpandVolume to 256 MiB, then NodeExpandVolume (through the staging path)");
    ctrl.controller_expand_volume(controller_expand_request(
        &volume.volume_id,
        256 * MIB,
        Some(capability()),
    ))
    .await?;
    node.node
        .node_expand_volume(expand_request(
            &volume.volume_id,
            &placed.target,
            &placed.staging,
            256 * MIB,
        ))
        .await?;
    println!("{}", df(&placed.target)?);

    step("CreateSnapshot, then CreateVolume from it into a 512 MiB volume");
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    let snap = ctrl
        .create_snapshot(snapshot_request(&volume.volume_id, "snap-demo"))
        .await?
        .into_inner()
        .snapshot
        .ok_or("snapshot")?;
    let restored = ctrl
        .create_volume(create(
            "pvc-restored",
            512 * MIB,
            from_snapshot(&snap.snapshot_id),
        ))
        .await?
        .into_inner()
        .volume
        .ok_or("volume")?;
    let placed_restored = place(&mut ctrl, &mut node, &daemon, &restored, capability()).await?;
    assert!(std::fs::read(placed_restored.target.join("hello.bin"))? == data);
    println!(
        "restored volume holds the data; {}",
        df(&placed_restored.target)?
    );
    status(&daemon)?;

    step("NodeGetVolumeStats");
    let stats = node
        .node
        .node_get_volume_stats(stats_request(&volume.volume_id, &placed.target))
        .await?
        .into_inner();
    let condition = stats.volume_condition.unwrap_or_default();
    println!("abnormal: {} ({})", condition.abnormal, condition.message);

    step("teardown: NodeUnpublish, NodeUnstage, ControllerUnpublish, DeleteVolume, DeleteSnapshot");
    remove(&mut ctrl, &mut node, &daemon, &placed_restored).await?;
    remove(&mut ctrl, &mut node, &daemon, &placed).await?;
    ctrl.delete_snapshot(delete_snapshot_request(&snap.snapshot_id))
        .await?;
    status(&daemon)?;
    assert!(daemon.journal_files().is_empty(), "no journal record left");
    println!(
        "\nvolume lifecycle finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
