//! The Kubernetes glue against a real kube-apiserver and kube-controller-manager (Kubernetes
//! 1.20, built by tests/kube/build-apiserver), started by each test: the VolumeSnapshotClass, which exists only while the snapshot API is served.
//! Ignored in a plain `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use controller_shim::kube::crd::{MindUstorStorageClass, Phase};
use controller_shim::kube::Glue;
use kube::api::Api;
use std::time::Duration;
use testkit::kube_cluster::KubeCluster;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn the_snapshot_class_exists_only_while_the_snapshot_api_is_served() {
    let cluster = KubeCluster::start().unwrap();
    install_crds(&cluster);
    let client = client(&cluster).await;
    let _glue = Glue::start(client.clone(), test_settings());
    // Without the API nothing fails, and the glue keeps serving the rest.
    tokio::time::sleep(Duration::from_secs(3)).await;
    apply(&cluster, &connection_yaml("main"));
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());
    create_class(&classes, "one", "main").await;
    wait_phase(&classes, "one", Phase::Created).await;

    // The API appears (a snapshot module is installed): the class follows within seconds.
    apply(&cluster, &snapshot_class_crd());
    let found = eventually(
        "VolumeSnapshotClass csi-mind-ustor",
        Duration::from_secs(60),
        || async {
            let out = cluster
                .kubectl(&["get", "volumesnapshotclass", "csi-mind-ustor", "-o", "json"])
                .ok()?;
            out.status
                .success()
                .then(|| serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap())
        },
    )
    .await;
    assert_eq!(found["driver"], csi_common::DRIVER_NAME);
    assert_eq!(found["deletionPolicy"], "Delete");
}
