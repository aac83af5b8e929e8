//! The one table from (RPC, error) to the gRPC code the CO is answered with, and to what
//! happens next. Nothing else in the daemon chooses a [`Code`]: to learn where a CSI error's
//! code comes from, find its message's variant (`grep` the text in `src/`), then its row here.
//!
//! What happens next follows from the code, because kubelet acts on the code:
//! - ABORTED, UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, CANCELLED mean "maybe still in
//!   progress": kubelet retries the call, so the journaled state is kept for the retry to
//!   resume ([`Then::Retry`]);
//! - any other code is final: kubelet forgets the operation. A NodeStage is then rolled back,
//!   since kubelet will never call NodeUnstage for it ([`Then::RollBack`]); every other call
//!   keeps its state as journaled ([`Then::KeepState`]).
//!
//! Where one error gets different codes from different RPCs, the row says which and names
//! the rule of the CSI spec (v1.12.0, the "Error Scheme" table of each RPC) it follows.

use nbd::handshake::HandshakeError;
use nbd::tls::TlsError;
use tonic::Code;

use crate::error::{
    ConnectionsError, ExpandError, NodeError, PublishError, StageError, StageTlsError, UnstageError,
};

/// The CSI Node calls that act on a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rpc {
    NodeStage,
    NodeUnstage,
    NodePublish,
    NodeUnpublish,
    NodeGetVolumeStats,
    NodeExpand,
}

impl Rpc {
    /// The method's name, as spans and metrics show it.
    pub fn name(self) -> &'static str {
        match self {
            Rpc::NodeStage => "NodeStageVolume",
            Rpc::NodeUnstage => "NodeUnstageVolume",
            Rpc::NodePublish => "NodePublishVolume",
            Rpc::NodeUnpublish => "NodeUnpublishVolume",
            Rpc::NodeGetVolumeStats => "NodeGetVolumeStats",
            Rpc::NodeExpand => "NodeExpandVolume",
        }
    }
}

/// What happens after the error is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// The CO retries; the journaled state is kept so the retry resumes it.
    Retry,
    /// The answer is final; the state stays as journaled.
    KeepState,
    /// The answer is final and the daemon undoes what the call did.
    RollBack,
}

/// The answer to one failed call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    pub code: Code,
    pub then: Then,
}

/// How `rpc` answers `e`.
pub fn answer(rpc: Rpc, e: &NodeError) -> Answer {
    let code = code(rpc, e);
    Answer {
        code,
        then: then(rpc, code),
    }
}

/// The wire status of a failed call: the table's code and the error's message.
pub fn status(rpc: Rpc, e: &NodeError) -> tonic::Status {
    tonic::Status::new(code(rpc, e), e.to_string())
}

fn then(rpc: Rpc, code: Code) -> Then {
    let retried = matches!(
        code,
        Code::Aborted
            | Code::Unavailable
            | Code::DeadlineExceeded
            | Code::ResourceExhausted
            | Code::Cancelled
    );
    match (retried, rpc) {
        (true, _) => Then::Retry,
        (false, Rpc::NodeStage) => Then::RollBack,
        (false, _) => Then::KeepState,
    }
}

