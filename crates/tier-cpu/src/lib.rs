//! # tier-cpu
//!
//! The CPU primary tier of kvtier: [`CpuTier`] implements [`tiering_core::PrimaryTier`] over a
//! [`tiering_core::arena::ChunkArena`] it owns. Every chunk the engine offloads lands here first; lookups,
//! pins and unpins are O(1): one probe of a compact key index whose 8-byte slots name a row, the
//! key confirmed on that row, which also holds the ref count. Batch operations touch each key's
//! index slot and row once per call, and nothing is allocated per key: policy links, ranks and
//! ghost lists live in flat arrays indexed by row or ghost slot. ARC's ghost lists share the
//! resident keys' index (a key is resident or a ghost, so it has one index slot): evicting a key
//! into a ghost list and storing a ghost again rename its slot in place, and a store's one probe
//! per key also says whether the key is a ghost. Completions (`complete_load`,
//! a successful `complete_store`) find their rows through the request's own record of the rows
//! its load pinned or its store reserved, checked against the row's key, and probe the index only
//! when the record has no such row.
//!
//! ## Semantics
//! The tier reproduces the released vLLM 0.33.0 `CPUOffloadingManager`:
//! - ref counts: −1 write in flight (`lookup` → `HitPending`, not evictable), 0 ready and
//!   evictable, n > 0 pinned by n readers (a key loaded twice is pinned twice);
//! - `prepare_store` skips resident keys (ready or in flight), never evicts a key of its own
//!   offer, fails fast with `None` and no change when too few chunks are evictable, and queues
//!   the removal event at prepare time, so removals always precede the stores that reuse the
//!   space;
//! - rows never used before are handed out first in ascending order, then freed rows
//!   last-in-first-out (evicted rows are freed in eviction order);
//! - `complete_store(true)` readies the listed in-flight keys (one store event, call order);
//!   `complete_store(false)` frees them and queues a metadata-only removal event, from which
//!   [`PrimaryTier::take_events`](tiering_core::PrimaryTier::take_events) drops keys that are
//!   resident again; absent and already-ready keys are ignored either way;
//! - request-scoped recency: each [`tiering_core::ReqContext`] carries a record of the keys the
//!   request observed (store offers that were new or ready, and loads; not cascade reads through
//!   `prepare_read`), and the policy commits it in prefix order when the request finishes;
//!   positions come from [`tiering_core::ReqContext::key_position`]. A finished request keeps
//!   its LRU rank while its context lives: storing again, with a position, a key it observed
//!   before ranks that key with the request, among the oldest (the rank's placeholder is freed
//!   with the context, so nothing accumulates for requests the engine has let go of).
//!
//! - `reset` forgets every chunk whatever its ref count, emits no event and keeps the events
//!   already queued; request records from before the reset are ignored afterwards.
//!
//! Eviction policies ([`policy`]): `lru` and `arc` reproduce 0.33.0 exactly; `s3fifo` is a
//! scan-resistant alternative. `tests/data/vllm033/` holds transcripts recorded from the released
//! 0.33.0 manager (every lookup, store output, chunk id, eviction, event and internal list order)
//! that the tests replay op for op.
//!
//! ## Deliberate deviations from vLLM 0.33.0
//! 1. **A key repeated within one `prepare_store` is stored once.** Upstream allocates a chunk per
//!    occurrence and leaks all but the last for good (and ARC adapts its target once per
//!    occurrence; here once).
//! 2. **Contract violations return a [`tiering_core::TierError`] and change nothing.** Upstream
//!    asserts in the middle of a batch (`prepare_load` of an absent or in-flight key,
//!    `complete_load` of an unpinned key), leaving the earlier keys of the batch pinned or
//!    unpinned. Here every key is checked before anything is mutated. Likewise a key first
//!    observed by a request after it finished is not recorded (upstream asserts).
//!
//! ## Construction
//! [`CpuTier::from_options`] takes a [`CpuTierOptions`] table (capacity as a size or a chunk
//! count, eviction policy, optional shared-memory file, events — on by default, unlike
//! upstream's constructor —, pre-faulting, huge pages) and
//! rejects a zero capacity, a capacity beyond the machine's memory, and unknown policy names with
//! a [`CpuTierError`]. The crate registers the tier type `cpu` with
//! [`tiering_core::register_tier!`]; a binary that builds chains from files names the crate
//! (`use tier_cpu as _;`) so the linker keeps the registration.

mod access;
mod ghost_lists;
mod index;
mod memory;
mod ops;
mod options;
pub mod policy;
mod registration;
mod ring;
mod slots;
mod tier;

pub use options::{Capacity, CpuTierError, CpuTierOptions, memory_limit_bytes};
pub use policy::{EvictionPolicy, PolicyKind, PolicySnapshot, UnknownPolicy};
pub use tier::CpuTier;
