//! The Kubernetes glue against a real kube-apiserver and kube-controller-manager (Kubernetes
//! 1.20, built by tests/kube/build-apiserver), started by each test: ControllerPublishVolume
//! checks the node, and its attach limit, against the CSINode objects.
//! Ignored in a plain `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use controller_shim::kube::Glue;
use std::sync::Arc;
use std::time::Duration;
use testkit::kube_cluster::KubeCluster;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn controller_publish_to_a_node_without_our_driver_is_not_found() {
    use controller_shim::backend::local::LocalBackend;
    use csi_proto::csi::volume_capability::access_mode::Mode;
    use testkit::csi::*;

    let cluster = KubeCluster::start().unwrap();
    let client = client(&cluster).await;
    let glue = Glue::start(client, test_settings());
    register_node(&cluster, "node-a");
    // Another driver's node: not ours to attach to.
    apply(
        &cluster,
        "apiVersion: storage.k8s.io/v1\nkind: CSINode\nmetadata:\n  name: node-c\nspec:\n  drivers:\n\
         \x20 - name: other.csi.example.com\n    nodeID: node-c\n",
    );
    let dir = tempfile::tempdir().unwrap();
    let backend = LocalBackend::open(&dir.path().join("store"), "127.0.0.1:10809").unwrap();
    let (mut csi, server) = serve_csi(Arc::new(backend), &glue, dir.path()).await;
    let cap = mount_capability("ext4", Mode::SingleNodeWriter);
    let volume = created_volume(
        &mut csi,
        create_volume_request("pvc-1", 1 << 20, cap.clone()),
    )
    .await;
    let publish = |node: &str| controller_publish_request(&volume.volume_id, node, cap.clone());
    let published = eventually("node-a known", Duration::from_secs(30), || {
        let mut csi = csi.clone();
        let req = publish("node-a");
        async move { csi.controller_publish_volume(req).await.ok() }
    })
    .await;
    assert!(published
        .into_inner()
        .publish_context
        .contains_key("nbdUri"));
    for ghost in ["ghost", "node-c"] {
        let err = csi
            .controller_publish_volume(publish(ghost))
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            tonic::Code::NotFound,
            "{ghost}: {}",
            err.message()
        );
        assert!(err.message().contains("CSINode"), "{}", err.message());
    }
    server.abort();
}

/// A CSINode of our driver for `name` whose allocatable count (kubelet's copy of the node
/// daemon's max_volumes_per_node) is `count`.
fn register_limited_node(cluster: &KubeCluster, name: &str, count: u32) {
    apply(
        cluster,
        &testkit::kube_cluster::csinode_yaml(name, &[], Some(i64::from(count))),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn controller_publish_past_the_nodes_allocatable_count_is_resource_exhausted() {
    use controller_shim::backend::local::LocalBackend;
    use csi_proto::csi::volume_capability::access_mode::Mode;
    use testkit::csi::*;

    let cluster = KubeCluster::start().unwrap();
    let client = client(&cluster).await;
    let glue = Glue::start(client, test_settings());
    register_limited_node(&cluster, "node-l", 1);
    let dir = tempfile::tempdir().unwrap();
    let backend = LocalBackend::open(&dir.path().join("store"), "127.0.0.1:10809").unwrap();
    let (mut csi, server) = serve_csi(Arc::new(backend), &glue, dir.path()).await;
    let cap = mount_capability("ext4", Mode::SingleNodeWriter);
    let mut ids = Vec::new();
    for name in ["pvc-1", "pvc-2"] {
        let request = create_volume_request(name, 1 << 20, cap.clone());
        ids.push(created_volume(&mut csi, request).await.volume_id);
    }
    let publish = |id: &str| controller_publish_request(id, "node-l", cap.clone());
    eventually("node-l known", Duration::from_secs(30), || {
        let mut csi = csi.clone();
        let req = publish(&ids[0]);
        async move { csi.controller_publish_volume(req).await.ok() }
    })
    .await;
    let err = csi
        .controller_publish_volume(publish(&ids[1]))
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        tonic::Code::ResourceExhausted,
        "{}",
        err.message()
    );
    assert!(err.message().contains("node-l"), "{}", err.message());
    // The daemon re-registers with a higher count (devices other tools held are free): the
    // driver entry is immutable, so kubelet writes it anew. The next publication fits.
    kubectl_ok(&cluster, &["delete", "csinode", "node-l"]);
    register_limited_node(&cluster, "node-l", 2);
    eventually("the new count read", Duration::from_secs(30), || {
        let mut csi = csi.clone();
        let req = publish(&ids[1]);
        async move { csi.controller_publish_volume(req).await.ok() }
    })
    .await;
    server.abort();
}
