//! The gRPC services: CSI Identity and Node for kubelet, plugin registration for kubelet's
//! plugin watcher, and the one table that turns a node error into a gRPC code ([`codes`]).

pub mod codes;
pub mod identity;
pub mod inflight;
pub mod node;
pub mod registration;
