//! csi-sanity (kubernetes-csi/csi-test, built by `tests/sanity/build`) against the driver as it
//! is deployed: the node daemon and the controller are two processes.
//!
//! csi-sanity decides whether a driver has a controller from `GetPluginCapabilities` on its node
//! endpoint, even when `--csi.controllerendpoint` names another socket; without one its node
//! lifecycle specs are skipped, not passed. [`SanityEndpoint`] is that node endpoint: it answers
//! Identity with the union of both services' plugin capabilities and forwards every Node call to
//! the daemon unchanged, so what the specs test is the daemon's own answer.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use csi_proto::csi::identity_client::IdentityClient;
use csi_proto::csi::identity_server::{Identity, IdentityServer};
use csi_proto::csi::node_client::NodeClient;
use csi_proto::csi::node_server::{Node, NodeServer};
use csi_proto::csi::*;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// A node endpoint for csi-sanity in front of the node daemon (see the module doc).
#[derive(Debug)]
pub struct SanityEndpoint {
    pub socket: PathBuf,
    server: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl SanityEndpoint {
    /// Serves on a new socket, forwarding to the daemon at `node` and taking the controller's
    /// plugin capabilities from `controller`.
    pub async fn start(node: &Path, controller: &Path) -> std::io::Result<Self> {
        let node = crate::csi::connect(node)
            .await
            .map_err(std::io::Error::other)?;
        let controller = crate::csi::connect(controller)
            .await
            .map_err(std::io::Error::other)?;
        let dir = tempfile::Builder::new().prefix("sanity").tempdir()?;
        let socket = dir.path().join("node.sock");
        let listener = tokio::net::UnixListener::bind(&socket)?;
        let forward = Forward {
            node: node.clone(),
            controller,
        };
        let server = tokio::spawn(async move {
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            let served = tonic::transport::Server::builder()
                .add_service(IdentityServer::new(forward))
                .add_service(NodeServer::new(NodeForward(node)))
                .serve_with_incoming(incoming)
                .await;
            if let Err(e) = served {
                eprintln!("sanity endpoint stopped: {e}");
            }
        });
        Ok(Self {
            socket,
            server,
            _dir: dir,
        })
    }
}

impl Drop for SanityEndpoint {
    fn drop(&mut self) {
        self.server.abort();
    }
}

#[derive(Debug, Clone)]
struct Forward {
    node: Channel,
    controller: Channel,
}

impl Forward {
    /// The daemon's identity service: plugin info and probe are the node's.
    fn node_identity(&self) -> IdentityClient<Channel> {
        IdentityClient::new(self.node.clone())
    }
}

#[tonic::async_trait]
impl Identity for Forward {
    async fn get_plugin_info(
        &self,
        request: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        self.node_identity()
            .get_plugin_info(request.into_inner())
            .await
    }

