//! A minimal in-memory primary tier for tests: correct ref counts, LRU by a logical clock,
//! linear-time eviction. Not for production (tier-cpu is).

use std::sync::Arc;

use parking_lot::Mutex;

use crate::arena::ChunkArena;
use crate::error::TierError;
use crate::event::OffloadingEvent;
use crate::key::{KeyMap, KeySet, OffloadKey};
use crate::outcome::{ChunkId, LookupResult, PrepareStoreOutput};
use crate::request::{Locality, Medium, ReqContext, TierInfo};
use crate::stats::TierStats;
use crate::tier::PrimaryTier;

#[derive(Clone, Copy, Debug)]
struct Slot {
    chunk: ChunkId,
    ref_cnt: i32,
    rank: u64,
}

/// A small, obviously-correct primary tier for tests. Clones share state, so a test keeps one
/// clone to inspect ref counts while the manager owns another.
#[derive(Clone)]
pub struct MemoryPrimary {
    arena: Arc<ChunkArena>,
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    arena: Arc<ChunkArena>,
    slots: KeyMap<Slot>,
    free: Vec<ChunkId>,
    clock: u64,
    events: Vec<OffloadingEvent>,
    stats: TierStats,
}

impl MemoryPrimary {
    /// A primary of `num_chunks` rows of `chunk_bytes` bytes.
    ///
    /// # Panics
    /// If the arena cannot be mapped (tests only).
    #[must_use]
    pub fn new(num_chunks: usize, chunk_bytes: usize) -> Self {
        Self::with_arena(ChunkArena::new(num_chunks, chunk_bytes).expect("test arena"))
    }

    /// A primary over an existing arena (for example a shared one that worker processes open).
    ///
    /// # Panics
    /// The arena has more rows than a chunk id can name.
    #[must_use]
    pub fn with_arena(arena: Arc<ChunkArena>) -> Self {
        let num_chunks = arena.num_chunks();
        let free = (0..u32::try_from(num_chunks).expect("test size")).rev().collect();
        let inner = Inner {
            arena: Arc::clone(&arena),
            slots: KeyMap::default(),
            free,
            clock: 0,
            events: Vec::new(),
            stats: TierStats::named("memory-primary"),
        };
        Self {
            arena,
            inner: Arc::new(Mutex::new(inner)),
        }
    }

    /// The ref count of `key`, if resident.
    #[must_use]
    pub fn ref_count(&self, key: &OffloadKey) -> Option<i32> {
        self.inner.lock().slots.get(key).map(|s| s.ref_cnt)
    }

    /// Total pins (positive ref counts) over every resident chunk.
    #[must_use]
    pub fn total_pins(&self) -> i64 {
        self.inner
            .lock()
            .slots
            .values()
            .map(|s| i64::from(s.ref_cnt.max(0)))
            .sum()
    }

    /// Chunks with a write in flight.
    #[must_use]
    pub fn writes_in_flight(&self) -> usize {
        self.inner
            .lock()
            .slots
            .values()
            .filter(|s| s.ref_cnt == -1)
            .count()
    }

    /// Resident keys.
    #[must_use]
    pub fn resident(&self) -> usize {
        self.inner.lock().slots.len()
    }

    /// Checks the structural invariants; returns a description of the first violation.
    ///
    /// # Errors
    /// A ref count below −1, a chunk id used twice, or lost capacity.
    pub fn check_invariants(&self) -> Result<(), String> {
        let this = self.inner.lock();
        let mut seen = std::collections::HashSet::new();
        for (k, s) in &this.slots {
            if s.ref_cnt < -1 {
                return Err(format!("{k} has ref count {}", s.ref_cnt));
            }
            if !seen.insert(s.chunk) {
                return Err(format!("chunk {} used twice", s.chunk));
            }
        }
        for c in &this.free {
            if !seen.insert(*c) {
                return Err(format!("free chunk {c} also in use"));
            }
        }
        if seen.len() != self.arena.num_chunks() {
            return Err(format!(
                "{} of {} chunks accounted for",
                seen.len(),
                self.arena.num_chunks()
            ));
        }
        Ok(())
    }
}

impl Inner {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn pin(&mut self, keys: &[OffloadKey]) -> Result<Vec<ChunkId>, TierError> {
        for k in keys {
            match self.slots.get(k) {
                None => return Err(TierError::NotFound(*k)),
                Some(s) if s.ref_cnt < 0 => return Err(TierError::NotReady(*k)),
                Some(_) => {}
            }
        }
        Ok(keys
            .iter()
            .filter_map(|k| {
                self.slots.get_mut(k).map(|s| {
                    s.ref_cnt += 1;
                    s.chunk
                })
            })
            .collect())
    }

    fn unpin(&mut self, keys: &[OffloadKey]) -> Result<(), TierError> {
        let mut need: KeyMap<i32> = KeyMap::default();
        for k in keys {
            *need.entry(*k).or_default() += 1;
        }
        for (k, n) in &need {
            match self.slots.get(k) {
                None => return Err(TierError::NotFound(*k)),
                Some(s) if s.ref_cnt < *n => return Err(TierError::NotPinned(*k)),
                Some(_) => {}
            }
        }
        for k in keys {
            if let Some(s) = self.slots.get_mut(k) {
                s.ref_cnt -= 1;
            }
        }
        Ok(())
    }
}

