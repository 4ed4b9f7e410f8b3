//! vLLM 0.33.0's ARC: resident lists T1 (seen once) and T2 (reused), ghost lists B1 and B2 of
//! keys evicted from each, and an adaptive target size for T1.
//!
//! Behaviour kept from upstream on purpose (it differs from textbook ARC):
//! - the target moves only on ghost hits seen by `touch` or by a request's first store miss of a
//!   key, by `max(1, |other ghost| / |this ghost|)` in real arithmetic, clamped to
//!   `[0, capacity]`;
//! - a victim comes from T1 when the simulated `|T1| ≥ ⌊target⌋`, else from T2, else (T2 has no
//!   candidate) from T1 after all; scans only move forward within one eviction;
//! - each ghost list is trimmed to `capacity` on its own after every eviction;
//! - touching a T1 chunk whose write is still in flight keeps it in T1 (at the MRU end).
//!
//! The ghost lists live in the tier's key index (see [`EvictionPolicy::ghost_bound`]): the
//! policy names the list each victim joins and adapts its target on ghost hits; keeping,
//! ordering, trimming and reviving the ghosts is the tier's.

use tiering_core::{OffloadKey, ReqContext, arena::ChunkId};

use super::list::{Links, List, NIL};
use super::{EvictionPolicy, FinishedKey, PolicyKind, PolicySnapshot, Protected, SlotView};

const B1: usize = 0;
const B2: usize = 1;

/// Tiers of at most this many rows skip requesting a touch's links ahead (128 KiB of links).
const LINKS_CACHED_ROWS: usize = 16_384;

/// vLLM 0.33.0's ARC (see the module docs).
pub struct ArcPolicy {
    capacity: usize,
    target: f64,
    links: Links,
    t1: List,
    t2: List,
    /// Bit per chunk: set when the chunk is in T2 (a bitmap stays cache resident where a byte
    /// per chunk would not).
    in_t2: Vec<u64>,
    /// The ghost list (B1 or B2) each victim of the last eviction joins.
    victim_lists: Vec<u8>,
}

impl ArcPolicy {
    /// A policy for `capacity` chunks.
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            target: 0.0,
            links: Links::with_nodes(capacity),
            t1: List::new(),
            t2: List::new(),
            in_t2: vec![0; capacity.div_ceil(64)],
            victim_lists: Vec::new(),
        }
    }

    /// The adaptive T1 target.
    #[must_use]
    pub fn target(&self) -> f64 {
        self.target
    }

    /// Adapts the target to a hit in ghost list `list`, given the lists' lengths.
    fn adapt_to_ghost_hit(&mut self, list: usize, [b1, b2]: [usize; 2]) {
        let (b1, b2) = (b1 as f64, b2 as f64);
        if list == B1 {
            self.target = (self.target + (b2 / b1).max(1.0)).min(self.capacity as f64);
        } else {
            self.target = (self.target - (b1 / b2).max(1.0)).max(0.0);
        }
    }

    #[inline]
    fn is_in_t2(&self, chunk: ChunkId) -> bool {
        self.in_t2[chunk as usize / 64] & (1 << (chunk % 64)) != 0
    }

    #[inline]
    fn set_in_t2(&mut self, chunk: ChunkId, on: bool) {
        let (word, bit) = (chunk as usize / 64, 1u64 << (chunk % 64));
        if on {
            self.in_t2[word] |= bit;
        } else {
            self.in_t2[word] &= !bit;
        }
    }

    fn move_to_t2_back(&mut self, chunk: ChunkId) {
        if self.is_in_t2(chunk) {
            self.t2.move_to_back(&mut self.links, chunk);
        } else {
            self.t1.remove(&mut self.links, chunk);
            self.t2.push_back(&mut self.links, chunk);
            self.set_in_t2(chunk, true);
        }
    }

    fn move_to_own_back(&mut self, chunk: ChunkId) {
        if self.is_in_t2(chunk) {
            self.t2.move_to_back(&mut self.links, chunk);
        } else {
            self.t1.move_to_back(&mut self.links, chunk);
        }
    }
}