    async fn get_plugin_capabilities(
        &self,
        request: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        let request = request.into_inner();
        let mut capabilities = Vec::new();
        for channel in [&self.node, &self.controller] {
            let answer = IdentityClient::new(channel.clone())
                .get_plugin_capabilities(request)
                .await?
                .into_inner();
            for c in answer.capabilities {
                if !capabilities.contains(&c) {
                    capabilities.push(c);
                }
            }
        }
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        request: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, Status> {
        self.node_identity().probe(request.into_inner()).await
    }
}

#[derive(Debug, Clone)]
struct NodeForward(Channel);

impl NodeForward {
    fn client(&self) -> NodeClient<Channel> {
        NodeClient::new(self.0.clone())
    }
}

/// `impl Node for NodeForward`: each RPC `name: Request -> Response` sends the request on to
/// the daemon and hands back its answer, status included.
macro_rules! forward_node {
    ($($rpc:ident: $request:ident -> $response:ident),* $(,)?) => {
        #[tonic::async_trait]
        impl Node for NodeForward {
            $(
                async fn $rpc(
                    &self,
                    r: Request<$request>,
                ) -> Result<Response<$response>, Status> {
                    self.client().$rpc(r.into_inner()).await
                }
            )*
        }
    };
}

forward_node! {
    node_stage_volume: NodeStageVolumeRequest -> NodeStageVolumeResponse,
    node_unstage_volume: NodeUnstageVolumeRequest -> NodeUnstageVolumeResponse,
    node_publish_volume: NodePublishVolumeRequest -> NodePublishVolumeResponse,
    node_unpublish_volume: NodeUnpublishVolumeRequest -> NodeUnpublishVolumeResponse,
    node_get_volume_stats: NodeGetVolumeStatsRequest -> NodeGetVolumeStatsResponse,
    node_expand_volume: NodeExpandVolumeRequest -> NodeExpandVolumeResponse,
    node_get_capabilities: NodeGetCapabilitiesRequest -> NodeGetCapabilitiesResponse,
    node_get_info: NodeGetInfoRequest -> NodeGetInfoResponse,
}

/// The outcome of one csi-sanity run, from its JSON report: every spec's full name by state
/// (`passed`, `failed`, `skipped`, ...), and each failure's message.
#[derive(Debug, Default)]
pub struct SanityReport {
    pub by_state: BTreeMap<String, Vec<String>>,
    pub failures: Vec<(String, String)>,
}

impl SanityReport {
    pub fn count(&self, state: &str) -> usize {
        self.by_state.get(state).map_or(0, Vec::len)
    }

    /// The spec names in `state`, sorted.
    pub fn names(&self, state: &str) -> Vec<String> {
        let mut names = self.by_state.get(state).cloned().unwrap_or_default();
        names.sort();
        names
    }

