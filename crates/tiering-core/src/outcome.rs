//! Small value types returned by tiers and managers: lookup verdicts, offload policies, store
//! reservations, and the step-end context.

use crate::key::OffloadKey;
use crate::request::RequestId;

pub use tiering_arena::ChunkId;

/// The verdict of a lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LookupResult {
    /// Present and readable in the primary tier; the engine may `prepare_load` it this step.
    Hit,
    /// Known to exist but not readable yet (a write or a promotion is in flight). The engine
    /// counts it toward the prefix and defers the request.
    HitPending,
    /// Not known yet (an asynchronous answer is pending); ask again next step.
    Retry,
    /// Absent or unobtainable.
    Miss,
}

impl LookupResult {
    /// Whether the verdict counts toward a prefix hit (`Hit` or `HitPending`).
    #[must_use]
    pub fn is_hit(self) -> bool {
        matches!(self, Self::Hit | Self::HitPending)
    }
}

/// What a tier wants offloaded for a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OffloadPolicy {
    /// Only newly computed chunks are offered to `prepare_store`.
    #[default]
    ChunkLevel,
    /// Every chunk of the request, prefix hits included, is offered; chunks already present are
    /// cascaded to the tiers that asked for this.
    RequestLevel,
}

/// The result of a successful `prepare_store` (or `prepare_write`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrepareStoreOutput {
    /// The keys that really need writing (keys already present are filtered out), in offer order.
    pub keys_to_store: Vec<OffloadKey>,
    /// The destination arena rows, parallel to `keys_to_store`.
    pub chunk_ids: Vec<ChunkId>,
    /// Keys evicted to make room.
    pub evicted: Vec<OffloadKey>,
}

/// What the engine tells the manager at the end of a scheduler step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScheduleEndContext {
    /// Requests scheduled for the first time this step.
    pub new_requests: Vec<RequestId>,
    /// Requests preempted this step.
    pub preempted_requests: Vec<RequestId>,
}
