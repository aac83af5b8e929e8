//! [`Backend`] over the uStor management API. Images are keyed `<pool>/<image>`; what
//! CreateVolume asked for and the publications live in the image's labels (see
//! `USTOR_API.md`).

use std::collections::BTreeMap;
use std::sync::Arc;

use reqwest::Method;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::UstorApi;
use super::error::UstorError;
use crate::backend::{
    Backend, BackendError, GrantToken, GroupSnapshotMeta, ListedVolume, SnapshotMeta, Source,
    VolumeMeta,
};

/// Sizes are whole MiB (the smallest allocation unit assumed for uStor).
const GRANULARITY: u64 = 1 << 20;

#[derive(Debug, Clone)]
pub struct UstorBackend {
    api: Arc<UstorApi>,
    /// The pool of volumes whose StorageClass names none.
    default_pool: String,
}

#[derive(Debug, Deserialize)]
struct Nbd {
    host: String,
    port: u16,
    export: String,
    /// The endpoint requires TLS: the URI is `nbds://`, dialed with the connection's
    /// certificates.
    #[serde(default)]
    tls: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Image {
    #[serde(default)]
    name: String,
    size_bytes: u64,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    nbd: Nbd,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Snapshot {
    name: String,
    image: String,
    size_bytes: u64,
    #[serde(default)]
    created_at: String,
    /// The group it was taken with, if any.
    #[serde(default)]
    group: Option<String>,
}

/// One snapshot of a group, as it was taken: uStor keeps the list when a member is deleted.
#[derive(Debug, Deserialize)]
struct GroupMember {
    snapshot: String,
    image: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SnapshotGroup {
    name: String,
    members: Vec<GroupMember>,
    #[serde(default)]
    created_at: String,
}

#[derive(Debug, Deserialize)]
struct Snapshots {
    snapshots: Vec<Snapshot>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Pool {
    #[serde(default)]
    name: String,
    free_bytes: u64,
}

#[derive(Debug, Deserialize)]
struct Pools {
    pools: Vec<Pool>,
}

#[derive(Debug, Deserialize)]
struct Images {
    images: Vec<Image>,
}

/// uStor's answer to a grant.
#[derive(Debug, Deserialize)]
struct GrantAnswer {
    token: GrantToken,
}

#[derive(Debug, Deserialize)]
struct GrantedNode {
    node: String,
}

#[derive(Debug, Deserialize)]
struct Grants {
    grants: Vec<GrantedNode>,
}

/// A node id as one segment of a path: what is not unreserved in a URI, percent-encoded
/// (CSI node ids are the CO's, not ours to restrict).
fn segment(node: &str) -> String {
    node.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn split(key: &str) -> Result<(&str, &str), UstorError> {
    key.split_once('/')
        .ok_or_else(|| UstorError::KeyWithoutPool {
            key: key.to_owned(),
        })
}

/// Label values are strings; structured ones are JSON inside them.
fn encode<T: serde::Serialize>(v: &T) -> Result<String, UstorError> {
    serde_json::to_string(v).map_err(UstorError::EncodeLabel)
}

fn labels(meta: &VolumeMeta) -> Result<Value, UstorError> {
    let mut labels = json!({
        "csi.name": meta.name,
        "csi.parameters": encode(&meta.parameters)?,
        "csi.source": encode(&meta.source)?,
        "csi.published": encode(&meta.published)?,
        "csi.mutable": encode(&meta.mutable)?,
    });
    if let Some(cluster) = &meta.adopted_by {
        labels["csi.adopted-by"] = json!(cluster);
    }
    Ok(labels)
}

fn label<T: serde::de::DeserializeOwned + Default>(
    image: &Image,
    key: &'static str,
) -> Result<T, UstorError> {
    match image.labels.get(key) {
        None => Ok(T::default()),
        Some(v) => serde_json::from_str(v).map_err(|source| UstorError::BadLabel { key, source }),
    }
}

fn from_labels(image: &Image) -> Result<VolumeMeta, UstorError> {
    Ok(VolumeMeta {
        name: image.labels.get("csi.name").cloned().unwrap_or_default(),
        size: image.size_bytes,
        parameters: label(image, "csi.parameters")?,
        source: label(image, "csi.source")?,
        published: label(image, "csi.published")?,
        mutable: label(image, "csi.mutable")?,
        // uStor keeps grants itself, with their tokens.
        grants: BTreeMap::new(),
        adopted_by: image.labels.get("csi.adopted-by").cloned(),
    })
}

impl UstorBackend {
    /// Size unit of uStor images.
    pub const GRANULARITY: u64 = GRANULARITY;

    pub fn new(api: Arc<UstorApi>, default_pool: &str) -> Self {
        Self {
            api,
            default_pool: default_pool.to_owned(),
        }
    }

    /// GET of one object; `None` when uStor has no such object.
    async fn get<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<Option<T>, UstorError> {
        match self.api.call::<T, Value>(Method::GET, path, None).await {
            Err(UstorError::NotFound(_)) => Ok(None),
            other => other,
        }
    }

    /// A call whose answer body does not matter.
    async fn send(&self, method: Method, path: &str, body: &Value) -> Result<(), BackendError> {
        self.api.call::<Value, _>(method, path, Some(body)).await?;
        Ok(())
    }

    /// DELETE; what is already gone counts as deleted.
    async fn delete(&self, path: &str) -> Result<(), BackendError> {
        match self
            .api
            .call::<Value, Value>(Method::DELETE, path, None)
            .await
        {
            Ok(_) | Err(UstorError::NotFound(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn image(&self, key: &str) -> Result<Option<Image>, UstorError> {
        let (pool, name) = split(key)?;
        self.get(&format!("/api/v1/pools/{pool}/images/{name}"))
            .await
    }
}

#[tonic::async_trait]
impl Backend for UstorBackend {
    fn name(&self) -> &'static str {
        "ustor"
    }

    fn granularity(&self) -> u64 {
        GRANULARITY
    }

    fn volume_key(
        &self,
        image: &str,
        parameters: &BTreeMap<String, String>,
    ) -> Result<String, BackendError> {
        let pool = parameters.get("pool").unwrap_or(&self.default_pool);
        crate::ids::valid_pool(pool)?;
        Ok(format!("{pool}/{image}"))
    }

    fn snapshot_key(&self, image: &str, source: &str) -> String {
        let pool = source
            .split_once('/')
            .map_or(self.default_pool.as_str(), |(p, _)| p);
        format!("{pool}/{image}")
    }

    async fn export_uri(&self, key: &str) -> Result<String, BackendError> {
        let image = self
            .image(key)
            .await?
            .ok_or_else(|| UstorError::ImageMissing {
                key: key.to_owned(),
            })?;
        Ok(nbd_uri(image.nbd))
    }

    async fn volume(&self, key: &str) -> Result<Option<VolumeMeta>, BackendError> {
        Ok(self
            .image(key)
            .await?
            .as_ref()
            .map(from_labels)
            .transpose()?)
    }

    /// Every pool's images that carry this driver's labels (others are not its volumes).
    /// With each image's NBD endpoint, which the listing answers anyway.
    async fn volumes(&self) -> Result<Vec<ListedVolume>, BackendError> {
        let pools = self.get::<Pools>("/api/v1/pools").await?.map(|p| p.pools);
        let mut out = Vec::new();
        for pool in pools.unwrap_or_default() {
            crate::ids::valid_pool(&pool.name)?;
            let path = format!("/api/v1/pools/{}/images", pool.name);
            // A pool deleted since it was listed holds nothing.
            let images = self.get::<Images>(&path).await?.map(|i| i.images);
            for image in images.unwrap_or_default() {
                if image.labels.contains_key("csi.name") {
                    out.push(ListedVolume {
                        key: format!("{}/{}", pool.name, image.name),
                        meta: from_labels(&image)?,
                        export: Some(nbd_uri(image.nbd)),
                    });
                }
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// uStor answered the image: it exists, with the size recorded (the size is uStor's).
    async fn problem(
        &self,
        _key: &str,
        _meta: &VolumeMeta,
    ) -> Result<Option<String>, BackendError> {
        Ok(None)
    }

    async fn create_volume(&self, key: &str, meta: &VolumeMeta) -> Result<(), BackendError> {
        let (pool, name) = split(key)?;
        let same_pool = |source_key: &str| -> Result<String, UstorError> {
            let (p, n) = split(source_key)?;
            if p != pool {
                return Err(UstorError::SourceInOtherPool {
                    source_pool: p.to_owned(),
                    pool: pool.to_owned(),
                });
            }
            Ok(n.to_owned())
        };
        let source = match &meta.source {
            None => Value::Null,
            Some(Source::Snapshot(s)) => json!({"snapshot": same_pool(s)?}),
            Some(Source::Volume(v)) => json!({"image": same_pool(v)?}),
        };
        let body = json!({"name": name, "sizeBytes": meta.size, "source": source, "labels": labels(meta)?});
        self.send(Method::POST, &format!("/api/v1/pools/{pool}/images"), &body)
            .await
    }

    async fn update_volume(&self, key: &str, meta: &VolumeMeta) -> Result<(), BackendError> {
        let (pool, name) = split(key)?;
        let body = json!({"labels": labels(meta)?});
        self.send(
            Method::PATCH,
            &format!("/api/v1/pools/{pool}/images/{name}"),
            &body,
        )
        .await
    }

    async fn delete_volume(&self, key: &str) -> Result<(), BackendError> {
        let (pool, name) = split(key)?;
        self.delete(&format!("/api/v1/pools/{pool}/images/{name}"))
            .await
    }

    async fn grow_volume(&self, key: &str, size: u64) -> Result<(), BackendError> {
        let (pool, name) = split(key)?;
        let body = json!({"sizeBytes": size});
        self.send(
            Method::PATCH,
            &format!("/api/v1/pools/{pool}/images/{name}"),
            &body,
        )
        .await
    }

    async fn grant(
        &self,
        key: &str,
        node: &str,
        readonly: bool,
    ) -> Result<GrantToken, BackendError> {
        let (pool, name) = split(key)?;
        let path = format!(
            "/api/v1/pools/{pool}/images/{name}/grants/{}",
            segment(node)
        );
        let body = json!({"readOnly": readonly});
        let answer: Option<GrantAnswer> = self.api.call(Method::PUT, &path, Some(&body)).await?;
        // A grant answered without a body is no grant: nothing to present.
        let answer = answer.ok_or_else(|| UstorError::NoGrantToken {
            key: key.to_owned(),
            node: node.to_owned(),
        })?;
        Ok(answer.token)
    }

    /// uStor cuts the grant's connections before it answers.
    async fn revoke(&self, key: &str, node: &str) -> Result<(), BackendError> {
        let (pool, name) = split(key)?;
        self.delete(&format!(
            "/api/v1/pools/{pool}/images/{name}/grants/{}",
            segment(node)
        ))
        .await
    }

    async fn granted_nodes(&self, key: &str) -> Result<Vec<String>, BackendError> {
        let (pool, name) = split(key)?;
        let grants: Option<Grants> = self
            .get(&format!("/api/v1/pools/{pool}/images/{name}/grants"))
            .await?;
        Ok(grants
            .map(|g| g.grants.into_iter().map(|g| g.node).collect())
            .unwrap_or_default())
    }

    async fn snapshot(&self, key: &str) -> Result<Option<SnapshotMeta>, BackendError> {
        let (pool, name) = split(key)?;
        let snapshot: Option<Snapshot> = self
            .get(&format!("/api/v1/pools/{pool}/snapshots/{name}"))
            .await?;
        Ok(snapshot.map(|s| snapshot_meta(pool, s)))
    }

    async fn create_snapshot(&self, key: &str, meta: &SnapshotMeta) -> Result<(), BackendError> {
        let (pool, name) = split(key)?;
        let (_, source) = split(&meta.source_image)?;
        let path = format!("/api/v1/pools/{pool}/images/{source}/snapshots");
        self.send(Method::POST, &path, &json!({"name": name})).await
    }

    async fn delete_snapshot(&self, key: &str) -> Result<(), BackendError> {
        let (pool, name) = split(key)?;
        self.delete(&format!("/api/v1/pools/{pool}/snapshots/{name}"))
            .await
    }

    async fn snapshots(
        &self,
        near: Option<&str>,
    ) -> Result<Vec<(String, SnapshotMeta)>, BackendError> {
        let pool = near
            .and_then(|key| key.split_once('/'))
            .map_or(self.default_pool.as_str(), |(p, _)| p);
        let list = self
            .api
            .call::<Snapshots, Value>(
                Method::GET,
                &format!("/api/v1/pools/{pool}/snapshots"),
                None,
            )
            .await?
            .map(|l| l.snapshots)
            .unwrap_or_default();
        let mut out: Vec<_> = list
            .into_iter()
            .map(|s| (format!("{pool}/{}", s.name), snapshot_meta(pool, s)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    fn group_key(&self, image: &str, sources: &[&str]) -> Result<String, BackendError> {
        let mut pools: Vec<String> = sources
            .iter()
            .map(|k| split(k).map(|(pool, _)| pool.to_owned()))
            .collect::<Result<_, _>>()?;
        pools.sort();
        pools.dedup();
        match pools.as_slice() {
            [pool] => Ok(format!("{pool}/{image}")),
            _ => Err(UstorError::GroupAcrossPools { pools }.into()),
        }
    }

    async fn group_snapshot(&self, key: &str) -> Result<Option<GroupSnapshotMeta>, BackendError> {
        let (pool, name) = split(key)?;
        let group: Option<SnapshotGroup> = self
            .get(&format!("/api/v1/pools/{pool}/snapshot-groups/{name}"))
            .await?;
        Ok(group.map(|g| group_meta(pool, g)))
    }

    /// One call: uStor holds the writes of every member image while it takes their snapshots,
    /// and takes all of them or none.
    async fn create_group_snapshot(
        &self,
        key: &str,
        _meta: &GroupSnapshotMeta,
        members: &[(String, SnapshotMeta)],
    ) -> Result<(), BackendError> {
        let (pool, name) = split(key)?;
        let members = members
            .iter()
            .map(|(snapshot, meta)| {
                Ok(json!({
                    "snapshot": split(snapshot)?.1,
                    "image": split(&meta.source_image)?.1,
                }))
            })
            .collect::<Result<Vec<_>, UstorError>>()?;
        self.send(
            Method::POST,
            &format!("/api/v1/pools/{pool}/snapshot-groups"),
            &json!({"name": name, "members": members}),
        )
        .await
    }

    async fn delete_group_snapshot(&self, key: &str) -> Result<(), BackendError> {
        let (pool, name) = split(key)?;
        self.delete(&format!("/api/v1/pools/{pool}/snapshot-groups/{name}"))
            .await
    }

    async fn capacity(
        &self,
        parameters: &BTreeMap<String, String>,
    ) -> Result<Option<u64>, BackendError> {
        let pool = parameters.get("pool").unwrap_or(&self.default_pool);
        crate::ids::valid_pool(pool)?;
        Ok(self
            .api
            .call::<Pool, Value>(Method::GET, &format!("/api/v1/pools/{pool}"), None)
            .await?
            .map(|p| p.free_bytes))
    }
}

/// Where nodes attach an image. NbdUri brackets an IPv6 host and percent-encodes the export
/// name (uStor's may hold characters a URI path cannot).
fn nbd_uri(nbd: Nbd) -> String {
    let uri = nbd::NbdUri::tcp(nbd.host, nbd.port, nbd.export);
    if nbd.tls { uri.with_tls() } else { uri }.to_string()
}

fn snapshot_meta(pool: &str, s: Snapshot) -> SnapshotMeta {
    SnapshotMeta {
        name: format!("{pool}/{}", s.name),
        source_image: format!("{pool}/{}", s.image),
        size: s.size_bytes,
        created: epoch_seconds(&s.created_at),
        group: s.group.map(|g| format!("{pool}/{g}")),
    }
}

fn group_meta(pool: &str, g: SnapshotGroup) -> GroupSnapshotMeta {
    GroupSnapshotMeta {
        name: format!("{pool}/{}", g.name),
        members: g
            .members
            .into_iter()
            .map(|m| {
                (
                    format!("{pool}/{}", m.snapshot),
                    format!("{pool}/{}", m.image),
                )
            })
            .collect(),
        created: epoch_seconds(&g.created_at),
    }
}

/// uStor's RFC 3339 time as seconds since the Unix epoch (0 when it gave none).
fn epoch_seconds(rfc3339: &str) -> i64 {
    humantime::parse_rfc3339(rfc3339)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}
