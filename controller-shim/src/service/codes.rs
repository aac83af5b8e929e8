//! The one table from a controller error to the gRPC code its RPC answers with. Nothing else
//! chooses a code: to learn why a call answered, say, FAILED_PRECONDITION, find the error's
//! variant in the message's words, then its row here. Every enum is matched without a
//! wildcard, so a new variant does not compile until it has a row.
//!
//! The codes are the CSI spec's where it names the case (noted per row), else the closest
//! gRPC meaning; the uStor rows are `USTOR_API.md`'s error table.

use tonic::{Code, Status};

use super::rpc::Rpc;
use crate::backend::connections::ConnectionError;
use crate::backend::local::LocalError;
use crate::backend::ustor::credentials::CredentialsError;
use crate::backend::ustor::error::UstorError;
use crate::backend::ustor::login::Refusal;
use crate::backend::BackendError;
use crate::error::Error;
use crate::ids::IdError;
use crate::provision::{ClaimError, GroupError, SnapshotError, VolumeError};
use crate::request::RequestError;

/// The answer of `rpc` that failed with `error`: its code and the error's message.
pub fn status(rpc: Rpc, error: &Error) -> Status {
    Status::new(code(rpc, error), error.to_string())
}

pub fn code(rpc: Rpc, error: &Error) -> Code {
    match error {
        Error::Request(e) => request(rpc, e),
        Error::Id(e) => id(e),
        Error::Backend(e) => backend_code(e),
        Error::Volume(e) => volume(e),
        Error::Snapshot(e) => snapshot(e),
        Error::Group(e) => group(e),
        Error::Claim(e) => claim(e),
    }
}

fn request(rpc: Rpc, e: &RequestError) -> Code {
    use RequestError as R;
    match (rpc, e) {
        // Spec, ListSnapshots and ListVolumes: "Invalid starting_token" is ABORTED.
        (Rpc::ListSnapshots | Rpc::ListVolumes, R::BadStartingToken { .. }) => Code::Aborted,
        // Spec, CreateVolume and ControllerExpandVolume: "Unsupported capacity_range" is
        // OUT_OF_RANGE.
        (
            Rpc::CreateVolume | Rpc::ControllerExpandVolume,
            R::RequiredOverLimit { .. } | R::MinimumOverLimit { .. } | R::RoundedOverLimit { .. },
        ) => Code::OutOfRange,
        (
            _,
            R::Missing { .. }
            | R::NegativeCapacity
            | R::RequiredOverLimit { .. }
            | R::MinimumOverLimit { .. }
            | R::RoundedOverLimit { .. }
            | R::UnknownParameter { .. }
            | R::BadConnectionCount { .. }
            | R::UnknownMutableParameter { .. }
            | R::SnapshotParameters { .. }
            | R::DuplicateSource { .. }
            | R::Capability(_)
            | R::Filesystem { .. }
            | R::NegativeMaxEntries
            | R::BadStartingToken { .. },
        ) => Code::InvalidArgument,
    }
}

fn id(e: &IdError) -> Code {
    match e {
        IdError::Missing { .. }
        | IdError::BadName { .. }
        | IdError::BadImage { .. }
        | IdError::BadSegment { .. } => Code::InvalidArgument,
        // An id this driver did not issue names nothing: for the spec, what it names does
        // not exist.
        IdError::NotIssued { .. }
        | IdError::OtherKind { .. }
        | IdError::OtherBackend { .. }
        | IdError::ForeignImage { .. } => Code::NotFound,
    }
}

fn volume(e: &VolumeError) -> Code {
    match e {
        VolumeError::Missing { .. } => Code::NotFound,
        // Spec, CreateVolume: "Volume already exists but is incompatible".
        VolumeError::Clash { .. } => Code::AlreadyExists,
        // Spec, DeleteVolume: "Volume in use".
        VolumeError::StillPublished { .. } => Code::FailedPrecondition,
        // Spec, ControllerPublishVolume: "Volume published but is incompatible".
        VolumeError::PublishedOtherwise { .. } => Code::AlreadyExists,
        // Spec, ControllerPublishVolume: "Volume published to another node".
        VolumeError::SingleNode { .. } => Code::FailedPrecondition,
        // Spec, ControllerPublishVolume: "Node does not exist".
        VolumeError::NodeUnknown { .. } => Code::NotFound,
        VolumeError::NodeListLoading => Code::Unavailable,
        // Spec, ControllerPublishVolume: "Max volumes attached".
        VolumeError::AttachLimit { .. } => Code::ResourceExhausted,
    }
}

fn snapshot(e: &SnapshotError) -> Code {
    match e {
        SnapshotError::Missing { .. } => Code::NotFound,
        // Spec, CreateSnapshot: "Snapshot already exists but is incompatible".
        SnapshotError::Clash { .. } => Code::AlreadyExists,
    }
}

