//! The `PrimaryTier` operations of [`CpuTier`], in the order and with the hooks of vLLM 0.33.0's
//! `CPUOffloadingManager` (see the crate docs for the two deliberate deviations).

use std::sync::Arc;

use tiering_core::{
    ChunkArena, ChunkId, KeyMap, KeySet, Locality, LookupResult, Medium, OffloadKey, OffloadingEvent,
    PrepareStoreOutput, PrimaryTier, ReqContext, TierError, TierInfo, TierStats,
};

use crate::access::RequestAccess;
use crate::policy::{FinishedKey, KeyRef, Protected};
use crate::slots::WRITING;
use crate::tier::CpuTier;

/// Batches up to this size check duplicates by scanning instead of hashing.
const SMALL_BATCH: usize = 32;

/// The key's first hash word: uniformly random, so comparing it first settles almost every
/// inequality with one integer compare.
#[inline]
fn first_word(key: &OffloadKey) -> u64 {
    key.hash_bytes()
        .first_chunk::<8>()
        .map_or(0, |w| u64::from_le_bytes(*w))
}

impl CpuTier {
    fn push_event(&mut self, event: impl FnOnce() -> OffloadingEvent) {
        if let Some(events) = self.events.as_mut() {
            events.push(event());
        }
    }

    /// Resolves keys to their resident rows into `out`.
    fn resolve_into(&self, keys: &[OffloadKey], out: &mut Vec<KeyRef>) {
        out.clear();
        out.extend(keys.iter().map(|k| KeyRef {
            key: *k,
            chunk: self.table.get(k).map(|e| e.chunk),
            position: None,
        }));
    }

    /// Tells the policy about keys a request observed for the first time.
    fn announce_first_access(&mut self, new: &[OffloadKey], ctx: &ReqContext) {
        if new.is_empty() {
            return;
        }
        let mut refs = std::mem::take(&mut self.buf_refs);
        let mut positions = std::mem::take(&mut self.buf_positions);
        self.resolve_into(new, &mut refs);
        positions.clear();
        ctx.key_positions_into(new, &mut positions);
        for (r, p) in refs.iter_mut().zip(&positions) {
            r.position = *p;
        }
        self.policy.on_request_access(&refs, self.table.view(), ctx);
        self.buf_refs = refs;
        self.buf_positions = positions;
    }

    /// Resolves every key to a row that can take one more reader, into `out`; changes nothing.
    fn resolve_pinnable(&self, keys: &[OffloadKey], out: &mut Vec<ChunkId>) -> Result<(), TierError> {
        let headroom = i32::MAX - i32::try_from(keys.len()).unwrap_or(i32::MAX);
        for k in keys {
            let Some(e) = self.table.get(k) else {
                return Err(TierError::NotFound(*k));
            };
            if e.ref_cnt < 0 {
                return Err(TierError::NotReady(*k));
            }
            if e.ref_cnt > headroom {
                return Err(TierError::Other(format!("key {k} has too many readers")));
            }
            out.push(e.chunk);
        }
        Ok(())
    }

    /// Pins every key (all or nothing); records the access when `record` (engine loads only).
    fn pin(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        record: bool,
    ) -> Result<Vec<ChunkId>, TierError> {
        let mut out = Vec::with_capacity(keys.len());
        self.resolve_pinnable(keys, &mut out)?;
        for k in keys {
            if let Some((chunk, true)) = self.table.pin(k) {
                self.policy.mark_non_evictable(chunk);
            }
        }
        if record {
            self.counters.loads += keys.len() as u64;
            let mut new = std::mem::take(&mut self.buf_keys);
            new.clear();
            RequestAccess::with(ctx, self.id, self.generation, |rec| {
                rec.record_load(keys, &mut new);
            });
            self.announce_first_access(&new, ctx);
            self.buf_keys = new;
        } else {
            self.counters.reads += keys.len() as u64;
        }
        Ok(out)
    }

    /// Checks that every key holds at least as many readers as it appears in `keys`; changes
    /// nothing.
    fn check_unpinnable(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        let mut counts: Option<KeyMap<i32>> = (keys.len() > SMALL_BATCH).then(KeyMap::default);
        // Small batches count repeats among the rows already checked (a row is one key).
        let mut rows = [0 as ChunkId; SMALL_BATCH];
        for (i, k) in keys.iter().enumerate() {
            let Some(e) = self.table.get(k) else {
                return Err(TierError::NotFound(*k));
            };
            let needed = match counts.as_mut() {
                Some(m) => {
                    let n = m.entry(*k).or_insert(0);
                    *n += 1;
                    *n
                }
                None => {
                    rows[i] = e.chunk;
                    1 + rows[..i].iter().filter(|&&c| c == e.chunk).count() as i32
                }
            };
            if e.ref_cnt < needed {
                return Err(TierError::NotPinned(*k));
            }
        }
        Ok(())
    }

