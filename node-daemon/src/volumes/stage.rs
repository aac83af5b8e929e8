//! NodeStageVolume and NodeUnstageVolume.
//!
//! Staging is a sequence of journaled steps (see [`Phase`]): the record is written before each
//! step, so a call repeated after a crash resumes where the previous one stopped, and an
//! interrupted step is redone only when redoing it is safe.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mounts::{Filesystem, MountOptions, MountTable, Probe};
use nbd::attach;

use crate::connections::tcp_pairs;
use crate::error::NodeError;
use crate::ids::{Identifier, VolumeId};
use crate::node::{
    blocking, device_numbers, export_uri, flush_device, identifier, Node, RELEASE_TIMEOUT,
};
use crate::record::{Access, Export, Phase, Record, TargetPhase, SCHEMA};
use crate::request::Capability;

/// A validated NodeStageVolume.
#[derive(Debug)]
pub struct StageRequest {
    pub volume: VolumeId,
    pub staging_path: PathBuf,
    pub capability: Capability,
    pub export: Export,
}

/// Steps staging may take in one call; more means the state keeps changing under us.
const MAX_STEPS: usize = 12;

impl Node {
    pub async fn stage(&self, req: StageRequest) -> Result<(), NodeError> {
        self.ensure_ready()?;
        let _guard = self
            .locks
            .lock_within(req.volume.as_str(), self.settings.call_patience)
            .await?;
        let existing = match self.record(req.volume.as_str()) {
            // A teardown a crash interrupted is finished before staging anew.
            Some(r) if r.phase == Phase::Unstaging => {
                self.run_unstage(r).await?;
                None
            }
            other => other,
        };
        let record = match existing {
            Some(existing) => self.reconcile_stage_request(existing, &req)?,
            None => {
                let record = Record {
                    schema: SCHEMA,
                    volume_id: req.volume.as_str().to_owned(),
                    identifier: Identifier::new_attachment(&self.settings.node_id, &req.volume)?
                        .as_str()
                        .to_owned(),
                    export: Some(req.export.clone()),
                    device: None,
                    staging_path: Some(req.staging_path.clone()),
                    access: req.capability.access.clone(),
                    mode: req.capability.mode,
                    phase: Phase::Attaching,
                    size_bytes: None,
                    targets: BTreeMap::new(),
                    tcp: Vec::new(),
                };
                self.save(&record)?;
                record
            }
        };
        let volume = record.volume_id.clone();
        let result = self.run_stage(record).await;
        if result.is_err() {
            self.roll_back_failed_attach(&volume)?;
        }
        result
    }

    /// A stage that failed before any device carried its identifier leaves no record behind.
    fn roll_back_failed_attach(&self, volume: &str) -> Result<(), NodeError> {
        let Some(record) = self.record(volume) else {
            return Ok(());
        };
        if record.phase == Phase::Attaching && self.sysfs.find(&identifier(&record)?)?.is_none() {
            self.forget(volume)?;
        }
        Ok(())
    }

    /// Checks a repeated NodeStage against what is staged: same path, capability and export
    /// is the idempotent case; anything else is ALREADY_EXISTS.
    fn reconcile_stage_request(
        &self,
        mut record: Record,
        req: &StageRequest,
    ) -> Result<Record, NodeError> {
        if let Some(staged) = &record.staging_path {
            if staged != &req.staging_path {
                return Err(NodeError::AlreadyExists(format!(
                    "volume {} is already staged at {}; unstage it there first",
                    req.volume,
                    staged.display()
                )));
            }
        }
        if record.export.is_none() {
            // Rebuilt from kernel facts: the CO's capability is better than our inference.
            record.access = req.capability.access.clone();
            record.mode = req.capability.mode;
        }
        if record.access != req.capability.access || record.mode != req.capability.mode {
            return Err(NodeError::AlreadyExists(format!(
                "volume {} is already staged with another capability ({:?} {:?})",
                req.volume, record.access, record.mode
            )));
        }
        match &record.export {
            Some(e) if e.uri != req.export.uri => {
                return Err(NodeError::AlreadyExists(format!(
                    "volume {} is already staged from {}, not {}",
                    req.volume, e.uri, req.export.uri
                )))
            }
            Some(_) => {}
            None => {
                // A record rebuilt from kernel facts learns its export here.
                record.export = Some(req.export.clone());
                record.staging_path = Some(req.staging_path.clone());
                self.save(&record)?;
            }
        }
        Ok(record)
    }

    /// Drives a record to `Staged`, one journaled step at a time.
    pub(crate) async fn run_stage(&self, mut record: Record) -> Result<(), NodeError> {
        for _ in 0..MAX_STEPS {
            record.phase = match record.phase {
                Phase::Attaching => self.step_attach(&mut record).await?,
                Phase::Attached => self.step_probe(&record).await?,
                Phase::Formatting => self.step_format(&record)?,
                Phase::Mounting => self.step_mount(&record)?,
                Phase::Expanding { .. } => return self.run_expand(record).await.map(drop),
                Phase::Staged => match self.check_staged(&mut record)? {
                    None => return Ok(()),
                    Some(repair) => repair,
                },
                Phase::Unstaging => {
                    return Err(NodeError::Unavailable(format!(
                        "volume {} is being unstaged",
                        record.volume_id
                    )))
                }
            };
            self.save(&record)?;
        }
        Err(NodeError::Internal(format!(
            "staging volume {} did not settle after {MAX_STEPS} steps",
            record.volume_id
        )))
    }

