//! Start-up reconciliation: the journal, the kernel (sysfs identifiers) and the mount table
//! are brought into agreement before any CSI call is served.
//!
//! What is finished here: teardowns a crash interrupted (unstage, unpublish), expansions, a
//! staging mount lost while its device is still attached (kubelet never calls NodeStage again
//! while the pod's bind mounts exist). What is rolled back: an attach that never reached the
//! kernel. What is left for kubelet's retry: a stage interrupted mid-way. What is never done:
//! attaching or mounting a volume whose device is gone (after a reboot the volume may be in use
//! on another node by now), or touching a device that does not carry our identifier.

use std::collections::BTreeMap;
use std::path::PathBuf;

use mounts::MountTable;
use serde::Serialize;

use crate::error::NodeError;
use crate::ids::Identifier;
use crate::node::{device_numbers, identifier, Node};
use crate::record::{Access, AccessMode, Phase, Record, Target, TargetPhase, SCHEMA};
use crate::volumes::publish::release_target;

/// What recovery did, for the log, `ustor-csi-node status`, and tests.
#[derive(Debug, Default, Clone, Serialize, serde::Deserialize)]
pub struct Report {
    pub records: usize,
    pub finished: Vec<String>,
    pub rolled_back: Vec<String>,
    pub repaired: Vec<String>,
    pub waiting: Vec<String>,
    pub rebuilt: Vec<String>,
    pub quarantined: Vec<String>,
    pub unreconciled: Vec<String>,
}

pub const REPORT_FILE: &str = "recovery.json";

pub async fn recover(node: &Node) -> Result<Report, NodeError> {
    let loaded = node.journal.load()?;
    let mut report = Report {
        records: loaded.records.len(),
        quarantined: loaded
            .quarantined
            .iter()
            .map(|(p, why)| format!("{}: {why}", p.display()))
            .collect(),
        ..Report::default()
    };
    for record in loaded.records {
        node.adopt(record);
    }
    for record in node.records() {
        let volume = record.volume_id.clone();
        let _guard = node.locks.lock(&volume).await;
        if let Err(e) = recover_one(node, record, &mut report).await {
            tracing::error!(%volume, error = %e, "could not reconcile");
            report.unreconciled.push(format!("{volume}: {e}"));
        }
    }
    if let Err(e) = rebuild_lost(node, &mut report) {
        report
            .unreconciled
            .push(format!("rebuilding from kernel facts: {e}"));
    }
    write_report(node, &report);
    node.metrics
        .unreconciled
        .set(report.unreconciled.len() as i64);
    node.set_ready();
    Ok(report)
}

async fn recover_one(
    node: &Node,
    mut record: Record,
    report: &mut Report,
) -> Result<(), NodeError> {
    let volume = record.volume_id.clone();
    let unpublishing: Vec<PathBuf> = record
        .targets
        .iter()
        .filter(|(_, t)| t.phase == TargetPhase::Unpublishing)
        .map(|(p, _)| p.clone())
        .collect();
    for target in unpublishing {
        release_target(&target, record.access.is_block())?;
        record.targets.remove(&target);
        node.save(&record)?;
        report
            .finished
            .push(format!("{volume}: unpublish of {}", target.display()));
    }
    match record.phase {
        Phase::Attaching => match node.sysfs.find(&identifier(&record)?)? {
            Some(device) => {
                record.device = Some(device.index().0);
                record.size_bytes = Some(node.sysfs.size_bytes(device.index())?);
                record.phase = Phase::Attached;
                node.save(&record)?;
                report.waiting.push(format!(
                    "{volume}: attached as {}; NodeStage will finish",
                    device.index()
                ));
            }
            None => {
                node.forget(&volume)?;
                report
                    .rolled_back
                    .push(format!("{volume}: attach had not reached the kernel"));
            }
        },
        Phase::Unstaging => {
            node.run_unstage(record).await?;
            report.finished.push(format!("{volume}: unstage"));
        }
        Phase::Attached | Phase::Formatting | Phase::Mounting => {
            report.waiting.push(format!(
                "{volume}: staging stopped at {:?}; NodeStage will resume",
                record.phase
            ));
        }
        Phase::Expanding { to_bytes } => {
            node.run_expand(record).await?;
            report
                .finished
                .push(format!("{volume}: expansion to {to_bytes} bytes"));
        }
        Phase::Staged => recover_staged(node, record, report)?,
    }
    Ok(())
}

