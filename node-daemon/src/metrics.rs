//! Prometheus metrics, served as text on `--metrics-address` (`/metrics`).
//!
//! Labels carry the CSI method and outcome, never a volume id: per-volume series would grow
//! without bound on a busy node, and `ustor-csi-node status` answers per-volume questions.

use std::net::SocketAddr;
use std::sync::Arc;

use csi_common::metrics::{CallMetrics, Labels};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    calls: CallMetrics,
    /// Volumes with a journal record on this node.
    pub volumes: Gauge,
    /// Volumes whose link is down right now.
    pub links_down: Gauge,
    /// LINK_DEAD events for this node's devices.
    pub link_dead: Counter,
    heals: Family<Labels, Counter>,
    splice_refusals: Family<Labels, Counter>,
    /// What the last start-up could not reconcile.
    pub unreconciled: Gauge,
    /// Devices whose I/O scheduler someone changed and the daemon set back to `none`.
    pub scheduler_reset: Counter,
    /// Volumes fenced: the export refused this node's grant.
    pub fenced: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("ustor_csi_node");
        let calls = CallMetrics::register(&mut registry);
        let volumes = Gauge::default();
        let links_down = Gauge::default();
        let link_dead = Counter::default();
        let heals = Family::<Labels, Counter>::default();
        let splice_refusals = Family::<Labels, Counter>::default();
        let unreconciled = Gauge::default();
        let scheduler_reset = Counter::default();
        let fenced = Counter::default();
        registry.register(
            "fenced_volumes",
            "Volumes fenced because the export refused this node's grant (unpublished from this node)",
            fenced.clone(),
        );
        registry.register(
            "volumes",
            "Volumes staged or being staged on this node",
            volumes.clone(),
        );
        registry.register(
            "links_down",
            "Volumes whose connection to the export is down now",
            links_down.clone(),
        );
        registry.register(
            "link_dead_events",
            "LINK_DEAD events for this node's devices",
            link_dead.clone(),
        );
        registry.register("link_heals", "Reconnect attempts by result", heals.clone());
        registry.register(
            "splice_refusals",
            "Re-dialed exports not spliced under a device, by how they differed from it",
            splice_refusals.clone(),
        );
        registry.register(
            "recovery_unreconciled",
            "Problems the last start-up could not reconcile",
            unreconciled.clone(),
        );
        registry.register(
            "scheduler_resets",
            "Devices whose I/O scheduler was changed and set back to none",
            scheduler_reset.clone(),
        );
        Self {
            registry,
            calls,
            volumes,
            links_down,
            link_dead,
            heals,
            splice_refusals,
            unreconciled,
            scheduler_reset,
            fenced,
        }
    }
}

impl Metrics {
    pub fn observe_call(&self, method: &'static str, code: tonic::Code, seconds: f64) {
        self.calls.observe(method, code, seconds);
    }

    pub fn heal_attempt(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.heals
            .get_or_create(&vec![("result", result.to_owned())])
            .inc();
    }

    pub fn splice_refused(&self, difference: &'static str) {
        self.splice_refusals
            .get_or_create(&vec![("difference", difference.to_owned())])
            .inc();
    }

    pub fn render(&self) -> String {
        csi_common::metrics::render(&self.registry)
    }
}

/// Serves `/metrics` until the process ends; an error (binding `addr`, or serving) is the
/// caller's to log: the endpoint is optional, the daemon keeps running without it.
pub async fn serve(metrics: Arc<Metrics>, addr: SocketAddr) -> std::io::Result<()> {
    tracing::info!(%addr, "serving metrics");
    let listener = tokio::net::TcpListener::bind(addr).await?;
    csi_common::metrics::serve(move || metrics.render(), listener).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_what_was_observed() {
        let m = Metrics::default();
        m.observe_call("NodeStageVolume", tonic::Code::Ok, 0.2);
        m.observe_call("NodeStageVolume", tonic::Code::InvalidArgument, 0.001);
        m.volumes.set(3);
        m.heal_attempt(true);
        let text = m.render();
        assert!(
            text.contains(r#"ustor_csi_node_requests_total{method="NodeStageVolume",code="Ok"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"code="InvalidArgument"} 1"#), "{text}");
        assert!(text.contains("ustor_csi_node_volumes 3"), "{text}");
        assert!(
            text.contains(r#"ustor_csi_node_link_heals_total{result="ok"} 1"#),
            "{text}"
        );
        assert!(
            text.contains("ustor_csi_node_request_duration_seconds_bucket"),
            "{text}"
        );
    }
}
