//! NBD URIs, as the NBD project specifies them (`doc/uri.md`):
//! `nbd://host[:port][/export]`, `nbds://…` (TLS required) and `nbd+unix:///[export]?socket=/path`.
//!
//! Only what the kernel data path can carry is accepted: TLS over a unix socket (`nbds+unix`; the
//! kernel's TLS is TCP-only) and vsock are refused with an error that says why, instead of being
//! parsed and failing later at attach time.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, CONTROLS};

/// The IANA port for NBD.
pub const DEFAULT_PORT: u16 = 10809;

/// The protocol limits names to 4096 bytes; a longer one would be refused by every server.
const MAX_EXPORT_NAME: usize = 4096;

/// Why a string is not a usable NBD URI.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UriError {
    #[error("not a URI: {0}")]
    Syntax(String),
    #[error("scheme {0:?} is not an NBD scheme (use nbd://, nbds:// or nbd+unix://)")]
    UnknownScheme(String),
    #[error("scheme {0:?}: the kernel's TLS works on TCP only; serve the export with nbds://host or over a unix socket without TLS")]
    TlsOverUnix(String),
    #[error("scheme {0:?} (vsock) is not supported by this driver")]
    VsockUnsupported(String),
    #[error("nbd:// URI has no host")]
    MissingHost,
    #[error("nbd+unix:// URI must not name a host (got {0:?}); the socket goes in ?socket=")]
    HostOnUnix(String),
    #[error("nbd+unix:// URI needs a ?socket=/absolute/path parameter")]
    MissingSocket,
    #[error("socket path {0:?} must be absolute")]
    RelativeSocket(String),
    #[error("?socket= is only valid with nbd+unix://")]
    SocketOnTcp,
    #[error("query parameter {0:?} is not supported")]
    UnknownParameter(String),
    #[error("query parameter {0:?} is given more than once")]
    DuplicateParameter(String),
    #[error("user name or password in an NBD URI is not supported")]
    UserInfo,
    #[error("fragment (#...) is not allowed in an NBD URI")]
    Fragment,
    #[error("export name is not valid UTF-8 after percent-decoding")]
    ExportNotUtf8,
    #[error("export name is {0} bytes; the protocol allows at most 4096")]
    ExportTooLong(usize),
    #[error("port 0 is not a valid NBD port")]
    ZeroPort,
}

/// Where the export's server listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// Host name or IP literal (IPv6 without brackets) and port.
    Tcp { host: String, port: u16 },
    /// Absolute path of a unix stream socket.
    Unix { socket: PathBuf },
}

/// A parsed NBD URI: an endpoint and the export name to ask for there.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NbdUri {
    endpoint: Endpoint,
    export: String,
    /// `nbds`: STARTTLS is required, never a plaintext fallback.
    tls: bool,
}

impl NbdUri {
    pub fn tcp(host: impl Into<String>, port: u16, export: impl Into<String>) -> Self {
        Self {
            endpoint: Endpoint::Tcp {
                host: host.into(),
                port,
            },
            export: export.into(),
            tls: false,
        }
    }

    /// The same export, reached over TLS (`nbds://`). TCP only.
    pub fn with_tls(mut self) -> Self {
        self.tls = matches!(self.endpoint, Endpoint::Tcp { .. });
        self
    }

    /// Whether the export must be reached over TLS.
    pub fn tls(&self) -> bool {
        self.tls
    }