    /// Releases one pin per key (all or nothing).
    fn unpin(&mut self, keys: &[OffloadKey]) -> Result<(), TierError> {
        self.check_unpinnable(keys)?;
        for k in keys {
            if let Some((chunk, true)) = self.table.unpin(k) {
                self.policy.mark_evictable(chunk);
            }
        }
        Ok(())
    }

    /// Splits a store offer into new keys (deduplicated, offer order), the keys the request
    /// observes (all but keys another write has in flight; `true` when ready, a reuse), and the
    /// rows of the ready ones (protected from this offer's eviction).
    fn partition_offer(
        &self,
        keys: &[OffloadKey],
        to_store: &mut Vec<OffloadKey>,
        observed: &mut Vec<(OffloadKey, bool)>,
        ready_rows: &mut Vec<ChunkId>,
    ) {
        let mut offered: Option<KeySet> = (keys.len() > SMALL_BATCH).then(KeySet::default);
        // Small offers compare new keys by their first word, then in full on a match.
        let mut words = [0u64; SMALL_BATCH];
        for k in keys {
            match self.table.get(k) {
                None => {
                    // Deviation: a key repeated in one offer is stored once.
                    let repeat = match offered.as_mut() {
                        Some(set) => !set.insert(*k),
                        None => {
                            let w = first_word(k);
                            let n = to_store.len();
                            let dup = words[..n]
                                .iter()
                                .zip(to_store.iter())
                                .any(|(&x, other)| x == w && other == k);
                            if !dup {
                                words[n] = w;
                            }
                            dup
                        }
                    };
                    if !repeat {
                        to_store.push(*k);
                    }
                    observed.push((*k, false));
                }
                Some(e) if e.ref_cnt != WRITING => {
                    observed.push((*k, true));
                    ready_rows.push(e.chunk);
                }
                Some(_) => {}
            }
        }
    }

    /// Marks the evictable rows among `rows` as protected; returns how many there were.
    fn protect_rows(&mut self, rows: &[ChunkId]) -> usize {
        let mut n = 0;
        for &c in rows {
            let (word, bit) = (c as usize / 64, 1u64 << (c % 64));
            if self.table.ref_of(c) == 0 && self.protect[word] & bit == 0 {
                self.protect[word] |= bit;
                n += 1;
            }
        }
        n
    }

    fn unprotect_rows(&mut self, rows: &[ChunkId]) {
        for &c in rows {
            self.protect[c as usize / 64] &= !(1u64 << (c % 64));
        }
    }

    /// Frees `need` rows by eviction, sparing `protected_rows`, or returns `None` with nothing
    /// evicted.
    fn make_room(&mut self, need: usize, protected_rows: &[ChunkId]) -> Option<Vec<OffloadKey>> {
        if need > self.table.num_evictable {
            return None;
        }
        let protected_evictable = self.protect_rows(protected_rows);
        let mut victims = std::mem::take(&mut self.buf_chunks);
        victims.clear();
        let ok = need <= self.table.num_evictable - protected_evictable
            && self.policy.evict(
                need,
                self.table.view(),
                Protected::new(&self.protect),
                &mut victims,
            );
        self.unprotect_rows(protected_rows);
        if !ok || victims.len() != need {
            self.buf_chunks = victims;
            return None;
        }
        let evicted: Vec<OffloadKey> = victims.iter().map(|&c| self.table.release(c)).collect();
        self.buf_chunks = victims;
        self.counters.evictions += evicted.len() as u64;
        Some(evicted)
    }

    /// The allocating half of `prepare_store`: evicts what is needed, reserves rows for
    /// `to_store` and inserts them into the policy.
    fn reserve_rows(
        &mut self,
        to_store: Vec<OffloadKey>,
        ready_rows: &[ChunkId],
        ctx: &ReqContext,
    ) -> Option<PrepareStoreOutput> {
        if to_store.is_empty() {
            return Some(PrepareStoreOutput::default());
        }
        self.counters.alloc_batches += 1;
        self.counters.alloc_chunks += to_store.len() as u64;

        let need = to_store.len().saturating_sub(self.table.num_free());
        let evicted = if need > 0 {
            self.make_room(need, ready_rows)?
        } else {
            Vec::new()
        };
        if !evicted.is_empty() {
            let ev = evicted.clone();
            self.push_event(|| OffloadingEvent::removed(ev, Some(Medium::Cpu), Some(Locality::Local)));
        }

        let mut chunk_ids = Vec::with_capacity(to_store.len());
        if !self.table.allocate(to_store.len(), &mut chunk_ids) {
            // Unreachable: eviction freed exactly the shortfall.
            tracing::error!(
                wanted = to_store.len(),
                "cpu tier allocation failed after eviction"
            );
            return None;
        }
        let mut positions = std::mem::take(&mut self.buf_positions);
        positions.clear();
        ctx.key_positions_into(&to_store, &mut positions);
        for ((k, &chunk), &position) in to_store.iter().zip(&chunk_ids).zip(&positions) {
            self.table.insert_writing(*k, chunk);
            self.policy.insert(chunk, k, position, self.table.view(), ctx);
        }
        self.buf_positions = positions;
        RequestAccess::with(ctx, self.id, self.generation, |rec| rec.mark_inserted(&to_store));
        Some(PrepareStoreOutput {
            keys_to_store: to_store,
            chunk_ids,
            evicted,
        })
    }
}

