//! The CSI sidecars as host processes, kept running as kubelet keeps a Deployment's containers
//! running: one that exits is started again, and its exit is recorded with the end of its log.
//!
//! Why: a sidecar that loses its leader lease exits by design (csi-lib-utils' "Stopped
//! leading"), and a control plane on a busy host, reached by a TCG guest, can miss the renewal
//! deadline. In a cluster the Deployment restarts it; here, without a restart, a scenario
//! waited five minutes for a provisioner that was gone and failed without saying why. That exit
//! is excused, and so is one before every sidecar first leads ([`Sidecars::mark_steady`]): under
//! a loaded TCG host a starting sidecar can give up its first probe of the controller, which a
//! Deployment's restart also absorbs. Any other exit fails the scenario at its end
//! ([`Sidecars::assert_steady`]), since it may be ours (a sidecar also exits when it loses its
//! connection to the controller).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// One sidecar: its executable, whether it dials the controller's CSI socket, its arguments,
/// and the Lease it holds while it leads.
pub struct Spec {
    pub name: &'static str,
    pub speaks_csi: bool,
    pub args: &'static [&'static str],
    pub lease: &'static str,
}

/// A sidecar's exit, as the scenario's report shows it.
struct Exit {
    name: &'static str,
    status: String,
    ran_for: Duration,
    log_end: Vec<String>,
    excuse: Option<Excuse>,
}

/// Why an exit does not fail the scenario.
#[derive(Clone, Copy)]
enum Excuse {
    LostLease,
    StartingUp,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} exited ({}) after {:.1} s{}; its log ended:",
            self.name,
            self.status,
            self.ran_for.as_secs_f64(),
            match self.excuse {
                Some(Excuse::LostLease) => ", having lost its leader lease",
                Some(Excuse::StartingUp) => ", before the sidecars all led",
                None => "",
            }
        )?;
        for line in &self.log_end {
            writeln!(f, "    {line}")?;
        }
        Ok(())
    }
}

/// Every sidecar exit of this test process, for [`report`] (a failure's diagnostics).
static EXITS: Mutex<Vec<Exit>> = Mutex::new(Vec::new());

/// The exits so far; a scenario that failed while holding them does not cost the next one.
fn exits() -> MutexGuard<'static, Vec<Exit>> {
    EXITS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How many times one sidecar is started again before it is left down (a crash loop).
const MAX_RESTARTS: usize = 5;
/// How often the supervisor looks at its children.
const POLL: Duration = Duration::from_millis(500);
/// The lines of a sidecar's log its exit record keeps.
const LOG_END_LINES: usize = 12;

struct Running {
    spec: &'static Spec,
    child: Option<Child>,
    started: Instant,
    restarts: usize,
}

struct Shared {
    stop: AtomicBool,
    /// Set once every sidecar has led: from then on only a lost lease excuses an exit.
    steady: AtomicBool,
    running: Mutex<Vec<Running>>,
}

/// The sidecars, supervised by a thread; all killed when dropped.
pub struct Sidecars {
    shared: Arc<Shared>,
    supervisor: Option<std::thread::JoinHandle<()>>,
    /// How many exits [`EXITS`] held when these started: those belong to earlier scenarios.
    first_exit: usize,
}

struct Launch {
    csi_address: String,
    kubeconfig: String,
    logs: PathBuf,
}

impl Launch {
    fn log_path(&self, spec: &Spec) -> PathBuf {
        self.logs.join(format!("{}.log", spec.name))
    }

