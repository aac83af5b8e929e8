//! Which CSI nodes of this driver exist, from an informer cache of CSINode objects (one watch,
//! no request per call): ControllerPublishVolume to a node without our driver registered is
//! NOT_FOUND, as the CSI spec says.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::storage::v1::CSINode;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};

use crate::provision::Nodes;
use csi_common::DRIVER_NAME;

#[derive(Debug, Clone)]
pub struct CsiNodes {
    store: Store<CSINode>,
    /// Set once the first full list is in the store: before that, absence proves nothing.
    listed: Arc<AtomicBool>,
}

impl CsiNodes {
    /// Starts the informer; the returned task keeps it current (and reconnects after an API
    /// server outage) until aborted.
    pub fn start(client: Client) -> (Self, tokio::task::JoinHandle<()>) {
        let (store, writer) = reflector::store();
        let api: Api<CSINode> = Api::all(client);
        let listed = Arc::new(AtomicBool::new(false));
        let (ready, flag) = (store.clone(), Arc::clone(&listed));
        let task = tokio::spawn(async move {
            let mark_listed = async move {
                if ready.wait_until_ready().await.is_ok() {
                    flag.store(true, Ordering::Release);
                }
            };
            tokio::spawn(mark_listed);
            let stream = watcher(api, watcher::Config::default())
                .backoff(super::watch_backoff())
                .reflect(writer)
                .applied_objects();
            tokio::pin!(stream);
            while let Some(event) = stream.next().await {
                if let Err(e) = event {
                    tracing::warn!(error = %e, "CSINode watch; retrying");
                }
            }
        });
        (Self { store, listed }, task)
    }
}

impl CsiNodes {
    /// Our driver's entry in the CSINode of `node_id`, if any.
    fn entry<T>(
        &self,
        node_id: &str,
        read: impl Fn(&k8s_openapi::api::storage::v1::CSINodeDriver) -> T,
    ) -> Option<T> {
        self.store.state().iter().find_map(|node: &Arc<CSINode>| {
            node.spec
                .drivers
                .iter()
                .find(|d| d.name == DRIVER_NAME && d.node_id == node_id)
                .map(&read)
        })
    }
}

impl Nodes for CsiNodes {
    fn has_node(&self, node_id: &str) -> Option<bool> {
        if !self.listed.load(Ordering::Acquire) {
            return None;
        }
        Some(self.entry(node_id, |_| ()).is_some())
    }

    /// kubelet writes the node daemon's max_volumes_per_node there; 0 or none is no limit.
    fn attach_limit(&self, node_id: &str) -> Option<u64> {
        self.entry(node_id, |d| d.allocatable.as_ref().and_then(|a| a.count))
            .flatten()
            .and_then(|count| u64::try_from(count).ok())
            .filter(|count| *count > 0)
    }
}
