//! Why a peer could not serve this node, as a consumer sees it: typed, so an operator (and the
//! `kvtier` binary's exit code) can tell an unreachable peer from a refused handshake, a
//! producer that died mid-transfer or a deadline, instead of a bare miss.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

/// A consumer-side failure toward one peer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PeerFailure {
    /// The peer's name does not resolve, or nothing answered on its control or data address
    /// before the handshake deadline (a refused port and a black-holed one end the same way).
    #[error("peer {peer} is unreachable: {reason}")]
    Unreachable {
        /// The peer (`host:port`).
        peer: String,
        /// What failed.
        reason: String,
    },
    /// The handshake was refused (by either side), with the reason: version, chunk size,
    /// layout fingerprint, hash seed, or authentication.
    #[error("handshake with peer {peer} refused: {reason}")]
    HandshakeRefused {
        /// The peer (`host:port`).
        peer: String,
        /// Why, as the refusing side said it.
        reason: String,
    },
    /// The session died while this node was using it (the producer exited or the connection
    /// broke mid-transfer).
    #[error("peer {peer} went away: {reason}")]
    ProducerDied {
        /// The peer (`host:port`).
        peer: String,
        /// What was seen.
        reason: String,
    },
    /// The peer was up but did not answer in time.
    #[error("peer {peer} missed the {what} deadline")]
    Deadline {
        /// The peer (`host:port`).
        peer: String,
        /// `lookup` or `load`.
        what: &'static str,
    },
}

/// The reason a node gives its peers when it shuts down (its goodbye message).
pub(crate) const SHUTTING_DOWN: &str = "shutting down";

impl PeerFailure {
    /// Whether the peer announced its own orderly shutdown (peers come and go: not a fault of
    /// either side, though its sessions are gone all the same).
    #[must_use]
    pub fn is_shutdown_goodbye(&self) -> bool {
        matches!(self, Self::ProducerDied { reason, .. }
            if reason.strip_prefix("peer disconnected: ") == Some(SHUTTING_DOWN))
    }

    /// The peer it concerns.
    #[must_use]
    pub fn peer(&self) -> &str {
        match self {
            Self::Unreachable { peer, .. }
            | Self::HandshakeRefused { peer, .. }
            | Self::ProducerDied { peer, .. }
            | Self::Deadline { peer, .. } => peer,
        }
    }
}

#[derive(Default)]
struct Failures {
    by_peer: HashMap<String, PeerFailure>,
    last: Option<PeerFailure>,
}

/// The latest failure per peer (shared with [`P2pHandle`](crate::P2pHandle)).
#[derive(Clone, Default)]
pub(crate) struct FailureLog(Arc<Mutex<Failures>>);

impl FailureLog {
    pub(crate) fn record(&self, f: PeerFailure) {
        if f.is_shutdown_goodbye() {
            tracing::info!(error = %f, "p2p peer shut down");
        } else {
            tracing::warn!(error = %f, "p2p peer failure");
        }
        let mut g = self.0.lock();
        g.by_peer.insert(f.peer().to_owned(), f.clone());
        g.last = Some(f);
    }

    pub(crate) fn get(&self, peer: &str) -> Option<PeerFailure> {
        self.0.lock().by_peer.get(peer).cloned()
    }

    pub(crate) fn last(&self) -> Option<PeerFailure> {
        self.0.lock().last.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_peers_announced_shutdown_is_a_goodbye() {
        let died = |reason: &str| PeerFailure::ProducerDied {
            peer: "10.0.0.1:7100".into(),
            reason: reason.into(),
        };
        assert!(died(&format!("peer disconnected: {SHUTTING_DOWN}")).is_shutdown_goodbye());
        assert!(!died("peer disconnected: authentication failed").is_shutdown_goodbye());
        assert!(!died("connection reset").is_shutdown_goodbye());
        let refused = PeerFailure::HandshakeRefused {
            peer: "10.0.0.1:7100".into(),
            reason: SHUTTING_DOWN.into(),
        };
        assert!(!refused.is_shutdown_goodbye());
    }
}
