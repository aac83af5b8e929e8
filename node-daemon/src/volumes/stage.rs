//! NodeStageVolume and NodeUnstageVolume.
//!
//! Staging is a sequence of journaled steps (see [`Phase`]): the record is written before each
//! step, so a call repeated after a crash resumes where the previous one stopped, and an
//! interrupted step is redone only when redoing it is safe. A stage that ends in an error the
//! CO treats as final is undone, since kubelet will never call NodeUnstage for it.
//!
//! Every step that can block on the device (probe, mkfs, mount, grow, umount, flush) runs on
//! the blocking pool (see [`off_runtime`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use mounts::{Filesystem, MountOptions, Probe};
use nbd::sysfs::ProvenDevice;
use nbd::DeviceIndex;

use crate::connections::tcp_pairs;
use crate::error::NodeError;
use crate::ids::{random_uuid, Identifier, VolumeId};
use crate::kernel::Tools;
use crate::node::{export_uri, off_runtime, Node};
use crate::openers::UdevLock;
use crate::record::{Access, AttachedWith, Export, Phase, Record, Target, TargetPhase};
use crate::request::Capability;
use crate::service::codes::{answer, Rpc, Then};
use crate::stage_tls::StageTls;

/// A validated NodeStageVolume.
#[derive(Debug)]
pub struct StageRequest {
    pub volume: VolumeId,
    pub staging_path: PathBuf,
    pub capability: Capability,
    pub export: Export,
    /// TLS material from the request's secrets, if they hold any.
    pub tls: Option<StageTls>,
}

/// Why a NodeStageVolume failed. The four steps wrap what failed inside them; the refusals
/// name what the request clashes with.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// CONNECT (or finding the device of an interrupted one) failed.
    #[error("{source}")]
    Attach {
        volume: String,
        source: Box<NodeError>,
    },
    /// Reading what the device holds failed, or what it holds cannot be staged.
    #[error("{source}")]
    Probe {
        volume: String,
        source: Box<NodeError>,
    },
    #[error("{source}")]
    Format {
        volume: String,
        source: Box<NodeError>,
    },
    /// The staging mount, or growing the filesystem to the device, failed.
    #[error("{source}")]
    Mount {
        volume: String,
        source: Box<NodeError>,
    },
    #[error(
        "export {uri} is already staged on this node as volume {other}; one export can be mounted by one volume at a time"
    )]
    SharedExport { uri: String, other: String },
    #[error("volume {volume} is already staged at {}; unstage it there first", staged.display())]
    StagedElsewhere { volume: String, staged: PathBuf },
    #[error("volume {volume} is already staged from {staged}, not {requested}")]
    OtherExport {
        volume: String,
        staged: String,
        requested: String,
    },
    #[error("volume {volume} is being unstaged")]
    BeingUnstaged { volume: String },
    #[error("staging volume {volume} did not settle after {steps} steps")]
    DidNotSettle { volume: String, steps: usize },
    #[error("volume {volume} has no known export")]
    NoExport { volume: String },
    #[error(
        "the export of volume {volume} is {size} bytes, not a positive multiple of 512: the kernel cannot attach it"
    )]
    ExportSize { volume: String, size: u64 },
    #[error("volume {volume} holds no filesystem and is staged read-only: nothing to mount")]
    ReadOnlyBlank { volume: String },
    #[error("volume {volume} holds {found}, not the requested {wanted}: refusing to reformat it")]
    ForeignFilesystem {
        volume: String,
        found: String,
        wanted: String,
    },
    /// After a crash mid-mkfs, the filesystem there is not provably ours.
    #[error("volume {volume}: refusing to format it again: {source}")]
    FormatAgain {
        volume: String,
        source: mounts::Error,
    },
    #[error(
        "volume {volume} now holds {found}, which this daemon did not write: refusing to format it"
    )]
    FilesystemAppeared { volume: String, found: String },
    #[error("{} already has something else mounted on it", path.display())]
    StagingPathTaken { path: PathBuf },
    #[error("creating {}: {source}", path.display())]
    CreateStagingDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The device vanished between the check and the step that needs it.
    #[error("volume {volume} lost its device mid-stage; retry to attach it again")]
    DeviceLost { volume: String },
}

impl StageError {
    /// The step's error with the step named; an error that already is a stage error is
    /// not wrapped twice.
    fn step(
        wrap: fn(String, Box<NodeError>) -> StageError,
        volume: &str,
    ) -> impl FnOnce(NodeError) -> NodeError + '_ {
        move |e| match e {
            NodeError::Stage(_) => e,
            e => wrap(volume.to_owned(), Box::new(e)).into(),
        }
    }
}

/// Why a NodeUnstageVolume refused.
#[derive(Debug, thiserror::Error)]
pub enum UnstageError {
    #[error("volume {volume} is still published at {targets}: unpublish it first")]
    StillPublished { volume: String, targets: String },
    /// Someone else's mount of the device or of the staging path.
    #[error("{device} of volume {volume} is still mounted at {mounts}: refusing to detach it")]
    ForeignUsers {
        device: DeviceIndex,
        volume: String,
        mounts: String,
    },
    /// A process other than the daemon kept the device open past [`OTHERS_CLOSE_WITHIN`]:
    /// a DISCONNECT would fail its I/O.
    #[error(
        "{device} of volume {volume} is open by {holders}: refusing to detach it under them; \
         NodeUnstage finishes once they close it"
    )]
    OpenElsewhere {
        device: DeviceIndex,
        volume: String,
        holders: String,
    },
}

/// How long NodeUnstage waits for other processes to close the device (udev's probe after
/// kubelet lets go of its loop device takes well under a second).
pub const OTHERS_CLOSE_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Steps staging may take in one call; more means the state keeps changing under us.
const MAX_STEPS: usize = 12;

/// Where one NodeStage's time went, step by step (each with its journal save), for an
/// operator looking at a slow stage and for the claim-to-Running benchmark.
#[derive(Debug, Default)]
struct StepTimes {
    attach: std::time::Duration,
    probe: std::time::Duration,
    format: std::time::Duration,
    mount: std::time::Duration,
}

