//! NodeExpandVolume: the export has grown (ControllerExpandVolume ran); make the device and
//! the filesystem follow. The filesystem is grown through the staging path recorded in the
//! journal, never through the path the call names: the old product expanded through the pod's
//! path after a restart and then could never unstage (its v0.2.2 fix).
//!
//! The device announces a new size only once its connections can serve it: NBD servers fix an
//! export's size per connection, so the connections are replaced first (see
//! `connections.rs`; unix-socket ones through the copies in `held.rs`). Where they cannot be
//! (a unix-socket export attached before a restart that did not keep systemd's descriptor
//! store), a resize the old connections do not serve is undone, so the device is left as it
//! was and never claims space whose I/O fails.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use mounts::Filesystem;
use nbd::sysfs::ProvenDevice;

use crate::connections;
use crate::error::NodeError;
use crate::ids::VolumeId;
use crate::node::{export_uri, off_runtime, Node};
use crate::record::{Access, Phase, Record};
use crate::service::codes::{answer, Rpc, Then};
use crate::volumes::stage::{kernel_takes_size, staging_path};

/// Why a NodeExpandVolume failed.
#[derive(Debug, thiserror::Error)]
pub enum ExpandError {
    #[error(
        "export of volume {volume} is {size} bytes, less than the {required} requested: has ControllerExpandVolume finished?"
    )]
    ExportTooSmall {
        volume: String,
        size: u64,
        required: u64,
    },
    #[error(
        "the export of volume {volume} reports {export} bytes, less than the device's {current}: \
         refusing to shrink it (volumes only grow)"
    )]
    Shrink {
        volume: String,
        current: u64,
        export: u64,
    },
    /// The new size is served only on new connections, and these could not be made.
    #[error(
        "the export of volume {volume} serves its new size only on new connections, and this daemon cannot replace \
         the device's existing ones (a unix-socket export attached before a restart that did not keep \
         systemd's file-descriptor store); the device keeps its old size of {old} bytes: restart the pod \
         to restage the volume"
    )]
    OldConnections { volume: String, old: u64 },
    #[error(
        "the export of volume {volume} is now {size} bytes, not a positive multiple of 512: \
         the kernel cannot use that size; the volume keeps its current size"
    )]
    UnalignedSize { volume: String, size: u64 },
    #[error(
        "could not give volume {volume} new connections within {within:?}; its size is unchanged"
    )]
    ReplaceTimedOut { volume: String, within: Duration },
    /// The kernel resizes with the device's queue frozen: never while I/O may wait for a
    /// reconnect (see `Node::resize_while_live`).
    #[error(
        "the link of volume {volume} to its export is not proven live ({detail}); the device is not \
         resized while its I/O may wait for a reconnect, and keeps its size: retry once it has healed"
    )]
    LinkDown { volume: String, detail: String },
    #[error(
        "found no moment to resize the device of volume {volume} within {within:?}: {busy} looks found \
         requests in flight throughout, {closed} found every TCP connection closed; it keeps its size: \
         retry (a device is resized with I/O in flight only after its connections have stayed up for \
         longer than its I/O timeout)"
    )]
    NoQuietMoment {
        volume: String,
        within: Duration,
        busy: u32,
        closed: u32,
    },
}

/// How long each look for a moment with no request in flight lasts.
const IDLE_WITHIN: Duration = Duration::from_millis(200);
/// What the block layer's timer may add to a request's I/O timeout before the request is
/// timed out (its timer is rounded up to a whole second), with room to spare.
const TIMER_SLACK: Duration = Duration::from_secs(2);

/// Why a look found no moment to resize in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NotQuiet {
    /// Requests were in flight for the whole look.
    Busy,
    /// The kernel showed every TCP connection of the device closed (or, for a forced
    /// resize, one of them).
    Closed,
}