    pub fn unix(socket: impl Into<PathBuf>, export: impl Into<String>) -> Self {
        Self {
            endpoint: Endpoint::Unix {
                socket: socket.into(),
            },
            export: export.into(),
            tls: false,
        }
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The export name, percent-decoded; empty means the server's default export.
    pub fn export(&self) -> &str {
        &self.export
    }

    pub fn unix_socket(&self) -> Option<&Path> {
        match &self.endpoint {
            Endpoint::Unix { socket } => Some(socket),
            Endpoint::Tcp { .. } => None,
        }
    }
}

impl FromStr for NbdUri {
    type Err = UriError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let url = url::Url::parse(s).map_err(|e| UriError::Syntax(e.to_string()))?;
        let scheme = url.scheme();
        let (unix, tls) = match scheme {
            "nbd" => (false, false),
            "nbds" => (false, true),
            "nbd+unix" => (true, false),
            "nbds+unix" => return Err(UriError::TlsOverUnix(scheme.into())),
            "nbd+vsock" | "nbds+vsock" => return Err(UriError::VsockUnsupported(scheme.into())),
            other => return Err(UriError::UnknownScheme(other.into())),
        };
        if !url.username().is_empty() || url.password().is_some() {
            return Err(UriError::UserInfo);
        }
        if url.fragment().is_some() {
            return Err(UriError::Fragment);
        }

        let mut socket = None;
        for (key, value) in url.query_pairs() {
            match key.as_ref() {
                "socket" if socket.is_some() => {
                    return Err(UriError::DuplicateParameter(key.into_owned()))
                }
                "socket" => socket = Some(value.into_owned()),
                _ => return Err(UriError::UnknownParameter(key.into_owned())),
            }
        }

        let export = decode_export(url.path())?;
        let endpoint = if unix {
            if let Some(host) = url.host_str().filter(|h| !h.is_empty()) {
                return Err(UriError::HostOnUnix(host.into()));
            }
            let socket = socket.ok_or(UriError::MissingSocket)?;
            if !socket.starts_with('/') {
                return Err(UriError::RelativeSocket(socket));
            }
            Endpoint::Unix {
                socket: socket.into(),
            }
        } else {
            if socket.is_some() {
                return Err(UriError::SocketOnTcp);
            }
            let host = match url.host() {
                Some(url::Host::Domain(d)) if !d.is_empty() => d.to_owned(),
                Some(url::Host::Ipv4(ip)) => ip.to_string(),
                Some(url::Host::Ipv6(ip)) => ip.to_string(),
                _ => return Err(UriError::MissingHost),
            };
            let port = url.port().unwrap_or(DEFAULT_PORT);
            if port == 0 {
                return Err(UriError::ZeroPort);
            }
            Endpoint::Tcp { host, port }
        };
        Ok(Self {
            endpoint,
            export,
            tls,
        })
    }
}

/// The export name is the path without its leading slash, percent-decoded.
fn decode_export(path: &str) -> Result<String, UriError> {
    let raw = path.strip_prefix('/').unwrap_or(path);
    let export = percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| UriError::ExportNotUtf8)?
        .into_owned();
    if export.len() > MAX_EXPORT_NAME {
        return Err(UriError::ExportTooLong(export.len()));
    }
    Ok(export)
}

