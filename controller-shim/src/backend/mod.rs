//! Storage backends: one trait; a local directory of image files (the embedded default), one
//! uStor cluster's management API, and the uStor clusters of every MindUstorStorageConnection.

pub mod connections;
pub mod error;
pub mod grants;
pub mod local;
pub mod ustor;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

pub use error::BackendError;
pub use grants::{Grant, GrantToken};

/// What a new volume is filled from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "image", rename_all = "snake_case")]
pub enum Source {
    Snapshot(String),
    Volume(String),
}

impl Source {
    /// The image key of the snapshot or volume.
    pub fn key(&self) -> &str {
        match self {
            Source::Snapshot(k) | Source::Volume(k) => k,
        }
    }

    /// The same kind of source under `key`.
    pub fn with_key(&self, key: String) -> Self {
        match self {
            Source::Snapshot(_) => Source::Snapshot(key),
            Source::Volume(_) => Source::Volume(key),
        }
    }
}

/// What CreateVolume asked for, kept so a repeated call can be told from a clash, and which
/// nodes the volume is published to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMeta {
    pub name: String,
    pub size: u64,
    pub parameters: BTreeMap<String, String>,
    pub source: Option<Source>,
    /// Node id → published read-only.
    #[serde(default)]
    pub published: BTreeMap<String, bool>,
    /// The mutable parameters (a VolumeAttributesClass's), as CreateVolume gave them or
    /// ControllerModifyVolume last set them; each overrides the StorageClass's parameter of
    /// the same name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mutable: BTreeMap<String, String>,
    /// Node id → its live grant, where the backend keeps grants with the volume (local);
    /// the backend's own: [`Backend::update_volume`] keeps what is stored.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub grants: BTreeMap<String, Grant>,
    /// The cluster id that adopted the image (`ustor-csi-controller import`), whose name is
    /// therefore not `<cluster id>-<name>`; `None` for the volumes CreateVolume made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopted_by: Option<String>,
}

impl VolumeMeta {
    /// The parameter `key` in force: the mutable one if set, else the StorageClass's.
    pub fn parameter(&self, key: &str) -> Option<&String> {
        self.mutable.get(key).or_else(|| self.parameters.get(key))
    }
}

/// A volume as [`Backend::volumes`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedVolume {
    pub key: String,
    pub meta: VolumeMeta,
    /// Its NBD URI, when the listing told it: ListVolumes then needs no look-up per volume.
    pub export: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotMeta {
    pub name: String,
    pub source_image: String,
    pub size: u64,
    /// Seconds since the Unix epoch.
    pub created: i64,
    /// The key of the group snapshot it was taken with, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

/// A group snapshot: snapshots of several volumes, taken at one point in time. Each member is
/// also an ordinary snapshot, restorable alone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSnapshotMeta {
    pub name: String,
    /// Each member's snapshot key → the key of the volume it was taken of.
    pub members: BTreeMap<String, String>,
    /// Seconds since the Unix epoch.
    pub created: i64,
}

#[tonic::async_trait]
pub trait Backend: Send + Sync + fmt::Debug {
    /// Short name, the first part of every id.
    fn name(&self) -> &'static str;
    /// Sizes are rounded up to a multiple of this.
    fn granularity(&self) -> u64;
    /// The NBD URI nodes attach the image through.
    async fn export_uri(&self, image: &str) -> Result<String, BackendError>;
    /// The node's TLS profile an `nbds://` export of `image` is dialed with (the node's
    /// default TLS settings when `None`).
    fn tls_profile(&self, _image: &str) -> Option<String> {
        None
    }

    /// Where a new volume's image lives, as the backend keys it (for uStor, `<pool>/<image>`
    /// with the pool from the StorageClass). The key is what volume ids carry.
    fn volume_key(
        &self,
        image: &str,
        _parameters: &BTreeMap<String, String>,
    ) -> Result<String, BackendError> {
        Ok(image.to_owned())
    }

    /// Where a snapshot of the volume keyed `source` lives (uStor keeps it in the volume's pool).
    fn snapshot_key(&self, image: &str, _source: &str) -> String {
        image.to_owned()
    }

