//! csi-sanity, the community's CSI conformance suite, against the node daemon and the controller
//! (local backend) together, on a real kernel, in mount and in block mode. Ignored on the host;
//! run in the VM on every kernel line by `tests/vm/run`, which copies the suite's binaries
//! (`tests/sanity/build`) into the guest.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use csi_proto::csi::controller_client::ControllerClient;
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::{NodeGetInfoRequest, NodeGetInfoResponse};
use testkit::controller::ControllerProcess;
use testkit::csi::*;
use testkit::daemon::NodeDaemon;
use testkit::kube_cluster::{csinode_yaml, Kubectl};
use testkit::sanity::{SanityEndpoint, SanityRun};

mod common;
use common::{assert_clean, status_of, CONFIG, MIB};

/// The host's control plane, as `tests/vm/run` hands it to the guest: the controller runs
/// with its Kubernetes glue against it, so it knows which nodes exist and their attach limits
/// (from CSINodes) as in a cluster, and csi-sanity's specs of both are real.
fn control_plane() -> Kubectl {
    let kubeconfig = std::env::var_os("USTOR_KUBECONFIG").expect(
        "USTOR_KUBECONFIG is not set: tests/vm/run starts a control plane for the tests named *sanity*",
    );
    Kubectl {
        binary: "kubectl".into(),
        kubeconfig: kubeconfig.into(),
    }
}

/// The node's registration as kubelet makes it from the daemon's NodeGetInfo (no kubelet runs
/// in this guest): a CSINode with our driver, the node's id and its attach limit. Made anew,
/// since a CSINode's driver entries cannot be changed.
fn register_node(kube: &Kubectl, info: &NodeGetInfoResponse) {
    let name = &info.node_id;
    let keys: Vec<&str> = info
        .accessible_topology
        .iter()
        .flat_map(|t| t.segments.keys())
        .map(String::as_str)
        .collect();
    kube.ok(
        &["delete", "csinode", name, "--ignore-not-found", "--wait"],
        None,
    )
    .unwrap();
    let csinode = csinode_yaml(name, &keys, Some(info.max_volumes_per_node));
    kube.ok(&["create", "-f", "-"], Some(&csinode)).unwrap();
}

/// Waits until the controller's list of nodes has loaded (before that a publication is
/// UNAVAILABLE, which csi-sanity would count as a failure), by publishing a probe volume to
/// the registered node; then removes the probe.
async fn wait_nodes_listed(ctrl: &mut ControllerClient<tonic::transport::Channel>, node: &str) {
    let cap = mount_capability("ext4", Mode::SingleNodeWriter);
    let volume = created_volume(
        ctrl,
        create_volume_request("nodes-listed", 16 << 20, cap.clone()),
    )
    .await
    .volume_id;
    let patience = std::time::Duration::from_secs(60);
    testkit::wait::eventually("the controller's list of nodes", patience, || {
        let (mut ctrl, request) = (
            ctrl.clone(),
            controller_publish_request(&volume, node, cap.clone()),
        );
        async move {
            match ctrl.controller_publish_volume(request).await {
                Ok(_) => Some(()),
                Err(status) if status.code() == tonic::Code::Unavailable => None,
                Err(status) => panic!("ControllerPublishVolume to {node}: {status:?}"),
            }
        }
    })
    .await;
    ctrl.controller_unpublish_volume(controller_unpublish_request(&volume, node))
        .await
        .unwrap();
    ctrl.delete_volume(delete_volume_request(&volume))
        .await
        .unwrap();
}

async fn sanity(access_type: &str, binary: &str) {
    let kube = control_plane();
    // A small attach limit: the attach-limit spec creates and publishes that many volumes.
    let config = format!("{CONFIG}max-volumes = 8\n");
    let mut daemon = NodeDaemon::new("sanity-node", &config).unwrap();
    let mut node = daemon.start(None).await;
    let info = node
        .node
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.max_volumes_per_node, 8, "{info:?}");
    register_node(&kube, &info);
    let (controller, mut ctrl) = ControllerProcess::start_with("sanity", Some(&kube.kubeconfig))
        .await
        .unwrap();
    wait_nodes_listed(&mut ctrl, &info.node_id).await;
    let endpoint = SanityEndpoint::start(&daemon.socket, &controller.socket)
        .await
        .unwrap();
    let work = daemon.scratch().join(format!("sanity-{access_type}"));
    std::fs::create_dir_all(&work).unwrap();

    let run = SanityRun {
        binary: binary.into(),
        node_endpoint: endpoint.socket.clone(),
        controller_endpoint: controller.socket.clone(),
        access_type: access_type.into(),
        volume_bytes: 64 * MIB,
        work,
        // A VolumeAttributesClass's: a connection count other than the default one.
        mutable_parameters: [("nbdConnections".to_owned(), "2".to_owned())].into(),
    };
    let report = tokio::task::spawn_blocking(move || run.run())
        .await
        .unwrap();
    let report = report.unwrap();
    for (name, message) in &report.failures {
        eprintln!("FAILED: {name}\n  {message}");
    }
    // The driver offers every capability csi-sanity tests (the GroupController's too): a skip,
    // like a failure, fails the test.
    let skipped: Vec<String> = report.names("skipped");
    eprintln!(
        "csi-sanity ({access_type}): {} passed, {} failed, {} skipped",
        report.count("passed"),
        report.failures.len(),
        report.count("skipped")
    );
    assert!(report.count("passed") > 50, "{report:?}");
    let failed: Vec<&String> = report.failures.iter().map(|(name, _)| name).collect();
    assert!(failed.is_empty(), "failed: {failed:?}");
    assert_eq!(
        skipped,
        Vec::<String>::new(),
        "skipped for a capability we offer"
    );

    drop(endpoint);
    kube.ok(&["delete", "csinode", &info.node_id], None)
        .unwrap();
    let (code, status) = status_of(&daemon);
    assert_eq!(code, 0, "{status}");
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn csi_sanity_passes_in_mount_mode() {
    sanity("mount", "csi-sanity").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn csi_sanity_passes_in_block_mode() {
    sanity("block", "csi-sanity-block").await;
}
