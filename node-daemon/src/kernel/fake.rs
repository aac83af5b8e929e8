//! A recording fake of the host (youki's `TestHelperSyscall`): it answers from a scripted
//! state and records every verb it is asked for, so a test asserts what a decision did.
//!
//! Sysfs facts come from a real [`Sysfs`] rooted in a temporary directory: the `nbd` crate
//! makes a [`ProvenDevice`] only by reading an identifier there, and the fake does not get
//! round that proof. Devices `nbd0`..`nbd7` exist (as the module creates them); scripting a
//! device means writing its `backend` and `size`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mounts::{Filesystem, MountEntry, MountOptions, MountTable, Probe};
use nbd::attach::{AttachOptions, Attached};
use nbd::dial::{DialOptions, Dialed};
use nbd::handshake::ExportInfo;
use nbd::protocol::TransmissionFlags;
use nbd::sysfs::{ProvenDevice, Sysfs};
use nbd::{DeviceIndex, NbdUri};

use super::{Host, Kernel, Mounts, SendGate, Tools};
use crate::blockdev::{BlockdevError, UnreadableError};
use crate::error::NodeError;
use crate::openers::UdevLock;

/// The `nbd` block major.
const NBD_MAJOR: u32 = 43;
const DEVICES: u32 = 8;

#[derive(Debug)]
pub struct FakeHost {
    root: PathBuf,
    sysfs: Sysfs,
    /// Every verb asked for, in order: `attach nbd5`, `mount nbd1 /…/staging`, `probe`, …
    calls: Mutex<Vec<String>>,
    table: Mutex<Vec<MountEntry>>,
    /// What a probe of any device finds.
    holds: Mutex<Probe>,
    /// The size the export reports when dialed.
    export_size: Mutex<u64>,
    /// Another process that has every device open (`pid (command)`).
    opener: Mutex<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl FakeHost {
    /// A host whose devices carry nothing and whose mount table is empty, under `root`.
    pub fn new(root: &Path) -> Arc<Self> {
        for n in 0..DEVICES {
            let d = root.join(format!("sys/nbd{n}"));
            std::fs::create_dir_all(d.join("queue")).unwrap();
            std::fs::write(d.join("size"), "0\n").unwrap();
            std::fs::write(d.join("queue/scheduler"), "[none]\n").unwrap();
        }
        std::fs::create_dir_all(root.join("dev")).unwrap();
        Arc::new(Self {
            root: root.to_owned(),
            sysfs: Sysfs::new(root.join("sys"), root.join("dev")),
            calls: Mutex::default(),
            table: Mutex::default(),
            holds: Mutex::new(Probe::Blank),
            export_size: Mutex::new(0),
            opener: Mutex::default(),
        })
    }

    pub fn host(self: &Arc<Self>) -> Host {
        Host {
            kernel: Arc::clone(self) as Arc<dyn Kernel>,
            mounts: Arc::clone(self) as Arc<dyn Mounts>,
            tools: Arc::clone(self) as Arc<dyn Tools>,
        }
    }

    /// `index` carries `backend` (or nothing) and is `bytes` long.
    pub fn set_device(&self, index: u32, backend: Option<&str>, bytes: u64) {
        let d = self.root.join(format!("sys/nbd{index}"));
        std::fs::write(d.join("size"), format!("{}\n", bytes / 512)).unwrap();
        match backend {
            Some(b) => std::fs::write(d.join("backend"), format!("{b}\n")).unwrap(),
            None => {
                let _ = std::fs::remove_file(d.join("backend"));
            }
        }
    }

    /// A filesystem from `nbd<index>` is mounted at `path`.
    pub fn set_mounted(&self, index: u32, path: &Path) {
        let mut table = lock(&self.table);
        let id = 100 + u32::try_from(table.len()).unwrap_or(0);
        table.push(MountEntry {
            id,
            parent: 1,
            major: NBD_MAJOR,
            minor: index,
            root: "/".into(),
            mount_point: path.to_owned(),
            options: vec!["rw".into()],
            fs_type: "ext4".into(),
            source: format!("/dev/nbd{index}"),
        });
    }

    pub fn set_holds(&self, probe: Probe) {
        *lock(&self.holds) = probe;
    }

    /// Another process has every device open (or, with `None`, nobody has).
    pub fn set_opener(&self, holder: Option<&str>) {
        *lock(&self.opener) = holder.map(str::to_owned);
    }

    pub fn set_export_size(&self, bytes: u64) {
        *lock(&self.export_size) = bytes;
    }

    /// The verbs asked for so far, and forgets them.
    pub fn take_calls(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.calls))
    }

    fn record(&self, call: String) {
        lock(&self.calls).push(call);
    }

    fn path_name(&self, path: &Path) -> String {
        path.strip_prefix(&self.root)
            .unwrap_or(path)
            .display()
            .to_string()
    }

    fn index_of(dev: &Path) -> Option<DeviceIndex> {
        dev.file_name()?.to_str()?.parse().ok()
    }
}

