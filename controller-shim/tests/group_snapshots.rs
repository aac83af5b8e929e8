//! Group snapshots on the local backend, through the CSI socket: the members are of one point
//! in time while writers keep writing through the real export server (nbdkit behind the
//! gate, this repo's NBD client), each member restores alone, and the group's calls are
//! idempotent and refuse what does not match.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use controller_shim::backend::local::LocalBackend;
use controller_shim::backend::{Backend, SnapshotMeta};
use csi_proto::csi::controller_client::ControllerClient;
use csi_proto::csi::group_controller_client::GroupControllerClient;
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::*;
use testkit::csi::*;
use tonic::transport::Channel;
use tonic::Code;

const MIB: i64 = 1 << 20;
const MEMBERS: usize = 3;

struct Controller {
    client: ControllerClient<Channel>,
    groups: GroupControllerClient<Channel>,
    backend: LocalBackend,
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
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let listen: std::net::SocketAddr = ([127, 0, 0, 1], testkit::free_port().unwrap()).into();
    let backend = LocalBackend::open(&root, &listen.to_string()).unwrap();
    let exports = common::start_exports(&backend, listen);
    let (client, server) =
        common::serve_controller(dir.path(), Arc::new(backend.clone()), "test", None, None).await;
    let channel = wait_connect(&dir.path().join("csi.sock"), Duration::from_secs(10)).await;
    Controller {
        client,
        groups: GroupControllerClient::new(channel),
        backend,
        root,
        _dir: dir,
        tasks: vec![exports, server],
    }
}

fn block() -> VolumeCapability {
    block_capability(Mode::SingleNodeSingleWriter)
}

async fn volume(c: &mut Controller, name: &str, size: i64) -> String {
    c.client
        .create_volume(create_volume_request(name, size, block()))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id
}

fn group_request(name: &str, volumes: &[String]) -> CreateVolumeGroupSnapshotRequest {
    CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: volumes.to_vec(),
        parameters: Default::default(),
    }
}

/// CreateVolumeGroupSnapshot that must succeed: the group taken.
async fn created_group(c: &mut Controller, name: &str, volumes: &[String]) -> VolumeGroupSnapshot {
    c.groups
        .create_volume_group_snapshot(group_request(name, volumes))
        .await
        .unwrap_or_else(|e| panic!("CreateVolumeGroupSnapshot {name}: {e:?}"))
        .into_inner()
        .group_snapshot
        .unwrap()
}

/// GetVolumeGroupSnapshot of `id`, listing `snapshot_ids`.
async fn get_group(
    c: &mut Controller,
    id: &str,
    snapshot_ids: &[String],
) -> Result<VolumeGroupSnapshot, tonic::Status> {
    c.groups
        .get_volume_group_snapshot(GetVolumeGroupSnapshotRequest {
            group_snapshot_id: id.into(),
            snapshot_ids: snapshot_ids.to_vec(),
        })
        .await
        .map(|r| r.into_inner().group_snapshot.unwrap())
}

/// Every snapshot ListSnapshots answers.
async fn all_snapshots(c: &mut Controller) -> Vec<Snapshot> {
    c.client
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .map(|e| e.snapshot.unwrap())
        .collect()
}

/// The source volume of each member, by member snapshot id.
fn sources(g: &VolumeGroupSnapshot) -> BTreeMap<String, String> {
    g.snapshots
        .iter()
        .map(|s| (s.snapshot_id.clone(), s.source_volume_id.clone()))
        .collect()
}

/// One writer's log: for its n-th write (the value n, written at offset 0), when it was sent
/// and when the server acknowledged it.
type Log = Vec<(Instant, Instant)>;

