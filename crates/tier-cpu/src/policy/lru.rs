//! vLLM 0.33.0's LRU: logical recency ranks, independent of pinning.
//!
//! Every resident chunk has a rank `(hi, lo)`; eviction takes the evictable chunks with the
//! smallest `(hi, lo, key)`. A plain use gets `(counter, 0)` from a global counter. A request gets
//! its own rank `r` from the same counter the first time it needs one, and its keys with known
//! token positions rank `(r, −position)`, so within a request the tail goes before the head.
//!
//! Upstream keeps a lazily invalidated heap. Here the ranks live in one doubly-linked list kept
//! sorted by rank, which makes every operation O(1) in the common case:
//! - a fresh global rank is larger than every existing rank, so it is a push at the back;
//! - a request rank is fresh when assigned, so its *sentinel* node is pushed at the back, and the
//!   request's members sit right after their sentinel, sorted by `(lo, key)`. Prefixes arrive in
//!   position order, so new members land at the group's front or back in O(1); anything else
//!   walks the group.
//! - eviction walks from the front, skipping sentinels and chunks that are pinned, in flight or
//!   protected (normally few, since pins last one transfer).
//!
//! A group's sentinel is recycled once the group is empty and its request context is gone
//! (detected through the context's [`ReqLiveness`](tiering_core::ReqLiveness)). Finishing is not
//! enough: a finished request may still store a key it observed before (one whose earlier store
//! failed or was evicted since), and vLLM 0.33.0 then ranks it with the request's old rank, among
//! the oldest keys. Keeping the sentinel costs
//! one node per live context, released with the context, so nothing accumulates for finished
//! requests the engine has let go of.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

use tiering_core::KeyBuildHasher;
use tiering_core::{OffloadKey, ReqContext, ReqLiveness, arena::ChunkId};

use super::list::{Links, List, NIL};
use super::{EvictionPolicy, FinishedKey, KeyRef, PolicyKind, PolicySnapshot, Protected, SlotView};

/// Distinguishes policy instances in request scratch state (vLLM checks the owner object).
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// The request rank an LRU policy keeps in a [`ReqContext`].
struct RequestRank {
    owner: u64,
    generation: u64,
    rank: u64,
}

impl RequestRank {
    fn unset() -> Self {
        Self {
            owner: 0,
            generation: 0,
            rank: 0,
        }
    }
}

/// The members of one request rank.
struct Group {
    sentinel: u32,
    /// The last member, or the sentinel when the group is empty.
    last: u32,
    len: usize,
    /// Whether the request's context is still alive.
    request: ReqLiveness,
}

impl Group {
    fn reclaimable(&self) -> bool {
        self.len == 0 && !self.request.is_alive()
    }
}

/// vLLM 0.33.0's logical-rank LRU (see the module docs).
pub struct LruPolicy {
    owner: u64,
    generation: u64,
    /// Chunk ids are `0..capacity`; sentinel ids follow.
    capacity: u32,
    /// The order, each node's `hi` rank as its links' payload: a move rewrites the node's links
    /// and its `hi` on the one line it loads (16 bytes a node).
    links: Links<u64>,
    order: List,
    /// Each node's `lo` rank, read only for group members and sentinels (an ungrouped chunk's
    /// `lo` is 0), so a touch never writes it.
    lo: Vec<i64>,
    /// One bit per chunk: a member of its rank's request group. Apart from the ranks because
    /// every move asks it first: a bitset of the tier stays cached where the links do not.
    grouped: Vec<u64>,
    next_rank: u64,
    groups: HashMap<u64, Group, KeyBuildHasher>,
    /// Group ranks in creation order, swept a little at every creation so groups of requests
    /// that were dropped without finishing do not pile up.
    sweep: VecDeque<u64>,
    free_sentinels: Vec<u32>,
    num_sentinels: u32,
}