impl StepTimes {
    fn add(&mut self, step: &Phase, took: std::time::Duration) {
        match step {
            Phase::Attaching => self.attach += took,
            Phase::Attached => self.probe += took,
            Phase::Formatting => self.format += took,
            Phase::Mounting => self.mount += took,
            _ => {}
        }
    }

    /// One line per stage that did something; a repeated NodeStage of a staged volume is quiet.
    fn log(&self, record: &Record) {
        let total = self.attach + self.probe + self.format + self.mount;
        if total.is_zero() {
            return;
        }
        let ms = crate::healer::millis;
        tracing::info!(
            volume = %record.volume_id,
            device = %record.device.map_or_else(String::new, |d| d.to_string()),
            attach_ms = ms(self.attach),
            probe_ms = ms(self.probe),
            format_ms = ms(self.format),
            mount_ms = ms(self.mount),
            "staged"
        );
    }
}

impl Node {
    pub async fn stage(&self, req: StageRequest) -> Result<(), NodeError> {
        let _guard = self.begin_call(&req.volume).await?;
        let existing = match self.record(req.volume.as_str()) {
            // A teardown a crash interrupted is finished before staging anew.
            Some(r) if r.phase() == Phase::Unstaging => {
                self.run_unstage(r).await?;
                None
            }
            // A fenced stage serves no pod any more: it is cleared, and the volume staged
            // anew with this call's grant. One that pods still use is theirs to unpublish.
            Some(r) if r.fenced.is_some() => {
                if !r.targets.is_empty() {
                    return Err(NodeError::Fenced {
                        volume: req.volume.to_string(),
                        targets: crate::node::paths(&r.targets),
                    });
                }
                tracing::info!(volume = %req.volume, "staging a fenced volume anew: clearing what was left of it first");
                self.run_unstage(r).await?;
                None
            }
            other => other,
        };
        // Only what this call began may be undone: a record that was already there may be
        // serving pods (staged and published, in `Mounting` after a lost staging mount or in
        // `Expanding` after a failed expansion), and kubelet repeats NodeStage after a restart.
        // A record still short of a filesystem served nothing, and is undone as well.
        let may_undo = existing.as_ref().is_none_or(|r| {
            r.targets.is_empty()
                && matches!(
                    r.phase(),
                    Phase::Attaching | Phase::Attached | Phase::Formatting
                )
        });
        let record = match existing {
            Some(existing) => self.reconcile_stage_request(existing, &req)?,
            None => {
                self.refuse_shared_export(&req)?;
                let mut export = req.export.clone();
                export.stage_tls =
                    self.keep_stage_tls(req.volume.as_str(), &export, req.tls.as_ref())?;
                // Journaled in step_attach, with its connections, before CONNECT: until then
                // there is nothing in the kernel to find or undo.
                Record::attaching(
                    req.volume.clone(),
                    Identifier::new_attachment(&self.settings.node_id, &req.volume)?,
                    export,
                    req.staging_path.clone(),
                    req.capability.access.clone(),
                    req.capability.mode,
                )
            }
        };
        let volume = record.volume_id.clone();
        let result = self
            .run_stage(record)
            .await
            .map_err(|e| self.fenced_mid_stage(&volume, e));
        if let Err(e) = &result {
            let answer = answer(Rpc::NodeStage, e);
            if may_undo && answer.then == Then::RollBack {
                // kubelet takes this answer as final and will never call NodeUnstage.
                self.undo_failed_stage(&volume, answer.code).await;
            } else {
                self.roll_back_failed_attach(&volume)?;
            }
        }
        result
    }

    /// A step that failed because the healer fenced the volume meanwhile (its redial was
    /// refused: the volume was unpublished from this node mid-call) is told as the fence. A
    /// read error it met is then no outage to retry but the end of this publication, and
    /// the stage is undone like any final failure.
    fn fenced_mid_stage(&self, volume: &VolumeId, e: NodeError) -> NodeError {
        let fenced = self
            .record(volume.as_str())
            .is_some_and(|r| r.fenced.is_some());
        if !fenced
            || matches!(
                e,
                NodeError::Fenced { .. } | NodeError::FencedMidStage { .. }
            )
        {
            return e;
        }
        NodeError::FencedMidStage {
            volume: volume.to_string(),
            source: Box::new(e),
        }
    }

    /// A stage that failed before any device carried its identifier leaves no record behind.
    fn roll_back_failed_attach(&self, volume: &str) -> Result<(), NodeError> {
        let Some(record) = self.record(volume) else {
            return Ok(());
        };
        if record.phase() == Phase::Attaching
            && record.targets.is_empty()
            && self.kernel.find(&record.identifier)?.is_none()
        {
            self.forget(volume)?;
        }
        Ok(())
    }

    /// Undoes a stage that ended in a final error: unmounts what it mounted, disconnects the
    /// proven device, forgets the record. The original error is what the CO is told; an
    /// undo that fails leaves the record (for the next call or `status`) and is logged.
    async fn undo_failed_stage(&self, volume: &str, code: tonic::Code) {
        let Some(mut record) = self.record(volume) else {
            return;
        };
        if !record.targets.is_empty() {
            tracing::warn!(%volume, ?code, "stage failed for good, but the volume is published: left as it is");
            return;
        }
        tracing::warn!(%volume, ?code, "stage failed for good; undoing what it did");
        let undone = match self.advance(&mut record, Phase::Unstaging) {
            Ok(()) => self.run_unstage(record).await,
            Err(e) => Err(e),
        };
        if let Err(e) = undone {
            tracing::error!(%volume, error = %e, "could not undo a failed stage; NodeStage or NodeUnstage will retry");
        }
    }

    /// Two volume ids naming one export (static PVs) must not both be used on this node: two
    /// mounts of one filesystem from two devices corrupt it, and a filesystem mounted while
    /// the same disk is written raw elsewhere on the node is no better. One export, one
    /// volume per node; several nodes share a block volume under one id (live migration).
    fn refuse_shared_export(&self, req: &StageRequest) -> Result<(), NodeError> {
        let clash = self.records().into_iter().find(|r| {
            r.volume_id != req.volume && r.export.as_ref().is_some_and(|e| e.uri == req.export.uri)
        });
        match clash {
            Some(other) => Err(StageError::SharedExport {
                uri: req.export.uri.clone(),
                other: other.volume_id.to_string(),
            }
            .into()),
            None => Ok(()),
        }
    }

