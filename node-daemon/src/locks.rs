//! One operation per volume at a time.
//!
//! CSI: "the CO is responsible for ensuring that there is no more than one call in-flight per
//! volume at a given time", but a CO that lost its state may send two; the second waits a
//! little (the holder may be short background work, such as the healer refreshing the
//! volume's connections), then gets ABORTED and retries with back-off. The healer waits its
//! turn instead of failing.

use std::time::Duration;

use csi_common::locks::KeyedLocks;
use tokio::sync::OwnedMutexGuard;

use crate::error::NodeError;

pub type VolumeGuard = OwnedMutexGuard<()>;

#[derive(Debug, Default)]
pub struct VolumeLocks {
    locks: KeyedLocks,
}

impl VolumeLocks {
    /// For CSI calls: the lock within `patience`, or ABORTED.
    pub async fn lock_within(
        &self,
        volume: &str,
        patience: Duration,
    ) -> Result<VolumeGuard, NodeError> {
        tokio::time::timeout(patience, self.locks.lock(volume))
            .await
            .map_err(|_| NodeError::Busy {
                volume: volume.to_owned(),
            })
    }

    /// For background work: waits for the lock.
    pub async fn lock(&self, volume: &str) -> VolumeGuard {
        self.locks.lock(volume).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const SHORT: Duration = Duration::from_millis(50);

    #[tokio::test]
    async fn second_caller_is_aborted_until_the_first_is_done() {
        let locks = Arc::new(VolumeLocks::default());
        let first = locks.lock_within("v", SHORT).await.unwrap();
        assert!(
            matches!(locks.lock_within("v", SHORT).await, Err(NodeError::Busy { volume }) if volume == "v")
        );
        assert!(
            locks.lock_within("other", SHORT).await.is_ok(),
            "volumes are independent"
        );
        drop(first);
        assert!(locks.lock_within("v", SHORT).await.is_ok());
        let held = locks.lock("v").await;
        assert!(locks.lock_within("v", SHORT).await.is_err());
        // A caller that arrives while a short holder finishes gets the lock.
        let waiter = {
            let locks = Arc::clone(&locks);
            tokio::spawn(
                async move { locks.lock_within("v", Duration::from_secs(5)).await.is_ok() },
            )
        };
        tokio::time::sleep(SHORT).await;
        drop(held);
        assert!(waiter.await.unwrap());
    }
}
