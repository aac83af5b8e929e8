//! Fencing: the export's server refused this node's grant (NBD_REP_ERR_POLICY to the
//! handshake), so the volume was unpublished from this node, most likely by force while the
//! node was cut off, and may be attached and written elsewhere now. Whatever this node still
//! holds for it (dirty pages, queued requests) must never reach the export.
//!
//! Refused is not an outage: the healer stops for good instead of redialing, the device is
//! disconnected so that queued and new I/O fails at once (rather than waiting out the
//! dead-connection timeout), and the record says so, journaled first, so a restart neither
//! heals nor attaches it again. NodeUnpublish and NodeUnstage clean up what is left.

use std::time::{SystemTime, UNIX_EPOCH};

use nbd::handshake::HandshakeError;

use crate::error::NodeError;
use crate::node::{Link, Node};
use crate::record::Fenced;

/// The server's refusal, if `e` is a refused grant (and not an outage or another fault).
pub fn refusal(e: &NodeError) -> Option<&str> {
    match e {
        NodeError::Nbd(nbd::Error::Handshake {
            source: HandshakeError::PolicyRefused { message, .. },
            ..
        }) => Some(message),
        _ => None,
    }
}

impl Node {
    /// Fences `volume`: journals it, stops its I/O, reports it. Called by the healer when a
    /// re-dial was refused; safe to repeat.
    pub(crate) async fn fence(&self, volume: &str, refusal: &str) {
        let Some(record) = self.record(volume) else {
            return;
        };
        let at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let fenced = Fenced {
            at,
            refusal: refusal.to_owned(),
        };
        // Journaled before anything else: a crash from here on must not heal it again.
        if let Err(e) = self.set_fenced(volume, &record.identifier, fenced) {
            tracing::error!(%volume, error = %e, "could not journal the fence; its next redial (now, or after a restart) is refused and fences it again");
        }
        self.metrics.fenced.inc();
        self.set_link(
            volume,
            Link::Fenced {
                refusal: refusal.to_owned(),
            },
        );
        tracing::error!(%volume, device = ?record.device, %refusal, "the export refused this node's grant: the volume was unpublished from this node (and may be in use elsewhere); fenced: its I/O fails from now on, NodeUnstage cleans up");
        match self.proven_device(&record) {
            Ok(Some(device)) => match self.disconnect_only(volume, &device).await {
                Ok(_) => {
                    tracing::info!(%volume, device = %device.index(), "fenced device disconnected")
                }
                Err(e) => {
                    tracing::error!(%volume, device = %device.index(), error = %e, "could not disconnect the fenced device; its I/O fails at the dead-connection timeout")
                }
            },
            Ok(None) => {}
            Err(e) => {
                tracing::error!(%volume, error = %e, "cannot prove the fenced volume's device")
            }
        }
    }
}
