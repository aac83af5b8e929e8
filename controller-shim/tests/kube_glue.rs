//! The Kubernetes glue against a real kube-apiserver and kube-controller-manager (Kubernetes
//! 1.20, built by tests/kube/build-apiserver), started by each test. Ignored in a plain
//! `cargo test`; `tests/kube/run` runs them.

#![allow(clippy::unwrap_used)] // a test fails by panicking

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use controller_shim::backend::ustor::login::Timing;
use controller_shim::kube::crd::MindUstorStorageConnection;
use controller_shim::kube::crd::{
    FsType, MindUstorStorageClass, MindUstorStorageClassSpec, Phase, ReclaimPolicy,
    VolumeBindingMode,
};
use controller_shim::kube::{Glue, Settings};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::Client;
use testkit::kube_cluster::KubeCluster;

async fn client(cluster: &KubeCluster) -> Client {
    client_as(cluster, None).await
}

/// A client of the cluster's admin, or of the user it impersonates.
async fn client_as(cluster: &KubeCluster, user: Option<&str>) -> Client {
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
fn test_settings() -> Settings {
    Settings {
        snapshot_api_poll: Duration::from_secs(1),
        allow_insecure_http: true,
        login_timing: Timing {
            after_refusal: REFUSAL_PAUSE,
            after_unreachable: Duration::from_secs(1),
            keepalive: Duration::from_secs(3600),
        },
        ..Settings::default()
    }
}

/// The 5-minute pause after a refused login, shortened.
const REFUSAL_PAUSE: Duration = Duration::from_secs(6);

/// `kubectl apply -f -` of `yaml`; panics with kubectl's words when it fails.
fn apply(cluster: &KubeCluster, yaml: &str) {
    let out = cluster.kubectl_stdin(&["apply", "-f", "-"], yaml).unwrap();
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Installs the CRDs as an operator would, from the committed file, and waits until served.
fn install_crds(cluster: &KubeCluster) {
    let crds = include_str!("../../deploy/crds.yaml");
    apply(cluster, crds);
    let out = cluster
        .kubectl(&[
            "wait",
            "--for=condition=established",
            "--timeout=60s",
            "crd/mindustorstorageconnections.storage.deckhouse.io",
            "crd/mindustorstorageclasses.storage.deckhouse.io",
        ])
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Polls `probe` until it gives a value, for at most `timeout`.
async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            started.elapsed() < timeout,
            "{what}: not within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn connection_yaml(name: &str) -> String {
    format!(
        "apiVersion: storage.deckhouse.io/v1alpha1\nkind: MindUstorStorageConnection\nmetadata:\n  name: {name}\n\
         spec:\n  controlPlane:\n    address: https://ustor.example:23004\n    credentialsSecretName: creds\n\
         \x20 dataPlane:\n    etcdAddresses: [\"https://10.0.0.1:23000\"]\n    osdNetwork: 10.0.0.0/24\n\
         \x20   tlsSecretName: tls\n"
    )
}

fn class_spec(connection: &str, pool: &str) -> MindUstorStorageClassSpec {
    MindUstorStorageClassSpec {
        connection_name: connection.into(),
        pool: pool.into(),
        fs_type: FsType::Ext4,
        reclaim_policy: ReclaimPolicy::Delete,
        volume_binding_mode: VolumeBindingMode::WaitForFirstConsumer,
    }
}

async fn create_class(api: &Api<MindUstorStorageClass>, name: &str, connection: &str) {
    let class = MindUstorStorageClass::new(name, class_spec(connection, "data"));
    api.create(&PostParams::default(), &class).await.unwrap();
}

/// What an operator's `kubectl edit` of the pool does.
async fn set_pool(api: &Api<MindUstorStorageClass>, name: &str, pool: &str) {
    let patch = Patch::Merge(serde_json::json!({ "spec": { "pool": pool } }));
    api.patch(name, &PatchParams::default(), &patch)
        .await
        .unwrap();
}

/// The status of a MindUstorStorageClass once its phase is `phase`.
async fn wait_phase(
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
fn snapshot_class_crd() -> String {
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
    assert_eq!(sc.provisioner, csi_proto::DRIVER_NAME);
    let params = sc.parameters.clone().unwrap();
    assert_eq!(params["pool"], "data");
    assert_eq!(params["connection"], "main");
    assert_eq!(params["csi.storage.k8s.io/fstype"], "ext4");
    assert_eq!(sc.reclaim_policy.as_deref(), Some("Delete"));
    assert_eq!(
        sc.volume_binding_mode.as_deref(),
        Some("WaitForFirstConsumer")
    );
    assert_eq!(sc.allow_volume_expansion, Some(true));
    let topology = &sc.allowed_topologies.clone().unwrap()[0];
    let requirement = &topology.match_label_expressions.clone().unwrap()[0];
    assert_eq!(requirement.key, csi_proto::TOPOLOGY_KEY);
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
    let version = created.metadata.resource_version.clone();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        classes.get("fast").await.unwrap().metadata.resource_version,
        version,
        "status written again although nothing changed"
    );

    // An admin's annotation value is kept; a removed one of ours comes back.
    let out = cluster
        .kubectl(&[
            "annotate",
            "--overwrite",
            "storageclass/fast",
            "virtualdisk.virtualization.deckhouse.io/access-mode=ReadWriteOnce",
            "storage.deckhouse.io/volumesnapshotclass-",
        ])
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
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
    assert_eq!(found["driver"], csi_proto::DRIVER_NAME);
    assert_eq!(found["deletionPolicy"], "Delete");
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

/// The CSI controller over `backend`, in process, checking nodes through the glue, as the
/// sidecars reach it: its client and its task.
async fn serve_csi(
    backend: Arc<dyn controller_shim::backend::Backend>,
    glue: &Glue,
    dir: &std::path::Path,
) -> (
    csi_proto::csi::controller_client::ControllerClient<tonic::transport::Channel>,
    tokio::task::JoinHandle<()>,
) {
    let socket = dir.join("csi.sock");
    let nodes: Arc<dyn controller_shim::provision::Nodes> = Arc::new(glue.nodes.clone());
    let server = {
        let socket = socket.clone();
        tokio::spawn(async move {
            controller_shim::server::serve(
                &socket,
                backend,
                "k8s".into(),
                None,
                Default::default(),
                Some(nodes),
                std::future::pending(),
            )
            .await
            .unwrap();
        })
    };
    let channel = testkit::csi::wait_connect(&socket, Duration::from_secs(10)).await;
    (
        csi_proto::csi::controller_client::ControllerClient::new(channel),
        server,
    )
}

/// A CRD that only serves `kind` (no schema), standing in for another project's.
fn stand_in_crd(group: &str, version: &str, kind: &str, plural: &str, scope: &str) -> String {
    format!(
        "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata:\n  name: {plural}.{group}\n\
         spec:\n  group: {group}\n  names:\n    kind: {kind}\n    plural: {plural}\n    singular: {singular}\n\
         \x20 scope: {scope}\n  versions:\n  - name: {version}\n    served: true\n    storage: true\n\
         \x20   schema:\n      openAPIV3Schema:\n        type: object\n        x-kubernetes-preserve-unknown-fields: true\n",
        singular = kind.to_ascii_lowercase()
    )
}

/// A CSINode as kubelet's registration creates it for a node running our node service.
fn register_node(cluster: &KubeCluster, name: &str) {
    apply(
        cluster,
        &format!(
            "apiVersion: storage.k8s.io/v1\nkind: CSINode\nmetadata:\n  name: {name}\nspec:\n  drivers:\n\
             \x20 - name: {}\n    nodeID: {name}\n    topologyKeys: [\"{}\"]\n",
            csi_proto::DRIVER_NAME,
            csi_proto::TOPOLOGY_KEY
        ),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn controller_publish_to_a_node_without_our_driver_is_not_found() {
    use controller_shim::backend::local::LocalBackend;
    use csi_proto::csi::volume_capability::access_mode::Mode;
    use csi_proto::csi::*;

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
    let cap = testkit::csi::mount_capability("ext4", Mode::SingleNodeWriter);
    let volume = csi
        .create_volume(CreateVolumeRequest {
            name: "pvc-1".into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 1 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let publish = |node: &str| ControllerPublishVolumeRequest {
        volume_id: volume.volume_id.clone(),
        node_id: node.into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
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

/// A Secret in the driver's namespace, applied as `kubectl create secret … | apply` would.
fn put_secret(cluster: &KubeCluster, name: &str, pairs: &[(&str, &str)]) {
    let data: String = pairs
        .iter()
        .map(|(k, v)| format!("  {k}: {v:?}\n"))
        .collect();
    apply(
        cluster,
        &format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: d8-csi-mind-ustor\n\
             stringData:\n{data}"
        ),
    );
}

const TLS: [(&str, &str); 5] = [
    ("ca.crt", "ca"),
    ("client.crt", "crt"),
    ("client.key", "key"),
    ("etcd-client.crt", "ecrt"),
    ("etcd-client.key", "ekey"),
];

/// The connection once `accept` says its status is the awaited one.
async fn wait_connection(
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

fn authenticated(status: &controller_shim::kube::crd::ConnectionStatus) -> (String, String) {
    let c = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Authenticated")
        .expect("an Authenticated condition");
    (c.status.clone(), c.reason.clone())
}

fn reason_has(status: &controller_shim::kube::crd::ConnectionStatus, text: &str) -> bool {
    status.reason.as_deref().is_some_and(|r| r.contains(text))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn a_connection_names_what_is_wrong_and_logs_in_by_the_products_rules() {
    let cluster = KubeCluster::start().unwrap();
    install_crds(&cluster);
    apply(&cluster, include_str!("../../deploy/namespace.yaml"));
    let ustor = testkit::fake_ustor::FakeUstor::start().await.unwrap();
    ustor.set_user("csi", "S3cret@1", None);
    let client = client(&cluster).await;
    let _glue = Glue::start(client.clone(), test_settings());
    let api: Api<MindUstorStorageConnection> = Api::all(client.clone());
    apply(
        &cluster,
        &connection_yaml("main").replace("https://ustor.example:23004", &ustor.url()),
    );

    // Each missing piece is named, one at a time, and nothing logs in meanwhile.
    wait_connection(&api, "main", "no credentials Secret", |s| {
        reason_has(s, "Secret d8-csi-mind-ustor/creds (spec.controlPlane.credentialsSecretName) does not exist")
    })
    .await;
    put_secret(&cluster, "creds", &[("username", "csi")]);
    wait_connection(&api, "main", "no password", |s| {
        reason_has(s, "has no key password")
    })
    .await;
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "S3cret@1")],
    );
    wait_connection(&api, "main", "no TLS Secret", |s| {
        reason_has(
            s,
            "Secret d8-csi-mind-ustor/tls (spec.dataPlane.tlsSecretName) does not exist",
        )
    })
    .await;
    put_secret(&cluster, "tls", &TLS[..4]);
    wait_connection(&api, "main", "no etcd key", |s| {
        reason_has(s, "has no key etcd-client.key")
    })
    .await;
    assert_eq!(
        ustor.logins(),
        0,
        "no login before the connection is complete"
    );

    // Complete: logged in, Created, and the wide listing shows phase and reason.
    put_secret(&cluster, "tls", &TLS);
    let created =
        wait_connection(&api, "main", "Created", |s| s.phase == Some(Phase::Created)).await;
    assert_eq!(authenticated(&created), ("True".into(), "LoggedIn".into()));
    assert_eq!(ustor.logins(), 1);
    let version = api.get("main").await.unwrap().metadata.resource_version;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        api.get("main").await.unwrap().metadata.resource_version,
        version,
        "status written again although nothing changed"
    );
    let wide = cluster
        .kubectl(&["get", "mindustorstorageconnections", "-o", "wide"])
        .unwrap();
    let wide = String::from_utf8_lossy(&wide.stdout);
    assert!(
        wide.contains("PHASE") && wide.contains("REASON") && wide.contains("Created"),
        "{wide}"
    );

    // Every refusal uStor can give shows as the Authenticated reason, within seconds of the
    // Secret changing.
    for (i, code) in [
        "UserLocked",
        "PasswordExpired",
        "TemporaryPassword",
        "UserNotFound",
    ]
    .iter()
    .enumerate()
    {
        let password = format!("S3cret@{}", i + 2);
        ustor.set_user("csi", &password, Some(code));
        put_secret(
            &cluster,
            "creds",
            &[("username", "csi"), ("password", &password)],
        );
        let refused = wait_connection(&api, "main", code, |s| authenticated(s).1 == *code).await;
        assert_eq!(refused.phase, Some(Phase::Failed));
        assert!(reason_has(&refused, code), "{:?}", refused.reason);
    }

    // A wrong password: LoginRejected, and no second try with it during the pause, whatever
    // triggers a look at the connection.
    ustor.set_user("csi", "S3cret@9", None);
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "wrong")],
    );
    wait_connection(&api, "main", "LoginRejected", |s| {
        authenticated(s).1 == "LoginRejected"
    })
    .await;
    let refused_at = Instant::now();
    let logins = ustor.logins();
    for n in 0..3 {
        let out = cluster
            .kubectl(&[
                "annotate",
                "--overwrite",
                "mindustorstorageconnection/main",
                &format!("poke={n}"),
            ])
            .unwrap();
        assert!(out.status.success());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(refused_at.elapsed() < REFUSAL_PAUSE);
    assert_eq!(
        ustor.logins(),
        logins,
        "the refused credentials were tried again within the pause"
    );

    // The right password: logged in again within seconds.
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "S3cret@9")],
    );
    wait_connection(&api, "main", "logged in again", |s| {
        s.phase == Some(Phase::Created)
    })
    .await;

    // controlPlane.address never changes.
    let patch = |address: &str| {
        Patch::Merge(serde_json::json!({ "spec": { "controlPlane": { "address": address } } }))
    };
    api.patch(
        "main",
        &PatchParams::default(),
        &patch("https://elsewhere.example:23004"),
    )
    .await
    .unwrap();
    let moved = wait_connection(&api, "main", "address refused", |s| {
        reason_has(s, "cannot be changed")
    })
    .await;
    assert_eq!(moved.phase, Some(Phase::Failed));
    api.patch("main", &PatchParams::default(), &patch(&ustor.url()))
        .await
        .unwrap();
    wait_connection(&api, "main", "back to Created", |s| {
        s.phase == Some(Phase::Created)
    })
    .await;

    // An unreachable management API is told apart from a refusal.
    apply(
        &cluster,
        &connection_yaml("down").replace("https://ustor.example:23004", "http://127.0.0.1:1"),
    );
    put_secret(
        &cluster,
        "creds",
        &[("username", "csi"), ("password", "S3cret@9")],
    );
    wait_connection(&api, "down", "Unreachable", |s| {
        s.conditions.iter().any(|c| c.reason == "Unreachable")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server (tests/kube/run)"]
async fn volumes_of_two_connections_live_on_their_own_ustor_clusters() {
    use controller_shim::backend::connections::ConnectionsBackend;
    use csi_proto::csi::volume_capability::access_mode::Mode;
    use csi_proto::csi::*;

    let cluster = KubeCluster::start().unwrap();
    install_crds(&cluster);
    apply(&cluster, include_str!("../../deploy/namespace.yaml"));
    let (alpha, beta) = (
        testkit::fake_ustor::FakeUstor::start().await.unwrap(),
        testkit::fake_ustor::FakeUstor::start().await.unwrap(),
    );
    alpha.set_user("csi", "Alpha@1", None);
    beta.set_user("csi", "Beta@1", None);
    put_secret(
        &cluster,
        "creds-alpha",
        &[("username", "csi"), ("password", "Alpha@1")],
    );
    put_secret(
        &cluster,
        "creds-beta",
        &[("username", "csi"), ("password", "Beta@1")],
    );
    put_secret(&cluster, "tls", &TLS);
    for (name, ustor) in [("alpha", &alpha), ("beta", &beta)] {
        apply(
            &cluster,
            &connection_yaml(name)
                .replace("https://ustor.example:23004", &ustor.url())
                .replace(
                    "credentialsSecretName: creds",
                    &format!("credentialsSecretName: creds-{name}"),
                ),
        );
    }
    let client = client(&cluster).await;
    let glue = Glue::start(client.clone(), test_settings());
    let connections: Api<MindUstorStorageConnection> = Api::all(client.clone());
    for name in ["alpha", "beta"] {
        wait_connection(&connections, name, "Created", |s| {
            s.phase == Some(Phase::Created)
        })
        .await;
    }
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());
    create_class(&classes, "sc-alpha", "alpha").await;
    create_class(&classes, "sc-beta", "beta").await;
    wait_phase(&classes, "sc-alpha", Phase::Created).await;
    wait_phase(&classes, "sc-beta", Phase::Created).await;
    register_node(&cluster, "node-a");

    let dir = tempfile::tempdir().unwrap();
    let backend = ConnectionsBackend::new(Arc::new(glue.connections.clone()), "data");
    let (mut csi, server) = serve_csi(Arc::new(backend), &glue, dir.path()).await;
    let cap = testkit::csi::mount_capability("ext4", Mode::SingleNodeWriter);
    // What external-provisioner sends: the StorageClass's parameters as they are.
    let storage_classes: Api<StorageClass> = Api::all(client.clone());
    let mut ids = Vec::new();
    let mut contexts = Vec::new();
    // beta's data plane requires TLS: its volumes name its TLS profile.
    beta.serve_nbd_over_tls(true);
    for class in ["sc-alpha", "sc-beta"] {
        let parameters = storage_classes
            .get(class)
            .await
            .unwrap()
            .parameters
            .unwrap();
        let volume = csi
            .create_volume(CreateVolumeRequest {
                name: format!("pvc-{class}"),
                capacity_range: Some(CapacityRange {
                    required_bytes: 1 << 20,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![cap.clone()],
                parameters: parameters.into_iter().collect(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("CreateVolume with {class}: {e:?}"))
            .into_inner()
            .volume
            .unwrap();
        ids.push(volume.volume_id);
        contexts.push(volume.volume_context);
    }
    assert!(ids[0].starts_with("ustor:volume:alpha/data/"), "{}", ids[0]);
    assert!(contexts[0]["nbdUri"].starts_with("nbd://"), "{contexts:?}");
    assert!(!contexts[0].contains_key("tlsProfile"), "{contexts:?}");
    assert!(contexts[1]["nbdUri"].starts_with("nbds://"), "{contexts:?}");
    assert_eq!(contexts[1]["tlsProfile"], "beta", "{contexts:?}");
    assert!(ids[1].starts_with("ustor:volume:beta/data/"), "{}", ids[1]);
    assert_eq!(alpha.images(), ["data/k8s-pvc-sc-alpha"]);
    assert_eq!(beta.images(), ["data/k8s-pvc-sc-beta"]);

    // A new password in alpha's Secret: its volumes keep working with it.
    alpha.set_user("csi", "Alpha@2", None);
    put_secret(
        &cluster,
        "creds-alpha",
        &[("username", "csi"), ("password", "Alpha@2")],
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    alpha.expire_tokens();
    let published = csi
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: ids[0].clone(),
            node_id: "node-a".into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("publish after the password change: {e:?}"))
        .into_inner();
    assert!(published.publish_context["nbdUri"].starts_with("nbd://"));
    assert!(
        !published.publish_context.contains_key("tlsProfile"),
        "a plaintext export names no TLS profile: {:?}",
        published.publish_context
    );

    // Deleting a MindUstorStorageClass never touches its volumes.
    classes
        .delete("sc-alpha", &DeleteParams::default())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(alpha.images(), ["data/k8s-pvc-sc-alpha"]);

    // An id of the single-cluster controller (no connection) is the oldest connection's.
    let legacy = ids[0].replace("alpha/", "");
    csi.validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
        volume_id: legacy,
        volume_capabilities: vec![cap.clone()],
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("a legacy id: {e:?}"));

    csi.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
        volume_id: ids[0].clone(),
        node_id: "node-a".into(),
    })
    .await
    .unwrap();
    csi.delete_volume(DeleteVolumeRequest {
        volume_id: ids[0].clone(),
    })
    .await
    .unwrap();
    assert!(alpha.images().is_empty());

    // A deleted connection's session goes with it: its volumes are refused with the reason,
    // not served by a login nobody manages any more, and its images are left alone.
    connections
        .delete("beta", &DeleteParams::default())
        .await
        .unwrap();
    let refused = eventually("beta's volumes refused", Duration::from_secs(20), || {
        let mut csi = csi.clone();
        let id = ids[1].clone();
        let cap = cap.clone();
        async move {
            csi.validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
                volume_id: id,
                volume_capabilities: vec![cap],
                ..Default::default()
            })
            .await
            .err()
        }
    })
    .await;
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    assert!(
        refused.message().contains("beta does not exist"),
        "{}",
        refused.message()
    );
    assert_eq!(beta.images(), ["data/k8s-pvc-sc-beta"]);
    server.abort();
}

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
async fn two_replicas_never_both_write_and_the_follower_takes_over() {
    let cluster = KubeCluster::start().unwrap();
    install_crds(&cluster);
    apply(&cluster, include_str!("../../deploy/namespace.yaml"));
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

/// A CA and a serving certificate for 127.0.0.1 signed by it, made with openssl in `dir`:
/// (CA PEM, certificate path, key path).
fn make_certificate(dir: &std::path::Path, tag: &str) -> (Vec<u8>, String, String) {
    let path = |name: &str| dir.join(format!("{tag}-{name}")).display().to_string();
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    std::fs::write(path("ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        &format!("/CN={tag}-ca"),
        "-keyout",
        &path("ca.key"),
        "-out",
        &path("ca.crt"),
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        &path("tls.key"),
        "-out",
        &path("tls.csr"),
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        &path("tls.csr"),
        "-CA",
        &path("ca.crt"),
        "-CAkey",
        &path("ca.key"),
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        &path("ext"),
        "-out",
        &path("tls.crt"),
    ]);
    (
        std::fs::read(path("ca.crt")).unwrap(),
        path("tls.crt"),
        path("tls.key"),
    )
}

/// deploy/webhook.yaml's ValidatingWebhookConfiguration, pointed at `url` with `ca`: the
/// rules under test are the shipped ones.
fn webhook_configuration(url: &str, ca: &[u8]) -> String {
    let shipped = include_str!("../../deploy/webhook.yaml");
    let document = shipped
        .split("\n---\n")
        .find(|d| d.contains("kind: ValidatingWebhookConfiguration"))
        .unwrap();
    let mut config: serde_json::Value = serde_yaml_ng::from_str(document).unwrap();
    for hook in config["webhooks"].as_array_mut().unwrap() {
        hook["clientConfig"] = serde_json::json!({
            "url": url,
            // ByteString serializes as base64, as caBundle is written.
            "caBundle": k8s_openapi::ByteString(ca.to_vec()),
        });
    }
    serde_json::to_string(&config).unwrap()
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
    use controller_shim::kube::webhook::WebhookSettings;
    let cluster = KubeCluster::start().unwrap();
    install_crds(&cluster);
    apply(&cluster, include_str!("../../deploy/namespace.yaml"));
    let certs = tempfile::tempdir().unwrap();
    let (ca, crt, key) = make_certificate(certs.path(), "first");
    let put_tls = |crt: &str, key: &str| {
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
        apply(&cluster, &String::from_utf8_lossy(&yaml.stdout));
    };
    put_tls(&crt, &key);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let client = client(&cluster).await;
    let _glue = Glue::start(
        client.clone(),
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
    let url = format!("https://127.0.0.1:{port}/validate");
    apply(&cluster, &webhook_configuration(&url, &ca));
    apply(&cluster, &connection_yaml("main"));
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());
    create_class(&classes, "fast", "main").await;
    wait_phase(&classes, "fast", Phase::Created).await;

    // StorageClasses of the driver: the controller's only.
    let ours = format!(
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: handmade\nprovisioner: {}\n",
        csi_proto::DRIVER_NAME
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

    // The fixed fields stay fixed; metadata does not.
    let err = classes
        .patch(
            "fast",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": { "pool": "other" } })),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("cannot be changed"), "{err}");
    classes
        .patch(
            "fast",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "metadata": { "labels": { "team": "a" } } })),
        )
        .await
        .unwrap();
    let connections: Api<MindUstorStorageConnection> = Api::all(client.clone());
    let move_connection = || async {
        connections
            .patch(
                "main",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "spec": { "controlPlane": { "address": "https://elsewhere:23004" } } })),
            )
            .await
            .unwrap_err()
            .to_string()
    };
    let err = move_connection().await;
    assert!(err.contains("cannot be changed"), "{err}");

    // A renewed certificate from another CA is served without a restart.
    let (ca2, crt2, key2) = make_certificate(certs.path(), "second");
    put_tls(&crt2, &key2);
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
