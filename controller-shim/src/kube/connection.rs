//! A MindUstorStorageConnection's state, kept in its status as the guide describes: both
//! Secrets hold every key they need, `controlPlane.address` never changed, and the uStor
//! management API accepts the user's login. The login follows the product's rules
//! (`backend/ustor/login.rs`): at start, hourly, within seconds of either Secret changing, and
//! never again with credentials uStor refused until they change. Refused credentials are
//! kept in the connection's status (`refusedLogin`, by a keyed digest of the credentials
//! Secret's content), not in a session: a session made anew (the CA or address changed), a
//! restarted controller and every replica know them, so none moves the user toward uStor's
//! lock-out after 3 failed logins.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::runtime::controller::Action;
use kube::{Api, Client, ResourceExt};

use super::crd::{ConnectionStatus, MindUstorStorageConnection, Phase, RefusedLogin};
use super::key::ControllerKey;
use super::{Context, GlueError};
use crate::backend::connections::{ConnectionDirectory, ConnectionError};
use crate::backend::ustor::api::{check_url, RefusalRecord, Scheme, UstorApi};
use crate::backend::ustor::credentials::{Credentials, SharedCredentials};
use crate::backend::ustor::login::Refusal;

/// Keys of the credentials Secret.
pub const CREDENTIAL_KEYS: [&str; 2] = ["username", "password"];
/// Keys of the TLS Secret.
pub const TLS_KEYS: [&str; 5] = [
    "ca.crt",
    "client.crt",
    "client.key",
    "etcd-client.crt",
    "etcd-client.key",
];

/// How often a connection is looked at when nothing happens: the hourly login is due at
/// most this late.
const CHECK_EVERY: Duration = Duration::from_secs(60);

/// The management API client of one connection, kept across reconciles so the login rules
/// (the 5-minute pause) hold.
#[derive(Debug)]
pub struct Session {
    pub api: Arc<UstorApi>,
    credentials: Arc<SharedCredentials>,
    address: String,
    ca: Vec<u8>,
    /// The Secrets' resource versions at the last login attempt: a change means a login now.
    logged_in_with: Mutex<Option<String>>,
}

/// Sessions by connection name.
#[derive(Debug, Default)]
pub struct Sessions(Mutex<HashMap<String, Arc<Session>>>);

impl Sessions {
    pub fn get(&self, connection: &str) -> Option<Arc<Session>> {
        self.lock().get(connection).cloned()
    }

