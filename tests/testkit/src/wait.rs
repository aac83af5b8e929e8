//! Waiting for a state that comes later: poll, pause, and fail the test naming what did not
//! come within the time given.

use std::future::Future;
use std::time::{Duration, Instant};

/// How long to pause between two probes.
const PAUSE: Duration = Duration::from_millis(200);

/// Polls `probe` until it gives a value, for at most `timeout`; then panics naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            started.elapsed() < timeout,
            "{what}: not within {timeout:?}"
        );
        tokio::time::sleep(PAUSE).await;
    }
}

/// [`eventually`] for a probe that blocks, on this thread (tests without a runtime).
pub fn eventually_blocking<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> Option<T>,
) -> T {
    let started = Instant::now();
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(
            started.elapsed() < timeout,
            "{what}: not within {timeout:?}"
        );
        std::thread::sleep(PAUSE);
    }
}
