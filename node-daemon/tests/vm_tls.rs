//! NBD over TLS with the kernel doing the crypto: STARTTLS and the TLS handshake in the daemon,
//! the session's keys installed as kernel TLS, the socket handed to the nbd driver. Against
//! nbdkit `--tls=require` with certificates made by the test. Ignored on the host; run in the
//! VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking
#![allow(clippy::cast_possible_truncation)] // buffer sizes of a few MiB, on 64-bit guests

use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use testkit::csi::NodeClients;
use testkit::daemon::NodeDaemon;
use testkit::tls::TestPki;
use testkit::{kernel_io_errors, pattern, DirectFile, Listen};
use tonic::Code;

mod common;
use common::*;

/// `/proc/net/tls_stat` as name → value.
fn tls_stat() -> std::collections::HashMap<String, u64> {
    std::fs::read_to_string("/proc/net/tls_stat")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?.to_owned(), f.next()?.parse().ok()?))
        })
        .collect()
}

/// One `/proc/net/tls_stat` counter (0 when absent).
fn tls_counter(name: &str) -> u64 {
    tls_stat().get(name).copied().unwrap_or(0)
}

/// A daemon trusting `pki`'s CA and presenting its client certificate, started.
async fn daemon_trusting(node_id: &str, pki: &TestPki) -> (NodeDaemon, NodeClients) {
    let mut daemon = NodeDaemon::new(node_id, &format!("{CONFIG}{}", pki.node_config())).unwrap();
    let c = daemon.start(None).await;
    (daemon, c)
}

