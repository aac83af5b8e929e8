//! The controller's domain: volumes, their publications and snapshots over a [`Backend`].
//! Each operation takes the CSI request, checks it ([`crate::request`]), takes the locks of
//! the images it touches, and gives the CSI answer or a typed error; which gRPC code that
//! error becomes is `service::codes`'s business.
//!
//! - [`volumes`]: create, delete, expand, modify, validate capabilities, capacity;
//! - [`publish`]: ControllerPublish/Unpublish bookkeeping and the node check;
//! - [`snapshots`]: create, delete, list;
//! - [`groups`]: group snapshots, whose members are taken at one point in time;
//! - [`listing`]: ListVolumes and ControllerGetVolume, with each volume's condition;
//! - [`claims`]: the claim check of a ReadWriteMany block volume;
//! - [`import`]: adoption of an image another tool made, for `ustor-csi-controller import`.

pub mod claims;
pub mod groups;
pub mod import;
pub mod listing;
pub mod publish;
pub mod snapshots;
pub mod volumes;

use std::collections::HashMap;
use std::sync::Arc;

use csi_common::locks::KeyedLocks;
use csi_proto::csi::volume_content_source::{SnapshotSource, Type as SourceType, VolumeSource};
use csi_proto::csi::{Snapshot, Topology, Volume, VolumeContentSource};

use crate::backend::{Backend, BackendError, SnapshotMeta, Source, VolumeMeta};
use crate::ids::{Handle, IdError, Kind};
pub use claims::{ClaimError, Claims};
pub use groups::GroupError;
pub use publish::Nodes;
pub use snapshots::SnapshotError;
pub use volumes::VolumeError;

/// Topology segment every node running the node service reports.
pub use csi_common::TOPOLOGY_KEY;

#[derive(Debug)]
pub struct Provisioner {
    backend: Arc<dyn Backend>,
    cluster_id: String,
    /// One mutating call per image at a time (`v:<key>` volumes, `s:<key>` snapshots): a
    /// long copy for a clone holds its own images, not every other call.
    images: KeyedLocks,
    /// What the cluster says, when running in Kubernetes; without it every node id is taken
    /// as given and no claim is checked.
    cluster: Option<Cluster>,
    /// Deletes of ids this driver did not issue, counted for operators.
    foreign_ids: Arc<crate::metrics::ForeignIdMetrics>,
}

/// What the Kubernetes glue knows that calls check against.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// The nodes ControllerPublishVolume may publish to.
    pub nodes: Arc<dyn Nodes>,
    /// The claims a ReadWriteMany block volume may be made for.
    pub claims: Arc<dyn Claims>,
}

/// The lock key of a volume's image.
fn volume_lock(image: &str) -> String {
    format!("v:{image}")
}

/// The lock key of a snapshot's image.
fn snapshot_lock(image: &str) -> String {
    format!("s:{image}")
}

/// Now, in seconds since the Unix epoch, as snapshot records keep it.
fn now_seconds() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or_default()
}

impl Provisioner {
    pub fn new(backend: Arc<dyn Backend>, cluster_id: String) -> Self {
        Self {
            backend,
            cluster_id,
            images: KeyedLocks::default(),
            cluster: None,
            foreign_ids: Arc::default(),
        }
    }

    /// Counts deletes of foreign ids in `metrics` (the served ones).
    pub fn counting_foreign_ids(mut self, metrics: Arc<crate::metrics::ForeignIdMetrics>) -> Self {
        self.foreign_ids = metrics;
        self
    }

    /// Checks ControllerPublishVolume's node id and the claims of ReadWriteMany block
    /// volumes against `cluster`.
    pub fn in_cluster(mut self, cluster: Cluster) -> Self {
        self.cluster = Some(cluster);
        self
    }

    fn volume_handle(&self, raw: &str) -> Result<Handle, IdError> {
        Handle::parse(raw, self.backend.name(), Kind::Volume)
    }

    fn snapshot_handle(&self, raw: &str) -> Result<Handle, IdError> {
        Handle::parse(raw, self.backend.name(), Kind::Snapshot)
    }

    async fn existing_volume(&self, h: &Handle) -> Result<VolumeMeta, crate::error::Error> {
        self.backend
            .volume(&h.image)
            .await?
            .ok_or_else(|| VolumeError::Missing { volume: h.clone() }.into())
    }

