//! A real Kubernetes node: kubelet 1.20 and containerd in a Debian root booted with systemd,
//! joined to the control plane `tests/vm/run` starts on the host (API server, controller
//! manager, scheduler). Our node service is installed from its `.deb` and registers itself
//! with kubelet's plugin watcher; the controller (local backend) and the sidecars `deploy/`
//! ships (provisioner, attacher, resizer) run beside it as host processes with the
//! Deployment's flags. Pods, scheduled and started by kubelet, use claims of a StorageClass of
//! ours. Ignored on the host; `tests/vm/run` boots that root on each kernel line.
//!
//! What only a real kubelet exercises: the plugin registration, the staging and publish paths
//! it chooses, fsGroup, its restart with pods running (reconstruction), and a pod's own I/O.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test fails by panicking

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testkit::command::{ok, run};
use testkit::controller::ControllerProcess;
use testkit::kernel_io_errors;
use testkit::kube_cluster::Kubectl;

const KUBECONFIG: &str = "/vm/kube/kubeconfig";
const NODE: &str = "vm-node";
const DRIVER: &str = "ustor-nbd.csi.mindsw.io";
const UNIT: &str = "ustor-csi-node.service";
const BUSYBOX: &str = "docker.io/library/busybox:1.35";
const PAUSE: &str = "registry.k8s.io/pause:3.4.1";
const CLASS: &str = "ustor-local";
const FS_GROUP: u32 = 2345;
const LOGS: &str = "/var/log/vm-kubelet";
/// The host's API server, as QEMU forwards it to this guest (`tests/vm/run`).
const API_SERVER: &str = "10.0.2.100:6443";

fn kube() -> Kubectl {
    Kubectl {
        binary: "kubectl".into(),
        kubeconfig: KUBECONFIG.into(),
    }
}

fn kubectl(args: &[&str]) -> String {
    kube()
        .ok(args, None)
        .unwrap_or_else(|e| panic!("kubectl {args:?}: {e}\n{}", diagnostics()))
}

fn apply(yaml: &str) {
    kube()
        .ok(&["apply", "-f", "-"], Some(yaml))
        .unwrap_or_else(|e| panic!("kubectl apply: {e}\n{yaml}\n{}", diagnostics()));
}

/// A field of an object by JSONPath, or "" when the object or field is not there.
fn field(kind: &str, name: &str, path: &str) -> String {
    kube()
        .ok(
            &["get", kind, name, "-o", &format!("jsonpath={{{path}}}")],
            None,
        )
        .unwrap_or_default()
}

/// What a failure's report needs: the events, the objects, and the last lines of every
/// component's log (the console shows only the kernel).
fn diagnostics() -> String {
    let mut text = String::new();
    for args in [
        &[
            "get",
            "nodes,csinodes,pv,pvc,pods,volumeattachments",
            "-o",
            "wide",
        ][..],
        &["get", "events", "--sort-by=.lastTimestamp"][..],
    ] {
        let out = kube().run(args).map(|o| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        });
        text.push_str(&format!(
            "--- kubectl {args:?}\n{}\n",
            out.unwrap_or_default()
        ));
    }
    for unit in ["kubelet", "containerd", UNIT] {
        let (_, log) = run(
            "journalctl",
            &["-u", unit, "--no-pager", "-o", "short-monotonic"],
        );
        // klog's warnings, errors and fatal lines: the reason a start failed is rarely last.
        text.push_str(&format!(
            "--- journal of {unit}, its problems\n{}\n",
            problem_lines(&log).join("\n")
        ));
        let (_, log) = run(
            "journalctl",
            &[
                "-u",
                unit,
                "--no-pager",
                "-n",
                "40",
                "-o",
                "short-monotonic",
            ],
        );
        text.push_str(&format!("--- journal of {unit}, its end\n{log}\n"));
    }
    if let Ok(entries) = std::fs::read_dir(LOGS) {
        for entry in entries.flatten() {
            let log = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            text.push_str(&format!(
                "--- {}\n{}\n",
                entry.path().display(),
                lines[lines.len().saturating_sub(30)..].join("\n")
            ));
        }
    }
    text
}

/// The last 40 warning, error and fatal lines of a journal in klog's format (`E1204 …`) or
/// logrus's (`level=error`).
fn problem_lines(log: &str) -> Vec<&str> {
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.split_once("]: ")
                .is_some_and(|(_, m)| m.starts_with(['W', 'E', 'F']) || m.contains("level=error"))
        })
        .collect();
    lines[lines.len().saturating_sub(40)..].to_vec()
}

