//! Fencing grants: an export server of this driver lets a node in only while the node holds a
//! live grant for the export, which the controller makes at ControllerPublishVolume and
//! revokes at ControllerUnpublishVolume. The node proves it by asking for the export named
//! `<export>@<token>`; a server answers a name without a live grant with NBD_REP_ERR_POLICY.
//!
//! The token is a credential: it goes on the wire and into the root-only journal, and nowhere
//! else (no Debug, no Display, no error message carries it).

use std::fmt;

/// Longest token accepted: the controller makes 32 hex characters; room for other servers.
const MAX_TOKEN: usize = 128;

/// The token of one node's grant to one export.
#[derive(Clone, PartialEq, Eq)]
pub struct Grant(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadGrant {
    #[error("the grant token is empty")]
    Empty,
    #[error("the grant token is {len} characters; at most {MAX_TOKEN} are allowed")]
    TooLong { len: usize },
    #[error("the grant token may hold only ASCII letters, digits, '-' and '_'")]
    BadCharacter,
}

impl Grant {
    pub fn new(token: impl Into<String>) -> Result<Self, BadGrant> {
        let token = token.into();
        if token.is_empty() {
            return Err(BadGrant::Empty);
        }
        if token.len() > MAX_TOKEN {
            return Err(BadGrant::TooLong { len: token.len() });
        }
        if !token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(BadGrant::BadCharacter);
        }
        Ok(Self(token))
    }

    /// The token, for the journal. Never log it.
    pub fn token(&self) -> &str {
        &self.0
    }

    /// The export name a server of this driver is asked for: `<export>@<token>`.
    pub fn export_name(&self, export: &str) -> String {
        format!("{export}@{}", self.0)
    }
}

impl fmt::Debug for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Grant(<redacted>)")
    }
}

/// The name to send in the handshake for `export`, with the grant when there is one.
pub fn wire_name(export: &str, grant: Option<&Grant>) -> String {
    match grant {
        Some(g) => g.export_name(export),
        None => export.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_never_printed() {
        let g = Grant::new("0f3a9c").unwrap();
        assert_eq!(format!("{g:?}"), "Grant(<redacted>)");
        assert_eq!(format!("{:?}", Some(&g)), "Some(Grant(<redacted>))");
        assert_eq!(g.export_name("pvc-1"), "pvc-1@0f3a9c");
        assert_eq!(wire_name("pvc-1", None), "pvc-1");
    }

    #[test]
    fn a_token_that_could_split_the_name_is_refused() {
        assert_eq!(Grant::new(""), Err(BadGrant::Empty));
        assert_eq!(Grant::new("a@b"), Err(BadGrant::BadCharacter));
        assert_eq!(Grant::new("a b"), Err(BadGrant::BadCharacter));
        assert_eq!(
            Grant::new("x".repeat(129)),
            Err(BadGrant::TooLong { len: 129 })
        );
        assert!(Grant::new("x".repeat(128)).is_ok());
    }
}
