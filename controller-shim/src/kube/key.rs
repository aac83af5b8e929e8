//! The controller's secret key: the Secret `csi-controller-key` (key `key`, 32 random bytes)
//! in the driver's namespace, made by the first replica that finds none and followed by every
//! replica. It signs the admission webhook's stamps on claims ([`super::stamp`]), so only a
//! claim the webhook admitted carries a valid one, and it keys the digests by which the
//! connections' statuses name credentials uStor refused ([`super::connection`]), so nobody
//! can guess a password back from them. Deleting the Secret makes a new key: the stamps made
//! with the old one no longer count, and refused credentials are tried once more.

use std::fmt;
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::runtime::watcher::Event;
use kube::{Api, Client};

/// The Secret holding the key, in the driver's namespace.
pub const KEY_SECRET: &str = "csi-controller-key";
/// Its data key.
const KEY_FIELD: &str = "key";
/// Bytes of a new key (HMAC-SHA256 wants at least its output's size).
const KEY_BYTES: usize = 32;

/// The key once loaded; clones share it.
#[derive(Clone, Default)]
pub struct ControllerKey(Arc<RwLock<Option<ring::hmac::Key>>>);

impl fmt::Debug for ControllerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControllerKey")
            .field("loaded", &self.read().is_some())
            .finish()
    }
}

/// Why the key could not be loaded or made.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("Secret {namespace}/{KEY_SECRET}: {source}")]
    Api {
        namespace: String,
        source: kube::Error,
    },
    #[error(
        "Secret {namespace}/{KEY_SECRET} has no key {KEY_FIELD} of at least {KEY_BYTES} bytes: \
         delete it and the controller makes a new one"
    )]
    Short { namespace: String },
    #[error("no random bytes for a new controller key")]
    Random,
}

impl ControllerKey {
    /// A key of these bytes (in a cluster, [`follow`] loads the Secret's).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let key = Self::default();
        key.set(bytes);
        key
    }

    fn set(&self, bytes: &[u8]) {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, bytes);
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Some(key);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Option<ring::hmac::Key>> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The HMAC-SHA256 of `message`, in hex; `None` until the key is loaded.
    pub fn sign(&self, message: &[u8]) -> Option<String> {
        let guard = self.read();
        let key = guard.as_ref()?;
        Some(hex(ring::hmac::sign(key, message).as_ref()))
    }

    /// Whether `tag` (hex) is the HMAC-SHA256 of `message`, compared in constant time;
    /// `None` until the key is loaded.
    pub fn verify(&self, message: &[u8], tag: &str) -> Option<bool> {
        let guard = self.read();
        let key = guard.as_ref()?;
        Some(unhex(tag).is_some_and(|tag| ring::hmac::verify(key, message, &tag).is_ok()))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Keeps `key` loaded from the Secret until aborted, and makes the Secret whenever there is
/// none (at the first start, or after an operator deleted it to change the key).
pub async fn follow(client: Client, namespace: String, key: ControllerKey) {
    let api: Api<Secret> = Api::namespaced(client, &namespace);
    let stream = super::watch_named(api.clone(), KEY_SECRET);
    tokio::pin!(stream);
    let mut listed = false;
    while let Some(event) = stream.next().await {
        let outcome = match event {
            Ok(Event::Init) => {
                listed = false;
                Ok(())
            }
            Ok(Event::InitApply(secret) | Event::Apply(secret)) => {
                listed = true;
                load(&key, &namespace, &secret)
            }
            Ok(Event::InitDone) if listed => Ok(()),
            Ok(Event::InitDone | Event::Delete(_)) => make(&api, &namespace, &key).await,
            Err(e) => {
                tracing::warn!(error = %e, "controller key Secret watch; retrying");
                Ok(())
            }
        };
        if let Err(e) = outcome {
            tracing::error!(error = %e, "controller key");
        }
    }
}

fn load(key: &ControllerKey, namespace: &str, secret: &Secret) -> Result<(), KeyError> {
    match secret.data.as_ref().and_then(|d| d.get(KEY_FIELD)) {
        Some(bytes) if bytes.0.len() >= KEY_BYTES => {
            key.set(&bytes.0);
            tracing::info!(secret = KEY_SECRET, "controller key loaded");
            Ok(())
        }
        _ => Err(KeyError::Short {
            namespace: namespace.to_owned(),
        }),
    }
}

/// Makes the Secret with a new random key, retrying until it exists (made here, or by
/// another replica: the watch then brings its key).
async fn make(api: &Api<Secret>, namespace: &str, key: &ControllerKey) -> Result<(), KeyError> {
    let bytes: [u8; KEY_BYTES] = ring::rand::generate(&ring::rand::SystemRandom::new())
        .map_err(|_| KeyError::Random)?
        .expose();
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(KEY_SECRET.to_owned()),
            ..Default::default()
        },
        data: Some([(KEY_FIELD.to_owned(), ByteString(bytes.to_vec()))].into()),
        ..Default::default()
    };
    loop {
        match api.create(&Default::default(), &secret).await {
            Ok(made) => {
                tracing::info!(secret = KEY_SECRET, "made a new controller key");
                return load(key, namespace, &made);
            }
            Err(kube::Error::Api(e)) if e.code == 409 => return Ok(()),
            Err(source) => {
                let e = KeyError::Api {
                    namespace: namespace.to_owned(),
                    source,
                };
                tracing::error!(error = %e, "controller key: cannot make the Secret; retrying in 5 s");
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_verifies_only_under_its_key_and_message() {
        let key = ControllerKey::from_bytes(&[7; KEY_BYTES]);
        let tag = key.sign(b"claim").unwrap();
        assert_eq!(tag.len(), 64);
        assert_eq!(key.verify(b"claim", &tag), Some(true));
        assert_eq!(key.verify(b"other", &tag), Some(false));
        assert_eq!(key.verify(b"claim", "zz"), Some(false));
        assert_eq!(key.verify(b"claim", &tag[1..]), Some(false));
        let other = ControllerKey::from_bytes(&[8; KEY_BYTES]);
        assert_eq!(other.verify(b"claim", &tag), Some(false));
        let unloaded = ControllerKey::default();
        assert_eq!(unloaded.sign(b"claim"), None);
        assert_eq!(unloaded.verify(b"claim", &tag), None);
        assert!(!format!("{key:?}").contains("07"), "{key:?}");
    }
}
