//! The table, row by row: every variant and the code it answers with.

use std::path::PathBuf;
use std::time::Duration;

use reqwest::Method;

use super::*;
use crate::backend::ustor::credentials::PolicyBreach;
use crate::backend::ustor::error::{ApiCall, ApiReply};
use crate::backend::ustor::login::Hold;
use crate::ids::{Handle, Kind};

fn handle() -> Handle {
    Handle::new("local", Kind::Volume, "k8s-pvc-1".into())
}

fn call() -> ApiCall {
    ApiCall {
        method: Method::GET,
        path: "/api/v1/pools/data".into(),
    }
}

fn reply(status: u16, code: &str) -> ApiReply {
    ApiReply {
        call: call(),
        status,
        code: code.into(),
        message: "m".into(),
    }
}

fn http_error() -> reqwest::Error {
    // As `UstorApi::new` does: reqwest wants a TLS provider before any client exists.
    let _ = rustls::crypto::ring::default_provider().install_default();
    match reqwest::Client::new().get("not a url").build() {
        Err(e) => e,
        Ok(_) => panic!("a request to no URL was built"),
    }
}

fn json_error() -> serde_json::Error {
    match serde_json::from_str::<u8>("x") {
        Err(e) => e,
        Ok(_) => panic!("x parsed as a number"),
    }
}

fn join_error() -> tokio::task::JoinError {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let task = tokio::spawn(std::future::pending::<()>());
        task.abort();
        task.await.unwrap_err()
    })
}

fn io(errno: i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(errno)
}