#[tonic::async_trait]
impl Kernel for FakeHost {
    fn sysfs(&self) -> &Sysfs {
        &self.sysfs
    }

    fn device_numbers(&self, index: DeviceIndex) -> Option<(u32, u32)> {
        (index.0 < DEVICES).then_some((NBD_MAJOR, index.0))
    }

    fn set_scheduler(&self, index: DeviceIndex, scheduler: &str) -> Result<(), nbd::Error> {
        self.record(format!("scheduler {index} {scheduler}"));
        Ok(())
    }

    async fn dial(&self, _uri: &NbdUri, _opts: &DialOptions) -> Result<Dialed, nbd::Error> {
        self.record("dial".into());
        Ok(Dialed {
            info: ExportInfo {
                size: *lock(&self.export_size),
                flags: TransmissionFlags::empty(),
                block_sizes: None,
                tls: None,
            },
            sockets: Vec::new(),
        })
    }

    /// CONNECT takes the first device that carries nothing.
    async fn attach(&self, dialed: Dialed, opts: &AttachOptions) -> Result<Attached, nbd::Error> {
        let free = self
            .sysfs
            .devices()?
            .into_iter()
            .find(|i| matches!(self.sysfs.backend(*i), Ok(None)))
            .ok_or(nbd::Error::ModuleNotLoaded)?;
        self.record(format!("attach {free}"));
        self.set_device(free.0, Some(opts.identifier.as_str()), dialed.info.size);
        Ok(Attached {
            device: self.sysfs.prove(free, &opts.identifier)?,
            info: dialed.info,
            sockets: dialed.sockets,
        })
    }

    async fn reconnect(&self, device: &ProvenDevice, _dialed: &Dialed) -> Result<(), nbd::Error> {
        self.record(format!("reconnect {}", device.index()));
        Ok(())
    }

    async fn resize_when(
        &self,
        device: &ProvenDevice,
        bytes: u64,
        ready: SendGate,
    ) -> Result<bool, nbd::Error> {
        if !ready() {
            return Ok(false);
        }
        self.record(format!("resize {} {bytes}", device.index()));
        self.set_device(device.index().0, Some(device.identifier().as_str()), bytes);
        Ok(true)
    }

    async fn wait_ready(
        &self,
        index: DeviceIndex,
        bytes: u64,
        timeout: Duration,
    ) -> Result<(), nbd::Error> {
        // The real wait also wants a block device node, which a test cannot make.
        match self.sysfs.size_bytes(index)? {
            size if size == bytes => Ok(()),
            size => Err(nbd::Error::NotReady {
                device: index,
                waited: timeout,
                reason: format!("size is {size} bytes, expected {bytes}"),
            }),
        }
    }

    async fn disconnect(&self, device: &ProvenDevice) -> Result<(), nbd::Error> {
        self.record(format!("disconnect {}", device.index()));
        self.set_device(device.index().0, None, 0);
        Ok(())
    }

    async fn wait_released(
        &self,
        _index: DeviceIndex,
        _timeout: Duration,
    ) -> Result<(), nbd::Error> {
        Ok(())
    }
}

impl Mounts for FakeHost {
    fn table(&self) -> Result<MountTable, mounts::Error> {
        Ok(MountTable(lock(&self.table).clone()))
    }

    fn mount_filesystem(
        &self,
        dev: &Path,
        target: &Path,
        _fs: &str,
        _opts: &MountOptions,
    ) -> Result<(), mounts::Error> {
        let index = Self::index_of(dev).map_or(u32::MAX, |i| i.0);
        self.record(format!("mount nbd{index} {}", self.path_name(target)));
        self.set_mounted(index, target);
        Ok(())
    }

