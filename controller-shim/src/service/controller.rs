//! CSI Controller over a [`Backend`]: provisioning, publication bookkeeping, snapshots,
//! expansion. Every call validates its input first and answers with the spec's codes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use csi_proto::capability::{self, Shape};
use csi_proto::csi::controller_server::Controller;
use csi_proto::csi::controller_service_capability::rpc::Type as Rpc;
use csi_proto::csi::controller_service_capability::{Rpc as RpcCap, Type as CapType};
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::volume_content_source::{SnapshotSource, Type as SourceType, VolumeSource};
use csi_proto::csi::*;
use csi_proto::locks::KeyedLocks;
use tonic::{Request, Response, Status};

use crate::backend::{Backend, SnapshotMeta, Source, VolumeMeta};
use crate::error::ControllerError;
use crate::ids::{image_for, Handle, Kind};

/// Topology segment every node running the node service reports.
pub use csi_proto::TOPOLOGY_KEY;
/// Size of a volume whose claim names none.
pub const DEFAULT_SIZE: u64 = 1 << 30;

/// Parameters a StorageClass may set. Kubernetes' own (`csi.storage.k8s.io/…`) pass too.
/// `connection` names the MindUstorStorageConnection (StorageClasses the glue makes carry it).
const PARAMETERS: &[&str] = &["pool", "nbdConnections", "connection"];

#[derive(Debug)]
pub struct ControllerService {
    backend: Arc<dyn Backend>,
    cluster_id: String,
    /// One mutating call per image at a time (`v:<key>` volumes, `s:<key>` snapshots): a
    /// long copy for a clone holds its own images, not every other call.
    images: KeyedLocks,
    metrics: Arc<crate::metrics::ControllerMetrics>,
    /// Known nodes, when running in Kubernetes; without it every node id is taken as given.
    nodes: Option<Arc<dyn super::Nodes>>,
}

impl ControllerService {
    pub fn new(
        backend: Arc<dyn Backend>,
        cluster_id: String,
        metrics: Arc<crate::metrics::ControllerMetrics>,
    ) -> Self {
        Self {
            metrics,
            backend,
            cluster_id,
            images: KeyedLocks::default(),
            nodes: None,
        }
    }

    /// Checks ControllerPublishVolume's node id against `nodes`.
    pub fn with_nodes(mut self, nodes: Arc<dyn super::Nodes>) -> Self {
        self.nodes = Some(nodes);
        self
    }

    fn require_node(&self, node_id: &str) -> Result<(), ControllerError> {
        match self.nodes.as_ref().map(|n| n.has_node(node_id)) {
            None | Some(Some(true)) => Ok(()),
            Some(Some(false)) => Err(ControllerError::NotFound(format!(
                "node {node_id:?} has no CSINode entry for {}: is ustor-csi-node running there?",
                csi_proto::DRIVER_NAME
            ))),
            Some(None) => Err(ControllerError::Unavailable(
                "the list of nodes is still loading from the Kubernetes API; retry".into(),
            )),
        }
    }

    fn volume_handle(&self, raw: &str) -> Result<Handle, ControllerError> {
        Handle::parse(raw, self.backend.name(), Kind::Volume)
    }

    fn snapshot_handle(&self, raw: &str) -> Result<Handle, ControllerError> {
        Handle::parse(raw, self.backend.name(), Kind::Snapshot)
    }

    async fn existing_volume(&self, h: &Handle) -> Result<VolumeMeta, ControllerError> {
        self.backend
            .volume(&h.image)
            .await?
            .ok_or_else(|| ControllerError::NotFound(format!("volume {h} does not exist")))
    }

    fn round(&self, bytes: u64) -> u64 {
        let g = self.backend.granularity();
        bytes.div_ceil(g) * g
    }

