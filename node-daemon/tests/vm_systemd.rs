//! The packaged node service under a real systemd: `tests/vm/run` boots a Debian 12 root with
//! systemd as PID 1 on each kernel line and runs these in order, with a reboot of that root
//! between the two. The package is installed by the first test, as an operator would.
//! Ignored on the host (they need that machine).

#![allow(clippy::unwrap_used)] // a test fails by panicking
#![allow(clippy::cast_possible_truncation)] // buffer sizes of a few MiB, on 64-bit guests

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::{ProbeRequest, VolumeCapability};
use testkit::command::{ok, run};
use testkit::csi::*;
use testkit::wait::eventually_blocking;
use testkit::{kernel_io_error_lines, kernel_io_errors, pattern};

const UNIT: &str = "ustor-csi-node.service";
const SOCKET: &str = "/var/lib/kubelet/plugins/ustor-nbd.csi.mindsw.io/csi.sock";
const PACKAGE: &str = "/vm/ustor-csi-node.deb";
/// Survives the reboot: the export's file and its socket path.
const WORK: &str = "/var/lib/vm-test";
const VOLUME: &str = "pvc-systemd";
const MIB: u64 = 1 << 20;
const CONNECTIONS: &str = "2";

fn staging() -> PathBuf {
    PathBuf::from(
        "/var/lib/kubelet/plugins/kubernetes.io/csi/ustor-nbd.csi.mindsw.io/pv-systemd/globalmount",
    )
}

fn target() -> PathBuf {
    PathBuf::from("/var/lib/kubelet/pods/pod-1/volumes/kubernetes.io~csi/pv-systemd/mount")
}

fn image() -> PathBuf {
    Path::new(WORK).join("export.img")
}

fn export_uri() -> String {
    format!("nbd+unix:///?socket={WORK}/nbd.sock")
}

fn systemctl(args: &[&str]) -> String {
    ok("systemctl", args)
}

fn property(name: &str) -> String {
    systemctl(&["show", "-p", name, "--value", UNIT])
        .trim()
        .to_owned()
}

fn main_pid() -> i32 {
    property("MainPID").parse().unwrap()
}

fn state() -> String {
    run("systemctl", &["is-active", UNIT]).1.trim().to_owned()
}