    /// Checks a repeated NodeStage against what is staged: same path, capability and export
    /// is the idempotent case; anything else is ALREADY_EXISTS.
    fn reconcile_stage_request(
        &self,
        mut record: Record,
        req: &StageRequest,
    ) -> Result<Record, NodeError> {
        if record.rebuilt {
            self.adopt_co_view(&mut record, &req.staging_path, &req.capability)?;
        }
        if let Some(staged) = &record.staging_path {
            if staged != &req.staging_path {
                return Err(StageError::StagedElsewhere {
                    volume: req.volume.to_string(),
                    staged: staged.clone(),
                }
                .into());
            }
        }
        if record.access != req.capability.access || record.mode != req.capability.mode {
            return Err(NodeError::OtherCapability {
                volume: req.volume.to_string(),
                access: record.access,
                mode: record.mode,
            });
        }
        match &record.export {
            Some(e) if e.uri != req.export.uri => {
                return Err(StageError::OtherExport {
                    volume: req.volume.to_string(),
                    staged: e.uri.clone(),
                    requested: req.export.uri.clone(),
                }
                .into())
            }
            Some(e) => {
                // The profile and the secrets' material say what the next dial reads, and the
                // grant what it proves, nothing attached now: the CO's current word is taken
                // (a controller upgraded to name them, a rotated certificate), if this node
                // can dial with it.
                let mut wanted = req.export.clone();
                wanted.stage_tls = e.stage_tls.clone();
                wanted.stage_tls =
                    self.keep_stage_tls(req.volume.as_str(), &wanted, req.tls.as_ref())?;
                if (&wanted.tls_profile, &wanted.grant, &wanted.stage_tls)
                    != (&e.tls_profile, &e.grant, &e.stage_tls)
                {
                    self.dial_options(&wanted)?;
                    if let Some(e) = record.export.as_mut() {
                        e.tls_profile = wanted.tls_profile;
                        e.grant = wanted.grant;
                        e.stage_tls = wanted.stage_tls;
                    }
                    self.save(&record)?;
                }
            }
            None => {
                // A record rebuilt from kernel facts learns its export here.
                let mut export = req.export.clone();
                export.stage_tls =
                    self.keep_stage_tls(req.volume.as_str(), &export, req.tls.as_ref())?;
                record.export = Some(export);
                self.save(&record)?;
            }
        }
        Ok(record)
    }

    /// A record rebuilt from kernel facts guessed its staging path and capability; the CO
    /// knows them. A guessed staging path that is really a pod's mount becomes a target, so
    /// it is unpublished (not pulled away) before the volume can be unstaged.
    pub(crate) fn adopt_co_view(
        &self,
        record: &mut Record,
        staging_path: &Path,
        capability: &Capability,
    ) -> Result<(), NodeError> {
        if let Some(guess) = record.staging_path.take() {
            if guess != staging_path && self.is_mount_point(&guess)? {
                record
                    .targets
                    .entry(guess)
                    .or_insert(Target::published(false));
            }
        }
        record.targets.remove(staging_path);
        record.staging_path = Some(staging_path.to_owned());
        record.access = capability.access.clone();
        record.mode = capability.mode;
        record.rebuilt = false;
        self.save(record)
    }

    /// Drives a record to `Staged`, one journaled step at a time.
    pub(crate) async fn run_stage(&self, mut record: Record) -> Result<(), NodeError> {
        // An expansion whose device was lost (a reboot) is finished once staged again.
        let mut grow_to = None;
        let mut took = StepTimes::default();
        // The step this call ran last: what it proved need not be checked again by the next
        // (a probe that found the device blank, a format at the device's full size).
        let mut previous: Option<Phase> = None;
        for _ in 0..MAX_STEPS {
            let device = if matches!(
                record.phase(),
                Phase::Attached | Phase::Formatting | Phase::Mounting | Phase::Expanding { .. }
            ) {
                Some(self.proven_device(&record)?)
            } else {
                None
            };
            if let Some(Some(moved)) = &device {
                // Journaled before the step acts on it: a step's end never saves a stale index.
                self.follow_device_index(&mut record, moved)?;
            }
            if let Some(None) = device {
                // Node rebooted or the kernel dropped the device mid-stage: attach again, then
                // probe what the volume holds as if for the first time.
                tracing::warn!(volume = %record.volume_id, phase = ?record.phase(), "device lost mid-stage; attaching again");
                if let Phase::Expanding { to_bytes } = record.phase() {
                    grow_to = Some(to_bytes);
                }
                record.device = None;
                self.advance(&mut record, Phase::Attaching)?;
            }
            let volume = record.volume_id.to_string();
            let (step, began) = (record.phase(), std::time::Instant::now());
            let next = match record.phase() {
                Phase::Attaching => {
                    self.step_attach(&mut record)
                        .await
                        .map_err(StageError::step(
                            |volume, source| StageError::Attach { volume, source },
                            &volume,
                        ))?
                }
                Phase::Attached => self
                    .step_probe(&mut record)
                    .await
                    .map_err(StageError::step(
                        |volume, source| StageError::Probe { volume, source },
                        &volume,
                    ))?,
                // Formatting right after this call's probe: the probe found the device blank.
                Phase::Formatting => self
                    .step_format(&record, previous == Some(Phase::Attached))
                    .await
                    .map_err(StageError::step(
                        |volume, source| StageError::Format { volume, source },
                        &volume,
                    ))?,
                // Mounting right after this call's format: mkfs just ran.
                Phase::Mounting => self
                    .step_mount(&record, previous == Some(Phase::Formatting))
                    .await
                    .map_err(StageError::step(
                        |volume, source| StageError::Mount { volume, source },
                        &volume,
                    ))?,
                Phase::Expanding { .. } => {
                    // The volume is staged whatever becomes of its expansion: one that fails
                    // here leaves it at its device's size, for the CO's next NodeExpand.
                    if let Err(e) = self.run_expand(record.clone()).await {
                        self.give_up_expansion(&record.volume_id, &e)?;
                    }
                    record = self.record(&volume).ok_or_else(|| StageError::DeviceLost {
                        volume: volume.clone(),
                    })?;
                    continue;
                }
                Phase::Staged => match self.check_staged(&mut record)? {
                    Some(repair) => repair,
                    None => match grow_to.take() {
                        Some(to_bytes) => Phase::Expanding { to_bytes },
                        None => {
                            took.log(&record);
                            return Ok(());
                        }
                    },
                },
                Phase::Unstaging => {
                    return Err(StageError::BeingUnstaged {
                        volume: record.volume_id.to_string(),
                    }
                    .into())
                }
            };
            self.advance(&mut record, next)?;
            took.add(&step, began.elapsed());
            previous = Some(step);
        }
        Err(StageError::DidNotSettle {
            volume: record.volume_id.to_string(),
            steps: MAX_STEPS,
        }
        .into())
    }

