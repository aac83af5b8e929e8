//! The library against the real kernel NBD driver. These need root and the nbd module, so
//! they are ignored on the host and run inside the VM harness (`tests/vm/run`) on every
//! supported kernel line, where they must pass.

#![allow(clippy::unwrap_used)] // a test fails by panicking

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nbd::attach::{self, AttachOptions, Attached};
use nbd::dial::DialOptions;
use nbd::netlink::{LinkDeadEvents, NbdNetlink, ReconfigureRequest};
use nbd::sysfs::Sysfs;
use nbd::{BackendId, DeviceIndex, NbdUri};
use testkit::{pattern, DirectFile, Listen, NbdServer};

const MIB: u64 = 1 << 20;
/// [`MIB`] as a buffer length.
const MIB_LEN: usize = 1 << 20;
const RELEASE: Duration = Duration::from_secs(10);

/// A sparse backing file for nbdkit's file plugin: what the server really stores, readable
/// from the test without going through the kernel.
struct Backing {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Backing {
    fn new(size: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        std::fs::File::create(&path).unwrap().set_len(size).unwrap();
        Self { _dir: dir, path }
    }

    fn file_arg(&self) -> String {
        format!("file={}", self.path.display())
    }

    fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        testkit::read_at(&self.path, offset, len)
    }
}

fn id(s: &str) -> BackendId {
    BackendId::new(s).unwrap()
}

async fn attach(nl: &NbdNetlink, uri: &NbdUri, identifier: &str) -> Attached {
    attach::attach(
        nl,
        &Sysfs::default(),
        uri,
        &AttachOptions::new(id(identifier)),
    )
    .await
    .unwrap_or_else(|e| panic!("attaching {uri} as {identifier}: {e}"))
}

async fn detach(nl: &NbdNetlink, a: &Attached) {
    attach::detach(
        nl,
        &Sysfs::default(),
        a.device.index(),
        a.device.identifier(),
        RELEASE,
    )
    .await
    .unwrap();
}

fn dev(index: DeviceIndex) -> PathBuf {
    Sysfs::default().dev_path(index)
}

/// Writes `len` bytes of pattern `seed` at `offset` through the device with O_DIRECT and
/// checks that the server's backing file holds exactly that.
fn round_trip(device: &Path, backing: &Backing, seed: u64, offset: u64, len: usize) {
    let data = pattern(seed, offset, len);
    let f = DirectFile::open(device, true).unwrap();
    f.write_at(&data, offset).unwrap();
    f.sync().unwrap();
    assert!(
        backing.read(offset, len) == data,
        "server-side bytes differ at {offset}"
    );
    assert!(
        f.read_at(len, offset).unwrap() == data,
        "device read-back differs at {offset}"
    );
}

#[tokio::test]
#[ignore = "vm: needs root and the nbd module"]
async fn attach_over_tcp_and_unix_round_trips_data() {
    let nl = NbdNetlink::open().await.unwrap();
    for (n, listen) in [Listen::Tcp, Listen::Unix].into_iter().enumerate() {
        let backing = Backing::new(64 * MIB);
        let server = NbdServer::nbdkit(listen, &["file", &backing.file_arg()]).unwrap();
        let a = attach(&nl, &server.uri(), &format!("roundtrip-{n}")).await;
        assert_eq!(a.info.size, 64 * MIB);
        assert_eq!(
            Sysfs::default().size_bytes(a.device.index()).unwrap(),
            64 * MIB
        );
        assert_eq!(
            Sysfs::default().scheduler(a.device.index()).unwrap(),
            "none"
        );
        let device = dev(a.device.index());
        round_trip(&device, &backing, n as u64, 0, MIB_LEN);
        round_trip(
            &device,
            &backing,
            n as u64 + 10,
            40 * MIB + 4096,
            256 * 1024,
        );
        round_trip(&device, &backing, n as u64 + 20, 64 * MIB - 8192, 8192);
        detach(&nl, &a).await;
    }
}

