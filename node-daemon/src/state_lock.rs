//! The exclusive lock on the state directory: the daemon holds it for as long as it runs,
//! and `repair --apply` takes it or refuses, so the two never act on the journal and the
//! devices at once (a crash-looping daemon restarting in the middle of a repair waits for
//! the repair instead of racing it). `flock` is released by the kernel when its holder dies,
//! so a killed daemon never leaves it behind.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};

/// The file the lock is taken on, in the state directory.
pub const LOCK_FILE: &str = "lock";

/// Taking the state directory's lock failed.
#[derive(Debug, thiserror::Error)]
pub enum StateLockError {
    #[error("opening the state lock {}: {source}", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the state directory is in use ({} is locked{}): the node daemon is running, or a repair is; \
         stop it first (systemctl stop ustor-csi-node)",
        path.display(),
        holder.map(|p| format!(" by pid {p}")).unwrap_or_default()
    )]
    Held { path: PathBuf, holder: Option<u32> },
    #[error("locking {}: {source}", path.display())]
    Lock {
        path: PathBuf,
        source: nix::errno::Errno,
    },
}

/// The held lock; released when dropped (or when the process ends, however it ends).
#[derive(Debug)]
pub struct StateLock {
    _lock: Flock<File>,
}

impl StateLock {
    /// Takes the lock, or says who holds it.
    pub fn try_take(state_dir: &Path) -> Result<Self, StateLockError> {
        let path = state_dir.join(LOCK_FILE);
        match Self::attempt(&path)? {
            Some(lock) => Ok(lock),
            None => Err(StateLockError::Held {
                holder: holder(&path),
                path,
            }),
        }
    }

    /// Takes the lock, waiting for as long as another process holds it (the daemon, started
    /// while a repair runs). Blocks: call it before the runtime serves anything.
    pub fn take_waiting(state_dir: &Path) -> Result<Self, StateLockError> {
        let path = state_dir.join(LOCK_FILE);
        let mut told = false;
        loop {
            if let Some(lock) = Self::attempt(&path)? {
                return Ok(lock);
            }
            if !told {
                told = true;
                tracing::warn!(lock = %path.display(), holder = ?holder(&path), "the state directory is locked by another process (a repair?); waiting for it");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn attempt(path: &Path) -> Result<Option<Self>, StateLockError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| StateLockError::Open {
                path: path.to_owned(),
                source,
            })?;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|source| StateLockError::Open {
                path: path.to_owned(),
                source,
            })?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => {
                write_pid(&lock);
                Ok(Some(Self { _lock: lock }))
            }
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, source)) => Err(StateLockError::Lock {
                path: path.to_owned(),
                source,
            }),
        }
    }
}

/// The holder's pid in the file, for the messages (the lock itself is the truth).
fn write_pid(file: &File) {
    use std::io::{Seek, Write};
    let mut f = file;
    let _ = f.set_len(0);
    let _ = f.rewind();
    let _ = writeln!(f, "{}", std::process::id());
}

fn holder(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let held = StateLock::try_take(dir.path()).unwrap();
        let refused = StateLock::try_take(dir.path()).unwrap_err();
        assert!(
            matches!(&refused, StateLockError::Held { holder: Some(pid), .. } if *pid == std::process::id()),
            "{refused}"
        );
        assert!(refused
            .to_string()
            .contains("the node daemon is running, or a repair is"));
        drop(held);
        StateLock::try_take(dir.path()).unwrap();
    }
}
