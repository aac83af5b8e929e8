//! A real Kubernetes control plane for the glue tests: etcd, kube-apiserver and, on request,
//! kube-controller-manager (which owns garbage collection) and kube-scheduler, as child
//! processes on loopback. The binaries come from `tests/kube/build-apiserver`'s cache, named by
//! `$USTOR_KUBE_BIN` (`tests/kube/run` sets it). No kubelet runs here: nodes are objects the
//! tests create, or the real node of the guest suite `vm_kubelet`.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// Where the control plane's binaries are.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("USTOR_KUBE_BIN").map(PathBuf::from).expect(
        "USTOR_KUBE_BIN is not set: run the Kubernetes tests with tests/kube/run, which builds the API server",
    )
}

#[derive(Debug)]
pub struct KubeCluster {
    dir: tempfile::TempDir,
    etcd: Child,
    apiserver: Option<Child>,
    controller_manager: Option<Child>,
    scheduler: Option<Child>,
    etcd_url: String,
    /// The egress selector configuration the API server runs with, if any.
    egress_config: Option<PathBuf>,
    port: u16,
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    /// A bearer token of a `system:masters` user.
    pub token: String,
    /// A kubeconfig for that user (kubectl, kube-controller-manager).
    pub kubeconfig: PathBuf,
}

impl KubeCluster {
    /// Starts etcd and the API server and waits until `/readyz` answers.
    pub fn start() -> io::Result<Self> {
        Self::start_with_egress(None)
    }

