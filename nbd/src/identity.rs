//! Typed identities: which device, and which attachment it must carry.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// Index N of `/dev/nbdN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceIndex(pub u32);

impl DeviceIndex {
    pub fn name(self) -> String {
        format!("nbd{}", self.0)
    }

    pub fn dev_path(self) -> PathBuf {
        PathBuf::from(format!("/dev/nbd{}", self.0))
    }
}

impl fmt::Display for DeviceIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "/dev/nbd{}", self.0)
    }
}

/// Why a string cannot name a device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an NBD device (expected /dev/nbdN, nbdN or N)")]
pub struct BadDeviceName(pub String);

impl FromStr for DeviceIndex {
    type Err = BadDeviceName;

    /// Accepts `/dev/nbd3`, `nbd3` and `3`, and nothing else: a partition (`nbd3p1`) or another
    /// block device is refused rather than guessed at.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let digits = s
            .strip_prefix("/dev/nbd")
            .or_else(|| s.strip_prefix("nbd"))
            .unwrap_or(s);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(BadDeviceName(s.to_owned()));
        }
        digits
            .parse()
            .map(DeviceIndex)
            .map_err(|_| BadDeviceName(s.to_owned()))
    }
}

/// The string a device carries in `/sys/block/nbdN/backend` (`NBD_ATTR_BACKEND_IDENTIFIER`).
/// It names one attachment of one volume, so that no code acts on a device it did not attach.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendId(String);

/// Identifiers longer than this are refused; sysfs prints them in one page with room to spare.
pub const MAX_BACKEND_ID: usize = 255;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadBackendId {
    #[error("backend identifier is empty")]
    Empty,
    #[error("backend identifier is {0} bytes; at most 255 are allowed")]
    TooLong(usize),
    #[error("backend identifier {0:?} may contain only ASCII letters, digits and . _ - : / %")]
    BadCharacter(String),
}

impl BackendId {
    pub fn new(id: impl Into<String>) -> Result<Self, BadBackendId> {
        let id = id.into();
        if id.is_empty() {
            return Err(BadBackendId::Empty);
        }
        if id.len() > MAX_BACKEND_ID {
            return Err(BadBackendId::TooLong(id.len()));
        }
        // sysfs shows the value followed by a newline: whitespace or control characters would
        // make two identifiers compare equal after trimming, or one look like another.
        let allowed = |c: char| c.is_ascii_alphanumeric() || "._-:/%".contains(c);
        if !id.chars().all(allowed) {
            return Err(BadBackendId::BadCharacter(id));
        }
        Ok(Self(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for BackendId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for BackendId {
    type Err = BadBackendId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names() {
        assert_eq!("/dev/nbd12".parse(), Ok(DeviceIndex(12)));
        assert_eq!("nbd0".parse(), Ok(DeviceIndex(0)));
        assert_eq!("7".parse(), Ok(DeviceIndex(7)));
        for bad in [
            "",
            "/dev/nbd",
            "/dev/nbd1p1",
            "/dev/sda",
            "nbd-1",
            "99999999999",
        ] {
            assert!(bad.parse::<DeviceIndex>().is_err(), "{bad}");
        }
        assert_eq!(DeviceIndex(3).to_string(), "/dev/nbd3");
    }

    #[test]
    fn backend_ids() {
        assert!(BackendId::new("ustor-nbd.csi.mindsw.io/pvc-1:att-2").is_ok());
        assert_eq!(BackendId::new(""), Err(BadBackendId::Empty));
        assert_eq!(
            BackendId::new("a".repeat(256)),
            Err(BadBackendId::TooLong(256))
        );
        assert!(matches!(
            BackendId::new("a b"),
            Err(BadBackendId::BadCharacter(_))
        ));
        assert!(matches!(
            BackendId::new("a\n"),
            Err(BadBackendId::BadCharacter(_))
        ));
    }
}
