//! The gRPC services for the provisioning sidecars.

pub mod controller;
pub mod identity;
