//! What a storage backend call can fail with. Each backend has its own enum, one variant per
//! failed step; [`BackendError`] gathers them for the [`Backend`](super::Backend) trait.
//! Which gRPC code each becomes is decided in `service::codes`, nowhere else.

use super::connections::ConnectionError;
use super::local::LocalError;
use super::ustor::error::UstorError;
use crate::ids::IdError;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Local(#[from] LocalError),
    #[error(transparent)]
    Ustor(#[from] UstorError),
    #[error(transparent)]
    Connection(#[from] ConnectionError),
    /// A pool or connection name from a StorageClass that no image key can carry.
    #[error(transparent)]
    Name(#[from] IdError),
}
