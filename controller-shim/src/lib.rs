//! `ustor-csi-controller`: CSI Identity and Controller for the provisioning sidecars.
//!
//! - [`service`]: the gRPC surface; every call validated there, errors mapped in [`error`].
//! - [`backend`]: where images live (the embedded local directory; uStor to come).
//! - [`ids`]: the opaque, validated volume and snapshot ids.
//! - [`exports`]: the local backend's supervised NBD server.
//! - [`kube`]: the Kubernetes glue (custom resources, StorageClasses, the node list).

pub mod backend;
pub mod error;
pub mod exports;
pub mod ids;
pub mod kube;
pub mod metrics;
pub mod server;
pub mod service;
