//! The controller's error type, and its one mapping to gRPC status codes.

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    /// An id this driver did not issue (another driver's, malformed, of another backend):
    /// for the CSI spec the object it names does not exist.
    #[error("{0}")]
    UnknownId(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    OutOfRange(String),
    #[error("{0}")]
    Aborted(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("backend: {0}")]
    Backend(String),
}

impl ControllerError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        ControllerError::InvalidArgument(msg.into())
    }

    pub fn code(&self) -> Code {
        match self {
            ControllerError::InvalidArgument(_) => Code::InvalidArgument,
            ControllerError::NotFound(_) | ControllerError::UnknownId(_) => Code::NotFound,
            ControllerError::AlreadyExists(_) => Code::AlreadyExists,
            ControllerError::FailedPrecondition(_) => Code::FailedPrecondition,
            ControllerError::OutOfRange(_) => Code::OutOfRange,
            ControllerError::Aborted(_) => Code::Aborted,
            ControllerError::ResourceExhausted(_) => Code::ResourceExhausted,
            ControllerError::Unavailable(_) => Code::Unavailable,
            ControllerError::Unauthenticated(_) => Code::Unauthenticated,
            ControllerError::PermissionDenied(_) => Code::PermissionDenied,
            ControllerError::Backend(_) => Code::Internal,
        }
    }
}

impl From<std::io::Error> for ControllerError {
    fn from(e: std::io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::ENOSPC) => {
                ControllerError::ResourceExhausted(format!("backend storage is full: {e}"))
            }
            _ => ControllerError::Backend(e.to_string()),
        }
    }
}

/// The one place a controller error becomes a wire status.
impl From<ControllerError> for Status {
    fn from(e: ControllerError) -> Self {
        Status::new(e.code(), e.to_string())
    }
}