    /// Parses Ginkgo v2's `--ginkgo.json-report`: an array of suite reports, each with its
    /// `SpecReports`. Only `It` nodes are specs; suite set-up nodes fail the run otherwise.
    pub fn parse(json: &[u8]) -> Result<Self, String> {
        let suites: serde_json::Value =
            serde_json::from_slice(json).map_err(|e| format!("not JSON: {e}"))?;
        let suites = suites.as_array().ok_or("the report is not an array")?;
        let mut report = SanityReport::default();
        for suite in suites {
            for spec in suite["SpecReports"].as_array().into_iter().flatten() {
                let state = spec["State"].as_str().unwrap_or("unknown").to_owned();
                let mut name: Vec<&str> = spec["ContainerHierarchyTexts"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|t| t.as_str())
                    .collect();
                name.push(spec["LeafNodeText"].as_str().unwrap_or(""));
                let name = name.join(" ").trim().to_owned();
                let is_spec = spec["LeafNodeType"] == "It";
                // A spec the suite itself marks pending is neither run nor a failure.
                if !matches!(state.as_str(), "passed" | "skipped" | "pending") {
                    let message = spec["Failure"]["Message"].as_str().unwrap_or("").to_owned();
                    report.failures.push((name.clone(), message));
                }
                if is_spec || state != "passed" {
                    report.by_state.entry(state).or_default().push(name);
                }
            }
        }
        Ok(report)
    }
}

/// How one csi-sanity run is set up.
#[derive(Debug, Clone)]
pub struct SanityRun {
    /// The csi-sanity binary (`tests/sanity/build` makes `csi-sanity` and `csi-sanity-block`).
    pub binary: PathBuf,
    pub node_endpoint: PathBuf,
    pub controller_endpoint: PathBuf,
    /// `mount` or `block`.
    pub access_type: String,
    pub volume_bytes: u64,
    /// Where csi-sanity makes its staging and target paths (kubelet-shaped paths are not
    /// needed: the daemon takes any absolute path).
    pub work: PathBuf,
    /// The mutable parameters its ModifyVolume and VolumeAttributesClass specs create and
    /// modify volumes with.
    pub mutable_parameters: BTreeMap<String, String>,
}

impl SanityRun {
    /// Runs the suite to the end and reads its report. The suite's own output goes to this
    /// process's output, so a failing spec can be read in the test log.
    pub fn run(&self) -> Result<SanityReport, String> {
        let report = self.work.join("sanity-report.json");
        // The suite reads them from a YAML map; JSON is YAML.
        let mutable = self.work.join("mutable-parameters.yaml");
        let yaml = serde_json::to_vec(&self.mutable_parameters).map_err(|e| e.to_string())?;
        std::fs::write(&mutable, yaml)
            .map_err(|e| format!("writing {}: {e}", mutable.display()))?;
        let status = Command::new(&self.binary)
            .arg(format!(
                "--csi.endpoint=unix://{}",
                self.node_endpoint.display()
            ))
            .arg(format!(
                "--csi.controllerendpoint=unix://{}",
                self.controller_endpoint.display()
            ))
            .arg(format!(
                "--csi.stagingdir={}",
                self.work.join("staging").display()
            ))
            .arg(format!(
                "--csi.mountdir={}",
                self.work.join("target").display()
            ))
            .arg(format!("--csi.testvolumeaccesstype={}", self.access_type))
            .arg(format!("--csi.testvolumesize={}", self.volume_bytes))
            .arg(format!(
                "--csi.testvolumeexpandsize={}",
                2 * self.volume_bytes
            ))
            .arg(format!(
                "--csi.testvolumemutableparameters={}",
                mutable.display()
            ))
            // The node reports a limit (NodeGetInfo); the spec publishes one volume past it.
            .arg("--csi.testnodevolumeattachlimit")
            .arg(format!("--ginkgo.json-report={}", report.display()))
            .arg("--ginkgo.no-color")
            .status()
            .map_err(|e| format!("running {}: {e}", self.binary.display()))?;
        let json = std::fs::read(&report)
            .map_err(|e| format!("csi-sanity ({status}) wrote no report: {e}"))?;
        SanityReport::parse(&json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_counts_specs_by_state_and_keeps_failure_messages() {
        let json = br#"[{"SpecReports": [
            {"LeafNodeType": "BeforeSuite", "State": "passed", "ContainerHierarchyTexts": null, "LeafNodeText": ""},
            {"LeafNodeType": "It", "State": "passed", "ContainerHierarchyTexts": ["Node Service"], "LeafNodeText": "should work"},
            {"LeafNodeType": "It", "State": "skipped", "ContainerHierarchyTexts": ["ListVolumes"], "LeafNodeText": "should page"},
            {"LeafNodeType": "It", "State": "failed", "ContainerHierarchyTexts": ["Controller", "CreateSnapshot"], "LeafNodeText": "should fail when no name is provided",
             "Failure": {"Message": "Expected InvalidArgument, got NotFound"}}
        ]}]"#;
        let report = SanityReport::parse(json).unwrap();
        assert_eq!(report.count("passed"), 1);
        assert_eq!(report.count("skipped"), 1);
        assert_eq!(
            report.names("failed"),
            ["Controller CreateSnapshot should fail when no name is provided"]
        );
        assert_eq!(
            report.failures[0].1,
            "Expected InvalidArgument, got NotFound"
        );
    }

    #[test]
    fn a_pending_spec_is_not_a_failure() {
        let json = br#"[{"SpecReports": [
            {"LeafNodeType": "It", "State": "pending", "ContainerHierarchyTexts": ["ListVolumes"], "LeafNodeText": "pagination"}
        ]}]"#;
        let report = SanityReport::parse(json).unwrap();
        assert!(report.failures.is_empty());
        assert_eq!(report.count("pending"), 1);
    }

    #[test]
    fn a_failed_suite_set_up_is_counted_as_a_failure() {
        let json = br#"[{"SpecReports": [
            {"LeafNodeType": "BeforeSuite", "State": "failed", "LeafNodeText": "", "Failure": {"Message": "no endpoint"}}
        ]}]"#;
        let report = SanityReport::parse(json).unwrap();
        assert_eq!(report.count("failed"), 1);
        assert_eq!(report.count("passed"), 0);
    }
}
