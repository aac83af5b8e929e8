//! `ustor-csi-controller serve`: the CSI controller for external-provisioner, -attacher,
//! -resizer and -snapshotter.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};
use controller_shim::backend::local::LocalBackend;
use controller_shim::exports::ExportServer;
use controller_shim::ids::valid_cluster_id;

#[derive(Debug, Parser)]
#[command(version, about = "ustor-nbd CSI controller")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendKind {
    Local,
}

#[derive(Debug, Subcommand)]
enum Command {
    Serve {
        /// unix:///path of the CSI socket the sidecars use.
        #[arg(long, default_value = "unix:///csi/csi.sock")]
        csi_endpoint: String,
        #[arg(long, value_enum, default_value = "local")]
        backend: BackendKind,
        /// Prefix of every image name: one storage system can serve several clusters.
        #[arg(long, default_value = "k8s")]
        cluster_id: String,
        /// local: directory of image files.
        #[arg(long, default_value = "/var/lib/ustor-csi-controller")]
        local_dir: PathBuf,
        /// local: where the export server listens.
        #[arg(long, default_value = "127.0.0.1:10809")]
        local_listen: SocketAddr,
        /// local: host:port nodes dial (default: the listen address).
        #[arg(long)]
        local_export_address: Option<String>,
        /// local: do not start nbdkit (something else serves the directory).
        #[arg(long)]
        no_export_server: bool,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Serve {
            csi_endpoint,
            backend: BackendKind::Local,
            cluster_id,
            local_dir,
            local_listen,
            local_export_address,
            no_export_server,
        } => {
            valid_cluster_id(&cluster_id).map_err(anyhow::Error::msg)?;
            let socket = PathBuf::from(
                csi_endpoint
                    .strip_prefix("unix://")
                    .unwrap_or(&csi_endpoint),
            );
            anyhow::ensure!(
                socket.is_absolute(),
                "--csi-endpoint must be unix:///absolute/path"
            );
            let export_address = local_export_address.unwrap_or_else(|| local_listen.to_string());
            let backend = LocalBackend::open(&local_dir, &export_address)?;
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(async move {
                    let supervisor = (!no_export_server).then(|| {
                        tokio::spawn(
                            ExportServer {
                                images: backend.images_dir(),
                                listen: local_listen,
                            }
                            .supervise(),
                        )
                    });
                    let stop = async {
                        let _ = tokio::signal::ctrl_c().await;
                    };
                    let result = controller_shim::server::serve(
                        &socket,
                        Arc::new(backend),
                        cluster_id,
                        stop,
                    )
                    .await;
                    if let Some(s) = supervisor {
                        s.abort();
                    }
                    result
                })
        }
    }
}
