//! gRPC types and services generated from `proto/`: the CSI spec (package `csi.v1`) and
//! kubelet's plugin registration API; and [`capability`], the driver's access-mode rules over
//! those types, shared by node and controller.

/// CSI v1.12: Identity, Controller and Node (the parts this driver serves).
#[allow(clippy::all, missing_docs, missing_debug_implementations)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}

/// Kubelet's `pluginregistration` API, served on the plugins_registry socket.
#[allow(clippy::all, missing_docs, missing_debug_implementations)]
pub mod registration {
    tonic::include_proto!("pluginregistration");
}

pub mod capability;
pub mod locks;
pub mod metrics;
pub mod socket;

/// The CSI driver name, as CSIDriver objects, StorageClasses and PVs spell it; one definition
/// for node and controller.
pub const DRIVER_NAME: &str = "ustor-nbd.csi.mindsw.io";

/// The topology segment of nodes whose node service runs (the data plane).
pub const TOPOLOGY_KEY: &str = "topology.ustor-nbd.csi.mindsw.io/data-plane";
