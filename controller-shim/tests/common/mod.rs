//! Helpers of the controller's tests: the in-process CSI controller (every suite), and for
//! the Kubernetes glue tests (`tests/kube_*.rs`) clients of the test cluster, applying
//! manifests, waiting for a state, the glue's test settings.

// Each test binary uses its own part of these.
#![allow(dead_code)]
#![allow(clippy::unwrap_used)] // a test fails by panicking

use controller_shim::backend::ustor::login::Timing;
use controller_shim::backend::Backend;
use controller_shim::kube::crd::MindUstorStorageConnection;
use controller_shim::kube::crd::{
    FsType, MindUstorStorageClass, MindUstorStorageClassSpec, Phase, ReclaimPolicy,
    VolumeBindingMode,
};
use controller_shim::kube::{Glue, Settings};
use controller_shim::provision::Cluster;
use csi_proto::csi::controller_client::ControllerClient;
use kube::api::{Api, PostParams};
use kube::Client;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use testkit::kube_cluster::KubeCluster;
use testkit::tls::TestPki;
pub use testkit::wait::eventually;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

pub async fn client(cluster: &KubeCluster) -> Client {
    client_as(cluster, None).await
}

/// A client of the cluster's admin, or of the user it impersonates.
pub async fn client_as(cluster: &KubeCluster, user: Option<&str>) -> Client {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .try_init();
    let mut kubeconfig = kube::config::Kubeconfig::read_from(&cluster.kubeconfig).unwrap();
    if let Some(user) = user {
        let auth = kubeconfig.auth_infos[0].auth_info.as_mut().unwrap();
        auth.impersonate = Some(user.to_owned());
        auth.impersonate_groups = Some(vec!["system:serviceaccounts".into()]);
    }
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

/// Short pauses so the login rules can be watched at work; plain http for the in-repo uStor.
pub fn test_settings() -> Settings {
    Settings {
        snapshot_api_poll: Duration::from_secs(1),
        allow_insecure_http: true,
        login_timing: Timing {
            after_unreachable: Duration::from_secs(1),
            keepalive: Duration::from_secs(3600),
        },
        ..Settings::default()
    }
}

/// `kubectl apply -f -` of `yaml`; panics with kubectl's words when it fails.
pub fn apply(cluster: &KubeCluster, yaml: &str) {
    if let Err(e) = cluster.kubectl_tool().ok(&["apply", "-f", "-"], Some(yaml)) {
        panic!("{e}");
    }
}

/// Installs the CRDs as an operator would, from the committed file, and waits until served.
pub fn install_crds(cluster: &KubeCluster) {
    let crds = include_str!("../../../deploy/crds.yaml");
    apply(cluster, crds);
    kubectl_ok(
        cluster,
        &[
            "wait",
            "--for=condition=established",
            "--timeout=60s",
            "crd/mindustorstorageconnections.storage.deckhouse.io",
            "crd/mindustorstorageclasses.storage.deckhouse.io",
        ],
    );
}

/// A test cluster with the CRDs served and the driver's namespace in it.
pub fn cluster_with_namespace() -> KubeCluster {
    let cluster = KubeCluster::start().unwrap();
    install_crds(&cluster);
    apply(&cluster, include_str!("../../../deploy/namespace.yaml"));
    cluster
}

/// Nothing writes `name` again while nothing changes: its resource version stays `version`.
pub async fn assert_not_rewritten<K>(api: &Api<K>, name: &str, version: Option<String>)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        api.get(name).await.unwrap().meta().resource_version,
        version,
        "status written again although nothing changed"
    );
}

/// A JSON merge patch of `name`, as `kubectl patch --type merge` sends it.
pub async fn merge_patch<K>(api: &Api<K>, name: &str, patch: serde_json::Value) -> kube::Result<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(patch),
    )
    .await
}

/// `kubectl` with `args`; panics with kubectl's words when it fails.
pub fn kubectl_ok(cluster: &KubeCluster, args: &[&str]) {
    if let Err(e) = cluster.kubectl_tool().ok(args, None) {
        panic!("{e}");
    }
}

