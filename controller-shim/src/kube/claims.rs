//! The claims CreateVolume is asked for, read through the API when it needs one: whether the
//! admission webhook admitted a claim ([`super::stamp`]), for a ReadWriteMany block volume.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::{Api, Client};

use super::key::ControllerKey;
use super::stamp::{self, Check};
use crate::provision::{ClaimError, Claims};

#[derive(Clone)]
pub struct AdmittedClaims {
    pub client: Client,
    pub key: ControllerKey,
}

impl std::fmt::Debug for AdmittedClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmittedClaims")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

#[tonic::async_trait]
impl Claims for AdmittedClaims {
    async fn admitted(&self, namespace: &str, name: &str) -> Result<(), ClaimError> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), namespace);
        let (namespace, name) = (namespace.to_owned(), name.to_owned());
        let claim = match claims.get_opt(&name).await {
            Ok(Some(claim)) => claim,
            Ok(None) => return Err(ClaimError::Gone { namespace, name }),
            Err(source) => {
                return Err(ClaimError::Read {
                    namespace,
                    name,
                    source,
                })
            }
        };
        match stamp::check(&self.key, &claim) {
            Some(Check::Valid) => Ok(()),
            Some(Check::Missing) => Err(ClaimError::NotAdmitted { namespace, name }),
            Some(Check::Mismatch) => Err(ClaimError::StampMismatch { namespace, name }),
            None => Err(ClaimError::KeyNotLoaded { namespace, name }),
        }
    }
}