    /// The device of an attach a crash interrupted, if its CONNECT reached the kernel (the
    /// identifier tells): the record learns its index and size. The one step of NodeStage and
    /// recovery for an interrupted attach; the caller journals the phase that follows.
    pub(crate) fn find_interrupted_attach(
        &self,
        record: &mut Record,
    ) -> Result<Option<DeviceIndex>, NodeError> {
        let Some(found) = self.kernel.find(&record.identifier)? else {
            return Ok(None);
        };
        tracing::info!(volume = %record.volume_id, device = %found.index(), "found the device of an interrupted attach");
        record.device = Some(found.index());
        record.size_bytes = Some(self.kernel.size_bytes(found.index())?);
        Ok(Some(found.index()))
    }

    /// A device re-created under another number (its identifier proves it is the volume's):
    /// the record follows it, journaled. Returns whether the index changed. The one step of
    /// NodeStage and recovery for a moved device.
    pub(crate) fn follow_device_index(
        &self,
        record: &mut Record,
        device: &ProvenDevice,
    ) -> Result<bool, NodeError> {
        if record.device == Some(device.index()) {
            return Ok(false);
        }
        tracing::warn!(volume = %record.volume_id, device = %device.index(), "device index changed");
        record.device = Some(device.index());
        self.save(record)?;
        Ok(true)
    }

    /// CONNECT, unless the crash we are recovering from came after it: the identifier tells.
    async fn step_attach(&self, record: &mut Record) -> Result<Phase, NodeError> {
        let export = record.export.clone().ok_or_else(|| StageError::NoExport {
            volume: record.volume_id.to_string(),
        })?;
        // A record not yet journaled has a fresh identifier no device can carry: no scan.
        let journaled = self.record(&record.volume_id).is_some();
        let found = if journaled {
            self.find_interrupted_attach(record)?
        } else {
            None
        };
        if found.is_none() {
            {
                self.clear_staging_path(record).await?;
                let uri = export_uri(&export)?;
                let mut opts = self.attach_options(record.identifier.clone(), &export)?;
                opts.read_only = record.mode.read_only();
                let began = std::time::Instant::now();
                let dialed = self.kernel.dial(&uri, &opts.dial).await?;
                let dialed_at = began.elapsed();
                check_export_size(&record.volume_id, dialed.info.size)?;
                // Written ahead: the record, and the connections' addresses (what lets a later
                // daemon replace them), are journaled before the kernel gets the sockets.
                record.tcp = tcp_pairs(&dialed.sockets);
                self.save_with_connections(record)?;
                let journaled_at = began.elapsed();
                fail::fail_point!("stage-before-connect");
                crate::failpoints::pause("stage-before-connect").await;
                let attached = self
                    .kernel
                    .attach(dialed, &opts)
                    .await
                    .map_err(no_free_device)?;
                record.tls = attached.info.tls.map(|t| t.to_string());
                // Where an attach's time went, for an operator looking at a slow one.
                tracing::info!(
                    volume = %record.volume_id,
                    device = %attached.device.index(),
                    connections = attached.sockets.len(),
                    encryption = record.tls.as_deref().unwrap_or("none"),
                    dial_ms = crate::healer::millis(dialed_at),
                    journal_ms = crate::healer::millis(journaled_at - dialed_at),
                    connect_ms = crate::healer::millis(began.elapsed() - journaled_at),
                    "attached"
                );
                record.device = Some(attached.device.index());
                record.size_bytes = Some(attached.info.size);
                record.attached_with = Some(AttachedWith {
                    flags: attached.info.flags.bits(),
                    connections: attached.sockets.len(),
                });
                self.held.attached(
                    &record.volume_id,
                    record.identifier.as_str(),
                    attached.sockets,
                );
            }
        }
        fail::fail_point!("stage-after-connect");
        // A block volume has nothing to probe, format or mount: staged once attached.
        Ok(if record.access.is_block() {
            Phase::Staged
        } else {
            Phase::Attached
        })
    }

    /// Before a filesystem volume gets a new device, its staging path must be free: a mount
    /// there that a lost device of this volume left behind (an nbd that carries no identifier
    /// any more) is removed; anything else mounted there is refused before anything is
    /// attached, so a refusal leaves no device behind.
    async fn clear_staging_path(&self, record: &Record) -> Result<(), NodeError> {
        let (Access::Mount { .. }, Some(staging)) = (&record.access, &record.staging_path) else {
            return Ok(());
        };
        if self.volume_mounted_at(record, staging)? {
            tracing::warn!(volume = %record.volume_id, staging = %staging.display(), "unmounting what a lost device left at the staging path");
            self.unmount_ours_at(record, staging).await?;
        }
        if self.is_mount_point(staging)? {
            return Err(StageError::StagingPathTaken {
                path: staging.clone(),
            }
            .into());
        }
        Ok(())
    }

    /// Unmounts every layer at `path` that is this volume's (see [`Node::volume_mounted_at`]),
    /// from the top, and stops at the first that is not.
    async fn unmount_ours_at(&self, record: &Record, path: &Path) -> Result<(), NodeError> {
        while self.volume_mounted_at(record, path)? {
            let (path, host) = (path.to_owned(), Arc::clone(&self.mounts));
            if !off_runtime("unmount", move || Ok(host.unmount(&path)?)).await? {
                break; // the kernel says nothing is mounted there after all
            }
        }
        Ok(())
    }

