//! What an operator sees and uses, against the real kernel: systemd's readiness, status and
//! watchdog messages, `status` naming every disagreement, `repair` cleaning what it flags and
//! nothing else. Ignored on the host; run in the VM on every kernel line by `tests/vm/run`.

#![allow(clippy::unwrap_used)] // a test fails by panicking
#![allow(clippy::cast_possible_truncation)] // buffer sizes of a few MiB, on 64-bit guests

use nbd::netlink::NbdNetlink;
use nbd::BackendId;
use testkit::tls::TestPki;

mod common;
use common::prelude::*;

/// The fields of one entry in the journal's native protocol: `NAME=value` lines, or `NAME`,
/// a 64-bit little-endian length and that many bytes of value.
fn journal_fields(mut data: &[u8]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    while let Some(end) = data.iter().position(|b| *b == b'=' || *b == b'\n') {
        let name = String::from_utf8_lossy(&data[..end]).into_owned();
        let value;
        if data[end] == b'=' {
            let stop = data[end..].iter().position(|b| *b == b'\n').unwrap() + end;
            value = data[end + 1..stop].to_vec();
            data = &data[stop + 1..];
        } else {
            let len = u64::from_le_bytes(data[end + 1..end + 9].try_into().unwrap()) as usize;
            value = data[end + 9..end + 9 + len].to_vec();
            data = &data[end + 9 + len + 1..];
        }
        out.push((name, String::from_utf8_lossy(&value).into_owned()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn systemd_hears_ready_status_and_watchdog_keep_alives() {
    use std::os::unix::net::UnixDatagram;
    let mut daemon = NodeDaemon::new("notify", CONFIG).unwrap();
    let socket = daemon.scratch().join("notify.sock");
    let listener = UnixDatagram::bind(&socket).unwrap();
    listener
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // The journal's socket, as systemd-journald binds it (the guest runs no journald).
    std::fs::create_dir_all("/run/systemd/journal").unwrap();
    let _ = std::fs::remove_file("/run/systemd/journal/socket");
    let journal = UnixDatagram::bind("/run/systemd/journal/socket").unwrap();
    journal
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    // Read all along, as journald does: a full queue would block the daemon's logging.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let done = std::sync::Arc::clone(&done);
        std::thread::spawn(move || {
            let mut entries = Vec::new();
            let mut entry = vec![0u8; 65536];
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(n) = journal.recv(&mut entry) {
                    entries.push(journal_fields(&entry[..n]));
                }
            }
            entries
        })
    };
    daemon.env = vec![
        ("NOTIFY_SOCKET".into(), socket.display().to_string()),
        ("WATCHDOG_USEC".into(), "1000000".into()),
        ("JOURNAL_STREAM".into(), "8:1234".into()),
    ];
    let mut c = daemon.start(None).await;
    // READY=1 comes once recovery is done, before any volume of this test is attached.
    let mut buf = [0u8; 4096];
    let n = listener.recv(&mut buf).unwrap();
    let mut messages = vec![String::from_utf8_lossy(&buf[..n]).into_owned()];
    let vol = Volume::new(&daemon, "notified", 16 * MIB, block());
    vol.up(&mut c).await;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        let n = listener.recv(&mut buf).unwrap();
        messages.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    if !(messages[0].contains("READY=1") && messages[0].contains("0 volume(s) attached")) {
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let entries = reader.join().unwrap();
        panic!("{messages:?}; journal: {entries:?}");
    }
    let keep_alives = messages.iter().filter(|m| m.contains("WATCHDOG=1")).count();
    assert!(keep_alives >= 3, "every half second: {messages:?}");
    assert!(
        messages.iter().any(|m| m.contains("1 volume(s) attached")),
        "{messages:?}"
    );
    // A stopped daemon sends nothing: the keep-alive is not a timer of its own.
    let pid = std::process::Command::new("pidof")
        .arg("ustor-csi-node")
        .output()
        .unwrap();
    let pid: i32 = String::from_utf8_lossy(&pid.stdout).trim().parse().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    while listener
        .set_read_timeout(Some(Duration::from_millis(100)))
        .is_ok()
        && listener.recv(&mut buf).is_ok()
    {}
    listener
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    assert!(
        listener.recv(&mut buf).is_err(),
        "no keep-alive while stopped"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    vol.down(&mut c).await;
    // Log entries reached the journal with the volume id as a field of their own.
    daemon.kill();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let entries = reader.join().unwrap();
    std::fs::remove_file("/run/systemd/journal/socket").unwrap();
    let field = |e: &Vec<(String, String)>, name: &str| {
        e.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    };
    assert!(
        entries.iter().any(|e| {
            field(e, "VOLUME_ID").as_deref() == Some("notified")
                && field(e, "SYSLOG_IDENTIFIER").as_deref() == Some("ustor-csi-node")
        }),
        "no journal entry carries VOLUME_ID=notified: {entries:?}"
    );
    assert_clean(&daemon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn status_names_every_disagreement_and_exits_accordingly() {
    let (mut daemon, mut c) = start_node("status").await;
    let fs_vol = Volume::new_on(&daemon, "st-fs", 64 * MIB, ext4(), Listen::Tcp);
    let blk_vol = Volume::new(&daemon, "st-blk", 32 * MIB, block());
    fs_vol.up(&mut c).await;
    blk_vol.up(&mut c).await;
    // Someone else's device beside ours: shown, and not a problem.
    let stranger = testkit::NbdServer::nbdkit(Listen::Unix, &["memory", "8M"]).unwrap();
    let nl = NbdNetlink::open().await.unwrap();
    let sysfs = Sysfs::default();
    let foreign = nbd::attach::attach(
        &nl,
        &sysfs,
        &stranger.uri(),
        &nbd::attach::AttachOptions::new(BackendId::new("someone-else:1").unwrap()),
    )
    .await
    .unwrap();

    let (code, st) = status_of(&daemon);
    assert_eq!(code, 0, "consistent: {st}");
    assert_eq!(st["schema"], 1);
    assert_eq!(st["daemon_running"], true);
    let row = device_row(&st, "st-fs");
    assert_eq!(row["owner"], "ours");
    assert_eq!(row["link"], "up", "{row}");
    assert_eq!(row["access"], "ext4 filesystem");
    let mounted = row["mounted_at"].to_string();
    assert!(
        mounted.contains("globalmount") && mounted.contains("pods/pod-1"),
        "{mounted}"
    );
    let foreign_row = device_row_where(&st, "backend", "someone-else:1");
    assert_eq!(foreign_row["owner"], "foreign");
    assert!(foreign_row["problems"].as_array().unwrap().is_empty());

    // Stuck states, with the daemon stopped: a lost staging mount, a device detached behind
    // the journal's back, a lost record.
    daemon.kill();
    mounts::ops::unmount(&fs_vol.staging).unwrap();
    let (code, st) = status_of(&daemon);
    assert_eq!(code, 1);
    assert_eq!(st["daemon_running"], false);
    assert!(
        device_row(&st, "st-fs")["problems"]
            .to_string()
            .contains("staging mount missing"),
        "{st}"
    );
    disconnect_behind_the_back(&blk_vol, &daemon).await;
    let (_, st) = status_of(&daemon);
    let orphans = st["records_without_device"].as_array().unwrap();
    assert_eq!(orphans.len(), 1, "{st}");
    assert!(
        orphans[0]["problems"]
            .to_string()
            .contains("the kernel has no device with its identifier"),
        "{st}"
    );
    let fs_record = daemon
        .journal_files()
        .into_iter()
        .find(|p| p.to_string_lossy().contains("st-fs"))
        .unwrap();
    std::fs::remove_file(fs_record).unwrap();
    let (code, st) = status_of(&daemon);
    assert_eq!(code, 1);
    let row = device_row_where(&st, "owner", "ours");
    assert!(
        row["problems"].to_string().contains("no journal record"),
        "{row}"
    );
    // The daemon rebuilds what it can; the CO's calls clean up the rest.
    let mut c = daemon.start(None).await;
    fs_vol.unpublish(&mut c).await.unwrap();
    fs_vol.unstage(&mut c).await.unwrap();
    blk_vol.unpublish(&mut c).await.unwrap();
    blk_vol.unstage(&mut c).await.unwrap();
    nbd::attach::detach(
        &nl,
        &sysfs,
        foreign.device.index(),
        foreign.device.identifier(),
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let (code, st) = status_of(&daemon);
    assert_eq!(code, 0, "clean again: {st}");
    assert_clean(&daemon);
}

/// `ustor-csi-node repair [--apply]` of `daemon`'s state: exit code and output.
fn repair_of(daemon: &NodeDaemon, apply: bool) -> (i32, String) {
    repair_with(daemon, &[], apply)
}

/// `ustor-csi-node repair <args> [--apply]` as `daemon`'s node.
fn repair_with(daemon: &NodeDaemon, args: &[&str], apply: bool) -> (i32, String) {
    let mut cmd = std::process::Command::new(testkit::daemon::binary());
    cmd.args(["repair", "--node-id", &daemon.node_id, "--state-dir"])
        .arg(&daemon.state_dir)
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", daemon.socket.display()))
        .args(args);
    if apply {
        cmd.arg("--apply");
    }
    exit_and_output(cmd.output().unwrap())
}

/// A command's exit code and its stdout then stderr, as an operator sees them.
fn exit_and_output(out: std::process::Output) -> (i32, String) {
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn repair_cleans_what_status_flags_and_nothing_else() {
    let (mut daemon, mut c) = start_node("repair").await;
    let unrecorded = Volume::new(&daemon, "rp-unrecorded", 32 * MIB, block());
    let gone = Volume::new(&daemon, "rp-gone", 32 * MIB, block());
    let in_use = Volume::new(&daemon, "rp-in-use", 32 * MIB, block());
    for v in [&unrecorded, &gone, &in_use] {
        v.up(&mut c).await;
    }
    daemon.kill();
    // The seeds' stuck states: a device whose record is lost and that nobody uses any more; a
    // record whose device went away under its pod's bind mount; a device of ours, record
    // lost, still in use by a pod.
    let remove_record = |daemon: &NodeDaemon, id: &str| {
        let f = daemon
            .journal_files()
            .into_iter()
            .find(|p| p.to_string_lossy().contains(id))
            .unwrap();
        std::fs::remove_file(f).unwrap();
    };
    remove_record(&daemon, "rp-unrecorded");
    while mounts::ops::unmount(&unrecorded.target).unwrap() {}
    disconnect_behind_the_back(&gone, &daemon).await;
    remove_record(&daemon, "rp-in-use");
    let (code, before) = status_of(&daemon);
    assert_eq!(code, 1, "{before}");

    // A dry run says what it would do, and does nothing.
    let (code, plan) = repair_of(&daemon, false);
    assert_eq!(code, 0, "{plan}");
    assert!(plan.contains("would disconnect"), "{plan}");
    assert!(plan.contains("would unmount"), "{plan}");
    assert!(
        plan.contains("would forget the journal record of rp-gone"),
        "{plan}"
    );
    assert!(
        plan.contains("would leave"),
        "the device in use is left alone: {plan}"
    );
    assert_eq!(status_of(&daemon).1, before, "a dry run changes nothing");

    // Not while the daemon runs.
    let c2 = daemon.start(None).await;
    let (code, refused) = repair_of(&daemon, true);
    assert_ne!(code, 0, "{refused}");
    assert!(refused.contains("stop it first"), "{refused}");
    drop(c2);
    daemon.kill();
    // The daemon's start rebuilt the records of the devices it found; lose them again.
    remove_record(&daemon, "rp-unrecorded");
    remove_record(&daemon, "rp-in-use");

    let (code, done) = repair_of(&daemon, true);
    assert_eq!(code, 0, "{done}");
    assert!(
        unrecorded.device(&daemon).is_none(),
        "unused device disconnected: {done}"
    );
    assert!(
        in_use.device(&daemon).is_some(),
        "the device in use stays: {done}"
    );
    assert!(!is_mounted(&gone.target), "stale bind mount gone: {done}");
    let (_, after) = status_of(&daemon);
    assert!(
        after["records_without_device"]
            .as_array()
            .unwrap()
            .is_empty(),
        "{after}"
    );
    // What is left is the device in use, which kubelet unstages through the daemon.
    let mut c = daemon.start(None).await;
    in_use.down(&mut c).await;
    let (code, clean) = status_of(&daemon);
    assert_eq!(code, 0, "{clean}");
    assert_clean(&daemon);
}

/// The state directory's lock keeps `repair --apply` and the daemon apart: a repair refuses
/// while the lock is held (a daemon whose socket is not up yet, crash-looping), and a daemon
/// started during a repair waits for it instead of recovering beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn repair_and_the_daemon_never_act_at_once() {
    use node_daemon::state_lock::StateLock;
    let (mut daemon, mut c) = start_node("state-lock").await;
    let gone = Volume::new(&daemon, "lk-gone", 32 * MIB, block());
    gone.up(&mut c).await;
    drop(c);
    daemon.kill();
    disconnect_behind_the_back(&gone, &daemon).await;
    let (code, plan) = repair_of(&daemon, false);
    assert_eq!(code, 0, "{plan}");
    assert!(
        plan.contains("would forget the journal record of lk-gone"),
        "{plan}"
    );

    // Whoever holds the lock (here: this test, as a daemon that has not bound its socket yet
    // would), `repair --apply` refuses and changes nothing.
    let held = StateLock::try_take(&daemon.state_dir).unwrap();
    let (code, refused) = repair_of(&daemon, true);
    assert_ne!(code, 0, "{refused}");
    assert!(
        refused.contains("the state directory is in use"),
        "{refused}"
    );
    assert!(
        refused.contains(&format!("by pid {}", std::process::id())),
        "names the holder: {refused}"
    );
    assert_eq!(daemon.journal_files().len(), 1, "the record is still there");

    // A daemon started while the lock is held (a repair running) waits: it serves nothing and
    // recovers nothing until the lock is let go.
    daemon.spawn(None);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        NodeClients::connect(&daemon.socket).await.is_err(),
        "the daemon serves while a repair holds the state directory"
    );
    assert_eq!(daemon.journal_files().len(), 1, "recovery waited");
    drop(held);
    let mut c = daemon.wait_ready().await;

    // And the running daemon holds it for as long as it runs.
    let taken = StateLock::try_take(&daemon.state_dir);
    assert!(
        matches!(&taken, Err(node_daemon::state_lock::StateLockError::Held { holder: Some(pid), .. }) if *pid != std::process::id()),
        "the daemon holds the state directory: {taken:?}"
    );
    gone.down(&mut c).await;
    assert_clean(&daemon);
}

/// `ustor-csi-node preflight` with the settings in `config` (TOML) and `args`: exit code and
/// output.
fn preflight_of(dir: &std::path::Path, config: &str, args: &[&str]) -> (i32, String) {
    let file = dir.join("preflight.toml");
    std::fs::write(&file, config).unwrap();
    let out = std::process::Command::new(testkit::daemon::binary())
        .arg("preflight")
        .arg("--config")
        .arg(&file)
        .args(["--node-id", "preflight", "--state-dir"])
        .arg(dir.join("state"))
        .args(args)
        .output()
        .unwrap();
    exit_and_output(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn preflight_says_what_blocks_volumes_and_reaches_exports() {
    let dir = tempfile::tempdir().unwrap();
    // kubelet's directory as a symlink, as some distributions lay it out.
    std::fs::create_dir_all(dir.path().join("data/kubelet/plugins_registry")).unwrap();
    std::os::unix::fs::symlink(dir.path().join("data/kubelet"), dir.path().join("kubelet"))
        .unwrap();
    let kubelet = dir.path().join("kubelet");
    let base = format!(
        "registration-dir = \"{k}/plugins_registry\"\ncsi-endpoint = \"unix://{k}/plugins/x/csi.sock\"\n",
        k = kubelet.display()
    );
    let pki = TestPki::new("preflight CA").unwrap();
    let with_tls = format!("{base}{}", pki.profile_config("main"));

    // This guest can serve volumes: nothing blocks (warnings, such as missing XFS tools, may).
    let (code, out) = preflight_of(dir.path(), &with_tls, &[]);
    assert!(code == 0 || code == 1, "exit {code}: {out}");
    assert!(!out.contains("BLOCK"), "{out}");
    assert!(out.contains("nbd: loaded"), "{out}");
    assert!(out.contains("nbds_max="), "{out}");
    assert!(out.contains("(a symlink to"), "{out}");
    assert!(out.contains("tls-profile.main: files valid"), "{out}");

    // A reachable export says what it is, over TLS with the profile's files.
    let plain = NbdServer::nbdkit(Listen::Tcp, &["memory", "64M"]).unwrap();
    let (code, out) = preflight_of(dir.path(), &base, &["--export", &plain.uri().to_string()]);
    assert!(code <= 1, "exit {code}: {out}");
    assert!(out.contains("67108864 bytes, writable"), "{out}");
    let tls_args = pki.nbdkit_args();
    let mut args: Vec<&str> = tls_args.iter().map(String::as_str).collect();
    args.extend(["memory", "32M"]);
    let secure = NbdServer::nbdkit(Listen::Tcp, &args).unwrap();
    let secure_uri = secure.uri().with_tls().to_string();
    let (code, out) = preflight_of(
        dir.path(),
        &with_tls,
        &["--export", &secure_uri, "--tls-profile", "main"],
    );
    assert!(code <= 1, "exit {code}: {out}");
    assert!(
        out.contains("33554432 bytes, writable, TLS TLSv1_3"),
        "{out}"
    );
    // The same export without the client certificate is refused by the server: blocked.
    let ca_only = format!(
        "{base}tls-ca-file = \"{}\"\n",
        pki.file("ca-cert.pem").display()
    );
    let (code, out) = preflight_of(dir.path(), &ca_only, &["--export", &secure_uri]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("BLOCK export"), "{out}");

    // An export that is gone, a kubelet directory that is not there, a key that is not the
    // certificate's, a configuration that does not parse: each blocks, and says so.
    let gone = plain.uri().to_string();
    drop(plain);
    let (code, out) = preflight_of(dir.path(), &base, &["--export", &gone]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("BLOCK export") && out.contains("onnection refused"),
        "{out}"
    );
    let elsewhere = base.replace(&kubelet.display().to_string(), "/nonexistent/kubelet");
    let (code, out) = preflight_of(dir.path(), &elsewhere, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("BLOCK kubelet"), "{out}");
    let mismatched = with_tls.replace("client-key.pem", "server-key.pem");
    let (code, out) = preflight_of(dir.path(), &mismatched, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("do not go together"), "{out}");
    let (code, out) = preflight_of(dir.path(), &format!("{base}no-such-key = 1\n"), &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("BLOCK configuration"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn a_support_bundle_shows_the_volumes_and_the_daemons_metrics() {
    let (daemon, mut c) = start_node("bundle").await;
    let vol = Volume::new(&daemon, "bundled", 16 * MIB, block());
    vol.up(&mut c).await;
    let out = daemon.scratch().join("bundle.tar.gz");
    let made = std::process::Command::new(testkit::daemon::binary())
        .arg("support-bundle")
        .arg("--config")
        .arg(daemon.config_path())
        .args(["--node-id", &daemon.node_id, "--state-dir"])
        .arg(&daemon.state_dir)
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", daemon.socket.display()))
        .arg("--output")
        .arg(&out)
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    let unpacked = daemon.scratch().join("unpacked");
    std::fs::create_dir_all(&unpacked).unwrap();
    let tar = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&out)
        .arg("-C")
        .arg(&unpacked)
        .status()
        .unwrap();
    assert!(tar.success());
    let part = |name: &str| std::fs::read_to_string(unpacked.join("bundle").join(name)).unwrap();
    let st: serde_json::Value = serde_json::from_str(&part("status.json")).unwrap();
    assert_eq!(st["daemon_running"], true);
    assert!(
        st["devices"].to_string().contains("bundled"),
        "the staged volume is in status.json: {st}"
    );
    assert!(part("recovery.json").contains("records"));
    assert!(part("preflight.txt").contains("nbd: loaded"));
    assert!(part("nbd-parameters.txt").contains("nbds_max="));
    assert!(
        part("metrics.txt").contains("ustor_csi_node_"),
        "the daemon's own metrics: {}",
        part("metrics.txt")
    );
    assert!(part("kernel.txt").contains("nbd"), "{}", part("kernel.txt"));
    vol.down(&mut c).await;
    assert_clean(&daemon);
}

/// `ustor-csi-node repair --release <device> [--apply]` as `daemon`'s node: exit code and output.
fn release_of(daemon: &NodeDaemon, device: &str, apply: bool) -> (i32, String) {
    repair_with(daemon, &["--release", device], apply)
}

/// Another tool's device goes only on the operator's explicit request, only while nothing uses
/// it, and only if it carries an identifier that proves it at the moment of the DISCONNECT; the
/// daemon's own devices are never released this way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs root and the nbd module"]
async fn repair_releases_another_tools_idle_device_on_request_only() {
    let (daemon, mut c) = start_node("release").await;
    let ours = Volume::new(&daemon, "rel-ours", 16 * MIB, block());
    ours.up(&mut c).await;
    let sysfs = Sysfs::default();
    let nl = NbdNetlink::open().await.unwrap();
    let stranger = NbdServer::nbdkit(Listen::Unix, &["memory", "8M"]).unwrap();
    let theirs = nbd::attach::attach(
        &nl,
        &sysfs,
        &stranger.uri(),
        &nbd::attach::AttachOptions::new(BackendId::new("someone-else:7").unwrap()),
    )
    .await
    .unwrap();
    let name = theirs.device.index().name();

    // Open by a process: refused, and the device stays.
    let holder = std::fs::File::open(sysfs.dev_path(theirs.device.index())).unwrap();
    let (code, out) = release_of(&daemon, &name, true);
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("is in use") && out.contains("open by"),
        "{out}"
    );
    drop(holder);
    assert_eq!(
        sysfs.backend(theirs.device.index()).unwrap().as_deref(),
        Some("someone-else:7")
    );

    // A dry run says what it would do, and does nothing.
    let (code, out) = release_of(&daemon, &format!("/dev/{name}"), false);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!("would disconnect /dev/{name} (someone-else:7)")),
        "{out}"
    );
    assert!(sysfs.in_use(theirs.device.index()).unwrap());

    // This node's device: refused, whatever the flags.
    let our_device = ours.device(&daemon).unwrap().name();
    let (code, out) = release_of(&daemon, &our_device, true);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("is this node's (volume rel-ours)"), "{out}");

    // Applied: released, with the daemon running beside it and its volume untouched.
    let (code, out) = release_of(&daemon, &name, true);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!("disconnected /dev/{name} (someone-else:7)")),
        "{out}"
    );
    assert!(!sysfs.in_use(theirs.device.index()).unwrap());
    assert_eq!(ours.device(&daemon).unwrap().name(), our_device);

    // nbd-client's device carries no identifier: nothing could prove it, so it is refused.
    let backing = daemon.scratch().join("client.img");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(16 * MIB)
        .unwrap();
    let file = format!("file={}", backing.display());
    let server = NbdServer::nbdkit(Listen::Tcp, &["file", &file]).unwrap();
    let port = server.tcp_port().unwrap();
    let client = testkit::nbd_client::free_device(&sysfs);
    testkit::nbd_client::attach(&sysfs, client, "", port, &["-L"], 16 * MIB).await;
    let (_, st) = status_of(&daemon);
    let row = device_row_where(&st, "device", &client.name());
    assert_eq!(
        row["owner"], "foreign",
        "connected without an identifier: {row}"
    );
    assert_eq!(row["size_bytes"], 16 * MIB, "{row}");
    let (code, out) = release_of(&daemon, &client.name(), true);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("nbd-client -d"), "{out}");
    assert!(sysfs.in_use(client).unwrap(), "refused, and still attached");
    testkit::nbd_client::detach(&sysfs, client).await;

    ours.down(&mut c).await;
    assert_clean(&daemon);
}
