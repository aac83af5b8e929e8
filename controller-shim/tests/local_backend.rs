//! The controller with the local backend and its real export server (nbdkit), driven through
//! the CSI socket as the provisioning sidecars drive it. No kernel needed: exports are checked
//! with the NBD handshake, contents on the image files.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use controller_shim::backend::local::LocalBackend;
use csi_proto::csi::controller_client::ControllerClient;
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::*;
use testkit::csi::*;
use tonic::transport::Channel;
use tonic::Code;

const MIB: i64 = 1 << 20;

struct Controller {
    client: ControllerClient<Channel>,
    /// Where the controller serves `/metrics`.
    metrics: std::net::SocketAddr,
    root: PathBuf,
    _dir: tempfile::TempDir,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn start() -> Controller {
    start_in(None).await
}

/// The controller, checking nodes and claims against `cluster` when given.
async fn start_in(cluster: Option<controller_shim::provision::Cluster>) -> Controller {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let listen: std::net::SocketAddr = ([127, 0, 0, 1], testkit::free_port().unwrap()).into();
    let backend = LocalBackend::open(&root, &listen.to_string()).unwrap();
    let exports = common::start_exports(&backend, listen);
    // Bound here and handed over: no window in which another test could take the port.
    let metrics_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = metrics_listener.local_addr().unwrap();
    let (client, server) = common::serve_controller(
        dir.path(),
        Arc::new(backend),
        "test",
        Some(metrics_listener),
        cluster,
    )
    .await;
    Controller {
        client,
        metrics,
        root,
        _dir: dir,
        tasks: vec![exports, server],
    }
}

fn create(name: &str, required: i64, cap: VolumeCapability) -> CreateVolumeRequest {
    create_volume_request(name, required, cap)
}

fn ext4() -> VolumeCapability {
    mount_capability("ext4", Mode::SingleNodeWriter)
}

/// INVALID_ARGUMENT, and the message names what is wrong.
fn assert_invalid_naming(err: &tonic::Status, what: &str) {
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    assert!(err.message().contains(what), "{}", err.message());
}

fn image_file(c: &Controller, volume_id: &str) -> PathBuf {
    c.root
        .join("images")
        .join(volume_id.rsplit(':').next().unwrap())
}

/// The export's size as a node would see it, through a real NBD handshake with the grant a
/// publication to a probe node gives (unpublished again after).
async fn export_size(c: &mut Controller, volume_id: &str) -> u64 {
    let uri = granted_uri(c, volume_id, "probe", ext4()).await;
    let size = dialed_size(&uri).await.unwrap();
    c.client
        .controller_unpublish_volume(controller_unpublish_request(volume_id, "probe"))
        .await
        .unwrap();
    size
}

/// The URI a node dials after publishing `volume_id` to `node`: the export name with the
/// grant's token.
async fn granted_uri(c: &Controller, volume_id: &str, node: &str, cap: VolumeCapability) -> String {
    let published = c
        .client
        .clone()
        .controller_publish_volume(controller_publish_request(volume_id, node, cap))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    format!("{}@{}", published["nbdUri"], published["nbdGrant"])
}

/// The size of the export `uri` names, retried while the export server starts; the
/// handshake's error once it answers.
async fn dialed_size(uri: &str) -> Result<u64, nbd::Error> {
    let uri: nbd::NbdUri = uri.parse().unwrap();
    let started = Instant::now();
    loop {
        let opts = nbd::dial::DialOptions {
            deadline: Duration::from_secs(5),
            ..Default::default()
        };
        match nbd::dial::dial_one(&uri, &opts).await {
            Ok((info, _)) => return Ok(info.size),
            Err(e) if is_refusal(&e) => return Err(e),
            Err(e) => assert!(
                started.elapsed() < Duration::from_secs(10),
                "export {}: {e}",
                uri.export().split('@').next().unwrap_or_default()
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn is_refusal(e: &nbd::Error) -> bool {
    matches!(
        e,
        nbd::Error::Handshake {
            source: nbd::handshake::HandshakeError::PolicyRefused { .. },
            ..
        }
    )
}

fn write(path: &Path, offset: u64, data: &[u8]) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(data, offset)
        .unwrap();
}

fn read(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    testkit::read_at(path, offset, len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_snapshot_restore_clone_expand_delete() {
    let mut c = start().await;
    let v = created_volume(&mut c.client, create("pvc-a", 10 * MIB + 1, ext4())).await;
    assert_eq!(v.capacity_bytes, 11 * MIB, "rounded up to whole MiB");
    assert!(
        v.volume_id.starts_with("local:volume:test-"),
        "{}",
        v.volume_id
    );
    assert_eq!(
        v.accessible_topology[0].segments["topology.ustor-nbd.csi.mindsw.io/data-plane"],
        "true"
    );
    assert!(
        !v.volume_context.contains_key("nbdGrant"),
        "a volume's context is no grant"
    );
    assert_eq!(export_size(&mut c, &v.volume_id).await, 11 << 20);

    // Idempotent by name; a clash by name is ALREADY_EXISTS.
    let again = c
        .client
        .create_volume(create("pvc-a", 10 * MIB + 1, ext4()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.volume.unwrap().volume_id, v.volume_id);
    let clash = c
        .client
        .create_volume(create("pvc-a", 100 * MIB, ext4()))
        .await
        .unwrap_err();
    assert_eq!(clash.code(), Code::AlreadyExists);

    // Snapshot, then restore into a larger volume and clone: the data is there.
    let file = image_file(&c, &v.volume_id);
    write(&file, 5 << 20, b"snapshot me");
    let snap = created_snapshot(&mut c.client, &v.volume_id, "snap-1").await;
    assert!(
        snap.ready_to_use && snap.size_bytes == 11 * MIB && snap.source_volume_id == v.volume_id
    );
    write(&file, 5 << 20, b"changed!!!!");
    let mut restore = create("pvc-restored", 32 * MIB, ext4());
    restore.volume_content_source = from_snapshot(&snap.snapshot_id);
    let restored = created_volume(&mut c.client, restore).await;
    assert_eq!(
        restored.capacity_bytes,
        32 * MIB,
        "restored into a larger volume"
    );
    assert_eq!(
        read(&image_file(&c, &restored.volume_id), 5 << 20, 11),
        b"snapshot me"
    );
    assert_eq!(export_size(&mut c, &restored.volume_id).await, 32 << 20);
    let mut clone = create("pvc-clone", 0, ext4());
    clone.volume_content_source = from_volume(&v.volume_id);
    let cloned = created_volume(&mut c.client, clone).await;
    assert_eq!(
        read(&image_file(&c, &cloned.volume_id), 5 << 20, 11),
        b"changed!!!!"
    );
    assert_eq!(
        cloned.capacity_bytes,
        1 << 30,
        "no size asked: the default 1 GiB, not less than the source"
    );

    // Expansion: the export shows the new size to new connections.
    let r = c
        .client
        .controller_expand_volume(controller_expand_request(
            &v.volume_id,
            20 * MIB,
            Some(ext4()),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 20 * MIB);
    assert!(r.node_expansion_required);
    assert_eq!(export_size(&mut c, &v.volume_id).await, 20 << 20);

    // Deleting the source volume keeps its snapshot valid; deletes are idempotent.
    for id in [
        &v.volume_id,
        &v.volume_id,
        &restored.volume_id,
        &cloned.volume_id,
    ] {
        c.client
            .delete_volume(delete_volume_request(id))
            .await
            .unwrap();
    }
    assert!(!file.exists());
    let mut again = create("pvc-from-orphan-snap", 11 * MIB, ext4());
    again.volume_content_source = from_snapshot(&snap.snapshot_id);
    let orphan = created_volume(&mut c.client, again).await;
    assert_eq!(
        read(&image_file(&c, &orphan.volume_id), 5 << 20, 11),
        b"snapshot me"
    );
    for _ in 0..2 {
        c.client
            .delete_snapshot(delete_snapshot_request(&snap.snapshot_id))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_rules_follow_the_access_mode() {
    let mut c = start().await;
    let rwo = created_volume(&mut c.client, create("pvc-rwo", MIB, ext4())).await;
    let rwx_cap = block_capability(Mode::MultiNodeMultiWriter);
    let rwx = created_volume(&mut c.client, create("vm-disk", MIB, rwx_cap.clone())).await;
    let ctx = c
        .client
        .controller_publish_volume(controller_publish_request(&rwo.volume_id, "node-a", ext4()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ctx.publish_context["nbdUri"], rwo.volume_context["nbdUri"]);
    c.client
        .controller_publish_volume(controller_publish_request(&rwo.volume_id, "node-a", ext4()))
        .await
        .unwrap();
    let err = c
        .client
        .controller_publish_volume(controller_publish_request(&rwo.volume_id, "node-b", ext4()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    for node in ["node-a", "node-b"] {
        c.client
            .controller_publish_volume(controller_publish_request(
                &rwx.volume_id,
                node,
                rwx_cap.clone(),
            ))
            .await
            .unwrap();
    }
    let err = c
        .client
        .delete_volume(delete_volume_request(&rwo.volume_id))
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Code::FailedPrecondition,
        "delete while published"
    );
    for _ in 0..2 {
        c.client
            .controller_unpublish_volume(controller_unpublish_request(&rwo.volume_id, "node-a"))
            .await
            .unwrap();
    }
    c.client
        .controller_publish_volume(controller_publish_request(&rwo.volume_id, "node-b", ext4()))
        .await
        .unwrap();
    let err = c
        .client
        .controller_publish_volume(controller_publish_request(
            "local:volume:test-nope",
            "node-a",
            ext4(),
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_snapshots_pages_and_filters() {
    let mut c = start().await;
    let v = created_volume(&mut c.client, create("pvc-s", MIB, ext4())).await;
    let other = created_volume(&mut c.client, create("pvc-t", MIB, ext4())).await;
    for (name, source) in [("s1", &v), ("s2", &v), ("s3", &v), ("t1", &other)] {
        c.client
            .create_snapshot(snapshot_request(&source.volume_id, name))
            .await
            .unwrap();
    }
    let list = |max: i32, token: &str, source: &str, id: &str| ListSnapshotsRequest {
        max_entries: max,
        starting_token: token.into(),
        source_volume_id: source.into(),
        snapshot_id: id.into(),
    };
    let first = c
        .client
        .list_snapshots(list(3, "", "", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.entries.len(), 3);
    assert!(!first.next_token.is_empty());
    let rest = c
        .client
        .list_snapshots(list(3, &first.next_token, "", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.entries.len(), 1);
    assert!(rest.next_token.is_empty());
    let by_source = c
        .client
        .list_snapshots(list(0, "", &v.volume_id, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_source.entries.len(), 3);
    let one = &first.entries[0].snapshot.as_ref().unwrap().snapshot_id;
    let by_id = c
        .client
        .list_snapshots(list(0, "", "", one))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_id.entries.len(), 1);
    let none = c
        .client
        .list_snapshots(list(0, "", "", "local:snapshot:test-unknown"))
        .await
        .unwrap()
        .into_inner();
    assert!(none.entries.is_empty());
    let err = c
        .client
        .list_snapshots(list(0, "garbage", "", ""))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted);
    // The same name for a snapshot of another volume is a clash.
    let err = c
        .client
        .create_snapshot(snapshot_request(&other.volume_id, "s1"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_spec_code() {
    let mut c = start().await;
    let mut cases: Vec<(&str, CreateVolumeRequest, Code)> = Vec::new();
    cases.push(("no name", create("", MIB, ext4()), Code::InvalidArgument));
    let mut r = create("x", MIB, ext4());
    r.volume_capabilities.clear();
    cases.push(("no capabilities", r, Code::InvalidArgument));
    cases.push((
        "RWX filesystem",
        create(
            "x",
            MIB,
            mount_capability("ext4", Mode::MultiNodeMultiWriter),
        ),
        Code::InvalidArgument,
    ));
    cases.push((
        "unknown fsType",
        create("x", MIB, mount_capability("btrfs", Mode::SingleNodeWriter)),
        Code::InvalidArgument,
    ));
    let mut r = create("x", MIB, ext4());
    r.parameters.insert("pol".into(), "data".into());
    cases.push(("unknown parameter", r, Code::InvalidArgument));
    let mut r = create("x", MIB, ext4());
    r.parameters.insert("nbdConnections".into(), "99".into());
    cases.push(("bad nbdConnections", r, Code::InvalidArgument));
    let mut r = create("x", 10 * MIB, ext4());
    r.capacity_range.as_mut().unwrap().limit_bytes = MIB;
    cases.push(("required over limit", r, Code::OutOfRange));
    let mut r = create("x", MIB, ext4());
    r.volume_content_source = from_snapshot("local:snapshot:test-missing");
    cases.push(("missing snapshot source", r, Code::NotFound));
    let mut r = create("x", MIB, ext4());
    r.volume_content_source = from_volume("local:snapshot:test-x");
    cases.push(("snapshot id as volume source", r, Code::NotFound));
    // Ids another driver issued (csi-sanity's "some-snap-id"): the source does not exist.
    let mut r = create("x", MIB, ext4());
    r.volume_content_source = from_snapshot("some-snap-id");
    cases.push(("foreign snapshot source", r, Code::NotFound));
    let mut r = create("x", MIB, ext4());
    r.volume_content_source = from_volume("some-vol-id");
    cases.push(("foreign volume source", r, Code::NotFound));
    for (what, req, code) in cases {
        let err = c.client.create_volume(req).await.expect_err(what);
        assert_eq!(err.code(), code, "{what}: {}", err.message());
        assert!(!err.message().is_empty());
    }
    assert_eq!(
        std::fs::read_dir(c.root.join("images")).unwrap().count(),
        0,
        "nothing was created"
    );

    // Deleting what this driver never issued is deleting what does not exist: OK.
    c.client
        .delete_volume(delete_volume_request("not-ours"))
        .await
        .expect("a foreign volume id is deleted");
    c.client
        .delete_snapshot(delete_snapshot_request("ustor:snapshot:data/x"))
        .await
        .expect("a foreign snapshot id is deleted");
    let err = c
        .client
        .delete_volume(delete_volume_request(""))
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Code::InvalidArgument,
        "an empty id is still refused"
    );
    c.client
        .delete_volume(delete_volume_request("local:volume:test-never-existed"))
        .await
        .expect("deleting what is not there is OK");
    let err = c
        .client
        .controller_expand_volume(controller_expand_request(
            "local:volume:test-nope",
            MIB,
            None,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .client
        .create_snapshot(snapshot_request("local:volume:test-nope", "s"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    // ValidateVolumeCapabilities: confirmed, refused with a reason, unknown volume, no capability.
    let v = created_volume(&mut c.client, create("pvc-v", MIB, ext4())).await;
    let validate = |id: &str, caps: Vec<VolumeCapability>| ValidateVolumeCapabilitiesRequest {
        volume_id: id.into(),
        volume_context: HashMap::new(),
        volume_capabilities: caps,
        parameters: HashMap::new(),
    };
    let ok = c
        .client
        .validate_volume_capabilities(validate(
            &v.volume_id,
            vec![ext4(), block_capability(Mode::MultiNodeMultiWriter)],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.confirmed.unwrap().volume_capabilities.len(), 2);
    let refused = c
        .client
        .validate_volume_capabilities(validate(
            &v.volume_id,
            vec![mount_capability("ext4", Mode::MultiNodeMultiWriter)],
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(
        refused.confirmed.is_none() && refused.message.contains("volumeMode: Block"),
        "{}",
        refused.message
    );
    for unknown in ["local:volume:test-nope", "some-vol-id"] {
        let err = c
            .client
            .validate_volume_capabilities(validate(unknown, vec![ext4()]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound, "{unknown}");
    }
    // The longest name the spec allows gives an id within its 128 bytes.
    let long = created_volume(&mut c.client, create(&"n".repeat(128), MIB, ext4())).await;
    assert!(long.volume_id.len() <= 128, "{}", long.volume_id);
    c.client
        .delete_volume(delete_volume_request(&long.volume_id))
        .await
        .unwrap();
    let err = c
        .client
        .validate_volume_capabilities(validate(&v.volume_id, vec![]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // Required fields are checked before the volume is looked up (csi-sanity): a missing
    // one is INVALID_ARGUMENT even when the id names nothing.
    for (volume_id, node_id, volume_capability, missing) in [
        ("some-vol-id", "", Some(ext4()), "node_id"),
        (
            "local:volume:test-nope",
            "node-a",
            None,
            "volume_capability",
        ),
    ] {
        let err = c
            .client
            .controller_publish_volume(ControllerPublishVolumeRequest {
                volume_id: volume_id.into(),
                node_id: node_id.into(),
                volume_capability,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_invalid_naming(&err, missing);
    }
    let err = c
        .client
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: "some-vol-id".into(),
            name: String::new(),
            parameters: HashMap::new(),
        })
        .await
        .unwrap_err();
    assert_invalid_naming(&err, "name is required");

    let cap = c
        .client
        .get_capacity(GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(cap.available_capacity > 0);
    let caps = c
        .client
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    use controller_service_capability::rpc::Type as Rpc;
    let offered: Vec<Rpc> = caps
        .capabilities
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(controller_service_capability::Type::Rpc(r)) => Rpc::try_from(r.r#type).ok(),
            None => None,
        })
        .collect();
    assert_eq!(offered.len(), 14, "{offered:?}");
    for wanted in [
        Rpc::ListVolumes,
        Rpc::ListVolumesPublishedNodes,
        Rpc::GetVolume,
        Rpc::VolumeCondition,
        Rpc::ModifyVolume,
    ] {
        assert!(offered.contains(&wanted), "{wanted:?} not offered");
    }

    // Every call above is counted by method and code, with its latency.
    let metrics = testkit::scrape(c.metrics).await;
    assert!(
        metrics.contains(
            r#"ustor_csi_controller_requests_total{method="CreateVolume",code="InvalidArgument"}"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"ustor_csi_controller_requests_total{method="DeleteVolume",code="Ok"}"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            r#"ustor_csi_controller_request_duration_seconds_count{method="GetCapacity"} 1"#
        ),
        "{metrics}"
    );
    // The deletes of ids it never issued, answered OK, are counted for operators to see.
    assert!(
        metrics.contains(r#"ustor_csi_controller_foreign_id_deletes_total{op="DeleteVolume"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"ustor_csi_controller_foreign_id_deletes_total{op="DeleteSnapshot"} 1"#),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_grants_the_node_and_unpublish_fences_it() {
    let mut c = start().await;
    let v = created_volume(&mut c.client, create("pvc-fenced", MIB, ext4())).await;
    let uri = granted_uri(&c, &v.volume_id, "node-a", ext4()).await;
    let (export, token) = uri.rsplit_once('@').unwrap();
    assert!(!export.contains('@'), "the URI itself carries no token");
    assert_eq!(token.len(), 32, "{} characters", token.len());
    assert!(token
        .bytes()
        .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
    assert_eq!(
        granted_uri(&c, &v.volume_id, "node-a", ext4()).await,
        uri,
        "a repeated publish answers the same grant"
    );
    assert_eq!(dialed_size(&uri).await.unwrap(), 1 << 20);

    for _ in 0..2 {
        c.client
            .controller_unpublish_volume(controller_unpublish_request(&v.volume_id, "node-a"))
            .await
            .unwrap();
    }
    assert!(
        dialed_size(&uri).await.is_err_and(|e| is_refusal(&e)),
        "the unpublished node's token opens nothing"
    );
    let again = granted_uri(&c, &v.volume_id, "node-a", ext4()).await;
    assert_ne!(again, uri, "a new publication, a new grant");
    c.client
        .controller_unpublish_volume(controller_unpublish_request(&v.volume_id, "node-a"))
        .await
        .unwrap();

    // ReadWriteMany: one grant per node, live together; an unpublish without a node id
    // revokes every one.
    let rwx_cap = block_capability(Mode::MultiNodeMultiWriter);
    let rwx = created_volume(&mut c.client, create("vm-fenced", MIB, rwx_cap.clone())).await;
    let mut uris = Vec::new();
    for node in ["node-a", "node-b"] {
        uris.push(granted_uri(&c, &rwx.volume_id, node, rwx_cap.clone()).await);
    }
    assert_ne!(uris[0], uris[1], "each node has its own token");
    for uri in &uris {
        assert_eq!(dialed_size(uri).await.unwrap(), 1 << 20);
    }
    c.client
        .controller_unpublish_volume(controller_unpublish_request(&rwx.volume_id, ""))
        .await
        .unwrap();
    for uri in &uris {
        assert!(dialed_size(uri).await.is_err_and(|e| is_refusal(&e)));
    }
    c.client
        .delete_volume(delete_volume_request(&rwx.volume_id))
        .await
        .unwrap();
}

/// The external-attacher gives a call up at its deadline and calls again later. An
/// unpublish given up mid-way still revokes the grant and cuts the node's connection, on its
/// own; the publication it removed lets another node publish the volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpublish_given_up_at_its_deadline_still_fences_the_node() {
    let mut c = start().await;
    let v = created_volume(&mut c.client, create("pvc-abandoned", MIB, ext4())).await;
    let uri = granted_uri(&c, &v.volume_id, "node-a", ext4()).await;
    dialed_size(&uri).await.unwrap();
    let parsed: nbd::NbdUri = uri.parse().unwrap();
    let opts = nbd::dial::DialOptions {
        deadline: Duration::from_secs(5),
        ..Default::default()
    };
    let (_, open) = nbd::dial::dial_one(&parsed, &opts).await.unwrap();

    let mut given_up = tonic::Request::new(controller_unpublish_request(&v.volume_id, "node-a"));
    given_up.set_timeout(Duration::from_millis(1));
    let e = c
        .client
        .controller_unpublish_volume(given_up)
        .await
        .unwrap_err();
    assert!(
        matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{e:?}"
    );

    // No retry yet: the work goes on without its caller.
    let open = std::net::TcpStream::from(open);
    open.set_nonblocking(true).unwrap();
    let open = tokio::net::TcpStream::from_std(open).unwrap();
    let started = Instant::now();
    loop {
        let refused = dialed_size(&uri).await.is_err_and(|e| is_refusal(&e));
        let mut byte = [0u8; 1];
        let closed = matches!(
            tokio::time::timeout(Duration::from_millis(100), open.peek(&mut byte)).await,
            Ok(Ok(0) | Err(_))
        );
        if refused && closed {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the given-up unpublish never finished: token refused {refused}, connection closed {closed}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let b = granted_uri(&c, &v.volume_id, "node-b", ext4()).await;
    assert_eq!(dialed_size(&b).await.unwrap(), 1 << 20, "node B opens it");
    c.client
        .controller_unpublish_volume(controller_unpublish_request(&v.volume_id, "node-a"))
        .await
        .unwrap();
    assert!(dialed_size(&uri).await.is_err_and(|e| is_refusal(&e)));
}

/// ControllerGetVolume's answer for `volume_id`: the nodes it is published to, and its
/// condition (abnormal, message).
async fn volume_status(c: &mut Controller, volume_id: &str) -> (Vec<String>, bool, String) {
    let answer = c
        .client
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: volume_id.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.volume.unwrap().volume_id, volume_id);
    let status = answer.status.unwrap();
    let condition = status.volume_condition.unwrap();
    (
        status.published_node_ids,
        condition.abnormal,
        condition.message,
    )
}

/// Rewrites the metadata file of `volume_id` as `change` makes it.
fn edit_meta(c: &Controller, volume_id: &str, change: impl FnOnce(&mut serde_json::Value)) {
    let image = volume_id.rsplit(':').next().unwrap();
    let path = c.root.join("meta").join(format!("volume-{image}.json"));
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    change(&mut meta);
    std::fs::write(&path, serde_json::to_vec(&meta).unwrap()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_are_listed_in_pages_with_their_nodes_and_condition() {
    let mut c = start().await;
    let mut ids = Vec::new();
    for name in ["pvc-a", "pvc-b", "pvc-c"] {
        ids.push(
            created_volume(&mut c.client, create(name, MIB, ext4()))
                .await
                .volume_id,
        );
    }
    ids.sort();
    let list = |max: i32, token: &str| ListVolumesRequest {
        max_entries: max,
        starting_token: token.into(),
    };
    let listed = |r: &ListVolumesResponse| -> Vec<String> {
        r.entries
            .iter()
            .map(|e| e.volume.as_ref().unwrap().volume_id.clone())
            .collect()
    };
    let all = c
        .client
        .list_volumes(list(0, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed(&all), ids);
    assert!(all.next_token.is_empty());
    let first = c
        .client
        .list_volumes(list(2, ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed(&first), ids[..2]);
    let rest = c
        .client
        .list_volumes(list(2, &first.next_token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed(&rest), ids[2..]);
    assert!(rest.next_token.is_empty());
    let err = c.client.list_volumes(list(0, "garbage")).await.unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{}", err.message());
    let err = c.client.list_volumes(list(-1, "")).await.unwrap_err();
    assert_invalid_naming(&err, "max_entries");

    // Published, granted, served: healthy, and the node listed.
    let (a, b, gone) = (&ids[0], &ids[1], &ids[2]);
    granted_uri(&c, a, "node-1", ext4()).await;
    assert_eq!(
        volume_status(&mut c, a).await,
        (vec!["node-1".to_owned()], false, "healthy".to_owned())
    );
    let status = all.entries[1].status.as_ref().unwrap();
    assert!(status.published_node_ids.is_empty());
    assert!(!status.volume_condition.as_ref().unwrap().abnormal);

    // What the storage lost is each volume's condition, in words that say what.
    edit_meta(&c, a, |m| m["grants"] = serde_json::json!({}));
    let (nodes, abnormal, message) = volume_status(&mut c, a).await;
    assert_eq!(nodes, ["node-1"]);
    assert!(abnormal && message.contains("no grant"), "{message}");
    std::fs::OpenOptions::new()
        .write(true)
        .open(image_file(&c, b))
        .unwrap()
        .set_len(MIB as u64 / 2)
        .unwrap();
    let (_, abnormal, message) = volume_status(&mut c, b).await;
    assert!(abnormal && message.contains("less than"), "{message}");
    std::fs::remove_file(image_file(&c, gone)).unwrap();
    let (_, abnormal, message) = volume_status(&mut c, gone).await;
    assert!(abnormal && message.contains("missing"), "{message}");
    let listed_conditions: Vec<bool> = c
        .client
        .list_volumes(list(0, ""))
        .await
        .unwrap()
        .into_inner()
        .entries
        .iter()
        .map(|e| {
            e.status
                .as_ref()
                .unwrap()
                .volume_condition
                .as_ref()
                .unwrap()
                .abnormal
        })
        .collect();
    assert_eq!(
        listed_conditions,
        [true, true, true],
        "the list says the same"
    );

    // Unpublished, the missing grant no longer matters; the export server stopping does.
    c.client
        .controller_unpublish_volume(controller_unpublish_request(a, "node-1"))
        .await
        .unwrap();
    assert_eq!(
        volume_status(&mut c, a).await,
        (vec![], false, "healthy".to_owned())
    );
    c.tasks[0].abort();
    let started = Instant::now();
    loop {
        let (_, abnormal, message) = volume_status(&mut c, a).await;
        if abnormal {
            assert!(message.contains("export server"), "{message}");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "nbdkit still serves"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    for (id, code) in [
        ("local:volume:test-unknown", Code::NotFound),
        ("", Code::InvalidArgument),
    ] {
        let err = c
            .client
            .controller_get_volume(ControllerGetVolumeRequest {
                volume_id: id.into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{id:?}: {}", err.message());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutable_parameters_set_the_connections_of_the_next_publication() {
    let mut c = start().await;
    let mut request = create("pvc-m", MIB, ext4());
    request
        .parameters
        .insert("nbdConnections".into(), "2".into());
    request
        .mutable_parameters
        .insert("nbdConnections".into(), "3".into());
    let v = created_volume(&mut c.client, request).await;
    assert_eq!(
        v.volume_context["nbdConnections"], "2",
        "the volume context is the StorageClass's, the same in every answer"
    );
    let connections = |c: &Controller| {
        let (client, id) = (c.client.clone(), v.volume_id.clone());
        async move {
            client
                .clone()
                .controller_publish_volume(controller_publish_request(&id, "node-1", ext4()))
                .await
                .unwrap()
                .into_inner()
                .publish_context["nbdConnections"]
                .clone()
        }
    };
    assert_eq!(
        connections(&c).await,
        "3",
        "CreateVolume's mutable parameters hold"
    );
    let modify = |id: &str, pairs: &[(&str, &str)]| ControllerModifyVolumeRequest {
        volume_id: id.into(),
        mutable_parameters: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    c.client
        .controller_modify_volume(modify(&v.volume_id, &[("nbdConnections", "4")]))
        .await
        .unwrap();
    assert_eq!(
        connections(&c).await,
        "4",
        "the next publication has the new count"
    );
    let (listed, ..) = (
        c.client
            .controller_get_volume(ControllerGetVolumeRequest {
                volume_id: v.volume_id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap(),
        (),
    );
    assert_eq!(
        listed.volume_context, v.volume_context,
        "static, as the spec has it"
    );

    // Refused, and nothing changed.
    for (id, pairs, code, naming) in [
        (
            &*v.volume_id,
            &[("pool", "x")][..],
            Code::InvalidArgument,
            "pool",
        ),
        (
            &v.volume_id,
            &[("nbdConnections", "0")],
            Code::InvalidArgument,
            "nbdConnections",
        ),
        (
            "",
            &[("nbdConnections", "2")],
            Code::InvalidArgument,
            "volume_id",
        ),
        (
            "local:volume:test-unknown",
            &[("nbdConnections", "2")],
            Code::NotFound,
            "does not exist",
        ),
    ] {
        let err = c
            .client
            .controller_modify_volume(modify(id, pairs))
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{pairs:?}: {}", err.message());
        assert!(err.message().contains(naming), "{}", err.message());
    }
    assert_eq!(connections(&c).await, "4");
    let mut bad = create("pvc-n", MIB, ext4());
    bad.mutable_parameters
        .insert("XXX_FakeKey".into(), "v".into());
    let err = c.client.create_volume(bad).await.unwrap_err();
    assert_invalid_naming(&err, "XXX_FakeKey");
}

/// Nodes that all exist, each taking `limit` volumes; claims that are all admitted.
#[derive(Debug)]
struct Limited {
    limit: u64,
}

impl controller_shim::provision::Nodes for Limited {
    fn has_node(&self, _node_id: &str) -> Option<bool> {
        Some(true)
    }

    fn attach_limit(&self, _node_id: &str) -> Option<u64> {
        Some(self.limit)
    }
}

#[tonic::async_trait]
impl controller_shim::provision::Claims for Limited {
    async fn admitted(
        &self,
        _namespace: &str,
        _name: &str,
    ) -> Result<(), controller_shim::provision::ClaimError> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_at_its_attach_limit_takes_no_more_volumes() {
    let limited = Arc::new(Limited { limit: 2 });
    let mut c = start_in(Some(controller_shim::provision::Cluster {
        nodes: limited.clone(),
        claims: limited,
    }))
    .await;
    let mut ids = Vec::new();
    for name in ["pvc-1", "pvc-2", "pvc-3"] {
        ids.push(
            created_volume(&mut c.client, create(name, MIB, ext4()))
                .await
                .volume_id,
        );
    }
    granted_uri(&c, &ids[0], "node-1", ext4()).await;
    // Two at once for the node's last device: one takes it, the other is refused.
    let publish = |id: &str| {
        let mut client = c.client.clone();
        let request = controller_publish_request(id, "node-1", ext4());
        async move { client.controller_publish_volume(request).await }
    };
    let (one, two) = tokio::join!(publish(&ids[1]), publish(&ids[2]));
    let refused: Vec<tonic::Status> = [one, two].into_iter().filter_map(Result::err).collect();
    assert_eq!(refused.len(), 1, "{refused:?}");
    let err = &refused[0];
    assert_eq!(err.code(), Code::ResourceExhausted, "{}", err.message());
    assert!(
        err.message().contains("node-1") && err.message().contains("holds 2"),
        "{}",
        err.message()
    );
    let first_refused = c
        .client
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: ids[1].clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap()
        .published_node_ids
        .is_empty();
    let (held, free) = if first_refused {
        (&ids[2], &ids[1])
    } else {
        (&ids[1], &ids[2])
    };
    // A repeated publication is no new one; another node has room; a freed device is room.
    granted_uri(&c, &ids[0], "node-1", ext4()).await;
    granted_uri(&c, free, "node-2", ext4()).await;
    c.client
        .controller_unpublish_volume(controller_unpublish_request(free, "node-2"))
        .await
        .unwrap();
    c.client
        .controller_unpublish_volume(controller_unpublish_request(held, "node-1"))
        .await
        .unwrap();
    granted_uri(&c, free, "node-1", ext4()).await;
}
