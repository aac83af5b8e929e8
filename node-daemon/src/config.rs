//! Settings: built-in defaults, overridden by an optional TOML file, overridden by flags.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// The driver name kubelet and the CO know this plugin by.
pub use csi_common::DRIVER_NAME;
/// Topology key whose presence on a node says "this node runs the NBD data plane".
pub use csi_common::TOPOLOGY_KEY;

pub const DEFAULT_CSI_ENDPOINT: &str =
    "unix:///var/lib/kubelet/plugins/ustor-nbd.csi.mindsw.io/csi.sock";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/ustor-csi";
pub const DEFAULT_REGISTRATION_DIR: &str = "/var/lib/kubelet/plugins_registry";
pub const DEFAULT_CONFIG: &str = "/etc/ustor-csi/node.toml";
/// Loopback only by default: opening it to the cluster is the operator's choice.
pub const DEFAULT_METRICS_ADDRESS: &str = "127.0.0.1:9809";

/// The file form: every key optional, names as in the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileConfig {
    pub csi_endpoint: Option<String>,
    pub state_dir: Option<PathBuf>,
    pub node_id: Option<String>,
    pub registration_dir: Option<PathBuf>,
    pub kubelet_registration: Option<bool>,
    pub io_timeout_secs: Option<u64>,
    pub dead_conn_timeout_secs: Option<u64>,
    pub dial_timeout_secs: Option<u64>,
    pub max_volumes: Option<i64>,
    pub call_patience_secs: Option<u64>,
    /// `host:port` for `/metrics`; empty disables it.
    pub metrics_address: Option<String>,
    /// TLS for `nbds://` exports: the CA bundle that signs the servers, and the client
    /// certificate and key the servers may ask for (read at every connection).
    pub tls_ca_file: Option<PathBuf>,
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// The name servers' certificates carry, when not the URI's host.
    pub tls_server_name: Option<String>,
    /// Named TLS settings (`[tls-profile.<name>]`), chosen per volume by its `tlsProfile`
    /// volume context key: one per uStor connection, each with that connection's CA and client
    /// certificate. The `tls-*` keys above are used by volumes that name none.
    #[serde(default)]
    pub tls_profile: std::collections::BTreeMap<String, TlsProfileFile>,
}

/// One `[tls-profile.<name>]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct TlsProfileFile {
    pub ca_file: PathBuf,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub server_name: Option<String>,
}

impl FileConfig {
    /// Reads `path`; a missing file at the default location is no error.
    pub fn load(path: &Path, required: bool) -> anyhow::Result<Self> {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => Ok(Self::default()),
            Err(e) => Err(anyhow::anyhow!("{}: {e}", path.display())),
        }
    }
}

/// Everything the daemon runs with, resolved.
#[derive(Debug, Clone)]
pub struct Settings {
    pub csi_socket: PathBuf,
    pub state_dir: PathBuf,
    pub node_id: String,
    /// Where kubelet looks for registration sockets; `None` disables self-registration.
    pub registration_dir: Option<PathBuf>,
    /// Per-request timeout given to the kernel; a request that exceeds it is requeued on a
    /// fresh connection (the link is treated as dead and healed).
    pub io_timeout: Duration,
    /// How long I/O waits for the healer to replace a dead connection before failing.
    pub dead_conn_timeout: Duration,
    /// Bound on connect plus handshake.
    pub dial_timeout: Duration,
    /// Reported to the CO; 0 = no limit.
    pub max_volumes: Option<i64>,
    /// How long a CSI call waits for another operation on its volume before ABORTED.
    pub call_patience: Duration,
    /// Where `/metrics` is served; `None` disables it.
    pub metrics_address: Option<std::net::SocketAddr>,
    /// TLS material for `nbds://` exports that name no profile; `None` refuses them with a
    /// clear error.
    pub tls: Option<std::sync::Arc<nbd::tls::TlsFiles>>,
    /// TLS material by profile name, for exports whose volume names one.
    pub tls_profiles: std::collections::BTreeMap<String, std::sync::Arc<nbd::tls::TlsFiles>>,
}

