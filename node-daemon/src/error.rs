//! The node daemon's error type, and its one mapping to gRPC status codes.

use nbd::handshake::HandshakeError;
use nbd::tls::TlsError;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("another operation on volume {0} is in progress; retry later")]
    Busy(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error(transparent)]
    Nbd(#[from] nbd::Error),
    #[error(transparent)]
    Mount(#[from] mounts::Error),
    #[error("attachment journal: {0}")]
    Journal(String),
    #[error("{0}")]
    Internal(String),
}

impl NodeError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        NodeError::InvalidArgument(msg.into())
    }

    /// Whether kubelet takes this answer as final: it then forgets the operation and never
    /// calls the matching undo (NodeUnstage after a NodeStage), so the daemon must undo it.
    /// Retried are the codes kubelet treats as "maybe still in progress".
    pub fn is_final(&self) -> bool {
        !matches!(
            self.code(),
            Code::Aborted
                | Code::Unavailable
                | Code::DeadlineExceeded
                | Code::ResourceExhausted
                | Code::Cancelled
        )
    }

    /// The gRPC code this error is answered with.
    pub fn code(&self) -> Code {
        match self {
            NodeError::InvalidArgument(_) => Code::InvalidArgument,
            NodeError::NotFound(_) => Code::NotFound,
            NodeError::AlreadyExists(_) => Code::AlreadyExists,
            NodeError::FailedPrecondition(_) => Code::FailedPrecondition,
            NodeError::Busy(_) => Code::Aborted,
            NodeError::Unavailable(_) => Code::Unavailable,
            NodeError::ResourceExhausted(_) => Code::ResourceExhausted,
            NodeError::Nbd(e) => nbd_code(e),
            NodeError::Mount(e) => mount_code(e),
            NodeError::Journal(_) | NodeError::Internal(_) => Code::Internal,
        }
    }
}

fn nbd_code(e: &nbd::Error) -> Code {
    use nbd::Error as E;
    match e {
        E::Handshake { source, .. } => match source {
            HandshakeError::UnknownExport { .. } | HandshakeError::ExportNameRejected { .. } => {
                Code::NotFound
            }
            HandshakeError::PolicyRefused { .. } => Code::PermissionDenied,
            HandshakeError::TlsRequired { .. }
            | HandshakeError::TlsRefused { .. }
            | HandshakeError::OldStyle => Code::FailedPrecondition,
            _ => Code::Unavailable,
        },
        // A certificate the other side refuses, missing files or kernel modules: fixed by an
        // operator, not by retrying. A connection cut mid-handshake may heal by itself.
        E::Tls { source, .. } => match source {
            TlsError::Handshake(io) if io.kind() != std::io::ErrorKind::InvalidData => {
                Code::Unavailable
            }
            TlsError::Unexpected(_) => Code::Unavailable,
            _ => Code::FailedPrecondition,
        },
        // The export's server may come back: the CO retries with back-off.
        E::Connect { .. } | E::DialTimeout { .. } => Code::Unavailable,
        E::InvalidConnections(_) => Code::InvalidArgument,
        E::UnsupportedBlockSize(_) | E::ExportChanged { .. } => Code::FailedPrecondition,
        E::ModuleNotLoaded => Code::FailedPrecondition,
        E::NotOurs { .. } => Code::FailedPrecondition,
        _ => Code::Internal,
    }
}

fn mount_code(e: &mounts::Error) -> Code {
    use mounts::Error as E;
    match e {
        E::UnsupportedFilesystem(_) | E::ForbiddenOption(_) => Code::InvalidArgument,
        E::NotBlank { .. } => Code::FailedPrecondition,
        _ => Code::Internal,
    }
}

/// The one place a node error becomes a wire status.
impl From<NodeError> for Status {
    fn from(e: NodeError) -> Self {
        Status::new(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_spec() {
        let cases = [
            (NodeError::invalid("x"), Code::InvalidArgument),
            (NodeError::NotFound("x".into()), Code::NotFound),
            (NodeError::AlreadyExists("x".into()), Code::AlreadyExists),
            (
                NodeError::FailedPrecondition("x".into()),
                Code::FailedPrecondition,
            ),
            (NodeError::Busy("v".into()), Code::Aborted),
            (
                NodeError::Mount(mounts::Error::UnsupportedFilesystem("zfs".into())),
                Code::InvalidArgument,
            ),
            (
                NodeError::Nbd(nbd::Error::ModuleNotLoaded),
                Code::FailedPrecondition,
            ),
            (
                NodeError::Nbd(nbd::Error::Handshake {
                    uri: "nbd://h/x".into(),
                    source: HandshakeError::UnknownExport {
                        export: "x".into(),
                        message: String::new(),
                    },
                }),
                Code::NotFound,
            ),
            (NodeError::Journal("disk full".into()), Code::Internal),
            (
                NodeError::ResourceExhausted("nbds_max".into()),
                Code::ResourceExhausted,
            ),
        ];
        for (err, code) in cases {
            let msg = err.to_string();
            let status = Status::from(err);
            assert_eq!(status.code(), code, "{msg}");
            assert_eq!(status.message(), msg);
        }
    }

    #[test]
    fn final_errors_are_the_ones_kubelet_does_not_retry() {
        assert!(NodeError::FailedPrecondition("x".into()).is_final());
        assert!(NodeError::invalid("x").is_final());
        assert!(NodeError::Internal("x".into()).is_final());
        assert!(!NodeError::Busy("v".into()).is_final());
        assert!(!NodeError::Unavailable("x".into()).is_final());
        assert!(!NodeError::ResourceExhausted("x".into()).is_final());
    }
}
