//! `ustor-csi-node preflight`: whether this host can serve volumes, checked before the
//! service is started (and by the package's postinst, as warnings only). Each check gives a
//! [`Finding`]; the exit code is the worst of them: 0 ready, 1 warnings only, 2 something
//! blocks volumes.
//!
//! Every check reads the host through [`Host`], whose paths tests point at a scratch tree.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nbd::sysfs::Sysfs;
use nbd::tls::TlsFiles;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::Serialize;

use crate::config::Settings;
use crate::device_budget::DeviceBudget;

/// A certificate that expires sooner than this is a warning: rotation should be under way.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(14 * 24 * 3600);

/// Fewer free nbd devices than this (with no `max-volumes` set) is a warning.
const FEW_DEVICES: u64 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    Ok,
    Warn,
    /// Volumes cannot be served (or some cannot) until this is fixed.
    Block,
}

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub check: &'static str,
    pub level: Level,
    pub detail: String,
}

impl Finding {
    fn new(check: &'static str, level: Level, detail: impl Into<String>) -> Self {
        Self {
            check,
            level,
            detail: detail.into(),
        }
    }
}

/// The findings of one run.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub findings: Vec<Finding>,
}

impl Report {
    pub fn worst(&self) -> Level {
        self.findings
            .iter()
            .map(|f| f.level)
            .max()
            .unwrap_or(Level::Ok)
    }

    /// 0 ready, 1 warnings only, 2 blocked.
    pub fn exit_code(&self) -> i32 {
        match self.worst() {
            Level::Ok => 0,
            Level::Warn => 1,
            Level::Block => 2,
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        for f in &self.findings {
            let tag = match f.level {
                Level::Ok => "ok   ",
                Level::Warn => "WARN ",
                Level::Block => "BLOCK",
            };
            out.push_str(&format!("{tag} {:<14} {}\n", f.check, f.detail));
        }
        out.push_str(match self.worst() {
            Level::Ok => "ready\n",
            Level::Warn => "ready, with warnings\n",
            Level::Block => "NOT ready: fix what BLOCK names\n",
        });
        out
    }
}

/// Where the checks look. [`Host::real`] is this machine.
#[derive(Debug, Clone)]
pub struct Host {
    /// `/sys/module`: a loaded (or built-in) module has a directory there.
    pub sys_module: PathBuf,
    pub sysfs: Sysfs,
    /// Asked `-n -q <module>` (a dry run) for a module that is not loaded.
    pub modprobe: PathBuf,
    /// `/sys/fs/selinux/enforce`.
    pub selinux_enforce: PathBuf,
    /// `/sys/kernel/security/apparmor/profiles`.
    pub apparmor_profiles: PathBuf,
    /// This program, whose SELinux label is checked.
    pub exe: PathBuf,
    /// Where the tools the daemon runs are looked for (`PATH`).
    pub path: Vec<PathBuf>,
    pub now: SystemTime,
}

impl Host {
    pub fn real() -> Self {
        Self {
            sys_module: "/sys/module".into(),
            sysfs: Sysfs::default(),
            modprobe: "modprobe".into(),
            selinux_enforce: "/sys/fs/selinux/enforce".into(),
            apparmor_profiles: "/sys/kernel/security/apparmor/profiles".into(),
            exe: std::env::current_exe().unwrap_or_else(|_| "/usr/bin/ustor-csi-node".into()),
            path: std::env::var_os("PATH")
                .map(|p| std::env::split_paths(&p).collect())
                .unwrap_or_default(),
            now: SystemTime::now(),
        }
    }
}

/// Every check but the export's (which needs the network: [`check_export`]).
pub fn run(host: &Host, settings: &Settings) -> Report {
    let mut findings = vec![Finding::new(
        "configuration",
        Level::Ok,
        format!("valid; node id {:?}", settings.node_id),
    )];
    findings.extend(modules(host, settings));
    findings.push(devices(host, settings));
    findings.push(kubelet_dir(settings));
    findings.push(state_dir(&settings.state_dir));
    findings.extend(security_modules(host));
    findings.extend(tools(host));
    findings.extend(tls(host, settings));
    Report { findings }
}

fn module_state(host: &Host, name: &str) -> Result<&'static str, String> {
    if host.sys_module.join(name).is_dir() {
        return Ok("loaded");
    }
    let out = std::process::Command::new(&host.modprobe)
        .args(["-n", "-q", name])
        .output()
        .map_err(|e| format!("running {}: {e}", host.modprobe.display()))?;
    if out.status.success() {
        Ok("loadable")
    } else {
        Err(format!(
            "neither loaded nor loadable (modprobe -n {name} failed{})",
            String::from_utf8_lossy(&out.stderr)
                .trim()
                .split('\n')
                .next()
                .filter(|l| !l.is_empty())
                .map(|l| format!(": {l}"))
                .unwrap_or_default()
        ))
    }
}

