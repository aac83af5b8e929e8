//! Serving the controller on a unix socket.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use csi_proto::csi::controller_server::ControllerServer;
use csi_proto::csi::identity_server::IdentityServer;
use tokio_stream::wrappers::UnixListenerStream;

use crate::backend::Backend;
use crate::metrics::ControllerMetrics;
use crate::service::controller::ControllerService;
use crate::service::identity::IdentityService;

/// Serves Identity and Controller on `socket` until `stop` resolves, and `/metrics` on
/// `metrics` when a listener is given (bound by the caller, so a bad address fails the
/// start).
pub async fn serve(
    socket: &Path,
    backend: Arc<dyn Backend>,
    cluster_id: String,
    metrics_listener: Option<tokio::net::TcpListener>,
    metrics: ControllerMetrics,
    nodes: Option<Arc<dyn crate::service::Nodes>>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let listener = csi_proto::socket::bind(socket).context("the CSI socket")?;
    let metrics = Arc::new(metrics);
    let metrics_server = metrics_listener.map(|listener| {
        let served = Arc::clone(&metrics);
        let addr = listener.local_addr().ok();
        tracing::info!(?addr, "serving metrics");
        tokio::spawn(async move {
            if let Err(e) = csi_proto::metrics::serve(move || served.render(), listener).await {
                tracing::error!(?addr, error = %e, "metrics endpoint failed");
            }
        })
    });
    tonic::transport::Server::builder()
        .add_service(IdentityServer::new(IdentityService))
        .add_service(ControllerServer::new({
            let service = ControllerService::new(backend, cluster_id, metrics);
            match nodes {
                Some(nodes) => service.with_nodes(nodes),
                None => service,
            }
        }))
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), stop)
        .await?;
    let _ = std::fs::remove_file(socket);
    if let Some(m) = metrics_server {
        m.abort();
    }
    Ok(())
}
