//! `ustor-csi-controller serve`: the CSI controller for external-provisioner, -attacher,
//! -resizer and -snapshotter; `import`: an existing image adopted as a PersistentVolume.
//! The command line only: flags become [`Settings`], and
//! [`server::run`] starts it all.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};
use controller_shim::backend::ustor::api::{check_url, UrlRefusal};
use controller_shim::ids::valid_cluster_id;
use controller_shim::kube::webhook::issuer::IssueSettings;
use controller_shim::kube::webhook::WebhookSettings;
use controller_shim::server::{self, leader_identity, BackendSettings, Settings};

#[derive(Debug, Parser)]
#[command(
    name = "ustor-csi-controller",
    version,
    about = "ustor-nbd CSI controller"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    Local,
    Ustor,
}

#[derive(Debug, Subcommand)]
enum Command {
    Serve(Box<ServeArgs>),
    /// Adopt an existing uStor image (an old product's claim's) as a volume of this driver,
    /// without copying it, and print its PersistentVolume (and claim) for `kubectl apply`.
    Import(Box<ImportArgs>),
    /// Print the CustomResourceDefinitions (the content of deploy/crds.yaml).
    Crds,
    /// Print the manual page (roff), as the packages install it.
    #[command(hide = true)]
    Manpage,
}

#[derive(Debug, Args)]
struct ServeArgs {
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
    /// ustor: the management API of the one uStor cluster to serve; without it (and with
    /// --kubernetes) the controller serves every MindUstorStorageConnection.
    #[arg(long)]
    ustor_url: Option<String>,
    /// ustor: directory with `username` and `password` files (the mounted Secret).
    #[arg(long, default_value = "/etc/ustor-csi/credentials")]
    ustor_credentials: PathBuf,
    /// ustor: CA certificate of the management API (PEM).
    #[arg(long)]
    ustor_ca: Option<PathBuf>,
    /// ustor: allow an http:// management API (the password would cross the network in
    /// clear text); for test setups only.
    #[arg(long)]
    ustor_allow_insecure_http: bool,
    /// ip:port to serve Prometheus /metrics on (off unless given; e.g. 127.0.0.1:9810).
    #[arg(long)]
    metrics_address: Option<SocketAddr>,
    /// ustor: pool of volumes whose StorageClass names none.
    #[arg(long, default_value = "data")]
    ustor_pool: String,
    /// Run the Kubernetes glue (custom resources, StorageClasses, node checks), with the
    /// in-cluster service account or $KUBECONFIG.
    #[arg(long)]
    kubernetes: bool,
    /// Elect a leader among replicas (a Lease in --namespace) so only one writes; the
    /// identity is $POD_NAME, else the host name.
    #[arg(long)]
    leader_election: bool,
    /// ip:port to serve the admission webhook on over TLS (e.g. 0.0.0.0:9443); off unless given.
    #[arg(long)]
    webhook_address: Option<SocketAddr>,
    /// The kubernetes.io/tls Secret (in --namespace) with the webhook's certificate; re-read
    /// when it changes.
    #[arg(long, default_value = "csi-controller-webhook-tls")]
    webhook_cert_secret: String,
    /// Make and renew the webhook's certificate (a CA of the controller's own, in the same
    /// Secret) and keep the webhook configurations' caBundle current. Off when cert-manager
    /// or an operator keeps the Secret and the caBundle.
    #[arg(long)]
    webhook_cert_issue: bool,
    /// The names the issued certificate is for (default: the webhook Service's,
    /// csi-controller-webhook.<namespace>.svc).
    #[arg(long, value_delimiter = ',')]
    webhook_cert_names: Vec<String>,
    /// How long an issued certificate is valid; renewed with a third left.
    #[arg(long, default_value = "365d", value_parser = humantime::parse_duration)]
    webhook_cert_validity: std::time::Duration,
    /// The Validating- and MutatingWebhookConfiguration whose caBundle is kept current.
    #[arg(long, default_value = "d8-csi-mind-ustor")]
    webhook_configuration: String,
    /// Users that may create ReadWriteMany block claims: exact names, or prefixes ending in *.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "system:serviceaccount:d8-virtualization:*"
    )]
    webhook_migration_users: Vec<String>,
    /// The only user allowed to write this driver's StorageClasses (default: the
    /// csi-controller service account of --namespace).
    #[arg(long)]
    webhook_controller_user: Option<String>,
    /// The driver's namespace, where the connections' Secrets are.
    #[arg(long, env = "POD_NAMESPACE", default_value = controller_shim::kube::DEFAULT_NAMESPACE)]
    namespace: String,
}

