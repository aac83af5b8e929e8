//! gRPC types and services generated from `proto/`: the CSI spec (package `csi.v1`) and
//! kubelet's plugin registration API. Nothing here is written by hand: what node and
//! controller share beside these types lives in `csi-common`.

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
