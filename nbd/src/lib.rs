//! Attaching NBD exports to `/dev/nbdN` by speaking to the kernel directly.
//!
//! - [`uri`]: NBD URIs (`nbd://`, `nbds://`, `nbd+unix://`).
//! - [`handshake`] and [`dial`]: the user-space half of the protocol, up to transmission;
//!   [`tls`]: STARTTLS and the handover of a TLS session to the kernel.
//! - [`netlink`]: the kernel's `nbd` generic-netlink family (CONNECT, DISCONNECT, RECONFIGURE,
//!   STATUS, LINK_DEAD).
//! - [`sysfs`]: what `/sys/block/nbdN` says, and the proof that a device is ours.
//! - [`grant`]: the fencing grant a node proves itself with in the export name.
//! - [`attach`]: the sequences built from those, shared by the daemon and `nbdctl`.

pub mod attach;
pub mod dial;
mod error;
pub mod grant;
pub mod handshake;
pub mod identity;
pub mod netlink;
pub mod protocol;
pub mod sockdiag;
pub mod sysfs;
pub mod tls;
pub mod uri;

pub use error::Error;
pub use grant::Grant;
pub use identity::{BackendId, DeviceIndex};
pub use uri::NbdUri;
