//! `ustor-csi-node repair`: cleans what `status` flags, safely and explainably. It plans from a
//! [`Status`] and, with `--apply`, carries the plan out. It runs only while the daemon is
//! stopped, so it never races the daemon's recovery or healing.
//!
//! What it does, and only this:
//! - unmounts, at the staging and publish paths of journal records whose device is gone, the
//!   mounts those devices left behind;
//! - disconnects devices that carry this node's identifier, have no journal record, and are
//!   neither mounted nor held open by any process (a device in use is left alone, and the reason
//!   is said);
//! - forgets journal records whose device is gone, once none of their paths is still mounted
//!   from an nbd device.
//!
//! A device is disconnected only after it is proven again, at that moment, to carry the
//! identifier the plan saw, and found unused again. A device that does not carry this node's
//! identifier is never touched by the plan; `--release nbdN` ([`plan_release`]) disconnects one
//! on the operator's explicit request, under the same proofs.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mounts::MountTable;
use nbd::netlink::NbdNetlink;
use nbd::sysfs::Sysfs;
use nbd::{BackendId, DeviceIndex};

use crate::error::NodeError;
use crate::journal::Journal;
use crate::status::{Owner, Status};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Unmount {
        path: PathBuf,
        why: String,
    },
    Disconnect {
        device: DeviceIndex,
        identifier: String,
        why: String,
    },
    ForgetRecord {
        volume: String,
        why: String,
    },
    /// Not an action: something flagged that repair will not touch, and why.
    LeaveAlone {
        what: String,
        why: String,
    },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Unmount { path, why } => write!(f, "unmount {}: {why}", path.display()),
            Action::Disconnect {
                device,
                identifier,
                why,
            } => write!(f, "disconnect {device} ({identifier}): {why}"),
            Action::ForgetRecord { volume, why } => {
                write!(f, "forget the journal record of {volume}: {why}")
            }
            Action::LeaveAlone { what, why } => write!(f, "leave {what} alone: {why}"),
        }
    }
}

