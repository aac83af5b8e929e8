//! NodeExpandVolume: the export has grown (ControllerExpandVolume ran); make the device and
//! the filesystem follow. The filesystem is grown through the staging path recorded in the
//! journal, never through the path the call names: the old product expanded through the pod's
//! path after a restart and then could never unstage (its v0.2.2 fix).

use std::path::PathBuf;
use std::time::Duration;

use mounts::Filesystem;
use nbd::netlink::ReconfigureRequest;
use nbd::sysfs::ProvenDevice;

use crate::connections;
use crate::error::NodeError;
use crate::ids::VolumeId;
use crate::node::{blocking, export_uri, Node};
use crate::record::{Access, Phase, Record};
use crate::volumes::stage::staging_path;

#[derive(Debug)]
pub struct ExpandRequest {
    pub volume: VolumeId,
    pub volume_path: PathBuf,
    pub required_bytes: Option<u64>,
}

impl Node {
    pub async fn expand(&self, req: ExpandRequest) -> Result<u64, NodeError> {
        self.ensure_ready()?;
        let _guard = self
            .locks
            .lock_within(req.volume.as_str(), self.settings.call_patience)
            .await?;
        let mut record = self.record(req.volume.as_str()).ok_or_else(|| {
            NodeError::NotFound(format!("volume {} is not staged on this node", req.volume))
        })?;
        if !record.owns_path(&req.volume_path) {
            return Err(NodeError::NotFound(format!(
                "volume {} is neither staged nor published at {}",
                req.volume,
                req.volume_path.display()
            )));
        }
        if !matches!(record.phase, Phase::Staged | Phase::Expanding { .. }) {
            return Err(NodeError::FailedPrecondition(format!(
                "volume {} is not staged (step: {:?})",
                req.volume, record.phase
            )));
        }
        let export = record.export.clone().ok_or_else(|| {
            NodeError::FailedPrecondition(format!(
                "the export of volume {} is not known yet; it is learned at the next NodePublish",
                req.volume
            ))
        })?;
        let (info, _probe_socket) =
            nbd::dial::dial_one(&export_uri(&export)?, self.settings.dial_timeout).await?;
        if let Some(required) = req.required_bytes {
            if info.size < required {
                return Err(NodeError::FailedPrecondition(format!(
                    "export of volume {} is {} bytes, less than the {required} requested: has ControllerExpandVolume finished?",
                    req.volume, info.size
                )));
            }
        }
        record.phase = Phase::Expanding {
            to_bytes: info.size,
        };
        self.save(&record)?;
        self.run_expand(record).await
    }

    /// Resize and grow, idempotent; the target size is in the journal.
    pub(crate) async fn run_expand(&self, mut record: Record) -> Result<u64, NodeError> {
        let Phase::Expanding { to_bytes } = record.phase else {
            return Ok(record.size_bytes.unwrap_or_default());
        };
        let device = self.proven_device(&record)?.ok_or_else(|| {
            NodeError::FailedPrecondition(format!("device of volume {} is gone", record.volume_id))
        })?;
        let index = device.index();
        if self.sysfs.size_bytes(index)? != to_bytes {
            self.nl
                .reconfigure(&ReconfigureRequest {
                    index,
                    identifier: device.identifier(),
                    sockets: &[],
                    size_bytes: Some(to_bytes),
                    dead_conn_timeout: None,
                })
                .await?;
            self.sysfs
                .wait_ready(index, to_bytes, Duration::from_secs(10))
                .await?;
        }
        let dev = self.sysfs.dev_path(index);
        if !blocking(|| connections::serves_size(&dev, to_bytes)) {
            self.replace_connections(&mut record, &device).await?;
        }
        fail::fail_point!("expand-after-resize");
        if let Access::Mount { fs, .. } = &record.access {
            let fs: Filesystem = fs.parse()?;
            let staging = staging_path(&record)?.to_owned();
            blocking(|| mounts::format::grow(fs, &dev, &staging))?;
        }
        fail::fail_point!("expand-after-grow");
        tracing::info!(volume = %record.volume_id, device = %index, bytes = to_bytes, "expanded");
        record.size_bytes = Some(to_bytes);
        record.phase = Phase::Staged;
        self.save(&record)?;
        Ok(to_bytes)
    }

    /// The server serves each connection the size it had at the handshake: abort the device's
    /// connections and give it new ones, until the device reads its new last block.
    async fn replace_connections(
        &self,
        record: &mut Record,
        device: &ProvenDevice,
    ) -> Result<(), NodeError> {
        if record.tcp.is_empty() {
            return Err(NodeError::FailedPrecondition(format!(
                "the export of volume {} refuses I/O beyond its old size on the device's existing connections, \
                 and this daemon knows no TCP connection of it to replace (unix-socket export, or attached \
                 before an interrupted start); restart the pod to restage the volume",
                record.volume_id
            )));
        }
        let aborted = connections::abort_all(&record.tcp)?;
        tracing::info!(volume = %record.volume_id, aborted, "replacing connections so the server serves the new size");
        let dev = self.sysfs.dev_path(device.index());
        let size = record.size_bytes.unwrap_or_default();
        let until = connections::deadline();
        loop {
            // The kernel notices the aborts asynchronously; sockets offered before a slot is
            // dead are dropped, so offer again until the device serves the new size.
            if let Err(e) = connections::offer_new_connections(self, record, device).await {
                tracing::debug!(error = %e, "reconnect while replacing connections");
            }
            if let Phase::Expanding { to_bytes } = record.phase {
                if blocking(|| connections::serves_size(&dev, to_bytes)) {
                    self.save(record)?;
                    return Ok(());
                }
            }
            if std::time::Instant::now() > until {
                self.save(record)?;
                return Err(NodeError::Unavailable(format!(
                    "could not give volume {} new connections within {:?} (size {size})",
                    record.volume_id,
                    connections::REPLACE_WITHIN
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