    /// CONNECT, unless the crash we are recovering from came after it: the identifier tells.
    async fn step_attach(&self, record: &mut Record) -> Result<Phase, NodeError> {
        let id = identifier(record)?;
        let export = record.export.clone().ok_or_else(|| {
            NodeError::FailedPrecondition(format!(
                "volume {} has no known export",
                record.volume_id
            ))
        })?;
        let (index, size) = match self.sysfs.find(&id)? {
            Some(found) => {
                tracing::info!(volume = %record.volume_id, device = %found.index(), "found the device of an interrupted attach");
                (found.index(), self.sysfs.size_bytes(found.index())?)
            }
            None => {
                let uri = export_uri(&export)?;
                let opts = self.attach_options(id, &export);
                let dialed = nbd::dial::dial(&uri, &opts.dial).await?;
                // Written ahead: the connections' addresses are what lets a later daemon replace
                // them, so they are journaled before the kernel gets the sockets.
                record.tcp = tcp_pairs(&dialed.sockets);
                self.save(record)?;
                fail::fail_point!("stage-before-connect");
                let attached = attach::attach_dialed(&self.nl, &self.sysfs, dialed, &opts).await?;
                tracing::info!(
                    volume = %record.volume_id,
                    device = %attached.device.index(),
                    connections = attached.sockets.len(),
                    "attached"
                );
                (attached.device.index(), attached.info.size)
            }
        };
        fail::fail_point!("stage-after-connect");
        record.device = Some(index.0);
        record.size_bytes = Some(size);
        Ok(Phase::Attached)
    }

    /// Decides whether the device needs a filesystem. Never formats anything not blank.
    async fn step_probe(&self, record: &Record) -> Result<Phase, NodeError> {
        let Access::Mount { fs, .. } = &record.access else {
            return Ok(Phase::Staged);
        };
        let device = self.require_device(record)?;
        let dev = self.sysfs.dev_path(device);
        match blocking(|| mounts::format::probe(&dev))? {
            Probe::Blank => Ok(Phase::Formatting),
            Probe::Filesystem(found) if &found == fs => Ok(Phase::Mounting),
            Probe::Filesystem(found) | Probe::Other(found) => {
                Err(NodeError::FailedPrecondition(format!(
                    "volume {} holds {found}, not the requested {fs}: refusing to reformat it",
                    record.volume_id
                )))
            }
        }
    }

    /// mkfs. Reached only for a device found blank; if a previous mkfs was interrupted, the
    /// partial filesystem it left was never mounted and holds nothing, so it is redone.
    fn step_format(&self, record: &Record) -> Result<Phase, NodeError> {
        let Access::Mount { fs, .. } = &record.access else {
            return Ok(Phase::Staged);
        };
        let fs: Filesystem = fs.parse()?;
        let device = self.require_device(record)?;
        let dev = self.sysfs.dev_path(device);
        fail::fail_point!("stage-before-mkfs");
        blocking(|| {
            match mounts::format::probe(&dev)? {
            Probe::Blank => mounts::format::make_filesystem(&dev, fs).map_err(NodeError::from),
            // What our own interrupted mkfs left: the same type, never mounted, no data.
            Probe::Filesystem(found) if found == fs.name() => {
                mounts::format::redo_interrupted_format(&dev, fs).map_err(NodeError::from)
            }
            Probe::Filesystem(found) | Probe::Other(found) => Err(NodeError::FailedPrecondition(format!(
                "volume {} now holds {found}, which this daemon did not write: refusing to format it",
                record.volume_id
            ))),
        }
        })?;
        fail::fail_point!("stage-after-mkfs");
        Ok(Phase::Mounting)
    }

    /// Mounts the filesystem at the staging path (if not already there) and grows it to the
    /// device: a volume restored into a larger one gets its space here.
    fn step_mount(&self, record: &Record) -> Result<Phase, NodeError> {
        let Access::Mount { fs, flags } = &record.access else {
            return Ok(Phase::Staged);
        };
        let fs: Filesystem = fs.parse()?;
        let device = self.require_device(record)?;
        let dev = self.sysfs.dev_path(device);
        let staging = staging_path(record)?;
        if !self.mounted_from(&dev, staging)? {
            let table = MountTable::read()?;
            if table.is_mount_point(staging) {
                return Err(NodeError::FailedPrecondition(format!(
                    "{} already has something else mounted on it",
                    staging.display()
                )));
            }
            std::fs::create_dir_all(staging)
                .map_err(|e| NodeError::Internal(format!("creating {}: {e}", staging.display())))?;
            let mut opts = MountOptions::parse(flags)?;
            if record.mode.read_only() {
                opts.flags |= nix::mount::MsFlags::MS_RDONLY;
            }
            mounts::ops::mount_filesystem(&dev, staging, fs.name(), &opts)?;
            fail::fail_point!("stage-after-mount");
        }
        if !record.mode.read_only() {
            blocking(|| mounts::format::grow(fs, &dev, staging))?;
        }
        Ok(Phase::Staged)
    }