fn modules(host: &Host, settings: &Settings) -> Vec<Finding> {
    let tls_configured = settings.tls.is_some() || !settings.tls_profiles.is_empty();
    const NO_DIAG: &str =
        "the daemon cannot tell which connections are alive, nor cut them for an expansion";
    // (module, level when missing, what is lost without it)
    let wanted = [
        ("nbd", Level::Block, "no volume can attach"),
        (
            "tls",
            if tls_configured {
                Level::Block
            } else {
                Level::Warn
            },
            "nbds:// (TLS) exports cannot attach",
        ),
        ("inet_diag", Level::Warn, NO_DIAG),
        ("tcp_diag", Level::Warn, NO_DIAG),
    ];
    wanted
        .into_iter()
        .map(|(name, missing, lost)| match module_state(host, name) {
            Ok(state) => Finding::new("module", Level::Ok, format!("{name}: {state}")),
            Err(why) => Finding::new("module", missing, format!("{name}: {why}: {lost}")),
        })
        .collect()
}

/// How many more volumes the nbd driver can take ([`DeviceBudget`]).
fn devices(host: &Host, settings: &Settings) -> Finding {
    let Some(budget) = DeviceBudget::read(&host.sys_module, &host.sysfs) else {
        return Finding::new(
            "nbd devices",
            Level::Ok,
            "nbd not loaded yet: nbds_max is read from the packaged modprobe.d options at load",
        );
    };
    let detail = format!(
        "nbds_max={}: {} attached by this driver, {} by other tools, {} free",
        budget.nbds_max,
        budget.ours,
        budget.others,
        budget.free()
    );
    let wanted = settings
        .max_volumes
        .and_then(|m| u64::try_from(m).ok())
        .unwrap_or(FEW_DEVICES);
    if budget.for_this_driver() < wanted {
        Finding::new(
            "nbd devices",
            Level::Warn,
            format!(
                "{detail}; fewer than {wanted} usable (raise nbds_max in /etc/modprobe.d and reload nbd)"
            ),
        )
    } else {
        Finding::new("nbd devices", Level::Ok, detail)
    }
}

/// kubelet's directory, found through the paths the daemon serves on (a symlinked
/// /var/lib/kubelet is common and fine: it is resolved).
fn kubelet_dir(settings: &Settings) -> Finding {
    let Some(dir) = settings
        .registration_dir
        .as_deref()
        .or(settings.csi_socket.parent())
    else {
        return Finding::new("kubelet", Level::Warn, "no kubelet directory configured");
    };
    // plugins_registry or plugins/<driver>: kubelet's root is the directory above.
    let root = if settings.registration_dir.is_some() {
        dir.parent()
    } else {
        dir.parent().and_then(Path::parent)
    }
    .unwrap_or(dir);
    match std::fs::canonicalize(root) {
        Ok(real) if real.is_dir() => {
            let via = if real != root {
                format!(" (a symlink to {})", real.display())
            } else {
                String::new()
            };
            Finding::new("kubelet", Level::Ok, format!("{}{via}", root.display()))
        }
        Ok(real) => Finding::new(
            "kubelet",
            Level::Block,
            format!(
                "{} resolves to {}, not a directory",
                root.display(),
                real.display()
            ),
        ),
        Err(e) => Finding::new(
            "kubelet",
            Level::Block,
            format!(
                "{}: {e}: is kubelet installed, with this root directory (--root-dir)?",
                root.display()
            ),
        ),
    }
}

