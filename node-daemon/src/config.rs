//! Settings: built-in defaults, overridden by an optional TOML file, overridden by flags.

use std::io;
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

/// Why the settings could not be read: one variant per failed step, each message naming the
/// file, key or value at fault and keeping the cause. The daemon refuses to start with any of
/// them; `status` and `repair` report them and exit.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The settings file could not be read (a missing default file is no error).
    #[error("{}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    /// The settings file is not valid TOML, or names a key the daemon does not know.
    #[error("{}: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    /// A CSI endpoint that is not a unix socket at an absolute path.
    #[error("CSI endpoint {endpoint:?} must be unix:///absolute/path")]
    Endpoint { endpoint: String },
    /// A metrics address that is neither `ip:port` nor empty.
    #[error("metrics address {raw:?}: {source} (expected ip:port, or empty to disable)")]
    MetricsAddress {
        raw: String,
        source: std::net::AddrParseError,
    },
    /// A client certificate or key without the CA that signs the servers.
    #[error("tls-cert-file and tls-key-file need tls-ca-file (the CA that signs the servers)")]
    TlsClientWithoutCa,
    /// A client certificate without its key, or a key without its certificate: at the top
    /// level (`profile` is `None`) or in `[tls-profile.<profile>]`.
    #[error("{}: a client certificate and its key are set together, or neither", tls_keys(.profile.as_deref()))]
    IncompleteTlsIdentity { profile: Option<String> },
}

/// Where a TLS identity is configured, as an operator finds it in the file.
fn tls_keys(profile: Option<&str>) -> String {
    match profile {
        None => "tls-cert-file, tls-key-file".to_owned(),
        Some(name) => format!("[tls-profile.{name}]"),
    }
}

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
    pub fn load(path: &Path, required: bool) -> Result<Self, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => toml::from_str(&text).map_err(|source| ConfigError::Parse {
                path: path.to_owned(),
                source,
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound && !required => Ok(Self::default()),
            Err(source) => Err(ConfigError::Read {
                path: path.to_owned(),
                source,
            }),
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

    pub fn apply_file(&mut self, f: FileConfig) -> Result<(), ConfigError> {
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
                self.tls = Some(tls_files(
                    None,
                    ca,
                    f.tls_cert_file,
                    f.tls_key_file,
                    f.tls_server_name,
                )?)
            }
            (None, true) => return Err(ConfigError::TlsClientWithoutCa),
            (None, false) => {}
        }
        for (name, p) in f.tls_profile {
            let files = tls_files(
                Some(&name),
                p.ca_file,
                p.cert_file,
                p.key_file,
                p.server_name,
            )?;
            self.tls_profiles.insert(name, files);
        }
        Ok(())
    }
}

impl Settings {
    /// The TLS files a volume dials with: its profile's, or the top-level ones. `Err` is the
    /// name of a profile this node does not define.
    pub fn tls_for<'a>(
        &self,
        profile: Option<&'a str>,
    ) -> Result<Option<std::sync::Arc<nbd::tls::TlsFiles>>, &'a str> {
        match profile {
            None => Ok(self.tls.clone()),
            Some(name) => self.tls_profiles.get(name).cloned().map(Some).ok_or(name),
        }
    }
}

/// A client certificate comes with its key: one without the other is a configuration mistake
/// found at start, not at the first dial. `profile` names the `[tls-profile.<name>]` table the
/// files come from (`None`: the top-level `tls-*` keys).
fn tls_files(
    profile: Option<&str>,
    ca: PathBuf,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
    server_name: Option<String>,
) -> Result<std::sync::Arc<nbd::tls::TlsFiles>, ConfigError> {
    if client_cert.is_some() != client_key.is_some() {
        return Err(ConfigError::IncompleteTlsIdentity {
            profile: profile.map(str::to_owned),
        });
    }
    Ok(std::sync::Arc::new(nbd::tls::TlsFiles {
        ca,
        client_cert,
        client_key,
        server_name,
    }))
}

/// `host:port` to serve metrics on; empty means off.
pub fn metrics_address(raw: &str) -> Result<Option<std::net::SocketAddr>, ConfigError> {
    if raw.is_empty() {
        return Ok(None);
    }
    raw.parse()
        .map(Some)
        .map_err(|source| ConfigError::MetricsAddress {
            raw: raw.to_owned(),
            source,
        })
}

/// `unix:///path` (or a bare absolute path) to the socket path.
pub fn unix_path(endpoint: &str) -> Result<PathBuf, ConfigError> {
    let path = endpoint.strip_prefix("unix://").unwrap_or(endpoint);
    if !path.starts_with('/') {
        return Err(ConfigError::Endpoint {
            endpoint: endpoint.to_owned(),
        });
    }
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
        assert!(
            matches!(&err, ConfigError::IncompleteTlsIdentity { profile: Some(p) } if p == "x"),
            "{err:?}"
        );
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
        let err = FileConfig::load(Path::new("/nonexistent/node.toml"), true).unwrap_err();
        assert!(
            matches!(&err, ConfigError::Read { path, source }
                if path == Path::new("/nonexistent/node.toml")
                    && source.kind() == io::ErrorKind::NotFound),
            "{err:?}"
        );
    }

    /// Each refusal names the file, key or value at fault, in the words the daemon used before
    /// its errors were typed.
    #[test]
    fn refusals_name_what_is_at_fault() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("node.toml");
        std::fs::write(&bad, "csi_endpoint = \"x\"\n").unwrap();
        let err = FileConfig::load(&bad, true).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }), "{err:?}");
        assert!(
            err.to_string().starts_with(&format!("{}: ", bad.display())),
            "{err}"
        );
        assert!(err.to_string().contains("csi_endpoint"), "{err}");

        assert_eq!(
            unix_path("tcp://0.0.0.0:1").unwrap_err().to_string(),
            r#"CSI endpoint "tcp://0.0.0.0:1" must be unix:///absolute/path"#
        );
        let err = metrics_address("9809").unwrap_err();
        assert!(matches!(err, ConfigError::MetricsAddress { .. }), "{err:?}");
        assert!(
            err.to_string().starts_with(r#"metrics address "9809": "#)
                && err
                    .to_string()
                    .ends_with(" (expected ip:port, or empty to disable)"),
            "{err}"
        );
        assert_eq!(metrics_address("").unwrap(), None);

        let top = |text: &str| {
            let f: FileConfig = toml::from_str(text).unwrap();
            Settings::defaults("n".into()).apply_file(f).unwrap_err()
        };
        let err = top("tls-cert-file = \"/c\"\n");
        assert!(matches!(err, ConfigError::TlsClientWithoutCa), "{err:?}");
        assert_eq!(
            err.to_string(),
            "tls-cert-file and tls-key-file need tls-ca-file (the CA that signs the servers)"
        );
        let err = top("tls-ca-file = \"/ca\"\ntls-key-file = \"/k\"\n");
        assert_eq!(
            err.to_string(),
            "tls-cert-file, tls-key-file: a client certificate and its key are set together, or neither"
        );
    }
}
