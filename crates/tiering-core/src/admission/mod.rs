//! Admission policies: which chunks a secondary tier accepts from cascades, and backpressure,
//! which drops cascades to a tier whose stores have become slow (`docs/ARCHITECTURE.md`,
//! "Admission and backpressure").
//!
//! A cascade copies a chunk that landed in the primary to a secondary tier. Each secondary tier
//! of a chain has one [`AdmissionPolicy`] in front of it. The manager tells every policy about
//! accesses ([`Access::Offered`]: the engine offered the chunk for storing, vLLM's
//! `store_threshold` count; [`Access::Reused`]: a request loaded it from the primary) and asks
//! [`AdmissionPolicy::admit`] when it would cascade a chunk. A refused chunk is remembered by the
//! manager; when a later access makes the policy admit it while it is still ready in the
//! primary, it is cascaded then, from the primary's copy. Promotions (loads) never pass through
//! admission or backpressure.
//!
//! Policies are registered by name like tiers ([`register_admission!`](crate::register_admission),
//! on `inventory`) and built per tier from the chain's `admission` key. Built in: `always`,
//! `store_threshold` (vLLM 0.33.0's frequency gate), `after_first_reuse`, `tinylfu`.

mod after_first_reuse;
mod always;
pub mod backpressure;
mod lru;
mod registry;
mod sketch;
mod store_threshold;
mod tinylfu;

pub use backpressure::{BackpressureConfig, BackpressureDetector, Clock, ManualClock};
pub use lru::LruMap;
pub use registry::parse as parse_options;
pub use registry::{
    AdmissionConfig, AdmissionError, AdmissionFactory, AdmissionRegistration, registered_policies,
};
pub use sketch::FrequencySketch;

use crate::key::OffloadKey;

/// What happened to a chunk, as an admission policy is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The engine offered the chunk for storing (`prepare_store`), whether or not the primary
    /// already held it.
    Offered,
    /// A request loaded the chunk from the primary (`prepare_load`): the chunk was reused.
    Reused,
}

/// What a policy is built for.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct AdmissionContext {
    /// The tier's name (for logs).
    pub tier: String,
    /// The tier's capacity in chunks, when it reports one.
    pub capacity_chunks: Option<u64>,
}

impl AdmissionContext {
    /// A context for the tier `tier` holding `capacity_chunks` chunks (when known).
    #[must_use]
    pub fn new(tier: impl Into<String>, capacity_chunks: Option<u64>) -> Self {
        Self {
            tier: tier.into(),
            capacity_chunks: capacity_chunks.filter(|&c| c > 0),
        }
    }
}

/// Decides which chunks one secondary tier accepts from cascades. Called under the manager's
/// lock, so every method must be cheap and must not block.
pub trait AdmissionPolicy: Send {
    /// The chunks `keys` were accessed (one call per engine call, keys in the call's order).
    fn on_access(&mut self, keys: &[OffloadKey], access: Access);

    /// Whether `key` may be cascaded to the tier now. Asked when the chunk lands in the primary,
    /// and again after each later access while the manager remembers the refusal.
    fn admit(&mut self, key: &OffloadKey) -> bool;

    /// The admitted `keys` were submitted to the tier (backpressure may still have dropped
    /// others the policy admitted).
    fn on_cascaded(&mut self, keys: &[OffloadKey]) {
        let _ = keys;
    }
}
