//! The embedded default backend: sparse raw image files in a directory, exported by nbdkit's
//! file plugin (`dir=` mode: one export per file, named by the file).
//!
//! ```text
//! <dir>/images/<image>        volume data, exported as nbd://host:port/<image>
//! <dir>/snapshots/<image>     snapshot data (not exported)
//! <dir>/meta/<kind>-<image>.json   what was asked for, publications
//! ```
//!
//! Snapshots and clones are reflink copies where the filesystem supports them (FICLONE), and
//! sparse copies otherwise: either way an independent file, so deleting a volume never
//! invalidates its snapshots and restoring never changes the snapshot.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{Backend, SnapshotMeta, Source, VolumeMeta};
use crate::error::ControllerError;

/// Image sizes are whole MiB.
const GRANULARITY: u64 = 1 << 20;

#[derive(Debug, Clone)]
pub struct LocalBackend {
    root: PathBuf,
    /// `host:port` nodes reach the export server at.
    export_address: String,
}

impl LocalBackend {
    pub fn open(root: &Path, export_address: &str) -> Result<Self, ControllerError> {
        for d in ["images", "snapshots", "meta"] {
            fs::create_dir_all(root.join(d))?;
        }
        Ok(Self {
            root: root.to_owned(),
            export_address: export_address.to_owned(),
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

    fn meta_path(&self, kind: &str, image: &str) -> PathBuf {
        self.root.join("meta").join(format!("{kind}-{image}.json"))
    }

    fn read_meta<T: DeserializeOwned>(
        &self,
        kind: &str,
        image: &str,
    ) -> Result<Option<T>, ControllerError> {
        match fs::read(self.meta_path(kind, image)) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| ControllerError::Backend(format!("metadata of {kind} {image}: {e}"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Metadata is replaced atomically: temp file, fsync, rename, fsync the directory.
    fn write_meta<T: Serialize>(
        &self,
        kind: &str,
        image: &str,
        meta: &T,
    ) -> Result<(), ControllerError> {
        let path = self.meta_path(kind, image);
        let tmp = path.with_extension("json.tmp");
        let json =
            serde_json::to_vec_pretty(meta).map_err(|e| ControllerError::Backend(e.to_string()))?;
        let mut f = File::create(&tmp)?;
        f.write_all(&json)?;
        f.sync_all()?;
        fs::rename(&tmp, &path)?;
        File::open(self.root.join("meta"))?.sync_all()?;
        Ok(())
    }

    fn remove(path: &Path) -> Result<(), ControllerError> {
        match fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ControllerError> + Send + 'static,
) -> Result<T, ControllerError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ControllerError::Backend(format!("worker: {e}")))?
}

/// Copies `from` to `to` (which must not exist) as an independent file of `size` bytes: a
/// reflink when the filesystem can, else a sparse copy that skips zero blocks.
pub fn copy_image(from: &Path, to: &Path, size: u64) -> Result<(), ControllerError> {
    let src = File::open(from)?;
    let tmp = to.with_extension("partial");
    let dst = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)?;
    if !reflink(&src, &dst) {
        sparse_copy(&src, &dst)?;
    }
    dst.set_len(size.max(src.metadata()?.len()))?;
    dst.sync_all()?;
    fs::rename(&tmp, to)?;
    Ok(())
}

fn reflink(src: &File, dst: &File) -> bool {
    // FICLONE = _IOW(0x94, 9, int)
    const FICLONE: libc::c_ulong = 0x4004_9409;
    // SAFETY: FICLONE takes the source descriptor as its argument; both descriptors are open
    // files owned by the caller for the duration of the call.
    let rc = unsafe { libc::ioctl(dst.as_raw_fd(), FICLONE as _, src.as_raw_fd()) };
    rc == 0
}

fn sparse_copy(src: &File, dst: &File) -> Result<(), ControllerError> {
    let mut reader = src;
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        if buf[..n].iter().any(|b| *b != 0) {
            dst.write_all_at(&buf[..n], offset)?;
        }
        offset += n as u64;
    }
    dst.set_len(offset)?;
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

    async fn export_uri(&self, image: &str) -> Result<String, ControllerError> {
        Ok(format!("nbd://{}/{image}", self.export_address))
    }

    async fn volume(&self, image: &str) -> Result<Option<VolumeMeta>, ControllerError> {
        self.read_meta("volume", image)
    }

    async fn create_volume(&self, image: &str, meta: &VolumeMeta) -> Result<(), ControllerError> {
        let this = self.clone();
        let (image, meta) = (image.to_owned(), meta.clone());
        blocking(move || {
            let path = this.image_path(&image);
            match &meta.source {
                None => {
                    let f = OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(false)
                        .open(&path)?;
                    f.set_len(meta.size)?;
                    f.sync_all()?;
                }
                Some(Source::Snapshot(s)) => copy_image(&this.snapshot_path(s), &path, meta.size)?,
                Some(Source::Volume(v)) => copy_image(&this.image_path(v), &path, meta.size)?,
            }
            // The metadata is written last: a crash before it leaves an image that the
            // repeated CreateVolume finds without metadata and simply recreates.
            this.write_meta("volume", &image, &meta)
        })
        .await
    }

    async fn update_volume(&self, image: &str, meta: &VolumeMeta) -> Result<(), ControllerError> {
        self.write_meta("volume", image, meta)
    }

    async fn delete_volume(&self, image: &str) -> Result<(), ControllerError> {
        Self::remove(&self.meta_path("volume", image))?;
        Self::remove(&self.image_path(image))
    }

    async fn grow_volume(&self, image: &str, size: u64) -> Result<(), ControllerError> {
        let f = OpenOptions::new()
            .write(true)
            .open(self.image_path(image))?;
        if f.metadata()?.len() < size {
            f.set_len(size)?;
            f.sync_all()?;
        }
        let mut meta: VolumeMeta = self.read_meta("volume", image)?.ok_or_else(|| {
            ControllerError::NotFound(format!("volume image {image} has no metadata"))
        })?;
        meta.size = meta.size.max(size);
        self.write_meta("volume", image, &meta)
    }

    async fn snapshot(&self, image: &str) -> Result<Option<SnapshotMeta>, ControllerError> {
        self.read_meta("snapshot", image)
    }

    async fn create_snapshot(
        &self,
        image: &str,
        meta: &SnapshotMeta,
    ) -> Result<(), ControllerError> {
        let this = self.clone();
        let (image, meta) = (image.to_owned(), meta.clone());
        blocking(move || {
            copy_image(
                &this.image_path(&meta.source_image),
                &this.snapshot_path(&image),
                meta.size,
            )?;
            this.write_meta("snapshot", &image, &meta)
        })
        .await
    }

    async fn delete_snapshot(&self, image: &str) -> Result<(), ControllerError> {
        Self::remove(&self.meta_path("snapshot", image))?;
        Self::remove(&self.snapshot_path(image))
    }

    async fn snapshots(
        &self,
        _near: Option<&str>,
    ) -> Result<Vec<(String, SnapshotMeta)>, ControllerError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(self.root.join("meta"))? {
            let name = entry?.file_name();
            let Some(image) = name
                .to_str()
                .and_then(|n| n.strip_prefix("snapshot-")?.strip_suffix(".json"))
            else {
                continue;
            };
            if let Some(meta) = self.read_meta::<SnapshotMeta>("snapshot", image)? {
                out.push((image.to_owned(), meta));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    async fn capacity(
        &self,
        _parameters: &std::collections::BTreeMap<String, String>,
    ) -> Result<Option<u64>, ControllerError> {
        let s = nix::sys::statvfs::statvfs(&self.root)
            .map_err(|e| ControllerError::Backend(e.to_string()))?;
        Ok(Some(s.blocks_available() * s.fragment_size()))
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