/// The table.
fn code(rpc: Rpc, e: &NodeError) -> Code {
    use NodeError as N;
    match e {
        N::Request(_) => Code::InvalidArgument,
        N::Stage(e) => stage_code(rpc, e),
        N::Unstage(e) => match e {
            UnstageError::StillPublished { .. }
            | UnstageError::ForeignUsers { .. }
            | UnstageError::OpenElsewhere { .. } => Code::FailedPrecondition,
        },
        N::Publish(e) => match e {
            // Spec, NodePublishVolume: "Volume published but is incompatible" (the same target
            // with other arguments).
            PublishError::PublishedOtherwise { .. } => Code::AlreadyExists,
            // Spec, NodePublishVolume: "Exceeds capabilities" (a second workload for a
            // single-node mode).
            PublishError::SingleWorkload { .. }
            | PublishError::MixedReadOnly { .. }
            | PublishError::TargetTaken { .. } => Code::FailedPrecondition,
            PublishError::CreateTarget { .. } | PublishError::RemoveTarget { .. } => Code::Internal,
        },
        N::Expand(e) => match e {
            ExpandError::ExportTooSmall { .. }
            | ExpandError::Shrink { .. }
            | ExpandError::UnalignedSize { .. }
            | ExpandError::OldConnections { .. } => Code::FailedPrecondition,
            // The connections may be replaceable on the next try: the CO retries.
            ExpandError::ReplaceTimedOut { .. }
            | ExpandError::LinkDown { .. }
            | ExpandError::NoQuietMoment { .. } => Code::Unavailable,
        },
        N::StageTls(e) => match e {
            StageTlsError::HalfIdentity { .. } | StageTlsError::NoCa => Code::InvalidArgument,
            StageTlsError::Store { .. } => Code::Internal,
        },
        N::NotReady => Code::Unavailable,
        // Spec, "Concurrency": an operation pending on the volume is ABORTED.
        N::Busy { .. } => Code::Aborted,
        N::NotStaged { .. } => match rpc {
            // Spec, NodePublishVolume: a volume NodeStage has not staged is a precondition
            // the CO has not met (the volume exists, this node has not staged it).
            Rpc::NodePublish => Code::FailedPrecondition,
            // Spec, NodeGetVolumeStats and NodeExpandVolume: "Volume not found", NOT_FOUND.
            _ => Code::NotFound,
        },
        // Spec, NodeGetVolumeStats and NodeExpandVolume: the path is not the volume's.
        N::NotAtPath { .. } => Code::NotFound,
        N::NotStagedYet { .. } | N::WrongStagingPath { .. } => Code::FailedPrecondition,
        // Not retried into anything: the CO must unpublish and unstage it first.
        N::Fenced { .. } => Code::FailedPrecondition,
        // Final: the stage is undone; the CO stages again only with a new publication.
        N::FencedMidStage { .. } => Code::FailedPrecondition,
        N::OtherCapability { .. } => match rpc {
            // Spec, NodeStageVolume: "Volume published but is incompatible", ALREADY_EXISTS.
            Rpc::NodeStage => Code::AlreadyExists,
            // NodePublish names a capability the volume was not staged with: the request
            // itself is wrong for this volume.
            _ => Code::InvalidArgument,
        },
        // The device is gone after staging finished: NodeStage must run again first.
        N::DeviceGone { .. } => Code::FailedPrecondition,
        N::ExportUnknown { .. } | N::StagingPathUnknown { .. } | N::UnknownTlsProfile { .. } => {
            Code::FailedPrecondition
        }
        // The node is full, not broken: the CO retries, or schedules elsewhere.
        N::NoFreeDevice { .. } => Code::ResourceExhausted,
        N::Connections(e) => match e {
            ConnectionsError::Detaching { .. } => Code::Unavailable,
            ConnectionsError::NoSocketDiagnostics => Code::FailedPrecondition,
            // The server may come back as it was (a failover undone): retried.
            ConnectionsError::ExportChanged { .. } => Code::Unavailable,
        },
        // A step the lifecycle does not allow is a bug (or an edited record): not retried.
        N::Transition(_) | N::IllegalTargetTransition { .. } => Code::Internal,
        N::Worker { .. } | N::Journal(_) | N::Blockdev(_) | N::Id(_) => Code::Internal,
        // A degraded server, or a link healing mid-call: retried with the state kept (and
        // never formatted, resized back or detached on the strength of a failed read).
        N::Unreadable(_) => Code::Unavailable,
        N::Nbd(e) => nbd_code(e),
        N::Mount(e) => mount_code(e),
    }
}

