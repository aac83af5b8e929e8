//! The Kubernetes glue against a real kube-apiserver and kube-controller-manager (Kubernetes
//! 1.20, built by tests/kube/build-apiserver), started by each test: the admission webhook: what the guide forbids is refused, over TLS with a renewed certificate; claims it admits are stamped, and a ReadWriteMany block volume is made for a stamped claim only.
//! Ignored in a plain `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use controller_shim::kube::crd::MindUstorStorageConnection;
use controller_shim::kube::crd::{MindUstorStorageClass, Phase};
use controller_shim::kube::key::KEY_SECRET;
use controller_shim::kube::stamp;
use controller_shim::kube::{Glue, Settings};
use controller_shim::provision::claims::{CLAIM_NAME, CLAIM_NAMESPACE};
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::CreateVolumeRequest;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret};
use kube::api::Api;
use std::sync::Arc;
use std::time::Duration;
use testkit::csi::{block_capability, create_volume_request, created_volume};
use tonic::Code;

use common::*;

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
    let move_connection = || moved_connection_error(&connections);
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

/// The admission stamp of claim `default/name`, if it has one.
async fn stamp_of(claims: &Api<PersistentVolumeClaim>, name: &str) -> Option<String> {
    claims
        .get(name)
        .await
        .unwrap()
        .metadata
        .annotations?
        .get(stamp::ANNOTATION)
        .cloned()
}

/// CreateVolume of a ReadWriteMany block volume for claim `default/claim`, as
/// external-provisioner with --extra-create-metadata sends it.
fn rwx_block_for(claim: &str) -> CreateVolumeRequest {
    let mut request = create_volume_request(
        &format!("pvc-{claim}"),
        1 << 20,
        block_capability(Mode::MultiNodeMultiWriter),
    );
    request.parameters.extend([
        (CLAIM_NAMESPACE.to_owned(), "default".to_owned()),
        (CLAIM_NAME.to_owned(), claim.to_owned()),
    ]);
    request
}