    /// For a staged volume: is everything still in place? Returns the phase to go back to
    /// when something must be repaired (a lost device, a lost staging mount).
    fn check_staged(&self, record: &mut Record) -> Result<Option<Phase>, NodeError> {
        let Some(device) = self.proven_device(record)? else {
            tracing::warn!(volume = %record.volume_id, "device is gone; attaching again");
            record.device = None;
            return Ok(Some(Phase::Attaching));
        };
        if record.device != Some(device.index().0) {
            tracing::warn!(volume = %record.volume_id, device = %device.index(), "device index changed");
            record.device = Some(device.index().0);
            return Ok(Some(Phase::Staged));
        }
        if matches!(record.access, Access::Mount { .. }) {
            let dev = self.sysfs.dev_path(device.index());
            if !self.mounted_from(&dev, staging_path(record)?)? {
                tracing::warn!(volume = %record.volume_id, "staging mount is gone; mounting again");
                return Ok(Some(Phase::Mounting));
            }
        }
        Ok(None)
    }

    pub async fn unstage(&self, volume: &VolumeId, staging_path: &Path) -> Result<(), NodeError> {
        self.ensure_ready()?;
        let _guard = self
            .locks
            .lock_within(volume.as_str(), self.settings.call_patience)
            .await?;
        let Some(mut record) = self.record(volume.as_str()) else {
            return Ok(());
        };
        if let Some(staged) = &record.staging_path {
            if staged != staging_path {
                return Err(NodeError::FailedPrecondition(format!(
                    "volume {volume} is staged at {}, not at {}",
                    staged.display(),
                    staging_path.display()
                )));
            }
        }
        let published: BTreeMap<_, _> = record
            .targets
            .iter()
            .filter(|(_, t)| t.phase != TargetPhase::Unpublishing)
            .map(|(p, t)| (p.clone(), *t))
            .collect();
        if !published.is_empty() {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {volume} is still published at {}: unpublish it first",
                crate::node::paths(&published)
            )));
        }
        self.refuse_foreign_users(&record)?;
        record
            .staging_path
            .get_or_insert_with(|| staging_path.to_owned());
        record.phase = Phase::Unstaging;
        self.save(&record)?;
        fail::fail_point!("unstage-after-journal");
        self.run_unstage(record).await
    }

    /// Teardown, idempotent: staging unmount, flush, DISCONNECT of the proven device, forget.
    pub(crate) async fn run_unstage(&self, record: Record) -> Result<(), NodeError> {
        if let (Access::Mount { .. }, Some(staging)) = (&record.access, &record.staging_path) {
            while mounts::ops::unmount(staging)? {}
        }
        fail::fail_point!("unstage-after-unmount");
        if let Some(device) = self.proven_device(&record)? {
            let dev = self.sysfs.dev_path(device.index());
            if record.access.is_block() {
                flush_device(&dev)?;
            }
            self.nl.disconnect(&device).await?;
            attach::wait_released(&self.sysfs, device.index(), RELEASE_TIMEOUT).await?;
            tracing::info!(volume = %record.volume_id, device = %device.index(), "detached");
        }
        fail::fail_point!("unstage-after-disconnect");
        self.forget(&record.volume_id)
    }

    /// Unstage must not pull the device from under a mount it did not make (a bind mount
    /// someone else took of the staging path or the device).
    fn refuse_foreign_users(&self, record: &Record) -> Result<(), NodeError> {
        let Some(device) = self.proven_device(record)? else {
            return Ok(());
        };
        let dev = self.sysfs.dev_path(device.index());
        let table = MountTable::read()?;
        let mut foreign: Vec<String> = Vec::new();
        if let Some((major, minor)) = device_numbers(&dev) {
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
            Err(NodeError::FailedPrecondition(format!(
                "{} of volume {} is still mounted at {}: refusing to detach it",
                device.index(),
                record.volume_id,
                foreign.join(", ")
            )))
        }
    }

    fn require_device(&self, record: &Record) -> Result<nbd::DeviceIndex, NodeError> {
        self.proven_device(record)?
            .map(|d| d.index())
            .ok_or_else(|| {
                NodeError::Internal(format!(
                    "volume {} lost its device mid-stage",
                    record.volume_id
                ))
            })
    }

    /// Whether the filesystem on `dev` is mounted at `path`.
    pub(crate) fn mounted_from(&self, dev: &Path, path: &Path) -> Result<bool, NodeError> {
        let Some((major, minor)) = device_numbers(dev) else {
            return Ok(false);
        };
        Ok(MountTable::read()?
            .at(path)
            .any(|m| m.major == major && m.minor == minor))
    }
}

pub(crate) fn staging_path(record: &Record) -> Result<&Path, NodeError> {
    record.staging_path.as_deref().ok_or_else(|| {
        NodeError::FailedPrecondition(format!(
            "staging path of volume {} is unknown",
            record.volume_id
        ))
    })
}