/// Polls until `probe` answers; on time-out fails with the cluster's diagnostics.
fn wait_for<T>(what: &str, patience: Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    let started = Instant::now();
    loop {
        if let Some(v) = probe() {
            eprintln!("{what}: after {:.1} s", started.elapsed().as_secs_f64());
            return v;
        }
        if started.elapsed() > patience {
            panic!("{what}: not within {patience:?}\n{}", diagnostics());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

// --- the node: containerd, kubelet, our package ------------------------------------------

/// containerd with the CRI plugin, systemd cgroups (as kubelet), the sandbox image imported
/// here, and a bridge network for pods (CNI plugins from Debian).
fn start_containerd() {
    std::fs::create_dir_all("/etc/containerd").unwrap();
    std::fs::write(
        "/etc/containerd/config.toml",
        format!(
            "version = 2\n\
             [plugins.\"io.containerd.grpc.v1.cri\"]\n\
             \x20 sandbox_image = \"{PAUSE}\"\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n\
             \x20 runtime_type = \"io.containerd.runc.v2\"\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n\
             \x20 SystemdCgroup = true\n\
             [plugins.\"io.containerd.grpc.v1.cri\".cni]\n\
             \x20 bin_dir = \"/usr/lib/cni\"\n\
             \x20 conf_dir = \"/etc/cni/net.d\"\n"
        ),
    )
    .unwrap();
    std::fs::create_dir_all("/etc/cni/net.d").unwrap();
    std::fs::write(
        "/etc/cni/net.d/10-pods.conflist",
        r#"{"cniVersion": "0.4.0", "name": "pods", "plugins": [{"type": "bridge", "bridge": "cni0",
  "isGateway": true, "ipMasq": false,
  "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/24"}]]}}]}
"#,
    )
    .unwrap();
    ok("systemctl", &["restart", "containerd"]);
    wait_for("containerd answers", Duration::from_secs(60), || {
        (run("ctr", &["version"]).0 == 0).then_some(())
    });
    for archive in ["pause", "busybox"] {
        ok(
            "ctr",
            &[
                "-n",
                "k8s.io",
                "images",
                "import",
                &format!("/vm/images/{archive}.oci.tar"),
            ],
        );
    }
    let images = ok("ctr", &["-n", "k8s.io", "images", "ls", "-q"]);
    for image in [PAUSE, BUSYBOX] {
        assert!(
            images.lines().any(|l| l == image),
            "{image} not imported: {images}"
        );
    }
}

/// kubelet as a systemd service (so that a test can restart it), with a configuration for a
/// small test node: no image garbage collection (the images cannot be pulled again), eviction
/// only when nearly full, volume stats every few seconds, the read-only port for the summary.
fn start_kubelet() {
    std::fs::create_dir_all("/var/lib/kubelet").unwrap();
    std::fs::write(
        "/var/lib/kubelet/config.yaml",
        "apiVersion: kubelet.config.k8s.io/v1beta1\n\
         kind: KubeletConfiguration\n\
         cgroupDriver: systemd\n\
         failSwapOn: false\n\
         authentication:\n  anonymous:\n    enabled: true\n  webhook:\n    enabled: false\n\
         authorization:\n  mode: AlwaysAllow\n\
         readOnlyPort: 10255\n\
         imageGCHighThresholdPercent: 100\n\
         imageGCLowThresholdPercent: 99\n\
         evictionHard:\n  memory.available: 20Mi\n  nodefs.available: 1%\n  imagefs.available: 1%\n\
         \x20 nodefs.inodesFree: 1%\n\
         volumeStatsAggPeriod: 5s\n\
         runtimeRequestTimeout: 10m\n\
         resolvConf: /etc/resolv.conf\n",
    )
    .unwrap();
    if !Path::new("/etc/resolv.conf").exists() {
        std::fs::write("/etc/resolv.conf", "").unwrap();
    }
    std::fs::write(
        "/etc/systemd/system/kubelet.service",
        format!(
            "[Unit]\nDescription=kubelet (vm_kubelet)\nAfter=containerd.service\n\
             [Service]\nExecStart=/vm/bin/kubelet --config=/var/lib/kubelet/config.yaml \
             --kubeconfig={KUBECONFIG} --container-runtime=remote \
             --container-runtime-endpoint=unix:///run/containerd/containerd.sock \
             --hostname-override={NODE} --node-ip=10.0.2.15 --v=2\n\
             Restart=always\nRestartSec=2\n"
        ),
    )
    .unwrap();
    ok("systemctl", &["daemon-reload"]);
    ok("systemctl", &["start", "kubelet"]);
}

