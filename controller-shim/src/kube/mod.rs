//! The Kubernetes glue: the custom resources an operator writes ([`crd`]), the StorageClasses
//! they own ([`storage_class`]), the VolumeSnapshotClass ([`snapshot_class`]), the node
//! list ControllerPublishVolume checks ([`nodes`]), the admission webhook ([`webhook`]) and
//! its stamps on claims ([`stamp`]) that CreateVolume checks ([`claims`]), signed with the
//! controller's key ([`key`]). Every loop survives the API server going away and coming
//! back: watches re-list with back-off, reconcilers retry.

pub mod claims;
pub mod connection;
pub mod crd;
pub mod key;
pub mod leader;
pub mod metrics;
pub mod nodes;
pub mod snapshot_class;
pub mod stamp;
pub mod storage_class;
pub mod webhook;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};

use crd::{MindUstorStorageClass, MindUstorStorageConnection};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::storage::v1::StorageClass;

/// The VolumeSnapshotClass every StorageClass of ours names (the guide's name).
pub const SNAPSHOT_CLASS: &str = "csi-mind-ustor";

#[derive(Debug, thiserror::Error)]
pub enum GlueError {
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("{0}")]
    Invalid(String),
    #[error("the controller's key (Secret {}) is not loaded yet", key::KEY_SECRET)]
    KeyNotLoaded,
}

/// What the reconcilers share.
pub struct Context {
    pub client: Client,
    pub settings: Settings,
    /// The management API sessions of the connections.
    pub sessions: Arc<connection::Sessions>,
    /// Only the leader writes.
    pub leader: leader::Leadership,
    /// The field manager of every write, naming the replica (`managedFields` show who wrote).
    pub field_manager: String,
    /// The controller's key (digests of refused credentials).
    pub key: key::ControllerKey,
}

impl Context {
    pub fn patch_params(&self) -> kube::api::PatchParams {
        kube::api::PatchParams {
            field_manager: Some(self.field_manager.clone()),
            ..Default::default()
        }
    }

