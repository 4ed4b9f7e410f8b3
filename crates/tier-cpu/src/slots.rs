//! The chunk table: which key lives in which arena row, each row's ref count, and the row
//! allocator.
//!
//! Each row's key and ref count sit side by side in one [`Row`] (40 bytes), and a compact
//! [`KeyIndex`] maps keys to rows; a lookup probes one index slot and confirms the key on the
//! row it names, which is the line holding the ref count the answer needs. Policies read the
//! same rows through [`SlotView`], defined here (it is a view of this table's state; the policy
//! module re-exports it as part of the policy contract), and a store offer's probe outcome for
//! each new key is a [`NewKey`].
//!
//! Row allocation follows vLLM 0.33.0: rows never handed out before go first, in ascending order;
//! after that, freed rows are reused last-in-first-out.
//!
//! The index also holds the ghosts of a policy that keeps [`GhostLists`]: an index id with the
//! [`GHOST`] bit names a ghost, not a row. A key is resident or a ghost, never both, so it has
//! at most one index slot, and moving between the two renames that slot in place.

use tiering_core::{OffloadKey, TierError, arena::ChunkId};

use crate::ghost_lists::{GHOST_LISTS, GhostLists};
use crate::index::{KeyIndex, digest_of, same_key};

/// The bit of an index id that makes it a ghost id (see the module docs); rows stay below it.
pub(crate) const GHOST: u32 = 1 << 31;

/// The most rows a table holds (ids with the [`GHOST`] bit name ghosts, and the id just below
/// it is [`RESERVED`]).
pub(crate) const MAX_ROWS: u64 = RESERVED as u64;

/// The index id of a slot a store offer reserved for a new key until the key gets its row (see
/// [`ChunkTable::probe_for_store`]); it names no row, so no probe matches it.
const RESERVED: u32 = GHOST - 1;

/// No reserved index slot.
pub(crate) const NO_SLOT: usize = usize::MAX;

/// What one probe of the index found for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    /// Neither resident nor a ghost.
    Absent,
    /// Resident.
    Resident(Entry),
    /// A ghost, with its id.
    Ghost(u32),
}

/// What inserting a key a store offer is storing needs from the offer's probe of it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NewKey {
    /// The key's digest.
    pub(crate) digest: u64,
    /// The index slot reserved for the key ([`NO_SLOT`] when none: a ghost, renamed instead).
    pub(crate) slot: usize,
    /// The key's ghost id when it was a ghost ([`NO_GHOST`](crate::ghost_lists::NO_GHOST) otherwise).
    pub(crate) ghost: u32,
}

/// Ref count of a row whose write is in flight.
pub(crate) const WRITING: i32 = -1;

/// Keys of a batch whose lines [`ChunkTable::digest_batch`] requests ahead.
const PREFETCH_WINDOW: usize = 32;

/// Tables that track at most this many keys (rows, plus the ghosts a policy may keep weighed
/// by [`GHOST_WEIGHT`]) skip prefetching: their metadata mostly stays cached, where a prefetch
/// finds its line already there and only costs its instructions.
const PREFETCH_MIN_KEYS: u64 = 16_384;

/// How many ghosts of a policy's bound count as one key against [`PREFETCH_MIN_KEYS`]. A ghost
/// has an index slot, a record and a log element but no row, rank or links, and ARC, whose bound
/// is a row's worth per list, usually keeps about one list's worth in all. Counting each ghost
/// as a full key made a 10k-row ARC tier prefetch, and its stores paid more in instructions
/// (about 1.7k of 18k a call, counted by callgrind) than the prefetches saved (10k ARC
/// store16+evict alone, thread CPU, 24 interleaved runs each: median 2213 -> 2115 ns, min 2126
/// -> 2029, 19/24 faster; touch16 and load16 unchanged: 9/20 and 10/20). Empirical; an LRU
/// tier (no ghosts) is unaffected.
const GHOST_WEIGHT: u64 = 4;

/// Ref count of a row that holds no key.
pub(crate) const FREE: i32 = i32::MIN;

/// One arena row's metadata: the key it holds and its ref count (see the crate docs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Row {
    pub(crate) key: OffloadKey,
    pub(crate) ref_cnt: i32,
}

/// A resident key's row and ref count (a copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) chunk: ChunkId,
    pub(crate) ref_cnt: i32,
}

/// The tier's per-chunk state, read-only, as policies see it.
#[derive(Clone, Copy)]
pub struct SlotView<'a> {
    rows: &'a [Row],
    index: &'a KeyIndex,
    ghosts: &'a GhostLists,
}

