//! The optional health monitor (deploy/components/health-monitor) against a real
//! kube-apiserver and kube-controller-manager (Kubernetes 1.20): external-health-monitor-controller
//! v0.14.0, built from ../shared/third-party/ (tests/kube/build-health-monitor), asks the
//! controller (local backend, its export server running) for volume conditions and records the
//! abnormal one as an event on its claim, and nothing on the healthy one's.
//! Ignored in a plain `cargo test`; `tests/kube/run` runs it.

#![allow(clippy::unwrap_used)] // a test fails by panicking

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use controller_shim::backend::local::LocalBackend;
use csi_proto::csi::volume_capability::access_mode::Mode;
use k8s_openapi::api::core::v1::{Event, PersistentVolumeClaim};
use kube::api::{Api, ListParams};
use testkit::csi::*;
use testkit::kube_cluster::KubeCluster;

use common::*;

/// The monitor process, killed with the test.
struct Monitor(Child);

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A PersistentVolume of `volume_id` bound to claim `default/<name>`, as external-provisioner
/// makes them, and the claim.
fn bound_claim(cluster: &KubeCluster, name: &str, volume_id: &str) {
    apply(
        cluster,
        &format!(
            "apiVersion: v1\nkind: PersistentVolume\nmetadata:\n  name: pv-{name}\nspec:\n\
             \x20 capacity: {{storage: 1Mi}}\n  accessModes: [ReadWriteOnce]\n\
             \x20 persistentVolumeReclaimPolicy: Retain\n  storageClassName: \"\"\n\
             \x20 claimRef: {{namespace: default, name: {name}}}\n\
             \x20 csi: {{driver: {}, volumeHandle: \"{volume_id}\"}}\n---\n\
             apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {name}\n  namespace: default\n\
             spec:\n  accessModes: [ReadWriteOnce]\n  storageClassName: \"\"\n  volumeName: pv-{name}\n\
             \x20 resources: {{requests: {{storage: 1Mi}}}}\n",
            csi_common::DRIVER_NAME,
        ),
    );
}

/// The reasons and messages of the events on claim `default/<name>`.
async fn claim_events(events: &Api<Event>, name: &str) -> Vec<(String, String)> {
    let selector = format!("involvedObject.kind=PersistentVolumeClaim,involvedObject.name={name}");
    events
        .list(&ListParams::default().fields(&selector))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kube: needs the test API server and the health monitor (tests/kube/run)"]
async fn the_health_monitor_puts_an_abnormal_volume_on_its_claim() {
    let binary = std::env::var("USTOR_HEALTH_MONITOR")
        .expect("USTOR_HEALTH_MONITOR: the monitor's binary (tests/kube/build-health-monitor)");
    let mut cluster = KubeCluster::start().unwrap();
    cluster.start_controller_manager().unwrap();
    let client = client(&cluster).await;

    let dir = tempfile::tempdir().unwrap();
    let listen: std::net::SocketAddr = ([127, 0, 0, 1], testkit::free_port().unwrap()).into();
    let backend = LocalBackend::open(&dir.path().join("store"), &listen.to_string()).unwrap();
    let exports = common::start_exports(&backend, listen);
    let (mut csi, server) =
        serve_controller(dir.path(), Arc::new(backend), "test", None, None).await;
    let cap = mount_capability("ext4", Mode::SingleNodeWriter);
    let mut ids = Vec::new();
    for name in ["healthy", "lost"] {
        let request = create_volume_request(&format!("pvc-{name}"), 1 << 20, cap.clone());
        ids.push(created_volume(&mut csi, request).await.volume_id);
    }
    // The lost volume's data is gone from the storage.
    let image = ids[1].rsplit(':').next().unwrap();
    std::fs::remove_file(dir.path().join("store/images").join(image)).unwrap();
    bound_claim(&cluster, "healthy", &ids[0]);
    bound_claim(&cluster, "lost", &ids[1]);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), "default");
    for name in ["healthy", "lost"] {
        eventually(
            &format!("claim {name} bound"),
            Duration::from_secs(60),
            || {
                let claims = claims.clone();
                async move {
                    let phase = claims.get(name).await.ok()?.status?.phase?;
                    (phase == "Bound").then_some(())
                }
            },
        )
        .await;
    }

    let _monitor = Monitor(
        Command::new(&binary)
            .arg(format!(
                "--csi-address=unix://{}",
                dir.path().join("csi.sock").display()
            ))
            .arg(format!("--kubeconfig={}", cluster.kubeconfig.display()))
            .args([
                "--list-volumes-interval=2s",
                "--monitor-interval=2s",
                "--timeout=10s",
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("monitor.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let events: Api<Event> = Api::namespaced(client, "default");
    let (_, message) = eventually("the lost volume's event", Duration::from_secs(60), || {
        let events = events.clone();
        async move {
            claim_events(&events, "lost")
                .await
                .into_iter()
                .find(|(reason, _)| reason == "VolumeConditionAbnormal")
        }
    })
    .await;
    assert!(message.contains("missing"), "{message}");
    // Several rounds later, the healthy volume has no such event.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let healthy = claim_events(&events, "healthy").await;
    assert!(
        healthy
            .iter()
            .all(|(reason, _)| reason != "VolumeConditionAbnormal"),
        "{healthy:?}; the monitor's log: {}",
        std::fs::read_to_string(dir.path().join("monitor.log")).unwrap_or_default()
    );
    exports.abort();
    server.abort();
}
