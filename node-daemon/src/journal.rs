//! The attachment journal: one JSON file per volume under `<state-dir>/volumes/`.
//!
//! A record is replaced atomically: written to a temporary file, fsync'd, renamed over the old
//! one, and the directory fsync'd, so after a crash the file is either the old record or the
//! new one, never a mix. Records that cannot be read are moved to `<state-dir>/quarantine/`
//! with an error, never deleted and never trusted.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::ids::{digest, encode};
use crate::record::{Record, SCHEMA};

/// A journal operation that failed: the file and the step, with the OS error.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("attachment journal: {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("attachment journal: encoding: {0}")]
    Encode(#[source] serde_json::Error),
    #[error(
        "attachment journal: {} has schema {found}, newer than this daemon's {SCHEMA}: refusing to guess",
        path.display()
    )]
    NewerSchema { path: PathBuf, found: u32 },
    #[error("attachment journal: stored export {uri:?} is not a URI: {source}")]
    BadExportUri {
        uri: String,
        source: nbd::uri::UriError,
    },
}

#[derive(Debug, Clone)]
pub struct Journal {
    dir: PathBuf,
    quarantine: PathBuf,
}

/// What loading the journal found.
#[derive(Debug, Default)]
pub struct Loaded {
    pub records: Vec<Record>,
    /// Files moved aside, with the reason.
    pub quarantined: Vec<(PathBuf, String)>,
}

const SUFFIX: &str = ".json";
const TMP_PREFIX: &str = ".tmp.";

impl Journal {
    /// Opens (creating, root-only) the journal under `state_dir`.
    pub fn open(state_dir: &Path) -> Result<Self, JournalError> {
        let journal = Self {
            dir: state_dir.join("volumes"),
            quarantine: state_dir.join("quarantine"),
        };
        for d in [state_dir, &journal.dir, &journal.quarantine] {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(d)
                .map_err(|e| io(d, "creating", e))?;
        }
        Ok(journal)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path_for(&self, volume_id: &str) -> PathBuf {
        let mut name = encode(volume_id);
        // A leading dot would make the record a hidden file, or one that load takes for an
        // unfinished temporary write (".tmp.…") and deletes.
        if let Some(rest) = name.strip_prefix('.') {
            name = format!("%2E{rest}");
        }
        // NAME_MAX is 255 bytes; keep room for the temporary prefix.
        if name.len() + SUFFIX.len() + TMP_PREFIX.len() > 250 {
            name = format!("h.{}", digest(volume_id));
        }
        self.dir.join(name + SUFFIX)
    }

    /// Durably replaces the record of `record.volume_id`.
    pub fn write(&self, record: &Record) -> Result<(), JournalError> {
        let path = self.path_for(&record.volume_id);
        let file_name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let tmp = self.dir.join(format!("{TMP_PREFIX}{file_name}"));
        let json = serde_json::to_vec_pretty(record).map_err(JournalError::Encode)?;
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| io(&tmp, "creating", e))?;
        f.write_all(&json).map_err(|e| io(&tmp, "writing", e))?;
        f.sync_all().map_err(|e| io(&tmp, "syncing", e))?;
        drop(f);
        crate::failpoints::stall("journal-slow-disk");
        fail::fail_point!("journal-before-rename");
        fs::rename(&tmp, &path).map_err(|e| io(&path, "renaming into", e))?;
        self.sync_dir()
    }

    /// Durably forgets the record of `volume_id` (no error if there is none).
    pub fn remove(&self, volume_id: &str) -> Result<(), JournalError> {
        let path = self.path_for(volume_id);
        match fs::remove_file(&path) {
            Ok(()) => self.sync_dir(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path, "removing", e)),
        }
    }

    /// Reads every record. Leftover temporary files (a crash before their rename) are
    /// discarded: the record they would have replaced is still in place. Unreadable records
    /// are quarantined. A record of a newer schema stops the load: a downgraded daemon must
    /// not guess at it.
    pub fn load(&self) -> Result<Loaded, JournalError> {
        let mut loaded = Loaded::default();
        for path in sorted_entries(&self.dir)? {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_owned();
            if name.starts_with(TMP_PREFIX) {
                tracing::info!(path = %path.display(), "discarding an unfinished journal write");
                fs::remove_file(&path).map_err(|e| io(&path, "removing", e))?;
                continue;
            }
            if !name.ends_with(SUFFIX) {
                continue;
            }
            match read_record(&path) {
                Ok(r) if r.schema > SCHEMA => {
                    return Err(JournalError::NewerSchema {
                        path,
                        found: r.schema,
                    })
                }
                Ok(r) if self.path_for(&r.volume_id) != path => {
                    let reason = format!(
                        "names volume {:?}, which belongs in another file",
                        r.volume_id
                    );
                    loaded
                        .quarantined
                        .push((self.quarantine_file(&path)?, reason));
                }
                Ok(r) => loaded.records.push(r),
                Err(reason) => {
                    let moved = self.quarantine_file(&path)?;
                    tracing::error!(path = %path.display(), quarantined = %moved.display(), %reason, "unreadable journal record");
                    loaded.quarantined.push((moved, reason));
                }
            }
        }
        if !loaded.quarantined.is_empty() {
            self.sync_dir()?;
        }
        Ok(loaded)
    }

    /// Reads records without changing anything on disk (for `ustor-csi-node status`, which
    /// may run beside the daemon). Unreadable files are reported, not moved.
    pub fn peek(state_dir: &Path) -> Result<Loaded, JournalError> {
        let dir = state_dir.join("volumes");
        let mut loaded = Loaded::default();
        if !dir.exists() {
            return Ok(loaded);
        }
        for path in sorted_entries(&dir)? {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if name.starts_with(TMP_PREFIX) || !name.ends_with(SUFFIX) {
                continue;
            }
            match read_record(&path) {
                Ok(r) => loaded.records.push(r),
                Err(reason) => loaded.quarantined.push((path, reason)),
            }
        }
        Ok(loaded)
    }

    fn quarantine_file(&self, path: &Path) -> Result<PathBuf, JournalError> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("record");
        let target = self.quarantine.join(format!("{name}.{stamp}"));
        fs::rename(path, &target).map_err(|e| io(&target, "quarantining into", e))?;
        Ok(target)
    }

    fn sync_dir(&self) -> Result<(), JournalError> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io(&self.dir, "syncing", e))
    }
}

fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>, JournalError> {
    let entries = fs::read_dir(dir).map_err(|e| io(dir, "reading", e))?;
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    Ok(paths)
}

fn read_record(path: &Path) -> Result<Record, String> {
    let bytes = fs::read(path).map_err(|e| format!("read failed: {e}"))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("not a valid record: {e}"))
}

fn io(path: &Path, op: &'static str, source: std::io::Error) -> JournalError {
    JournalError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use nbd::DeviceIndex;

    use super::*;
    use crate::ids::{Identifier, VolumeId};
    use crate::record::{Access, AccessMode, Export, Phase};

    fn record(volume: &str) -> Record {
        let volume = VolumeId::parse(volume).unwrap();
        let identifier = Identifier::compose("n", &volume, "01").unwrap();
        let mut r = Record::attaching(
            volume,
            identifier,
            Export {
                uri: "nbd://h:10809/x".into(),
                connections: 1,
                tls_profile: None,
                stage_tls: None,
                grant: None,
            },
            "/s".into(),
            Access::Block,
            AccessMode::SingleNodeWriter,
        );
        r.export = None;
        r.device = Some(DeviceIndex(1));
        r.in_phase(Phase::Staged)
    }

    #[test]
    fn write_replace_remove() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        let mut r = record("pool/vol 1");
        j.write(&r).unwrap();
        r = r.in_phase(Phase::Unstaging);
        j.write(&r).unwrap();
        let loaded = j.load().unwrap();
        assert_eq!(loaded.records, vec![r.clone()]);
        j.remove("pool/vol 1").unwrap();
        j.remove("pool/vol 1").unwrap();
        assert!(j.load().unwrap().records.is_empty());
        let mode = fs::metadata(dir.path().join("volumes"))
            .unwrap()
            .permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o700
        );
    }

    #[test]
    fn torn_and_foreign_records_are_quarantined_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        j.write(&record("good")).unwrap();
        // A torn write: the first half of a valid record.
        let full = serde_json::to_vec(&record("torn")).unwrap();
        fs::write(j.path_for("torn"), &full[..full.len() / 2]).unwrap();
        // A valid record in the wrong file.
        fs::write(
            j.path_for("elsewhere"),
            serde_json::to_vec(&record("other")).unwrap(),
        )
        .unwrap();
        // A crash between writing the temporary file and renaming it.
        fs::write(j.dir.join(".tmp.good.json"), b"{partial").unwrap();

        let loaded = j.load().unwrap();
        assert_eq!(loaded.records.len(), 1);
        assert_eq!(loaded.records[0].volume_id.as_str(), "good");
        assert_eq!(loaded.quarantined.len(), 2);
        for (moved, _) in &loaded.quarantined {
            assert!(moved.starts_with(dir.path().join("quarantine")) && moved.exists());
        }
        assert!(!j.dir.join(".tmp.good.json").exists());
        assert_eq!(
            j.load().unwrap().records.len(),
            1,
            "a second load finds the same"
        );
    }

    #[test]
    fn newer_schema_stops_the_load() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        let mut r = record("v");
        r.schema = SCHEMA + 1;
        j.write(&r).unwrap();
        let err = j.load().unwrap_err();
        assert!(
            matches!(err, JournalError::NewerSchema { found, .. } if found == SCHEMA + 1),
            "{err}"
        );
        assert!(err.to_string().contains("newer"), "{err}");
    }

    #[test]
    fn volume_ids_with_a_leading_dot_are_not_taken_for_temporary_files() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        for id in [".tmp.good", ".hidden", "."] {
            j.write(&record(id)).unwrap();
        }
        let mut ids: Vec<_> = j
            .load()
            .unwrap()
            .records
            .into_iter()
            .map(|r| r.volume_id.to_string())
            .collect();
        ids.sort();
        assert_eq!(ids, [".", ".hidden", ".tmp.good"]);
        assert_eq!(j.load().unwrap().records.len(), 3, "nothing discarded");
    }

    #[test]
    fn long_volume_ids_get_short_file_names() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        let long = "ж".repeat(64);
        j.write(&record(&long)).unwrap();
        assert_eq!(j.load().unwrap().records[0].volume_id.as_str(), long);
    }
}
