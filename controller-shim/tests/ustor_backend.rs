//! The controller with the uStor backend, against the in-repo server implementing the
//! contract, through the CSI socket as the sidecars drive it.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use controller_shim::backend::connections::{
    ConnectionDirectory, ConnectionError, ConnectionsBackend,
};
use controller_shim::backend::ustor::api::UstorApi;
use controller_shim::backend::ustor::backend::UstorBackend;
use controller_shim::backend::ustor::credentials::CredentialsDir;
use controller_shim::backend::ustor::login::Timing;
use csi_proto::csi::controller_client::ControllerClient;
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::*;
use testkit::csi::*;
use testkit::fake_ustor::FakeUstor;
use tonic::transport::Channel;
use tonic::Code;

const MIB: i64 = 1 << 20;

/// The uStor backend logging in to `server` as `csi` with `password` (kept under `dir`).
fn backend(server: &FakeUstor, dir: &std::path::Path, password: &str) -> UstorBackend {
    common::ustor_backend(&server.url(), &common::ustor_credentials(dir, password))
}

async fn controller(
    server: &FakeUstor,
    password: &str,
) -> (ControllerClient<Channel>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let backend = backend(server, dir.path(), password);
    let (client, _server) =
        common::serve_controller(dir.path(), Arc::new(backend), "test", None, None).await;
    (client, dir)
}

