//! ControllerPublishVolume / ControllerUnpublishVolume: which nodes a volume is published to
//! is recorded with the volume (nothing is attached here: the node daemon attaches), so the
//! access mode's one-node rule holds across nodes. Each publication also holds a grant of
//! the backend (storage-side fencing): the node presents its token when it dials, and a
//! node unpublished cannot open the export any more, even cut off from the cluster.

use std::collections::BTreeSet;

use csi_common::capability;
use csi_proto::csi::*;

use super::{volume_lock, Provisioner, VolumeError};
use crate::error::Error;
use crate::request::{self, require, RequestError};

/// The publish context key of the grant token; the node dials `<export>@<token>`.
pub const GRANT_KEY: &str = "nbdGrant";

/// Which CSI nodes of this driver exist (in Kubernetes: CSINode objects naming it).
pub trait Nodes: Send + Sync + std::fmt::Debug {
    /// `None` while the list is still loading.
    fn has_node(&self, node_id: &str) -> Option<bool>;
    /// How many volumes the node takes at most (its CSINode's allocatable count, from the
    /// node daemon's NodeGetInfo); `None` when it says no limit.
    fn attach_limit(&self, node_id: &str) -> Option<u64>;
}

/// The lock of a node's publications: the count against its limit and the new publication
/// are one step, so two volumes published at once cannot both take its last device.
fn node_lock(node: &str) -> String {
    format!("n:{node}")
}

impl Provisioner {
    fn require_node(&self, node_id: &str) -> Result<(), VolumeError> {
        match self.cluster.as_ref().map(|c| c.nodes.has_node(node_id)) {
            None | Some(Some(true)) => Ok(()),
            Some(Some(false)) => Err(VolumeError::NodeUnknown {
                node: node_id.to_owned(),
            }),
            Some(None) => Err(VolumeError::NodeListLoading),
        }
    }

    /// Refuses a new publication to a node that holds as many volumes as its limit. The
    /// scheduler keeps to the limit too, but only for pods it places; this holds for every
    /// publication, counted from the backend's records.
    async fn require_room(&self, node_id: &str) -> Result<(), crate::error::Error> {
        let Some(limit) = self
            .cluster
            .as_ref()
            .and_then(|c| c.nodes.attach_limit(node_id))
        else {
            return Ok(());
        };
        let held = self
            .backend
            .volumes()
            .await?
            .iter()
            .filter(|v| self.is_ours(&v.key, &v.meta) && v.meta.published.contains_key(node_id))
            .count() as u64;
        if held >= limit {
            return Err(VolumeError::AttachLimit {
                node: node_id.to_owned(),
                limit,
            }
            .into());
        }
        Ok(())
    }

    pub async fn publish(
        &self,
        r: ControllerPublishVolumeRequest,
    ) -> Result<ControllerPublishVolumeResponse, Error> {
        // Every required field is checked before the volume is looked up (csi-sanity).
        require(!r.volume_id.is_empty(), "volume_id")?;
        require(!r.node_id.is_empty(), "node_id")?;
        let cap = r.volume_capability.as_ref().ok_or(RequestError::Missing {
            field: "volume_capability",
        })?;
        let mode = request::check_capability(cap)?;
        let h = self.volume_handle(&r.volume_id)?;
        let _locked = self.images.lock(&volume_lock(&h.image)).await;
        let mut meta = self.existing_volume(&h).await?;
        self.require_node(&r.node_id)?;
        match meta.published.get(&r.node_id) {
            Some(ro) if *ro != r.readonly => {
                return Err(VolumeError::PublishedOtherwise {
                    volume: h,
                    node: r.node_id,
                    readonly: *ro,
                }
                .into())
            }
            Some(_) => {}
            None => {
                if !capability::multi_node(mode) && !meta.published.is_empty() {
                    return Err(VolumeError::SingleNode {
                        volume: h,
                        nodes: meta.published.into_keys().collect(),
                    }
                    .into());
                }
                // Taken after the image's lock, as every publication takes them.
                let _node = self.images.lock(&node_lock(&r.node_id)).await;
                self.require_room(&r.node_id).await?;
                meta.published.insert(r.node_id.clone(), r.readonly);
                self.backend.update_volume(&h.image, &meta).await?;
            }
        }
        // After the publication is recorded: a grant never outlives what unpublish revokes.
        let token = self.backend.grant(&h.image, &r.node_id, r.readonly).await?;
        // The connection count in force: a VolumeAttributesClass's over the StorageClass's.
        let mut context = self
            .export_context(&h.image, meta.parameter("nbdConnections"))
            .await?;
        context.insert(GRANT_KEY.to_owned(), token.expose().to_owned());
        Ok(ControllerPublishVolumeResponse {
            publish_context: context,
        })
    }

    pub async fn unpublish(
        &self,
        r: ControllerUnpublishVolumeRequest,
    ) -> Result<ControllerUnpublishVolumeResponse, Error> {
        let h = self.volume_handle(&r.volume_id)?;
        let _locked = self.images.lock(&volume_lock(&h.image)).await;
        // A volume or node that is gone is unpublished: OK, per the spec's idempotency rule.
        if let Some(mut meta) = self.backend.volume(&h.image).await? {
            // Revoked first: a failed revoke leaves the publication, and the CO retries.
            let nodes = if r.node_id.is_empty() {
                let mut nodes: BTreeSet<String> = meta.published.keys().cloned().collect();
                nodes.extend(self.backend.granted_nodes(&h.image).await?);
                nodes
            } else {
                BTreeSet::from([r.node_id.clone()])
            };
            for node in &nodes {
                self.backend.revoke(&h.image, node).await?;
            }
            let removed = if r.node_id.is_empty() {
                std::mem::take(&mut meta.published).len()
            } else {
                usize::from(meta.published.remove(&r.node_id).is_some())
            };
            if removed > 0 {
                self.backend.update_volume(&h.image, &meta).await?;
            }
        }
        Ok(ControllerUnpublishVolumeResponse {})
    }
}
