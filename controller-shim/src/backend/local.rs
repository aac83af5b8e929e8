//! The embedded default backend: sparse raw image files in a directory, exported by nbdkit's
//! file plugin (`dir=` mode: one export per file, named by the file).
//!
//! ```text
//! <dir>/images/<image>        volume data, dialed as nbd://host:port/<image>@<grant token>
//! <dir>/snapshots/<image>     snapshot data (not exported)
//! <dir>/meta/<kind>-<image>.json   what was asked for, publications, grants; group records
//! <dir>/run/nbdkit{,-ro}.sock  nbdkit's sockets (writable, read-only), only for the gate
//! <dir>/run/nbdkit-pause.sock  the writable nbdkit's pause control
//! ```
//!
//! Grants are kept with the volume's metadata; the export server's gate reads them there for
//! every handshake, and a revoke cuts the grant's connections through the shared
//! [`Sessions`].
//!
//! Snapshots and clones are reflink copies where the filesystem supports them (FICLONE), and
//! sparse copies otherwise: either way an independent file, so deleting a volume never
//! invalidates its snapshots and restoring never changes the snapshot. A snapshot, or every
//! member of a group snapshot, is copied while the export server holds all writes
//! ([`WriteHold`]): a copy is of one point in time, not torn by writes landing during it.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::grants::NoRandom;
use super::{
    Backend, BackendError, Grant, GrantToken, GroupSnapshotMeta, ListedVolume, SnapshotMeta,
    Source, VolumeMeta,
};
use crate::exports::gate::GrantLookup;
use crate::exports::pause::{HoldError, WriteHold};
use crate::exports::sessions::Sessions;