    /// Each connection's login state, for metrics.
    pub fn login_states(&self) -> Vec<(String, &'static str)> {
        self.lock()
            .iter()
            .map(|(name, s)| (name.clone(), s.api.login_state().as_str()))
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The connections as the CSI controller sees them: their sessions, and the resources
/// (for the oldest one, and for why one is not usable).
#[derive(Debug, Clone)]
pub struct Directory {
    pub sessions: Arc<Sessions>,
    pub connections: kube::runtime::reflector::Store<MindUstorStorageConnection>,
}

impl Directory {
    /// Drops the sessions of connections that no longer exist. Deletion is not reconciled
    /// (there is no finalizer: a deleted connection holds nothing to clean up in uStor), so
    /// the session of a deleted connection would otherwise live, logged in, for ever.
    fn prune(&self) {
        let live = self.live();
        self.sessions.lock().retain(|name, _| live.contains(name));
    }

    /// The connections that exist and are not being deleted, by name.
    fn live(&self) -> std::collections::BTreeSet<String> {
        self.connections
            .state()
            .iter()
            .filter(|c| c.metadata.deletion_timestamp.is_none())
            .map(|c| c.name_any())
            .collect()
    }

    /// Each existing connection's login state, for metrics.
    pub fn login_states(&self) -> Vec<(String, &'static str)> {
        self.prune();
        self.sessions.login_states()
    }
}

impl ConnectionDirectory for Directory {
    fn api(&self, connection: &str) -> Result<Arc<UstorApi>, ConnectionError> {
        self.prune();
        if let Some(session) = self.sessions.get(connection) {
            return Ok(Arc::clone(&session.api));
        }
        let known = self
            .connections
            .state()
            .into_iter()
            .find(|c| c.name_any() == connection);
        Err(match known {
            Some(c) => ConnectionError::NotUsable {
                connection: connection.to_owned(),
                reason: c
                    .status
                    .as_ref()
                    .and_then(|s| s.reason.clone())
                    .unwrap_or_else(|| "being checked".into()),
            },
            None => ConnectionError::Unknown {
                connection: connection.to_owned(),
            },
        })
    }

    fn oldest(&self) -> Option<String> {
        self.connections
            .state()
            .into_iter()
            .filter(|c| c.metadata.deletion_timestamp.is_none())
            .min_by(|a, b| {
                (
                    a.metadata.creation_timestamp.as_ref().map(|t| t.0),
                    a.name_any(),
                )
                    .cmp(&(
                        b.metadata.creation_timestamp.as_ref().map(|t| t.0),
                        b.name_any(),
                    ))
            })
            .map(|c| c.name_any())
    }

    fn names(&self) -> Vec<String> {
        self.live().into_iter().collect()
    }
}

/// What a Secret lacks, named for the operator; the data when it has every key.
fn secret_data(
    secret: Option<&Secret>,
    namespace: &str,
    name: &str,
    field: &str,
    keys: &[&str],
) -> Result<BTreeMap<String, Vec<u8>>, String> {
    let Some(secret) = secret else {
        return Err(format!(
            "Secret {namespace}/{name} ({field}) does not exist"
        ));
    };
    let data: BTreeMap<String, Vec<u8>> = secret
        .data
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect();
    for key in keys {
        match data.get(*key) {
            None => {
                return Err(format!(
                    "Secret {namespace}/{name} ({field}) has no key {key}"
                ))
            }
            Some(v) if v.iter().all(u8::is_ascii_whitespace) => {
                return Err(format!(
                    "key {key} of Secret {namespace}/{name} ({field}) is empty"
                ))
            }
            Some(_) => {}
        }
    }
    Ok(data)
}

fn text(data: &BTreeMap<String, Vec<u8>>, key: &str) -> String {
    String::from_utf8_lossy(&data[key])
        .trim_end_matches(['\n', '\r'])
        .to_owned()
}

/// The credentials Secret's content as it identifies the credentials where refusals are
/// kept: the HMAC-SHA256 under the controller's key of its keys and values, so the status
/// never holds anything a reader could guess a password back from. Any change of the
/// content is new credentials (an operator who wants the same password tried again, after
/// uStor's administrator unlocked the user, changes any key of the Secret). `None` until the
/// key is loaded.
fn credentials_digest(key: &ControllerKey, data: &BTreeMap<String, Vec<u8>>) -> Option<String> {
    let mut message = b"ustor-nbd.csi.mindsw.io credentials v1".to_vec();
    for (name, value) in data {
        message.push(b'\n');
        message.extend_from_slice(name.as_bytes());
        message.push(b'=');
        message.extend(value.iter().flat_map(|b| format!("{b:02x}").into_bytes()));
    }
    key.sign(&message)
}

/// A connection's refused credentials, in its status (`refusedLogin`). Whichever replica is
/// refused writes it at once (waiting for the leader's next look would let another login
/// try them), and every login first reads it through the API.
struct StatusRecord {
    connection: String,
    client: Client,
    field_manager: String,
}

impl std::fmt::Debug for StatusRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusRecord")
            .field("connection", &self.connection)
            .finish_non_exhaustive()
    }
}

#[tonic::async_trait]
impl RefusalRecord for StatusRecord {
    async fn refused(&self, fingerprint: &str) -> Option<Refusal> {
        let api: Api<MindUstorStorageConnection> = Api::all(self.client.clone());
        match api.get(&self.connection).await {
            Ok(connection) => connection
                .status?
                .refused_login
                .filter(|r| r.credentials_digest == fingerprint)
                .map(|r| Refusal::from_code(&r.reason)),
            Err(e) => {
                tracing::warn!(connection = %self.connection, error = %e,
                    "refused logins: the status cannot be read; going by this session's");
                None
            }
        }
    }

    async fn record(&self, fingerprint: &str, reason: Refusal) {
        let api: Api<MindUstorStorageConnection> = Api::all(self.client.clone());
        let refused = RefusedLogin {
            credentials_digest: fingerprint.to_owned(),
            reason: reason.as_str().to_owned(),
        };
        let patch = serde_json::json!({ "status": { "refusedLogin": refused } });
        let params = kube::api::PatchParams {
            field_manager: Some(self.field_manager.clone()),
            ..Default::default()
        };
        if let Err(e) = api
            .patch_status(&self.connection, &params, &kube::api::Patch::Merge(patch))
            .await
        {
            tracing::error!(connection = %self.connection, %reason, error = %e,
                "the refused login could not be kept in the status");
        }
    }
}

