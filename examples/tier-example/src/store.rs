//! The tier's storage: a bounded map of chunks with least-recently-used eviction.
//!
//! Every access stamps the entry with a fresh tick; `order` maps ticks back to keys, so the
//! oldest entry is the first of `order`. O(log n) per operation, which is plenty for a template.

use std::collections::BTreeMap;

use tiering_core::{KeyMap, OffloadKey};

struct Entry {
    bytes: Box<[u8]>,
    tick: u64,
}

/// A bounded LRU map from keys to chunk bytes.
pub struct LruStore {
    capacity: usize,
    entries: KeyMap<Entry>,
    order: BTreeMap<u64, OffloadKey>,
    clock: u64,
}

impl LruStore {
    /// A store holding at most `capacity` chunks (at least one).
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            entries: KeyMap::default(),
            order: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Chunk capacity.
    #[must_use]
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Chunks held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the store is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `key` is held (no recency update: lookups must not reorder, only accesses do).
    #[must_use]
    pub fn contains(&self, key: &OffloadKey) -> bool {
        self.entries.contains_key(key)
    }

    fn stamp(&mut self, key: OffloadKey) {
        self.clock += 1;
        let tick = self.clock;
        if let Some(e) = self.entries.get_mut(&key) {
            self.order.remove(&e.tick);
            e.tick = tick;
            self.order.insert(tick, key);
        }
    }

    /// Marks `key` as just used; absent keys are ignored.
    pub fn touch(&mut self, key: &OffloadKey) {
        self.stamp(*key);
    }

    /// Copies the bytes of `key` into `dst` and marks it used; `false` when absent or the sizes
    /// differ.
    pub fn read_into(&mut self, key: &OffloadKey, dst: &mut [u8]) -> bool {
        let ok = match self.entries.get(key) {
            Some(e) if e.bytes.len() == dst.len() => {
                dst.copy_from_slice(&e.bytes);
                true
            }
            _ => false,
        };
        if ok {
            self.stamp(*key);
        }
        ok
    }

    /// Stores `bytes` under `key` (or only refreshes it when already held), evicting
    /// least-recently-used chunks to stay within capacity. Returns the evicted keys.
    pub fn insert(&mut self, key: OffloadKey, bytes: Box<[u8]>) -> Vec<OffloadKey> {
        if self.entries.contains_key(&key) {
            self.stamp(key);
            return Vec::new();
        }
        let mut evicted = Vec::new();
        while self.entries.len() >= self.capacity {
            let Some((_, victim)) = self.order.pop_first() else {
                break;
            };
            self.entries.remove(&victim);
            evicted.push(victim);
        }
        self.entries.insert(key, Entry { bytes, tick: 0 });
        self.stamp(key);
        evicted
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    #[test]
    fn evicts_the_least_recently_used() {
        let mut s = LruStore::new(2);
        assert!(s.insert(k(1), Box::new([1])).is_empty());
        assert!(s.insert(k(2), Box::new([2])).is_empty());
        let mut buf = [0u8];
        assert!(s.read_into(&k(1), &mut buf));
        assert_eq!(buf, [1]);
        assert_eq!(
            s.insert(k(3), Box::new([3])),
            vec![k(2)],
            "2 was the least recently used"
        );
        assert!(s.contains(&k(1)) && s.contains(&k(3)) && !s.contains(&k(2)));
        s.touch(&k(1));
        assert_eq!(s.insert(k(4), Box::new([4])), vec![k(3)]);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn reinserting_refreshes_without_eviction_and_size_mismatch_fails() {
        let mut s = LruStore::new(1);
        s.insert(k(1), Box::new([1, 2]));
        assert!(s.insert(k(1), Box::new([9, 9])).is_empty());
        let mut small = [0u8; 1];
        assert!(!s.read_into(&k(1), &mut small));
        assert!(!s.read_into(&k(2), &mut [0u8; 2]));
        s.clear();
        assert!(s.is_empty());
    }
}
