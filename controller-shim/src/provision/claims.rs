//! Who asked: a ReadWriteMany block volume is for the live migration of virtual machines, and
//! only the users the admission webhook lets create such claims may have one. CreateVolume
//! cannot see who asked, and the webhook can be bypassed (it fails open, and a claim made
//! before its StorageClass existed is not reviewed), so CreateVolume reads the claim the
//! volume is for (external-provisioner's `--extra-create-metadata` names it) and requires the
//! webhook's stamp on it (`kube::stamp`).

use std::collections::HashMap;

use csi_proto::csi::volume_capability::access_mode::Mode;
use csi_proto::csi::volume_capability::AccessType;
use csi_proto::csi::VolumeCapability;

use super::Provisioner;

/// The claim's name and namespace, from external-provisioner's `--extra-create-metadata`.
pub const CLAIM_NAME: &str = "csi.storage.k8s.io/pvc/name";
pub const CLAIM_NAMESPACE: &str = "csi.storage.k8s.io/pvc/namespace";

const RESERVED: &str = "ReadWriteMany block volumes are for the live migration of virtual machines";

/// Why a CreateVolume of a ReadWriteMany block volume is refused, by the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error(
        "{RESERVED}, and this CreateVolume names no claim to check: run csi-provisioner with \
         --extra-create-metadata (it adds {CLAIM_NAMESPACE} and {CLAIM_NAME})"
    )]
    Unnamed,
    #[error("claim {namespace}/{name} cannot be read from the Kubernetes API: {source}")]
    Read {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error("claim {namespace}/{name} does not exist (any more)")]
    Gone { namespace: String, name: String },
    #[error(
        "the controller's key (Secret {}) is not loaded yet, so claim {namespace}/{name} cannot be checked; retry",
        crate::kube::key::KEY_SECRET
    )]
    KeyNotLoaded { namespace: String, name: String },
    #[error(
        "{RESERVED}: claim {namespace}/{name} was not admitted by the admission webhook (it has no {} \
         annotation; the webhook was down, or the claim's StorageClass did not exist when it was \
         created). A live-migration user (--webhook-migration-users) updating the claim has it \
         admitted; anyone else must use ReadWriteOncePod",
        crate::kube::stamp::ANNOTATION
    )]
    NotAdmitted { namespace: String, name: String },
    #[error(
        "{RESERVED}: the admission stamp of claim {namespace}/{name} is not this claim's (copied from \
         another claim, the claim changed after admission, or the controller's key changed). A \
         live-migration user (--webhook-migration-users) updating the claim has it admitted anew"
    )]
    StampMismatch { namespace: String, name: String },
}

/// The claims CreateVolume is asked for (in Kubernetes, read through the API).
#[tonic::async_trait]
pub trait Claims: Send + Sync + std::fmt::Debug {
    /// Whether the admission webhook admitted claim `namespace/name` as it is.
    async fn admitted(&self, namespace: &str, name: &str) -> Result<(), ClaimError>;
}

/// Whether a capability is the one the rules reserve: several nodes writing a raw disk.
fn reserved(cap: &VolumeCapability) -> bool {
    matches!(cap.access_type, Some(AccessType::Block(_)))
        && cap
            .access_mode
            .as_ref()
            .is_some_and(|m| m.mode() == Mode::MultiNodeMultiWriter)
}

impl Provisioner {
    /// A volume asking for a reserved capability is made only for a claim the admission
    /// webhook admitted (in Kubernetes; without it there are no claims and no webhook).
    pub(super) async fn require_admitted(
        &self,
        capabilities: &[VolumeCapability],
        parameters: &HashMap<String, String>,
    ) -> Result<(), ClaimError> {
        let Some(claims) = self.cluster.as_ref().map(|c| &c.claims) else {
            return Ok(());
        };
        if !capabilities.iter().any(reserved) {
            return Ok(());
        }
        match (parameters.get(CLAIM_NAMESPACE), parameters.get(CLAIM_NAME)) {
            (Some(namespace), Some(name)) => claims.admitted(namespace, name).await,
            _ => Err(ClaimError::Unnamed),
        }
    }
}