fn group(e: &GroupError) -> Code {
    match e {
        // Spec, GetVolumeGroupSnapshot: "Volume group snapshot does not exist".
        GroupError::Missing { .. } => Code::NotFound,
        // Spec, CreateVolumeGroupSnapshot: "Group snapshot already exists but is
        // incompatible".
        GroupError::Clash { .. } | GroupError::MemberTaken { .. } => Code::AlreadyExists,
        // Spec, Delete- and GetVolumeGroupSnapshot: a mismatch in snapshot_ids is
        // INVALID_ARGUMENT.
        GroupError::NotMember { .. } => Code::InvalidArgument,
    }
}

/// The claim of a ReadWriteMany block volume. The spec names no code for a caller the
/// driver does not serve; the request is valid (the capability is one the driver offers), and
/// what it lacks is a state outside it: the claim's admission, which the webhook gives when a
/// live-migration user writes the claim. That is FAILED_PRECONDITION ("the system is not in
/// a state required for the operation"; INVALID_ARGUMENT is for arguments problematic
/// whatever the state). external-provisioner retries it with back-off, so a claim admitted
/// later is provisioned then.
fn claim(e: &ClaimError) -> Code {
    match e {
        ClaimError::Unnamed
        | ClaimError::Gone { .. }
        | ClaimError::NotAdmitted { .. }
        | ClaimError::StampMismatch { .. } => Code::FailedPrecondition,
        // The API or the key Secret not read yet: retried by the sidecar.
        ClaimError::Read { .. } | ClaimError::KeyNotLoaded { .. } => Code::Unavailable,
    }
}

/// A storage error's code in every RPC (the backend request metrics count by it too).
pub fn backend_code(e: &BackendError) -> Code {
    match e {
        BackendError::Local(e) => local(e),
        BackendError::Ustor(e) => ustor_code(e),
        BackendError::Connection(e) => connection(e),
        BackendError::Name(e) => id(e),
    }
}

fn local(e: &LocalError) -> Code {
    match e {
        LocalError::NoSpace { .. } => Code::ResourceExhausted,
        LocalError::NoMetadata { .. } => Code::NotFound,
        // The export server could not pause (restarting, or slow to drain): retried.
        LocalError::Hold(_) => Code::Unavailable,
        LocalError::Io { .. }
        | LocalError::BadMetadata { .. }
        | LocalError::EncodeMetadata { .. }
        | LocalError::Worker(_)
        | LocalError::FreeSpace { .. }
        | LocalError::Token { .. } => Code::Internal,
    }
}

/// `USTOR_API.md`'s table, then the steps around a call.
pub fn ustor_code(e: &UstorError) -> Code {
    match e {
        UstorError::InvalidArgument(_) => Code::InvalidArgument,
        UstorError::Unauthorized(_) => Code::Unauthenticated,
        UstorError::Forbidden(_) => Code::PermissionDenied,
        UstorError::NotFound(_) => Code::NotFound,
        UstorError::AlreadyExists(_) => Code::AlreadyExists,
        UstorError::InUse(_) => Code::FailedPrecondition,
        // The sidecar retries.
        UstorError::Busy(_) => Code::Unavailable,
        UstorError::NoSpace(_) => Code::ResourceExhausted,
        UstorError::Unexpected(_) => Code::Internal,
        UstorError::Unreachable { .. } | UstorError::TokenExpiredTwice { .. } => Code::Unavailable,
        // Not the credentials' fault: retried sooner.
        UstorError::LoginRefused {
            reason: Refusal::Unreachable,
            ..
        } => Code::Unavailable,
        UstorError::LoginRefused { .. } => Code::Unauthenticated,
        UstorError::Credentials(e) => credentials(e),
        UstorError::CaCertificate(_) => Code::FailedPrecondition,
        UstorError::KeyWithoutPool { .. }
        | UstorError::SourceInOtherPool { .. }
        | UstorError::GroupAcrossPools { .. } => Code::InvalidArgument,
        UstorError::ImageMissing { .. } => Code::NotFound,
        UstorError::BadAnswer { .. }
        | UstorError::LoginAnswer(_)
        | UstorError::HttpClient(_)
        | UstorError::BadLabel { .. }
        | UstorError::NoGrantToken { .. }
        | UstorError::EncodeLabel(_) => Code::Internal,
    }
}

fn credentials(e: &CredentialsError) -> Code {
    match e {
        CredentialsError::NotRead
        | CredentialsError::Read { .. }
        | CredentialsError::Empty { .. }
        | CredentialsError::AgainstPolicy(_) => Code::FailedPrecondition,
    }
}

fn connection(e: &ConnectionError) -> Code {
    match e {
        ConnectionError::NoneExists | ConnectionError::Unknown { .. } => Code::FailedPrecondition,
        // Being checked or refused: the sidecar retries.
        ConnectionError::NotUsable { .. } => Code::Unavailable,
        ConnectionError::SourceElsewhere { .. }
        | ConnectionError::GroupAcrossConnections { .. } => Code::InvalidArgument,
    }
}

#[cfg(test)]
mod tests;
