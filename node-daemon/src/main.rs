//! `ustor-csi-node`: `serve` runs the host service; `status` shows operators which /dev/nbdN
//! is which volume; `repair` cleans what status flags; `preflight` checks the host.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use node_daemon::config::{self, FileConfig, Settings};
use node_daemon::{failpoints, server, status};

#[derive(Debug, Parser)]
#[command(name = "ustor-csi-node", version, about = "ustor-nbd CSI node service")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Args)]
struct Common {
    /// TOML file with the same settings as the flags (flags win).
    #[arg(long, env = "USTOR_CSI_CONFIG", default_value = config::DEFAULT_CONFIG)]
    config: PathBuf,
    /// Where the attachment journal lives.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// This node's id (default: the host name).
    #[arg(long)]
    node_id: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve CSI Identity and Node on a unix socket for kubelet.
    Serve {
        #[command(flatten)]
        common: Common,
        /// unix:///path of the CSI socket.
        #[arg(long)]
        csi_endpoint: Option<String>,
        /// kubelet's plugins_registry directory.
        #[arg(long)]
        registration_dir: Option<PathBuf>,
        /// Do not register with kubelet (a registrar sidecar does it, or there is no kubelet).
        #[arg(long)]
        no_kubelet_registration: bool,
        /// Seconds I/O waits for a dead connection to be replaced before failing.
        #[arg(long)]
        dead_conn_timeout: Option<u64>,
        /// ip:port to serve Prometheus /metrics on ("" disables it).
        #[arg(long)]
        metrics_address: Option<String>,
        /// Log as JSON lines instead of text.
        #[arg(long)]
        log_json: bool,
    },
    /// Show every nbd device, whose it is, what uses it, and each disagreement between the
    /// journal, the kernel and the mount table. Exit code: 0 consistent, 1 problems shown,
    /// 2 the state could not be read.
    Status {
        #[command(flatten)]
        common: Common,
        /// The CSI socket, to tell whether the daemon runs.
        #[arg(long)]
        csi_endpoint: Option<String>,
        /// Machine-readable output (schema version in the `schema` field).
        #[arg(long)]
        json: bool,
    },
    /// Clean what `status` flags: stale mounts of gone volumes, unused devices carrying this
    /// node's identifier with no record, records of gone devices. Prints the plan; acts only
    /// with --apply, and only while the daemon is stopped.
    Repair {
        #[command(flatten)]
        common: Common,
        /// The CSI socket, to refuse while the daemon runs.
        #[arg(long)]
        csi_endpoint: Option<String>,
        /// Carry the plan out (default: print it only).
        #[arg(long)]
        apply: bool,
        /// Instead: disconnect this device (e.g. nbd7) that another tool attached, if nothing
        /// mounts or holds it. Needs no stopped daemon: the daemon never uses such a device.
        #[arg(long, value_name = "nbdN")]
        release: Option<String>,
    },
    /// Check that this host can serve volumes: kernel modules, nbd devices, kubelet's
    /// directory, SELinux/AppArmor, tools, the configuration and its TLS files. Exit code: 0
    /// ready, 1 warnings only, 2 something blocks volumes.
    Preflight {
        #[command(flatten)]
        common: Common,
        /// Also dial this export (nbd:// or nbds:// URI) and complete the NBD handshake.
        #[arg(long)]
        export: Option<String>,
        /// The [tls-profile.<name>] the export's TLS files come from (default: the top-level
        /// tls-* settings).
        #[arg(long, requires = "export")]
        tls_profile: Option<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Write one .tar.gz for support: status, recovery results, preflight, the service's
    /// journal, the configuration with secrets redacted, the kernel's nbd/TLS lines, metrics.
    SupportBundle {
        #[command(flatten)]
        common: Common,
        /// The CSI socket, to tell whether the daemon runs.
        #[arg(long)]
        csi_endpoint: Option<String>,
        /// Where to write it (default: ustor-csi-node-support-<node>-<time>.tar.gz here).
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
    /// Print the manual page (roff), as the packages install it.
    #[command(hide = true)]
    Manpage,
}

fn settings(common: &Common) -> Result<Settings> {
    let explicit = common.config.as_os_str() != config::DEFAULT_CONFIG;
    let mut s = Settings::defaults(config::host_name());
    s.apply_file(FileConfig::load(&common.config, explicit)?)?;
    if let Some(d) = &common.state_dir {
        s.state_dir = d.clone();
    }
    if let Some(n) = &common.node_id {
        s.node_id = n.clone();
    }
    Ok(s)
}

/// `repair`: plan from `status`, print, and with `apply` act (daemon stopped only, except for
/// the release of another tool's device).
fn repair(
    common: &Common,
    csi_endpoint: Option<String>,
    apply: bool,
    release: Option<String>,
) -> Result<()> {
    let mut s = settings(common)?;
    if let Some(e) = csi_endpoint {
        s.csi_socket = config::unix_path(&e)?;
    }
    let sysfs = nbd::sysfs::Sysfs::default();
    let st = status::collect(&s.state_dir, &s.node_id, &s.csi_socket, &sysfs)?;
    if let Some(name) = release {
        let name = name.trim_start_matches("/dev/");
        let action = node_daemon::repair::plan_release(&st, name)
            .map_err(|why| anyhow::anyhow!("not releasing {name}: {why}"))?;
        println!("{}{action}", if apply { "" } else { "would " });
        if !apply {
            println!("(dry run: --apply carries this out)");
            return Ok(());
        }
        let done = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(node_daemon::repair::apply(&[action], &s.state_dir, &sysfs))?;
        for line in done {
            println!("{line}");
        }
        return Ok(());
    }
    let plan = node_daemon::repair::plan(&st);
    if plan.is_empty() {
        println!("nothing to repair");
        return Ok(());
    }
    for action in &plan {
        println!("{}{action}", if apply { "" } else { "would " });
    }
    if !apply {
        println!("(dry run: --apply carries this out)");
        return Ok(());
    }
    anyhow::ensure!(
        !st.daemon_running,
        "the node daemon is running: stop it first (systemctl stop ustor-csi-node), repair must not race it"
    );
    // Held while the plan is carried out: a daemon started meanwhile waits for it.
    let _state_lock = node_daemon::state_lock::StateLock::try_take(&s.state_dir)?;
    let done = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(node_daemon::repair::apply(&plan, &s.state_dir, &sysfs))?;
    for line in done {
        println!("{line}");
    }
    Ok(())
}

/// `preflight`: every check, then the export's if asked; exits with the worst finding.
fn preflight(
    common: &Common,
    export: Option<String>,
    tls_profile: Option<String>,
    json: bool,
) -> Result<()> {
    use node_daemon::preflight::{self, Finding, Level, Report};
    let report = match settings(common) {
        Ok(s) => {
            let mut report = preflight::run(&preflight::Host::real(), &s);
            if let Some(uri) = export {
                let finding = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
                    .block_on(preflight::check_export(&s, &uri, tls_profile.as_deref()));
                report.findings.push(finding);
            }
            report
        }
        Err(e) => Report {
            findings: vec![Finding {
                check: "configuration",
                level: Level::Block,
                detail: format!("{e:#}"),
            }],
        },
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    std::process::exit(report.exit_code());
}

fn init_logging(json: bool) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    if !json {
        if let Some(journal) = journal() {
            use tracing_subscriber::layer::SubscriberExt;
            use tracing_subscriber::util::SubscriberInitExt;
            tracing_subscriber::registry()
                .with(filter)
                .with(journal)
                .init();
            return;
        }
    }
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Under systemd (stderr connected to the journal), log through the journal's native protocol:
/// every span and event field becomes a journal field (`VOLUME_ID`, `DEVICE`, `OP`), so
/// `journalctl -u ustor-csi-node VOLUME_ID=<id>` shows one volume's whole history.
fn journal() -> Option<tracing_journald::Layer> {
    std::env::var_os("JOURNAL_STREAM")?;
    let layer = tracing_journald::layer().ok()?;
    Some(
        layer
            .with_field_prefix(None)
            .with_syslog_identifier("ustor-csi-node".into()),
    )
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Serve {
            common,
            csi_endpoint,
            registration_dir,
            no_kubelet_registration,
            dead_conn_timeout,
            metrics_address,
            log_json,
        } => {
            init_logging(log_json);
            let armed = failpoints::arm_from_env().map_err(|e| anyhow::anyhow!(e))?;
            if !armed.is_empty() {
                tracing::warn!(?armed, "crash points armed (test build)");
            }
            let mut s = settings(&common)?;
            if let Some(e) = csi_endpoint {
                s.csi_socket = config::unix_path(&e)?;
            }
            if let Some(d) = registration_dir {
                s.registration_dir = Some(d);
            }
            if no_kubelet_registration {
                s.registration_dir = None;
            }
            if let Some(t) = dead_conn_timeout {
                s.dead_conn_timeout = std::time::Duration::from_secs(t);
            }
            if let Some(a) = metrics_address {
                s.metrics_address = config::metrics_address(&a)?;
            }
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(server::run(s))?;
            Ok(())
        }
        Command::Repair {
            common,
            csi_endpoint,
            apply,
            release,
        } => repair(&common, csi_endpoint, apply, release),
        Command::Preflight {
            common,
            export,
            tls_profile,
            json,
        } => preflight(&common, export, tls_profile, json),
        Command::SupportBundle {
            common,
            csi_endpoint,
            output,
        } => {
            let mut s = settings(&common)?;
            if let Some(e) = csi_endpoint {
                s.csi_socket = config::unix_path(&e)?;
            }
            let host = node_daemon::preflight::Host::real();
            let files =
                node_daemon::support_bundle::collect(&node_daemon::support_bundle::Sources {
                    settings: &s,
                    config_file: &common.config,
                    host: &host,
                });
            let out =
                output.unwrap_or_else(|| node_daemon::support_bundle::default_name(&s.node_id));
            node_daemon::support_bundle::write(&files, &out)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", out.display()))?;
            println!("{}", out.display());
            Ok(())
        }
        Command::Manpage => {
            use clap::CommandFactory;
            clap_mangen::Man::new(Cli::command())
                .section("8")
                .render(&mut std::io::stdout())?;
            Ok(())
        }
        Command::Status {
            common,
            csi_endpoint,
            json,
        } => {
            let collected = settings(&common).and_then(|mut s| {
                if let Some(e) = csi_endpoint {
                    s.csi_socket = config::unix_path(&e)?;
                }
                Ok(status::collect(
                    &s.state_dir,
                    &s.node_id,
                    &s.csi_socket,
                    &nbd::sysfs::Sysfs::default(),
                )?)
            });
            let st = match collected {
                Ok(st) => st,
                Err(e) => {
                    eprintln!("ustor-csi-node status: cannot read the node's state: {e:#}");
                    std::process::exit(2);
                }
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&st)?);
            } else {
                print!("{}", status::render(&st));
            }
            if st.problem_count() > 0 {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}
