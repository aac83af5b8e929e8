//! Crash points and pauses for the crash-safety and outage tests.
//!
//! `USTOR_FAILPOINTS=stage-after-connect,expand-while-frozen=pause(3000)` makes the daemon abort
//! (no cleanup, no flush: like `kill -9`) when it reaches a named point, and wait the given
//! milliseconds at a `=pause(ms)` one, a window for a test to take the export away in. Abort
//! points are `fail::fail_point!` sites; pause points are [`pause`] calls, which sleep on the
//! runtime's timer rather than blocking a worker thread, so the daemon keeps answering during
//! the window as it would during a slow step. A pause first creates a file named after its
//! point in `$USTOR_FAILPOINT_MARKS`, if set, so a test knows the window has begun. Both are
//! compiled in only with the `failpoints` feature.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

/// Environment variable naming the points to crash or pause at.
pub const ENV: &str = "USTOR_FAILPOINTS";
/// Environment variable naming the directory a pause marks itself in.
const MARKS: &str = "USTOR_FAILPOINT_MARKS";

static PAUSES: OnceLock<HashMap<String, Duration>> = OnceLock::new();

/// Arms the points named in the environment. Returns their names (empty in production), or
/// which entry cannot be understood.
pub fn arm_from_env() -> Result<Vec<String>, String> {
    let Ok(list) = std::env::var(ENV) else {
        return Ok(Vec::new());
    };
    let mut names = Vec::new();
    let mut pauses = HashMap::new();
    for entry in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match entry.split_once('=') {
            Some((name, action)) => {
                pauses.insert(
                    name.to_owned(),
                    parse_pause(action).ok_or_else(|| {
                        format!("{ENV}: {entry:?}: the only action is pause(<milliseconds>)")
                    })?,
                );
                names.push(name.to_owned());
            }
            None => {
                let point = entry.to_owned();
                fail::cfg_callback(entry, move || {
                    eprintln!("failpoint {point}: aborting");
                    std::process::abort();
                })
                .map_err(|e| format!("{ENV}: {entry}: {e}"))?;
                names.push(entry.to_owned());
            }
        }
    }
    let _ = PAUSES.set(pauses);
    Ok(names)
}

fn parse_pause(action: &str) -> Option<Duration> {
    let ms = action.strip_prefix("pause(")?.strip_suffix(')')?;
    ms.parse().ok().map(Duration::from_millis)
}

/// Waits at `point` if a test armed a pause there; nothing in production builds.
pub async fn pause(point: &str) {
    if let Some(wait) = armed(point) {
        tokio::time::sleep(wait).await;
    }
}

/// Like [`pause`], but holds the calling thread as a slow disk does (for the journal's
/// writes, which block on the root disk).
pub fn stall(point: &str) {
    if let Some(wait) = armed(point) {
        std::thread::sleep(wait);
    }
}

/// How long to wait at `point`, marked as begun, if a test armed it.
fn armed(point: &str) -> Option<std::time::Duration> {
    if !cfg!(feature = "failpoints") {
        return None;
    }
    let wait = *PAUSES.get()?.get(point)?;
    tracing::warn!(point, ?wait, "failpoint: pausing");
    if let Some(dir) = std::env::var_os(MARKS).map(std::path::PathBuf::from) {
        let marked =
            std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join(point), b""));
        if let Err(e) = marked {
            tracing::warn!(point, error = %e, "failpoint: cannot mark the pause");
        }
    }
    Some(wait)
}

#[cfg(test)]
mod tests {
    use super::parse_pause;
    use std::time::Duration;

    #[test]
    fn pauses_are_read_in_milliseconds_and_anything_else_is_refused() {
        assert_eq!(
            parse_pause("pause(2500)"),
            Some(Duration::from_millis(2500))
        );
        assert_eq!(parse_pause("sleep(2500)"), None);
        assert_eq!(parse_pause("pause(soon)"), None);
    }
}