    /// Decides whether the device needs a filesystem. Never formats anything not blank. The
    /// UUID the new filesystem will carry is chosen here and journaled with `Formatting`.
    async fn step_probe(&self, record: &mut Record) -> Result<Phase, NodeError> {
        let Access::Mount { fs, .. } = &record.access else {
            return Ok(Phase::Staged);
        };
        let dev = self.kernel.dev_path(self.require_device(record)?);
        let tools = Arc::clone(&self.tools);
        let probed = off_runtime("probe", move || tools.probe(&dev));
        match probed.await? {
            Probe::Blank if record.mode.read_only() => Err(StageError::ReadOnlyBlank {
                volume: record.volume_id.to_string(),
            }
            .into()),
            Probe::Blank => {
                record.fs_uuid = Some(random_uuid()?);
                Ok(Phase::Formatting)
            }
            Probe::Filesystem(found) if &found == fs => Ok(Phase::Mounting),
            Probe::Filesystem(found) | Probe::Other(found) => Err(StageError::ForeignFilesystem {
                volume: record.volume_id.to_string(),
                found,
                wanted: fs.clone(),
            }
            .into()),
        }
    }

    /// mkfs with the journaled UUID. Reached only for a device found blank; after a crash
    /// mid-mkfs the format is redone only if the filesystem there carries exactly our UUID.
    /// Any other filesystem appeared since (the volume was used elsewhere meanwhile) and may
    /// hold data: refused. `proven_blank`: this call's probe has just read the device's
    /// edges and found it blank, so it is not probed twice (mkfs's own check still runs); a
    /// format resumed by a later call or after a restart always probes first.
    async fn step_format(&self, record: &Record, proven_blank: bool) -> Result<Phase, NodeError> {
        let Access::Mount { fs, .. } = &record.access else {
            return Ok(Phase::Staged);
        };
        let fs: Filesystem = fs.parse()?;
        let Some(uuid) = record.fs_uuid.clone() else {
            // A record journaled before UUIDs were: probe again, and format a blank device.
            return Ok(Phase::Attached);
        };
        let dev = self.kernel.dev_path(self.require_device(record)?);
        let volume = record.volume_id.to_string();
        fail::fail_point!("stage-before-mkfs");
        let tools = Arc::clone(&self.tools);
        off_runtime("mkfs", move || {
            let found = if proven_blank {
                Probe::Blank
            } else {
                tools.probe(&dev)?
            };
            format_after(&*tools, &dev, found, fs, &uuid, volume)
        })
        .await?;
        fail::fail_point!("stage-after-mkfs");
        Ok(Phase::Mounting)
    }

    /// Mounts the filesystem at the staging path (if not already there) and grows it to the
    /// device: a volume restored into a larger one gets its space here. `formatted`: this
    /// call has just made the filesystem at the device's size, so there is nothing to grow.
    async fn step_mount(&self, record: &Record, formatted: bool) -> Result<Phase, NodeError> {
        let Access::Mount { fs, .. } = &record.access else {
            return Ok(Phase::Staged);
        };
        let fs: Filesystem = fs.parse()?;
        let device = self.require_device(record)?;
        self.mount_staging(record, device).await?;
        fail::fail_point!("stage-after-mount");
        if !record.mode.read_only() && !formatted {
            let dev = self.kernel.dev_path(device);
            let staging = staging_path(record)?.to_owned();
            let tools = Arc::clone(&self.tools);
            off_runtime("grow", move || Ok(tools.grow(fs, &dev, &staging)?)).await?;
        }
        Ok(Phase::Staged)
    }

    /// Mounts the volume's filesystem at its staging path unless it is already there: the one
    /// routine of stage, publish and recovery. Returns whether it mounted.
    pub(crate) async fn mount_staging(
        &self,
        record: &Record,
        device: DeviceIndex,
    ) -> Result<bool, NodeError> {
        let Access::Mount { fs, flags } = &record.access else {
            return Ok(false);
        };
        let dev = self.kernel.dev_path(device);
        let staging = staging_path(record)?.to_owned();
        if self.mounted_from(device, &staging)? {
            return Ok(false);
        }
        if self.mounts.table()?.is_mount_point(&staging) {
            return Err(StageError::StagingPathTaken { path: staging }.into());
        }
        let fs: Filesystem = fs.parse()?;
        let mut opts = MountOptions::parse(flags)?;
        if record.mode.read_only() {
            opts.flags |= nix::mount::MsFlags::MS_RDONLY;
        }
        if fs == Filesystem::Xfs && !opts.data.iter().any(|o| o == "nouuid") {
            // Clones and restores carry their source's UUID; XFS refuses a second mount of
            // one UUID unless told not to check.
            opts.data.push("nouuid".into());
        }
        let host = Arc::clone(&self.mounts);
        off_runtime("mount", move || {
            std::fs::create_dir_all(&staging).map_err(|source| StageError::CreateStagingDir {
                path: staging.clone(),
                source,
            })?;
            Ok(host.mount_filesystem(&dev, &staging, fs.name(), &opts)?)
        })
        .await?;
        Ok(true)
    }

    /// For a staged volume: is everything still in place? Returns the phase to go back to
    /// when something must be repaired (a lost device, a lost staging mount).
    fn check_staged(&self, record: &mut Record) -> Result<Option<Phase>, NodeError> {
        let Some(device) = self.proven_device(record)? else {
            tracing::warn!(volume = %record.volume_id, "device is gone; attaching again");
            record.device = None;
            return Ok(Some(Phase::Attaching));
        };
        self.follow_device_index(record, &device)?;
        if matches!(record.access, Access::Mount { .. })
            && !self.mounted_from(device.index(), staging_path(record)?)?
        {
            tracing::warn!(volume = %record.volume_id, "staging mount is gone; mounting again");
            return Ok(Some(Phase::Mounting));
        }
        Ok(None)
    }

