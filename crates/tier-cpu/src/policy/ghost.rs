//! Ghost lists: ordered sets of keys that are no longer resident (ARC's B1/B2, S3-FIFO's ghost
//! queue). Several lists share one compact key index (8-byte slots naming a ghost slot, the key
//! confirmed on the slot), so asking "is this key a ghost, and of which list" is a single probe.
//! Ghost slots are recycled through a free list: no allocation per key once the lists are at
//! their bound. Membership, removal, move-to-back and pop-front are O(1).

use tiering_core::{ChunkId, OffloadKey};

use super::SlotView;

use super::list::{Links, List, NIL};
use crate::index::{KeyIndex, digest_of};

/// `N` insertion-ordered, disjoint sets of keys (front = oldest).
pub(crate) struct Ghosts<const N: usize> {
    index: KeyIndex,
    keys: Vec<OffloadKey>,
    owner: Vec<u8>,
    links: Links,
    lists: [List; N],
    free: Vec<u32>,
}

impl<const N: usize> Default for Ghosts<N> {
    fn default() -> Self {
        Self {
            index: KeyIndex::with_capacity(0),
            keys: Vec::new(),
            owner: Vec::new(),
            links: Links::default(),
            lists: [List::new(); N],
            free: Vec::new(),
        }
    }
}

impl<const N: usize> Ghosts<N> {
    /// Empty lists.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Number of keys in list `l`.
    pub(crate) fn len(&self, l: usize) -> usize {
        self.lists[l].len()
    }

    #[inline]
    fn find(&self, key: &OffloadKey) -> Option<u32> {
        self.index.find(digest_of(key), |n| self.keys[n as usize] == *key)
    }

    /// Starts loading the index slots of `keys` (about to be probed).
    pub(crate) fn prefetch(&self, keys: &[OffloadKey]) {
        if keys.len() < 2 || self.index.len() == 0 {
            return;
        }
        for k in keys.iter().take(32) {
            self.index.prefetch(digest_of(k));
        }
    }

    /// Starts loading the index slots of the keys held in the chunks of `picked` (eviction
    /// victims about to become ghosts), and the tier's index slots of the same keys (about to
    /// be cleared).
    pub(crate) fn prefetch_chunks(&self, picked: &[(ChunkId, bool)], slots: SlotView<'_>) {
        if picked.len() < 2 {
            return;
        }
        for &(chunk, _) in picked.iter().take(32) {
            let digest = slots.prefetch_index_of(chunk);
            if self.index.len() != 0 {
                self.index.prefetch(digest);
            }
        }
    }

    /// The list holding `key`, if any.
    #[cfg(test)]
    pub(crate) fn list_of(&self, key: &OffloadKey) -> Option<usize> {
        self.find(key).map(|n| usize::from(self.owner[n as usize]))
    }

    /// Appends `key` at the back of list `l` (moving it there from wherever it was); one probe
    /// run finds the key or reserves its index slot.
    pub(crate) fn push_back(&mut self, l: usize, key: OffloadKey) {
        // The slot a new ghost takes: the last freed one, else a fresh one.
        let candidate = match self.free.last() {
            Some(&n) => n,
            None => match u32::try_from(self.keys.len()).ok().filter(|&n| n != NIL) {
                Some(n) => n,
                // More ghosts than u32 ids cannot happen below the arena's row limit; keep the
                // structure bounded anyway by forgetting this key.
                None => return,
            },
        };
        let keys = &self.keys;
        match self
            .index
            .find_or_insert(digest_of(&key), |n| keys[n as usize] == key, || candidate)
        {
            Ok(n) => {
                let from = usize::from(self.owner[n as usize]);
                self.lists[from].remove(&mut self.links, n);
                self.lists[l].push_back(&mut self.links, n);
                self.owner[n as usize] = l as u8;
            }
            Err(n) => {
                if self.free.pop().is_some() {
                    self.keys[n as usize] = key;
                } else {
                    self.keys.push(key);
                    self.owner.push(0);
                    self.links.grow_to(self.keys.len());
                }
                self.owner[n as usize] = l as u8;
                self.lists[l].push_back(&mut self.links, n);
            }
        }
    }

    /// Moves `key` to the back of its list; returns that list, or `None` if it is no ghost.
    pub(crate) fn move_to_back(&mut self, key: &OffloadKey) -> Option<usize> {
        let n = self.find(key)?;
        let l = usize::from(self.owner[n as usize]);
        self.lists[l].move_to_back(&mut self.links, n);
        Some(l)
    }

    /// Forgets `key`; returns whether it was a ghost.
    pub(crate) fn remove(&mut self, key: &OffloadKey) -> bool {
        match self.find(key) {
            Some(n) => {
                self.index.remove(digest_of(key), n);
                let l = usize::from(self.owner[n as usize]);
                self.lists[l].remove(&mut self.links, n);
                self.free.push(n);
                true
            }
            None => false,
        }
    }

    /// Removes and returns the oldest key of list `l`.
    pub(crate) fn pop_front(&mut self, l: usize) -> Option<OffloadKey> {
        let n = self.lists[l].front();
        if n == NIL {
            return None;
        }
        let key = self.keys[n as usize];
        self.lists[l].remove(&mut self.links, n);
        self.index.remove(digest_of(&key), n);
        self.free.push(n);
        Some(key)
    }

    /// Drops the oldest keys of list `l` until at most `cap` remain.
    pub(crate) fn trim_to(&mut self, l: usize, cap: usize) {
        while self.len(l) > cap {
            self.pop_front(l);
        }
    }

    /// Forgets every key.
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }

    /// The keys of list `l`, oldest first (for tests and diagnostics).
    pub(crate) fn keys(&self, l: usize) -> Vec<OffloadKey> {
        self.lists[l]
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
    fn keeps_insertion_order_per_list_and_reuses_nodes() {
        let mut g = Ghosts::<2>::new();
        for n in 1..=4 {
            g.push_back(0, k(n));
        }
        g.push_back(1, k(9));
        assert_eq!(g.move_to_back(&k(2)), Some(0));
        assert_eq!(g.move_to_back(&k(8)), None);
        assert_eq!(g.keys(0), vec![k(1), k(3), k(4), k(2)]);
        assert_eq!(
            (g.list_of(&k(9)), g.list_of(&k(1)), g.list_of(&k(8))),
            (Some(1), Some(0), None)
        );
        assert!(g.remove(&k(3)));
        assert!(!g.remove(&k(3)));
        g.push_back(0, k(5));
        assert_eq!(g.keys(0), vec![k(1), k(4), k(2), k(5)]);
        g.push_back(1, k(1));
        assert_eq!((g.keys(0), g.keys(1)), (vec![k(4), k(2), k(5)], vec![k(9), k(1)]));
        g.trim_to(0, 2);
        assert_eq!(g.keys(0), vec![k(2), k(5)]);
        assert_eq!(g.pop_front(1), Some(k(9)));
        assert_eq!((g.len(0), g.len(1)), (2, 1));
        g.clear();
        assert_eq!(g.pop_front(0), None);
        assert_eq!(g.list_of(&k(2)), None);
    }
}
