//! When to log in to the uStor management API, and when not to.
//!
//! From the product this driver replaces (its v0.2.0 notes and guide):
//! - a refused login names uStor's reason (UserLocked, PasswordExpired, TemporaryPassword,
//!   UserNotFound, LoginRejected), or Unreachable when uStor did not answer;
//! - a refused login is not retried with the same credentials for 5 minutes: three failures in
//!   a row lock the user for 15 minutes, so a typo in the Secret must not lock it in seconds;
//! - new credentials are tried at once;
//! - a login check runs every hour even when idle: uStor locks a user that has not logged in
//!   for 45 days.
//!
//! Pure decisions over an injected clock, so every rule is tested without waiting.

use std::fmt;
use std::time::{Duration, Instant};

/// Why uStor refused a login.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    UserLocked,
    PasswordExpired,
    TemporaryPassword,
    UserNotFound,
    LoginRejected,
    /// No answer from the management API: not the credentials' fault, retried sooner.
    Unreachable,
}

impl Refusal {
    /// The reason as uStor names it (the connection's Authenticated condition shows it).
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::UserLocked => "UserLocked",
            Refusal::PasswordExpired => "PasswordExpired",
            Refusal::TemporaryPassword => "TemporaryPassword",
            Refusal::UserNotFound => "UserNotFound",
            Refusal::LoginRejected => "LoginRejected",
            Refusal::Unreachable => "Unreachable",
        }
    }

    /// Parses the API's error code; an unknown code is a plain rejection.
    pub fn from_code(code: &str) -> Self {
        match code {
            "UserLocked" => Refusal::UserLocked,
            "PasswordExpired" => Refusal::PasswordExpired,
            "TemporaryPassword" => Refusal::TemporaryPassword,
            "UserNotFound" => Refusal::UserNotFound,
            _ => Refusal::LoginRejected,
        }
    }

    /// What the operator should do about it.
    pub fn advice(self) -> &'static str {
        match self {
            Refusal::UserLocked => "an administrator must unlock the uStor user",
            Refusal::PasswordExpired => {
                "change the password with ucli user-passwd and update the Secret"
            }
            Refusal::TemporaryPassword => {
                "log in once as the user, change the temporary password, update the Secret"
            }
            Refusal::UserNotFound => "create the uStor user or fix the user name in the Secret",
            Refusal::LoginRejected => "check the user name and password in the Secret",
            Refusal::Unreachable => "check the controlPlane address and the network to uStor",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Policy constants; the defaults are the product's.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// No second try with credentials uStor refused, for this long.
    pub after_refusal: Duration,
    /// Retry pause after Unreachable.
    pub after_unreachable: Duration,
    /// Log in at least this often, even with nothing to do.
    pub keepalive: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            after_refusal: Duration::from_secs(5 * 60),
            after_unreachable: Duration::from_secs(10),
            keepalive: Duration::from_secs(60 * 60),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Never,
    Accepted {
        at: Instant,
    },
    Refused {
        at: Instant,
        reason: Refusal,
        credentials: u64,
    },
}

/// The answer to "may I log in now?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Attempt,
    /// Not now: the last attempt with these credentials was refused for `reason`.
    Wait {
        reason: Refusal,
        retry_in: Duration,
    },
}

#[derive(Debug, Clone)]
pub struct LoginPolicy {
    timing: Timing,
    state: State,
}

impl LoginPolicy {
    pub fn new(timing: Timing) -> Self {
        Self {
            timing,
            state: State::Never,
        }
    }

