//! CSI Identity of the controller: the same plugin name as the node, with the controller and
//! group controller services and topology constraints.

use csi_proto::csi::identity_server::Identity;
use csi_proto::csi::plugin_capability::service::Type as ServiceType;
use csi_proto::csi::plugin_capability::{Service, Type as CapType};
use csi_proto::csi::*;
use tonic::{Request, Response, Status};

pub use csi_common::DRIVER_NAME;

#[derive(Debug, Default)]
pub struct IdentityService;

fn service(t: ServiceType) -> PluginCapability {
    PluginCapability {
        r#type: Some(CapType::Service(Service { r#type: t as i32 })),
    }
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: vec![
                service(ServiceType::ControllerService),
                service(ServiceType::GroupControllerService),
                service(ServiceType::VolumeAccessibilityConstraints),
            ],
        }))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}
