//! Request-scoped access recording, as vLLM 0.33.0 does it.
//!
//! Each request's context carries a record of the keys it observed: store-offer keys that were
//! new or ready (keys still being written by someone else are not recorded), and loaded keys.
//! Policies see first observations as they happen and the whole record, in prefix order, once the
//! request finishes. The record belongs to one tier instance and one cache generation; a stale
//! record (another tier, or from before a reset) is replaced by a fresh one.

use tiering_core::{KeyMap, OffloadKey, ReqContext};

const SEEN: u8 = 1;
const INSERTED: u8 = 2;
const REUSED: u8 = 4;
const STORE_MISS: u8 = 8;

/// Records up to this many keys are searched by scanning; larger ones build a hash index.
const SMALL_RECORD: usize = 32;

/// A key's first hash word: random, so equal words almost always mean equal keys.
#[inline]
fn word_of(key: &OffloadKey) -> u64 {
    key.hash_bytes()
        .first_chunk::<8>()
        .map_or(0, |w| u64::from_le_bytes(*w))
}

/// The bit of a first word in [`RequestAccess`]'s filter.
#[inline]
fn filter_bit(word: u64) -> u64 {
    1 << (word >> 58)
}

/// The keys one request observed. Lives in the request's [`ReqContext`] scratch map.
///
/// Keys with their flags sit in one vector in the order the request first flagged them (observed keys are flagged when first observed, so
/// filtering by `SEEN` gives first-observed order). A typical request flags a few dozen keys:
/// scanning their first hash words (kept inline) costs less than hashing each one, and the
/// record is two allocations. Past [`SMALL_RECORD`] keys a key→index map takes
/// over, so long requests stay O(1) per key.
#[derive(Default)]
pub(crate) struct RequestAccess {
    owner: u64,
    generation: u64,
    entries: Vec<Flagged>,
    /// The first hash word of each entry while the record is small enough to be scanned, side
    /// by side and inline (no allocation): a scan reads a few contiguous words instead of one
    /// entry (and cache line) per key.
    words: [u64; SMALL_RECORD],
    /// One bit per distinct top six bits of the first words in `words`: a key whose bit is clear
    /// is not in the small record, which settles most first sightings without a scan.
    filter: u64,
    index: Option<KeyMap<u32>>,
    pub(crate) finished: bool,
    /// Set by a [`RequestAccess::record_store`] that appended every one of its `n` entries to
    /// an empty record, one per stored key in order (`Some(n)`), until the next call: its
    /// [`RequestAccess::mark_inserted_entries`] then pairs entries and stored keys by index.
    fresh_store: Option<usize>,
}

/// A key the request flagged.
#[derive(Clone, Copy)]
struct Flagged {
    key: OffloadKey,
    flags: u8,
    /// The row this request last pinned or reserved for the key ([`NO_ROW`] when none): a hint
    /// for completing the load or store without probing the tier's index. The tier checks that
    /// the row still holds the key before using it.
    row: u32,
}

/// No row hint; also a store offer's key that is not resident.
pub(crate) const NO_ROW: u32 = u32::MAX;

/// A key of a store offer that the request observes: its index in the offer and the row holding
/// it when it is ready ([`NO_ROW`] when it is not resident, a store miss), and for the tier, the
/// ghost id the offer's probe found for it (`NO_GHOST` when none; the record ignores it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OfferedKey {
    pub(crate) at: u32,
    pub(crate) row: u32,
    pub(crate) ghost: u32,
}

/// A key of a finished request's record with what the request did with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ObservedKey {
    pub(crate) key: OffloadKey,
    /// The request inserted it and never reused it.
    pub(crate) insertion_only: bool,
    /// The request reused it (and had not inserted it before).
    pub(crate) reused: bool,
    /// The row the request last pinned or reserved for it ([`NO_ROW`] when none): a hint the
    /// tier checks before use.
    pub(crate) row: u32,
}

impl RequestAccess {
    fn fresh(owner: u64, generation: u64) -> Self {
        Self {
            owner,
            generation,
            ..Self::default()
        }
    }

    /// Whether the record was made by tier `owner` in cache generation `generation`.
    pub(crate) fn belongs_to(&self, owner: u64, generation: u64) -> bool {
        self.owner == owner && self.generation == generation
    }

