//! New keys for the store benches, made before the loop that is timed: an engine hands the tier
//! keys it has already hashed, so making them is not part of a store's cost (the touch and load
//! benches take theirs from a pre-drawn sequence for the same reason). Shared by
//! `benches/cpu_tier.rs`, `benches/scaling.rs` and the `op_cpu_time` example; vLLM's side
//! (`pybench.py`) makes its store keys ahead of each timed round too.

use tiering_core::OffloadKey;

/// Keys of a store batch.
pub const BATCH: usize = 16;

/// A source of keys never offered before, from a counter.
pub struct FreshKeys {
    next: u64,
}

impl FreshKeys {
    /// Keys from `start` on; `start` must lie above every key the tier was filled with.
    pub fn new(start: u64) -> Self {
        Self { next: start }
    }

    /// The next batch of new keys.
    pub fn batch(&mut self) -> [OffloadKey; BATCH] {
        std::array::from_fn(|_| self.key())
    }

    /// The next `count` batches, made now for a timed loop that only reads them (keep `count`
    /// small: a long array of keys streams through the cache the tier's data lives in).
    #[allow(
        dead_code,
        reason = "used by the op_cpu_time example, not by the criterion benches"
    )]
    pub fn batches(&mut self, count: usize) -> Vec<[OffloadKey; BATCH]> {
        (0..count).map(|_| self.batch()).collect()
    }

    /// The next new key.
    fn key(&mut self) -> OffloadKey {
        let key = OffloadKey::from_u64(self.next);
        self.next += 1;
        key
    }
}