/// The outcome of one look at a connection.
#[derive(Debug, Clone, PartialEq)]
enum Verdict {
    /// Secrets or spec are wrong: no login attempted.
    Misconfigured(String),
    LoggedIn,
    Refused {
        reason: Refusal,
        message: String,
        /// The fingerprint of the credentials uStor refused (none when uStor did not
        /// answer, or the login failed otherwise).
        credentials: Option<String>,
    },
}

pub async fn reconcile(
    connection: Arc<MindUstorStorageConnection>,
    ctx: Arc<Context>,
) -> Result<Action, GlueError> {
    if connection.metadata.deletion_timestamp.is_some() {
        ctx.sessions.lock().remove(&connection.name_any());
        return Ok(Action::await_change());
    }
    let prepared = prepare(&connection, &ctx).await?;
    if !ctx.leader.is_leader() {
        // Sessions stay current on every replica; the status and the login checks are the
        // leader's.
        return Ok(Action::requeue(super::FOLLOWER_RECHECK));
    }
    let verdict = match prepared {
        Err(why) => Verdict::Misconfigured(why),
        Ok(prepared) => {
            login(
                &prepared,
                &connection.spec.control_plane.credentials_secret_name,
                &ctx,
            )
            .await
        }
    };
    let status = status_for(&connection, &verdict);
    super::write_status(&ctx, &*connection, connection.status.as_ref(), &status).await?;
    Ok(Action::requeue(CHECK_EVERY))
}

/// A connection's session, ready for a login.
struct Prepared {
    session: Arc<Session>,
    /// The Secrets' versions.
    versions: String,
    /// The credentials' fingerprint.
    credentials: String,
}

/// The connection's session with the Secrets' current credentials (and the refusal its
/// status records for them), and the Secrets' versions; `Ok(Err(reason))` when the spec or
/// the Secrets are wrong.
async fn prepare(
    connection: &MindUstorStorageConnection,
    ctx: &Context,
) -> Result<Result<Prepared, String>, GlueError> {
    let name = connection.name_any();
    let spec = &connection.spec;
    if let Some(first) = connection
        .status
        .as_ref()
        .and_then(|s| s.control_plane_address.as_ref())
    {
        if *first != spec.control_plane.address {
            return Ok(Err(format!(
                "controlPlane.address cannot be changed: the volumes of this connection are on {first}; \
                 set it back, or create another connection for another uStor cluster"
            )));
        }
    }
    let scheme = match check_address(
        &spec.control_plane.address,
        ctx.settings.allow_insecure_http,
    ) {
        Ok(scheme) => scheme,
        Err(reason) => return Ok(Err(reason)),
    };
    let ns = &ctx.settings.namespace;
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let credentials_secret = secrets
        .get_opt(&spec.control_plane.credentials_secret_name)
        .await?;
    let tls_secret = secrets.get_opt(&spec.data_plane.tls_secret_name).await?;
    let credentials = match secret_data(
        credentials_secret.as_ref(),
        ns,
        &spec.control_plane.credentials_secret_name,
        "spec.controlPlane.credentialsSecretName",
        &CREDENTIAL_KEYS,
    ) {
        Ok(data) => data,
        Err(reason) => return Ok(Err(reason)),
    };
    let tls = match secret_data(
        tls_secret.as_ref(),
        ns,
        &spec.data_plane.tls_secret_name,
        "spec.dataPlane.tlsSecretName",
        &TLS_KEYS,
    ) {
        Ok(data) => data,
        Err(reason) => return Ok(Err(reason)),
    };
    let versions = format!(
        "{}/{}",
        credentials_secret
            .and_then(|s| s.metadata.resource_version)
            .unwrap_or_default(),
        tls_secret
            .and_then(|s| s.metadata.resource_version)
            .unwrap_or_default()
    );
    let session = match session_for(
        ctx,
        &name,
        &spec.control_plane.address,
        scheme,
        &tls["ca.crt"],
    ) {
        Ok(session) => session,
        Err(reason) => return Ok(Err(reason)),
    };
    let fingerprint = credentials_digest(&ctx.key, &credentials).ok_or(GlueError::KeyNotLoaded)?;
    let pair = Credentials::new(
        text(&credentials, "username"),
        text(&credentials, "password"),
    );
    // Said on the connection before any login: uStor would refuse one and count it.
    if let Some(breach) = pair.policy_breach() {
        return Ok(Err(format!(
            "Secret {ns}/{} (spec.controlPlane.credentialsSecretName): {breach}; no login is tried \
             with it (uStor locks the user after 3 failed logins)",
            spec.control_plane.credentials_secret_name
        )));
    }
    session
        .credentials
        .set(pair.with_fingerprint(fingerprint.clone()));
    // What another replica, session or run was refused, this session knows before its next
    // login, whichever call asks for it.
    if let Some(refused) = connection
        .status
        .as_ref()
        .and_then(|s| s.refused_login.as_ref())
        .filter(|r| r.credentials_digest == fingerprint)
    {
        session
            .api
            .remember_refusal(&fingerprint, Refusal::from_code(&refused.reason))
            .await;
    }
    Ok(Ok(Prepared {
        session,
        versions,
        credentials: fingerprint,
    }))
}

