//! Data-path throughput over TLS, run in the VM by `tests/vm/run --bench` (one guest run):
//! plaintext vs kernel TLS (the daemon's `nbds://` attach) vs `nbd-client` with its own TLS
//! (GnuTLS in a user-space proxy process that relays every byte), each with one and with four
//! connections, against the same nbdkit memory export (`--tls=require` for the TLS rows).
//!
//! Each row: sequential 1 MiB O_DIRECT writes then reads over the whole device, and 4 KiB
//! O_DIRECT random reads then writes for a fixed time; four threads in every case, so four
//! connections have work to share.

#![allow(clippy::unwrap_used)] // a benchmark stops on the first failure

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_proto::csi::volume_capability::access_mode::Mode;
use nbd::sysfs::Sysfs;
use testkit::csi::*;
use testkit::daemon::NodeDaemon;
use testkit::tls::TestPki;
use testkit::{AlignedBuf, Listen, NbdServer};

const SIZE: u64 = 256 << 20;
const THREADS: u64 = 4;
const SEQ_CHUNK: usize = 1 << 20;
const RANDOM_FOR: Duration = Duration::from_secs(5);

#[derive(Debug, Default, Clone, Copy)]
struct Figures {
    seq_write_mib_s: f64,
    seq_read_mib_s: f64,
    rand_read_iops: f64,
    rand_write_iops: f64,
}

fn open_direct(dev: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .unwrap()
}

