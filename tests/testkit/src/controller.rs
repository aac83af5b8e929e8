//! The controller as a real child process with its local backend and export server (the
//! grant gate listens on `--local-listen`, nbdkit behind it on a unix socket).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use csi_proto::csi::controller_client::ControllerClient;
use csi_proto::csi::identity_client::IdentityClient;
use csi_proto::csi::ProbeRequest;
use tonic::transport::Channel;

/// The controller binary: `$USTOR_CSI_CONTROLLER_BIN`, else `ustor-csi-controller` on PATH.
pub fn binary() -> PathBuf {
    crate::binary_from_env("USTOR_CSI_CONTROLLER_BIN", "ustor-csi-controller")
}

#[derive(Debug)]
pub struct ControllerProcess {
    pub socket: PathBuf,
    /// The local backend's directory (images under `images/`).
    pub store: PathBuf,
    child: Child,
    _dir: tempfile::TempDir,
}

impl ControllerProcess {
    /// Starts `ustor-csi-controller serve --backend local` and waits until it answers.
    pub async fn start(cluster_id: &str) -> std::io::Result<(Self, ControllerClient<Channel>)> {
        Self::start_with(cluster_id, None).await
    }

    /// Like [`start`](Self::start), with the Kubernetes glue (`--kubernetes`) run against the
    /// API server of `kubeconfig` when one is given: nodes are then known from their CSINodes.
    pub async fn start_with(
        cluster_id: &str,
        kubeconfig: Option<&Path>,
    ) -> std::io::Result<(Self, ControllerClient<Channel>)> {
        Self::start_with_args(cluster_id, kubeconfig, &[]).await
    }

    /// Like [`start_with`](Self::start_with), with `extra` arguments of `serve` (the
    /// admission webhook's, for example).
    pub async fn start_with_args(
        cluster_id: &str,
        kubeconfig: Option<&Path>,
        extra: &[&str],
    ) -> std::io::Result<(Self, ControllerClient<Channel>)> {
        let dir = tempfile::Builder::new().prefix("controller").tempdir()?;
        let socket = dir.path().join("csi.sock");
        let store = dir.path().join("store");
        let listen = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let mut command = Command::new(binary());
        command.arg("serve");
        if let Some(kubeconfig) = kubeconfig {
            command.arg("--kubernetes").env("KUBECONFIG", kubeconfig);
        }
        let child = command
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", socket.display()))
            .args(["--backend", "local", "--cluster-id", cluster_id])
            .arg("--local-dir")
            .arg(&store)
            .arg("--local-listen")
            .arg(listen.to_string())
            .args(extra)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .spawn()?;
        let mut me = Self {
            socket,
            store,
            child,
            _dir: dir,
        };
        let started = Instant::now();
        loop {
            if let Some(status) = me.child.try_wait()? {
                return Err(std::io::Error::other(format!(
                    "controller exited: {status}"
                )));
            }
            if let Ok(channel) = crate::csi::connect(&me.socket).await {
                if IdentityClient::new(channel.clone())
                    .probe(ProbeRequest {})
                    .await
                    .is_ok()
                {
                    return Ok((me, ControllerClient::new(channel)));
                }
            }
            if started.elapsed() > Duration::from_secs(30) {
                me.child.kill()?;
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "controller did not start",
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
