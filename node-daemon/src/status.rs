//! `ustor-csi-node status`: one row per nbd device the kernel has, ours or not, and the
//! journal records that have no device; each disagreement between journal, kernel and mount
//! table is named in a PROBLEMS column. Read-only: works with the daemon running or stopped.
//!
//! `--json` prints [`Status`], whose shape is versioned by [`SCHEMA`]: fields are only ever
//! added within one version. The exit code is 0 when nothing is wrong, 1 when a problem is
//! shown, 2 when the state cannot be read (main maps an error to 2).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use mounts::MountTable;
use nbd::sysfs::Sysfs;
use nbd::DeviceIndex;
use serde::Serialize;

use crate::error::NodeError;
use crate::ids::Identifier;
use crate::journal::Journal;
use crate::node::device_numbers;
use crate::record::{Access, Phase, Record, TargetPhase};
use crate::recovery::{Report, REPORT_FILE};

/// Version of the `--json` shape.
pub const SCHEMA: u32 = 1;

#[derive(Debug, Serialize)]
pub struct Status {
    pub schema: u32,
    pub node_id: String,
    /// Whether a daemon answers on the CSI socket.
    pub daemon_running: bool,
    pub devices: Vec<DeviceRow>,
    /// Journal records whose device the kernel does not have (or that never got one).
    pub records_without_device: Vec<RecordRow>,
    pub unreadable_records: Vec<String>,
    pub last_recovery: Option<Report>,
}

/// Whose a device is, by its backend identifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Owner {
    /// Carries this node's identifier.
    Ours,
    /// Carries this driver's identifier for another node id (a renamed host, a moved disk).
    OtherNode,
    /// Attached by something else: another tool's identifier, or connected with none
    /// (nbd-client, `qemu-nbd -c`).
    Foreign,
    /// Not attached.
    None,
}

