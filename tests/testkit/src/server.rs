//! Real NBD servers as child processes, killable and restartable at the same address.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nbd::NbdUri;

use crate::free_port;

/// How long a server may take to start listening. TCG guests are slow to exec.
const START_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerKind {
    Nbdkit,
    QemuNbd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listen {
    /// 127.0.0.1 on a port chosen once and kept across restarts.
    Tcp,
    /// A unix socket in the server's private directory.
    Unix,
}

#[derive(Debug, Clone)]
enum Address {
    Tcp(u16),
    Unix(PathBuf),
}

/// A running (or deliberately killed) NBD server.
#[derive(Debug)]
pub struct NbdServer {
    kind: ServerKind,
    address: Address,
    export: String,
    args: Vec<String>,
    pidfile: PathBuf,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

impl NbdServer {
    /// `nbdkit [args…]`, e.g. `&["file", "file=/tmp/disk"]` or `&["-r", "memory", "64M"]`.
    pub fn nbdkit(listen: Listen, args: &[&str]) -> io::Result<Self> {
        Self::new(ServerKind::Nbdkit, listen, "", args)
    }

    /// `qemu-nbd` serving a raw `image` as `export`.
    pub fn qemu_nbd(
        listen: Listen,
        image: &Path,
        export: &str,
        extra: &[&str],
    ) -> io::Result<Self> {
        let mut args: Vec<&str> = vec!["-f", "raw", "-x", export, "--persistent", "--shared=16"];
        args.extend_from_slice(extra);
        let image = image
            .to_str()
            .ok_or_else(|| io::Error::other("image path is not UTF-8"))?;
        args.push(image);
        Self::new(ServerKind::QemuNbd, listen, export, &args)
    }

    fn new(kind: ServerKind, listen: Listen, export: &str, args: &[&str]) -> io::Result<Self> {
        let dir = tempfile::Builder::new().prefix("nbd-server").tempdir()?;
        let address = match listen {
            Listen::Tcp => Address::Tcp(free_port()?),
            Listen::Unix => Address::Unix(dir.path().join("nbd.sock")),
        };
        let mut server = Self {
            kind,
            address,
            export: export.to_owned(),
            args: args.iter().map(|s| s.to_string()).collect(),
            pidfile: dir.path().join("server.pid"),
            child: None,
            _dir: dir,
        };
        server.start()?;
        Ok(server)
    }

    /// The URI of the server's export.
    pub fn uri(&self) -> NbdUri {
        self.uri_for(&self.export)
    }

    /// A URI naming another export on the same server.
    pub fn uri_for(&self, export: &str) -> NbdUri {
        match &self.address {
            Address::Tcp(port) => NbdUri::tcp("127.0.0.1", *port, export),
            Address::Unix(path) => NbdUri::unix(path, export),
        }
    }

    /// The TCP port it listens on (`None` for a unix socket), for clients given host and port.
    pub fn tcp_port(&self) -> Option<u16> {
        match &self.address {
            Address::Tcp(port) => Some(*port),
            Address::Unix(_) => None,
        }
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    /// Stops (`SIGSTOP`) or resumes (`SIGCONT`) the server: a hung server process whose
    /// kernel still holds its connections open and acknowledges, with the window shut.
    pub fn freeze(&self, frozen: bool) {
        let child = self.child.as_ref().expect("the server is not running");
        let pid = libc::pid_t::try_from(child.id()).expect("a pid fits pid_t");
        let signal = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: kill(2) takes plain integers; `pid` is our own child, not yet reaped.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(
            rc,
            0,
            "signalling the server: {}",
            io::Error::last_os_error()
        );
    }

    /// SIGKILL: the server vanishes without closing anything cleanly, as a crashed one does.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again at its address with other arguments: the storage coming back
    /// different after a failover or a restore (another image, read-only, fewer flags).
    pub fn restart_with(&mut self, args: &[&str]) -> io::Result<()> {
        self.args = args.iter().map(|s| s.to_string()).collect();
        self.start()
    }

    /// Starts the server (again) at its address and waits until it accepts connections.
    pub fn start(&mut self) -> io::Result<()> {
        self.kill();
        let _ = std::fs::remove_file(&self.pidfile);
        if let Address::Unix(path) = &self.address {
            let _ = std::fs::remove_file(path);
        }
        let mut cmd = match self.kind {
            ServerKind::Nbdkit => {
                let mut c = Command::new("nbdkit");
                c.args(["-f", "--exit-with-parent", "-P"])
                    .arg(&self.pidfile);
                match &self.address {
                    Address::Tcp(port) => c.args(["-i", "127.0.0.1", "-p", &port.to_string()]),
                    Address::Unix(path) => c.arg("-U").arg(path),
                };
                c
            }
            ServerKind::QemuNbd => {
                let mut c = Command::new("qemu-nbd");
                match &self.address {
                    Address::Tcp(port) => c.args(["-b", "127.0.0.1", "-p", &port.to_string()]),
                    Address::Unix(path) => c.arg("-k").arg(path),
                };
                c
            }
        };
        cmd.args(&self.args).stdin(Stdio::null());
        let child = cmd
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("starting {:?}: {e}", self.kind)))?;
        self.child = Some(child);
        self.wait_listening()
    }

    fn wait_listening(&mut self) -> io::Result<()> {
        let started = Instant::now();
        loop {
            if !self.is_running() {
                return Err(io::Error::other(format!(
                    "{:?} {:?} exited at start",
                    self.kind, self.args
                )));
            }
            // nbdkit writes its pidfile once it listens; qemu-nbd is probed by connecting.
            let ready = match (self.kind, &self.address) {
                (ServerKind::Nbdkit, _) => self.pidfile.exists(),
                (ServerKind::QemuNbd, Address::Tcp(port)) => {
                    std::net::TcpStream::connect(("127.0.0.1", *port)).is_ok()
                }
                (ServerKind::QemuNbd, Address::Unix(path)) => UnixStream::connect(path).is_ok(),
            };
            if ready {
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{:?} did not start listening", self.kind),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.kill();
    }
}
