//! When to log in to the uStor management API, and when not to.
//!
//! From the product this driver replaces (its v0.2.0 notes and guide):
//! - a refused login names uStor's reason (UserLocked, PasswordExpired, TemporaryPassword,
//!   UserNotFound, LoginRejected), or Unreachable when uStor did not answer;
//! - a refused login is not retried with the same credentials until they change: three
//!   failures in a row lock the user for 15 minutes, and waiting does not make a wrong
//!   password right (the product retried after 5 minutes, so a typo in the Secret locked the
//!   user within 10). A refusal seen by another session, another replica or before a restart
//!   counts the same ([`LoginPolicy::remember`]);
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
    /// Retry pause after Unreachable.
    pub after_unreachable: Duration,
    /// Log in at least this often, even with nothing to do.
    pub keepalive: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            after_unreachable: Duration::from_secs(10),
            keepalive: Duration::from_secs(60 * 60),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Never,
    Accepted {
        at: Instant,
    },
    Refused {
        at: Instant,
        reason: Refusal,
        credentials: String,
    },
}

/// How long a refused login holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// uStor did not answer: tried again after this.
    For(Duration),
    /// uStor refused these credentials: not tried again until they change.
    UntilChanged,
}

/// The answer to "may I log in now?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Attempt,
    /// Not now: the last attempt with these credentials was refused for `reason`.
    Wait {
        reason: Refusal,
        hold: Hold,
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
    pub fn decide(&self, now: Instant, fingerprint: &str) -> Decision {
        match &self.state {
            State::Refused {
                at,
                reason: Refusal::Unreachable,
                ..
            } => {
                let pause = self.timing.after_unreachable;
                let since = now.saturating_duration_since(*at);
                if since < pause {
                    Decision::Wait {
                        reason: Refusal::Unreachable,
                        hold: Hold::For(pause - since),
                    }
                } else {
                    Decision::Attempt
                }
            }
            State::Refused {
                reason,
                credentials,
                ..
            } if credentials == fingerprint => Decision::Wait {
                reason: *reason,
                hold: Hold::UntilChanged,
            },
            // New credentials (the Secret changed): try them at once.
            State::Refused { .. } | State::Never | State::Accepted { .. } => Decision::Attempt,
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

    pub fn record(&mut self, now: Instant, fingerprint: &str, outcome: Result<(), Refusal>) {
        self.state = match outcome {
            Ok(()) => State::Accepted { at: now },
            Err(reason) => State::Refused {
                at: now,
                reason,
                credentials: fingerprint.to_owned(),
            },
        };
    }

    /// Takes in a refusal of credentials `fingerprint` seen elsewhere (another session or
    /// replica, or before a restart): they are not tried here either.
    pub fn remember(&mut self, now: Instant, fingerprint: &str, reason: Refusal) {
        let known = matches!(&self.state, State::Refused { credentials, reason: r, .. }
            if credentials == fingerprint && *r == reason);
        if !known {
            self.record(now, fingerprint, Err(reason));
        }
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

    const HELD: Decision = Decision::Wait {
        reason: Refusal::LoginRejected,
        hold: Hold::UntilChanged,
    };

    #[test]
    fn a_refused_password_is_not_retried_until_it_changes() {
        let t0 = Instant::now();
        let mut p = LoginPolicy::new(Timing::default());
        assert_eq!(p.decide(t0, "a"), Decision::Attempt);
        p.record(t0, "a", Err(Refusal::LoginRejected));
        for later in [MIN, 5 * MIN, 24 * 60 * MIN] {
            assert_eq!(p.decide(t0 + later, "a"), HELD, "{later:?} later");
        }
        assert_eq!(p.refusal(), Some(Refusal::LoginRejected));
    }

    #[test]
    fn a_refusal_seen_elsewhere_holds_here() {
        let t0 = Instant::now();
        let mut p = LoginPolicy::new(Timing::default());
        p.record(t0, "a", Ok(()));
        p.remember(t0, "a", Refusal::LoginRejected);
        assert_eq!(p.decide(t0, "a"), HELD);
        assert_eq!(p.decide(t0, "b"), Decision::Attempt);
    }

    #[test]
    fn new_credentials_are_tried_at_once() {
        let t0 = Instant::now();
        let mut p = LoginPolicy::new(Timing::default());
        p.record(t0, "a", Err(Refusal::PasswordExpired));
        assert_eq!(
            p.decide(t0 + Duration::from_secs(1), "b"),
            Decision::Attempt
        );
        p.record(t0 + Duration::from_secs(1), "b", Ok(()));
        assert_eq!(p.refusal(), None);
    }

    #[test]
    fn unreachable_is_retried_sooner_whatever_the_credentials() {
        let t0 = Instant::now();
        let mut p = LoginPolicy::new(Timing::default());
        p.record(t0, "a", Err(Refusal::Unreachable));
        assert_eq!(
            p.decide(t0 + Duration::from_secs(5), "a"),
            Decision::Wait {
                reason: Refusal::Unreachable,
                hold: Hold::For(Duration::from_secs(5)),
            }
        );
        assert_eq!(
            p.decide(t0 + Duration::from_secs(10), "a"),
            Decision::Attempt
        );
    }

    #[test]
    fn an_idle_controller_logs_in_every_hour() {
        let t0 = Instant::now();
        let mut p = LoginPolicy::new(Timing::default());
        assert!(p.check_due(t0), "before the first login");
        p.record(t0, "a", Ok(()));
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