    /// Runs `f` on the context's record for this tier and generation, replacing a stale one.
    pub(crate) fn with<R>(
        ctx: &ReqContext,
        owner: u64,
        generation: u64,
        f: impl FnOnce(&mut RequestAccess) -> R,
    ) -> R {
        ctx.with_state(
            || Self::fresh(owner, generation),
            |rec| {
                if !rec.belongs_to(owner, generation) {
                    *rec = Self::fresh(owner, generation);
                }
                f(rec)
            },
        )
    }

    #[inline]
    fn find(&self, key: &OffloadKey) -> Option<usize> {
        match &self.index {
            Some(index) => index.get(key).map(|&i| i as usize),
            None => {
                let w = word_of(key);
                if self.filter & filter_bit(w) == 0 {
                    return None;
                }
                let mut from = 0;
                let words = &self.words[..self.entries.len().min(SMALL_RECORD)];
                while let Some(off) = words[from..].iter().position(|&x| x == w) {
                    let i = from + off;
                    if self.entries[i].key == *key {
                        return Some(i);
                    }
                    from = i + 1;
                }
                None
            }
        }
    }

    /// The index of `key`'s flags, adding the key with no flag when absent.
    #[inline]
    fn slot(&mut self, key: &OffloadKey) -> usize {
        if let Some(i) = self.find(key) {
            return i;
        }
        let i = self.entries.len();
        if let Some(w) = self.words.get_mut(i) {
            *w = word_of(key);
            self.filter |= filter_bit(*w);
        }
        self.entries.push(Flagged {
            key: *key,
            flags: 0,
            row: NO_ROW,
        });
        match self.index.as_mut() {
            Some(index) => {
                index.insert(*key, i as u32);
            }
            None => self.index_when_large(),
        }
        i
    }

    /// Builds the key→entry map once the record outgrows scanning.
    #[cold]
    fn build_index(&mut self) {
        self.index = Some(
            self.entries
                .iter()
                .map(|e| &e.key)
                .enumerate()
                .map(|(j, k)| (*k, j as u32))
                .collect(),
        );
    }

    #[inline]
    fn index_when_large(&mut self) {
        if self.index.is_none() && self.entries.len() > SMALL_RECORD {
            self.build_index();
        }
    }

    #[cfg(test)]
    fn flags(&self, key: &OffloadKey) -> u8 {
        self.find(key).map_or(0, |i| self.entries[i].flags)
    }

    /// Whether this request inserted `key`.
    #[cfg(test)]
    pub(crate) fn inserted(&self, key: &OffloadKey) -> bool {
        self.flags(key) & INSERTED != 0
    }

    /// Whether this request reused `key` (and did not insert it before reusing it).
    #[cfg(test)]
    pub(crate) fn reused(&self, key: &OffloadKey) -> bool {
        self.flags(key) & REUSED != 0
    }

    /// Marks the entries [`RequestAccess::record_store`] reported as inserted by this request,
    /// and notes the rows reserved for them: `stored` are the keys stored (the distinct keys of
    /// those entries, in the same order) and `rows` their rows.
    pub(crate) fn mark_inserted_entries(&mut self, entries: &[u32], stored: &[OffloadKey], rows: &[u32]) {
        if self.fresh_store == Some(entries.len()) && entries.len() == stored.len() {
            // `record_store` appended entry i for stored key i (no repeats): no key to match.
            for (e, &row) in self.entries.iter_mut().zip(rows) {
                e.flags |= INSERTED;
                e.row = row;
            }
            self.fresh_store = None;
            return;
        }
        self.fresh_store = None;
        let mut next = 0;
        for &i in entries {
            if let Some(e) = self.entries.get_mut(i as usize) {
                e.flags |= INSERTED;
                // A repeated key's entry got its row at its first occurrence.
                if stored
                    .get(next)
                    .is_some_and(|k| crate::index::same_key(k, &e.key))
                {
                    e.row = rows.get(next).copied().unwrap_or(NO_ROW);
                    next += 1;
                }
            }
        }
    }