#[derive(Debug, Args)]
struct ImportArgs {
    /// The image, as `<pool>/<image>` on uStor.
    #[arg(long)]
    image: String,
    /// The management API of the uStor holding it.
    #[arg(long)]
    ustor_url: String,
    /// Directory with `username` and `password` files of a uStor user of the controller's.
    #[arg(long, default_value = "/etc/ustor-csi/credentials")]
    ustor_credentials: PathBuf,
    /// CA certificate of the management API (PEM).
    #[arg(long)]
    ustor_ca: Option<PathBuf>,
    /// Allow an http:// management API; for test setups only.
    #[arg(long)]
    ustor_allow_insecure_http: bool,
    /// The MindUstorStorageConnection of that uStor, when the controller serves connections
    /// (the volume id names it).
    #[arg(long)]
    connection: Option<String>,
    /// The controller's --cluster-id, whose volume the image becomes.
    #[arg(long, default_value = "k8s")]
    cluster_id: String,
    /// The PersistentVolume's name (default: `imported-<image>`).
    #[arg(long)]
    name: Option<String>,
    /// `<namespace>/<name>` of the claim to bind it to; its manifest is printed too.
    #[arg(long)]
    claim: Option<String>,
    /// The StorageClass of the volume and claim (one of a MindUstorStorageClass); none if not given.
    #[arg(long)]
    storage_class: Option<String>,
    #[arg(long, default_value = "ReadWriteOnce")]
    access_mode: String,
    /// Filesystem or Block.
    #[arg(long, default_value = "Filesystem")]
    volume_mode: String,
    /// The filesystem the image holds (Filesystem volumes).
    #[arg(long, default_value = "ext4")]
    fs_type: String,
    /// Retain keeps the image when the claim goes; Delete deletes it with the volume.
    #[arg(long, default_value = "Retain")]
    reclaim_policy: String,
    /// `<namespace>/<name>` of the connection's TLS Secret, for an export over TLS.
    #[arg(long)]
    node_stage_secret: Option<String>,
    /// Connections per device (`nbdConnections`, 1-16), as a StorageClass parameter.
    #[arg(long)]
    nbd_connections: Option<u8>,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Crds => {
            print!("{}", controller_shim::kube::crd::crds_yaml());
            Ok(())
        }
        Command::Serve(args) => serve(*args),
        Command::Import(args) => import(*args),
        Command::Manpage => {
            use clap::CommandFactory;
            clap_mangen::Man::new(Cli::command())
                .section("8")
                .render(&mut std::io::stdout())?;
            Ok(())
        }
    }
}

