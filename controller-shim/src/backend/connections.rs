//! Volumes of every MindUstorStorageConnection at once (the old product served only the
//! oldest). A volume's key starts with its connection, `<connection>/<pool>/<image>`, so its
//! id says where it lives; keys of the single-cluster controller (`<pool>/<image>`) belong
//! to the oldest connection, which is what that controller served. Each call goes to the
//! connection's management API session, whose credentials follow its Secret. A clone's or
//! restore's source is on its volume's connection: recorded without it, as that uStor
//! cluster knows it, and answered with it, so a repeated CreateVolume finds its source.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use super::ustor::api::UstorApi;
use super::ustor::backend::UstorBackend;
use super::{
    Backend, BackendError, GrantToken, GroupSnapshotMeta, ListedVolume, SnapshotMeta, VolumeMeta,
};
use crate::ids::valid_connection;

/// Why a call found no uStor connection to go to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectionError {
    #[error("no MindUstorStorageConnection exists: create one (see the README's quick start)")]
    NoneExists,
    /// It exists but has no working session yet (being checked, or refused).
    #[error("MindUstorStorageConnection {connection} is not usable yet: {reason}")]
    NotUsable { connection: String, reason: String },
    #[error("MindUstorStorageConnection {connection} does not exist")]
    Unknown { connection: String },
    #[error(
        "the source {source_key} is on another uStor connection than {key}: \
         a clone or restore stays on its source's connection"
    )]
    SourceElsewhere { source_key: String, key: String },
    #[error(
        "the volumes of a group snapshot must be on one MindUstorStorageConnection; these are on {connections:?}"
    )]
    GroupAcrossConnections { connections: Vec<String> },
}

/// The StorageClass parameter naming the connection.
pub const CONNECTION_PARAMETER: &str = "connection";

/// Where the connections' sessions are (in Kubernetes: the connection reconciler's).
pub trait ConnectionDirectory: Send + Sync + fmt::Debug {
    /// The management API of `connection`; [`ConnectionError::NotUsable`] (saying why) while
    /// it is not usable.
    fn api(&self, connection: &str) -> Result<Arc<UstorApi>, ConnectionError>;
    /// The oldest connection, for keys and StorageClasses that name none.
    fn oldest(&self) -> Option<String>;
    /// Every existing connection, by name.
    fn names(&self) -> Vec<String>;
}

#[derive(Debug)]
pub struct ConnectionsBackend {
    directory: Arc<dyn ConnectionDirectory>,
    default_pool: String,
}

/// A key's connection (none for a key of the single-cluster controller) and the rest.
fn split(key: &str) -> (Option<&str>, &str) {
    match key.split('/').count() {
        3 => key
            .split_once('/')
            .map_or((None, key), |(c, rest)| (Some(c), rest)),
        _ => (None, key),
    }
}

impl ConnectionsBackend {
    pub fn new(directory: Arc<dyn ConnectionDirectory>, default_pool: &str) -> Self {
        Self {
            directory,
            default_pool: default_pool.to_owned(),
        }
    }

    fn oldest(&self) -> Result<String, ConnectionError> {
        self.directory.oldest().ok_or(ConnectionError::NoneExists)
    }

    /// The backend serving `connection` (the oldest when none is named).
    fn serving(&self, connection: Option<&str>) -> Result<(String, UstorBackend), ConnectionError> {
        let name = match connection {
            Some(c) => c.to_owned(),
            None => self.oldest()?,
        };
        let api = self.directory.api(&name)?;
        Ok((name, UstorBackend::new(api, &self.default_pool)))
    }

    /// `meta` as the backend of volume `key` records it: a clone or restore copies inside one
    /// uStor cluster, so its source is on the volume's connection and recorded without it,
    /// as that cluster's backend keys it (`<pool>/<image>`).
    fn stored(&self, key: &str, meta: &VolumeMeta) -> Result<VolumeMeta, ConnectionError> {
        let mut meta = meta.clone();
        if let Some(source) = &meta.source {
            let connection = |k: &str| {
                split(k)
                    .0
                    .map(str::to_owned)
                    .or_else(|| self.directory.oldest())
            };
            if connection(source.key()) != connection(key) {
                return Err(ConnectionError::SourceElsewhere {
                    source_key: source.key().to_owned(),
                    key: key.to_owned(),
                });
            }
            meta.source = Some(source.with_key(split(source.key()).1.to_owned()));
        }
        Ok(meta)
    }

