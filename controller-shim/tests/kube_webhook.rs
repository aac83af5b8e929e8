//! The Kubernetes glue against a real kube-apiserver and kube-controller-manager (Kubernetes
//! 1.20, built by tests/kube/build-apiserver), started by each test: the admission webhook: what the guide forbids is refused, over TLS with a renewed certificate.
//! Ignored in a plain `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use controller_shim::kube::crd::MindUstorStorageConnection;
use controller_shim::kube::crd::{MindUstorStorageClass, Phase};
use controller_shim::kube::stamp;
use controller_shim::kube::{Glue, Settings};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::Api;
use std::time::Duration;
use testkit::kube_cluster::KubeCluster;
use testkit::tls::TestPki;

use common::*;

/// A CA and a serving certificate for 127.0.0.1 signed by it (testkit's PKI): the CA's PEM,
/// the certificate and key files as `kubectl create secret tls` takes them, and the PKI that
/// holds them.
fn make_certificate(tag: &str) -> (Vec<u8>, String, String, TestPki) {
    let pki = TestPki::new(&format!("{tag}-ca")).unwrap();
    let path = |name: &str| pki.file(name).display().to_string();
    (
        std::fs::read(pki.file("ca-cert.pem")).unwrap(),
        path("server-cert.pem"),
        path("server-key.pem"),
        pki,
    )
}

/// deploy/webhook.yaml's webhook configurations, each webhook pointed at its path under
/// `base` (`https://127.0.0.1:<port>`) with `ca`: the rules under test are the shipped ones.
fn webhook_configuration(base: &str, ca: &[u8]) -> String {
    let shipped = include_str!("../../deploy/webhook.yaml");
    let configs = shipped
        .split("\n---\n")
        .filter(|d| d.contains("WebhookConfiguration"))
        .map(|document| {
            let mut config: serde_json::Value = serde_yaml_ng::from_str(document).unwrap();
            for hook in config["webhooks"].as_array_mut().unwrap() {
                let path = hook["clientConfig"]["service"]["path"].as_str().unwrap();
                hook["clientConfig"] = serde_json::json!({
                    "url": format!("{base}{path}"),
                    // ByteString serializes as base64, as caBundle is written.
                    "caBundle": k8s_openapi::ByteString(ca.to_vec()),
                });
            }
            config
        })
        .collect::<Vec<_>>();
    serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": configs }).to_string()
}

/// The webhook's serving certificate, as the operator puts it (`kubectl create secret tls`).
fn put_tls(cluster: &KubeCluster, crt: &str, key: &str) {
    let yaml = cluster
        .kubectl(&[
            "create",
            "secret",
            "tls",
            "webhook-tls",
            "-n",
            "d8-csi-mind-ustor",
            "--cert",
            crt,
            "--key",
            key,
            "--dry-run=client",
            "-o",
            "yaml",
        ])
        .unwrap();
    apply(cluster, &String::from_utf8_lossy(&yaml.stdout));
}

/// The glue with the webhook on a free port (the migration users the shipped default, the
/// test's admin the controller), and the webhook configuration pointing at it: its base URL.
fn glue_with_webhook(cluster: &KubeCluster, client: kube::Client, ca: &[u8]) -> (Glue, String) {
    use controller_shim::kube::webhook::WebhookSettings;
    let port = testkit::free_port().unwrap();
    let glue = Glue::start(
        client,
        Settings {
            webhook: Some(WebhookSettings {
                listen: ([127, 0, 0, 1], port).into(),
                cert_secret: "webhook-tls".into(),
                migration_users: vec!["system:serviceaccount:d8-virtualization:*".into()],
                // The glue writes with the test's admin user.
                controller_user: "admin".into(),
            }),
            ..test_settings()
        },
    );
    let base = format!("https://127.0.0.1:{port}");
    apply(cluster, &webhook_configuration(&base, ca));
    (glue, base)
}

/// `kubectl create -f -` of `yaml` as `user` (with admin rights, so only the webhook can
/// refuse): the refusal's message, or None when created.
fn create_as(cluster: &KubeCluster, user: &str, yaml: &str) -> Option<String> {
    let out = cluster
        .kubectl_stdin(
            &[
                "create",
                "--as",
                user,
                "--as-group",
                "system:masters",
                "-f",
                "-",
            ],
            yaml,
        )
        .unwrap();
    (!out.status.success()).then(|| String::from_utf8_lossy(&out.stderr).into_owned())
}