fn recover_staged(node: &Node, mut record: Record, report: &mut Report) -> Result<(), NodeError> {
    let volume = record.volume_id.clone();
    let Some(device) = node.proven_device(&record)? else {
        report.waiting.push(format!(
            "{volume}: no device carries {} (node rebooted?); NodeStage will attach it again, NodeUnstage will forget it",
            record.identifier
        ));
        return Ok(());
    };
    if record.device != Some(device.index().0) {
        report.repaired.push(format!(
            "{volume}: device index updated to {}",
            device.index()
        ));
        record.device = Some(device.index().0);
        node.save(&record)?;
    }
    if let (Access::Mount { fs, flags }, Some(staging)) = (&record.access, &record.staging_path) {
        let dev = node.sysfs.dev_path(device.index());
        if !node.mounted_from(&dev, staging)? {
            let mut opts = mounts::MountOptions::parse(flags)?;
            if record.mode.read_only() {
                opts.flags |= nix::mount::MsFlags::MS_RDONLY;
            }
            std::fs::create_dir_all(staging)
                .map_err(|e| NodeError::Internal(format!("creating {}: {e}", staging.display())))?;
            mounts::ops::mount_filesystem(&dev, staging, fs, &opts)?;
            report.repaired.push(format!(
                "{volume}: staging mount at {} restored",
                staging.display()
            ));
        }
    }
    Ok(())
}

/// Devices that carry this node's identifiers but have no journal record (it was torn or
/// lost): rebuilt from what the kernel and the mount table say, so they can be unstaged and
/// healed. The export is learned at the next call that carries it.
fn rebuild_lost(node: &Node, report: &mut Report) -> Result<(), NodeError> {
    let table = MountTable::read()?;
    for index in node.sysfs.devices()? {
        let Some(backend) = node.sysfs.backend(index)? else {
            continue;
        };
        let Some(id) = Identifier::parse(&backend) else {
            continue;
        };
        if id.node != node.settings.node_id {
            continue;
        }
        let Some(volume) = id.volume else {
            report.unreconciled.push(format!(
                "{index} carries {backend} but its volume id was digested"
            ));
            continue;
        };
        if let Some(existing) = node.record(&volume) {
            if existing.identifier != backend {
                report.unreconciled.push(format!(
                    "{index} carries {backend}, an older attachment of {volume}: left alone"
                ));
            }
            continue;
        }
        let dev = node.sysfs.dev_path(index);
        let mut fs_mounts: Vec<_> = device_numbers(&dev)
            .map(|(major, minor)| table.of_device(major, minor).collect())
            .unwrap_or_default();
        fs_mounts.sort_by_key(|m| m.id);
        let name = index.name();
        let node_binds: Vec<_> = table.of_device_node(&name).collect();
        let (access, staging_path, targets) = match fs_mounts.split_first() {
            Some((staging, rest)) => (
                Access::Mount {
                    fs: staging.fs_type.clone(),
                    flags: Vec::new(),
                },
                Some(staging.mount_point.clone()),
                rest.iter()
                    .map(|m| (m.mount_point.clone(), m.read_only()))
                    .collect::<Vec<_>>(),
            ),
            None => (
                Access::Block,
                None,
                node_binds
                    .iter()
                    .map(|m| (m.mount_point.clone(), m.read_only()))
                    .collect(),
            ),
        };
        let record = Record {
            schema: SCHEMA,
            volume_id: volume.clone(),
            identifier: backend.clone(),
            export: None,
            device: Some(index.0),
            staging_path,
            access,
            mode: AccessMode::SingleNodeWriter,
            phase: Phase::Staged,
            size_bytes: node.sysfs.size_bytes(index).ok(),
            targets: targets
                .into_iter()
                .map(|(p, read_only)| {
                    (
                        p,
                        Target {
                            read_only,
                            phase: TargetPhase::Published,
                        },
                    )
                })
                .collect::<BTreeMap<_, _>>(),
            tcp: Vec::new(),
        };
        node.save(&record)?;
        tracing::warn!(%volume, device = %index, "journal record rebuilt from kernel facts");
        report.rebuilt.push(format!("{volume}: {index}"));
    }
    Ok(())
}

fn write_report(node: &Node, report: &Report) {
    let path = node.settings.state_dir.join(REPORT_FILE);
    match serde_json::to_vec_pretty(report) {
        Ok(json) => {
            if let Err(e) = std::fs::write(&path, json) {
                tracing::warn!(path = %path.display(), error = %e, "could not write the recovery report");
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not encode the recovery report"),
    }
}