/// What repair would do about what `status` shows.
pub fn plan(status: &Status) -> Vec<Action> {
    let mut actions = Vec::new();
    for d in &status.devices {
        match d.owner {
            Owner::None => {
                for path in &d.mounted_at {
                    let recorded = status.records_without_device.iter().any(|r| {
                        r.staging_path.as_deref() == Some(path.as_str()) || r.targets.contains(path)
                    });
                    actions.push(if recorded {
                        Action::Unmount {
                            path: path.into(),
                            why: format!("a mount of {}, which is attached to nothing", d.device),
                        }
                    } else {
                        Action::LeaveAlone {
                            what: path.clone(),
                            why: format!(
                                "a mount of {}, which is attached to nothing, at a path no journal record names",
                                d.device
                            ),
                        }
                    });
                }
            }
            Owner::Ours if d.step.is_none() => {
                let Some(identifier) = d.backend.clone() else {
                    continue;
                };
                let Ok(device) = d.device.parse::<DeviceIndex>() else {
                    continue;
                };
                if !d.mounted_at.is_empty() || !d.held_by.is_empty() {
                    actions.push(Action::LeaveAlone {
                        what: d.device.clone(),
                        why: format!(
                            "carries this node's identifier with no journal record, but is in use ({}); \
                             start the daemon (it rebuilds the record) and let kubelet unstage it",
                            d.mounted_at
                                .iter()
                                .map(|m| format!("mounted at {m}"))
                                .chain(d.held_by.iter().map(|h| format!("open by {h}")))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    });
                    continue;
                }
                actions.push(Action::Disconnect {
                    device,
                    identifier,
                    why: "carries this node's identifier, no journal record names it, and nothing uses it"
                        .into(),
                });
            }
            Owner::OtherNode => actions.push(Action::LeaveAlone {
                what: d.device.clone(),
                why: "carries another node id's identifier: was this host renamed? its owner must decide".into(),
            }),
            Owner::Ours | Owner::Foreign => {}
        }
    }
    for r in &status.records_without_device {
        if r.problems.is_empty() {
            continue;
        }
        // Its paths still mounted from a detached device are unmounted above (Owner::None);
        // from anything else, the record stays until someone looks.
        let busy: Vec<&String> = r
            .staging_path
            .iter()
            .chain(&r.targets)
            .filter(|p| {
                status
                    .devices
                    .iter()
                    .any(|d| d.owner != Owner::None && d.mounted_at.iter().any(|m| m == *p))
            })
            .collect();
        if busy.is_empty() {
            actions.push(Action::ForgetRecord {
                volume: r.volume.clone(),
                why: "its device is gone".into(),
            });
        } else {
            actions.push(Action::LeaveAlone {
                what: format!("the record of {}", r.volume),
                why: format!(
                    "its device is gone, but another device is mounted at {}",
                    busy.iter()
                        .map(|p| p.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
    }
    actions
}

/// `repair --release nbdN`: the operator's explicit request to disconnect a device this node
/// did not attach (another tool's, or another node id's). Refused, with the reason, for a device
/// of this node's (the daemon and `repair` own those), one attached to nothing, one that carries
/// no identifier (nothing could prove it is still the same attachment at the moment of the
/// DISCONNECT: the tool that attached it must detach it), and one that is mounted or open.
pub fn plan_release(status: &Status, name: &str) -> Result<Action, String> {
    let d = status
        .devices
        .iter()
        .find(|d| d.device == name)
        .ok_or_else(|| format!("the kernel has no {name}"))?;
    let device = d
        .device
        .parse::<DeviceIndex>()
        .map_err(|e| format!("{name}: {e}"))?;
    match (d.owner, &d.backend) {
        (Owner::None, _) => return Err(format!("{name} is attached to nothing")),
        (Owner::Ours, _) => {
            return Err(format!(
                "{name} is this node's (volume {}): kubelet unstages it, or `repair` cleans it when no record names it",
                d.volume.as_deref().unwrap_or("unknown")
            ))
        }
        (_, None) => {
            return Err(format!(
                "{name} carries no backend identifier (attached by nbd-client or qemu-nbd -c):                  detach it with that tool (nbd-client -d /dev/{name}, qemu-nbd -d /dev/{name})"
            ))
        }
        (Owner::Foreign | Owner::OtherNode, Some(_)) => {}
    }
    let users: Vec<String> = d
        .mounted_at
        .iter()
        .map(|m| format!("mounted at {m}"))
        .chain(d.held_by.iter().map(|h| format!("open by {h}")))
        .collect();
    if !users.is_empty() {
        return Err(format!("{name} is in use: {}", users.join(", ")));
    }
    let identifier = d.backend.clone().unwrap_or_default();
    Ok(Action::Disconnect {
        device,
        why: format!(
            "released on request: {} bytes, {}, nothing mounts it or holds it open",
            d.size_bytes,
            match d.owner {
                Owner::OtherNode => "this driver's device for another node id",
                _ => "attached by another tool",
            }
        ),
        identifier,
    })
}

/// Why `device` cannot be disconnected now, if anything uses it: a mount (as `status` finds
/// them, bind mounts of the device node included), an open file descriptor, or a device
/// stacked on it (device mapper, md).
fn in_use_now(sysfs: &Sysfs, device: DeviceIndex) -> Result<Option<String>, NodeError> {
    let table = MountTable::read()?;
    let mut users: Vec<String> = crate::status::mounts_of(&table, sysfs, device)
        .into_iter()
        .map(|m| format!("mounted at {m}"))
        .collect();
    users.extend(
        crate::openers::open_devices()
            .remove(&device.name())
            .unwrap_or_default()
            .into_iter()
            .map(|h| format!("open by {h}")),
    );
    let holders = Path::new("/sys/block").join(device.name()).join("holders");
    if let Ok(entries) = std::fs::read_dir(holders) {
        users.extend(
            entries
                .flatten()
                .map(|e| format!("held by {}", e.file_name().to_string_lossy())),
        );
    }
    Ok((!users.is_empty()).then(|| users.join(", ")))
}

/// Carries out `actions` in order (unmounts before disconnects before forgetting), each step
/// checked again at the moment it is taken. Returns one line per action done.
pub async fn apply(
    actions: &[Action],
    state_dir: &Path,
    sysfs: &Sysfs,
) -> Result<Vec<String>, NodeError> {
    let mut done = Vec::new();
    let mut ordered: Vec<&Action> = actions.iter().collect();
    ordered.sort_by_key(|a| match a {
        Action::Unmount { .. } => 0,
        Action::Disconnect { .. } => 1,
        Action::ForgetRecord { .. } => 2,
        Action::LeaveAlone { .. } => 3,
    });
    let mut netlink = None;
    for action in ordered {
        match action {
            Action::Unmount { path, .. } => {
                if MountTable::read()?.is_mount_point(path) {
                    let p = path.clone();
                    tokio::task::spawn_blocking(move || {
                        while mounts::ops::unmount(&p)? {}
                        Ok::<_, mounts::Error>(())
                    })
                    .await
                    .map_err(|source| NodeError::Worker {
                        what: "unmount",
                        source,
                    })??;
                    done.push(format!("unmounted {}", path.display()));
                }
            }
            Action::Disconnect {
                device, identifier, ..
            } => {
                let id = BackendId::new(identifier.clone()).map_err(|source| {
                    crate::ids::IdError::Unusable {
                        identifier: identifier.clone(),
                        source,
                    }
                })?;
                // Proven again now: the plan may be old.
                let proven = sysfs.prove(*device, &id)?;
                if let Some(users) = in_use_now(sysfs, *device)? {
                    done.push(format!(
                        "left {device} alone: in use since the plan ({users})"
                    ));
                    continue;
                }
                let nl = match &netlink {
                    Some(nl) => nl,
                    None => netlink.insert(NbdNetlink::open().await?),
                };
                nl.disconnect(&proven).await?;
                nbd::attach::wait_released(sysfs, *device, Duration::from_secs(30)).await?;
                done.push(format!("disconnected {device} ({identifier})"));
            }
            Action::ForgetRecord { volume, .. } => {
                Journal::open(state_dir)?.remove(volume)?;
                done.push(format!("forgot the record of {volume}"));
            }
            Action::LeaveAlone { .. } => {}
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{DeviceRow, RecordRow};

    fn device(name: &str, owner: Owner) -> DeviceRow {
        DeviceRow {
            device: name.into(),
            size_bytes: 1 << 20,
            backend: None,
            owner,
            volume: None,
            access: None,
            export: None,
            encryption: None,
            step: None,
            staging_path: None,
            targets: Vec::new(),
            connections_alive: None,
            connections_total: None,
            link: "-".into(),
            mounted_at: Vec::new(),
            held_by: Vec::new(),
            scheduler: None,
            problems: Vec::new(),
        }
    }

    fn status(devices: Vec<DeviceRow>, records: Vec<RecordRow>) -> Status {
        Status {
            schema: crate::status::SCHEMA,
            node_id: "n".into(),
            daemon_running: false,
            devices,
            records_without_device: records,
            unreadable_records: Vec::new(),
            last_recovery: None,
        }
    }

    #[test]
    fn only_unused_devices_of_ours_are_disconnected() {
        let mut unused = device("nbd1", Owner::Ours);
        unused.backend = Some("ustor:n:v:01".into());
        let mut mounted = device("nbd2", Owner::Ours);
        mounted.backend = Some("ustor:n:w:01".into());
        mounted.mounted_at = vec!["/pod/target".into()];
        let mut recorded = device("nbd3", Owner::Ours);
        recorded.backend = Some("ustor:n:x:01".into());
        recorded.step = Some("staged".into());
        let mut foreign = device("nbd4", Owner::Foreign);
        foreign.backend = Some("someone:1".into());
        foreign.mounted_at = vec!["/mnt/theirs".into()];
        let mut other = device("nbd5", Owner::OtherNode);
        other.backend = Some("ustor:old-name:y:01".into());
        let actions = plan(&status(
            vec![unused, mounted, recorded, foreign, other],
            vec![],
        ));
        assert_eq!(
            actions
                .iter()
                .filter(|a| matches!(a, Action::Disconnect { .. }))
                .count(),
            1
        );
        assert!(matches!(&actions[0], Action::Disconnect { device, .. } if device.0 == 1));
        assert!(matches!(&actions[1], Action::LeaveAlone { what, .. } if what == "nbd2"));
        assert!(matches!(&actions[2], Action::LeaveAlone { what, .. } if what == "nbd5"));
        assert_eq!(actions.len(), 3, "{actions:?}");
    }

    #[test]
    fn only_an_unused_identified_device_of_another_tool_is_released() {
        let mut theirs = device("nbd4", Owner::Foreign);
        theirs.backend = Some("someone:1".into());
        let mut mounted = device("nbd5", Owner::Foreign);
        mounted.backend = Some("someone:2".into());
        mounted.mounted_at = vec!["/mnt/theirs".into()];
        let mut open = device("nbd6", Owner::OtherNode);
        open.backend = Some("ustor:old:y:01".into());
        open.held_by = vec!["77 (qemu)".into()];
        let unidentified = device("nbd7", Owner::Foreign);
        let mut ours = device("nbd1", Owner::Ours);
        ours.backend = Some("ustor:n:v:01".into());
        ours.volume = Some("v".into());
        let idle = device("nbd9", Owner::None);
        let st = status(
            vec![theirs, mounted, open, unidentified, ours, idle],
            vec![],
        );

        assert!(matches!(
            plan_release(&st, "nbd4"),
            Ok(Action::Disconnect { device, identifier, .. }) if device.0 == 4 && identifier == "someone:1"
        ));
        let refusal = |name: &str| plan_release(&st, name).unwrap_err();
        assert!(refusal("nbd5").contains("mounted at /mnt/theirs"));
        assert!(refusal("nbd6").contains("open by 77 (qemu)"));
        assert!(refusal("nbd7").contains("nbd-client -d /dev/nbd7"));
        assert!(refusal("nbd1").contains("this node's (volume v)"));
        assert!(refusal("nbd9").contains("attached to nothing"));
        assert!(refusal("nbd42").contains("no nbd42"));
    }

    #[test]
    fn stale_mounts_go_and_records_of_gone_devices_are_forgotten() {
        let mut stale = device("nbd0", Owner::None);
        stale.mounted_at = vec!["/pod/block-target".into()];
        let record = RecordRow {
            volume: "gone".into(),
            identifier: "ustor:n:gone:01".into(),
            device: Some("nbd0".into()),
            step: "staged".into(),
            staging_path: Some("/staging".into()),
            targets: vec!["/pod/block-target".into()],
            problems: vec![
                "journal says nbd0, the kernel has no device with its identifier".into(),
            ],
        };
        let actions = plan(&status(vec![stale], vec![record]));
        assert_eq!(
            actions,
            [
                Action::Unmount {
                    path: "/pod/block-target".into(),
                    why: "a mount of nbd0, which is attached to nothing".into()
                },
                Action::ForgetRecord {
                    volume: "gone".into(),
                    why: "its device is gone".into()
                }
            ]
        );
    }
}