    /// Like [`start`](Self::start), with the API server's connections to kubelets and
    /// webhooks sent through the HTTP CONNECT proxy on the unix socket `egress`
    /// ([`crate::egress`]), when given.
    pub fn start_with_egress(egress: Option<&Path>) -> io::Result<Self> {
        let dir = tempfile::Builder::new().prefix("kube").tempdir()?;
        let root = dir.path();
        let (client, peer, metrics) = (free_port()?, free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let etcd = Command::new(bin_dir().join("etcd"))
            .arg("--data-dir")
            .arg(root.join("etcd"))
            .args(["--listen-client-urls", &etcd_url])
            .args(["--advertise-client-urls", &etcd_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .args([
                "--listen-metrics-urls",
                &format!("http://127.0.0.1:{metrics}"),
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(root.join("etcd.log"))?)
            .spawn()?;
        let key = root.join("sa.key");
        let made = Command::new("openssl")
            .args(["genrsa", "-out"])
            .arg(&key)
            .arg("2048")
            .stderr(Stdio::null())
            .status()?;
        if !made.success() {
            return Err(io::Error::other("openssl genrsa failed"));
        }
        // Random: the API server listens on this machine's loopback, open to its other users.
        let token = random_token()?;
        std::fs::write(
            root.join("tokens.csv"),
            format!("{token},admin,admin,\"system:masters\"\n"),
        )?;
        let port = free_port()?;
        let url = format!("https://127.0.0.1:{port}");
        let kubeconfig = root.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            kubeconfig_text(&url, "insecure-skip-tls-verify: true", &token),
        )?;
        let egress_config = match egress {
            Some(socket) => {
                let config = root.join("egress-selector.yaml");
                std::fs::write(&config, crate::egress::selector_config(socket))?;
                Some(config)
            }
            None => None,
        };
        let mut me = Self {
            dir,
            etcd,
            apiserver: None,
            controller_manager: None,
            scheduler: None,
            etcd_url,
            egress_config,
            port,
            url,
            token,
            kubeconfig,
        };
        me.start_apiserver()?;
        Ok(me)
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    /// Starts (again) the API server on the same port and data, and waits until it is ready.
    pub fn start_apiserver(&mut self) -> io::Result<()> {
        let root = self.root().to_owned();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(root.join("apiserver.log"))?;
        let mut command = Command::new(bin_dir().join("kube-apiserver"));
        if let Some(config) = &self.egress_config {
            command.arg("--egress-selector-config-file").arg(config);
        }
        let child = command
            .args(["--etcd-servers", &self.etcd_url])
            .args([
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
            ])
            .args(["--secure-port", &self.port.to_string()])
            .arg("--cert-dir")
            .arg(root.join("certs"))
            .arg("--token-auth-file")
            .arg(root.join("tokens.csv"))
            .args(["--authorization-mode", "RBAC"])
            // Privileged pods: the e2e suite's injector and hostexec pods, as on clusters
            // that run CSI node plugins (the API server refuses them by default).
            .arg("--allow-privileged=true")
            .args(["--service-cluster-ip-range", "10.0.0.0/24"])
            .args(["--service-account-issuer", "https://kubernetes.default.svc"])
            .arg("--service-account-key-file")
            .arg(root.join("sa.key"))
            .arg("--service-account-signing-key-file")
            .arg(root.join("sa.key"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        self.apiserver = Some(child);
        self.wait_ready(Duration::from_secs(90))
    }

    /// Stops the API server (etcd keeps the data), as an outage of the control plane.
    pub fn stop_apiserver(&mut self) {
        if let Some(mut child) = self.apiserver.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A control-plane component of `binary` as both are started: this cluster's kubeconfig,
    /// serving only on loopback (no insecure port), no leader election (one replica), its
    /// log in `<log>.log`.
    fn component(&self, binary: &str, log: &str) -> io::Result<Command> {
        let mut command = Command::new(bin_dir().join(binary));
        command
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["--bind-address", "127.0.0.1", "--port", "0"])
            .args(["--secure-port", &free_port()?.to_string()])
            .arg("--leader-elect=false")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(
                self.root().join(format!("{log}.log")),
            )?);
        Ok(command)
    }

    /// Starts kube-controller-manager (garbage collection of owned objects, among others).
    /// Service account tokens carry the API server's own CA, so that a pod's in-cluster
    /// client verifies it (the real node runs the controller's Deployment).
    pub fn start_controller_manager(&mut self) -> io::Result<()> {
        let child = self
            .component("kube-controller-manager", "controller-manager")?
            .arg("--use-service-account-credentials=false")
            .arg("--service-account-private-key-file")
            .arg(self.root().join("sa.key"))
            .arg("--root-ca-file")
            .arg(self.root().join("certs").join("apiserver.crt"))
            .spawn()?;
        self.controller_manager = Some(child);
        Ok(())
    }

    /// Starts kube-scheduler, for pods of a real kubelet.
    pub fn start_scheduler(&mut self) -> io::Result<()> {
        let child = self.component("kube-scheduler", "scheduler")?.spawn()?;
        self.scheduler = Some(child);
        Ok(())
    }

    fn wait_ready(&mut self, timeout: Duration) -> io::Result<()> {
        let started = Instant::now();
        loop {
            if let Some(status) = crate::exited(&mut self.apiserver) {
                return Err(io::Error::other(format!(
                    "kube-apiserver exited ({status}); its log: {}",
                    self.log_tail("apiserver.log")
                )));
            }
            let out = self.kubectl(&["get", "--raw", "/readyz"])?;
            if out.status.success() {
                return Ok(());
            }
            if started.elapsed() > timeout {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "kube-apiserver not ready: {}",
                        self.log_tail("apiserver.log")
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The last lines of one of the control plane's logs, for failure messages.
    pub fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.root().join(name)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// The API server's port on loopback.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A kubeconfig of this cluster's admin that names the API server as `server` (an
    /// address by which another machine, such as a VM guest, reaches it), and verifies it:
    /// against the CA of the certificate the API server made itself, by a name that
    /// certificate holds whatever the address.
    pub fn kubeconfig_via(&self, server: &str) -> io::Result<String> {
        use base64::Engine as _;
        // The serving certificate, then its CA (kube-apiserver's self-signed pair).
        let chain = std::fs::read(self.root().join("certs").join("apiserver.crt"))?;
        let ca = base64::engine::general_purpose::STANDARD.encode(chain);
        let tls = format!(
            "certificate-authority-data: {ca}\n    tls-server-name: kubernetes.default.svc"
        );
        Ok(kubeconfig_text(server, &tls, &self.token))
    }

    /// The cached kubectl (the API server's own version) for this cluster.
    pub fn kubectl_tool(&self) -> Kubectl {
        Kubectl {
            binary: bin_dir().join("kubectl"),
            kubeconfig: self.kubeconfig.clone(),
        }
    }

    /// Runs the cached kubectl against this cluster.
    pub fn kubectl(&self, args: &[&str]) -> io::Result<Output> {
        self.kubectl_tool().run(args)
    }

    /// Like [`kubectl`](Self::kubectl) with `stdin` fed to it (`apply -f -`).
    pub fn kubectl_stdin(&self, args: &[&str], stdin: &str) -> io::Result<Output> {
        self.kubectl_tool().run_stdin(args, stdin)
    }
}

fn random_token() -> io::Result<String> {
    let mut bytes = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| io::Error::other("no random bytes for the API server's token"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A kubeconfig with one cluster, its TLS settings `tls` (lines of the cluster entry), and
/// one user, the bearer `token`'s.
fn kubeconfig_text(server: &str, tls: &str, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    \
         {tls}\nusers:\n- name: admin\n  user:\n    token: {token}\n\
         contexts:\n- name: test\n  context:\n    cluster: test\n    user: admin\ncurrent-context: test\n"
    )
}

/// A CSINode as kubelet's registration writes it for a node running our node service: our
/// driver with the node's id, its topology keys and, when it has one, its attach limit.
pub fn csinode_yaml(node_id: &str, topology_keys: &[&str], attach_limit: Option<i64>) -> String {
    let keys: Vec<String> = topology_keys.iter().map(|k| format!("{k:?}")).collect();
    let allocatable = attach_limit
        .map(|count| format!("    allocatable:\n      count: {count}\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: storage.k8s.io/v1\nkind: CSINode\nmetadata:\n  name: {node_id}\nspec:\n  drivers:\n\
         \x20 - name: {}\n    nodeID: {node_id}\n    topologyKeys: [{}]\n{allocatable}",
        csi_common::DRIVER_NAME,
        keys.join(", ")
    )
}

/// kubectl with a kubeconfig: of a cluster this process started, or of one it is handed (a
/// VM guest gets the host's control plane this way, see `tests/vm/run`).
#[derive(Debug, Clone)]
pub struct Kubectl {
    pub binary: PathBuf,
    pub kubeconfig: PathBuf,
}

impl Kubectl {
    pub fn run(&self, args: &[&str]) -> io::Result<Output> {
        Command::new(&self.binary)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .output()
    }

    /// Like [`run`](Self::run) with `stdin` fed to it (`apply -f -`).
    pub fn run_stdin(&self, args: &[&str], stdin: &str) -> io::Result<Output> {
        use std::io::Write;
        let mut child = Command::new(&self.binary)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        child
            .stdin
            .take()
            .ok_or_else(|| io::Error::other("kubectl stdin"))?
            .write_all(stdin.as_bytes())?;
        child.wait_with_output()
    }

    /// [`run`](Self::run) or [`run_stdin`](Self::run_stdin), and an error with kubectl's own
    /// words when it fails.
    pub fn ok(&self, args: &[&str], stdin: Option<&str>) -> io::Result<String> {
        let out = match stdin {
            Some(text) => self.run_stdin(args, text)?,
            None => self.run(args)?,
        };
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for KubeCluster {
    /// The API server stops before etcd: stopping both at once can hang the API server.
    fn drop(&mut self) {
        for child in [
            self.scheduler.take(),
            self.controller_manager.take(),
            self.apiserver.take(),
        ]
        .into_iter()
        .flatten()
        {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = self.etcd.kill();
        let _ = self.etcd.wait();
    }
}
