//! The chunk table: which key lives in which arena row, each row's ref count, and the row
//! allocator.
//!
//! The key→row map holds each resident key's row and ref count, so a lookup reads one bucket and
//! nothing else (it stays within a hair of a bare hash-map probe). Eviction policies scan rows,
//! not keys, so the ref counts are mirrored in a dense array indexed by row, next to the row's
//! key; every mutation here updates both copies.
//!
//! Row allocation follows vLLM 0.33.0: rows never handed out before go first, in ascending order;
//! after that, freed rows are reused last-in-first-out.

use tiering_core::{ChunkId, KeyMap, OffloadKey, TierError};

use crate::policy::SlotView;

/// Ref count of a row whose write is in flight.
pub(crate) const WRITING: i32 = -1;

/// A resident key's row and ref count (a copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) chunk: ChunkId,
    pub(crate) ref_cnt: i32,
}

/// See the module docs.
pub(crate) struct ChunkTable {
    map: KeyMap<Entry>,
    refs: Vec<i32>,
    keys: Vec<OffloadKey>,
    free: Vec<ChunkId>,
    num_allocated: u32,
    capacity: u32,
    /// Resident rows with ref count 0.
    pub(crate) num_evictable: usize,
    /// Resident rows with ref count −1.
    pub(crate) num_write_pending: usize,
}

impl ChunkTable {
    /// A table of `capacity` rows (`capacity` ≤ `u32::MAX`, checked by the arena).
    pub(crate) fn new(capacity: u32) -> Self {
        let n = capacity as usize;
        let mut map = KeyMap::default();
        // Reserving the whole table up front keeps inserts free of rehash pauses; for huge tiers
        // cap it and let the map grow.
        map.reserve(n.min(1 << 22));
        Self {
            map,
            refs: vec![0; n],
            keys: vec![OffloadKey::new([0; 32], 0); n],
            free: Vec::new(),
            num_allocated: 0,
            capacity,
            num_evictable: 0,
            num_write_pending: 0,
        }
    }

    /// Rows in the tier.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// Resident keys.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
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
        self.map.get(key).copied()
    }

    /// The ref count of a resident row.
    #[inline]
    pub(crate) fn ref_of(&self, chunk: ChunkId) -> i32 {
        self.refs[chunk as usize]
    }

    /// Every resident entry, in no particular order.
    pub(crate) fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        self.map.values().copied()
    }

    /// The policies' view of the rows.
    #[inline]
    pub(crate) fn view(&self) -> SlotView<'_> {
        SlotView::new(&self.refs, &self.keys)
    }

    /// Adds one reader to resident, ready `key`. Returns its row and whether it just stopped
    /// being evictable (0 → 1); an absent key, a write in flight or a reader count at its limit
    /// is an error and changes nothing.
    #[inline]
    pub(crate) fn pin(&mut self, key: &OffloadKey) -> Result<(ChunkId, bool), TierError> {
        let Some(e) = self.map.get_mut(key) else {
            return Err(TierError::NotFound(*key));
        };
        if e.ref_cnt < 0 {
            return Err(TierError::NotReady(*key));
        }
        if e.ref_cnt == i32::MAX {
            return Err(TierError::Other(format!("key {key} has too many readers")));
        }
        let edge = e.ref_cnt == 0;
        e.ref_cnt += 1;
        self.refs[e.chunk as usize] = e.ref_cnt;
        if edge {
            self.num_evictable -= 1;
        }
        Ok((e.chunk, edge))
    }

    /// Removes one reader from pinned `key`. Returns its row and whether it just became
    /// evictable (1 → 0); an absent or unpinned key is an error and changes nothing.
    #[inline]
    pub(crate) fn unpin(&mut self, key: &OffloadKey) -> Result<(ChunkId, bool), TierError> {
        let Some(e) = self.map.get_mut(key) else {
            return Err(TierError::NotFound(*key));
        };
        if e.ref_cnt <= 0 {
            return Err(TierError::NotPinned(*key));
        }
        e.ref_cnt -= 1;
        self.refs[e.chunk as usize] = e.ref_cnt;
        let edge = e.ref_cnt == 0;
        if edge {
            self.num_evictable += 1;
        }
        Ok((e.chunk, edge))
    }

    /// Undoes one successful [`ChunkTable::unpin`] of `key` (rolling back a batch).
    pub(crate) fn repin(&mut self, key: &OffloadKey) {
        if let Some(e) = self.map.get_mut(key) {
            if e.ref_cnt == 0 {
                self.num_evictable -= 1;
            }
            e.ref_cnt += 1;
            self.refs[e.chunk as usize] = e.ref_cnt;
        }
    }

    /// Completes the write of `key` if it is in flight. Returns its row then.
    #[inline]
    pub(crate) fn mark_written(&mut self, key: &OffloadKey) -> Option<ChunkId> {
        let e = self.map.get_mut(key)?;
        if e.ref_cnt != WRITING {
            return None;
        }
        e.ref_cnt = 0;
        self.refs[e.chunk as usize] = 0;
        self.num_write_pending -= 1;
        self.num_evictable += 1;
        Some(e.chunk)
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

    /// Makes `key` resident in `chunk` with a write in flight.
    pub(crate) fn insert_writing(&mut self, key: OffloadKey, chunk: ChunkId) {
        self.map.insert(
            key,
            Entry {
                chunk,
                ref_cnt: WRITING,
            },
        );
        self.refs[chunk as usize] = WRITING;
        self.keys[chunk as usize] = key;
        self.num_write_pending += 1;
    }

    /// Drops the key stored in `chunk` and frees the row. Returns the key.
    pub(crate) fn release(&mut self, chunk: ChunkId) -> OffloadKey {
        let key = self.keys[chunk as usize];
        match self.refs[chunk as usize] {
            WRITING => self.num_write_pending -= 1,
            0 => self.num_evictable -= 1,
            _ => {}
        }
        self.map.remove(&key);
        self.free.push(chunk);
        key
    }

    /// Forgets every key and every allocation.
    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.free.clear();
        self.num_allocated = 0;
        self.num_evictable = 0;
        self.num_write_pending = 0;
    }

    /// Checks the structural invariants; the first violation, described.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut owner = vec![false; self.capacity as usize];
        let (mut evictable, mut writing) = (0, 0);
        for (key, e) in &self.map {
            let (chunk, c) = (e.chunk, e.chunk as usize);
            if chunk >= self.num_allocated {
                return Err(format!("{key} holds row {c}, never allocated"));
            }
            if std::mem::replace(&mut owner[c], true) {
                return Err(format!("row {c} owned twice"));
            }
            if self.keys[c] != *key || self.refs[c] != e.ref_cnt {
                return Err(format!("row {c} arrays disagree with the map for {key}"));
            }
            match self.refs[c] {
                WRITING => writing += 1,
                0 => evictable += 1,
                r if r > 0 => {}
                r => return Err(format!("{key} has ref count {r}")),
            }
        }
        for &c in &self.free {
            if c >= self.num_allocated || std::mem::replace(&mut owner[c as usize], true) {
                return Err(format!("free row {c} is invalid or also owned"));
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
mod tests {
    use super::*;

    #[test]
    fn fresh_rows_ascend_then_freed_rows_come_back_lifo() {
        let mut t = ChunkTable::new(4);
        let mut out = Vec::new();
        assert!(t.allocate(3, &mut out));
        assert_eq!(out, vec![0, 1, 2]);
        for (i, &c) in out.iter().enumerate() {
            t.insert_writing(OffloadKey::from_u64(i as u64), c);
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
