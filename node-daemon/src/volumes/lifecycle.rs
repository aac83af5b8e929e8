//! The one owner of a volume's phases. Stage, expand, publish, unstage and recovery drive a
//! volume through its steps here: each change is checked against [`legal`] and journaled
//! (through [`Node::save`]) before the step it describes is taken. Nothing else can change a
//! [`Phase`] or a [`TargetPhase`]: their setters ask for an [`Owner`], which only this module
//! can make.
//!
//! ```text
//!            ┌──────────── device lost ──────────────┐
//!            ▼                                        │
//!  (new) → Attaching → Attached → Formatting → Mounting → Staged ⇄ Expanding
//!                 └────────┴──── block ────────────────────▲   │
//!  any phase → Unstaging → (forgotten)                          └─ staging mount lost → Mounting
//! ```

use std::path::{Path, PathBuf};

use crate::error::NodeError;
use crate::node::Node;
use crate::record::{Phase, Record, Target, TargetPhase};

/// The capability to change a phase. Only this module makes one.
#[derive(Debug)]
pub struct Owner(());

const OWNER: Owner = Owner(());

/// A phase change the lifecycle does not allow: a bug, or a record someone edited.
#[derive(Debug, thiserror::Error)]
#[error("volume {volume}: no step leads from {from:?} to {to:?}")]
pub struct IllegalTransition {
    pub volume: String,
    pub from: Phase,
    pub to: Phase,
}

/// Whether a volume may go from `from` to `to`.
pub fn legal(from: Phase, to: Phase) -> bool {
    use Phase::*;
    match (from, to) {
        // Teardown may start anywhere (NodeUnstage, the undo of a failed NodeStage), and is
        // journaled again when repeated; nothing leaves it but forgetting the record.
        (_, Unstaging) => true,
        (Unstaging, _) => false,
        // CONNECT answered (or the device of an interrupted attach was found); a block
        // volume has nothing to probe, format or mount.
        (Attaching, Attached | Staged) => true,
        // The device was lost (a reboot, the kernel dropped it): attach again.
        (Attached | Formatting | Mounting | Expanding { .. } | Staged, Attaching) => true,
        // Probed: blank (format), our filesystem (mount), or nothing to mount (block).
        (Attached, Formatting | Mounting | Staged) => true,
        // Formatted; or a record from before UUIDs were journaled, probed again.
        (Formatting, Mounting | Attached | Staged) => true,
        (Mounting, Staged) => true,
        // A staged volume whose staging mount was lost is mounted again; its device index
        // is refreshed in place; an expansion starts (or restarts at a new size) and ends.
        (Staged, Mounting | Staged | Expanding { .. }) => true,
        (Expanding { .. }, Staged | Expanding { .. }) => true,
        _ => false,
    }
}

/// Whether a publish target may go from `from` (`None`: not listed) to `to`.
pub fn legal_target(from: Option<TargetPhase>, to: TargetPhase) -> bool {
    use TargetPhase::*;
    match (from, to) {
        // NodePublish (again, after a crash or a failed unpublish: the call is idempotent).
        (_, Publishing) => true,
        (Some(Publishing), Published) => true,
        // NodeUnpublish (again, after a crash).
        (Some(_), Unpublishing) => true,
        _ => false,
    }
}

impl Node {
    /// Moves `record` to `to` and journals it. The record is the caller's copy; the journal
    /// and the node's view follow it.
    pub(crate) fn advance(&self, record: &mut Record, to: Phase) -> Result<(), NodeError> {
        self.check(record, to)?;
        record.set_phase(to, &OWNER);
        self.save(record)
    }

    fn check(&self, record: &Record, to: Phase) -> Result<(), NodeError> {
        if legal(record.phase(), to) {
            Ok(())
        } else {
            Err(IllegalTransition {
                volume: record.volume_id.to_string(),
                from: record.phase(),
                to,
            }
            .into())
        }
    }

    /// Journals `target` as being published (before the bind mount).
    pub(crate) fn begin_publish(
        &self,
        record: &mut Record,
        target: &Path,
        read_only: bool,
    ) -> Result<(), NodeError> {
        self.set_target(record, target, read_only, TargetPhase::Publishing)
    }

    /// Journals `target` as published (after the bind mount).
    pub(crate) fn end_publish(&self, record: &mut Record, target: &Path) -> Result<(), NodeError> {
        let read_only = record.targets.get(target).is_some_and(|t| t.read_only);
        self.set_target(record, target, read_only, TargetPhase::Published)
    }

    /// Journals `target` as being unpublished (before the unmount).
    pub(crate) fn begin_unpublish(
        &self,
        record: &mut Record,
        target: &Path,
    ) -> Result<(), NodeError> {
        let read_only = record.targets.get(target).is_some_and(|t| t.read_only);
        self.set_target(record, target, read_only, TargetPhase::Unpublishing)
    }

    /// Forgets targets (unpublished, or no longer mounted) and journals the record.
    pub(crate) fn drop_targets(
        &self,
        record: &mut Record,
        targets: &[PathBuf],
    ) -> Result<(), NodeError> {
        for t in targets {
            record.targets.remove(t);
        }
        self.save(record)
    }

    fn set_target(
        &self,
        record: &mut Record,
        target: &Path,
        read_only: bool,
        to: TargetPhase,
    ) -> Result<(), NodeError> {
        let from = record.targets.get(target).map(Target::phase);
        if !legal_target(from, to) {
            return Err(NodeError::IllegalTargetTransition {
                volume: record.volume_id.to_string(),
                target: target.to_owned(),
                from,
                to,
            });
        }
        record
            .targets
            .insert(target.to_owned(), Target::with_phase(read_only, to, &OWNER));
        self.save(record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Phase::*;

    const EXPANDING: Phase = Expanding { to_bytes: 1 << 30 };
    const ALL: [Phase; 7] = [
        Attaching, Attached, Formatting, Mounting, Staged, EXPANDING, Unstaging,
    ];

    /// Every pair: the steps stage, expand, unstage and recovery take are legal, and
    /// nothing else is.
    #[test]
    fn transitions() {
        let allowed = [
            (Attaching, Attached),
            (Attaching, Staged),
            (Attached, Attaching),
            (Attached, Formatting),
            (Attached, Mounting),
            (Attached, Staged),
            (Formatting, Attaching),
            (Formatting, Attached),
            (Formatting, Mounting),
            (Formatting, Staged),
            (Mounting, Attaching),
            (Mounting, Staged),
            (Staged, Attaching),
            (Staged, Mounting),
            (Staged, Staged),
            (Staged, EXPANDING),
            (EXPANDING, Attaching),
            (EXPANDING, Staged),
            (EXPANDING, EXPANDING),
        ];
        for from in ALL {
            for to in ALL {
                let want = to == Unstaging || allowed.contains(&(from, to));
                assert_eq!(legal(from, to), want, "{from:?} → {to:?}");
            }
        }
    }

    #[test]
    fn target_transitions() {
        use TargetPhase::*;
        let all = [Publishing, Published, Unpublishing];
        for to in all {
            assert_eq!(legal_target(None, to), to == Publishing, "none → {to:?}");
        }
        for from in all {
            assert!(legal_target(Some(from), Publishing));
            assert!(legal_target(Some(from), Unpublishing));
            assert_eq!(
                legal_target(Some(from), Published),
                from == Publishing,
                "{from:?}"
            );
        }
    }
}
