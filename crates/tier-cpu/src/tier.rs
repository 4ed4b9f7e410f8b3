//! `CpuTier`: construction, state and diagnostics. The `PrimaryTier` operations are in
//! [`crate::ops`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tiering_core::{
    Locality, Medium, OffloadKey, OffloadingEvent, TierInfo, TierStats,
    arena::{ArenaOptions, ChunkArena, ChunkId},
};

use crate::options::{CpuTierError, CpuTierOptions, memory_limit_bytes};
use crate::policy::{EvictionPolicy, KeyRef, PolicyKind, PolicySnapshot};
use crate::slots::ChunkTable;

static NEXT_TIER_ID: AtomicU64 = AtomicU64::new(1);

/// Cumulative counters (see [`TierStats`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counters {
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) stores: u64,
    pub(crate) loads: u64,
    pub(crate) reads: u64,
    pub(crate) evictions: u64,
    pub(crate) failures: u64,
    pub(crate) alloc_batches: u64,
    pub(crate) alloc_chunks: u64,
}

/// The CPU primary tier: ref-counted chunk slots over a [`ChunkArena`], an eviction policy,
/// events and stats. See the crate docs for the semantics and the deviations from vLLM 0.33.0.
pub struct CpuTier {
    /// Identifies this instance in request scratch state.
    pub(crate) id: u64,
    /// Bumped by `reset`, so request records from before a reset are discarded.
    pub(crate) generation: u64,
    pub(crate) arena: Arc<ChunkArena>,
    pub(crate) table: ChunkTable,
    pub(crate) policy: Box<dyn EvictionPolicy>,
    /// Bitmap of rows protected from the eviction in progress.
    pub(crate) protect: Vec<u64>,
    pub(crate) events: Option<Vec<OffloadingEvent>>,
    pub(crate) counters: Counters,
    // Reused buffers of the hot paths.
    pub(crate) buf_keys: Vec<OffloadKey>,
    /// Digests of the batch being probed (see `ChunkTable::digest_batch`).
    pub(crate) buf_digests: Vec<u64>,
    /// The probe outcomes of the keys a `prepare_store` is storing, in `keys_to_store` order.
    pub(crate) buf_store: Vec<crate::slots::NewKey>,
    pub(crate) buf_new: Vec<usize>,
    pub(crate) buf_entries: Vec<u32>,
    pub(crate) buf_rows: Vec<ChunkId>,
    /// Indices (into the observed keys) of a store offer's misses new to its request.
    pub(crate) buf_misses: Vec<usize>,
    /// Ghost ids of the keys a batch observed or touched.
    pub(crate) buf_observed_ghosts: Vec<u32>,
    pub(crate) buf_positions: Vec<Option<u64>>,
    pub(crate) buf_refs: Vec<KeyRef>,
    /// The keys a store offer observes (see `CpuTier::partition_offer`).
    pub(crate) buf_offered: Vec<crate::access::OfferedKey>,
    /// The chunks a touched batch resolved to.
    pub(crate) buf_resolved: Vec<Option<ChunkId>>,
    pub(crate) buf_chunks: Vec<ChunkId>,
    /// Row hints of a batch being completed (see `RequestAccess::row_hints`).
    pub(crate) buf_hints: Vec<ChunkId>,
}

impl std::fmt::Debug for CpuTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuTier")
            .field("policy", &self.policy.kind())
            .field("capacity", &self.table.capacity())
            .field("resident", &self.table.len())
            .field("arena", &self.arena)
            .finish_non_exhaustive()
    }
}

impl CpuTier {
    /// A tier of `num_chunks` chunks of `chunk_bytes` bytes in an anonymous arena, with the
    /// given policy and events enabled.
    ///
    /// # Errors
    /// Zero chunks or chunk bytes, more memory than the machine has, or a failed mapping.
    pub fn new(num_chunks: usize, chunk_bytes: usize, policy: PolicyKind) -> Result<Self, CpuTierError> {
        let options = CpuTierOptions::new(crate::Capacity::Chunks(num_chunks as u64)).with_eviction(policy);
        Self::from_options(&options, chunk_bytes)
    }

    /// A tier built from its options table for chunks of `chunk_bytes` bytes.
    ///
    /// # Errors
    /// A capacity of zero chunks, a capacity larger than this machine's memory (or cgroup limit),
    /// a zero chunk size, or an arena the OS refuses (including a failed pre-fault).
    pub fn from_options(options: &CpuTierOptions, chunk_bytes: usize) -> Result<Self, CpuTierError> {
        if chunk_bytes == 0 {
            return Err(CpuTierError::ZeroChunkBytes);
        }
        let page = tiering_core::arena::page_size();
        let row_stride = chunk_bytes.div_ceil(page).saturating_mul(page);
        let chunks = options.capacity.chunks(row_stride);
        if chunks == 0 {
            return Err(CpuTierError::ZeroCapacity {
                capacity: options.capacity,
                row_stride,
            });
        }
        let bytes = u128::from(chunks) * row_stride as u128;
        let limit = memory_limit_bytes();
        let num_chunks = usize::try_from(chunks)
            .ok()
            .filter(|_| chunks <= crate::slots::MAX_ROWS);
        let (Some(num_chunks), true) = (num_chunks, bytes <= u128::from(limit)) else {
            return Err(CpuTierError::TooLarge {
                chunks,
                row_stride,
                bytes,
                limit,
            });
        };
        let arena = ChunkArena::with_options(&ArenaOptions {
            num_chunks,
            chunk_bytes,
            shared_memory: options.shared_memory.clone(),
            prefault: options.prefault,
            huge_pages: options.huge_pages,
        })?;
        tracing::info!(
            chunks = num_chunks,
            chunk_bytes,
            row_stride,
            policy = %options.eviction,
            shared = ?options.shared_memory,
            huge_pages = arena.uses_huge_pages(),
            "cpu tier created"
        );
        Ok(Self::with_arena(
            arena,
            options.eviction.build(num_chunks),
            options.events,
        ))
    }

