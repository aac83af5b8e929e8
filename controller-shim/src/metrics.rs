//! Prometheus metrics of the controller, served on `--metrics-address` (off by default):
//! CSI calls by method and gRPC code with their latency, and, in Kubernetes, the phases of
//! the custom resources.

use csi_proto::metrics::CallMetrics;
use prometheus_client::registry::Registry;

#[derive(Debug)]
pub struct ControllerMetrics {
    registry: Registry,
    pub calls: CallMetrics,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("ustor_csi_controller");
        let calls = CallMetrics::register(&mut registry);
        Self { registry, calls }
    }
}

impl ControllerMetrics {
    /// Adds figures gathered at each scrape (the glue's resource phases).
    pub fn with_collector(
        mut self,
        collector: impl prometheus_client::collector::Collector,
    ) -> Self {
        self.registry.register_collector(Box::new(collector));
        self
    }

    pub fn render(&self) -> String {
        csi_proto::metrics::render(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_counted_by_method_and_code() {
        let m = ControllerMetrics::default();
        m.calls.observe("CreateVolume", tonic::Code::Ok, 0.3);
        m.calls.observe("CreateVolume", tonic::Code::Ok, 0.1);
        m.calls.observe("DeleteVolume", tonic::Code::NotFound, 0.01);
        let text = m.render();
        assert!(
            text.contains(
                r#"ustor_csi_controller_requests_total{method="CreateVolume",code="Ok"} 2"#
            ),
            "{text}"
        );
        assert!(text.contains(r#"code="NotFound"} 1"#), "{text}");
        assert!(
            text.contains(
                r#"ustor_csi_controller_request_duration_seconds_count{method="CreateVolume"} 2"#
            ),
            "{text}"
        );
    }
}