impl<'a> SlotView<'a> {
    /// A view over the tier's rows (key and ref count per chunk; −1 = write in flight), the
    /// key index leading to them and the ghost lists the tier keeps for the policy.
    pub(crate) fn new(rows: &'a [Row], index: &'a KeyIndex, ghosts: &'a GhostLists) -> Self {
        Self { rows, index, ghosts }
    }

    /// The digest of the key in (resident) `chunk`, after starting to load the tier's index
    /// slot for it: an eviction victim's slot is about to be cleared, and a ghost entry the
    /// policy keeps itself is indexed by the same digest. A hint only.
    #[inline]
    pub(crate) fn prefetch_index_of(&self, chunk: ChunkId) -> u64 {
        let digest = digest_of(&self.rows[chunk as usize].key);
        self.index.prefetch(digest);
        digest
    }

    /// Number of keys in the tier's ghost list `list` (see
    /// [`EvictionPolicy::ghost_bound`](crate::policy::EvictionPolicy::ghost_bound)); 0 for a list the tier does not keep.
    #[inline]
    #[must_use]
    pub fn ghost_len(&self, list: usize) -> usize {
        if list < GHOST_LISTS {
            self.ghosts.len(list)
        } else {
            0
        }
    }

    /// The keys of the tier's ghost list `list`, oldest first (for snapshots).
    #[must_use]
    pub fn ghost_keys(&self, list: usize) -> Vec<OffloadKey> {
        if list >= GHOST_LISTS {
            return Vec::new();
        }
        self.ghosts.iter(list).map(|g| *self.ghosts.key(g)).collect()
    }

    /// Whether the (resident) chunk is readable: its write has completed.
    #[inline]
    #[must_use]
    pub fn is_ready(&self, chunk: ChunkId) -> bool {
        self.rows[chunk as usize].ref_cnt >= 0
    }

    /// Whether the (resident) chunk may be evicted: ready and unpinned.
    #[inline]
    #[must_use]
    pub fn is_evictable(&self, chunk: ChunkId) -> bool {
        self.rows[chunk as usize].ref_cnt == 0
    }

    /// The key stored in the (resident) chunk.
    #[inline]
    #[must_use]
    pub fn key(&self, chunk: ChunkId) -> OffloadKey {
        self.rows[chunk as usize].key
    }
}

/// See the module docs.
pub(crate) struct ChunkTable {
    index: KeyIndex,
    rows: Vec<Row>,
    ghosts: GhostLists,
    free: Vec<ChunkId>,
    /// Rows a reset left out of the free list because a write to them was in flight (see
    /// [`ChunkTable::clear_fencing_writes`]).
    fenced: Vec<ChunkId>,
    num_allocated: u32,
    capacity: u32,
    /// Whether batches request their lines ahead (see [`PREFETCH_MIN_KEYS`]).
    prefetching: bool,
    /// Resident rows with ref count 0.
    pub(crate) num_evictable: usize,
    /// Resident rows with ref count −1.
    pub(crate) num_write_pending: usize,
}

impl ChunkTable {
    /// A table of `capacity` rows (`capacity` ≤ [`MAX_ROWS`], checked by the tier) whose ghost
    /// lists will hold up to `max_ghosts` keys in all (0 for a policy that keeps none).
    pub(crate) fn new(capacity: u32, max_ghosts: u64) -> Self {
        let n = capacity as usize;
        Self {
            index: KeyIndex::with_capacity(n),
            rows: crate::memory::filled_vec(
                n,
                Row {
                    key: OffloadKey::new([0; 32], 0),
                    ref_cnt: FREE,
                },
            ),
            ghosts: GhostLists::new(),
            free: Vec::new(),
            fenced: Vec::new(),
            num_allocated: 0,
            capacity,
            prefetching: u64::from(capacity).saturating_add(max_ghosts / GHOST_WEIGHT) > PREFETCH_MIN_KEYS,
            num_evictable: 0,
            num_write_pending: 0,
        }
    }

    /// Computes the digest of every key of a batch into `digests` (the probes of the batch take
    /// them from there instead of hashing each key again) and starts loading, for the first keys,
    /// their index slots and then the rows they probably name, so the batch's cache misses
    /// overlap instead of queueing one key at a time. The prefetches are hints only.
    pub(crate) fn digest_batch(&self, keys: &[OffloadKey], digests: &mut Vec<u64>) {
        self.digest_batch_with(keys, digests, |_| {});
    }

