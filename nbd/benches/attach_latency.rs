//! Attach latency: this library (in process, and through the `nbdctl` binary) against
//! `nbd-client`, on the same export, in the same guest, interleaved run by run.
//!
//! Each sample runs from "start" to "device ready" (the node exists and shows the export's
//! size), so the work both clients leave to the kernel counts for both. Run it in the VM:
//! `tests/vm/run --bench`. Needs root, the nbd module, nbdkit and nbd-client.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench run fails by panicking

use std::process::Command;
use std::time::{Duration, Instant};

use nbd::attach::{self, AttachOptions};
use nbd::netlink::NbdNetlink;
use nbd::sysfs::Sysfs;
use nbd::{BackendId, DeviceIndex};
use testkit::{Listen, NbdServer};

const RUNS: usize = 20;
const SIZE: u64 = 64 << 20;
const DEVICE: DeviceIndex = DeviceIndex(0);
const SETTLE: Duration = Duration::from_secs(10);

fn median(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::main]
async fn main() {
    let nl = NbdNetlink::open()
        .await
        .expect("nbd netlink family (run in the VM)");
    let sysfs = Sysfs::default();
    let server = NbdServer::nbdkit(Listen::Tcp, &["memory", "64M"]).expect("nbdkit");
    let uri = server.uri();
    let nbd::uri::Endpoint::Tcp { port, .. } = uri.endpoint().clone() else {
        unreachable!("TCP server")
    };
    let identifier = BackendId::new("bench").expect("identifier");
    let dev = sysfs.dev_path(DEVICE);

    let (mut library, mut nbdctl, mut nbd_client) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let mut opts = AttachOptions::new(identifier.clone());
        opts.index = Some(DEVICE);
        let t = Instant::now();
        let a = attach::attach(&nl, &sysfs, &uri, &opts)
            .await
            .expect("attach");
        library.push(t.elapsed());
        attach::detach(&nl, &sysfs, a.device.index(), &identifier, SETTLE)
            .await
            .expect("detach");

        let t = Instant::now();
        run(Command::new("nbdctl")
            .args(["attach", &uri.to_string(), "--id", "bench", "--device"])
            .arg(&dev));
        nbdctl.push(t.elapsed());
        attach::detach(&nl, &sysfs, DEVICE, &identifier, SETTLE)
            .await
            .expect("detach nbdctl's device");

        let t = Instant::now();
        run(Command::new("nbd-client")
            .args(["-N", "bench", "127.0.0.1", &port.to_string()])
            .arg(&dev)
            .args(["-b", "512"]));
        sysfs
            .wait_ready(DEVICE, SIZE, SETTLE)
            .await
            .expect("nbd-client's device ready");
        nbd_client.push(t.elapsed());
        run(Command::new("nbd-client").arg("-d").arg(&dev));
        attach::wait_released(&sysfs, DEVICE, SETTLE).await.ok();
        while nl
            .status(Some(DEVICE))
            .await
            .map(|s| s.iter().any(|d| d.connected))
            .unwrap_or(false)
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    let (lib, ctl, client) = (
        median(&mut library),
        median(&mut nbdctl),
        median(&mut nbd_client),
    );
    println!("attach latency, {RUNS} runs each, median (start to device ready):");
    println!("  nbd library, in process : {:8.2} ms", ms(lib));
    println!("  nbdctl attach (process) : {:8.2} ms", ms(ctl));
    println!("  nbd-client (process)    : {:8.2} ms", ms(client));
    println!("  ratio library / nbd-client : {:.2}", ms(lib) / ms(client));
    println!("  ratio nbdctl / nbd-client  : {:.2}", ms(ctl) / ms(client));
}
