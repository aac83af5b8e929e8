//! What the driver's two services share, written by hand beside the generated code of
//! `csi-proto`: the driver's names, [`capability`] (the access-mode rules, in one place so node
//! and controller cannot disagree), [`locks`] (one operation per name at a time), [`metrics`]
//! (CSI call metrics and the `/metrics` endpoint), [`socket`] (how a CSI socket is bound) and
//! [`h2_front`] (what makes kubelet's gRPC requests acceptable on it).

pub mod capability;
pub mod h2_front;
pub mod locks;
pub mod metrics;
pub mod socket;

/// The CSI driver name, as CSIDriver objects, StorageClasses and PVs spell it; one definition
/// for node and controller.
pub const DRIVER_NAME: &str = "ustor-nbd.csi.mindsw.io";

/// The topology segment of nodes whose node service runs (the data plane).
pub const TOPOLOGY_KEY: &str = "topology.ustor-nbd.csi.mindsw.io/data-plane";
