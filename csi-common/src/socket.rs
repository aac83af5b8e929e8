//! The unix socket a CSI service listens on, bound the same way by node and controller.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;

use tokio::net::UnixListener;

/// Binds a unix socket at `path`, mode 0600 (kubelet and the sidecars run as root; nobody else
/// has business there). A stale socket left by a crash is removed; a live one (another process
/// answering there) or a file that is not a socket is an error, never deleted.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    let with_path = |what: &str, e: io::Error| {
        io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| with_path("creating the directory of", e))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is in use by another process", path.display()),
                ));
            }
            std::fs::remove_file(path).map_err(|e| with_path("removing stale", e))?;
        }
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket: refusing to remove it",
                    path.display()
                ),
            ))
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(|e| with_path("binding", e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| with_path("chmod", e))?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stale_sockets_go_live_ones_and_files_stay() {
        let dir = std::env::temp_dir().join(format!("csi-socket-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("csi.sock");
        let live = bind(&path).expect("binds in a new directory");
        assert_eq!(
            std::fs::metadata(&path)
                .map(|m| m.permissions().mode() & 0o777)
                .ok(),
            Some(0o600)
        );
        assert_eq!(
            bind(&path).map(drop).map_err(|e| e.kind()),
            Err(io::ErrorKind::AddrInUse),
            "a live socket is left alone"
        );
        drop(live);
        bind(&path).expect("a stale socket is replaced");
        let file = dir.join("not-a-socket");
        std::fs::write(&file, b"data").unwrap_or_default();
        assert_eq!(
            bind(&file).map(drop).map_err(|e| e.kind()),
            Err(io::ErrorKind::AlreadyExists)
        );
        assert_eq!(std::fs::read(&file).ok().as_deref(), Some(&b"data"[..]));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