    fn spawn(&self, spec: &Spec) -> std::io::Result<Child> {
        // Appended to: a restarted sidecar's log follows the exited one's.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(spec))?;
        Command::new(spec.name)
            .args(spec.speaks_csi.then_some(&self.csi_address))
            .arg(&self.kubeconfig)
            .args(spec.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
    }
}

impl Sidecars {
    /// Starts `specs` against the controller's `socket`, each logging to `logs/<name>.log`.
    pub fn start(specs: &'static [Spec], socket: &Path, kubeconfig: &str, logs: &Path) -> Self {
        std::fs::create_dir_all(logs).unwrap();
        let launch = Launch {
            csi_address: format!("--csi-address={}", socket.display()),
            kubeconfig: format!("--kubeconfig={kubeconfig}"),
            logs: logs.to_owned(),
        };
        let running = specs
            .iter()
            .map(|spec| {
                // A fresh log per scenario.
                let _ = std::fs::remove_file(launch.log_path(spec));
                let child = launch
                    .spawn(spec)
                    .unwrap_or_else(|e| panic!("{}: {e}", spec.name));
                Running {
                    spec,
                    child: Some(child),
                    started: Instant::now(),
                    restarts: 0,
                }
            })
            .collect();
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            steady: AtomicBool::new(false),
            running: Mutex::new(running),
        });
        let first_exit = exits().len();
        let supervisor = {
            let shared = shared.clone();
            std::thread::spawn(move || supervise(&shared, &launch))
        };
        Self {
            shared,
            supervisor: Some(supervisor),
            first_exit,
        }
    }

    /// Every sidecar has led once: start-up is over.
    pub fn mark_steady(&self) {
        self.shared.steady.store(true, Ordering::SeqCst);
    }

    /// Fails when a sidecar of this scenario exited, after start-up, for a reason other than
    /// a lost lease.
    pub fn assert_steady(&self) {
        let unexcused: Vec<String> = exits()[self.first_exit..]
            .iter()
            .filter(|e| e.excuse.is_none())
            .map(Exit::to_string)
            .collect();
        assert!(
            unexcused.is_empty(),
            "a sidecar exited during the scenario:\n{}",
            unexcused.join("")
        );
    }
}

impl Drop for Sidecars {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(supervisor) = self.supervisor.take() {
            let _ = supervisor.join();
        }
        for running in self.shared.running.lock().unwrap().iter_mut() {
            if let Some(child) = running.child.as_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// Restarts what exits, until told to stop.
fn supervise(shared: &Shared, launch: &Launch) {
    while !shared.stop.load(Ordering::SeqCst) {
        std::thread::sleep(POLL);
        let mut running = shared.running.lock().unwrap();
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        for r in running.iter_mut() {
            let Some(status) = r.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) else {
                continue;
            };
            let log_path = launch.log_path(r.spec);
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let log_end: Vec<String> = lines[lines.len().saturating_sub(LOG_END_LINES)..]
                .iter()
                .map(|l| l.to_string())
                .collect();
            let exit = Exit {
                name: r.spec.name,
                status: status.to_string(),
                ran_for: r.started.elapsed(),
                excuse: if lost_its_lease(&log_end) {
                    Some(Excuse::LostLease)
                } else if !shared.steady.load(Ordering::SeqCst) {
                    Some(Excuse::StartingUp)
                } else {
                    None
                },
                log_end,
            };
            eprint!("sidecar {exit}");
            exits().push(exit);
            r.child = None;
            if r.restarts == MAX_RESTARTS {
                eprintln!(
                    "sidecar {}: left down after {MAX_RESTARTS} restarts",
                    r.spec.name
                );
                continue;
            }
            r.restarts += 1;
            if let Ok(mut log) = std::fs::OpenOptions::new().append(true).open(&log_path) {
                let _ = writeln!(log, "--- started again ({}) by the test", r.restarts);
            }
            match launch.spawn(r.spec) {
                Ok(child) => {
                    r.child = Some(child);
                    r.started = Instant::now();
                }
                Err(e) => eprintln!("sidecar {}: could not start it again: {e}", r.spec.name),
            }
        }
    }
}

/// Whether a sidecar's last lines say it stopped because it lost its leader lease: what
/// csi-lib-utils logs then ("Stopped leading"), or client-go's renewal failure before it.
fn lost_its_lease(log_end: &[String]) -> bool {
    log_end
        .iter()
        .any(|l| l.contains("Stopped leading") || l.contains("failed to renew lease"))
}

/// The sidecars' exits so far and which are running, for a failure's diagnostics.
pub fn report() -> String {
    let exits = exits();
    if exits.is_empty() {
        return "--- sidecars: none exited\n".to_owned();
    }
    let mut text = format!("--- sidecars: {} exit(s)\n", exits.len());
    for exit in exits.iter() {
        text.push_str(&exit.to_string());
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_lost_lease_excuses_an_exit() {
        let lines = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(lost_its_lease(&lines(&[
            "E1207 14:06:36.1 1 leaderelection.go:429] Failed to update lock: etcdserver: request timed out",
            "E1207 14:06:46.1 1 leader_election.go:188] \"Stopped leading\"",
        ])));
        assert!(lost_its_lease(&lines(&[
            "I1207 1 leaderelection.go:297] failed to renew lease default/x: timed out waiting for the condition",
        ])));
        assert!(!lost_its_lease(&lines(&[
            "E1207 1 connection.go:200] \"Lost connection\" address=\"unix:///tmp/c/csi.sock\"",
            "E1207 1 connection.go:117] Lost connection to CSI driver, exiting",
        ])));
        assert!(!lost_its_lease(&[]));
    }
}