    /// Whether a login with credentials `fingerprint` may be attempted at `now`.
    pub fn decide(&self, now: Instant, fingerprint: u64) -> Decision {
        match self.state {
            State::Refused {
                at,
                reason,
                credentials,
            } => {
                let pause = if reason == Refusal::Unreachable {
                    self.timing.after_unreachable
                } else if credentials != fingerprint {
                    // New credentials (the Secret changed): try them at once.
                    return Decision::Attempt;
                } else {
                    self.timing.after_refusal
                };
                let since = now.saturating_duration_since(at);
                if since < pause {
                    Decision::Wait {
                        reason,
                        retry_in: pause - since,
                    }
                } else {
                    Decision::Attempt
                }
            }
            State::Never | State::Accepted { .. } => Decision::Attempt,
        }
    }

    /// Whether the hourly check is due (also true before the first login).
    pub fn check_due(&self, now: Instant) -> bool {
        match self.state {
            State::Never => true,
            State::Accepted { at } => now.saturating_duration_since(at) >= self.timing.keepalive,
            State::Refused { .. } => true,
        }
    }

    pub fn record(&mut self, now: Instant, fingerprint: u64, outcome: Result<(), Refusal>) {
        self.state = match outcome {
            Ok(()) => State::Accepted { at: now },
            Err(reason) => State::Refused {
                at: now,
                reason,
                credentials: fingerprint,
            },
        };
    }

    /// The current refusal, if the last attempt was refused.
    pub fn refusal(&self) -> Option<Refusal> {
        match self.state {
            State::Refused { reason, .. } => Some(reason),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    #[test]
    fn a_refused_password_is_not_retried_for_five_minutes() {
        let t0 = Instant::now();
        let mut p = LoginPolicy::new(Timing::default());
        assert_eq!(p.decide(t0, 1), Decision::Attempt);
        p.record(t0, 1, Err(Refusal::LoginRejected));
        assert_eq!(
            p.decide(t0 + MIN, 1),
            Decision::Wait {
                reason: Refusal::LoginRejected,
                retry_in: 4 * MIN
            }
        );
        assert!(matches!(
            p.decide(t0 + 5 * MIN - Duration::from_secs(1), 1),
            Decision::Wait { .. }
        ));
        assert_eq!(p.decide(t0 + 5 * MIN, 1), Decision::Attempt);
        assert_eq!(p.refusal(), Some(Refusal::LoginRejected));
    }

    #[test]
    fn new_credentials_are_tried_at_once() {
        let t0 = Instant::now();
        let mut p = LoginPolicy::new(Timing::default());
        p.record(t0, 1, Err(Refusal::PasswordExpired));
        assert_eq!(p.decide(t0 + Duration::from_secs(1), 2), Decision::Attempt);
        p.record(t0 + Duration::from_secs(1), 2, Ok(()));
        assert_eq!(p.refusal(), None);
    }

    #[test]
    fn unreachable_is_retried_sooner_whatever_the_credentials() {
        let t0 = Instant::now();
        let mut p = LoginPolicy::new(Timing::default());
        p.record(t0, 1, Err(Refusal::Unreachable));
        assert!(matches!(
            p.decide(t0 + Duration::from_secs(5), 1),
            Decision::Wait {
                reason: Refusal::Unreachable,
                ..
            }
        ));
        assert_eq!(p.decide(t0 + Duration::from_secs(10), 1), Decision::Attempt);
    }

    #[test]
    fn an_idle_controller_logs_in_every_hour() {
        let t0 = Instant::now();
        let mut p = LoginPolicy::new(Timing::default());
        assert!(p.check_due(t0), "before the first login");
        p.record(t0, 1, Ok(()));
        assert!(!p.check_due(t0 + 59 * MIN));
        assert!(p.check_due(t0 + 60 * MIN));
    }

    #[test]
    fn reasons_are_named_as_ustor_names_them() {
        for r in [
            "UserLocked",
            "PasswordExpired",
            "TemporaryPassword",
            "UserNotFound",
        ] {
            assert_eq!(Refusal::from_code(r).as_str(), r);
        }
        assert_eq!(Refusal::from_code("Whatever"), Refusal::LoginRejected);
        assert!(!Refusal::UserLocked.advice().is_empty());
    }
}
