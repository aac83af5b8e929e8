//! The node's state: journal, kernel handles, the in-memory copy of the records, per-volume
//! locks and link health. The CSI operations are `impl Node` blocks in `volumes/`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nbd::attach::AttachOptions;
use nbd::dial::DialOptions;
use nbd::sysfs::ProvenDevice;
use nbd::{BackendId, DeviceIndex, NbdUri};

use crate::config::Settings;
use crate::error::NodeError;
use crate::held::HeldSockets;
use crate::journal::Journal;
use crate::kernel::{Host, Kernel, Mounts, Tools};
use crate::locks::VolumeLocks;
use crate::metrics::Metrics;
use crate::openers::UdevLock;
use crate::record::{Export, Record, TcpConnection};
use crate::stage_tls::{StageTls, StageTlsStore};

/// Health of a volume's link to its export, as the healer last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Link {
    Up,
    Down {
        since: Instant,
        last_error: Option<String>,
    },
    /// The export refused this node's grant (see [`crate::fence`]): never reconnected.
    Fenced {
        refusal: String,
    },
}

pub struct Node {
    pub settings: Settings,
    pub metrics: Arc<Metrics>,
    pub(crate) journal: Journal,
    /// Sysfs facts and netlink verbs.
    pub(crate) kernel: Arc<dyn Kernel>,
    /// The mount table and the staging mount syscalls.
    pub(crate) mounts: Arc<dyn Mounts>,
    /// probe, mkfs, grow, flush, freeze: blocking, so only through [`off_runtime`].
    pub(crate) tools: Arc<dyn Tools>,
    records: Mutex<BTreeMap<String, Record>>,
    /// Per volume, whose turn it is to write its journal record (see [`Node::journaled`]).
    journal_turns: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// One CSI operation (or recovery step) per volume at a time. Held across device I/O, so
    /// healing never takes it.
    pub(crate) locks: VolumeLocks,
    /// Serialises what changes a device's connections: the healer's RECONFIGURE and a CSI
    /// call's DISCONNECT or resize. Never held across I/O on the device itself (mount, umount,
    /// fsync, mkfs): a call blocked on a dead link must not keep the healer from fixing it.
    pub(crate) link_locks: VolumeLocks,
    links: Mutex<HashMap<String, Link>>,
    /// Volumes whose device is being disconnected: the healer must not RECONFIGURE them
    /// (kernels before 6.14 accept a reconnect after DISCONNECT and can then use freed memory).
    detaching: Mutex<HashSet<String>>,
    /// Copies of the unix-socket connections handed to the kernel (see `held.rs`).
    pub(crate) held: HeldSockets,
    ready: AtomicBool,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("node_id", &self.settings.node_id)
            .field("ready", &self.is_ready())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Node {
    /// A node on `host`: [`Host::real`] in the daemon, fakes in the unit tests.
    pub fn new(settings: Settings, journal: Journal, host: Host) -> Self {
        Self {
            settings,
            metrics: Arc::default(),
            journal,
            kernel: host.kernel,
            mounts: host.mounts,
            tools: host.tools,
            records: Mutex::default(),
            journal_turns: Mutex::default(),
            locks: VolumeLocks::default(),
            link_locks: VolumeLocks::default(),
            links: Mutex::default(),
            detaching: Mutex::default(),
            held: HeldSockets::default(),
            ready: AtomicBool::new(false),
        }
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    pub(crate) fn set_ready(&self) {
        self.ready.store(true, Ordering::SeqCst);
    }

    /// CSI node calls wait for recovery: acting on a half-known state is how devices get lost.
    pub(crate) fn ensure_ready(&self) -> Result<(), NodeError> {
        if self.is_ready() {
            Ok(())
        } else {
            Err(NodeError::NotReady)
        }
    }

    /// How every call that changes a volume begins: recovery has finished, and no other call
    /// acts on the volume (waiting for one at most `call_patience`, then
    /// [`NodeError::Busy`]). The volume is the caller's until the guard drops.
    pub(crate) async fn begin_call(
        &self,
        volume: &crate::ids::VolumeId,
    ) -> Result<crate::locks::VolumeGuard, NodeError> {
        self.ensure_ready()?;
        self.locks
            .lock_within(volume.as_str(), self.settings.call_patience)
            .await
    }

    /// The volume's record; [`NodeError::NotStaged`] when this node has none.
    pub(crate) fn staged_record(&self, volume: &crate::ids::VolumeId) -> Result<Record, NodeError> {
        self.record(volume.as_str())
            .ok_or_else(|| NodeError::NotStaged {
                volume: volume.to_string(),
            })
    }

    /// [`NodeError::NotStaged`] for a volume this node has no record of.
    pub(crate) fn require_known(&self, volume: &crate::ids::VolumeId) -> Result<(), NodeError> {
        self.ensure_ready()?;
        self.staged_record(volume).map(drop)
    }

    pub fn record(&self, volume: &str) -> Option<Record> {
        lock(&self.records).get(volume).cloned()
    }

    pub fn records(&self) -> Vec<Record> {
        lock(&self.records).values().cloned().collect()
    }

    pub(crate) fn record_by_device(&self, index: DeviceIndex) -> Option<Record> {
        lock(&self.records)
            .values()
            .find(|r| r.device == Some(index))
            .cloned()
    }

    /// Journals `record` durably, then makes it the in-memory truth. The connection list
    /// (`tcp`) is not the caller's to change: the healer updates it without the volume lock,
    /// so the current one is kept (see [`Node::set_tcp`]). Two writers of one volume never
    /// interleave (see [`Node::journaled`]).
    pub(crate) fn save(&self, record: &Record) -> Result<(), NodeError> {
        self.journaled(record.volume_id.as_str(), |current| {
            let mut record = record.clone();
            if let Some(current) = current {
                if current.identifier == record.identifier {
                    record.tcp = current.tcp.clone();
                }
            }
            Some(record)
        })
    }

    /// Journals `record` whole, its connection list included: for the step that has just
    /// dialed them, before CONNECT.
    pub(crate) fn save_with_connections(&self, record: &Record) -> Result<(), NodeError> {
        self.journaled(record.volume_id.as_str(), |_| Some(record.clone()))
    }

    /// The one way a record is written: `change` sees the current record and says what to
    /// journal (`None`: nothing). Writers of one volume take turns on its journal lock; the
    /// records lock is held only to read and to swap, never across the disk, so a slow root
    /// disk stalls only the writers of that volume, not every call and the healer. The
    /// write (file, fsync, rename, directory fsync) leaves the runtime's worker to the
    /// runtime while it waits for the disk.
    fn journaled(
        &self,
        volume: &str,
        change: impl FnOnce(Option<&Record>) -> Option<Record>,
    ) -> Result<(), NodeError> {
        self.in_journal_turn(volume, || {
            let current = lock(&self.records).get(volume).cloned();
            let Some(record) = change(current.as_ref()) else {
                return Ok(());
            };
            self.journal.write(&record)?;
            let mut records = lock(&self.records);
            records.insert(volume.to_owned(), record);
            self.metrics.volumes.set(records.len() as i64);
            Ok(())
        })
    }

    /// Gives free nbd devices the `none` scheduler ahead of use, so the queue freeze a switch
    /// costs is not paid inside an attach. A device another tool attached (no identifier, but
    /// connected) is not free, and is not touched.
    pub(crate) fn prepare_idle_devices(&self) {
        let Ok(devices) = self.kernel.devices() else {
            return;
        };
        for index in devices {
            if matches!(self.kernel.is_free(index), Ok(true))
                && self.kernel.scheduler(index).is_ok_and(|s| s != "none")
            {
                if let Err(e) = self.kernel.set_scheduler(index, "none") {
                    tracing::debug!(device = %index, error = %e, "could not preset the none scheduler");
                }
            }
        }
    }

    /// Runs `f`, which writes `volume`'s journal record, in that volume's turn and off the
    /// runtime's worker (see [`on_disk`]).
    fn in_journal_turn<T>(&self, volume: &str, f: impl FnOnce() -> T) -> T {
        let turn = Arc::clone(
            lock(&self.journal_turns)
                .entry(volume.to_owned())
                .or_default(),
        );
        on_disk(|| {
            let _turn = lock(&turn);
            f()
        })
    }

    /// Journals the connections the device of `volume` may hold, if the volume still has
    /// the attachment `identifier` (a forgotten or re-attached volume is left alone).
    pub(crate) fn set_tcp(
        &self,
        volume: &str,
        identifier: &BackendId,
        tcp: Vec<TcpConnection>,
    ) -> Result<(), NodeError> {
        self.journaled(volume, |current| {
            let current = current?;
            if current.identifier != *identifier || current.tcp == tcp {
                return None;
            }
            let mut record = current.clone();
            record.tcp = tcp;
            Some(record)
        })
    }

    /// Journals that `volume` was fenced, if it still has the attachment `identifier`.
    pub(crate) fn set_fenced(
        &self,
        volume: &str,
        identifier: &BackendId,
        fenced: crate::record::Fenced,
    ) -> Result<(), NodeError> {
        self.journaled(volume, |current| {
            let current = current?;
            if current.identifier != *identifier || current.fenced.is_some() {
                return None;
            }
            let mut record = current.clone();
            record.fenced = Some(fenced);
            Some(record)
        })
    }

    /// Forgets the volume, journal first.
    pub(crate) fn forget(&self, volume: &str) -> Result<(), NodeError> {
        self.in_journal_turn(volume, || {
            self.journal.remove(volume)?;
            let mut records = lock(&self.records);
            records.remove(volume);
            self.metrics.volumes.set(records.len() as i64);
            Ok::<_, NodeError>(())
        })?;
        lock(&self.journal_turns).remove(volume);
        // After the record: a crash between the two leaves files that the next start sweeps,
        // never a record whose dials find no material.
        if let Err(e) = self.stage_tls().remove(volume) {
            tracing::warn!(%volume, error = %e, "could not remove the volume's TLS material; the next start removes it");
        }
        self.held.forget(volume);
        self.set_link(volume, Link::Up);
        lock(&self.links).remove(volume);
        Ok(())
    }

    /// Loads records without journaling them again (recovery).
    pub(crate) fn adopt(&self, record: Record) {
        let fenced = record.fenced.clone();
        let volume = record.volume_id.to_string();
        {
            let mut records = lock(&self.records);
            records.insert(volume.clone(), record);
            self.metrics.volumes.set(records.len() as i64);
        }
        if let Some(f) = fenced {
            self.set_link(&volume, Link::Fenced { refusal: f.refusal });
        }
    }

    /// Volumes whose link is down right now.
    pub fn links_down(&self) -> usize {
        count_down(&lock(&self.links))
    }

    /// How many volumes have a record.
    pub fn record_count(&self) -> usize {
        lock(&self.records).len()
    }

    /// The connections the journal lists for `volume`'s device (empty if none or unknown).
    pub(crate) fn connections_of(&self, volume: &str) -> Vec<TcpConnection> {
        lock(&self.records)
            .get(volume)
            .map(|r| r.tcp.clone())
            .unwrap_or_default()
    }

    pub fn link(&self, volume: &str) -> Link {
        lock(&self.links).get(volume).cloned().unwrap_or(Link::Up)
    }

    pub(crate) fn set_link(&self, volume: &str, link: Link) {
        let mut links = lock(&self.links);
        links.insert(volume.to_owned(), link);
        self.metrics.links_down.set(count_down(&links) as i64);
    }

    pub(crate) fn is_detaching(&self, volume: &str) -> bool {
        lock(&self.detaching).contains(volume)
    }

    /// DISCONNECT of `volume`'s device, marked as detaching and proven again under the link
    /// lock so the healer can neither race it nor reconnect the device afterwards; then waits
    /// until the kernel has let the device go. The caller has unmounted and flushed:
    /// DISCONNECT fails I/O in flight. `udev_lock` is held until the DISCONNECT is sent: the
    /// kernel lets the device go only once it is dropped (it holds the device open).
    pub(crate) async fn disconnect(
        &self,
        volume: &str,
        device: &ProvenDevice,
        udev_lock: UdevLock,
    ) -> Result<(), NodeError> {
        let sent = self.disconnect_only(volume, device).await;
        drop(udev_lock);
        let device = sent?;
        self.kernel
            .wait_released(device.index(), RELEASE_TIMEOUT)
            .await?;
        Ok(())
    }

    /// DISCONNECT as in [`Node::disconnect`], without waiting for the kernel to let the device
    /// go (a fenced device stays held by its mounts until they are unmounted).
    pub(crate) async fn disconnect_only(
        &self,
        volume: &str,
        device: &ProvenDevice,
    ) -> Result<ProvenDevice, NodeError> {
        // Cleared however this ends: a marker left behind would stop healing for good.
        let _detaching = Detaching::mark(self, volume);
        // The link lock only waits out a RECONFIGURE already under way: every later one sees
        // the marker first. It is not held across the DISCONNECT itself, which can wait in
        // the kernel on a stalled socket.
        let device = {
            let _link = self.link_locks.lock(volume).await;
            self.kernel.prove(device.index(), device.identifier())?
        };
        self.kernel.disconnect(&device).await?;
        Ok(device)
    }

    /// Puts the `none` I/O scheduler back on a device of ours where someone changed it: with
    /// another scheduler, kernels before 6.14 can send a request header twice and drop the
    /// link ("Double reply"). Returns the scheduler found, if it was not `none`.
    pub(crate) fn keep_scheduler(&self, record: &Record) -> Option<String> {
        let device = self.proven_device(record).ok().flatten()?;
        let found = self.kernel.scheduler(device.index()).ok()?;
        if found == "none" {
            return None;
        }
        match self.kernel.set_scheduler(device.index(), "none") {
            Ok(()) => {
                tracing::warn!(volume = %record.volume_id, device = %device.index(), %found, "I/O scheduler was changed; set back to none")
            }
            Err(e) => {
                tracing::warn!(volume = %record.volume_id, device = %device.index(), %found, error = %e, "I/O scheduler was changed and cannot be set back to none")
            }
        }
        self.metrics.scheduler_reset.inc();
        Some(found)
    }

    /// The store of the TLS material NodeStage's secrets deliver.
    pub(crate) fn stage_tls(&self) -> StageTlsStore {
        StageTlsStore::new(&self.settings.state_dir)
    }

    /// Keeps `tls` (a NodeStage's or NodeExpand's secrets) for `volume` if its export dials
    /// with it, and returns what `export.stage_tls` is to name. A volume already dialing with
    /// such material takes the newer; otherwise an `nbds://` export whose TLS this node's own
    /// configuration does not provide starts to. Without `tls` nothing changes.
    pub(crate) fn keep_stage_tls(
        &self,
        volume: &str,
        export: &Export,
        tls: Option<&StageTls>,
    ) -> Result<Option<PathBuf>, NodeError> {
        let Some(tls) = tls else {
            return Ok(export.stage_tls.clone());
        };
        let encrypted = export.uri.parse::<NbdUri>().is_ok_and(|u| u.tls());
        let node_files = matches!(
            self.settings.tls_for(export.tls_profile.as_deref()),
            Ok(Some(_))
        );
        if export.stage_tls.is_none() && (!encrypted || node_files) {
            return Ok(None);
        }
        let store = self.stage_tls();
        if store.holds(volume, tls) {
            return Ok(Some(store.dir_for(volume)));
        }
        let dir = store.write(volume, tls)?;
        tracing::info!(%volume, "TLS material of the node-stage secret kept for the volume's dials");
        Ok(Some(dir))
    }

    pub(crate) fn attach_options(
        &self,
        identifier: BackendId,
        export: &Export,
    ) -> Result<AttachOptions, NodeError> {
        let mut opts = AttachOptions::new(identifier);
        opts.dial = self.dial_options(export)?;
        opts.io_timeout = Some(self.settings.io_timeout);
        opts.dead_conn_timeout = self.settings.dead_conn_timeout;
        Ok(opts)
    }

    /// How `export` is dialed. A TLS profile this node does not define is refused here, for
    /// every dial (stage, expansion, healing), naming the table to add: dialing without it
    /// would only say that TLS files are missing.
    pub(crate) fn dial_options(&self, export: &Export) -> Result<DialOptions, NodeError> {
        let tls = match &export.stage_tls {
            Some(dir) => Some(Arc::new(crate::stage_tls::files_in(dir))),
            None => self
                .settings
                .tls_for(export.tls_profile.as_deref())
                .map_err(|name| NodeError::UnknownTlsProfile {
                    uri: export.uri.clone(),
                    profile: name.to_owned(),
                })?,
        };
        Ok(DialOptions {
            deadline: self.settings.dial_timeout,
            connections: export.connections,
            tls,
            grant: export.grant.clone(),
        })
    }

    /// The device of a record, proven to carry the record's identifier. If the record's index
    /// is stale (a device re-created under another number), the identifier finds it.
    pub(crate) fn proven_device(&self, record: &Record) -> Result<Option<ProvenDevice>, NodeError> {
        let id = &record.identifier;
        if let Some(index) = record.device_index() {
            if let Ok(proven) = self.kernel.prove(index, id) {
                return Ok(Some(proven));
            }
        }
        Ok(self.kernel.find(id)?)
    }
}

/// A volume marked as being disconnected for as long as this lives.
struct Detaching<'a> {
    node: &'a Node,
    volume: &'a str,
}

impl<'a> Detaching<'a> {
    fn mark(node: &'a Node, volume: &'a str) -> Self {
        lock(&node.detaching).insert(volume.to_owned());
        Self { node, volume }
    }
}

impl Drop for Detaching<'_> {
    fn drop(&mut self) {
        lock(&self.node.detaching).remove(self.volume);
    }
}