/// Every way past the webhook ends at CreateVolume: a ReadWriteMany block volume is made
/// only for a claim the webhook stamped, for what the claim is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn a_read_write_many_block_volume_is_made_only_for_a_claim_the_webhook_admitted() {
    use controller_shim::backend::local::LocalBackend;
    let cluster = cluster_with_namespace();
    let (ca, crt, key, _pki) = make_certificate("stamps");
    put_tls(&cluster, &crt, &key);
    let client = client(&cluster).await;
    let (glue, base) = glue_with_webhook(&cluster, client.clone(), &ca);
    apply(&cluster, &connection_yaml("main"));
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());
    create_class(&classes, "fast", "main").await;
    wait_phase(&classes, "fast", Phase::Created).await;
    // The controller made its key.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "d8-csi-mind-ustor");
    eventually("the controller key", Duration::from_secs(30), || async {
        secrets.get_opt(KEY_SECRET).await.ok().flatten()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let backend = LocalBackend::open(&dir.path().join("store"), "127.0.0.1:10809").unwrap();
    let (mut csi, server) = serve_csi(Arc::new(backend), &glue, dir.path()).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    let virt = "system:serviceaccount:d8-virtualization:virtualization-controller";

    // The virtualization module's claim is stamped, and gets its volume.
    let vm_disk = claim_yaml("vm-disk", "fast", "ReadWriteMany", "Block");
    eventually("the webhook answers", Duration::from_secs(30), || async {
        create_as(
            &cluster,
            "alice",
            &claim_yaml("probe", "fast", "ReadWriteMany", "Block"),
        )
        .filter(|e| e.contains("virtualization module"))
    })
    .await;
    assert_eq!(create_as(&cluster, virt, &vm_disk), None);
    let vm_stamp = stamp_of(&claims, "vm-disk").await.expect("vm-disk stamped");
    created_volume(&mut csi, rwx_block_for("vm-disk")).await;
    // Another user's claim is stamped too (the 1.20 API server knows no ReadWriteOncePod).
    assert_eq!(
        create_as(
            &cluster,
            "alice",
            &claim_yaml("pod-fs", "fast", "ReadWriteOnce", "Filesystem")
        ),
        None
    );
    assert!(stamp_of(&claims, "pod-fs").await.is_some());

    let checker = csi.clone();
    let refused = |claim: &'static str, says: &'static str| {
        let mut csi = checker.clone();
        async move {
            let err = csi.create_volume(rwx_block_for(claim)).await.unwrap_err();
            assert_eq!(err.code(), Code::FailedPrecondition, "{claim}: {err:?}");
            assert!(err.message().contains(says), "{claim}: {}", err.message());
        }
    };

    // The webhook down (it fails open): alice's claims get through, unstamped or with a
    // stamp copied from the virtualization module's claim, and get no volume.
    let dead = format!("https://127.0.0.1:{}", testkit::free_port().unwrap());
    apply(&cluster, &webhook_configuration(&dead, &ca));
    eventually("the webhook bypassed", Duration::from_secs(30), || async {
        create_as(
            &cluster,
            "alice",
            &claim_yaml("sneaky", "fast", "ReadWriteMany", "Block"),
        )
        .is_none()
        .then_some(())
    })
    .await;
    assert_eq!(stamp_of(&claims, "sneaky").await, None);
    let copied = claim_yaml("copycat", "fast", "ReadWriteMany", "Block").replace(
        "  namespace: default\n",
        &format!(
            "  namespace: default\n  annotations:\n    {}: {vm_stamp}\n",
            stamp::ANNOTATION
        ),
    );
    assert_eq!(create_as(&cluster, "alice", &copied), None);
    apply(&cluster, &webhook_configuration(&base, &ca));
    refused("sneaky", "was not admitted").await;
    refused("copycat", "is not this claim's").await;

    // A claim made before its StorageClass existed was not reviewed: no volume either.
    assert_eq!(
        create_as(
            &cluster,
            "alice",
            &claim_yaml("early", "later", "ReadWriteMany", "Block")
        ),
        None
    );
    create_class(&classes, "later", "main").await;
    wait_phase(&classes, "later", Phase::Created).await;
    refused("early", "was not admitted").await;
    // A MindUstorStorageClass whose StorageClass is not made yet is ours already.
    create_class(&classes, "stranded", "nowhere").await;
    wait_phase(&classes, "stranded", Phase::Failed).await;
    let err = create_as(
        &cluster,
        "alice",
        &claim_yaml("waiting", "stranded", "ReadWriteMany", "Block"),
    )
    .expect("refused before its StorageClass exists");
    assert!(err.contains("virtualization module"), "{err}");

    // Updates are reviewed: alice's leave the claim unstamped (and are not stopped), the
    // virtualization module's stamp it, and then it gets its volume.
    let touch = |user: &str, claim: &str, n: u32| {
        cluster
            .kubectl(&[
                "annotate",
                "--overwrite",
                "--as",
                user,
                "--as-group",
                "system:masters",
                "-n",
                "default",
                &format!("pvc/{claim}"),
                &format!("touched={n}"),
            ])
            .unwrap()
    };
    assert!(touch("alice", "sneaky", 1).status.success());
    assert_eq!(stamp_of(&claims, "sneaky").await, None);
    refused("sneaky", "was not admitted").await;
    assert!(touch(virt, "sneaky", 2).status.success());
    assert!(
        stamp_of(&claims, "sneaky").await.is_some(),
        "stamped on update"
    );
    created_volume(&mut csi, rwx_block_for("sneaky")).await;
    // A stamp removed by an update of alice's stays removed.
    let out = cluster
        .kubectl(&[
            "annotate",
            "--as",
            "alice",
            "--as-group",
            "system:masters",
            "-n",
            "default",
            "pvc/vm-disk",
            &format!("{}-", stamp::ANNOTATION),
        ])
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    refused("vm-disk", "was not admitted").await;

    // Without --extra-create-metadata there is no claim to check.
    let mut unnamed = rwx_block_for("vm-disk");
    unnamed.parameters.clear();
    let err = csi.create_volume(unnamed).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("--extra-create-metadata"),
        "{}",
        err.message()
    );
    server.abort();
}

/// The glue serving the webhook on `port` from the Secret `secret`, which it issues itself
/// with `validity`, for 127.0.0.1 (the test's admin is the controller).
fn issuing(port: u16, secret: &str, validity: Duration) -> Settings {
    use controller_shim::kube::webhook::issuer::IssueSettings;
    use controller_shim::kube::webhook::WebhookSettings;
    Settings {
        webhook: Some(WebhookSettings {
            listen: ([127, 0, 0, 1], port).into(),
            cert_secret: secret.into(),
            issue: Some(IssueSettings {
                names: vec!["127.0.0.1".into()],
                validity,
                configuration: "d8-csi-mind-ustor".into(),
            }),
            migration_users: vec![],
            controller_user: "admin".into(),
        }),
        ..test_settings()
    }
}

