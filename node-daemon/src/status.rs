//! `ustor-csi-node status`: which /dev/nbdN is which volume, and whether the kernel agrees
//! with the journal. Read-only; safe to run beside the daemon.

use std::fmt::Write as _;
use std::path::Path;

use nbd::sysfs::Sysfs;
use serde::Serialize;

use crate::error::NodeError;
use crate::ids::Identifier;
use crate::journal::Journal;
use crate::record::Record;
use crate::recovery::{Report, REPORT_FILE};

#[derive(Debug, Serialize)]
pub struct VolumeStatus {
    pub volume: String,
    pub device: Option<String>,
    pub step: String,
    /// `ok`, `gone`, or what the device carries instead.
    pub kernel: String,
    pub identifier: String,
    pub export: Option<String>,
    pub staging_path: Option<String>,
    pub targets: Vec<String>,
    /// The device's I/O scheduler; anything but `none` risks link drops on kernels before
    /// 6.14 (the daemon sets it back within seconds while it runs).
    pub scheduler: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Status {
    pub volumes: Vec<VolumeStatus>,
    /// Devices carrying one of this node's identifiers that no record names.
    pub unrecorded_devices: Vec<String>,
    pub unreadable_records: Vec<String>,
    pub last_recovery: Option<Report>,
}

pub fn collect(state_dir: &Path, node_id: &str, sysfs: &Sysfs) -> Result<Status, NodeError> {
    let loaded = Journal::peek(state_dir)?;
    let volumes: Vec<VolumeStatus> = loaded
        .records
        .iter()
        .map(|r| volume_status(r, sysfs))
        .collect();
    let mut unrecorded_devices = Vec::new();
    for index in sysfs.devices().unwrap_or_default() {
        let Ok(Some(backend)) = sysfs.backend(index) else {
            continue;
        };
        let ours = Identifier::parse(&backend).is_some_and(|id| id.node == node_id);
        if ours && !loaded.records.iter().any(|r| r.identifier == backend) {
            unrecorded_devices.push(format!("{index} ({backend})"));
        }
    }
    let last_recovery = std::fs::read(state_dir.join(REPORT_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    Ok(Status {
        volumes,
        unrecorded_devices,
        unreadable_records: loaded
            .quarantined
            .iter()
            .map(|(p, why)| format!("{}: {why}", p.display()))
            .collect(),
        last_recovery,
    })
}

fn volume_status(r: &Record, sysfs: &Sysfs) -> VolumeStatus {
    let kernel = match r.device_index() {
        None => "none".to_owned(),
        Some(i) => match sysfs.backend(i) {
            Ok(Some(b)) if b == r.identifier => "ok".to_owned(),
            Ok(Some(b)) => format!("carries {b}"),
            Ok(None) => "gone".to_owned(),
            Err(e) => format!("unreadable: {e}"),
        },
    };
    VolumeStatus {
        volume: r.volume_id.clone(),
        device: r.device_index().map(|i| i.to_string()),
        step: format!("{:?}", r.phase).to_lowercase(),
        identifier: r.identifier.clone(),
        export: r.export.as_ref().map(|e| e.uri.clone()),
        staging_path: r.staging_path.as_ref().map(|p| p.display().to_string()),
        targets: r.targets.keys().map(|p| p.display().to_string()).collect(),
        scheduler: (kernel == "ok")
            .then(|| r.device_index().and_then(|i| sysfs.scheduler(i).ok()))
            .flatten(),
        kernel,
    }
}

/// A table for people.
pub fn render(status: &Status) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<40} {:<11} {:<10} {:<8} STAGING / TARGETS",
        "VOLUME", "DEVICE", "STEP", "KERNEL"
    );
    for v in &status.volumes {
        let _ = writeln!(
            out,
            "{:<40} {:<11} {:<10} {:<8} {}",
            v.volume,
            v.device.as_deref().unwrap_or("-"),
            v.step,
            v.kernel,
            v.staging_path.as_deref().unwrap_or("-")
        );
        for t in &v.targets {
            let _ = writeln!(out, "{:<72} -> {t}", "");
        }
        if let Some(sched) = v.scheduler.as_deref().filter(|s| *s != "none") {
            let _ = writeln!(
                out,
                "warning: {} of {} uses the {sched} I/O scheduler, not none (links may drop on kernels before 6.14)",
                v.device.as_deref().unwrap_or("?"),
                v.volume
            );
        }
    }
    if status.volumes.is_empty() {
        let _ = writeln!(out, "(no volumes attached by this node)");
    }
    for d in &status.unrecorded_devices {
        let _ = writeln!(
            out,
            "warning: {d} carries this node's identifier but no record names it"
        );
    }
    for r in &status.unreadable_records {
        let _ = writeln!(out, "warning: unreadable record {r}");
    }
    if let Some(r) = &status.last_recovery {
        for u in &r.unreconciled {
            let _ = writeln!(out, "last recovery could not reconcile: {u}");
        }
    }
    out
}
