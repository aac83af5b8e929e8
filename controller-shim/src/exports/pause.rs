//! Holding the writes of every image at once, so that copies taken meanwhile are of one point
//! in time: the writable nbdkit runs with its pause filter, whose control socket stops new
//! requests and answers only once the ones in flight have finished.
//!
//! Shared by the supervisor that (re)starts nbdkit and by the snapshots that hold its writes:
//! a hold keeps the supervisor from starting a new, unpaused nbdkit behind its back, and the
//! supervisor says whether one runs at all (none does in a controller without an export
//! server, and then nothing can write). nbdkit exits with the controller, so a hold never
//! outlives a crash. A hold that cannot be released kills nbdkit rather than leave every
//! volume's I/O stopped: the nodes reconnect to the restarted one.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{Mutex, MutexGuard};

/// How long the requests in flight may take to finish before a hold gives up. Kernel clients
/// time out a stalled request after their own deadline (the node daemon's is longer).
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);
/// How long a started nbdkit may take to open its control socket.
const START_DEADLINE: Duration = Duration::from_secs(10);

/// Why writes could not be held. Nothing was copied then.
#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    #[error("holding the export server's writes: connecting to {}: {source}", socket.display())]
    Connect {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("holding the export server's writes: {during}: {source}")]
    Io {
        during: &'static str,
        source: std::io::Error,
    },
    #[error("holding the export server's writes: the requests in flight did not finish within {DRAIN_DEADLINE:?}")]
    Drain,
    #[error("holding the export server's writes: nbdkit answered {got:?} to {sent:?}")]
    Answer { sent: char, got: char },
}

/// Whether the writable nbdkit runs, as its supervisor last saw it.
#[derive(Debug, Default)]
enum Running {
    #[default]
    No,
    Pid(i32),
}

#[derive(Debug)]
pub struct WriteHold {
    socket: PathBuf,
    running: Mutex<Running>,
}

/// Writes are held while this lives; [`Held::release`] lets them go.
#[derive(Debug)]
pub struct Held<'a> {
    control: Option<UnixStream>,
    pid: Option<i32>,
    since: Instant,
    _running: MutexGuard<'a, Running>,
}

impl WriteHold {
    pub fn new(socket: PathBuf) -> Self {
        Self {
            socket,
            running: Mutex::default(),
        }
    }

    /// The pause filter's control socket, as nbdkit is told it.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Stops new requests to every image and waits for the ones in flight. When no nbdkit
    /// runs, nothing can write, and nothing needs holding.
    pub async fn hold(&self) -> Result<Held<'_>, HoldError> {
        let running = self.running.lock().await;
        let pid = match *running {
            Running::No => None,
            Running::Pid(pid) => Some(pid),
        };
        let mut held = Held {
            control: None,
            pid,
            since: Instant::now(),
            _running: running,
        };
        if pid.is_none() {
            return Ok(held);
        }
        let mut control =
            UnixStream::connect(&self.socket)
                .await
                .map_err(|source| HoldError::Connect {
                    socket: self.socket.clone(),
                    source,
                })?;
        let answer = tokio::time::timeout(DRAIN_DEADLINE, command(&mut control, 'p')).await;
        held.control = Some(control);
        match answer {
            Ok(Ok('P')) => Ok(held),
            Ok(Ok(got)) => {
                held.release().await;
                Err(HoldError::Answer { sent: 'p', got })
            }
            Ok(Err(e)) => {
                held.release().await;
                Err(e)
            }
            Err(_) => {
                // The pause still waits for the requests in flight; the release follows it.
                held.release().await;
                Err(HoldError::Drain)
            }
        }
    }

    /// Runs a newly started nbdkit (`pid`) as the one holds pause: called by the supervisor
    /// with the lock held from before the start until the control socket answers, so no hold
    /// sees a running nbdkit it cannot pause.
    pub async fn starting(&self) -> Starting<'_> {
        Starting {
            hold: self,
            running: self.running.lock().await,
        }
    }

    /// nbdkit has exited.
    pub async fn stopped(&self) {
        *self.running.lock().await = Running::No;
    }
}

/// The supervisor's lock across a start of nbdkit.
#[derive(Debug)]
pub struct Starting<'a> {
    hold: &'a WriteHold,
    running: MutexGuard<'a, Running>,
}

impl Starting<'_> {
    /// Waits until nbdkit `pid` opens its control socket, then records it as running. False
    /// when it did not within the deadline (it is killed then, and counts as stopped).
    pub async fn started(mut self, pid: i32) -> bool {
        let deadline = Instant::now() + START_DEADLINE;
        while Instant::now() < deadline {
            if UnixStream::connect(&self.hold.socket).await.is_ok() {
                *self.running = Running::Pid(pid);
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        kill(pid);
        *self.running = Running::No;
        false
    }
}

impl Held<'_> {
    /// Lets the held writes go. When nbdkit does not confirm, it is killed: better every
    /// connection cut (the nodes reconnect) than every volume's I/O stopped for good.
    pub async fn release(mut self) {
        let Some(mut control) = self.control.take() else {
            return;
        };
        let resumed = tokio::time::timeout(DRAIN_DEADLINE, async {
            loop {
                match command(&mut control, 'r').await {
                    // The answer to a pause that timed out comes first.
                    Ok('P') => continue,
                    other => return other,
                }
            }
        })
        .await;
        let held_ms = self.since.elapsed().as_millis();
        match resumed {
            Ok(Ok('R')) => tracing::info!(held_ms, "export server's writes held, then released"),
            other => {
                tracing::error!(
                    held_ms,
                    answer = ?other,
                    "the export server did not release its writes; restarting it"
                );
                if let Some(pid) = self.pid {
                    kill(pid);
                }
            }
        }
    }
}

impl Drop for Held<'_> {
    /// A hold dropped unreleased (its task panicked): nbdkit must not stay paused.
    fn drop(&mut self) {
        if self.control.is_some() {
            if let Some(pid) = self.pid {
                tracing::error!("a hold of the export server's writes was dropped; restarting it");
                kill(pid);
            }
        }
    }
}

/// Sends one command character and reads the filter's one-character answer.
async fn command(control: &mut UnixStream, c: char) -> Result<char, HoldError> {
    let byte = [c as u8];
    control
        .write_all(&byte)
        .await
        .map_err(|source| HoldError::Io {
            during: "sending a command",
            source,
        })?;
    let mut answer = [0u8; 1];
    control
        .read_exact(&mut answer)
        .await
        .map_err(|source| HoldError::Io {
            during: "reading the answer",
            source,
        })?;
    Ok(char::from(answer[0]))
}

fn kill(pid: i32) {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
}
