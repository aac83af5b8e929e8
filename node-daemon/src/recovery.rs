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
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::error::NodeError;
use crate::ids::{Identifier, VolumeId};
use crate::node::{off_runtime, Node};
use crate::record::{Access, Phase, Record, Target, TargetPhase};
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

/// How long start-up waits for the volumes' reconciliation before it declares the daemon
/// ready. A volume whose step waits on an unreachable export (an unmount flushing to it)
/// goes on in the background, holding its lock, so only that volume's calls are ABORTED.
const RECONCILE_PATIENCE: Duration = Duration::from_secs(20);

/// Loads the journal into memory, so that the healer knows every device before recovery
/// does any device I/O (which a link that died while the daemon was down would stall).
pub fn load(node: &Node) -> Result<Report, NodeError> {
    let loaded = node.journal.load()?;
    let report = Report {
        records: loaded.records.len(),
        quarantined: loaded
            .quarantined
            .iter()
            .map(|(p, why)| format!("{}: {why}", p.display()))
            .collect(),
        ..Report::default()
    };
    // TLS material of volumes the journal no longer has: an unstage cut short.
    let live = loaded.records.iter().map(|r| r.volume_id.as_str());
    match node.stage_tls().sweep(live) {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            removed = n,
            "removed the TLS material of volumes no longer staged"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "could not sweep the TLS material of volumes no longer staged")
        }
    }
    for record in loaded.records {
        node.adopt(record);
    }
    Ok(report)
}

