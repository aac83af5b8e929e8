//! Starting the controller: the backend the settings name (and its background tasks), the
//! Kubernetes glue, the metrics endpoint, and the CSI services on their unix socket, until
//! SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use csi_common::h2_front;
use csi_proto::csi::controller_server::ControllerServer;
use csi_proto::csi::group_controller_server::GroupControllerServer;
use csi_proto::csi::identity_server::IdentityServer;
use tokio::task::JoinHandle;

use crate::backend::connections::ConnectionsBackend;
use crate::backend::local::{LocalBackend, LocalError};
use crate::backend::ustor::api::UstorApi;
use crate::backend::ustor::backend::UstorBackend;
use crate::backend::ustor::credentials::CredentialsDir;
use crate::backend::ustor::error::UstorError;
use crate::backend::ustor::login::Timing;
use crate::backend::Backend;
use crate::exports::ExportServer;
use crate::kube::Glue;
use crate::metrics::{ControllerMetrics, LoginStates};
use crate::provision::{Cluster, Provisioner};
use crate::service::controller::ControllerService;
use crate::service::identity::IdentityService;

/// Where volumes live.
#[derive(Debug, Clone)]
pub enum BackendSettings {
    /// Image files in `dir`, exported by a supervised nbdkit behind the grant gate on
    /// `listen` unless `export_server` is off; nodes dial `export_address` (default: `listen`).
    Local {
        dir: PathBuf,
        listen: SocketAddr,
        export_address: Option<String>,
        export_server: bool,
    },
    /// One uStor cluster's management API, with credentials from a mounted Secret.
    Ustor {
        url: String,
        credentials: PathBuf,
        ca: Option<PathBuf>,
        pool: String,
    },
    /// Every MindUstorStorageConnection (needs the Kubernetes glue).
    Connections { pool: String },
}

#[derive(Debug)]
pub struct Settings {
    pub socket: PathBuf,
    pub backend: BackendSettings,
    /// Prefix of every image name.
    pub cluster_id: String,
    pub metrics_address: Option<SocketAddr>,
    /// The glue's settings when it runs (`--kubernetes`).
    pub kubernetes: Option<crate::kube::Settings>,
}