    pub async fn unstage(&self, volume: &VolumeId, staging_path: &Path) -> Result<(), NodeError> {
        let _guard = self.begin_call(volume).await?;
        let Some(mut record) = self.record(volume.as_str()) else {
            return Ok(());
        };
        if record.rebuilt {
            let capability = Capability {
                access: record.access.clone(),
                mode: record.mode,
            };
            self.adopt_co_view(&mut record, staging_path, &capability)?;
        }
        if let Some(staged) = &record.staging_path {
            if staged != staging_path {
                return Err(NodeError::WrongStagingPath {
                    volume: volume.to_string(),
                    staged: staged.clone(),
                    asked: staging_path.to_owned(),
                });
            }
        }
        self.drop_stale_targets(&mut record)?;
        let published: BTreeMap<_, _> = record
            .targets
            .iter()
            .filter(|(_, t)| t.phase() != TargetPhase::Unpublishing)
            .map(|(p, t)| (p.clone(), *t))
            .collect();
        if !published.is_empty() {
            return Err(UnstageError::StillPublished {
                volume: volume.to_string(),
                targets: crate::node::paths(&published),
            }
            .into());
        }
        self.refuse_foreign_users(&record)?;
        record
            .staging_path
            .get_or_insert_with(|| staging_path.to_owned());
        self.advance(&mut record, Phase::Unstaging)?;
        fail::fail_point!("unstage-after-journal");
        self.run_unstage(record).await
    }

    /// Publish targets the journal lists but that nothing is mounted on any more (a reboot,
    /// kubelet's orphan cleanup) are forgotten: they would block unstage forever.
    fn drop_stale_targets(&self, record: &mut Record) -> Result<(), NodeError> {
        let table = self.mounts.table()?;
        let stale: Vec<PathBuf> = record
            .targets
            .keys()
            .filter(|t| !table.is_mount_point(t))
            .cloned()
            .collect();
        if stale.is_empty() {
            return Ok(());
        }
        for t in &stale {
            tracing::warn!(volume = %record.volume_id, target = %t.display(), "publish target is no longer mounted; forgetting it");
        }
        self.drop_targets(record, &stale)
    }

    /// Teardown, idempotent: staging unmount, flush, DISCONNECT of the proven device, forget.
    /// The unmount and flush wait for a dead link to be healed (the healer needs no lock this
    /// call holds), so dirty data reaches the export before the device goes.
    pub(crate) async fn run_unstage(&self, record: Record) -> Result<(), NodeError> {
        if let (Access::Mount { .. }, Some(staging)) = (&record.access, &record.staging_path) {
            self.unmount_ours_at(&record, staging).await?;
        }
        fail::fail_point!("unstage-after-unmount");
        if let Some(device) = self.proven_device(&record)? {
            // A fenced device is disconnected: a flush can only fail, and nothing it held may
            // reach the export anyway.
            if record.access.is_block() && record.fenced.is_none() {
                let dev = self.kernel.dev_path(device.index());
                let tools = Arc::clone(&self.tools);
                off_runtime("flush", move || Ok(tools.flush(&dev)?)).await?;
            }
            let udev_lock = self.wait_unused(&record, &device).await?;
            crate::failpoints::pause("unstage-before-disconnect").await;
            self.disconnect(&record.volume_id, &device, udev_lock)
                .await?;
            tracing::info!(volume = %record.volume_id, device = %device.index(), "detached");
        }
        fail::fail_point!("unstage-after-disconnect");
        self.forget(&record.volume_id)
    }

    /// DISCONNECT fails every request in flight, whoever sent it: wait until nothing but this
    /// daemon has the device open and udev's probes are done (see `openers.rs`).
    async fn wait_unused(
        &self,
        record: &Record,
        device: &ProvenDevice,
    ) -> Result<UdevLock, NodeError> {
        let dev = self.kernel.dev_path(device.index());
        let tools = Arc::clone(&self.tools);
        let waited = off_runtime("wait for other users to close", move || {
            Ok(tools.wait_unused(&dev, OTHERS_CLOSE_WITHIN))
        })
        .await?;
        waited.map_err(|holders| {
            UnstageError::OpenElsewhere {
                device: device.index(),
                volume: record.volume_id.to_string(),
                holders: holders.join(", "),
            }
            .into()
        })
    }

    /// Unstage must not pull the device from under a mount it did not make (a bind mount
    /// someone else took of the staging path or the device).
    fn refuse_foreign_users(&self, record: &Record) -> Result<(), NodeError> {
        let Some(device) = self.proven_device(record)? else {
            return Ok(());
        };
        let table = self.mounts.table()?;
        let mut foreign: Vec<String> = Vec::new();
        if let Some((major, minor)) = self.kernel.device_numbers(device.index()) {
            foreign.extend(
                table
                    .of_device(major, minor)
                    .filter(|m| !record.is_staging_path(&m.mount_point))
                    .map(|m| m.mount_point.display().to_string()),
            );
        }
        foreign.extend(
            table
                .of_device_node(&device.index().name())
                .map(|m| m.mount_point.display().to_string()),
        );
        if foreign.is_empty() {
            Ok(())
        } else {
            Err(UnstageError::ForeignUsers {
                device: device.index(),
                volume: record.volume_id.to_string(),
                mounts: foreign.join(", "),
            }
            .into())
        }
    }

    /// The device of a record mid-stage. [`Node::run_stage`] has just checked it exists; if
    /// it vanished since, the call fails retriably and the next one attaches again.
    fn require_device(&self, record: &Record) -> Result<DeviceIndex, NodeError> {
        self.proven_device(record)?
            .map(|d| d.index())
            .ok_or_else(|| {
                StageError::DeviceLost {
                    volume: record.volume_id.to_string(),
                }
                .into()
            })
    }

    /// Whether the top mount at `path` is this volume's: from its proven device, or, when the
    /// device is gone, from an nbd device that is free now (no identifier, nobody connected:
    /// a mount the lost device left behind). Anything else mounted there, a device another
    /// tool attached included, is not ours to remove.
    fn volume_mounted_at(&self, record: &Record, path: &Path) -> Result<bool, NodeError> {
        let table = self.mounts.table()?;
        let Some(top) = table.at(path).last() else {
            return Ok(false);
        };
        if let Some(device) = self.proven_device(record)? {
            return Ok(self.kernel.device_numbers(device.index()) == Some((top.major, top.minor)));
        }
        let stale = top.source.starts_with("/dev/nbd")
            && top
                .source
                .parse::<DeviceIndex>()
                .is_ok_and(|index| matches!(self.kernel.is_free(index), Ok(true)));
        Ok(stale)
    }

