//! Support for tests that need real NBD servers, real block devices and the real daemons.
//!
//! Servers are real processes (nbdkit, qemu-nbd) on loopback or unix sockets: they can be killed
//! and restarted at the same address to test link loss, which no in-process fake could show.

// Test support: a set-up that cannot be made fails the test that asked for it, with the
// reason in the panic.
#![allow(clippy::expect_used)]

pub mod command;
pub mod controller;
pub mod csi;
pub mod daemon;
mod direct;
pub mod egress;
pub mod fake_ustor;
pub mod kube_cluster;
pub mod nbd_client;
pub mod placement;
pub mod proxy;
pub mod sanity;
mod server;
pub mod tls;
pub mod tls_proxy;
pub mod wait;

pub use direct::{pattern, AlignedBuf, DirectFile};
pub use server::{Listen, NbdServer, ServerKind};

/// A binary the tests run: the path in `env` when it is set, else `name` looked up on PATH.
pub fn binary_from_env(env: &str, name: &str) -> std::path::PathBuf {
    std::env::var_os(env)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| name.into())
}

/// Writes `data` at `offset` of the existing file `path`, panicking with the path on failure.
pub fn write_at(path: &std::path::Path, offset: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.write_all_at(data, offset))
        .unwrap_or_else(|e| panic!("write {} at {offset}: {e}", path.display()));
}

/// `len` bytes of the file at `path` from `offset`, read through the page cache.
pub fn read_at(path: &std::path::Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0; len];
    std::fs::File::open(path)
        .and_then(|f| f.read_exact_at(&mut buf, offset))
        .unwrap_or_else(|e| panic!("read {} at {offset}: {e}", path.display()));
    buf
}

/// The exit status of `child` if it was started and has exited.
pub fn exited(child: &mut Option<std::process::Child>) -> Option<std::process::ExitStatus> {
    child.as_mut().and_then(|c| c.try_wait().ok().flatten())
}

/// A port free right now on loopback, for a server the test starts next, and restarts at.
///
/// It is chosen below the kernel's ephemeral range: a port from `bind(…:0)` is one the
/// kernel hands out again as the local end of any client's `connect()`, so a parallel
/// test's client can hold it by the time the server binds (CI saw nbdkit fail with
/// "Address already in use" that way). Ports below the range are never given to clients (and
/// 20000 up is clear of the ports nbd, kubelet and its kin listen on);
/// a per-process counter keeps this process's tests apart, and the bind check other
/// processes.
pub fn free_port() -> std::io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(32768);
    let (low, high) = (20_000u32, ephemeral_low.max(20_001));
    let span = high - low;
    // Processes running at once start at different places of the range.
    let start = std::process::id().wrapping_mul(7919) % span;
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let Ok(port) = u16::try_from(low + offset) else {
            continue;
        };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free loopback port in {low}..{high}"),
    ))
}

/// The `/metrics` text served at `addr` (node daemon or controller), headers included.
pub async fn scrape(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .expect("request");
    let mut text = String::new();
    s.read_to_string(&mut text).await.expect("response");
    text
}

/// How many lines of the kernel log report a failed I/O on an nbd device.
pub fn kernel_io_errors() -> usize {
    kernel_io_error_lines().len()
}

/// The lines of the kernel log that report a failed I/O on an nbd device, to name what
/// failed when a test finds more of them than before.
pub fn kernel_io_error_lines() -> Vec<String> {
    let out = std::process::Command::new("dmesg")
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    String::from_utf8_lossy(&out)
        .lines()
        .filter(|l| l.contains("nbd") && l.contains("I/O error"))
        .map(str::to_owned)
        .collect()
}
