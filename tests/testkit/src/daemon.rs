//! The node daemon as a real child process: started, probed, killed with SIGKILL, restarted
//! on the same state directory.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use csi_proto::csi::ProbeRequest;

use crate::csi::NodeClients;

/// The daemon binary: `$USTOR_CSI_NODE_BIN`, else `ustor-csi-node` on PATH.
pub fn binary() -> PathBuf {
    crate::binary_from_env("USTOR_CSI_NODE_BIN", "ustor-csi-node")
}

#[derive(Debug)]
pub struct NodeDaemon {
    pub node_id: String,
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub registration_dir: PathBuf,
    /// Where the daemon serves `/metrics`.
    pub metrics: std::net::SocketAddr,
    /// Extra environment for the next starts (e.g. systemd's NOTIFY_SOCKET).
    pub env: Vec<(String, String)>,
    config: PathBuf,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl NodeDaemon {
    /// A daemon with its own state directory and sockets; `config` is extra TOML settings.
    pub fn new(node_id: &str, config: &str) -> io::Result<Self> {
        let dir = tempfile::Builder::new().prefix("node-daemon").tempdir()?;
        let config_path = dir.path().join("node.toml");
        let metrics = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        std::fs::write(
            &config_path,
            // Top-level keys before `config`, which may end in a table.
            format!("metrics-address = \"{metrics}\"\n{config}\n"),
        )?;
        Ok(Self {
            node_id: node_id.to_owned(),
            state_dir: dir.path().join("state"),
            socket: dir.path().join("plugin/csi.sock"),
            registration_dir: dir.path().join("plugins_registry"),
            metrics,
            env: Vec::new(),
            config: config_path,
            child: None,
            dir,
        })
    }

    /// The configuration file the daemon is started with.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// The daemon's state directory (journal, kept TLS material).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// A scratch directory that lives as long as the daemon (for staging and target paths).
    pub fn scratch(&self) -> &Path {
        self.dir.path()
    }

    /// Starts the daemon (crash points armed if given) and waits until its Probe says ready.
    pub async fn start(&mut self, failpoints: Option<&str>) -> NodeClients {
        self.spawn(failpoints);
        self.wait_ready().await
    }

    /// Starts the daemon process without waiting for it ([`NodeDaemon::wait_ready`] does).
    pub fn spawn(&mut self, failpoints: Option<&str>) {
        assert!(self.child.is_none(), "already running");
        let mut cmd = Command::new(binary());
        cmd.arg("serve")
            .arg("--config")
            .arg(&self.config)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--node-id")
            .arg(&self.node_id)
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", self.socket.display()))
            .arg("--registration-dir")
            .arg(&self.registration_dir)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("NO_COLOR", "1")
            .stdin(Stdio::null());
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        match failpoints {
            Some(f) => cmd
                .env("USTOR_FAILPOINTS", f)
                .env("USTOR_FAILPOINT_MARKS", self.marks_dir()),
            None => cmd.env_remove("USTOR_FAILPOINTS"),
        };
        self.child = Some(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("starting {:?}: {e}", binary())),
        );
    }

    /// Waits until the started daemon's Probe says ready; panics if it exits or takes a minute.
    pub async fn wait_ready(&mut self) -> NodeClients {
        let started = Instant::now();
        loop {
            if let Some(status) = crate::exited(&mut self.child) {
                panic!("the node daemon exited during start-up: {status}");
            }
            if let Ok(mut clients) = NodeClients::connect(&self.socket).await {
                if let Ok(r) = clients.identity.probe(ProbeRequest {}).await {
                    if r.into_inner().ready == Some(true) {
                        return clients;
                    }
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the node daemon did not become ready"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops (`SIGSTOP`) or resumes (`SIGCONT`) the running daemon: a node that is cut off
    /// hears nothing and does nothing, then comes back with all its state.
    pub fn freeze(&self, frozen: bool) {
        let child = self.child.as_ref().expect("the daemon is not running");
        let pid = libc::pid_t::try_from(child.id()).expect("a pid fits pid_t");
        let signal = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: kill(2) takes plain integers; `pid` is our own child, not yet reaped.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(
            rc,
            0,
            "signalling the daemon: {}",
            io::Error::last_os_error()
        );
    }

    /// SIGKILL, as a crash or the OOM killer would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the daemon to exit on its own (an armed crash point).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let started = Instant::now();
        while started.elapsed() < timeout {
            if let Some(status) = crate::exited(&mut self.child) {
                self.child = None;
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    fn marks_dir(&self) -> PathBuf {
        self.dir.path().join("failpoint-marks")
    }

    /// Waits until the daemon pauses at `point` (armed with `point=pause(ms)`), and clears the
    /// mark so the next wait waits for the next pause.
    pub async fn wait_paused(&self, point: &str) {
        let mark = self.marks_dir().join(point);
        let started = Instant::now();
        while std::fs::remove_file(&mark).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the daemon never paused at {point}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The daemon's `/metrics` text.
    pub async fn scrape(&self) -> String {
        crate::scrape(self.metrics).await
    }

    /// Journal records on disk.
    pub fn journal_files(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.state_dir.join("volumes"))
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default()
    }
}

impl Drop for NodeDaemon {
    fn drop(&mut self) {
        self.kill();
    }
}