fn node_ready() -> bool {
    field(
        "node",
        NODE,
        ".status.conditions[?(@.type==\"Ready\")].status",
    ) == "True"
}

/// The package installed and started as an operator does; the daemon's debug lines in the
/// journal for a failure's report.
fn install_node_service() {
    ok("dpkg", &["-i", "/vm/ustor-csi-node.deb"]);
    std::fs::write(
        "/etc/default/ustor-csi-node",
        "RUST_LOG=info,node_daemon=debug,nbd=debug\n",
    )
    .unwrap();
    ok("systemctl", &["start", UNIT]);
}

// --- the controller side: our controller and the sidecars, with deploy/'s flags ----------

/// The sidecars as host processes, each with its log in `LOGS`; killed when dropped.
struct Sidecars(Vec<Child>);

impl Sidecars {
    fn start(socket: &Path) -> Self {
        std::fs::create_dir_all(LOGS).unwrap();
        let csi = format!("--csi-address={}", socket.display());
        let kubeconfig = format!("--kubeconfig={KUBECONFIG}");
        // deploy/base/controller.yaml's arguments; the HTTP endpoints on loopback.
        let sidecars: [(&str, &[&str]); 3] = [
            (
                "csi-provisioner",
                &[
                    "--leader-election",
                    "--http-endpoint=127.0.0.1:8080",
                    "--feature-gates=Topology=true",
                    "--default-fstype=ext4",
                    "--timeout=300s",
                    "--extra-create-metadata",
                ],
            ),
            (
                "csi-attacher",
                &[
                    "--leader-election",
                    "--http-endpoint=127.0.0.1:8081",
                    "--timeout=60s",
                ],
            ),
            (
                "csi-resizer",
                &["--leader-election", "--http-endpoint=127.0.0.1:8082"],
            ),
        ];
        let children = sidecars
            .iter()
            .map(|(name, args)| {
                let log =
                    std::fs::File::create(Path::new(LOGS).join(format!("{name}.log"))).unwrap();
                Command::new(name)
                    .arg(&csi)
                    .arg(&kubeconfig)
                    .args(*args)
                    .stdin(Stdio::null())
                    .stdout(log.try_clone().unwrap())
                    .stderr(log)
                    .spawn()
                    .unwrap_or_else(|e| panic!("{name}: {e}"))
            })
            .collect();
        Self(children)
    }
}

impl Drop for Sidecars {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// --- claims and pods -----------------------------------------------------------------------

fn claim_yaml(name: &str, bytes: &str) -> String {
    format!(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {name}\n  namespace: default\n\
         spec:\n  accessModes: [ReadWriteOnce]\n  storageClassName: {CLASS}\n\
         \x20 resources:\n    requests:\n      storage: {bytes}\n"
    )
}

/// A busybox pod running `script` with the claim at /data, fsGroup set, never restarted.
fn pod_yaml(name: &str, claim: &str, script: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\n\
         spec:\n  restartPolicy: Never\n  automountServiceAccountToken: false\n\
         \x20 terminationGracePeriodSeconds: 2\n  securityContext:\n    fsGroup: {FS_GROUP}\n\
         \x20 containers:\n  - name: main\n    image: {BUSYBOX}\n    command: [sh, -c, {script:?}]\n\
         \x20   volumeMounts:\n    - name: data\n      mountPath: /data\n\
         \x20 volumes:\n  - name: data\n    persistentVolumeClaim:\n      claimName: {claim}\n"
    )
}

fn pod_phase(name: &str) -> String {
    field("pod", name, ".status.phase")
}

fn wait_phase(name: &str, phase: &str, patience: Duration) {
    wait_for(&format!("pod {name} {phase}"), patience, || {
        let now = pod_phase(name);
        assert!(
            !(now == "Failed" && phase != "Failed"),
            "pod {name} failed\n{}",
            diagnostics()
        );
        (now == phase).then_some(())
    });
}

fn delete_pod(name: &str) {
    kubectl(&[
        "delete",
        "pod",
        name,
        "--wait=true",
        "--timeout=180s",
        "--ignore-not-found",
    ]);
}

/// Where kubelet publishes a pod's claim: `<root>/pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`.
fn published_path(pod: &str, claim: &str) -> PathBuf {
    let uid = field("pod", pod, ".metadata.uid");
    let pv = field("pvc", claim, ".spec.volumeName");
    assert!(
        !uid.is_empty() && !pv.is_empty(),
        "pod {pod} / claim {claim}"
    );
    PathBuf::from(format!(
        "/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~csi/{pv}/mount"
    ))
}

