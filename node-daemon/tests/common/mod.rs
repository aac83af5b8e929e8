//! Helpers shared by the node daemon's VM suites: volumes served by real NBD servers, at
//! kubelet-shaped paths, and checks that nothing is left behind.

#![allow(dead_code)] // each suite uses its own subset

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::VolumeCapability;
use mounts::MountTable;
use nbd::netlink::NbdNetlink;
use nbd::sysfs::Sysfs;
use nbd::BackendId;
use testkit::csi::*;
use testkit::daemon::NodeDaemon;
use testkit::{pattern, DirectFile, Listen, NbdServer};

/// What the suites import, in one line: `use common::prelude::*;`.
#[allow(unused_imports)] // unused in the suites that name their imports one by one
pub mod prelude {
    pub use super::*;
    pub use csi_proto::csi::volume_capability::access_mode::Mode;
    pub use nbd::sysfs::Sysfs;
    pub use std::time::{Duration, Instant};
    pub use testkit::csi::*;
    pub use testkit::daemon::NodeDaemon;
    pub use testkit::{kernel_io_errors, pattern, DirectFile, Listen, NbdServer};
    pub use tonic::Code;
}

pub const MIB: u64 = 1 << 20;

/// Short timeouts so healing and requeues happen within a test's patience.
pub const CONFIG: &str =
    "io-timeout-secs = 4\ndead-conn-timeout-secs = 30\ndial-timeout-secs = 5\n";

/// A node daemon named `name` with [`CONFIG`], started, and its clients.
pub async fn start_node(name: &str) -> (NodeDaemon, NodeClients) {
    let mut daemon = NodeDaemon::new(name, CONFIG).unwrap();
    let clients = daemon.start(None).await;
    (daemon, clients)
}

/// One volume: a sparse backing file served by nbdkit, and kubelet-shaped paths.
pub struct Volume {
    pub id: String,
    pub backing: PathBuf,
    pub server: NbdServer,
    pub staging: PathBuf,
    pub target: PathBuf,
    pub cap: VolumeCapability,
    /// `nbdConnections` in the volume context, when not the default of one.
    pub connections: Option<u8>,
    /// Served over TLS (`nbds://`).
    pub tls: bool,
    /// `tlsProfile` in the volume context.
    pub tls_profile: Option<String>,
    /// The URI nodes are given, when not the server's own (a proxy in front of it).
    pub via: Option<String>,
}

impl Volume {
    pub fn new(daemon: &NodeDaemon, id: &str, size: u64, cap: VolumeCapability) -> Self {
        Self::new_on(daemon, id, size, cap, Listen::Unix)
    }

    /// Exports that will grow are served over TCP: the daemon replaces a device's TCP
    /// connections so the server serves the new size (see node-daemon/src/connections.rs).
    pub fn new_on(
        daemon: &NodeDaemon,
        id: &str,
        size: u64,
        cap: VolumeCapability,
        listen: Listen,
    ) -> Self {
        Self::served(daemon, id, size, cap, listen, &[], &[])
    }

    /// Served by nbdkit through its error filter: every read fails with EIO while the file
    /// `reads_fail_while` exists, and writes succeed (a degraded backend).
    pub fn with_failing_reads(
        daemon: &NodeDaemon,
        id: &str,
        size: u64,
        cap: VolumeCapability,
        reads_fail_while: &Path,
    ) -> Self {
        Self::failing_reads_on(daemon, id, size, cap, Listen::Unix, &[], reads_fail_while)
    }

    /// Served over TCP by nbdkit (requiring TLS with `pki`'s certificates, if given) through
    /// its error filter, as [`Volume::with_failing_reads`]. What the fault campaign's volumes
    /// are served by: any of them can be reset, killed or degraded.
    pub fn misbehaving(
        daemon: &NodeDaemon,
        id: &str,
        size: u64,
        cap: VolumeCapability,
        pki: Option<&testkit::tls::TestPki>,
        reads_fail_while: &Path,
    ) -> Self {
        let tls: Vec<String> = pki.map(|p| p.nbdkit_args().to_vec()).unwrap_or_default();
        let mut vol =
            Self::failing_reads_on(daemon, id, size, cap, Listen::Tcp, &tls, reads_fail_while);
        vol.tls = pki.is_some();
        vol
    }

