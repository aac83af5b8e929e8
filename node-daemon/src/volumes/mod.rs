//! The CSI node operations, each an `impl Node` block, and the lifecycle that owns a
//! volume's phases.

pub mod expand;
pub mod lifecycle;
pub mod publish;
pub mod stage;
pub mod stats;

pub use expand::ExpandRequest;
pub use publish::PublishRequest;
pub use stage::StageRequest;
pub use stats::{Stats, Usage};
