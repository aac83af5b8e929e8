//! Group snapshots: CreateVolumeGroupSnapshot, GetVolumeGroupSnapshot,
//! DeleteVolumeGroupSnapshot. The members of a group are taken at one point in time by the
//! backend; each is also an ordinary snapshot (listed, restorable and deletable alone), named
//! after the group and its source so that a repeated call takes the same ones.

use std::collections::BTreeSet;

use csi_proto::csi::*;

use super::{now_seconds, snapshot_lock, volume_lock, Provisioner};
use crate::backend::{GroupSnapshotMeta, SnapshotMeta};
use crate::error::Error;
use crate::ids::{image_for, member_image, Handle, Kind};
use crate::request::{self, RequestError};

/// Why a group snapshot operation cannot be done (the request itself being valid).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    #[error("group snapshot {group} does not exist")]
    Missing { group: Handle },
    /// A repeated CreateVolumeGroupSnapshot under the same name, of other volumes.
    #[error("group snapshot {name:?} already exists with other volumes: {volumes:?}")]
    Clash { name: String, volumes: Vec<String> },
    /// A snapshot under a member's name that was not taken with the group.
    #[error("snapshot {snapshot} exists already and was not taken with group snapshot {name:?}")]
    MemberTaken { name: String, snapshot: Handle },
    /// The CO's list of the group's snapshots names one the group does not have.
    #[error("snapshot_ids does not match group snapshot {group}: {snapshot} is not a member")]
    NotMember { group: Handle, snapshot: String },
}

/// The lock key of a group snapshot's record.
fn group_lock(key: &str) -> String {
    format!("g:{key}")
}

impl Provisioner {
    fn group_handle(&self, raw: &str) -> Result<Handle, crate::ids::IdError> {
        Handle::parse(raw, self.backend.name(), Kind::Group)
    }

    pub async fn create_group_snapshot(
        &self,
        r: CreateVolumeGroupSnapshotRequest,
    ) -> Result<CreateVolumeGroupSnapshotResponse, Error> {
        let image = image_for(&self.cluster_id, &r.name)?;
        request::no_snapshot_parameters(&r.parameters)?;
        if r.source_volume_ids.is_empty() {
            return Err(RequestError::Missing {
                field: "source_volume_ids",
            }
            .into());
        }
        let mut sources: Vec<Handle> = Vec::with_capacity(r.source_volume_ids.len());
        for raw in &r.source_volume_ids {
            let h = self.volume_handle(raw)?;
            if sources.contains(&h) {
                return Err(RequestError::DuplicateSource {
                    volume_id: raw.clone(),
                }
                .into());
            }
            sources.push(h);
        }
        let source_keys: Vec<&str> = sources.iter().map(|h| h.image.as_str()).collect();
        let key = self.backend.group_key(&image, &source_keys)?;
        // Each member's snapshot key, with its source volume.
        let mut members = Vec::with_capacity(sources.len());
        for source in &sources {
            let member = member_image(&self.cluster_id, &r.name, &source.image)?;
            members.push((self.backend.snapshot_key(&member, &source.image), source));
        }
        let mut locks = vec![group_lock(&key)];
        for (snapshot, source) in &members {
            locks.push(snapshot_lock(snapshot));
            locks.push(volume_lock(&source.image));
        }
        let _locked = self.images.lock_all(&locks).await;

        if let Some(existing) = self.backend.group_snapshot(&key).await? {
            let asked: BTreeSet<String> = sources
                .iter()
                .map(|h| self.backend.source_key(&h.image))
                .collect();
            let had: BTreeSet<String> = existing
                .members
                .values()
                .map(|k| self.backend.source_key(k))
                .collect();
            if asked != had {
                return Err(GroupError::Clash {
                    name: r.name,
                    volumes: had.into_iter().collect(),
                }
                .into());
            }
            return Ok(CreateVolumeGroupSnapshotResponse {
                group_snapshot: Some(self.group_answer(&key, &existing).await?),
            });
        }

        let created = now_seconds();
        let mut taken = Vec::with_capacity(members.len());
        for (snapshot, source) in &members {
            // A member left by an attempt that crashed before the group was recorded is
            // taken anew; anything else under the name is not ours to overwrite.
            if let Some(existing) = self.backend.snapshot(snapshot).await? {
                if existing.group.as_deref() != Some(key.as_str()) {
                    return Err(GroupError::MemberTaken {
                        name: r.name,
                        snapshot: Handle::new(
                            self.backend.name(),
                            Kind::Snapshot,
                            snapshot.clone(),
                        ),
                    }
                    .into());
                }
            }
            let volume = self.existing_volume(source).await?;
            taken.push((
                snapshot.clone(),
                SnapshotMeta {
                    name: format!("{}/{}", r.name, source.image),
                    source_image: source.image.clone(),
                    size: volume.size,
                    created,
                    group: Some(key.clone()),
                },
            ));
        }
        let meta = GroupSnapshotMeta {
            name: r.name,
            members: taken
                .iter()
                .map(|(s, m)| (s.clone(), m.source_image.clone()))
                .collect(),
            created,
        };
        self.backend
            .create_group_snapshot(&key, &meta, &taken)
            .await?;
        tracing::info!(group = %key, members = taken.len(), "group snapshot created");
        Ok(CreateVolumeGroupSnapshotResponse {
            group_snapshot: Some(self.group_answer(&key, &meta).await?),
        })
    }

