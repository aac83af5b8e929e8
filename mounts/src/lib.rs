//! Filesystem plumbing for the node daemon: what is mounted where, mounting and unmounting,
//! formatting (only ever a blank device), growing, and usage figures.
//!
//! Everything here is synchronous and does one system call or runs one tool; the decisions
//! (what to mount where, whether to format) belong to the caller.

mod error;
pub mod format;
pub mod mountinfo;
pub mod ops;
pub mod options;
pub mod usage;

pub use error::Error;
pub use format::{Filesystem, Probe};
pub use mountinfo::{MountEntry, MountTable};
pub use options::MountOptions;
