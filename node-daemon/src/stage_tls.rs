//! The data path's TLS material as kubelet delivers it: NodeStageVolume's secrets (the
//! connection's TLS Secret, which the StorageClass names as its node-stage secret). A volume
//! staged with it keeps it under `<state-dir>/stage-tls/<digest of the volume id>/`
//! (root-only), so every later dial of the volume — healing, expansion, recovery after a
//! restart — uses it without files placed on the node by hand. Newer material from a later
//! NodeStage or NodeExpand replaces it; unstaging removes it.
//!
//! A node's own `[tls-profile.<name>]` (or top-level `tls-*` files) wins where it has one: an
//! operator who placed files on a node chose them.

use std::collections::{HashMap, HashSet};
use std::fs::{self, DirBuilder, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The CA bundle that signs the servers' certificates.
pub const KEY_CA: &str = "ca.crt";
/// A client certificate and its key: the connection Secret's names, then those of a
/// `kubernetes.io/tls` Secret (as cert-manager writes them).
const CLIENT_KEYS: [(&str, &str); 2] = [("client.crt", "client.key"), ("tls.crt", "tls.key")];

/// File names inside a volume's directory.
const CA_FILE: &str = "ca.crt";
const CERT_FILE: &str = "client.crt";
const KEY_FILE: &str = "client.key";

#[derive(Debug, thiserror::Error)]
pub enum StageTlsError {
    /// Half a client identity: the server would refuse the handshake, and which half is
    /// missing is what the operator must fix in the Secret.
    #[error(
        "the node-stage secret has {present} but not {missing}: a client certificate comes with its key"
    )]
    HalfIdentity {
        present: &'static str,
        missing: &'static str,
    },
    #[error(
        "the node-stage secret has a client certificate but no {KEY_CA} (the CA that signs the servers)"
    )]
    NoCa,
    #[error("{action} {}: {source}", path.display())]
    Store {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// TLS material from a node-stage secret. Debug shows what is there, never its bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct StageTls {
    ca: String,
    client: Option<(String, String)>,
}

impl std::fmt::Debug for StageTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageTls")
            .field("ca", &format_args!("<{} bytes>", self.ca.len()))
            .field("client_identity", &self.client.is_some())
            .finish()
    }
}

impl StageTls {
    /// What `secrets` hold for the data path; `None` when they hold none of it (a plaintext
    /// export's class, or a Secret for something else). Other keys (the etcd client's) are
    /// not ours and are ignored.
    pub fn from_secrets(secrets: &HashMap<String, String>) -> Result<Option<Self>, StageTlsError> {
        let given = |k: &str| secrets.get(k).filter(|v| !v.trim().is_empty());
        let mut client = None;
        for (cert, key) in CLIENT_KEYS {
            match (given(cert), given(key)) {
                (Some(c), Some(k)) => {
                    client = Some((c.clone(), k.clone()));
                    break;
                }
                (Some(_), None) => {
                    return Err(StageTlsError::HalfIdentity {
                        present: cert,
                        missing: key,
                    })
                }
                (None, Some(_)) => {
                    return Err(StageTlsError::HalfIdentity {
                        present: key,
                        missing: cert,
                    })
                }
                (None, None) => {}
            }
        }
        match (given(KEY_CA), client) {
            (Some(ca), client) => Ok(Some(Self {
                ca: ca.clone(),
                client,
            })),
            (None, Some(_)) => Err(StageTlsError::NoCa),
            (None, None) => Ok(None),
        }
    }
}

/// The per-volume directories under `<state-dir>/stage-tls`.
#[derive(Debug, Clone)]
pub struct StageTlsStore {
    root: PathBuf,
}

