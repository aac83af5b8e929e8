//! NodePublishVolume and NodeUnpublishVolume: bind mounts from the staging path (filesystem
//! volumes) or of the device node (block volumes) onto the pod's target path.

use std::path::{Path, PathBuf};

use crate::error::NodeError;
use crate::ids::{Identifier, VolumeId};
use crate::node::{off_runtime, Node};
use crate::record::{Access, Export, Phase, Record};
use crate::request::Capability;
use crate::volumes::stage::staging_path;

/// Why a NodePublishVolume or NodeUnpublishVolume failed.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The same target, asked for with another read-only flag.
    #[error("volume {volume} is already published at {} with readonly={read_only}", target.display())]
    PublishedOtherwise {
        volume: String,
        target: PathBuf,
        read_only: bool,
    },
    /// A second target for an access mode that allows one workload.
    #[error(
        "volume {volume} allows one workload ({mode:?}) and is already published at {targets}"
    )]
    SingleWorkload {
        volume: String,
        mode: crate::record::AccessMode,
        targets: String,
    },
    #[error(
        "volume {volume} is published on this node {} at {targets}; a raw block volume cannot be read-only for one pod and writable for another",
        if *read_only { "writable" } else { "read-only" }
    )]
    MixedReadOnly {
        volume: String,
        /// What this request asked for.
        read_only: bool,
        targets: String,
    },
    #[error("{} already has another mount on it", path.display())]
    TargetTaken { path: PathBuf },
    #[error("creating {}: {source}", path.display())]
    CreateTarget {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("removing {}: {source}", path.display())]
    RemoveTarget {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A validated NodePublishVolume.
#[derive(Debug)]
pub struct PublishRequest {
    pub volume: VolumeId,
    pub staging_path: PathBuf,
    pub target: PathBuf,
    pub capability: Capability,
    pub read_only: bool,
    /// Present when the request carried `nbdUri`.
    pub export: Option<Export>,
}

impl Node {
    pub async fn publish(&self, req: PublishRequest) -> Result<(), NodeError> {
        let _guard = self.begin_call(&req.volume).await?;
        let mut record = self.staged_record(&req.volume)?;
        if record.fenced.is_some() {
            return Err(NodeError::Fenced {
                volume: req.volume.to_string(),
                targets: crate::node::paths(&record.targets),
            });
        }
        // An expansion a retry will resume leaves the volume mounted at its old size: usable.
        if !matches!(record.phase(), Phase::Staged | Phase::Expanding { .. }) {
            return Err(NodeError::NotStagedYet {
                volume: req.volume.to_string(),
                phase: record.phase(),
            });
        }
        if record.inferred() {
            // Rebuilt from kernel facts: take the CO's word for paths, capability and export.
            self.adopt_co_view(&mut record, &req.staging_path, &req.capability)?;
            if record.export.is_none() {
                record.export = req.export.clone();
                self.save(&record)?;
            }
        }
        if !record.is_staging_path(&req.staging_path) {
            return Err(NodeError::WrongStagingPath {
                volume: req.volume.to_string(),
                staged: staging_path(&record)?.to_owned(),
                asked: req.staging_path.clone(),
            });
        }
        if record.access != req.capability.access || record.mode != req.capability.mode {
            return Err(NodeError::OtherCapability {
                volume: req.volume.to_string(),
                access: record.access,
                mode: record.mode,
            });
        }
        let read_only = req.read_only || record.mode.read_only();

        if let Some(existing) = record.targets.get(&req.target).copied() {
            if existing.read_only != read_only {
                return Err(PublishError::PublishedOtherwise {
                    volume: req.volume.to_string(),
                    target: req.target.clone(),
                    read_only: existing.read_only,
                }
                .into());
            }
        } else if record.mode.single_target() && !record.targets.is_empty() {
            return Err(PublishError::SingleWorkload {
                volume: req.volume.to_string(),
                mode: record.mode,
                targets: crate::node::paths(&record.targets),
            }
            .into());
        } else if record.access.is_block()
            && record.targets.values().any(|t| t.read_only != read_only)
        {
            // A block device is read-only for all its users or for none: a read-only bind
            // of a device node does not stop writes to the device.
            return Err(PublishError::MixedReadOnly {
                volume: req.volume.to_string(),
                read_only,
                targets: crate::node::paths(&record.targets),
            }
            .into());
        }

        self.begin_publish(&mut record, &req.target, read_only)?;
        fail::fail_point!("publish-after-journal");
        self.bind_target(&record, &req.target, read_only).await?;
        fail::fail_point!("publish-after-mount");
        self.end_publish(&mut record, &req.target)
    }

    /// Makes `target` show the volume, unless it already does. A filesystem is bound only
    /// from a staging path that has it mounted (mounted again here if it was lost): binding
    /// the bare directory would let the pod write into the node's root filesystem.
    async fn bind_target(
        &self,
        record: &Record,
        target: &Path,
        read_only: bool,
    ) -> Result<(), NodeError> {
        let device = self
            .proven_device(record)?
            .ok_or_else(|| NodeError::DeviceGone {
                volume: record.volume_id.to_string(),
            })?;
        let dev = self.kernel.dev_path(device.index());
        if self.mount_staging(record, device.index()).await? {
            tracing::warn!(volume = %record.volume_id, "staging mount was gone; mounted it again before publishing");
        }
        if record.access.is_block() {
            let ro = read_only || record.mode.read_only();
            let dev = dev.clone();
            off_runtime("set read-only", move || {
                Ok(crate::blockdev::set_read_only(&dev, ro)?)
            })
            .await?;
        }
        let table = self.mounts.table()?;
        let already = match &record.access {
            Access::Block => table
                .of_device_node(&device.index().name())
                .any(|m| m.mount_point == target),
            Access::Mount { .. } => {
                self.kernel
                    .device_numbers(device.index())
                    .is_some_and(|(major, minor)| {
                        table
                            .at(target)
                            .any(|m| m.major == major && m.minor == minor)
                    })
            }
        };
        if already {
            return Ok(());
        }
        if table.is_mount_point(target) {
            return Err(PublishError::TargetTaken {
                path: target.to_owned(),
            }
            .into());
        }
        let target = target.to_owned();
        match &record.access {
            Access::Block => {
                off_runtime("bind mount", move || {
                    // Kubelet creates the parent; the plugin creates the file the device is bound onto.
                    std::fs::OpenOptions::new()
                        .create(true)
                        .truncate(false)
                        .write(true)
                        .open(&target)
                        .map_err(|source| PublishError::CreateTarget {
                            path: target.clone(),
                            source,
                        })?;
                    Ok(mounts::ops::bind(&dev, &target, read_only)?)
                })
                .await
            }
            Access::Mount { .. } => {
                let staging = staging_path(record)?.to_owned();
                off_runtime("bind mount", move || {
                    std::fs::create_dir_all(&target).map_err(|source| {
                        PublishError::CreateTarget {
                            path: target.clone(),
                            source,
                        }
                    })?;
                    Ok(mounts::ops::bind(&staging, &target, read_only)?)
                })
                .await
            }
        }
    }

    pub async fn unpublish(&self, volume: &VolumeId, target: &Path) -> Result<(), NodeError> {
        let _guard = self.begin_call(volume).await?;
        let Some(mut record) = self.record(volume.as_str()) else {
            return self.unpublish_unknown(volume, target).await;
        };
        if !record.targets.contains_key(target) {
            return self.unpublish_unknown(volume, target).await;
        }
        self.begin_unpublish(&mut record, target)?;
        fail::fail_point!("unpublish-after-journal");
        let (path, block) = (target.to_owned(), record.access.is_block());
        off_runtime("unmount", move || release_target(&path, block)).await?;
        fail::fail_point!("unpublish-after-unmount");
        self.drop_targets(&mut record, &[target.to_owned()])?;
        if record.access.is_block() && !record.mode.read_only() && record.targets.is_empty() {
            // The last pod is gone: the next publish decides read-only afresh.
            if let Some(device) = self.proven_device(&record)? {
                let dev = self.kernel.dev_path(device.index());
                off_runtime("set read-write", move || {
                    Ok(crate::blockdev::set_read_only(&dev, false)?)
                })
                .await?;
            }
        }
        Ok(())
    }

    /// NodeUnpublish of a target the journal does not know: success (the call is idempotent),
    /// after removing a mount there only if it is provably this volume's device.
    async fn unpublish_unknown(&self, volume: &VolumeId, target: &Path) -> Result<(), NodeError> {
        let table = self.mounts.table()?;
        let Some(mount) = table.at(target).last() else {
            return Ok(());
        };
        let index = if mount.fs_type == "devtmpfs" {
            mount
                .root
                .to_str()
                .and_then(|r| r.trim_start_matches('/').parse::<nbd::DeviceIndex>().ok())
        } else {
            self.kernel
                .devices()?
                .into_iter()
                .find(|i| self.kernel.device_numbers(*i) == Some((mount.major, mount.minor)))
        };
        let ours = index
            .and_then(|i| self.kernel.backend(i).ok().flatten())
            .and_then(|b| Identifier::parse(&b))
            .is_some_and(|id| {
                id.node == self.settings.node_id && id.volume.as_deref() == Some(volume.as_str())
            });
        if ours {
            tracing::warn!(%volume, target = %target.display(), "unpublishing a target the journal did not know");
            let (path, block) = (target.to_owned(), mount.fs_type == "devtmpfs");
            off_runtime("unmount", move || release_target(&path, block)).await?;
        }
        Ok(())
    }
}

/// Unmounts the target (every layer) and deletes the file or directory the plugin created.
pub(crate) fn release_target(target: &Path, block: bool) -> Result<(), NodeError> {
    while mounts::ops::unmount(target)? {}
    let removed = if block {
        std::fs::remove_file(target)
    } else {
        std::fs::remove_dir(target)
    };
    match removed {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(PublishError::RemoveTarget {
            path: target.to_owned(),
            source,
        }
        .into()),
    }
}