    fn failing_reads_on(
        daemon: &NodeDaemon,
        id: &str,
        size: u64,
        cap: VolumeCapability,
        listen: Listen,
        server_options: &[String],
        reads_fail_while: &Path,
    ) -> Self {
        let mut options = server_options.to_vec();
        options.push("--filter=error".into());
        Self::served(
            daemon,
            id,
            size,
            cap,
            listen,
            &options,
            &[
                "error-pread=EIO".into(),
                "error-pread-rate=100%".into(),
                format!("error-pread-file={}", reads_fail_while.display()),
            ],
        )
    }

    /// The nbdkit arguments that serve `image` as this volume's export (for a restart with
    /// other ones: see [`NbdServer::restart_with`]).
    pub fn file_args(image: &Path) -> Vec<String> {
        vec!["file".into(), format!("file={}", image.display())]
    }

    /// Served over TCP by nbdkit requiring TLS with `pki`'s certificates (`nbds://`).
    pub fn new_tls(
        daemon: &NodeDaemon,
        id: &str,
        size: u64,
        cap: VolumeCapability,
        pki: &testkit::tls::TestPki,
    ) -> Self {
        let mut vol = Self::served(daemon, id, size, cap, Listen::Tcp, &pki.nbdkit_args(), &[]);
        vol.tls = true;
        vol
    }

    fn served(
        daemon: &NodeDaemon,
        id: &str,
        size: u64,
        cap: VolumeCapability,
        listen: Listen,
        server_options: &[String],
        plugin_options: &[String],
    ) -> Self {
        let root = daemon.scratch();
        let backing = root.join(format!("{id}.img"));
        std::fs::File::create(&backing)
            .unwrap()
            .set_len(size)
            .unwrap();
        let file = format!("file={}", backing.display());
        let mut args: Vec<&str> = server_options.iter().map(String::as_str).collect();
        args.extend(["file", &file]);
        args.extend(plugin_options.iter().map(String::as_str));
        let server = NbdServer::nbdkit(listen, &args).unwrap();
        let block = matches!(
            cap.access_type,
            Some(csi_proto::csi::volume_capability::AccessType::Block(_))
        );
        let (staging, target) = if block {
            (
                root.join(format!(
                    "plugins/kubernetes.io/csi/volumeDevices/staging/{id}"
                )),
                root.join(format!(
                    "plugins/kubernetes.io/csi/volumeDevices/publish/{id}/pod-1"
                )),
            )
        } else {
            (
                root.join(format!(
                    "plugins/kubernetes.io/csi/ustor-nbd.csi.mindsw.io/{id}/globalmount"
                )),
                root.join(format!("pods/pod-1/volumes/kubernetes.io~csi/{id}/mount")),
            )
        };
        // What kubelet creates before calling: the staging directory, the target's parent.
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        Self {
            id: id.into(),
            backing,
            server,
            staging,
            target,
            cap,
            connections: None,
            tls: false,
            tls_profile: None,
            via: None,
        }
    }

    /// The export is dialed with the node's TLS profile `name`.
    pub fn with_tls_profile(mut self, name: &str) -> Self {
        self.tls_profile = Some(name.to_owned());
        self
    }

    /// The export is attached with `n` connections.
    pub fn with_connections(mut self, n: u8) -> Self {
        self.connections = Some(n);
        self
    }

    fn with_context<R>(
        &self,
        mut req: R,
        context: impl FnOnce(&mut R) -> &mut std::collections::HashMap<String, String>,
    ) -> R {
        let ctx = context(&mut req);
        if let Some(n) = self.connections {
            ctx.insert("nbdConnections".into(), n.to_string());
        }
        if let Some(p) = &self.tls_profile {
            ctx.insert("tlsProfile".into(), p.clone());
        }
        req
    }

    pub fn uri(&self) -> String {
        if let Some(via) = &self.via {
            return via.clone();
        }
        let uri = self.server.uri();
        if self.tls { uri.with_tls() } else { uri }.to_string()
    }

    /// This volume's NodeStageVolume request, its context included.
    pub fn stage_req(&self) -> csi_proto::csi::NodeStageVolumeRequest {
        let req = stage_request(&self.id, &self.staging, self.cap.clone(), &self.uri());
        self.with_context(req, |r| &mut r.volume_context)
    }

    pub async fn stage(&self, c: &mut NodeClients) -> Result<(), tonic::Status> {
        c.node.node_stage_volume(self.stage_req()).await.map(drop)
    }

    pub async fn publish(&self, c: &mut NodeClients) -> Result<(), tonic::Status> {
        self.publish_at(c, &self.target, false).await
    }

