//! `ustor-csi-controller import`: adopts an existing uStor image (an old product's claim's) as
//! a volume of this driver and writes the statically provisioned PersistentVolume for it, and
//! the claim that binds it, as YAML for `kubectl apply`. Nothing is copied: the claim's data is
//! the image's. The image's records are written here (see [`Provisioner::import_volume`]);
//! the objects are left to the operator to apply with their own rights.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use csi_proto::csi::Volume;
use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
    ObjectReference, PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeSpec, SecretReference, VolumeNodeAffinity, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::backend::connections::{ConnectionDirectory, ConnectionError, ConnectionsBackend};
use crate::backend::ustor::api::{check_url, UstorApi};
use crate::backend::ustor::backend::UstorBackend;
use crate::backend::ustor::credentials::CredentialsDir;
use crate::backend::ustor::login::Timing;
use crate::backend::Backend;
use crate::provision::Provisioner;

/// The annotation naming the image a PersistentVolume was adopted from.
pub const IMPORTED_FROM: &str = "ustor-nbd.csi.mindsw.io/imported-from";

/// Where the image is and how to reach its uStor.
#[derive(Debug, Clone)]
pub struct Source {
    pub url: String,
    pub credentials: PathBuf,
    pub ca: Option<PathBuf>,
    /// The MindUstorStorageConnection the volume id names (a controller serving every
    /// connection routes by it); without one, the id is the single-cluster controller's,
    /// which a multi-connection controller takes as its oldest connection's.
    pub connection: Option<String>,
    pub pool: String,
    pub image: String,
    /// The controller's `--cluster-id`: the image is recorded as adopted by that cluster, so
    /// its controller lists it although its name lacks the cluster's prefix.
    pub cluster_id: String,
}

/// The Kubernetes objects wanted.
#[derive(Debug, Clone)]
pub struct Objects {
    pub volume_name: String,
    /// `(namespace, name)` of the claim to pre-bind, and to write.
    pub claim: Option<(String, String)>,
    pub storage_class: Option<String>,
    pub access_mode: String,
    /// `Filesystem` or `Block`.
    pub volume_mode: String,
    pub fs_type: String,
    /// `Retain` or `Delete`.
    pub reclaim_policy: String,
    /// `(namespace, name)` of the TLS Secret kubelet passes to NodeStageVolume.
    pub node_stage_secret: Option<(String, String)>,
    /// Further StorageClass parameters to record (`nbdConnections`).
    pub parameters: HashMap<String, String>,
}

/// One connection, for the key and the TLS profile of a multi-connection controller's ids.
#[derive(Debug)]
struct OneConnection {
    name: String,
    api: Arc<UstorApi>,
}

impl ConnectionDirectory for OneConnection {
    fn api(&self, connection: &str) -> Result<Arc<UstorApi>, ConnectionError> {
        if connection == self.name {
            Ok(Arc::clone(&self.api))
        } else {
            Err(ConnectionError::Unknown {
                connection: connection.to_owned(),
            })
        }
    }

    fn oldest(&self) -> Option<String> {
        Some(self.name.clone())
    }

    fn names(&self) -> Vec<String> {
        vec![self.name.clone()]
    }
}

/// Checks what can be checked before any call to uStor.
pub fn check(objects: &Objects) -> anyhow::Result<()> {
    const MODES: [&str; 4] = [
        "ReadWriteOnce",
        "ReadWriteOncePod",
        "ReadOnlyMany",
        "ReadWriteMany",
    ];
    anyhow::ensure!(
        MODES.contains(&objects.access_mode.as_str()),
        "--access-mode {:?} must be one of {}",
        objects.access_mode,
        MODES.join(", ")
    );
    anyhow::ensure!(
        ["Filesystem", "Block"].contains(&objects.volume_mode.as_str()),
        "--volume-mode must be Filesystem or Block"
    );
    anyhow::ensure!(
        !(objects.volume_mode == "Block" && objects.access_mode == "ReadWriteOnce"),
        "a raw block volume serves one pod at a time: use --access-mode ReadWriteOncePod \
         (ReadWriteMany block is for VM live migration)"
    );
    anyhow::ensure!(
        ["ext4", "xfs"].contains(&objects.fs_type.as_str()),
        "--fs-type must be ext4 or xfs"
    );
    anyhow::ensure!(
        ["Retain", "Delete"].contains(&objects.reclaim_policy.as_str()),
        "--reclaim-policy must be Retain or Delete"
    );
    Ok(())
}

