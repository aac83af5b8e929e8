//! A test Kubernetes control plane (etcd and kube-apiserver, see `testkit::kube_cluster`) for
//! the guests of `tests/vm/run`, which reach it through QEMU's forwarding of one guest address
//! to it. Writes `<dir>/kubeconfig` (this machine's view) and `<dir>/guest-kubeconfig` (the
//! same user, the API server named by the guest's address), prints `ready` and its port, and
//! runs until its standard input closes. `tests/vm/run` holds that pipe open, so the control
//! plane stops with the harness however the harness ends (a kill -9 included).
//!
//! With `--node`, kube-controller-manager and kube-scheduler run too, for a guest whose kubelet
//! joins as a real node (volume binding, attach/detach, scheduling).
//!
//! With `--kubelet-at <host:port>` as well, the API server reaches the node's kubelet (exec,
//! logs, port-forward: what the e2e suite uses) at that loopback forward of the guest's port
//! 10250, through an egress proxy (`testkit::egress`) on `<dir>/egress.sock`.
//!
//! Usage: kube-control-plane <dir> <guest-server-url> [--node [--kubelet-at <host:port>]]

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;

use testkit::kube_cluster::KubeCluster;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let (Some(dir), Some(guest_server)) = (args.next(), args.next()) else {
        eprintln!("usage: kube-control-plane <dir> <guest-server-url> [--node]");
        std::process::exit(2);
    };
    let rest: Vec<String> = args.map(|a| a.to_string_lossy().into_owned()).collect();
    let (node, kubelet_at) = match rest.as_slice() {
        [] => (false, None),
        [flag] if flag == "--node" => (true, None),
        [flag, at_flag, at] if flag == "--node" && at_flag == "--kubelet-at" => {
            let at: SocketAddr = at.parse().unwrap_or_else(|_| {
                eprintln!("--kubelet-at {at:?} is not host:port");
                std::process::exit(2);
            });
            (true, Some(at))
        }
        _ => {
            eprintln!("usage: kube-control-plane <dir> <guest-server-url> [--node [--kubelet-at <host:port>]]");
            std::process::exit(2);
        }
    };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir)?;
    let guest_server = guest_server.to_string_lossy().into_owned();
    let egress = dir.join("egress.sock");
    if let Some(kubelet) = kubelet_at {
        testkit::egress::spawn(&egress, kubelet)?;
    }
    let mut cluster = KubeCluster::start_with_egress(kubelet_at.map(|_| egress.as_path()))?;
    if node {
        cluster.start_controller_manager()?;
        cluster.start_scheduler()?;
    }
    std::fs::copy(&cluster.kubeconfig, dir.join("kubeconfig"))?;
    std::fs::write(
        dir.join("guest-kubeconfig"),
        cluster.kubeconfig_via(&guest_server)?,
    )?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "ready {}", cluster.port())?;
    stdout.flush()?;
    // Until the harness closes the pipe; the cluster's Drop then stops its processes.
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(cluster);
    Ok(())
}