    /// [`ChunkTable::digest_batch`] that also hands the rows it requests to `on_rows`, once per
    /// batch whose lines it requests ahead (not at all when the table is small enough to stay
    /// cached, or for a single key), for the caller to request what it will read about them.
    pub(crate) fn digest_batch_with(
        &self,
        keys: &[OffloadKey],
        digests: &mut Vec<u64>,
        on_rows: impl FnOnce(&[ChunkId]),
    ) {
        digests.clear();
        digests.extend(keys.iter().map(digest_of));
        if keys.len() < 2 || !self.prefetching {
            return;
        }
        // More lines than the core can have in flight would only evict each other.
        let window = &digests[..keys.len().min(PREFETCH_WINDOW)];
        for &d in window {
            self.index.prefetch(d);
        }
        let mut rows = [0; PREFETCH_WINDOW];
        let mut found = 0;
        for &d in window {
            match self.index.likely(d) {
                Some(id) if id & GHOST == 0 => {
                    crate::memory::prefetch(&self.rows[id as usize]);
                    rows[found] = id;
                    found += 1;
                }
                Some(id) => self.ghosts.prefetch(id & !GHOST),
                None => {}
            }
        }
        on_rows(&rows[..found]);
    }

    /// The digest of the key held in `row`.
    #[inline]
    pub(crate) fn digest_of_row(&self, row: ChunkId) -> u64 {
        digest_of(&self.rows[row as usize].key)
    }

    /// Puts the digests of the keys held in `rows` (about to be released) into `digests`, and
    /// starts loading their index slots.
    pub(crate) fn digest_rows(&self, rows: &[ChunkId], digests: &mut Vec<u64>) {
        digests.clear();
        digests.extend(rows.iter().map(|&row| digest_of(&self.rows[row as usize].key)));
        if !self.prefetching {
            return;
        }
        for &d in digests.iter().take(PREFETCH_WINDOW) {
            self.index.prefetch(d);
        }
    }

    /// The row holding `key`, whose digest is `digest`.
    #[inline]
    fn find(&self, key: &OffloadKey, digest: u64) -> Option<ChunkId> {
        // A ghost id (GHOST bit set) is beyond every row, so the bounds check rejects it.
        self.index.find(digest, |id| {
            self.rows.get(id as usize).is_some_and(|r| same_key(&r.key, key))
        })
    }

    /// Whether index id `id` (a row, a ghost or [`RESERVED`]) holds `key`.
    #[inline(always)]
    fn holds(&self, id: u32, key: &OffloadKey) -> bool {
        if id & GHOST == 0 {
            // RESERVED is beyond every row, so the bounds check rejects it.
            self.rows.get(id as usize).is_some_and(|r| same_key(&r.key, key))
        } else {
            same_key(self.ghosts.key(id & !GHOST), key)
        }
    }

    /// Whether `key`, whose digest is `digest`, is resident, a ghost or neither: one probe run.
    #[inline(always)]
    pub(crate) fn probe(&self, key: &OffloadKey, digest: u64) -> Probe {
        match self.index.find(digest, |id| self.holds(id, key)) {
            None => Probe::Absent,
            Some(id) if id & GHOST != 0 => Probe::Ghost(id & !GHOST),
            Some(chunk) => Probe::Resident(Entry {
                chunk,
                ref_cnt: self.rows[chunk as usize].ref_cnt,
            }),
        }
    }

    /// What a store offer's probe of `key`, whose digest is `digest`, found: `Ok` with the key's
    /// row or ghost, or `Err` with the vacancy that ends its probe run, which
    /// [`ChunkTable::reserve_slot`] can take for it at once. Call
    /// [`ChunkTable::reserve_for_batch`] before the batch's first probe.
    #[inline(always)]
    pub(crate) fn probe_for_store(&self, key: &OffloadKey, digest: u64) -> Result<Probe, usize> {
        match self.index.find_or_vacancy(digest, |id| self.holds(id, key)) {
            Err(vacancy) => Err(vacancy),
            Ok(id) if id & GHOST != 0 => Ok(Probe::Ghost(id & !GHOST)),
            Ok(chunk) => Ok(Probe::Resident(Entry {
                chunk,
                ref_cnt: self.rows[chunk as usize].ref_cnt,
            })),
        }
    }

    /// Makes room in the index for `n` more keys, so that slots reserved by the next `n`
    /// [`ChunkTable::reserve_slot`] calls stay where they are (nothing is rehashed).
    pub(crate) fn reserve_for_batch(&mut self, n: usize) {
        self.index.reserve(n);
    }

    /// Takes `vacancy`, the slot [`ChunkTable::probe_for_store`] just returned for an absent key
    /// whose digest is `digest`, with nothing changed in the index since, so the key's
    /// insertion ([`ChunkTable::insert_writing`] with the returned hint) finds its slot without
    /// walking the run again; [`ChunkTable::cancel_slot`] gives it back. Returns the hint.
    #[inline]
    pub(crate) fn reserve_slot(&mut self, vacancy: usize, digest: u64) -> usize {
        self.index.occupy(vacancy, digest, RESERVED);
        vacancy
    }