/// Rows every RPC answers alike.
fn any_rpc() -> Vec<(Error, Code)> {
    use Code::*;
    let path = PathBuf::from("/var/lib/x");
    let request = [
        (RequestError::Missing { field: "node_id" }, InvalidArgument),
        (RequestError::NegativeCapacity, InvalidArgument),
        (
            RequestError::UnknownParameter { name: "pol".into() },
            InvalidArgument,
        ),
        (
            RequestError::BadConnectionCount { value: "99".into() },
            InvalidArgument,
        ),
        (
            RequestError::UnknownMutableParameter {
                name: "pool".into(),
            },
            InvalidArgument,
        ),
        (
            RequestError::SnapshotParameters {
                keys: vec!["a".into()],
            },
            InvalidArgument,
        ),
        (RequestError::Capability("no".into()), InvalidArgument),
        (
            RequestError::Filesystem {
                fs_type: "btrfs".into(),
            },
            InvalidArgument,
        ),
        (RequestError::NegativeMaxEntries, InvalidArgument),
    ]
    .map(|(e, c)| (Error::from(e), c));
    let id = [
        (IdError::Missing { field: "volume_id" }, InvalidArgument),
        (IdError::BadName { name: "\n".into() }, InvalidArgument),
        (IdError::BadImage { image: "-".into() }, InvalidArgument),
        (
            IdError::BadSegment {
                what: "pool",
                value: "Data".into(),
                max: 32,
                why: "",
            },
            InvalidArgument,
        ),
        (
            IdError::NotIssued {
                field: "volume_id",
                raw: "x".into(),
            },
            NotFound,
        ),
        (
            IdError::OtherKind {
                field: "volume_id",
                raw: "local:snapshot:x".into(),
                found: "snapshot".into(),
                wanted: Kind::Volume,
            },
            NotFound,
        ),
        (
            IdError::OtherBackend {
                field: "volume_id",
                raw: "ustor:volume:x".into(),
                found: "ustor".into(),
                serves: "local".into(),
            },
            NotFound,
        ),
        (
            IdError::ForeignImage {
                field: "volume_id",
                raw: "local:volume:..".into(),
                image: "..".into(),
            },
            NotFound,
        ),
    ]
    .map(|(e, c)| (Error::from(e), c));
    let volume = [
        (VolumeError::Missing { volume: handle() }, NotFound),
        (VolumeError::Clash { name: "pvc".into() }, AlreadyExists),
        (
            VolumeError::StillPublished {
                volume: handle(),
                nodes: vec!["a".into()],
            },
            FailedPrecondition,
        ),
        (
            VolumeError::PublishedOtherwise {
                volume: handle(),
                node: "a".into(),
                readonly: true,
            },
            AlreadyExists,
        ),
        (
            VolumeError::SingleNode {
                volume: handle(),
                nodes: vec!["a".into()],
            },
            FailedPrecondition,
        ),
        (VolumeError::NodeUnknown { node: "a".into() }, NotFound),
        (VolumeError::NodeListLoading, Unavailable),
    ]
    .map(|(e, c)| (Error::from(e), c));
    let snapshot = [
        (SnapshotError::Missing { snapshot: handle() }, NotFound),
        (SnapshotError::Clash { name: "s".into() }, AlreadyExists),
    ]
    .map(|(e, c)| (Error::from(e), c));
    let namespace = || "vms".to_owned();
    let name = || "disk".to_owned();
    let claim = [
        (ClaimError::Unnamed, FailedPrecondition),
        (
            ClaimError::Read {
                namespace: namespace(),
                name: name(),
                source: kube::Error::Api(kube::core::Status::failure("m", "Timeout").boxed()),
            },
            Unavailable,
        ),
        (
            ClaimError::Gone {
                namespace: namespace(),
                name: name(),
            },
            FailedPrecondition,
        ),
        (
            ClaimError::KeyNotLoaded {
                namespace: namespace(),
                name: name(),
            },
            Unavailable,
        ),
        (
            ClaimError::NotAdmitted {
                namespace: namespace(),
                name: name(),
            },
            FailedPrecondition,
        ),
        (
            ClaimError::StampMismatch {
                namespace: namespace(),
                name: name(),
            },
            FailedPrecondition,
        ),
    ]
    .map(|(e, c)| (Error::from(e), c));
    let local = vec![
        (
            LocalError::NoSpace {
                op: "write",
                path: path.clone(),
                source: io(libc::ENOSPC),
            },
            ResourceExhausted,
        ),
        (
            LocalError::Io {
                op: "write",
                path: path.clone(),
                source: io(libc::EIO),
            },
            Internal,
        ),
        (
            LocalError::BadMetadata {
                kind: "volume",
                image: "i".into(),
                source: json_error(),
            },
            Internal,
        ),
        (
            LocalError::EncodeMetadata {
                kind: "volume",
                image: "i".into(),
                source: json_error(),
            },
            Internal,
        ),
        (LocalError::NoMetadata { image: "i".into() }, NotFound),
        (LocalError::Worker(join_error()), Internal),
        (
            LocalError::FreeSpace {
                path: path.clone(),
                source: nix::errno::Errno::EIO,
            },
            Internal,
        ),
        (
            LocalError::Token {
                image: "i".into(),
                node: "n".into(),
                source: crate::backend::grants::NoRandom,
            },
            Internal,
        ),
    ];
    let ustor = vec![
        (
            UstorError::InvalidArgument(reply(400, "InvalidArgument")),
            InvalidArgument,
        ),
        (
            UstorError::Unauthorized(reply(401, "LoginRejected")),
            Unauthenticated,
        ),
        (
            UstorError::Forbidden(reply(403, "Forbidden")),
            PermissionDenied,
        ),
        (UstorError::NotFound(reply(404, "NotFound")), NotFound),
        (
            UstorError::AlreadyExists(reply(409, "AlreadyExists")),
            AlreadyExists,
        ),
        (
            UstorError::InUse(reply(409, "HasDependents")),
            FailedPrecondition,
        ),
        (UstorError::Busy(reply(503, "Unavailable")), Unavailable),
        (
            UstorError::NoSpace(reply(507, "NoSpace")),
            ResourceExhausted,
        ),
        (UstorError::Unexpected(reply(500, "Oops")), Internal),
        (
            UstorError::Unreachable {
                call: call(),
                source: http_error(),
            },
            Unavailable,
        ),
        (
            UstorError::BadAnswer {
                call: call(),
                source: http_error(),
            },
            Internal,
        ),
        (UstorError::TokenExpiredTwice { call: call() }, Unavailable),
        (
            UstorError::LoginRefused {
                reason: Refusal::Unreachable,
                held: None,
            },
            Unavailable,
        ),
        (
            UstorError::LoginRefused {
                reason: Refusal::PasswordExpired,
                held: Some(Hold::UntilChanged),
            },
            Unauthenticated,
        ),
        (
            UstorError::LoginRefused {
                reason: Refusal::Unreachable,
                held: Some(Hold::For(Duration::from_secs(9))),
            },
            Unavailable,
        ),
        (UstorError::LoginAnswer(http_error()), Internal),
        (
            UstorError::Credentials(CredentialsError::NotRead),
            FailedPrecondition,
        ),
        (
            UstorError::Credentials(CredentialsError::Read {
                path: path.clone(),
                source: io(libc::ENOENT),
            }),
            FailedPrecondition,
        ),
        (
            UstorError::Credentials(CredentialsError::Empty { path: path.clone() }),
            FailedPrecondition,
        ),
        (
            UstorError::Credentials(CredentialsError::AgainstPolicy(
                PolicyBreach::HyphenInUserName,
            )),
            FailedPrecondition,
        ),
        (UstorError::CaCertificate(http_error()), FailedPrecondition),
        (UstorError::HttpClient(http_error()), Internal),
        (
            UstorError::KeyWithoutPool { key: "x".into() },
            InvalidArgument,
        ),
        (
            UstorError::SourceInOtherPool {
                source_pool: "a".into(),
                pool: "b".into(),
            },
            InvalidArgument,
        ),
        (
            UstorError::ImageMissing {
                key: "data/x".into(),
            },
            NotFound,
        ),
        (
            UstorError::BadLabel {
                key: "csi.source",
                source: json_error(),
            },
            Internal,
        ),
        (UstorError::EncodeLabel(json_error()), Internal),
        (
            UstorError::NoGrantToken {
                key: "data/x".into(),
                node: "n".into(),
            },
            Internal,
        ),
    ];
    let connection = [
        (ConnectionError::NoneExists, FailedPrecondition),
        (
            ConnectionError::NotUsable {
                connection: "main".into(),
                reason: "being checked".into(),
            },
            Unavailable,
        ),
        (
            ConnectionError::Unknown {
                connection: "beta".into(),
            },
            FailedPrecondition,
        ),
        (
            ConnectionError::SourceElsewhere {
                source_key: "a/d/x".into(),
                key: "b/d/y".into(),
            },
            InvalidArgument,
        ),
    ];
    let backend = local
        .into_iter()
        .map(|(e, c)| (BackendError::from(e), c))
        .chain(ustor.into_iter().map(|(e, c)| (BackendError::from(e), c)))
        .chain(connection.map(|(e, c)| (BackendError::from(e), c)))
        .chain([(
            BackendError::from(IdError::BadImage { image: "-".into() }),
            InvalidArgument,
        )])
        .map(|(e, c)| (Error::from(e), c));
    request
        .into_iter()
        .chain(id)
        .chain(volume)
        .chain(snapshot)
        .chain(claim)
        .chain(backend)
        .collect()
}