pub fn connection_yaml(name: &str) -> String {
    format!(
        "apiVersion: storage.deckhouse.io/v1alpha1\nkind: MindUstorStorageConnection\nmetadata:\n  name: {name}\n\
         spec:\n  controlPlane:\n    address: https://ustor.example:23004\n    credentialsSecretName: creds\n\
         \x20 dataPlane:\n    etcdAddresses: [\"https://10.0.0.1:23000\"]\n    osdNetwork: 10.0.0.0/24\n\
         \x20   tlsSecretName: tls\n"
    )
}

pub fn class_spec(connection: &str, pool: &str) -> MindUstorStorageClassSpec {
    MindUstorStorageClassSpec {
        connection_name: connection.into(),
        pool: pool.into(),
        fs_type: FsType::Ext4,
        reclaim_policy: ReclaimPolicy::Delete,
        volume_binding_mode: VolumeBindingMode::WaitForFirstConsumer,
    }
}

pub async fn create_class(api: &Api<MindUstorStorageClass>, name: &str, connection: &str) {
    let class = MindUstorStorageClass::new(name, class_spec(connection, "data"));
    api.create(&PostParams::default(), &class).await.unwrap();
}

/// The status of a MindUstorStorageClass once its phase is `phase`.
pub async fn wait_phase(
    api: &Api<MindUstorStorageClass>,
    name: &str,
    phase: Phase,
) -> MindUstorStorageClass {
    eventually(
        &format!("{name} in phase {phase:?}"),
        Duration::from_secs(60),
        || async {
            let class = api.get(name).await.ok()?;
            let status = class.status.as_ref()?;
            (status.phase == Some(phase)).then_some(class)
        },
    )
    .await
}

/// The VolumeSnapshotClass CRD of the external-snapshotter, enough to serve the API (its
/// group is protected, hence the approval annotation).
pub fn snapshot_class_crd() -> String {
    stand_in_crd(
        "snapshot.storage.k8s.io",
        "v1",
        "VolumeSnapshotClass",
        "volumesnapshotclasses",
        "Cluster",
    )
    .replace(
        "metadata:\n",
        "metadata:\n  annotations:\n    api-approved.kubernetes.io: \"unapproved, the glue tests' stand-in for external-snapshotter's CRD\"\n",
    )
}

/// The CSI controller over `backend`, in process on `dir/csi.sock`, as the sidecars reach it:
/// its client and its task (abort it to stop the server). `metrics` is where it serves
/// `/metrics`, `cluster` what checks a node before ControllerPublish and the claim of a
/// ReadWriteMany block volume.
/// The local backend's export server (nbdkit behind the gate) on `listen`, until aborted.
pub fn start_exports(
    backend: &controller_shim::backend::local::LocalBackend,
    listen: std::net::SocketAddr,
) -> JoinHandle<()> {
    tokio::spawn(
        controller_shim::exports::ExportServer {
            backend: backend.clone(),
            listen,
            metrics: Default::default(),
        }
        .supervise(),
    )
}

pub async fn serve_controller(
    dir: &Path,
    backend: Arc<dyn Backend>,
    cluster_id: &str,
    metrics: Option<tokio::net::TcpListener>,
    cluster: Option<Cluster>,
) -> (ControllerClient<Channel>, JoinHandle<()>) {
    let socket = dir.join("csi.sock");
    let server = {
        let socket = socket.clone();
        let cluster_id = cluster_id.to_owned();
        tokio::spawn(async move {
            controller_shim::server::serve(
                &socket,
                backend,
                cluster_id,
                metrics,
                Default::default(),
                cluster,
                std::future::pending(),
            )
            .await
            .unwrap();
        })
    };
    let channel = testkit::csi::wait_connect(&socket, Duration::from_secs(10)).await;
    (ControllerClient::new(channel), server)
}

/// The CSI controller over `backend`, checking nodes and claims through the glue (cluster
/// id `k8s`).
pub async fn serve_csi(
    backend: Arc<dyn Backend>,
    glue: &Glue,
    dir: &Path,
) -> (ControllerClient<Channel>, JoinHandle<()>) {
    serve_controller(dir, backend, "k8s", None, Some(glue.cluster())).await
}