    /// Gives back a slot [`ChunkTable::reserve_slot`] took for a key whose digest is `digest`
    /// (its store failed before the insertion).
    pub(crate) fn cancel_slot(&mut self, digest: u64) {
        self.index.remove(digest, RESERVED);
    }

    /// The ghost lists.
    #[inline]
    pub(crate) fn ghosts(&self) -> &GhostLists {
        &self.ghosts
    }

    /// Moves live ghost `g` to the back of its list.
    #[inline]
    pub(crate) fn ghost_to_back(&mut self, g: u32) {
        self.ghosts.move_to_back(g);
    }

    /// Starts loading what the ghost lists will touch when `n` more victims join them and each
    /// is then trimmed to `bound`: the records new ghosts take and the index slots of the ghosts
    /// the trims drop. A hint only.
    pub(crate) fn prefetch_ghost_trims(&self, n: usize, bound: usize) {
        if !self.prefetching {
            return;
        }
        self.ghosts.prefetch_free(n);
        let mut oldest = [(0u32, 0u32); 32];
        for l in 0..GHOST_LISTS {
            let after = self.ghosts.len(l) + n;
            if after > bound {
                let want = (after - bound).min(oldest.len());
                let got = self.ghosts.oldest(l, &mut oldest[..want]);
                for &(_, tag) in &oldest[..got] {
                    self.index.prefetch_tag(tag);
                }
            }
        }
    }

    /// Whether batches request their lines ahead (the table is too large to stay cached).
    #[inline]
    pub(crate) fn prefetches(&self) -> bool {
        self.prefetching
    }

    /// Rows in the tier.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// Resident keys.
    pub(crate) fn len(&self) -> usize {
        self.index.len() - self.ghosts.total()
    }

    /// Rows available without eviction.
    pub(crate) fn num_free(&self) -> usize {
        self.free.len() + (self.capacity - self.num_allocated) as usize
    }

    /// Rows pinned: in flight or read.
    pub(crate) fn num_pinned(&self) -> usize {
        self.len() - self.num_evictable
    }

    /// The resident entry of `key`.
    #[inline]
    pub(crate) fn get(&self, key: &OffloadKey) -> Option<Entry> {
        self.get_digested(key, digest_of(key))
    }

    /// The resident entry of `key`, whose digest is `digest`.
    #[inline]
    pub(crate) fn get_digested(&self, key: &OffloadKey, digest: u64) -> Option<Entry> {
        self.find(key, digest).map(|chunk| Entry {
            chunk,
            ref_cnt: self.rows[chunk as usize].ref_cnt,
        })
    }

    /// The ref count of a resident row.
    #[inline]
    pub(crate) fn ref_of(&self, chunk: ChunkId) -> i32 {
        self.rows[chunk as usize].ref_cnt
    }

