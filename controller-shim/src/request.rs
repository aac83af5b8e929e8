//! What a request may ask for, checked before anything is looked up: required fields,
//! capacity ranges, StorageClass parameters, volume capabilities, list paging.

use std::collections::{BTreeMap, HashMap};

use csi_common::capability::{self, Shape};
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::{CapacityRange, VolumeCapability};

/// Size of a volume whose claim names none.
pub const DEFAULT_SIZE: u64 = 1 << 30;

/// Parameters a StorageClass may set. Kubernetes' own (`csi.storage.k8s.io/…`) pass too.
/// `connection` names the MindUstorStorageConnection (StorageClasses the glue makes carry it).
pub const PARAMETERS: &[&str] = &["pool", "nbdConnections", "connection"];

/// Parameters a VolumeAttributesClass may set, which ControllerModifyVolume changes later.
pub const MUTABLE_PARAMETERS: &[&str] = &["nbdConnections"];

/// Why a request is refused as it stands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("{field} is required")]
    Missing { field: &'static str },
    #[error("capacity_range must not be negative")]
    NegativeCapacity,
    #[error("required_bytes {required} exceeds limit_bytes {limit}")]
    RequiredOverLimit { required: u64, limit: u64 },
    /// A clone or restore is at least its source's size; a volume never shrinks.
    #[error(
        "the volume cannot be smaller than {minimum} bytes (its source's or its current size, or \
         the 300 MiB mkfs.xfs needs), but limit_bytes is {limit}"
    )]
    MinimumOverLimit { minimum: u64, limit: u64 },
    #[error(
        "{wanted} bytes rounded to the backend's {granularity} byte granularity is {size}, over limit_bytes {limit}"
    )]
    RoundedOverLimit {
        wanted: u64,
        granularity: u64,
        size: u64,
        limit: u64,
    },
    #[error("unknown parameter {name:?} (supported: {})", PARAMETERS.join(", "))]
    UnknownParameter { name: String },
    #[error("nbdConnections {value:?} must be a number from 1 to 16")]
    BadConnectionCount { value: String },
    #[error(
        "mutable parameter {name:?} is not supported (a VolumeAttributesClass may set: {})",
        MUTABLE_PARAMETERS.join(", ")
    )]
    UnknownMutableParameter { name: String },
    #[error("snapshot parameters are not supported (got {keys:?})")]
    SnapshotParameters { keys: Vec<String> },
    #[error("source_volume_ids names {volume_id} more than once")]
    DuplicateSource { volume_id: String },
    /// The driver's capability rules (shared with the node) refuse it; their words.
    #[error("{0}")]
    Capability(String),
    #[error("fsType {fs_type:?} is not supported (ext4, xfs)")]
    Filesystem { fs_type: String },
    #[error("max_entries must not be negative")]
    NegativeMaxEntries,
    #[error("starting_token {token:?} is not valid")]
    BadStartingToken { token: String },
}

/// `Missing { field }` unless `present`.
pub fn require(present: bool, field: &'static str) -> Result<(), RequestError> {
    if present {
        Ok(())
    } else {
        Err(RequestError::Missing { field })
    }
}

/// The size to provision for a capacity range: at least `minimum` (a clone's or restore's
/// source), rounded up to `granularity`.
pub fn size_for(
    range: Option<&CapacityRange>,
    minimum: u64,
    granularity: u64,
) -> Result<u64, RequestError> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    let (Ok(required), Ok(limit)) = (u64::try_from(required), u64::try_from(limit)) else {
        return Err(RequestError::NegativeCapacity);
    };
    if limit > 0 && required > limit {
        return Err(RequestError::RequiredOverLimit { required, limit });
    }
    if limit > 0 && minimum > limit {
        return Err(RequestError::MinimumOverLimit { minimum, limit });
    }
    let wanted = if required == 0 {
        DEFAULT_SIZE.max(minimum)
    } else {
        required.max(minimum)
    };
    let wanted = if limit > 0 && required == 0 {
        wanted.min(limit).max(minimum)
    } else {
        wanted
    };
    let size = wanted.div_ceil(granularity) * granularity;
    if limit > 0 && size > limit {
        return Err(RequestError::RoundedOverLimit {
            wanted,
            granularity,
            size,
            limit,
        });
    }
    Ok(size)
}

/// Whether an existing volume of `size` satisfies a repeated request's range.
pub fn fits(size: u64, range: Option<&CapacityRange>) -> bool {
    let Some(r) = range else { return true };
    (r.required_bytes <= 0 || size >= r.required_bytes.unsigned_abs())
        && (r.limit_bytes <= 0 || size <= r.limit_bytes.unsigned_abs())
}