/// A step of the local backend that failed, with the file it was about.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// The filesystem holding the images is full (ENOSPC).
    #[error("backend storage is full: {op} {}: {source}", path.display())]
    NoSpace {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("backend: {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("backend: metadata of {kind} {image}: {source}")]
    BadMetadata {
        kind: &'static str,
        image: String,
        source: serde_json::Error,
    },
    #[error("backend: encoding the metadata of {kind} {image}: {source}")]
    EncodeMetadata {
        kind: &'static str,
        image: String,
        source: serde_json::Error,
    },
    #[error("volume image {image} has no metadata")]
    NoMetadata { image: String },
    #[error("backend: worker: {0}")]
    Worker(#[source] tokio::task::JoinError),
    #[error("backend: free space of {}: {source}", path.display())]
    FreeSpace {
        path: PathBuf,
        source: nix::errno::Errno,
    },
    #[error(transparent)]
    Hold(#[from] HoldError),
    #[error("backend: grant of {image} to {node}: {source}")]
    Token {
        image: String,
        node: String,
        source: NoRandom,
    },
}

/// For `map_err`: the failed `op` on `path`, told apart when the disk is full.
fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> LocalError {
    let path = path.to_owned();
    move |source| {
        if source.raw_os_error() == Some(libc::ENOSPC) {
            LocalError::NoSpace { op, path, source }
        } else {
            LocalError::Io { op, path, source }
        }
    }
}

/// Image sizes are whole MiB.
const GRANULARITY: u64 = 1 << 20;

#[derive(Debug, Clone)]
pub struct LocalBackend {
    root: PathBuf,
    /// `host:port` nodes reach the export server at.
    export_address: String,
    /// The export server's open connections, by grant.
    sessions: Arc<Sessions>,
    /// The export server's writes, held while snapshots are copied.
    writes: Arc<WriteHold>,
}

impl LocalBackend {
    pub fn open(root: &Path, export_address: &str) -> Result<Self, LocalError> {
        for d in ["images", "snapshots", "meta", "run"] {
            let dir = root.join(d);
            fs::create_dir_all(&dir).map_err(io("create directory", &dir))?;
        }
        // Only the controller may reach nbdkit's socket: anyone else would pass the gate.
        let run = root.join("run");
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&run, fs::Permissions::from_mode(0o700))
            .map_err(io("restrict", &run))?;
        Ok(Self {
            root: root.to_owned(),
            export_address: export_address.to_owned(),
            sessions: Arc::default(),
            writes: Arc::new(WriteHold::new(run.join("nbdkit-pause.sock"))),
        })
    }

    /// The socket of the nbdkit serving writable or read-only grants, behind the gate.
    pub fn export_socket(&self, read_only: bool) -> PathBuf {
        let name = if read_only {
            "nbdkit-ro.sock"
        } else {
            "nbdkit.sock"
        };
        self.root.join("run").join(name)
    }

    /// The export server's open connections, by grant.
    pub fn sessions(&self) -> Arc<Sessions> {
        Arc::clone(&self.sessions)
    }

    /// Where nodes dial `image` (through the gate).
    fn uri_of(&self, image: &str) -> String {
        format!("nbd://{}/{image}", self.export_address)
    }

    /// The writable export server's pause control.
    pub fn write_hold(&self) -> Arc<WriteHold> {
        Arc::clone(&self.writes)
    }

    /// Copies each `(snapshot, meta)` from its source volume and records it, every copy made
    /// while no write reaches any image. All or none: copies made before a failure are
    /// removed again.
    async fn copy_at_one_point(
        &self,
        members: Vec<(String, SnapshotMeta)>,
    ) -> Result<(), LocalError> {
        let held = self.writes.hold().await?;
        let this = self.clone();
        let copied = blocking(move || {
            let mut done: Vec<&str> = Vec::new();
            for (image, meta) in &members {
                let copy = copy_image(
                    &this.image_path(&meta.source_image),
                    &this.snapshot_path(image),
                    meta.size,
                );
                if let Err(e) = copy {
                    for image in done {
                        let _ = Self::remove(&this.snapshot_path(image));
                    }
                    return Err(e);
                }
                done.push(image);
            }
            Ok(members)
        })
        .await;
        held.release().await;
        // The records are written once writes flow again: the data is what had to be held.
        let this = self.clone();
        blocking(move || {
            for (image, meta) in &copied? {
                this.write_meta("snapshot", image, meta)?;
            }
            Ok(())
        })
        .await
    }

    /// The grants stored with `image`'s metadata (none without it).
    fn stored_grants(&self, image: &str) -> Result<BTreeMap<String, Grant>, LocalError> {
        Ok(self
            .read_meta::<VolumeMeta>("volume", image)?
            .map(|m| m.grants)
            .unwrap_or_default())
    }

    fn existing_meta(&self, image: &str) -> Result<VolumeMeta, LocalError> {
        self.read_meta("volume", image)?
            .ok_or_else(|| LocalError::NoMetadata {
                image: image.to_owned(),
            })
    }

    /// The directory nbdkit serves.
    pub fn images_dir(&self) -> PathBuf {
        self.root.join("images")
    }

    fn image_path(&self, image: &str) -> PathBuf {
        self.root.join("images").join(image)
    }

    fn snapshot_path(&self, image: &str) -> PathBuf {
        self.root.join("snapshots").join(image)
    }

    fn meta_path(&self, kind: &'static str, image: &str) -> PathBuf {
        self.root.join("meta").join(format!("{kind}-{image}.json"))
    }

    fn read_meta<T: DeserializeOwned>(
        &self,
        kind: &'static str,
        image: &str,
    ) -> Result<Option<T>, LocalError> {
        let path = self.meta_path(kind, image);
        match fs::read(&path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|source| LocalError::BadMetadata {
                        kind,
                        image: image.to_owned(),
                        source,
                    })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("read", &path)(e)),
        }
    }

    /// Metadata is replaced atomically: temp file, fsync, rename, fsync the directory.
    fn write_meta<T: Serialize>(
        &self,
        kind: &'static str,
        image: &str,
        meta: &T,
    ) -> Result<(), LocalError> {
        let path = self.meta_path(kind, image);
        let tmp = path.with_extension("json.tmp");
        let json =
            serde_json::to_vec_pretty(meta).map_err(|source| LocalError::EncodeMetadata {
                kind,
                image: image.to_owned(),
                source,
            })?;
        let mut f = File::create(&tmp).map_err(io("create", &tmp))?;
        f.write_all(&json).map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
        fs::rename(&tmp, &path).map_err(io("rename into place", &path))?;
        let dir = self.root.join("meta");
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io("fsync", &dir))
    }

    /// Every record of `kind`, by image, sorted.
    fn all_meta<T: DeserializeOwned>(
        &self,
        kind: &'static str,
    ) -> Result<Vec<(String, T)>, LocalError> {
        let mut out = Vec::new();
        let dir = self.root.join("meta");
        let prefix = format!("{kind}-");
        for entry in fs::read_dir(&dir).map_err(io("list", &dir))? {
            let name = entry.map_err(io("list", &dir))?.file_name();
            let Some(image) = name
                .to_str()
                .and_then(|n| n.strip_prefix(&prefix)?.strip_suffix(".json"))
            else {
                continue;
            };
            // Deleted between the listing and the read: not there.
            if let Some(meta) = self.read_meta::<T>(kind, image)? {
                out.push((image.to_owned(), meta));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    fn remove(path: &Path) -> Result<(), LocalError> {
        match fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("remove", path)(e)),
        }
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, LocalError> + Send + 'static,
) -> Result<T, LocalError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(LocalError::Worker)?
}