/// The moment a resize is sent in, found on the thread that sends it, so that nothing of
/// this process runs between the last look and the kernel's freeze (see
/// [`Node::resize_while_live`]): one of the device's TCP connections established and no
/// request in flight, looked at again for at most [`IDLE_WITHIN`]. A `forced` resize takes
/// such a moment too if one comes, and at the end of the look goes through the requests in
/// flight if every connection is established.
struct QuietMoment {
    sysfs: nbd::sysfs::Sysfs,
    index: nbd::DeviceIndex,
    /// The device's journaled TCP connections (none for unix-socket exports, whose proof is
    /// the read before the resize).
    tcp: Vec<crate::record::TcpConnection>,
    forced: bool,
}

impl QuietMoment {
    /// Polls until the moment comes. Blocks: runs only inside a [`crate::kernel::SendGate`].
    fn wait(self) -> Result<(), NotQuiet> {
        let until = std::time::Instant::now() + IDLE_WITHIN;
        loop {
            // The connections first, the requests in flight last: the send follows at once.
            if !connections::some_open(&self.tcp) {
                return Err(NotQuiet::Closed);
            }
            match self.sysfs.in_flight(self.index) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(device = %self.index, error = %e, "cannot read the requests in flight");
                    return Ok(());
                }
            }
            if std::time::Instant::now() >= until {
                if !self.forced {
                    return Err(NotQuiet::Busy);
                }
                return connections::all_open(&self.tcp)
                    .then_some(())
                    .ok_or(NotQuiet::Closed);
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
}

#[derive(Debug)]
pub struct ExpandRequest {
    pub volume: VolumeId,
    pub volume_path: PathBuf,
    pub required_bytes: Option<u64>,
    /// TLS material from the request's secrets (kubelet passes a node-expand secret only
    /// where the StorageClass names one and the cluster supports it).
    pub tls: Option<crate::stage_tls::StageTls>,
}

impl Node {
    pub async fn expand(&self, req: ExpandRequest) -> Result<u64, NodeError> {
        let _guard = self.begin_call(&req.volume).await?;
        let mut record = self.staged_record(&req.volume)?;
        if !record.owns_path(&req.volume_path) {
            return Err(NodeError::NotAtPath {
                volume: req.volume.to_string(),
                path: req.volume_path.clone(),
            });
        }
        if !matches!(record.phase(), Phase::Staged | Phase::Expanding { .. }) {
            return Err(NodeError::NotStagedYet {
                volume: req.volume.to_string(),
                phase: record.phase(),
            });
        }
        let mut export = crate::node::known_export(&record)?;
        let kept = self.keep_stage_tls(record.volume_id.as_str(), &export, req.tls.as_ref())?;
        if kept != export.stage_tls {
            export.stage_tls = kept.clone();
            if let Some(e) = record.export.as_mut() {
                e.stage_tls = kept;
            }
            self.save(&record)?;
        }
        let (info, _probe_socket) =
            nbd::dial::dial_one(&export_uri(&export)?, &self.dial_options(&export)?).await?;
        if let Some(required) = req.required_bytes {
            if info.size < required {
                return Err(ExpandError::ExportTooSmall {
                    volume: req.volume.to_string(),
                    size: info.size,
                    required,
                }
                .into());
            }
        }
        let device = self
            .proven_device(&record)?
            .ok_or_else(|| NodeError::DeviceGone {
                volume: record.volume_id.to_string(),
            })?;
        if !kernel_takes_size(info.size) {
            return Err(ExpandError::UnalignedSize {
                volume: req.volume.to_string(),
                size: info.size,
            }
            .into());
        }
        let current = self.kernel.size_bytes(device.index())?;
        refuse_shrink(&record.volume_id, current, info.size)?;
        self.advance(
            &mut record,
            Phase::Expanding {
                to_bytes: info.size,
            },
        )?;
        let result = self.run_expand(record).await;
        if let Err(e) = &result {
            if answer(Rpc::NodeExpand, e).then != Then::Retry {
                // The CO gives this expansion up: the volume stays usable at the size its
                // device has now (a later NodeExpand starts over from there).
                self.give_up_expansion(&req.volume, e)?;
            }
        }
        result
    }

