//! Locks by name: one operation per volume (node) or per image (controller) at a time, while
//! operations on other names go on.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;

#[derive(Debug, Default)]
pub struct KeyedLocks {
    map: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl KeyedLocks {
    fn entry(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        // Forget entries nobody holds or waits for, so the map does not grow with every name
        // ever seen.
        map.retain(|_, m| Arc::strong_count(m) > 1);
        Arc::clone(map.entry(key.to_owned()).or_default())
    }

    /// Waits for the lock of `key`.
    pub async fn lock(&self, key: &str) -> OwnedMutexGuard<()> {
        self.entry(key).lock_owned().await
    }

    /// The lock of `key` if no one holds it now.
    pub fn try_lock(&self, key: &str) -> Option<OwnedMutexGuard<()>> {
        self.entry(key).try_lock_owned().ok()
    }

    /// Waits for the locks of all `keys`, taken in sorted order so that two callers wanting
    /// overlapping sets cannot deadlock.
    pub async fn lock_all(&self, keys: &[String]) -> Vec<OwnedMutexGuard<()>> {
        let mut keys: Vec<&String> = keys.iter().collect();
        keys.sort();
        keys.dedup();
        let mut guards = Vec::with_capacity(keys.len());
        for key in keys {
            guards.push(self.lock(key).await);
        }
        guards
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn names_are_independent_and_sets_do_not_deadlock() {
        let locks = Arc::new(KeyedLocks::default());
        let a = locks.lock("a").await;
        let b = tokio::time::timeout(Duration::from_millis(50), locks.lock("b")).await;
        assert!(b.is_ok(), "another name is not held up");
        drop(b);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), locks.lock("a"))
                .await
                .is_err(),
            "the same name waits"
        );
        assert!(locks.try_lock("a").is_none(), "held: not taken");
        assert!(locks.try_lock("b").is_some(), "free: taken");
        drop(a);
        let (x, y) = (Arc::clone(&locks), Arc::clone(&locks));
        let one = tokio::spawn(async move {
            for _ in 0..100 {
                drop(x.lock_all(&["p".into(), "q".into()]).await);
            }
        });
        let two = tokio::spawn(async move {
            for _ in 0..100 {
                drop(y.lock_all(&["q".into(), "p".into()]).await);
            }
        });
        tokio::time::timeout(Duration::from_secs(5), async {
            one.await.ok();
            two.await.ok();
        })
        .await
        .expect("no deadlock");
    }
}
