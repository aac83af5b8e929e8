//! The one error type of this crate. Each variant names the step that failed and carries what
//! an operator needs to act: the URI, the device, the errno.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use crate::handshake::{ExportInfo, HandshakeError};
use crate::identity::{BackendId, DeviceIndex};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connecting to {uri}: {source}")]
    Connect {
        uri: String,
        #[source]
        source: io::Error,
    },
    #[error("NBD handshake with {uri}: {source}")]
    Handshake {
        uri: String,
        #[source]
        source: HandshakeError,
    },
    #[error("TLS with {uri}: {source}")]
    Tls {
        uri: String,
        #[source]
        source: crate::tls::TlsError,
    },
    #[error("no NBD handshake with {uri} within {deadline:?}")]
    DialTimeout { uri: String, deadline: Duration },
    #[error("export changed between connections: first {first:?}, later {later:?}")]
    ExportChanged {
        first: Box<ExportInfo>,
        later: Box<ExportInfo>,
    },
    #[error("{0} connections requested; between 1 and 16 are allowed")]
    InvalidConnections(u8),
    #[error(
        "export block size constraints {0} cannot be met by the kernel (512..=4096, power of two)"
    )]
    UnsupportedBlockSize(String),

    #[error("the kernel has no \"nbd\" generic netlink family: load the module (modprobe nbd)")]
    ModuleNotLoaded,
    #[error("netlink socket: {0}")]
    NetlinkSocket(String),
    #[error("NBD {op} on {device}: {}{}", errno_text(*.errno), detail(.message))]
    Kernel {
        op: &'static str,
        device: String,
        /// Positive errno from the kernel's reply.
        errno: i32,
        message: String,
    },
    #[error("malformed netlink reply to {op}: {detail}")]
    BadReply { op: &'static str, detail: String },

    #[error("{device} carries backend identifier {found:?}, not {expected}: refusing to touch it")]
    NotOurs {
        device: DeviceIndex,
        expected: BackendId,
        found: Option<String>,
    },
    #[error("{device} did not become ready within {waited:?}: {reason}")]
    NotReady {
        device: DeviceIndex,
        waited: Duration,
        reason: String,
    },
    #[error("sysfs {path}: {source}")]
    Sysfs {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("internal error: {0}")]
    Internal(String),
}

fn errno_text(errno: i32) -> String {
    format!("{} (errno {errno})", io::Error::from_raw_os_error(errno))
}

fn detail(message: &str) -> String {
    if message.is_empty() {
        String::new()
    } else {
        format!(": {message}")
    }
}

impl Error {
    /// The kernel's errno, when the kernel refused a request.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Kernel { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}
