//! The Kubernetes glue against a real kube-apiserver and kube-controller-manager (Kubernetes
//! 1.20, built by tests/kube/build-apiserver), started by each test: MindUstorStorageClass → StorageClass: created, followed, kept as admins set it.
//! Ignored in a plain `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use controller_shim::kube::crd::{MindUstorStorageClass, Phase};
use controller_shim::kube::Glue;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use std::time::Duration;
use testkit::kube_cluster::KubeCluster;

use common::*;

/// What an operator's `kubectl edit` of the pool does.
async fn set_pool(api: &Api<MindUstorStorageClass>, name: &str, pool: &str) {
    let patch = Patch::Merge(serde_json::json!({ "spec": { "pool": pool } }));
    api.patch(name, &PatchParams::default(), &patch)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn a_storage_class_follows_its_resource_and_keeps_what_admins_set() {
    let mut cluster = KubeCluster::start().unwrap();
    cluster.start_controller_manager().unwrap();
    install_crds(&cluster);
    let client = client(&cluster).await;
    let _glue = Glue::start(client.clone(), test_settings());
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());
    let storage_classes: Api<StorageClass> = Api::all(client.clone());

    // A class naming a connection that does not exist yet: Failed, no StorageClass.
    create_class(&classes, "fast", "main").await;
    let failed = wait_phase(&classes, "fast", Phase::Failed).await;
    let reason = failed.status.unwrap().reason.unwrap();
    assert!(reason.contains("\"main\" does not exist"), "{reason}");
    assert!(storage_classes.get_opt("fast").await.unwrap().is_none());

    // The connection appears: the class is created at once (not at the next retry).
    apply(&cluster, &connection_yaml("main"));
    let created = wait_phase(&classes, "fast", Phase::Created).await;
    let sc = storage_classes.get("fast").await.unwrap();
    assert_eq!(sc.provisioner, csi_common::DRIVER_NAME);
    let params = sc.parameters.clone().unwrap();
    assert_eq!(params["pool"], "data");
    assert_eq!(params["connection"], "main");
    assert_eq!(params["csi.storage.k8s.io/fstype"], "ext4");
    // kubelet passes the connection's TLS Secret to the nodes' NodeStage and NodeExpand.
    for (name, namespace) in controller_shim::kube::storage_class::NODE_SECRET_PARAMETERS {
        assert_eq!(params[name], "tls", "{name}");
        assert_eq!(params[namespace], test_settings().namespace, "{namespace}");
    }
    assert_eq!(created.status.as_ref().unwrap().reason, None);
    assert_eq!(sc.reclaim_policy.as_deref(), Some("Delete"));
    assert_eq!(
        sc.volume_binding_mode.as_deref(),
        Some("WaitForFirstConsumer")
    );
    assert_eq!(sc.allow_volume_expansion, Some(true));
    let topology = &sc.allowed_topologies.clone().unwrap()[0];
    let requirement = &topology.match_label_expressions.clone().unwrap()[0];
    assert_eq!(requirement.key, csi_common::TOPOLOGY_KEY);
    let annotations = sc.metadata.annotations.clone().unwrap();
    assert_eq!(
        annotations["storage.deckhouse.io/volumesnapshotclass"],
        "csi-mind-ustor"
    );
    assert_eq!(
        annotations["virtualdisk.virtualization.deckhouse.io/volume-mode"],
        "Block"
    );
    let owner = &sc.metadata.owner_references.clone().unwrap()[0];
    assert_eq!(Some(&owner.uid), created.metadata.uid.as_ref());

    // No writes when nothing changed: the resource version stays put.
    assert_not_rewritten(&classes, "fast", created.metadata.resource_version.clone()).await;

    // An admin's annotation value is kept; a removed one of ours comes back.
    kubectl_ok(
        &cluster,
        &[
            "annotate",
            "--overwrite",
            "storageclass/fast",
            "virtualdisk.virtualization.deckhouse.io/access-mode=ReadWriteOnce",
            "storage.deckhouse.io/volumesnapshotclass-",
        ],
    );
    let annotations = eventually(
        "the removed annotation back",
        Duration::from_secs(30),
        || async {
            let sc = storage_classes.get("fast").await.ok()?;
            let a = sc.metadata.annotations?;
            a.contains_key("storage.deckhouse.io/volumesnapshotclass")
                .then_some(a)
        },
    )
    .await;
    assert_eq!(
        annotations["virtualdisk.virtualization.deckhouse.io/access-mode"],
        "ReadWriteOnce"
    );

    // A changed spec: Failed, naming the change; the StorageClass is left as it was.
    set_pool(&classes, "fast", "other").await;
    let changed = wait_phase(&classes, "fast", Phase::Failed).await;
    let reason = changed.status.unwrap().reason.unwrap();
    assert!(reason.contains("pool is \"data\""), "{reason}");
    assert_eq!(
        storage_classes
            .get("fast")
            .await
            .unwrap()
            .parameters
            .unwrap()["pool"],
        "data"
    );
    set_pool(&classes, "fast", "data").await;
    wait_phase(&classes, "fast", Phase::Created).await;

    // A StorageClass of the same name that is not ours is never taken over.
    apply(
        &cluster,
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: taken\nprovisioner: example.com/other\n",
    );
    create_class(&classes, "taken", "main").await;
    let refused = wait_phase(&classes, "taken", Phase::Failed).await;
    assert!(
        refused
            .status
            .unwrap()
            .reason
            .unwrap()
            .contains("not managed by"),
        "foreign StorageClass"
    );
    assert_eq!(
        storage_classes.get("taken").await.unwrap().provisioner,
        "example.com/other"
    );

    // Deleting the resource deletes its StorageClass (garbage collector), nothing else.
    classes
        .delete("fast", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "StorageClass fast deleted",
        Duration::from_secs(60),
        || async {
            storage_classes
                .get_opt("fast")
                .await
                .ok()
                .and_then(|sc| sc.is_none().then_some(()))
        },
    )
    .await;
    assert!(storage_classes.get_opt("taken").await.unwrap().is_some());
}