/// Moving the connection `main` to another uStor cluster, which must be refused: the
/// refusal's message. The resources' webhook fails closed, so "cannot be changed" is its own
/// answer, and anything else (a TLS error, no caBundle) means the API server could not ask it.
async fn moved_connection_error(connections: &Api<MindUstorStorageConnection>) -> String {
    merge_patch(
        connections,
        "main",
        serde_json::json!({ "spec": { "controlPlane": { "address": "https://elsewhere:23004" } } }),
    )
    .await
    .unwrap_err()
    .to_string()
}

/// Whether the API server calls the webhook: it refuses to move the connection `main`.
async fn reaches_webhook(connections: &Api<MindUstorStorageConnection>) -> Option<()> {
    moved_connection_error(connections)
        .await
        .contains("cannot be changed")
        .then_some(())
}

/// The certificate the webhook on `port` serves, checked against `ca_pem` (a TLS handshake as
/// the API server makes one): its DER.
async fn served_certificate(port: u16, ca_pem: &[u8]) -> Result<Vec<u8>, String> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem) {
        roots
            .add(cert.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (_, session) = tls.get_ref();
    session
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .ok_or_else(|| "no certificate".into())
}

/// With `--webhook-cert-issue`, nobody makes a certificate: the controller makes its CA and
/// serving certificate, the configurations' caBundle trusts it, the API server calls the
/// webhook over TLS, and a renewal (a short validity here) is served without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn the_controller_issues_and_renews_the_webhook_certificate_itself() {
    let cluster = cluster_with_namespace();
    let client = client(&cluster).await;
    let port = testkit::free_port().unwrap();
    // No caBundle at all: the controller fills it in.
    apply(
        &cluster,
        &webhook_configuration(&format!("https://127.0.0.1:{port}"), b""),
    );
    let validity = Duration::from_secs(9);
    let _glue = Glue::start(client.clone(), issuing(port, "webhook-tls", validity));
    apply(&cluster, &connection_yaml("main"));
    let connections: Api<MindUstorStorageConnection> = Api::all(client.clone());
    let webhook_answers = || reaches_webhook(&connections);
    eventually(
        "the API server calls the webhook",
        Duration::from_secs(30),
        webhook_answers,
    )
    .await;

    let secrets: Api<Secret> = Api::namespaced(client.clone(), "d8-csi-mind-ustor");
    let secret = secrets.get("webhook-tls").await.unwrap();
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let data = secret.data.unwrap();
    for key in ["tls.crt", "tls.key", "ca.crt", "ca.key"] {
        assert!(data.contains_key(key), "the Secret lacks {key}");
    }
    let ca = data["ca.crt"].0.clone();
    let webhooks: Api<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration> =
        Api::all(client.clone());
    let mutating = webhooks.get("d8-csi-mind-ustor").await.unwrap();
    for hook in mutating.webhooks.unwrap() {
        assert_eq!(
            hook.client_config.ca_bundle.map(|b| b.0),
            Some(ca.clone()),
            "the mutating webhook {} does not trust the CA",
            hook.name
        );
    }

    // Renewed with a third of its validity left: another certificate, the same CA trusted.
    let first = eventually("a certificate served", Duration::from_secs(10), || async {
        served_certificate(port, &ca).await.ok()
    })
    .await;
    let renewed = eventually("a renewed certificate served", validity * 3, || async {
        served_certificate(port, &ca)
            .await
            .ok()
            .filter(|c| *c != first)
    })
    .await;
    assert_ne!(renewed, first);
    eventually(
        "the webhook still answers",
        Duration::from_secs(10),
        webhook_answers,
    )
    .await;
}

