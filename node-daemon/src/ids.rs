//! Identities: volume ids as the CO sends them, node ids, and the backend identifier that
//! names one attachment of one volume on one node.

use std::fmt;

use nbd::BackendId;
use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use sha2::{Digest, Sha256};

use crate::request::RequestError;

/// Making an identity failed: the randomness source, or an identifier the kernel would refuse.
#[derive(Debug, thiserror::Error)]
pub enum IdError {
    #[error("building identifier: {0}")]
    Identifier(#[source] nbd::identity::BadBackendId),
    #[error("identifier {identifier:?}: {source}")]
    Unusable {
        identifier: String,
        source: nbd::identity::BadBackendId,
    },
    #[error("random {what}: {source}")]
    Random {
        what: &'static str,
        source: std::io::Error,
    },
}

impl IdError {
    fn random(what: &'static str) -> impl FnOnce(getrandom::Error) -> Self {
        move |e| IdError::Random {
            what,
            source: match e.raw_os_error() {
                Some(errno) => std::io::Error::from_raw_os_error(errno),
                None => std::io::Error::other(e.to_string()),
            },
        }
    }
}

/// The CSI spec caps strings at 128 bytes unless a field says otherwise.
const MAX_ID: usize = 128;

/// A volume id from the CO: opaque, non-empty, at most 128 bytes, no control characters.
/// The journal keeps it as a plain string, checked again when read.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub struct VolumeId(String);

impl TryFrom<String> for VolumeId {
    type Error = RequestError;

    fn try_from(raw: String) -> Result<Self, RequestError> {
        Self::parse(&raw)
    }
}

impl From<VolumeId> for String {
    fn from(id: VolumeId) -> String {
        id.0
    }
}

impl VolumeId {
    pub fn parse(raw: &str) -> Result<Self, RequestError> {
        if raw.is_empty() {
            return Err(RequestError::Missing { field: "volume_id" });
        }
        if raw.len() > MAX_ID {
            return Err(RequestError::VolumeIdTooLong {
                len: raw.len(),
                max: MAX_ID,
            });
        }
        if raw.chars().any(char::is_control) {
            return Err(RequestError::VolumeIdControl);
        }
        Ok(Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A volume id is used as the key of the node's maps and locks, and in messages.
impl std::ops::Deref for VolumeId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Bytes kept as they are in encoded ids; everything else becomes %XX.
const KEEP: &AsciiSet = &NON_ALPHANUMERIC.remove(b'.').remove(b'_').remove(b'-');

pub fn encode(s: &str) -> String {
    utf8_percent_encode(s, KEEP).to_string()
}

pub fn decode(s: &str) -> Option<String> {
    percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

/// A short stable digest, for names that would otherwise be too long.
pub fn digest(s: &str) -> String {
    let d = Sha256::digest(s.as_bytes());
    d.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// Prefix of every identifier this driver gives a device.
pub const IDENTIFIER_PREFIX: &str = "ustor";

/// The parts of an identifier: `ustor:<node>:<volume>:<attachment>`, each percent-encoded.
/// A volume part that would make the identifier too long is replaced by `#<digest>`-style
/// `h.<digest>`, and then cannot be decoded back (recovery needs the journal for those).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identifier {
    pub node: String,
    pub volume: Option<String>,
    pub attachment: String,
}

impl Identifier {
    /// A fresh identifier for a new attachment of `volume` on `node`.
    pub fn new_attachment(node: &str, volume: &VolumeId) -> Result<BackendId, IdError> {
        let attachment = random_hex(8)?;
        Self::compose(node, volume, &attachment)
    }

    pub fn compose(node: &str, volume: &VolumeId, attachment: &str) -> Result<BackendId, IdError> {
        let mut id = format!(
            "{IDENTIFIER_PREFIX}:{}:{}:{attachment}",
            encode(node),
            encode(volume.as_str())
        );
        if id.len() > nbd::identity::MAX_BACKEND_ID {
            id = format!(
                "{IDENTIFIER_PREFIX}:{}:h.{}:{attachment}",
                encode(node),
                digest(volume.as_str())
            );
        }
        BackendId::new(id).map_err(IdError::Identifier)
    }

    /// Splits an identifier made by [`Identifier::compose`]; `None` for anything else.
    pub fn parse(id: &str) -> Option<Self> {
        let mut parts = id.split(':');
        if parts.next()? != IDENTIFIER_PREFIX {
            return None;
        }
        let node = decode(parts.next()?)?;
        let volume = parts.next()?;
        let attachment = parts.next()?.to_owned();
        if parts.next().is_some() || attachment.is_empty() {
            return None;
        }
        let volume = if volume.starts_with("h.") {
            None
        } else {
            Some(decode(volume)?)
        };
        Some(Self {
            node,
            volume,
            attachment,
        })
    }
}

/// A random (version 4) UUID, for a filesystem the daemon is about to create.
pub fn random_uuid() -> Result<String, IdError> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(IdError::random("filesystem UUID"))?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    ))
}

fn random_hex(bytes: usize) -> Result<String, IdError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(IdError::random("attachment id"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filesystem_uuids_are_random_v4() {
        let (a, b) = (random_uuid().unwrap(), random_uuid().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(a.as_bytes()[14], b'4', "{a}");
        assert!(b"89ab".contains(&a.as_bytes()[19]), "{a}");
    }

    #[test]
    fn volume_ids_are_validated() {
        assert!(VolumeId::parse("pvc-0a1b").is_ok());
        assert!(VolumeId::parse("pool/image with space").is_ok());
        assert!(VolumeId::parse("").is_err());
        assert!(VolumeId::parse(&"x".repeat(129)).is_err());
        assert!(VolumeId::parse("a\nb").is_err());
    }

    #[test]
    fn identifiers_round_trip_and_are_unique() {
        let v = VolumeId::parse("pool/img:1").unwrap();
        let a = Identifier::new_attachment("node-a", &v).unwrap();
        let b = Identifier::new_attachment("node-a", &v).unwrap();
        assert_ne!(a, b, "each attachment gets its own identifier");
        let parsed = Identifier::parse(a.as_str()).unwrap();
        assert_eq!(parsed.node, "node-a");
        assert_eq!(parsed.volume.as_deref(), Some("pool/img:1"));
        assert_eq!(parsed.attachment.len(), 16);
    }

    #[test]
    fn long_volume_ids_are_digested() {
        let v = VolumeId::parse(&"é".repeat(64)).unwrap();
        let id = Identifier::compose("n", &v, "00ff").unwrap();
        assert!(id.as_str().len() <= nbd::identity::MAX_BACKEND_ID);
        let parsed = Identifier::parse(id.as_str()).unwrap();
        assert_eq!(parsed.volume, None);
    }

    #[test]
    fn foreign_identifiers_are_not_ours() {
        for other in [
            "",
            "vol-1",
            "ceph:pool:img",
            "ustor:n:v",
            "ustor:n:v:a:extra",
            "ustor:n:v:",
        ] {
            assert_eq!(Identifier::parse(other), None, "{other}");
        }
    }
}
