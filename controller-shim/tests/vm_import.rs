//! An old product's uStor image adopted with `ustor-csi-controller import`, then staged on a
//! real kernel from the PersistentVolume the command printed: the filesystem the image held is
//! mounted as it is (nothing formats it), and its data reads back. The in-repo uStor server
//! answers the management API; nbdkit serves the image's data. (That the PersistentVolume
//! binds a claim is `kube_import`'s part.) Ignored on the host; run in the VM on every kernel
//! line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use std::process::Command;
use std::sync::Arc;

use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::*;
use k8s_openapi::api::core::v1::PersistentVolume;
use serde::Deserialize;
use serde_json::json;
use testkit::csi::*;
use testkit::daemon::NodeDaemon;
use testkit::fake_ustor::FakeUstor;
use testkit::placement::{place, unplace};
use testkit::{Listen, NbdServer};

const OLD: &str = "data/old-claim-data";
const SIZE: u64 = 64 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn an_imported_image_stages_with_its_data() {
    // The old product's volume: an ext4 filesystem holding a file, on an image file that
    // nbdkit serves (mke2fs fills it from a directory, so no mount is needed to make it).
    let dir = tempfile::tempdir().unwrap();
    let content = dir.path().join("content");
    std::fs::create_dir(&content).unwrap();
    let data = testkit::pattern(23, 0, 3 << 20);
    std::fs::write(content.join("data.bin"), &data).unwrap();
    let image = dir.path().join("old.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    let made = Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-d"])
        .arg(&content)
        .arg(&image)
        .status()
        .unwrap();
    assert!(made.success(), "mke2fs -d");
    let nbd = NbdServer::nbdkit(Listen::Tcp, &["file", image.to_str().unwrap()]).unwrap();
    let port = nbd.tcp_port().unwrap();

    let server = FakeUstor::start().await.unwrap();
    server.set_user("csi", "Import@Pw1", None);
    let addr = ([127, 0, 0, 1], port).into();
    server.add_image(OLD, SIZE, json!({"owner": "csi-mind-ustor"}), addr);
    let creds = common::ustor_credentials(dir.path(), "Import@Pw1");

    let out = Command::new(testkit::controller::binary())
        .args(["import", "--ustor-allow-insecure-http", "--image", OLD])
        .args(["--ustor-url", &server.url(), "--name", "pv-old-claim"])
        .arg("--ustor-credentials")
        .arg(&creds)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "import: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let yaml = String::from_utf8(out.stdout).unwrap();
    let pv = PersistentVolume::deserialize(serde_yaml_ng::Deserializer::from_str(&yaml)).unwrap();
    let csi = pv.spec.unwrap().csi.unwrap();

    // The controller (cluster id k8s, the command's default) publishes it; the node daemon
    // stages and publishes it from what the PersistentVolume holds, as kubelet passes it.
    let backend = Arc::new(common::ustor_backend(&server.url(), &creds));
    let (mut ctrl, _serving) =
        common::serve_controller(dir.path(), backend, "k8s", None, None).await;
    let mut daemon = NodeDaemon::new("import-node", "io-timeout-secs = 4\n").unwrap();
    let mut node = daemon.start(None).await;
    let volume = Volume {
        volume_id: csi.volume_handle.clone(),
        volume_context: csi.volume_attributes.unwrap().into_iter().collect(),
        ..Volume::default()
    };
    let cap = mount_capability(csi.fs_type.as_deref().unwrap(), Mode::SingleNodeWriter);
    let placed = place(&mut ctrl, &mut node, &daemon, &volume, cap)
        .await
        .unwrap();
    let read = std::fs::read(placed.target.join("data.bin")).unwrap();
    assert!(read == data, "the old volume's file did not read back");
    // The pod's writes land in the same image: written, unstaged, staged again.
    std::fs::write(placed.target.join("new.bin"), b"written after the import").unwrap();
    unplace(&mut ctrl, &mut node, &daemon, &placed)
        .await
        .unwrap();
    let cap = mount_capability("ext4", Mode::SingleNodeWriter);
    let placed = place(&mut ctrl, &mut node, &daemon, &volume, cap)
        .await
        .unwrap();
    assert!(std::fs::read(placed.target.join("data.bin")).unwrap() == data);
    assert_eq!(
        std::fs::read(placed.target.join("new.bin")).unwrap(),
        b"written after the import"
    );
    unplace(&mut ctrl, &mut node, &daemon, &placed)
        .await
        .unwrap();
    assert!(server.images().contains(&OLD.to_owned()));
}