/// Logs in when the rules say so: now if a Secret changed since the last attempt (the rules
/// still refuse another try with credentials uStor refused), else only when the hourly
/// check or a retry is due.
async fn login(prepared: &Prepared, secret: &str, ctx: &Context) -> Verdict {
    let session = &prepared.session;
    let changed = {
        let mut last = session
            .logged_in_with
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let changed = last.as_deref() != Some(prepared.versions.as_str());
        *last = Some(prepared.versions.clone());
        changed
    };
    let outcome = if changed {
        session.api.login().await
    } else {
        session.api.keepalive().await
    };
    let credentials = Some(prepared.credentials.clone());
    match (outcome, session.api.refusal().await) {
        (Ok(()), None) => Verdict::LoggedIn,
        (_, Some(Refusal::Unreachable)) => Verdict::Refused {
            reason: Refusal::Unreachable,
            message: format!(
                "uStor refused the login: {}: {}",
                Refusal::Unreachable,
                Refusal::Unreachable.advice()
            ),
            credentials: None,
        },
        (_, Some(reason)) => Verdict::Refused {
            reason,
            message: format!(
                "uStor refused the login: {reason}: {}; these credentials are not tried again until \
                 Secret {}/{secret} changes (uStor locks the user after 3 failed logins)",
                reason.advice(),
                ctx.settings.namespace
            ),
            credentials,
        },
        (Err(e), None) => Verdict::Refused {
            reason: Refusal::LoginRejected,
            message: e.to_string(),
            credentials: None,
        },
    }
}

/// `controlPlane.address` by the rule of [`check_url`].
fn check_address(address: &str, allow_http: bool) -> Result<Scheme, String> {
    check_url(address, allow_http).map_err(|_| {
        format!(
            "controlPlane.address {address:?} must be an https:// URL (the uStor password crosses the network)"
        )
    })
}

/// The connection's session, made anew when its address or CA changed.
fn session_for(
    ctx: &Context,
    name: &str,
    address: &str,
    scheme: Scheme,
    ca: &[u8],
) -> Result<Arc<Session>, String> {
    let mut sessions = ctx.sessions.lock();
    if let Some(s) = sessions.get(name) {
        if s.address == address && s.ca == ca {
            return Ok(Arc::clone(s));
        }
    }
    let credentials = Arc::new(SharedCredentials::default());
    let ca_pem = (scheme == Scheme::Https).then_some(ca);
    let mut api = UstorApi::new(
        address,
        ca_pem,
        Arc::clone(&credentials) as _,
        ctx.settings.login_timing,
        Arc::new(Instant::now),
    )
    .map_err(|e| format!("ca.crt of the TLS Secret: {e}"))?;
    if let Some(metrics) = &ctx.settings.backend_metrics {
        api = api.with_metrics(Arc::clone(metrics), name);
    }
    let api = api.with_refusals(Arc::new(StatusRecord {
        connection: name.to_owned(),
        client: ctx.client.clone(),
        field_manager: ctx.field_manager.clone(),
    }));
    let session = Arc::new(Session {
        api: Arc::new(api),
        credentials,
        address: address.to_owned(),
        ca: ca.to_owned(),
        logged_in_with: Mutex::new(None),
    });
    sessions.insert(name.to_owned(), Arc::clone(&session));
    Ok(session)
}