    /// Appends to `out` the row hint of each of `keys` ([`NO_ROW`] for keys without one). A hint
    /// may name another key's row (the tier checks every hint against the row's key).
    pub(crate) fn row_hints(&self, keys: &[OffloadKey], out: &mut Vec<u32>) {
        // A completion usually lists the keys in the order the request recorded them: try the
        // entry after the previous key's first, confirmed by the (random) first hash word only,
        // and search only when that is not the key.
        let mut guess = 0;
        out.extend(keys.iter().map(|k| {
            let at = match self.entries.get(guess) {
                Some(e) if word_of(&e.key) == word_of(k) => Some(guess),
                _ => self.find(k),
            };
            at.map_or(NO_ROW, |i| {
                guess = i + 1;
                self.entries[i].row
            })
        }));
    }

    /// Marks `keys` as inserted by this request.
    #[cfg(test)]
    pub(crate) fn mark_inserted(&mut self, keys: &[OffloadKey]) {
        for k in keys {
            let i = self.slot(k);
            self.entries[i].flags |= INSERTED;
        }
    }

    /// Marks the key at `i` seen; whether it was new to the request.
    #[inline]
    fn see(&mut self, i: usize) -> bool {
        if self.entries[i].flags & SEEN != 0 {
            return false;
        }
        if self.finished {
            // vLLM asserts here; see the crate docs.
            tracing::debug!(key = %self.entries[i].key, "key observed after its request finished; not recorded");
            return false;
        }
        self.entries[i].flags |= SEEN;
        true
    }

    /// Records a store offer in one pass: `observed` are the offered keys (indices into `keys`)
    /// that are not being written by someone else, with their row when ready (a reuse) and
    /// [`NO_ROW`] when new (a store miss). Appends to `misses` the store misses this request has
    /// not reported before, and to `new` the indices (into `observed`) of keys observed for the
    /// first time, and to `absent_entries` the record entry of every offered key that is not
    /// resident (for [`RequestAccess::mark_inserted_entries`] once they are stored).
    ///
    /// `all_new` says that every observed key is a store miss and no key repeats: on a fresh
    /// record (the first store of a request) every key is then a new entry, appended without
    /// a search.
    pub(crate) fn record_store(
        &mut self,
        keys: &[OffloadKey],
        observed: &[OfferedKey],
        all_new: bool,
        misses: &mut Vec<usize>,
        new: &mut Vec<usize>,
        absent_entries: &mut Vec<u32>,
    ) {
        self.entries.reserve(observed.len());
        if all_new && self.entries.is_empty() && !self.finished {
            for (j, o) in observed.iter().enumerate() {
                let key = keys[o.at as usize];
                if let Some(w) = self.words.get_mut(j) {
                    *w = word_of(&key);
                    self.filter |= filter_bit(*w);
                }
                self.entries.push(Flagged {
                    key,
                    flags: SEEN | STORE_MISS,
                    row: NO_ROW,
                });
            }
            // Entry j is observed key j: each is absent, a first store miss and a first sighting.
            let n = observed.len();
            self.fresh_store = Some(n);
            absent_entries.extend(0..n as u32);
            misses.extend(0..n);
            new.extend(0..n);
            self.index_when_large();
            return;
        }
        self.fresh_store = None;
        for (j, o) in observed.iter().enumerate() {
            let ready = o.row != NO_ROW;
            let i = self.slot(&keys[o.at as usize]);
            let flags = self.entries[i].flags;
            let mut add = 0;
            if !ready {
                absent_entries.push(i as u32);
                if flags & STORE_MISS == 0 {
                    add |= STORE_MISS;
                    misses.push(j);
                }
            } else if flags & INSERTED == 0 {
                // Re-reading a chunk this request inserted is not a reuse.
                add |= REUSED;
            }
            self.entries[i].flags |= add;
            if self.see(i) {
                new.push(j);
            }
        }
    }

    /// Records loaded keys (all reuses), pinned in `rows`, in one pass; appends the indices
    /// (into `keys`) of first observations to `new`.
    pub(crate) fn record_load(&mut self, keys: &[OffloadKey], rows: &[u32], new: &mut Vec<usize>) {
        self.fresh_store = None;
        if self.entries.is_empty() && !self.finished && keys.len() <= SMALL_RECORD {
            self.record_first_load(keys, rows, new);
            return;
        }
        self.entries.reserve(keys.len());
        for (j, k) in keys.iter().enumerate() {
            let i = self.slot(k);
            self.entries[i].row = rows.get(j).copied().unwrap_or(NO_ROW);
            if self.see(i) {
                new.push(j);
            }
            if self.entries[i].flags & INSERTED == 0 {
                self.entries[i].flags |= REUSED;
            }
        }
    }