/// Advances `cursor` to the next evictable, unprotected node and returns it; sets `skipped`
/// when it passes over a node that is not one.
#[inline]
fn next_candidate(
    links: &Links,
    cursor: &mut u32,
    slots: SlotView<'_>,
    protected: Protected<'_>,
    skipped: &mut bool,
) -> u32 {
    while *cursor != NIL {
        let n = *cursor;
        *cursor = links.next(n);
        if slots.is_evictable(n) && !protected.contains(n) {
            return n;
        }
        *skipped = true;
    }
    NIL
}

impl EvictionPolicy for ArcPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Arc
    }

    fn observes_evictability(&self) -> bool {
        false
    }

    fn uses_insert_position(&self) -> bool {
        false
    }

    fn observes_request_access(&self) -> bool {
        false
    }

    fn ghost_bound(&self) -> Option<usize> {
        Some(self.capacity)
    }

    fn on_ghost_hit(&mut self, list: usize, lengths: [usize; 2]) {
        self.adapt_to_ghost_hit(list, lengths);
    }

    fn victim_ghost_lists(&self) -> &[u8] {
        &self.victim_lists
    }

    fn insert(
        &mut self,
        chunk: ChunkId,
        _key: &OffloadKey,
        _position: Option<u64>,
        _slots: SlotView<'_>,
        _ctx: &ReqContext,
    ) {
        // A ghost of the key was revived by the tier.
        self.t1.push_back(&mut self.links, chunk);
        self.set_in_t2(chunk, false);
    }

    fn insert_batch(
        &mut self,
        chunks: &[ChunkId],
        _keys: &[OffloadKey],
        _positions: &[Option<u64>],
        _slots: SlotView<'_>,
        _ctx: &ReqContext,
    ) {
        for &chunk in chunks {
            self.t1.push_back(&mut self.links, chunk);
            self.set_in_t2(chunk, false);
        }
    }

    fn remove(&mut self, chunk: ChunkId, _slots: SlotView<'_>) {
        if self.is_in_t2(chunk) {
            self.t2.remove(&mut self.links, chunk);
        } else {
            self.t1.remove(&mut self.links, chunk);
        }
    }

    fn prefetch_touch(&self, chunks: &[ChunkId]) {
        if self.capacity > LINKS_CACHED_ROWS {
            for &chunk in chunks {
                self.links.prefetch_node(chunk);
            }
        }
    }

    fn touch(
        &mut self,
        _keys: &[OffloadKey],
        chunks: &[Option<ChunkId>],
        slots: SlotView<'_>,
        _ctx: &ReqContext,
    ) {
        // Links of a tier this small (8 bytes a row) stay cached between touches: requesting
        // them and their neighbours ahead would only cost its instructions. A larger tier
        // requested the chunks' own links with their rows (`prefetch_touch`, the table
        // prefetches at every size this one does): only their neighbours are left.
        if self.capacity > LINKS_CACHED_ROWS {
            self.links.prefetch_neighbours(chunks.iter().flatten().copied());
        }
        // Keys that are not resident may be ghosts: the tier reports those hits through
        // `on_ghost_hit`.
        for &chunk in chunks.iter().rev().flatten() {
            // One read of the chunk's T2 bit decides the move (`move_to_t2_back` would read it
            // again).
            let (word, bit) = (chunk as usize / 64, 1u64 << (chunk % 64));
            if self.in_t2[word] & bit != 0 {
                self.t2.move_to_back(&mut self.links, chunk);
            } else if slots.is_ready(chunk) {
                self.t1.remove(&mut self.links, chunk);
                self.t2.push_back(&mut self.links, chunk);
                self.in_t2[word] |= bit;
            } else {
                // A store that has not completed is not a second access.
                self.t1.move_to_back(&mut self.links, chunk);
            }
        }
    }

    fn on_request_finished(&mut self, keys: &[FinishedKey], _slots: SlotView<'_>, _ctx: &ReqContext) {
        for k in keys.iter().rev() {
            if k.insertion_only {
                // Inserting is not a reuse: keep the list, refresh recency only.
                self.move_to_own_back(k.chunk);
            } else if k.reused {
                self.move_to_t2_back(k.chunk);
            }
        }
    }

    fn evict(
        &mut self,
        n: usize,
        slots: SlotView<'_>,
        protected: Protected<'_>,
        out: &mut Vec<ChunkId>,
    ) -> bool {
        if n == 0 {
            return true;
        }
        self.victim_lists.clear();
        let start = out.len();
        // Truncation toward zero, as Python's int() of a non-negative float.
        let target = self.target as usize;
        let mut virtual_t1 = self.t1.len();
        let mut c1 = self.t1.front();
        let mut c2 = self.t2.front();
        // Whether a scan passed over a node it could not take: when not, the list's victims
        // are its first members and leave it in one step.
        let (mut skipped1, mut skipped2) = (false, false);
        let mut from_t1_count = 0;
        for _ in 0..n {
            let mut pick = NIL;
            let mut from_t1 = false;
            if virtual_t1 >= target {
                pick = next_candidate(&self.links, &mut c1, slots, protected, &mut skipped1);
                from_t1 = pick != NIL;
            }
            if pick == NIL {
                pick = next_candidate(&self.links, &mut c2, slots, protected, &mut skipped2);
            }
            if pick == NIL {
                pick = next_candidate(&self.links, &mut c1, slots, protected, &mut skipped1);
                if pick == NIL {
                    out.truncate(start);
                    self.victim_lists.clear();
                    return false;
                }
                from_t1 = true;
            }
            if from_t1 {
                virtual_t1 = virtual_t1.saturating_sub(1);
                from_t1_count += 1;
            }
            out.push(pick);
            self.victim_lists.push(if from_t1 { B1 as u8 } else { B2 as u8 });
        }
        // Unlinked only once every pick is made: the scans above walk the lists as they were.
        let from_t2_count = n - from_t1_count;
        if !skipped1 {
            self.t1.unlink_front(&mut self.links, from_t1_count, c1);
        }
        if !skipped2 {
            self.t2.unlink_front(&mut self.links, from_t2_count, c2);
        }
        for (&chunk, &list) in out[start..].iter().zip(&self.victim_lists) {
            match (usize::from(list) == B1, skipped1, skipped2) {
                (true, true, _) => self.t1.remove(&mut self.links, chunk),
                (false, _, true) => self.t2.remove(&mut self.links, chunk),
                _ => self.links.detach(chunk),
            }
        }
        true
    }

    fn clear(&mut self) {
        self.target = 0.0;
        self.victim_lists.clear();
        self.t1.clear();
        self.t2.clear();
        self.links = Links::with_nodes(self.capacity);
    }

    fn snapshot(&self, slots: SlotView<'_>) -> PolicySnapshot {
        let keys = |l: &List| l.iter(&self.links).map(|n| slots.key(n)).collect::<Vec<_>>();
        PolicySnapshot {
            lists: vec![
                ("t1", keys(&self.t1)),
                ("t2", keys(&self.t2)),
                ("b1", slots.ghost_keys(B1)),
                ("b2", slots.ghost_keys(B2)),
            ],
            target: Some(self.target),
        }
    }

    fn extra_stats(&self, slots: SlotView<'_>, out: &mut Vec<(&'static str, f64)>) {
        out.push(("arc_target_t1", self.target));
        out.push(("arc_t1", self.t1.len() as f64));
        out.push(("arc_t2", self.t2.len() as f64));
        out.push(("arc_b1", slots.ghost_len(B1) as f64));
        out.push(("arc_b2", slots.ghost_len(B2) as f64));
    }
}