/// Writes `len` bytes of a pattern with O_DIRECT at `offset`, reads them back the same way,
/// and returns the SHA-256 of what was read (the written pattern's must match).
fn direct_round_trip(vol: &Volume, offset: u64, len: usize, seed: u64) -> [u8; 32] {
    const CHUNK: usize = 4 << 20;
    let f = DirectFile::open(&vol.target, true).unwrap();
    let mut wrote = Sha256::new();
    for at in (0..len).step_by(CHUNK) {
        let data = pattern(seed, offset + at as u64, CHUNK.min(len - at));
        wrote.update(&data);
        f.write_at(&data, offset + at as u64).unwrap();
    }
    f.sync().unwrap();
    let mut read = Sha256::new();
    for at in (0..len).step_by(CHUNK) {
        read.update(f.read_at(CHUNK.min(len - at), offset + at as u64).unwrap());
    }
    let (wrote, read): ([u8; 32], [u8; 32]) = (wrote.finalize().into(), read.finalize().into());
    assert_eq!(read, wrote, "read back differs from what was written");
    read
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root, the nbd and tls modules"]
async fn tls_is_handed_to_the_kernel_and_needs_no_process() {
    let pki = TestPki::new("ustor test CA").unwrap();
    let (mut daemon, mut c) = daemon_trusting("ktls", &pki).await;
    let (tx_before, rx_before) = (tls_counter("TlsCurrTxSw"), tls_counter("TlsCurrRxSw"));

    let vol = Volume::new_tls(&daemon, "tls-proof", 96 * MIB, block(), &pki);
    assert!(vol.uri().starts_with("nbds://"), "{}", vol.uri());
    vol.up(&mut c).await;
    assert!(
        tls_counter("TlsCurrTxSw") > tx_before && tls_counter("TlsCurrRxSw") > rx_before,
        "no kernel TLS session in TX and RX: {:?}",
        tls_stat()
    );
    let sum = direct_round_trip(&vol, 0, 64 * MIB as usize, 50);
    // The server's file holds the data: it went through the kernel's encryption and back.
    let mut on_disk = Sha256::new();
    on_disk.update(vol.read_backing(0, 64 * MIB as usize));
    assert_eq!(<[u8; 32]>::from(on_disk.finalize()), sum);
    assert_eq!(tls_counter("TlsDecryptError"), 0);

    // No process in the data path: the daemon gone, I/O still flows.
    daemon.kill();
    direct_round_trip(&vol, 70 * MIB, 16 * MIB as usize, 51);
    let mut c = daemon.start(None).await;
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root, the nbd and tls modules"]
async fn tls_refusals_name_their_cause_and_leave_nothing_attached() {
    let pki = TestPki::new("ustor test CA").unwrap();
    let (daemon, mut c) = daemon_trusting("ktls-no", &pki).await;

    // A server without TLS: STARTTLS refused, never a plaintext fallback.
    let mut plain = Volume::new_on(&daemon, "tls-plain", 16 * MIB, block(), Listen::Tcp);
    plain.tls = true;
    let err = plain.stage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("STARTTLS"), "{}", err.message());

    // A server whose certificate another CA signed.
    let stranger = TestPki::new("another CA").unwrap();
    let forged = Volume::new_tls(&daemon, "tls-forged", 16 * MIB, block(), &stranger);
    let err = forged.stage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("TLS"), "{}", err.message());

    // A server whose certificate expired, signed by the CA the node trusts (the node's files
    // are replaced in place: they are read at every dial).
    pki.replace_with(&TestPki::with_expired_server("ustor test CA").unwrap())
        .unwrap();
    let expired = Volume::new_tls(&daemon, "tls-expired", 16 * MIB, block(), &pki);
    let err = expired.stage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message().contains("certificate expired"),
        "{}",
        err.message()
    );

    // A volume naming a TLS profile this node does not define: refused before dialing.
    let unprofiled = Volume::new_tls(&daemon, "tls-unprofiled", 16 * MIB, block(), &pki)
        .with_tls_profile("nowhere");
    let err = unprofiled.stage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message().contains("[tls-profile.nowhere]"),
        "{}",
        err.message()
    );

    for vol in [&plain, &forged, &expired, &unprofiled] {
        assert!(vol.device(&daemon).is_none(), "{} left a device", vol.id);
    }
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root, the nbd and tls modules"]
async fn a_dropped_tls_link_is_healed_and_rotated_certificates_are_used() {
    let pki = TestPki::new("first CA").unwrap();
    let (daemon, mut c) = daemon_trusting("ktls-heal", &pki).await;
    let vol = Volume::new_tls(&daemon, "tls-heal", 32 * MIB, block(), &pki);
    vol.up(&mut c).await;
    let errors = kernel_io_errors();
    direct_round_trip(&vol, 0, 4 * MIB as usize, 60);

    // The server restarts: the link dies, the healer redials with a new TLS handshake and
    // hands the kernel a new kernel-TLS socket; I/O waits and then goes through.
    let mut vol = vol;
    vol.server.kill();
    vol.server.start().unwrap();
    direct_round_trip(&vol, 4 * MIB, 4 * MIB as usize, 61);

    // Certificates rotated on both sides (a new CA, server and client certificates), the
    // daemon not restarted: the next connection uses the new files.
    let next = TestPki::new("second CA").unwrap();
    pki.replace_with(&next).unwrap();
    vol.server.start().unwrap();
    direct_round_trip(&vol, 8 * MIB, 4 * MIB as usize, 62);

    assert_eq!(
        kernel_io_errors(),
        errors,
        "the applications saw I/O errors"
    );
    assert_eq!(tls_counter("TlsDecryptError"), 0);
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

/// The TCP connections the journal records for `volume` (local, peer).
fn journaled_connections(
    daemon: &NodeDaemon,
    volume: &str,
) -> Vec<(std::net::SocketAddr, std::net::SocketAddr)> {
    journal_record(daemon, volume)["tcp"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|c| {
            (
                c["local"].as_str().unwrap().parse().unwrap(),
                c["peer"].as_str().unwrap().parse().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root, the nbd and tls modules"]
async fn a_tls_filesystem_on_four_connections_grows_heals_and_outlives_the_daemon() {
    // The volume names a TLS profile, as the controller does for a uStor connection; the
    // node's default TLS files belong to another CA and would be refused.
    let pki = TestPki::new("connection CA").unwrap();
    let other = TestPki::new("default CA").unwrap();
    let config = format!(
        "{CONFIG}{}{}{}",
        other.node_config(),
        pki.profile_config("lab"),
        pki.profile_config("renamed")
    );
    let mut daemon = NodeDaemon::new("ktls-fs", &config).unwrap();
    let mut c = daemon.start(None).await;
    let sessions = tls_counter("TlsTxSw");
    let mut vol = Volume::new_tls(&daemon, "tls-fs", 64 * MIB, ext4(), &pki)
        .with_connections(4)
        .with_tls_profile("lab");
    vol.up(&mut c).await;
    let errors = kernel_io_errors();
    assert!(
        tls_counter("TlsTxSw") >= sessions + 4,
        "four kernel TLS sessions: {:?}",
        tls_stat()
    );
    write_and_check_file(&vol.target, "before", 4 * MIB as usize, 70);

    // status names the encryption.
    let (code, status) = status_of(&daemon);
    assert_eq!(code, 0, "{status}");
    let encryption = device_row(&status, &vol.id)["encryption"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        encryption.starts_with("kernel TLS, TLSv1_3 TLS13_AES_"),
        "{encryption}"
    );

    // A repeated NodeStage naming another profile (a controller upgraded to name them): the
    // journal takes it, and every later dial below uses it.
    vol.tls_profile = Some("renamed".into());
    vol.stage(&mut c).await.unwrap();
    let record = journal_record(&daemon, &vol.id);
    assert_eq!(record["export"]["tls_profile"], "renamed", "{record}");

    // Expansion replaces the four connections with new TLS handshakes.
    vol.resize_backing(96 * MIB);
    vol.expand(&mut c, 96 * MIB)
        .await
        .unwrap_or_else(|e| panic!("expand a TLS volume: {e:?}"));
    assert!(fs_bytes(&vol.target) > 80 * MIB, "the filesystem grew");
    write_and_check_file(&vol.target, "grown", 16 * MIB as usize, 71);

    // A writer keeps writing and syncing while the links are cut under it, and while the
    // daemon is killed and started again.
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let writer = {
        let (file, stop, written) = (
            vol.target.join("stream"),
            Arc::clone(&stop),
            Arc::clone(&written),
        );
        std::thread::spawn(move || -> std::io::Result<u64> {
            let f = std::fs::File::create(&file)?;
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let at = (n % 32) * MIB;
                f.write_all_at(&pattern(n, at, MIB as usize), at)?;
                f.sync_data()?;
                n += 1;
                written.store(n, Ordering::SeqCst);
            }
            Ok(n)
        })
    };
    let wait_writes = |more: u64| {
        let written = Arc::clone(&written);
        async move {
            let target = written.load(Ordering::SeqCst) + more;
            let started = std::time::Instant::now();
            while written.load(Ordering::SeqCst) < target {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "the writer stalled"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    wait_writes(4).await;

    // Every connection aborted (a reset on the wire, as a middlebox or a crashed peer
    // leaves): the kernel reports them dead and the healer dials new TLS sessions.
    let connections = journaled_connections(&daemon, &vol.id);
    assert_eq!(connections.len(), 4, "{connections:?}");
    for (local, peer) in &connections {
        assert!(
            nbd::sockdiag::destroy_tcp(*local, *peer).unwrap(),
            "{local} -> {peer}"
        );
    }
    wait_writes(8).await;

    // The server restarts.
    vol.server.kill();
    vol.server.start().unwrap();
    wait_writes(8).await;

    // The daemon dies mid-write and comes back.
    daemon.kill();
    wait_writes(4).await;
    let mut c = daemon.start(None).await;
    wait_writes(4).await;

    stop.store(true, Ordering::SeqCst);
    let n = tokio::task::spawn_blocking(move || writer.join().unwrap())
        .await
        .unwrap()
        .expect("the writer saw no I/O error");
    assert_eq!(kernel_io_errors(), errors, "no I/O error in the kernel log");
    assert_eq!(tls_counter("TlsDecryptError"), 0);
    // The last 32 writes are what the file holds.
    let data = std::fs::read(vol.target.join("stream")).unwrap();
    for i in n.saturating_sub(32)..n {
        let at = (i % 32) * MIB;
        assert!(
            data[at as usize..(at + MIB) as usize] == pattern(i, at, MIB as usize)[..],
            "write {i} is intact"
        );
    }
    for (name, seed, len) in [("before", 70, 4 * MIB), ("grown", 71, 16 * MIB)] {
        assert!(
            std::fs::read(vol.target.join(name)).unwrap() == pattern(seed, 0, len as usize),
            "{name} is intact"
        );
    }

    // The full lifecycle ends clean, and the volume stages again with its data.
    vol.down(&mut c).await;
    vol.up(&mut c).await;
    assert!(std::fs::read(vol.target.join("before")).unwrap() == pattern(70, 0, 4 * MIB as usize));
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root, the nbd and tls modules"]
async fn a_tls_key_update_the_kernel_cannot_take_is_healed_unseen() {
    let pki = TestPki::new("ustor test CA").unwrap();
    let (daemon, mut c) = daemon_trusting("ktls-rekey", &pki).await;
    // nbdkit cannot send a KeyUpdate: a TLS-terminating proxy in front of it can.
    let mut vol = Volume::new_on(&daemon, "tls-rekey", 32 * MIB, block(), Listen::Tcp);
    let nbd::uri::Endpoint::Tcp { port, .. } = vol.server.uri().endpoint().clone() else {
        unreachable!()
    };
    let proxy = testkit::tls_proxy::TlsTerminatingProxy::start(([127, 0, 0, 1], port).into(), &pki)
        .await
        .unwrap();
    vol.via = Some(proxy.uri("").to_string());
    vol.up(&mut c).await;
    let errors = kernel_io_errors();
    direct_round_trip(&vol, 0, 4 * MIB as usize, 80);
    assert_eq!(proxy.accepted(), 1);

    // The server side refreshes its keys; the kernel's TLS cannot read a KeyUpdate record,
    // so the link dies, and the healer hands the kernel a new session. Applications see
    // I/O wait, never fail, and read what they wrote.
    for round in 0..3u64 {
        let accepted = proxy.accepted();
        proxy.key_update();
        direct_round_trip(&vol, (4 + 4 * round) * MIB, 4 * MIB as usize, 81 + round);
        let started = std::time::Instant::now();
        while proxy.accepted() == accepted {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "no new TLS session after KeyUpdate {round}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(
        kernel_io_errors(),
        errors,
        "the applications saw I/O errors"
    );
    assert_eq!(tls_counter("TlsDecryptError"), 0);
    let metrics = daemon.scrape().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("ustor_csi_node_link_dead_events_total ") && !l.ends_with(" 0")),
        "the dead links were heard: {metrics}"
    );
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root, the nbd and tls modules"]
async fn a_tls_stage_whose_server_dies_mid_call_answers_and_heals() {
    let pki = TestPki::new("ustor test CA").unwrap();
    let mut daemon =
        NodeDaemon::new("ktls-midstage", &format!("{CONFIG}{}", pki.node_config())).unwrap();
    // A window after the TLS handshakes, before the kernel gets the sockets.
    let mut c = daemon.start(Some("stage-before-connect=pause(2000)")).await;
    let mut vol = Volume::new_tls(&daemon, "tls-midstage", 32 * MIB, block(), &pki);
    let errors = kernel_io_errors();
    let stage = {
        let mut node = c.node.clone();
        let req = testkit::csi::stage_request(&vol.id, &vol.staging, vol.cap.clone(), &vol.uri());
        tokio::spawn(async move { node.node_stage_volume(req).await })
    };
    daemon.wait_paused("stage-before-connect").await;
    vol.server.kill();
    // The daemon answers while the call goes on with sockets whose server is gone.
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        let t = std::time::Instant::now();
        c.identity
            .probe(csi_proto::csi::ProbeRequest {})
            .await
            .unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "Probe took {:?}",
            t.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The kernel takes the dead sockets; the healer dials new TLS sessions once the server
    // is back, and the volume works with nothing lost.
    let staged = tokio::time::timeout(Duration::from_secs(60), stage)
        .await
        .expect("NodeStageVolume answers")
        .unwrap();
    vol.server.start().unwrap();
    staged.unwrap_or_else(|e| panic!("NodeStage across the server's death: {e:?}"));
    vol.publish(&mut c).await.unwrap();
    direct_round_trip(&vol, 0, 4 * MIB as usize, 90);
    assert_eq!(kernel_io_errors(), errors, "no I/O error in the kernel log");
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

/// What kubelet passes as NodeStage's secrets: the connection's TLS Secret, `pki`'s files
/// under the Secret's keys (and the etcd client's pair, which is not the data path's).
fn stage_secrets(pki: &TestPki) -> std::collections::HashMap<String, String> {
    [
        ("ca.crt", "ca-cert.pem"),
        ("client.crt", "client-cert.pem"),
        ("client.key", "client-key.pem"),
        ("etcd-client.crt", "client-cert.pem"),
    ]
    .into_iter()
    .map(|(key, file)| {
        (
            key.to_owned(),
            std::fs::read_to_string(pki.file(file)).unwrap(),
        )
    })
    .collect()
}

/// NodeStage of `vol` with `secrets`, as kubelet sends it.
async fn stage_with(
    vol: &Volume,
    c: &mut NodeClients,
    secrets: std::collections::HashMap<String, String>,
) -> Result<(), tonic::Status> {
    let mut req = vol.stage_req();
    req.secrets = secrets;
    c.node.node_stage_volume(req).await.map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root, the nbd and tls modules"]
async fn tls_material_from_the_stage_secrets_heals_outlives_the_daemon_and_rotates() {
    let pki = TestPki::new("first CA").unwrap();
    // No TLS file on this node: the certificates come only with NodeStage.
    let mut daemon = NodeDaemon::new("ktls-secrets", CONFIG).unwrap();
    let mut c = daemon.start(None).await;
    let mut vol = Volume::new_tls(&daemon, "tls-secrets", 32 * MIB, block(), &pki);

    let err = vol.stage(&mut c).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(
        err.message().contains("node-stage secret"),
        "{}",
        err.message()
    );
    let mut half = stage_secrets(&pki);
    half.remove("client.key");
    let err = stage_with(&vol, &mut c, half).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    assert!(err.message().contains("client.key"), "{}", err.message());
    assert!(
        vol.device(&daemon).is_none(),
        "a refused stage left a device"
    );

    stage_with(&vol, &mut c, stage_secrets(&pki)).await.unwrap();
    vol.publish(&mut c).await.unwrap();
    let errors = kernel_io_errors();
    direct_round_trip(&vol, 0, 4 * MIB as usize, 70);

    // Kept root-only in the state directory, named in the journal by place, never by content.
    let kept: Vec<_> = std::fs::read_dir(daemon.state_dir().join("stage-tls"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let key = std::fs::read_to_string(pki.file("client-key.pem")).unwrap();
    assert_eq!(
        std::fs::read_to_string(kept[0].join("client.key")).unwrap(),
        key
    );
    for (path, mode) in [
        (kept[0].clone(), 0o700),
        (kept[0].join("client.key"), 0o600),
        (kept[0].join("ca.crt"), 0o600),
    ] {
        use std::os::unix::fs::PermissionsExt;
        let got = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(got, mode, "{}", path.display());
    }
    assert!(!kept[0].join("etcd-client.crt").exists());
    let record = journal_record(&daemon, &vol.id).to_string();
    assert!(record.contains("stage-tls"), "{record}");
    assert!(
        !record.contains("PRIVATE KEY"),
        "key material in the journal"
    );

    // The daemon killed, the server restarted while it is down: recovery finds the material,
    // and the healer dials with it.
    daemon.kill();
    vol.server.kill();
    vol.server.start().unwrap();
    let mut c = daemon.start(None).await;
    direct_round_trip(&vol, 4 * MIB, 4 * MIB as usize, 71);

    // A rotation: kubelet's next NodeStage brings a new CA's certificates. The server then
    // moves to the new CA only: the healer's dial succeeds only with the newer material.
    let next = TestPki::new("second CA").unwrap();
    stage_with(&vol, &mut c, stage_secrets(&next))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(kept[0].join("ca.crt")).unwrap(),
        std::fs::read_to_string(next.file("ca-cert.pem")).unwrap()
    );
    pki.replace_with(&next).unwrap();
    vol.server.kill();
    vol.server.start().unwrap();
    direct_round_trip(&vol, 8 * MIB, 4 * MIB as usize, 72);
    assert_eq!(
        kernel_io_errors(),
        errors,
        "the applications saw I/O errors"
    );

    // Unstaging removes the material with the record.
    vol.down(&mut c).await;
    assert!(!kept[0].exists(), "TLS material outlived its volume");
    assert_clean(&daemon);
}
