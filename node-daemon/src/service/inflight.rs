//! Operations that outlive the call that started them.
//!
//! kubelet gives up on a call at its deadline and drops it; dropping the handler's future
//! would release the volume's lock while the blocking work it started (an unmount syncing to
//! a dead server, mkfs, a freeze) goes on, so the retry would act beside it: find the mount
//! gone from the table while the kernel still writes it back, and DISCONNECT. Here the work
//! and its lock are one unit: each operation runs as its own task, which keeps the lock until
//! the work is done whether or not anyone still waits for it. A retry of the same operation
//! (the same RPC for the same volume and path) joins the running one and gets its answer; a
//! different operation on the volume waits for the lock as before (`call-patience`, then
//! ABORTED).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use futures::future::{BoxFuture, FutureExt, Shared};
use tonic::Status;

type Answer<T> = Shared<BoxFuture<'static, Result<T, Status>>>;

/// The running operations of one RPC, by key.
#[derive(Debug)]
pub struct Inflight<T: Clone> {
    running: Arc<Mutex<HashMap<String, Running<T>>>>,
}

#[derive(Debug)]
struct Running<T: Clone> {
    /// Tells this run from a later one under the same key.
    generation: u64,
    answer: Answer<T>,
}

impl<T: Clone> Default for Inflight<T> {
    fn default() -> Self {
        Self {
            running: Arc::default(),
        }
    }
}

fn lock<V>(m: &Mutex<V>) -> std::sync::MutexGuard<'_, V> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T> Inflight<T>
where
    T: Clone + Send + Sync + 'static,
{
    /// Runs `work` as a task of its own under `key`, or joins the one already running under
    /// it; either way waits for its answer. Dropping the returned future leaves the task
    /// running to its end.
    pub async fn run<F>(&self, key: String, work: F) -> Result<T, Status>
    where
        F: Future<Output = Result<T, Status>> + Send + 'static,
    {
        let answer = {
            let mut running = lock(&self.running);
            match running.get(&key) {
                Some(r) => {
                    tracing::info!(%key, "the same call is still running; waiting for its answer");
                    r.answer.clone()
                }
                None => {
                    let generation = next_generation();
                    let registry = Arc::clone(&self.running);
                    let done_key = key.clone();
                    let task = tokio::spawn(async move {
                        let answer = work.await;
                        let mut running = lock(&registry);
                        if running
                            .get(&done_key)
                            .is_some_and(|r| r.generation == generation)
                        {
                            running.remove(&done_key);
                        }
                        answer
                    });
                    let answer: Answer<T> = async move {
                        task.await.unwrap_or_else(|e| {
                            Err(Status::internal(format!(
                                "the operation's task failed: {e}"
                            )))
                        })
                    }
                    .boxed()
                    .shared();
                    running.insert(
                        key,
                        Running {
                            generation,
                            answer: answer.clone(),
                        },
                    );
                    answer
                }
            }
        };
        answer.await
    }

    /// How many operations are running (for tests and shutdown).
    pub fn len(&self) -> usize {
        lock(&self.running).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn next_generation() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn an_abandoned_call_runs_to_its_end_and_a_retry_joins_it() {
        let inflight = Inflight::<u32>::default();
        let runs = Arc::new(AtomicUsize::new(0));
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let work = {
            let runs = Arc::clone(&runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let _ = released.await;
                Ok(7)
            }
        };
        // The caller gives up; the work goes on.
        let abandoned =
            tokio::time::timeout(Duration::from_millis(20), inflight.run("v:/p".into(), work))
                .await;
        assert!(abandoned.is_err());
        assert_eq!(inflight.len(), 1, "still running after its caller left");
        // The retry joins it instead of starting the work a second time.
        let retry = inflight.run("v:/p".into(), async { Ok(99) });
        let other = inflight.run("v:/q".into(), async { Ok(1) });
        assert_eq!(other.await.unwrap(), 1, "another key runs on its own");
        release.send(()).unwrap();
        assert_eq!(
            retry.await.unwrap(),
            7,
            "the retry gets the first run's answer"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        tokio::task::yield_now().await;
        assert!(inflight.is_empty());
        // Once done, the same key runs anew.
        assert_eq!(
            inflight.run("v:/p".into(), async { Ok(8) }).await.unwrap(),
            8
        );
    }

    #[tokio::test]
    async fn errors_are_shared_too() {
        let inflight = Inflight::<()>::default();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let mut first = Box::pin(inflight.run("k".into(), async move {
            let _ = released.await;
            Err(Status::unavailable("down"))
        }));
        assert!(
            futures::poll!(&mut first).is_pending(),
            "started and waiting"
        );
        let second = inflight.run("k".into(), async { Ok(()) });
        release.send(()).unwrap();
        let (first, second) = tokio::join!(first, second);
        assert_eq!(first.unwrap_err().code(), tonic::Code::Unavailable);
        assert_eq!(
            second.unwrap_err().message(),
            "down",
            "the joined call's answer"
        );
    }
}