fn stage_code(rpc: Rpc, e: &StageError) -> Code {
    use StageError as S;
    match e {
        // A failed step answers as what failed inside it.
        S::Attach { source, .. }
        | S::Probe { source, .. }
        | S::Format { source, .. }
        | S::Mount { source, .. } => code(rpc, source),
        // Spec, NodeStageVolume: "Volume published but is incompatible", ALREADY_EXISTS.
        S::StagedElsewhere { .. } | S::OtherExport { .. } => Code::AlreadyExists,
        S::SharedExport { .. }
        | S::NoExport { .. }
        | S::ExportSize { .. }
        | S::ReadOnlyBlank { .. }
        | S::ForeignFilesystem { .. }
        | S::FormatAgain { .. }
        | S::FilesystemAppeared { .. }
        | S::StagingPathTaken { .. } => Code::FailedPrecondition,
        // Retried, not rolled back: the teardown or the next attach finishes it.
        S::BeingUnstaged { .. } | S::DeviceLost { .. } => Code::Unavailable,
        S::DidNotSettle { .. } | S::CreateStagingDir { .. } => Code::Internal,
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

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::error::{BlockdevError, JournalError, RequestError, UnreadableError};
    use crate::record::{Access, AccessMode, Phase};
    use Rpc::*;
    use Then::*;

    fn v() -> String {
        "pvc-1".into()
    }

    fn io() -> std::io::Error {
        std::io::Error::from_raw_os_error(libc::EIO)
    }

    fn boxed(e: impl Into<NodeError>) -> Box<NodeError> {
        Box::new(e.into())
    }

    /// Every variant, in every RPC where its answer differs: code and what happens next.
    /// A row changes only with the CSI spec's reason written next to the table's row.
    #[test]
    fn the_table() {
        let unknown_export = || nbd::Error::Handshake {
            uri: "nbd://h/x".into(),
            source: HandshakeError::UnknownExport {
                export: "x".into(),
                message: String::new(),
            },
        };
        let rows: Vec<(Rpc, NodeError, Code, Then)> = vec![
            // Validation: every RPC.
            (
                NodeStage,
                RequestError::Missing { field: "volume_id" }.into(),
                Code::InvalidArgument,
                RollBack,
            ),
            (
                NodeExpand,
                RequestError::NegativeCapacity.into(),
                Code::InvalidArgument,
                KeepState,
            ),
            (NodeStage, NodeError::NotReady, Code::Unavailable, Retry),
            (
                NodeUnstage,
                NodeError::Busy { volume: v() },
                Code::Aborted,
                Retry,
            ),
            // Not staged here: NOT_FOUND where the spec says "volume not found", but a
            // precondition of NodePublish.
            (
                NodePublish,
                NodeError::NotStaged { volume: v() },
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeGetVolumeStats,
                NodeError::NotStaged { volume: v() },
                Code::NotFound,
                KeepState,
            ),
            (
                NodeExpand,
                NodeError::NotStaged { volume: v() },
                Code::NotFound,
                KeepState,
            ),
            (
                NodeGetVolumeStats,
                NodeError::NotAtPath {
                    volume: v(),
                    path: "/p".into(),
                },
                Code::NotFound,
                KeepState,
            ),
            (
                NodePublish,
                NodeError::NotStagedYet {
                    volume: v(),
                    phase: Phase::Mounting,
                },
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeUnstage,
                NodeError::WrongStagingPath {
                    volume: v(),
                    staged: "/a".into(),
                    asked: "/b".into(),
                },
                Code::FailedPrecondition,
                KeepState,
            ),
            // Another capability: ALREADY_EXISTS for NodeStage, INVALID_ARGUMENT for publish.
            (
                NodeStage,
                NodeError::OtherCapability {
                    volume: v(),
                    access: Access::Block,
                    mode: AccessMode::SingleNodeSingleWriter,
                },
                Code::AlreadyExists,
                RollBack,
            ),
            (
                NodePublish,
                NodeError::OtherCapability {
                    volume: v(),
                    access: Access::Block,
                    mode: AccessMode::SingleNodeSingleWriter,
                },
                Code::InvalidArgument,
                KeepState,
            ),
            // The device gone: after staging a precondition; mid-stage retried.
            (
                NodePublish,
                NodeError::DeviceGone { volume: v() },
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeExpand,
                NodeError::DeviceGone { volume: v() },
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeStage,
                StageError::DeviceLost { volume: v() }.into(),
                Code::Unavailable,
                Retry,
            ),
            (
                NodeExpand,
                NodeError::ExportUnknown { volume: v() },
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodePublish,
                NodeError::StagingPathUnknown { volume: v() },
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeStage,
                NodeError::UnknownTlsProfile {
                    uri: "nbds://h/x".into(),
                    profile: "lab".into(),
                },
                Code::FailedPrecondition,
                RollBack,
            ),
            (
                NodeStage,
                NodeError::NoFreeDevice {
                    source: nbd::Error::ModuleNotLoaded,
                },
                Code::ResourceExhausted,
                Retry,
            ),
            (
                NodeStage,
                NodeError::Worker {
                    what: "mkfs",
                    source: join_error(),
                },
                Code::Internal,
                RollBack,
            ),
            (
                NodeStage,
                JournalError::Io {
                    op: "syncing",
                    path: "/j".into(),
                    source: io(),
                }
                .into(),
                Code::Internal,
                RollBack,
            ),
            (
                NodePublish,
                BlockdevError {
                    op: "opening",
                    path: "/dev/nbd0".into(),
                    source: io(),
                }
                .into(),
                Code::Internal,
                KeepState,
            ),
            (
                NodeStage,
                StageError::Probe {
                    volume: v(),
                    source: boxed(UnreadableError {
                        device: "/dev/nbd0".into(),
                        offset: 0,
                        len: 4096,
                        source: io(),
                    }),
                }
                .into(),
                Code::Unavailable,
                Retry,
            ),
            (
                NodeExpand,
                UnreadableError {
                    device: "/dev/nbd0".into(),
                    offset: 0,
                    len: 4096,
                    source: io(),
                }
                .into(),
                Code::Unavailable,
                Retry,
            ),
            (
                NodeExpand,
                ConnectionsError::Detaching { volume: v() }.into(),
                Code::Unavailable,
                Retry,
            ),
            (
                NodeExpand,
                ConnectionsError::NoSocketDiagnostics.into(),
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeStage,
                crate::ids::IdError::Identifier(nbd::identity::BadBackendId::Empty).into(),
                Code::Internal,
                RollBack,
            ),
            (
                NodeStage,
                crate::error::IllegalTransition {
                    volume: v(),
                    from: Phase::Unstaging,
                    to: Phase::Staged,
                }
                .into(),
                Code::Internal,
                RollBack,
            ),
            (
                NodePublish,
                NodeError::IllegalTargetTransition {
                    volume: v(),
                    target: "/t".into(),
                    from: None,
                    to: crate::record::TargetPhase::Published,
                },
                Code::Internal,
                KeepState,
            ),
            // NodeStage's own.
            (
                NodeStage,
                StageError::StagedElsewhere {
                    volume: v(),
                    staged: "/s".into(),
                }
                .into(),
                Code::AlreadyExists,
                RollBack,
            ),
            (
                NodeStage,
                StageError::OtherExport {
                    volume: v(),
                    staged: "nbd://a/x".into(),
                    requested: "nbd://b/x".into(),
                }
                .into(),
                Code::AlreadyExists,
                RollBack,
            ),
            (
                NodeStage,
                StageError::BeingUnstaged { volume: v() }.into(),
                Code::Unavailable,
                Retry,
            ),
            (
                NodeStage,
                StageError::DidNotSettle {
                    volume: v(),
                    steps: 12,
                }
                .into(),
                Code::Internal,
                RollBack,
            ),
            (
                NodeStage,
                StageError::CreateStagingDir {
                    path: "/s".into(),
                    source: io(),
                }
                .into(),
                Code::Internal,
                RollBack,
            ),
            (
                NodeStage,
                StageError::FormatAgain {
                    volume: v(),
                    source: mounts::Error::UnsupportedFilesystem("zfs".into()),
                }
                .into(),
                Code::FailedPrecondition,
                RollBack,
            ),
            // A failed step answers as what failed in it.
            (
                NodeStage,
                StageError::Attach {
                    volume: v(),
                    source: boxed(unknown_export()),
                }
                .into(),
                Code::NotFound,
                RollBack,
            ),
            (
                NodeStage,
                StageError::Attach {
                    volume: v(),
                    source: boxed(NodeError::NoFreeDevice {
                        source: nbd::Error::ModuleNotLoaded,
                    }),
                }
                .into(),
                Code::ResourceExhausted,
                Retry,
            ),
            (
                NodeStage,
                StageError::Probe {
                    volume: v(),
                    source: boxed(StageError::DeviceLost { volume: v() }),
                }
                .into(),
                Code::Unavailable,
                Retry,
            ),
            (
                NodeStage,
                StageError::Mount {
                    volume: v(),
                    source: boxed(mounts::Error::UnsupportedFilesystem("zfs".into())),
                }
                .into(),
                Code::InvalidArgument,
                RollBack,
            ),
            (
                NodeStage,
                StageError::Format {
                    volume: v(),
                    source: boxed(JournalError::Encode(
                        serde_json::from_str::<u8>("x").unwrap_err(),
                    )),
                }
                .into(),
                Code::Internal,
                RollBack,
            ),
            // NodeUnstage's.
            (
                NodeUnstage,
                UnstageError::StillPublished {
                    volume: v(),
                    targets: "/t".into(),
                }
                .into(),
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeUnstage,
                UnstageError::ForeignUsers {
                    device: nbd::DeviceIndex(0),
                    volume: v(),
                    mounts: "/m".into(),
                }
                .into(),
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeUnstage,
                UnstageError::OpenElsewhere {
                    device: nbd::DeviceIndex(0),
                    volume: v(),
                    holders: "812 (dd)".into(),
                }
                .into(),
                Code::FailedPrecondition,
                KeepState,
            ),
            // NodePublish's.
            (
                NodePublish,
                PublishError::PublishedOtherwise {
                    volume: v(),
                    target: "/t".into(),
                    read_only: true,
                }
                .into(),
                Code::AlreadyExists,
                KeepState,
            ),
            (
                NodePublish,
                PublishError::SingleWorkload {
                    volume: v(),
                    mode: AccessMode::SingleNodeSingleWriter,
                    targets: "/t".into(),
                }
                .into(),
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodePublish,
                PublishError::MixedReadOnly {
                    volume: v(),
                    read_only: true,
                    targets: "/t".into(),
                }
                .into(),
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodePublish,
                PublishError::TargetTaken { path: "/t".into() }.into(),
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeUnpublish,
                PublishError::RemoveTarget {
                    path: "/t".into(),
                    source: io(),
                }
                .into(),
                Code::Internal,
                KeepState,
            ),
            // NodeExpand's.
            (
                NodeExpand,
                ExpandError::Shrink {
                    volume: v(),
                    current: 2,
                    export: 1,
                }
                .into(),
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeExpand,
                ExpandError::OldConnections {
                    volume: v(),
                    old: 1,
                }
                .into(),
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeExpand,
                ExpandError::ExportTooSmall {
                    volume: v(),
                    size: 1,
                    required: 2,
                }
                .into(),
                Code::FailedPrecondition,
                KeepState,
            ),
            (
                NodeExpand,
                ExpandError::ReplaceTimedOut {
                    volume: v(),
                    within: std::time::Duration::from_secs(1),
                }
                .into(),
                Code::Unavailable,
                Retry,
            ),
            (
                NodeExpand,
                ExpandError::LinkDown {
                    volume: v(),
                    detail: "the device could not be read: /dev/nbd1 could not be read at 0+4096"
                        .into(),
                }
                .into(),
                Code::Unavailable,
                Retry,
            ),
            (
                NodeExpand,
                ExpandError::NoQuietMoment {
                    volume: v(),
                    within: std::time::Duration::from_secs(30),
                    busy: 80,
                    closed: 3,
                }
                .into(),
                Code::Unavailable,
                Retry,
            ),
            // The libraries' errors.
            (NodeStage, unknown_export().into(), Code::NotFound, RollBack),
            (
                NodeStage,
                nbd::Error::ModuleNotLoaded.into(),
                Code::FailedPrecondition,
                RollBack,
            ),
            (
                NodeStage,
                mounts::Error::UnsupportedFilesystem("zfs".into()).into(),
                Code::InvalidArgument,
                RollBack,
            ),
        ];
        for (rpc, err, code, then) in rows {
            let msg = err.to_string();
            assert_eq!(answer(rpc, &err), Answer { code, then }, "{rpc:?}: {msg}");
            let status = status(rpc, &err);
            assert_eq!(status.code(), code, "{msg}");
            assert_eq!(status.message(), msg);
        }
    }

    /// Kubelet retries exactly the codes that mean "maybe still in progress"; a final answer
    /// rolls a NodeStage back and leaves every other call's state alone.
    #[test]
    fn final_answers_are_the_ones_kubelet_does_not_retry() {
        for code in [
            Code::Aborted,
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::ResourceExhausted,
            Code::Cancelled,
        ] {
            assert_eq!(then(NodeStage, code), Retry, "{code:?}");
            assert_eq!(then(NodeExpand, code), Retry, "{code:?}");
        }
        for code in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::AlreadyExists,
            Code::FailedPrecondition,
            Code::PermissionDenied,
            Code::Internal,
        ] {
            assert_eq!(then(NodeStage, code), RollBack, "{code:?}");
            assert_eq!(then(NodePublish, code), KeepState, "{code:?}");
        }
    }

    /// Messages keep the facts an operator needs (the VM tests match some of them).
    #[test]
    fn messages_keep_their_facts() {
        let cases: Vec<(NodeError, &str)> = vec![
            (
                StageError::ForeignFilesystem {
                    volume: v(),
                    found: "ext4".into(),
                    wanted: "xfs".into(),
                }
                .into(),
                "volume pvc-1 holds ext4, not the requested xfs: refusing to reformat it",
            ),
            (
                NodeError::UnknownTlsProfile {
                    uri: "nbds://h/x".into(),
                    profile: "nowhere".into(),
                },
                "[tls-profile.nowhere]",
            ),
            (
                ExpandError::Shrink {
                    volume: v(),
                    current: 2,
                    export: 1,
                }
                .into(),
                "refusing to shrink it",
            ),
            (
                ExpandError::OldConnections {
                    volume: v(),
                    old: 7,
                }
                .into(),
                "keeps its old size of 7 bytes",
            ),
            (
                ExpandError::ReplaceTimedOut {
                    volume: v(),
                    within: std::time::Duration::from_secs(1),
                }
                .into(),
                "its size is unchanged",
            ),
            (
                ExpandError::LinkDown {
                    volume: v(),
                    detail: "the device could not be read: /dev/nbd1 could not be read at 0+4096"
                        .into(),
                }
                .into(),
                "retry once it has healed",
            ),
            (
                ExpandError::NoQuietMoment {
                    volume: v(),
                    within: std::time::Duration::from_secs(30),
                    busy: 80,
                    closed: 3,
                }
                .into(),
                "keeps its size: retry",
            ),
            (
                JournalError::Io {
                    op: "syncing",
                    path: PathBuf::from("/state/volumes"),
                    source: io(),
                }
                .into(),
                "attachment journal: syncing /state/volumes: Input/output error (os error 5)",
            ),
            (
                StageError::Attach {
                    volume: v(),
                    source: boxed(StageError::ExportSize {
                        volume: v(),
                        size: 7,
                    }),
                }
                .into(),
                "the export of volume pvc-1 is 7 bytes",
            ),
        ];
        for (err, want) in cases {
            assert!(err.to_string().contains(want), "{err} !~ {want}");
        }
    }

    fn join_error() -> tokio::task::JoinError {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async { tokio::spawn(async { panic!("worker") }).await.unwrap_err() })
    }
}
