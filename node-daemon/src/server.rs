//! Start-up order, sockets, and shutdown.
//!
//! 1. netlink (loading the nbd module if the kernel does not autoload it) and the LINK_DEAD
//!    subscription, before anything else, so no event is missed;
//! 2. the CSI socket, so Probe answers "not ready" while recovery runs;
//! 3. recovery; then the healer, and the kubelet registration socket.
//!
//! Both sockets serve through [`h2_front`]: kubelet's gRPC clients send the socket's path as
//! the HTTP/2 authority, which tonic alone refuses.
//!
//! Shutdown stops serving and removes the sockets; it never touches a device: the kernel owns
//! the data path, and a restart must not interrupt I/O.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use csi_common::h2_front;
use csi_proto::csi::identity_server::IdentityServer;
use csi_proto::csi::node_server::NodeServer;
use csi_proto::registration::registration_server::RegistrationServer;
use nbd::netlink::{LinkDeadEvents, NbdNetlink};
use nbd::sysfs::Sysfs;
use tokio::sync::watch;

use crate::config::Settings;
use crate::error::NodeError;
use crate::healer::Healer;
use crate::held;
use crate::journal::{Journal, JournalError};
use crate::kernel::Host;
use crate::node::Node;
use crate::recovery;
use crate::service::identity::IdentityService;
use crate::service::node::NodeService;
use crate::service::registration::RegistrationService;
use crate::state_lock::{StateLock, StateLockError};

