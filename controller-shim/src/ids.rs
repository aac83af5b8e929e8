//! Volume and snapshot ids: `<backend>:volume:<image>` and `<backend>:snapshot:<image>`.
//! Opaque to the CO, stable, and validated when they come back: a snapshot id used as a
//! volume id, or an id of another backend, is refused with a message that says so.
//!
//! Image names carry the configured cluster id as a prefix, so one storage system can serve
//! several Kubernetes clusters without their images colliding.

use std::fmt;

use crate::error::ControllerError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Volume,
    Snapshot,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Volume => "volume",
            Kind::Snapshot => "snapshot",
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
    pub fn parse(raw: &str, backend: &str, kind: Kind) -> Result<Self, ControllerError> {
        let field = match kind {
            Kind::Volume => "volume_id",
            Kind::Snapshot => "snapshot_id",
        };
        if raw.is_empty() {
            return Err(ControllerError::invalid(format!("{field} is required")));
        }
        let mut parts = raw.splitn(3, ':');
        let (b, k, image) = (parts.next(), parts.next(), parts.next());
        let (Some(b), Some(k), Some(image)) = (b, k, image) else {
            return Err(ControllerError::invalid(format!(
                "{field} {raw:?} is not an id this driver issued"
            )));
        };
        if k != kind.as_str() {
            return Err(ControllerError::invalid(format!(
                "{field} {raw:?} names a {k}, not a {}",
                kind.as_str()
            )));
        }
        if b != backend {
            return Err(ControllerError::invalid(format!(
                "{field} {raw:?} belongs to backend {b:?}; this controller serves {backend:?}"
            )));
        }
        // A backend with pools keys images as `<pool>/<image>`.
        let mut segments = image.split('/');
        let valid = segments.clone().count() <= 2 && segments.all(|s| valid_image(s).is_ok());
        if !valid {
            return Err(ControllerError::invalid(format!(
                "{field} {raw:?}: image name {image:?} is not valid"
            )));
        }
        Ok(Self::new(backend, kind, image.to_owned()))
    }
}

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.backend, self.kind.as_str(), self.image)
    }
}

fn valid_image(image: &str) -> Result<(), String> {
    let ok = !image.is_empty()
        && image.len() <= 128
        && image
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !image.starts_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(format!("image name {image:?} is not valid"))
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

/// The image name for a CSI object name: `<cluster>-<name>`, lowercased. A name with
/// characters an image name cannot hold gets them replaced and a digest appended, so two
/// different names never share an image.
pub fn image_for(cluster: &str, name: &str) -> Result<String, ControllerError> {
    if name.is_empty() {
        return Err(ControllerError::invalid("name is required"));
    }
    if name.len() > 128 || name.chars().any(char::is_control) {
        return Err(ControllerError::invalid(format!(
            "name {name:?} is too long or has control characters"
        )));
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
    if clean != name {
        image = format!("{}-{:016x}", &image[..image.len().min(100)], fnv1a(name));
    }
    image.truncate(128);
    valid_image(&image).map_err(ControllerError::invalid)?;
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
        for (bad, why) in [
            ("", "required"),
            ("k8s-pvc-1", "not an id this driver issued"),
            ("local:snapshot:k8s-s", "names a snapshot"),
            ("ustor:volume:k8s-pvc-1", "belongs to backend"),
            ("local:volume:../etc", "not valid"),
            ("local:volume:a/b/c", "not valid"),
            ("local:volume:UPPER", "not valid"),
        ] {
            let err = Handle::parse(bad, "local", Kind::Volume).unwrap_err();
            assert!(err.to_string().contains(why), "{bad}: {err}");
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
        assert!(valid_cluster_id("prod-1").is_ok());
        assert!(valid_cluster_id("Prod").is_err());
        assert!(valid_cluster_id("").is_err());
    }
}