impl Inner {
    fn lookup(&mut self, key: &OffloadKey, _ctx: &ReqContext) -> LookupResult {
        match self.slots.get(key) {
            None => {
                self.stats.misses += 1;
                LookupResult::Miss
            }
            Some(s) => {
                self.stats.hits += 1;
                if s.ref_cnt < 0 {
                    LookupResult::HitPending
                } else {
                    LookupResult::Hit
                }
            }
        }
    }

    fn prepare_load(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.pin(keys)
    }

    fn touch(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) {
        for k in keys.iter().rev() {
            let t = self.tick();
            if let Some(s) = self.slots.get_mut(k) {
                s.rank = t;
            }
        }
    }

    fn complete_load(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) -> Result<(), TierError> {
        self.unpin(keys)
    }

    fn prepare_store(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) -> Option<PrepareStoreOutput> {
        let mut offered = KeySet::default();
        let new: Vec<OffloadKey> = keys
            .iter()
            .filter(|k| !self.slots.contains_key(k) && offered.insert(**k))
            .copied()
            .collect();
        let shortfall = new.len().saturating_sub(self.free.len());
        let mut victims: Vec<(u64, OffloadKey)> = self
            .slots
            .iter()
            .filter(|(k, s)| s.ref_cnt == 0 && !offered.contains(k) && !keys.contains(k))
            .map(|(k, s)| (s.rank, *k))
            .collect();
        if victims.len() < shortfall {
            return None;
        }
        victims.sort_unstable();
        let evicted: Vec<OffloadKey> = victims.into_iter().take(shortfall).map(|(_, k)| k).collect();
        for k in &evicted {
            if let Some(s) = self.slots.remove(k) {
                self.free.push(s.chunk);
            }
        }
        if !evicted.is_empty() {
            self.stats.evictions += evicted.len() as u64;
            self.events.push(OffloadingEvent::removed(
                evicted.clone(),
                Some(Medium::Cpu),
                Some(Locality::Local),
            ));
        }
        let mut chunk_ids = Vec::with_capacity(new.len());
        for k in &new {
            let chunk = self.free.pop()?;
            let rank = self.tick();
            self.slots.insert(
                *k,
                Slot {
                    chunk,
                    ref_cnt: -1,
                    rank,
                },
            );
            chunk_ids.push(chunk);
        }
        Some(PrepareStoreOutput {
            keys_to_store: new,
            chunk_ids,
            evicted,
        })
    }

    fn complete_store(&mut self, keys: &[OffloadKey], _ctx: &ReqContext, success: bool) {
        let mut done = Vec::new();
        for k in keys {
            let Some(s) = self.slots.get_mut(k) else { continue };
            if s.ref_cnt != -1 {
                continue;
            }
            if success {
                s.ref_cnt = 0;
                self.stats.stores += 1;
            } else if let Some(s) = self.slots.remove(k) {
                self.free.push(s.chunk);
            }
            done.push(*k);
        }
        if done.is_empty() {
            return;
        }
        let ev = if success {
            OffloadingEvent::stored(done, Some(Medium::Cpu), Some(Locality::Local))
        } else {
            OffloadingEvent::removed(done, Some(Medium::Cpu), Some(Locality::Local)).metadata_only()
        };
        self.events.push(ev);
    }

    fn prepare_read(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.pin(keys)
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        std::mem::take(&mut self.events)
    }

    fn stats(&self) -> TierStats {
        let mut s = self.stats.clone();
        s.resident_chunks = self.slots.len() as u64;
        s.capacity_chunks = self.arena.num_chunks() as u64;
        s
    }

    fn reset(&mut self) {
        self.slots.clear();
        self.free = (0..u32::try_from(self.arena.num_chunks()).unwrap_or(u32::MAX))
            .rev()
            .collect();
        self.events.clear();
    }
}

impl PrimaryTier for MemoryPrimary {
    fn info(&self) -> TierInfo {
        TierInfo::new("memory-primary", Some(Medium::Cpu), Some(Locality::Local))
    }

    fn arena(&self) -> &Arc<ChunkArena> {
        &self.arena
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        self.inner.lock().lookup(key, ctx)
    }

    fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.inner.lock().prepare_load(keys, ctx)
    }

    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        self.inner.lock().touch(keys, ctx);
    }

    fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), TierError> {
        self.inner.lock().complete_load(keys, ctx)
    }

    fn prepare_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Option<PrepareStoreOutput> {
        self.inner.lock().prepare_store(keys, ctx)
    }

    fn complete_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool) {
        self.inner.lock().complete_store(keys, ctx, success);
    }

    fn prepare_read(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.inner.lock().prepare_read(keys, ctx)
    }

    fn on_request_finished(&mut self, _ctx: &ReqContext) {}

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        self.inner.lock().take_events()
    }

    fn stats(&self) -> TierStats {
        self.inner.lock().stats()
    }

    fn reset(&mut self) {
        self.inner.lock().reset();
    }
}
