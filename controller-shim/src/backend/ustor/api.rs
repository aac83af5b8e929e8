//! The client of the uStor management API, per `controller-shim/USTOR_API.md`: login under
//! the rules of [`LoginPolicy`] (with refusals remembered beyond the session where a
//! [`RefusalRecord`] keeps them), bearer tokens renewed on expiry, answers typed by the
//! contract's error table ([`UstorError`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use super::credentials::{CredentialSource, CredentialsError};
use super::error::{ApiCall, UstorError};
use super::login::{Decision, Hold, LoginPolicy, Refusal, Timing};

/// How the management API is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Https,
    Http,
}

/// Why a management API URL is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UrlRefusal {
    /// http:// without the explicit permission.
    PlainHttp,
    /// Neither https:// nor http://.
    NotHttp,
}

/// The management API carries the uStor password: https only, plain http only when
/// `allow_http` says so (test setups). One rule for the flag and for the connections.
pub fn check_url(url: &str, allow_http: bool) -> Result<Scheme, UrlRefusal> {
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("https://") {
        Ok(Scheme::Https)
    } else if lower.starts_with("http://") {
        if allow_http {
            Ok(Scheme::Http)
        } else {
            Err(UrlRefusal::PlainHttp)
        }
    } else {
        Err(UrlRefusal::NotHttp)
    }
}

/// The API's error body.
#[derive(Debug, Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Debug, Deserialize)]
struct ErrorDetail {
    code: String,
    #[serde(default)]
    message: String,
}

#[derive(Debug, Deserialize)]
struct Token {
    token: String,
}

#[derive(Debug)]
struct Session {
    policy: LoginPolicy,
    token: Option<String>,
}

/// A clock, injectable so the login rules are tested without waiting.
pub type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// Where the credentials uStor refused are remembered beyond one session, so that no
/// session, replica or restarted controller tries them again (in Kubernetes: the
/// connection's status). Credentials are named by their fingerprint only.
#[tonic::async_trait]
pub trait RefusalRecord: Send + Sync + std::fmt::Debug {
    /// Why credentials `fingerprint` were refused, if they were.
    async fn refused(&self, fingerprint: &str) -> Option<Refusal>;
    /// Remembers that uStor refused credentials `fingerprint` for `reason`.
    async fn record(&self, fingerprint: &str, reason: Refusal);
}

pub struct UstorApi {
    base: String,
    http: reqwest::Client,
    credentials: Arc<dyn CredentialSource>,
    session: Mutex<Session>,
    clock: Clock,
    /// The last login's outcome, readable without waiting (metrics scrapes).
    login_state: std::sync::Mutex<LoginState>,
    /// Where requests are counted, and the connection they are counted under.
    metrics: Option<(Arc<crate::metrics::BackendMetrics>, String)>,
    /// Where refusals are remembered beyond this session.
    refusals: Option<Arc<dyn RefusalRecord>>,
}

/// What the last login attempt gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginState {
    NotTried,
    LoggedIn,
    Refused(Refusal),
}

impl LoginState {
    pub fn as_str(self) -> &'static str {
        match self {
            LoginState::NotTried => "NotTried",
            LoginState::LoggedIn => "LoggedIn",
            LoginState::Refused(r) => r.as_str(),
        }
    }
}

