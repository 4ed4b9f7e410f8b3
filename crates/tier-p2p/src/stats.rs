//! Counters of the p2p tier, shared with [`P2pHandle`](crate::P2pHandle) so tests and the
//! binary can watch a tier the manager owns.

use std::sync::atomic::{AtomicU64, Ordering};

/// Tier-level counters.
#[derive(Default, Debug)]
pub struct P2pCounters {
    /// Consumer lookups answered `Hit`.
    pub hits: AtomicU64,
    /// Consumer lookups answered `Miss`.
    pub misses: AtomicU64,
    /// Consumer requests that gave up on a lookup past its deadline.
    pub lookup_timeouts: AtomicU64,
    /// Handshakes refused (version, chunk size, fingerprint or hash seed).
    pub handshake_failures: AtomicU64,
    /// Sessions torn down for a protocol violation.
    pub protocol_errors: AtomicU64,
    /// Sessions that died (any cause).
    pub sessions_lost: AtomicU64,
    /// Sessions whose handshake completed.
    pub sessions_ready: AtomicU64,
    /// Lookups served for peers.
    pub lookups_served: AtomicU64,
    /// Keys a peer's lookup found (and pinned).
    pub keys_offered: AtomicU64,
    /// Consumer loads completed (any outcome).
    pub loads_finished: AtomicU64,
    /// Consumer keys loaded and verified.
    pub keys_loaded: AtomicU64,
    /// Consumer keys that failed to load.
    pub keys_failed: AtomicU64,
    /// Fetches aborted by the consumer.
    pub aborts_sent: AtomicU64,
    /// Producer-side pins released without a fetch (deadline, terminal fetch, session loss).
    pub supply_released: AtomicU64,
    /// Hand-off fetches that arrived before some of their chunks were stored, and waited.
    pub fetches_waited: AtomicU64,
    /// Chunks a store handed straight to a fetch waiting for them (from `submit_store`).
    pub keys_handed_off: AtomicU64,
    /// Keys a waiting fetch never got: not stored by the producer's load deadline.
    pub wait_timeouts: AtomicU64,
    /// Peers disconnected for exceeding their inbound message budget.
    pub peers_flooded: AtomicU64,
}

impl P2pCounters {
    pub(crate) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads one counter.
    #[must_use]
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}
