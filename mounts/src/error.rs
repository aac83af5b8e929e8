use std::io;
use std::path::PathBuf;

/// Failures of mount-table reads, mount system calls and filesystem tools.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("malformed mountinfo line {line}: {reason}")]
    MountInfo { line: usize, reason: String },
    #[error("{op} {target}: {source}")]
    Syscall {
        op: &'static str,
        target: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("running {tool}: {source}")]
    Spawn {
        tool: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{tool} failed on {target} ({status}): {stderr}")]
    Tool {
        tool: &'static str,
        target: PathBuf,
        status: String,
        stderr: String,
    },
    #[error("{device} is not blank (it holds {found}): refusing to format it")]
    NotBlank { device: PathBuf, found: String },
    #[error("unsupported filesystem type {0:?} (supported: ext4, xfs)")]
    UnsupportedFilesystem(String),
    #[error("mount option {0:?} is not allowed here")]
    ForbiddenOption(String),
}