    /// Ends an expansion that failed: `Staged` at the device's current size, so that new
    /// pods can publish the volume and NodeStage does not try the expansion again.
    pub(crate) fn give_up_expansion(
        &self,
        volume: &VolumeId,
        error: &NodeError,
    ) -> Result<(), NodeError> {
        let Some(mut record) = self.record(volume.as_str()) else {
            return Ok(());
        };
        if !matches!(record.phase(), Phase::Expanding { .. }) {
            return Ok(());
        }
        let size = match self.proven_device(&record)? {
            Some(device) => Some(self.kernel.size_bytes(device.index())?),
            None => record.size_bytes,
        };
        tracing::warn!(%volume, error = %error, size, "expansion failed; the volume stays staged at its current size");
        record.size_bytes = size;
        self.advance(&mut record, Phase::Staged)
    }

    /// Resize and grow, idempotent; the target size is in the journal.
    pub(crate) async fn run_expand(&self, mut record: Record) -> Result<u64, NodeError> {
        let Phase::Expanding { to_bytes } = record.phase() else {
            return Ok(record.size_bytes.unwrap_or_default());
        };
        self.thaw_staging(&record).await?;
        let device = self
            .proven_device(&record)?
            .ok_or_else(|| NodeError::DeviceGone {
                volume: record.volume_id.to_string(),
            })?;
        let index = device.index();
        let dev = self.kernel.dev_path(index);
        let current = self.kernel.size_bytes(index)?;
        if let Err(e) = refuse_shrink(&record.volume_id, current, to_bytes) {
            self.end_expansion(&mut record, current)?;
            return Err(e);
        }
        if current != to_bytes {
            self.replace_and_resize_quiesced(&record, &device, current, to_bytes)
                .await?;
        }
        let (dev_probe, tools) = (dev.clone(), Arc::clone(&self.tools));
        // A device that cannot read at all is a degraded server, not old connections: the
        // error keeps `Expanding` for the retry, and the size is not put back.
        let served = off_runtime("read the new end", move || {
            Ok(tools.serves_size(&dev_probe, to_bytes)?)
        })
        .await?;
        if !served {
            // Connections this daemon could not replace: put the old size back (or the
            // journaled one, after a crash between resize and this check).
            let old = if current != to_bytes {
                current
            } else {
                record.size_bytes.unwrap_or(current)
            };
            self.resize_while_live(&record, &device, old).await?;
            self.end_expansion(&mut record, old)?;
            return Err(ExpandError::OldConnections {
                volume: record.volume_id.to_string(),
                old,
            }
            .into());
        }
        fail::fail_point!("expand-after-resize");
        crate::failpoints::pause("expand-after-resize").await;
        if let Access::Mount { fs, .. } = &record.access {
            let fs: Filesystem = fs.parse()?;
            let staging = staging_path(&record)?.to_owned();
            let tools = Arc::clone(&self.tools);
            off_runtime("grow", move || Ok(tools.grow(fs, &dev, &staging)?)).await?;
        }
        fail::fail_point!("expand-after-grow");
        tracing::info!(volume = %record.volume_id, device = %index, bytes = to_bytes, "expanded");
        self.end_expansion(&mut record, to_bytes)?;
        Ok(to_bytes)
    }

    fn end_expansion(&self, record: &mut Record, size: u64) -> Result<(), NodeError> {
        record.size_bytes = Some(size);
        self.advance(record, Phase::Staged)
    }

