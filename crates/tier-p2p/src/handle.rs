//! [`P2pHandle`]: a cheap, thread-safe view of a p2p tier's identity and counters that stays
//! usable after the tier was moved into a manager.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::Mutex;
use tiering_core::TierStats;

use crate::dataplane::{DataCounters, Faults};
use crate::stats::P2pCounters;
use crate::transport::TransportCounters;

/// A view of one p2p tier.
#[derive(Clone)]
pub struct P2pHandle {
    pub(crate) local_id: String,
    pub(crate) data_addr: String,
    pub(crate) counters: Arc<P2pCounters>,
    pub(crate) transport: Arc<TransportCounters>,
    pub(crate) data: Arc<DataCounters>,
    pub(crate) faults: Arc<Faults>,
    pub(crate) last_error: Arc<Mutex<Option<String>>>,
    pub(crate) failures: crate::failure::FailureLog,
}

impl P2pHandle {
    /// The node's identity (`host:port` of its control socket).
    #[must_use]
    pub fn local_id(&self) -> &str {
        &self.local_id
    }

    /// The host part of the identity.
    #[must_use]
    pub fn host(&self) -> &str {
        self.local_id.rsplit_once(':').map_or("", |(h, _)| h)
    }

    /// The control port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.local_id
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or(0)
    }

    /// The data-plane listener (`host:port`).
    #[must_use]
    pub fn data_addr(&self) -> &str {
        &self.data_addr
    }

    /// Tier-level counters.
    #[must_use]
    pub fn counters(&self) -> &P2pCounters {
        &self.counters
    }

    /// Control frames dropped as malformed (wrong frame count, undecodable payload).
    #[must_use]
    pub fn malformed_frames(&self) -> u64 {
        self.transport.malformed_frames.load(Ordering::Relaxed)
    }

    /// Control messages dropped because their peer was over its inbound budget or banned.
    #[must_use]
    pub fn inbound_dropped(&self) -> u64 {
        self.transport.dropped_flood.load(Ordering::Relaxed)
    }

    /// Control messages the tier's I/O thread read and queued because the tier had not read
    /// them itself within a millisecond (its manager lock was held); the others were read by
    /// the thread that handled them.
    #[must_use]
    pub fn inbound_relayed(&self) -> u64 {
        self.transport.relayed.load(Ordering::Relaxed)
    }

    /// Chunks written and verified into this node's rows.
    #[must_use]
    pub fn chunks_received(&self) -> u64 {
        self.data.chunks_received.load(Ordering::Relaxed)
    }

    /// Chunks pushed to consumers.
    #[must_use]
    pub fn chunks_sent(&self) -> u64 {
        self.data.chunks_sent.load(Ordering::Relaxed)
    }

    /// Chunks refused because their row was not reserved for them.
    #[must_use]
    pub fn chunks_rejected(&self) -> u64 {
        self.data.chunks_rejected.load(Ordering::Relaxed)
    }

    /// Chunks whose payload MAC did not match (written, not trusted).
    #[must_use]
    pub fn checksum_failures(&self) -> u64 {
        self.data.checksum_failures.load(Ordering::Relaxed)
    }

    /// Data connections cut because a frame did not authenticate (no or another secret, a
    /// replay from another session, a forged tag).
    #[must_use]
    pub fn auth_failures(&self) -> u64 {
        self.data.auth_failures.load(Ordering::Relaxed)
    }

    /// The last handshake or protocol error, for diagnostics.
    #[must_use]
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().clone()
    }

    /// Why `peer` (canonical `ip:port`, see [`canonical_peer`](crate::canonical_peer)) last
    /// failed this node as a consumer, if it did.
    #[must_use]
    pub fn peer_failure(&self, peer: &str) -> Option<crate::PeerFailure> {
        self.failures.get(peer)
    }

    /// The most recent consumer-side peer failure.
    #[must_use]
    pub fn last_failure(&self) -> Option<crate::PeerFailure> {
        self.failures.last()
    }

    /// Fault injection (tests only).
    #[doc(hidden)]
    #[must_use]
    pub fn faults(&self) -> &Faults {
        &self.faults
    }
}

impl std::fmt::Debug for P2pHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2pHandle")
            .field("local_id", &self.local_id)
            .field("data_addr", &self.data_addr)
            .finish_non_exhaustive()
    }
}

#[expect(clippy::cast_precision_loss, reason = "counters reported as gauges")]
pub(crate) fn tier_stats(name: &str, h: &P2pHandle, sessions: usize, retiring: usize) -> TierStats {
    let c = &h.counters;
    let g = P2pCounters::get;
    let mut s = TierStats::named(name);
    s.hits = g(&c.hits);
    s.misses = g(&c.misses);
    s.loads = g(&c.keys_loaded);
    s.failures = g(&c.keys_failed);
    s.bytes_read = h.data.bytes_received.load(Ordering::Relaxed);
    s.bytes_written = h.data.bytes_sent.load(Ordering::Relaxed);
    let mut put = |k: &str, v: u64| {
        s.extra.insert(k.to_owned(), v as f64);
    };
    put("sessions", sessions as u64);
    put("sessions_retiring", retiring as u64);
    put("sessions_ready", g(&c.sessions_ready));
    put("sessions_lost", g(&c.sessions_lost));
    put("handshake_failures", g(&c.handshake_failures));
    put("protocol_errors", g(&c.protocol_errors));
    put("lookup_timeouts", g(&c.lookup_timeouts));
    put("lookups_served", g(&c.lookups_served));
    put("keys_offered", g(&c.keys_offered));
    put("aborts_sent", g(&c.aborts_sent));
    put("supply_released", g(&c.supply_released));
    put("fetches_waited", g(&c.fetches_waited));
    put("keys_handed_off", g(&c.keys_handed_off));
    put("wait_timeouts", g(&c.wait_timeouts));
    put("peers_flooded", g(&c.peers_flooded));
    put(
        "messages_dropped_flood",
        h.transport.dropped_flood.load(Ordering::Relaxed),
    );
    put("malformed_frames", h.malformed_frames());
    put("chunks_sent", h.chunks_sent());
    put("chunks_received", h.chunks_received());
    put("chunks_rejected", h.chunks_rejected());
    put("checksum_failures", h.checksum_failures());
    put("auth_failures", h.auth_failures());
    s
}