impl StageTlsStore {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            root: state_dir.join("stage-tls"),
        }
    }

    /// Where `volume_id`'s material lives (a digest: volume ids may be long or odd).
    pub fn dir_for(&self, volume_id: &str) -> PathBuf {
        self.root.join(crate::ids::digest(volume_id))
    }

    /// Whether `volume_id`'s directory already holds exactly `tls` (kubelet passes the same
    /// Secret at every NodeStage: rewriting it would only open the window described at
    /// [`StageTlsStore::write`] for nothing).
    pub fn holds(&self, volume_id: &str, tls: &StageTls) -> bool {
        let dir = self.dir_for(volume_id);
        let read = |name: &str| fs::read_to_string(dir.join(name)).ok();
        let client = match (read(CERT_FILE), read(KEY_FILE)) {
            (Some(cert), Some(key)) => Some((cert, key)),
            _ => None,
        };
        read(CA_FILE).as_ref() == Some(&tls.ca) && client == tls.client
    }

    /// Durably writes `tls` for `volume_id` and returns its directory. Each file is replaced
    /// by a rename, so a dial never reads a half-written file; one that reads the CA of one
    /// generation and the certificate of the next fails its handshake and is retried like any
    /// failed dial.
    pub fn write(&self, volume_id: &str, tls: &StageTls) -> Result<PathBuf, StageTlsError> {
        let dir = self.dir_for(volume_id);
        for d in [&self.root, &dir] {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(d)
                .map_err(|e| store("creating", d, e))?;
        }
        write_file(&dir, CA_FILE, &tls.ca)?;
        match &tls.client {
            Some((cert, key)) => {
                // The key first: a certificate is never there without the key it needs.
                write_file(&dir, KEY_FILE, key)?;
                write_file(&dir, CERT_FILE, cert)?;
            }
            None => {
                for name in [CERT_FILE, KEY_FILE] {
                    remove_file(&dir.join(name))?;
                }
            }
        }
        sync_dir(&dir)?;
        Ok(dir)
    }

    /// Forgets `volume_id`'s material (nothing to do if there is none).
    pub fn remove(&self, volume_id: &str) -> Result<(), StageTlsError> {
        let dir = self.dir_for(volume_id);
        match fs::remove_dir_all(&dir) {
            Ok(()) => sync_dir(&self.root),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(store("removing", &dir, e)),
        }
    }

    /// Removes the material of every volume not in `live` (an unstage a crash cut short
    /// between forgetting the record and removing its files). Returns how many went.
    pub fn sweep<'a>(
        &self,
        live: impl IntoIterator<Item = &'a str>,
    ) -> Result<usize, StageTlsError> {
        let keep: HashSet<String> = live.into_iter().map(crate::ids::digest).collect();
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(store("listing", &self.root, e)),
        };
        let mut removed = 0;
        for entry in entries {
            let entry = entry.map_err(|e| store("listing", &self.root, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if keep.contains(&name) {
                continue;
            }
            let path = entry.path();
            fs::remove_dir_all(&path).map_err(|e| store("removing", &path, e))?;
            removed += 1;
        }
        if removed > 0 {
            sync_dir(&self.root)?;
        }
        Ok(removed)
    }
}

/// The files a dial reads from a volume's directory, as they are now.
pub fn files_in(dir: &Path) -> nbd::tls::TlsFiles {
    let client = dir.join(CERT_FILE).exists();
    nbd::tls::TlsFiles {
        ca: dir.join(CA_FILE),
        client_cert: client.then(|| dir.join(CERT_FILE)),
        client_key: client.then(|| dir.join(KEY_FILE)),
        server_name: None,
    }
}

fn store(action: &'static str, path: &Path, source: std::io::Error) -> StageTlsError {
    StageTlsError::Store {
        action,
        path: path.to_owned(),
        source,
    }
}

fn write_file(dir: &Path, name: &str, content: &str) -> Result<(), StageTlsError> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".tmp.{name}"));
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| store("creating", &tmp, e))?;
    f.write_all(content.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(|e| store("writing", &tmp, e))?;
    drop(f);
    fs::rename(&tmp, &path).map_err(|e| store("renaming into", &path, e))
}

fn remove_file(path: &Path) -> Result<(), StageTlsError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(store("removing", path, e)),
    }
}