/// Why the controller did not start, or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("the CSI socket: {0}")]
    Socket(#[source] std::io::Error),
    #[error("serving CSI: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("the signal handler: {0}")]
    Signals(#[source] std::io::Error),
    #[error("--kubernetes: no Kubernetes client: {0}")]
    KubeClient(#[source] kube::Error),
    #[error("--backend ustor needs --kubernetes (the MindUstorStorageConnections) or --ustor-url")]
    NoConnections,
    #[error("the local backend: {0}")]
    Local(#[from] LocalError),
    #[error("--ustor-ca {}: {source}", path.display())]
    UstorCa {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the uStor client: {0}")]
    Ustor(#[from] UstorError),
    #[error("--metrics-address {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// This replica's name in leader election: `$POD_NAME`, else the host name.
pub fn leader_identity() -> String {
    std::env::var("POD_NAME").unwrap_or_else(|_| {
        nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("pid-{}", std::process::id()))
    })
}

/// Runs the controller until SIGTERM (how Kubernetes stops the container) or SIGINT.
pub async fn run(settings: Settings) -> Result<(), StartError> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(StartError::Signals)?;
    let stop = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("stopping");
    };
    let mut figures = ControllerMetrics::default();
    let glue = match settings.kubernetes {
        Some(kube_settings) => {
            let client = kube::Client::try_default()
                .await
                .map_err(StartError::KubeClient)?;
            Some(Glue::start(
                client,
                crate::kube::Settings {
                    backend_metrics: Some(Arc::clone(&figures.backend)),
                    ..kube_settings
                },
            ))
        }
        None => None,
    };
    let mut background = Vec::new();
    let backend = open_backend(
        settings.backend,
        glue.as_ref(),
        &mut figures,
        &mut background,
    )?;
    let metrics = match settings.metrics_address {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Metrics { addr, source })?,
        ),
        None => None,
    };
    let cluster = glue.as_ref().map(Glue::cluster);
    if let Some(glue) = &glue {
        let directory = glue.connections.clone();
        figures = figures
            .with_collector(glue.phases.clone())
            .with_collector(LoginStates(Box::new(move || directory.login_states())));
    }
    let result = serve(
        &settings.socket,
        backend,
        settings.cluster_id,
        metrics,
        figures,
        cluster,
        stop,
    )
    .await;
    drop(glue);
    for task in background {
        task.abort();
    }
    result
}

/// The backend `settings` name, with the tasks it needs running in `background`.
fn open_backend(
    settings: BackendSettings,
    glue: Option<&Glue>,
    figures: &mut ControllerMetrics,
    background: &mut Vec<JoinHandle<()>>,
) -> Result<Arc<dyn Backend>, StartError> {
    Ok(match settings {
        BackendSettings::Local {
            dir,
            listen,
            export_address,
            export_server,
        } => {
            let export_address = export_address.unwrap_or_else(|| listen.to_string());
            let local = LocalBackend::open(&dir, &export_address)?;
            if export_server {
                background.push(tokio::spawn(
                    ExportServer {
                        backend: local.clone(),
                        listen,
                        metrics: Arc::clone(&figures.gate),
                    }
                    .supervise(),
                ));
            } else {
                tracing::warn!(
                    "--no-export-server: grants are recorded but not enforced \
                     (whatever serves the images admits any node)"
                );
            }
            Arc::new(local)
        }
        // In Kubernetes without a fixed URL: the volumes of every connection.
        BackendSettings::Connections { pool } => {
            let glue = glue.ok_or(StartError::NoConnections)?;
            Arc::new(ConnectionsBackend::new(
                Arc::new(glue.connections.clone()),
                &pool,
            ))
        }
        BackendSettings::Ustor {
            url,
            credentials,
            ca,
            pool,
        } => {
            let ca = ca
                .map(|path| {
                    std::fs::read(&path).map_err(|source| StartError::UstorCa { path, source })
                })
                .transpose()?;
            let api = Arc::new(
                UstorApi::new(
                    &url,
                    ca.as_deref(),
                    Arc::new(CredentialsDir::new(&credentials)),
                    Timing::default(),
                    Arc::new(Instant::now),
                )?
                .with_metrics(Arc::clone(&figures.backend), "default"),
            );
            let watched = Arc::clone(&api);
            *figures = std::mem::take(figures).with_collector(LoginStates(Box::new(move || {
                vec![("default".to_owned(), watched.login_state().as_str())]
            })));
            // The hourly login (uStor locks users idle for 45 days), and the retry of a
            // refused one once its pause is over, even when no volume is created.
            let keepalive = Arc::clone(&api);
            background.push(tokio::spawn(async move {
                loop {
                    if let Err(e) = keepalive.keepalive().await {
                        tracing::warn!(error = %e, "uStor login check");
                    }
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
            }));
            Arc::new(UstorBackend::new(api, &pool))
        }
    })
}

/// Serves Identity and Controller on `socket` until `stop` resolves, and `/metrics` on
/// `metrics` when a listener is given (bound by the caller, so a bad address fails the
/// start); `cluster` is what the Kubernetes glue checks calls against.
pub async fn serve(
    socket: &Path,
    backend: Arc<dyn Backend>,
    cluster_id: String,
    metrics_listener: Option<tokio::net::TcpListener>,
    metrics: ControllerMetrics,
    cluster: Option<Cluster>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), StartError> {
    let listener = csi_common::socket::bind(socket).map_err(StartError::Socket)?;
    let metrics = Arc::new(metrics);
    let metrics_server = metrics_listener.map(|listener| {
        let served = Arc::clone(&metrics);
        let addr = listener.local_addr().ok();
        tracing::info!(?addr, "serving metrics");
        tokio::spawn(async move {
            if let Err(e) = csi_common::metrics::serve(move || served.render(), listener).await {
                tracing::error!(?addr, error = %e, "metrics endpoint failed");
            }
        })
    });
    let provisioner = Provisioner::new(backend, cluster_id)
        .counting_foreign_ids(Arc::clone(&metrics.foreign_ids));
    let provisioner = match cluster {
        Some(cluster) => provisioner.in_cluster(cluster),
        None => provisioner,
    };
    // One service answers both: a group snapshot and a snapshot share the image locks.
    let controller = Arc::new(ControllerService::new(provisioner, metrics));
    tonic::transport::Server::builder()
        .add_service(IdentityServer::new(IdentityService))
        .add_service(ControllerServer::from_arc(Arc::clone(&controller)))
        .add_service(GroupControllerServer::from_arc(controller))
        .serve_with_incoming_shutdown(h2_front::incoming(listener), stop)
        .await?;
    let _ = std::fs::remove_file(socket);
    if let Some(m) = metrics_server {
        m.abort();
    }
    Ok(())
}
