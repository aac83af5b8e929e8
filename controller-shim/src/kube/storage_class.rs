//! A MindUstorStorageClass owns a StorageClass of the same name for this driver. The
//! StorageClass is created once from the spec and never rewritten: Kubernetes forbids changing
//! a StorageClass's parameters, and volumes already provisioned depend on them. A spec that
//! no longer matches it puts the resource in phase Failed, naming what changed. Deleting the
//! resource deletes the StorageClass (owner reference, garbage collector), never volumes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{TopologySelectorLabelRequirement, TopologySelectorTerm};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::Patch;
use kube::runtime::controller::Action;
use kube::{Api, Resource, ResourceExt};

use super::crd::{MindUstorStorageClass, MindUstorStorageConnection, Phase, StorageClassStatus};
use super::{Context, GlueError, SNAPSHOT_CLASS};
use csi_common::{DRIVER_NAME, TOPOLOGY_KEY};

/// Annotations every StorageClass of ours carries; a value an admin already set is kept.
pub const ANNOTATIONS: [(&str, &str); 3] = [
    ("storage.deckhouse.io/volumesnapshotclass", SNAPSHOT_CLASS),
    (
        "virtualdisk.virtualization.deckhouse.io/volume-mode",
        "Block",
    ),
    (
        "virtualdisk.virtualization.deckhouse.io/access-mode",
        "ReadWriteMany",
    ),
];

/// The StorageClass parameters that make kubelet pass the connection's TLS Secret to
/// NodeStageVolume and NodeExpandVolume: the nodes take the data path's certificates from it
/// (the node daemon's `stage_tls`), with no files placed by hand.
pub const NODE_SECRET_PARAMETERS: [(&str, &str); 2] = [
    (
        "csi.storage.k8s.io/node-stage-secret-name",
        "csi.storage.k8s.io/node-stage-secret-namespace",
    ),
    (
        "csi.storage.k8s.io/node-expand-secret-name",
        "csi.storage.k8s.io/node-expand-secret-namespace",
    ),
];

/// The Secret kubelet is to pass to the nodes: the connection's TLS Secret.
#[derive(Debug, Clone, Copy)]
pub struct NodeSecret<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
}

/// Why a class created by an older version, whose StorageClass names no node secret, is
/// kept as it is (its parameters cannot change) with its phase Created.
const WITHOUT_NODE_SECRET: &str = "the StorageClass was created before StorageClasses named the \
    connection's TLS Secret as node-stage secret: nodes staging its volumes need \
    [tls-profile.<connection>] files in their configuration; a new MindUstorStorageClass needs none";

/// How often a healthy resource is looked at again, changes or not (missed events).
const RESYNC: Duration = Duration::from_secs(600);
/// How soon a Failed one is looked at again (a connection created later, a fixed spec).
const RETRY_FAILED: Duration = Duration::from_secs(30);

