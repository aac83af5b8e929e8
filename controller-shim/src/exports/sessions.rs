//! The open NBD connections of each grant, shared by the gate (which registers them) and the
//! local backend (whose revoke cuts them and waits until they are gone).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{oneshot, Notify};

/// (image, node): one grant.
type Key = (String, String);

/// A connection stays listed until it is gone, cut or not: a revoke abandoned mid-way (its
/// call dropped at the CO's deadline) has told connections to close, and its retry must
/// still wait until they have, or it would answer before the last forwarded write landed.
#[derive(Debug, Default)]
pub struct Sessions {
    open: Mutex<HashMap<Key, HashMap<u64, Entry>>>,
    next: AtomicU64,
    /// Woken whenever a connection is gone.
    closed: Notify,
}

#[derive(Debug)]
struct Entry {
    /// Taken when the connection is told to close.
    cut: Option<oneshot::Sender<()>>,
}

/// One connection's place in [`Sessions`], held by the task serving it: dropping it says the
/// connection is gone.
#[derive(Debug)]
pub struct Registration {
    sessions: Arc<Sessions>,
    key: Key,
    id: u64,
    cut: oneshot::Receiver<()>,
}

impl Sessions {
    fn open(&self) -> std::sync::MutexGuard<'_, HashMap<Key, HashMap<u64, Entry>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a connection of `node`'s grant of `image`.
    pub fn register(self: &Arc<Self>, image: &str, node: &str) -> Registration {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let key = (image.to_owned(), node.to_owned());
        let (cut_tx, cut_rx) = oneshot::channel();
        self.open()
            .entry(key.clone())
            .or_default()
            .insert(id, Entry { cut: Some(cut_tx) });
        Registration {
            sessions: Arc::clone(self),
            key,
            id,
            cut: cut_rx,
        }
    }

    /// Cuts every open connection of `node`'s grant of `image` and waits until each is gone,
    /// including those an earlier, abandoned cut told to close. Returns how many were open.
    pub async fn cut(&self, image: &str, node: &str) -> usize {
        let key = (image.to_owned(), node.to_owned());
        let n = self.open().get_mut(&key).map_or(0, |of_grant| {
            for entry in of_grant.values_mut() {
                if let Some(cut) = entry.cut.take() {
                    let _ = cut.send(());
                }
            }
            of_grant.len()
        });
        loop {
            // Armed before the check, so a connection gone in between still wakes us.
            let closed = self.closed.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            if self.count(image, node) == 0 {
                return n;
            }
            closed.await;
        }
    }

    /// Open connections of `node`'s grant of `image`, cut or not.
    pub fn count(&self, image: &str, node: &str) -> usize {
        self.open()
            .get(&(image.to_owned(), node.to_owned()))
            .map_or(0, HashMap::len)
    }
}

impl Registration {
    /// Resolves when the connection is to be cut.
    pub async fn cut(&mut self) {
        let _ = (&mut self.cut).await;
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        {
            let mut open = self.sessions.open();
            if let Some(of_grant) = open.get_mut(&self.key) {
                of_grant.remove(&self.id);
                if of_grant.is_empty() {
                    open.remove(&self.key);
                }
            }
        }
        self.sessions.closed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_cut_reaches_only_its_grant_and_waits_for_the_connection() {
        let sessions = Arc::new(Sessions::default());
        let mut a = sessions.register("img", "node-a");
        let b = sessions.register("img", "node-b");
        let served = tokio::spawn(async move {
            a.cut().await;
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            drop(a);
            std::time::Instant::now()
        });
        assert_eq!(sessions.cut("img", "node-a").await, 1);
        let cut_returned = std::time::Instant::now();
        assert!(
            served.await.unwrap() <= cut_returned,
            "cut returned before the connection was gone"
        );
        assert_eq!(sessions.count("img", "node-a"), 0);
        assert_eq!(
            sessions.count("img", "node-b"),
            1,
            "the other grant's stays"
        );
        drop(b);
        assert_eq!(
            sessions.count("img", "node-b"),
            0,
            "a closed connection leaves"
        );
    }

    /// kubelet's attacher gives a ControllerUnpublish up at its deadline and calls again: the
    /// second revoke still waits for the connection the first one told to close.
    #[tokio::test]
    async fn a_cut_retried_after_an_abandoned_one_waits_for_the_connection() {
        let sessions = Arc::new(Sessions::default());
        let mut a = sessions.register("img", "node-a");
        let served = tokio::spawn(async move {
            a.cut().await;
            // nbdkit finishing what was forwarded before the cut.
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            drop(a);
            std::time::Instant::now()
        });
        let abandoned = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            sessions.cut("img", "node-a"),
        )
        .await;
        assert!(abandoned.is_err(), "the first cut waits for the connection");
        assert_eq!(
            sessions.count("img", "node-a"),
            1,
            "still listed until gone"
        );
        assert_eq!(sessions.cut("img", "node-a").await, 1);
        let retried_returned = std::time::Instant::now();
        assert!(
            served.await.unwrap() <= retried_returned,
            "the retried cut returned before the connection was gone"
        );
        assert_eq!(
            sessions.cut("img", "node-a").await,
            0,
            "nothing left to cut"
        );
    }
}