/// Adopts the image and answers the objects' YAML.
pub async fn run(source: &Source, objects: &Objects, allow_http: bool) -> anyhow::Result<String> {
    check(objects)?;
    let ca = source
        .ca
        .as_ref()
        .map(|path| std::fs::read(path).with_context(|| format!("reading {}", path.display())))
        .transpose()?;
    anyhow::ensure!(
        check_url(&source.url, allow_http).is_ok(),
        "--ustor-url {} must be an https:// URL (the uStor password crosses the network); \
         --ustor-allow-insecure-http allows http:// for a test setup",
        source.url
    );
    let api = Arc::new(UstorApi::new(
        &source.url,
        ca.as_deref(),
        Arc::new(CredentialsDir::new(&source.credentials)),
        Timing::default(),
        Arc::new(Instant::now),
    )?);
    let key = format!("{}/{}", source.pool, source.image);
    let mut parameters = objects.parameters.clone();
    parameters.insert("pool".to_owned(), source.pool.clone());
    let (backend, key): (Arc<dyn Backend>, String) = match &source.connection {
        None => (Arc::new(UstorBackend::new(api, &source.pool)), key),
        Some(name) => {
            crate::ids::valid_connection(name)?;
            parameters.insert(
                crate::backend::connections::CONNECTION_PARAMETER.to_owned(),
                name.clone(),
            );
            let directory = OneConnection {
                name: name.clone(),
                api,
            };
            let backend = ConnectionsBackend::new(Arc::new(directory), &source.pool);
            (Arc::new(backend), format!("{name}/{key}"))
        }
    };
    crate::ids::valid_cluster_id(&source.cluster_id).map_err(anyhow::Error::msg)?;
    let provisioner = Provisioner::new(backend, source.cluster_id.clone());
    let volume = provisioner
        .import_volume(&key, &objects.volume_name, &parameters)
        .await?;
    manifests(&volume, &key, objects)
}

/// The PersistentVolume external-provisioner would have made for `volume`, and the claim.
pub fn manifests(volume: &Volume, key: &str, objects: &Objects) -> anyhow::Result<String> {
    let size = Quantity(volume.capacity_bytes.to_string());
    let class = objects.storage_class.clone().unwrap_or_default();
    let filesystem = objects.volume_mode == "Filesystem";
    let affinity = volume
        .accessible_topology
        .iter()
        .map(|t| NodeSelectorTerm {
            match_expressions: Some(
                t.segments
                    .iter()
                    .map(|(k, v)| NodeSelectorRequirement {
                        key: k.clone(),
                        operator: "In".to_owned(),
                        values: Some(vec![v.clone()]),
                    })
                    .collect(),
            ),
            ..NodeSelectorTerm::default()
        })
        .collect::<Vec<_>>();
    let pv = PersistentVolume {
        metadata: ObjectMeta {
            name: Some(objects.volume_name.clone()),
            annotations: Some(BTreeMap::from([
                (
                    "pv.kubernetes.io/provisioned-by".to_owned(),
                    csi_common::DRIVER_NAME.to_owned(),
                ),
                (IMPORTED_FROM.to_owned(), key.to_owned()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([("storage".to_owned(), size.clone())])),
            access_modes: Some(vec![objects.access_mode.clone()]),
            volume_mode: Some(objects.volume_mode.clone()),
            persistent_volume_reclaim_policy: Some(objects.reclaim_policy.clone()),
            storage_class_name: Some(class.clone()),
            claim_ref: objects
                .claim
                .as_ref()
                .map(|(namespace, name)| ObjectReference {
                    namespace: Some(namespace.clone()),
                    name: Some(name.clone()),
                    ..ObjectReference::default()
                }),
            csi: Some(CSIPersistentVolumeSource {
                driver: csi_common::DRIVER_NAME.to_owned(),
                volume_handle: volume.volume_id.clone(),
                fs_type: filesystem.then(|| objects.fs_type.clone()),
                volume_attributes: Some(volume.volume_context.clone().into_iter().collect()),
                node_stage_secret_ref: objects.node_stage_secret.as_ref().map(
                    |(namespace, name)| SecretReference {
                        namespace: Some(namespace.clone()),
                        name: Some(name.clone()),
                    },
                ),
                ..CSIPersistentVolumeSource::default()
            }),
            node_affinity: (!affinity.is_empty()).then_some(VolumeNodeAffinity {
                required: Some(NodeSelector {
                    node_selector_terms: affinity,
                }),
            }),
            ..PersistentVolumeSpec::default()
        }),
        ..PersistentVolume::default()
    };
    let mut yaml = serde_yaml_ng::to_string(&pv)?;
    if let Some((namespace, name)) = &objects.claim {
        let pvc = PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec![objects.access_mode.clone()]),
                volume_mode: Some(objects.volume_mode.clone()),
                storage_class_name: Some(class),
                volume_name: Some(objects.volume_name.clone()),
                resources: Some(VolumeResourceRequirements {
                    requests: Some(BTreeMap::from([("storage".to_owned(), size)])),
                    ..VolumeResourceRequirements::default()
                }),
                ..PersistentVolumeClaimSpec::default()
            }),
            ..PersistentVolumeClaim::default()
        };
        yaml.push_str("---\n");
        yaml.push_str(&serde_yaml_ng::to_string(&pvc)?);
    }
    Ok(yaml)
}