    /// Whether the filesystem on `device` is mounted at `path`.
    pub(crate) fn mounted_from(&self, device: DeviceIndex, path: &Path) -> Result<bool, NodeError> {
        let Some((major, minor)) = self.kernel.device_numbers(device) else {
            return Ok(false);
        };
        Ok(self
            .mounts
            .table()?
            .at(path)
            .any(|m| m.major == major && m.minor == minor))
    }

    fn is_mount_point(&self, path: &Path) -> Result<bool, NodeError> {
        Ok(self.mounts.table()?.is_mount_point(path))
    }
}

/// The format decision on what the probe found: mkfs on a blank device, a redo of our own
/// interrupted format, a refusal for anything else.
fn format_after(
    tools: &dyn Tools,
    dev: &Path,
    found: Probe,
    fs: Filesystem,
    uuid: &str,
    volume: String,
) -> Result<(), NodeError> {
    match found {
        Probe::Blank => Ok(tools.make_filesystem(dev, fs, uuid)?),
        Probe::Filesystem(found) if found == fs.name() => tools
            .redo_interrupted_format(dev, fs, uuid)
            .map_err(|source| StageError::FormatAgain { volume, source }.into()),
        Probe::Filesystem(found) | Probe::Other(found) => {
            Err(StageError::FilesystemAppeared { volume, found }.into())
        }
    }
}

/// The kernel takes sizes in whole logical blocks: an export whose size is not a multiple of
/// 512 bytes would be cut short or refused deep in CONNECT. Said plainly instead.
fn check_export_size(volume: &str, size: u64) -> Result<(), NodeError> {
    if !kernel_takes_size(size) {
        return Err(StageError::ExportSize {
            volume: volume.to_owned(),
            size,
        }
        .into());
    }
    Ok(())
}

/// Whether the kernel can give a device `size` bytes: a positive number of whole 512-byte
/// logical blocks. Checked before CONNECT and before an expansion's resize.
pub(crate) fn kernel_takes_size(size: u64) -> bool {
    size > 0 && size.is_multiple_of(512)
}

/// CONNECT for "any free device" fails with ENOSPC or ENODEV when every device is taken
/// (and the kernel caps how many netlink creates): the node is full, not broken.
fn no_free_device(e: nbd::Error) -> NodeError {
    match e.errno() {
        Some(libc::ENOSPC) | Some(libc::ENODEV) | Some(libc::EMFILE) => {
            NodeError::NoFreeDevice { source: e }
        }
        _ => NodeError::Nbd(e),
    }
}