impl PrimaryTier for CpuTier {
    fn info(&self) -> TierInfo {
        Self::tier_info()
    }

    fn arena(&self) -> &Arc<ChunkArena> {
        &self.arena
    }

    #[inline]
    fn lookup(&mut self, key: &OffloadKey, _ctx: &ReqContext) -> LookupResult {
        match self.table.get(key) {
            None => {
                self.counters.misses += 1;
                LookupResult::Miss
            }
            Some(e) => {
                self.counters.hits += 1;
                if e.ref_cnt == WRITING {
                    LookupResult::HitPending
                } else {
                    LookupResult::Hit
                }
            }
        }
    }

    fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.pin(keys, ctx, true)
    }

    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        let mut refs = std::mem::take(&mut self.buf_refs);
        self.resolve_into(keys, &mut refs);
        self.policy.touch(&refs, self.table.view(), ctx);
        self.buf_refs = refs;
    }

    fn complete_load(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) -> Result<(), TierError> {
        self.unpin(keys)
    }

    fn prepare_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Option<PrepareStoreOutput> {
        let mut to_store = Vec::with_capacity(keys.len());
        let mut observed = std::mem::take(&mut self.buf_observed);
        let mut ready_rows = std::mem::take(&mut self.buf_rows);
        let mut misses = std::mem::take(&mut self.buf_misses);
        let mut new = std::mem::take(&mut self.buf_keys);
        observed.clear();
        ready_rows.clear();
        misses.clear();
        new.clear();
        self.partition_offer(keys, &mut to_store, &mut observed, &mut ready_rows);
        RequestAccess::with(ctx, self.id, self.generation, |rec| {
            rec.record_store(&observed, &mut misses, &mut new);
        });
        // ARC learns from ghost hits before insertion drops the ghosts (once per key per
        // request), then the policy sees first observations; both before any early return, as
        // upstream does.
        if !misses.is_empty() {
            self.policy.on_store_miss(&misses, ctx);
        }
        self.announce_first_access(&new, ctx);
        self.buf_observed = observed;
        self.buf_misses = misses;
        self.buf_keys = new;

        let out = self.reserve_rows(to_store, &ready_rows, ctx);
        self.buf_rows = ready_rows;
        out
    }

    fn complete_store(&mut self, keys: &[OffloadKey], _ctx: &ReqContext, success: bool) {
        let mut done = Vec::new();
        for k in keys {
            if success {
                if let Some(chunk) = self.table.mark_written(k) {
                    self.policy.mark_evictable(chunk);
                    done.push(*k);
                }
            } else if let Some(e) = self.table.get(k)
                && e.ref_cnt == WRITING
            {
                self.policy.remove(e.chunk, self.table.view());
                self.table.release(e.chunk);
                done.push(*k);
            }
        }
        if done.is_empty() {
            return;
        }
        if success {
            self.counters.stores += done.len() as u64;
            self.push_event(|| OffloadingEvent::stored(done, Some(Medium::Cpu), Some(Locality::Local)));
        } else {
            self.counters.failures += done.len() as u64;
            self.push_event(|| {
                OffloadingEvent::removed(done, Some(Medium::Cpu), Some(Locality::Local)).metadata_only()
            });
        }
    }

    fn prepare_read(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.pin(keys, ctx, false)
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) {
        let table = &self.table;
        let finished: Option<Vec<FinishedKey>> = ctx.with_state(RequestAccess::default, |rec| {
            if !rec.belongs_to(self.id, self.generation) {
                return None;
            }
            let order = rec.finish(ctx)?;
            Some(
                order
                    .iter()
                    .filter_map(|k| {
                        let e = table.get(k)?;
                        let reused = rec.reused(k);
                        Some(FinishedKey {
                            key: *k,
                            chunk: e.chunk,
                            insertion_only: !reused && rec.inserted(k),
                            reused,
                        })
                    })
                    .collect(),
            )
        });
        if let Some(keys) = finished {
            self.policy.on_request_finished(&keys, self.table.view(), ctx);
        }
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        let Some(events) = self.events.as_mut() else {
            return Vec::new();
        };
        let mut out = std::mem::take(events);
        // A failed store's cleanup names keys a retry may have stored again since; drop those.
        out.retain_mut(|ev| {
            if ev.metadata_only {
                ev.keys.retain(|k| self.table.get(k).is_none());
                !ev.keys.is_empty()
            } else {
                true
            }
        });
        out
    }

    fn stats(&self) -> TierStats {
        self.stats_snapshot()
    }

    fn reset(&mut self) {
        self.policy.clear();
        self.table.clear();
        self.generation += 1;
        tracing::debug!(generation = self.generation, "cpu tier reset");
    }
}
