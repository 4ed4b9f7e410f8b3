//! Ghost lists: ordered sets of keys that are no longer resident (ARC's B1/B2, S3-FIFO's ghost
//! queue). Membership, removal, move-to-back and pop-front are O(1).

use tiering_core::{KeyMap, OffloadKey};

use super::list::{Links, List, NIL};

/// An insertion-ordered set of keys (front = oldest).
#[derive(Default)]
pub(crate) struct GhostList {
    index: KeyMap<u32>,
    keys: Vec<OffloadKey>,
    links: Links,
    list: List,
    free: Vec<u32>,
}

impl GhostList {
    /// An empty ghost list.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Number of keys.
    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether `key` is a member.
    pub(crate) fn contains(&self, key: &OffloadKey) -> bool {
        self.index.contains_key(key)
    }

    /// Appends `key` at the back, or moves it there if already present.
    pub(crate) fn push_back(&mut self, key: OffloadKey) {
        if let Some(&n) = self.index.get(&key) {
            self.list.move_to_back(&mut self.links, n);
            return;
        }
        let n = if let Some(n) = self.free.pop() {
            self.keys[n as usize] = key;
            n
        } else {
            let n = u32::try_from(self.keys.len()).unwrap_or(NIL);
            if n == NIL {
                // More ghosts than u32 ids: cannot happen below the arena's row limit; drop the
                // oldest instead of growing.
                self.pop_front();
                return self.push_back(key);
            }
            self.keys.push(key);
            self.links.grow_to(self.keys.len());
            n
        };
        self.index.insert(key, n);
        self.list.push_back(&mut self.links, n);
    }

    /// Moves `key` to the back if present; returns whether it was.
    pub(crate) fn move_to_back(&mut self, key: &OffloadKey) -> bool {
        match self.index.get(key) {
            Some(&n) => {
                self.list.move_to_back(&mut self.links, n);
                true
            }
            None => false,
        }
    }

    /// Removes `key`; returns whether it was present.
    pub(crate) fn remove(&mut self, key: &OffloadKey) -> bool {
        match self.index.remove(key) {
            Some(n) => {
                self.list.remove(&mut self.links, n);
                self.free.push(n);
                true
            }
            None => false,
        }
    }

    /// Removes and returns the oldest key.
    pub(crate) fn pop_front(&mut self) -> Option<OffloadKey> {
        let n = self.list.front();
        if n == NIL {
            return None;
        }
        let key = self.keys[n as usize];
        self.list.remove(&mut self.links, n);
        self.index.remove(&key);
        self.free.push(n);
        Some(key)
    }

    /// Drops the oldest keys until at most `cap` remain.
    pub(crate) fn trim_to(&mut self, cap: usize) {
        while self.len() > cap {
            self.pop_front();
        }
    }

    /// Forgets every key.
    pub(crate) fn clear(&mut self) {
        self.index.clear();
        self.keys.clear();
        self.links = Links::default();
        self.list.clear();
        self.free.clear();
    }

    /// The keys, oldest first (for tests and diagnostics).
    pub(crate) fn keys(&self) -> Vec<OffloadKey> {
        self.list
            .iter(&self.links)
            .map(|n| self.keys[n as usize])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    #[test]
    fn keeps_insertion_order_and_reuses_nodes() {
        let mut g = GhostList::new();
        for n in 1..=4 {
            g.push_back(k(n));
        }
        assert!(g.move_to_back(&k(2)));
        assert!(!g.move_to_back(&k(9)));
        assert_eq!(g.keys(), vec![k(1), k(3), k(4), k(2)]);
        assert!(g.remove(&k(3)));
        assert!(!g.remove(&k(3)));
        g.push_back(k(5));
        assert_eq!(g.keys(), vec![k(1), k(4), k(2), k(5)]);
        g.push_back(k(1));
        assert_eq!(g.keys(), vec![k(4), k(2), k(5), k(1)]);
        g.trim_to(2);
        assert_eq!(g.keys(), vec![k(5), k(1)]);
        assert!(g.contains(&k(5)) && !g.contains(&k(4)));
        assert_eq!(g.pop_front(), Some(k(5)));
        g.clear();
        assert_eq!(g.len(), 0);
        assert_eq!(g.pop_front(), None);
    }
}
