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
    let listener = csi_proto::socket::bind(socket).context("the CSI socket")?;
    tonic::transport::Server::builder()
        .add_service(IdentityServer::new(IdentityService))
        .add_service(ControllerServer::new(ControllerService::new(
            backend, cluster_id,
        )))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop)
        .await?;
    let _ = std::fs::remove_file(socket);
    Ok(())
}