/// Characters escaped when an export name is written back into a URI path.
const EXPORT_ESCAPES: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'"')
    .add(b'#')
    .add(b'%')
    .add(b'<')
    .add(b'>')
    .add(b'?')
    .add(b'`')
    .add(b'{')
    .add(b'}');

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let export = utf8_percent_encode(&self.export, EXPORT_ESCAPES);
        let scheme = if self.tls { "nbds" } else { "nbd" };
        match &self.endpoint {
            Endpoint::Tcp { host, port } if host.contains(':') => {
                write!(f, "{scheme}://[{host}]:{port}/{export}")
            }
            Endpoint::Tcp { host, port } => write!(f, "{scheme}://{host}:{port}/{export}"),
            Endpoint::Unix { socket } => {
                let socket = utf8_percent_encode(&socket.to_string_lossy(), EXPORT_ESCAPES)
                    .to_string()
                    .replace('&', "%26");
                write!(f, "nbd+unix:///{export}?socket={socket}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<NbdUri, UriError> {
        s.parse()
    }

    #[test]
    fn tcp_with_port_and_export() {
        let uri = parse("nbd://storage-1.example:10900/pool%2Fimage-7").unwrap();
        assert_eq!(
            uri.endpoint(),
            &Endpoint::Tcp {
                host: "storage-1.example".into(),
                port: 10900
            }
        );
        assert_eq!(uri.export(), "pool/image-7");
    }

    #[test]
    fn tcp_defaults_port_and_empty_export() {
        let uri = parse("nbd://10.1.2.3").unwrap();
        assert_eq!(uri, NbdUri::tcp("10.1.2.3", DEFAULT_PORT, ""));
        let uri = parse("nbd://10.1.2.3/").unwrap();
        assert_eq!(uri.export(), "");
    }

    #[test]
    fn tcp_ipv6_literal() {
        let uri = parse("nbd://[::1]:4000/disk").unwrap();
        assert_eq!(uri, NbdUri::tcp("::1", 4000, "disk"));
        assert_eq!(uri.to_string(), "nbd://[::1]:4000/disk");
    }

    #[test]
    fn unix_socket() {
        let uri = parse("nbd+unix:///vol-1?socket=/run/nbd/vol%201.sock").unwrap();
        assert_eq!(uri.unix_socket(), Some(Path::new("/run/nbd/vol 1.sock")));
        assert_eq!(uri.export(), "vol-1");
        let uri = parse("nbd+unix://?socket=/run/s").unwrap();
        assert_eq!(uri.export(), "");
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "nbd://host:10809/a%20b",
            "nbd+unix:///exp?socket=/run/x%26y.sock",
            "nbd://[fe80::1]:10809/",
            "nbds://host:10809/secure",
        ] {
            let uri = parse(s).unwrap();
            assert_eq!(parse(&uri.to_string()).unwrap(), uri, "{s}");
        }
    }

    #[test]
    fn nbds_requires_tls_and_keeps_it() {
        let uri = parse("nbds://storage.example:10900/img").unwrap();
        assert!(uri.tls());
        assert_eq!(uri.to_string(), "nbds://storage.example:10900/img");
        assert!(!parse("nbd://storage.example/img").unwrap().tls());
        assert!(
            !NbdUri::unix("/s", "x").with_tls().tls(),
            "no TLS over unix sockets"
        );
    }

    #[test]
    fn refusals_name_the_problem() {
        let cases: &[(&str, UriError)] = &[
            ("http://host/x", UriError::UnknownScheme("http".into())),
            (
                "nbds+unix:///x?socket=/s",
                UriError::TlsOverUnix("nbds+unix".into()),
            ),
            (
                "nbd+vsock://2/x",
                UriError::VsockUnsupported("nbd+vsock".into()),
            ),
            ("nbd:///x", UriError::MissingHost),
            ("nbd+unix:///x", UriError::MissingSocket),
            (
                "nbd+unix:///x?socket=run/s",
                UriError::RelativeSocket("run/s".into()),
            ),
            (
                "nbd+unix://host/x?socket=/s",
                UriError::HostOnUnix("host".into()),
            ),
            ("nbd://host/x?socket=/s", UriError::SocketOnTcp),
            (
                "nbd://host/x?tls-certificates=/etc",
                UriError::UnknownParameter("tls-certificates".into()),
            ),
            (
                "nbd+unix:///x?socket=/a&socket=/b",
                UriError::DuplicateParameter("socket".into()),
            ),
            ("nbd://user:pw@host/x", UriError::UserInfo),
            ("nbd://host/x#frag", UriError::Fragment),
            ("nbd://host/%ff", UriError::ExportNotUtf8),
            ("nbd://host:0/x", UriError::ZeroPort),
        ];
        for (input, want) in cases {
            assert_eq!(parse(input).as_ref(), Err(want), "{input}");
        }
        assert!(matches!(parse("not a uri"), Err(UriError::Syntax(_))));
        assert!(matches!(
            parse("nbd://host:99999/x"),
            Err(UriError::Syntax(_))
        ));
        let long = format!("nbd://host/{}", "a".repeat(4097));
        assert_eq!(parse(&long), Err(UriError::ExportTooLong(4097)));
    }
}