/// Every thread covers its quarter of the device in 1 MiB requests.
fn sequential(dev: &Path, write: bool) -> f64 {
    let started = Instant::now();
    let share = SIZE / THREADS;
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let dev = dev.to_owned();
            std::thread::spawn(move || {
                let f = open_direct(&dev);
                let mut buf = AlignedBuf::from_slice(&testkit::pattern(t, 0, SEQ_CHUNK));
                for at in (t * share..(t + 1) * share).step_by(SEQ_CHUNK) {
                    if write {
                        f.write_all_at(buf.as_ref(), at).unwrap();
                    } else {
                        f.read_exact_at(buf.as_mut(), at).unwrap();
                    }
                }
                if write {
                    f.sync_all().unwrap();
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    (SIZE >> 20) as f64 / started.elapsed().as_secs_f64()
}

/// 4 KiB requests at random aligned offsets for [`RANDOM_FOR`].
fn random(dev: &Path, write: bool) -> f64 {
    let started = Instant::now();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let dev = dev.to_owned();
            std::thread::spawn(move || {
                let f = open_direct(&dev);
                let mut buf = AlignedBuf::from_slice(&testkit::pattern(t, 0, 4096));
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
                let mut done = 0u64;
                while started.elapsed() < RANDOM_FOR {
                    // xorshift64: cheap, and the same sequence for every row.
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let at = (x % (SIZE / 4096)) * 4096;
                    if write {
                        f.write_all_at(buf.as_ref(), at).unwrap();
                    } else {
                        f.read_exact_at(buf.as_mut(), at).unwrap();
                    }
                    done += 1;
                }
                done
            })
        })
        .collect();
    let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    total as f64 / started.elapsed().as_secs_f64()
}

fn measure(dev: &Path) -> Figures {
    Figures {
        seq_write_mib_s: sequential(dev, true),
        seq_read_mib_s: sequential(dev, false),
        rand_read_iops: random(dev, false),
        rand_write_iops: random(dev, true),
    }
}

/// Attaches through the daemon (`nbd://` or `nbds://`), measures, detaches.
async fn through_daemon(daemon: &NodeDaemon, uri: &str, connections: u8) -> Figures {
    let mut c = NodeClients::connect(&daemon.socket).await.unwrap();
    let id = format!("bench-{}-{connections}", uri.split(':').next().unwrap());
    let staging = daemon.scratch().join(format!("staging/{id}"));
    std::fs::create_dir_all(&staging).unwrap();
    let mut req = stage_request(
        &id,
        &staging,
        block_capability(Mode::SingleNodeSingleWriter),
        uri,
    );
    req.volume_context
        .insert("nbdConnections".into(), connections.to_string());
    c.node.node_stage_volume(req).await.unwrap();
    let dev = device_of(&id);
    let figures = tokio::task::spawn_blocking(move || measure(&dev))
        .await
        .unwrap();
    c.node
        .node_unstage_volume(unstage_request(&id, &staging))
        .await
        .unwrap();
    figures
}

/// The device whose backend identifier names `volume`.
fn device_of(volume: &str) -> PathBuf {
    let sysfs = Sysfs::default();
    let index = sysfs
        .devices()
        .unwrap()
        .into_iter()
        .find(|i| {
            sysfs
                .backend(*i)
                .ok()
                .flatten()
                .is_some_and(|b| b.contains(volume))
        })
        .unwrap_or_else(|| panic!("no device carries {volume}"));
    sysfs.dev_path(index)
}

/// `nbd-client` with GnuTLS on the first free device, measures, disconnects.
async fn through_nbd_client(port: u16, pki: &TestPki, connections: u8) -> Figures {
    let sysfs = Sysfs::default();
    let index = testkit::nbd_client::free_device(&sysfs);
    let connections = connections.to_string();
    let (cert, key, ca) = (
        pki.file("client-cert.pem"),
        pki.file("client-key.pem"),
        pki.file("ca-cert.pem"),
    );
    // nbd-client 3.24 takes only the long names of its TLS options.
    let options: [&std::ffi::OsStr; 13] = [
        "-b".as_ref(),
        "512".as_ref(),
        "-C".as_ref(),
        connections.as_ref(),
        "-x".as_ref(),
        "-certfile".as_ref(),
        cert.as_ref(),
        "-keyfile".as_ref(),
        key.as_ref(),
        "-cacertfile".as_ref(),
        ca.as_ref(),
        "-tlshostname".as_ref(),
        "127.0.0.1".as_ref(),
    ];
    testkit::nbd_client::attach(&sysfs, index, "bench", port, &options, SIZE).await;
    let dev = sysfs.dev_path(index);
    let figures = tokio::task::spawn_blocking(move || measure(&dev))
        .await
        .unwrap();
    testkit::nbd_client::detach(&sysfs, index).await;
    figures
}

fn row(name: &str, f: Figures, base: Option<Figures>) {
    let ratio = |v: f64, b: Option<f64>| b.map_or(String::new(), |b| format!(" ({:.2}x)", v / b));
    println!(
        "  {name:<24} seq write {:7.1} MiB/s{:<9} seq read {:7.1} MiB/s{:<9} rand read {:7.0} IOPS{:<9} rand write {:7.0} IOPS{}",
        f.seq_write_mib_s,
        ratio(f.seq_write_mib_s, base.map(|b| b.seq_write_mib_s)),
        f.seq_read_mib_s,
        ratio(f.seq_read_mib_s, base.map(|b| b.seq_read_mib_s)),
        f.rand_read_iops,
        ratio(f.rand_read_iops, base.map(|b| b.rand_read_iops)),
        f.rand_write_iops,
        ratio(f.rand_write_iops, base.map(|b| b.rand_write_iops)),
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let pki = Arc::new(TestPki::new("bench CA").unwrap());
    let size = format!("{}M", SIZE >> 20);
    let plain = NbdServer::nbdkit(Listen::Tcp, &["memory", &size]).unwrap();
    let mut tls_args: Vec<&str> = Vec::new();
    let nbdkit_tls = pki.nbdkit_args();
    tls_args.extend(nbdkit_tls.iter().map(String::as_str));
    tls_args.extend(["memory", &size]);
    let tls = NbdServer::nbdkit(Listen::Tcp, &tls_args).unwrap();
    let nbd::uri::Endpoint::Tcp { port: tls_port, .. } = tls.uri().endpoint().clone() else {
        unreachable!()
    };

    let mut daemon = NodeDaemon::new("bench-tls", &pki.node_config()).unwrap();
    daemon.start(None).await;
    let plain_uri = plain.uri().to_string();
    let tls_uri = tls.uri().with_tls().to_string();

    // Every byte is sealed by one side and opened by the other, both in this machine: what
    // one core seals per second bounds what any TLS row can reach.
    println!(
        "AES-128-GCM in user space (ring), one thread: {:.1} MiB/s",
        testkit::tls::aes_gcm_seal_mib_per_s(64 << 20)
    );
    println!(
        "TLS data path, {} MiB device, {THREADS} threads; ratios against plaintext with the same connections:",
        SIZE >> 20
    );
    for connections in [1u8, 4] {
        let base = through_daemon(&daemon, &plain_uri, connections).await;
        let ktls = through_daemon(&daemon, &tls_uri, connections).await;
        let user = through_nbd_client(tls_port, &pki, connections).await;
        println!("{connections} connection(s):");
        row("plaintext", base, None);
        row("kernel TLS (daemon)", ktls, Some(base));
        row("nbd-client GnuTLS proxy", user, Some(base));
    }
}
