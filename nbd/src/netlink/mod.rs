//! The kernel's `nbd` generic-netlink family: constants, message encoding, and the client.

pub mod client;
pub mod consts;
pub mod message;

pub use client::{LinkDeadEvents, NbdNetlink};
pub use message::{ConnectRequest, DeviceStatus, ReconfigureRequest};
