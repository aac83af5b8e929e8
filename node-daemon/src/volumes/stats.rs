//! NodeGetVolumeStats: usage and the volume's condition. Usage is always returned, even when
//! the condition is abnormal: kubelet drops a response that has a condition but no usage.

use std::path::Path;
use std::time::Instant;

use crate::error::NodeError;
use crate::ids::VolumeId;
use crate::node::{off_runtime, Link, Node};
use crate::record::{Access, Record};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Usage {
    Filesystem(mounts::usage::Usage),
    /// Size of the block device.
    Block {
        bytes: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    pub usage: Usage,
    pub abnormal: bool,
    pub message: String,
}

impl Node {
    pub async fn stats(&self, volume: &VolumeId, path: &Path) -> Result<Stats, NodeError> {
        self.ensure_ready()?;
        let record = self.staged_record(volume)?;
        if !record.owns_path(path) {
            return Err(NodeError::NotAtPath {
                volume: volume.to_string(),
                path: path.to_owned(),
            });
        }
        let (abnormal, message) = self.condition(&record)?;
        let usage = match &record.access {
            Access::Mount { .. } => {
                // statvfs walks the path into the volume's filesystem: off the runtime, in case
                // that needs the device while its export is down.
                let at = path.to_owned();
                let measured =
                    off_runtime("statvfs", move || Ok(mounts::usage::usage(&at))).await?;
                match measured {
                    Ok(u) if !abnormal || self.mounted_here(&record, path) => Usage::Filesystem(u),
                    _ => Usage::Filesystem(mounts::usage::Usage::default()),
                }
            }
            Access::Block => Usage::Block {
                bytes: record
                    .device_index()
                    .and_then(|i| self.kernel.size_bytes(i).ok())
                    .unwrap_or_default(),
            },
        };
        Ok(Stats {
            usage,
            abnormal,
            message,
        })
    }

    fn mounted_here(&self, record: &Record, path: &Path) -> bool {
        record
            .device_index()
            .is_some_and(|i| self.mounted_from(i, path).unwrap_or(false))
    }

    /// Abnormal when the device is missing, carries another identifier, or its link is down.
    fn condition(&self, record: &Record) -> Result<(bool, String), NodeError> {
        let Some(index) = record.device_index() else {
            return Ok((true, "no NBD device is attached for this volume".into()));
        };
        let expected = &record.identifier;
        match self.kernel.backend(index)? {
            None => return Ok((true, format!("{index} is gone (no longer attached)"))),
            Some(found) if found != expected.as_str() => {
                return Ok((
                    true,
                    format!("{index} now carries {found:?}, not this volume's {expected}"),
                ))
            }
            Some(_) => {}
        }
        Ok(match self.link(&record.volume_id) {
            Link::Up => (false, format!("attached as {index}, connected")),
            Link::Fenced { refusal } => (
                true,
                format!(
                    "fenced: the export refused this node's grant ({refusal}); the volume was unpublished from this node and may be in use elsewhere. {index} is disconnected and its I/O fails; unpublish and unstage it here"
                ),
            ),
            Link::Down { since, last_error } => (
                true,
                format!(
                    "connection of {index} to its export lost {}s ago; reconnecting{}",
                    Instant::now().duration_since(since).as_secs(),
                    last_error
                        .map(|e| format!(" (last error: {e})"))
                        .unwrap_or_default()
                ),
            ),
        })
    }
}
