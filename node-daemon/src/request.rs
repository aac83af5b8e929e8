//! Validation at the gRPC edge: CSI requests become typed values, or an INVALID_ARGUMENT that
//! names the field and what is wrong with it. Nothing past this module sees raw strings.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use csi_common::capability::Shape;
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::VolumeCapability;
use mounts::{Filesystem, MountOptions};
use nbd::NbdUri;

use crate::record::{Access, AccessMode, Export};

/// A request the node refuses before doing anything: the field and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{field} is required")]
    Missing { field: &'static str },
    #[error("volume_id is {len} bytes; at most {max} are allowed")]
    VolumeIdTooLong { len: usize, max: usize },
    #[error("volume_id contains control characters")]
    VolumeIdControl,
    /// The shared capability rules (`csi_common::capability`) refused it.
    #[error("{0}")]
    Capability(String),
    #[error("volume_mount_group is not supported by this driver")]
    MountGroup,
    #[error("fsType: {0}")]
    FsType(#[source] mounts::Error),
    #[error("mount flags: {0}")]
    MountFlags(#[source] mounts::Error),
    #[error("{field} is not a usable path")]
    UnusablePath { field: &'static str },
    #[error("{field} {raw:?} must be an absolute path")]
    RelativePath { field: &'static str, raw: String },
    #[error("{field} {raw:?} must not contain . or .. components")]
    DotComponents { field: &'static str, raw: String },
    #[error(
        "unknown key {key:?} in {context} (this driver reads {KEY_NBD_URI}, {KEY_NBD_CONNECTIONS}, {KEY_TLS_PROFILE} and {KEY_NBD_GRANT})"
    )]
    UnknownContextKey { key: String, context: &'static str },
    #[error("no {KEY_NBD_URI} in the publish or volume context")]
    NoExport,
    #[error("{KEY_NBD_URI} {raw:?}: {source}")]
    BadUri {
        raw: String,
        source: nbd::uri::UriError,
    },
    #[error("{KEY_NBD_CONNECTIONS} {raw:?} must be a number from 1 to 16")]
    BadConnections { raw: String },
    #[error(
        "{KEY_TLS_PROFILE} {profile:?} is set for the plaintext export {uri}: TLS profiles are for nbds:// exports"
    )]
    TlsProfileOnPlaintext { profile: String, uri: String },
    #[error("{KEY_TLS_PROFILE} {profile:?} is not a profile name")]
    BadTlsProfile { profile: String },
    /// The token is not shown: it is a credential.
    #[error("{KEY_NBD_GRANT} in the publish context: {0}")]
    BadGrant(#[source] nbd::grant::BadGrant),
    #[error("{KEY_NBD_GRANT} is in the volume context: a grant comes from ControllerPublishVolume, in the publish context")]
    GrantInVolumeContext,
    #[error("capacity_range.required_bytes must not be negative")]
    NegativeCapacity,
}

/// Context keys this driver reads.
pub const KEY_NBD_URI: &str = "nbdUri";
pub const KEY_NBD_CONNECTIONS: &str = "nbdConnections";
pub const KEY_TLS_PROFILE: &str = "tlsProfile";
/// The node's fencing grant; only ControllerPublishVolume makes one, so only the publish
/// context carries it.
pub const KEY_NBD_GRANT: &str = "nbdGrant";

/// Key prefixes others put in the volume context, which are accepted and ignored: Kubernetes'
/// own (`csi.storage.k8s.io/…`, `storage.kubernetes.io/…`) and the controller's.
const FOREIGN_PREFIXES: &[&str] = &[
    "csi.storage.k8s.io/",
    "storage.kubernetes.io/",
    "ustor.mindsw.io/",
];

/// A volume capability the node can serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capability {
    pub access: Access,
    pub mode: AccessMode,
}

impl Capability {
    pub fn filesystem(&self) -> Option<Filesystem> {
        match &self.access {
            Access::Mount { fs, .. } => fs.parse().ok(),
            Access::Block => None,
        }
    }
}

pub fn capability(cap: Option<&VolumeCapability>) -> Result<Capability, RequestError> {
    let cap = cap.ok_or(RequestError::Missing {
        field: "volume_capability",
    })?;
    let (mode, shape) = csi_common::capability::check(cap).map_err(RequestError::Capability)?;
    let mode = match mode {
        Mode::SingleNodeWriter => AccessMode::SingleNodeWriter,
        Mode::SingleNodeReaderOnly => AccessMode::SingleNodeReaderOnly,
        Mode::SingleNodeSingleWriter => AccessMode::SingleNodeSingleWriter,
        Mode::SingleNodeMultiWriter => AccessMode::SingleNodeMultiWriter,
        Mode::MultiNodeReaderOnly => AccessMode::MultiNodeReaderOnly,
        Mode::MultiNodeSingleWriter => AccessMode::MultiNodeSingleWriter,
        // `check` refuses Unknown.
        Mode::MultiNodeMultiWriter | Mode::Unknown => AccessMode::MultiNodeMultiWriter,
    };
    let access = match shape {
        Shape::Block => Access::Block,
        Shape::Mount(m) => {
            if !m.volume_mount_group.is_empty() {
                return Err(RequestError::MountGroup);
            }
            let fs = if m.fs_type.is_empty() {
                "ext4"
            } else {
                m.fs_type.as_str()
            };
            let fs: Filesystem = fs.parse().map_err(RequestError::FsType)?;
            MountOptions::parse(&m.mount_flags).map_err(RequestError::MountFlags)?;
            Access::Mount {
                fs: fs.name().to_owned(),
                flags: m.mount_flags.clone(),
            }
        }
    };
    Ok(Capability { access, mode })
}

/// A path field is given, and is one the kernel can take (no NUL, at most `PATH_MAX`).
fn usable_path(field: &'static str, raw: &str) -> Result<(), RequestError> {
    if raw.is_empty() {
        return Err(RequestError::Missing { field });
    }
    if raw.contains('\0') || raw.len() > 4096 {
        return Err(RequestError::UnusablePath { field });
    }
    Ok(())
}

/// An absolute path without `.` or `..` components (which could step out of kubelet's tree).
pub fn abs_path(field: &'static str, raw: &str) -> Result<PathBuf, RequestError> {
    usable_path(field, raw)?;
    let path = Path::new(raw);
    if !path.is_absolute() {
        return Err(RequestError::RelativePath {
            field,
            raw: raw.to_owned(),
        });
    }
    // Checked on the raw text: `Path::components` silently drops interior `.` segments.
    if raw
        .split('/')
        .any(|segment| segment == "." || segment == "..")
    {
        return Err(RequestError::DotComponents {
            field,
            raw: raw.to_owned(),
        });
    }
    Ok(path.components().collect())
}

/// A path that only names which of a volume's paths a call means (NodeGetVolumeStats,
/// NodeExpandVolume): it must be given, but is never acted on, so a relative or unknown one is
/// simply not the volume's path (NOT_FOUND, as the spec has it), not a malformed request.
pub fn lookup_path(field: &'static str, raw: &str) -> Result<PathBuf, RequestError> {
    usable_path(field, raw)?;
    let path = PathBuf::from(raw);
    Ok(if path.is_absolute() {
        resolved(path)
    } else {
        path
    })
}

/// `path` with its directory resolved through symlinks (the last component is kept, since
/// the plugin may be about to create it). kubelet's directory may be a symlink (a
/// `/var/lib/kubelet` moved to a data disk) while the mount table shows resolved paths:
/// comparing unresolved paths would stack mounts and take our own mounts for foreign ones.
/// A directory that does not exist yet is left as given.
pub fn resolved(path: PathBuf) -> PathBuf {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return path;
    };
    match std::fs::canonicalize(parent) {
        Ok(real) => real.join(name),
        Err(_) => path,
    }
}

/// The export to attach: `nbdUri` from the publish context, else the volume context.
pub fn export(
    publish_context: &HashMap<String, String>,
    volume_context: &HashMap<String, String>,
) -> Result<Export, RequestError> {
    for (name, ctx) in [
        ("publish_context", publish_context),
        ("volume_context", volume_context),
    ] {
        for key in ctx.keys() {
            let known = [
                KEY_NBD_URI,
                KEY_NBD_CONNECTIONS,
                KEY_TLS_PROFILE,
                KEY_NBD_GRANT,
            ]
            .contains(&key.as_str());
            if !known && !FOREIGN_PREFIXES.iter().any(|p| key.starts_with(p)) {
                return Err(RequestError::UnknownContextKey {
                    key: key.clone(),
                    context: name,
                });
            }
        }
    }
    let lookup = |key: &str| publish_context.get(key).or_else(|| volume_context.get(key));
    let raw = lookup(KEY_NBD_URI).ok_or(RequestError::NoExport)?;
    let uri: NbdUri = raw.parse().map_err(|source| RequestError::BadUri {
        raw: raw.clone(),
        source,
    })?;
    let connections = match lookup(KEY_NBD_CONNECTIONS) {
        None => 1,
        Some(n) => n
            .parse::<u8>()
            .ok()
            .filter(|n| (1..=nbd::dial::MAX_CONNECTIONS).contains(n))
            .ok_or_else(|| RequestError::BadConnections { raw: n.clone() })?,
    };
    let tls_profile = match lookup(KEY_TLS_PROFILE) {
        None => None,
        Some(p) if !uri.tls() => {
            return Err(RequestError::TlsProfileOnPlaintext {
                profile: p.clone(),
                uri: uri.to_string(),
            })
        }
        Some(p) if p.is_empty() || p.len() > 253 || p.chars().any(|c| c.is_control()) => {
            return Err(RequestError::BadTlsProfile { profile: p.clone() })
        }
        Some(p) => Some(p.clone()),
    };
    if volume_context.contains_key(KEY_NBD_GRANT) {
        return Err(RequestError::GrantInVolumeContext);
    }
    let grant = publish_context
        .get(KEY_NBD_GRANT)
        .map(|t| nbd::Grant::new(t.as_str()))
        .transpose()
        .map_err(RequestError::BadGrant)?;
    Ok(Export {
        uri: uri.to_string(),
        connections,
        tls_profile,
        stage_tls: None,
        grant,
    })
}

/// Whether the request carries an export at all (publish may omit it).
pub fn has_export(
    publish_context: &HashMap<String, String>,
    volume_context: &HashMap<String, String>,
) -> bool {
    publish_context.contains_key(KEY_NBD_URI) || volume_context.contains_key(KEY_NBD_URI)
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi_proto::csi::volume_capability::{
        AccessMode as PbMode, AccessType, BlockVolume, MountVolume,
    };

    fn cap(access: Option<AccessType>, mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_type: access,
            access_mode: Some(PbMode { mode: mode as i32 }),
        }
    }

    fn mount(fs: &str, flags: &[&str]) -> Option<AccessType> {
        Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: flags.iter().map(|s| s.to_string()).collect(),
            volume_mount_group: String::new(),
        }))
    }

    fn block() -> Option<AccessType> {
        Some(AccessType::Block(BlockVolume {}))
    }

    #[test]
    fn capabilities_accepted() {
        let c = capability(Some(&cap(mount("", &["noatime"]), Mode::SingleNodeWriter))).unwrap();
        assert_eq!(
            c.access,
            Access::Mount {
                fs: "ext4".into(),
                flags: vec!["noatime".into()]
            }
        );
        assert_eq!(c.filesystem(), Some(Filesystem::Ext4));
        let c = capability(Some(&cap(block(), Mode::MultiNodeMultiWriter))).unwrap();
        assert_eq!(
            (c.access, c.mode),
            (Access::Block, AccessMode::MultiNodeMultiWriter)
        );
        assert!(capability(Some(&cap(mount("xfs", &[]), Mode::SingleNodeSingleWriter))).is_ok());
        assert!(capability(Some(&cap(block(), Mode::SingleNodeSingleWriter))).is_ok());
    }

    #[test]
    fn capabilities_refused_with_reasons() {
        let refused = [
            (None, "volume_capability is required"),
            (
                Some(cap(mount("ext4", &[]), Mode::MultiNodeMultiWriter)),
                "volumeMode: Block",
            ),
            (
                Some(cap(mount("ext4", &[]), Mode::MultiNodeReaderOnly)),
                "volumeMode: Block",
            ),
            (
                Some(cap(mount("btrfs", &[]), Mode::SingleNodeWriter)),
                "unsupported filesystem type",
            ),
            (
                Some(cap(mount("ext4", &["bind"]), Mode::SingleNodeWriter)),
                "mount flags",
            ),
            (
                Some(cap(block(), Mode::MultiNodeSingleWriter)),
                "MULTI_NODE_SINGLE_WRITER",
            ),
            (Some(cap(block(), Mode::Unknown)), "access_mode is required"),
            (
                Some(cap(block(), Mode::SingleNodeWriter)),
                "use ReadWriteOncePod",
            ),
            (
                Some(cap(block(), Mode::MultiNodeReaderOnly)),
                "use ReadWriteOncePod",
            ),
            (Some(cap(None, Mode::SingleNodeWriter)), "access_type"),
        ];
        for (c, want) in refused {
            let err = capability(c.as_ref()).unwrap_err();
            assert!(err.to_string().contains(want), "{err} !~ {want}");
        }
    }

    #[test]
    fn paths_are_resolved_through_symlinked_directories() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real-kubelet");
        std::fs::create_dir_all(real.join("pods")).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("kubelet")).unwrap();
        let real = std::fs::canonicalize(&real).unwrap();
        assert_eq!(
            resolved(dir.path().join("kubelet/pods/target")),
            real.join("pods/target")
        );
        // A symlink as the last component is kept: it is not followed into somewhere else.
        assert_eq!(
            resolved(dir.path().join("kubelet")).file_name().unwrap(),
            "kubelet"
        );
        let missing = dir.path().join("nowhere/x");
        assert_eq!(resolved(missing.clone()), missing);
    }

    #[test]
    fn paths() {
        assert_eq!(
            abs_path("p", "/var/lib/x/").unwrap(),
            PathBuf::from("/var/lib/x")
        );
        for bad in ["", "relative/x", "/a/../b", "/a/./b", "/a\0b"] {
            assert!(abs_path("staging_target_path", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_lookup_path_must_be_given_but_may_be_relative() {
        assert!(matches!(
            lookup_path("volume_path", ""),
            Err(RequestError::Missing {
                field: "volume_path"
            })
        ));
        assert!(matches!(
            lookup_path("volume_path", "/a\0b"),
            Err(RequestError::UnusablePath { .. })
        ));
        // Not a path of any volume (they are absolute), so the lookup finds nothing: NOT_FOUND.
        assert_eq!(
            lookup_path("volume_path", "some/path").unwrap(),
            PathBuf::from("some/path")
        );
    }

    fn ctx(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_tls_profile_is_for_nbds_exports_only() {
        let e = export(
            &ctx(&[]),
            &ctx(&[("nbdUri", "nbds://h/x"), ("tlsProfile", "lab")]),
        )
        .unwrap();
        assert_eq!(e.tls_profile.as_deref(), Some("lab"));
        for bad in [
            ctx(&[("nbdUri", "nbd://h/x"), ("tlsProfile", "lab")]),
            ctx(&[("nbdUri", "nbds://h/x"), ("tlsProfile", "")]),
        ] {
            assert!(export(&ctx(&[]), &bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_grant_comes_from_the_publish_context_only() {
        let e = export(
            &ctx(&[("nbdGrant", "0f3a9c")]),
            &ctx(&[("nbdUri", "nbd://h/x")]),
        )
        .unwrap();
        assert_eq!(e.grant.as_ref().map(|g| g.token()), Some("0f3a9c"));
        let e = export(&ctx(&[]), &ctx(&[("nbdUri", "nbd://h/x")])).unwrap();
        assert!(e.grant.is_none());
        let misplaced = export(
            &ctx(&[]),
            &ctx(&[("nbdUri", "nbd://h/x"), ("nbdGrant", "0f3a9c")]),
        )
        .unwrap_err();
        assert!(matches!(misplaced, RequestError::GrantInVolumeContext));
        // A token that could split the export name is refused, and not echoed back.
        let bad = export(
            &ctx(&[("nbdUri", "nbd://h/x"), ("nbdGrant", "s3cret@x")]),
            &ctx(&[]),
        )
        .unwrap_err();
        assert!(matches!(bad, RequestError::BadGrant(_)), "{bad:?}");
        assert!(!bad.to_string().contains("s3cret"), "{bad}");
    }

    #[test]
    fn export_from_contexts() {
        let e = export(
            &ctx(&[("nbdUri", "nbd://a/x")]),
            &ctx(&[("nbdUri", "nbd://b/y"), ("nbdConnections", "4")]),
        )
        .unwrap();
        assert_eq!(e.uri, "nbd://a:10809/x", "publish context wins");
        assert_eq!(e.connections, 4);
        let e = export(
            &ctx(&[]),
            &ctx(&[
                ("nbdUri", "nbd+unix:///v?socket=/s"),
                ("csi.storage.k8s.io/pv/name", "pv"),
            ]),
        )
        .unwrap();
        assert_eq!(e.connections, 1);
    }

    #[test]
    fn export_refusals() {
        let refused = [
            (ctx(&[]), ctx(&[]), "no nbdUri"),
            (
                ctx(&[]),
                ctx(&[("nbdUri", "http://x")]),
                "not an NBD scheme",
            ),
            (
                ctx(&[]),
                ctx(&[("nbdUri", "nbd://x/"), ("nbdConnections", "0")]),
                "from 1 to 16",
            ),
            (
                ctx(&[]),
                ctx(&[("nbdUri", "nbd://x/"), ("nbdConnections", "17")]),
                "from 1 to 16",
            ),
            (
                ctx(&[("nbdURI", "nbd://x/")]),
                ctx(&[]),
                "unknown key \"nbdURI\" in publish_context",
            ),
        ];
        for (p, v, want) in refused {
            let err = export(&p, &v).unwrap_err();
            assert!(err.to_string().contains(want), "{err} !~ {want}");
        }
    }
}
