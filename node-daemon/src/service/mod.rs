//! The gRPC services: CSI Identity and Node for kubelet, plugin registration for kubelet's
//! plugin watcher.

pub mod identity;
pub mod node;
pub mod registration;
