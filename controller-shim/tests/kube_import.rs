//! `ustor-csi-controller import` against the in-repo uStor server and a real kube-apiserver
//! and kube-controller-manager (Kubernetes 1.20, built by tests/kube/build-apiserver): an old
//! product's image becomes a volume of this driver, and the PersistentVolume the command prints
//! binds a claim. (That a node stages it with its data intact is `vm_import`'s part.)
//! Ignored in a plain `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::ListVolumesRequest;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use serde::Deserialize;
use serde_json::json;
use testkit::csi::*;
use testkit::fake_ustor::FakeUstor;
use testkit::kube_cluster::KubeCluster;

const OLD: &str = "data/k8s-pvc-0a1b2c";

/// Runs the import command; its status, standard output and standard error.
async fn import(args: Vec<String>) -> (bool, String, String) {
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_ustor-csi-controller"))
            .arg("import")
            .args(args)
            .env("NO_COLOR", "1")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn args(server: &FakeUstor, creds: &Path, image: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--ustor-url",
        &server.url(),
        "--ustor-allow-insecure-http",
        "--ustor-credentials",
        creds.to_str().unwrap(),
        "--image",
        image,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// The PersistentVolume and the claim of the command's YAML.
fn objects(yaml: &str) -> (PersistentVolume, PersistentVolumeClaim) {
    let mut docs = serde_yaml_ng::Deserializer::from_str(yaml);
    let pv = PersistentVolume::deserialize(docs.next().unwrap()).unwrap();
    let pvc = PersistentVolumeClaim::deserialize(docs.next().unwrap()).unwrap();
    assert!(docs.next().is_none(), "two objects: {yaml}");
    (pv, pvc)
}

fn jsonpath(cluster: &KubeCluster, kind: &str, name: &str, path: &str) -> String {
    let out = cluster
        .kubectl(&[
            "get",
            kind,
            name,
            "-n",
            "default",
            "-o",
            &format!("jsonpath={path}"),
        ])
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn an_imported_image_is_a_volume_whose_persistent_volume_binds_its_claim() {
    let server = FakeUstor::start().await.unwrap();
    server.set_user("csi", "Import@Pw1", None);
    let nbd = "127.0.0.1:10809".parse().unwrap();
    // As the old product left it: its own labels, none of this driver's.
    server.add_image(OLD, 64 << 20, json!({"owner": "csi-mind-ustor"}), nbd);
    let dir = tempfile::tempdir().unwrap();
    let creds = common::ustor_credentials(dir.path(), "Import@Pw1");
    let wanted = [
        "--name",
        "pv-adopted",
        "--claim",
        "default/restored",
        "--storage-class",
        "ustor-fast",
    ];

    let (ok, yaml, stderr) = import(args(&server, &creds, OLD, &wanted)).await;
    assert!(ok, "import failed: {stderr}");
    let (pv, pvc) = objects(&yaml);
    let spec = pv.spec.as_ref().unwrap();
    let csi = spec.csi.as_ref().unwrap();
    assert_eq!(csi.driver, csi_common::DRIVER_NAME);
    assert_eq!(csi.volume_handle, format!("ustor:volume:{OLD}"));
    assert_eq!(csi.fs_type.as_deref(), Some("ext4"));
    let attributes = csi.volume_attributes.as_ref().unwrap();
    assert_eq!(attributes["nbdUri"], "nbd://127.0.0.1:10809/k8s-pvc-0a1b2c");
    assert_eq!(spec.capacity.as_ref().unwrap()["storage"].0, "67108864");
    assert_eq!(
        spec.persistent_volume_reclaim_policy.as_deref(),
        Some("Retain")
    );
    assert_eq!(
        pvc.spec.as_ref().unwrap().volume_name.as_deref(),
        Some("pv-adopted")
    );
    // The image is now this driver's volume, under the volume's name.
    let labels = server.labels(OLD).unwrap();
    assert_eq!(labels["csi.name"], "pv-adopted", "{labels}");
    assert_eq!(labels["csi.adopted-by"], "k8s", "{labels}");
    assert!(labels["csi.parameters"]
        .as_str()
        .unwrap()
        .contains("\"pool\":\"data\""));

    // Run again (a run cut short is simply repeated): the same objects.
    let (ok, again, stderr) = import(args(&server, &creds, OLD, &wanted)).await;
    assert!(ok, "a repeated import failed: {stderr}");
    assert_eq!(again, yaml);
    // Under another name it is refused: one image, one PersistentVolume.
    let (ok, _, stderr) = import(args(&server, &creds, OLD, &["--name", "pv-other"])).await;
    assert!(!ok && stderr.contains("already"), "{stderr}");
    let (ok, _, stderr) = import(args(&server, &creds, "data/nothing-here", &[])).await;
    assert!(!ok && stderr.contains("does not exist"), "{stderr}");
    let (ok, _, stderr) = import(args(
        &server,
        &creds,
        OLD,
        &["--volume-mode", "Block", "--name", "pv-adopted"],
    ))
    .await;
    assert!(!ok && stderr.contains("ReadWriteOncePod"), "{stderr}");
    assert_eq!(server.labels(OLD).unwrap()["csi.name"], "pv-adopted");

    // The controller serves it as any of its volumes.
    let backend = Arc::new(common::ustor_backend(&server.url(), &creds));
    let (mut ctrl, _serving) =
        common::serve_controller(dir.path(), backend, "k8s", None, None).await;
    let listed = ctrl
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(
        listed
            .entries
            .iter()
            .any(|e| e.volume.as_ref().unwrap().volume_id == csi.volume_handle),
        "{listed:?}"
    );
    let cap = mount_capability("ext4", Mode::SingleNodeWriter);
    let published = ctrl
        .controller_publish_volume(controller_publish_request(
            &csi.volume_handle,
            "node-a",
            cap,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(published.publish_context["nbdUri"], attributes["nbdUri"]);

    // Applied as printed, the claim binds to the volume (kube-controller-manager's binder
    // checks class, size, access and volume mode).
    let mut cluster = KubeCluster::start().unwrap();
    cluster.start_controller_manager().unwrap();
    let applied = cluster.kubectl_stdin(&["apply", "-f", "-"], &yaml).unwrap();
    assert!(
        applied.status.success(),
        "{}",
        String::from_utf8_lossy(&applied.stderr)
    );
    testkit::wait::eventually("the claim bound", Duration::from_secs(90), || {
        let phases = (
            jsonpath(&cluster, "pvc", "restored", "{.status.phase}"),
            jsonpath(&cluster, "pv", "pv-adopted", "{.status.phase}"),
        );
        async move { (phases.0 == "Bound" && phases.1 == "Bound").then_some(()) }
    })
    .await;
    assert_eq!(
        jsonpath(&cluster, "pvc", "restored", "{.spec.volumeName}"),
        "pv-adopted"
    );
}