/// Why the daemon did not start, or stopped serving: one variant per step of the start-up order
/// above, each keeping its cause.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The nbd generic netlink family is missing, even after `modprobe nbd`.
    #[error("opening the nbd netlink family: {0}")]
    Netlink(#[source] nbd::Error),
    /// The LINK_DEAD multicast group could not be joined.
    #[error("subscribing to LINK_DEAD: {0}")]
    LinkDead(#[source] nbd::Error),
    /// The state directory's lock could not be taken.
    #[error(transparent)]
    StateLock(#[from] StateLockError),
    /// The attachment journal could not be opened.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// A socket could not be bound; the cause names the path and the step that failed.
    #[error("the {what} socket: {source}")]
    BindSocket {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// Recovery could not read or reconcile the journal.
    #[error(transparent)]
    Recovery(#[from] NodeError),
    /// SIGTERM or SIGINT could not be watched.
    #[error("the signal handler: {0}")]
    Signals(#[source] io::Error),
    /// A gRPC server stopped with an error.
    #[error("serving {what}: {source}")]
    Serve {
        what: &'static str,
        source: tonic::transport::Error,
    },
    /// A gRPC server's task panicked or was cancelled.
    #[error("serving {what}: {source}")]
    ServerTask {
        what: &'static str,
        source: tokio::task::JoinError,
    },
}

pub async fn run(settings: Settings) -> Result<(), StartError> {
    // Everything this daemon creates (journal, sockets) is for root only.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    // Sockets the previous daemon parked in systemd's store, owned from here on.
    let stored = held::from_systemd();
    // Held until the process ends: `repair --apply` never acts while this daemon does.
    let dir = settings.state_dir.clone();
    let _state_lock = tokio::task::spawn_blocking(move || StateLock::take_waiting(&dir))
        .await
        .map_err(|source| StartError::ServerTask {
            what: "the state lock",
            source,
        })??;
    let nl = open_netlink().await?;
    let events = LinkDeadEvents::subscribe()
        .await
        .map_err(StartError::LinkDead)?;
    let journal = Journal::open(&settings.state_dir)?;
    let node = Arc::new(Node::new(
        settings.clone(),
        journal,
        Host::real(nl, Sysfs::default()),
    ));
    let (stop_tx, stop_rx) = watch::channel(false);

    let csi = bind("CSI", &settings.csi_socket)?;
    let csi_server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(IdentityServer::new(IdentityService::new(Arc::clone(&node))))
            .add_service(NodeServer::new(NodeService::new(Arc::clone(&node))))
            .serve_with_incoming_shutdown(h2_front::incoming(csi), stopped(stop_rx.clone())),
    );
    tracing::info!(socket = %settings.csi_socket.display(), node_id = %settings.node_id, "serving CSI; recovering");

    let started = std::time::Instant::now();
    // The healer runs before recovery touches any device: a link that died while the daemon
    // was down would otherwise stall recovery's first unmount or read until I/O fails.
    let report = recovery::load(&node)?;
    let loaded = started.elapsed();
    take_back_held_sockets(&node, stored);
    let healer = Arc::new(Healer::default());
    let healing = Arc::clone(&healer).spawn(Arc::clone(&node), events);
    healer.refresh_all(&node);
    let refreshed = started.elapsed();
    let report = recovery::reconcile(&node, report).await?;
    // Scheduler writes on every idle device take seconds on slow machines (each freezes a
    // queue): in the background, so readiness does not wait for them.
    let idle = Arc::clone(&node);
    tokio::task::spawn_blocking(move || idle.prepare_idle_devices());
    tracing::info!(
        records = report.records,
        finished = report.finished.len(),
        rolled_back = report.rolled_back.len(),
        repaired = report.repaired.len(),
        rebuilt = report.rebuilt.len(),
        quarantined = report.quarantined.len(),
        unreconciled = report.unreconciled.len(),
        elapsed_ms = crate::healer::millis(started.elapsed()),
        load_ms = crate::healer::millis(loaded),
        refresh_ms = crate::healer::millis(refreshed - loaded),
        reconcile_ms = crate::healer::millis(started.elapsed() - refreshed),
        "recovery finished; ready"
    );
    for problem in &report.unreconciled {
        tracing::error!(problem, "not reconciled");
    }

    if let Some(addr) = settings.metrics_address {
        let metrics = Arc::clone(&node.metrics);
        tokio::spawn(async move {
            if let Err(e) = crate::metrics::serve(metrics, addr).await {
                tracing::error!(%addr, error = %e, "metrics endpoint failed");
            }
        });
    }

    let mut sockets = vec![settings.csi_socket.clone()];
    let registration = match &settings.registration_dir {
        Some(dir) => {
            let path = dir.join(RegistrationService::socket_name());
            let listener = bind(REGISTRATION, &path)?;
            sockets.push(path);
            Some(tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(RegistrationServer::new(RegistrationService::new(
                        settings.csi_socket.clone(),
                    )))
                    .serve_with_incoming_shutdown(
                        h2_front::incoming(listener),
                        stopped(stop_rx.clone()),
                    ),
            ))
        }
        None => None,
    };

    crate::systemd::ready(&node);
    let watchdog = crate::systemd::spawn_watchdog(Arc::clone(&node));
    let status = crate::systemd::spawn_status(Arc::clone(&node));

    wait_for_signal().await?;
    tracing::info!("stopping; attached devices stay attached");
    crate::systemd::stopping();
    for task in [watchdog, status].into_iter().flatten() {
        task.abort();
    }
    let _ = stop_tx.send(true);
    healing.abort();
    joined("CSI", csi_server).await?;
    if let Some(r) = registration {
        joined(REGISTRATION, r).await?;
    }
    for s in sockets {
        let _ = std::fs::remove_file(s);
    }
    Ok(())
}

/// The kubelet registration server, as its errors name it.
const REGISTRATION: &str = "kubelet registration";

fn bind(
    what: &'static str,
    path: &std::path::Path,
) -> Result<tokio::net::UnixListener, StartError> {
    csi_common::socket::bind(path).map_err(|source| StartError::BindSocket {
        what,
        path: path.to_owned(),
        source,
    })
}

/// Waits for a server task: its own error, or its panic.
async fn joined(
    what: &'static str,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) -> Result<(), StartError> {
    task.await
        .map_err(|source| StartError::ServerTask { what, source })?
        .map_err(|source| StartError::Serve { what, source })
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

async fn wait_for_signal() -> Result<(), StartError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(StartError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(StartError::Signals)?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

/// Opens the nbd netlink family, loading the module first on kernels that do not autoload it.
async fn open_netlink() -> Result<NbdNetlink, StartError> {
    match NbdNetlink::open().await {
        Err(nbd::Error::ModuleNotLoaded) => {
            tracing::info!("loading the nbd module");
            let status = tokio::process::Command::new("modprobe")
                .arg("nbd")
                .status()
                .await;
            match status {
                Ok(s) if s.success() => {}
                other => tracing::warn!(?other, "modprobe nbd failed"),
            }
            NbdNetlink::open().await.map_err(StartError::Netlink)
        }
        other => other.map_err(StartError::Netlink),
    }
}

/// The unix-socket connections systemd kept across the restart go back to their volumes
/// (those of attachments no longer journaled are closed).
fn take_back_held_sockets(node: &Node, stored: Vec<(std::os::fd::OwnedFd, String)>) {
    if stored.is_empty() {
        return;
    }
    let offered = stored.len();
    let identifiers = node
        .records()
        .into_iter()
        .map(|r| (r.volume_id.to_string(), r.identifier.to_string()))
        .collect();
    let kept = node.held.restore(stored, &identifiers);
    tracing::info!(
        offered,
        kept,
        "took back the unix-socket connections systemd kept"
    );
}