    /// [`RequestAccess::record_load`] into an empty, unfinished record of a batch that stays
    /// small enough to scan (a request's first load, the common case): every key is a first
    /// sighting and a reuse unless it repeats an earlier key of the batch, which only takes the
    /// later row. The same outcome as the general path without its per-key search setup.
    fn record_first_load(&mut self, keys: &[OffloadKey], rows: &[u32], new: &mut Vec<usize>) {
        self.entries.reserve_exact(keys.len());
        for (j, key) in keys.iter().enumerate() {
            let row = rows.get(j).copied().unwrap_or(NO_ROW);
            let w = word_of(key);
            let bit = filter_bit(w);
            let len = self.entries.len();
            // The filter settles most first sightings; a set bit means a scan of the words.
            let repeat = if self.filter & bit == 0 {
                None
            } else {
                (0..len).find(|&i| self.words[i] == w && self.entries[i].key == *key)
            };
            match repeat {
                Some(i) => self.entries[i].row = row,
                None => {
                    self.words[len] = w;
                    self.filter |= bit;
                    self.entries.push(Flagged {
                        key: *key,
                        flags: SEEN | REUSED,
                        row,
                    });
                    new.push(j);
                }
            }
        }
    }

    /// Marks the record finished and returns the observed keys head first: groups in ascending
    /// index, each sorted by position when every key of the group has one, then the whole list
    /// sorted by position (stably) when every key has one. `None` if already finished.
    pub(crate) fn finish(&mut self, ctx: &ReqContext) -> Option<Vec<ObservedKey>> {
        if self.finished {
            return None;
        }
        self.finished = true;
        let mut seen: Vec<ObservedKey> = self
            .entries
            .iter()
            .filter(|e| e.flags & SEEN != 0)
            .map(|e| ObservedKey {
                key: e.key,
                insertion_only: e.flags & (INSERTED | REUSED) == INSERTED,
                reused: e.flags & REUSED != 0,
                row: e.row,
            })
            .collect();
        if !ctx.has_key_positions() {
            // No key has a position: the order is by group, first observed within each (what
            // the general path below gives, without its buffers), and usually already is.
            if seen.windows(2).any(|w| w[0].key.group() > w[1].key.group()) {
                seen.sort_by_key(|o| o.key.group());
            }
            return Some(seen);
        }
        let mut positions = Vec::with_capacity(seen.len());
        let keys: Vec<OffloadKey> = seen.iter().map(|o| o.key).collect();
        ctx.key_positions_into(&keys, &mut positions);
        let mut all: Vec<(ObservedKey, Option<u64>)> = seen.drain(..).zip(positions).collect();
        // Stable: first-observed order within each group.
        all.sort_by_key(|(o, _)| o.key.group());
        let mut start = 0;
        while start < all.len() {
            let group = all[start].0.key.group();
            let end = start
                + all[start..]
                    .iter()
                    .take_while(|(o, _)| o.key.group() == group)
                    .count();
            let members = &mut all[start..end];
            if members.iter().all(|(_, p)| p.is_some()) {
                members.sort_by_key(|(_, p)| *p);
            }
            start = end;
        }
        if all.iter().all(|(_, p)| p.is_some()) {
            all.sort_by_key(|(_, p)| *p);
        }
        Some(all.into_iter().map(|(o, _)| o).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u64, group: u32) -> OffloadKey {
        OffloadKey::from_u64(n).with_group(group)
    }

    fn finished_keys(rec: &mut RequestAccess, ctx: &ReqContext) -> Option<Vec<OffloadKey>> {
        rec.finish(ctx).map(|v| v.into_iter().map(|o| o.key).collect())
    }

    /// An offer's keys and the observed entries of all of them (ready ones in row 0).
    fn offer(offer: &[(OffloadKey, bool)]) -> (Vec<OffloadKey>, Vec<OfferedKey>) {
        let keys = offer.iter().map(|&(key, _)| key).collect();
        let observed = (0u32..)
            .zip(offer)
            .map(|(at, &(_, ready))| OfferedKey {
                at,
                row: if ready { 0 } else { NO_ROW },
                ghost: crate::ghost_lists::NO_GHOST,
            })
            .collect();
        (keys, observed)
    }

    #[test]
    fn small_and_indexed_records_flag_the_same_keys() {
        // 100 keys crosses the scan limit: the index must agree with the scan before it.
        let mut rec = RequestAccess::fresh(1, 0);
        let keys: Vec<OffloadKey> = (0..100).map(|n| k(n, 0)).collect();
        rec.mark_inserted(&keys[..50]);
        let mut new = Vec::new();
        rec.record_load(&keys, &[], &mut new);
        assert_eq!(new, (0..100).collect::<Vec<_>>());
        new.clear();
        rec.record_load(&keys, &[], &mut new);
        assert!(new.is_empty(), "every key was seen already");
        for (n, key) in keys.iter().enumerate() {
            assert_eq!(rec.inserted(key), n < 50, "key {n}");
            assert_eq!(rec.reused(key), n >= 50, "key {n}");
        }
        let done = rec.finish(&ReqContext::local("r")).unwrap();
        assert_eq!(done.len(), 100);
        assert!(done[..50].iter().all(|o| o.insertion_only && !o.reused));
        assert!(done[50..].iter().all(|o| !o.insertion_only && o.reused));
    }

    /// The state of a record an observer can see: its entries' keys, flags and rows, in order.
    fn entries_of(rec: &RequestAccess) -> Vec<(OffloadKey, u8, u32)> {
        rec.entries.iter().map(|e| (e.key, e.flags, e.row)).collect()
    }

    #[test]
    fn a_first_load_records_what_the_general_path_records() {
        // Repeats (also of a key whose filter bit another key shares) take the later row and
        // are reported new once. The general path runs on a record that is not empty.
        let batch: Vec<OffloadKey> = [1, 2, 1, 3, 2, 4, 5, 1].into_iter().map(|n| k(n, 0)).collect();
        let rows: Vec<u32> = (10..18).collect();
        let mut first = RequestAccess::fresh(1, 0);
        let mut new_first = Vec::new();
        first.record_load(&batch, &rows, &mut new_first);
        let mut general = RequestAccess::fresh(1, 0);
        general.entries.push(Flagged {
            key: k(99, 0),
            flags: 0,
            row: NO_ROW,
        });
        general.words[0] = word_of(&k(99, 0));
        general.filter = filter_bit(general.words[0]);
        let mut new_general = Vec::new();
        general.record_load(&batch, &rows, &mut new_general);
        assert_eq!(new_first, vec![0, 1, 3, 5, 6]);
        assert_eq!(new_first, new_general);
        assert_eq!(entries_of(&first), entries_of(&general)[1..].to_vec());
        assert_eq!(entries_of(&first)[0], (k(1, 0), SEEN | REUSED, 17));
        let mut hints = Vec::new();
        first.row_hints(&batch, &mut hints);
        assert_eq!(hints, vec![17, 14, 17, 13, 14, 15, 16, 17]);
    }

    #[test]
    fn row_hints_name_the_rows_loads_pinned_and_stores_reserved() {
        let mut rec = RequestAccess::fresh(1, 0);
        let mut new = Vec::new();
        rec.record_load(&[k(1, 0), k(2, 0)], &[7, 8], &mut new);
        // A store offer with a repeated absent key: the entry gets the row of its one insertion.
        let (mut misses, mut absent) = (Vec::new(), Vec::new());
        let (keys, observed) = offer(&[(k(5, 0), false), (k(6, 0), false), (k(5, 0), false)]);
        rec.record_store(&keys, &observed, false, &mut misses, &mut new, &mut absent);
        rec.mark_inserted_entries(&absent, &[k(5, 0), k(6, 0)], &[30, 31]);
        let mut hints = Vec::new();
        // In recorded order, out of order, and a key the request never saw.
        rec.row_hints(&[k(1, 0), k(2, 0), k(5, 0), k(6, 0)], &mut hints);
        assert_eq!(hints, vec![7, 8, 30, 31]);
        hints.clear();
        rec.row_hints(&[k(6, 0), k(9, 0), k(1, 0), k(5, 0)], &mut hints);
        assert_eq!(hints, vec![31, NO_ROW, 7, 30]);
        assert!(rec.inserted(&k(5, 0)) && rec.inserted(&k(6, 0)) && !rec.inserted(&k(1, 0)));
    }

    #[test]
    fn a_first_store_of_new_keys_pairs_entries_and_rows_by_index() {
        let mut rec = RequestAccess::fresh(1, 0);
        let (mut misses, mut new, mut absent) = (Vec::new(), Vec::new(), Vec::new());
        let (keys, observed) = offer(&[(k(1, 0), false), (k(2, 0), false), (k(3, 0), false)]);
        rec.record_store(&keys, &observed, true, &mut misses, &mut new, &mut absent);
        assert_eq!(
            (misses.clone(), new.clone(), absent.clone()),
            (vec![0, 1, 2], vec![0, 1, 2], vec![0, 1, 2])
        );
        rec.mark_inserted_entries(&absent, &keys, &[40, 41, 42]);
        let mut hints = Vec::new();
        rec.row_hints(&[k(3, 0), k(1, 0), k(2, 0)], &mut hints);
        assert_eq!(hints, vec![42, 40, 41]);
        assert!(keys.iter().all(|key| rec.inserted(key) && !rec.reused(key)));
        // A second store of the same request takes the searching path: a repeated new key and
        // a key it inserted before, which is marked again with its new row.
        let (keys, observed) = offer(&[(k(4, 0), false), (k(4, 0), false), (k(1, 0), false)]);
        absent.clear();
        rec.record_store(&keys, &observed, false, &mut misses, &mut new, &mut absent);
        rec.mark_inserted_entries(&absent, &[k(4, 0), k(1, 0)], &[50, 51]);
        hints.clear();
        rec.row_hints(&[k(4, 0), k(1, 0), k(2, 0)], &mut hints);
        assert_eq!(hints, vec![50, 51, 41]);
    }

    #[test]
    fn finish_orders_by_group_then_by_position_when_complete() {
        let ctx = ReqContext::local("r");
        let mut rec = RequestAccess::fresh(1, 0);
        let mut new = Vec::new();
        let keys = [k(3, 1), k(1, 0), k(2, 0), k(4, 1)];
        rec.record_load(&keys, &[], &mut new);
        assert_eq!(new, vec![0, 1, 2, 3]);
        // No positions: group 0 first, first-seen order within groups.
        let mut no_pos = RequestAccess::fresh(1, 0);
        no_pos.record_load(&keys, &[], &mut Vec::new());
        assert_eq!(
            finished_keys(&mut no_pos, &ctx),
            Some(vec![k(1, 0), k(2, 0), k(3, 1), k(4, 1)])
        );
        assert_eq!(no_pos.finish(&ctx), None, "finishing twice does nothing");
        // Every key positioned: one global order by position, groups interleaved.
        for (key, pos) in [(k(1, 0), 20), (k(2, 0), 10), (k(3, 1), 15), (k(4, 1), 5)] {
            ctx.set_key_position(key, pos);
        }
        assert_eq!(
            finished_keys(&mut rec, &ctx),
            Some(vec![k(4, 1), k(2, 0), k(3, 1), k(1, 0)])
        );
    }

    #[test]
    fn reuse_excludes_own_insertions_and_late_keys_are_ignored() {
        let mut rec = RequestAccess::fresh(1, 0);
        rec.mark_inserted(&[k(1, 0)]);
        let mut new = Vec::new();
        rec.record_load(&[k(1, 0), k(2, 0)], &[7, 8], &mut new);
        assert!(rec.reused(&k(2, 0)) && !rec.reused(&k(1, 0)));
        assert!(rec.inserted(&k(1, 0)) && !rec.inserted(&k(2, 0)));
        let (mut misses, mut new) = (Vec::new(), Vec::new());
        let (keys, observed) = offer(&[
            (k(5, 0), false),
            (k(5, 0), false),
            (k(6, 0), false),
            (k(2, 0), true),
        ]);
        rec.record_store(&keys, &observed, false, &mut misses, &mut new, &mut Vec::new());
        assert_eq!((misses.clone(), new.clone()), (vec![0, 2], vec![0, 2]));
        rec.finish(&ReqContext::local("r"));
        misses.clear();
        new.clear();
        let mut absent = Vec::new();
        let (keys, observed) = offer(&[(k(6, 0), false), (k(9, 0), false)]);
        rec.record_store(&keys, &observed, false, &mut misses, &mut new, &mut absent);
        assert_eq!(absent.len(), 2, "absent keys are reported even after finish");
        assert_eq!(
            misses,
            vec![1],
            "store misses still count once per key after finish"
        );
        assert!(new.is_empty(), "new keys are not recorded after finish");
    }
}
