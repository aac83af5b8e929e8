//! `ustor-csi-node`: the host service that attaches NBD exports for kubelet.
//!
//! - [`service`]: the gRPC surface (CSI Identity and Node, kubelet registration);
//!   [`service::codes`] is the one table from (RPC, error) to the gRPC code and what happens next.
//! - [`request`]: validation at that surface.
//! - [`node`] and [`volumes`]: the operations, journaled step by step in [`journal`];
//!   [`volumes::lifecycle`] is the only code that changes a volume's phase.
//! - [`error`]: what can fail, one variant per failed step.
//! - [`kernel`]: the host (sysfs, netlink, mount table, tools) behind the traits the
//!   decisions are unit-tested through.
//! - [`recovery`]: start-up reconciliation of journal, kernel and mounts.
//! - [`healer`]: LINK_DEAD → redial → RECONFIGURE; [`fence`]: what a refused grant stops.
//! - [`server`]: sockets, start-up order, shutdown.
//! - [`status`], [`repair`], [`preflight`], [`support_bundle`]: the operators' commands.

pub mod blockdev;
pub mod config;
pub mod connections;
pub mod device_budget;
pub mod error;
pub mod failpoints;
pub mod fence;
pub mod healer;
pub mod held;
pub mod ids;
pub mod journal;
pub mod kernel;
pub mod locks;
pub mod metrics;
pub mod node;
pub mod openers;
pub mod preflight;
pub mod record;
pub mod recovery;
pub mod repair;
pub mod request;
pub mod server;
pub mod service;
pub mod stage_tls;
pub mod state_lock;
pub mod status;
pub mod support_bundle;
pub mod systemd;
pub mod volumes;