    /// The size to provision for a capacity range, rounded to the backend's granularity.
    fn size_for(
        &self,
        range: Option<&CapacityRange>,
        minimum: u64,
    ) -> Result<u64, ControllerError> {
        let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
        if required < 0 || limit < 0 {
            return Err(ControllerError::invalid(
                "capacity_range must not be negative",
            ));
        }
        let (required, limit) = (required as u64, limit as u64);
        if limit > 0 && required > limit {
            return Err(ControllerError::OutOfRange(format!(
                "required_bytes {required} exceeds limit_bytes {limit}"
            )));
        }
        let wanted = if required == 0 {
            DEFAULT_SIZE.max(minimum)
        } else {
            required.max(minimum)
        };
        let wanted = if limit > 0 && required == 0 {
            wanted.min(limit).max(minimum)
        } else {
            wanted
        };
        let size = self.round(wanted);
        if limit > 0 && size > limit {
            return Err(ControllerError::OutOfRange(format!(
                "{wanted} bytes rounded to the backend's {} byte granularity is {size}, over limit_bytes {limit}",
                self.backend.granularity()
            )));
        }
        Ok(size)
    }

    /// What a node needs to attach `image`: its URI, the connection count, and for an
    /// `nbds://` export the TLS profile of its connection.
    async fn export_context(
        &self,
        image: &str,
        meta: &VolumeMeta,
    ) -> Result<HashMap<String, String>, ControllerError> {
        let uri = self.backend.export_uri(image).await?;
        let mut context = HashMap::new();
        if let Some(n) = meta.parameters.get("nbdConnections") {
            context.insert("nbdConnections".into(), n.clone());
        }
        if uri.parse::<nbd::NbdUri>().is_ok_and(|u| u.tls()) {
            if let Some(profile) = self.backend.tls_profile(image) {
                context.insert("tlsProfile".into(), profile);
            }
        }
        context.insert("nbdUri".into(), uri);
        Ok(context)
    }

