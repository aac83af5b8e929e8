//! The Kubernetes glue against a real kube-apiserver and kube-controller-manager (Kubernetes
//! 1.20, built by tests/kube/build-apiserver), started by each test: the glue survives an API server restart, and two replicas elect one writer.
//! Ignored in a plain `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use controller_shim::kube::crd::{MindUstorStorageClass, Phase};
use controller_shim::kube::{Glue, Settings};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::Api;
use std::time::Duration;
use testkit::kube_cluster::KubeCluster;

use common::*;

/// The managers that wrote a resource's status (`managedFields` of its status subresource).
fn status_writers(object: &kube::api::ObjectMeta) -> Vec<String> {
    let mut out: Vec<String> = object
        .managed_fields
        .iter()
        .flatten()
        .filter(|f| {
            f.subresource.as_deref() == Some("status")
                || f.fields_v1
                    .as_ref()
                    .is_some_and(|v| v.0.get("f:status").is_some())
        })
        .filter_map(|f| f.manager.clone())
        .collect();
    out.sort();
    out.dedup();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn reconcilers_come_back_after_the_api_server_does() {
    let mut cluster = KubeCluster::start().unwrap();
    install_crds(&cluster);
    let client = client(&cluster).await;
    let glue = Glue::start(client.clone(), test_settings());
    apply(&cluster, &connection_yaml("main"));
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());
    create_class(&classes, "before", "main").await;
    wait_phase(&classes, "before", Phase::Created).await;

    cluster.stop_apiserver();
    tokio::time::sleep(Duration::from_secs(5)).await;
    cluster.start_apiserver().unwrap();
    // Watches retry with client-go's back-off (at most 30 s apart), so within about 30 s
    // of the API server's return the glue is current again.

    create_class(&classes, "after", "main").await;
    wait_phase(&classes, "after", Phase::Created).await;
    let storage_classes: Api<StorageClass> = Api::all(client.clone());
    let names: Vec<String> = storage_classes
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|sc| sc.metadata.name)
        .collect();
    assert_eq!(names, ["after", "before"], "exactly one StorageClass each");

    // The node list came back too: a node registered after the outage is known.
    register_node(&cluster, "node-b");
    eventually("node-b known", Duration::from_secs(60), || async {
        use controller_shim::provision::Nodes;
        (glue.nodes.has_node("node-b") == Some(true)).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn two_replicas_never_both_write_and_the_follower_takes_over() {
    let cluster = cluster_with_namespace();
    let client = client(&cluster).await;
    let replica = |name: &str| {
        Glue::start(
            client.clone(),
            Settings {
                election: Some(name.into()),
                ..test_settings()
            },
        )
    };
    let mut replicas = vec![("a", replica("a")), ("b", replica("b"))];
    apply(&cluster, &connection_yaml("main"));
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());
    create_class(&classes, "first", "main").await;
    let first = wait_phase(&classes, "first", Phase::Created).await;
    let writers = status_writers(&first.metadata);
    assert_eq!(writers.len(), 1, "one replica wrote: {writers:?}");
    let leader = writers[0]
        .trim_start_matches("ustor-csi-controller/")
        .to_owned();

    // The leader stops; the other takes over, and it alone writes from then on.
    let position = replicas.iter().position(|(n, _)| *n == leader).unwrap();
    let (_, gone) = replicas.remove(position);
    drop(gone);
    create_class(&classes, "second", "main").await;
    let second = eventually(
        "the follower took over",
        Duration::from_secs(60),
        || async {
            let c = classes.get("second").await.ok()?;
            (c.status.as_ref()?.phase == Some(Phase::Created)).then_some(c)
        },
    )
    .await;
    let follower = replicas[0].0;
    assert_eq!(
        status_writers(&second.metadata),
        [format!("ustor-csi-controller/{follower}")]
    );
}