/// Writes 1, 2, 3, … (a big-endian u64 in a 512-byte block at offset 0) through the export
/// `uri` until `stop`, one at a time, each waiting for the server's reply.
fn writer(uri: &str, stop: &AtomicBool) -> Log {
    let uri: nbd::NbdUri = uri.parse().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let opts = nbd::dial::DialOptions {
        deadline: Duration::from_secs(5),
        ..Default::default()
    };
    let (_, fd) = runtime.block_on(async {
        let started = Instant::now();
        loop {
            match nbd::dial::dial_one(&uri, &opts).await {
                Ok(dialed) => return dialed,
                Err(e) => assert!(started.elapsed() < Duration::from_secs(10), "dial: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let mut s = std::net::TcpStream::from(fd);
    let mut log = Log::new();
    for n in 1u64.. {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let mut request = Vec::with_capacity(28 + 512);
        request.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        request.extend_from_slice(&0u16.to_be_bytes()); // flags
        request.extend_from_slice(&1u16.to_be_bytes()); // NBD_CMD_WRITE
        request.extend_from_slice(&n.to_be_bytes()); // handle
        request.extend_from_slice(&0u64.to_be_bytes()); // offset
        request.extend_from_slice(&512u32.to_be_bytes());
        let mut block = [0u8; 512];
        block[..8].copy_from_slice(&n.to_be_bytes());
        request.extend_from_slice(&block);
        let sent = Instant::now();
        s.write_all(&request).unwrap();
        let mut reply = [0u8; 16];
        s.read_exact(&mut reply).unwrap();
        let acked = Instant::now();
        assert_eq!(&reply[..4], &0x6744_6698u32.to_be_bytes(), "reply magic");
        assert_eq!(&reply[4..8], &[0; 4], "write {n} failed");
        assert_eq!(&reply[8..], &n.to_be_bytes(), "reply handle");
        log.push((sent, acked));
    }
    log
}

/// The last value written to a restored member's image (0 if none).
fn last_value(c: &Controller, volume_id: &str) -> u64 {
    let image = volume_id.rsplit(':').next().unwrap();
    let bytes = testkit::read_at(&c.root.join("images").join(image), 0, 8);
    u64::from_be_bytes(bytes.try_into().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_is_taken_at_one_point_in_time_while_writers_write() {
    let mut c = start().await;
    let mut volumes = Vec::new();
    let mut uris = Vec::new();
    for i in 0..MEMBERS {
        let v = volume(&mut c, &format!("disk-{i}"), 64 * MIB).await;
        // Data to copy past the first block, so copying a member takes a while: without
        // writes held, the members would be copied many writes apart.
        let image = v.rsplit(':').next().unwrap();
        testkit::write_at(
            &c.root.join("images").join(image),
            1 << 20,
            &vec![0x5a; 16 << 20],
        );
        let published = c
            .client
            .controller_publish_volume(controller_publish_request(&v, "vm-node", block()))
            .await
            .unwrap()
            .into_inner()
            .publish_context;
        uris.push(format!("{}@{}", published["nbdUri"], published["nbdGrant"]));
        volumes.push(v);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let logs = Arc::new(Mutex::new(vec![Log::new(); MEMBERS]));
    let writers: Vec<_> = uris
        .iter()
        .enumerate()
        .map(|(i, uri)| {
            let (uri, stop, logs) = (uri.clone(), Arc::clone(&stop), Arc::clone(&logs));
            std::thread::spawn(move || {
                let log = writer(&uri, &stop);
                logs.lock().unwrap()[i] = log;
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let group = created_group(&mut c, "vm-1", &volumes).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    let logs = logs.lock().unwrap().clone();
    // For the record (not asserted): the longest a write waited, about the hold's length.
    let longest = logs
        .iter()
        .flatten()
        .map(|(sent, acked)| *acked - *sent)
        .max()
        .unwrap_or_default();
    eprintln!(
        "writes: {:?}; the longest waited {longest:?}",
        logs.iter().map(Vec::len).collect::<Vec<_>>()
    );

    assert!(group.ready_to_use);
    assert!(group.group_snapshot_id.starts_with("local:group:"));
    assert_eq!(group.snapshots.len(), MEMBERS);
    let by_source: BTreeMap<String, String> =
        sources(&group).into_iter().map(|(s, v)| (v, s)).collect();
    assert_eq!(
        by_source.keys().cloned().collect::<BTreeSet<_>>(),
        volumes.iter().cloned().collect::<BTreeSet<_>>()
    );

    // Each member restored alone, and what it holds.
    let mut latest_sent = None::<Instant>;
    let mut earliest_unseen_ack = None::<Instant>;
    for (i, v) in volumes.iter().enumerate() {
        let snapshot = &by_source[v];
        let mut restore = create_volume_request(&format!("restore-{i}"), 64 * MIB, block());
        restore.volume_content_source = from_snapshot(snapshot);
        let restored = c
            .client
            .create_volume(restore)
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let n = usize::try_from(last_value(&c, &restored.volume_id)).unwrap();
        let log = &logs[i];
        assert!(n > 0, "member {i} holds no write: the writers never ran?");
        assert!(
            n < log.len(),
            "member {i} holds write {n}, but its writer went on to {}: the group must have been \
             taken while it wrote",
            log.len()
        );
        // Write n is in the member, write n + 1 is not.
        let (sent, _) = log[n - 1];
        let (_, next_acked) = log[n];
        latest_sent = Some(latest_sent.map_or(sent, |t| t.max(sent)));
        earliest_unseen_ack = Some(earliest_unseen_ack.map_or(next_acked, |t| t.min(next_acked)));
    }
    // One point in time T lies after every write the members hold was sent and before every
    // write they lack was acknowledged: only writes in flight at T may go either way.
    let (latest_sent, earliest_unseen_ack) = (latest_sent.unwrap(), earliest_unseen_ack.unwrap());
    assert!(
        latest_sent < earliest_unseen_ack,
        "not one point in time: a member holds a write sent {:?} after another member's \
         missing write was acknowledged",
        latest_sent - earliest_unseen_ack
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_calls_are_idempotent_list_their_members_and_delete_them() {
    let mut c = start().await;
    let a = volume(&mut c, "a", 4 * MIB).await;
    let b = volume(&mut c, "b", 4 * MIB).await;
    let other = volume(&mut c, "other", 4 * MIB).await;
    let first = created_group(&mut c, "pair", &[a.clone(), b.clone()]).await;
    // Repeated, sources in another order: the same group.
    let again = created_group(&mut c, "pair", &[b.clone(), a.clone()]).await;
    assert_eq!(again.group_snapshot_id, first.group_snapshot_id);
    assert_eq!(sources(&again), sources(&first));
    // The same name for other volumes.
    let clash = c
        .groups
        .create_volume_group_snapshot(group_request("pair", &[a.clone(), other.clone()]))
        .await
        .unwrap_err();
    assert_eq!(clash.code(), Code::AlreadyExists, "{clash:?}");

    // Each member is an ordinary snapshot too, listed with its group.
    let members: BTreeSet<_> = all_snapshots(&mut c)
        .await
        .into_iter()
        .filter(|s| s.group_snapshot_id == first.group_snapshot_id)
        .map(|s| s.snapshot_id)
        .collect();
    assert_eq!(members, sources(&first).into_keys().collect());

    let ids: Vec<String> = sources(&first).into_keys().collect();
    let got = get_group(&mut c, &first.group_snapshot_id, &ids)
        .await
        .unwrap();
    assert_eq!(sources(&got), sources(&first));
    assert_eq!(got.creation_time, first.creation_time);

    // snapshot_ids naming what is not a member is a mismatch; nothing is deleted by it.
    let lone = c
        .client
        .create_snapshot(snapshot_request(&other, "lone"))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    let mismatch = c
        .groups
        .delete_volume_group_snapshot(DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: first.group_snapshot_id.clone(),
            snapshot_ids: vec![ids[0].clone(), lone.snapshot_id.clone()],
        })
        .await
        .unwrap_err();
    assert_eq!(mismatch.code(), Code::InvalidArgument, "{mismatch:?}");
    assert!(
        mismatch.message().contains(&lone.snapshot_id),
        "{mismatch:?}"
    );
    let still = get_group(&mut c, &first.group_snapshot_id, &[])
        .await
        .unwrap();
    assert_eq!(still.snapshots.len(), 2);

    // Deleted: the group and its members; the lone snapshot stays. Repeated: still fine.
    for _ in 0..2 {
        c.groups
            .delete_volume_group_snapshot(DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: first.group_snapshot_id.clone(),
                snapshot_ids: ids.clone(),
            })
            .await
            .unwrap();
    }
    let gone = get_group(&mut c, &first.group_snapshot_id, &[])
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound, "{gone:?}");
    let left: Vec<String> = all_snapshots(&mut c)
        .await
        .into_iter()
        .map(|s| s.snapshot_id)
        .collect();
    assert_eq!(left, vec![lone.snapshot_id]);
    for id in &ids {
        let image = id.rsplit(':').next().unwrap();
        assert!(
            !c.root.join("snapshots").join(image).exists(),
            "{id} left data"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_group_requests_get_the_spec_codes() {
    let mut c = start().await;
    let a = volume(&mut c, "a", 4 * MIB).await;
    let cases: Vec<(CreateVolumeGroupSnapshotRequest, Code, &str)> = vec![
        (
            group_request("", std::slice::from_ref(&a)),
            Code::InvalidArgument,
            "name",
        ),
        (
            group_request("g", &[]),
            Code::InvalidArgument,
            "source_volume_ids",
        ),
        (
            group_request("g", &[a.clone(), a.clone()]),
            Code::InvalidArgument,
            "more than once",
        ),
        (
            group_request("g", &[a.clone(), "local:volume:test-gone".into()]),
            Code::NotFound,
            "test-gone",
        ),
        (
            CreateVolumeGroupSnapshotRequest {
                parameters: [("consistency".to_owned(), "crash".to_owned())].into(),
                ..group_request("g", std::slice::from_ref(&a))
            },
            Code::InvalidArgument,
            "consistency",
        ),
    ];
    for (request, code, says) in cases {
        let e = c
            .groups
            .create_volume_group_snapshot(request.clone())
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{request:?}: {e:?}");
        assert!(e.message().contains(says), "{request:?}: {e:?}");
    }
    // A refused group left no member behind.
    assert!(all_snapshots(&mut c).await.is_empty());

    let get = |id: &str| GetVolumeGroupSnapshotRequest {
        group_snapshot_id: id.into(),
        snapshot_ids: vec![],
    };
    let e = c
        .groups
        .get_volume_group_snapshot(get(""))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = c
        .groups
        .get_volume_group_snapshot(get("local:group:test-never"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    // Another driver's id: nothing of ours, nothing deleted.
    c.groups
        .delete_volume_group_snapshot(DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: "some-other-driver-id".into(),
            snapshot_ids: vec![],
        })
        .await
        .unwrap();
    let e = c
        .groups
        .delete_volume_group_snapshot(DeleteVolumeGroupSnapshotRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
}

/// A controller killed after copying some members but before recording the group: the CO's
/// retry takes every member anew, at one new point in time; a snapshot of the member's name
/// that no group took is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_cut_short_is_taken_anew_and_never_over_a_lone_snapshot() {
    let mut c = start().await;
    let a = volume(&mut c, "a", 4 * MIB).await;
    let b = volume(&mut c, "b", 4 * MIB).await;
    let image = |id: &str| id.rsplit(':').next().unwrap().to_owned();
    let member = |group: &str, source: &str| {
        controller_shim::ids::member_image("test", group, &image(source)).unwrap()
    };
    let image_a = c.root.join("images").join(image(&a));
    testkit::write_at(&image_a, 0, b"old!");

    // What the crashed attempt left: a's member, copied when a held "old!", no group record.
    let left = member("cut", &a);
    c.backend
        .create_snapshot(
            &left,
            &SnapshotMeta {
                name: "cut".into(),
                source_image: image(&a),
                size: 4 << 20,
                created: 1,
                group: Some("test-cut".into()),
            },
        )
        .await
        .unwrap();
    testkit::write_at(&image_a, 0, b"new!");
    let group = created_group(&mut c, "cut", &[a.clone(), b.clone()]).await;
    assert_eq!(group.snapshots.len(), 2);
    assert_eq!(
        testkit::read_at(&c.root.join("snapshots").join(&left), 0, 4),
        b"new!",
        "the member left by the cut-short attempt was taken again"
    );

    // An ordinary snapshot under a member's name is not the group's to overwrite.
    let lone = member("lonely", &b);
    c.backend
        .create_snapshot(
            &lone,
            &SnapshotMeta {
                name: "someone's".into(),
                source_image: image(&b),
                size: 4 << 20,
                created: 1,
                group: None,
            },
        )
        .await
        .unwrap();
    let e = c
        .groups
        .create_volume_group_snapshot(group_request("lonely", std::slice::from_ref(&b)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    assert!(c
        .backend
        .snapshot(&lone)
        .await
        .unwrap()
        .unwrap()
        .group
        .is_none());
}
