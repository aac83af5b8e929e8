//! The open NBD connections of each grant, shared by the gate (which registers them) and the
//! local backend (whose revoke cuts them and waits until they are gone).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// (image, node): one grant.
type Key = (String, String);

#[derive(Debug, Default)]
pub struct Sessions {
    open: Mutex<HashMap<Key, HashMap<u64, Entry>>>,
    next: AtomicU64,
}

#[derive(Debug)]
struct Entry {
    cut: oneshot::Sender<()>,
    /// Resolves (with an error) once the connection's [`Registration`] is dropped.
    gone: oneshot::Receiver<()>,
}

/// One connection's place in [`Sessions`], held by the task serving it: dropping it says the
/// connection is gone.
#[derive(Debug)]
pub struct Registration {
    sessions: Arc<Sessions>,
    key: Key,
    id: u64,
    cut: oneshot::Receiver<()>,
    _gone: oneshot::Sender<()>,
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
        let (gone_tx, gone_rx) = oneshot::channel();
        self.open().entry(key.clone()).or_default().insert(
            id,
            Entry {
                cut: cut_tx,
                gone: gone_rx,
            },
        );
        Registration {
            sessions: Arc::clone(self),
            key,
            id,
            cut: cut_rx,
            _gone: gone_tx,
        }
    }

    /// Cuts every open connection of `node`'s grant of `image` and waits until each is gone.
    pub async fn cut(&self, image: &str, node: &str) -> usize {
        let entries = self
            .open()
            .remove(&(image.to_owned(), node.to_owned()))
            .unwrap_or_default();
        let n = entries.len();
        let mut waiting = Vec::with_capacity(n);
        for entry in entries.into_values() {
            let _ = entry.cut.send(());
            waiting.push(entry.gone);
        }
        for gone in waiting {
            let _ = gone.await;
        }
        n
    }

    /// Open connections of `node`'s grant of `image`.
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
        let mut open = self.sessions.open();
        if let Some(of_grant) = open.get_mut(&self.key) {
            of_grant.remove(&self.id);
            if of_grant.is_empty() {
                open.remove(&self.key);
            }
        }
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
}
