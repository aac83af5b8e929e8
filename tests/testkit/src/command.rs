//! Host commands a test runs and judges by their exit code and words (systemctl, dpkg, ctr).

use std::process::Command;

/// Runs a command; returns its exit code (-1 when killed) and what it printed, stdout then
/// stderr. Panics when it cannot be started.
pub fn run(program: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// [`run`], and a panic naming the command and its words when it does not exit 0.
pub fn ok(program: &str, args: &[&str]) -> String {
    let (code, out) = run(program, args);
    assert_eq!(code, 0, "{program} {args:?} exited {code}: {out}");
    out
}
