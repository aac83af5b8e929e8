//! systemd integration (`Type=notify`): READY=1 once recovery is done and the CSI socket
//! serves, STATUS= lines with the volume counts kept current, and a watchdog keep-alive sent only when the
//! daemon proves it still works. Outside systemd (no NOTIFY_SOCKET) every call is a no-op.

use std::sync::Arc;
use std::time::Duration;

use sd_notify::NotifyState;

use crate::node::Node;

/// What `systemctl status` shows under the unit's name.
pub fn status_line(node: &Node) -> String {
    let volumes = node.record_count();
    let down = node.links_down();
    format!("{volumes} volume(s) attached, {down} link(s) down")
}

pub fn ready(node: &Node) {
    notify(&[NotifyState::Ready, NotifyState::Status(&status_line(node))]);
}

pub fn stopping() {
    notify(&[NotifyState::Stopping]);
}

fn notify(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!(error = %e, "notifying systemd");
    }
}

/// How often the STATUS= line is brought up to date (sent only when it changed).
const STATUS_EVERY: Duration = Duration::from_secs(1);

/// Keeps `systemctl status` current: the volume and link-down counts as they change. `None`
/// outside systemd.
pub fn spawn_status(node: Arc<Node>) -> Option<tokio::task::JoinHandle<()>> {
    std::env::var_os("NOTIFY_SOCKET")?;
    Some(tokio::spawn(async move {
        let mut shown = status_line(&node);
        let mut every = tokio::time::interval(STATUS_EVERY);
        loop {
            every.tick().await;
            let now = status_line(&node);
            if now != shown {
                notify(&[NotifyState::Status(&now)]);
                shown = now;
            }
        }
    }))
}

/// How long the liveness proof may take before the keep-alive is skipped.
const PROOF_WITHIN: Duration = Duration::from_secs(5);

/// Sends WATCHDOG=1 every half `WatchdogSec`, each time after proving the daemon works: the
/// runtime ran this task, the node's state lock is free, and the blocking pool (where device
/// I/O runs) takes new work. A wedged daemon stops sending and systemd restarts it, which
/// never detaches a volume. `None` when systemd asked for no watchdog.
pub fn spawn_watchdog(node: Arc<Node>) -> Option<tokio::task::JoinHandle<()>> {
    let period = sd_notify::watchdog_enabled()? / 2;
    tracing::info!(?period, "systemd watchdog enabled");
    Some(tokio::spawn(async move {
        let mut every = tokio::time::interval(period);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let proof = {
                let node = Arc::clone(&node);
                tokio::time::timeout(
                    PROOF_WITHIN,
                    tokio::task::spawn_blocking(move || status_line(&node)),
                )
                .await
            };
            match proof {
                Ok(Ok(status)) => notify(&[NotifyState::Watchdog, NotifyState::Status(&status)]),
                Ok(Err(e)) => tracing::error!(error = %e, "watchdog proof failed"),
                Err(_) => tracing::error!(
                    "the blocking pool did not take new work within {PROOF_WITHIN:?}: no keep-alive"
                ),
            }
        }
    }))
}
