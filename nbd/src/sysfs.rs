//! What `/sys/block/nbdN` says about a device, and the proof of ownership every destructive
//! action needs.
//!
//! `backend` is the identifier given at CONNECT; it exists only while the device is configured.
//! `pid` is deliberately not used: it names whoever sent CONNECT and goes stale when that
//! process exits.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::identity::{BackendId, DeviceIndex};
use crate::Error;

/// A device shown to carry a given backend identifier. Only [`Sysfs::prove`] and
/// [`Sysfs::find`] make one, so any code holding it has checked ownership first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProvenDevice {
    index: DeviceIndex,
    identifier: BackendId,
}

impl ProvenDevice {
    pub fn index(&self) -> DeviceIndex {
        self.index
    }

    pub fn identifier(&self) -> &BackendId {
        &self.identifier
    }
}

/// Access to the NBD parts of sysfs and /dev, rooted so tests can point it at a directory.
#[derive(Debug, Clone)]
pub struct Sysfs {
    sys_block: PathBuf,
    dev: PathBuf,
}

impl Default for Sysfs {
    fn default() -> Self {
        Self::new("/sys/block", "/dev")
    }
}

impl Sysfs {
    pub fn new(sys_block: impl Into<PathBuf>, dev: impl Into<PathBuf>) -> Self {
        Self {
            sys_block: sys_block.into(),
            dev: dev.into(),
        }
    }

    fn attr(&self, index: DeviceIndex, name: &str) -> PathBuf {
        self.sys_block.join(index.name()).join(name)
    }

    /// An attribute that holds one unsigned number.
    fn read_number(&self, index: DeviceIndex, name: &str) -> Result<u64, Error> {
        let (path, text) = self.read_attr(index, name)?;
        text.trim()
            .parse()
            .map_err(|_| invalid_data(path, format!("not a number: {text:?}")))
    }

