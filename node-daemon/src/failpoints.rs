//! Crash points for the crash-safety tests.
//!
//! `USTOR_FAILPOINTS=stage-after-connect,unstage-after-unmount` makes the daemon abort (no
//! cleanup, no flush: like `kill -9`) when it reaches any of the named points. The points are
//! `fail::fail_point!` sites, compiled in only with the `failpoints` feature.

/// Environment variable naming the points to crash at.
pub const ENV: &str = "USTOR_FAILPOINTS";

/// Arms the points named in the environment. Returns their names (empty in production).
pub fn arm_from_env() -> Vec<String> {
    let Ok(list) = std::env::var(ENV) else {
        return Vec::new();
    };
    let names: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    for name in &names {
        let point = name.clone();
        let armed = fail::cfg_callback(name.clone(), move || {
            eprintln!("failpoint {point}: aborting");
            std::process::abort();
        });
        if let Err(e) = armed {
            eprintln!("failpoint {name}: {e}");
        }
    }
    names
}
