//! The admission webhook's stamp on a claim it admitted for one of our StorageClasses: the
//! annotation `ustor-nbd.csi.mindsw.io/admitted: v1.<hex>`, the HMAC-SHA256 under the
//! controller's key ([`ControllerKey`]) of the fields the rules judged, one per line:
//!
//! ```text
//! ustor-nbd.csi.mindsw.io/admitted v1
//! <namespace>
//! <name>            (generateName=<prefix> for a claim created with a generateName only)
//! <storageClassName>
//! <volumeMode>      (Filesystem when unset)
//! <access modes>    (sorted, without repeats, joined by commas)
//! ```
//!
//! CreateVolume of a ReadWriteMany block volume, the kind the rules reserve for the live
//! migration users, reads its claim and requires a stamp that matches the claim as it is: a
//! claim admitted while the webhook was down, or before its StorageClass existed, has none; a
//! stamp copied onto another claim, or a claim whose modes changed, does not match. The stamp
//! binds the namespace and name, not the uid: a mutating webhook sees a new claim before the
//! API server gives it a uid (and, for a generateName, its name).

use k8s_openapi::api::core::v1::PersistentVolumeClaim;

use super::key::ControllerKey;

/// The annotation carrying the stamp.
pub const ANNOTATION: &str = "ustor-nbd.csi.mindsw.io/admitted";
/// The scheme's version, the stamp's prefix.
const VERSION: &str = "v1";

/// What a claim's stamp says about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// The webhook admitted the claim as it is.
    Valid,
    /// No stamp.
    Missing,
    /// A stamp that is not this claim's (copied, the claim changed, the key changed).
    Mismatch,
}

/// The signed text of `claim` in `namespace` under the name form `name`.
fn message(namespace: &str, name: &str, claim: &PersistentVolumeClaim) -> Vec<u8> {
    let spec = claim.spec.clone().unwrap_or_default();
    let mut modes = spec.access_modes.unwrap_or_default();
    modes.sort();
    modes.dedup();
    [
        format!("{ANNOTATION} {VERSION}"),
        namespace.to_owned(),
        name.to_owned(),
        spec.storage_class_name.unwrap_or_default(),
        spec.volume_mode.unwrap_or_else(|| "Filesystem".to_owned()),
        modes.join(","),
    ]
    .join("\n")
    .into_bytes()
}

/// The name form a claim is signed under: its name, or its generateName before the API
/// server has picked the name.
fn generated(prefix: &str) -> String {
    format!("generateName={prefix}")
}

/// The stamp for a claim being admitted in `namespace`; `None` until the key is loaded.
pub fn stamp(
    key: &ControllerKey,
    namespace: &str,
    claim: &PersistentVolumeClaim,
) -> Option<String> {
    let meta = &claim.metadata;
    let name = match (meta.name.as_deref(), meta.generate_name.as_deref()) {
        (Some(name), _) if !name.is_empty() => name.to_owned(),
        (_, prefix) => generated(prefix.unwrap_or_default()),
    };
    key.sign(&message(namespace, &name, claim))
        .map(|tag| format!("{VERSION}.{tag}"))
}