impl LruPolicy {
    /// A policy for `capacity` chunks.
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        let capacity = u32::try_from(capacity).unwrap_or(u32::MAX - 1);
        let n = capacity as usize;
        Self {
            owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
            generation: 0,
            capacity,
            links: Links::with_nodes(n),
            order: List::new(),
            lo: crate::memory::filled_vec(n, 0),
            grouped: vec![0; n.div_ceil(64)],
            next_rank: 0,
            groups: HashMap::default(),
            sweep: VecDeque::new(),
            free_sentinels: Vec::new(),
            num_sentinels: 0,
        }
    }

    fn is_sentinel(&self, node: u32) -> bool {
        node >= self.capacity
    }

    /// Whether `node` is a member of a request group (never a sentinel).
    fn is_grouped(&self, node: u32) -> bool {
        self.grouped
            .get(node as usize / 64)
            .is_some_and(|w| w & (1 << (node % 64)) != 0)
    }

    /// `chunk`'s `lo` rank: its recorded one in a group, 0 under a global rank.
    fn lo_of(&self, chunk: ChunkId) -> i64 {
        if self.is_grouped(chunk) {
            self.lo[chunk as usize]
        } else {
            0
        }
    }

    fn set_grouped(&mut self, chunk: ChunkId, member: bool) {
        if let Some(w) = self.grouped.get_mut(chunk as usize / 64) {
            let bit = 1 << (chunk % 64);
            if member { *w |= bit } else { *w &= !bit }
        }
    }

    fn fresh_rank(&mut self) -> u64 {
        self.next_rank += 1;
        self.next_rank
    }

    /// The request's rank, assigning a fresh one (and its group) when the context has none for
    /// this policy and generation. `None` only if no sentinel id is left (absurd sizes).
    fn request_rank(&mut self, ctx: &ReqContext) -> Option<u64> {
        let (owner, generation) = (self.owner, self.generation);
        // One visit to the context's state: reuse its rank if it is ours and its group is alive,
        // else create the group and overwrite the state in place.
        ctx.with_state(RequestRank::unset, |state| {
            if state.owner == owner && state.generation == generation && self.groups.contains_key(&state.rank)
            {
                return Some(state.rank);
            }
            let sentinel = self.alloc_sentinel()?;
            let rank = self.fresh_rank();
            self.links.set_data(sentinel, rank);
            self.lo[sentinel as usize] = i64::MIN;
            self.order.push_back(&mut self.links, sentinel);
            self.groups.insert(
                rank,
                Group {
                    sentinel,
                    last: sentinel,
                    len: 0,
                    request: ctx.liveness(),
                },
            );
            self.sweep_groups(rank);
            *state = RequestRank {
                owner,
                generation,
                rank,
            };
            Some(rank)
        })
    }

    /// Queues the new group `rank` and examines the two oldest queued groups: reclaimed ones
    /// leave the queue, reclaimable ones are reclaimed, live ones go to the back. Each creation
    /// adds one entry and removes up to two, so the queue (and the garbage) stays proportional to
    /// the number of live requests.
    fn sweep_groups(&mut self, rank: u64) {
        self.sweep.push_back(rank);
        for _ in 0..2 {
            let Some(old) = self.sweep.pop_front() else { break };
            match self.groups.get(&old) {
                None => {}
                Some(g) if g.reclaimable() => self.reclaim_group(old),
                Some(_) => self.sweep.push_back(old),
            }
        }
    }

    fn alloc_sentinel(&mut self) -> Option<u32> {
        if let Some(s) = self.free_sentinels.pop() {
            return Some(s);
        }
        let id = self
            .capacity
            .checked_add(self.num_sentinels)
            .filter(|&id| id != NIL)?;
        self.num_sentinels += 1;
        let n = id as usize + 1;
        self.links.grow_to(n);
        if self.lo.len() < n {
            self.lo.resize(n, 0);
        }
        Some(id)
    }

    fn reclaim_group(&mut self, rank: u64) {
        if let Some(g) = self.groups.remove(&rank) {
            self.order.remove(&mut self.links, g.sentinel);
            self.free_sentinels.push(g.sentinel);
        }
    }

    /// Unlinks a resident chunk from the order (and from its group).
    fn detach(&mut self, chunk: ChunkId) {
        if self.is_grouped(chunk) {
            self.set_grouped(chunk, false);
            let rank = self.links.data(chunk);
            let prev = self.links.prev(chunk);
            let mut reclaim = false;
            if let Some(g) = self.groups.get_mut(&rank) {
                g.len -= 1;
                if g.last == chunk {
                    g.last = prev;
                }
                reclaim = g.reclaimable();
            }
            self.order.remove(&mut self.links, chunk);
            if reclaim {
                self.reclaim_group(rank);
            }
        } else {
            self.order.remove(&mut self.links, chunk);
        }
    }

    /// Gives a detached chunk a fresh global rank (most recent).
    fn place_global(&mut self, chunk: ChunkId) {
        let rank = self.fresh_rank();
        self.links.set_data(chunk, rank);
        self.set_grouped(chunk, false);
        self.order.push_back(&mut self.links, chunk);
    }

    /// Places a detached chunk in request group `rank` at its `(lo, key)` position.
    fn place_in_group(&mut self, chunk: ChunkId, rank: u64, lo: i64, slots: SlotView<'_>) {
        let Some(g) = self.groups.get(&rank) else {
            self.place_global(chunk);
            return;
        };
        let (sentinel, last) = (g.sentinel, g.last);
        let key = slots.key(chunk);
        let member_key = |n: u32| (self.lo[n as usize], slots.key(n));
        let at = if last == sentinel || member_key(last) < (lo, key) {
            // Empty group, or the largest rank of the group: append at the group's end.
            last
        } else {
            // Prefixes usually arrive head first, each key ranking below the previous one, so
            // this walk normally stops at once, right after the sentinel.
            let mut at = sentinel;
            let mut cur = self.links.next(sentinel);
            while cur != NIL && cur != last && member_key(cur) < (lo, key) {
                at = cur;
                cur = self.links.next(cur);
            }
            at
        };
        self.links.set_data(chunk, rank);
        self.lo[chunk as usize] = lo;
        self.set_grouped(chunk, true);
        self.order.insert_after(&mut self.links, at, chunk);
        if let Some(g) = self.groups.get_mut(&rank) {
            g.len += 1;
            if at == g.last {
                g.last = chunk;
            }
        }
    }

    fn rerank_global(&mut self, chunk: ChunkId) {
        if self.is_grouped(chunk) {
            self.detach(chunk);
            self.place_global(chunk);
            return;
        }
        // An ungrouped chunk already ranks by a global rank, and every global rank is below a
        // fresh one: it moves to the back in one relink (a touch's usual case).
        let rank = self.fresh_rank();
        self.links.set_data(chunk, rank);
        self.order.move_to_back(&mut self.links, chunk);
    }
}

