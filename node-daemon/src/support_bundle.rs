//! `ustor-csi-node support-bundle`: one gzipped tarball with what a support engineer asks for
//! first — `status --json`, the last recovery's results, the preflight, the service's journal,
//! the configuration (secrets redacted), the kernel's nbd/TLS/block lines, the nbd module's
//! parameters and the daemon's metrics. Read-only, like `status`; each part that cannot be
//! collected is replaced by a note saying why, so a bundle is always made.
//!
//! What never goes in: key files, NodeStage secrets, anything under the state directory but
//! the recovery report and the journal's records.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::config::Settings;
use crate::preflight;
use crate::recovery::REPORT_FILE;
use crate::status;

/// What a bundle is made from: the settings, and where the configuration file is.
#[derive(Debug)]
pub struct Sources<'a> {
    pub settings: &'a Settings,
    pub config_file: &'a Path,
    pub host: &'a preflight::Host,
}

/// The bundle's files, in order: (name inside the archive, contents).
pub fn collect(src: &Sources<'_>) -> Vec<(String, Vec<u8>)> {
    let s = src.settings;
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    let mut add = |name: &str, data: Vec<u8>| files.push((name.to_owned(), data));

    add(
        "version.txt",
        format!(
            "ustor-csi-node {}\nkernel {}\nnode id {}\n",
            env!("CARGO_PKG_VERSION"),
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim(),
            s.node_id
        )
        .into_bytes(),
    );
    match status::collect(&s.state_dir, &s.node_id, &s.csi_socket, &src.host.sysfs) {
        Ok(st) => add(
            "status.json",
            serde_json::to_vec_pretty(&st).unwrap_or_else(|e| e.to_string().into_bytes()),
        ),
        Err(e) => add("status.error.txt", format!("status: {e}\n").into_bytes()),
    }
    match std::fs::read(s.state_dir.join(REPORT_FILE)) {
        Ok(report) => add("recovery.json", report),
        Err(e) => add(
            "recovery.missing.txt",
            format!("{}: {e}\n", s.state_dir.join(REPORT_FILE).display()).into_bytes(),
        ),
    }
    add(
        "preflight.txt",
        preflight::run(src.host, s).render().into_bytes(),
    );
    add("config.toml", redacted_config(src.config_file).into_bytes());
    add(
        "journal.txt",
        command_output(
            "journalctl",
            &[
                "-u",
                "ustor-csi-node",
                "-n",
                "5000",
                "--no-pager",
                "-o",
                "short-iso",
            ],
        ),
    );
    add("kernel.txt", kernel_lines());
    add(
        "nbd-parameters.txt",
        module_parameters(&src.host.sys_module),
    );
    if let Some(addr) = s.metrics_address {
        add("metrics.txt", scrape(addr));
    }
    files
}

/// Writes the bundle to `out` (mode 0600: it names hosts, exports and volumes).
pub fn write(files: &[(String, Vec<u8>)], out: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)?;
    let gz = flate2::write::GzEncoder::new(file, flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    let top = out
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".tar.gz"))
        .unwrap_or("support-bundle")
        .to_owned();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for (name, data) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o600);
        header.set_mtime(now);
        tar.append_data(&mut header, format!("{top}/{name}"), data.as_slice())?;
    }
    tar.into_inner()?.finish()?.flush()
}

/// The default file name: host and time, so bundles of several nodes do not collide.
pub fn default_name(node_id: &str) -> PathBuf {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    PathBuf::from(format!("ustor-csi-node-support-{node_id}-{now}.tar.gz"))
}

/// A key whose value is a secret by its name.
fn secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["password", "secret", "token", "passphrase", "private"]
        .iter()
        .any(|s| k.contains(s))
}

/// The configuration file as TOML with every secret-named value replaced. Keys the daemon does
/// not know are kept (they are what an operator got wrong), redacted all the same.
pub fn redacted_config(path: &Path) -> String {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => return format!("# {}: {e}\n", path.display()),
    };
    match text.parse::<toml::Table>() {
        Ok(mut table) => {
            redact(&mut table);
            format!(
                "# {} (secret-named values redacted)\n{}",
                path.display(),
                toml::to_string(&table).unwrap_or_default()
            )
        }
        // Not TOML: no value can be told from a key, so no line is shown.
        Err(e) => format!(
            "# {}: not valid TOML, contents left out: {}\n",
            path.display(),
            e.message()
        ),
    }
}

fn redact(table: &mut toml::Table) {
    for (key, value) in table.iter_mut() {
        match value {
            toml::Value::Table(t) => redact(t),
            v if secret_key(key) => *v = toml::Value::String("<redacted>".into()),
            toml::Value::String(s) if s.contains("PRIVATE KEY") => {
                *s = "<redacted>".into();
            }
            _ => {}
        }
    }
}

fn command_output(program: &str, args: &[&str]) -> Vec<u8> {
    match Command::new(program).args(args).output() {
        Ok(out) => {
            let mut text = out.stdout;
            if !out.status.success() {
                text.extend_from_slice(format!("\n# {program} exited {}: ", out.status).as_bytes());
                text.extend_from_slice(&out.stderr);
            }
            text
        }
        Err(e) => format!("# {program}: {e}\n").into_bytes(),
    }
}

