//! Snapshots: CreateSnapshot, DeleteSnapshot, ListSnapshots (filtered by id or source, paged).

use csi_proto::csi::*;

use super::{now_seconds, snapshot_lock, volume_lock, Provisioner};
use crate::backend::SnapshotMeta;
use crate::error::Error;
use crate::ids::{image_for, Handle};
use crate::request;

/// Why a snapshot operation cannot be done (the request itself being valid).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot {snapshot} does not exist")]
    Missing { snapshot: Handle },
    /// A repeated CreateSnapshot under the same name, of another volume.
    #[error("snapshot {name:?} already exists for another volume")]
    Clash { name: String },
}

impl Provisioner {
    pub async fn create_snapshot(
        &self,
        r: CreateSnapshotRequest,
    ) -> Result<CreateSnapshotResponse, Error> {
        // Name and parameters first: a request without a name is invalid whatever its
        // source (csi-sanity).
        let name = image_for(&self.cluster_id, &r.name)?;
        request::no_snapshot_parameters(&r.parameters)?;
        let source = self.volume_handle(&r.source_volume_id)?;
        let image = self.backend.snapshot_key(&name, &source.image);
        let _locked = self
            .images
            .lock_all(&[snapshot_lock(&image), volume_lock(&source.image)])
            .await;
        if let Some(existing) = self.backend.snapshot(&image).await? {
            // The snapshot's image is derived from its name, so the name matches already;
            // a member of a group snapshot under that image is not this call's.
            if existing.source_image != source.image || existing.group.is_some() {
                return Err(SnapshotError::Clash { name: r.name }.into());
            }
            return Ok(CreateSnapshotResponse {
                snapshot: Some(self.snapshot_answer(&image, &existing)),
            });
        }
        let volume = self.existing_volume(&source).await?;
        let meta = SnapshotMeta {
            name: r.name,
            source_image: source.image.clone(),
            size: volume.size,
            created: now_seconds(),
            group: None,
        };
        self.backend.create_snapshot(&image, &meta).await?;
        tracing::info!(%image, source = %source.image, "snapshot created");
        Ok(CreateSnapshotResponse {
            snapshot: Some(self.snapshot_answer(&image, &meta)),
        })
    }

    pub async fn delete_snapshot(
        &self,
        r: DeleteSnapshotRequest,
    ) -> Result<DeleteSnapshotResponse, Error> {
        let Some(h) = self.issued_by_us(self.snapshot_handle(&r.snapshot_id), "DeleteSnapshot")?
        else {
            return Ok(DeleteSnapshotResponse {});
        };
        let _locked = self.images.lock(&snapshot_lock(&h.image)).await;
        self.backend.delete_snapshot(&h.image).await?;
        Ok(DeleteSnapshotResponse {})
    }

    pub async fn list_snapshots(
        &self,
        r: ListSnapshotsRequest,
    ) -> Result<ListSnapshotsResponse, Error> {
        if r.max_entries < 0 {
            return Err(request::RequestError::NegativeMaxEntries.into());
        }
        // An id of another backend or a malformed one simply matches nothing.
        let by_id = (!r.snapshot_id.is_empty()).then(|| self.snapshot_handle(&r.snapshot_id).ok());
        let by_source =
            (!r.source_volume_id.is_empty()).then(|| self.volume_handle(&r.source_volume_id).ok());
        // The pool to look in is the one the filter's id names.
        let near = by_id
            .iter()
            .chain(by_source.iter())
            .flatten()
            .map(|h| h.image.clone())
            .next();
        let mut all = self.backend.snapshots(near.as_deref()).await?;
        if let Some(wanted) = &by_id {
            all.retain(|(image, _)| wanted.as_ref().is_some_and(|w| &w.image == image));
        }
        if let Some(wanted) = &by_source {
            all.retain(|(_, m)| wanted.as_ref().is_some_and(|w| w.image == m.source_image));
        }
        let page = request::page(r.max_entries, &r.starting_token, all.len())?;
        let entries: Vec<_> = all
            .iter()
            .skip(page.start)
            .take(page.take)
            .map(|(image, meta)| list_snapshots_response::Entry {
                snapshot: Some(self.snapshot_answer(image, meta)),
            })
            .collect();
        Ok(ListSnapshotsResponse {
            next_token: page.next_token(entries.len(), all.len()),
            entries,
        })
    }
}
