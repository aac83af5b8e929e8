//! Everything a controller call can fail with, by where it failed: the request
//! ([`RequestError`]), an id or name ([`IdError`]), the storage ([`BackendError`]), or the
//! volume's, snapshot's or group snapshot's state ([`VolumeError`], [`SnapshotError`],
//! [`GroupError`]), or the claim a
//! ReadWriteMany block volume is for ([`ClaimError`]). The gRPC code each
//! becomes is chosen in one table, `service::codes`.

use crate::backend::BackendError;
use crate::ids::IdError;
use crate::provision::{ClaimError, GroupError, SnapshotError, VolumeError};
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
    Group(#[from] GroupError),
    #[error(transparent)]
    Claim(#[from] ClaimError),
}
