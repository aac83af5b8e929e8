//! `ustor-csi-controller`: CSI Identity and Controller for the provisioning sidecars.
//!
//! - [`server`]: starts it all (backend, Kubernetes glue, metrics, the gRPC services).
//! - [`service`]: the gRPC surface, wire only; [`service::codes`] is the one table from an
//!   error to its gRPC code.
//! - [`request`]: request validation (required fields, sizes, parameters, capabilities).
//! - [`provision`]: the domain: volumes, publications, snapshots.
//! - [`error`]: every failure by where it happened.
//! - [`backend`]: where images live (a local directory, one uStor cluster, every connection).
//! - [`ids`]: the opaque, validated volume and snapshot ids.
//! - [`exports`]: the local backend's supervised NBD server and the grant gate in front of it.
//! - [`kube`]: the Kubernetes glue (custom resources, StorageClasses, the node list).
//! - [`import`]: `ustor-csi-controller import`, adopting an existing image as a PersistentVolume.

pub mod backend;
pub mod error;
pub mod exports;
pub mod ids;
pub mod import;
pub mod kube;
pub mod metrics;
pub mod provision;
pub mod request;
pub mod server;
pub mod service;