impl Settings {
    pub fn defaults(node_id: String) -> Self {
        Self {
            csi_socket: unix_path(DEFAULT_CSI_ENDPOINT).unwrap_or_default(),
            state_dir: DEFAULT_STATE_DIR.into(),
            node_id,
            registration_dir: Some(DEFAULT_REGISTRATION_DIR.into()),
            io_timeout: nbd::attach::DEFAULT_IO_TIMEOUT,
            dead_conn_timeout: nbd::attach::DEFAULT_DEAD_CONN_TIMEOUT,
            dial_timeout: Duration::from_secs(10),
            max_volumes: None,
            call_patience: Duration::from_secs(15),
            metrics_address: Some(
                DEFAULT_METRICS_ADDRESS
                    .parse()
                    .unwrap_or_else(|_| ([127, 0, 0, 1], 9809).into()),
            ),
            tls: None,
            tls_profiles: Default::default(),
        }
    }

    pub fn apply_file(&mut self, f: FileConfig) -> anyhow::Result<()> {
        if let Some(e) = f.csi_endpoint {
            self.csi_socket = unix_path(&e)?;
        }
        if let Some(d) = f.state_dir {
            self.state_dir = d;
        }
        if let Some(n) = f.node_id {
            self.node_id = n;
        }
        if let Some(d) = f.registration_dir {
            self.registration_dir = Some(d);
        }
        if f.kubelet_registration == Some(false) {
            self.registration_dir = None;
        }
        if let Some(s) = f.io_timeout_secs {
            self.io_timeout = Duration::from_secs(s);
        }
        if let Some(s) = f.dead_conn_timeout_secs {
            self.dead_conn_timeout = Duration::from_secs(s);
        }
        if let Some(s) = f.dial_timeout_secs {
            self.dial_timeout = Duration::from_secs(s);
        }
        if f.max_volumes.is_some() {
            self.max_volumes = f.max_volumes;
        }
        if let Some(s) = f.call_patience_secs {
            self.call_patience = Duration::from_secs(s);
        }
        if let Some(a) = f.metrics_address {
            self.metrics_address = metrics_address(&a)?;
        }
        match (
            f.tls_ca_file,
            f.tls_cert_file.is_some() || f.tls_key_file.is_some(),
        ) {
            (Some(ca), _) => {
                self.tls = Some(
                    tls_files(ca, f.tls_cert_file, f.tls_key_file, f.tls_server_name)
                        .map_err(|e| anyhow::anyhow!("tls-cert-file, tls-key-file: {e}"))?,
                )
            }
            (None, true) => anyhow::bail!(
                "tls-cert-file and tls-key-file need tls-ca-file (the CA that signs the servers)"
            ),
            (None, false) => {}
        }
        for (name, p) in f.tls_profile {
            let files = tls_files(p.ca_file, p.cert_file, p.key_file, p.server_name)
                .map_err(|e| anyhow::anyhow!("[tls-profile.{name}]: {e}"))?;
            self.tls_profiles.insert(name, files);
        }
        Ok(())
    }
}

/// A client certificate comes with its key: one without the other is a configuration mistake
/// found at start, not at the first dial.
fn tls_files(
    ca: PathBuf,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
    server_name: Option<String>,
) -> anyhow::Result<std::sync::Arc<nbd::tls::TlsFiles>> {
    if client_cert.is_some() != client_key.is_some() {
        anyhow::bail!("a client certificate and its key are set together, or neither");
    }
    Ok(std::sync::Arc::new(nbd::tls::TlsFiles {
        ca,
        client_cert,
        client_key,
        server_name,
    }))
}

/// `host:port` to serve metrics on; empty means off.
pub fn metrics_address(raw: &str) -> anyhow::Result<Option<std::net::SocketAddr>> {
    if raw.is_empty() {
        return Ok(None);
    }
    raw.parse().map(Some).map_err(|e| {
        anyhow::anyhow!("metrics address {raw:?}: {e} (expected ip:port, or empty to disable)")
    })
}