/// The StorageClass parameters the driver keeps, checked; Kubernetes' own are dropped.
pub fn parameters(raw: &HashMap<String, String>) -> Result<BTreeMap<String, String>, RequestError> {
    let mut out = BTreeMap::new();
    for (k, v) in raw {
        if k.starts_with("csi.storage.k8s.io/") {
            continue;
        }
        if !PARAMETERS.contains(&k.as_str()) {
            return Err(RequestError::UnknownParameter { name: k.clone() });
        }
        check_value(k, v)?;
        out.insert(k.clone(), v.clone());
    }
    Ok(out)
}

/// A value of a parameter that has rules of its own.
fn check_value(key: &str, value: &str) -> Result<(), RequestError> {
    if key == "nbdConnections" && !value.parse::<u8>().is_ok_and(|n| (1..=16).contains(&n)) {
        return Err(RequestError::BadConnectionCount {
            value: value.to_owned(),
        });
    }
    Ok(())
}

/// The mutable parameters (a VolumeAttributesClass's), checked: only the ones the driver can
/// change on a live volume.
pub fn mutable_parameters(
    raw: &HashMap<String, String>,
) -> Result<BTreeMap<String, String>, RequestError> {
    let mut out = BTreeMap::new();
    for (k, v) in raw {
        if !MUTABLE_PARAMETERS.contains(&k.as_str()) {
            return Err(RequestError::UnknownMutableParameter { name: k.clone() });
        }
        check_value(k, v)?;
        out.insert(k.clone(), v.clone());
    }
    Ok(out)
}

/// Snapshots take no parameters.
pub fn no_snapshot_parameters(raw: &HashMap<String, String>) -> Result<(), RequestError> {
    if raw.is_empty() {
        return Ok(());
    }
    let mut keys: Vec<String> = raw.keys().cloned().collect();
    keys.sort();
    Err(RequestError::SnapshotParameters { keys })
}

/// The driver's capability rules (shared with the node), plus the filesystems the node can
/// format. Returns the access mode.
pub fn check_capability(cap: &VolumeCapability) -> Result<Mode, RequestError> {
    let (mode, shape) = capability::check(cap).map_err(RequestError::Capability)?;
    if let Shape::Mount(m) = shape {
        if !matches!(m.fs_type.as_str(), "" | "ext4" | "xfs") {
            return Err(RequestError::Filesystem {
                fs_type: m.fs_type.clone(),
            });
        }
    }
    Ok(mode)
}

/// The smallest filesystem mkfs.xfs makes (xfsprogs 5.19 and later; Debian 12 ships 6.1,
/// Ubuntu 24.04 6.6): it refuses a smaller device ("Filesystem must be larger than 300MB").
pub const XFS_MIN_BYTES: u64 = 300 << 20;

/// The least size a volume with these capabilities needs for the node to format it: an xfs
/// volume below [`XFS_MIN_BYTES`] could be created but never staged.
pub fn filesystem_minimum(caps: &[VolumeCapability]) -> u64 {
    let xfs = caps.iter().any(
        |cap| matches!(capability::check(cap), Ok((_, Shape::Mount(m))) if m.fs_type == "xfs"),
    );
    if xfs {
        XFS_MIN_BYTES
    } else {
        0
    }
}

/// Every capability of a request that needs at least one.
pub fn check_capabilities(caps: &[VolumeCapability]) -> Result<(), RequestError> {
    require(!caps.is_empty(), "volume_capabilities")?;
    caps.iter()
        .try_for_each(|cap| check_capability(cap).map(drop))
}

/// A page of a list: where it starts and how many entries it holds at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page {
    pub start: usize,
    pub take: usize,
}

/// `max_entries` and `starting_token` of a list of `total` entries (the token is the index
/// of the next entry, as this controller issues it).
pub fn page(max_entries: i32, starting_token: &str, total: usize) -> Result<Page, RequestError> {
    let Ok(max) = usize::try_from(max_entries) else {
        return Err(RequestError::NegativeMaxEntries);
    };
    let start = if starting_token.is_empty() {
        0
    } else {
        starting_token
            .parse::<usize>()
            .ok()
            .filter(|s| *s <= total)
            .ok_or_else(|| RequestError::BadStartingToken {
                token: starting_token.to_owned(),
            })?
    };
    let take = if max == 0 { usize::MAX } else { max };
    Ok(Page { start, take })
}