    /// An attribute's path and its text, as read.
    fn read_attr(&self, index: DeviceIndex, name: &str) -> Result<(PathBuf, String), Error> {
        let path = self.attr(index, name);
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok((path, text)),
            Err(source) => Err(Error::Sysfs { path, source }),
        }
    }

    /// The device node, e.g. `/dev/nbd3`.
    pub fn dev_path(&self, index: DeviceIndex) -> PathBuf {
        self.dev.join(index.name())
    }

    /// Every `nbdN` the driver has created, in index order.
    pub fn devices(&self) -> Result<Vec<DeviceIndex>, Error> {
        let entries = std::fs::read_dir(&self.sys_block).map_err(|source| Error::Sysfs {
            path: self.sys_block.clone(),
            source,
        })?;
        let mut found: Vec<DeviceIndex> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name();
                let name = name.to_str()?;
                name.strip_prefix("nbd")?;
                name.parse().ok()
            })
            .collect();
        found.sort();
        Ok(found)
    }

    /// The backend identifier the device carries, or `None` when it has none (not configured,
    /// or configured without one).
    pub fn backend(&self, index: DeviceIndex) -> Result<Option<String>, Error> {
        let path = self.attr(index, "backend");
        match std::fs::read_to_string(&path) {
            Ok(s) => Ok(Some(s.trim_end_matches('\n').to_owned())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(Error::Sysfs { path, source }),
        }
    }

    /// Proves that `index` carries `expected`, or says what it carries instead.
    pub fn prove(&self, index: DeviceIndex, expected: &BackendId) -> Result<ProvenDevice, Error> {
        match self.backend(index)? {
            Some(found) if found == expected.as_str() => Ok(ProvenDevice {
                index,
                identifier: expected.clone(),
            }),
            found => Err(Error::NotOurs {
                device: index,
                expected: expected.clone(),
                found,
            }),
        }
    }

    /// The device carrying `identifier`, if any: how a lost device index is found again.
    pub fn find(&self, identifier: &BackendId) -> Result<Option<ProvenDevice>, Error> {
        for index in self.devices()? {
            if self.backend(index)?.as_deref() == Some(identifier.as_str()) {
                return Ok(Some(ProvenDevice {
                    index,
                    identifier: identifier.clone(),
                }));
            }
        }
        Ok(None)
    }

    /// Whether anyone has the device connected, with or without a backend identifier: a
    /// size, or the `pid` attribute the driver creates at CONNECT (or NBD_DO_IT, for
    /// `nbd-client` and `qemu-nbd -c`, which carry no identifier) and removes when the
    /// device is let go. A device that carries no identifier and is not in use is free.
    pub fn in_use(&self, index: DeviceIndex) -> Result<bool, Error> {
        Ok(self.attr(index, "pid").exists() || self.size_bytes(index)? > 0)
    }

    /// Size of the device in bytes (0 when not configured).
    pub fn size_bytes(&self, index: DeviceIndex) -> Result<u64, Error> {
        Ok(self.read_number(index, "size")? * 512)
    }

    /// Requests the block layer has in flight on the device (reads and writes handed to the
    /// driver and not yet completed: `inflight`). A request the driver holds back to wait for
    /// a reconnect is not counted.
    pub fn in_flight(&self, index: DeviceIndex) -> Result<u64, Error> {
        let (path, text) = self.read_attr(index, "inflight")?;
        text.split_whitespace()
            .map(|n| {
                n.parse::<u64>()
                    .map_err(|_| invalid_data(path.clone(), format!("not two numbers: {text:?}")))
            })
            .sum()
    }

    /// How long the kernel lets a request of the device run before it times out
    /// (`queue/io_timeout`): a request sent on a connection that then died stays in flight
    /// until then, and the block layer's timer may add up to a second.
    pub fn io_timeout(&self, index: DeviceIndex) -> Result<Duration, Error> {
        Ok(Duration::from_millis(
            self.read_number(index, "queue/io_timeout")?,
        ))
    }

    /// Whether the kernel marked the device read-only.
    pub fn read_only(&self, index: DeviceIndex) -> Result<bool, Error> {
        let (_, text) = self.read_attr(index, "ro")?;
        Ok(text.trim() == "1")
    }

    /// The active I/O scheduler, e.g. `none` or `mq-deadline`.
    pub fn scheduler(&self, index: DeviceIndex) -> Result<String, Error> {
        let (path, text) = self.read_attr(index, "queue/scheduler")?;
        active_scheduler(&text)
            .ok_or_else(|| invalid_data(path, format!("no active scheduler in {text:?}")))
    }

    /// Selects the I/O scheduler. `none` keeps a request's tag across requeues, which avoids
    /// the "Double reply" link drops of kernels before 6.14 (see the design notes).
    pub fn set_scheduler(&self, index: DeviceIndex, scheduler: &str) -> Result<(), Error> {
        let path = self.attr(index, "queue/scheduler");
        std::fs::write(&path, scheduler).map_err(|source| Error::Sysfs { path, source })
    }

    /// Waits until the device node exists and the kernel reports `size` bytes: both appear
    /// asynchronously after CONNECT or a resize.
    pub async fn wait_ready(
        &self,
        index: DeviceIndex,
        size: u64,
        timeout: Duration,
    ) -> Result<(), Error> {
        let started = Instant::now();
        loop {
            let reason = match (
                self.size_bytes(index),
                is_block_device(&self.dev_path(index)),
            ) {
                (Ok(s), true) if s == size => return Ok(()),
                (Ok(s), true) => format!("size is {s} bytes, expected {size}"),
                (Ok(_), false) => format!(
                    "{} is not a block device yet",
                    self.dev_path(index).display()
                ),
                (Err(e), _) => e.to_string(),
            };
            if started.elapsed() >= timeout {
                return Err(Error::NotReady {
                    device: index,
                    waited: timeout,
                    reason,
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn is_block_device(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device())
}

/// `"[mq-deadline] none"` → `mq-deadline`; a queue without schedulers shows just `none`.
fn invalid_data(path: PathBuf, what: String) -> Error {
    Error::Sysfs {
        path,
        source: io::Error::new(io::ErrorKind::InvalidData, what),
    }
}

fn active_scheduler(text: &str) -> Option<String> {
    let text = text.trim();
    if let Some(start) = text.find('[') {
        let end = text[start..].find(']')? + start;
        return Some(text[start + 1..end].to_owned());
    }
    (!text.is_empty() && !text.contains(' ')).then(|| text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(dir: &Path, devices: &[(u32, Option<&str>, u64)]) -> Sysfs {
        for (index, backend, sectors) in devices {
            let d = dir.join(format!("sys/nbd{index}"));
            std::fs::create_dir_all(d.join("queue")).unwrap();
            std::fs::write(d.join("size"), format!("{sectors}\n")).unwrap();
            std::fs::write(d.join("queue/scheduler"), "[mq-deadline] none\n").unwrap();
            if let Some(b) = backend {
                std::fs::write(d.join("backend"), format!("{b}\n")).unwrap();
            }
        }
        std::fs::create_dir_all(dir.join("sys/loop0")).unwrap();
        Sysfs::new(dir.join("sys"), dir.join("dev"))
    }

    #[test]
    fn prove_and_find_by_identifier() {
        let dir = tempfile::tempdir().unwrap();
        let sys = fake(
            dir.path(),
            &[(0, Some("vol-a"), 8), (1, None, 0), (12, Some("vol-b"), 16)],
        );
        assert_eq!(
            sys.devices().unwrap(),
            vec![DeviceIndex(0), DeviceIndex(1), DeviceIndex(12)]
        );

        let a = BackendId::new("vol-a").unwrap();
        let b = BackendId::new("vol-b").unwrap();
        assert_eq!(
            sys.prove(DeviceIndex(0), &a).unwrap().index(),
            DeviceIndex(0)
        );
        match sys.prove(DeviceIndex(0), &b) {
            Err(Error::NotOurs { found, .. }) => assert_eq!(found.as_deref(), Some("vol-a")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            sys.prove(DeviceIndex(1), &a),
            Err(Error::NotOurs { found: None, .. })
        ));
        assert!(matches!(
            sys.prove(DeviceIndex(7), &a),
            Err(Error::NotOurs { found: None, .. })
        ));
        assert_eq!(
            sys.find(&b).unwrap().map(|d| d.index()),
            Some(DeviceIndex(12))
        );
        // A prefix of another identifier is not that identifier.
        assert_eq!(sys.find(&BackendId::new("vol").unwrap()).unwrap(), None);
        assert_eq!(sys.size_bytes(DeviceIndex(12)).unwrap(), 16 * 512);
        assert_eq!(sys.scheduler(DeviceIndex(0)).unwrap(), "mq-deadline");
    }

    #[test]
    fn scheduler_parsing() {
        assert_eq!(
            active_scheduler("[none] mq-deadline\n").as_deref(),
            Some("none")
        );
        assert_eq!(
            active_scheduler("mq-deadline kyber [bfq] none").as_deref(),
            Some("bfq")
        );
        assert_eq!(active_scheduler("none\n").as_deref(), Some("none"));
        assert_eq!(active_scheduler(""), None);
    }

    #[tokio::test]
    async fn wait_ready_reports_why_it_gave_up() {
        let dir = tempfile::tempdir().unwrap();
        let sys = fake(dir.path(), &[(0, Some("v"), 8)]);
        let err = sys
            .wait_ready(DeviceIndex(0), 4096, Duration::from_millis(30))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("not a block device yet"), "{err}");
    }
}
