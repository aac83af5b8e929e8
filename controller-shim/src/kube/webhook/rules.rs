//! What the admission webhook allows, as pure functions over the objects. PVC access modes
//! are mapped to CSI modes as external-provisioner maps them and checked with the same rules
//! the controller and the node apply (`csi_common::capability`), so a claim is refused at
//! `kubectl apply` for exactly the reasons CreateVolume would refuse it later.

use csi_common::capability;
use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use csi_proto::csi::VolumeCapability;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;

use crate::kube::crd::{MindUstorStorageClass, MindUstorStorageConnection};
use csi_common::DRIVER_NAME;

/// The CSI mode external-provisioner asks for a Kubernetes access mode.
fn csi_mode(access_mode: &str) -> Option<Mode> {
    Some(match access_mode {
        "ReadWriteOnce" => Mode::SingleNodeWriter,
        "ReadWriteOncePod" => Mode::SingleNodeSingleWriter,
        "ReadOnlyMany" => Mode::MultiNodeReaderOnly,
        "ReadWriteMany" => Mode::MultiNodeMultiWriter,
        _ => return None,
    })
}

/// Whether `user` matches one of `patterns` (exact, or a prefix ending in `*`).
pub fn user_matches(user: &str, patterns: &[String]) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => user.starts_with(prefix),
        None => user == p,
    })
}

/// A claim of one of our StorageClasses, created by `user`. `migration_users` may create
/// ReadWriteMany block claims (the virtualization module's live migration).
pub fn review_claim(
    claim: &PersistentVolumeClaim,
    user: &str,
    migration_users: &[String],
) -> Result<(), String> {
    let spec = claim.spec.clone().unwrap_or_default();
    let block = spec.volume_mode.as_deref() == Some("Block");
    let access_type = if block {
        AccessType::Block(BlockVolume {})
    } else {
        AccessType::Mount(MountVolume::default())
    };
    let modes = spec.access_modes.unwrap_or_default();
    for mode in &modes {
        let Some(csi) = csi_mode(mode) else {
            return Err(format!(
                "access mode {mode} is not supported by {DRIVER_NAME}"
            ));
        };
        let cap = VolumeCapability {
            access_type: Some(access_type.clone()),
            access_mode: Some(AccessMode { mode: csi as i32 }),
        };
        capability::check(&cap).map_err(|why| format!("{mode}: {why}"))?;
        if block && csi == Mode::MultiNodeMultiWriter && !user_matches(user, migration_users) {
            return Err(format!(
                "ReadWriteMany block volumes are for the live migration of virtual machines and only the \
                 virtualization module may create them ({user} may not); use ReadWriteOncePod for a pod's raw disk"
            ));
        }
    }
    Ok(())
}

/// What the claim rules judge: the StorageClass, the volume mode, the access modes.
fn judged(claim: &PersistentVolumeClaim) -> (Option<String>, String, Vec<String>) {
    let spec = claim.spec.clone().unwrap_or_default();
    let mut modes = spec.access_modes.unwrap_or_default();
    modes.sort();
    modes.dedup();
    (
        spec.storage_class_name,
        spec.volume_mode.unwrap_or_else(|| "Filesystem".into()),
        modes,
    )
}

/// An update by `user` of a claim that is (now) of one of our StorageClasses: `Ok(true)` when
/// `user` may have the claim as it is (it is stamped again), `Ok(false)` when the update passes
/// but gives no stamp. An update that changes what the rules judge (a claim given our
/// StorageClass) is reviewed as a new claim; any other (metadata, finalizers, a resize, the
/// binding) passes whoever writes it, so the controllers that keep a claim are never stopped,
/// and keeps the stamp the claim has, which proves what the webhook admitted before.
pub fn review_claim_update(
    old: &PersistentVolumeClaim,
    new: &PersistentVolumeClaim,
    user: &str,
    migration_users: &[String],
) -> Result<bool, String> {
    match review_claim(new, user, migration_users) {
        Ok(()) => Ok(true),
        Err(why) if judged(old) != judged(new) => Err(why),
        Err(_) => Ok(false),
    }
}

/// A StorageClass write by `user`: ours are made by the controller from a
/// MindUstorStorageClass, by nobody else.
pub fn review_storage_class(
    class: &StorageClass,
    user: &str,
    controller_user: &str,
) -> Result<(), String> {
    if class.provisioner != DRIVER_NAME || user == controller_user {
        return Ok(());
    }
    Err(format!(
        "StorageClasses of {DRIVER_NAME} are made by its controller from MindUstorStorageClass resources: \
         create or change a MindUstorStorageClass instead ({user} may not write them)"
    ))
}

