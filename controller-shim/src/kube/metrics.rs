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

/// One gauge family: 1 for each resource in phase Failed, 0 for the others.
fn encode_failed(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    resources: impl Iterator<Item = (String, Option<Phase>)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (resource, phase) in resources {
        let labels = [("name", resource)];
        ConstGauge::new(i64::from(phase == Some(Phase::Failed)))
            .encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl Collector for Phases {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        encode_failed(
            &mut encoder,
            "connection_failed",
            "1 while the MindUstorStorageConnection is in phase Failed (see its REASON)",
            self.connections
                .state()
                .into_iter()
                .map(|c| (c.name_any(), c.status.as_ref().and_then(|s| s.phase))),
        )?;
        encode_failed(
            &mut encoder,
            "storage_class_failed",
            "1 while the MindUstorStorageClass is in phase Failed (see its REASON)",
            self.classes
                .state()
                .into_iter()
                .map(|c| (c.name_any(), c.status.as_ref().and_then(|s| s.phase))),
        )
    }
}
