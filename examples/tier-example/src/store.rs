//! The tier's storage: chunk bytes in `tiering-core`'s [`LruMap`], bounded by a chunk count;
//! inserting past the bound evicts the least recently used.

use tiering_core::OffloadKey;
use tiering_core::admission::LruMap;

/// A bounded LRU map from keys to chunk bytes.
pub struct LruStore {
    capacity: usize,
    chunks: LruMap<Box<[u8]>>,
}

impl LruStore {
    /// A store holding at most `capacity` chunks (at least one).
    #[must_use]
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            chunks: LruMap::new(),
        }
    }

    /// The chunks, for reading (`len`, `contains`: no recency update, only accesses reorder).
    #[must_use]
    pub fn chunks(&self) -> &LruMap<Box<[u8]>> {
        &self.chunks
    }

    /// Marks `key` as just used; absent keys are ignored.
    pub fn touch(&mut self, key: &OffloadKey) {
        self.chunks.touch(key);
    }

    /// Copies the bytes of `key` into `dst` and marks it used; `false` when absent or the sizes
    /// differ.
    pub fn read_into(&mut self, key: &OffloadKey, dst: &mut [u8]) -> bool {
        match self.chunks.touch(key) {
            Some(bytes) if bytes.len() == dst.len() => {
                dst.copy_from_slice(bytes);
                true
            }
            _ => false,
        }
    }

    /// Stores `bytes` under `key` (or only refreshes it when already held), evicting
    /// least-recently-used chunks to stay within capacity. Returns the evicted keys.
    pub fn insert(&mut self, key: OffloadKey, bytes: Box<[u8]>) -> Vec<OffloadKey> {
        if self.chunks.touch(&key).is_some() {
            return Vec::new();
        }
        let mut evicted = Vec::new();
        while self.chunks.len() >= self.capacity {
            let Some((victim, _)) = self.chunks.pop_oldest() else {
                break;
            };
            evicted.push(victim);
        }
        self.chunks.insert(key, bytes);
        evicted
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
        let held = s.chunks();
        assert!(held.contains(&k(1)) && held.contains(&k(3)) && !held.contains(&k(2)));
        s.touch(&k(1));
        assert_eq!(s.insert(k(4), Box::new([4])), vec![k(3)]);
        assert_eq!(s.chunks().len(), 2);
    }

    #[test]
    fn reinserting_refreshes_without_eviction_and_size_mismatch_fails() {
        let mut s = LruStore::new(1);
        s.insert(k(1), Box::new([1, 2]));
        assert!(s.insert(k(1), Box::new([9, 9])).is_empty());
        let mut small = [0u8; 1];
        assert!(!s.read_into(&k(1), &mut small));
        assert!(!s.read_into(&k(2), &mut [0u8; 2]));
    }
}
