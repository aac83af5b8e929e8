//! gRPC types and services generated from `proto/`: the CSI spec (package `csi.v1`) and
//! kubelet's plugin registration API. Nothing here is written by hand but the Debug of the two
//! messages that carry secrets: what node and controller share beside these types lives in
//! `csi-common`.

/// CSI v1.12: Identity, Controller and Node (the parts this driver serves).
#[allow(clippy::all, missing_docs, missing_debug_implementations)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}

/// Kubelet's `pluginregistration` API, served on the plugins_registry socket.
#[allow(clippy::all, missing_docs, missing_debug_implementations)]
pub mod registration {
    tonic::include_proto!("pluginregistration");
}

/// The key names of a `secrets` map, never its values.
struct SecretKeys<'a>(&'a std::collections::HashMap<String, String>);

impl std::fmt::Debug for SecretKeys<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut keys: Vec<&str> = self.0.keys().map(String::as_str).collect();
        keys.sort_unstable();
        f.debug_map()
            .entries(keys.into_iter().map(|k| (k, "<redacted>")))
            .finish()
    }
}

impl std::fmt::Debug for csi::NodeStageVolumeRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeStageVolumeRequest")
            .field("volume_id", &self.volume_id)
            .field("publish_context", &self.publish_context)
            .field("staging_target_path", &self.staging_target_path)
            .field("volume_capability", &self.volume_capability)
            .field("secrets", &SecretKeys(&self.secrets))
            .field("volume_context", &self.volume_context)
            .finish()
    }
}

impl std::fmt::Debug for csi::NodeExpandVolumeRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeExpandVolumeRequest")
            .field("volume_id", &self.volume_id)
            .field("volume_path", &self.volume_path)
            .field("capacity_range", &self.capacity_range)
            .field("staging_target_path", &self.staging_target_path)
            .field("volume_capability", &self.volume_capability)
            .field("secrets", &SecretKeys(&self.secrets))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::csi::{NodeExpandVolumeRequest, NodeStageVolumeRequest};

    #[test]
    fn secrets_never_print() {
        let secrets = std::collections::HashMap::from([
            ("client.key".to_owned(), "PRIVATE-KEY-BYTES".to_owned()),
            ("ca.crt".to_owned(), "CA-BYTES".to_owned()),
        ]);
        let stage = NodeStageVolumeRequest {
            volume_id: "vol-1".into(),
            secrets: secrets.clone(),
            ..Default::default()
        };
        let expand = NodeExpandVolumeRequest {
            volume_id: "vol-1".into(),
            secrets,
            ..Default::default()
        };
        for shown in [
            format!("{stage:?}"),
            format!("{expand:?}"),
            format!("{stage:#?}"),
        ] {
            assert!(
                shown.contains("vol-1") && shown.contains("client.key"),
                "{shown}"
            );
            assert!(!shown.contains("BYTES"), "a secret printed: {shown}");
        }
    }
}