    /// NodePublishVolume to `target` (a second pod's, or this volume's), read-only or not.
    pub async fn publish_at(
        &self,
        c: &mut NodeClients,
        target: &Path,
        readonly: bool,
    ) -> Result<(), tonic::Status> {
        let req = publish_request(
            &self.id,
            &self.staging,
            target,
            self.cap.clone(),
            &self.uri(),
            readonly,
        );
        c.node
            .node_publish_volume(self.with_context(req, |r| &mut r.volume_context))
            .await
            .map(drop)
    }

    pub async fn unpublish(&self, c: &mut NodeClients) -> Result<(), tonic::Status> {
        c.node
            .node_unpublish_volume(unpublish_request(&self.id, &self.target))
            .await
            .map(drop)
    }

    pub async fn unstage(&self, c: &mut NodeClients) -> Result<(), tonic::Status> {
        c.node
            .node_unstage_volume(unstage_request(&self.id, &self.staging))
            .await
            .map(drop)
    }

    /// NodeExpandVolume through the published path, to `bytes`.
    pub async fn expand(&self, c: &mut NodeClients, bytes: u64) -> Result<(), tonic::Status> {
        c.node
            .node_expand_volume(expand_request(
                &self.id,
                &self.target,
                &self.staging,
                bytes as i64,
            ))
            .await
            .map(drop)
    }

    pub async fn up(&self, c: &mut NodeClients) {
        self.succeeded("stage", self.stage(c).await);
        self.succeeded("publish", self.publish(c).await);
    }

    pub async fn down(&self, c: &mut NodeClients) {
        self.succeeded("unpublish", self.unpublish(c).await);
        self.succeeded("unstage", self.unstage(c).await);
    }

    /// Panics naming the step and this volume unless the step succeeded.
    fn succeeded(&self, step: &str, result: Result<(), tonic::Status>) {
        result.unwrap_or_else(|e| panic!("{step} {}: {e:?}", self.id));
    }

    /// The device the daemon attached for this volume, found by its identifier.
    pub fn device(&self, daemon: &NodeDaemon) -> Option<nbd::DeviceIndex> {
        let sysfs = Sysfs::default();
        sysfs.devices().unwrap().into_iter().find(|i| {
            sysfs
                .backend(*i)
                .unwrap()
                .is_some_and(|b| b.starts_with(&format!("ustor:{}:{}:", daemon.node_id, self.id)))
        })
    }

    /// Grows (or shrinks) the export's backing file, as the storage does on expansion.
    pub fn resize_backing(&self, size: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&self.backing)
            .unwrap()
            .set_len(size)
            .unwrap();
    }

    pub fn read_backing(&self, offset: u64, len: usize) -> Vec<u8> {
        testkit::read_at(&self.backing, offset, len)
    }
}

pub fn ext4() -> VolumeCapability {
    mount_capability("ext4", Mode::SingleNodeWriter)
}

/// A raw block volume for one pod (ReadWriteOncePod, the guide's mode for block volumes).
pub fn block() -> VolumeCapability {
    block_capability(Mode::SingleNodeSingleWriter)
}

/// Nothing of this daemon's is left: no journal record, no device with its identifiers, no
/// mount of an nbd device.
pub fn assert_clean(daemon: &NodeDaemon) {
    assert!(
        daemon.journal_files().is_empty(),
        "journal records left: {:?}",
        daemon.journal_files()
    );
    let sysfs = Sysfs::default();
    let prefix = format!("ustor:{}:", daemon.node_id);
    for i in sysfs.devices().unwrap() {
        let backend = sysfs.backend(i).unwrap();
        assert!(
            !backend.as_deref().is_some_and(|b| b.starts_with(&prefix)),
            "{i} still attached as {backend:?}"
        );
    }
    let table = MountTable::read().unwrap();
    let leftover: Vec<_> = table
        .0
        .iter()
        .filter(|m| {
            m.source.starts_with("/dev/nbd")
                || (m.fs_type == "devtmpfs" && m.root.starts_with("/nbd"))
        })
        .filter(|m| m.mount_point.starts_with(daemon.scratch()))
        .collect();
    assert!(leftover.is_empty(), "mounts left: {leftover:?}");
}

pub fn is_mounted(path: &Path) -> bool {
    MountTable::read().unwrap().is_mount_point(path)
}

/// Writes a file through the published path and checks it reads back.
pub fn write_and_check_file(dir: &Path, name: &str, len: usize, seed: u64) {
    let path = dir.join(name);
    let data = pattern(seed, 0, len);
    std::fs::write(&path, &data).unwrap();
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    assert!(std::fs::read(&path).unwrap() == data);
}

