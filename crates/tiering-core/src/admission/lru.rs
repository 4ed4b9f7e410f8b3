//! A bounded map from chunk keys to values in recency order, the bookkeeping several policies
//! and the manager's refusal memory share.

use std::collections::BTreeMap;

use crate::key::{KeyMap, OffloadKey};

/// Keys with values, ordered from least to most recently inserted or touched. Every operation
/// is O(log n). The bound is the caller's: [`LruMap::pop_oldest`] makes room.
#[derive(Debug, Default)]
pub struct LruMap<V> {
    entries: KeyMap<(u64, V)>,
    order: BTreeMap<u64, OffloadKey>,
    next_stamp: u64,
}

impl<V> LruMap<V> {
    /// An empty map.
    #[must_use]
    pub fn new() -> Self {
        Self {
            entries: KeyMap::default(),
            order: BTreeMap::new(),
            next_stamp: 0,
        }
    }

    /// Number of keys held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the map is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `key` is held.
    #[must_use]
    pub fn contains(&self, key: &OffloadKey) -> bool {
        self.entries.contains_key(key)
    }

    /// The value of `key`, without touching it.
    #[must_use]
    pub fn get(&self, key: &OffloadKey) -> Option<&V> {
        self.entries.get(key).map(|(_, v)| v)
    }

    fn stamp(&mut self) -> u64 {
        let s = self.next_stamp;
        self.next_stamp += 1;
        s
    }

    /// Makes `key` the most recent and returns its value, if held.
    pub fn touch(&mut self, key: &OffloadKey) -> Option<&mut V> {
        let stamp = self.stamp();
        let (old, v) = self.entries.get_mut(key)?;
        self.order.remove(old);
        *old = stamp;
        self.order.insert(stamp, *key);
        Some(v)
    }

    /// Inserts `key` as the most recent (replacing its value if it was held).
    pub fn insert(&mut self, key: OffloadKey, value: V) {
        let stamp = self.stamp();
        if let Some((old, _)) = self.entries.insert(key, (stamp, value)) {
            self.order.remove(&old);
        }
        self.order.insert(stamp, key);
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &OffloadKey) -> Option<V> {
        let (stamp, v) = self.entries.remove(key)?;
        self.order.remove(&stamp);
        Some(v)
    }

    /// The least recent key.
    #[must_use]
    pub fn oldest(&self) -> Option<&OffloadKey> {
        self.order.values().next()
    }

    /// Removes and returns the least recent key and its value.
    pub fn pop_oldest(&mut self) -> Option<(OffloadKey, V)> {
        let (_, key) = self.order.pop_first()?;
        let (_, v) = self.entries.remove(&key)?;
        Some((key, v))
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_by_recency_and_touch_refreshes() {
        let k = OffloadKey::from_u64;
        let mut m = LruMap::new();
        m.insert(k(1), 'a');
        m.insert(k(2), 'b');
        m.insert(k(3), 'c');
        assert_eq!(m.touch(&k(1)).copied(), Some('a'));
        assert_eq!(m.oldest(), Some(&k(2)));
        assert_eq!(m.pop_oldest(), Some((k(2), 'b')));
        m.insert(k(3), 'd');
        assert_eq!(m.pop_oldest(), Some((k(1), 'a')));
        assert_eq!(m.remove(&k(3)), Some('d'));
        assert!(m.is_empty());
        assert_eq!(m.pop_oldest(), None);
        assert!(m.touch(&k(9)).is_none());
    }
}