fn create(name: &str, bytes: i64, pool: Option<&str>) -> CreateVolumeRequest {
    let mut request = create_volume_request(
        name,
        bytes,
        mount_capability("ext4", Mode::SingleNodeWriter),
    );
    if let Some(pool) = pool {
        request
            .parameters
            .insert("pool".to_owned(), pool.to_owned());
    }
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisioning_on_ustor() {
    let server = FakeUstor::start().await.unwrap();
    server.set_user("csi", "pw", None);
    let (mut c, _dir) = controller(&server, "pw").await;

    let v = created_volume(&mut c, create("pvc-1", 100 * MIB, Some("data"))).await;
    assert_eq!(v.volume_id, "ustor:volume:data/test-pvc-1");
    assert_eq!(
        v.volume_context["nbdUri"],
        "nbd://127.0.0.1:10809/test-pvc-1"
    );
    let again = c
        .create_volume(create("pvc-1", 100 * MIB, Some("data")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        again.volume.unwrap().volume_id,
        v.volume_id,
        "idempotent by name"
    );
    let clash = c
        .create_volume(create("pvc-1", 100 * MIB, None))
        .await
        .unwrap_err();
    assert_eq!(
        clash.code(),
        Code::AlreadyExists,
        "same name, other parameters"
    );
    let clash = c
        .create_volume(create("pvc-1", 500 * MIB, Some("data")))
        .await
        .unwrap_err();
    assert_eq!(clash.code(), Code::AlreadyExists);

    // Publications are kept in uStor (labels), so they survive a controller restart.
    let publish = |node: &str| {
        controller_publish_request(
            &v.volume_id,
            node,
            mount_capability("ext4", Mode::SingleNodeWriter),
        )
    };
    let ctx = c
        .controller_publish_volume(publish("node-a"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ctx.publish_context["nbdUri"], v.volume_context["nbdUri"]);
    let (mut restarted, _dir2) = controller(&server, "pw").await;
    let err = restarted
        .controller_publish_volume(publish("node-b"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    restarted
        .controller_unpublish_volume(controller_unpublish_request(&v.volume_id, "node-a"))
        .await
        .unwrap();

    let snap = created_snapshot(&mut c, &v.volume_id, "snap-1").await;
    assert_eq!(snap.snapshot_id, "ustor:snapshot:data/test-snap-1");
    assert_eq!(snap.size_bytes, 100 * MIB);
    let mut restore = create("pvc-restored", 200 * MIB, Some("data"));
    restore.volume_content_source = from_snapshot(&snap.snapshot_id);
    let restored = created_volume(&mut c, restore).await;
    assert_eq!(restored.capacity_bytes, 200 * MIB);
    let mut other_pool = create("pvc-elsewhere", 200 * MIB, Some("fast"));
    other_pool.volume_content_source = from_snapshot(&snap.snapshot_id);
    let err = c.create_volume(other_pool).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());

    let r = c
        .controller_expand_volume(controller_expand_request(&v.volume_id, 300 * MIB, None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 300 * MIB);
    let listed = c
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1);
    let cap = c
        .get_capacity(GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cap.available_capacity, 1 << 39);
    // The pool a StorageClass names, not the default one.
    let cap = c
        .get_capacity(GetCapacityRequest {
            parameters: [("pool".to_owned(), "fast".to_owned())].into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        cap.available_capacity,
        1 << 38,
        "the fast pool's free bytes"
    );
    let err = c
        .get_capacity(GetCapacityRequest {
            parameters: [("pool".to_owned(), "Not A Pool".to_owned())].into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    // Snapshots of a volume in another pool are listed from that pool.
    let fast = created_volume(&mut c, create("pvc-fast", 100 * MIB, Some("fast"))).await;
    let fast_snap = created_snapshot(&mut c, &fast.volume_id, "snap-fast").await;
    assert!(fast_snap.snapshot_id.starts_with("ustor:snapshot:fast/"));
    for request in [
        ListSnapshotsRequest {
            source_volume_id: fast.volume_id.clone(),
            ..Default::default()
        },
        ListSnapshotsRequest {
            snapshot_id: fast_snap.snapshot_id.clone(),
            ..Default::default()
        },
    ] {
        let listed = c.list_snapshots(request).await.unwrap().into_inner();
        assert_eq!(listed.entries.len(), 1, "found in the fast pool");
    }
    c.delete_snapshot(delete_snapshot_request(&fast_snap.snapshot_id))
        .await
        .unwrap();
    c.delete_volume(delete_volume_request(&fast.volume_id))
        .await
        .unwrap();

    for id in [&v.volume_id, &v.volume_id, &restored.volume_id] {
        c.delete_volume(delete_volume_request(id)).await.unwrap();
    }
    for _ in 0..2 {
        c.delete_snapshot(delete_snapshot_request(&snap.snapshot_id))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_login_names_its_reason_to_the_sidecar() {
    let server = FakeUstor::start().await.unwrap();
    server.set_user("csi", "pw", Some("PasswordExpired"));
    let (mut c, _dir) = controller(&server, "pw").await;
    let err = c
        .create_volume(create("pvc-x", MIB, None))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(
        err.message().contains("PasswordExpired"),
        "{}",
        err.message()
    );
    let err = c
        .create_volume(create("pvc-x", MIB, None))
        .await
        .unwrap_err();
    assert!(err.message().contains("not retried"), "{}", err.message());
    assert_eq!(
        server.logins(),
        1,
        "the refused password is not retried at once"
    );
}

/// The connections as a fixed list, the first the oldest (in Kubernetes the glue keeps
/// them): each name's session to its uStor, or why it has none.
#[derive(Debug)]
struct FixedConnections(Vec<(&'static str, Result<Arc<UstorApi>, &'static str>)>);

impl ConnectionDirectory for FixedConnections {
    fn api(&self, connection: &str) -> Result<Arc<UstorApi>, ConnectionError> {
        match self.0.iter().find(|(name, _)| *name == connection) {
            Some((_, Ok(api))) => Ok(Arc::clone(api)),
            Some((_, Err(reason))) => Err(ConnectionError::NotUsable {
                connection: connection.to_owned(),
                reason: (*reason).to_owned(),
            }),
            None => Err(ConnectionError::Unknown {
                connection: connection.to_owned(),
            }),
        }
    }

    fn oldest(&self) -> Option<String> {
        self.0.first().map(|(name, _)| (*name).to_owned())
    }

    fn names(&self) -> Vec<String> {
        self.0.iter().map(|(name, _)| (*name).to_owned()).collect()
    }
}

/// The controller over every connection (`main`, the oldest, on `server`), as
/// `--backend ustor --kubernetes` serves it.
async fn connections_controller(
    server: &FakeUstor,
) -> (ControllerClient<Channel>, tempfile::TempDir) {
    connections_controller_with(server, &[]).await
}

/// The controller over `main` on `server` and the connections `down`, each not usable for
/// the reason given.
async fn connections_controller_with(
    server: &FakeUstor,
    down: &[(&'static str, &'static str)],
) -> (ControllerClient<Channel>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("credentials");
    std::fs::create_dir_all(&creds).unwrap();
    std::fs::write(creds.join("username"), "csi").unwrap();
    std::fs::write(creds.join("password"), "pw").unwrap();
    let api = UstorApi::new(
        &server.url(),
        None,
        Arc::new(CredentialsDir::new(&creds)),
        Timing::default(),
        Arc::new(Instant::now),
    )
    .unwrap();
    let mut connections = vec![("main", Ok(Arc::new(api)))];
    connections.extend(down.iter().map(|(name, reason)| (*name, Err(*reason))));
    let directory = FixedConnections(connections);
    let backend = ConnectionsBackend::new(Arc::new(directory), "data");
    let (client, _server) =
        common::serve_controller(dir.path(), Arc::new(backend), "test", None, None).await;
    (client, dir)
}

/// A CreateVolume the provisioner retries (its answer lost, a timeout) answers the volume
/// it made, whatever the source: a restore or clone of a connection's volume is recorded
/// with its source's connection-qualified id, and an id without the connection (the
/// single-cluster controller's) names the same source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restores_and_clones_through_the_connections_are_idempotent() {
    let server = FakeUstor::start().await.unwrap();
    server.set_user("csi", "pw", None);
    let (mut c, _dir) = connections_controller(&server).await;
    let in_main = |name: &str| {
        let mut request = create(name, 100 * MIB, Some("data"));
        request
            .parameters
            .insert("connection".to_owned(), "main".to_owned());
        request
    };
    let source = created_volume(&mut c, in_main("pvc-source")).await;
    assert_eq!(source.volume_id, "ustor:volume:main/data/test-pvc-source");
    let snap = created_snapshot(&mut c, &source.volume_id, "snap-1").await;
    assert_eq!(snap.snapshot_id, "ustor:snapshot:main/data/test-snap-1");
    let legacy_snapshot = snap.snapshot_id.replace("main/", "");

    for (name, content) in [
        ("pvc-restored", from_snapshot(&snap.snapshot_id)),
        ("pvc-cloned", from_volume(&source.volume_id)),
        ("pvc-restored-legacy", from_snapshot(&legacy_snapshot)),
    ] {
        let request = CreateVolumeRequest {
            volume_content_source: content.clone(),
            ..in_main(name)
        };
        let first = created_volume(&mut c, request.clone()).await;
        assert_eq!(first.content_source, content, "{name}");
        // Once published (the publications are written back with the volume's record),
        // and again after that: the same volume each time.
        let retried = created_volume(&mut c, request.clone()).await;
        assert_eq!(retried, first, "{name}: the retry answers the same volume");
        c.controller_publish_volume(controller_publish_request(
            &first.volume_id,
            "node-a",
            mount_capability("ext4", Mode::SingleNodeWriter),
        ))
        .await
        .unwrap();
        let retried = created_volume(&mut c, request.clone()).await;
        assert_eq!(retried, first, "{name}: after a publish, still the same");
        // Another source under the same name is still a clash.
        let other = CreateVolumeRequest {
            volume_content_source: None,
            ..request
        };
        let clash = c.create_volume(other).await.unwrap_err();
        assert_eq!(clash.code(), Code::AlreadyExists, "{name}");
    }
    assert_eq!(
        server.images(),
        [
            "data/test-pvc-cloned",
            "data/test-pvc-restored",
            "data/test-pvc-restored-legacy",
            "data/test-pvc-source"
        ],
        "one image each, none orphaned"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publications_hold_ustor_grants() {
    use controller_shim::backend::Backend;
    let server = FakeUstor::start().await.unwrap();
    server.set_user("csi", "pw", None);
    let (mut c, _dir) = controller(&server, "pw").await;
    let cap = block_capability(Mode::MultiNodeMultiWriter);
    let mut request = create_volume_request("vm-1", 100 * MIB, cap.clone());
    request.parameters.insert("pool".into(), "data".into());
    let v = created_volume(&mut c, request).await;
    let key = "data/test-vm-1";
    let publish = |node: &str| controller_publish_request(&v.volume_id, node, cap.clone());

    let context = |node: &str| {
        let request = publish(node);
        let mut c = c.clone();
        async move {
            c.controller_publish_volume(request)
                .await
                .unwrap()
                .into_inner()
                .publish_context
        }
    };
    let ctx = context("node-a").await;
    let token = server.grant_token(key, "node-a").expect("granted in uStor");
    assert_eq!(ctx["nbdGrant"], token, "the token uStor issued");
    assert_eq!(
        ctx["nbdUri"], v.volume_context["nbdUri"],
        "the URI carries no token"
    );
    assert_eq!(context("node-a").await["nbdGrant"], token, "idempotent");
    context("node-b").await;
    let b = server.grant_token(key, "node-b").unwrap();
    assert_ne!(b, token);

    c.controller_unpublish_volume(controller_unpublish_request(&v.volume_id, "node-a"))
        .await
        .unwrap();
    assert_eq!(server.grant_token(key, "node-a"), None, "revoked in uStor");
    assert_eq!(
        server.grant_token(key, "node-b"),
        Some(b),
        "node-b keeps its grant"
    );
    c.controller_unpublish_volume(controller_unpublish_request(&v.volume_id, "node-a"))
        .await
        .unwrap();

    // A grant without a publication (a crash between the two) is revoked by an unpublish
    // of every node all the same.
    let dir = tempfile::tempdir().unwrap();
    let backend = backend(&server, dir.path(), "pw");
    let stray = backend.grant(key, "node c/1", true).await.unwrap();
    assert_eq!(
        server.grant_token(key, "node c/1").as_deref(),
        Some(stray.expose()),
        "a node id that is no path segment is encoded"
    );
    let mut nodes = backend.granted_nodes(key).await.unwrap();
    nodes.sort();
    assert_eq!(
        nodes,
        ["node c/1", "node-b"],
        "listed by uStor, without tokens"
    );
    c.controller_unpublish_volume(controller_unpublish_request(&v.volume_id, ""))
        .await
        .unwrap();
    assert_eq!(
        backend.granted_nodes(key).await.unwrap(),
        Vec::<String>::new()
    );
    backend.revoke(key, "node-a").await.unwrap();
    c.delete_volume(delete_volume_request(&v.volume_id))
        .await
        .unwrap();
}

/// The nodes ControllerGetVolume says `volume_id` is published to.
async fn published_nodes(c: &mut ControllerClient<Channel>, volume_id: &str) -> Vec<String> {
    c.controller_get_volume(ControllerGetVolumeRequest {
        volume_id: volume_id.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .status
    .unwrap()
    .published_node_ids
}

/// The external-attacher gives a call up at its deadline and calls again later. Here uStor is
/// slow to answer the revoke of an unpublish (held at the server), so the call is given up
/// mid-way, between its two steps (revoke the grant, then record the publication's end):
/// - with no retry, the work goes on without its caller and the publication ends once uStor
///   answers (a handler dropped with its caller would leave the node listed for good);
/// - a retry made while the first is still under way waits for it rather than start its own
///   revoke beside it (a lock dropped with its caller would let it through to uStor).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpublish_given_up_mid_call_finishes_and_its_retry_waits_for_it() {
    let server = FakeUstor::start().await.unwrap();
    server.set_user("csi", "pw", None);
    let (mut c, _dir) = controller(&server, "pw").await;
    let v = created_volume(&mut c, create("pvc-given-up", 100 * MIB, Some("data"))).await;
    let (key, cap) = (
        "data/test-pvc-given-up",
        mount_capability("ext4", Mode::SingleNodeWriter),
    );
    let revoke = "/api/v1/pools/data/images/test-pvc-given-up/grants/node-a";
    let publish = controller_publish_request(&v.volume_id, "node-a", cap);
    let unpublish = controller_unpublish_request(&v.volume_id, "node-a");
    let caller = c.clone();
    let call = |timeout: Option<Duration>| {
        let (mut c, mut request) = (caller.clone(), tonic::Request::new(unpublish.clone()));
        if let Some(t) = timeout {
            request.set_timeout(t);
        }
        tokio::spawn(async move { c.controller_unpublish_volume(request).await })
    };

    // Given up, and never retried.
    c.controller_publish_volume(publish.clone()).await.unwrap();
    let hold = server.hold("DELETE", revoke);
    let given_up = call(Some(Duration::from_millis(300)));
    hold.arrived(1).await;
    let e = given_up.await.unwrap().unwrap_err();
    assert!(
        matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{e:?}"
    );
    assert_eq!(published_nodes(&mut c, &v.volume_id).await, ["node-a"]);
    drop(hold);
    let started = Instant::now();
    while !published_nodes(&mut c, &v.volume_id).await.is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the given-up unpublish never finished: node-a is still listed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(server.grant_token(key, "node-a"), None, "revoked in uStor");

    // Given up, and retried at once, as the attacher does after a restart.
    c.controller_publish_volume(publish).await.unwrap();
    let hold = server.hold("DELETE", revoke);
    let given_up = call(Some(Duration::from_millis(300)));
    hold.arrived(1).await;
    assert!(given_up.await.unwrap().is_err());
    let retry = call(None);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        hold.count(),
        1,
        "the retry sent a revoke of its own beside the given-up call's"
    );
    assert!(
        !retry.is_finished(),
        "the retry answered before the work it repeats ended"
    );
    drop(hold);
    tokio::time::timeout(Duration::from_secs(10), retry)
        .await
        .expect("the retry answers once uStor does")
        .unwrap()
        .unwrap();
    assert_eq!(
        published_nodes(&mut c, &v.volume_id).await,
        Vec::<String>::new()
    );
    assert_eq!(server.grant_token(key, "node-a"), None);
    c.delete_volume(delete_volume_request(&v.volume_id))
        .await
        .unwrap();
}

/// ListVolumes over uStor: every pool, only this cluster's images, the nodes and the
/// condition from uStor's grants; ControllerModifyVolume kept in the image's labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_are_listed_from_every_pool_and_modified_in_labels() {
    use controller_shim::backend::Backend;
    let server = FakeUstor::start().await.unwrap();
    server.set_user("csi", "pw", None);
    let (mut c, dir) = controller(&server, "pw").await;
    let one = created_volume(&mut c, create("pvc-1", 100 * MIB, Some("data"))).await;
    let two = created_volume(&mut c, create("pvc-2", 100 * MIB, Some("fast"))).await;
    // Another cluster's volume on the same uStor is not this controller's.
    let other_dir = tempfile::tempdir().unwrap();
    let (mut other, _server) = common::serve_controller(
        other_dir.path(),
        Arc::new(backend(&server, other_dir.path(), "pw")),
        "other",
        None,
        None,
    )
    .await;
    created_volume(&mut other, create("pvc-1", 100 * MIB, Some("data"))).await;

    let list = |c: &ControllerClient<Channel>| {
        let mut c = c.clone();
        async move {
            c.list_volumes(ListVolumesRequest::default())
                .await
                .unwrap()
                .into_inner()
                .entries
        }
    };
    let gets = server.image_gets();
    let entries = list(&c).await;
    // The listing answers each image with its NBD endpoint: no look-up per volume.
    assert_eq!(
        server.image_gets(),
        gets,
        "ListVolumes fetched images one by one"
    );
    let ids: Vec<&str> = entries
        .iter()
        .map(|e| e.volume.as_ref().unwrap().volume_id.as_str())
        .collect();
    assert_eq!(ids, [one.volume_id.as_str(), two.volume_id.as_str()]);
    assert_eq!(
        entries[0].volume.as_ref().unwrap().volume_context,
        one.volume_context
    );

    let cap = mount_capability("ext4", Mode::SingleNodeWriter);
    c.controller_publish_volume(controller_publish_request(
        &one.volume_id,
        "node-1",
        cap.clone(),
    ))
    .await
    .unwrap();
    let status = list(&c).await[0].status.clone().unwrap();
    assert_eq!(status.published_node_ids, ["node-1"]);
    assert!(!status.volume_condition.unwrap().abnormal);
    // The grant gone in uStor (revoked by hand there): the publication cannot reconnect.
    backend(&server, dir.path(), "pw")
        .revoke("data/test-pvc-1", "node-1")
        .await
        .unwrap();
    let condition = list(&c).await[0]
        .status
        .clone()
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(condition.abnormal, "{condition:?}");
    assert!(
        condition.message.contains("node-1"),
        "{}",
        condition.message
    );

    c.controller_modify_volume(ControllerModifyVolumeRequest {
        volume_id: one.volume_id.clone(),
        mutable_parameters: [("nbdConnections".to_owned(), "5".to_owned())].into(),
    })
    .await
    .unwrap();
    let stored = backend(&server, dir.path(), "pw")
        .volume("data/test-pvc-1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        stored.mutable["nbdConnections"], "5",
        "kept in uStor's labels"
    );
    let context = c
        .controller_publish_volume(controller_publish_request(&one.volume_id, "node-1", cap))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert_eq!(context["nbdConnections"], "5");

    // Through the connections, ids carry the connection.
    let (connections, _dir) = connections_controller(&server).await;
    let ids: Vec<String> = list(&connections)
        .await
        .iter()
        .map(|e| e.volume.as_ref().unwrap().volume_id.clone())
        .collect();
    assert_eq!(
        ids,
        [
            "ustor:volume:main/data/test-pvc-1",
            "ustor:volume:main/fast/test-pvc-2"
        ]
    );

    // A connection without a session: its volumes cannot be listed, so no list is answered
    // (one without them would say they are gone); each says so as its condition.
    let (mut down, _dir) =
        connections_controller_with(&server, &[("beta", "UserLocked: locked for 15 minutes")])
            .await;
    let err = down
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{}", err.message());
    assert!(err.message().contains("beta"), "{}", err.message());
    let answer = down
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: "ustor:volume:beta/data/test-pvc-9".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let condition = answer.status.unwrap().volume_condition.unwrap();
    assert!(condition.abnormal);
    assert!(
        condition.message.contains("UserLocked"),
        "{}",
        condition.message
    );
}

/// The GroupController on the CSI socket of a controller served under `dir`.
async fn group_client(
    dir: &tempfile::TempDir,
) -> csi_proto::csi::group_controller_client::GroupControllerClient<Channel> {
    let channel = wait_connect(
        &dir.path().join("csi.sock"),
        std::time::Duration::from_secs(10),
    )
    .await;
    csi_proto::csi::group_controller_client::GroupControllerClient::new(channel)
}

fn group(name: &str, volumes: &[&str]) -> CreateVolumeGroupSnapshotRequest {
    CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: volumes.iter().map(|v| (*v).to_owned()).collect(),
        parameters: Default::default(),
    }
}

/// A group snapshot is one uStor call in the members' pool: each member an ordinary snapshot
/// there (restorable alone), the group deleted with its members; through the connections,
/// ids carry the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_snapshots_are_one_call_in_the_members_pool() {
    let server = FakeUstor::start().await.unwrap();
    server.set_user("csi", "pw", None);
    let (mut c, dir) = controller(&server, "pw").await;
    let mut g = group_client(&dir).await;
    let a = created_volume(&mut c, create("a", 10 * MIB, Some("data"))).await;
    let b = created_volume(&mut c, create("b", 20 * MIB, Some("data"))).await;
    let elsewhere = created_volume(&mut c, create("far", 10 * MIB, Some("fast"))).await;

    let taken = g
        .create_volume_group_snapshot(group("vm", &[&a.volume_id, &b.volume_id]))
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(taken.group_snapshot_id, "ustor:group:data/test-vm");
    let mut members: Vec<(String, String, i64)> = taken
        .snapshots
        .iter()
        .map(|s| {
            assert_eq!(s.group_snapshot_id, taken.group_snapshot_id);
            assert!(
                s.snapshot_id.starts_with("ustor:snapshot:data/test-vm-"),
                "{s:?}"
            );
            (
                s.snapshot_id.clone(),
                s.source_volume_id.clone(),
                s.size_bytes,
            )
        })
        .collect();
    members.sort_by_key(|m| m.2);
    assert_eq!(
        members
            .iter()
            .map(|m| (m.1.as_str(), m.2))
            .collect::<Vec<_>>(),
        [
            (a.volume_id.as_str(), 10 * MIB),
            (b.volume_id.as_str(), 20 * MIB)
        ]
    );
    let again = g
        .create_volume_group_snapshot(group("vm", &[&b.volume_id, &a.volume_id]))
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(again.group_snapshot_id, taken.group_snapshot_id);
    assert_eq!(again.snapshots.len(), 2);

    let across = g
        .create_volume_group_snapshot(group("spread", &[&a.volume_id, &elsewhere.volume_id]))
        .await
        .unwrap_err();
    assert_eq!(across.code(), Code::InvalidArgument, "{across:?}");
    assert!(across.message().contains("fast"), "{across:?}");

    // A member restores alone, into its pool.
    let mut restore = create("restored", 20 * MIB, Some("data"));
    restore.volume_content_source = from_snapshot(&members[1].0);
    created_volume(&mut c, restore).await;

    g.delete_volume_group_snapshot(DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: taken.group_snapshot_id.clone(),
        snapshot_ids: members.iter().map(|m| m.0.clone()).collect(),
    })
    .await
    .unwrap();
    let left = c
        .list_snapshots(ListSnapshotsRequest {
            source_volume_id: a.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert!(left.is_empty(), "{left:?}");
    let gone = g
        .get_volume_group_snapshot(GetVolumeGroupSnapshotRequest {
            group_snapshot_id: taken.group_snapshot_id.clone(),
            snapshot_ids: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound, "{gone:?}");

    // Through the connections: the same call, ids with the connection.
    let (mut c, dir) = connections_controller(&server).await;
    let mut g = group_client(&dir).await;
    let in_main = |name: &str| {
        let mut request = create(name, 10 * MIB, Some("data"));
        request
            .parameters
            .insert("connection".to_owned(), "main".to_owned());
        request
    };
    let x = created_volume(&mut c, in_main("x")).await;
    let y = created_volume(&mut c, in_main("y")).await;
    let taken = g
        .create_volume_group_snapshot(group("pair", &[&x.volume_id, &y.volume_id]))
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(taken.group_snapshot_id, "ustor:group:main/data/test-pair");
    let got = g
        .get_volume_group_snapshot(GetVolumeGroupSnapshotRequest {
            group_snapshot_id: taken.group_snapshot_id.clone(),
            snapshot_ids: taken
                .snapshots
                .iter()
                .map(|s| s.snapshot_id.clone())
                .collect(),
        })
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    let ids = |g: &VolumeGroupSnapshot| {
        let mut v: Vec<_> = g
            .snapshots
            .iter()
            .map(|s| (s.snapshot_id.clone(), s.group_snapshot_id.clone()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(ids(&got), ids(&taken));
    assert!(ids(&got)
        .iter()
        .all(|(s, g)| s.starts_with("ustor:snapshot:main/data/") && g == &taken.group_snapshot_id));
}