fn sync_dir(dir: &Path) -> Result<(), StageTlsError> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| store("syncing", dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn secrets(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_secret_keys_are_read_and_half_an_identity_is_refused() {
        let full = StageTls::from_secrets(&secrets(&[
            ("ca.crt", "CA"),
            ("client.crt", "CERT"),
            ("client.key", "KEY"),
            ("etcd-client.key", "not ours"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(full.client, Some(("CERT".into(), "KEY".into())));
        let tls_secret = StageTls::from_secrets(&secrets(&[
            ("ca.crt", "CA"),
            ("tls.crt", "C"),
            ("tls.key", "K"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(tls_secret.client, Some(("C".into(), "K".into())));
        let ca_only = StageTls::from_secrets(&secrets(&[("ca.crt", "CA")]))
            .unwrap()
            .unwrap();
        assert_eq!(ca_only.client, None);
        assert_eq!(
            StageTls::from_secrets(&secrets(&[("username", "u")])).unwrap(),
            None
        );

        let half =
            StageTls::from_secrets(&secrets(&[("ca.crt", "CA"), ("client.crt", "C")])).unwrap_err();
        assert!(
            half.to_string().contains("client.crt but not client.key"),
            "{half}"
        );
        let no_ca =
            StageTls::from_secrets(&secrets(&[("tls.crt", "C"), ("tls.key", "K")])).unwrap_err();
        assert!(matches!(no_ca, StageTlsError::NoCa), "{no_ca}");
    }

    #[test]
    fn debug_never_shows_the_material() {
        let tls = StageTls::from_secrets(&secrets(&[
            ("ca.crt", "CA-PEM"),
            ("client.crt", "CERT-PEM"),
            ("client.key", "KEY-PEM"),
        ]))
        .unwrap()
        .unwrap();
        let shown = format!("{tls:?}");
        assert!(!shown.contains("PEM"), "{shown}");
        assert!(shown.contains("client_identity: true"), "{shown}");
    }

    #[test]
    fn material_is_root_only_replaced_whole_and_swept_with_its_volume() {
        let state = tempfile::tempdir().unwrap();
        let store = StageTlsStore::new(state.path());
        let first = StageTls::from_secrets(&secrets(&[
            ("ca.crt", "CA1"),
            ("client.crt", "C1"),
            ("client.key", "K1"),
        ]))
        .unwrap()
        .unwrap();
        assert!(!store.holds("vol-a", &first));
        let dir = store.write("vol-a", &first).unwrap();
        assert!(store.holds("vol-a", &first));
        let files = files_in(&dir);
        assert_eq!(fs::read_to_string(&files.ca).unwrap(), "CA1");
        let key = files.client_key.clone().unwrap();
        assert_eq!(fs::read_to_string(&key).unwrap(), "K1");
        for (path, mode) in [(&dir, 0o700), (&files.ca, 0o600), (&key, 0o600)] {
            let got = fs::metadata(path).unwrap().permissions().mode() & 0o777;
            assert_eq!(got, mode, "{}", path.display());
        }

        // Newer material without a client identity: the old identity does not linger.
        let second = StageTls::from_secrets(&secrets(&[("ca.crt", "CA2")]))
            .unwrap()
            .unwrap();
        assert!(!store.holds("vol-a", &second));
        assert_eq!(store.write("vol-a", &second).unwrap(), dir);
        assert!(store.holds("vol-a", &second) && !store.holds("vol-a", &first));
        let files = files_in(&dir);
        assert_eq!(fs::read_to_string(&files.ca).unwrap(), "CA2");
        assert_eq!(files.client_cert, None);
        assert!(!key.exists());

        store.write("vol-b", &first).unwrap();
        assert_eq!(store.sweep(["vol-b"]).unwrap(), 1);
        assert!(!dir.exists() && store.dir_for("vol-b").exists());
        store.remove("vol-b").unwrap();
        store.remove("vol-b").unwrap();
        assert!(!store.dir_for("vol-b").exists());
    }
}