    pub fn post_params(&self) -> kube::api::PostParams {
        kube::api::PostParams {
            field_manager: Some(self.field_manager.clone()),
            ..Default::default()
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
pub struct Settings {
    /// The driver's namespace: the connections' Secrets are there.
    pub namespace: String,
    /// How often to look whether the snapshot API has appeared.
    pub snapshot_api_poll: Duration,
    /// Accept http:// management APIs (test setups only: the password crosses in clear).
    pub allow_insecure_http: bool,
    /// The login rules' pauses (the product's defaults; shorter in tests).
    pub login_timing: crate::backend::ustor::login::Timing,
    /// Take part in leader election under this identity; without it, this replica leads.
    pub election: Option<String>,
    /// Serve the admission webhook (every replica serves it).
    pub webhook: Option<webhook::WebhookSettings>,
    /// Where the connections' management API requests are counted.
    pub backend_metrics: Option<Arc<crate::metrics::BackendMetrics>>,
}

/// The namespace of the guide.
pub const DEFAULT_NAMESPACE: &str = "d8-csi-mind-ustor";

impl Default for Settings {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            snapshot_api_poll: Duration::from_secs(30),
            allow_insecure_http: false,
            login_timing: Default::default(),
            election: None,
            webhook: None,
            backend_metrics: None,
        }
    }
}

/// The running glue; dropping it stops every loop.
#[derive(Debug)]
pub struct Glue {
    pub nodes: nodes::CsiNodes,
    /// The connections, for the CSI controller's backend.
    pub connections: connection::Directory,
    /// The resources' phases, for Prometheus.
    pub phases: metrics::Phases,
    /// The claims of ReadWriteMany block volumes, for CreateVolume.
    pub claims: claims::AdmittedClaims,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Glue {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Glue {
    pub fn start(client: Client, settings: Settings) -> Self {
        let poll = settings.snapshot_api_poll;
        let sessions = Arc::new(connection::Sessions::default());
        let mut tasks = Vec::new();
        let leader = match &settings.election {
            Some(identity) => {
                let (leader, election) =
                    leader::Leadership::elect(client.clone(), &settings.namespace, identity);
                tasks.push(election);
                leader
            }
            None => leader::Leadership::always(),
        };
        let key = key::ControllerKey::default();
        tasks.push(tokio::spawn(key::follow(
            client.clone(),
            settings.namespace.clone(),
            key.clone(),
        )));
        if let Some(hook) = settings.webhook.clone() {
            let (client, namespace) = (client.clone(), settings.namespace.clone());
            let key = key.clone();
            tasks.push(tokio::spawn(async move {
                let listen = hook.listen;
                let served = match tokio::net::TcpListener::bind(listen).await {
                    Ok(listener) => webhook::serve(listener, client, namespace, hook, key).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = served {
                    tracing::error!(%listen, error = %e, "admission webhook stopped");
                }
            }));
        }
        let field_manager = match &settings.election {
            Some(identity) => format!("ustor-csi-controller/{identity}"),
            None => "ustor-csi-controller".to_owned(),
        };
        let ctx = Arc::new(Context {
            client: client.clone(),
            settings,
            sessions: Arc::clone(&sessions),
            leader,
            field_manager,
            key: key.clone(),
        });
        let (nodes, node_watch) = nodes::CsiNodes::start(client.clone());
        let claims = claims::AdmittedClaims {
            client: client.clone(),
            key,
        };
        let connection_controller = Controller::new(
            Api::<MindUstorStorageConnection>::all(client.clone()),
            watcher::Config::default(),
        )
        .trigger_backoff(watch_backoff());
        let directory = connection::Directory {
            sessions,
            connections: connection_controller.store(),
        };
        let connections = tokio::spawn(run_connections(
            connection_controller,
            client.clone(),
            Arc::clone(&ctx),
        ));
        let class_controller = storage_class_controller(&client);
        let phases = metrics::Phases {
            connections: directory.connections.clone(),
            classes: class_controller.store(),
        };
        let classes = tokio::spawn(run_storage_classes(
            class_controller,
            client,
            Arc::clone(&ctx),
        ));
        let snapshots = tokio::spawn(snapshot_class::run(ctx, poll));
        Self {
            nodes,
            phases,
            claims,
            connections: directory,
            tasks: {
                tasks.extend([node_watch, connections, classes, snapshots]);
                tasks
            },
        }
    }

    /// What the CSI controller checks against: the nodes, the claims.
    pub fn cluster(&self) -> crate::provision::Cluster {
        crate::provision::Cluster {
            nodes: Arc::new(self.nodes.clone()),
            claims: Arc::new(self.claims.clone()),
        }
    }
}

async fn run_connections(
    controller: Controller<MindUstorStorageConnection>,
    client: Client,
    ctx: Arc<Context>,
) {
    let secrets: Api<Secret> = Api::namespaced(client, &ctx.settings.namespace);
    // A Secret changed: its connections log in again within seconds.
    let known = controller.store();
    controller
        .watches(secrets, watcher::Config::default(), move |secret| {
            let name = secret.name_any();
            referring(&known, |c| {
                c.spec.control_plane.credentials_secret_name == name
                    || c.spec.data_plane.tls_secret_name == name
            })
        })
        .run(connection::reconcile, retry_later, ctx)
        .for_each(|result| log_failure(result, "MindUstorStorageConnection"))
        .await;
}

fn storage_class_controller(client: &Client) -> Controller<MindUstorStorageClass> {
    Controller::new(
        Api::<MindUstorStorageClass>::all(client.clone()),
        watcher::Config::default(),
    )
    .owns(
        Api::<StorageClass>::all(client.clone()),
        watcher::Config::default(),
    )
    .trigger_backoff(watch_backoff())
}

async fn run_storage_classes(
    controller: Controller<MindUstorStorageClass>,
    client: Client,
    ctx: Arc<Context>,
) {
    let connections: Api<MindUstorStorageConnection> = Api::all(client);
    // A connection created (or changed) after the classes that name it: look at them now,
    // not at the next retry.
    let known = controller.store();
    controller
        .watches(connections, watcher::Config::default(), move |connection| {
            let name = connection.name_any();
            referring(&known, |class| class.spec.connection_name == name)
        })
        .run(storage_class::reconcile, retry_later, ctx)
        .for_each(|result| log_failure(result, "MindUstorStorageClass"))
        .await;
}

/// The objects in `store` that `refers` says name a changed object: what a watch of that
/// object kind triggers.
fn referring<K>(
    store: &kube::runtime::reflector::Store<K>,
    refers: impl Fn(&K) -> bool,
) -> Vec<ObjectRef<K>>
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    store
        .state()
        .iter()
        .filter(|object| refers(object))
        .map(|object| ObjectRef::from_obj(&**object))
        .collect()
}

/// The events of the one object `name` that `api` serves (a field selector, so that RBAC
/// can grant the watch by resourceNames), retried with [`watch_backoff`].
pub(crate) fn watch_named<K>(
    api: Api<K>,
    name: &str,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    K::DynamicType: Default,
{
    use kube::runtime::WatchStreamExt;
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    watcher::watcher(api, config).backoff(watch_backoff())
}

/// Pause between retries of the controller's watches. One back-off serves all of its
/// watches, and each of them fails once more (410 Expired) when an API server comes back with
/// a new watch cache: client-go's 30 s cap stacked so that the glue stayed blind for over a
/// minute after the API server returned. One client retrying every few seconds is no burden.
pub(crate) fn watch_backoff() -> watcher::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .into()
}

/// How soon a follower looks again: after a leader change, everything is reconciled within
/// this.
const FOLLOWER_RECHECK: Duration = Duration::from_secs(5);

/// A reconcile's failure, at debug level: `retry_later` already warned about it.
async fn log_failure<T, E: std::fmt::Display>(result: Result<T, E>, kind: &'static str) {
    if let Err(e) = result {
        tracing::debug!(error = %e, kind, "reconcile");
    }
}

/// Writes `status` into a resource of ours, only when it differs from what it has. A field
/// the current status has and `status` lacks is removed (a merge patch leaves out what it
/// does not name).
async fn write_status<K, S>(
    ctx: &Context,
    object: &K,
    current: Option<&S>,
    status: &S,
) -> Result<(), GlueError>
where
    K: kube::Resource<DynamicType = (), Scope = kube::core::ClusterResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    S: serde::Serialize + PartialEq,
{
    if current == Some(status) {
        return Ok(());
    }
    let mut patch = serde_json::to_value(status).map_err(|e| GlueError::Invalid(e.to_string()))?;
    let was = current.map(serde_json::to_value).transpose();
    if let (Some(fields), Ok(Some(serde_json::Value::Object(was)))) = (patch.as_object_mut(), was) {
        for gone in was.keys() {
            fields
                .entry(gone.clone())
                .or_insert(serde_json::Value::Null);
        }
    }
    let api: Api<K> = Api::all(ctx.client.clone());
    api.patch_status(
        &object.name_any(),
        &ctx.patch_params(),
        &kube::api::Patch::Merge(serde_json::json!({ "status": patch })),
    )
    .await?;
    Ok(())
}

/// A failed reconcile (API unreachable, conflict) is tried again shortly.
fn retry_later<K>(_object: Arc<K>, error: &GlueError, _ctx: Arc<Context>) -> Action {
    // The key is read within moments of the start.
    let pause = match error {
        GlueError::KeyNotLoaded => Duration::from_secs(1),
        GlueError::Api(_) | GlueError::Invalid(_) => Duration::from_secs(5),
    };
    tracing::warn!(error = %error, ?pause, "reconcile failed; retrying");
    Action::requeue(pause)
}
