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

use tiering_core::{ChunkId, OffloadKey, ReqContext};

use super::ghost::Ghosts;
use super::list::{Links, List, NIL};
use super::{EvictionPolicy, FinishedKey, PolicyKind, PolicySnapshot, Protected, SlotView};
use crate::index::digest_of;

const B1: usize = 0;
const B2: usize = 1;

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
    /// B1 (list 0) and B2 (list 1).
    ghosts: Ghosts<2>,
    /// Scratch for `evict`: (chunk, from T1).
    picked: Vec<(ChunkId, bool, u64)>,
    /// Keys the last `on_store_miss` found in no ghost list and not inserted since. A key only
    /// becomes a ghost by being evicted, which needs an insertion first, and insertion takes the
    /// key out of here; so these are still not ghosts, and their insertion skips the ghost probe.
    not_ghosts: Vec<OffloadKey>,
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
            ghosts: Ghosts::new(),
            picked: Vec::new(),
            not_ghosts: Vec::new(),
        }
    }

    /// The adaptive T1 target.
    #[must_use]
    pub fn target(&self) -> f64 {
        self.target
    }

    /// Adapts the target if `key` (whose digest is `digest`) is a ghost; returns whether it was.
    fn adapt_to_ghost_hit(&mut self, key: &OffloadKey, digest: u64) -> bool {
        let (b1, b2) = (self.ghosts.len(B1) as f64, self.ghosts.len(B2) as f64);
        // Moving within its list changes no length, so the lengths read above still hold.
        match self.ghosts.move_to_back(key, digest) {
            Some(B1) => {
                self.target = (self.target + (b2 / b1).max(1.0)).min(self.capacity as f64);
            }
            Some(_) => self.target = (self.target - (b1 / b2).max(1.0)).max(0.0),
            None => return false,
        }
        true
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

    /// Starts loading what trimming the ghost lists after `n` more evictions would touch.
    fn prefetch_trims(&self, n: usize) {
        self.ghosts.prefetch_free(n);
        for l in [B1, B2] {
            let after = self.ghosts.len(l) + n;
            if after > self.capacity {
                self.ghosts.prefetch_front(l, after - self.capacity);
            }
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

/// Advances `cursor` to the next evictable, unprotected node and returns it.
fn next_candidate(links: &Links, cursor: &mut u32, slots: SlotView<'_>, protected: Protected<'_>) -> u32 {
    while *cursor != NIL {
        let n = *cursor;
        *cursor = links.next(n);
        if slots.is_evictable(n) && !protected.contains(n) {
            return n;
        }
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

    fn observes_request_access(&self) -> bool {
        false
    }

    fn prefetch_for_offer(&self, digests: &[u64]) {
        self.ghosts.prefetch_digests(digests);
        self.prefetch_trims(digests.len());
    }

    fn on_store_miss(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) {
        self.ghosts.prefetch(keys);
        self.not_ghosts.clear();
        for key in keys.iter().rev() {
            let digest = digest_of(key);
            if !self.adapt_to_ghost_hit(key, digest) {
                self.not_ghosts.push(*key);
            }
        }
    }

    fn insert(
        &mut self,
        chunk: ChunkId,
        key: &OffloadKey,
        _position: Option<u64>,
        _slots: SlotView<'_>,
        _ctx: &ReqContext,
    ) {
        self.t1.push_back(&mut self.links, chunk);
        self.set_in_t2(chunk, false);
        // Misses were noted last key first and are inserted first key first: searching from the
        // back finds the key at once in the usual case, and removing it is then a pop.
        if let Some(i) = self.not_ghosts.iter().rposition(|k| k == key) {
            self.not_ghosts.swap_remove(i);
        } else {
            self.ghosts.remove(key);
        }
    }

    fn remove(&mut self, chunk: ChunkId, _slots: SlotView<'_>) {
        if self.is_in_t2(chunk) {
            self.t2.remove(&mut self.links, chunk);
        } else {
            self.t1.remove(&mut self.links, chunk);
        }
    }

    fn touch(
        &mut self,
        keys: &[OffloadKey],
        chunks: &[Option<ChunkId>],
        slots: SlotView<'_>,
        _ctx: &ReqContext,
    ) {
        self.links.prefetch(chunks.iter().flatten().copied());
        for (key, chunk) in keys.iter().zip(chunks).rev() {
            match *chunk {
                Some(chunk) if self.is_in_t2(chunk) || slots.is_ready(chunk) => {
                    self.move_to_t2_back(chunk);
                }
                // A store that has not completed is not a second access.
                Some(chunk) => self.t1.move_to_back(&mut self.links, chunk),
                None => {
                    self.adapt_to_ghost_hit(key, digest_of(key));
                }
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
        self.picked.clear();
        self.prefetch_trims(n);
        // Truncation toward zero, as Python's int() of a non-negative float.
        let target = self.target as usize;
        let mut virtual_t1 = self.t1.len();
        let mut c1 = self.t1.front();
        let mut c2 = self.t2.front();
        for _ in 0..n {
            let mut pick = NIL;
            let mut from_t1 = false;
            if virtual_t1 >= target {
                pick = next_candidate(&self.links, &mut c1, slots, protected);
                from_t1 = pick != NIL;
            }
            if pick == NIL {
                pick = next_candidate(&self.links, &mut c2, slots, protected);
            }
            if pick == NIL {
                pick = next_candidate(&self.links, &mut c1, slots, protected);
                if pick == NIL {
                    return false;
                }
                from_t1 = true;
            }
            if from_t1 {
                virtual_t1 = virtual_t1.saturating_sub(1);
            }
            self.picked.push((pick, from_t1, 0));
        }
        self.ghosts.digest_chunks(&mut self.picked, slots);
        for i in 0..self.picked.len() {
            let (chunk, from_t1, digest) = self.picked[i];
            let key = slots.key(chunk);
            if from_t1 {
                self.t1.remove(&mut self.links, chunk);
                self.ghosts.push_back_digested(B1, key, digest);
            } else {
                self.t2.remove(&mut self.links, chunk);
                self.ghosts.push_back_digested(B2, key, digest);
            }
            out.push(chunk);
        }
        self.ghosts.trim_to(B1, self.capacity);
        self.ghosts.trim_to(B2, self.capacity);
        true
    }

    fn clear(&mut self) {
        self.target = 0.0;
        self.not_ghosts.clear();
        self.t1.clear();
        self.t2.clear();
        self.links = Links::with_nodes(self.capacity);
        self.ghosts.clear();
    }

    fn snapshot(&self, slots: SlotView<'_>) -> PolicySnapshot {
        let keys = |l: &List| l.iter(&self.links).map(|n| slots.key(n)).collect::<Vec<_>>();
        PolicySnapshot {
            lists: vec![
                ("t1", keys(&self.t1)),
                ("t2", keys(&self.t2)),
                ("b1", self.ghosts.keys(B1)),
                ("b2", self.ghosts.keys(B2)),
            ],
            target: Some(self.target),
        }
    }

    fn extra_stats(&self, out: &mut Vec<(&'static str, f64)>) {
        out.push(("arc_target_t1", self.target));
        out.push(("arc_t1", self.t1.len() as f64));
        out.push(("arc_t2", self.t2.len() as f64));
        out.push(("arc_b1", self.ghosts.len(B1) as f64));
        out.push(("arc_b2", self.ghosts.len(B2) as f64));
    }
}
