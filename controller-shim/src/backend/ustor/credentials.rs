//! The uStor user's credentials, from the files of a mounted Secret (`username`, `password`)
//! or from the Secret itself through the Kubernetes API (kept current by the connection's
//! reconciler); read again at every login, so a new password is used without a restart.
//! The password never appears in `Debug` output or logs.

use std::fmt;
use std::path::{Path, PathBuf};

/// Why the credentials could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// The connection's reconciler has not taken credentials from its Secret: not yet, or
    /// they were found wrong there (its status says why; the real node found an operator
    /// left with this message alone).
    #[error(
        "uStor credentials: none taken from the connection's Secret yet; its \
         MindUstorStorageConnection's status says why (kubectl get mindustorstorageconnections -o wide)"
    )]
    NotRead,
    #[error("uStor credentials: {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("uStor credentials: {} is empty", path.display())]
    Empty { path: PathBuf },
    /// uStor's password policy rules them out: a login would be refused, and count towards
    /// locking the user, so none is tried.
    #[error("uStor credentials: {0}; no login is tried with them (a refused one counts towards locking the user)")]
    AgainstPolicy(PolicyBreach),
}

/// What uStor's password policy (the old product's guide) never accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PolicyBreach {
    #[error("the user name has a hyphen, which uStor does not allow in user names")]
    HyphenInUserName,
    /// Which character is not said: it is part of the password.
    #[error("the password has a special character other than {PASSWORD_SPECIALS}, the only ones uStor allows")]
    PasswordCharacter,
}

/// The only characters other than letters and digits a uStor password may have.
pub const PASSWORD_SPECIALS: &str = "@$!%*?&";

#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    password: String,
    /// What identifies them where refusals are remembered beyond this process (in
    /// Kubernetes, a keyed digest of the Secret's content).
    fingerprint: Option<String>,
}

impl Credentials {
    pub fn new(username: impl Into<String>, password: impl Into<String>) -> Self {
        Self {
            username: username.into(),
            password: password.into(),
            fingerprint: None,
        }
    }

    /// The same credentials, identified by `fingerprint` (which must not reveal them).
    pub fn with_fingerprint(mut self, fingerprint: String) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// For the login request body only.
    pub fn password(&self) -> &str {
        &self.password
    }

    /// What uStor's password policy would refuse in them, if anything.
    pub fn policy_breach(&self) -> Option<PolicyBreach> {
        if self.username.contains('-') {
            return Some(PolicyBreach::HyphenInUserName);
        }
        let allowed = |c: char| c.is_alphanumeric() || PASSWORD_SPECIALS.contains(c);
        (!self.password.chars().all(allowed)).then_some(PolicyBreach::PasswordCharacter)
    }

    /// Identifies these credentials without revealing them: the login rules remember which
    /// credentials were refused by this value, never by the password. The one given with
    /// [`Credentials::with_fingerprint`], else a SHA-256 of the pair, kept in memory only.
    pub fn fingerprint(&self) -> String {
        if let Some(given) = &self.fingerprint {
            return given.clone();
        }
        let mut pair = self.username.as_bytes().to_vec();
        pair.push(0);
        pair.extend_from_slice(self.password.as_bytes());
        ring::digest::digest(&ring::digest::SHA256, &pair)
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .field("fingerprint", &self.fingerprint)
            .finish()
    }
}

/// Where the login finds the current credentials.
pub trait CredentialSource: Send + Sync + fmt::Debug {
    fn read(&self) -> Result<Credentials, CredentialsError>;
}

/// Credentials another task keeps current (the connection reconciler, from the Secret).
#[derive(Debug, Default)]
pub struct SharedCredentials(std::sync::Mutex<Option<Credentials>>);

impl SharedCredentials {
    pub fn set(&self, credentials: Credentials) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(credentials);
    }
}

impl CredentialSource for SharedCredentials {
    fn read(&self) -> Result<Credentials, CredentialsError> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or(CredentialsError::NotRead)
    }
}

/// A directory with `username` and `password` files, as Kubernetes mounts a Secret. Kubelet
/// updates such a mount in place (through a symlink swap), so every read sees a whole pair.
#[derive(Debug, Clone)]
pub struct CredentialsDir {
    dir: PathBuf,
}

impl CredentialsDir {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
        }
    }
}

impl CredentialSource for CredentialsDir {
    fn read(&self) -> Result<Credentials, CredentialsError> {
        let read = |name: &str| -> Result<String, CredentialsError> {
            let path = self.dir.join(name);
            let value = match std::fs::read_to_string(&path) {
                Ok(value) => value,
                Err(source) => return Err(CredentialsError::Read { path, source }),
            };
            let value = value.trim_end_matches(['\n', '\r']).to_owned();
            if value.is_empty() {
                return Err(CredentialsError::Empty { path });
            }
            Ok(value)
        };
        Ok(Credentials::new(read("username")?, read("password")?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_never_shows_and_changes_are_seen() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("username"), "csi\n").unwrap();
        std::fs::write(dir.path().join("password"), "S3cret@1\n").unwrap();
        let source = CredentialsDir::new(dir.path());
        let first = source.read().unwrap();
        assert_eq!(first.username, "csi");
        assert_eq!(first.password(), "S3cret@1");
        let shown = format!("{first:?}");
        assert!(!shown.contains("S3cret"), "{shown}");

        std::fs::write(dir.path().join("password"), "N3w@pass").unwrap();
        let second = source.read().unwrap();
        assert_ne!(
            first.fingerprint(),
            second.fingerprint(),
            "a new password is new credentials"
        );

        std::fs::write(dir.path().join("password"), "").unwrap();
        assert!(matches!(source.read(), Err(CredentialsError::Empty { .. })));
    }

    #[test]
    fn what_the_password_policy_refuses_is_named_without_the_password() {
        let ok = Credentials::new("csi", "Zz9@$!%*?&");
        assert_eq!(ok.policy_breach(), None);
        // Letters of any alphabet are letters.
        assert_eq!(Credentials::new("csi", "Пароль1!").policy_breach(), None);
        assert_eq!(
            Credentials::new("csi-user", "S3cret@1").policy_breach(),
            Some(PolicyBreach::HyphenInUserName)
        );
        for password in ["S3cret#1", "with space", "dot.", "dash-"] {
            let breach = Credentials::new("csi", password).policy_breach();
            assert_eq!(breach, Some(PolicyBreach::PasswordCharacter), "{password}");
            let told = CredentialsError::AgainstPolicy(breach.unwrap()).to_string();
            assert!(!told.contains(password), "{told}");
            assert!(told.contains(PASSWORD_SPECIALS), "{told}");
        }
    }
}
