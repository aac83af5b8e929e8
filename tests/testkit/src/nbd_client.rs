//! `nbd-client`, the reference client the benchmarks compare against, on a free device.

use std::ffi::OsStr;
use std::process::Command;
use std::time::Duration;

use nbd::sysfs::Sysfs;
use nbd::DeviceIndex;

/// The first device nothing is attached to.
pub fn free_device(sysfs: &Sysfs) -> DeviceIndex {
    sysfs
        .devices()
        .unwrap_or_default()
        .into_iter()
        .find(|i| {
            sysfs.backend(*i).ok().flatten().is_none() && sysfs.size_bytes(*i).ok() == Some(0)
        })
        .unwrap_or(DeviceIndex(0))
}

/// `nbd-client -N <export> 127.0.0.1 <port> /dev/nbdN <options>`, then waits until the device
/// shows `size` bytes. Panics with nbd-client's message when it fails.
pub async fn attach<S: AsRef<OsStr>>(
    sysfs: &Sysfs,
    index: DeviceIndex,
    export: &str,
    port: u16,
    options: &[S],
    size: u64,
) {
    let out = Command::new("nbd-client")
        .args(["-N", export, "127.0.0.1", &port.to_string()])
        .arg(sysfs.dev_path(index))
        .args(options)
        .output()
        .unwrap_or_else(|e| panic!("running nbd-client: {e}"));
    assert!(
        out.status.success(),
        "nbd-client: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    sysfs
        .wait_ready(index, size, Duration::from_secs(20))
        .await
        .unwrap_or_else(|e| panic!("device after nbd-client: {e}"));
}

/// `nbd-client -d`, then waits until the device is free again.
pub async fn detach(sysfs: &Sysfs, index: DeviceIndex) {
    let status = Command::new("nbd-client")
        .arg("-d")
        .arg(sysfs.dev_path(index))
        .status()
        .unwrap_or_else(|e| panic!("running nbd-client -d: {e}"));
    assert!(status.success(), "nbd-client -d failed");
    while sysfs.size_bytes(index).unwrap_or(0) != 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
