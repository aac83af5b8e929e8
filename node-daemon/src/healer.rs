//! Link healing: when the kernel announces LINK_DEAD for one of our devices, redial the
//! export, redo the handshake and RECONFIGURE the device with the new sockets, under the same
//! identifier, before its dead-connection timeout runs out. I/O waits meanwhile instead of
//! failing, whatever killed the link: a server restart, a cut network, or the kernel itself
//! dropping the connection on a reply it did not expect ("Double reply" / "Unexpected reply").
//!
//! Healing never takes a volume's operation lock: a CSI call may be blocked in umount or
//! fsync on the very device whose link is down, and only a healed link lets it finish. It
//! needs the identifier proof and the kernel's own identifier check on RECONFIGURE, plus the
//! volume's short link lock, which no one holds across device I/O.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nbd::netlink::LinkDeadEvents;

use crate::connections::{
    liveness_in, offer_new_connections, tcp_snapshot, ConnectionsError, Liveness,
};
use crate::error::NodeError;
use crate::node::{Link, Node};

// A refused dial is cheap: retry often at first, so I/O resumes soon after the export is back;
// an export that stays away is asked every few seconds.
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const MAX_PAUSE: Duration = Duration::from_secs(2);
/// How often every device is checked for a dead connection whose LINK_DEAD was missed (the
/// event socket can overrun) and for an I/O scheduler someone switched back.
pub const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// A healing task's view of the events for its volume: a LINK_DEAD that arrives while a task
/// runs bumps `dead_events`, so the task knows the link is down (not merely being refreshed)
/// and does not end before it has healed a link that died after its last attempt.
#[derive(Debug, Default)]
struct Task {
    dead_events: AtomicU64,
}

/// Volumes with a healing task running, so events for one volume do not pile up tasks.
#[derive(Debug, Default)]
pub struct Healer {
    running: Mutex<HashMap<String, Arc<Task>>>,
}

impl Healer {
    /// Consumes LINK_DEAD events for as long as the daemon runs, and sweeps every device
    /// periodically for what the events may have missed.
    pub fn spawn(
        self: Arc<Self>,
        node: Arc<Node>,
        mut events: LinkDeadEvents,
    ) -> tokio::task::JoinHandle<()> {
        let sweeper = {
            let (healer, node) = (Arc::clone(&self), Arc::clone(&node));
            tokio::spawn(async move {
                let mut every = tokio::time::interval(SWEEP_EVERY);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                every.tick().await;
                loop {
                    every.tick().await;
                    let _ = Arc::clone(&healer).sweep_off_runtime(&node).await;
                }
            })
        };
        tokio::spawn(async move {
            let _sweeper = AbortOnDrop(sweeper);
            loop {
                match events.next().await {
                    Some(Ok(index)) => match node.record_by_device(index) {
                        Some(record) => {
                            node.metrics.link_dead.inc();
                            tracing::warn!(volume = %record.volume_id, device = %index, "link dead; reconnecting");
                            Arc::clone(&self).heal(
                                Arc::clone(&node),
                                record.volume_id.to_string(),
                                true,
                            );
                        }
                        None => {
                            tracing::debug!(device = %index, "link dead on a device that is not ours")
                        }
                    },
                    Some(Err(e)) => {
                        // Most likely an overrun: events were lost. Look at every device now.
                        tracing::warn!(error = %e, "LINK_DEAD event stream; sweeping every device");
                        drop(Arc::clone(&self).sweep_off_runtime(&node));
                    }
                    None => {
                        tracing::error!("LINK_DEAD stream closed; resubscribing");
                        events = loop {
                            match LinkDeadEvents::subscribe().await {
                                Ok(e) => break e,
                                Err(e) => {
                                    tracing::error!(error = %e, "resubscribing to LINK_DEAD");
                                    tokio::time::sleep(MAX_PAUSE).await;
                                }
                            }
                        };
                        drop(Arc::clone(&self).sweep_off_runtime(&node));
                    }
                }
            }
        })
    }

    /// After a restart: give fresh connections once to every device that may have a dead
    /// slot (a link that died while the daemon was down: its LINK_DEAD went unheard). The
    /// kernel puts them into dead slots only and drops the rest, so this costs a live link
    /// nothing but a dial; devices whose TCP connections are all established are skipped, so
    /// a restart with hundreds of healthy volumes does not redial them all. Runs before
    /// recovery does any device I/O, which would otherwise wait on such a link.
    pub fn refresh_all(self: &Arc<Self>, node: &Arc<Node>) {
        let snapshot = tcp_snapshot();
        for record in node.records() {
            if record.export.is_none() || record.device.is_none() || record.fenced.is_some() {
                continue;
            }
            match liveness_in(snapshot.as_ref(), &record.tcp) {
                // Provably dead: reported as down from the start.
                Liveness::SomeClosed => {
                    Arc::clone(self).heal(Arc::clone(node), record.volume_id.to_string(), true)
                }
                Liveness::Unknown => {
                    Arc::clone(self).heal(Arc::clone(node), record.volume_id.to_string(), false)
                }
                Liveness::AllEstablished => {}
            }
        }
    }

    /// [`sweep`](Self::sweep) on the blocking pool: a scheduler write freezes the device's
    /// queue, which waits for requests in flight, and those wait for a dead link's heal.
    fn sweep_off_runtime(self: Arc<Self>, node: &Arc<Node>) -> tokio::task::JoinHandle<()> {
        let node = Arc::clone(node);
        tokio::task::spawn_blocking(move || self.sweep(&node))
    }

