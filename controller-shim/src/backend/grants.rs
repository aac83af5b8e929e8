//! Grants: which node may open an export of an image now (storage-side fencing). The
//! controller grants at ControllerPublishVolume and revokes at ControllerUnpublishVolume; the
//! export server admits a handshake only for the export name `<export>@<token>` of a live
//! grant, so a node cut off from the cluster cannot reach a volume published elsewhere.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Separates the export from the grant token in the export name a node dials.
pub const TOKEN_SEPARATOR: char = '@';

/// A grant's token: a credential, so it has no `Display` and its `Debug` hides it; only
/// [`expose`](Self::expose) gives it out (for the publish context).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GrantToken(String);

impl fmt::Debug for GrantToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GrantToken(<redacted>)")
    }
}

/// The system's random source failed: no token can be made.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("no random bytes for a grant token")]
pub struct NoRandom;

impl GrantToken {
    /// 128 random bits as 32 lowercase hex characters.
    pub fn generate() -> Result<Self, NoRandom> {
        use ring::rand::SecureRandom;
        let mut bytes = [0u8; 16];
        ring::rand::SystemRandom::new()
            .fill(&mut bytes)
            .map_err(|_| NoRandom)?;
        Ok(Self(bytes.iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// A token as the storage system issued it.
    pub fn issued(token: String) -> Self {
        Self(token)
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time that does not depend on where they differ.
    pub fn matches(&self, presented: &str) -> bool {
        let (ours, theirs) = (self.0.as_bytes(), presented.as_bytes());
        // The length is no secret (always 32); the bytes are compared all the way.
        let diff = ours
            .iter()
            .zip(theirs)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        ours.len() == theirs.len() && std::hint::black_box(diff) == 0
    }
}

/// One node's live grant of an image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub token: GrantToken,
    pub readonly: bool,
}

/// An export name a node dialed, split into the export and the token it presents (`None`
/// without a separator).
pub fn split_export_name(name: &str) -> (&str, Option<&str>) {
    match name.rsplit_once(TOKEN_SEPARATOR) {
        Some((export, token)) => (export, Some(token)),
        None => (name, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_hex_and_never_shown() {
        let a = GrantToken::generate().unwrap();
        let b = GrantToken::generate().unwrap();
        assert_eq!(a.expose().len(), 32);
        assert!(a
            .expose()
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        assert_ne!(a, b, "each grant gets its own token");
        assert!(a.matches(a.expose()) && !a.matches(b.expose()));
        let shown = format!(
            "{:?}",
            Grant {
                token: a.clone(),
                readonly: false
            }
        );
        assert!(!shown.contains(a.expose()), "{shown}");
    }

    #[test]
    fn the_token_is_after_the_last_separator() {
        assert_eq!(split_export_name("pvc-1@ab"), ("pvc-1", Some("ab")));
        assert_eq!(split_export_name("a@b@cd"), ("a@b", Some("cd")));
        assert_eq!(split_export_name("pvc-1"), ("pvc-1", None));
    }
}
