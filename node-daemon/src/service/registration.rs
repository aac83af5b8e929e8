//! Kubelet plugin registration without a sidecar: kubelet watches its `plugins_registry`
//! directory, dials the socket found there, asks GetInfo, then reports whether it registered
//! the plugin.

use std::path::PathBuf;

use csi_proto::registration::registration_server::Registration;
use csi_proto::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use tonic::{Request, Response, Status};

use crate::config::DRIVER_NAME;

#[derive(Debug)]
pub struct RegistrationService {
    csi_socket: PathBuf,
}

impl RegistrationService {
    pub fn new(csi_socket: PathBuf) -> Self {
        Self { csi_socket }
    }

    /// The socket name kubelet expects: the plugin name, never starting with a dot.
    pub fn socket_name() -> String {
        format!("{DRIVER_NAME}-reg.sock")
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: "CSIPlugin".into(),
            name: DRIVER_NAME.into(),
            endpoint: self.csi_socket.display().to_string(),
            supported_versions: vec!["1.0.0".into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!("kubelet registered the plugin");
        } else {
            tracing::error!(error = %status.error, "kubelet refused to register the plugin");
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