/// Written to only when it exists: a check (and the support bundle, which runs the checks)
/// creates nothing; the daemon makes the directory at its first start.
fn state_dir(dir: &Path) -> Finding {
    if !dir.exists() {
        return Finding::new(
            "state dir",
            Level::Ok,
            format!("{} not there yet: the daemon creates it", dir.display()),
        );
    }
    let probe = dir.join(".preflight");
    let result = std::fs::write(&probe, b"ok").and_then(|()| std::fs::remove_file(&probe));
    match result {
        Ok(()) => Finding::new(
            "state dir",
            Level::Ok,
            format!("{} writable", dir.display()),
        ),
        Err(e) => Finding::new(
            "state dir",
            Level::Block,
            format!(
                "{}: {e}: the attachment journal cannot be kept",
                dir.display()
            ),
        ),
    }
}

/// SELinux and AppArmor: the service must run unconfined or under a policy that allows nbd,
/// mounts and kubelet's directory (README, `preflight`).
fn security_modules(host: &Host) -> Vec<Finding> {
    let mut out = Vec::new();
    match std::fs::read_to_string(&host.selinux_enforce).map(|s| s.trim().to_owned()) {
        Err(_) => out.push(Finding::new("selinux", Level::Ok, "not enabled")),
        Ok(mode) if mode == "0" => out.push(Finding::new("selinux", Level::Ok, "permissive")),
        Ok(_) => {
            let label = xattr(&host.exe, "security.selinux");
            match label.as_deref() {
                Some(l) if l.contains(":bin_t:") => out.push(Finding::new(
                    "selinux",
                    Level::Ok,
                    format!("enforcing; {} is {l}: the service runs as unconfined_service_t", host.exe.display()),
                )),
                other => out.push(Finding::new(
                    "selinux",
                    Level::Warn,
                    format!(
                        "enforcing, and {} is labelled {}, not bin_t: systemd may confine the service; run restorecon -v {}",
                        host.exe.display(),
                        other.unwrap_or("(none)"),
                        host.exe.display()
                    ),
                )),
            }
        }
    }
    match std::fs::read_to_string(&host.apparmor_profiles) {
        Err(_) => out.push(Finding::new("apparmor", Level::Ok, "not enabled")),
        Ok(profiles) => {
            let name = host
                .exe
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            match profiles
                .lines()
                .find(|l| l.contains(&name) && l.contains("(enforce)"))
            {
                Some(p) => out.push(Finding::new(
                    "apparmor",
                    Level::Warn,
                    format!("profile {p} confines the daemon: it must allow /dev/nbd*, mount and netlink"),
                )),
                None => out.push(Finding::new(
                    "apparmor",
                    Level::Ok,
                    "enabled; no profile confines the daemon",
                )),
            }
        }
    }
    out
}