/// Copies `from` to `to` (which must not exist) as an independent file of `size` bytes: a
/// reflink when the filesystem can, else a sparse copy that skips zero blocks.
pub fn copy_image(from: &Path, to: &Path, size: u64) -> Result<(), LocalError> {
    let src = File::open(from).map_err(io("open", from))?;
    let tmp = to.with_extension("partial");
    let dst = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(io("create", &tmp))?;
    if !reflink(&src, &dst) {
        sparse_copy(&src, &dst).map_err(io("copy into", &tmp))?;
    }
    let len = src.metadata().map_err(io("stat", from))?.len();
    dst.set_len(size.max(len)).map_err(io("resize", &tmp))?;
    dst.sync_all().map_err(io("fsync", &tmp))?;
    fs::rename(&tmp, to).map_err(io("rename into place", to))
}

fn reflink(src: &File, dst: &File) -> bool {
    // FICLONE = _IOW(0x94, 9, int)
    const FICLONE: libc::c_ulong = 0x4004_9409;
    // SAFETY: FICLONE takes the source descriptor as its argument; both descriptors are open
    // files owned by the caller for the duration of the call.
    let rc = unsafe { libc::ioctl(dst.as_raw_fd(), FICLONE as _, src.as_raw_fd()) };
    rc == 0
}