impl Page {
    /// The token of the page after this one, which answered `answered` of `total` entries
    /// (empty after the last page).
    pub fn next_token(&self, answered: usize, total: usize) -> String {
        let next = self.start + answered;
        if next < total {
            next.to_string()
        } else {
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn range(required: i64, limit: i64) -> Option<CapacityRange> {
        Some(CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        })
    }

    #[test]
    fn sizes_are_rounded_defaulted_and_kept_within_the_limit() {
        assert_eq!(size_for(None, 0, MIB), Ok(DEFAULT_SIZE));
        assert_eq!(size_for(range(1, 0).as_ref(), 0, MIB), Ok(MIB));
        assert_eq!(
            size_for(range(0, 3 * MIB as i64).as_ref(), 0, MIB),
            Ok(3 * MIB)
        );
        assert_eq!(
            size_for(range(MIB as i64, 0).as_ref(), 5 * MIB, MIB),
            Ok(5 * MIB)
        );
        assert_eq!(
            size_for(range(-1, 0).as_ref(), 0, MIB),
            Err(RequestError::NegativeCapacity)
        );
        assert_eq!(
            size_for(range(2, 1).as_ref(), 0, MIB),
            Err(RequestError::RequiredOverLimit {
                required: 2,
                limit: 1
            })
        );
        assert_eq!(
            size_for(range(0, MIB as i64).as_ref(), 2 * MIB, MIB),
            Err(RequestError::MinimumOverLimit {
                minimum: 2 * MIB,
                limit: MIB
            })
        );
        assert!(matches!(
            size_for(range(1, MIB as i64 - 1).as_ref(), 0, MIB),
            Err(RequestError::RoundedOverLimit { size, .. }) if size == MIB
        ));
        assert!(fits(MIB, range(MIB as i64, 0).as_ref()));
        assert!(!fits(MIB, range(2 * MIB as i64, 0).as_ref()));
    }

    /// xfs volumes are at least what mkfs.xfs formats; ext4, the default and block have no
    /// floor of their own.
    #[test]
    fn xfs_volumes_have_mkfs_xfs_floor() {
        use csi_proto::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
        let cap = |access: AccessType| VolumeCapability {
            access_type: Some(access),
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter.into(),
            }),
        };
        let mount = |fs: &str| {
            cap(AccessType::Mount(MountVolume {
                fs_type: fs.into(),
                ..Default::default()
            }))
        };
        assert_eq!(filesystem_minimum(&[mount("xfs")]), XFS_MIN_BYTES);
        assert_eq!(filesystem_minimum(&[mount("ext4")]), 0);
        assert_eq!(filesystem_minimum(&[mount("")]), 0);
        let block = VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeSingleWriter.into(),
            }),
            ..cap(AccessType::Block(BlockVolume {}))
        };
        assert_eq!(filesystem_minimum(&[block]), 0);
        // A 64 MiB claim of xfs gets 300 MiB; with a limit below that, a clear refusal.
        assert_eq!(
            size_for(range(64 * MIB as i64, 0).as_ref(), XFS_MIN_BYTES, MIB),
            Ok(XFS_MIN_BYTES)
        );
        assert_eq!(
            size_for(
                range(64 * MIB as i64, 128 * MIB as i64).as_ref(),
                XFS_MIN_BYTES,
                MIB
            ),
            Err(RequestError::MinimumOverLimit {
                minimum: XFS_MIN_BYTES,
                limit: 128 * MIB
            })
        );
    }

    #[test]
    fn parameters_are_the_known_ones_and_kubernetes_own() {
        let raw = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let kept = parameters(&raw(&[
            ("pool", "data"),
            ("csi.storage.k8s.io/pvc/name", "x"),
        ]))
        .unwrap();
        assert_eq!(kept.keys().collect::<Vec<_>>(), ["pool"]);
        assert_eq!(
            parameters(&raw(&[("pol", "data")])),
            Err(RequestError::UnknownParameter { name: "pol".into() })
        );
        assert_eq!(
            parameters(&raw(&[("nbdConnections", "17")])),
            Err(RequestError::BadConnectionCount { value: "17".into() })
        );
        assert_eq!(
            mutable_parameters(&raw(&[("nbdConnections", "4")])).map(|m| m.len()),
            Ok(1)
        );
        assert_eq!(
            mutable_parameters(&raw(&[("pool", "data")])),
            Err(RequestError::UnknownMutableParameter {
                name: "pool".into()
            }),
            "the pool of a live volume cannot change"
        );
        assert_eq!(
            mutable_parameters(&raw(&[("nbdConnections", "0")])),
            Err(RequestError::BadConnectionCount { value: "0".into() })
        );
        assert_eq!(
            no_snapshot_parameters(&raw(&[("b", ""), ("a", "")])),
            Err(RequestError::SnapshotParameters {
                keys: vec!["a".into(), "b".into()]
            })
        );
    }

    #[test]
    fn pages_start_at_issued_tokens_only() {
        assert_eq!(
            page(0, "", 3),
            Ok(Page {
                start: 0,
                take: usize::MAX
            })
        );
        assert_eq!(page(2, "1", 3), Ok(Page { start: 1, take: 2 }));
        assert_eq!(page(-1, "", 3), Err(RequestError::NegativeMaxEntries));
        for bad in ["4", "x", "-1"] {
            assert_eq!(
                page(1, bad, 3),
                Err(RequestError::BadStartingToken { token: bad.into() })
            );
        }
    }
}
