//! ListVolumes and ControllerGetVolume: the volumes of this cluster as the backend records
//! them, each with the nodes it is published to and its condition, for the health monitor
//! (external-health-monitor reports an abnormal one as an event on its claim).
//!
//! A volume is abnormal when the backend sees a problem with its data or export server, or
//! when it is published to a node the storage holds no grant for: that node's next
//! reconnection (after an outage, a restart of the daemon) would be refused.

use csi_proto::csi::*;

use super::{volume_lock, Provisioner};
use crate::backend::connections::ConnectionError;
use crate::backend::{BackendError, ListedVolume, VolumeMeta};
use crate::error::Error;
use crate::ids::image_for;
use crate::request::{self, require};

/// The message of a volume with nothing wrong.
const HEALTHY: &str = "healthy";

fn condition(problem: Option<String>) -> VolumeCondition {
    VolumeCondition {
        abnormal: problem.is_some(),
        message: problem.unwrap_or_else(|| HEALTHY.to_owned()),
    }
}

impl Provisioner {
    pub async fn list_volumes(&self, r: ListVolumesRequest) -> Result<ListVolumesResponse, Error> {
        if r.max_entries < 0 {
            return Err(request::RequestError::NegativeMaxEntries.into());
        }
        let all: Vec<ListedVolume> = self
            .backend
            .volumes()
            .await?
            .into_iter()
            .filter(|v| self.is_ours(&v.key, &v.meta))
            .collect();
        let page = request::page(r.max_entries, &r.starting_token, all.len())?;
        let mut entries = Vec::new();
        for listed in all.iter().skip(page.start).take(page.take) {
            let (image, meta) = (&listed.key, &listed.meta);
            let (published_node_ids, volume_condition) = self.status(image, meta).await?;
            entries.push(list_volumes_response::Entry {
                volume: Some(
                    self.volume_answer_at(image, meta, listed.export.clone())
                        .await?,
                ),
                status: Some(list_volumes_response::VolumeStatus {
                    published_node_ids,
                    volume_condition: Some(volume_condition),
                }),
            });
        }
        Ok(ListVolumesResponse {
            next_token: page.next_token(entries.len(), all.len()),
            entries,
        })
    }

    pub async fn get_volume(
        &self,
        r: ControllerGetVolumeRequest,
    ) -> Result<ControllerGetVolumeResponse, Error> {
        require(!r.volume_id.is_empty(), "volume_id")?;
        let h = self.volume_handle(&r.volume_id)?;
        let meta = match self.backend.volume(&h.image).await {
            // The connection's session is down: the volume cannot be looked at, and that is
            // its condition (the health monitor takes an error for "no news").
            Err(BackendError::Connection(e @ ConnectionError::NotUsable { .. })) => {
                return Ok(ControllerGetVolumeResponse {
                    volume: Some(Volume {
                        volume_id: r.volume_id,
                        ..Volume::default()
                    }),
                    status: Some(controller_get_volume_response::VolumeStatus {
                        published_node_ids: Vec::new(),
                        volume_condition: Some(condition(Some(e.to_string()))),
                    }),
                });
            }
            found => found?,
        };
        let meta = meta.ok_or_else(|| super::VolumeError::Missing { volume: h.clone() })?;
        let (published_node_ids, volume_condition) = self.status(&h.image, &meta).await?;
        Ok(ControllerGetVolumeResponse {
            volume: Some(self.volume_answer(&h.image, &meta).await?),
            status: Some(controller_get_volume_response::VolumeStatus {
                published_node_ids,
                volume_condition: Some(volume_condition),
            }),
        })
    }

    /// Whether the volume keyed `key` is one this cluster made or adopted: a backend shared
    /// by several clusters (uStor) holds theirs too, under their cluster ids.
    pub(super) fn is_ours(&self, key: &str, meta: &VolumeMeta) -> bool {
        if let Some(cluster) = &meta.adopted_by {
            return *cluster == self.cluster_id;
        }
        let image = key.rsplit('/').next().unwrap_or(key);
        image_for(&self.cluster_id, &meta.name).is_ok_and(|ours| ours == image)
    }

    /// The nodes `image` is published to, and its condition.
    async fn status(
        &self,
        image: &str,
        meta: &VolumeMeta,
    ) -> Result<(Vec<String>, VolumeCondition), BackendError> {
        let nodes: Vec<String> = meta.published.keys().cloned().collect();
        let problem = match self.backend.problem(image, meta).await? {
            Some(problem) => Some(problem),
            None => self.ungranted(image, meta).await?,
        };
        Ok((nodes, condition(problem)))
    }

    /// A node the volume is published to that holds no grant. Checked only while no call
    /// changes the volume (publish records the publication before it grants; unpublish
    /// revokes before it forgets the publication), on the record as it is then.
    async fn ungranted(
        &self,
        image: &str,
        meta: &VolumeMeta,
    ) -> Result<Option<String>, BackendError> {
        if meta.published.is_empty() {
            return Ok(None);
        }
        let Some(_locked) = self.images.try_lock(&volume_lock(image)) else {
            return Ok(None);
        };
        let Some(now) = self.backend.volume(image).await? else {
            return Ok(None);
        };
        let granted = self.backend.granted_nodes(image).await?;
        let missing: Vec<&str> = now
            .published
            .keys()
            .filter(|node| !granted.contains(node))
            .map(String::as_str)
            .collect();
        Ok((!missing.is_empty()).then(|| {
            format!(
                "published to {} but the storage holds no grant for {}: a reconnection from \
                 there is refused until the volume is published there again, which grants anew",
                missing.join(", "),
                if missing.len() == 1 { "it" } else { "them" }
            )
        }))
    }
}