fn claim_yaml(name: &str, class: &str, mode: &str, volume_mode: &str) -> String {
    format!(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {name}\n  namespace: default\n\
         spec:\n  storageClassName: {class}\n  accessModes: [{mode}]\n  volumeMode: {volume_mode}\n\
         \x20 resources:\n    requests:\n      storage: 1Gi\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn the_webhook_refuses_what_the_guide_forbids_over_tls_with_a_renewed_certificate() {
    let cluster = cluster_with_namespace();
    let (ca, crt, key, _pki) = make_certificate("first");
    put_tls(&cluster, &crt, &key);
    let client = client(&cluster).await;
    let (_glue, url) = glue_with_webhook(&cluster, client.clone(), &ca);
    apply(&cluster, &connection_yaml("main"));
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());
    create_class(&classes, "fast", "main").await;
    wait_phase(&classes, "fast", Phase::Created).await;

    // StorageClasses of the driver: the controller's only.
    let ours = format!(
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: handmade\nprovisioner: {}\n",
        csi_common::DRIVER_NAME
    );
    let refused = eventually("the webhook answers", Duration::from_secs(30), || async {
        create_as(&cluster, "intruder", &ours)
    })
    .await;
    assert!(refused.contains("MindUstorStorageClass"), "{refused}");
    let other = "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: other\nprovisioner: example.com/other\n";
    assert_eq!(create_as(&cluster, "intruder", other), None);

    // Claims: the guide's modes, and what to use instead.
    let virt = "system:serviceaccount:d8-virtualization:virtualization-controller";
    for (name, mode, volume_mode, user, says) in [
        ("rwo-fs", "ReadWriteOnce", "Filesystem", "alice", None),
        (
            "rwx-fs",
            "ReadWriteMany",
            "Filesystem",
            "alice",
            Some("volumeMode: Block"),
        ),
        (
            "rox-fs",
            "ReadOnlyMany",
            "Filesystem",
            "alice",
            Some("volumeMode: Block"),
        ),
        (
            "rwo-block",
            "ReadWriteOnce",
            "Block",
            "alice",
            Some("ReadWriteOncePod"),
        ),
        (
            "rox-block",
            "ReadOnlyMany",
            "Block",
            "alice",
            Some("ReadWriteOncePod"),
        ),
        (
            "rwx-block",
            "ReadWriteMany",
            "Block",
            "alice",
            Some("virtualization module"),
        ),
        ("rwx-block-vm", "ReadWriteMany", "Block", virt, None),
        (
            "rwx-fs-vm",
            "ReadWriteMany",
            "Filesystem",
            virt,
            Some("volumeMode: Block"),
        ),
    ] {
        let result = create_as(&cluster, user, &claim_yaml(name, "fast", mode, volume_mode));
        match says {
            None => assert_eq!(result, None, "{name} must be admitted"),
            Some(text) => {
                let err = result.unwrap_or_else(|| panic!("{name} must be refused"));
                assert!(err.contains(text), "{name}: {err}");
            }
        }
    }
    // Claims of other storage are not ours to judge.
    assert_eq!(
        create_as(
            &cluster,
            "alice",
            &claim_yaml("elsewhere", "other", "ReadWriteMany", "Filesystem")
        ),
        None
    );
    // What it admits for our StorageClasses it stamps; claims of other storage it leaves.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    for (name, stamped) in [
        ("rwo-fs", true),
        ("rwx-block-vm", true),
        ("elsewhere", false),
    ] {
        let claim = claims.get(name).await.unwrap();
        let annotations = claim.metadata.annotations.unwrap_or_default();
        assert_eq!(
            annotations.contains_key(stamp::ANNOTATION),
            stamped,
            "{name}: {annotations:?}"
        );
    }

    // The fixed fields stay fixed; metadata does not.
    let err = merge_patch(
        &classes,
        "fast",
        serde_json::json!({ "spec": { "pool": "other" } }),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("cannot be changed"), "{err}");
    merge_patch(
        &classes,
        "fast",
        serde_json::json!({ "metadata": { "labels": { "team": "a" } } }),
    )
    .await
    .unwrap();
    let connections: Api<MindUstorStorageConnection> = Api::all(client.clone());
    let move_connection = || async {
        merge_patch(
            &connections,
            "main",
            serde_json::json!({ "spec": { "controlPlane": { "address": "https://elsewhere:23004" } } }),
        )
        .await
        .unwrap_err()
        .to_string()
    };
    let err = move_connection().await;
    assert!(err.contains("cannot be changed"), "{err}");

    // A renewed certificate from another CA is served without a restart.
    let (ca2, crt2, key2, _pki2) = make_certificate("second");
    put_tls(&cluster, &crt2, &key2);
    apply(&cluster, &webhook_configuration(&url, &ca2));
    // (The resources' webhook fails closed: until the new certificate is served, the change
    // is refused for a TLS error instead.)
    eventually(
        "the new certificate served",
        Duration::from_secs(30),
        || async {
            move_connection()
                .await
                .contains("cannot be changed")
                .then_some(())
        },
    )
    .await;
}
