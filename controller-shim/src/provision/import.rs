//! Adoption of an image this driver did not make (the old product's, or one an operator made
//! with uStor's own tools) as a volume of this driver, without copying it: the image gets the
//! records CreateVolume would have given it, and the answer is the volume as CreateVolume
//! would have answered, from which `ustor-csi-controller import` writes a PersistentVolume.

use std::collections::{BTreeMap, HashMap};

use csi_proto::csi::Volume;

use super::{volume_lock, Provisioner};
use crate::backend::{BackendError, VolumeMeta};
use crate::ids::IdError;
use crate::request::{self, RequestError};

/// Why an image is not adopted.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("image {key} does not exist")]
    Missing { key: String },
    /// A volume of this driver already, under another name: adopting it again would give one
    /// image two PersistentVolumes.
    #[error(
        "image {key} is volume {name:?} of this driver already; its PersistentVolume is the one \
         for it (import it only once, under one name)"
    )]
    AlreadyVolume { key: String, name: String },
    /// Nodes hold live grants of it: published by this driver, so in use.
    #[error("image {key} is granted to node(s) {}: it is in use; unpublish it first", nodes.join(", "))]
    Granted { key: String, nodes: Vec<String> },
    #[error("the volume name: {0}")]
    Name(#[source] IdError),
    #[error("the parameters: {0}")]
    Parameters(#[source] RequestError),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl Provisioner {
    /// Records the image keyed `key` as volume `name` with the StorageClass parameters
    /// `parameters`, and answers it as CreateVolume would. Idempotent: an image adopted under
    /// `name` already is answered again, so a run cut short is simply run again.
    pub async fn import_volume(
        &self,
        key: &str,
        name: &str,
        parameters: &HashMap<String, String>,
    ) -> Result<Volume, ImportError> {
        crate::ids::image_for(&self.cluster_id, name).map_err(ImportError::Name)?;
        let parameters = request::parameters(parameters).map_err(ImportError::Parameters)?;
        let _locked = self.images.lock(&volume_lock(key)).await;
        let found = self
            .backend
            .volume(key)
            .await?
            .ok_or_else(|| ImportError::Missing {
                key: key.to_owned(),
            })?;
        if !found.name.is_empty() {
            if found.name != name {
                return Err(ImportError::AlreadyVolume {
                    key: key.to_owned(),
                    name: found.name,
                });
            }
            return Ok(self.volume_answer(key, &found).await?);
        }
        let nodes = self.backend.granted_nodes(key).await?;
        if !nodes.is_empty() {
            return Err(ImportError::Granted {
                key: key.to_owned(),
                nodes,
            });
        }
        let meta = VolumeMeta {
            name: name.to_owned(),
            size: found.size,
            parameters,
            source: None,
            published: BTreeMap::new(),
            mutable: BTreeMap::new(),
            grants: BTreeMap::new(),
            adopted_by: Some(self.cluster_id.clone()),
        };
        self.backend.update_volume(key, &meta).await?;
        tracing::info!(image = %key, name, size = meta.size, "image adopted as a volume");
        Ok(self.volume_answer(key, &meta).await?)
    }
}