/// A CRD that only serves `kind` (no schema), standing in for another project's.
pub fn stand_in_crd(group: &str, version: &str, kind: &str, plural: &str, scope: &str) -> String {
    format!(
        "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata:\n  name: {plural}.{group}\n\
         spec:\n  group: {group}\n  names:\n    kind: {kind}\n    plural: {plural}\n    singular: {singular}\n\
         \x20 scope: {scope}\n  versions:\n  - name: {version}\n    served: true\n    storage: true\n\
         \x20   schema:\n      openAPIV3Schema:\n        type: object\n        x-kubernetes-preserve-unknown-fields: true\n",
        singular = kind.to_ascii_lowercase()
    )
}

/// A CSINode as kubelet's registration creates it for a node running our node service.
pub fn register_node(cluster: &KubeCluster, name: &str) {
    apply(
        cluster,
        &testkit::kube_cluster::csinode_yaml(name, &[csi_common::TOPOLOGY_KEY], None),
    );
}

pub const TLS: [(&str, &str); 5] = [
    ("ca.crt", "ca"),
    ("client.crt", "crt"),
    ("client.key", "key"),
    ("etcd-client.crt", "ecrt"),
    ("etcd-client.key", "ekey"),
];

/// The connection once `accept` says its status is the awaited one.
pub async fn wait_connection(
    api: &Api<MindUstorStorageConnection>,
    name: &str,
    what: &str,
    accept: impl Fn(&controller_shim::kube::crd::ConnectionStatus) -> bool,
) -> controller_shim::kube::crd::ConnectionStatus {
    eventually(
        &format!("{name}: {what}"),
        Duration::from_secs(30),
        || async {
            let status = api.get(name).await.ok()?.status?;
            accept(&status).then_some(status)
        },
    )
    .await
}

pub fn reason_has(status: &controller_shim::kube::crd::ConnectionStatus, text: &str) -> bool {
    status.reason.as_deref().is_some_and(|r| r.contains(text))
}

/// A CA and a serving certificate for 127.0.0.1 signed by it (testkit's PKI): the CA's PEM,
/// the certificate and key files as `kubectl create secret tls` takes them, and the PKI that
/// holds them.
pub fn make_certificate(tag: &str) -> (Vec<u8>, String, String, TestPki) {
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
pub fn webhook_configuration(base: &str, ca: &[u8]) -> String {
    let shipped = include_str!("../../../deploy/webhook.yaml");
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
pub fn put_tls(cluster: &KubeCluster, crt: &str, key: &str) {
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
pub fn glue_with_webhook(cluster: &KubeCluster, client: kube::Client, ca: &[u8]) -> (Glue, String) {
    use controller_shim::kube::webhook::WebhookSettings;
    let port = testkit::free_port().unwrap();
    let glue = Glue::start(
        client,
        Settings {
            webhook: Some(WebhookSettings {
                listen: ([127, 0, 0, 1], port).into(),
                cert_secret: "webhook-tls".into(),
                issue: None,
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
pub fn create_as(cluster: &KubeCluster, user: &str, yaml: &str) -> Option<String> {
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

/// A `username`/`password` directory under `dir` for the uStor user `csi`, as the
/// controller's mounted Secret.
pub fn ustor_credentials(dir: &Path, password: &str) -> std::path::PathBuf {
    let creds = dir.join("credentials");
    std::fs::create_dir_all(&creds).unwrap();
    std::fs::write(creds.join("username"), "csi").unwrap();
    std::fs::write(creds.join("password"), password).unwrap();
    creds
}

/// The uStor backend (pool `data`) of the management API at `url`, logging in with `creds`.
pub fn ustor_backend(
    url: &str,
    creds: &Path,
) -> controller_shim::backend::ustor::backend::UstorBackend {
    use controller_shim::backend::ustor::{api::UstorApi, credentials::CredentialsDir};
    let api = UstorApi::new(
        url,
        None,
        Arc::new(CredentialsDir::new(creds)),
        Timing::default(),
        Arc::new(std::time::Instant::now),
    )
    .unwrap();
    controller_shim::backend::ustor::backend::UstorBackend::new(Arc::new(api), "data")
}