/// Finishes or rolls back what each record says was under way, every volume at once, then
/// rebuilds records for devices the journal lost, writes the report and declares ready.
pub async fn reconcile(node: &Arc<Node>, mut report: Report) -> Result<Report, NodeError> {
    let deadline = tokio::time::Instant::now() + RECONCILE_PATIENCE;
    let tasks: Vec<_> = node
        .records()
        .into_iter()
        .map(|record| {
            let node = Arc::clone(node);
            let volume = record.volume_id.clone();
            let phase = record.phase();
            let task = tokio::spawn(async move {
                let _guard = node.locks.lock(&record.volume_id).await;
                let mut part = Report::default();
                let volume = record.volume_id.clone();
                if let Err(e) = recover_one(&node, record, &mut part).await {
                    tracing::error!(%volume, error = %e, "could not reconcile");
                    part.unreconciled.push(format!("{volume}: {e}"));
                }
                part
            });
            (volume, phase, task)
        })
        .collect();
    for (volume, phase, mut task) in tasks {
        match tokio::time::timeout_at(deadline, &mut task).await {
            Ok(Ok(part)) => report.merge(part),
            Ok(Err(e)) => report
                .unreconciled
                .push(format!("{volume}: reconciliation failed: {e}")),
            Err(_) => {
                tracing::warn!(%volume, ?phase, "reconciliation is still waiting on the device; going on in the background");
                report.waiting.push(format!(
                    "{volume}: still finishing {phase:?} (is its export reachable?); its calls are ABORTED until then"
                ));
            }
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

impl Report {
    fn merge(&mut self, other: Report) {
        self.finished.extend(other.finished);
        self.rolled_back.extend(other.rolled_back);
        self.repaired.extend(other.repaired);
        self.waiting.extend(other.waiting);
        self.rebuilt.extend(other.rebuilt);
        self.quarantined.extend(other.quarantined);
        self.unreconciled.extend(other.unreconciled);
    }
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
        .filter(|(_, t)| t.phase() == TargetPhase::Unpublishing)
        .map(|(p, _)| p.clone())
        .collect();
    for target in unpublishing {
        let (path, block) = (target.clone(), record.access.is_block());
        off_runtime("unmount", move || release_target(&path, block)).await?;
        node.drop_targets(&mut record, std::slice::from_ref(&target))?;
        report
            .finished
            .push(format!("{volume}: unpublish of {}", target.display()));
    }
    match record.phase() {
        // The same step as NodeStage's for an interrupted attach; recovery stops at Attached
        // (even for a block volume) and leaves the rest to kubelet's retry.
        Phase::Attaching => match node.find_interrupted_attach(&mut record)? {
            Some(index) => {
                node.advance(&mut record, Phase::Attached)?;
                report.waiting.push(format!(
                    "{volume}: attached as {index}; NodeStage will finish"
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
                record.phase()
            ));
        }
        Phase::Expanding { .. } if node.proven_device(&record)?.is_none() => {
            report.waiting.push(format!(
                "{volume}: expanding, but no device carries {} (node rebooted?); NodeStage will attach it again and finish the expansion",
                record.identifier
            ));
        }
        Phase::Expanding { to_bytes } => {
            node.run_expand(record).await?;
            report
                .finished
                .push(format!("{volume}: expansion to {to_bytes} bytes"));
        }
        Phase::Staged => recover_staged(node, record, report).await?,
    }
    Ok(())
}

async fn recover_staged(
    node: &Node,
    mut record: Record,
    report: &mut Report,
) -> Result<(), NodeError> {
    let volume = record.volume_id.clone();
    let Some(device) = node.proven_device(&record)? else {
        report.waiting.push(format!(
            "{volume}: no device carries {} (node rebooted?); NodeStage will attach it again, NodeUnstage will forget it",
            record.identifier
        ));
        return Ok(());
    };
    // The same step as NodeStage's for a moved device.
    if node.follow_device_index(&mut record, &device)? {
        report.repaired.push(format!(
            "{volume}: device index updated to {}",
            device.index()
        ));
    }
    if record.staging_path.is_some() && node.mount_staging(&record, device.index()).await? {
        report.repaired.push(format!(
            "{volume}: staging mount at {} restored",
            record
                .staging_path
                .as_deref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        ));
    }
    Ok(())
}

/// Devices that carry this node's identifiers but have no journal record (it was torn or
/// lost): rebuilt from what the kernel and the mount table say, so they can be unstaged and
/// healed. The export is learned at the next call that carries it.
fn rebuild_lost(node: &Node, report: &mut Report) -> Result<(), NodeError> {
    let table = node.mounts.table()?;
    for index in node.kernel.devices()? {
        let Some(backend) = node.kernel.backend(index)? else {
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
            if existing.identifier.as_str() != backend {
                report.unreconciled.push(format!(
                    "{index} carries {backend}, an older attachment of {volume}: left alone"
                ));
            }
            continue;
        }
        let mut fs_mounts: Vec<_> = node
            .kernel
            .device_numbers(index)
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
        // Both were made by this daemon, so both parse; a device that says otherwise is not
        // trusted with a record.
        let (volume_id, identifier) = match (VolumeId::parse(&volume), backend.parse()) {
            (Ok(v), Ok(i)) => (v, i),
            (Err(e), _) => {
                report.unreconciled.push(format!(
                    "{index} carries {backend}, whose volume id is not usable: {e}"
                ));
                continue;
            }
            (_, Err(e)) => {
                report
                    .unreconciled
                    .push(format!("{index} carries {backend}, not usable: {e}"));
                continue;
            }
        };
        let targets = targets
            .into_iter()
            .map(|(p, read_only)| (p, Target::published(read_only)))
            .collect::<BTreeMap<_, _>>();
        let record = Record::rebuilt(
            volume_id,
            identifier,
            index,
            staging_path,
            access,
            targets,
            node.kernel.size_bytes(index).ok(),
        );
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::fake::{check_table, Cell, Facts, Row, GIB, MOUNTED, UNMOUNTED};
    use Facts::*;
    use Phase::*;

    const EXPANDING: Phase = Expanding { to_bytes: 2 * GIB };

    /// A daemon start with a volume journaled in the cell's phase: what the report says,
    /// the verbs recovery took, and the journal afterwards.
    async fn recover_in(phase: Phase, facts: Facts, mounted: bool) -> (String, String, String) {
        let cell = Cell::new(phase, facts, mounted);
        let report = reconcile(&cell.node, Report::default()).await.unwrap();
        let mut said = Vec::new();
        for (what, list) in [
            ("finished", &report.finished),
            ("rolled back", &report.rolled_back),
            ("repaired", &report.repaired),
            ("waiting", &report.waiting),
            ("rebuilt", &report.rebuilt),
            ("unreconciled", &report.unreconciled),
        ] {
            if !list.is_empty() {
                said.push(format!("{what}: {}", list.join("; ")));
            }
        }
        let calls = cell.host.take_calls().join(", ");
        (
            cell.stable(&said.join(" / ")),
            cell.stable(&calls),
            cell.journaled()
                .replace(&format!("{EXPANDING:?}"), "Expanding"),
        )
    }

    /// Recovery for each phase × kernel facts × staging mount (devices as in the stage
    /// table). Recovery never attaches or mounts a volume whose device is gone, never
    /// touches a device it cannot prove, and leaves interrupted stages to NodeStage.
    /// Questioned (kept as it is): `Expanding` with the device moved finishes the expansion
    /// but journals `Staged` with the old index.
    #[tokio::test]
    async fn recovery_decisions() {
        #[rustfmt::skip]
        const TABLE: &[Row] = &[
        (Attaching, Proven, MOUNTED, "waiting: pvc-1: attached as /dev/nbd1; NodeStage will finish", "", "Attached /dev/nbd1"),
        (Attaching, Proven, UNMOUNTED, "waiting: pvc-1: attached as /dev/nbd1; NodeStage will finish", "", "Attached /dev/nbd1"),
        (Attaching, Absent, MOUNTED, "rolled back: pvc-1: attach had not reached the kernel", "", "none"),
        (Attaching, Absent, UNMOUNTED, "rolled back: pvc-1: attach had not reached the kernel", "", "none"),
        (Attaching, Foreign, MOUNTED, "rolled back: pvc-1: attach had not reached the kernel", "", "none"),
        (Attaching, Foreign, UNMOUNTED, "rolled back: pvc-1: attach had not reached the kernel", "", "none"),
        (Attaching, Moved, MOUNTED, "waiting: pvc-1: attached as /dev/nbd3; NodeStage will finish", "", "Attached /dev/nbd3"),
        (Attaching, Moved, UNMOUNTED, "waiting: pvc-1: attached as /dev/nbd3; NodeStage will finish", "", "Attached /dev/nbd3"),
        (Attached, Proven, MOUNTED, "waiting: pvc-1: staging stopped at Attached; NodeStage will resume", "", "Attached /dev/nbd1"),
        (Attached, Proven, UNMOUNTED, "waiting: pvc-1: staging stopped at Attached; NodeStage will resume", "", "Attached /dev/nbd1"),
        (Attached, Absent, MOUNTED, "waiting: pvc-1: staging stopped at Attached; NodeStage will resume", "", "Attached /dev/nbd1"),
        (Attached, Absent, UNMOUNTED, "waiting: pvc-1: staging stopped at Attached; NodeStage will resume", "", "Attached /dev/nbd1"),
        (Attached, Foreign, MOUNTED, "waiting: pvc-1: staging stopped at Attached; NodeStage will resume", "", "Attached /dev/nbd1"),
        (Attached, Foreign, UNMOUNTED, "waiting: pvc-1: staging stopped at Attached; NodeStage will resume", "", "Attached /dev/nbd1"),
        (Attached, Moved, MOUNTED, "waiting: pvc-1: staging stopped at Attached; NodeStage will resume", "", "Attached /dev/nbd1"),
        (Attached, Moved, UNMOUNTED, "waiting: pvc-1: staging stopped at Attached; NodeStage will resume", "", "Attached /dev/nbd1"),
        (Formatting, Proven, MOUNTED, "waiting: pvc-1: staging stopped at Formatting; NodeStage will resume", "", "Formatting /dev/nbd1"),
        (Formatting, Proven, UNMOUNTED, "waiting: pvc-1: staging stopped at Formatting; NodeStage will resume", "", "Formatting /dev/nbd1"),
        (Formatting, Absent, MOUNTED, "waiting: pvc-1: staging stopped at Formatting; NodeStage will resume", "", "Formatting /dev/nbd1"),
        (Formatting, Absent, UNMOUNTED, "waiting: pvc-1: staging stopped at Formatting; NodeStage will resume", "", "Formatting /dev/nbd1"),
        (Formatting, Foreign, MOUNTED, "waiting: pvc-1: staging stopped at Formatting; NodeStage will resume", "", "Formatting /dev/nbd1"),
        (Formatting, Foreign, UNMOUNTED, "waiting: pvc-1: staging stopped at Formatting; NodeStage will resume", "", "Formatting /dev/nbd1"),
        (Formatting, Moved, MOUNTED, "waiting: pvc-1: staging stopped at Formatting; NodeStage will resume", "", "Formatting /dev/nbd1"),
        (Formatting, Moved, UNMOUNTED, "waiting: pvc-1: staging stopped at Formatting; NodeStage will resume", "", "Formatting /dev/nbd1"),
        (Mounting, Proven, MOUNTED, "waiting: pvc-1: staging stopped at Mounting; NodeStage will resume", "", "Mounting /dev/nbd1"),
        (Mounting, Proven, UNMOUNTED, "waiting: pvc-1: staging stopped at Mounting; NodeStage will resume", "", "Mounting /dev/nbd1"),
        (Mounting, Absent, MOUNTED, "waiting: pvc-1: staging stopped at Mounting; NodeStage will resume", "", "Mounting /dev/nbd1"),
        (Mounting, Absent, UNMOUNTED, "waiting: pvc-1: staging stopped at Mounting; NodeStage will resume", "", "Mounting /dev/nbd1"),
        (Mounting, Foreign, MOUNTED, "waiting: pvc-1: staging stopped at Mounting; NodeStage will resume", "", "Mounting /dev/nbd1"),
        (Mounting, Foreign, UNMOUNTED, "waiting: pvc-1: staging stopped at Mounting; NodeStage will resume", "", "Mounting /dev/nbd1"),
        (Mounting, Moved, MOUNTED, "waiting: pvc-1: staging stopped at Mounting; NodeStage will resume", "", "Mounting /dev/nbd1"),
        (Mounting, Moved, UNMOUNTED, "waiting: pvc-1: staging stopped at Mounting; NodeStage will resume", "", "Mounting /dev/nbd1"),
        (Staged, Proven, MOUNTED, "", "", "Staged /dev/nbd1"),
        (Staged, Proven, UNMOUNTED, "repaired: pvc-1: staging mount at /staging restored", "mount nbd1 /staging", "Staged /dev/nbd1"),
        (Staged, Absent, MOUNTED, "waiting: pvc-1: no device carries <id> (node rebooted?); NodeStage will attach it again, NodeUnstage will forget it", "", "Staged /dev/nbd1"),
        (Staged, Absent, UNMOUNTED, "waiting: pvc-1: no device carries <id> (node rebooted?); NodeStage will attach it again, NodeUnstage will forget it", "", "Staged /dev/nbd1"),
        (Staged, Foreign, MOUNTED, "waiting: pvc-1: no device carries <id> (node rebooted?); NodeStage will attach it again, NodeUnstage will forget it", "", "Staged /dev/nbd1"),
        (Staged, Foreign, UNMOUNTED, "waiting: pvc-1: no device carries <id> (node rebooted?); NodeStage will attach it again, NodeUnstage will forget it", "", "Staged /dev/nbd1"),
        (Staged, Moved, MOUNTED, "repaired: pvc-1: device index updated to /dev/nbd3", "", "Staged /dev/nbd3"),
        (Staged, Moved, UNMOUNTED, "repaired: pvc-1: device index updated to /dev/nbd3; pvc-1: staging mount at /staging restored", "mount nbd3 /staging", "Staged /dev/nbd3"),
        (EXPANDING, Proven, MOUNTED, "finished: pvc-1: expansion to 2147483648 bytes", "thaw, freeze, resize /dev/nbd1 2147483648, thaw, grow", "Staged /dev/nbd1"),
        (EXPANDING, Proven, UNMOUNTED, "finished: pvc-1: expansion to 2147483648 bytes", "resize /dev/nbd1 2147483648, grow", "Staged /dev/nbd1"),
        (EXPANDING, Absent, MOUNTED, "waiting: pvc-1: expanding, but no device carries <id> (node rebooted?); NodeStage will attach it again and finish the expansion", "", "Expanding /dev/nbd1"),
        (EXPANDING, Absent, UNMOUNTED, "waiting: pvc-1: expanding, but no device carries <id> (node rebooted?); NodeStage will attach it again and finish the expansion", "", "Expanding /dev/nbd1"),
        (EXPANDING, Foreign, MOUNTED, "waiting: pvc-1: expanding, but no device carries <id> (node rebooted?); NodeStage will attach it again and finish the expansion", "", "Expanding /dev/nbd1"),
        (EXPANDING, Foreign, UNMOUNTED, "waiting: pvc-1: expanding, but no device carries <id> (node rebooted?); NodeStage will attach it again and finish the expansion", "", "Expanding /dev/nbd1"),
        (EXPANDING, Moved, MOUNTED, "finished: pvc-1: expansion to 2147483648 bytes", "thaw, freeze, resize /dev/nbd3 2147483648, thaw, grow", "Staged /dev/nbd1"),
        (EXPANDING, Moved, UNMOUNTED, "finished: pvc-1: expansion to 2147483648 bytes", "resize /dev/nbd3 2147483648, grow", "Staged /dev/nbd1"),
        (Unstaging, Proven, MOUNTED, "finished: pvc-1: unstage", "unmount /staging, disconnect /dev/nbd1", "none"),
        (Unstaging, Proven, UNMOUNTED, "finished: pvc-1: unstage", "disconnect /dev/nbd1", "none"),
        (Unstaging, Absent, MOUNTED, "finished: pvc-1: unstage", "unmount /staging", "none"),
        (Unstaging, Absent, UNMOUNTED, "finished: pvc-1: unstage", "", "none"),
        (Unstaging, Foreign, MOUNTED, "finished: pvc-1: unstage", "", "none"),
        (Unstaging, Foreign, UNMOUNTED, "finished: pvc-1: unstage", "", "none"),
        (Unstaging, Moved, MOUNTED, "finished: pvc-1: unstage", "unmount /staging, disconnect /dev/nbd3", "none"),
        (Unstaging, Moved, UNMOUNTED, "finished: pvc-1: unstage", "disconnect /dev/nbd3", "none"),
        ];
        check_table(TABLE, recover_in).await;
    }
}
