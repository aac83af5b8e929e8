//! The local backend's export server: nbdkit's file plugin serving the image directory, one
//! export per image file, supervised (restarted if it exits) for a single-machine setup.
//!
//! - [`sessions`]: the open connections of each grant, which a revoke cuts.

pub mod sessions;

use std::path::PathBuf;
use std::time::Duration;

use tokio::process::Command;

#[derive(Debug, Clone)]
pub struct ExportServer {
    pub images: PathBuf,
    /// Address to listen on, e.g. `127.0.0.1:10809`.
    pub listen: std::net::SocketAddr,
}

impl ExportServer {
    /// Runs nbdkit until the task is dropped, restarting it after an exit.
    pub async fn supervise(self) {
        loop {
            let mut cmd = Command::new("nbdkit");
            cmd.args(["--foreground", "--exit-with-parent", "-i"])
                .arg(self.listen.ip().to_string())
                .args(["-p", &self.listen.port().to_string(), "file"])
                .arg(format!("dir={}", self.images.display()))
                .kill_on_drop(true);
            match cmd.spawn() {
                Ok(mut child) => {
                    tracing::info!(listen = %self.listen, images = %self.images.display(), "export server started");
                    let status = child.wait().await;
                    tracing::warn!(?status, "export server exited; restarting");
                }
                Err(e) => tracing::error!(error = %e, "cannot start nbdkit"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}