    pub async fn get_group_snapshot(
        &self,
        r: GetVolumeGroupSnapshotRequest,
    ) -> Result<GetVolumeGroupSnapshotResponse, Error> {
        let h = self.group_handle(&r.group_snapshot_id)?;
        let _locked = self.images.lock(&group_lock(&h.image)).await;
        let group = self.recorded_group(&h).await?;
        self.only_members(&h, &group, &r.snapshot_ids)?;
        Ok(GetVolumeGroupSnapshotResponse {
            group_snapshot: Some(self.group_answer(&h.image, &group).await?),
        })
    }

    /// The members first, the record last: a delete cut short leaves the record, and its
    /// retry deletes what is left.
    pub async fn delete_group_snapshot(
        &self,
        r: DeleteVolumeGroupSnapshotRequest,
    ) -> Result<DeleteVolumeGroupSnapshotResponse, Error> {
        let Some(h) = self.issued_by_us(
            self.group_handle(&r.group_snapshot_id),
            "DeleteVolumeGroupSnapshot",
        )?
        else {
            return Ok(DeleteVolumeGroupSnapshotResponse {});
        };
        let _group = self.images.lock(&group_lock(&h.image)).await;
        let Some(group) = self.backend.group_snapshot(&h.image).await? else {
            return Ok(DeleteVolumeGroupSnapshotResponse {});
        };
        self.only_members(&h, &group, &r.snapshot_ids)?;
        for snapshot in group.members.keys() {
            let _member = self.images.lock(&snapshot_lock(snapshot)).await;
            self.backend.delete_snapshot(snapshot).await?;
        }
        self.backend.delete_group_snapshot(&h.image).await?;
        tracing::info!(group = %h.image, members = group.members.len(), "group snapshot deleted");
        Ok(DeleteVolumeGroupSnapshotResponse {})
    }

    async fn recorded_group(&self, h: &Handle) -> Result<GroupSnapshotMeta, Error> {
        self.backend
            .group_snapshot(&h.image)
            .await?
            .ok_or_else(|| GroupError::Missing { group: h.clone() }.into())
    }

    /// The CO's `snapshot_ids` (optional for us: the record lists the members) may name only
    /// members: any other is a mismatch the spec asks to report.
    fn only_members(
        &self,
        h: &Handle,
        group: &GroupSnapshotMeta,
        snapshot_ids: &[String],
    ) -> Result<(), GroupError> {
        for raw in snapshot_ids {
            let member = self
                .snapshot_handle(raw)
                .ok()
                .filter(|s| group.members.contains_key(&s.image));
            if member.is_none() {
                return Err(GroupError::NotMember {
                    group: h.clone(),
                    snapshot: raw.clone(),
                });
            }
        }
        Ok(())
    }

    /// The group as the CSI answers it: the members that still exist (one deleted alone is
    /// left out), ready, since the backend's snapshots are complete when taken.
    async fn group_answer(
        &self,
        key: &str,
        group: &GroupSnapshotMeta,
    ) -> Result<VolumeGroupSnapshot, Error> {
        let mut snapshots = Vec::with_capacity(group.members.len());
        for snapshot in group.members.keys() {
            if let Some(meta) = self.backend.snapshot(snapshot).await? {
                snapshots.push(self.snapshot_answer(snapshot, &meta));
            }
        }
        Ok(VolumeGroupSnapshot {
            group_snapshot_id: Handle::new(self.backend.name(), Kind::Group, key.to_owned())
                .to_string(),
            snapshots,
            creation_time: Some(prost_types::Timestamp {
                seconds: group.created,
                nanos: 0,
            }),
            ready_to_use: true,
        })
    }
}