fn xattr(path: &Path, name: &str) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let c_name = std::ffi::CString::new(name).ok()?;
    let mut buf = [0u8; 256];
    // SAFETY: both strings are NUL-terminated and live across the call; the buffer's length is
    // passed with it, so the kernel writes no further.
    let n = unsafe {
        libc::getxattr(
            c_path.as_ptr(),
            c_name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    let n = usize::try_from(n).ok()?;
    Some(
        String::from_utf8_lossy(&buf[..n])
            .trim_end_matches('\0')
            .to_owned(),
    )
}

/// The programs the daemon runs: without mkfs.ext4, blkid or mount no filesystem volume
/// stages; without the XFS tools only XFS volumes fail.
fn tools(host: &Host) -> Vec<Finding> {
    let wanted = [
        ("blkid", Level::Block),
        ("mount", Level::Block),
        ("umount", Level::Block),
        ("mkfs.ext4", Level::Block),
        ("resize2fs", Level::Block),
        ("fsfreeze", Level::Block),
        ("mkfs.xfs", Level::Warn),
        ("xfs_growfs", Level::Warn),
    ];
    let missing: Vec<(&str, Level)> = wanted
        .into_iter()
        .filter(|(tool, _)| !host.path.iter().any(|d| d.join(tool).is_file()))
        .collect();
    if missing.is_empty() {
        return vec![Finding::new(
            "tools",
            Level::Ok,
            "mkfs, blkid, mount, resize and freeze tools found",
        )];
    }
    missing
        .into_iter()
        .map(|(tool, level)| {
            let package = if tool.contains("xfs") {
                "xfsprogs"
            } else if tool.contains("2fs") || tool.contains("ext4") {
                "e2fsprogs"
            } else {
                "util-linux / mount"
            };
            Finding::new(
                "tools",
                level,
                format!("{tool} not found in PATH (package {package})"),
            )
        })
        .collect()
}

/// Every TLS file set the configuration names: readable, parseable, in date, and the client
/// key the one of its certificate.
fn tls(host: &Host, settings: &Settings) -> Vec<Finding> {
    let mut sets: Vec<(String, &TlsFiles)> = Vec::new();
    if let Some(t) = &settings.tls {
        sets.push(("tls".into(), t));
    }
    for (name, t) in &settings.tls_profiles {
        sets.push((format!("tls-profile.{name}"), t));
    }
    sets.into_iter()
        .map(|(name, files)| match tls_files(host.now, files) {
            Ok(None) => Finding::new("tls", Level::Ok, format!("{name}: files valid")),
            Ok(Some(warning)) => Finding::new("tls", Level::Warn, format!("{name}: {warning}")),
            Err(why) => Finding::new("tls", Level::Block, format!("{name}: {why}")),
        })
        .collect()
}

/// `Ok(Some(_))` is a warning (expiry close), `Err` a set that cannot work.
fn tls_files(now: SystemTime, files: &TlsFiles) -> Result<Option<String>, String> {
    let mut warnings = Vec::new();
    let cas = certificates(&files.ca)?;
    for (i, ca) in cas.iter().enumerate() {
        if let Some(w) = validity(
            now,
            ca,
            &format!("{} (certificate {})", files.ca.display(), i + 1),
        )? {
            warnings.push(w);
        }
    }
    if let (Some(cert), Some(key)) = (&files.client_cert, &files.client_key) {
        let chain = certificates(cert)?;
        if let Some(w) = validity(now, &chain[0], &cert.display().to_string())? {
            warnings.push(w);
        }
        let der = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| format!("{}: not a PEM private key: {e}", key.display()))?;
        rustls::sign::CertifiedKey::from_der(chain, der, &rustls::crypto::ring::default_provider())
            .map_err(|e| {
                format!(
                    "{} and {} do not go together: {e}",
                    key.display(),
                    cert.display()
                )
            })?;
    }
    Ok((!warnings.is_empty()).then(|| warnings.join("; ")))
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

/// `Err` when out of date, `Ok(Some)` when it expires within [`EXPIRY_WARNING`].
fn validity(
    now: SystemTime,
    der: &CertificateDer<'_>,
    what: &str,
) -> Result<Option<String>, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
        .map_err(|e| format!("{what}: not an X.509 certificate: {e}"))?;
    let secs = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
    };
    let now = secs(now);
    let validity = cert.validity();
    let (from, until) = (
        validity.not_before.timestamp(),
        validity.not_after.timestamp(),
    );
    if now < from {
        return Err(format!("{what}: not valid before {}", validity.not_before));
    }
    if now > until {
        return Err(format!("{what}: expired {}", validity.not_after));
    }
    let left = Duration::from_secs(u64::try_from(until - now).unwrap_or(0));
    Ok((left < EXPIRY_WARNING).then(|| {
        format!(
            "{what} expires {} (in {} days)",
            validity.not_after,
            left.as_secs() / 86_400
        )
    }))
}