/// The flags as the server's settings.
fn settings(args: ServeArgs) -> Result<Settings> {
    let ServeArgs {
        csi_endpoint,
        backend,
        cluster_id,
        local_dir,
        local_listen,
        local_export_address,
        no_export_server,
        ustor_url,
        ustor_credentials,
        ustor_ca,
        ustor_allow_insecure_http,
        metrics_address,
        ustor_pool,
        kubernetes,
        namespace,
        leader_election,
        webhook_address,
        webhook_cert_secret,
        webhook_cert_issue,
        webhook_cert_names,
        webhook_cert_validity,
        webhook_configuration,
        webhook_migration_users,
        webhook_controller_user,
    } = args;
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
    let backend = match (backend, ustor_url) {
        (BackendKind::Local, _) => BackendSettings::Local {
            dir: local_dir,
            listen: local_listen,
            export_address: local_export_address,
            export_server: !no_export_server,
        },
        (BackendKind::Ustor, None) => BackendSettings::Connections { pool: ustor_pool },
        (BackendKind::Ustor, Some(url)) => {
            check_ustor_url(&url, ustor_allow_insecure_http)?;
            BackendSettings::Ustor {
                url,
                credentials: ustor_credentials,
                ca: ustor_ca,
                pool: ustor_pool,
            }
        }
    };
    let glue = kubernetes.then(|| {
        let issue = webhook_cert_issue.then(|| IssueSettings {
            names: if webhook_cert_names.is_empty() {
                let service = format!("csi-controller-webhook.{namespace}.svc");
                vec![service.clone(), format!("{service}.cluster.local")]
            } else {
                webhook_cert_names
            },
            validity: webhook_cert_validity,
            configuration: webhook_configuration,
        });
        let webhook = webhook_address.map(|listen| WebhookSettings {
            listen,
            cert_secret: webhook_cert_secret,
            issue,
            migration_users: webhook_migration_users,
            controller_user: webhook_controller_user
                .unwrap_or_else(|| format!("system:serviceaccount:{namespace}:csi-controller")),
        });
        controller_shim::kube::Settings {
            namespace,
            allow_insecure_http: ustor_allow_insecure_http,
            election: leader_election.then(leader_identity),
            webhook,
            ..controller_shim::kube::Settings::default()
        }
    });
    Ok(Settings {
        socket,
        backend,
        cluster_id,
        metrics_address,
        kubernetes: glue,
    })
}

fn serve(args: ServeArgs) -> Result<()> {
    let settings = settings(args)?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(server::run(settings))?;
    Ok(())
}

/// `<namespace>/<name>` of `flag`.
fn namespaced(flag: &str, value: Option<String>) -> Result<Option<(String, String)>> {
    value
        .map(|v| match v.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok((ns.to_owned(), name.to_owned()))
            }
            _ => anyhow::bail!("--{flag} {v:?} must be <namespace>/<name>"),
        })
        .transpose()
}

fn import(args: ImportArgs) -> Result<()> {
    use controller_shim::import::{Objects, Source};
    let Some((pool, image)) = args.image.split_once('/') else {
        anyhow::bail!("--image {:?} must be <pool>/<image>", args.image);
    };
    let source = Source {
        url: args.ustor_url,
        credentials: args.ustor_credentials,
        ca: args.ustor_ca,
        connection: args.connection,
        pool: pool.to_owned(),
        image: image.to_owned(),
        cluster_id: args.cluster_id,
    };
    let objects = Objects {
        volume_name: args.name.unwrap_or_else(|| format!("imported-{image}")),
        claim: namespaced("claim", args.claim)?,
        storage_class: args.storage_class,
        access_mode: args.access_mode,
        volume_mode: args.volume_mode,
        fs_type: args.fs_type,
        reclaim_policy: args.reclaim_policy,
        node_stage_secret: namespaced("node-stage-secret", args.node_stage_secret)?,
        parameters: args
            .nbd_connections
            .map(|n| ("nbdConnections".to_owned(), n.to_string()))
            .into_iter()
            .collect(),
    };
    let yaml = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(controller_shim::import::run(
            &source,
            &objects,
            args.ustor_allow_insecure_http,
        ))?;
    print!("{yaml}");
    Ok(())
}

/// `--ustor-url` by the rule of [`check_url`], with the flag's own words.
fn check_ustor_url(url: &str, allow_http: bool) -> Result<()> {
    match check_url(url, allow_http) {
        Ok(_) => Ok(()),
        Err(UrlRefusal::PlainHttp) => anyhow::bail!(
            "--ustor-url {url} is plain http: the uStor password would cross the network in clear text; \
             use https, or --ustor-allow-insecure-http for a test setup"
        ),
        Err(UrlRefusal::NotHttp) => anyhow::bail!("--ustor-url {url} must be an https:// URL"),
    }
}

#[cfg(test)]
mod tests {
    use super::check_ustor_url;

    #[test]
    fn plain_http_needs_an_explicit_flag() {
        assert!(check_ustor_url("https://ustor:23004", false).is_ok());
        let err = check_ustor_url("http://ustor:23004", false).unwrap_err();
        assert!(err.to_string().contains("clear text"), "{err}");
        assert!(check_ustor_url("http://ustor:23004", true).is_ok());
        assert!(check_ustor_url("ftp://ustor", true).is_err());
    }
}