/// Whether `claim`, as the API serves it, carries the webhook's stamp for what it is; `None`
/// until the key is loaded.
pub fn check(key: &ControllerKey, claim: &PersistentVolumeClaim) -> Option<Check> {
    let meta = &claim.metadata;
    let Some(stamp) = meta.annotations.as_ref().and_then(|a| a.get(ANNOTATION)) else {
        return Some(Check::Missing);
    };
    let Some(tag) = stamp.strip_prefix(&format!("{VERSION}.")) else {
        // Not this scheme's, whatever the key.
        return Some(Check::Mismatch);
    };
    let (namespace, name) = (
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default(),
    );
    let mut names = vec![name.to_owned()];
    if let Some(prefix) = meta.generate_name.as_deref() {
        if !prefix.is_empty() && name.starts_with(prefix) {
            names.push(generated(prefix));
        }
    }
    let mut valid = false;
    for name in names {
        valid |= key.verify(&message(namespace, &name, claim), tag)?;
    }
    Some(if valid { Check::Valid } else { Check::Mismatch })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PersistentVolumeClaimSpec;
    use kube::api::ObjectMeta;

    fn claim(name: &str, generate_name: Option<&str>, modes: &[&str]) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: (!name.is_empty()).then(|| name.to_owned()),
                generate_name: generate_name.map(str::to_owned),
                namespace: Some("vms".into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(modes.iter().map(|m| (*m).to_owned()).collect()),
                volume_mode: Some("Block".into()),
                storage_class_name: Some("fast".into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn stamped(mut claim: PersistentVolumeClaim, stamp: Option<String>) -> PersistentVolumeClaim {
        claim.metadata.annotations = stamp.map(|s| [(ANNOTATION.to_owned(), s)].into());
        claim
    }

    #[test]
    fn a_stamp_holds_for_its_claim_as_admitted_only() {
        let key = ControllerKey::from_bytes(&[1; 32]);
        let admitted = claim("disk", None, &["ReadWriteMany"]);
        let s = stamp(&key, "vms", &admitted);
        assert!(s.as_deref().is_some_and(|s| s.starts_with("v1.")), "{s:?}");
        assert_eq!(
            check(&key, &stamped(admitted.clone(), s.clone())),
            Some(Check::Valid)
        );
        assert_eq!(check(&key, &admitted), Some(Check::Missing));
        // Repeats and order of the modes do not matter; a changed mode, name, namespace,
        // class or volume mode does, and so does another key.
        let same = claim("disk", None, &["ReadWriteMany", "ReadWriteMany"]);
        assert_eq!(check(&key, &stamped(same, s.clone())), Some(Check::Valid));
        let mut changed = vec![
            claim("disk", None, &["ReadWriteMany", "ReadWriteOncePod"]),
            claim("other-disk", None, &["ReadWriteMany"]),
        ];
        let mut moved = admitted.clone();
        moved.metadata.namespace = Some("default".into());
        changed.push(moved);
        let mut filesystem = admitted.clone();
        if let Some(spec) = filesystem.spec.as_mut() {
            spec.volume_mode = None;
        }
        changed.push(filesystem);
        let mut reclassed = admitted.clone();
        if let Some(spec) = reclassed.spec.as_mut() {
            spec.storage_class_name = Some("slow".into());
        }
        changed.push(reclassed);
        for other in changed {
            assert_eq!(
                check(&key, &stamped(other.clone(), s.clone())),
                Some(Check::Mismatch),
                "{other:?}"
            );
        }
        let rotated = ControllerKey::from_bytes(&[2; 32]);
        assert_eq!(
            check(&rotated, &stamped(admitted.clone(), s)),
            Some(Check::Mismatch)
        );
        assert_eq!(
            check(&key, &stamped(admitted.clone(), Some("v1.00".into()))),
            Some(Check::Mismatch)
        );
        assert_eq!(
            check(&key, &stamped(admitted.clone(), Some("forged".into()))),
            Some(Check::Mismatch)
        );
        assert_eq!(
            check(&ControllerKey::default(), &admitted),
            Some(Check::Missing)
        );
        assert_eq!(stamp(&ControllerKey::default(), "vms", &admitted), None);
    }

    #[test]
    fn a_claim_named_by_the_api_server_keeps_its_stamp() {
        let key = ControllerKey::from_bytes(&[1; 32]);
        let at_admission = claim("", Some("disk-"), &["ReadWriteMany"]);
        let s = stamp(&key, "vms", &at_admission);
        let created = stamped(
            claim("disk-x7k2p", Some("disk-"), &["ReadWriteMany"]),
            s.clone(),
        );
        assert_eq!(check(&key, &created), Some(Check::Valid));
        let elsewhere = stamped(claim("vm-x7k2p", Some("disk-"), &["ReadWriteMany"]), s);
        assert_eq!(check(&key, &elsewhere), Some(Check::Mismatch));
    }
}