    fn unmount(&self, target: &Path) -> Result<bool, mounts::Error> {
        self.record(format!("unmount {}", self.path_name(target)));
        let mut table = lock(&self.table);
        match table.iter().rposition(|m| m.mount_point == target) {
            Some(at) => {
                table.remove(at);
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

impl Tools for FakeHost {
    fn probe(&self, _dev: &Path) -> Result<Probe, NodeError> {
        self.record("probe".into());
        Ok(lock(&self.holds).clone())
    }

    fn make_filesystem(
        &self,
        _dev: &Path,
        fs: Filesystem,
        _uuid: &str,
    ) -> Result<(), mounts::Error> {
        self.record("mkfs".into());
        self.set_holds(Probe::Filesystem(fs.name().into()));
        Ok(())
    }

    fn redo_interrupted_format(
        &self,
        _dev: &Path,
        _fs: Filesystem,
        _uuid: &str,
    ) -> Result<(), mounts::Error> {
        self.record("mkfs again".into());
        Ok(())
    }

    fn grow(&self, _fs: Filesystem, _dev: &Path, _mount_point: &Path) -> Result<(), mounts::Error> {
        self.record("grow".into());
        Ok(())
    }

    fn flush(&self, _dev: &Path) -> Result<(), BlockdevError> {
        self.record("flush".into());
        Ok(())
    }

    fn freeze(&self, _mount_point: &Path) -> Result<(), BlockdevError> {
        self.record("freeze".into());
        Ok(())
    }

    fn thaw(&self, _mount_point: &Path) -> Result<(), BlockdevError> {
        self.record("thaw".into());
        Ok(())
    }

    fn serves_size(&self, _dev: &Path, _size: u64) -> Result<bool, UnreadableError> {
        Ok(true)
    }

    fn wait_unused(&self, _dev: &Path, _within: Duration) -> Result<UdevLock, Vec<String>> {
        match lock(&self.opener).clone() {
            None => Ok(None),
            Some(holder) => Err(vec![holder]),
        }
    }
}

/// The columns of the phase tables: what the kernel says about the record's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Facts {
    /// The record's index carries the record's identifier.
    Proven,
    /// No device carries the identifier; the record's index carries nothing.
    Absent,
    /// The record's index carries another node's identifier; none carries ours.
    Foreign,
    /// The identifier is on another index than the record's (a device re-created).
    Moved,
}

pub const ALL_FACTS: [Facts; 4] = [Facts::Proven, Facts::Absent, Facts::Foreign, Facts::Moved];

/// The record's index, and where [`Facts::Moved`] finds the device.
pub const RECORDED: u32 = 1;
pub const MOVED_TO: u32 = 3;
pub const GIB: u64 = 1 << 30;

/// One cell of a phase table: a node with one volume, journaled in `phase`, on a host with
/// `facts` and (if `mounted`) the volume's filesystem at its staging path.
#[derive(Debug)]
pub struct Cell {
    pub dir: tempfile::TempDir,
    pub host: Arc<FakeHost>,
    pub node: Arc<crate::node::Node>,
    pub record: crate::record::Record,
}

impl Cell {
    pub fn new(phase: crate::record::Phase, facts: Facts, mounted: bool) -> Self {
        use crate::ids::{Identifier, VolumeId};
        use crate::record::{Access, AccessMode, Export, Phase, Record};

        let dir = tempfile::tempdir().unwrap();
        let host = FakeHost::new(&dir.path().join("host"));
        let mut settings = crate::config::Settings::defaults("node-a".into());
        settings.state_dir = dir.path().join("state");
        settings.call_patience = Duration::from_secs(1);
        let journal = crate::journal::Journal::open(&settings.state_dir).unwrap();
        let node = Arc::new(crate::node::Node::new(settings, journal, host.host()));

        let volume = VolumeId::parse("pvc-1").unwrap();
        let identifier = Identifier::new_attachment("node-a", &volume).unwrap();
        let staging = dir.path().join("staging");
        let mut record = Record::attaching(
            volume,
            identifier.clone(),
            Export {
                uri: "nbd://export:10809/pvc-1".into(),
                connections: 1,
                tls_profile: None,
                stage_tls: None,
                grant: None,
            },
            staging.clone(),
            Access::Mount {
                fs: "ext4".into(),
                flags: Vec::new(),
            },
            AccessMode::SingleNodeWriter,
        )
        .in_phase(phase);
        let past_mkfs = !matches!(
            phase,
            Phase::Attaching | Phase::Attached | Phase::Formatting
        );
        if phase != Phase::Attaching {
            record.device = Some(DeviceIndex(RECORDED));
            record.size_bytes = Some(GIB);
        }
        if !matches!(phase, Phase::Attaching | Phase::Attached) {
            record.fs_uuid = Some("0b6f5a52-4c8e-4d8e-9d2b-5d3c1c2b7a10".into());
        }
        host.set_export_size(match phase {
            Phase::Expanding { to_bytes } => to_bytes,
            _ => GIB,
        });
        host.set_holds(if past_mkfs {
            Probe::Filesystem("ext4".into())
        } else {
            Probe::Blank
        });
        let other = VolumeId::parse("pvc-other").unwrap();
        let foreign = Identifier::new_attachment("node-b", &other).unwrap();
        let at = match facts {
            Facts::Proven => {
                host.set_device(RECORDED, Some(identifier.as_str()), GIB);
                RECORDED
            }
            Facts::Absent => RECORDED,
            Facts::Foreign => {
                host.set_device(RECORDED, Some(foreign.as_str()), GIB);
                RECORDED
            }
            Facts::Moved => {
                host.set_device(MOVED_TO, Some(identifier.as_str()), GIB);
                MOVED_TO
            }
        };
        if mounted {
            std::fs::create_dir_all(&staging).unwrap();
            host.set_mounted(at, &staging);
        }
        node.save(&record).unwrap();
        Self {
            dir,
            host,
            node,
            record,
        }
    }

    /// What the journal on disk holds for the volume: `Staged nbd3`, or `none`.
    pub fn journaled(&self) -> String {
        let loaded = crate::journal::Journal::open(&self.dir.path().join("state"))
            .unwrap()
            .load()
            .unwrap();
        match loaded.records.as_slice() {
            [] => "none".into(),
            [r] => format!(
                "{:?} {}",
                r.phase(),
                r.device.map_or("-".into(), |d| d.to_string())
            ),
            more => format!("{} records", more.len()),
        }
    }

    /// `text` with the temporary directory and the identifiers made stable.
    pub fn stable(&self, text: &str) -> String {
        text.replace(&self.dir.path().display().to_string(), "")
            .replace(self.record.identifier.as_str(), "<id>")
    }
}

pub const MOUNTED: bool = true;
pub const UNMOUNTED: bool = false;

/// One row of a phase table: the cell (phase, kernel facts, staging mount) and what must
/// come of it (the answer or report, the verbs in order, the journal afterwards).
pub type Row = (
    crate::record::Phase,
    Facts,
    bool,
    &'static str,
    &'static str,
    &'static str,
);

/// Runs every cell of `table` through `run` and fails naming each cell whose outcome
/// differs; checks first that the table has each (phase, facts, mount) cell exactly once.
pub async fn check_table<F, Fut>(table: &[Row], run: F)
where
    F: Fn(crate::record::Phase, Facts, bool) -> Fut,
    Fut: std::future::Future<Output = (String, String, String)>,
{
    let mut cells: Vec<String> = table
        .iter()
        .map(|(p, f, m, ..)| format!("{p:?} {f:?} {m}"))
        .collect();
    cells.sort();
    cells.dedup();
    assert_eq!(cells.len(), 7 * ALL_FACTS.len() * 2, "every cell, once");
    assert_eq!(cells.len(), table.len(), "every cell, once");
    let mut wrong = Vec::new();
    for &(phase, facts, mounted, said, calls, journal) in table {
        let got = run(phase, facts, mounted).await;
        let want = (said.to_owned(), calls.to_owned(), journal.to_owned());
        if got != want {
            let staging = if mounted { "mounted" } else { "not mounted" };
            wrong.push(format!(
                "{phase:?}, device {facts:?}, staging {staging}:\n  want {want:?}\n  got  {got:?}"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} cells differ:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}
