//! The uStor API client against the in-repo server that implements the contract: every login
//! outcome and its named reason, refused credentials never tried again, new credentials tried
//! at once, the hourly keep-alive login, token renewal, and API errors mapped to CSI codes.

#![allow(clippy::unwrap_used)] // a test fails by panicking

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use controller_shim::backend::ustor::api::UstorApi;
use controller_shim::backend::ustor::credentials::CredentialsDir;
use controller_shim::backend::ustor::error::UstorError;
use controller_shim::backend::ustor::login::Timing;
use controller_shim::service::codes::ustor_code;
use reqwest::Method;
use serde_json::{json, Value};
use testkit::fake_ustor::FakeUstor;
use tonic::Code;

const MIN: Duration = Duration::from_secs(60);

/// A clock the test moves by hand.
#[derive(Clone)]
struct TestClock(Arc<Mutex<Instant>>);

impl TestClock {
    fn new() -> Self {
        Self(Arc::new(Mutex::new(Instant::now())))
    }
    fn advance(&self, d: Duration) {
        *self.0.lock().unwrap() += d;
    }
}

fn secret(dir: &Path, user: &str, password: &str) {
    std::fs::write(dir.join("username"), user).unwrap();
    std::fs::write(dir.join("password"), password).unwrap();
}

fn client(server_url: &str, dir: &Path, clock: &TestClock) -> UstorApi {
    let c = clock.clone();
    UstorApi::new(
        server_url,
        None,
        Arc::new(CredentialsDir::new(dir)),
        Timing::default(),
        Arc::new(move || *c.0.lock().unwrap()),
    )
    .unwrap()
}

/// A server that knows the user `csi` by `password`, and a Secret that gives it `given`.
async fn known_user(password: &str, given: &str) -> (FakeUstor, tempfile::TempDir) {
    let server = FakeUstor::start().await.unwrap();
    server.set_user("csi", password, None);
    let dir = tempfile::tempdir().unwrap();
    secret(dir.path(), "csi", given);
    (server, dir)
}

#[tokio::test]
async fn every_refusal_is_named() {
    let server = FakeUstor::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    for reason in [
        "UserLocked",
        "PasswordExpired",
        "TemporaryPassword",
        "LoginRejected",
    ] {
        server.set_user("csi", "pw", Some(reason));
        secret(dir.path(), "csi", &format!("pw@{reason}"));
        let api = client(&server.url(), dir.path(), &TestClock::new());
        let err = api.login().await.unwrap_err();
        assert!(matches!(err, UstorError::LoginRefused { .. }), "{err}");
        assert_eq!(ustor_code(&err), Code::Unauthenticated);
        assert!(err.to_string().contains(reason), "{err}");
        assert!(!err.to_string().contains("invalid credentials"));
        assert!(
            !err.to_string().contains("pw@"),
            "the password never shows: {err}"
        );
    }
    secret(dir.path(), "nobody", "pw");
    let err = client(&server.url(), dir.path(), &TestClock::new())
        .login()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("UserNotFound"), "{err}");

    // Nothing listening: Unreachable, a retryable CSI code.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let err = client(&format!("http://{closed}"), dir.path(), &TestClock::new())
        .login()
        .await
        .unwrap_err();
    assert_eq!(ustor_code(&err), Code::Unavailable);
    assert!(err.to_string().contains("Unreachable"), "{err}");
}

#[tokio::test]
async fn refused_credentials_are_not_tried_again_until_they_change() {
    let (server, dir) = known_user("right", "typo").await;
    let clock = TestClock::new();
    let api = client(&server.url(), dir.path(), &clock);

    assert!(api.login().await.is_err());
    assert_eq!(server.logins(), 1);
    for _ in 0..5 {
        clock.advance(60 * MIN);
        let err = api.login().await.unwrap_err();
        assert!(err.to_string().contains("not retried"), "{err}");
        assert!(err.to_string().contains("until they change"), "{err}");
        api.keepalive().await.unwrap_err();
    }
    assert_eq!(
        server.logins(),
        1,
        "a typo must not lock the user: no retry, however long"
    );

    // The Secret is fixed: the new password is tried at once, without a restart.
    secret(dir.path(), "csi", "right");
    api.login().await.unwrap();
    assert_eq!(server.logins(), 2);
    assert_eq!(api.refusal().await, None);
}