/// O_DIRECT round trip through a published block target, checked on the server's file.
pub fn block_round_trip(vol: &Volume, offset: u64, seed: u64) {
    let data = pattern(seed, offset, 256 * 1024);
    let f = DirectFile::open(&vol.target, true).unwrap();
    f.write_at(&data, offset).unwrap();
    f.sync().unwrap();
    assert!(
        vol.read_backing(offset, data.len()) == data,
        "server-side bytes of {} differ",
        vol.id
    );
}

pub fn mkfs_ext4(image: &Path) {
    let out = std::process::Command::new("mkfs.ext4")
        .arg("-q")
        .arg(image)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Copies an image file keeping its holes (as a clone of a sparse volume does), so large
/// sparse images cost the guest's memory only what they hold.
pub fn sparse_copy(from: &Path, to: &Path) {
    use std::os::fd::AsRawFd;
    let src = std::fs::File::open(from).unwrap();
    let dst = std::fs::OpenOptions::new().write(true).open(to).unwrap();
    let len = src.metadata().unwrap().len();
    dst.set_len(len).unwrap();
    let mut offset: i64 = 0;
    let mut buf = vec![0u8; 1 << 20];
    while (offset as u64) < len {
        // SAFETY: lseek on an open descriptor; no memory is touched.
        let data = unsafe { libc::lseek(src.as_raw_fd(), offset, libc::SEEK_DATA) };
        if data < 0 {
            break; // no data past `offset`
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(src.as_raw_fd(), data, libc::SEEK_HOLE) };
        let mut at = data;
        while at < hole {
            let n = usize::try_from(hole - at).map_or(buf.len(), |left| left.min(buf.len()));
            src.read_exact_at(&mut buf[..n], at as u64).unwrap();
            dst.write_all_at(&buf[..n], at as u64).unwrap();
            at += n as i64;
        }
        offset = hole;
    }
    dst.sync_all().unwrap();
}

/// Size of the filesystem mounted at `path`, in bytes.
pub fn fs_bytes(path: &Path) -> u64 {
    let st = nix::sys::statvfs::statvfs(path).unwrap();
    st.blocks() * st.fragment_size()
}

/// `ustor-csi-node status --json` of `daemon`'s state: its exit code and its output.
pub fn status_of(daemon: &NodeDaemon) -> (i32, serde_json::Value) {
    let out = std::process::Command::new(testkit::daemon::binary())
        .args([
            "status",
            "--json",
            "--node-id",
            &daemon.node_id,
            "--state-dir",
        ])
        .arg(&daemon.state_dir)
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", daemon.socket.display()))
        .output()
        .unwrap();
    let json = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code().unwrap_or(-1), json)
}

/// The device row of `volume` in a status.
pub fn device_row<'a>(status: &'a serde_json::Value, volume: &str) -> &'a serde_json::Value {
    device_row_where(status, "volume", volume)
}

/// The status' device row whose `field` is `value`; panics naming both when there is none.
pub fn device_row_where<'a>(
    status: &'a serde_json::Value,
    field: &str,
    value: &str,
) -> &'a serde_json::Value {
    status["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d[field] == value)
        .unwrap_or_else(|| panic!("no device row with {field} {value}: {status}"))
}

/// The journal record of `volume`, as JSON.
pub fn journal_record(daemon: &NodeDaemon, volume: &str) -> serde_json::Value {
    daemon
        .journal_files()
        .iter()
        .filter_map(|f| serde_json::from_slice::<serde_json::Value>(&std::fs::read(f).ok()?).ok())
        .find(|r| r["volume_id"] == volume)
        .unwrap_or_else(|| panic!("no journal record of {volume}"))
}

/// The filesystem UUID of an image file, as blkid reads it.
pub fn image_uuid(image: &Path) -> String {
    let out = std::process::Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "UUID"])
        .arg(image)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Disconnects a volume's device behind the daemon's back, as a reboot or an operator would.
pub async fn disconnect_behind_the_back(vol: &Volume, daemon: &NodeDaemon) {
    let sysfs = Sysfs::default();
    let Some(index) = vol.device(daemon) else {
        panic!("volume {} has no device to disconnect", vol.id);
    };
    let id = BackendId::new(sysfs.backend(index).unwrap().unwrap()).unwrap();
    let proven = sysfs.prove(index, &id).unwrap();
    NbdNetlink::open()
        .await
        .unwrap()
        .disconnect(&proven)
        .await
        .unwrap();
    nbd::attach::wait_released(&sysfs, index, Duration::from_secs(30))
        .await
        .unwrap();
}
