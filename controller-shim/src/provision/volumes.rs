//! Volumes: CreateVolume (empty, restored from a snapshot, cloned), DeleteVolume,
//! ControllerExpandVolume, ValidateVolumeCapabilities and GetCapacity.

use std::collections::BTreeMap;

use csi_proto::csi::volume_content_source::Type as SourceType;
use csi_proto::csi::*;

use super::{snapshot_lock, volume_lock, wire_size, Provisioner, SnapshotError};
use crate::backend::{Source, VolumeMeta};
use crate::error::Error;
use crate::ids::{image_for, Handle};
use crate::request::{self, require};

/// Why a volume operation cannot be done (the request itself being valid).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {volume} does not exist")]
    Missing { volume: Handle },
    /// A repeated CreateVolume that asks for something else under the same name.
    #[error("volume {name:?} already exists with other parameters, size or source")]
    Clash { name: String },
    #[error("volume {volume} is still published to {}", nodes.join(", "))]
    StillPublished { volume: Handle, nodes: Vec<String> },
    #[error("volume {volume} is published to {node} with readonly={readonly}")]
    PublishedOtherwise {
        volume: Handle,
        node: String,
        readonly: bool,
    },
    #[error("volume {volume} is published to {} and its access mode allows one node", nodes.join(", "))]
    SingleNode { volume: Handle, nodes: Vec<String> },
    #[error(
        "node {node:?} has no CSINode entry for {}: is ustor-csi-node running there?",
        csi_common::DRIVER_NAME
    )]
    NodeUnknown { node: String },
    #[error("the list of nodes is still loading from the Kubernetes API; retry")]
    NodeListLoading,
    #[error(
        "node {node:?} holds {limit} volumes of this driver already, its limit (its free nbd \
         devices, or max-volumes in its node.toml): unpublish one there, or use another node"
    )]
    AttachLimit { node: String, limit: u64 },
}

impl Provisioner {
    pub async fn create_volume(
        &self,
        r: CreateVolumeRequest,
    ) -> Result<CreateVolumeResponse, Error> {
        let image = image_for(&self.cluster_id, &r.name)?;
        request::check_capabilities(&r.volume_capabilities)?;
        let parameters = request::parameters(&r.parameters)?;
        let mutable = request::mutable_parameters(&r.mutable_parameters)?;
        self.require_admitted(&r.volume_capabilities, &r.parameters)
            .await?;
        let image = self.backend.volume_key(&image, &parameters)?;
        let (source, minimum) = match r.volume_content_source.and_then(|s| s.r#type) {
            None => (None, 0),
            Some(SourceType::Snapshot(s)) => {
                let h = self.snapshot_handle(&s.snapshot_id)?;
                let snap = self.backend.snapshot(&h.image).await?.ok_or_else(|| {
                    SnapshotError::Missing {
                        snapshot: h.clone(),
                    }
                })?;
                (Some(Source::Snapshot(h.image)), snap.size)
            }
            Some(SourceType::Volume(v)) => {
                let h = self.volume_handle(&v.volume_id)?;
                let src = self.existing_volume(&h).await?;
                (Some(Source::Volume(h.image)), src.size)
            }
        };
        let minimum = minimum.max(request::filesystem_minimum(&r.volume_capabilities));
        let size = request::size_for(
            r.capacity_range.as_ref(),
            minimum,
            self.backend.granularity(),
        )?;
        let mut keys = vec![volume_lock(&image)];
        match &source {
            Some(Source::Snapshot(s)) => keys.push(snapshot_lock(s)),
            Some(Source::Volume(v)) => keys.push(volume_lock(v)),
            None => {}
        }
        let _locked = self.images.lock_all(&keys).await;
        if let Some(existing) = self.backend.volume(&image).await? {
            // The recorded source is in the backend's one form of its key; the request's id
            // may have another (a uStor id without its connection).
            let same_source = existing.source
                == source
                    .as_ref()
                    .map(|s| s.with_key(self.backend.source_key(s.key())));
            let same = existing.name == r.name
                && existing.parameters == parameters
                && same_source
                && request::fits(existing.size, r.capacity_range.as_ref());
            if !same {
                return Err(VolumeError::Clash { name: r.name }.into());
            }
            // The mutable parameters are not compared: ControllerModifyVolume may have changed
            // them since. The same answer as the first call's: the source as this request
            // names it.
            let existing = VolumeMeta { source, ..existing };
            return Ok(CreateVolumeResponse {
                volume: Some(self.volume_answer(&image, &existing).await?),
            });
        }
        let meta = VolumeMeta {
            name: r.name,
            size,
            parameters,
            source,
            published: BTreeMap::new(),
            mutable,
            grants: BTreeMap::new(),
            adopted_by: None,
        };
        self.backend.create_volume(&image, &meta).await?;
        tracing::info!(%image, size, "volume created");
        Ok(CreateVolumeResponse {
            volume: Some(self.volume_answer(&image, &meta).await?),
        })
    }