/// `unix:///path` (or a bare absolute path) to the socket path.
pub fn unix_path(endpoint: &str) -> anyhow::Result<PathBuf> {
    let path = endpoint.strip_prefix("unix://").unwrap_or(endpoint);
    anyhow::ensure!(
        path.starts_with('/'),
        "CSI endpoint {endpoint:?} must be unix:///absolute/path"
    );
    Ok(PathBuf::from(path))
}

/// The host name, the default node id.
pub fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_overrides_defaults() {
        let mut s = Settings::defaults("n".into());
        // The one set of defaults the library, nbdctl and the daemon share (see README).
        assert_eq!(s.io_timeout, Duration::from_secs(10));
        assert_eq!(s.dead_conn_timeout, Duration::from_secs(300));
        let f: FileConfig = toml::from_str(
            r#"
            csi-endpoint = "unix:///run/csi/x.sock"
            dead-conn-timeout-secs = 60
            kubelet-registration = false
            "#,
        )
        .unwrap();
        s.apply_file(f).unwrap();
        assert_eq!(s.csi_socket, Path::new("/run/csi/x.sock"));
        assert_eq!(s.dead_conn_timeout, Duration::from_secs(60));
        assert_eq!(s.registration_dir, None);
        assert_eq!(s.state_dir, Path::new(DEFAULT_STATE_DIR));
    }

    #[test]
    fn unknown_keys_and_relative_endpoints_are_refused() {
        assert!(toml::from_str::<FileConfig>("csi_endpoint = \"x\"").is_err());
        assert!(unix_path("unix://relative/x.sock").is_err());
        assert!(unix_path("tcp://0.0.0.0:1").is_err());
        assert_eq!(unix_path("/a.sock").unwrap(), Path::new("/a.sock"));
    }

    #[test]
    fn tls_profiles_are_read_by_name_and_half_a_client_identity_is_refused() {
        let mut s = Settings::defaults("n".into());
        let f: FileConfig = toml::from_str(
            r#"
            tls-ca-file = "/etc/ustor-csi/tls/ca.crt"
            [tls-profile.lab]
            ca-file = "/etc/ustor-csi/tls/lab/ca.crt"
            cert-file = "/etc/ustor-csi/tls/lab/client.crt"
            key-file = "/etc/ustor-csi/tls/lab/client.key"
            server-name = "ustor.lab"
            "#,
        )
        .unwrap();
        s.apply_file(f).unwrap();
        let lab = &s.tls_profiles["lab"];
        assert_eq!(lab.ca, Path::new("/etc/ustor-csi/tls/lab/ca.crt"));
        assert_eq!(lab.server_name.as_deref(), Some("ustor.lab"));
        assert_eq!(
            s.tls.as_ref().unwrap().ca,
            Path::new("/etc/ustor-csi/tls/ca.crt")
        );

        let half: FileConfig =
            toml::from_str("[tls-profile.x]\nca-file = \"/ca\"\ncert-file = \"/c\"\n").unwrap();
        let err = Settings::defaults("n".into()).apply_file(half).unwrap_err();
        assert!(err.to_string().contains("[tls-profile.x]"), "{err}");
        assert!(toml::from_str::<FileConfig>("[tls-profile.x]\ncert-file = \"/c\"\n").is_err());
    }

    /// Every setting the packaged example shows, uncommented, is one the daemon reads.
    #[test]
    fn the_packaged_example_names_only_real_settings() {
        let example = include_str!("../../packaging/etc/node.toml");
        let uncommented: String = example
            .lines()
            .filter_map(|l| l.strip_prefix("# "))
            .filter(|l| {
                l.starts_with("[tls-profile.")
                    || l.split_once(" = ").is_some_and(|(k, _)| {
                        !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '-')
                    })
            })
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(uncommented.contains("tls-ca-file"), "{uncommented}");
        let f: FileConfig =
            toml::from_str(&uncommented).unwrap_or_else(|e| panic!("{e}\n{uncommented}"));
        assert!(f.tls_profile.contains_key("main"));
    }

    #[test]
    fn missing_default_file_is_fine_missing_named_file_is_not() {
        assert!(FileConfig::load(Path::new("/nonexistent/node.toml"), false).is_ok());
        assert!(FileConfig::load(Path::new("/nonexistent/node.toml"), true).is_err());
    }
}
