//! The Kubernetes glue against a real kube-apiserver and kube-controller-manager (Kubernetes
//! 1.20, built by tests/kube/build-apiserver), started by each test: every manifest in deploy/ applies, and the controller needs no more than its roles.
//! Ignored in a plain `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use controller_shim::kube::crd::MindUstorStorageConnection;
use controller_shim::kube::crd::{MindUstorStorageClass, Phase};
use controller_shim::kube::{Glue, Settings};
use kube::api::Api;
use std::time::Duration;
use testkit::kube_cluster::KubeCluster;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn every_manifest_applies_and_the_controller_needs_no_more_than_its_roles() {
    let cluster = KubeCluster::start().unwrap();
    let deploy = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
    for file in ["namespace.yaml", "crds.yaml"] {
        apply(
            &cluster,
            &std::fs::read_to_string(format!("{deploy}/{file}")).unwrap(),
        );
    }
    install_crds(&cluster);
    // prometheus-operator's kinds, for deploy/monitoring.yaml.
    for (kind, plural) in [
        ("PodMonitor", "podmonitors"),
        ("PrometheusRule", "prometheusrules"),
    ] {
        apply(
            &cluster,
            &stand_in_crd("monitoring.coreos.com", "v1", kind, plural, "Namespaced"),
        );
    }
    let mut checked = 0;
    for entry in std::fs::read_dir(deploy).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let out = cluster
            .kubectl(&["apply", "--dry-run=server", "-f", path.to_str().unwrap()])
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        checked += 1;
    }
    assert!(checked >= 5, "only {checked} manifests found in deploy/");

    // The glue, running as the controller's service account with only deploy/rbac.yaml's
    // grants, does its whole job.
    apply(
        &cluster,
        &std::fs::read_to_string(format!("{deploy}/controller.yaml")).unwrap(),
    );
    apply(
        &cluster,
        &std::fs::read_to_string(format!("{deploy}/rbac.yaml")).unwrap(),
    );
    apply(&cluster, &snapshot_class_crd());
    let account = client_as(
        &cluster,
        Some("system:serviceaccount:d8-csi-mind-ustor:csi-controller"),
    )
    .await;
    let forbidden: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(account.clone(), "default");
    assert!(
        forbidden.list(&Default::default()).await.is_err(),
        "the service account must not read Secrets outside its namespace"
    );
    let glue = Glue::start(
        account,
        Settings {
            election: Some("replica-a".into()),
            ..test_settings()
        },
    );
    register_node(&cluster, "node-a");
    apply(&cluster, &connection_yaml("main"));
    let admin = client(&cluster).await;
    let classes: Api<MindUstorStorageClass> = Api::all(admin.clone());
    create_class(&classes, "granted", "main").await;
    wait_phase(&classes, "granted", Phase::Created).await;
    eventually("node-a known", Duration::from_secs(30), || async {
        use controller_shim::provision::Nodes;
        (glue.nodes.has_node("node-a") == Some(true)).then_some(())
    })
    .await;
    // It reads the connection's Secrets in its namespace and writes the connection's status.
    let connections: Api<MindUstorStorageConnection> = Api::all(admin.clone());
    wait_connection(&connections, "main", "the missing Secret named", |s| {
        reason_has(s, "Secret d8-csi-mind-ustor/creds")
    })
    .await;
    // It makes its key, and reads the claim of a ReadWriteMany block volume.
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(admin.clone(), "d8-csi-mind-ustor");
    eventually(
        "the controller key made",
        Duration::from_secs(30),
        || async {
            secrets
                .get_opt(controller_shim::kube::key::KEY_SECRET)
                .await
                .ok()
                .flatten()
        },
    )
    .await;
    apply(
        &cluster,
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: unstamped\n  namespace: default\n\
         spec:\n  storageClassName: granted\n  accessModes: [ReadWriteMany]\n  volumeMode: Block\n\
         \x20 resources:\n    requests:\n      storage: 1Gi\n",
    );
    use controller_shim::provision::{ClaimError, Claims};
    let read = glue.claims.admitted("default", "unstamped").await;
    assert!(
        matches!(read, Err(ClaimError::NotAdmitted { .. })),
        "the claim read with the granted rights: {read:?}"
    );
    // The alerts' metrics exist and say what the resources' phases say.
    let text = controller_shim::metrics::ControllerMetrics::default()
        .with_collector(glue.phases.clone())
        .render();
    assert!(
        text.contains(r#"ustor_csi_controller_connection_failed{name="main"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"ustor_csi_controller_storage_class_failed{name="granted"} 0"#),
        "{text}"
    );
    let rules = std::fs::read_to_string(format!("{deploy}/monitoring.yaml")).unwrap();
    for word in rules.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("ustor_csi_") {
            assert!(
                text.contains(word),
                "an alert uses {word}, which is not exported"
            );
        }
    }
    eventually(
        "VolumeSnapshotClass created",
        Duration::from_secs(30),
        || async {
            let out = cluster
                .kubectl(&["get", "volumesnapshotclass", "csi-mind-ustor"])
                .ok()?;
            out.status.success().then_some(())
        },
    )
    .await;
}
