//! Prometheus metrics of the controller, served on `--metrics-address` (off by default):
//! CSI calls by method and gRPC code with their latency, and, in Kubernetes, the phases of
//! the custom resources.

use std::sync::Arc;

use csi_common::metrics::CallMetrics;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Debug)]
pub struct ControllerMetrics {
    registry: Registry,
    pub calls: CallMetrics,
    pub backend: Arc<BackendMetrics>,
    pub gate: Arc<GateMetrics>,
    pub foreign_ids: Arc<ForeignIdMetrics>,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("ustor_csi_controller");
        let calls = CallMetrics::register(&mut registry);
        let backend = Arc::new(BackendMetrics::default());
        registry.register(
            "backend_requests",
            "uStor management API requests by connection, method and outcome (the gRPC code)",
            backend.requests.clone(),
        );
        let gate = Arc::new(GateMetrics::default());
        registry.register(
            "grant_refusals",
            "NBD handshakes the local export server's gate refused for want of a live grant, by reason",
            gate.refusals.clone(),
        );
        let foreign_ids = Arc::new(ForeignIdMetrics::default());
        registry.register(
            "foreign_id_deletes",
            "Deletes of an id this driver did not issue, by call: answered OK with nothing deleted \
             (an old product's volume, or a mistake), so the image it names may be leaked",
            foreign_ids.deletes.clone(),
        );
        Self {
            registry,
            calls,
            backend,
            gate,
            foreign_ids,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub connection: String,
    pub method: String,
    pub outcome: String,
}

/// Requests to the storage's management API.
#[derive(Debug, Default)]
pub struct BackendMetrics {
    requests: Family<BackendLabels, Counter>,
}

impl BackendMetrics {
    pub fn count(&self, connection: &str, method: &str, outcome: String) {
        self.requests
            .get_or_create(&BackendLabels {
                connection: connection.to_owned(),
                method: method.to_owned(),
                outcome,
            })
            .inc();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub reason: &'static str,
}

/// Handshakes of the local export server refused for want of a live grant.
#[derive(Debug, Default)]
pub struct GateMetrics {
    refusals: Family<RefusalLabels, Counter>,
}

impl GateMetrics {
    pub fn refused(&self, reason: &'static str) {
        self.refusals.get_or_create(&RefusalLabels { reason }).inc();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub op: &'static str,
}

/// Deletes answered OK because the id is not one this driver issued.
#[derive(Debug, Default)]
pub struct ForeignIdMetrics {
    deletes: Family<OpLabels, Counter>,
}

impl ForeignIdMetrics {
    pub fn deleted(&self, op: &'static str) {
        self.deletes.get_or_create(&OpLabels { op }).inc();
    }
}

/// The login state of each management API client, at scrape time.
pub struct LoginStates(pub Box<dyn Fn() -> Vec<(String, &'static str)> + Send + Sync>);

impl std::fmt::Debug for LoginStates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoginStates")
    }
}

impl prometheus_client::collector::Collector for LoginStates {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        let mut family = encoder.encode_descriptor(
            "login_state",
            "1 for the state of each connection's last uStor login (LoggedIn, NotTried, or uStor's refusal)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (connection, state) in (self.0)() {
            let labels = [("connection", connection), ("state", state.to_owned())];
            prometheus_client::metrics::gauge::ConstGauge::new(1i64)
                .encode(family.encode_family(&labels)?)?;
        }
        Ok(())
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
        csi_common::metrics::render(&self.registry)
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
        m.gate.refused("no_grant");
        let text = m.render();
        assert!(
            text.contains(r#"ustor_csi_controller_grant_refusals_total{reason="no_grant"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"ustor_csi_controller_request_duration_seconds_count{method="CreateVolume"} 2"#
            ),
            "{text}"
        );
    }
}