/// The StorageClass a resource stands for.
pub fn desired(
    class: &MindUstorStorageClass,
    node_secret: Option<NodeSecret<'_>>,
) -> Result<StorageClass, GlueError> {
    let owner = class
        .controller_owner_ref(&())
        .ok_or_else(|| GlueError::Invalid("the resource has no uid yet".into()))?;
    let spec = &class.spec;
    Ok(StorageClass {
        metadata: ObjectMeta {
            name: Some(class.name_any()),
            annotations: Some(
                ANNOTATIONS
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        provisioner: DRIVER_NAME.to_owned(),
        parameters: Some(parameters(class, node_secret)),
        reclaim_policy: Some(spec.reclaim_policy.as_str().to_owned()),
        volume_binding_mode: Some(spec.volume_binding_mode.as_str().to_owned()),
        allow_volume_expansion: Some(true),
        // Only nodes whose node service runs report this segment: pods land there, with
        // either binding mode.
        allowed_topologies: Some(vec![TopologySelectorTerm {
            match_label_expressions: Some(vec![TopologySelectorLabelRequirement {
                key: TOPOLOGY_KEY.to_owned(),
                values: vec!["true".to_owned()],
            }]),
        }]),
        mount_options: None,
    })
}

/// What the CSI controller reads from a StorageClass.
fn parameters(
    class: &MindUstorStorageClass,
    node_secret: Option<NodeSecret<'_>>,
) -> BTreeMap<String, String> {
    let mut parameters = BTreeMap::from([
        ("connection".to_owned(), class.spec.connection_name.clone()),
        ("pool".to_owned(), class.spec.pool.clone()),
        (
            "csi.storage.k8s.io/fstype".to_owned(),
            class.spec.fs_type.as_str().to_owned(),
        ),
    ]);
    if let Some(secret) = node_secret {
        for (name, namespace) in NODE_SECRET_PARAMETERS {
            parameters.insert(name.to_owned(), secret.name.to_owned());
            parameters.insert(namespace.to_owned(), secret.namespace.to_owned());
        }
    }
    parameters
}

/// Whether `sc` names a node secret (a StorageClass of an older version does not).
fn names_node_secret(sc: &StorageClass) -> bool {
    sc.parameters
        .as_ref()
        .is_some_and(|p| p.contains_key(NODE_SECRET_PARAMETERS[0].0))
}

/// The fields of `existing` that differ from `wanted` among those a StorageClass cannot
/// change, named for the operator.
fn immutable_differences(existing: &StorageClass, wanted: &StorageClass) -> Vec<String> {
    let mut out = Vec::new();
    if existing.provisioner != wanted.provisioner {
        out.push(format!("provisioner {}", existing.provisioner));
    }
    let (have, want) = (
        existing.parameters.clone().unwrap_or_default(),
        wanted.parameters.clone().unwrap_or_default(),
    );
    let legacy = !names_node_secret(existing);
    for (key, value) in &want {
        if legacy && is_node_secret_parameter(key) {
            continue;
        }
        match have.get(key) {
            Some(v) if v == value => {}
            Some(v) => out.push(format!("{key} is {v:?}, the spec says {value:?}")),
            None => out.push(format!("{key} is not set, the spec says {value:?}")),
        }
    }
    let differs = |name: &str, a: &Option<String>, b: &Option<String>| {
        (a != b).then(|| {
            format!(
                "{name} is {}, the spec says {}",
                a.as_deref().unwrap_or("unset"),
                b.as_deref().unwrap_or("unset")
            )
        })
    };
    out.extend(differs(
        "reclaimPolicy",
        &existing.reclaim_policy,
        &wanted.reclaim_policy,
    ));
    out.extend(differs(
        "volumeBindingMode",
        &existing.volume_binding_mode,
        &wanted.volume_binding_mode,
    ));
    out
}

fn is_node_secret_parameter(key: &str) -> bool {
    NODE_SECRET_PARAMETERS
        .iter()
        .any(|(name, namespace)| key == *name || key == *namespace)
}

/// Annotations and expansion the StorageClass lacks, as a merge patch (None: nothing to add).
fn missing_mutable(existing: &StorageClass) -> Option<serde_json::Value> {
    let have = existing.metadata.annotations.clone().unwrap_or_default();
    let annotations: serde_json::Map<String, serde_json::Value> = ANNOTATIONS
        .iter()
        .filter(|(k, _)| !have.contains_key(*k))
        .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v)))
        .collect();
    let expansion = existing.allow_volume_expansion != Some(true);
    if annotations.is_empty() && !expansion {
        return None;
    }
    let mut patch = serde_json::json!({});
    if !annotations.is_empty() {
        patch["metadata"] = serde_json::json!({ "annotations": annotations });
    }
    if expansion {
        patch["allowVolumeExpansion"] = serde_json::Value::Bool(true);
    }
    Some(patch)
}

pub async fn reconcile(
    class: Arc<MindUstorStorageClass>,
    ctx: Arc<Context>,
) -> Result<Action, GlueError> {
    if class.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    if !ctx.leader.is_leader() {
        return Ok(Action::requeue(super::FOLLOWER_RECHECK));
    }
    let status = match ensure(&class, &ctx).await? {
        Ok(note) => StorageClassStatus {
            phase: Some(Phase::Created),
            reason: note,
        },
        Err(reason) => {
            tracing::warn!(class = %class.name_any(), %reason, "MindUstorStorageClass failed");
            StorageClassStatus {
                phase: Some(Phase::Failed),
                reason: Some(reason),
            }
        }
    };
    let failed = status.phase == Some(Phase::Failed);
    super::write_status(&ctx, &*class, class.status.as_ref(), &status).await?;
    Ok(Action::requeue(if failed { RETRY_FAILED } else { RESYNC }))
}