/// Installing the driver creates the webhook configurations with no caBundle, often after the
/// controller's first look (and so does deleting and applying them again): the controller
/// watches them and trusts its CA there at once. Without the watch it would wait for its next
/// look, a minute later, and meanwhile the API server could not call the webhook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn a_webhook_configuration_applied_after_the_start_is_trusted_at_once() {
    let cluster = cluster_with_namespace();
    let client = client(&cluster).await;
    let port = testkit::free_port().unwrap();
    // A long validity: nothing is due for renewal, so the next periodic look is a minute away.
    let _glue = Glue::start(
        client.clone(),
        issuing(port, "webhook-tls", Duration::from_secs(3600)),
    );
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "d8-csi-mind-ustor");
    eventually(
        "the controller's Secret",
        Duration::from_secs(30),
        || async { secrets.get_opt("webhook-tls").await.ok().flatten() },
    )
    .await;
    apply(&cluster, &connection_yaml("main"));
    // Past the round that follows the Secret's creation (a second later): only the watch can
    // trust the configuration now within the minute.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let base = format!("https://127.0.0.1:{port}");
    let connections: Api<MindUstorStorageConnection> = Api::all(client.clone());
    let webhook_answers = || reaches_webhook(&connections);
    for what in ["created", "deleted and created again"] {
        if what != "created" {
            kubectl_ok(
                &cluster,
                &[
                    "delete",
                    "validatingwebhookconfiguration,mutatingwebhookconfiguration",
                    "d8-csi-mind-ustor",
                ],
            );
        }
        apply(&cluster, &webhook_configuration(&base, b""));
        eventually(
            &format!("the API server calls the webhook (configuration {what})"),
            Duration::from_secs(15),
            webhook_answers,
        )
        .await;
    }
}

/// The CA is replaced without the API server ever meeting a certificate its caBundle does
/// not trust: the new CA joins the bundle first, then signs. Every call during the change
/// reaches the webhook. A Secret without `ca.key` (cert-manager's) is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn the_webhook_ca_is_replaced_without_a_failed_call_and_a_foreign_secret_is_left_alone() {
    let cluster = cluster_with_namespace();
    let client = client(&cluster).await;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "d8-csi-mind-ustor");
    let port = testkit::free_port().unwrap();
    apply(
        &cluster,
        &webhook_configuration(&format!("https://127.0.0.1:{port}"), b""),
    );
    // A short validity: the CA (ten of them) is due for replacement after 48 s.
    let validity = Duration::from_secs(6);

    // Someone else's Secret first: kept as it is, and its certificate served.
    let (ca, crt, key, _pki) = make_certificate("foreign");
    put_tls(&cluster, &crt, &key);
    let foreign = secrets.get("webhook-tls").await.unwrap();
    let glue = Glue::start(client.clone(), issuing(port, "webhook-tls", validity));
    let served = eventually(
        "the foreign certificate served",
        Duration::from_secs(30),
        || async { served_certificate(port, &ca).await.ok() },
    )
    .await;
    tokio::time::sleep(validity).await;
    let after = secrets.get("webhook-tls").await.unwrap();
    assert_eq!(
        after.data, foreign.data,
        "a Secret without ca.key was rewritten"
    );
    assert_eq!(served_certificate(port, &ca).await.unwrap(), served);
    drop(glue);
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Its own Secret: through a CA replacement, every call reaches the webhook.
    let _glue = Glue::start(client.clone(), issuing(port, "webhook-own", validity));
    apply(&cluster, &connection_yaml("main"));
    let connections: Api<MindUstorStorageConnection> = Api::all(client.clone());
    let webhook_answers = || async {
        moved_connection_error(&connections)
            .await
            .contains("cannot be changed")
    };
    eventually(
        "the API server calls the webhook",
        Duration::from_secs(30),
        || async { webhook_answers().await.then_some(()) },
    )
    .await;
    let ca_of = |s: &Secret| s.data.as_ref().unwrap()["ca.crt"].0.clone();
    let first_ca = ca_of(&secrets.get("webhook-own").await.unwrap());
    let started = std::time::Instant::now();
    let (mut calls, mut joined) = (0, false);
    while started.elapsed() < Duration::from_secs(70) {
        assert!(
            webhook_answers().await,
            "a call failed to reach the webhook after {:?} (call {calls})",
            started.elapsed()
        );
        calls += 1;
        let bundle = ca_of(&secrets.get("webhook-own").await.unwrap());
        if bundle.len() > first_ca.len() && bundle.ends_with(&first_ca) {
            joined = true;
        }
        // Replaced: the new CA signs what is served, and the old one is still trusted.
        if joined && served_certificate(port, &first_ca).await.is_err() {
            assert!(
                served_certificate(port, &bundle).await.is_ok(),
                "the served certificate is trusted by neither CA"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(joined, "the new CA never joined the bundle");
    assert!(
        served_certificate(port, &first_ca).await.is_err(),
        "the first CA still signs after {:?}",
        started.elapsed()
    );
    assert!(
        webhook_answers().await,
        "the webhook is not reached after the replacement"
    );
}
