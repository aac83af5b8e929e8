//! The Kubernetes glue: the custom resources an operator writes ([`crd`]), the StorageClasses
//! they own ([`storage_class`]), the VolumeSnapshotClass ([`snapshot_class`]) and the node
//! list ControllerPublishVolume checks ([`nodes`]). Every loop survives the API server going
//! away and coming back: watches re-list with back-off, reconcilers retry.

pub mod crd;
pub mod nodes;
pub mod snapshot_class;
pub mod storage_class;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};

use crd::{MindUstorStorageClass, MindUstorStorageConnection};
use k8s_openapi::api::storage::v1::StorageClass;

/// The VolumeSnapshotClass every StorageClass of ours names (the guide's name).
pub const SNAPSHOT_CLASS: &str = "csi-mind-ustor";

#[derive(Debug, thiserror::Error)]
pub enum GlueError {
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    #[error("{0}")]
    Invalid(String),
}

/// What the reconcilers share.
pub struct Context {
    pub client: Client,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
pub struct Settings {
    /// How often to look whether the snapshot API has appeared.
    pub snapshot_api_poll: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            snapshot_api_poll: Duration::from_secs(30),
        }
    }
}

/// The running glue; dropping it stops every loop.
#[derive(Debug)]
pub struct Glue {
    pub nodes: nodes::CsiNodes,
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
        let ctx = Arc::new(Context {
            client: client.clone(),
        });
        let (nodes, node_watch) = nodes::CsiNodes::start(client.clone());
        let classes = tokio::spawn(run_storage_classes(client, Arc::clone(&ctx)));
        let snapshots = tokio::spawn(snapshot_class::run(ctx, settings.snapshot_api_poll));
        Self {
            nodes,
            tasks: vec![node_watch, classes, snapshots],
        }
    }
}

async fn run_storage_classes(client: Client, ctx: Arc<Context>) {
    let classes: Api<MindUstorStorageClass> = Api::all(client.clone());
    let owned: Api<StorageClass> = Api::all(client.clone());
    let connections: Api<MindUstorStorageConnection> = Api::all(client);
    let controller = Controller::new(classes, watcher::Config::default())
        .owns(owned, watcher::Config::default())
        .trigger_backoff(watch_backoff());
    // A connection created (or changed) after the classes that name it: look at them now,
    // not at the next retry.
    let known = controller.store();
    controller
        .watches(connections, watcher::Config::default(), move |connection| {
            let name = connection.name_any();
            known
                .state()
                .iter()
                .filter(|class| class.spec.connection_name == name)
                .map(|class| ObjectRef::from_obj(&**class))
                .collect::<Vec<_>>()
        })
        .run(storage_class::reconcile, retry_later, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "MindUstorStorageClass reconcile");
            }
        })
        .await;
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

/// A failed reconcile (API unreachable, conflict) is tried again shortly.
fn retry_later<K>(_object: Arc<K>, error: &GlueError, _ctx: Arc<Context>) -> Action {
    tracing::warn!(error = %error, "reconcile failed; retrying in 5 s");
    Action::requeue(Duration::from_secs(5))
}
