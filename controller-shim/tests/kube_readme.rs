//! The Kubernetes glue against a real kube-apiserver (Kubernetes 1.20, built by
//! tests/kube/build-apiserver), started by the test: every manifest of the README, applied as
//! the README writes it, with the glue and its webhook running. What the README says is
//! admitted is admitted and stamped; what it says is refused is refused.
//! Ignored in a plain `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use controller_shim::kube::crd::{MindUstorStorageClass, Phase};
use controller_shim::kube::stamp;
use controller_shim::kube::webhook::rules;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::Api;

use common::*;

/// The migration account the README names for ReadWriteMany block claims.
const VIRTUALIZATION: &str = "system:serviceaccount:d8-virtualization:virtualization-controller";

/// Every `kubectl apply -f - <<EOF` of the README, in order: the here-document, dedented by
/// the command's own indentation.
fn readme_manifests() -> Vec<String> {
    let readme = include_str!("../../README.md");
    let mut found = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        if !line.trim_end().ends_with("apply -f - <<EOF") {
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let mut text = String::new();
        for body in lines.by_ref() {
            if body.trim() == "EOF" {
                break;
            }
            text.push_str(body.get(indent..).unwrap_or_default().trim_end());
            text.push('\n');
        }
        found.push(text);
    }
    found
}

/// external-snapshotter's own CRDs, of the version deploy/ ships (`tests/kube/run` unpacks
/// them from ../shared/third-party and names the directory).
fn install_snapshot_crds(cluster: &testkit::kube_cluster::KubeCluster) {
    let dir = std::env::var("USTOR_SNAPSHOT_CRDS")
        .unwrap_or_else(|_| panic!("USTOR_SNAPSHOT_CRDS is not set: run this with tests/kube/run"));
    // Their CEL rules (x-kubernetes-validations) are newer than the 1.20 schema: the API
    // server drops what it does not know, the rest is served.
    kubectl_ok(cluster, &["apply", "--validate=false", "-f", &dir]);
    kubectl_ok(
        cluster,
        &[
            "wait",
            "--for=condition=established",
            "--timeout=60s",
            "crd/volumesnapshots.snapshot.storage.k8s.io",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn every_manifest_of_the_readme_applies_as_written() {
    let mut cluster = cluster_with_namespace();
    install_snapshot_crds(&cluster);
    // Pods need the namespace's default service account and its token, which
    // kube-controller-manager makes.
    cluster.start_controller_manager().unwrap();
    eventually(
        "the default service account's token",
        std::time::Duration::from_secs(60),
        || async {
            let out = cluster
                .kubectl(&[
                    "get",
                    "serviceaccount",
                    "default",
                    "-o",
                    "jsonpath={.secrets[0].name}",
                ])
                .ok()?;
            (out.status.success() && !out.stdout.is_empty()).then_some(())
        },
    )
    .await;
    let client = client(&cluster).await;
    let (ca, crt, key, _pki) = make_certificate("readme");
    put_tls(&cluster, &crt, &key);
    let (_glue, _base) = glue_with_webhook(&cluster, client.clone(), &ca);
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());

    let manifests = readme_manifests();
    let named = |name: &str| {
        manifests
            .iter()
            // An object's own name (metadata's, two spaces in), not a reference to one.
            .filter(|m| m.lines().any(|l| l == format!("  name: {name}")))
            .count()
    };
    for name in [
        "main",
        "ustor-nbd",
        "data",
        "data-snapshot",
        "data-clone",
        "raw",
        "vm-disk",
    ] {
        assert_eq!(
            named(name),
            1,
            "the README has no one manifest named {name}"
        );
    }
    let mut block_claims = 0;
    for manifest in &manifests {
        if manifest.contains("name: vm-disk") {
            // Only the virtualization module's accounts make ReadWriteMany block claims.
            let refused = create_as(&cluster, "admin", manifest).expect("admitted from admin");
            assert!(refused.contains("virtualization module"), "{refused}");
            assert_eq!(create_as(&cluster, VIRTUALIZATION, manifest), None);
            continue;
        }
        if manifest.contains("ReadWriteOncePod") {
            // The 1.20 API server knows no ReadWriteOncePod (1.22+): the claim goes through the
            // webhook's own rules, the rest (the pod) through the API server.
            let mut rest = Vec::new();
            for document in manifest.split("\n---\n") {
                if !document.contains("kind: PersistentVolumeClaim") {
                    rest.push(document);
                    continue;
                }
                let mut claim: PersistentVolumeClaim = serde_yaml_ng::from_str(document).unwrap();
                let migration = ["system:serviceaccount:d8-virtualization:*".to_owned()];
                assert_eq!(rules::review_claim(&claim, "admin", &migration), Ok(()));
                let spec = claim.spec.as_mut().unwrap();
                assert_eq!(spec.volume_mode.as_deref(), Some("Block"));
                spec.access_modes = Some(vec!["ReadWriteOnce".into()]);
                let refused = rules::review_claim(&claim, "admin", &migration).unwrap_err();
                assert!(refused.contains("ReadWriteOncePod"), "{refused}");
                block_claims += 1;
            }
            apply(&cluster, &rest.join("\n---\n"));
            continue;
        }
        apply(&cluster, manifest);
        if manifest.contains("kind: MindUstorStorageClass") {
            // Claims are reviewed against the StorageClass the glue makes from it.
            wait_phase(&classes, "ustor-nbd", Phase::Created).await;
        }
    }

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    assert_eq!(block_claims, 1, "the README's raw block claim");
    for name in ["data", "data-restored", "data-clone", "vm-disk"] {
        let claim = claims.get(name).await.unwrap();
        let annotations = claim.metadata.annotations.unwrap_or_default();
        assert!(
            annotations.contains_key(stamp::ANNOTATION),
            "{name}: not stamped by the webhook: {annotations:?}"
        );
    }
    let source = |name: &str| {
        let claims = claims.clone();
        let name = name.to_owned();
        async move {
            let spec = claims.get(&name).await.unwrap().spec.unwrap();
            spec.data_source.map(|s| (s.kind, s.name))
        }
    };
    assert_eq!(
        source("data-restored").await,
        Some(("VolumeSnapshot".into(), "data-snapshot".into()))
    );
    assert_eq!(
        source("data-clone").await,
        Some(("PersistentVolumeClaim".into(), "data".into()))
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let reader = pods.get("raw-reader").await.unwrap().spec.unwrap();
    assert_eq!(
        reader.containers[0].volume_devices.as_ref().map(Vec::len),
        Some(1)
    );
    assert!(pods.get("app").await.is_ok());
    kubectl_ok(&cluster, &["get", "volumesnapshot", "data-snapshot"]);
}