const EVERY_RPC: [Rpc; 18] = [
    Rpc::CreateVolume,
    Rpc::DeleteVolume,
    Rpc::ControllerPublishVolume,
    Rpc::ControllerUnpublishVolume,
    Rpc::ValidateVolumeCapabilities,
    Rpc::GetCapacity,
    Rpc::ControllerGetCapabilities,
    Rpc::CreateSnapshot,
    Rpc::DeleteSnapshot,
    Rpc::ListSnapshots,
    Rpc::ControllerExpandVolume,
    Rpc::ListVolumes,
    Rpc::ControllerGetVolume,
    Rpc::ControllerModifyVolume,
    Rpc::GroupControllerGetCapabilities,
    Rpc::CreateVolumeGroupSnapshot,
    Rpc::DeleteVolumeGroupSnapshot,
    Rpc::GetVolumeGroupSnapshot,
];

#[test]
fn every_variant_answers_with_its_code_in_every_rpc() {
    for (error, want) in any_rpc() {
        for rpc in EVERY_RPC {
            let status = status(rpc, &error);
            assert_eq!(status.code(), want, "{rpc:?}: {error:?}");
            assert_eq!(status.message(), error.to_string());
        }
    }
}

#[test]
fn capacity_and_paging_rows_follow_the_rpc() {
    let over = [
        RequestError::RequiredOverLimit {
            required: 2,
            limit: 1,
        },
        RequestError::MinimumOverLimit {
            minimum: 2,
            limit: 1,
        },
        RequestError::RoundedOverLimit {
            wanted: 1,
            granularity: 2,
            size: 2,
            limit: 1,
        },
    ];
    for e in over.map(Error::from) {
        assert_eq!(code(Rpc::CreateVolume, &e), Code::OutOfRange, "{e}");
        assert_eq!(
            code(Rpc::ControllerExpandVolume, &e),
            Code::OutOfRange,
            "{e}"
        );
        assert_eq!(code(Rpc::GetCapacity, &e), Code::InvalidArgument, "{e}");
    }
    let token = Error::from(RequestError::BadStartingToken { token: "9".into() });
    assert_eq!(code(Rpc::ListSnapshots, &token), Code::Aborted);
    assert_eq!(code(Rpc::ListVolumes, &token), Code::Aborted);
    assert_eq!(code(Rpc::CreateVolume, &token), Code::InvalidArgument);
}

#[test]
fn backend_requests_are_counted_by_the_same_codes() {
    assert_eq!(
        ustor_code(&UstorError::NotFound(reply(404, "NotFound"))),
        Code::NotFound
    );
    assert_eq!(
        backend_code(&BackendError::from(UstorError::Busy(reply(429, "Busy")))),
        Code::Unavailable
    );
}