    /// A source's key (a snapshot's or volume's, from an id) in the one form [`volume`]
    /// answers sources in, where ids have more than one form for an image: a repeated
    /// CreateVolume compares its source by this, whichever form its id had.
    ///
    /// [`volume`]: Backend::volume
    fn source_key(&self, key: &str) -> String {
        key.to_owned()
    }

    /// What was recorded for the volume; its source in the form of [`source_key`].
    ///
    /// [`source_key`]: Backend::source_key
    async fn volume(&self, image: &str) -> Result<Option<VolumeMeta>, BackendError>;
    /// Every volume with recorded metadata, by key, sorted by key (images of other tools, which
    /// have none, are not volumes). All or an error: a list with a part missing would tell
    /// its reader that the missing volumes are gone.
    async fn volumes(&self) -> Result<Vec<ListedVolume>, BackendError>;
    /// What is wrong with the recorded volume `image` as the storage sees it (its data gone
    /// or short, its export server down), in words for an operator; `None` when nothing is.
    async fn problem(&self, image: &str, meta: &VolumeMeta)
        -> Result<Option<String>, BackendError>;
    /// Creates the image (empty, or filled from `meta.source`) and records `meta`.
    async fn create_volume(&self, image: &str, meta: &VolumeMeta) -> Result<(), BackendError>;
    /// Records a changed `meta` (publications) without touching data.
    async fn update_volume(&self, image: &str, meta: &VolumeMeta) -> Result<(), BackendError>;
    /// Idempotent.
    async fn delete_volume(&self, image: &str) -> Result<(), BackendError>;
    /// Grows the image; never shrinks.
    async fn grow_volume(&self, image: &str, size: u64) -> Result<(), BackendError>;

    /// Lets `node` open exports of `image`: the token it presents. Idempotent: while the
    /// grant is live, the same token. Stored before it is answered.
    async fn grant(
        &self,
        image: &str,
        node: &str,
        readonly: bool,
    ) -> Result<GrantToken, BackendError>;
    /// Ends `node`'s grant of `image`; returns only once that grant's open NBD connections
    /// are cut. Idempotent.
    async fn revoke(&self, image: &str, node: &str) -> Result<(), BackendError>;
    /// The nodes holding a live grant of `image`.
    async fn granted_nodes(&self, image: &str) -> Result<Vec<String>, BackendError>;

    async fn snapshot(&self, image: &str) -> Result<Option<SnapshotMeta>, BackendError>;
    async fn create_snapshot(&self, image: &str, meta: &SnapshotMeta) -> Result<(), BackendError>;
    /// Idempotent.
    async fn delete_snapshot(&self, image: &str) -> Result<(), BackendError>;
    /// Every snapshot, by image name. `near` is an image key the caller filters by (a
    /// snapshot's, or a source volume's): a backend with pools looks in that key's pool,
    /// else in its default one.
    async fn snapshots(
        &self,
        near: Option<&str>,
    ) -> Result<Vec<(String, SnapshotMeta)>, BackendError>;

    /// Where a group snapshot of the volumes keyed `sources` lives (uStor: in their pool, and
    /// they must share one).
    fn group_key(&self, image: &str, _sources: &[&str]) -> Result<String, BackendError> {
        Ok(image.to_owned())
    }
    async fn group_snapshot(&self, key: &str) -> Result<Option<GroupSnapshotMeta>, BackendError>;
    /// Takes the snapshots `members` (each with its source volume and `key` as its group)
    /// at one point in time, then records `meta`. All or none: a failure leaves no member.
    async fn create_group_snapshot(
        &self,
        key: &str,
        meta: &GroupSnapshotMeta,
        members: &[(String, SnapshotMeta)],
    ) -> Result<(), BackendError>;
    /// Removes the group's record; the caller deletes its members first. Idempotent.
    async fn delete_group_snapshot(&self, key: &str) -> Result<(), BackendError>;

    /// Bytes available for new volumes with these StorageClass parameters (a pool), if the
    /// backend can tell.
    async fn capacity(
        &self,
        parameters: &BTreeMap<String, String>,
    ) -> Result<Option<u64>, BackendError>;
}
