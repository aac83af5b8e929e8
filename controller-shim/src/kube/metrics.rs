//! The phases of the custom resources as Prometheus gauges, read from the informer caches at
//! each scrape (a deleted resource leaves no stale series). The alerts in
//! `deploy/monitoring.yaml` fire on them.

use kube::runtime::reflector::Store;
use kube::ResourceExt;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use super::crd::{MindUstorStorageClass, MindUstorStorageConnection, Phase};

#[derive(Debug, Clone)]
pub struct Phases {
    pub connections: Store<MindUstorStorageConnection>,
    pub classes: Store<MindUstorStorageClass>,
}

fn failed(phase: Option<Phase>) -> i64 {
    i64::from(phase == Some(Phase::Failed))
}

impl Collector for Phases {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "connection_failed",
            "1 while the MindUstorStorageConnection is in phase Failed (see its REASON)",
            None,
            MetricType::Gauge,
        )?;
        for c in self.connections.state() {
            let phase = c.status.as_ref().and_then(|s| s.phase);
            let labels = [("name", c.name_any())];
            ConstGauge::new(failed(phase)).encode(family.encode_family(&labels)?)?;
        }
        let mut family = encoder.encode_descriptor(
            "storage_class_failed",
            "1 while the MindUstorStorageClass is in phase Failed (see its REASON)",
            None,
            MetricType::Gauge,
        )?;
        for c in self.classes.state() {
            let phase = c.status.as_ref().and_then(|s| s.phase);
            let labels = [("name", c.name_any())];
            ConstGauge::new(failed(phase)).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
