//! Leader election among controller replicas (a Lease in the driver's namespace, through
//! kube-lease-manager): only the leader writes to the Kubernetes API and runs the periodic
//! uStor login checks, so two replicas never both reconcile. Every replica keeps its
//! connection sessions current, because the CSI calls go to whichever replica's sidecars
//! lead, which need not be the glue's leader; such a replica logs in when a call needs it,
//! and when uStor refuses it, writes that into the connection's status itself (no replica
//! tries those credentials again).

use std::time::Duration;

use kube::Client;
use kube_lease_manager::LeaseManagerBuilder;
use tokio::sync::watch;

/// The Lease's name.
pub const LEASE: &str = "ustor-csi-controller";
/// How long a leader that stopped renewing keeps the lease.
const LEASE_SECONDS: u64 = 15;

/// Whether this replica may write now.
#[derive(Debug, Clone)]
pub struct Leadership(watch::Receiver<bool>);

impl Leadership {
    /// A replica that leads without an election (a single replica, tests).
    pub fn always() -> Self {
        let (sender, receiver) = watch::channel(true);
        // The receiver keeps the value after the sender is gone.
        drop(sender);
        Self(receiver)
    }

    pub fn is_leader(&self) -> bool {
        *self.0.borrow()
    }

    /// Takes part in the election as `identity`; the task runs until aborted, and makes the
    /// replica a follower whenever it cannot tell.
    pub fn elect(
        client: Client,
        namespace: &str,
        identity: &str,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let (sender, receiver) = watch::channel(false);
        let (namespace, identity) = (namespace.to_owned(), identity.to_owned());
        let task = tokio::spawn(async move {
            loop {
                let manager = LeaseManagerBuilder::new(client.clone(), LEASE)
                    .with_namespace(namespace.clone())
                    .with_identity(identity.clone())
                    .with_duration(LEASE_SECONDS)
                    .build()
                    .await;
                match manager {
                    Ok(manager) => {
                        let (mut state, running) = manager.watch().await;
                        loop {
                            let leading = *state.borrow_and_update();
                            if *sender.borrow() != leading {
                                tracing::info!(%identity, leading, "leadership changed");
                                sender.send_replace(leading);
                            }
                            if state.changed().await.is_err() {
                                break;
                            }
                        }
                        running.abort();
                    }
                    Err(e) => tracing::warn!(error = %e, "leader election: no Lease; retrying"),
                }
                sender.send_replace(false);
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        });
        (Self(receiver), task)
    }
}