    /// `meta` as `connection`'s backend recorded it, its source keyed with the connection.
    fn answered(&self, connection: &str, mut meta: VolumeMeta) -> VolumeMeta {
        meta.source = meta
            .source
            .map(|s| s.with_key(format!("{connection}/{}", s.key())));
        meta
    }

    /// The backend of an image key and the key as that backend knows it.
    fn route<'k>(&self, key: &'k str) -> Result<(UstorBackend, &'k str), ConnectionError> {
        let (connection, rest) = split(key);
        let (_, backend) = self.serving(connection)?;
        Ok((backend, rest))
    }
}

#[tonic::async_trait]
impl Backend for ConnectionsBackend {
    fn name(&self) -> &'static str {
        "ustor"
    }

    fn granularity(&self) -> u64 {
        UstorBackend::GRANULARITY
    }

    fn volume_key(
        &self,
        image: &str,
        parameters: &BTreeMap<String, String>,
    ) -> Result<String, BackendError> {
        let connection = match parameters.get(CONNECTION_PARAMETER) {
            Some(c) => c.clone(),
            None => self.oldest()?,
        };
        valid_connection(&connection)?;
        let pool = parameters.get("pool").unwrap_or(&self.default_pool);
        crate::ids::valid_pool(pool)?;
        Ok(format!("{connection}/{pool}/{image}"))
    }

    fn snapshot_key(&self, image: &str, source: &str) -> String {
        let (connection, rest) = split(source);
        let pool = rest
            .split_once('/')
            .map_or(self.default_pool.as_str(), |(p, _)| p);
        match connection {
            Some(c) => format!("{c}/{pool}/{image}"),
            None => format!("{pool}/{image}"),
        }
    }

    /// With its connection: the oldest's when the key (of the single-cluster controller)
    /// has none.
    fn source_key(&self, key: &str) -> String {
        match (split(key), self.directory.oldest()) {
            ((None, rest), Some(oldest)) => format!("{oldest}/{rest}"),
            _ => key.to_owned(),
        }
    }

    /// Named after the volume's connection: each connection has its own TLS Secret, and
    /// nodes define a `[tls-profile.<connection>]` with its files.
    fn tls_profile(&self, key: &str) -> Option<String> {
        split(key)
            .0
            .map(str::to_owned)
            .or_else(|| self.directory.oldest())
    }

    async fn export_uri(&self, key: &str) -> Result<String, BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.export_uri(rest).await
    }

    /// The source recorded without its connection (it is the volume's) comes back with it.
    async fn volume(&self, key: &str) -> Result<Option<VolumeMeta>, BackendError> {
        let (connection, rest) = split(key);
        let (connection, backend) = self.serving(connection)?;
        Ok(backend
            .volume(rest)
            .await?
            .map(|meta| self.answered(&connection, meta)))
    }

    /// Every connection's volumes, keyed with it. A connection that is not usable fails the
    /// list, naming it: its volumes cannot be listed, and a list without them would say
    /// they are gone.
    async fn volumes(&self) -> Result<Vec<ListedVolume>, BackendError> {
        let mut out = Vec::new();
        for connection in self.directory.names() {
            let (_, backend) = self.serving(Some(&connection))?;
            for listed in backend.volumes().await? {
                out.push(ListedVolume {
                    key: format!("{connection}/{}", listed.key),
                    meta: self.answered(&connection, listed.meta),
                    export: listed.export,
                });
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    async fn problem(&self, key: &str, meta: &VolumeMeta) -> Result<Option<String>, BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.problem(rest, meta).await
    }

    async fn create_volume(&self, key: &str, meta: &VolumeMeta) -> Result<(), BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.create_volume(rest, &self.stored(key, meta)?).await
    }

    async fn update_volume(&self, key: &str, meta: &VolumeMeta) -> Result<(), BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.update_volume(rest, &self.stored(key, meta)?).await
    }

    async fn delete_volume(&self, key: &str) -> Result<(), BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.delete_volume(rest).await
    }

    async fn grow_volume(&self, key: &str, size: u64) -> Result<(), BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.grow_volume(rest, size).await
    }

    async fn grant(
        &self,
        key: &str,
        node: &str,
        readonly: bool,
    ) -> Result<GrantToken, BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.grant(rest, node, readonly).await
    }

    async fn revoke(&self, key: &str, node: &str) -> Result<(), BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.revoke(rest, node).await
    }

    async fn granted_nodes(&self, key: &str) -> Result<Vec<String>, BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.granted_nodes(rest).await
    }

    async fn snapshot(&self, key: &str) -> Result<Option<SnapshotMeta>, BackendError> {
        let (connection, rest) = split(key);
        let (backend, _) = self.route(key)?;
        Ok(backend
            .snapshot(rest)
            .await?
            .map(|meta| prefixed(connection, meta)))
    }

    async fn create_snapshot(&self, key: &str, meta: &SnapshotMeta) -> Result<(), BackendError> {
        let (backend, rest) = self.route(key)?;
        let mut meta = meta.clone();
        meta.source_image = split(&meta.source_image).1.to_owned();
        backend.create_snapshot(rest, &meta).await
    }

    async fn delete_snapshot(&self, key: &str) -> Result<(), BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.delete_snapshot(rest).await
    }

    async fn snapshots(
        &self,
        near: Option<&str>,
    ) -> Result<Vec<(String, SnapshotMeta)>, BackendError> {
        let (connection, rest) = near.map_or((None, None), |k| {
            let (c, r) = split(k);
            (c, Some(r))
        });
        let (_, backend) = self.serving(connection)?;
        Ok(backend
            .snapshots(rest)
            .await?
            .into_iter()
            .map(|(key, meta)| {
                let key = connection.map_or(key.clone(), |c| format!("{c}/{key}"));
                (key, prefixed(connection, meta))
            })
            .collect())
    }

    /// On the members' one connection (keys without one are the oldest's).
    fn group_key(&self, image: &str, sources: &[&str]) -> Result<String, BackendError> {
        let mut connections: Vec<String> = sources
            .iter()
            .map(|k| split(&self.source_key(k)).0.unwrap_or_default().to_owned())
            .collect();
        connections.sort();
        connections.dedup();
        let [connection] = connections.as_slice() else {
            return Err(ConnectionError::GroupAcrossConnections { connections }.into());
        };
        let (_, backend) = self.serving(Some(connection))?;
        let inner: Vec<&str> = sources.iter().map(|k| split(k).1).collect();
        let key = backend.group_key(image, &inner)?;
        Ok(format!("{connection}/{key}"))
    }

    async fn group_snapshot(&self, key: &str) -> Result<Option<GroupSnapshotMeta>, BackendError> {
        let (connection, rest) = split(key);
        let (backend, _) = self.route(key)?;
        Ok(backend.group_snapshot(rest).await?.map(|mut g| {
            if let Some(c) = connection {
                g.name = format!("{c}/{}", g.name);
                g.members = g
                    .members
                    .into_iter()
                    .map(|(s, v)| (format!("{c}/{s}"), format!("{c}/{v}")))
                    .collect();
            }
            g
        }))
    }

    async fn create_group_snapshot(
        &self,
        key: &str,
        meta: &GroupSnapshotMeta,
        members: &[(String, SnapshotMeta)],
    ) -> Result<(), BackendError> {
        let (backend, rest) = self.route(key)?;
        let members: Vec<_> = members
            .iter()
            .map(|(snapshot, m)| {
                let mut m = m.clone();
                m.source_image = split(&m.source_image).1.to_owned();
                m.group = m.group.as_deref().map(|g| split(g).1.to_owned());
                (split(snapshot).1.to_owned(), m)
            })
            .collect();
        backend.create_group_snapshot(rest, meta, &members).await
    }

    async fn delete_group_snapshot(&self, key: &str) -> Result<(), BackendError> {
        let (backend, rest) = self.route(key)?;
        backend.delete_group_snapshot(rest).await
    }

    async fn capacity(
        &self,
        parameters: &BTreeMap<String, String>,
    ) -> Result<Option<u64>, BackendError> {
        let (_, backend) =
            self.serving(parameters.get(CONNECTION_PARAMETER).map(String::as_str))?;
        backend.capacity(parameters).await
    }
}

/// A snapshot's keys as this backend issues them: with the connection when the caller's had it.
fn prefixed(connection: Option<&str>, mut meta: SnapshotMeta) -> SnapshotMeta {
    if let Some(c) = connection {
        meta.name = format!("{c}/{}", meta.name);
        meta.source_image = format!("{c}/{}", meta.source_image);
        meta.group = meta.group.map(|g| format!("{c}/{g}"));
    }
    meta
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_their_connection_and_old_keys_have_none() {
        assert_eq!(
            split("main/data/k8s-pvc-1"),
            (Some("main"), "data/k8s-pvc-1")
        );
        assert_eq!(split("data/k8s-pvc-1"), (None, "data/k8s-pvc-1"));
    }
}