#[tokio::test]
#[ignore = "vm: needs root and the nbd module"]
async fn identifier_is_shown_and_status_follows_disconnect() {
    let nl = NbdNetlink::open().await.unwrap();
    let sysfs = Sysfs::default();
    let server = NbdServer::nbdkit(Listen::Unix, &["memory", "64M"]).unwrap();
    let a = attach(&nl, &server.uri(), "pvc-1234:att-1").await;
    let index = a.device.index();

    assert_eq!(
        sysfs.backend(index).unwrap().as_deref(),
        Some("pvc-1234:att-1")
    );
    let status = nl.status(Some(index)).await.unwrap();
    assert_eq!(status.len(), 1);
    assert!(status[0].connected && status[0].index == index);
    assert!(nl
        .status(None)
        .await
        .unwrap()
        .iter()
        .any(|s| s.index == index && s.connected));

    // Proof of ownership: the wrong identifier is refused and the device stays attached.
    let err = attach::detach(&nl, &sysfs, index, &id("pvc-9999:att-1"), RELEASE)
        .await
        .unwrap_err();
    assert!(matches!(err, nbd::Error::NotOurs { .. }), "{err}");
    assert!(nl.status(Some(index)).await.unwrap()[0].connected);

    detach(&nl, &a).await;
    assert_eq!(sysfs.backend(index).unwrap(), None);
    let after = nl.status(Some(index)).await.unwrap();
    assert!(after.iter().all(|s| !s.connected), "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn eight_concurrent_connects_get_distinct_devices() {
    let nl = Arc::new(NbdNetlink::open().await.unwrap());
    let server = NbdServer::nbdkit(Listen::Tcp, &["memory", "16M"]).unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..8 {
        let nl = Arc::clone(&nl);
        let uri = server.uri();
        tasks.spawn(async move { attach(&nl, &uri, &format!("concurrent-{n}")).await });
    }
    let mut attached = Vec::new();
    while let Some(a) = tasks.join_next().await {
        attached.push(a.unwrap());
    }
    let mut indices: Vec<_> = attached.iter().map(|a| a.device.index()).collect();
    indices.sort();
    indices.dedup();
    assert_eq!(indices.len(), 8, "distinct devices: {indices:?}");
    let sysfs = Sysfs::default();
    for a in &attached {
        assert_eq!(
            sysfs.backend(a.device.index()).unwrap().as_deref(),
            Some(a.device.identifier().as_str())
        );
    }
    for a in &attached {
        detach(&nl, a).await;
    }
}

#[tokio::test]
#[ignore = "vm: needs root and the nbd module"]
async fn four_connections_to_a_multi_conn_export() {
    let nl = NbdNetlink::open().await.unwrap();
    let backing = Backing::new(64 * MIB);
    let log = backing.path.with_extension("log");
    let log_arg = format!("logfile={}", log.display());
    let server = NbdServer::nbdkit(
        Listen::Tcp,
        &["--filter=log", "file", &backing.file_arg(), &log_arg],
    )
    .unwrap();
    let mut opts = AttachOptions::new(id("multi-conn"));
    opts.dial.connections = 4;
    let a = attach::attach(&nl, &Sysfs::default(), &server.uri(), &opts)
        .await
        .unwrap();
    assert!(a.info.multi_conn());
    assert_eq!(a.sockets.len(), 4);
    let log_text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        log_text.matches(" Connect export=").count(),
        4,
        "{log_text}"
    );

    // Enough parallel I/O that requests spread over the connections.
    let device = dev(a.device.index());
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (device, backing) = (&device, &backing);
            s.spawn(move || round_trip(device, backing, 100 + t, t * 8 * MIB, 2 * MIB_LEN));
        }
    });
    detach(&nl, &a).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn link_loss_is_healed_without_io_errors() {
    const TOTAL: u64 = 24 * MIB;
    const CHUNK: usize = 64 * 1024;
    let nl = NbdNetlink::open().await.unwrap();
    let sysfs = Sysfs::default();
    let backing = Backing::new(64 * MIB);
    let mut server = NbdServer::nbdkit(Listen::Tcp, &["file", &backing.file_arg()]).unwrap();
    let mut events = LinkDeadEvents::subscribe().await.unwrap();

    let mut opts = AttachOptions::new(id("heal-me"));
    // Requests in flight when the link dies are requeued after this, then wait for RECONFIGURE.
    opts.io_timeout = Some(Duration::from_secs(3));
    opts.dead_conn_timeout = Duration::from_secs(60);
    let a = attach::attach(&nl, &sysfs, &server.uri(), &opts)
        .await
        .unwrap();
    let index = a.device.index();

    let written = Arc::new(AtomicU64::new(0));
    let writer = {
        let device = dev(index);
        let written = Arc::clone(&written);
        std::thread::spawn(move || -> std::io::Result<()> {
            let f = DirectFile::open(&device, true)?;
            let mut offset = 0;
            while offset < TOTAL {
                f.write_at(&pattern(7, offset, CHUNK), offset)?;
                offset += CHUNK as u64;
                written.store(offset, Ordering::SeqCst);
            }
            f.sync()
        })
    };
    while written.load(Ordering::SeqCst) < 2 * MIB {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    server.kill();
    let killed = Instant::now();
    let dead = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match events.next().await {
                Some(Ok(i)) if i == index => return i,
                Some(Ok(_)) => continue,
                other => panic!("LINK_DEAD stream ended: {other:?}"),
            }
        }
    })
    .await
    .expect("LINK_DEAD within 20 s of killing the server");
    assert_eq!(dead, index);
    assert!(
        written.load(Ordering::SeqCst) < TOTAL,
        "the writer was still running at the kill"
    );

    tokio::time::sleep(Duration::from_secs(2).saturating_sub(killed.elapsed())).await;
    server.start().unwrap();
    let proven = sysfs.prove(index, &id("heal-me")).unwrap();
    let dial = DialOptions::default();
    let mut tries = 0;
    while let Err(e) = attach::reconnect(&nl, &server.uri(), &proven, &dial).await {
        tries += 1;
        assert!(tries < 50, "reconnect kept failing: {e}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let result = tokio::task::spawn_blocking(move || writer.join())
        .await
        .unwrap()
        .expect("writer thread panicked");
    result.expect("the writer saw no I/O error");

    for offset in (0..TOTAL).step_by(MIB_LEN) {
        let want: Vec<u8> = (0..MIB)
            .step_by(CHUNK)
            .flat_map(|o| pattern(7, offset + o, CHUNK))
            .collect();
        assert!(
            backing.read(offset, MIB_LEN) == want,
            "data differs in the MiB at {offset}"
        );
    }

    // RECONFIGURE under another identifier is refused by the kernel itself.
    let stranger = nbd::dial::dial(&server.uri(), &dial).await.unwrap();
    let fds: Vec<_> = stranger
        .sockets
        .iter()
        .map(std::os::fd::AsFd::as_fd)
        .collect();
    let err = nl
        .reconfigure(&ReconfigureRequest {
            index,
            identifier: &id("someone-else"),
            sockets: &fds,
            size_bytes: None,
            dead_conn_timeout: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.errno(), Some(libc::EINVAL), "{err}");
    assert_eq!(sysfs.backend(index).unwrap().as_deref(), Some("heal-me"));
    round_trip(&dev(index), &backing, 8, 30 * MIB, 64 * 1024);

    detach(&nl, &a).await;
}

#[tokio::test]
#[ignore = "vm: needs root and the nbd module"]
async fn read_only_export_gives_a_read_only_device() {
    let nl = NbdNetlink::open().await.unwrap();
    let backing = Backing::new(8 * MIB);
    std::fs::write(&backing.path, pattern(5, 0, 8 * MIB_LEN)).unwrap();
    let server = NbdServer::nbdkit(Listen::Unix, &["-r", "file", &backing.file_arg()]).unwrap();
    let a = attach(&nl, &server.uri(), "read-only").await;
    let index = a.device.index();
    assert!(a.info.read_only());
    assert!(Sysfs::default().read_only(index).unwrap());

    let f = DirectFile::open(&dev(index), false).unwrap();
    assert!(f.read_at(4096, 4096).unwrap() == pattern(5, 4096, 4096));

    let refused = DirectFile::open(&dev(index), true).and_then(|f| f.write_at(&[0xaa; 4096], 0));
    let err = refused.expect_err("a write to a read-only device must fail");
    assert!(
        matches!(
            err.raw_os_error(),
            Some(libc::EROFS | libc::EPERM | libc::EACCES)
        ),
        "{err}"
    );
    assert!(
        backing.read(0, 4096) == pattern(5, 0, 4096),
        "the export is unchanged"
    );
    // An open device keeps its configuration past DISCONNECT until the last close.
    drop(f);
    detach(&nl, &a).await;
}

#[tokio::test]
#[ignore = "vm: needs root and the nbd module"]
async fn explicit_index_and_busy_device() {
    let nl = NbdNetlink::open().await.unwrap();
    let server = NbdServer::nbdkit(Listen::Unix, &["memory", "4M"]).unwrap();
    let first = attach(&nl, &server.uri(), "explicit-a").await;
    let index = first.device.index();

    // A configured device is refused, not taken over, even after the retry window.
    let mut opts = AttachOptions::new(id("explicit-b"));
    opts.index = Some(index);
    let err = attach::attach(&nl, &Sysfs::default(), &server.uri(), &opts)
        .await
        .unwrap_err();
    assert_eq!(err.errno(), Some(libc::EBUSY), "{err}");
    assert_eq!(
        Sysfs::default().backend(index).unwrap().as_deref(),
        Some("explicit-a")
    );

    detach(&nl, &first).await;
    // The freed index can be asked for by number.
    let again = attach::attach(&nl, &Sysfs::default(), &server.uri(), &opts)
        .await
        .unwrap();
    assert_eq!(again.device.index(), index);
    detach(&nl, &again).await;
}

/// A size RECONFIGURE goes out only if its gate holds, and the gate runs on the sending
/// thread, where it can read what the kernel shows of the device just before the send.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "vm: needs root and the nbd module"]
async fn a_gated_resize_is_sent_only_when_its_gate_holds() {
    let nl = NbdNetlink::open().await.unwrap();
    let server = NbdServer::nbdkit(Listen::Unix, &["memory", "8M"]).unwrap();
    let a = attach(&nl, &server.uri(), "gated-resize").await;
    let (sysfs, index) = (Sysfs::default(), a.device.index());
    let before = sysfs.size_bytes(index).unwrap();
    let smaller = before / 2;
    let request = ReconfigureRequest {
        index,
        identifier: a.device.identifier(),
        sockets: &[],
        size_bytes: Some(smaller),
        dead_conn_timeout: None,
    };

    assert!(!nl.reconfigure_when(&request, || false).await.unwrap());
    assert_eq!(
        sysfs.size_bytes(index).unwrap(),
        before,
        "a gate that does not hold sends nothing"
    );

    let seen = Arc::new(AtomicU64::new(u64::MAX));
    let (gate_seen, gate_sysfs) = (Arc::clone(&seen), sysfs.clone());
    let sent = nl
        .reconfigure_when(&request, move || {
            gate_seen.store(gate_sysfs.in_flight(index).unwrap(), Ordering::SeqCst);
            true
        })
        .await
        .unwrap();
    assert!(sent);
    assert_eq!(
        seen.load(Ordering::SeqCst),
        0,
        "the gate saw the idle device"
    );
    sysfs.wait_ready(index, smaller, RELEASE).await.unwrap();
    detach(&nl, &a).await;
}