fn count_down(links: &HashMap<String, Link>) -> usize {
    links
        .values()
        .filter(|l| matches!(l, Link::Down { .. } | Link::Fenced { .. }))
        .count()
}

/// The export `record` was attached from; [`NodeError::ExportUnknown`] while a record rebuilt
/// from kernel facts has not learned it.
pub(crate) fn known_export(record: &Record) -> Result<Export, NodeError> {
    record
        .export
        .clone()
        .ok_or_else(|| NodeError::ExportUnknown {
            volume: record.volume_id.to_string(),
        })
}

pub(crate) fn export_uri(export: &Export) -> Result<NbdUri, NodeError> {
    export.uri.parse().map_err(|source| {
        NodeError::from(crate::journal::JournalError::BadExportUri {
            uri: export.uri.clone(),
            source,
        })
    })
}

/// Runs work that can block on a device (mount, umount, fsync, O_DIRECT I/O, mkfs, resize,
/// blkid) on tokio's blocking pool, never on a runtime worker: while an export is down such
/// a call may wait for minutes, and the workers must keep serving other volumes, Probe and
/// the healer. Dropping the future leaves the work to finish on its own thread.
pub(crate) async fn off_runtime<T, F>(what: &'static str, f: F) -> Result<T, NodeError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, NodeError> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|source| NodeError::Worker { what, source })?
}