    /// RECONFIGURE to `bytes`, and wait until the kernel shows it; never while the device's
    /// link is down.
    ///
    /// Since 6.9 the kernel freezes the device's queue to change its size, inside the
    /// RECONFIGURE and under the genl mutex that every nbd request of the machine takes. The
    /// freeze waits for every request in flight, and a request waiting for a dead link ends
    /// only at a reconnect or at the dead-connection timeout. The reconnect is a RECONFIGURE
    /// too, stuck behind that mutex: a resize sent while the link is down holds the volume's
    /// I/O, and every other volume's healing, until the timeout fails the waiting I/O. So the
    /// size changes only right after a read has proven the link live, under the link lock
    /// (our own reconnects stay out of the gap), while the kernel shows one of the device's
    /// TCP connections established, and at a moment with no request in flight. A filesystem
    /// is kept frozen across it, so nothing of its own is in flight.
    ///
    /// The last two are looked at on the thread that sends the RECONFIGURE, right before the
    /// send ([`QuietMoment`]): a request that a writer sends between the look and the freeze
    /// is what the freeze waits for, and a server that dies under it strands the resize. The
    /// look used to be made on the runtime, a thread hand-off and a message build earlier
    /// (milliseconds under load), and the long fault campaign hit that gap. What remains is a
    /// server that dies in the microseconds between the look and the freeze, under a request
    /// sent in them: the kernel gives no way to close that. (The kernel's `inflight` counts
    /// only requests handed to a socket, not those waiting for a reconnect; these wait only
    /// while every connection is dead, which the look at the connections rules out.)
    async fn resize_while_live(
        &self,
        record: &Record,
        device: &ProvenDevice,
        bytes: u64,
    ) -> Result<(), NodeError> {
        let index = device.index();
        let current = self.kernel.size_bytes(index)?;
        if current == bytes {
            return Ok(());
        }
        let volume = record.volume_id.as_str();
        let link_down = |detail: String| ExpandError::LinkDown {
            volume: volume.to_owned(),
            detail,
        };
        fail::fail_point!("expand-before-resize");
        crate::failpoints::pause("expand-before-resize").await;
        // A request sent on a connection that then died stays in flight until its I/O
        // timeout, and is then sent again over a live one. A resize forced through requests
        // in flight waits for them in the freeze: only once the connections have stayed the
        // same and up for longer than that are none of them such a request.
        let force_after = self
            .kernel
            .sysfs()
            .io_timeout(index)
            .unwrap_or(self.settings.io_timeout)
            + TIMER_SLACK;
        let within = connections::REPLACE_WITHIN.max(force_after * 2);
        let until = std::time::Instant::now() + within;
        let (mut busy, mut closed) = (0u32, 0u32);
        // Since when the connections have been these, at every look.
        let mut steady: Option<(std::time::Instant, Vec<crate::record::TcpConnection>)> = None;
        loop {
            // The read waits for a heal if the link is down (the healer is not held up): its
            // answer is the proof, whenever it comes; the dead-connection timeout fails it.
            let (dev, tools) = (self.kernel.dev_path(index), Arc::clone(&self.tools));
            off_runtime("read before resizing", move || {
                Ok(tools.serves_size(&dev, current)?)
            })
            .await
            .map_err(|e| link_down(format!("the device could not be read: {e}")))?;
            {
                let _link = self.link_locks.lock(volume).await;
                let device = self.kernel.prove(index, device.identifier())?;
                let tcp = self.connections_of(volume);
                let since = match &steady {
                    Some((since, seen)) if *seen == tcp => *since,
                    _ => steady.insert((std::time::Instant::now(), tcp.clone())).0,
                };
                let quiet = QuietMoment {
                    sysfs: self.kernel.sysfs().clone(),
                    index,
                    tcp,
                    forced: since.elapsed() >= force_after,
                };
                let forced = quiet.forced;
                let verdict = Arc::new(std::sync::OnceLock::new());
                let gate_verdict = Arc::clone(&verdict);
                let sent = std::time::Instant::now();
                let gate = Box::new(move || match quiet.wait() {
                    Ok(()) => true,
                    Err(why) => {
                        let _ = gate_verdict.set(why);
                        false
                    }
                });
                if self.kernel.resize_when(&device, bytes, gate).await? {
                    tracing::debug!(%volume, device = %index, bytes, forced, busy, closed, took_ms = crate::healer::millis(sent.elapsed()), "resized");
                    break;
                }
                match verdict.get() {
                    Some(NotQuiet::Closed) => {
                        closed += 1;
                        steady = None;
                    }
                    _ => busy += 1,
                }
                tracing::debug!(%volume, device = %index, busy, closed, "no moment to resize in yet");
            }
            if std::time::Instant::now() > until {
                return Err(ExpandError::NoQuietMoment {
                    volume: volume.to_owned(),
                    within,
                    busy,
                    closed,
                }
                .into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.kernel
            .wait_ready(index, bytes, Duration::from_secs(10))
            .await?;
        Ok(())
    }

    /// New connections where the server serves the new size only on new ones, then the new
    /// size, with the filesystem frozen, if there is one: nothing is in flight when the old
    /// connections go, so nothing waits for the I/O timeout to be sent again (and a server is
    /// never cut off mid-reply), and nothing of the filesystem's is in flight when the kernel
    /// freezes the queue to resize (see [`Node::resize_while_live`]). A crash while frozen is
    /// undone by recovery, which thaws the staging mount of every expansion it finishes.
    async fn replace_and_resize_quiesced(
        &self,
        record: &Record,
        device: &ProvenDevice,
        current: u64,
        to_bytes: u64,
    ) -> Result<(), NodeError> {
        let volume = record.volume_id.as_str();
        // Decided before the window below, in which the connections may die.
        let replace = !self.connections_of(volume).is_empty() || self.held.holds_every_slot(volume);
        let staging = self.our_staging_mount(record)?;
        if let Some(dir) = staging.clone() {
            let tools = Arc::clone(&self.tools);
            off_runtime("freeze", move || Ok(tools.freeze(&dir)?)).await?;
            fail::fail_point!("expand-while-frozen");
            crate::failpoints::pause("expand-while-frozen").await;
        }
        let grown = async {
            if replace {
                self.replace_connections(record, device, current).await?;
            }
            self.resize_while_live(record, device, to_bytes).await
        }
        .await;
        if let Some(dir) = staging {
            let tools = Arc::clone(&self.tools);
            off_runtime("thaw", move || Ok(tools.thaw(&dir)?)).await?;
        }
        grown
    }

    /// The staging path, if the volume's filesystem is mounted there from its device (never
    /// freeze or thaw whatever else is mounted, or the root filesystem under an empty dir).
    fn our_staging_mount(&self, record: &Record) -> Result<Option<PathBuf>, NodeError> {
        let (Access::Mount { .. }, Some(staging)) = (&record.access, &record.staging_path) else {
            return Ok(None);
        };
        let Some(device) = self.proven_device(record)? else {
            return Ok(None);
        };
        Ok(self
            .mounted_from(device.index(), staging)?
            .then(|| staging.clone()))
    }

    /// An expansion interrupted between freeze and thaw left its filesystem frozen: thawed
    /// before the expansion is finished (a no-op when it is not frozen).
    async fn thaw_staging(&self, record: &Record) -> Result<(), NodeError> {
        if let Some(dir) = self.our_staging_mount(record)? {
            let tools = Arc::clone(&self.tools);
            off_runtime("thaw", move || Ok(tools.thaw(&dir)?)).await?;
        }
        Ok(())
    }

    /// The server serves each connection the size it had at the handshake: abort the device's
    /// connections and give it new ones, before the device announces the new size. Done when
    /// none of the old connections is open and the device reads its current last block over
    /// the new ones.
    async fn replace_connections(
        &self,
        record: &Record,
        device: &ProvenDevice,
        current: u64,
    ) -> Result<(), NodeError> {
        // TCP connections are aborted by address; unix ones through the copies held of them.
        let old = self.connections_of(&record.volume_id);
        let (aborted, old_held) = if old.is_empty() {
            let names = self.held.shut_down_all(&record.volume_id);
            (names.len(), names)
        } else {
            (connections::abort_all(&old)?, Vec::new())
        };
        tracing::info!(volume = %record.volume_id, aborted, "replacing connections so the server serves the new size");
        let dev = self.kernel.dev_path(device.index());
        let until = connections::deadline();
        loop {
            // The kernel notices the aborts asynchronously; sockets offered before a slot is
            // dead are dropped, so offer again until every old connection is gone.
            if let Err(e) = connections::offer_new_connections(self, record, device).await {
                tracing::debug!(error = %e, "reconnect while replacing connections");
            }
            let live = self.connections_of(&record.volume_id);
            let old_gone = !old.iter().any(|c| live.contains(c))
                && !self.held.holds_any(&record.volume_id, &old_held);
            // Read only over a live new connection: with none, the read would wait for the
            // export as long as the dead-connection timeout, and when that ran out the kernel
            // failed the requests queued behind it too (the thaw's superblock write, and ext4
            // aborted its journal). A frozen filesystem with no I/O in flight loses nothing.
            let new_live =
                !live.is_empty() || self.held.holds_other_than(&record.volume_id, &old_held);
            if old_gone && new_live {
                let (dev, tools) = (dev.clone(), Arc::clone(&self.tools));
                let served = off_runtime("read", move || Ok(tools.serves_size(&dev, current)?));
                if matches!(served.await, Ok(true)) {
                    return Ok(());
                }
            }
            if std::time::Instant::now() > until {
                return Err(ExpandError::ReplaceTimedOut {
                    volume: record.volume_id.to_string(),
                    within: connections::REPLACE_WITHIN,
                }
                .into());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// NodeExpand never shrinks a device: a smaller export is a mistake somewhere else (a wrong
/// image, a restore into a smaller volume), and a shrunk device cuts the filesystem short.
fn refuse_shrink(volume: &str, current: u64, export: u64) -> Result<(), NodeError> {
    if export < current {
        return Err(ExpandError::Shrink {
            volume: volume.to_owned(),
            current,
            export,
        }
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs with one device, nbd0, whose `inflight` file says `text` (reads, writes).
    fn sysfs_in_flight(dir: &tempfile::TempDir, text: &str) -> nbd::sysfs::Sysfs {
        let device = dir.path().join("nbd0");
        std::fs::create_dir_all(&device).unwrap();
        std::fs::write(device.join("inflight"), text).unwrap();
        nbd::sysfs::Sysfs::new(dir.path(), dir.path().join("dev"))
    }

    fn moment(sysfs: nbd::sysfs::Sysfs, forced: bool) -> QuietMoment {
        QuietMoment {
            sysfs,
            index: nbd::DeviceIndex(0),
            tcp: Vec::new(),
            forced,
        }
    }

    #[test]
    fn a_quiet_moment_is_an_idle_device() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(moment(sysfs_in_flight(&dir, "0 0\n"), false).wait(), Ok(()));
    }

    #[test]
    fn a_device_busy_throughout_has_no_quiet_moment_unless_forced() {
        let dir = tempfile::tempdir().unwrap();
        let sysfs = sysfs_in_flight(&dir, "0 1\n");
        let started = std::time::Instant::now();
        assert_eq!(moment(sysfs.clone(), false).wait(), Err(NotQuiet::Busy));
        assert!(
            started.elapsed() >= IDLE_WITHIN,
            "it looked again until IDLE_WITHIN"
        );
        let started = std::time::Instant::now();
        assert_eq!(moment(sysfs, true).wait(), Ok(()));
        assert!(
            started.elapsed() >= IDLE_WITHIN,
            "a forced resize, too, waited for an idle moment first"
        );
    }

    #[test]
    fn a_device_that_goes_idle_while_looked_at_is_caught() {
        let dir = tempfile::tempdir().unwrap();
        let sysfs = sysfs_in_flight(&dir, "2 0\n");
        let path = dir.path().join("nbd0/inflight");
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            std::fs::write(path, "0 0\n").unwrap();
        });
        assert_eq!(moment(sysfs, false).wait(), Ok(()));
        writer.join().unwrap();
    }

    #[test]
    fn an_unreadable_count_does_not_hold_the_resize_up() {
        let dir = tempfile::tempdir().unwrap();
        let sysfs = nbd::sysfs::Sysfs::new(dir.path(), dir.path().join("dev"));
        assert_eq!(moment(sysfs, false).wait(), Ok(()));
    }
}