/// The status the verdict gives; transition times are kept while a condition holds, so an
/// unchanged connection writes nothing.
fn status_for(connection: &MindUstorStorageConnection, verdict: &Verdict) -> ConnectionStatus {
    let old = connection.status.clone().unwrap_or_default();
    let generation = connection.metadata.generation;
    let condition = |kind: &str, ok: bool, reason: &str, message: &str| {
        let status = if ok { "True" } else { "False" };
        let since = old
            .conditions
            .iter()
            .find(|c| c.type_ == kind && c.status == status && c.reason == reason)
            .map(|c| c.last_transition_time.clone())
            .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
        Condition {
            type_: kind.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message: message.to_owned(),
            last_transition_time: since,
            observed_generation: generation,
        }
    };
    let (phase, reason, conditions) = match verdict {
        Verdict::Misconfigured(why) => (
            Phase::Failed,
            Some(why.clone()),
            vec![
                condition("Ready", false, "Misconfigured", why),
                // Not tried: keep whatever the last login said.
                old.conditions
                    .iter()
                    .find(|c| c.type_ == "Authenticated")
                    .cloned()
                    .unwrap_or_else(|| {
                        condition(
                            "Authenticated",
                            false,
                            "NotTried",
                            "no login until the connection is configured",
                        )
                    }),
            ],
        ),
        Verdict::LoggedIn => (
            Phase::Created,
            None,
            vec![
                condition("Ready", true, "Ready", "secrets complete, login accepted"),
                condition(
                    "Authenticated",
                    true,
                    "LoggedIn",
                    "uStor accepted the login",
                ),
            ],
        ),
        Verdict::Refused {
            reason, message, ..
        } => (
            Phase::Failed,
            Some(message.clone()),
            vec![
                condition("Ready", false, "LoginRefused", message),
                condition("Authenticated", false, reason.as_str(), message),
            ],
        ),
    };
    // The first address served is the reference of the immutability check.
    let control_plane_address = old.control_plane_address.clone().or_else(|| match verdict {
        Verdict::Misconfigured(_) => None,
        _ => Some(connection.spec.control_plane.address.clone()),
    });
    // Refused credentials stay on record until a login with others succeeds.
    let refused_login = match verdict {
        Verdict::LoggedIn => None,
        Verdict::Refused {
            reason,
            credentials: Some(credentials),
            ..
        } => Some(RefusedLogin {
            credentials_digest: credentials.clone(),
            reason: reason.as_str().to_owned(),
        }),
        Verdict::Refused { .. } | Verdict::Misconfigured(_) => old.refused_login.clone(),
    };
    ConnectionStatus {
        phase: Some(phase),
        reason,
        conditions,
        control_plane_address,
        refused_login,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;

    fn secret(pairs: &[(&str, &str)]) -> Secret {
        Secret {
            data: Some(
                pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
                    .collect(),
            ),
            ..Secret::default()
        }
    }

    #[test]
    fn the_missing_secret_or_key_is_named() {
        let field = "spec.controlPlane.credentialsSecretName";
        let err = secret_data(None, "ns", "creds", field, &CREDENTIAL_KEYS).unwrap_err();
        assert_eq!(err, format!("Secret ns/creds ({field}) does not exist"));
        let only_user = secret(&[("username", "csi")]);
        let err =
            secret_data(Some(&only_user), "ns", "creds", field, &CREDENTIAL_KEYS).unwrap_err();
        assert!(err.ends_with("has no key password"), "{err}");
        let blank = secret(&[("username", "csi"), ("password", "\n")]);
        let err = secret_data(Some(&blank), "ns", "creds", field, &CREDENTIAL_KEYS).unwrap_err();
        assert!(err.starts_with("key password"), "{err}");
        let whole = secret(&[("username", "csi"), ("password", "S3cret@1")]);
        assert!(secret_data(Some(&whole), "ns", "creds", field, &CREDENTIAL_KEYS).is_ok());
    }

    #[test]
    fn credentials_are_named_by_a_keyed_digest_of_the_whole_secret() {
        let key = ControllerKey::from_bytes(&[3; 32]);
        let data = |pairs: &[(&str, &str)]| -> BTreeMap<String, Vec<u8>> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
                .collect()
        };
        let secret = data(&[("username", "csi"), ("password", "S3cret@1")]);
        let digest = credentials_digest(&key, &secret).unwrap();
        assert_eq!(digest.len(), 64);
        assert_eq!(
            credentials_digest(&key, &secret.clone()),
            Some(digest.clone())
        );
        for other in [
            data(&[("username", "csi"), ("password", "S3cret@2")]),
            data(&[
                ("username", "csi"),
                ("password", "S3cret@1"),
                ("retry", "1"),
            ]),
        ] {
            assert_ne!(credentials_digest(&key, &other), Some(digest.clone()));
        }
        let other_key = ControllerKey::from_bytes(&[4; 32]);
        assert_ne!(credentials_digest(&other_key, &secret), Some(digest));
        assert_eq!(credentials_digest(&ControllerKey::default(), &secret), None);
    }

    #[test]
    fn plain_http_needs_the_explicit_setting() {
        assert!(check_address("https://ustor:23004", false).is_ok());
        assert!(check_address("http://ustor:23004", false).is_err());
        assert!(check_address("http://ustor:23004", true).is_ok());
    }
}
