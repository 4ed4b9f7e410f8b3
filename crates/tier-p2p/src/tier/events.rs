//! What the tier's I/O threads report: control messages (dispatched to their session) and
//! data-plane events (registrations, finished transfers, lost connections).

use crate::dataplane::DataEvent;
use crate::session::SessionError;
use crate::stats::P2pCounters;
use crate::wire::Message;

use super::P2pTier;

impl P2pTier {
    pub(super) fn on_message(&mut self, peer: &str, msg: Message) {
        if let Err(e) = msg.validate() {
            tracing::warn!(%peer, error = %e, "malformed message; closing the session");
            if self.sessions.contains_key(peer) {
                P2pCounters::bump(&self.core.counters.protocol_errors);
                self.kill(peer, &e.to_string(), true);
            }
            return;
        }
        if let Message::Connect(c) = &msg {
            let restarted = self
                .sessions
                .get(peer)
                .and_then(|s| s.peer_connect.as_ref())
                .is_some_and(|old| old.instance != c.instance);
            if restarted {
                self.kill(peer, "the peer restarted", false);
            }
            if !self.sessions.contains_key(peer) && self.session(peer).is_none() {
                return;
            }
        }
        let Some(s) = self.sessions.get_mut(peer) else {
            tracing::debug!(%peer, kind = msg.kind(), "message from a peer without a session; dropped");
            return;
        };
        match s.dispatch(&mut self.core, msg) {
            Ok(()) => {}
            Err(SessionError::Protocol(m)) => {
                P2pCounters::bump(&self.core.counters.protocol_errors);
                self.core.record_error(m.clone());
                self.kill(peer, &m, true);
            }
            Err(SessionError::Handshake(m)) => {
                P2pCounters::bump(&self.core.counters.handshake_failures);
                tracing::error!(%peer, "p2p handshake refused: {m}");
                self.core.record_error(m.clone());
                let f = crate::PeerFailure::HandshakeRefused {
                    peer: peer.to_owned(),
                    reason: m,
                };
                self.fail(peer, f, true);
            }
            Err(SessionError::Closed(m)) => {
                // A goodbye before the session was ready is the peer refusing us (its reason
                // is in the message); after, the producer went away.
                let ready = self
                    .sessions
                    .get(peer)
                    .is_some_and(crate::session::Session::ready);
                let f = if ready {
                    crate::PeerFailure::ProducerDied {
                        peer: peer.to_owned(),
                        reason: format!("peer disconnected: {m}"),
                    }
                } else {
                    self.core.record_error(m.clone());
                    crate::PeerFailure::HandshakeRefused {
                        peer: peer.to_owned(),
                        reason: m,
                    }
                };
                self.fail(peer, f, false);
            }
        }
    }

    pub(super) fn on_data_event(&mut self, ev: DataEvent) {
        match ev {
            DataEvent::Registered {
                peer,
                generation,
                handle,
            } => match self.sessions.get_mut(&peer) {
                Some(s) if s.generation == generation && s.dead.is_none() => {
                    s.on_registered(&mut self.core, handle);
                }
                // A late registration must not revive a removed or replaced peer.
                _ => {
                    let _ = handle.close();
                }
            },
            DataEvent::RegistrationFailed {
                peer,
                generation,
                reason,
            } => {
                if self
                    .sessions
                    .get(&peer)
                    .is_some_and(|s| s.generation == generation)
                {
                    let f = crate::PeerFailure::Unreachable {
                        peer: peer.clone(),
                        reason: format!("data-plane registration failed: {reason}"),
                    };
                    self.fail(&peer, f, true);
                }
            }
            DataEvent::TransferFinished {
                peer,
                generation,
                transfer_id,
                statuses,
            } => {
                tracing::debug!(%peer, generation, transfer_id, ?statuses, "transfer finished");
                let live = self
                    .sessions
                    .get_mut(&peer)
                    .filter(|s| s.generation == generation);
                let target = match live {
                    Some(s) => Some(s),
                    None => self
                        .retiring
                        .iter_mut()
                        .find(|s| s.peer == peer && s.generation == generation),
                };
                match target {
                    Some(s) => s.on_transfer_finished(&mut self.core, transfer_id, &statuses),
                    None => tracing::error!(
                        %peer,
                        generation,
                        transfer_id,
                        "a transfer finished for a session that no longer exists; its pins leak"
                    ),
                }
            }
            DataEvent::SenderLost { peer, generation } => {
                if self
                    .sessions
                    .get(&peer)
                    .is_some_and(|s| s.generation == generation)
                {
                    self.kill(&peer, "data connection lost", false);
                }
            }
        }
    }
}
