//! `ustor-csi-controller`: CSI Identity and Controller for the provisioning sidecars.
//!
//! - [`service`]: the gRPC surface; every call validated there, errors mapped in [`error`].
//! - [`backend`]: where images live (the embedded local directory; uStor to come).
//! - [`ids`]: the opaque, validated volume and snapshot ids.
//! - [`exports`]: the local backend's supervised NBD server.

pub mod backend;
pub mod error;
pub mod exports;
pub mod ids;
pub mod metrics;
pub mod server;
pub mod service;