impl std::fmt::Debug for UstorApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UstorApi")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl UstorApi {
    /// `base` is the management API's address (`https://host:port`); `ca_pem` the CA that
    /// signed its certificate, when it is not a public one.
    pub fn new(
        base: &str,
        ca_pem: Option<&[u8]>,
        credentials: Arc<dyn CredentialSource>,
        timing: Timing,
        clock: Clock,
    ) -> Result<Self, UstorError> {
        // One process-wide TLS provider; a second install is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(30));
        if let Some(pem) = ca_pem {
            let ca = reqwest::Certificate::from_pem(pem).map_err(UstorError::CaCertificate)?;
            builder = builder.tls_certs_only([ca]);
        } else if base.starts_with("http://") {
            // Plain HTTP trusts no certificate, so it needs no system trust store (which a
            // minimal host or guest may lack: the client would not build without one).
            builder = builder.tls_certs_only(std::iter::empty());
        }
        let http = builder.build().map_err(UstorError::HttpClient)?;
        Ok(Self {
            base: base.trim_end_matches('/').to_owned(),
            http,
            credentials,
            session: Mutex::new(Session {
                policy: LoginPolicy::new(timing),
                token: None,
            }),
            clock,
            login_state: std::sync::Mutex::new(LoginState::NotTried),
            metrics: None,
            refusals: None,
        })
    }

    /// Remembers refused credentials in `record` as well, and never tries credentials it
    /// names as refused.
    pub fn with_refusals(mut self, record: Arc<dyn RefusalRecord>) -> Self {
        self.refusals = Some(record);
        self
    }

    /// Counts this client's requests in `metrics` under `connection`.
    pub fn with_metrics(
        mut self,
        metrics: Arc<crate::metrics::BackendMetrics>,
        connection: &str,
    ) -> Self {
        self.metrics = Some((metrics, connection.to_owned()));
        self
    }

    pub fn login_state(&self) -> LoginState {
        *self.login_state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_login_state(&self, state: LoginState) {
        *self.login_state.lock().unwrap_or_else(|p| p.into_inner()) = state;
    }

    /// Logs in now if the rules allow it. The outcome is what the connection's Authenticated
    /// condition shows.
    pub async fn login(&self) -> Result<(), UstorError> {
        let mut session = self.session.lock().await;
        self.login_locked(&mut session).await
    }

    async fn login_locked(&self, session: &mut Session) -> Result<(), UstorError> {
        let credentials = self.credentials.read()?;
        if let Some(breach) = credentials.policy_breach() {
            session.token = None;
            return Err(CredentialsError::AgainstPolicy(breach).into());
        }
        let fingerprint = credentials.fingerprint();
        let now = (self.clock)();
        if let Some(record) = &self.refusals {
            if let Some(reason) = record.refused(&fingerprint).await {
                session.policy.remember(now, &fingerprint, reason);
            }
        }
        if let Decision::Wait { reason, hold } = session.policy.decide(now, &fingerprint) {
            if hold == Hold::UntilChanged {
                self.set_login_state(LoginState::Refused(reason));
            }
            return Err(UstorError::LoginRefused {
                reason,
                held: Some(hold),
            });
        }
        let body = serde_json::json!({"username": credentials.username, "password": credentials.password()});
        let outcome = match self
            .http
            .post(format!("{}/api/v1/auth/login", self.base))
            .json(&body)
            .send()
            .await
        {
            Err(e) => {
                tracing::warn!(error = %e, "uStor management API unreachable");
                Err(Refusal::Unreachable)
            }
            Ok(r) if r.status().is_success() => match r.json::<Token>().await {
                Ok(t) => {
                    session.token = Some(t.token);
                    Ok(())
                }
                Err(e) => return Err(UstorError::LoginAnswer(e)),
            },
            Ok(r) => {
                let code = r
                    .json::<ErrorBody>()
                    .await
                    .map(|b| b.error.code)
                    .unwrap_or_default();
                Err(Refusal::from_code(&code))
            }
        };
        session.policy.record(now, &fingerprint, outcome);
        self.set_login_state(match outcome {
            Ok(()) => LoginState::LoggedIn,
            Err(reason) => LoginState::Refused(reason),
        });
        if let (Err(reason), Some(record)) = (outcome, &self.refusals) {
            if reason != Refusal::Unreachable {
                record.record(&fingerprint, reason).await;
            }
        }
        match outcome {
            Ok(()) => {
                tracing::info!(user = %credentials.username, "logged in to uStor");
                Ok(())
            }
            Err(reason) => {
                session.token = None;
                tracing::error!(user = %credentials.username, %reason, advice = reason.advice(), "uStor refused the login");
                Err(UstorError::LoginRefused { reason, held: None })
            }
        }
    }

    /// The hourly login, and a retry of a refused one once the rules allow: run it every
    /// minute or so.
    pub async fn keepalive(&self) -> Result<(), UstorError> {
        let mut session = self.session.lock().await;
        if session.policy.check_due((self.clock)()) {
            session.token = None;
            self.login_locked(&mut session).await
        } else {
            Ok(())
        }
    }

    /// Takes in that uStor refused credentials `fingerprint` (seen by another session or
    /// replica, or before a restart): no login tries them.
    pub async fn remember_refusal(&self, fingerprint: &str, reason: Refusal) {
        self.session
            .lock()
            .await
            .policy
            .remember((self.clock)(), fingerprint, reason);
    }

    /// The last login refusal, if the last attempt was refused.
    pub async fn refusal(&self) -> Option<Refusal> {
        self.session.lock().await.policy.refusal()
    }

    /// One API call; logs in first if needed, and once more if the token expired. Counted
    /// by method and outcome (the gRPC code the status table maps it to, as for CSI calls).
    pub async fn call<T: DeserializeOwned, B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<Option<T>, UstorError> {
        let result = self.call_uncounted(method.clone(), path, body).await;
        if let Some((metrics, connection)) = &self.metrics {
            let outcome = match &result {
                Ok(_) => "Ok".to_owned(),
                Err(e) => format!("{:?}", crate::service::codes::ustor_code(e)),
            };
            metrics.count(connection, method.as_str(), outcome);
        }
        result
    }

    async fn call_uncounted<T: DeserializeOwned, B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<Option<T>, UstorError> {
        let call = || ApiCall {
            method: method.clone(),
            path: path.to_owned(),
        };
        for attempt in 0..2 {
            let token = {
                let mut session = self.session.lock().await;
                if session.token.is_none() {
                    self.login_locked(&mut session).await?;
                }
                session.token.clone().unwrap_or_default()
            };
            let mut req = self
                .http
                .request(method.clone(), format!("{}{path}", self.base))
                .bearer_auth(token);
            if let Some(b) = body {
                req = req.json(b);
            }
            let resp = req.send().await.map_err(|source| UstorError::Unreachable {
                call: call(),
                source,
            })?;
            let status = resp.status();
            if status.is_success() {
                if status == StatusCode::NO_CONTENT {
                    return Ok(None);
                }
                return resp
                    .json::<T>()
                    .await
                    .map(Some)
                    .map_err(|source| UstorError::BadAnswer {
                        call: call(),
                        source,
                    });
            }
            let detail = resp
                .json::<ErrorBody>()
                .await
                .map(|b| b.error)
                .unwrap_or(ErrorDetail {
                    code: String::new(),
                    message: String::new(),
                });
            if status == StatusCode::UNAUTHORIZED && detail.code == "TokenExpired" && attempt == 0 {
                self.session.lock().await.token = None;
                continue;
            }
            return Err(UstorError::answer(
                call(),
                status,
                detail.code,
                detail.message,
            ));
        }
        Err(UstorError::TokenExpiredTwice { call: call() })
    }
}