#[tokio::test]
async fn an_idle_controller_logs_in_every_hour() {
    let (server, dir) = known_user("pw", "pw").await;
    let clock = TestClock::new();
    let api = client(&server.url(), dir.path(), &clock);
    api.keepalive().await.unwrap();
    assert_eq!(server.logins(), 1, "the first keep-alive logs in");
    clock.advance(59 * MIN);
    api.keepalive().await.unwrap();
    assert_eq!(server.logins(), 1);
    clock.advance(MIN);
    api.keepalive().await.unwrap();
    assert_eq!(server.logins(), 2, "an hour later, again");
}

#[tokio::test]
async fn api_errors_map_to_csi_codes_and_tokens_are_renewed() {
    let (server, dir) = known_user("pw", "pw").await;
    let api = client(&server.url(), dir.path(), &TestClock::new());

    let body = json!({"name": "k8s-pvc-1", "sizeBytes": 1u64 << 30, "source": null, "labels": {}});
    let created: Value = api
        .call(Method::POST, "/api/v1/pools/data/images", Some(&body))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(created["nbd"]["export"], "k8s-pvc-1");
    assert_eq!(server.logins(), 1, "logged in on first use");
    let err = api
        .call::<Value, _>(Method::POST, "/api/v1/pools/data/images", Some(&body))
        .await
        .unwrap_err();
    assert!(matches!(err, UstorError::AlreadyExists(_)), "{err}");
    assert_eq!(ustor_code(&err), Code::AlreadyExists);
    let err = api
        .call::<Value, Value>(Method::GET, "/api/v1/pools/data/images/k8s-missing", None)
        .await
        .unwrap_err();
    assert!(matches!(err, UstorError::NotFound(_)), "{err}");
    assert_eq!(ustor_code(&err), Code::NotFound);
    let err = api
        .call::<Value, _>(
            Method::PATCH,
            "/api/v1/pools/data/images/k8s-pvc-1",
            Some(&json!({"sizeBytes": 1})),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, UstorError::InvalidArgument(_)), "{err}");
    assert_eq!(ustor_code(&err), Code::InvalidArgument, "images only grow");

    server.expire_tokens();
    let image: Value = api
        .call::<Value, Value>(Method::GET, "/api/v1/pools/data/images/k8s-pvc-1", None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(image["sizeBytes"], 1u64 << 30);
    assert_eq!(
        server.logins(),
        2,
        "an expired token is renewed once, transparently"
    );
    let gone = api
        .call::<Value, Value>(Method::DELETE, "/api/v1/pools/data/images/k8s-pvc-1", None)
        .await
        .unwrap();
    assert!(gone.is_none(), "204 has no body");
}

#[tokio::test]
async fn requests_are_counted_by_outcome_and_the_login_state_is_exported() {
    use controller_shim::backend::ustor::api::LoginState;
    use controller_shim::metrics::{ControllerMetrics, LoginStates};

    let (server, dir) = known_user("pw", "pw").await;
    let figures = ControllerMetrics::default();
    let api = Arc::new(
        client(&server.url(), dir.path(), &TestClock::new())
            .with_metrics(Arc::clone(&figures.backend), "main"),
    );
    assert_eq!(api.login_state(), LoginState::NotTried);
    api.call::<Value, Value>(Method::GET, "/api/v1/pools/data", None)
        .await
        .unwrap();
    let missing = api
        .call::<Value, Value>(Method::GET, "/api/v1/pools/data/images/none", None)
        .await
        .unwrap_err();
    assert_eq!(ustor_code(&missing), Code::NotFound);
    assert_eq!(api.login_state(), LoginState::LoggedIn);
    let watched = Arc::clone(&api);
    let text = figures
        .with_collector(LoginStates(Box::new(move || {
            vec![("main".to_owned(), watched.login_state().as_str())]
        })))
        .render();
    for line in [
        r#"ustor_csi_controller_backend_requests_total{connection="main",method="GET",outcome="Ok"} 1"#,
        r#"ustor_csi_controller_backend_requests_total{connection="main",method="GET",outcome="NotFound"} 1"#,
        r#"ustor_csi_controller_login_state{connection="main",state="LoggedIn"} 1"#,
    ] {
        assert!(text.contains(line), "{line} missing from:\n{text}");
    }

    // A refused login shows uStor's reason.
    server.set_user("csi", "pw", Some("PasswordExpired"));
    server.expire_tokens();
    api.call::<Value, Value>(Method::GET, "/api/v1/pools/data", None)
        .await
        .unwrap_err();
    assert_eq!(
        api.login_state(),
        LoginState::Refused(controller_shim::backend::ustor::login::Refusal::PasswordExpired)
    );
}