    /// A tier over an existing arena with any policy (for custom policies and tests). The
    /// policy must have been built for `arena.num_chunks()` chunks.
    #[must_use]
    pub fn with_arena(arena: Arc<ChunkArena>, policy: Box<dyn EvictionPolicy>, events: bool) -> Self {
        // The arena guarantees the row count fits in u32; the table takes at most MAX_ROWS.
        let capacity =
            u32::try_from(arena.num_chunks().min(crate::slots::MAX_ROWS as usize)).unwrap_or(u32::MAX);
        // Each ghost list is trimmed to the policy's bound on its own.
        let max_ghosts = policy.ghost_bound().map_or(0, |b| {
            (b as u64).saturating_mul(crate::ghost_lists::GHOST_LISTS as u64)
        });
        Self {
            id: NEXT_TIER_ID.fetch_add(1, Ordering::Relaxed),
            generation: 0,
            table: ChunkTable::new(capacity, max_ghosts),
            protect: vec![0; (capacity as usize).div_ceil(64)],
            arena,
            policy,
            events: events.then(Vec::new),
            counters: Counters::default(),
            buf_keys: Vec::new(),
            buf_digests: Vec::new(),
            buf_store: Vec::new(),
            buf_new: Vec::new(),
            buf_entries: Vec::new(),
            buf_rows: Vec::new(),
            buf_misses: Vec::new(),
            buf_observed_ghosts: Vec::new(),
            buf_positions: Vec::new(),
            buf_refs: Vec::new(),
            buf_offered: Vec::new(),
            buf_resolved: Vec::new(),
            buf_chunks: Vec::new(),
            buf_hints: Vec::new(),
        }
    }

    /// The tier's description: `cpu`, medium CPU, local.
    #[must_use]
    pub fn tier_info() -> TierInfo {
        TierInfo::new("cpu", Some(Medium::Cpu), Some(Locality::Local))
    }

    /// The eviction policy in use.
    #[must_use]
    pub fn policy_kind(&self) -> PolicyKind {
        self.policy.kind()
    }

    /// Number of chunks the tier holds at most.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.table.capacity()
    }

    /// Number of resident chunks (ready or being written).
    #[must_use]
    pub fn resident(&self) -> usize {
        self.table.len()
    }

    /// Number of resident chunks that are ready and unpinned.
    #[must_use]
    pub fn num_evictable(&self) -> usize {
        self.table.num_evictable
    }

    /// The arena row of resident `key`.
    #[must_use]
    pub fn chunk_of(&self, key: &OffloadKey) -> Option<ChunkId> {
        self.table.get(key).map(|e| e.chunk)
    }

    /// The ref count of resident `key`: −1 write in flight, 0 ready, n > 0 pinned n times.
    #[must_use]
    pub fn ref_count(&self, key: &OffloadKey) -> Option<i32> {
        self.table.get(key).map(|e| e.ref_cnt)
    }

    /// Total reader pins over every resident chunk.
    #[must_use]
    pub fn total_pins(&self) -> u64 {
        self.table
            .entries()
            .map(|e| u64::try_from(e.ref_cnt).unwrap_or(0))
            .sum()
    }

    /// The policy's internal orders (for tests and diagnostics).
    #[must_use]
    pub fn policy_snapshot(&self) -> PolicySnapshot {
        self.policy.snapshot(self.table.view())
    }

    /// Checks the table's invariants (rows owned once, counters, ref counts).
    ///
    /// # Errors
    /// The first violation, described.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.table.check()
    }

    pub(crate) fn stats_snapshot(&self) -> TierStats {
        let c = &self.counters;
        let cap = self.table.capacity();
        let chunk_bytes = self.arena.chunk_bytes() as u64;
        let mut s = TierStats::named(Self::tier_info().name);
        s.hits = c.hits;
        s.misses = c.misses;
        s.stores = c.stores;
        s.loads = c.loads;
        s.evictions = c.evictions;
        s.failures = c.failures;
        s.bytes_written = c.stores * chunk_bytes;
        s.bytes_read = (c.loads + c.reads) * chunk_bytes;
        s.resident_chunks = self.table.len() as u64;
        s.capacity_chunks = cap as u64;
        let ratio = |n: usize| if cap == 0 { 0.0 } else { n as f64 / cap as f64 };
        let usage = ratio(self.table.num_pinned());
        let write_usage = ratio(self.table.num_write_pending);
        let mut extra: Vec<(&'static str, f64)> = vec![
            ("usage_perc", usage),
            ("write_usage_perc", write_usage),
            ("read_usage_perc", (usage - write_usage).max(0.0)),
            ("evictable_chunks", self.table.num_evictable as f64),
            ("write_pending_chunks", self.table.num_write_pending as f64),
            ("cascade_reads", c.reads as f64),
            ("allocation_batches", c.alloc_batches as f64),
            ("allocation_chunks", c.alloc_chunks as f64),
        ];
        self.policy.extra_stats(self.table.view(), &mut extra);
        s.extra = extra.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        s
    }
}
