//! The gRPC services for the provisioning sidecars, wire only: [`controller`] hands each
//! RPC to the domain (`crate::provision`) through one wrapper, which [`group_controller`]'s
//! RPCs go through too; [`codes`] is the one table from an error to the gRPC code, [`rpc`]
//! names the RPCs.

pub mod codes;
pub mod controller;
pub mod group_controller;
pub mod identity;
pub mod rpc;