    pub async fn delete_volume(
        &self,
        r: DeleteVolumeRequest,
    ) -> Result<DeleteVolumeResponse, Error> {
        let Some(h) = self.issued_by_us(self.volume_handle(&r.volume_id), "DeleteVolume")? else {
            return Ok(DeleteVolumeResponse {});
        };
        let _locked = self.images.lock(&volume_lock(&h.image)).await;
        if let Some(meta) = self.backend.volume(&h.image).await? {
            if !meta.published.is_empty() {
                return Err(VolumeError::StillPublished {
                    volume: h,
                    nodes: meta.published.into_keys().collect(),
                }
                .into());
            }
        }
        self.backend.delete_volume(&h.image).await?;
        Ok(DeleteVolumeResponse {})
    }

    pub async fn expand_volume(
        &self,
        r: ControllerExpandVolumeRequest,
    ) -> Result<ControllerExpandVolumeResponse, Error> {
        require(!r.volume_id.is_empty(), "volume_id")?;
        let range = r
            .capacity_range
            .as_ref()
            .ok_or(request::RequestError::Missing {
                field: "capacity_range",
            })?;
        if let Some(cap) = &r.volume_capability {
            request::check_capability(cap)?;
        }
        let h = self.volume_handle(&r.volume_id)?;
        let _locked = self.images.lock(&volume_lock(&h.image)).await;
        let meta = self.existing_volume(&h).await?;
        let size = request::size_for(Some(range), meta.size, self.backend.granularity())?;
        if size > meta.size {
            self.backend.grow_volume(&h.image, size).await?;
            tracing::info!(image = %h.image, from = meta.size, to = size, "volume expanded");
        }
        // The node resizes the NBD device (and the filesystem) in every case.
        Ok(ControllerExpandVolumeResponse {
            capacity_bytes: wire_size(size.max(meta.size)),
            node_expansion_required: true,
        })
    }

    /// Records new mutable parameters (a VolumeAttributesClass's). Nothing on a node changes
    /// now: a node takes `nbdConnections` from the publish context, so the new count holds
    /// from the next ControllerPublishVolume to a node on (the volume's next attach there).
    pub async fn modify_volume(
        &self,
        r: ControllerModifyVolumeRequest,
    ) -> Result<ControllerModifyVolumeResponse, Error> {
        require(!r.volume_id.is_empty(), "volume_id")?;
        let changes = request::mutable_parameters(&r.mutable_parameters)?;
        let h = self.volume_handle(&r.volume_id)?;
        let _locked = self.images.lock(&volume_lock(&h.image)).await;
        let mut meta = self.existing_volume(&h).await?;
        let before = meta.mutable.clone();
        meta.mutable.extend(changes);
        if meta.mutable != before {
            self.backend.update_volume(&h.image, &meta).await?;
            tracing::info!(image = %h.image, mutable = ?meta.mutable, "volume modified");
        }
        Ok(ControllerModifyVolumeResponse {})
    }

    /// Confirms the capabilities the driver supports; a refused one is an answer with the
    /// reason, not an error.
    pub async fn validate_capabilities(
        &self,
        r: ValidateVolumeCapabilitiesRequest,
    ) -> Result<ValidateVolumeCapabilitiesResponse, Error> {
        require(!r.volume_id.is_empty(), "volume_id")?;
        require(!r.volume_capabilities.is_empty(), "volume_capabilities")?;
        let h = self.volume_handle(&r.volume_id)?;
        self.existing_volume(&h).await?;
        if let Err(refused) = r
            .volume_capabilities
            .iter()
            .try_for_each(|cap| request::check_capability(cap).map(drop))
        {
            return Ok(ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: refused.to_string(),
            });
        }
        Ok(ValidateVolumeCapabilitiesResponse {
            confirmed: Some(validate_volume_capabilities_response::Confirmed {
                volume_context: r.volume_context,
                volume_capabilities: r.volume_capabilities,
                parameters: r.parameters,
            }),
            message: String::new(),
        })
    }

    pub async fn capacity(&self, r: GetCapacityRequest) -> Result<GetCapacityResponse, Error> {
        let parameters = request::parameters(&r.parameters)?;
        let available = self.backend.capacity(&parameters).await?;
        Ok(GetCapacityResponse {
            available_capacity: wire_size(available.unwrap_or_default()),
            maximum_volume_size: None,
            minimum_volume_size: Some(wire_size(self.backend.granularity())),
        })
    }
}
