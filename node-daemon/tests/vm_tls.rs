//! NBD over TLS with the kernel doing the crypto: STARTTLS and the TLS handshake in the daemon,
//! the session's keys installed as kernel TLS, the socket handed to the nbd driver. Against
//! nbdkit `--tls=require` with certificates made by the test. Ignored on the host; run in the
//! VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking

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

    assert!(plain.device(&daemon).is_none() && forged.device(&daemon).is_none());
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
