//! What a node operation can fail with. Each variant names the failed step and keeps its
//! source; none of them chooses a gRPC code. Which code the CO gets, and what happens next
//! (keep the state, roll back, let the CO retry), is decided in one table:
//! [`crate::service::status`].
//!
//! - Conditions several RPCs share (a volume not staged here, its device gone) are variants
//!   of [`NodeError`]; the table says where their code differs per RPC and why.
//! - Each operation's own refusals are in its module: [`RequestError`] (validation),
//!   [`StageError`], [`UnstageError`], [`PublishError`], [`ExpandError`].
//! - Components keep theirs: [`JournalError`], [`BlockdevError`], [`UnreadableError`],
//!   [`ConnectionsError`],
//!   [`IdError`], and the libraries' [`nbd::Error`] and [`mounts::Error`].

use std::path::PathBuf;

pub use crate::blockdev::{BlockdevError, UnreadableError};
pub use crate::connections::ConnectionsError;
pub use crate::ids::IdError;
pub use crate::journal::JournalError;
pub use crate::request::RequestError;
pub use crate::stage_tls::StageTlsError;
pub use crate::volumes::expand::ExpandError;
pub use crate::volumes::lifecycle::IllegalTransition;
pub use crate::volumes::publish::PublishError;
pub use crate::volumes::stage::{StageError, UnstageError};

use crate::record::{Access, AccessMode, Phase, TargetPhase};

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error(transparent)]
    Unstage(#[from] UnstageError),
    #[error(transparent)]
    Publish(#[from] PublishError),
    #[error(transparent)]
    Expand(#[from] ExpandError),
    /// The node-stage secret's TLS material: unusable as given, or not kept.
    #[error(transparent)]
    StageTls(#[from] StageTlsError),

    /// Recovery has not finished: no call acts on a half-known state.
    #[error("the node daemon is still recovering its attachments; retry shortly")]
    NotReady,
    /// Another call holds the volume's lock.
    #[error("another operation on volume {volume} is in progress; retry later")]
    Busy { volume: String },
    /// The journal has no record of the volume.
    #[error("volume {volume} is not staged on this node")]
    NotStaged { volume: String },
    /// The path the call names is neither the volume's staging path nor one of its targets.
    #[error("volume {volume} is neither staged nor published at {}", path.display())]
    NotAtPath { volume: String, path: PathBuf },
    /// The volume has a record, but staging has not finished (or teardown has begun).
    #[error("volume {volume} is not staged yet (step: {phase:?})")]
    NotStagedYet { volume: String, phase: Phase },
    /// The export refused this node's grant (see [`crate::fence`]): what is staged here is
    /// dead, and only unpublishing and unstaging it is left.
    #[error(
        "volume {volume} is fenced on this node: its export refused this node's grant (it was unpublished from this node, and may be in use elsewhere){}; unpublish and unstage it here first",
        if targets.is_empty() { String::new() } else { format!(", and it is still published at {targets}") }
    )]
    Fenced { volume: String, targets: String },
    /// The export refused this node's grant while NodeStage was under way (the volume was
    /// unpublished from this node mid-call): the step that failed on it is not retried.
    #[error(
        "volume {volume} was fenced while it was being staged: its export refused this node's grant (it was unpublished from this node mid-call, and may be in use elsewhere); staging stopped at: {source}"
    )]
    FencedMidStage {
        volume: String,
        source: Box<NodeError>,
    },
    /// The call names a staging path other than the one the volume is staged at.
    #[error("volume {volume} is staged at {}, not at {}", staged.display(), asked.display())]
    WrongStagingPath {
        volume: String,
        staged: PathBuf,
        asked: PathBuf,
    },
    /// The call's capability is not the one the volume was staged with.
    #[error("volume {volume} is staged with another capability ({access}, {mode:?})")]
    OtherCapability {
        volume: String,
        access: Access,
        mode: AccessMode,
    },
    /// No device carries the volume's identifier any more.
    #[error("device of volume {volume} is gone: NodeStageVolume must attach it again")]
    DeviceGone { volume: String },
    /// A record rebuilt from kernel facts has not learned its export yet.
    #[error(
        "the export of volume {volume} is not known yet; it is learned at the next NodePublish"
    )]
    ExportUnknown { volume: String },
    /// The record names no staging path (a rebuilt block volume).
    #[error("staging path of volume {volume} is unknown")]
    StagingPathUnknown { volume: String },
    /// The export asks for a TLS profile this node's configuration lacks.
    #[error(
        "the volume's export {uri} asks for TLS profile {profile:?}, which this node does not define: \
         add [tls-profile.{profile}] with its ca-file, cert-file and key-file to the node's configuration"
    )]
    UnknownTlsProfile { uri: String, profile: String },
    /// CONNECT for any free device found none: the node is full, not broken.
    #[error(
        "no free NBD device on this node ({source}); raise the nbd module's nbds_max or move volumes away"
    )]
    NoFreeDevice { source: nbd::Error },
    /// A phase change the lifecycle does not allow.
    #[error(transparent)]
    Transition(#[from] IllegalTransition),
    /// A publish target's phase change the lifecycle does not allow.
    #[error("volume {volume}: target {} cannot go from {from:?} to {to:?}", target.display())]
    IllegalTargetTransition {
        volume: String,
        target: PathBuf,
        from: Option<TargetPhase>,
        to: TargetPhase,
    },
    /// A blocking step's worker thread panicked or was cancelled.
    #[error("{what}: worker thread failed: {source}")]
    Worker {
        what: &'static str,
        source: tokio::task::JoinError,
    },

    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Blockdev(#[from] BlockdevError),
    /// The device is there but its data cannot be read: never taken for blank.
    #[error(transparent)]
    Unreadable(#[from] UnreadableError),
    #[error(transparent)]
    Connections(#[from] ConnectionsError),
    #[error(transparent)]
    Id(#[from] IdError),
    #[error(transparent)]
    Nbd(#[from] nbd::Error),
    #[error(transparent)]
    Mount(#[from] mounts::Error),
}
