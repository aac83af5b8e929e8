//! The local backend's export server: nbdkit's file plugin serving the image directory, one
//! export per image file, supervised (restarted if it exits) for a single-machine setup.
//! nbdkit listens only on unix sockets in the backend's directory (one instance writable,
//! one read-only); nodes reach it through the [`gate`] on the public address, which admits
//! only handshakes of a live grant.
//!
//! - [`gate`]: one connection's handshake, checked and relayed;
//! - [`upstream`]: its connection to the nbdkit instance its grant is served by;
//! - [`wire`]: the framing of handshake options and replies;
//! - [`sessions`]: the open connections of each grant, which a revoke cuts;
//! - [`pause`]: the writable nbdkit's pause filter, which holds writes for snapshots.

pub mod gate;
pub mod pause;
pub mod sessions;
pub mod upstream;
pub mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::process::Command;
use tokio::task::JoinSet;

use crate::backend::local::LocalBackend;
use crate::metrics::GateMetrics;
use gate::Gate;
use pause::WriteHold;
use upstream::Sockets;

#[derive(Debug, Clone)]
pub struct ExportServer {
    /// The images it serves, and the grants the gate admits by.
    pub backend: LocalBackend,
    /// Address the gate listens on, e.g. `127.0.0.1:10809`.
    pub listen: SocketAddr,
    pub metrics: Arc<GateMetrics>,
}

impl ExportServer {
    /// Runs nbdkit and the gate until the task is dropped (which drops every connection),
    /// restarting nbdkit after an exit.
    pub async fn supervise(self) {
        let sockets = Sockets {
            writable: self.backend.export_socket(false),
            read_only: self.backend.export_socket(true),
        };
        let images = self.backend.images_dir();
        let gate = Arc::new(Gate {
            lookup: Arc::new(self.backend.clone()),
            sessions: self.backend.sessions(),
            metrics: self.metrics,
            upstreams: sockets.clone(),
        });
        let writes = self.backend.write_hold();
        tokio::join!(
            nbdkit(images.clone(), sockets.writable, Some(&writes)),
            nbdkit(images, sockets.read_only, None),
            serve(gate, self.listen)
        );
    }
}

/// Runs one nbdkit, again after each exit: the writable one (`writes` given) with the pause
/// filter its snapshots hold writes with, the read-only one without (it writes nothing).
async fn nbdkit(images: PathBuf, socket: PathBuf, writes: Option<&WriteHold>) {
    let read_only = writes.is_none();
    loop {
        // No hold may find this nbdkit running before it can be paused.
        let starting = match writes {
            Some(w) => Some(w.starting().await),
            None => None,
        };
        // A socket left by an nbdkit that did not exit cleanly would keep the next from binding.
        let _ = std::fs::remove_file(&socket);
        let mut cmd = Command::new("nbdkit");
        cmd.args(["--foreground", "--exit-with-parent"]);
        if read_only {
            cmd.arg("--readonly");
        }
        if let Some(w) = writes {
            let _ = std::fs::remove_file(w.socket());
            cmd.arg("--filter=pause");
        }
        cmd.arg("-U")
            .arg(&socket)
            .arg("file")
            .arg(format!("dir={}", images.display()));
        if let Some(w) = writes {
            cmd.arg(format!("pause-control={}", w.socket().display()));
        }
        cmd.kill_on_drop(true);
        match cmd.spawn() {
            Ok(mut child) => {
                if let (Some(starting), Some(pid)) = (starting, child.id()) {
                    let pid = i32::try_from(pid).unwrap_or(i32::MAX);
                    if !starting.started(pid).await {
                        tracing::error!(socket = %socket.display(), "nbdkit did not open its pause control; restarting it");
                    }
                }
                tracing::info!(socket = %socket.display(), images = %images.display(), read_only, "nbdkit started");
                let status = child.wait().await;
                if let Some(w) = writes {
                    w.stopped().await;
                }
                tracing::warn!(?status, "nbdkit exited; restarting");
            }
            Err(e) => tracing::error!(error = %e, "cannot start nbdkit"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The gate's accept loop; connections are tasks of this one, so dropping it ends them.
async fn serve(gate: Arc<Gate>, listen: SocketAddr) {
    let listener = loop {
        match TcpListener::bind(listen).await {
            Ok(l) => break l,
            Err(e) => {
                tracing::error!(%listen, error = %e, "export server cannot listen; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    tracing::info!(%listen, "export server listening (grants enforced)");
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        match listener.accept().await {
            Ok((stream, peer)) => {
                let gate = Arc::clone(&gate);
                connections.spawn(async move {
                    if let Err(e) = gate.serve(stream, peer).await {
                        tracing::debug!(%peer, error = %e, "NBD connection ended");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting an NBD connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