/// The source device of the mount at `path`, from this process's mount table.
fn mounted_device(path: &Path) -> Option<String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let wanted = path.to_str().unwrap();
    table.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        let sep = fields.iter().position(|f| *f == "-")?;
        (fields.get(4) == Some(&wanted)).then(|| fields[sep + 2].to_owned())
    })
}

/// The mount points of this node that belong to kubelet's CSI volumes or our devices.
fn our_mounts() -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains("kubernetes.io~csi") || l.contains("/dev/nbd") || l.contains(DRIVER))
        .map(str::to_owned)
        .collect()
}

/// kubelet's stats summary (read-only port): the capacity it reports for a pod's claim.
fn summary_capacity(pod: &str, claim: &str) -> Option<u64> {
    let mut stream = std::net::TcpStream::connect("127.0.0.1:10255").ok()?;
    stream
        .write_all(b"GET /stats/summary HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let body = response.split_once("\r\n\r\n")?.1;
    let summary: serde_json::Value = serde_json::from_str(body).ok()?;
    summary["pods"]
        .as_array()?
        .iter()
        .filter(|p| p["podRef"]["name"] == pod)
        .flat_map(|p| p["volume"].as_array().cloned().unwrap_or_default())
        .find(|v| v["pvcRef"]["name"] == claim)
        .and_then(|v| v["capacityBytes"].as_u64())
}

/// The writer pod's script: 8 MiB of random data with its digest, a marker once both are
/// synced, then a loop of fsynced writes that leaves a line in io-errors for any that fails.
const WRITER: &str = "dd if=/dev/urandom of=/data/blob bs=1M count=8 && sha256sum /data/blob >/data/blob.sha256 \
     && sync && touch /data/written && while true; do \
     dd if=/dev/zero of=/data/io bs=64k count=16 conv=fsync 2>/dev/null || echo failed >>/data/io-errors; \
     echo x >>/data/io-count; sleep 0.2; done";

/// The reader pod's script: the digest holds, and no write of the writer ever failed.
const READER: &str =
    "sha256sum -c /data/blob.sha256 && test ! -e /data/io-errors && test -s /data/io-count";

fn io_count(published: &Path) -> usize {
    std::fs::read_to_string(published.join("io-count"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// Waits until the writer's loop has gone `n` rounds further than it had.
fn wait_io_progress(published: &Path, n: usize, what: &str) {
    let from = io_count(published);
    wait_for(what, Duration::from_secs(120), || {
        (io_count(published) >= from + n).then_some(())
    });
    assert!(
        !published.join("io-errors").exists(),
        "the pod's writes failed: {}",
        std::fs::read_to_string(published.join("io-errors")).unwrap_or_default()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "vm: needs the booted real-node root of tests/vm/run"]
async fn pods_use_our_volumes_through_a_real_kubelet() {
    let started = Instant::now();
    install_node_service();
    start_containerd();
    // kubelet checks that its node address is this machine's: systemd-networkd sets it.
    wait_for(
        "the control plane reachable",
        Duration::from_secs(60),
        || {
            std::net::TcpStream::connect_timeout(
                &API_SERVER.parse().unwrap(),
                Duration::from_secs(2),
            )
            .ok()
        },
    );
    start_kubelet();
    wait_for("node Ready", Duration::from_secs(300), || {
        node_ready().then_some(())
    });
    // Our daemon registered itself through kubelet's plugin watcher: kubelet wrote the
    // CSINode entry and the node's id annotation from our NodeGetInfo.
    wait_for("CSINode lists our driver", Duration::from_secs(120), || {
        (field("csinode", NODE, ".spec.drivers[*].name") == DRIVER).then_some(())
    });
    assert_eq!(
        field("csinode", NODE, ".spec.drivers[0].nodeID"),
        NODE,
        "the node id kubelet registered"
    );
    eprintln!("node ready after {:.0} s", started.elapsed().as_secs_f64());

    let (controller, _ctrl) = ControllerProcess::start_with("kubelet", Some(Path::new(KUBECONFIG)))
        .await
        .unwrap();
    let _sidecars = Sidecars::start(&controller.socket);
    apply(include_str!("../../deploy/base/csidriver.yaml"));
    apply(&format!(
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: {CLASS}\n\
         provisioner: {DRIVER}\nreclaimPolicy: Delete\nallowVolumeExpansion: true\n\
         volumeBindingMode: WaitForFirstConsumer\nparameters:\n  csi.storage.k8s.io/fstype: ext4\n"
    ));

    // A claim bound when its first pod is scheduled, mounted in that pod, written by it.
    apply(&claim_yaml("claim-fs", "64Mi"));
    apply(&pod_yaml("writer", "claim-fs", WRITER));
    wait_phase("writer", "Running", Duration::from_secs(300));
    let published = published_path("writer", "claim-fs");
    wait_for("the pod's first data", Duration::from_secs(120), || {
        published.join("written").exists().then_some(())
    });
    let device = mounted_device(&published).expect("the pod's volume is not mounted");
    assert!(device.starts_with("/dev/nbd"), "mounted from {device}");
    // fsGroup: kubelet made the volume the group's, and a file the pod made is the group's.
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let root = std::fs::metadata(&published).unwrap();
    assert_eq!(root.gid(), FS_GROUP, "the volume's root group");
    assert!(
        root.permissions().mode() & 0o2000 != 0,
        "setgid on the root"
    );
    assert_eq!(
        std::fs::metadata(published.join("blob")).unwrap().gid(),
        FS_GROUP
    );
    let errors_before = kernel_io_errors();
    wait_io_progress(&published, 5, "the pod's writes");

    // kubelet restarted while the pod runs: nothing is unmounted, the writes go on, the stats
    // of the volume are still served.
    let kubelet_pid = ok(
        "systemctl",
        &["show", "-p", "MainPID", "--value", "kubelet"],
    );
    ok("systemctl", &["restart", "kubelet"]);
    wait_for("kubelet back", Duration::from_secs(120), || {
        let pid = ok(
            "systemctl",
            &["show", "-p", "MainPID", "--value", "kubelet"],
        );
        (pid != kubelet_pid
            && pid.trim() != "0"
            && summary_capacity("writer", "claim-fs").is_some())
        .then_some(())
    });
    assert_eq!(
        mounted_device(&published).as_deref(),
        Some(device.as_str()),
        "kubelet's restart changed the pod's mount"
    );
    let capacity = summary_capacity("writer", "claim-fs").unwrap();
    assert!(
        capacity > 50 << 20 && capacity <= 64 << 20,
        "kubelet reports {capacity} bytes for a 64 MiB claim"
    );
    assert_eq!(pod_phase("writer"), "Running");
    wait_io_progress(&published, 5, "the pod's writes after kubelet's restart");

    // Our service restarted under the pod's I/O: not one write fails.
    ok("systemctl", &["restart", UNIT]);
    wait_for("the node service back", Duration::from_secs(60), || {
        (run("systemctl", &["is-active", UNIT]).1.trim() == "active").then_some(())
    });
    wait_io_progress(
        &published,
        10,
        "the pod's writes after the service's restart",
    );
    assert_eq!(
        kernel_io_errors(),
        errors_before,
        "the kernel logged I/O errors"
    );

    // The pod deleted and another started on the claim: the data is there.
    delete_pod("writer");
    assert!(
        mounted_device(&published).is_none(),
        "the deleted pod's volume is still mounted"
    );
    apply(&pod_yaml("reader", "claim-fs", READER));
    wait_phase("reader", "Succeeded", Duration::from_secs(300));
    delete_pod("reader");

    // Deleting everything leaves nothing behind: no attachment, no mount, no device, no image.
    kubectl(&["delete", "pvc", "claim-fs", "--wait=true", "--timeout=180s"]);
    wait_for("no PersistentVolume left", Duration::from_secs(180), || {
        kubectl(&["get", "pv", "-o", "name"])
            .trim()
            .is_empty()
            .then_some(())
    });
    wait_for("no VolumeAttachment left", Duration::from_secs(180), || {
        kubectl(&["get", "volumeattachments", "-o", "name"])
            .trim()
            .is_empty()
            .then_some(())
    });
    assert_eq!(our_mounts(), Vec::<String>::new(), "mounts left behind");
    let (code, status) = run("ustor-csi-node", &["status", "--json"]);
    assert_eq!(code, 0, "status: {status}");
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert!(
        status["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["volume"].is_null()),
        "a device still serves a volume: {status}"
    );
    let images: Vec<_> = std::fs::read_dir(controller.store.join("images"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(images.is_empty(), "backend images left: {images:?}");
    eprintln!(
        "the real node's scenarios took {:.0} s",
        started.elapsed().as_secs_f64()
    );
}
