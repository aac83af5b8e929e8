//! Volume, snapshot and group snapshot ids: `<backend>:volume:<image>`,
//! `<backend>:snapshot:<image>` and `<backend>:group:<image>`.
//! Opaque to the CO, stable, and validated when they come back: a snapshot id used as a
//! volume id, or an id of another backend, is refused with a message that says so.
//!
//! Image names carry the configured cluster id as a prefix, so one storage system can serve
//! several Kubernetes clusters without their images colliding.

use std::fmt;

/// Why an id, a name or a name segment is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{field} is required")]
    Missing { field: &'static str },
    /// Not of the `<backend>:<kind>:<image>` shape: another driver's, or made up.
    #[error("{field} {raw:?} is not an id this driver issued")]
    NotIssued { field: &'static str, raw: String },
    #[error("{field} {raw:?} names a {found}, not a {}", wanted.as_str())]
    OtherKind {
        field: &'static str,
        raw: String,
        found: String,
        wanted: Kind,
    },
    #[error("{field} {raw:?} belongs to backend {found:?}; this controller serves {serves:?}")]
    OtherBackend {
        field: &'static str,
        raw: String,
        found: String,
        serves: String,
    },
    #[error("{field} {raw:?}: image name {image:?} is not one this driver issued")]
    ForeignImage {
        field: &'static str,
        raw: String,
        image: String,
    },
    #[error("name {name:?} is too long or has control characters")]
    BadName { name: String },
    #[error("image name {image:?} is not valid")]
    BadImage { image: String },
    /// A pool or connection name that an image key cannot carry.
    #[error("{what} {value:?} must be 1-{max} characters of a-z, 0-9, - and .{why}")]
    BadSegment {
        what: &'static str,
        value: String,
        max: usize,
        why: &'static str,
    },
}

impl IdError {
    /// An id this driver did not issue (another driver's, malformed, of another backend):
    /// for the CSI spec the object it names does not exist.
    pub fn is_unknown_id(&self) -> bool {
        matches!(
            self,
            IdError::NotIssued { .. }
                | IdError::OtherKind { .. }
                | IdError::OtherBackend { .. }
                | IdError::ForeignImage { .. }
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Volume,
    Snapshot,
    /// A group snapshot: the record of snapshots taken together.
    Group,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Volume => "volume",
            Kind::Snapshot => "snapshot",
            Kind::Group => "group",
        }
    }
}

/// A validated id of this controller's backend.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Handle {
    pub backend: String,
    pub kind: Kind,
    pub image: String,
}

impl Handle {
    pub fn new(backend: &str, kind: Kind, image: String) -> Self {
        Self {
            backend: backend.to_owned(),
            kind,
            image,
        }
    }

    /// Parses an id the CO sends back, expecting `kind` from `backend`.
    pub fn parse(raw: &str, backend: &str, kind: Kind) -> Result<Self, IdError> {
        let field = match kind {
            Kind::Volume => "volume_id",
            Kind::Snapshot => "snapshot_id",
            Kind::Group => "group_snapshot_id",
        };
        if raw.is_empty() {
            return Err(IdError::Missing { field });
        }
        let mut parts = raw.splitn(3, ':');
        let (b, k, image) = (parts.next(), parts.next(), parts.next());
        let (Some(b), Some(k), Some(image)) = (b, k, image) else {
            return Err(IdError::NotIssued {
                field,
                raw: raw.to_owned(),
            });
        };
        if k != kind.as_str() {
            return Err(IdError::OtherKind {
                field,
                raw: raw.to_owned(),
                found: k.to_owned(),
                wanted: kind,
            });
        }
        if b != backend {
            return Err(IdError::OtherBackend {
                field,
                raw: raw.to_owned(),
                found: b.to_owned(),
                serves: backend.to_owned(),
            });
        }
        // A backend with pools keys images as `[<connection>/]<pool>/<image>`.
        let mut segments = image.split('/');
        let valid = segments.clone().count() <= 3 && segments.all(|s| valid_image(s).is_ok());
        if !valid || raw.len() > MAX_ID {
            return Err(IdError::ForeignImage {
                field,
                raw: raw.to_owned(),
                image: image.to_owned(),
            });
        }
        Ok(Self::new(backend, kind, image.to_owned()))
    }
}

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.backend, self.kind.as_str(), self.image)
    }
}

/// The CSI spec's limit on ids (and most strings): 128 bytes.
pub const MAX_ID: usize = 128;
/// Longest pool name and longest connection name: with the longest prefix
/// (`ustor:snapshot:`), a connection, `/`, a pool, `/` and an image of [`MAX_IMAGE`] bytes,
/// an id stays within [`MAX_ID`].
pub const MAX_POOL: usize = 32;
pub const MAX_CONNECTION: usize = 16;
pub const MAX_IMAGE: usize = MAX_ID - "ustor:snapshot:".len() - MAX_CONNECTION - 1 - MAX_POOL - 1;

/// Checks the name of the MindUstorStorageConnection a volume id will carry.
pub fn valid_connection(name: &str) -> Result<(), IdError> {
    valid_segment(
        "connection name",
        name,
        MAX_CONNECTION,
        " (volume ids carry it and must stay within 128 bytes)",
    )
}

/// Checks a pool name from a StorageClass: what an image name may be, and short enough that
/// ids stay within the spec's 128 bytes.
pub fn valid_pool(pool: &str) -> Result<(), IdError> {
    valid_segment("pool", pool, MAX_POOL, "")
}