    /// What a missed LINK_DEAD would have told: a journaled connection of a device that the
    /// kernel reports closed. Also puts back the `none` I/O scheduler (see nbd::attach), and
    /// sets it ahead on idle devices.
    pub fn sweep(self: &Arc<Self>, node: &Arc<Node>) {
        let snapshot = tcp_snapshot();
        for record in node.records() {
            let Some(index) = record.device_index() else {
                continue;
            };
            if !self.is_healing_dead_link(&record.volume_id)
                && record.fenced.is_none()
                && liveness_in(snapshot.as_ref(), &record.tcp) == Liveness::SomeClosed
            {
                tracing::warn!(volume = %record.volume_id, device = %index, "a connection is closed and no LINK_DEAD was heard; reconnecting");
                Arc::clone(self).heal(Arc::clone(node), record.volume_id.to_string(), true);
            }
            node.keep_scheduler(&record);
        }
        node.prepare_idle_devices();
    }

    /// Whether a task is already healing `volume` as a dead link (a refresh is not).
    fn is_healing_dead_link(&self, volume: &str) -> bool {
        self.running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(volume)
            .is_some_and(|t| t.dead_events.load(Ordering::SeqCst) > 0)
    }

    /// Reconnects `volume` until it succeeds or there is nothing left to heal. With
    /// `known_dead`, the link is reported down (in the volume condition) until healed, and
    /// retried with capped back-off for as long as the volume has its device.
    fn heal(self: Arc<Self>, node: Arc<Node>, volume: String, known_dead: bool) {
        let task = {
            let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(task) = running.get(&volume) {
                if known_dead {
                    task.dead_events.fetch_add(1, Ordering::SeqCst);
                }
                return;
            }
            let task = Arc::new(Task::default());
            if known_dead {
                task.dead_events.fetch_add(1, Ordering::SeqCst);
            }
            running.insert(volume.clone(), Arc::clone(&task));
            task
        };
        tokio::spawn(async move {
            let mut since = Instant::now();
            let mut pause = FIRST_PAUSE;
            let mut attempts = 0u32;
            let mut reported_down = false;
            loop {
                let seen = task.dead_events.load(Ordering::SeqCst);
                let dead = seen > 0;
                if dead && !reported_down {
                    reported_down = true;
                    node.set_link(
                        &volume,
                        Link::Down {
                            since,
                            last_error: None,
                        },
                    );
                }
                attempts += 1;
                let outcome = Self::attempt(&node, &volume).await;
                if !matches!(outcome, Ok(false)) {
                    node.metrics.heal_attempt(outcome.is_ok());
                }
                match outcome {
                    Ok(healed) => {
                        if healed && dead {
                            tracing::info!(%volume, attempts, downtime_ms = millis(since.elapsed()), "link healed");
                        } else if healed {
                            tracing::debug!(%volume, "connections refreshed");
                        }
                        if healed {
                            node.set_link(&volume, Link::Up);
                        }
                        if self.finish(&volume, &task, seen) {
                            return;
                        }
                        // The link died again after this attempt began: heal that too.
                        (since, pause, attempts, reported_down) =
                            (Instant::now(), FIRST_PAUSE, 0, false);
                        continue;
                    }
                    Err(e) => {
                        if let Some(refusal) = crate::fence::refusal(&e) {
                            // Refused, not down: the volume was unpublished from this node.
                            node.fence(&volume, refusal).await;
                            let mut running =
                                self.running.lock().unwrap_or_else(|p| p.into_inner());
                            running.remove(&volume);
                            return;
                        }
                        // Rate-limited: the first failures, then every doubling.
                        if attempts.is_power_of_two() {
                            tracing::warn!(%volume, attempts, error = %e, "reconnect failed; retrying");
                        }
                        // An export that came back different is abnormal even when no
                        // LINK_DEAD was heard (a refresh after a restart found it).
                        let changed = matches!(
                            e,
                            NodeError::Connections(ConnectionsError::ExportChanged { .. })
                        );
                        if dead || changed {
                            let e = e.to_string();
                            node.set_link(
                                &volume,
                                Link::Down {
                                    since,
                                    last_error: Some(e),
                                },
                            );
                        } else if since.elapsed() > node.settings.dead_conn_timeout
                            && self.finish(&volume, &task, seen)
                        {
                            return;
                        }
                    }
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
        });
    }

    /// Ends a task unless a LINK_DEAD arrived after `seen` was read. Decided under the map's
    /// lock, so an event is either counted by this task or starts a new one.
    fn finish(&self, volume: &str, task: &Task, seen: u64) -> bool {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if task.dead_events.load(Ordering::SeqCst) != seen {
            return false;
        }
        running.remove(volume);
        true
    }

    /// One reconnect. `Ok(false)`: nothing to heal any more (unstaged, detaching, device gone).
    async fn attempt(node: &Node, volume: &str) -> Result<bool, NodeError> {
        let Some(record) = node.record(volume) else {
            return Ok(false);
        };
        if node.is_detaching(volume) || record.fenced.is_some() {
            return Ok(false);
        }
        crate::node::known_export(&record)?;
        let Some(device) = node.proven_device(&record)? else {
            tracing::warn!(%volume, "device is gone; nothing to reconnect");
            return Ok(false);
        };
        match offer_new_connections(node, &record, &device).await {
            Ok(()) => Ok(true),
            Err(_) if node.is_detaching(volume) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// Stops the sweeper with the event loop (shutdown aborts the loop's task).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Milliseconds for a log field (a duration past `u64::MAX` ms is not one a node lives to see).
pub(crate) fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
