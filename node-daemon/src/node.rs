//! The node's state: journal, kernel handles, the in-memory copy of the records, per-volume
//! locks and link health. The CSI operations are `impl Node` blocks in `volumes/`.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nbd::attach::AttachOptions;
use nbd::dial::DialOptions;
use nbd::netlink::NbdNetlink;
use nbd::sysfs::{ProvenDevice, Sysfs};
use nbd::{BackendId, DeviceIndex, NbdUri};

use crate::config::Settings;
use crate::error::NodeError;
use crate::journal::Journal;
use crate::locks::VolumeLocks;
use crate::metrics::Metrics;
use crate::record::{Export, Record};

/// Health of a volume's link to its export, as the healer last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Link {
    Up,
    Down {
        since: Instant,
        last_error: Option<String>,
    },
}

pub struct Node {
    pub settings: Settings,
    pub metrics: Arc<Metrics>,
    pub(crate) journal: Journal,
    pub(crate) nl: NbdNetlink,
    pub(crate) sysfs: Sysfs,
    records: Mutex<BTreeMap<String, Record>>,
    pub(crate) locks: VolumeLocks,
    links: Mutex<HashMap<String, Link>>,
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
    pub fn new(settings: Settings, journal: Journal, nl: NbdNetlink, sysfs: Sysfs) -> Self {
        Self {
            settings,
            metrics: Arc::default(),
            journal,
            nl,
            sysfs,
            records: Mutex::default(),
            locks: VolumeLocks::default(),
            links: Mutex::default(),
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
            Err(NodeError::Unavailable(
                "the node daemon is still recovering its attachments; retry shortly".into(),
            ))
        }
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
            .find(|r| r.device == Some(index.0))
            .cloned()
    }

    /// Journals `record` durably, then makes it the in-memory truth.
    pub(crate) fn save(&self, record: &Record) -> Result<(), NodeError> {
        self.journal.write(record)?;
        let mut records = lock(&self.records);
        records.insert(record.volume_id.clone(), record.clone());
        self.metrics.volumes.set(records.len() as i64);
        Ok(())
    }

    /// Forgets the volume, journal first.
    pub(crate) fn forget(&self, volume: &str) -> Result<(), NodeError> {
        self.journal.remove(volume)?;
        let mut records = lock(&self.records);
        records.remove(volume);
        self.metrics.volumes.set(records.len() as i64);
        drop(records);
        self.set_link(volume, Link::Up);
        lock(&self.links).remove(volume);
        Ok(())
    }

    /// Loads records without journaling them again (recovery).
    pub(crate) fn adopt(&self, record: Record) {
        let mut records = lock(&self.records);
        records.insert(record.volume_id.clone(), record);
        self.metrics.volumes.set(records.len() as i64);
    }

    pub fn link(&self, volume: &str) -> Link {
        lock(&self.links).get(volume).cloned().unwrap_or(Link::Up)
    }

    pub(crate) fn set_link(&self, volume: &str, link: Link) {
        let mut links = lock(&self.links);
        links.insert(volume.to_owned(), link);
        let down = links
            .values()
            .filter(|l| matches!(l, Link::Down { .. }))
            .count();
        self.metrics.links_down.set(down as i64);
    }

    pub(crate) fn attach_options(&self, identifier: BackendId, export: &Export) -> AttachOptions {
        let mut opts = AttachOptions::new(identifier);
        opts.dial = self.dial_options(export);
        opts.io_timeout = Some(self.settings.io_timeout);
        opts.dead_conn_timeout = self.settings.dead_conn_timeout;
        opts
    }

    pub(crate) fn dial_options(&self, export: &Export) -> DialOptions {
        DialOptions {
            deadline: self.settings.dial_timeout,
            connections: export.connections,
        }
    }

    /// The device of a record, proven to carry the record's identifier. If the record's index
    /// is stale (a device re-created under another number), the identifier finds it.
    pub(crate) fn proven_device(&self, record: &Record) -> Result<Option<ProvenDevice>, NodeError> {
        let id = identifier(record)?;
        if let Some(index) = record.device_index() {
            if let Ok(proven) = self.sysfs.prove(index, &id) {
                return Ok(Some(proven));
            }
        }
        Ok(self.sysfs.find(&id)?)
    }
}

pub(crate) fn identifier(record: &Record) -> Result<BackendId, NodeError> {
    BackendId::new(record.identifier.clone()).map_err(|e| {
        NodeError::Journal(format!(
            "record of {} has a bad identifier: {e}",
            record.volume_id
        ))
    })
}

pub(crate) fn export_uri(export: &Export) -> Result<NbdUri, NodeError> {
    export.uri.parse().map_err(|e| {
        NodeError::Journal(format!("stored export {:?} is not a URI: {e}", export.uri))
    })
}

/// Runs slow blocking work (mkfs, resize, blkid) without stalling the runtime's other tasks.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// Major and minor numbers of a block device node.
pub(crate) fn device_numbers(path: &Path) -> Option<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    if !meta.file_type().is_block_device() {
        return None;
    }
    let rdev = meta.rdev();
    Some((
        nix::sys::stat::major(rdev) as u32,
        nix::sys::stat::minor(rdev) as u32,
    ))
}

/// Flushes what the page cache holds for a raw block device down to the export.
pub(crate) fn flush_device(path: &Path) -> Result<(), NodeError> {
    std::fs::OpenOptions::new()
        .read(true)
        .open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| NodeError::Internal(format!("flushing {}: {e}", path.display())))
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
