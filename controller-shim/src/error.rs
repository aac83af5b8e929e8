//! Everything a controller call can fail with, by where it failed: the request
//! ([`RequestError`]), an id or name ([`IdError`]), the storage ([`BackendError`]), or the
//! volume's or snapshot's state ([`VolumeError`], [`SnapshotError`]), or the claim a
//! ReadWriteMany block volume is for ([`ClaimError`]). The gRPC code each
//! becomes is chosen in one table, `service::codes`.

use crate::backend::BackendError;
use crate::ids::IdError;
use crate::provision::{ClaimError, SnapshotError, VolumeError};
use crate::request::RequestError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Id(#[from] IdError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Volume(#[from] VolumeError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Claim(#[from] ClaimError),
}
