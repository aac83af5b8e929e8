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
//! Usage: kube-control-plane <dir> <guest-server-url> [--node]

use std::io::{Read, Write};
use std::path::PathBuf;

use testkit::kube_cluster::KubeCluster;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let (Some(dir), Some(guest_server)) = (args.next(), args.next()) else {
        eprintln!("usage: kube-control-plane <dir> <guest-server-url> [--node]");
        std::process::exit(2);
    };
    let node = args.next().is_some_and(|a| a == "--node");
    let dir = PathBuf::from(dir);
    let guest_server = guest_server.to_string_lossy().into_owned();
    let mut cluster = KubeCluster::start()?;
    if node {
        cluster.start_controller_manager()?;
        cluster.start_scheduler()?;
    }
    std::fs::create_dir_all(&dir)?;
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
