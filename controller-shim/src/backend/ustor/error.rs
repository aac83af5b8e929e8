//! What a call of the uStor management API can fail with. The first variants are the
//! contract's error table (`USTOR_API.md`, "Errors"), one per documented answer, each keeping
//! the HTTP status and uStor's code and message; the rest name the step that failed before
//! or after an answer.

use std::fmt;

use reqwest::{Method, StatusCode};

use super::credentials::CredentialsError;
use super::login::{Hold, Refusal};

/// One request to the management API, as messages name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiCall {
    pub method: Method,
    pub path: String,
}

impl fmt::Display for ApiCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.method, self.path)
    }
}

/// A non-2xx answer: its status, and the code and message of its error body (empty when the
/// body had none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiReply {
    pub call: ApiCall,
    pub status: u16,
    pub code: String,
    pub message: String,
}

impl fmt::Display for ApiReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "uStor {}: {} {}: {}",
            self.call, self.status, self.code, self.message
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UstorError {
    /// 400 `InvalidArgument`.
    #[error("{0}")]
    InvalidArgument(ApiReply),
    /// 401 (other than the `TokenExpired` that is retried once with a new login).
    #[error("{0}")]
    Unauthorized(ApiReply),
    /// 403 `Forbidden`.
    #[error("{0}")]
    Forbidden(ApiReply),
    /// 404 `NotFound`.
    #[error("{0}")]
    NotFound(ApiReply),
    /// 409 `AlreadyExists`.
    #[error("{0}")]
    AlreadyExists(ApiReply),
    /// 409 `HasDependents`, `InUse` (any 409 but `AlreadyExists`).
    #[error("{0}")]
    InUse(ApiReply),
    /// 429 `Busy`, 503 `Unavailable`: worth retrying.
    #[error("{0}")]
    Busy(ApiReply),
    /// 507 `NoSpace`.
    #[error("{0}")]
    NoSpace(ApiReply),
    /// Any other answer.
    #[error("backend: {0}")]
    Unexpected(ApiReply),

    /// No answer: the connection failed or timed out.
    #[error("uStor management API: {call}: {source}")]
    Unreachable {
        call: ApiCall,
        source: reqwest::Error,
    },
    /// A 2xx answer whose body is not what the contract says.
    #[error("backend: {call}: {source}")]
    BadAnswer {
        call: ApiCall,
        source: reqwest::Error,
    },
    #[error("{call}: token expired twice in a row")]
    TokenExpiredTwice { call: ApiCall },
    /// The login was refused (or not tried: the rules say wait), with uStor's reason.
    #[error("uStor refused the login: {reason} ({}){}", reason.advice(), held_note(*held))]
    LoginRefused {
        reason: Refusal,
        /// Set when the login was not even tried, saying for how long it holds.
        held: Option<Hold>,
    },
    #[error("backend: login answer: {0}")]
    LoginAnswer(#[source] reqwest::Error),
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error("uStor CA certificate: {0}")]
    CaCertificate(#[source] reqwest::Error),
    #[error(
        "backend: HTTP client: {0} (without a CA given, it trusts the system's CA certificates)"
    )]
    HttpClient(#[source] reqwest::Error),

    #[error("uStor image key {key:?} names no pool")]
    KeyWithoutPool { key: String },
    #[error(
        "the source lives in pool {source_pool:?}; a volume restored or cloned from it must use the same pool, not {pool:?}"
    )]
    SourceInOtherPool { source_pool: String, pool: String },
    #[error("the volumes of a group snapshot must share a pool; these are in pools {pools:?}")]
    GroupAcrossPools { pools: Vec<String> },
    #[error("uStor image {key} does not exist")]
    ImageMissing { key: String },
    #[error("backend: uStor answered the grant of {key} to {node} without a token")]
    NoGrantToken { key: String, node: String },
    #[error("backend: label {key} of a uStor image: {source}")]
    BadLabel {
        key: &'static str,
        source: serde_json::Error,
    },
    #[error("backend: label of a uStor image: {0}")]
    EncodeLabel(#[source] serde_json::Error),
}

fn held_note(held: Option<Hold>) -> String {
    match held {
        None => String::new(),
        Some(Hold::For(d)) => format!("; not retried for another {}s", d.as_secs()),
        Some(Hold::UntilChanged) => "; not retried with the same credentials until they change \
             (uStor locks the user after 3 failed logins)"
            .into(),
    }
}

impl UstorError {
    /// The contract's error table: which variant a non-2xx answer is.
    pub fn from_reply(reply: ApiReply) -> Self {
        match (reply.status, reply.code.as_str()) {
            (400, _) => UstorError::InvalidArgument(reply),
            (401, _) => UstorError::Unauthorized(reply),
            (403, _) => UstorError::Forbidden(reply),
            (404, _) => UstorError::NotFound(reply),
            (409, "AlreadyExists") => UstorError::AlreadyExists(reply),
            (409, _) => UstorError::InUse(reply),
            (429 | 503, _) => UstorError::Busy(reply),
            (507, _) => UstorError::NoSpace(reply),
            _ => UstorError::Unexpected(reply),
        }
    }

    /// The answer of `call` with `status` and its error body's code and message.
    pub fn answer(call: ApiCall, status: StatusCode, code: String, message: String) -> Self {
        Self::from_reply(ApiReply {
            call,
            status: status.as_u16(),
            code,
            message,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_documented_answer_is_its_own_variant() {
        type Is = fn(&UstorError) -> bool;
        let cases: [(u16, &str, Is); 10] = [
            (400, "InvalidArgument", |e| {
                matches!(e, UstorError::InvalidArgument(_))
            }),
            (401, "LoginRejected", |e| {
                matches!(e, UstorError::Unauthorized(_))
            }),
            (403, "Forbidden", |e| matches!(e, UstorError::Forbidden(_))),
            (404, "NotFound", |e| matches!(e, UstorError::NotFound(_))),
            (409, "AlreadyExists", |e| {
                matches!(e, UstorError::AlreadyExists(_))
            }),
            (409, "HasDependents", |e| matches!(e, UstorError::InUse(_))),
            (429, "Busy", |e| matches!(e, UstorError::Busy(_))),
            (503, "Unavailable", |e| matches!(e, UstorError::Busy(_))),
            (507, "NoSpace", |e| matches!(e, UstorError::NoSpace(_))),
            (500, "Oops", |e| matches!(e, UstorError::Unexpected(_))),
        ];
        for (status, code, is) in cases {
            let call = ApiCall {
                method: Method::GET,
                path: "/x".into(),
            };
            let e = UstorError::answer(
                call,
                StatusCode::from_u16(status).unwrap(),
                code.into(),
                "m".into(),
            );
            assert!(is(&e), "{status} {code}: {e:?}");
            let shown = e.to_string();
            assert!(
                shown.contains(code)
                    && shown.contains(&status.to_string())
                    && shown.contains("GET /x"),
                "{shown}"
            );
        }
    }
}
