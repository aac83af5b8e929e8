//! The main job: one volume through its whole life on a real kernel, as kubelet would drive
//! it. Starts an NBD server (nbdkit) and the node daemon, then stages, publishes, writes,
//! expands, unpublishes and unstages an ext4 volume, printing each step and what the node's
//! `status` command shows. Run by `tests/vm/run --demo` inside the VM.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use csi_proto::csi::volume_capability::access_mode::Mode;
use testkit::csi::*;
use testkit::daemon::NodeDaemon;
use testkit::{Listen, NbdServer};

const MIB: u64 = 1 << 20;

fn step(what: &str) {
    println!("\n== {what}");
}

fn status(daemon: &NodeDaemon) {
    let out = Command::new(testkit::daemon::binary())
        .args(["status", "--state-dir"])
        .arg(&daemon.state_dir)
        .args(["--node-id", &daemon.node_id])
        .output()
        .expect("ustor-csi-node status");
    print!("{}", String::from_utf8_lossy(&out.stdout));
}

fn df(path: &Path) -> String {
    let u = mounts::usage::usage(path).expect("statvfs");
    format!(
        "{} MiB total, {} MiB used",
        u.bytes_total / MIB,
        u.bytes_used / MIB
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let dir = tempfile::tempdir()?;
    let image = dir.path().join("pvc-demo.img");
    std::fs::File::create(&image)?.set_len(128 * MIB)?;
    let file_arg = format!("file={}", image.display());

    step("an NBD export: nbdkit serving a 128 MiB sparse file over TCP");
    let server = NbdServer::nbdkit(Listen::Tcp, &["file", &file_arg])?;
    let uri = server.uri().to_string();
    println!("export: {uri}");

    step("the node daemon (ustor-csi-node serve)");
    let mut daemon = NodeDaemon::new("demo-node", "")?;
    let mut c = daemon.start(None).await;
    println!("ready on {}", daemon.socket.display());

    let volume = "pvc-demo";
    let cap = mount_capability("ext4", Mode::SingleNodeWriter);
    let staging = dir
        .path()
        .join("plugins/kubernetes.io/csi/ustor-nbd.csi.mindsw.io/demo/globalmount");
    let target = dir
        .path()
        .join("pods/demo-pod/volumes/kubernetes.io~csi/pvc-demo/mount");
    std::fs::create_dir_all(&staging)?;
    std::fs::create_dir_all(target.parent().ok_or("target has a parent")?)?;

    step("NodeStageVolume: attach, format (blank device only), mount at the staging path");
    c.node
        .node_stage_volume(stage_request(volume, &staging, cap.clone(), &uri))
        .await?;
    status(&daemon);

    step("NodePublishVolume: bind mount into the pod");
    c.node
        .node_publish_volume(publish_request(
            volume,
            &staging,
            &target,
            cap.clone(),
            &uri,
            false,
        ))
        .await?;
    let data = testkit::pattern(1, 0, 8 * MIB as usize);
    std::fs::write(target.join("hello.bin"), &data)?;
    std::fs::File::open(target.join("hello.bin"))?.sync_all()?;
    assert!(std::fs::read(target.join("hello.bin"))? == data);
    println!(
        "wrote and read back 8 MiB in the pod's mount: {}",
        df(&target)
    );

    step("the daemon is killed (-9) and restarted: the volume keeps working");
    daemon.kill();
    let mut c = daemon.start(None).await;
    assert!(std::fs::read(target.join("hello.bin"))? == data);
    println!("data intact after the restart");

    step("the export grows to 256 MiB; NodeExpandVolume grows the filesystem through the staging path");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&image)?
        .set_len(256 * MIB)?;
    let r = c
        .node
        .node_expand_volume(expand_request(
            volume,
            &target,
            &staging,
            (256 * MIB) as i64,
        ))
        .await?
        .into_inner();
    println!(
        "capacity {} MiB; {}",
        r.capacity_bytes as u64 / MIB,
        df(&target)
    );

    step("NodeGetVolumeStats");
    let stats = c
        .node
        .node_get_volume_stats(stats_request(volume, &target))
        .await?
        .into_inner();
    let condition = stats.volume_condition.unwrap_or_default();
    println!("abnormal: {} ({})", condition.abnormal, condition.message);

    step("NodeUnpublishVolume and NodeUnstageVolume: unmount, detach, forget");
    c.node
        .node_unpublish_volume(unpublish_request(volume, &target))
        .await?;
    c.node
        .node_unstage_volume(unstage_request(volume, &staging))
        .await?;
    status(&daemon);
    assert!(daemon.journal_files().is_empty(), "no journal record left");
    println!(
        "\nvolume lifecycle finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