/// An update of a connection: its management API never changes.
pub fn review_connection_update(
    old: &MindUstorStorageConnection,
    new: &MindUstorStorageConnection,
) -> Result<(), String> {
    let (was, is) = (
        &old.spec.control_plane.address,
        &new.spec.control_plane.address,
    );
    if was == is {
        return Ok(());
    }
    Err(format!(
        "spec.controlPlane.address cannot be changed (from {was} to {is}): the volumes of this connection \
         stay on the uStor cluster they were created on; create another connection for another cluster"
    ))
}

/// An update of a MindUstorStorageClass: its spec is fixed once created.
pub fn review_class_update(
    old: &MindUstorStorageClass,
    new: &MindUstorStorageClass,
) -> Result<(), String> {
    if old.spec == new.spec {
        return Ok(());
    }
    Err(
        "the spec of a MindUstorStorageClass cannot be changed: volumes already provisioned depend on it; \
         create another MindUstorStorageClass with the new parameters"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PersistentVolumeClaimSpec;

    fn claim(modes: &[&str], block: bool) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(modes.iter().map(|m| (*m).to_owned()).collect()),
                volume_mode: Some(if block { "Block" } else { "Filesystem" }.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    const VIRT: &str = "system:serviceaccount:d8-virtualization:virtualization-controller";

    fn migration() -> Vec<String> {
        vec!["system:serviceaccount:d8-virtualization:*".into()]
    }

    #[test]
    fn claims_take_the_guides_modes_and_say_what_to_use() {
        let user = "alice";
        for (modes, block) in [
            (&["ReadWriteOnce"][..], false),
            (&["ReadWriteOncePod"][..], false),
            (&["ReadWriteOncePod"][..], true),
        ] {
            assert!(
                review_claim(&claim(modes, block), user, &migration()).is_ok(),
                "{modes:?}"
            );
        }
        for (modes, block, says) in [
            (&["ReadWriteMany"][..], false, "volumeMode: Block"),
            (&["ReadOnlyMany"][..], false, "volumeMode: Block"),
            (&["ReadWriteOnce"][..], true, "ReadWriteOncePod"),
            (&["ReadOnlyMany"][..], true, "ReadWriteOncePod"),
            (&["ReadWriteMany"][..], true, "virtualization module"),
        ] {
            let err = review_claim(&claim(modes, block), user, &migration()).unwrap_err();
            assert!(err.contains(says), "{modes:?} block={block}: {err}");
        }
        assert!(review_claim(&claim(&["ReadWriteMany"], true), VIRT, &migration()).is_ok());
        // Filesystem RWX is refused for the virtualization module too.
        assert!(review_claim(&claim(&["ReadWriteMany"], false), VIRT, &migration()).is_err());
    }

    #[test]
    fn an_update_is_judged_only_when_it_changes_what_the_rules_judge() {
        let user = "alice";
        let rwx_block = claim(&["ReadWriteMany"], true);
        // The virtualization module's update stamps its claim; nobody else's does, and
        // nobody else's is stopped.
        assert_eq!(
            review_claim_update(&rwx_block, &rwx_block, VIRT, &migration()),
            Ok(true)
        );
        assert_eq!(
            review_claim_update(&rwx_block, &rwx_block, user, &migration()),
            Ok(false)
        );
        assert_eq!(
            review_claim_update(
                &rwx_block,
                &rwx_block,
                "system:kube-controller-manager",
                &migration()
            ),
            Ok(false)
        );
        // A claim given one of our StorageClasses by an update is reviewed as a new one.
        let mut unclassed = rwx_block.clone();
        if let Some(spec) = unclassed.spec.as_mut() {
            spec.storage_class_name = None;
        }
        let mut classed = rwx_block.clone();
        if let Some(spec) = classed.spec.as_mut() {
            spec.storage_class_name = Some("fast".into());
        }
        let err = review_claim_update(&unclassed, &classed, user, &migration()).unwrap_err();
        assert!(err.contains("virtualization module"), "{err}");
        let rwo = claim(&["ReadWriteOnce"], false);
        assert_eq!(
            review_claim_update(&rwo, &rwo, user, &migration()),
            Ok(true)
        );
    }

    #[test]
    fn user_patterns_are_exact_or_prefixes() {
        let patterns = vec!["system:serviceaccount:ns:*".to_owned(), "bob".to_owned()];
        assert!(user_matches("system:serviceaccount:ns:a", &patterns));
        assert!(user_matches("bob", &patterns));
        assert!(!user_matches("bobby", &patterns));
        assert!(!user_matches("system:serviceaccount:other:a", &patterns));
    }
}
