//! The `PrimaryTier` operations of [`CpuTier`], in the order and with the hooks of vLLM 0.33.0's
//! `CPUOffloadingManager` (see the crate docs for the two deliberate deviations).

use std::sync::Arc;

use tiering_core::{
    KeySet, Locality, LookupResult, Medium, OffloadKey, OffloadingEvent, PrepareStoreOutput, PrimaryTier,
    ReqContext, TierError, TierInfo, TierStats,
    arena::{ChunkArena, ChunkId},
};

use crate::access::{NO_ROW, OfferedKey, RequestAccess};
use crate::ghost_lists::NO_GHOST;
use crate::policy::{FinishedKey, KeyRef, Protected};
use crate::slots::{NO_SLOT, NewKey, Probe, WRITING};
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

    /// Resolves keys to their resident rows into `out`, and appends the ghost ids of the keys
    /// that are ghosts to `ghosts`, in key order: one probe per key, which tells a resident key,
    /// a ghost (only a policy that keeps ghosts in the table has any) and an absent key apart.
    /// A table small enough to stay cached hashes each key inside the probe loop; a large one
    /// digests the batch first, requesting every key's lines before the first probe waits, and
    /// with each likely row what the policy's touch of it reads first (LRU touch16 at 100k rows,
    /// 16 interleaved runs: 633 -> 561 ns median, 12 of 16 faster; one dependent miss less).
    fn resolve_into(&mut self, keys: &[OffloadKey], out: &mut Vec<Option<ChunkId>>, ghosts: &mut Vec<u32>) {
        out.clear();
        ghosts.clear();
        let mut resolve = |probe: Probe| match probe {
            Probe::Resident(e) => Some(e.chunk),
            Probe::Ghost(g) => {
                ghosts.push(g);
                None
            }
            Probe::Absent => None,
        };
        if self.table.prefetches() {
            let mut digests = std::mem::take(&mut self.buf_digests);
            let policy = &self.policy;
            self.table
                .digest_batch_with(keys, &mut digests, |rows| policy.prefetch_touch(rows));
            out.extend(
                keys.iter()
                    .zip(&digests)
                    .map(|(k, &d)| resolve(self.table.probe(k, d))),
            );
            self.buf_digests = digests;
        } else {
            out.extend(
                keys.iter()
                    .map(|k| resolve(self.table.probe(k, crate::index::digest_of(k)))),
            );
        }
    }

    /// Reports hits of the ghosts `ghosts` (in reverse order, [`NO_GHOST`] skipped) to the
    /// policy, each followed by the ghost's move to the back of its list. Hits and resident
    /// moves touch disjoint state, so reporting a batch's hits after its moves keeps the order
    /// that matters: among the hits.
    fn ghost_hits(&mut self, ghosts: impl DoubleEndedIterator<Item = u32>) {
        for g in ghosts.rev().filter(|&g| g != NO_GHOST) {
            let view = self.table.ghosts();
            let list = view.list(g);
            self.policy.on_ghost_hit(list, [view.len(0), view.len(1)]);
            self.table.ghost_to_back(g);
        }
    }

    /// Tells the policy about keys a request observed for the first time; `refs` are already
    /// resolved (their positions are filled in here).
    fn announce_first_access(&mut self, refs: &mut [KeyRef], ctx: &ReqContext) {
        if refs.is_empty() || !self.policy.observes_request_access() {
            return;
        }
        let mut positions = std::mem::take(&mut self.buf_positions);
        let mut keys = std::mem::take(&mut self.buf_keys);
        positions.clear();
        keys.clear();
        keys.extend(refs.iter().map(|r| r.key));
        ctx.key_positions_into(&keys, &mut positions);
        for (r, p) in refs.iter_mut().zip(&positions) {
            r.position = *p;
        }
        self.policy.on_request_access(refs, self.table.view(), ctx);
        self.buf_positions = positions;
        self.buf_keys = keys;
    }

    /// Pins every key (all or nothing), one probe per key; records the access when `record`
    /// (engine loads only). On a bad key the pins already taken are released again.
    fn pin(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        record: bool,
    ) -> Result<Vec<ChunkId>, TierError> {
        let mut digests = std::mem::take(&mut self.buf_digests);
        self.table.digest_batch(keys, &mut digests);
        let mut rows = Vec::with_capacity(keys.len());
        let mut edges = std::mem::take(&mut self.buf_chunks);
        edges.clear();
        for (k, &d) in keys.iter().zip(&digests) {
            match self.table.pin(k, d) {
                Ok((chunk, edge)) => {
                    rows.push(chunk);
                    if edge {
                        edges.push(chunk);
                    }
                }
                Err(e) => {
                    for (done, &d) in keys[..rows.len()].iter().zip(&digests) {
                        // Pinned by this loop a moment ago, so the release cannot fail.
                        let _ = self.table.unpin(done, d);
                    }
                    self.buf_chunks = edges;
                    self.buf_digests = digests;
                    return Err(e);
                }
            }
        }
        self.buf_digests = digests;
        if self.policy.observes_evictability() {
            for &chunk in &edges {
                self.policy.mark_non_evictable(chunk);
            }
        }
        self.buf_chunks = edges;
        if record {
            self.counters.loads += keys.len() as u64;
            let mut new = std::mem::take(&mut self.buf_new);
            new.clear();
            RequestAccess::with(ctx, self.id, self.generation, |rec| {
                rec.record_load(keys, &rows, &mut new);
            });
            if !new.is_empty() && self.policy.observes_request_access() {
                let mut refs = std::mem::take(&mut self.buf_refs);
                refs.clear();
                refs.extend(new.iter().map(|&j| KeyRef {
                    key: keys[j],
                    chunk: Some(rows[j]),
                    position: None,
                }));
                self.announce_first_access(&mut refs, ctx);
                self.buf_refs = refs;
            }
            self.buf_new = new;
        } else {
            self.counters.reads += keys.len() as u64;
        }
        Ok(rows)
    }

    /// Fills `hints` with the rows the request's record names for `keys` (the rows its load pinned
    /// or its store reserved) and starts loading those rows; `false` (and no hints) when the
    /// context holds no record of this tier and generation. Hints are checked before use.
    fn row_hints_into(&self, keys: &[OffloadKey], ctx: &ReqContext, hints: &mut Vec<ChunkId>) -> bool {
        hints.clear();
        let (owner, generation) = (self.id, self.generation);
        ctx.with_state(RequestAccess::default, |rec| {
            if rec.belongs_to(owner, generation) {
                rec.row_hints(keys, hints);
            }
        });
        if hints.len() != keys.len() {
            hints.clear();
            return false;
        }
        self.table.prefetch_rows(hints);
        true
    }

    /// Releases one pin per key (all or nothing): through the request's row hints when it has
    /// them, else one probe per key. On a bad key the pins already released are taken again.
    fn unpin(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), TierError> {
        let mut hints = std::mem::take(&mut self.buf_hints);
        let hinted = self.row_hints_into(keys, ctx, &mut hints);
        let mut digests = std::mem::take(&mut self.buf_digests);
        if hinted {
            digests.clear();
        } else {
            self.table.digest_batch(keys, &mut digests);
        }
        let mut edges = std::mem::take(&mut self.buf_chunks);
        edges.clear();
        for (i, k) in keys.iter().enumerate() {
            let unpinned = match (hints.get(i), digests.get(i)) {
                (Some(&row), _) => self.table.unpin_hinted(k, row),
                (None, Some(&d)) => self.table.unpin(k, d),
                (None, None) => self.table.unpin(k, crate::index::digest_of(k)),
            };
            match unpinned {
                Ok((chunk, edge)) => {
                    if edge {
                        edges.push(chunk);
                    }
                }
                Err(e) => {
                    for done in &keys[..i] {
                        self.table.repin(done);
                    }
                    self.buf_chunks = edges;
                    self.buf_digests = digests;
                    self.buf_hints = hints;
                    return Err(e);
                }
            }
        }
        self.buf_digests = digests;
        self.buf_hints = hints;
        if self.policy.observes_evictability() {
            for &chunk in &edges {
                self.policy.mark_evictable(chunk);
            }
        }
        self.buf_chunks = edges;
        Ok(())
    }

    /// Splits a store offer into new keys (deduplicated, offer order), the keys the request
    /// observes (all but keys another write has in flight, each with its row when ready, a
    /// reuse), and the rows of the ready ones (protected from this offer's eviction).
    fn partition_offer(
        &mut self,
        keys: &[OffloadKey],
        to_store: &mut Vec<OffloadKey>,
        observed: &mut Vec<OfferedKey>,
        ready_rows: &mut Vec<ChunkId>,
    ) {
        // A large table digests the batch first to request its lines; a cached one hashes each
        // key inside the probe loop instead.
        let mut digests = std::mem::take(&mut self.buf_digests);
        digests.clear();
        if self.table.prefetches() {
            self.table.digest_batch(keys, &mut digests);
        }
        let ghost_bound = self.policy.ghost_bound();
        if let Some(bound) = ghost_bound {
            self.table.prefetch_ghost_trims(keys.len(), bound);
        }
        // Each new key takes its index slot during its probe (the probe has just walked to it),
        // so that its insertion finds the slot without walking the run again.
        self.table.reserve_for_batch(keys.len());
        // What the insertion of each key of `to_store` needs from its probe.
        self.buf_store.clear();
        let mut offered: Option<KeySet> = (keys.len() > SMALL_BATCH).then(KeySet::default);
        // Small offers compare new keys by their first word, then in full on a match; a bit per
        // distinct top six bits of the words seen settles most first sightings without a scan.
        let mut words = [0u64; SMALL_BATCH];
        let mut seen_bits = 0u64;
        for (at, k) in (0u32..).zip(keys) {
            let d = digests
                .get(at as usize)
                .copied()
                .unwrap_or_else(|| crate::index::digest_of(k));
            // Ghosts are only in the index when the policy keeps them there.
            let (found, ghost, vacancy) = match self.table.probe_for_store(k, d) {
                Err(vacancy) => (None, NO_GHOST, vacancy),
                Ok(Probe::Resident(e)) => (Some(e), NO_GHOST, NO_SLOT),
                Ok(Probe::Ghost(g)) => (None, g, NO_SLOT),
                Ok(Probe::Absent) => (None, NO_GHOST, NO_SLOT),
            };
            match found {
                None => {
                    // Deviation: a key repeated in one offer is stored once.
                    let repeat = match offered.as_mut() {
                        Some(set) => !set.insert(*k),
                        None => {
                            let w = first_word(k);
                            let bit = 1u64 << (w >> 58);
                            let n = to_store.len();
                            let dup = seen_bits & bit != 0
                                && words[..n]
                                    .iter()
                                    .zip(to_store.iter())
                                    .any(|(&x, other)| x == w && other == k);
                            if !dup {
                                words[n] = w;
                                seen_bits |= bit;
                            }
                            dup
                        }
                    };
                    if !repeat {
                        let slot = if vacancy == NO_SLOT {
                            NO_SLOT
                        } else {
                            self.table.reserve_slot(vacancy, d)
                        };
                        to_store.push(*k);
                        self.buf_store.push(NewKey {
                            digest: d,
                            slot,
                            ghost,
                        });
                    }
                    observed.push(OfferedKey {
                        at,
                        row: NO_ROW,
                        ghost,
                    });
                }
                Some(e) if e.ref_cnt != WRITING => {
                    observed.push(OfferedKey {
                        at,
                        row: e.chunk,
                        ghost: NO_GHOST,
                    });
                    ready_rows.push(e.chunk);
                }
                Some(_) => {}
            }
        }
        self.buf_digests = digests;
    }

    /// Gives back the index slots the store offer being served reserved for its new keys.
    fn cancel_reserved_slots(&mut self) {
        for new in &mut self.buf_store {
            if new.slot != NO_SLOT {
                self.table.cancel_slot(new.digest);
                new.slot = NO_SLOT;
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
        // A large table digests the victims first to request their index slots; a cached one
        // digests each victim's key as it releases it.
        let mut digests = std::mem::take(&mut self.buf_digests);
        digests.clear();
        if self.table.prefetches() {
            self.table.digest_rows(&victims, &mut digests);
        }
        let ghost_lists = self.policy.victim_ghost_lists();
        let evicted: Vec<OffloadKey> = victims
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let d = digests
                    .get(i)
                    .copied()
                    .unwrap_or_else(|| self.table.digest_of_row(c));
                match ghost_lists.get(i) {
                    Some(&list) => self.table.release_to_ghost(c, d, usize::from(list)),
                    None => self.table.release_digested(c, d),
                }
            })
            .collect();
        if let Some(bound) = self.policy.ghost_bound() {
            // `partition_offer` requested the slots of the oldest ghosts each list would drop
            // if every key of the offer were a victim joining it (up to 32).
            self.table.trim_ghosts(bound, self.buf_store.len().min(32));
        }
        self.buf_digests = digests;
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
            match self.make_room(need, ready_rows) {
                Some(evicted) => evicted,
                None => {
                    self.cancel_reserved_slots();
                    return None;
                }
            }
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
            self.cancel_reserved_slots();
            return None;
        }
        let mut positions = std::mem::take(&mut self.buf_positions);
        positions.clear();
        if self.policy.uses_insert_position() {
            ctx.key_positions_into(&to_store, &mut positions);
        } else {
            positions.resize(to_store.len(), None);
        }
        let news = std::mem::take(&mut self.buf_store);
        debug_assert_eq!(news.len(), to_store.len(), "a probe outcome per key to store");
        for ((k, &chunk), new) in to_store.iter().zip(&chunk_ids).zip(&news) {
            self.table
                .insert_writing(*k, new.digest, chunk, new.ghost, new.slot);
        }
        self.buf_store = news;
        // Policies read only the keys of chunks they already order, so every row can be filled
        // before the first insertion.
        self.policy
            .insert_batch(&chunk_ids, &to_store, &positions, self.table.view(), ctx);
        self.buf_positions = positions;
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
        let mut chunks = std::mem::take(&mut self.buf_resolved);
        let mut ghosts = std::mem::take(&mut self.buf_observed_ghosts);
        self.resolve_into(keys, &mut chunks, &mut ghosts);
        self.policy.touch(keys, &chunks, self.table.view(), ctx);
        self.ghost_hits(ghosts.iter().copied());
        self.buf_observed_ghosts = ghosts;
        self.buf_resolved = chunks;
    }

    fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), TierError> {
        self.unpin(keys, ctx)
    }

    fn prepare_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Option<PrepareStoreOutput> {
        let mut to_store = Vec::with_capacity(keys.len());
        let mut observed = std::mem::take(&mut self.buf_offered);
        let mut ready_rows = std::mem::take(&mut self.buf_rows);
        let mut misses = std::mem::take(&mut self.buf_misses);
        let mut new = std::mem::take(&mut self.buf_new);
        observed.clear();
        ready_rows.clear();
        misses.clear();
        new.clear();
        self.partition_offer(keys, &mut to_store, &mut observed, &mut ready_rows);
        let mut absent = std::mem::take(&mut self.buf_entries);
        absent.clear();
        // Every observed key new and distinct: each was stored once.
        let all_new = observed.len() == to_store.len() && ready_rows.is_empty();
        RequestAccess::with(ctx, self.id, self.generation, |rec| {
            rec.record_store(keys, &observed, all_new, &mut misses, &mut new, &mut absent);
        });
        // ARC learns from ghost hits before insertion revives the ghosts (once per key per
        // request, last miss first), then the policy sees first observations; both before any
        // early return, as upstream does.
        if !misses.is_empty() && self.policy.ghost_bound().is_some() {
            self.ghost_hits(misses.iter().map(|&j| observed[j].ghost));
        }
        if !new.is_empty() && self.policy.observes_request_access() {
            // First observations, in offer order.
            let mut refs = std::mem::take(&mut self.buf_refs);
            refs.clear();
            refs.extend(new.iter().map(|&j| {
                let o = observed[j];
                KeyRef {
                    key: keys[o.at as usize],
                    chunk: (o.row != NO_ROW).then_some(o.row),
                    position: None,
                }
            }));
            self.announce_first_access(&mut refs, ctx);
            self.buf_refs = refs;
        }
        self.buf_offered = observed;
        self.buf_misses = misses;
        self.buf_new = new;

        let out = self.reserve_rows(to_store, &ready_rows, ctx);
        if out.as_ref().is_some_and(|o| !o.keys_to_store.is_empty()) {
            // Every absent key of the offer was just stored (repeats once): mark the request's
            // entries of them inserted, found by index rather than by key.
            RequestAccess::with(ctx, self.id, self.generation, |rec| {
                if let Some(o) = out.as_ref() {
                    rec.mark_inserted_entries(&absent, &o.keys_to_store, &o.chunk_ids);
                }
            });
        }
        self.buf_entries = absent;
        self.buf_rows = ready_rows;
        out
    }

    fn complete_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool) {
        let mut hints = std::mem::take(&mut self.buf_hints);
        // A successful store completes through the rows the request's record names for its keys
        // (checked, so a stale or missing hint only costs the probe it would have cost anyway).
        let hinted = success && self.row_hints_into(keys, ctx, &mut hints);
        let mut digests = std::mem::take(&mut self.buf_digests);
        if hinted {
            digests.clear();
        } else {
            self.table.digest_batch(keys, &mut digests);
        }
        let mut done = Vec::with_capacity(keys.len());
        let observes_evictability = self.policy.observes_evictability();
        for (i, k) in keys.iter().enumerate() {
            let d = || {
                digests
                    .get(i)
                    .copied()
                    .unwrap_or_else(|| crate::index::digest_of(k))
            };
            if success {
                let written = match hints.get(i) {
                    Some(&row) => self.table.mark_written_hinted(k, row),
                    None => self.table.mark_written(k, d()),
                };
                if let Some(chunk) = written {
                    if observes_evictability {
                        self.policy.mark_evictable(chunk);
                    }
                    done.push(*k);
                }
            } else if let Some(e) = self.table.get_digested(k, d())
                && e.ref_cnt == WRITING
            {
                self.policy.remove(e.chunk, self.table.view());
                self.table.release(e.chunk);
                done.push(*k);
            }
        }
        self.buf_digests = digests;
        self.buf_hints = hints;
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
        let (owner, generation) = (self.id, self.generation);
        let observed = ctx.with_state(RequestAccess::default, |rec| {
            if rec.belongs_to(owner, generation) {
                rec.finish(ctx)
            } else {
                None
            }
        });
        let Some(observed) = observed else {
            return;
        };
        let keys: Vec<FinishedKey> = observed
            .iter()
            .filter_map(|o| {
                // The record's row hint settles most keys with one row read instead of a probe.
                let chunk = if self.table.hinted(o.row, &o.key).is_some() {
                    o.row
                } else {
                    self.table.get(&o.key)?.chunk
                };
                Some(FinishedKey {
                    key: o.key,
                    chunk,
                    insertion_only: o.insertion_only,
                    reused: o.reused,
                })
            })
            .collect();
        self.policy.on_request_finished(&keys, self.table.view(), ctx);
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        let Some(events) = self.events.as_mut() else {
            return Vec::new();
        };
        if events.is_empty() {
            return Vec::new();
        }
        // The next batch of events gets room for as many as this one had (no growth steps).
        let room = events.len();
        let mut out = std::mem::replace(events, Vec::with_capacity(room));
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

    fn reset_fencing_writes(&mut self) -> usize {
        self.policy.clear();
        let fenced = self.table.clear_fencing_writes();
        self.generation += 1;
        tracing::debug!(
            generation = self.generation,
            fenced,
            "cpu tier reset, writes fenced"
        );
        fenced
    }

    fn release_reset_fence(&mut self) -> usize {
        self.table.release_fence()
    }
}
