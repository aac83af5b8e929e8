//! Serving the controller on a unix socket.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use csi_proto::csi::controller_server::ControllerServer;
use csi_proto::csi::identity_server::IdentityServer;
use tokio_stream::wrappers::UnixListenerStream;

use crate::backend::Backend;
use crate::service::controller::ControllerService;
use crate::service::identity::IdentityService;

/// Serves Identity and Controller on `socket` until `stop` resolves.
pub async fn serve(
    socket: &Path,
    backend: Arc<dyn Backend>,
    cluster_id: String,
    stop: impl std::future::Future<Output = ()>,
) -> Result<()> {
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if socket.exists() {
        std::fs::remove_file(socket)
            .with_context(|| format!("removing stale {}", socket.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(socket)
        .with_context(|| format!("binding {}", socket.display()))?;
    std::fs::set_permissions(socket, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    tonic::transport::Server::builder()
        .add_service(IdentityServer::new(IdentityService))
        .add_service(ControllerServer::new(ControllerService::new(
            backend, cluster_id,
        )))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop)
        .await?;
    Ok(())
}