pub(crate) fn staging_path(record: &Record) -> Result<&Path, NodeError> {
    record
        .staging_path
        .as_deref()
        .ok_or_else(|| NodeError::StagingPathUnknown {
            volume: record.volume_id.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::fake::{check_table, Cell, Facts, Row, GIB, MOUNTED, UNMOUNTED};
    use Facts::*;
    use Phase::*;

    const EXPANDING: Phase = Expanding { to_bytes: 2 * GIB };

    /// A NodeStage (repeated, or after a crash) of a volume journaled in the cell's phase:
    /// the answer, the verbs it took, and the journal afterwards.
    async fn stage_in(phase: Phase, facts: Facts, mounted: bool) -> (String, String, String) {
        let cell = Cell::new(phase, facts, mounted);
        cell.node.set_ready();
        let r = &cell.record;
        let req = StageRequest {
            volume: r.volume_id.clone(),
            staging_path: r.staging_path.clone().unwrap(),
            capability: Capability {
                access: r.access.clone(),
                mode: r.mode,
            },
            export: r.export.clone().unwrap(),
            tls: None,
        };
        let said = match cell.node.stage(req).await {
            Ok(()) => "ok".to_owned(),
            Err(e) => format!("{:?}: {e}", answer(Rpc::NodeStage, &e).code),
        };
        let calls = cell.host.take_calls().join(", ");
        (
            cell.stable(&said),
            cell.stable(&calls),
            cell.journaled()
                .replace(&format!("{EXPANDING:?}"), "Expanding"),
        )
    }

    /// NodeStage for each phase × kernel facts × staging mount. The device is `nbd1` in
    /// the journal (none while `Attaching`); "Moved" finds it at `nbd3`; a new attach takes
    /// `nbd0`. A staging mount a lost device left (an nbd that carries nothing) is removed
    /// before a new device is attached; one from another node's device is refused before
    /// anything is attached. A moved device is journaled before any step acts on it.
    #[tokio::test]
    async fn stage_decisions() {
        #[rustfmt::skip]
        const TABLE: &[Row] = &[
        (Attaching, Proven, MOUNTED, "ok", "probe, mkfs", "Staged /dev/nbd1"),
        (Attaching, Proven, UNMOUNTED, "ok", "probe, mkfs, mount nbd1 /staging", "Staged /dev/nbd1"),
        (Attaching, Absent, MOUNTED, "ok", "unmount /staging, dial, attach /dev/nbd0, probe, mkfs, mount nbd0 /staging", "Staged /dev/nbd0"),
        (Attaching, Absent, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mkfs, mount nbd0 /staging", "Staged /dev/nbd0"),
        (Attaching, Foreign, MOUNTED, "FailedPrecondition: /staging already has something else mounted on it", "", "none"),
        (Attaching, Foreign, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mkfs, mount nbd0 /staging", "Staged /dev/nbd0"),
        (Attaching, Moved, MOUNTED, "ok", "probe, mkfs", "Staged /dev/nbd3"),
        (Attaching, Moved, UNMOUNTED, "ok", "probe, mkfs, mount nbd3 /staging", "Staged /dev/nbd3"),
        (Attached, Proven, MOUNTED, "ok", "probe, mkfs", "Staged /dev/nbd1"),
        (Attached, Proven, UNMOUNTED, "ok", "probe, mkfs, mount nbd1 /staging", "Staged /dev/nbd1"),
        (Attached, Absent, MOUNTED, "ok", "unmount /staging, dial, attach /dev/nbd0, probe, mkfs, mount nbd0 /staging", "Staged /dev/nbd0"),
        (Attached, Absent, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mkfs, mount nbd0 /staging", "Staged /dev/nbd0"),
        (Attached, Foreign, MOUNTED, "FailedPrecondition: /staging already has something else mounted on it", "", "none"),
        (Attached, Foreign, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mkfs, mount nbd0 /staging", "Staged /dev/nbd0"),
        (Attached, Moved, MOUNTED, "ok", "probe, mkfs", "Staged /dev/nbd3"),
        (Attached, Moved, UNMOUNTED, "ok", "probe, mkfs, mount nbd3 /staging", "Staged /dev/nbd3"),
        (Formatting, Proven, MOUNTED, "ok", "probe, mkfs", "Staged /dev/nbd1"),
        (Formatting, Proven, UNMOUNTED, "ok", "probe, mkfs, mount nbd1 /staging", "Staged /dev/nbd1"),
        (Formatting, Absent, MOUNTED, "ok", "unmount /staging, dial, attach /dev/nbd0, probe, mkfs, mount nbd0 /staging", "Staged /dev/nbd0"),
        (Formatting, Absent, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mkfs, mount nbd0 /staging", "Staged /dev/nbd0"),
        (Formatting, Foreign, MOUNTED, "FailedPrecondition: /staging already has something else mounted on it", "", "none"),
        (Formatting, Foreign, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mkfs, mount nbd0 /staging", "Staged /dev/nbd0"),
        (Formatting, Moved, MOUNTED, "ok", "probe, mkfs", "Staged /dev/nbd3"),
        (Formatting, Moved, UNMOUNTED, "ok", "probe, mkfs, mount nbd3 /staging", "Staged /dev/nbd3"),
        (Mounting, Proven, MOUNTED, "ok", "grow", "Staged /dev/nbd1"),
        (Mounting, Proven, UNMOUNTED, "ok", "mount nbd1 /staging, grow", "Staged /dev/nbd1"),
        (Mounting, Absent, MOUNTED, "ok", "unmount /staging, dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Mounting, Absent, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Mounting, Foreign, MOUNTED, "FailedPrecondition: /staging already has something else mounted on it", "", "none"),
        (Mounting, Foreign, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Mounting, Moved, MOUNTED, "ok", "grow", "Staged /dev/nbd3"),
        (Mounting, Moved, UNMOUNTED, "ok", "mount nbd3 /staging, grow", "Staged /dev/nbd3"),
        (Staged, Proven, MOUNTED, "ok", "", "Staged /dev/nbd1"),
        (Staged, Proven, UNMOUNTED, "ok", "mount nbd1 /staging, grow", "Staged /dev/nbd1"),
        (Staged, Absent, MOUNTED, "ok", "unmount /staging, dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Staged, Absent, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Staged, Foreign, MOUNTED, "FailedPrecondition: /staging already has something else mounted on it", "", "none"),
        (Staged, Foreign, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Staged, Moved, MOUNTED, "ok", "", "Staged /dev/nbd3"),
        (Staged, Moved, UNMOUNTED, "ok", "mount nbd3 /staging, grow", "Staged /dev/nbd3"),
        (EXPANDING, Proven, MOUNTED, "ok", "thaw, freeze, resize /dev/nbd1 2147483648, thaw, grow", "Staged /dev/nbd1"),
        (EXPANDING, Proven, UNMOUNTED, "ok", "resize /dev/nbd1 2147483648, grow, mount nbd1 /staging, grow", "Staged /dev/nbd1"),
        (EXPANDING, Absent, MOUNTED, "ok", "unmount /staging, dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow, thaw, grow", "Staged /dev/nbd0"),
        (EXPANDING, Absent, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow, thaw, grow", "Staged /dev/nbd0"),
        (EXPANDING, Foreign, MOUNTED, "FailedPrecondition: /staging already has something else mounted on it", "", "none"),
        (EXPANDING, Foreign, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow, thaw, grow", "Staged /dev/nbd0"),
        (EXPANDING, Moved, MOUNTED, "ok", "thaw, freeze, resize /dev/nbd3 2147483648, thaw, grow", "Staged /dev/nbd3"),
        (EXPANDING, Moved, UNMOUNTED, "ok", "resize /dev/nbd3 2147483648, grow, mount nbd3 /staging, grow", "Staged /dev/nbd3"),
        (Unstaging, Proven, MOUNTED, "ok", "unmount /staging, disconnect /dev/nbd1, dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Unstaging, Proven, UNMOUNTED, "ok", "disconnect /dev/nbd1, dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Unstaging, Absent, MOUNTED, "ok", "unmount /staging, dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Unstaging, Absent, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Unstaging, Foreign, MOUNTED, "FailedPrecondition: /staging already has something else mounted on it", "", "none"),
        (Unstaging, Foreign, UNMOUNTED, "ok", "dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Unstaging, Moved, MOUNTED, "ok", "unmount /staging, disconnect /dev/nbd3, dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        (Unstaging, Moved, UNMOUNTED, "ok", "disconnect /dev/nbd3, dial, attach /dev/nbd0, probe, mount nbd0 /staging, grow", "Staged /dev/nbd0"),
        ];
        check_table(TABLE, stage_in).await;
    }

    /// NodeUnstage of a volume whose device another process still has open is refused with
    /// FAILED_PRECONDITION naming that process, before any DISCONNECT, and the volume is
    /// kept; once the other process has closed it, kubelet's retry detaches.
    #[tokio::test]
    async fn unstage_waits_for_other_openers() {
        let cell = Cell::new(Staged, Proven, MOUNTED);
        cell.node.set_ready();
        let volume = cell.record.volume_id.clone();
        let staging = cell.record.staging_path.clone().unwrap();
        cell.host.set_opener(Some("812 (blkid)"));

        let err = cell.node.unstage(&volume, &staging).await.unwrap_err();
        assert_eq!(
            answer(Rpc::NodeUnstage, &err).code,
            tonic::Code::FailedPrecondition
        );
        assert!(err.to_string().contains("812 (blkid)"), "{err}");
        let calls = cell.host.take_calls().join(", ");
        assert!(!calls.contains("disconnect"), "{calls}");
        assert!(cell.node.record(volume.as_str()).is_some());

        cell.host.set_opener(None);
        cell.node.unstage(&volume, &staging).await.unwrap();
        let calls = cell.host.take_calls().join(", ");
        assert!(calls.contains("disconnect /dev/nbd1"), "{calls}");
        assert!(cell.node.record(volume.as_str()).is_none());
    }
}