fn position_rank(position: u64) -> i64 {
    i64::try_from(position).map_or(i64::MIN + 1, |p| -p)
}

impl EvictionPolicy for LruPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }

    fn observes_evictability(&self) -> bool {
        false
    }

    fn on_request_access(&mut self, keys: &[KeyRef], slots: SlotView<'_>, ctx: &ReqContext) {
        let Some(rank) = self.request_rank(ctx) else {
            return;
        };
        for k in keys {
            let (Some(chunk), Some(position)) = (k.chunk, k.position) else {
                continue;
            };
            let lo = position_rank(position);
            // Only moves forward: a key already ranked at or after this request position stays.
            if (self.links.data(chunk), self.lo_of(chunk)) >= (rank, lo) {
                continue;
            }
            self.detach(chunk);
            self.place_in_group(chunk, rank, lo, slots);
        }
    }

    fn insert(
        &mut self,
        chunk: ChunkId,
        _key: &OffloadKey,
        position: Option<u64>,
        slots: SlotView<'_>,
        ctx: &ReqContext,
    ) {
        match position {
            None => self.place_global(chunk),
            Some(position) => match self.request_rank(ctx) {
                Some(rank) => self.place_in_group(chunk, rank, position_rank(position), slots),
                None => self.place_global(chunk),
            },
        }
    }

    fn remove(&mut self, chunk: ChunkId, _slots: SlotView<'_>) {
        self.detach(chunk);
    }

    fn prefetch_touch(&self, chunks: &[ChunkId]) {
        for &chunk in chunks {
            self.links.prefetch_node(chunk);
        }
    }

    fn touch(
        &mut self,
        _keys: &[OffloadKey],
        chunks: &[Option<ChunkId>],
        _slots: SlotView<'_>,
        _ctx: &ReqContext,
    ) {
        // Requested ahead even on a tier that would fit in cache: a touched batch's keys stream
        // through it and evict the links (measured slower without, at 10k rows).
        self.links.prefetch(chunks.iter().flatten().copied());
        for &chunk in chunks.iter().rev().flatten() {
            self.rerank_global(chunk);
        }
    }

    fn on_request_finished(&mut self, keys: &[FinishedKey], _slots: SlotView<'_>, _ctx: &ReqContext) {
        // The request's group stays while its context lives: a finished request that stores a
        // key it saw before still ranks it with its old rank (see the module docs).
        for k in keys.iter().rev() {
            self.rerank_global(k.chunk);
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
        let start = out.len();
        let mut dead_groups = Vec::new();
        let mut cur = self.order.front();
        while cur != NIL && out.len() - start < n {
            if self.is_sentinel(cur) {
                let rank = self.links.data(cur);
                if self.groups.get(&rank).is_some_and(Group::reclaimable) {
                    dead_groups.push(rank);
                }
            } else if slots.is_evictable(cur) && !protected.contains(cur) {
                out.push(cur);
            }
            cur = self.links.next(cur);
        }
        for rank in dead_groups {
            self.reclaim_group(rank);
        }
        if out.len() - start < n {
            out.truncate(start);
            return false;
        }
        if n > 1 {
            for &chunk in out[start..].iter().take(32) {
                slots.prefetch_index_of(chunk);
            }
        }
        for &chunk in &out[start..] {
            self.detach(chunk);
        }
        true
    }

    fn clear(&mut self) {
        self.generation += 1;
        self.next_rank = 0;
        self.order.clear();
        self.groups.clear();
        self.sweep.clear();
        self.free_sentinels.clear();
        self.num_sentinels = 0;
        let n = self.capacity as usize;
        self.links = Links::with_nodes(n);
        self.lo.truncate(n);
        self.grouped.fill(0);
    }

    fn snapshot(&self, slots: SlotView<'_>) -> PolicySnapshot {
        let order = self
            .order
            .iter(&self.links)
            .filter(|&n| !self.is_sentinel(n))
            .map(|n| slots.key(n))
            .collect();
        PolicySnapshot {
            lists: vec![("lru", order)],
            target: None,
        }
    }

    fn extra_stats(&self, _slots: SlotView<'_>, out: &mut Vec<(&'static str, f64)>) {
        out.push(("lru_request_groups", self.groups.len() as f64));
    }
}