    /// Every resident entry, in row order.
    pub(crate) fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        self.rows[..self.num_allocated as usize]
            .iter()
            .zip(0..)
            .filter(|(r, _)| r.ref_cnt != FREE)
            .map(|(r, chunk)| Entry {
                chunk,
                ref_cnt: r.ref_cnt,
            })
    }

    /// The policies' view of the rows.
    #[inline]
    pub(crate) fn view(&self) -> SlotView<'_> {
        SlotView::new(&self.rows, &self.index, &self.ghosts)
    }

    /// Adds one reader to resident, ready `key`. Returns its row and whether it just stopped
    /// being evictable (0 → 1); an absent key, a write in flight or a reader count at its limit
    /// is an error and changes nothing.
    #[inline]
    pub(crate) fn pin(&mut self, key: &OffloadKey, digest: u64) -> Result<(ChunkId, bool), TierError> {
        let Some(chunk) = self.find(key, digest) else {
            return Err(TierError::NotFound(*key));
        };
        let r = &mut self.rows[chunk as usize].ref_cnt;
        if *r < 0 {
            return Err(TierError::NotReady(*key));
        }
        if *r == i32::MAX {
            return Err(TierError::Other(format!("key {key} has too many readers")));
        }
        let edge = *r == 0;
        *r += 1;
        if edge {
            self.num_evictable -= 1;
        }
        Ok((chunk, edge))
    }

    /// Removes one reader from pinned `key`. Returns its row and whether it just became
    /// evictable (1 → 0); an absent or unpinned key is an error and changes nothing.
    #[inline]
    pub(crate) fn unpin(&mut self, key: &OffloadKey, digest: u64) -> Result<(ChunkId, bool), TierError> {
        let Some(chunk) = self.find(key, digest) else {
            return Err(TierError::NotFound(*key));
        };
        let r = &mut self.rows[chunk as usize].ref_cnt;
        if *r <= 0 {
            return Err(TierError::NotPinned(*key));
        }
        *r -= 1;
        let edge = *r == 0;
        if edge {
            self.num_evictable += 1;
        }
        Ok((chunk, edge))
    }

    /// The ref count of `row` when it holds resident `key` (a row hint checked: a key is resident
    /// in one row at most, so a resident row holding it is its row).
    #[inline]
    pub(crate) fn hinted(&self, row: ChunkId, key: &OffloadKey) -> Option<i32> {
        let r = self.rows.get(row as usize)?;
        (r.ref_cnt != FREE && same_key(&r.key, key)).then_some(r.ref_cnt)
    }

    /// Starts loading the rows named by `hints` (rows about to be checked by
    /// [`ChunkTable::hinted`]).
    pub(crate) fn prefetch_rows(&self, hints: &[ChunkId]) {
        if !self.prefetching {
            return;
        }
        for &row in hints.iter().take(PREFETCH_WINDOW) {
            if let Some(r) = self.rows.get(row as usize) {
                crate::memory::prefetch(r);
            }
        }
    }

    /// Removes one reader from `row`, which holds resident `key`: the row and whether it just
    /// became evictable, as [`ChunkTable::unpin`], whose probe it saves when the hint is right
    /// (else it probes).
    #[inline]
    pub(crate) fn unpin_hinted(
        &mut self,
        key: &OffloadKey,
        row: ChunkId,
    ) -> Result<(ChunkId, bool), TierError> {
        match self.hinted(row, key) {
            Some(r) if r > 0 => {
                let ref_cnt = &mut self.rows[row as usize].ref_cnt;
                *ref_cnt -= 1;
                let edge = *ref_cnt == 0;
                if edge {
                    self.num_evictable += 1;
                }
                Ok((row, edge))
            }
            Some(_) => Err(TierError::NotPinned(*key)),
            None => self.unpin(key, digest_of(key)),
        }
    }

    /// Completes the write of `key`, hinted to be in `row`, as [`ChunkTable::mark_written`]
    /// (which it falls back to when the hint is wrong).
    #[inline]
    pub(crate) fn mark_written_hinted(&mut self, key: &OffloadKey, row: ChunkId) -> Option<ChunkId> {
        match self.hinted(row, key) {
            Some(WRITING) => {
                self.rows[row as usize].ref_cnt = 0;
                self.num_write_pending -= 1;
                self.num_evictable += 1;
                Some(row)
            }
            Some(_) => None,
            None => self.mark_written(key, digest_of(key)),
        }
    }

    /// Undoes one successful [`ChunkTable::unpin`] of `key` (rolling back a batch).
    pub(crate) fn repin(&mut self, key: &OffloadKey) {
        if let Some(chunk) = self.find(key, digest_of(key)) {
            let r = &mut self.rows[chunk as usize].ref_cnt;
            if *r == 0 {
                self.num_evictable -= 1;
            }
            *r += 1;
        }
    }

    /// Completes the write of `key` if it is in flight. Returns its row then.
    #[inline]
    pub(crate) fn mark_written(&mut self, key: &OffloadKey, digest: u64) -> Option<ChunkId> {
        let chunk = self.find(key, digest)?;
        let r = &mut self.rows[chunk as usize].ref_cnt;
        if *r != WRITING {
            return None;
        }
        *r = 0;
        self.num_write_pending -= 1;
        self.num_evictable += 1;
        Some(chunk)
    }

    /// Takes `n` rows: fresh ones ascending, then freed ones LIFO. The caller made room first.
    pub(crate) fn allocate(&mut self, n: usize, out: &mut Vec<ChunkId>) -> bool {
        if n > self.num_free() {
            return false;
        }
        let fresh = n.min((self.capacity - self.num_allocated) as usize);
        for _ in 0..fresh {
            out.push(self.num_allocated);
            self.num_allocated += 1;
        }
        for _ in fresh..n {
            match self.free.pop() {
                Some(c) => out.push(c),
                None => return false,
            }
        }
        true
    }

    /// Makes `key`, whose digest is `digest`, resident in `chunk` with a write in flight.
    /// `ghost` is the ghost id a probe of this key found earlier ([`NO_GHOST`] if none): when
    /// it still is `key`'s ghost (an eviction since may have dropped it), the ghost is revived
    /// in place, its index slot renamed to `chunk`. Else `slot` is the hint
    /// [`ChunkTable::reserve_slot`] returned for the key ([`NO_SLOT`] if none): the reserved
    /// slot is renamed to `chunk`, or the key inserted.
    ///
    /// [`NO_GHOST`]: crate::ghost_lists::NO_GHOST
    #[inline]
    pub(crate) fn insert_writing(
        &mut self,
        key: OffloadKey,
        digest: u64,
        chunk: ChunkId,
        ghost: u32,
        slot: usize,
    ) {
        let tag = KeyIndex::tag(digest);
        if self.ghosts.is_live_ghost_of(ghost, &key) && self.index.replace_tagged(tag, ghost | GHOST, chunk) {
            self.ghosts.remove(ghost);
        } else if slot == NO_SLOT || !self.index.replace_at(slot, tag, RESERVED, chunk) {
            self.index.insert(digest, chunk);
        }
        self.rows[chunk as usize] = Row {
            key,
            ref_cnt: WRITING,
        };
        self.num_write_pending += 1;
    }

    /// Drops the key stored in `chunk` and frees the row. Returns the key.
    pub(crate) fn release(&mut self, chunk: ChunkId) -> OffloadKey {
        let digest = digest_of(&self.rows[chunk as usize].key);
        self.release_digested(chunk, digest)
    }

    /// [`ChunkTable::release`] of a row whose key's digest is `digest`.
    pub(crate) fn release_digested(&mut self, chunk: ChunkId, digest: u64) -> OffloadKey {
        let key = self.free_row(chunk);
        self.index.remove(digest, chunk);
        self.free.push(chunk);
        key
    }

    /// Marks row `chunk` free, off the pending-write or evictable count it was on; returns
    /// its key (the index and the free list are the caller's).
    #[inline]
    fn free_row(&mut self, chunk: ChunkId) -> OffloadKey {
        let row = &mut self.rows[chunk as usize];
        match row.ref_cnt {
            WRITING => self.num_write_pending -= 1,
            0 => self.num_evictable -= 1,
            _ => {}
        }
        row.ref_cnt = FREE;
        row.key
    }

    /// [`ChunkTable::release_digested`] that keeps the key as a ghost at the back of ghost list
    /// `list`: its index slot is renamed to the ghost in place.
    #[inline]
    pub(crate) fn release_to_ghost(&mut self, chunk: ChunkId, digest: u64, list: usize) -> OffloadKey {
        let key = self.free_row(chunk);
        let tag = KeyIndex::tag(digest);
        match self.ghosts.push(list, key, tag) {
            Some(g) => {
                if !self.index.replace_tagged(tag, chunk, g | GHOST) {
                    // Unreachable (a resident row has its index slot); stay consistent anyway.
                    self.ghosts.remove(g);
                }
            }
            None => {
                self.index.remove(digest, chunk);
            }
        }
        self.free.push(chunk);
        key
    }

    /// Drops the oldest ghosts of every list until each holds at most `bound`. The first
    /// `requested` of each list are dropped at once (their index slots were requested by
    /// [`ChunkTable::prefetch_ghost_trims`], or the table is small enough to be cached); any
    /// further ones a batch at a time: the batch is read from the front of the list's log, its
    /// index slots requested, and only then removed.
    pub(crate) fn trim_ghosts(&mut self, bound: usize, requested: usize) {
        let mut batch = [(0u32, 0u32); 32];
        for l in 0..GHOST_LISTS {
            let direct = self.ghosts.len(l).saturating_sub(bound).min(requested);
            for _ in 0..direct {
                if let Some((g, tag)) = self.ghosts.pop_oldest(l) {
                    self.index.remove_tagged(tag, g | GHOST);
                }
            }
            while self.ghosts.len(l) > bound {
                let excess = (self.ghosts.len(l) - bound).min(batch.len());
                let got = self.ghosts.oldest(l, &mut batch[..excess]);
                for &(_, tag) in &batch[..got] {
                    self.index.prefetch_tag(tag);
                }
                for _ in 0..got {
                    if let Some((g, tag)) = self.ghosts.pop_oldest(l) {
                        self.index.remove_tagged(tag, g | GHOST);
                    }
                }
            }
        }
    }

    /// Forgets every key and every allocation (fenced rows included).
    pub(crate) fn clear(&mut self) {
        self.index.clear();
        self.ghosts.clear();
        for row in &mut self.rows[..self.num_allocated as usize] {
            row.ref_cnt = FREE;
        }
        self.free.clear();
        self.fenced.clear();
        self.num_allocated = 0;
        self.num_evictable = 0;
        self.num_write_pending = 0;
    }

    /// Forgets every key, but keeps the rows with a write in flight (and those an earlier
    /// reset fenced) out of allocation until [`ChunkTable::release_fence`]: an engine whose
    /// copies of those rows are still queued would otherwise write into rows handed to new
    /// keys. Returns how many rows are fenced.
    pub(crate) fn clear_fencing_writes(&mut self) -> usize {
        let mut fenced = std::mem::take(&mut self.fenced);
        fenced.extend((0..self.num_allocated).filter(|&c| self.rows[c as usize].ref_cnt == WRITING));
        self.clear();
        let Some(&top) = fenced.iter().max() else {
            return 0;
        };
        fenced.sort_unstable();
        // Rows up to the highest fenced one stay allocated; the unfenced ones among them are
        // free, pushed so they are taken in ascending order as fresh rows are.
        self.num_allocated = top + 1;
        self.free
            .extend((0..=top).rev().filter(|c| fenced.binary_search(c).is_err()));
        self.fenced = fenced;
        self.fenced.len()
    }

    /// Returns the rows a reset fenced to allocation; how many.
    pub(crate) fn release_fence(&mut self) -> usize {
        let n = self.fenced.len();
        // Taken after the rows freed since (LIFO), lowest first.
        self.free.extend(self.fenced.drain(..).rev());
        n
    }

    /// Checks the structural invariants; the first violation, described.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut owner = vec![false; self.capacity as usize];
        let (mut evictable, mut writing, mut resident) = (0, 0, 0);
        for (c, row) in self.rows.iter().enumerate() {
            if row.ref_cnt == FREE {
                continue;
            }
            let key = row.key;
            if c >= self.num_allocated as usize {
                return Err(format!("{key} holds row {c}, never allocated"));
            }
            if self.find(&key, digest_of(&key)) != Some(c as ChunkId) {
                return Err(format!("the index does not lead {key} to its row {c}"));
            }
            owner[c] = true;
            resident += 1;
            match row.ref_cnt {
                WRITING => writing += 1,
                0 => evictable += 1,
                r if r > 0 => {}
                r => return Err(format!("{key} has ref count {r}")),
            }
        }
        self.ghosts.check()?;
        for l in 0..GHOST_LISTS {
            for g in self.ghosts.iter(l) {
                let key = *self.ghosts.key(g);
                if self.probe(&key, digest_of(&key)) != Probe::Ghost(g) {
                    return Err(format!("the index does not lead {key} to its ghost {g}"));
                }
            }
        }
        if resident + self.ghosts.total() != self.index.len() {
            return Err(format!(
                "{resident} resident rows and {} ghosts, {} index entries",
                self.ghosts.total(),
                self.index.len()
            ));
        }
        for &c in self.free.iter().chain(&self.fenced) {
            if c >= self.num_allocated || std::mem::replace(&mut owner[c as usize], true) {
                return Err(format!("free or fenced row {c} is invalid or also owned"));
            }
        }
        if owner.iter().filter(|&&o| o).count() != self.num_allocated as usize {
            return Err("allocated rows are neither owned nor free".into());
        }
        if evictable != self.num_evictable || writing != self.num_write_pending {
            return Err(format!(
                "counters say {} evictable / {} writing, table has {evictable} / {writing}",
                self.num_evictable, self.num_write_pending
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod fence_tests {
    use super::*;
    use crate::ghost_lists::NO_GHOST;

    fn key(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    #[test]
    fn a_fencing_reset_keeps_rows_being_written_until_the_fence_is_released() {
        let mut t = ChunkTable::new(6, 0);
        let mut rows = Vec::new();
        assert!(t.allocate(4, &mut rows));
        for (i, &c) in rows.iter().enumerate() {
            t.insert_writing(key(i as u64), digest_of(&key(i as u64)), c, NO_GHOST, NO_SLOT);
        }
        // Rows 0 and 2 finished their writes; 1 and 3 are still being written.
        assert_eq!(t.mark_written(&key(0), digest_of(&key(0))), Some(0));
        assert_eq!(t.mark_written(&key(2), digest_of(&key(2))), Some(2));
        assert_eq!(t.clear_fencing_writes(), 2);
        t.check().unwrap();
        assert_eq!(t.num_free(), 4);
        let mut after = Vec::new();
        assert!(t.allocate(4, &mut after));
        after.sort_unstable();
        assert_eq!(after, vec![0, 2, 4, 5], "fenced rows 1 and 3 are not handed out");
        assert!(!t.allocate(1, &mut Vec::new()));
        // A second reset keeps the fence (nothing reported it flushed yet).
        assert_eq!(t.clear_fencing_writes(), 2);
        t.check().unwrap();
        assert_eq!(t.release_fence(), 2);
        t.check().unwrap();
        let mut all = Vec::new();
        assert!(t.allocate(6, &mut all));
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3, 4, 5]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ghost_lists::NO_GHOST;

    /// A table of `n` rows holding keys `0..n`, written.
    fn full_table(n: u32) -> ChunkTable {
        let mut t = ChunkTable::new(n, 0);
        let mut rows = Vec::new();
        assert!(t.allocate(n as usize, &mut rows));
        for (i, &c) in rows.iter().enumerate() {
            let key = OffloadKey::from_u64(i as u64);
            t.insert_writing(key, digest_of(&key), c, NO_GHOST, NO_SLOT);
            assert_eq!(t.mark_written(&key, digest_of(&key)), Some(c));
        }
        t
    }

    fn ghost_of(t: &ChunkTable, key: &OffloadKey) -> Option<u32> {
        match t.probe(key, digest_of(key)) {
            Probe::Ghost(g) => Some(g),
            _ => None,
        }
    }

    #[test]
    fn a_victim_becomes_a_ghost_in_place_and_a_stored_ghost_is_revived_in_place() {
        let mut t = full_table(4);
        let k = |n: u64| OffloadKey::from_u64(n);
        let released = t.release_to_ghost(0, digest_of(&k(0)), 0);
        assert_eq!(released, k(0));
        t.release_to_ghost(1, digest_of(&k(1)), 1);
        assert_eq!((t.len(), t.num_free(), t.num_evictable), (2, 2, 2));
        assert!(t.get(&k(0)).is_none(), "a ghost is not resident");
        let g0 = ghost_of(&t, &k(0)).unwrap();
        assert!(ghost_of(&t, &k(1)).is_some() && ghost_of(&t, &k(2)).is_none());
        assert_eq!((t.ghosts().len(0), t.ghosts().len(1)), (1, 1));
        t.check().unwrap();
        // Storing k(0) again, with the ghost id its probe found: the ghost leaves its list.
        let mut rows = Vec::new();
        assert!(t.allocate(1, &mut rows));
        t.insert_writing(k(0), digest_of(&k(0)), rows[0], g0, NO_SLOT);
        assert_eq!(
            t.probe(&k(0), digest_of(&k(0))),
            Probe::Resident(Entry {
                chunk: rows[0],
                ref_cnt: WRITING
            })
        );
        assert_eq!((t.ghosts().len(0), t.ghosts().len(1), t.len()), (0, 1, 3));
        t.check().unwrap();
    }

    #[test]
    fn a_stale_ghost_id_is_not_revived_for_another_key() {
        let mut t = full_table(4);
        let k = |n: u64| OffloadKey::from_u64(n);
        t.release_to_ghost(2, digest_of(&k(2)), 0);
        let stale = ghost_of(&t, &k(2)).unwrap();
        // An eviction drops k(2)'s ghost, and the next victim's ghost takes its id.
        t.trim_ghosts(0, 0);
        assert_eq!(ghost_of(&t, &k(2)), None);
        t.release_to_ghost(3, digest_of(&k(3)), 0);
        assert_eq!(ghost_of(&t, &k(3)), Some(stale), "ghost ids are recycled");
        let mut rows = Vec::new();
        assert!(t.allocate(1, &mut rows));
        t.insert_writing(k(2), digest_of(&k(2)), rows[0], stale, NO_SLOT);
        assert_eq!(ghost_of(&t, &k(3)), Some(stale), "k(3) stays a ghost");
        assert_eq!(t.get(&k(2)).map(|e| e.chunk), Some(rows[0]));
        assert_eq!(t.ghosts().len(0), 1);
        t.check().unwrap();
    }

    #[test]
    fn trims_drop_the_oldest_ghosts_of_each_list_and_clear_forgets_them() {
        let mut t = full_table(8);
        let k = |n: u64| OffloadKey::from_u64(n);
        for n in 0..6u32 {
            t.release_to_ghost(n, digest_of(&k(u64::from(n))), (n % 2) as usize);
        }
        t.ghost_to_back(ghost_of(&t, &k(0)).unwrap());
        // List 0 is 2, 4, 0; list 1 is 1, 3, 5.
        t.trim_ghosts(1, 1);
        assert_eq!(ghost_of(&t, &k(2)).or(ghost_of(&t, &k(4))), None);
        assert!(ghost_of(&t, &k(0)).is_some() && ghost_of(&t, &k(5)).is_some());
        assert_eq!((t.ghosts().len(0), t.ghosts().len(1)), (1, 1));
        assert_eq!(t.view().ghost_keys(0), vec![k(0)]);
        t.check().unwrap();
        t.clear();
        assert_eq!((t.len(), t.ghosts().total()), (0, 0));
        assert_eq!(ghost_of(&t, &k(0)), None);
        t.check().unwrap();
    }

    #[test]
    fn fresh_rows_ascend_then_freed_rows_come_back_lifo() {
        let mut t = ChunkTable::new(4, 0);
        let mut out = Vec::new();
        assert!(t.allocate(3, &mut out));
        assert_eq!(out, vec![0, 1, 2]);
        for (i, &c) in out.iter().enumerate() {
            let key = OffloadKey::from_u64(i as u64);
            t.insert_writing(key, digest_of(&key), c, NO_GHOST, NO_SLOT);
        }
        t.release(0);
        t.release(1);
        out.clear();
        assert!(t.allocate(3, &mut out));
        assert_eq!(out, vec![3, 1, 0]);
        out.clear();
        assert!(!t.allocate(1, &mut out));
    }
}
