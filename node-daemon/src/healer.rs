//! Link healing: when the kernel announces LINK_DEAD for one of our devices, redial the
//! export, redo the handshake and RECONFIGURE the device with the new sockets, under the same
//! identifier, before its dead-connection timeout runs out. I/O waits meanwhile instead of
//! failing, whatever killed the link: a server restart, a cut network, or the kernel itself
//! dropping the connection on a reply it did not expect ("Double reply" / "Unexpected reply").

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nbd::netlink::LinkDeadEvents;

use crate::connections::offer_new_connections;
use crate::node::{Link, Node};
use crate::record::Phase;

// A refused dial is cheap: retry often, so I/O resumes soon after the export is back.
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// Volumes with a healing task running, so events for one volume do not pile up tasks.
#[derive(Debug, Default)]
pub struct Healer {
    running: Mutex<HashSet<String>>,
}

impl Healer {
    /// Consumes LINK_DEAD events for as long as the daemon runs.
    pub fn spawn(
        self: Arc<Self>,
        node: Arc<Node>,
        mut events: LinkDeadEvents,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                match events.next().await {
                    Some(Ok(index)) => match node.record_by_device(index) {
                        Some(record) => {
                            node.metrics.link_dead.inc();
                            tracing::warn!(volume = %record.volume_id, device = %index, "link dead; reconnecting");
                            Arc::clone(&self).heal(Arc::clone(&node), record.volume_id, true);
                        }
                        None => {
                            tracing::debug!(device = %index, "link dead on a device that is not ours")
                        }
                    },
                    Some(Err(e)) => tracing::warn!(error = %e, "LINK_DEAD event"),
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
                    }
                }
            }
        })
    }

    /// After a restart: give every staged device fresh connections once. The kernel puts them
    /// into dead slots only and drops the rest, so this heals a link that died while the
    /// daemon was down (its LINK_DEAD went unheard) and costs a live one nothing.
    pub fn refresh_all(self: &Arc<Self>, node: &Arc<Node>) {
        for record in node.records() {
            if record.phase == Phase::Staged && record.export.is_some() && record.device.is_some() {
                Arc::clone(self).heal(Arc::clone(node), record.volume_id, false);
            }
        }
    }

    /// Reconnects `volume` until it succeeds or there is nothing left to heal. With
    /// `known_dead`, the link is reported down (in the volume condition) until healed.
    fn heal(self: Arc<Self>, node: Arc<Node>, volume: String, known_dead: bool) {
        {
            let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            if !running.insert(volume.clone()) {
                return;
            }
        }
        tokio::spawn(async move {
            let since = Instant::now();
            if known_dead {
                node.set_link(
                    &volume,
                    Link::Down {
                        since,
                        last_error: None,
                    },
                );
            }
            let mut pause = FIRST_PAUSE;
            let mut attempts = 0u32;
            loop {
                attempts += 1;
                let outcome = Self::attempt(&node, &volume).await;
                if !matches!(outcome, Ok(false)) {
                    node.metrics.heal_attempt(outcome.is_ok());
                }
                match outcome {
                    Ok(true) => {
                        if known_dead {
                            tracing::info!(%volume, attempts, downtime_ms = since.elapsed().as_millis() as u64, "link healed");
                        } else {
                            tracing::debug!(%volume, "connections refreshed");
                        }
                        node.set_link(&volume, Link::Up);
                        break;
                    }
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!(%volume, attempts, error = %e, "reconnect failed; retrying");
                        if known_dead {
                            node.set_link(
                                &volume,
                                Link::Down {
                                    since,
                                    last_error: Some(e),
                                },
                            );
                        } else if since.elapsed() > node.settings.dead_conn_timeout {
                            break;
                        }
                    }
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
            self.running
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&volume);
        });
    }

    /// One reconnect. `Ok(false)`: nothing to heal any more (unstaged, device gone).
    async fn attempt(node: &Node, volume: &str) -> Result<bool, String> {
        let _guard = node.locks.lock(volume).await;
        let Some(record) = node.record(volume) else {
            return Ok(false);
        };
        if record.phase == Phase::Unstaging {
            return Ok(false);
        }
        if record.export.is_none() {
            return Err("the export is not known yet".into());
        }
        let device = match node.proven_device(&record) {
            Ok(Some(d)) => d,
            Ok(None) => {
                tracing::warn!(%volume, "device is gone; nothing to reconnect");
                return Ok(false);
            }
            Err(e) => return Err(e.to_string()),
        };
        let mut record = record;
        offer_new_connections(node, &mut record, &device)
            .await
            .map_err(|e| e.to_string())?;
        Ok(true)
    }
}