/// Runs `f`, which waits for the root disk (a journal write), without holding up the other
/// tasks of the runtime worker it is called on: the multi-threaded runtime hands them to
/// another worker meanwhile. Called from a blocking thread or a current-thread runtime (the
/// unit tests), it just runs.
fn on_disk<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Major and minor numbers of a block device node.
pub(crate) fn device_numbers(path: &Path) -> Option<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    if !meta.file_type().is_block_device() {
        return None;
    }
    let rdev = meta.rdev();
    // The kernel's dev_t has a 12-bit major and a 20-bit minor: both fit; a number that did
    // not could name no device the mount table shows.
    Some((
        u32::try_from(nix::sys::stat::major(rdev)).ok()?,
        u32::try_from(nix::sys::stat::minor(rdev)).ok()?,
    ))
}

/// A short pause for kernel state that settles asynchronously.
pub(crate) const RELEASE_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) fn paths(targets: &BTreeMap<PathBuf, crate::record::Target>) -> String {
    targets
        .keys()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::fake::FakeHost;

    fn export(uri: &str, profile: Option<&str>) -> Export {
        Export {
            uri: uri.into(),
            connections: 1,
            tls_profile: profile.map(str::to_owned),
            stage_tls: None,
            grant: None,
        }
    }

    #[test]
    fn stage_secrets_serve_tls_exports_the_node_has_no_files_for() {
        let dir = tempfile::tempdir().unwrap();
        let host = FakeHost::new(&dir.path().join("host"));
        let mut settings = Settings::defaults("node-a".into());
        settings.state_dir = dir.path().join("state");
        let node_files = Arc::new(nbd::tls::TlsFiles {
            ca: "/etc/ustor-csi/tls/main/ca.crt".into(),
            client_cert: None,
            client_key: None,
            server_name: None,
        });
        settings.tls_profiles.insert("main".into(), node_files);
        let journal = Journal::open(&settings.state_dir).unwrap();
        let node = Node::new(settings, journal, host.host());
        let secrets = HashMap::from([("ca.crt".to_owned(), "CA".to_owned())]);
        let tls = StageTls::from_secrets(&secrets).unwrap();

        // A plaintext export has no use for it; a node's own profile wins.
        for e in [
            export("nbd://h:10809/x", None),
            export("nbds://h:10809/x", Some("main")),
        ] {
            assert_eq!(node.keep_stage_tls("v", &e, tls.as_ref()).unwrap(), None);
        }
        assert!(!node.stage_tls().dir_for("v").exists());

        // A profile this node lacks: the secret's material is kept, and dials read it.
        let mut e = export("nbds://h:10809/x", Some("other"));
        assert!(matches!(
            node.dial_options(&e),
            Err(NodeError::UnknownTlsProfile { .. })
        ));
        let kept = node.keep_stage_tls("v", &e, tls.as_ref()).unwrap().unwrap();
        e.stage_tls = Some(kept.clone());
        let dial = node.dial_options(&e).unwrap();
        assert_eq!(dial.tls.map(|t| t.ca.clone()), Some(kept.join("ca.crt")));
        // A call without secrets changes nothing; forgetting the volume removes them.
        assert_eq!(
            node.keep_stage_tls("v", &e, None).unwrap(),
            Some(kept.clone())
        );
        node.forget("v").unwrap();
        assert!(!kept.exists());
    }
}