/// A segment of an image key: what an image name may be, at most `max` bytes.
fn valid_segment(
    what: &'static str,
    value: &str,
    max: usize,
    why: &'static str,
) -> Result<(), IdError> {
    if value.len() <= max && valid_image(value).is_ok() {
        Ok(())
    } else {
        Err(IdError::BadSegment {
            what,
            value: value.to_owned(),
            max,
            why,
        })
    }
}

/// What an image name may be (also checked on export names the local gate is asked for).
pub fn valid_image(image: &str) -> Result<(), IdError> {
    let ok = !image.is_empty()
        && image.len() <= 128
        && image
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !image.starts_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(IdError::BadImage {
            image: image.to_owned(),
        })
    }
}

/// Checks a cluster id from configuration: what prefixes every image name.
pub fn valid_cluster_id(id: &str) -> Result<(), String> {
    let ok = (1..=32).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "cluster id {id:?} must be 1-32 characters of a-z, 0-9 and -"
        ))
    }
}

/// The image name for a CSI object name: `<cluster>-<name>`, lowercased, at most
/// [`MAX_IMAGE`] bytes. A name with characters an image name cannot hold, or too long to fit,
/// is cut and gets a digest of the whole name appended, so two different names never share
/// an image.
pub fn image_for(cluster: &str, name: &str) -> Result<String, IdError> {
    if name.is_empty() {
        return Err(IdError::Missing { field: "name" });
    }
    if name.len() > 128 || name.chars().any(char::is_control) {
        return Err(IdError::BadName {
            name: name.to_owned(),
        });
    }
    let clean: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let mut image = format!("{cluster}-{clean}");
    if clean != name || image.len() > MAX_IMAGE {
        let keep = image[..image.len().min(MAX_IMAGE - 17)].trim_end_matches(['-', '.']);
        image = format!("{keep}-{:016x}", fnv1a(name));
    }
    valid_image(&image)?;
    Ok(image)
}

/// The image of the member of group snapshot `group` (a CSI name) taken of the volume keyed
/// `source`: the group's image with a digest of both, so a repeated call names the same.
pub fn member_image(cluster: &str, group: &str, source: &str) -> Result<String, IdError> {
    let group_image = image_for(cluster, group)?;
    let keep = group_image[..group_image.len().min(MAX_IMAGE - 17)].trim_end_matches(['-', '.']);
    let image = format!("{keep}-{:016x}", fnv1a(&format!("{group}/{source}")));
    valid_image(&image)?;
    Ok(image)
}

/// FNV-1a: a stable 64-bit digest, enough to keep sanitised names apart.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_refuse_what_is_not_ours() {
        let h = Handle::new("local", Kind::Volume, "k8s-pvc-1".into());
        assert_eq!(h.to_string(), "local:volume:k8s-pvc-1");
        assert_eq!(
            Handle::parse("local:volume:k8s-pvc-1", "local", Kind::Volume).unwrap(),
            h
        );
        assert_eq!(
            Handle::parse("ustor:volume:data/k8s-pvc-1", "ustor", Kind::Volume)
                .unwrap()
                .image,
            "data/k8s-pvc-1"
        );
        assert_eq!(
            Handle::parse("", "local", Kind::Volume),
            Err(IdError::Missing { field: "volume_id" })
        );
        for (bad, why) in [
            ("k8s-pvc-1", "not an id this driver issued"),
            ("local:snapshot:k8s-s", "names a snapshot"),
            ("ustor:volume:k8s-pvc-1", "belongs to backend"),
            ("local:volume:../etc", "not one this driver issued"),
            ("local:volume:a/b/c/d", "not one this driver issued"),
            ("local:volume:UPPER", "not one this driver issued"),
        ] {
            let err = Handle::parse(bad, "local", Kind::Volume).unwrap_err();
            assert!(err.to_string().contains(why), "{bad}: {err}");
            assert!(err.is_unknown_id(), "{bad}: not an id of ours");
        }
    }

    #[test]
    fn image_names_carry_the_cluster_and_never_collide() {
        assert_eq!(image_for("k8s", "pvc-0a1b").unwrap(), "k8s-pvc-0a1b");
        let a = image_for("k8s", "My Volume").unwrap();
        let b = image_for("k8s", "My_Volume").unwrap();
        assert_ne!(a, b, "sanitised names get distinct digests");
        assert!(a.starts_with("k8s-my-volume-"));
        assert!(image_for("k8s", "").is_err());
        // The longest names the spec allows give ids within its 128 bytes, distinct ones.
        let long_a = "a".repeat(128);
        let long_b = format!("{}b", "a".repeat(127));
        let (ia, ib) = (
            image_for("k8s", &long_a).unwrap(),
            image_for("k8s", &long_b).unwrap(),
        );
        assert_ne!(ia, ib);
        let pool = "p".repeat(MAX_POOL);
        let connection = "c".repeat(MAX_CONNECTION);
        for image in [ia, ib] {
            let id = Handle::new(
                "ustor",
                Kind::Snapshot,
                format!("{connection}/{pool}/{image}"),
            )
            .to_string();
            assert!(id.len() <= MAX_ID, "{id} is {} bytes", id.len());
            assert!(Handle::parse(&id, "ustor", Kind::Snapshot).is_ok());
        }
        assert!(valid_pool(&pool).is_ok());
        assert!(valid_pool(&"p".repeat(MAX_POOL + 1)).is_err());
        assert!(valid_pool("Data").is_err());
        assert!(valid_cluster_id("prod-1").is_ok());
        assert!(valid_cluster_id("Prod").is_err());
        assert!(valid_cluster_id("").is_err());
    }
}