/// Makes the StorageClass exist as the spec says. `Ok(Ok(note))`: Created, with what the
/// operator should know about it; `Ok(Err(reason))`: the resource is Failed for a reason the
/// operator must act on; `Err`: the API failed (retried).
async fn ensure(
    class: &MindUstorStorageClass,
    ctx: &Context,
) -> Result<Result<Option<String>, String>, GlueError> {
    let name = class.name_any();
    let classes: Api<StorageClass> = Api::all(ctx.client.clone());
    let connections: Api<MindUstorStorageConnection> = Api::all(ctx.client.clone());
    let connection = connections.get_opt(&class.spec.connection_name).await?;
    let node_secret = connection.as_ref().map(|c| NodeSecret {
        name: &c.spec.data_plane.tls_secret_name,
        namespace: &ctx.settings.namespace,
    });
    let wanted = desired(class, node_secret)?;
    let Some(existing) = classes.get_opt(&name).await? else {
        if connection.is_none() {
            return Ok(Err(format!(
                "MindUstorStorageConnection {:?} does not exist; create it, then the StorageClass is created",
                class.spec.connection_name
            )));
        }
        if let Err(reason) = crate::ids::valid_pool(&class.spec.pool) {
            return Ok(Err(reason.to_string()));
        }
        classes.create(&ctx.post_params(), &wanted).await?;
        tracing::info!(class = %name, "StorageClass created");
        return Ok(Ok(None));
    };
    let ours = existing
        .owner_references()
        .iter()
        .any(|o| Some(&o.uid) == class.meta().uid.as_ref());
    if !ours {
        return Ok(Err(format!(
            "StorageClass {name} already exists and is not managed by this MindUstorStorageClass; \
             delete that StorageClass or choose another name"
        )));
    }
    let changed = immutable_differences(&existing, &wanted);
    if !changed.is_empty() {
        return Ok(Err(format!(
            "the spec changed after the StorageClass was created ({}); a MindUstorStorageClass cannot be \
             changed: the StorageClass is kept as it was; create another MindUstorStorageClass instead",
            changed.join("; ")
        )));
    }
    if let Some(patch) = missing_mutable(&existing) {
        classes
            .patch(&name, &ctx.patch_params(), &Patch::Merge(patch))
            .await?;
    }
    Ok(Ok(
        (!names_node_secret(&existing)).then(|| WITHOUT_NODE_SECRET.to_owned())
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::crd::{FsType, MindUstorStorageClassSpec, ReclaimPolicy, VolumeBindingMode};

    fn class() -> MindUstorStorageClass {
        let mut c = MindUstorStorageClass::new(
            "fast",
            MindUstorStorageClassSpec {
                connection_name: "main".into(),
                pool: "data".into(),
                fs_type: FsType::Xfs,
                reclaim_policy: ReclaimPolicy::Retain,
                volume_binding_mode: VolumeBindingMode::WaitForFirstConsumer,
            },
        );
        c.metadata.uid = Some("u-1".into());
        c
    }

    const SECRET: Option<NodeSecret<'static>> = Some(NodeSecret {
        name: "main-tls",
        namespace: "d8-csi-mind-ustor",
    });

    #[test]
    fn the_storage_class_carries_every_field_the_driver_needs() {
        let sc = desired(&class(), SECRET).unwrap();
        assert_eq!(sc.provisioner, "ustor-nbd.csi.mindsw.io");
        let p = sc.parameters.as_ref().unwrap();
        assert_eq!(p["pool"], "data");
        assert_eq!(p["connection"], "main");
        assert_eq!(p["csi.storage.k8s.io/fstype"], "xfs");
        for (name, namespace) in NODE_SECRET_PARAMETERS {
            assert_eq!(
                (p[name].as_str(), p[namespace].as_str()),
                ("main-tls", "d8-csi-mind-ustor")
            );
        }
        assert_eq!(sc.reclaim_policy.as_deref(), Some("Retain"));
        assert_eq!(
            sc.volume_binding_mode.as_deref(),
            Some("WaitForFirstConsumer")
        );
        assert_eq!(sc.allow_volume_expansion, Some(true));
        let owner = &sc.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!((owner.uid.as_str(), owner.controller), ("u-1", Some(true)));
        assert!(immutable_differences(&sc, &sc).is_empty());
        assert!(missing_mutable(&sc).is_none(), "nothing to write");
    }

    #[test]
    fn a_changed_spec_is_named_and_an_admins_annotation_is_kept() {
        let original = desired(&class(), SECRET).unwrap();
        let mut changed = class();
        changed.spec.pool = "other".into();
        changed.spec.reclaim_policy = ReclaimPolicy::Delete;
        let diff = immutable_differences(&original, &desired(&changed, SECRET).unwrap());
        assert_eq!(diff.len(), 2, "{diff:?}");
        assert!(diff[0].contains("pool is \"data\""), "{diff:?}");

        let mut admin = original.clone();
        let annotations = admin.metadata.annotations.as_mut().unwrap();
        annotations.insert(
            "virtualdisk.virtualization.deckhouse.io/access-mode".into(),
            "ReadWriteOnce".into(),
        );
        annotations.remove("storage.deckhouse.io/volumesnapshotclass");
        let patch = missing_mutable(&admin).unwrap();
        let added = patch["metadata"]["annotations"].as_object().unwrap();
        assert_eq!(added.len(), 1, "only the missing one: {patch}");
        assert!(added.contains_key("storage.deckhouse.io/volumesnapshotclass"));
    }

    #[test]
    fn a_class_made_before_node_secrets_is_kept_but_a_changed_secret_is_named() {
        let wanted = desired(&class(), SECRET).unwrap();
        let legacy = desired(&class(), None).unwrap();
        assert!(!names_node_secret(&legacy));
        assert!(
            immutable_differences(&legacy, &wanted).is_empty(),
            "a StorageClass of an older version is not Failed for lacking the node secret"
        );
        let renamed = desired(
            &class(),
            Some(NodeSecret {
                name: "other-tls",
                namespace: "d8-csi-mind-ustor",
            }),
        )
        .unwrap();
        let diff = immutable_differences(&wanted, &renamed);
        assert_eq!(diff.len(), 2, "{diff:?}");
        assert!(diff[0].contains("\"main-tls\""), "{diff:?}");
    }
}