/// Dials `uri` with the configuration's TLS files and completes the NBD handshake, without the
/// kernel: says the export's size and flags, or why it is not reachable.
pub async fn check_export(
    settings: &Settings,
    raw_uri: &str,
    tls_profile: Option<&str>,
) -> Finding {
    let uri = match raw_uri.parse::<nbd::uri::NbdUri>() {
        Ok(u) => u,
        Err(e) => return Finding::new("export", Level::Block, format!("{raw_uri}: {e}")),
    };
    let tls = match settings.tls_for(tls_profile) {
        Ok(tls) => tls,
        Err(name) => {
            return Finding::new(
                "export",
                Level::Block,
                format!("no [tls-profile.{name}] in the configuration"),
            )
        }
    };
    let opts = nbd::dial::DialOptions {
        deadline: settings.dial_timeout,
        tls,
        ..Default::default()
    };
    match nbd::dial::dial_one(&uri, &opts).await {
        Ok((info, _socket)) => Finding::new(
            "export",
            Level::Ok,
            format!(
                "{uri}: {} bytes, {}{}",
                info.size,
                if info.read_only() {
                    "read-only"
                } else {
                    "writable"
                },
                info.tls.map(|t| format!(", TLS {t}")).unwrap_or_default()
            ),
        ),
        Err(e) => Finding::new("export", Level::Block, format!("{uri}: {e}")),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::ids::Identifier;
    use testkit::tls::TestPki;

    const DAY: Duration = Duration::from_secs(86_400);

    /// A host whose /sys is `root`, with `modules` loaded and `tools` on its PATH; modprobe
    /// loads nothing else.
    fn host(root: &Path, modules: &[&str], tools: &[&str]) -> Host {
        for m in modules {
            std::fs::create_dir_all(root.join("module").join(m)).unwrap();
        }
        let bin = root.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        for t in tools {
            std::fs::write(bin.join(t), "").unwrap();
        }
        std::fs::create_dir_all(root.join("block")).unwrap();
        Host {
            sys_module: root.join("module"),
            sysfs: Sysfs::new(root.join("block"), root.join("dev")),
            modprobe: "false".into(),
            selinux_enforce: root.join("selinux/enforce"),
            apparmor_profiles: root.join("apparmor/profiles"),
            exe: root.join("bin/ustor-csi-node"),
            path: vec![bin],
            now: SystemTime::now(),
        }
    }

    fn settings(root: &Path) -> Settings {
        let mut s = Settings::defaults("node-a".into());
        s.state_dir = root.join("state");
        let kubelet = root.join("kubelet");
        std::fs::create_dir_all(kubelet.join("plugins_registry")).unwrap();
        s.registration_dir = Some(kubelet.join("plugins_registry"));
        s.csi_socket = kubelet.join("plugins/driver/csi.sock");
        s
    }

    fn levels<'a>(report: &'a Report, check: &str) -> Vec<(Level, &'a str)> {
        report
            .findings
            .iter()
            .filter(|f| f.check == check)
            .map(|f| (f.level, f.detail.as_str()))
            .collect()
    }

    const ALL_TOOLS: &[&str] = &[
        "blkid",
        "mount",
        "umount",
        "mkfs.ext4",
        "resize2fs",
        "fsfreeze",
        "mkfs.xfs",
        "xfs_growfs",
    ];

    #[test]
    fn a_host_with_everything_is_ready() {
        let root = tempfile::tempdir().unwrap();
        let h = ready_host(root.path());
        let report = run(&h, &settings(root.path()));
        assert_eq!(report.exit_code(), 0, "{}", report.render());
        assert!(report.render().ends_with("ready\n"));
    }

    #[test]
    fn a_missing_module_blocks_or_warns_by_what_it_costs() {
        let root = tempfile::tempdir().unwrap();
        let h = host(root.path(), &["inet_diag", "tcp_diag"], ALL_TOOLS);
        let mut s = settings(root.path());
        let report = run(&h, &s);
        let modules = levels(&report, "module");
        assert_eq!(modules[0].0, Level::Block, "{modules:?}");
        assert!(modules[0].1.starts_with("nbd: neither loaded nor loadable"));
        // tls without any TLS configured only costs nbds:// exports.
        assert_eq!(modules[1].0, Level::Warn, "{modules:?}");
        assert_eq!(report.exit_code(), 2);

        // With TLS files configured, a missing tls module blocks those volumes.
        let pki = TestPki::new("preflight").unwrap();
        s.tls = Some(std::sync::Arc::new(TlsFiles {
            ca: pki.file("ca-cert.pem"),
            client_cert: None,
            client_key: None,
            server_name: None,
        }));
        let other = tempfile::tempdir().unwrap();
        let h = host(other.path(), &["nbd"], ALL_TOOLS);
        let report = run(&h, &s);
        let modules = levels(&report, "module");
        assert_eq!(modules[1], (Level::Block, modules[1].1), "{modules:?}");
        assert_eq!(modules[2].0, Level::Warn, "inet_diag: {modules:?}");

        // A module modprobe can load is as good as a loaded one.
        let bare = tempfile::tempdir().unwrap();
        let mut h = host(bare.path(), &[], ALL_TOOLS);
        h.modprobe = "true".into();
        let report = run(&h, &s);
        assert!(levels(&report, "module")
            .iter()
            .all(|(l, d)| *l == Level::Ok && d.ends_with("loadable")));
    }

    #[test]
    fn devices_held_by_other_tools_count_against_nbds_max() {
        let root = tempfile::tempdir().unwrap();
        let h = host(
            root.path(),
            &["nbd/parameters", "tls", "inet_diag", "tcp_diag"],
            ALL_TOOLS,
        );
        std::fs::write(root.path().join("module/nbd/parameters/nbds_max"), "4\n").unwrap();
        let block = root.path().join("block");
        let ours =
            Identifier::new_attachment("node-a", &crate::ids::VolumeId::parse("v1").unwrap())
                .unwrap();
        for (i, backend, size) in [
            (0, Some(ours.as_str()), "2048"),
            (1, Some("someone-else"), "2048"),
            (2, None, "2048"), // nbd-client: no identifier, but a size
            (3, None, "0"),
        ] {
            let dir = block.join(format!("nbd{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("size"), size).unwrap();
            if let Some(b) = backend {
                std::fs::write(dir.join("backend"), format!("{b}\n")).unwrap();
            }
        }
        let mut s = settings(root.path());
        s.max_volumes = Some(2);
        let report = run(&h, &s);
        assert_eq!(
            levels(&report, "nbd devices"),
            vec![(
                Level::Ok,
                "nbds_max=4: 1 attached by this driver, 2 by other tools, 1 free"
            )]
        );
        // Three volumes wanted, two devices left to this driver.
        s.max_volumes = Some(3);
        let report = run(&h, &s);
        let found = levels(&report, "nbd devices");
        assert_eq!(found[0].0, Level::Warn, "{found:?}");
        assert!(found[0].1.contains("fewer than 3 usable"), "{found:?}");
    }

    #[test]
    fn kubelets_directory_may_be_a_symlink_but_must_exist() {
        let root = tempfile::tempdir().unwrap();
        let h = ready_host(root.path());
        let mut s = settings(root.path());
        let real = root.path().join("data/kubelet");
        std::fs::create_dir_all(&real).unwrap();
        std::os::unix::fs::symlink(&real, root.path().join("linked")).unwrap();
        s.registration_dir = Some(root.path().join("linked/plugins_registry"));
        let report = run(&h, &s);
        let found = levels(&report, "kubelet");
        assert_eq!(found[0].0, Level::Ok, "{found:?}");
        assert!(found[0].1.contains("a symlink to"), "{found:?}");

        s.registration_dir = Some(root.path().join("nowhere/plugins_registry"));
        let report = run(&h, &s);
        assert_eq!(levels(&report, "kubelet")[0].0, Level::Block);
        assert_eq!(report.exit_code(), 2);
    }

    #[test]
    fn the_state_dir_is_probed_only_where_it_exists() {
        let root = tempfile::tempdir().unwrap();
        let h = ready_host(root.path());
        let s = settings(root.path());
        let report = run(&h, &s);
        assert_eq!(levels(&report, "state dir")[0].0, Level::Ok);
        assert!(!s.state_dir.exists(), "a check created the state directory");
        std::fs::write(&s.state_dir, "a file, not a directory").unwrap();
        let report = run(&h, &s);
        assert_eq!(levels(&report, "state dir")[0].0, Level::Block);
    }

    #[test]
    fn missing_tools_are_named_with_their_package() {
        let root = tempfile::tempdir().unwrap();
        let h = host(
            root.path(),
            &["nbd", "tls", "inet_diag", "tcp_diag"],
            &[
                "blkid",
                "mount",
                "umount",
                "mkfs.ext4",
                "resize2fs",
                "fsfreeze",
            ],
        );
        let report = run(&h, &settings(root.path()));
        let found = levels(&report, "tools");
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found
            .iter()
            .all(|(l, d)| *l == Level::Warn && d.contains("xfsprogs")));
        assert_eq!(report.exit_code(), 1);

        let mut h = host(root.path(), &[], &[]);
        h.path = vec![root.path().join("empty")];
        let report = run(&h, &settings(root.path()));
        assert!(levels(&report, "tools")
            .iter()
            .any(|(l, d)| *l == Level::Block && d.starts_with("mkfs.ext4")));
    }

    #[test]
    fn selinux_enforcing_warns_unless_the_binary_runs_unconfined() {
        let root = tempfile::tempdir().unwrap();
        let h = ready_host(root.path());
        std::fs::create_dir_all(root.path().join("selinux")).unwrap();
        std::fs::write(root.path().join("selinux/enforce"), "0").unwrap();
        let report = run(&h, &settings(root.path()));
        assert_eq!(levels(&report, "selinux"), vec![(Level::Ok, "permissive")]);
        std::fs::write(root.path().join("selinux/enforce"), "1").unwrap();
        let report = run(&h, &settings(root.path()));
        // The scratch binary carries no SELinux label.
        assert_eq!(levels(&report, "selinux")[0].0, Level::Warn);

        std::fs::create_dir_all(root.path().join("apparmor")).unwrap();
        std::fs::write(
            root.path().join("apparmor/profiles"),
            "/usr/bin/man (enforce)\nustor-csi-node (enforce)\n",
        )
        .unwrap();
        let report = run(&h, &settings(root.path()));
        let found = levels(&report, "apparmor");
        assert_eq!(found[0].0, Level::Warn, "{found:?}");
        assert!(found[0].1.contains("ustor-csi-node (enforce)"));
    }

    /// A host with every module and tool.
    fn ready_host(root: &Path) -> Host {
        host(root, &["nbd", "tls", "inet_diag", "tcp_diag"], ALL_TOOLS)
    }

    fn with_profile(root: &Path, files: TlsFiles) -> Settings {
        let mut s = settings(root);
        s.tls_profiles
            .insert("main".into(), std::sync::Arc::new(files));
        s
    }

    #[test]
    fn tls_files_must_parse_and_the_key_must_be_the_certificates() {
        let root = tempfile::tempdir().unwrap();
        let pki = TestPki::new("preflight").unwrap();
        let files = |cert: &str, key: &str| TlsFiles {
            ca: pki.file("ca-cert.pem"),
            client_cert: Some(pki.file(cert)),
            client_key: Some(pki.file(key)),
            server_name: None,
        };
        let h = ready_host(root.path());
        let report = run(
            &h,
            &with_profile(root.path(), files("client-cert.pem", "client-key.pem")),
        );
        assert_eq!(
            levels(&report, "tls"),
            vec![(Level::Ok, "tls-profile.main: files valid")]
        );

        let report = run(
            &h,
            &with_profile(root.path(), files("client-cert.pem", "server-key.pem")),
        );
        let found = levels(&report, "tls");
        assert_eq!(found[0].0, Level::Block, "{found:?}");
        assert!(found[0].1.contains("do not go together"), "{found:?}");

        std::fs::write(root.path().join("garbage.pem"), "not a certificate").unwrap();
        let mut broken = files("client-cert.pem", "client-key.pem");
        broken.ca = root.path().join("garbage.pem");
        let report = run(&h, &with_profile(root.path(), broken));
        let found = levels(&report, "tls");
        assert_eq!(found[0].0, Level::Block, "{found:?}");
        assert!(found[0].1.contains("no PEM certificate"), "{found:?}");

        let mut missing = files("client-cert.pem", "client-key.pem");
        missing.ca = root.path().join("absent.pem");
        let report = run(&h, &with_profile(root.path(), missing));
        assert_eq!(levels(&report, "tls")[0].0, Level::Block);
    }

    #[test]
    fn a_certificate_close_to_expiry_warns_and_an_expired_one_blocks() {
        let root = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["ca".to_owned()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2026, 1, 1);
        params.not_after = rcgen::date_time_ymd(2027, 1, 1);
        let ca = params.self_signed(&key).unwrap();
        let path = root.path().join("ca.pem");
        std::fs::write(&path, ca.pem()).unwrap();
        let s = with_profile(
            root.path(),
            TlsFiles {
                ca: path,
                client_cert: None,
                client_key: None,
                server_name: None,
            },
        );
        let until = SystemTime::UNIX_EPOCH + Duration::from_secs(1_798_761_600); // 2027-01-01
        let at = |now: SystemTime| {
            let mut h = ready_host(root.path());
            h.now = now;
            run(&h, &s)
                .findings
                .into_iter()
                .find(|f| f.check == "tls")
                .unwrap()
        };
        assert_eq!(at(until - 100 * DAY).level, Level::Ok);
        let soon = at(until - 3 * DAY);
        assert_eq!(soon.level, Level::Warn, "{soon:?}");
        assert!(soon.detail.contains("(in 3 days)"), "{soon:?}");
        let late = at(until + DAY);
        assert_eq!(late.level, Level::Block, "{late:?}");
        assert!(late.detail.contains("expired"), "{late:?}");
        assert_eq!(at(until - 400 * DAY).level, Level::Block, "not yet valid");
    }
}
