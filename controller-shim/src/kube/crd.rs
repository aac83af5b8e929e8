//! The custom resources an operator writes (the seeds' guide, group `storage.deckhouse.io`,
//! cluster-scoped): a connection to a uStor cluster, and storage classes over it. The CRD
//! manifests in `deploy/crds.yaml` are generated from these types (`ustor-csi-controller crds`);
//! a test fails when the committed file differs.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "storage.deckhouse.io";

/// Where a uStor cluster is and how to log in to it.
#[derive(CustomResource, Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "storage.deckhouse.io",
    version = "v1alpha1",
    kind = "MindUstorStorageConnection",
    status = "ConnectionStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.reason","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MindUstorStorageConnectionSpec {
    pub control_plane: ControlPlane,
    pub data_plane: DataPlane,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControlPlane {
    /// URL of the uStor management API, e.g. https://ustor-api.example.lab:23004. Cannot be
    /// changed: the volumes stay on the uStor cluster they were created on.
    pub address: String,
    /// Secret in the driver's namespace with the keys `username` and `password`.
    pub credentials_secret_name: String,
}

#[derive(Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataPlane {
    /// Client endpoints of the uStor etcd.
    pub etcd_addresses: Vec<String>,
    /// Network of the uStor OSDs (CIDR).
    pub osd_network: String,
    /// Secret in the driver's namespace with `ca.crt`, `client.crt`, `client.key`,
    /// `etcd-client.crt` and `etcd-client.key`.
    pub tls_secret_name: String,
    /// Nodes that reach the data network; all nodes when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
}

/// Created or Failed, as the guide's `kubectl get -o wide` shows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
pub enum Phase {
    Created,
    Failed,
}

/// The phase as a plain string enum: schemars would list `null` among the values of an
/// optional enum, which API servers before 1.21 refuse in a CRD.
fn phase_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "type": "string", "enum": ["Created", "Failed"] })
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "phase_schema")]
    pub phase: Option<Phase>,
    /// What is wrong, when the phase is Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `Ready` and `Authenticated`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The management API address the connection was first served with: the reference the
    /// immutability check compares against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_address: Option<String>,
    /// The credentials uStor last refused: no login is tried with them again (uStor locks
    /// the user after 3 failed logins) until the credentials Secret changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused_login: Option<RefusedLogin>,
}

/// Credentials uStor refused, named without revealing them.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RefusedLogin {
    /// HMAC-SHA256, under the controller's key (Secret csi-controller-key), of the content of
    /// the credentials Secret when uStor refused it; never the Secret itself.
    pub credentials_digest: String,
    /// uStor's reason: UserLocked, PasswordExpired, TemporaryPassword, UserNotFound or
    /// LoginRejected.
    pub reason: String,
}

/// A StorageClass of this driver over one connection and pool. Immutable once created.
#[derive(CustomResource, Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "storage.deckhouse.io",
    version = "v1alpha1",
    kind = "MindUstorStorageClass",
    status = "StorageClassStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.reason","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct MindUstorStorageClassSpec {
    /// The MindUstorStorageConnection whose uStor cluster holds the volumes.
    pub connection_name: String,
    /// uStor pool of the volumes.
    pub pool: String,
    pub fs_type: FsType,
    pub reclaim_policy: ReclaimPolicy,
    pub volume_binding_mode: VolumeBindingMode,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FsType {
    Ext4,
    Xfs,
}

impl FsType {
    pub fn as_str(self) -> &'static str {
        match self {
            FsType::Ext4 => "ext4",
            FsType::Xfs => "xfs",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
pub enum ReclaimPolicy {
    Delete,
    Retain,
}

impl ReclaimPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            ReclaimPolicy::Delete => "Delete",
            ReclaimPolicy::Retain => "Retain",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
pub enum VolumeBindingMode {
    Immediate,
    WaitForFirstConsumer,
}

impl VolumeBindingMode {
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeBindingMode::Immediate => "Immediate",
            VolumeBindingMode::WaitForFirstConsumer => "WaitForFirstConsumer",
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StorageClassStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "phase_schema")]
    pub phase: Option<Phase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Both CRDs as one multi-document YAML, the content of `deploy/crds.yaml`.
pub fn crds_yaml() -> String {
    let mut out = String::from(
        "# Generated by `ustor-csi-controller crds` from controller-shim/src/kube/crd.rs; do not edit.\n",
    );
    for crd in [
        MindUstorStorageConnection::crd(),
        MindUstorStorageClass::crd(),
    ] {
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(&crd).unwrap_or_else(|e| {
            // Serializing a value built from static types cannot fail; say so if it ever does.
            panic!("CRD to YAML: {e}")
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `deploy/crds.yaml` is what the types generate: run `ustor-csi-controller crds >
    /// deploy/crds.yaml` after changing them.
    #[test]
    fn committed_crds_match_the_types() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/crds.yaml");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == crds_yaml(),
            "deploy/crds.yaml is stale: regenerate it with `cargo run -p controller-shim -- crds > deploy/crds.yaml`"
        );
    }

    #[test]
    fn crds_are_cluster_scoped_with_status_and_wide_columns() {
        for crd in [
            MindUstorStorageConnection::crd(),
            MindUstorStorageClass::crd(),
        ] {
            assert_eq!(crd.spec.group, GROUP);
            assert_eq!(crd.spec.scope, "Cluster");
            let version = &crd.spec.versions[0];
            assert_eq!(version.name, "v1alpha1");
            assert!(version.subresources.as_ref().unwrap().status.is_some());
            let columns = version.additional_printer_columns.as_ref().unwrap();
            let reason = columns.iter().find(|c| c.name == "Reason").unwrap();
            assert_eq!(reason.priority, Some(1), "REASON only with -o wide");
        }
    }
}