/// Waits until systemd shows the service active under a main process other than `old`.
fn wait_new_main_pid(old: i32, within: Duration) -> i32 {
    let until = Instant::now() + within;
    loop {
        let pid = main_pid();
        if pid != 0 && pid != old && state() == "active" {
            return pid;
        }
        assert!(
            Instant::now() < until,
            "the service did not come back within {within:?} (state {}, pid {pid})",
            state()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// nbdkit serving the export file on the unix socket, in a unit of its own that a shutdown
/// does not stop (DefaultDependencies=no): like a remote server, it outlives the node's
/// unmounts at reboot, so they can flush.
fn start_export() {
    let socket = format!("{WORK}/nbd.sock");
    let _ = std::fs::remove_file(&socket);
    let pidfile = format!("{WORK}/nbdkit.pid");
    let _ = std::fs::remove_file(&pidfile);
    let file = format!("file={}", image().display());
    ok(
        "systemd-run",
        &[
            "--quiet",
            "--unit=vm-export",
            "--property=DefaultDependencies=no",
            // Restarted when it dies, as a real server would be. Debian 12's nbdkit (1.32)
            // aborts (`raw_send_socket: Assertion 'sock >= 0'`) when the kernel shuts a
            // connection it is replying on, which it does to requests slower than the I/O
            // timeout: a stall of this guest's disk behind the host's I/O is enough. The
            // daemon heals onto the restarted server.
            "--property=Restart=always",
            "--property=RestartSec=1",
            // The socket an aborted nbdkit left would keep the next from binding.
            &format!("--property=ExecStartPre=/usr/bin/rm -f {socket}"),
            "nbdkit",
            "--foreground",
            "--unix",
            &socket,
            "--pidfile",
            &pidfile,
            "file",
            &file,
        ],
    );
    let until = Instant::now() + Duration::from_secs(10);
    while !Path::new(&pidfile).exists() {
        assert!(Instant::now() < until, "nbdkit did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn capability() -> VolumeCapability {
    mount_capability("ext4", Mode::SingleNodeWriter)
}

fn with_connections(
    mut context: std::collections::HashMap<String, String>,
) -> std::collections::HashMap<String, String> {
    context.insert("nbdConnections".into(), CONNECTIONS.into());
    context
}

async fn clients() -> NodeClients {
    let channel = wait_connect(Path::new(SOCKET), Duration::from_secs(30)).await;
    NodeClients {
        identity: csi_proto::csi::identity_client::IdentityClient::new(channel.clone()),
        node: csi_proto::csi::node_client::NodeClient::new(channel),
    }
}

async fn ready(c: &mut NodeClients) -> bool {
    c.identity
        .probe(ProbeRequest {})
        .await
        .unwrap()
        .into_inner()
        .ready
        .unwrap_or(false)
}

async fn stage_and_publish(c: &mut NodeClients) {
    let mut stage = stage_request(VOLUME, &staging(), capability(), &export_uri());
    stage.volume_context = with_connections(stage.volume_context);
    if let Err(e) = c.node.node_stage_volume(stage).await {
        // What the daemon and the export server saw: the console shows only the kernel.
        let (_, daemon) = run(
            "journalctl",
            &["-u", UNIT, "--no-pager", "-o", "short-monotonic"],
        );
        let (_, export) = run(
            "journalctl",
            &["-u", "vm-export", "--no-pager", "-o", "short-monotonic"],
        );
        panic!("NodeStage: {e:?}\n--- {UNIT}:\n{daemon}\n--- vm-export:\n{export}");
    }
    std::fs::create_dir_all(target().parent().unwrap()).unwrap();
    let mut publish = publish_request(
        VOLUME,
        &staging(),
        &target(),
        capability(),
        &export_uri(),
        false,
    );
    publish.volume_context = with_connections(publish.volume_context);
    c.node
        .node_publish_volume(publish)
        .await
        .unwrap_or_else(|e| panic!("NodePublish: {e:?}"));
}

fn write_file(name: &str, len: usize, seed: u64) {
    let path = target().join(name);
    std::fs::write(&path, pattern(seed, 0, len)).unwrap();
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
}

fn assert_file(name: &str, len: usize, seed: u64) {
    let data = std::fs::read(target().join(name)).unwrap();
    assert!(
        data == pattern(seed, 0, len),
        "{name} does not hold what was written"
    );
}

/// Writes and fsyncs files on the volume until stopped; counts each outcome.
struct Writer {
    stop: Arc<AtomicBool>,
    written: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let (s, w, f) = (stop.clone(), written.clone(), failed.clone());
        let thread = std::thread::spawn(move || {
            let mut n = 0u64;
            while !s.load(Ordering::SeqCst) {
                let path = target().join(format!("io-{}", n % 8));
                let data = pattern(100 + n, 0, 256 * 1024);
                let done = std::fs::write(&path, &data)
                    .and_then(|()| std::fs::File::open(&path)?.sync_all())
                    .and_then(|()| std::fs::read(&path))
                    .map(|back| back == data);
                match done {
                    Ok(true) => w.fetch_add(1, Ordering::SeqCst),
                    _ => f.fetch_add(1, Ordering::SeqCst),
                };
                n += 1;
            }
        });
        Self {
            stop,
            written,
            failed,
            thread: Some(thread),
        }
    }

    /// Stops the writer; returns (written, failed).
    fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap();
        (
            self.written.load(Ordering::SeqCst),
            self.failed.load(Ordering::SeqCst),
        )
    }
}

fn drop_in(contents: Option<&str>) {
    let dir = Path::new("/run/systemd/system/ustor-csi-node.service.d");
    let file = dir.join("vm-test.conf");
    match contents {
        Some(text) => {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(&file, text).unwrap();
        }
        None => {
            let _ = std::fs::remove_file(&file);
        }
    }
    systemctl(&["daemon-reload"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs the booted Debian root of tests/vm/run"]
async fn systemd_1_the_package_installs_serves_restarts_and_is_watched() {
    // Installed: enabled, not started; the unit is clean to systemd's own checker.
    let installed = ok("dpkg", &["-i", PACKAGE]);
    // postinst ran the preflight, as warnings: it names the nbd module and what it found.
    assert!(
        installed.contains("ustor-csi-node preflight") && installed.contains("module         nbd:"),
        "{installed}"
    );
    assert_eq!(run("systemctl", &["is-enabled", UNIT]).1.trim(), "enabled");
    assert_eq!(state(), "inactive", "installing must not start the service");
    // The man page is checked by packaging/test (no man-db in this root).
    let verify = ok("systemd-analyze", &["verify", "--man=no", UNIT]);
    assert!(verify.trim().is_empty(), "systemd-analyze verify: {verify}");

    // The daemon's debug lines in its journal, for a failure's report (the unit reads this
    // file if it exists).
    std::fs::write(
        "/etc/default/ustor-csi-node",
        "RUST_LOG=info,node_daemon=debug,nbd=debug\n",
    )
    .unwrap();

    // Started: READY=1 only once the CSI socket serves. The unit loads nbd with the
    // package's module options.
    systemctl(&["start", UNIT]);
    assert_eq!(
        std::fs::read_to_string("/sys/module/nbd/parameters/nbds_max")
            .unwrap()
            .trim(),
        "128"
    );
    assert_eq!(state(), "active");
    let mut c = clients().await;
    assert!(ready(&mut c).await, "active but not ready");
    assert!(
        property("StatusText").contains("0 volume(s) attached"),
        "{}",
        property("StatusText")
    );

    // A volume through the CSI socket, on a unix-socket export with two connections.
    std::fs::create_dir_all(WORK).unwrap();
    std::fs::File::create(image())
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    start_export();
    std::fs::create_dir_all(staging()).unwrap();
    stage_and_publish(&mut c).await;
    write_file("before", 4 * MIB as usize, 1);
    eventually_blocking("STATUS= counts the volume", Duration::from_secs(10), || {
        property("StatusText")
            .contains("1 volume(s) attached")
            .then_some(())
    });
    assert_eq!(
        property("NFileDescriptorStore"),
        CONNECTIONS,
        "one stored socket per connection"
    );

    // Restarted and killed under I/O: the data path never notices.
    let errors_before = kernel_io_errors();
    let writer = Writer::start();
    std::thread::sleep(Duration::from_secs(1));
    let first = main_pid();
    systemctl(&["restart", UNIT]);
    let second = wait_new_main_pid(first, Duration::from_secs(60));
    std::thread::sleep(Duration::from_secs(1));
    let restarts = property("NRestarts");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(second),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    wait_new_main_pid(second, Duration::from_secs(60));
    assert_ne!(
        property("NRestarts"),
        restarts,
        "Restart=always brought it back"
    );
    std::thread::sleep(Duration::from_secs(1));
    let (written, failed) = writer.finish();
    assert_eq!(
        failed, 0,
        "I/O failed across restarts ({written} writes went through)"
    );
    assert!(written > 0, "no write went through during the restarts");
    assert_eq!(
        kernel_io_errors(),
        errors_before,
        "the kernel logged I/O errors"
    );
    assert_file("before", 4 * MIB as usize, 1);

    // The stored sockets came back to the restarted daemon: it can replace the unix-socket
    // connections, so the export's growth reaches the filesystem.
    let mut c = clients().await;
    assert!(ready(&mut c).await);
    assert_eq!(property("NFileDescriptorStore"), CONNECTIONS);
    std::fs::OpenOptions::new()
        .write(true)
        .open(image())
        .unwrap()
        .set_len(96 * MIB)
        .unwrap();
    c.node
        .node_expand_volume(expand_request(
            VOLUME,
            &target(),
            &staging(),
            (96 * MIB) as i64,
        ))
        .await
        .unwrap_or_else(|e| panic!("NodeExpand after restarts: {e:?}"));
    let st = nix::sys::statvfs::statvfs(&target()).unwrap();
    assert!(
        st.blocks() * st.fragment_size() > 80 * MIB,
        "the filesystem did not grow: {} bytes",
        st.blocks() * st.fragment_size()
    );
    write_file("after-expand", 40 * MIB as usize, 2);
    assert_eq!(
        property("NFileDescriptorStore"),
        CONNECTIONS,
        "replaced sockets replace their stored copies"
    );

    // A daemon that stops answering is killed by the watchdog and started again.
    drop_in(Some("[Service]\nWatchdogSec=3\n"));
    systemctl(&["restart", UNIT]);
    let watched = main_pid();
    let restarts = property("NRestarts");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(watched),
        nix::sys::signal::SIGSTOP,
    )
    .unwrap();
    let started = Instant::now();
    wait_new_main_pid(watched, Duration::from_secs(60));
    let journal = ok("journalctl", &["-u", UNIT, "--no-pager"]);
    assert!(
        journal.contains("Watchdog timeout"),
        "no watchdog kill in the journal:\n{journal}"
    );
    assert_ne!(property("NRestarts"), restarts);
    eprintln!("watchdog restart after {:?}", started.elapsed());
    drop_in(None);
    systemctl(&["restart", UNIT]);
    let mut c = clients().await;
    assert!(ready(&mut c).await);
    assert_file("after-expand", 40 * MIB as usize, 2);

    // Left staged and published for the reboot.
    write_file("before-reboot", MIB as usize, 3);
    ok("sync", &[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs the booted Debian root of tests/vm/run"]
async fn systemd_2_after_a_reboot_the_service_is_up_and_the_volume_comes_back() {
    // Started at boot by its enablement, and ready although the export is not served yet;
    // the modules it needs are loaded, with the package's options.
    assert_eq!(state(), "active");
    assert_eq!(
        std::fs::read_to_string("/sys/module/nbd/parameters/nbds_max")
            .unwrap()
            .trim(),
        "128"
    );
    assert!(Path::new("/sys/module/tcp_diag").exists());
    assert_eq!(property("NRestarts"), "0");
    let mut c = clients().await;
    assert!(ready(&mut c).await);

    // The journal remembers the volume; the kernel has no device for it: status says so.
    let (code, out) = run("ustor-csi-node", &["status", "--json"]);
    assert_eq!(code, 1, "a record without its device is a problem: {out}");
    assert!(out.contains(VOLUME), "{out}");

    // kubelet stages and publishes again after a reboot: the same data.
    start_export();
    std::fs::create_dir_all(staging()).unwrap();
    stage_and_publish(&mut c).await;
    assert_file("before-reboot", MIB as usize, 3);
    assert_file("after-expand", 40 * MIB as usize, 2);
    let (code, out) = run("ustor-csi-node", &["status"]);
    assert_eq!(code, 0, "{out}");

    c.node
        .node_unpublish_volume(unpublish_request(VOLUME, &target()))
        .await
        .unwrap();
    c.node
        .node_unstage_volume(unstage_request(VOLUME, &staging()))
        .await
        .unwrap();
    let (code, out) = run("ustor-csi-node", &["status", "--json"]);
    assert_eq!(code, 0, "{out}");
    let st: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        st["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["volume"] != VOLUME),
        "{out}"
    );
    assert_eq!(st["records_without_device"], serde_json::json!([]), "{out}");

    kubelets_block_teardown_logs_no_io_error(&mut c).await;
    systemctl(&["stop", UNIT]);
    assert_eq!(state(), "inactive");
}

/// The device node of `VOLUME`, from `status --json`.
fn device_of_volume() -> String {
    let (_, out) = run("ustor-csi-node", &["status", "--json"]);
    let st: serde_json::Value = serde_json::from_str(&out).unwrap();
    st["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["volume"] == VOLUME)
        .and_then(|d| d["device"].as_str())
        .map(|name| format!("/dev/{}", name.trim_start_matches("/dev/")))
        .unwrap_or_else(|| panic!("no device for {VOLUME}: {out}"))
}

/// kubelet keeps a loop device over a raw block volume and lets it go just before
/// NodeUnstage. The loop device had the device open for writing, so its release is a close
/// after write, which udev's watch answers with a "change" event and a blkid probe of the
/// device. A DISCONNECT sent while that probe reads fails its reads: the kernel logged I/O
/// errors at the end of the real-node test. Each round here closes the device after opening
/// it for writing, as the loop device's release does, and unstages at once.
async fn kubelets_block_teardown_logs_no_io_error(c: &mut NodeClients) {
    let block_staging =
        Path::new("/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/staging/pv-systemd");
    std::fs::create_dir_all(block_staging).unwrap();
    let errors_before = kernel_io_errors();
    for round in 0..6 {
        let mut stage = stage_request(
            VOLUME,
            block_staging,
            block_capability(Mode::MultiNodeMultiWriter),
            &export_uri(),
        );
        stage.volume_context = with_connections(stage.volume_context);
        c.node
            .node_stage_volume(stage)
            .await
            .unwrap_or_else(|e| panic!("NodeStage (block), round {round}: {e:?}"));
        let device = device_of_volume();
        drop(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&device)
                .unwrap(),
        );
        c.node
            .node_unstage_volume(unstage_request(VOLUME, block_staging))
            .await
            .unwrap_or_else(|e| panic!("NodeUnstage (block), round {round}: {e:?}"));
        let errors = kernel_io_error_lines();
        assert_eq!(
            errors.len(),
            errors_before,
            "round {round}: the kernel logged I/O errors at NodeUnstage of {device}:\n{}",
            errors.join("\n")
        );
    }
}