#[derive(Debug, Serialize)]
pub struct DeviceRow {
    pub device: String,
    pub size_bytes: u64,
    pub backend: Option<String>,
    pub owner: Owner,
    pub volume: Option<String>,
    /// `raw block` or `<fs> filesystem`.
    pub access: Option<String>,
    pub export: Option<String>,
    /// `none` for a plaintext export, `kernel TLS, <version> <cipher>` (as negotiated when
    /// attached) for an `nbds://` one.
    pub encryption: Option<String>,
    pub step: Option<String>,
    pub staging_path: Option<String>,
    pub targets: Vec<String>,
    /// TCP connections the kernel shows established, of those the volume asked for; `None`
    /// when it cannot tell (unix sockets, tcp_diag not loaded).
    pub connections_alive: Option<usize>,
    pub connections_total: Option<usize>,
    /// `up`, `down` or `unknown` (from the connections, not from the daemon's memory).
    pub link: String,
    /// Where the device is mounted (filesystems and bind mounts of the device node).
    pub mounted_at: Vec<String>,
    /// Processes that have the device open (`pid (command)`).
    pub held_by: Vec<String>,
    pub scheduler: Option<String>,
    pub problems: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct RecordRow {
    pub volume: String,
    pub identifier: String,
    pub device: Option<String>,
    pub step: String,
    pub staging_path: Option<String>,
    pub targets: Vec<String>,
    pub problems: Vec<String>,
}

impl Status {
    pub fn problem_count(&self) -> usize {
        self.devices.iter().map(|d| d.problems.len()).sum::<usize>()
            + self
                .records_without_device
                .iter()
                .map(|r| r.problems.len())
                .sum::<usize>()
            + self.unreadable_records.len()
    }
}

pub fn collect(
    state_dir: &Path,
    node_id: &str,
    csi_socket: &Path,
    sysfs: &Sysfs,
) -> Result<Status, NodeError> {
    let loaded = Journal::peek(state_dir)?;
    let table = MountTable::read()?;
    let holders = crate::openers::open_devices();
    let by_identifier: BTreeMap<&str, &Record> = loaded
        .records
        .iter()
        .map(|r| (r.identifier.as_str(), r))
        .collect();
    let mut devices = Vec::new();
    let mut seen = Vec::new();
    for index in sysfs.devices()? {
        let backend = sysfs.backend(index)?;
        let record = backend
            .as_deref()
            .and_then(|b| by_identifier.get(b))
            .copied();
        if let Some(r) = record {
            seen.push(r.identifier.clone());
        }
        devices.push(device_row(
            index, backend, record, node_id, sysfs, &table, &holders,
        ));
    }
    let records_without_device = loaded
        .records
        .iter()
        .filter(|r| !seen.contains(&r.identifier))
        .map(record_row)
        .collect();
    let last_recovery = std::fs::read(state_dir.join(REPORT_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    Ok(Status {
        schema: SCHEMA,
        node_id: node_id.to_owned(),
        daemon_running: std::os::unix::net::UnixStream::connect(csi_socket).is_ok(),
        devices,
        records_without_device,
        unreadable_records: loaded
            .quarantined
            .iter()
            .map(|(p, why)| format!("{}: {why}", p.display()))
            .collect(),
        last_recovery,
    })
}

fn device_row(
    index: DeviceIndex,
    backend: Option<String>,
    record: Option<&Record>,
    node_id: &str,
    sysfs: &Sysfs,
    table: &MountTable,
    holders: &BTreeMap<String, Vec<String>>,
) -> DeviceRow {
    let parsed = backend.as_deref().and_then(Identifier::parse);
    let owner = match (&backend, &parsed) {
        // nbd-client and qemu-nbd -c set no identifier: connected all the same, and not ours.
        (None, _) if sysfs.in_use(index).unwrap_or(false) => Owner::Foreign,
        (None, _) => Owner::None,
        (Some(_), Some(id)) if id.node == node_id => Owner::Ours,
        (Some(_), Some(_)) => Owner::OtherNode,
        (Some(_), None) => Owner::Foreign,
    };
    let mounted_at = mounts_of(table, sysfs, index);
    let scheduler = sysfs.scheduler(index).ok();
    let mut problems = Vec::new();
    let (connections_alive, connections_total) = record
        .and_then(|r| r.export.as_ref().map(|e| (r, e)))
        .map_or((None, None), |(r, e)| {
            (alive_connections(r), Some(usize::from(e.connections)))
        });
    let link = match (connections_alive, connections_total) {
        (Some(a), Some(t)) if a >= t => "up",
        (Some(_), Some(_)) => "down",
        _ if record.is_some() => "unknown",
        _ => "-",
    };
    match owner {
        Owner::Ours => match record {
            Some(r) => volume_problems(r, index, table, &mut problems),
            None => problems.push(
                "carries this node's identifier but no journal record names it (record lost or unreadable)"
                    .to_owned(),
            ),
        },
        Owner::OtherNode => problems.push(format!(
            "carries the identifier of node {:?}, not this node's {node_id:?}",
            parsed.as_ref().map(|p| p.node.as_str()).unwrap_or("?")
        )),
        Owner::None if !mounted_at.is_empty() => problems.push(format!(
            "not attached, yet mounted at {}",
            mounted_at.join(", ")
        )),
        Owner::Foreign | Owner::None => {}
    }
    if link == "down" {
        problems.push(format!(
            "{} of {} connections open",
            connections_alive.unwrap_or_default(),
            connections_total.unwrap_or_default()
        ));
    }
    if owner == Owner::Ours {
        if let Some(s) = scheduler.as_deref().filter(|s| *s != "none") {
            problems.push(format!(
                "I/O scheduler is {s}, not none (links may drop on kernels before 6.14)"
            ));
        }
    }
    DeviceRow {
        device: index.name(),
        size_bytes: sysfs.size_bytes(index).unwrap_or_default(),
        backend,
        owner,
        volume: record
            .map(|r| r.volume_id.to_string())
            .or_else(|| parsed.as_ref().and_then(|p| p.volume.clone())),
        access: record.map(|r| r.access.to_string()),
        export: record.and_then(|r| r.export.as_ref().map(|e| e.uri.clone())),
        encryption: record.and_then(encryption),
        step: record.map(|r| step_name(r.phase())),
        staging_path: record.and_then(|r| r.staging_path.as_ref().map(|p| p.display().to_string())),
        targets: record
            .map(|r| r.targets.keys().map(|p| p.display().to_string()).collect())
            .unwrap_or_default(),
        connections_alive,
        connections_total,
        link: link.to_owned(),
        mounted_at,
        held_by: holders.get(&index.name()).cloned().unwrap_or_default(),
        scheduler,
        problems,
    }
}

/// How a record's connections are protected, when its export is known.
fn encryption(r: &Record) -> Option<String> {
    let export = r.export.as_ref()?;
    let tls = export.uri.parse::<nbd::NbdUri>().is_ok_and(|u| u.tls());
    if !tls {
        return Some("none".to_owned());
    }
    let mut shown = match &r.tls {
        Some(session) => format!("kernel TLS, {session}"),
        None => "kernel TLS".to_owned(),
    };
    // Where the next dial's certificates come from, the first question after a rotation.
    shown.push_str(match (&export.stage_tls, &export.tls_profile) {
        (Some(_), _) => " (certificates from the node-stage secret)",
        (None, Some(_)) => " (certificates from the node's TLS profile)",
        (None, None) => " (certificates from the node's tls-* files)",
    });
    Some(shown)
}

/// What is wrong with a volume whose device the kernel has.
fn volume_problems(r: &Record, index: DeviceIndex, table: &MountTable, problems: &mut Vec<String>) {
    if r.device != Some(index) {
        problems.push(format!(
            "journal says {}, the kernel has the volume on {index}",
            r.device
                .map(|d| format!("nbd{}", d.0))
                .unwrap_or_else(|| "no device".into())
        ));
    }
    if r.phase() != Phase::Staged {
        problems.push(format!("stopped at step {}", step_name(r.phase())));
    }
    fenced_problem(r, problems);
    if let (Access::Mount { .. }, Some(staging), Phase::Staged) =
        (&r.access, &r.staging_path, r.phase())
    {
        if !table.is_mount_point(staging) {
            problems.push(format!("staging mount missing at {}", staging.display()));
        }
    }
    for (target, t) in &r.targets {
        if t.phase() == TargetPhase::Published && !table.is_mount_point(target) {
            problems.push(format!(
                "publish target {} is not mounted",
                target.display()
            ));
        }
    }
}

/// A fenced volume is a problem until NodeUnstage has cleaned it up.
fn fenced_problem(r: &Record, problems: &mut Vec<String>) {
    if let Some(f) = &r.fenced {
        problems.push(format!(
            "fenced (the export refused this node's grant: {}); it was unpublished from this node, so unpublish and unstage it here",
            f.refusal
        ));
    }
}

fn record_row(r: &Record) -> RecordRow {
    let mut problems = Vec::new();
    fenced_problem(r, &mut problems);
    match (r.phase(), r.device) {
        // An attach interrupted before CONNECT: recovery or the next NodeStage clears it.
        (Phase::Attaching, None) => {}
        (_, Some(d)) => problems.push(format!(
            "journal says nbd{}, the kernel has no device with its identifier",
            d.0
        )),
        (phase, None) => problems.push(format!("no device at step {}", step_name(phase))),
    }
    RecordRow {
        volume: r.volume_id.to_string(),
        identifier: r.identifier.to_string(),
        device: r.device.map(|d| format!("nbd{}", d.0)),
        step: step_name(r.phase()),
        staging_path: r.staging_path.as_ref().map(|p| p.display().to_string()),
        targets: r.targets.keys().map(|p| p.display().to_string()).collect(),
        problems,
    }
}

fn step_name(phase: Phase) -> String {
    match phase {
        Phase::Expanding { to_bytes } => format!("expanding to {to_bytes}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Established connections of those journaled; `None` when there are none to ask about
/// (unix sockets) or the kernel cannot tell.
fn alive_connections(r: &Record) -> Option<usize> {
    if r.tcp.is_empty() {
        return None;
    }
    let states = crate::connections::states(&r.tcp);
    if states.contains(&None) {
        return None;
    }
    Some(states.iter().filter(|s| **s == Some(true)).count())
}

/// nbd device name → processes that have it open, from `/proc/*/fd`.
/// Where `index` is mounted: filesystems on the device, and bind mounts of its device node
/// (raw block targets).
pub(crate) fn mounts_of(table: &MountTable, sysfs: &Sysfs, index: DeviceIndex) -> Vec<String> {
    let mut mounted_at: Vec<String> = device_numbers(&sysfs.dev_path(index))
        .map(|(major, minor)| {
            table
                .of_device(major, minor)
                .map(|m| m.mount_point.display().to_string())
                .collect()
        })
        .unwrap_or_default();
    mounted_at.extend(
        table
            .of_device_node(&index.name())
            .map(|m| m.mount_point.display().to_string()),
    );
    mounted_at
}

/// A table for people: devices in use, then idle ones counted, then records without a
/// device and unreadable records.
pub fn render(status: &Status) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "node {} — daemon {}",
        status.node_id,
        if status.daemon_running {
            "running"
        } else {
            "not running"
        }
    );
    let _ = writeln!(
        out,
        "{:<7} {:>9} {:<10} {:<40} {:<8} {:<12} {:<5} PROBLEMS",
        "DEVICE", "SIZE", "OWNER", "VOLUME", "ACCESS", "STEP", "LINK"
    );
    let mut idle = 0;
    for d in &status.devices {
        if d.owner == Owner::None && d.problems.is_empty() && d.held_by.is_empty() {
            idle += 1;
            continue;
        }
        let _ = writeln!(
            out,
            "{:<7} {:>9} {:<10} {:<40} {:<8} {:<12} {:<5} {}",
            d.device,
            human_size(d.size_bytes),
            format!("{:?}", d.owner).to_lowercase(),
            d.volume.as_deref().unwrap_or("-"),
            d.access
                .as_deref()
                .map(|a| a.split(' ').next().unwrap_or(a))
                .unwrap_or("-"),
            d.step.as_deref().unwrap_or("-"),
            d.link,
            if d.problems.is_empty() {
                "-".to_owned()
            } else {
                d.problems.join("; ")
            }
        );
        for (what, value) in [
            ("export", d.export.clone()),
            ("encryption", d.encryption.clone()),
            ("backend", d.backend.clone()),
            ("staging", d.staging_path.clone()),
        ] {
            if let Some(v) = value {
                let _ = writeln!(out, "        {what}: {v}");
            }
        }
        if d.owner == Owner::Foreign && d.backend.is_none() {
            let _ = writeln!(
                out,
                "        backend: none (attached by nbd-client, qemu-nbd -c or another ioctl user)"
            );
        }
        for t in &d.targets {
            let _ = writeln!(out, "        target: {t}");
        }
        if !d.mounted_at.is_empty() {
            let _ = writeln!(out, "        mounted at: {}", d.mounted_at.join(", "));
        }
        if !d.held_by.is_empty() {
            let _ = writeln!(out, "        held open by: {}", d.held_by.join(", "));
        }
    }
    if idle > 0 {
        let _ = writeln!(
            out,
            "({idle} idle nbd devices not shown; --json lists them)"
        );
    }
    for r in &status.records_without_device {
        let _ = writeln!(
            out,
            "record {} ({}, step {}): {}",
            r.volume,
            r.device.as_deref().unwrap_or("no device"),
            r.step,
            if r.problems.is_empty() {
                "-".to_owned()
            } else {
                r.problems.join("; ")
            }
        );
    }
    for r in &status.unreadable_records {
        let _ = writeln!(out, "unreadable record {r}");
    }
    if let Some(r) = &status.last_recovery {
        for u in &r.unreconciled {
            let _ = writeln!(out, "last start-up could not reconcile: {u}");
        }
    }
    let problems = status.problem_count();
    let _ = writeln!(
        out,
        "{}",
        if problems == 0 {
            "consistent: journal, kernel and mount table agree".to_owned()
        } else {
            format!("{problems} problem(s)")
        }
    );
    out
}

fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut size = bytes as f64;
    let mut unit = 0;
    while size >= 1024.0 && unit < UNITS.len() - 1 {
        size /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{size:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_like_people_write_them() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(64 << 20), "64.0 MiB");
        assert_eq!(human_size(3 << 30), "3.0 GiB");
    }

    #[test]
    fn a_record_without_its_device_is_a_problem_an_interrupted_attach_is_not() {
        let json = serde_json::json!({
            "schema": 1, "volume_id": "v", "identifier": "ustor:n:v:01", "export": null,
            "device": 3, "staging_path": null, "access": {"kind": "block"},
            "mode": "SINGLE_NODE_SINGLE_WRITER", "phase": {"step": "staged"},
            "size_bytes": null, "targets": {}
        });
        let mut r: Record = serde_json::from_value(json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            record_row(&r).problems,
            ["journal says nbd3, the kernel has no device with its identifier"]
        );
        r = r.in_phase(Phase::Attaching);
        r.device = None;
        assert!(record_row(&r).problems.is_empty());
    }

    #[test]
    fn encryption_names_kernel_tls_and_its_session_or_none() {
        let json = serde_json::json!({
            "schema": 1, "volume_id": "v", "identifier": "ustor:n:v:01",
            "export": {"uri": "nbd://h:10809/x", "connections": 1},
            "device": 3, "staging_path": null, "access": {"kind": "block"},
            "mode": "SINGLE_NODE_SINGLE_WRITER", "phase": {"step": "staged"},
            "size_bytes": null, "targets": {}
        });
        let mut r: Record = serde_json::from_value(json).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(encryption(&r).as_deref(), Some("none"));
        r.export = Some(crate::record::Export {
            uri: "nbds://h:10809/x".into(),
            connections: 1,
            tls_profile: None,
            stage_tls: None,
            grant: None,
        });
        r.tls = Some("TLSv1_3 TLS13_AES_256_GCM_SHA384".into());
        assert_eq!(
            encryption(&r).as_deref(),
            Some("kernel TLS, TLSv1_3 TLS13_AES_256_GCM_SHA384 (certificates from the node's tls-* files)")
        );
        if let Some(e) = r.export.as_mut() {
            e.stage_tls = Some("/var/lib/x/stage-tls/ab".into());
        }
        assert!(encryption(&r)
            .unwrap_or_default()
            .ends_with("(certificates from the node-stage secret)"));
        r.export = None;
        assert_eq!(encryption(&r), None);
    }
}
