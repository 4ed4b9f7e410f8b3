//! The data plane's counters, shared by the sender and receiver threads and read into the
//! tier's stats.

use std::sync::atomic::AtomicU64;

/// Data-plane counters.
#[derive(Default, Debug)]
pub(crate) struct DataCounters {
    pub(crate) chunks_sent: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) chunks_received: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) chunks_rejected: AtomicU64,
    pub(crate) checksum_failures: AtomicU64,
    /// Data connections cut because a frame did not authenticate.
    pub(crate) auth_failures: AtomicU64,
}
