//! A compact open-addressing index from keys to dense `u32` ids (arena rows, ghost slots), and
//! how the tier digests and compares keys for it ([`digest_of`], [`same_key`]).
//!
//! The index stores no keys: each slot is one `u64` holding a 32-bit tag taken from the key's
//! digest and the id, and the owner of the ids keeps the keys (the chunk table keeps each row's
//! key next to its ref count, so confirming a match reads the line a lookup needs anyway). At a
//! load factor of at most one half, a slot costs 8–16 bytes per key, against the ~45 of a
//! general hash map holding the key itself, which matters at 10M rows.
//!
//! Linear probing; the home slot is derived from the tag alone (`tag × slots / 2³²`), so the
//! table can grow without the keys, and removal shifts later members of the run back instead of
//! leaving tombstones, so probe runs never rot under churn.

use tiering_core::OffloadKey;

/// The 64-bit digest the tier's indexes hash a key by: two words of the key's (already random)
/// hash and its group, mixed. Defined here rather than taken from `OffloadKey::digest` so it
/// inlines into every probe (a call per probe showed up in profiles).
#[inline(always)]
pub(crate) fn digest_of(key: &OffloadKey) -> u64 {
    let h = key.hash_bytes();
    let a = h.first_chunk::<8>().map_or(0, |w| u64::from_le_bytes(*w));
    let b = h.last_chunk::<8>().map_or(0, |w| u64::from_le_bytes(*w));
    let mut x =
        (a ^ b.rotate_left(29) ^ u64::from(key.group()).rotate_left(47)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Whether `a` and `b` are the same key, comparing word by word with the random first word
/// first, so a mismatch is settled by one integer compare instead of a byte-wise compare call.
#[inline]
pub(crate) fn same_key(a: &OffloadKey, b: &OffloadKey) -> bool {
    let (x, y) = (a.hash_bytes(), b.hash_bytes());
    let word = |h: &[u8; 32], i: usize| {
        h[i * 8..i * 8 + 8]
            .first_chunk::<8>()
            .map_or(0, |w| u64::from_ne_bytes(*w))
    };
    word(x, 0) == word(y, 0)
        && word(x, 1) == word(y, 1)
        && word(x, 2) == word(y, 2)
        && word(x, 3) == word(y, 3)
        && a.group() == b.group()
}

/// Slot content meaning "empty" (an id is stored plus one, so no live slot is zero).
const EMPTY: u64 = 0;

/// See the module docs.
#[derive(Clone, Debug)]
pub(crate) struct KeyIndex {
    slots: Vec<u64>,
    mask: usize,
    len: usize,
}

/// The 32-bit tag of a digest: its high half (the low half picks nothing, so both are usable).
#[inline]
fn tag_of(digest: u64) -> u32 {
    (digest >> 32) as u32
}

#[inline]
fn pack(tag: u32, id: u32) -> u64 {
    (u64::from(tag) << 32) | (u64::from(id) + 1)
}

#[inline]
fn id_of(slot: u64) -> u32 {
    // Ids are stored plus one and are below u32::MAX, so the low half is at least 1.
    ((slot & 0xFFFF_FFFF) - 1) as u32
}

impl KeyIndex {
    /// An index that holds `expected` ids without growing.
    pub(crate) fn with_capacity(expected: usize) -> Self {
        let slots = expected.saturating_mul(2).max(16).next_power_of_two();
        Self {
            slots: crate::memory::filled_vec(slots, EMPTY),
            mask: slots - 1,
            len: 0,
        }
    }

    /// Number of ids held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        ((u64::from(tag) * self.slots.len() as u64) >> 32) as usize
    }

    /// The content of slot `i`, which is a home ([`KeyIndex::home`]) or a position masked by
    /// `mask`: below the slot count either way, so the probe loops skip the bounds check.
    #[inline(always)]
    fn slot_at(&self, i: usize) -> u64 {
        debug_assert!(i < self.slots.len());
        // SAFETY: every caller passes a home, `(tag * len) >> 32 < len` for a 32-bit tag, or an
        // index reduced by `& self.mask`, `mask == len - 1` with `len` a power of two; so
        // `i < self.slots.len()`.
        unsafe { *self.slots.get_unchecked(i) }
    }

    /// Starts loading the home slot of `digest` (see [`crate::memory::prefetch`]).
    #[inline]
    pub(crate) fn prefetch(&self, digest: u64) {
        crate::memory::prefetch(&self.slots[self.home(tag_of(digest))]);
    }

    /// Starts loading the home slot of a key whose digest has the tag `tag` (see
    /// [`KeyIndex::tag`]).
    #[inline]
    pub(crate) fn prefetch_tag(&self, tag: u32) {
        let home = self.home(tag);
        crate::memory::prefetch(&self.slots[home]);
        // A removal reads the run past its member, into the next line when the home is near
        // the end of its own (eight slots a line).
        if home & 7 >= 5 {
            crate::memory::prefetch(&self.slots[(home + 8) & self.mask]);
        }
    }

    /// The part of a digest the index keeps and places keys by: removing an id needs only this.
    #[inline]
    pub(crate) fn tag(digest: u64) -> u32 {
        tag_of(digest)
    }

    /// Removes `id`, held for a key whose digest has the tag `tag`; whether it was there.
    pub(crate) fn remove_tagged(&mut self, tag: u32, id: u32) -> bool {
        self.remove(u64::from(tag) << 32, id)
    }

    /// The id held in the home slot of `digest` when its tag matches (the likely answer of a
    /// [`KeyIndex::find`], for prefetching what it names).
    #[inline]
    pub(crate) fn likely(&self, digest: u64) -> Option<u32> {
        let tag = tag_of(digest);
        let slot = self.slot_at(self.home(tag));
        (slot != EMPTY && (slot >> 32) as u32 == tag).then(|| id_of(slot))
    }

    /// The id whose key has `digest` and satisfies `is_key`, if any.
    #[inline]
    pub(crate) fn find(&self, digest: u64, mut is_key: impl FnMut(u32) -> bool) -> Option<u32> {
        let tag = tag_of(digest);
        let mut i = self.home(tag);
        loop {
            let slot = self.slot_at(i);
            if slot == EMPTY {
                return None;
            }
            if (slot >> 32) as u32 == tag && is_key(id_of(slot)) {
                return Some(id_of(slot));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// As [`KeyIndex::find`], but for an absent key also says where its probe run ended: the
    /// empty slot an insertion would take, for [`KeyIndex::occupy`].
    #[inline]
    pub(crate) fn find_or_vacancy(
        &self,
        digest: u64,
        mut is_key: impl FnMut(u32) -> bool,
    ) -> Result<u32, usize> {
        let tag = tag_of(digest);
        let mut i = self.home(tag);
        loop {
            let slot = self.slot_at(i);
            if slot == EMPTY {
                return Err(i);
            }
            if (slot >> 32) as u32 == tag && is_key(id_of(slot)) {
                return Ok(id_of(slot));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Makes sure `extra` more ids fit without growing (grows now if not), so that vacancies
    /// found by [`KeyIndex::find_or_vacancy`] stay where they are until filled.
    pub(crate) fn reserve(&mut self, extra: usize) {
        while (self.len + extra) * 2 > self.slots.len() {
            self.grow();
        }
    }

    /// Puts `id`, for a key with `digest`, in empty slot `at`: the vacancy a
    /// [`KeyIndex::find_or_vacancy`] of that digest just returned, with nothing inserted or
    /// removed since and room reserved ([`KeyIndex::reserve`]).
    #[inline]
    pub(crate) fn occupy(&mut self, at: usize, digest: u64, id: u32) {
        debug_assert_eq!(self.slots[at], EMPTY, "a vacancy is filled once");
        self.slots[at] = pack(tag_of(digest), id);
        self.len += 1;
    }

    /// [`KeyIndex::replace_tagged`] that first tries slot `at`, where `old` was put (removals
    /// since may have moved it back, in which case the run is searched from its start).
    #[inline]
    pub(crate) fn replace_at(&mut self, at: usize, tag: u32, old: u32, new: u32) -> bool {
        if self.slots.get(at) == Some(&pack(tag, old)) {
            self.slots[at] = pack(tag, new);
            return true;
        }
        self.replace_tagged(tag, old, new)
    }

    /// Adds `id` for a key with `digest`; the caller knows the key is absent.
    pub(crate) fn insert(&mut self, digest: u64, id: u32) {
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        self.place(pack(tag_of(digest), id));
        self.len += 1;
    }

    /// The id of the key with `digest` that satisfies `is_key`, or, when there is none, `new()`
    /// inserted for it, in one probe run: `Ok(existing)` or `Err(inserted)`.
    pub(crate) fn find_or_insert(
        &mut self,
        digest: u64,
        mut is_key: impl FnMut(u32) -> bool,
        new: impl FnOnce() -> u32,
    ) -> Result<u32, u32> {
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let tag = tag_of(digest);
        let mut i = self.home(tag);
        loop {
            let slot = self.slot_at(i);
            if slot == EMPTY {
                let id = new();
                self.slots[i] = pack(tag, id);
                self.len += 1;
                return Err(id);
            }
            if (slot >> 32) as u32 == tag && is_key(id_of(slot)) {
                return Ok(id_of(slot));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Makes the slot holding `old`, for a key whose digest has the tag `tag`, hold `new`
    /// instead, in place: the slot's position depends on the tag alone, so nothing moves.
    /// Whether `old` was there.
    pub(crate) fn replace_tagged(&mut self, tag: u32, old: u32, new: u32) -> bool {
        let want = pack(tag, old);
        let mut i = self.home(tag);
        loop {
            let slot = self.slot_at(i);
            if slot == EMPTY {
                return false;
            }
            if slot == want {
                self.slots[i] = pack(tag, new);
                return true;
            }
            i = (i + 1) & self.mask;
        }
    }

    fn place(&mut self, slot: u64) {
        let mut i = self.home((slot >> 32) as u32);
        while self.slots[i] != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.slots[i] = slot;
    }

    fn grow(&mut self) {
        let doubled = crate::memory::filled_vec(self.slots.len() * 2, EMPTY);
        let old = std::mem::replace(&mut self.slots, doubled);
        self.mask = self.slots.len() - 1;
        for slot in old.into_iter().filter(|&s| s != EMPTY) {
            self.place(slot);
        }
    }

    /// Removes `id`, held for a key with `digest`; whether it was there.
    pub(crate) fn remove(&mut self, digest: u64, id: u32) -> bool {
        let tag = tag_of(digest);
        let want = pack(tag, id);
        let mut i = self.home(tag);
        loop {
            let slot = self.slot_at(i);
            if slot == EMPTY {
                return false;
            }
            if slot == want {
                break;
            }
            i = (i + 1) & self.mask;
        }
        // Backward shift: move each later member of the run into the hole unless its home lies
        // cyclically in (hole, j], where it would then be unreachable; that is, unless it sits
        // closer to its home than to the hole. Written without a branch per member (the
        // outcome is a coin flip a predictor cannot learn): a member that stays is rewritten
        // in place.
        let mask = self.mask;
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let slot = self.slot_at(j);
            if slot == EMPTY {
                break;
            }
            let home = self.home((slot >> 32) as u32);
            let moves = (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask);
            let kept = self.slot_at(hole);
            self.slots[hole] = if moves { slot } else { kept };
            hole = if moves { j } else { hole };
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
        true
    }

    /// Forgets every id (keeps the allocation).
    pub(crate) fn clear(&mut self) {
        self.slots.fill(EMPTY);
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_tells_every_field_apart() {
        let a = OffloadKey::from_u64(1);
        assert!(same_key(&a, &OffloadKey::from_u64(1)));
        assert!(!same_key(&a, &OffloadKey::from_u64(2)));
        assert!(!same_key(&a, &a.with_group(1)));
        for byte in [0, 9, 17, 31] {
            let mut bytes = *a.hash_bytes();
            bytes[byte] ^= 1;
            assert!(!same_key(&a, &OffloadKey::new(bytes, 0)), "byte {byte}");
        }
    }

    /// Digests with many shared tags and homes, to exercise collisions and wrap-around.
    fn digest(n: u32) -> u64 {
        (u64::from(n % 7) << 61) | (u64::from(n) << 32 >> 3) | u64::from(n)
    }

    #[test]
    fn finds_what_was_inserted_and_nothing_after_removal_under_churn() {
        let mut index = KeyIndex::with_capacity(8);
        let mut live = std::collections::BTreeSet::new();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for step in 0..20_000u32 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let n = (state % 300) as u32;
            let found = index.find(digest(n), |id| id == n);
            assert_eq!(found.is_some(), live.contains(&n), "step {step}, key {n}");
            if live.contains(&n) {
                assert!(index.remove(digest(n), n));
                live.remove(&n);
            } else {
                index.insert(digest(n), n);
                live.insert(n);
            }
            assert_eq!(index.len(), live.len());
        }
        for n in 0..300 {
            assert_eq!(index.find(digest(n), |id| id == n).is_some(), live.contains(&n));
        }
        assert!(!index.remove(digest(1000), 1000));
        index.clear();
        assert_eq!(index.len(), 0);
        assert_eq!(
            index.find(digest(live.first().copied().unwrap_or(0)), |_| true),
            None
        );
    }

    #[test]
    fn find_or_insert_inserts_once() {
        let mut index = KeyIndex::with_capacity(2);
        for n in 0..100 {
            assert_eq!(index.find_or_insert(digest(n), |id| id == n, || n), Err(n));
        }
        for n in 0..100 {
            assert_eq!(index.find_or_insert(digest(n), |id| id == n, || 999), Ok(n));
            assert_eq!(index.find(digest(n), |id| id == n), Some(n));
        }
        assert_eq!(index.len(), 100);
    }

    #[test]
    fn replace_renames_an_id_in_place_and_only_that_id() {
        let mut index = KeyIndex::with_capacity(4);
        for n in 0..40 {
            index.insert(digest(n), n);
        }
        assert!(index.replace_tagged(KeyIndex::tag(digest(7)), 7, 1000));
        assert!(
            !index.replace_tagged(KeyIndex::tag(digest(7)), 7, 1001),
            "7 is gone"
        );
        assert!(
            !index.replace_tagged(KeyIndex::tag(digest(8)), 9, 1002),
            "wrong tag"
        );
        assert_eq!(index.find(digest(7), |id| id == 1000), Some(1000));
        assert_eq!(index.find(digest(7), |id| id == 7), None);
        assert_eq!(index.len(), 40);
        // The renamed id is removable under its key's tag, and the others are untouched.
        assert!(index.remove_tagged(KeyIndex::tag(digest(7)), 1000));
        for n in (0..40).filter(|&n| n != 7) {
            assert_eq!(index.find(digest(n), |id| id == n), Some(n));
        }
    }

    #[test]
    fn a_tag_match_is_confirmed_by_the_caller() {
        let mut index = KeyIndex::with_capacity(4);
        index.insert(0xABCD_0000_0000_0001, 3);
        index.insert(0xABCD_0000_0000_0002, 9);
        // Same tag: the caller's check tells the two apart.
        assert_eq!(index.find(0xABCD_0000_0000_0002, |id| id == 9), Some(9));
        assert_eq!(index.find(0xABCD_0000_0000_0001, |id| id == 3), Some(3));
        assert_eq!(index.find(0xABCD_0000_0000_0001, |_| false), None);
    }
}