/// Copies the data extents only (SEEK_DATA/SEEK_HOLE: a hole is never read), and within them
/// skips blocks of zeros, so the copy stays sparse and a mostly empty image copies fast (the
/// export server's writes are held meanwhile).
fn sparse_copy(src: &File, dst: &File) -> std::io::Result<()> {
    use nix::unistd::{lseek, Whence};
    let len = src.metadata()?.len();
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    while offset < len {
        let at = i64::try_from(offset).map_err(std::io::Error::other)?;
        let data = match lseek(src, at, Whence::SeekData) {
            Ok(d) => u64::try_from(d).map_err(std::io::Error::other)?,
            // No data past `offset`: the rest is a hole.
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let data_at = i64::try_from(data).map_err(std::io::Error::other)?;
        let hole = u64::try_from(lseek(src, data_at, Whence::SeekHole)?)
            .map_err(std::io::Error::other)?
            .min(len);
        let mut at = data;
        while at < hole {
            let want = usize::try_from((hole - at).min(buf.len() as u64)).unwrap_or(buf.len());
            let n = src.read_at(&mut buf[..want], at)?;
            if n == 0 {
                break;
            }
            if buf[..n].iter().any(|b| *b != 0) {
                dst.write_all_at(&buf[..n], at)?;
            }
            at += n as u64;
        }
        offset = hole.max(at);
    }
    dst.set_len(len)?;
    Ok(())
}

#[tonic::async_trait]
impl Backend for LocalBackend {
    fn name(&self) -> &'static str {
        "local"
    }

    fn granularity(&self) -> u64 {
        GRANULARITY
    }

    async fn export_uri(&self, image: &str) -> Result<String, BackendError> {
        Ok(self.uri_of(image))
    }

    async fn volume(&self, image: &str) -> Result<Option<VolumeMeta>, BackendError> {
        Ok(self.read_meta("volume", image)?)
    }

    async fn create_volume(&self, image: &str, meta: &VolumeMeta) -> Result<(), BackendError> {
        let this = self.clone();
        let (image, meta) = (image.to_owned(), meta.clone());
        blocking(move || {
            let path = this.image_path(&image);
            match &meta.source {
                None => OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&path)
                    .and_then(|f| {
                        f.set_len(meta.size)?;
                        f.sync_all()
                    })
                    .map_err(io("create", &path))?,
                Some(Source::Snapshot(s)) => copy_image(&this.snapshot_path(s), &path, meta.size)?,
                Some(Source::Volume(v)) => copy_image(&this.image_path(v), &path, meta.size)?,
            }
            // The metadata is written last: a crash before it leaves an image that the
            // repeated CreateVolume finds without metadata and simply recreates.
            this.write_meta("volume", &image, &meta)
        })
        .await?;
        Ok(())
    }

    /// The grants stored stay: they are this backend's, changed by grant and revoke only.
    async fn update_volume(&self, image: &str, meta: &VolumeMeta) -> Result<(), BackendError> {
        let grants = self.existing_meta(image)?.grants;
        let meta = VolumeMeta {
            grants,
            ..meta.clone()
        };
        Ok(self.write_meta("volume", image, &meta)?)
    }

    async fn delete_volume(&self, image: &str) -> Result<(), BackendError> {
        Self::remove(&self.meta_path("volume", image))?;
        Ok(Self::remove(&self.image_path(image))?)
    }

    async fn grow_volume(&self, image: &str, size: u64) -> Result<(), BackendError> {
        let path = self.image_path(image);
        OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|f| {
                if f.metadata()?.len() < size {
                    f.set_len(size)?;
                    f.sync_all()?;
                }
                Ok(())
            })
            .map_err(io("grow", &path))?;
        let mut meta = self.existing_meta(image)?;
        meta.size = meta.size.max(size);
        Ok(self.write_meta("volume", image, &meta)?)
    }

    async fn grant(
        &self,
        image: &str,
        node: &str,
        readonly: bool,
    ) -> Result<GrantToken, BackendError> {
        let mut meta = self.existing_meta(image)?;
        if let Some(live) = meta.grants.get(node) {
            return Ok(live.token.clone());
        }
        let token = GrantToken::generate().map_err(|source| LocalError::Token {
            image: image.to_owned(),
            node: node.to_owned(),
            source,
        })?;
        meta.grants.insert(
            node.to_owned(),
            Grant {
                token: token.clone(),
                readonly,
            },
        );
        // Written before it is answered: a token given out is one the gate admits.
        self.write_meta("volume", image, &meta)?;
        tracing::info!(image, node, readonly, "grant made");
        Ok(token)
    }

    /// The grant is removed first, so the gate admits no new connection of it, then its open
    /// ones are cut.
    async fn revoke(&self, image: &str, node: &str) -> Result<(), BackendError> {
        if let Some(mut meta) = self.read_meta::<VolumeMeta>("volume", image)? {
            if meta.grants.remove(node).is_some() {
                self.write_meta("volume", image, &meta)?;
            }
        }
        let cut = self.sessions.cut(image, node).await;
        tracing::info!(image, node, connections_cut = cut, "grant revoked");
        Ok(())
    }

    async fn granted_nodes(&self, image: &str) -> Result<Vec<String>, BackendError> {
        Ok(self.stored_grants(image)?.into_keys().collect())
    }

    async fn snapshot(&self, image: &str) -> Result<Option<SnapshotMeta>, BackendError> {
        Ok(self.read_meta("snapshot", image)?)
    }

    async fn create_snapshot(&self, image: &str, meta: &SnapshotMeta) -> Result<(), BackendError> {
        Ok(self
            .copy_at_one_point(vec![(image.to_owned(), meta.clone())])
            .await?)
    }

    async fn delete_snapshot(&self, image: &str) -> Result<(), BackendError> {
        Self::remove(&self.meta_path("snapshot", image))?;
        Ok(Self::remove(&self.snapshot_path(image))?)
    }

    async fn snapshots(
        &self,
        _near: Option<&str>,
    ) -> Result<Vec<(String, SnapshotMeta)>, BackendError> {
        Ok(self.all_meta("snapshot")?)
    }

    async fn volumes(&self) -> Result<Vec<ListedVolume>, BackendError> {
        Ok(self
            .all_meta("volume")?
            .into_iter()
            .map(|(key, meta)| ListedVolume {
                export: Some(self.uri_of(&key)),
                key,
                meta,
            })
            .collect())
    }

    async fn group_snapshot(&self, key: &str) -> Result<Option<GroupSnapshotMeta>, BackendError> {
        Ok(self.read_meta("group", key)?)
    }

    /// The members first, then the record: a crash between leaves members without a group,
    /// which the repeated call (the CO retries until it has an answer) copies anew over them.
    async fn create_group_snapshot(
        &self,
        key: &str,
        meta: &GroupSnapshotMeta,
        members: &[(String, SnapshotMeta)],
    ) -> Result<(), BackendError> {
        self.copy_at_one_point(members.to_vec()).await?;
        Ok(self.write_meta("group", key, meta)?)
    }

    async fn delete_group_snapshot(&self, key: &str) -> Result<(), BackendError> {
        Ok(Self::remove(&self.meta_path("group", key))?)
    }

    async fn problem(
        &self,
        image: &str,
        meta: &VolumeMeta,
    ) -> Result<Option<String>, BackendError> {
        let path = self.image_path(image);
        match fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Some(format!(
                    "its image file {} is missing",
                    path.display()
                )))
            }
            Err(e) => return Err(io("stat", &path)(e).into()),
            Ok(m) if m.len() < meta.size => {
                return Ok(Some(format!(
                    "its image file {} holds {} bytes, less than the volume's {}",
                    path.display(),
                    m.len(),
                    meta.size
                )))
            }
            Ok(_) => {}
        }
        // The export server behind the gate opens the image: a handshake with it, as the gate
        // would make one (read-only publications are served by the second instance).
        let read_only = meta.published.values().any(|ro| *ro);
        for socket in [Some(false), read_only.then_some(true)]
            .into_iter()
            .flatten()
        {
            let socket = self.export_socket(socket);
            let uri = nbd::NbdUri::unix(&socket, image);
            let opts = nbd::dial::DialOptions {
                deadline: std::time::Duration::from_secs(5),
                ..Default::default()
            };
            if let Err(e) = nbd::dial::dial_one(&uri, &opts).await {
                return Ok(Some(format!(
                    "the export server (nbdkit at {}) does not serve it: {e}",
                    socket.display()
                )));
            }
        }
        Ok(None)
    }

    async fn capacity(
        &self,
        _parameters: &BTreeMap<String, String>,
    ) -> Result<Option<u64>, BackendError> {
        let s = nix::sys::statvfs::statvfs(&self.root).map_err(|source| LocalError::FreeSpace {
            path: self.root.clone(),
            source,
        })?;
        Ok(Some(s.blocks_available() * s.fragment_size()))
    }
}

impl GrantLookup for LocalBackend {
    fn grants(&self, image: &str) -> Result<BTreeMap<String, Grant>, LocalError> {
        self.stored_grants(image)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_independent_sparse_and_sized() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let f = File::create(&a).unwrap();
        f.set_len(8 << 20).unwrap();
        f.write_all_at(b"hello", 3 << 20).unwrap();
        let b = dir.path().join("b");
        copy_image(&a, &b, 16 << 20).unwrap();
        assert_eq!(
            fs::metadata(&b).unwrap().len(),
            16 << 20,
            "grown to the requested size"
        );
        let mut buf = [0u8; 5];
        File::open(&b)
            .unwrap()
            .read_exact_at(&mut buf, 3 << 20)
            .unwrap();
        assert_eq!(&buf, b"hello");
        f.write_all_at(b"world", 3 << 20).unwrap();
        File::open(&b)
            .unwrap()
            .read_exact_at(&mut buf, 3 << 20)
            .unwrap();
        assert_eq!(&buf, b"hello", "the copy does not follow the original");
        use std::os::unix::fs::MetadataExt;
        assert!(
            fs::metadata(&b).unwrap().blocks() * 512 < 4 << 20,
            "holes stay holes"
        );
    }
}