/// The kernel log's lines about nbd, TLS and block I/O errors.
fn kernel_lines() -> Vec<u8> {
    // No options: busybox's dmesg (minimal hosts, the test guest) takes none of util-linux's.
    let log = command_output("dmesg", &[]);
    let text = String::from_utf8_lossy(&log);
    let wanted = [
        "nbd",
        "tls",
        "I/O error",
        "blk_update_request",
        "EXT4-fs",
        "XFS",
    ];
    let mut out: String = text
        .lines()
        .filter(|l| l.starts_with("# ") || wanted.iter().any(|w| l.contains(w)))
        .map(|l| format!("{l}\n"))
        .collect();
    if out.is_empty() {
        out = "# no nbd, TLS or block I/O lines in the kernel log\n".into();
    }
    out.into_bytes()
}

fn module_parameters(sys_module: &Path) -> Vec<u8> {
    let dir = sys_module.join("nbd/parameters");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return format!("# {}: nbd not loaded\n", dir.display()).into_bytes();
    };
    let mut lines: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|e| {
            let value = std::fs::read_to_string(e.path()).unwrap_or_default();
            format!("{}={}\n", e.file_name().to_string_lossy(), value.trim())
        })
        .collect();
    lines.sort();
    lines.concat().into_bytes()
}

/// The daemon's own /metrics, over plain HTTP/1.0 on the configured address.
fn scrape(addr: std::net::SocketAddr) -> Vec<u8> {
    let attempt = || -> std::io::Result<Vec<u8>> {
        let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response)?;
        Ok(response)
    };
    attempt().unwrap_or_else(|e| format!("# {addr}: {e} (is the daemon running?)\n").into_bytes())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn secret_values_are_redacted_wherever_they_sit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.toml");
        std::fs::write(
            &path,
            "node-id = \"n1\"\nuStor-Password = \"hunter2\"\n[tls-profile.main]\nca-file = \"/etc/ca.pem\"\nkey-token = \"tok-123\"\ninline = \"-----BEGIN PRIVATE KEY-----\\nabc\"\n",
        )
        .unwrap();
        let out = redacted_config(&path);
        assert!(out.contains("node-id = \"n1\""), "{out}");
        assert!(out.contains("ca-file = \"/etc/ca.pem\""), "{out}");
        for secret in ["hunter2", "tok-123", "BEGIN PRIVATE KEY"] {
            assert!(!out.contains(secret), "{secret} leaked: {out}");
        }
        assert_eq!(out.matches("<redacted>").count(), 3, "{out}");

        std::fs::write(&path, "password = hunter2 not toml").unwrap();
        let out = redacted_config(&path);
        assert!(!out.contains("hunter2"), "{out}");
        assert!(out.contains("not valid TOML"), "{out}");
    }

    #[test]
    fn a_bundle_holds_every_part_and_no_key_file() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("client.key");
        std::fs::write(&key, "KEY-MATERIAL-THAT-MUST-NOT-LEAK").unwrap();
        let config = dir.path().join("node.toml");
        std::fs::write(
            &config,
            format!(
                "tls-ca-file = \"{0}\"\ntls-cert-file = \"{0}\"\ntls-key-file = \"{1}\"\n",
                dir.path().join("ca.pem").display(),
                key.display()
            ),
        )
        .unwrap();
        let mut settings = Settings::defaults("node-b".into());
        settings.state_dir = dir.path().join("state");
        std::fs::create_dir_all(settings.state_dir.join("volumes")).unwrap();
        std::fs::write(settings.state_dir.join(REPORT_FILE), "{\"records\":0}").unwrap();
        settings.csi_socket = dir.path().join("csi.sock");
        settings.metrics_address = None;
        let mut host = preflight::Host::real();
        host.sys_module = dir.path().join("module");
        host.sysfs = nbd::sysfs::Sysfs::new(dir.path().join("block"), dir.path().join("dev"));
        std::fs::create_dir_all(dir.path().join("block")).unwrap();
        let files = collect(&Sources {
            settings: &settings,
            config_file: &config,
            host: &host,
        });
        let out = dir.path().join("bundle.tar.gz");
        write(&files, &out).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&out).unwrap().permissions().mode() & 0o777,
            0o600
        );

        let mut names = Vec::new();
        let mut all = Vec::new();
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(
            std::fs::File::open(&out).unwrap(),
        ));
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            names.push(entry.path().unwrap().display().to_string());
            entry.read_to_end(&mut all).unwrap();
        }
        for part in [
            "bundle/version.txt",
            "bundle/status.json",
            "bundle/recovery.json",
            "bundle/preflight.txt",
            "bundle/config.toml",
            "bundle/journal.txt",
            "bundle/kernel.txt",
            "bundle/nbd-parameters.txt",
        ] {
            assert!(names.iter().any(|n| n == part), "{part} missing: {names:?}");
        }
        let text = String::from_utf8_lossy(&all);
        assert!(
            text.contains("\"node_id\": \"node-b\""),
            "status.json: {text}"
        );
        assert!(text.contains("{\"records\":0}"), "recovery.json");
        assert!(
            text.contains("tls-key-file"),
            "the config names the key file"
        );
        assert!(
            !text.contains("KEY-MATERIAL-THAT-MUST-NOT-LEAK"),
            "a key file went in"
        );
        // A second bundle never overwrites the first.
        assert!(write(&files, &out).is_err());
    }
}