    /// What a node needs to attach `image`: its URI, the connection count `connections`,
    /// and for an `nbds://` export the TLS profile of its connection.
    async fn export_context(
        &self,
        image: &str,
        connections: Option<&String>,
    ) -> Result<HashMap<String, String>, BackendError> {
        let uri = self.backend.export_uri(image).await?;
        Ok(self.context_at(image, connections, uri))
    }

    /// [`export_context`](Self::export_context) with the URI known.
    fn context_at(
        &self,
        image: &str,
        connections: Option<&String>,
        uri: String,
    ) -> HashMap<String, String> {
        let mut context = HashMap::new();
        if let Some(n) = connections {
            context.insert("nbdConnections".into(), n.clone());
        }
        if uri.parse::<nbd::NbdUri>().is_ok_and(|u| u.tls()) {
            if let Some(profile) = self.backend.tls_profile(image) {
                context.insert("tlsProfile".into(), profile);
            }
        }
        context.insert("nbdUri".into(), uri);
        context
    }

    /// The volume as CreateVolume answered it. Its context is the spec's "static properties"
    /// (the same in every answer), so it holds the StorageClass's connection count; the one in
    /// force, which ControllerModifyVolume may change, is in each publish context.
    async fn volume_answer(&self, image: &str, meta: &VolumeMeta) -> Result<Volume, BackendError> {
        self.volume_answer_at(image, meta, None).await
    }

    /// [`volume_answer`](Self::volume_answer), with the export's URI when the caller has it
    /// (a listing told it); else it is looked up.
    async fn volume_answer_at(
        &self,
        image: &str,
        meta: &VolumeMeta,
        uri: Option<String>,
    ) -> Result<Volume, BackendError> {
        let uri = match uri {
            Some(uri) => uri,
            None => self.backend.export_uri(image).await?,
        };
        let context = self.context_at(image, meta.parameters.get("nbdConnections"), uri);
        Ok(Volume {
            capacity_bytes: wire_size(meta.size),
            volume_id: Handle::new(self.backend.name(), Kind::Volume, image.to_owned()).to_string(),
            volume_context: context,
            content_source: meta.source.as_ref().map(|s| self.content_source(s)),
            accessible_topology: vec![Topology {
                segments: [(TOPOLOGY_KEY.to_owned(), "true".to_owned())].into(),
            }],
        })
    }

    fn content_source(&self, source: &Source) -> VolumeContentSource {
        let backend = self.backend.name();
        VolumeContentSource {
            r#type: Some(match source {
                Source::Snapshot(s) => SourceType::Snapshot(SnapshotSource {
                    snapshot_id: Handle::new(backend, Kind::Snapshot, s.clone()).to_string(),
                }),
                Source::Volume(v) => SourceType::Volume(VolumeSource {
                    volume_id: Handle::new(backend, Kind::Volume, v.clone()).to_string(),
                }),
            }),
        }
    }

    fn snapshot_answer(&self, image: &str, meta: &SnapshotMeta) -> Snapshot {
        let backend = self.backend.name();
        Snapshot {
            size_bytes: wire_size(meta.size),
            snapshot_id: Handle::new(backend, Kind::Snapshot, image.to_owned()).to_string(),
            source_volume_id: Handle::new(backend, Kind::Volume, meta.source_image.clone())
                .to_string(),
            creation_time: Some(prost_types::Timestamp {
                seconds: meta.created,
                nanos: 0,
            }),
            ready_to_use: true,
            group_snapshot_id: meta
                .group
                .as_ref()
                .map(|g| Handle::new(backend, Kind::Group, g.clone()).to_string())
                .unwrap_or_default(),
        }
    }
}

/// A size for the wire's signed fields; no image reaches 2^63 bytes.
fn wire_size(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

impl Provisioner {
    /// For deletes: an id this driver did not issue names nothing, so for the spec it is
    /// already deleted (`None`); any other parse error stands. It is logged as a warning and
    /// counted: after a move from the old product, such an id is an image left behind.
    fn issued_by_us(
        &self,
        parsed: Result<Handle, IdError>,
        op: &'static str,
    ) -> Result<Option<Handle>, IdError> {
        match parsed {
            Err(e) if e.is_unknown_id() => {
                tracing::warn!(
                    op,
                    why = %e,
                    "an id this driver did not issue: nothing deleted; if it names an image of the \
                     old product, that image is still on the storage"
                );
                self.foreign_ids.deleted(op);
                Ok(None)
            }
            other => other.map(Some),
        }
    }
}