    async fn volume_response(
        &self,
        image: &str,
        meta: &VolumeMeta,
    ) -> Result<Volume, ControllerError> {
        let context = self.export_context(image, meta).await?;
        Ok(Volume {
            capacity_bytes: meta.size as i64,
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

    fn snapshot_response(&self, image: &str, meta: &SnapshotMeta) -> Snapshot {
        let backend = self.backend.name();
        Snapshot {
            size_bytes: meta.size as i64,
            snapshot_id: Handle::new(backend, Kind::Snapshot, image.to_owned()).to_string(),
            source_volume_id: Handle::new(backend, Kind::Volume, meta.source_image.clone())
                .to_string(),
            creation_time: Some(prost_types::Timestamp {
                seconds: meta.created,
                nanos: 0,
            }),
            ready_to_use: true,
            group_snapshot_id: String::new(),
        }
    }

    async fn create_volume(
        &self,
        r: CreateVolumeRequest,
    ) -> Result<CreateVolumeResponse, ControllerError> {
        let image = image_for(&self.cluster_id, &r.name)?;
        if r.volume_capabilities.is_empty() {
            return Err(ControllerError::invalid("volume_capabilities is required"));
        }
        for cap in &r.volume_capabilities {
            check_capability(cap)?;
        }
        let parameters = parameters(&r.parameters)?;
        let image = self.backend.volume_key(&image, &parameters)?;
        let backend = self.backend.name();
        let (source, minimum) = match r.volume_content_source.and_then(|s| s.r#type) {
            None => (None, 0),
            Some(SourceType::Snapshot(s)) => {
                let h = Handle::parse(&s.snapshot_id, backend, Kind::Snapshot)?;
                let snap = self.backend.snapshot(&h.image).await?.ok_or_else(|| {
                    ControllerError::NotFound(format!("snapshot {h} does not exist"))
                })?;
                (Some(Source::Snapshot(h.image)), snap.size)
            }
            Some(SourceType::Volume(v)) => {
                let h = Handle::parse(&v.volume_id, backend, Kind::Volume)?;
                let src = self.existing_volume(&h).await?;
                (Some(Source::Volume(h.image)), src.size)
            }
        };
        let size = self.size_for(r.capacity_range.as_ref(), minimum)?;
        if let Some(range) = &r.capacity_range {
            if range.limit_bytes > 0 && (minimum as i64) > range.limit_bytes {
                return Err(ControllerError::OutOfRange(format!(
                    "the source is {minimum} bytes, more than limit_bytes {}",
                    range.limit_bytes
                )));
            }
        }
        let mut keys = vec![format!("v:{image}")];
        match &source {
            Some(Source::Snapshot(s)) => keys.push(format!("s:{s}")),
            Some(Source::Volume(v)) => keys.push(format!("v:{v}")),
            None => {}
        }
        let _locked = self.images.lock_all(&keys).await;
        if let Some(existing) = self.backend.volume(&image).await? {
            let same = existing.name == r.name
                && existing.parameters == parameters
                && existing.source == source
                && fits(existing.size, r.capacity_range.as_ref());
            if !same {
                return Err(ControllerError::AlreadyExists(format!(
                    "volume {:?} already exists with other parameters, size or source",
                    r.name
                )));
            }
            return Ok(CreateVolumeResponse {
                volume: Some(self.volume_response(&image, &existing).await?),
            });
        }
        let meta = VolumeMeta {
            name: r.name,
            size,
            parameters,
            source,
            published: BTreeMap::new(),
        };
        self.backend.create_volume(&image, &meta).await?;
        tracing::info!(%image, size, "volume created");
        Ok(CreateVolumeResponse {
            volume: Some(self.volume_response(&image, &meta).await?),
        })
    }

    async fn delete_volume(
        &self,
        r: DeleteVolumeRequest,
    ) -> Result<DeleteVolumeResponse, ControllerError> {
        let Some(h) = issued_by_us(self.volume_handle(&r.volume_id), "DeleteVolume")? else {
            return Ok(DeleteVolumeResponse {});
        };
        let _locked = self.images.lock(&format!("v:{}", h.image)).await;
        if let Some(meta) = self.backend.volume(&h.image).await? {
            if !meta.published.is_empty() {
                return Err(ControllerError::FailedPrecondition(format!(
                    "volume {h} is still published to {}",
                    meta.published
                        .keys()
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        self.backend.delete_volume(&h.image).await?;
        Ok(DeleteVolumeResponse {})
    }

    async fn publish(
        &self,
        r: ControllerPublishVolumeRequest,
    ) -> Result<ControllerPublishVolumeResponse, ControllerError> {
        let h = self.volume_handle(&r.volume_id)?;
        if r.node_id.is_empty() {
            return Err(ControllerError::invalid("node_id is required"));
        }
        let cap = r
            .volume_capability
            .as_ref()
            .ok_or_else(|| ControllerError::invalid("volume_capability is required"))?;
        let mode = check_capability(cap)?;
        let _locked = self.images.lock(&format!("v:{}", h.image)).await;
        let mut meta = self.existing_volume(&h).await?;
        self.require_node(&r.node_id)?;
        match meta.published.get(&r.node_id) {
            Some(ro) if *ro != r.readonly => {
                return Err(ControllerError::AlreadyExists(format!(
                    "volume {h} is published to {} with readonly={ro}",
                    r.node_id
                )))
            }
            Some(_) => {}
            None => {
                let multi = capability::multi_node(mode);
                if !multi && !meta.published.is_empty() {
                    return Err(ControllerError::FailedPrecondition(format!(
                        "volume {h} is published to {} and its access mode allows one node",
                        meta.published
                            .keys()
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
                meta.published.insert(r.node_id.clone(), r.readonly);
                self.backend.update_volume(&h.image, &meta).await?;
            }
        }
        let context = self.export_context(&h.image, &meta).await?;
        Ok(ControllerPublishVolumeResponse {
            publish_context: context,
        })
    }

    async fn unpublish(
        &self,
        r: ControllerUnpublishVolumeRequest,
    ) -> Result<ControllerUnpublishVolumeResponse, ControllerError> {
        let h = self.volume_handle(&r.volume_id)?;
        let _locked = self.images.lock(&format!("v:{}", h.image)).await;
        // A volume or node that is gone is unpublished: OK, per the spec's idempotency rule.
        if let Some(mut meta) = self.backend.volume(&h.image).await? {
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

    async fn create_snapshot(
        &self,
        r: CreateSnapshotRequest,
    ) -> Result<CreateSnapshotResponse, ControllerError> {
        let source = self.volume_handle(&r.source_volume_id)?;
        let image = self
            .backend
            .snapshot_key(&image_for(&self.cluster_id, &r.name)?, &source.image);
        if !r.parameters.is_empty() {
            return Err(ControllerError::invalid(format!(
                "snapshot parameters are not supported (got {:?})",
                r.parameters.keys().collect::<Vec<_>>()
            )));
        }
        let _locked = self
            .images
            .lock_all(&[format!("s:{image}"), format!("v:{}", source.image)])
            .await;
        if let Some(existing) = self.backend.snapshot(&image).await? {
            // The snapshot's image is derived from its name, so the name matches already.
            if existing.source_image != source.image {
                return Err(ControllerError::AlreadyExists(format!(
                    "snapshot {:?} already exists for another volume",
                    r.name
                )));
            }
            return Ok(CreateSnapshotResponse {
                snapshot: Some(self.snapshot_response(&image, &existing)),
            });
        }
        let volume = self.existing_volume(&source).await?;
        let meta = SnapshotMeta {
            name: r.name,
            source_image: source.image.clone(),
            size: volume.size,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or_default(),
        };
        self.backend.create_snapshot(&image, &meta).await?;
        tracing::info!(%image, source = %source.image, "snapshot created");
        Ok(CreateSnapshotResponse {
            snapshot: Some(self.snapshot_response(&image, &meta)),
        })
    }

    async fn list_snapshots(
        &self,
        r: ListSnapshotsRequest,
    ) -> Result<ListSnapshotsResponse, ControllerError> {
        if r.max_entries < 0 {
            return Err(ControllerError::invalid("max_entries must not be negative"));
        }
        // An id of another backend or a malformed one simply matches nothing.
        let by_id = (!r.snapshot_id.is_empty())
            .then(|| Handle::parse(&r.snapshot_id, self.backend.name(), Kind::Snapshot).ok());
        let by_source = (!r.source_volume_id.is_empty())
            .then(|| Handle::parse(&r.source_volume_id, self.backend.name(), Kind::Volume).ok());
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
        let start = if r.starting_token.is_empty() {
            0
        } else {
            r.starting_token
                .parse::<usize>()
                .ok()
                .filter(|s| *s <= all.len())
                .ok_or_else(|| {
                    ControllerError::Aborted(format!(
                        "starting_token {:?} is not valid",
                        r.starting_token
                    ))
                })?
        };
        let take = if r.max_entries == 0 {
            usize::MAX
        } else {
            r.max_entries as usize
        };
        let page: Vec<_> = all.iter().skip(start).take(take).collect();
        let next = start + page.len();
        Ok(ListSnapshotsResponse {
            entries: page
                .into_iter()
                .map(|(image, meta)| list_snapshots_response::Entry {
                    snapshot: Some(self.snapshot_response(image, meta)),
                })
                .collect(),
            next_token: if next < all.len() {
                next.to_string()
            } else {
                String::new()
            },
        })
    }

    async fn expand(
        &self,
        r: ControllerExpandVolumeRequest,
    ) -> Result<ControllerExpandVolumeResponse, ControllerError> {
        let h = self.volume_handle(&r.volume_id)?;
        let range = r
            .capacity_range
            .as_ref()
            .ok_or_else(|| ControllerError::invalid("capacity_range is required"))?;
        if let Some(cap) = &r.volume_capability {
            check_capability(cap)?;
        }
        let _locked = self.images.lock(&format!("v:{}", h.image)).await;
        let meta = self.existing_volume(&h).await?;
        let size = self.size_for(Some(range), meta.size)?;
        if size > meta.size {
            self.backend.grow_volume(&h.image, size).await?;
            tracing::info!(image = %h.image, from = meta.size, to = size, "volume expanded");
        }
        // The node resizes the NBD device (and the filesystem) in every case.
        Ok(ControllerExpandVolumeResponse {
            capacity_bytes: size.max(meta.size) as i64,
            node_expansion_required: true,
        })
    }
}

/// Whether an existing volume of `size` satisfies a repeated request's range.
fn fits(size: u64, range: Option<&CapacityRange>) -> bool {
    let Some(r) = range else { return true };
    (r.required_bytes <= 0 || size >= r.required_bytes as u64)
        && (r.limit_bytes <= 0 || size <= r.limit_bytes as u64)
}

fn parameters(raw: &HashMap<String, String>) -> Result<BTreeMap<String, String>, ControllerError> {
    let mut out = BTreeMap::new();
    for (k, v) in raw {
        if k.starts_with("csi.storage.k8s.io/") {
            continue;
        }
        if !PARAMETERS.contains(&k.as_str()) {
            return Err(ControllerError::invalid(format!(
                "unknown parameter {k:?} (supported: {})",
                PARAMETERS.join(", ")
            )));
        }
        if k == "nbdConnections" && !v.parse::<u8>().is_ok_and(|n| (1..=16).contains(&n)) {
            return Err(ControllerError::invalid(format!(
                "nbdConnections {v:?} must be a number from 1 to 16"
            )));
        }
        out.insert(k.clone(), v.clone());
    }
    Ok(out)
}

/// The driver's capability rules (shared with the node), plus the filesystems the node can
/// format. Returns the access mode.
pub fn check_capability(cap: &VolumeCapability) -> Result<Mode, ControllerError> {
    let (mode, shape) = capability::check(cap).map_err(ControllerError::InvalidArgument)?;
    if let Shape::Mount(m) = shape {
        if !matches!(m.fs_type.as_str(), "" | "ext4" | "xfs") {
            return Err(ControllerError::invalid(format!(
                "fsType {:?} is not supported (ext4, xfs)",
                m.fs_type
            )));
        }
    }
    Ok(mode)
}

impl ControllerService {
    /// The one place a call's outcome becomes a gRPC answer: logged when it failed, counted
    /// with its latency.
    fn answer<T>(
        &self,
        started: std::time::Instant,
        op: &'static str,
        result: Result<T, ControllerError>,
    ) -> Result<Response<T>, Status> {
        let answer = match result {
            Ok(v) => Ok(Response::new(v)),
            Err(e) => {
                let status = Status::from(e);
                tracing::warn!(op, code = ?status.code(), message = status.message(), "failed");
                Err(status)
            }
        };
        let code = answer
            .as_ref()
            .map_or_else(|s| s.code(), |_| tonic::Code::Ok);
        self.metrics
            .calls
            .observe(op, code, started.elapsed().as_secs_f64());
        answer
    }
}

/// For deletes: an id this driver did not issue names nothing, so for the spec it is already
/// deleted (`None`); any other parse error stands.
fn issued_by_us(
    parsed: Result<Handle, ControllerError>,
    op: &'static str,
) -> Result<Option<Handle>, ControllerError> {
    match parsed {
        Err(ControllerError::UnknownId(why)) => {
            tracing::info!(op, %why, "an id this driver did not issue: nothing to delete");
            Ok(None)
        }
        other => other.map(Some),
    }
}

fn capability_of(rpc: Rpc) -> ControllerServiceCapability {
    ControllerServiceCapability {
        r#type: Some(CapType::Rpc(RpcCap { r#type: rpc as i32 })),
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        r: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let started = std::time::Instant::now();
        let r = r.into_inner();
        let span = tracing::info_span!("csi", op = "CreateVolume", name = %r.name);
        self.answer(
            started,
            "CreateVolume",
            tracing::Instrument::instrument(self.create_volume(r), span).await,
        )
    }

    async fn delete_volume(
        &self,
        r: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let started = std::time::Instant::now();
        let r = r.into_inner();
        let span = tracing::info_span!("csi", op = "DeleteVolume", volume_id = %r.volume_id);
        self.answer(
            started,
            "DeleteVolume",
            tracing::Instrument::instrument(self.delete_volume(r), span).await,
        )
    }

    async fn controller_publish_volume(
        &self,
        r: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        let started = std::time::Instant::now();
        let r = r.into_inner();
        let span = tracing::info_span!("csi", op = "ControllerPublishVolume", volume_id = %r.volume_id, node = %r.node_id);
        self.answer(
            started,
            "ControllerPublishVolume",
            tracing::Instrument::instrument(self.publish(r), span).await,
        )
    }

    async fn controller_unpublish_volume(
        &self,
        r: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        let started = std::time::Instant::now();
        let r = r.into_inner();
        let span = tracing::info_span!("csi", op = "ControllerUnpublishVolume", volume_id = %r.volume_id, node = %r.node_id);
        self.answer(
            started,
            "ControllerUnpublishVolume",
            tracing::Instrument::instrument(self.unpublish(r), span).await,
        )
    }

    async fn validate_volume_capabilities(
        &self,
        r: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let started = std::time::Instant::now();
        let r = r.into_inner();
        let result = async {
            let h = self.volume_handle(&r.volume_id)?;
            if r.volume_capabilities.is_empty() {
                return Err(ControllerError::invalid("volume_capabilities is required"));
            }
            self.existing_volume(&h).await?;
            for cap in &r.volume_capabilities {
                if let Err(e) = check_capability(cap) {
                    return Ok(ValidateVolumeCapabilitiesResponse {
                        confirmed: None,
                        message: e.to_string(),
                    });
                }
            }
            Ok(ValidateVolumeCapabilitiesResponse {
                confirmed: Some(validate_volume_capabilities_response::Confirmed {
                    volume_context: r.volume_context.clone(),
                    volume_capabilities: r.volume_capabilities.clone(),
                    parameters: r.parameters.clone(),
                }),
                message: String::new(),
            })
        }
        .await;
        self.answer(started, "ValidateVolumeCapabilities", result)
    }

    async fn get_capacity(
        &self,
        r: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let started = std::time::Instant::now();
        let r = r.into_inner();
        let result = async {
            let parameters = parameters(&r.parameters)?;
            let available = self.backend.capacity(&parameters).await?;
            Ok(GetCapacityResponse {
                available_capacity: available.unwrap_or_default() as i64,
                maximum_volume_size: None,
                minimum_volume_size: Some(self.backend.granularity() as i64),
            })
        }
        .await;
        self.answer(started, "GetCapacity", result)
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities: [
                Rpc::CreateDeleteVolume,
                Rpc::PublishUnpublishVolume,
                Rpc::GetCapacity,
                Rpc::CreateDeleteSnapshot,
                Rpc::ListSnapshots,
                Rpc::CloneVolume,
                Rpc::ExpandVolume,
                Rpc::PublishReadonly,
                Rpc::SingleNodeMultiWriter,
            ]
            .into_iter()
            .map(capability_of)
            .collect(),
        }))
    }

    async fn create_snapshot(
        &self,
        r: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let started = std::time::Instant::now();
        let r = r.into_inner();
        let span = tracing::info_span!("csi", op = "CreateSnapshot", name = %r.name, volume_id = %r.source_volume_id);
        self.answer(
            started,
            "CreateSnapshot",
            tracing::Instrument::instrument(self.create_snapshot(r), span).await,
        )
    }

    async fn delete_snapshot(
        &self,
        r: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let started = std::time::Instant::now();
        let r = r.into_inner();
        let result = async {
            let Some(h) = issued_by_us(self.snapshot_handle(&r.snapshot_id), "DeleteSnapshot")?
            else {
                return Ok(DeleteSnapshotResponse {});
            };
            let _locked = self.images.lock(&format!("s:{}", h.image)).await;
            self.backend.delete_snapshot(&h.image).await?;
            Ok(DeleteSnapshotResponse {})
        }
        .await;
        self.answer(started, "DeleteSnapshot", result)
    }

    async fn list_snapshots(
        &self,
        r: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        let started = std::time::Instant::now();
        self.answer(
            started,
            "ListSnapshots",
            self.list_snapshots(r.into_inner()).await,
        )
    }

    async fn controller_expand_volume(
        &self,
        r: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let started = std::time::Instant::now();
        let r = r.into_inner();
        let span =
            tracing::info_span!("csi", op = "ControllerExpandVolume", volume_id = %r.volume_id);
        self.answer(
            started,
            "ControllerExpandVolume",
            tracing::Instrument::instrument(self.expand(r), span).await,
        )
    }
}
