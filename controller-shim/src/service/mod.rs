//! The gRPC services for the provisioning sidecars.

pub mod controller;
pub mod identity;

/// Which CSI nodes of this driver exist (in Kubernetes: CSINode objects naming it).
pub trait Nodes: Send + Sync + std::fmt::Debug {
    /// `None` while the list is still loading.
    fn has_node(&self, node_id: &str) -> Option<bool>;
}
