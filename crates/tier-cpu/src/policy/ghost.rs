//! Ghost lists a policy keeps itself: ordered sets of keys that are no longer resident (S3-FIFO's
//! ghost queue; ARC's B1/B2 live in the tier's own key index instead, see
//! [`crate::ghost_lists`]). Several lists share one compact key index (8-byte slots naming a ghost slot, the key
//! confirmed on the slot), so asking "is this key a ghost, and of which list" is a single probe.
//! The orders are logs of ghost slots ([`Rings`]), each element carrying its key's index tag:
//! trimming the oldest ghosts reads consecutive elements instead of chasing links and finds their
//! index slots from the log alone, so a batch of them is dropped with its cache misses overlapped
//! Ghost slots are recycled through a free list: no allocation per key once the lists
//! are at their bound. Membership, removal, move-to-back and pop-front are O(1) (amortized).

use tiering_core::OffloadKey;

use crate::index::{KeyIndex, digest_of};
use crate::ring::{NIL, Rings};

/// Ghosts dropped per round of a trim: their index slots are requested before any is removed.
const TRIM_BATCH: usize = 32;

/// One ghost: its key and the list holding it.
#[derive(Clone, Copy)]
struct Ghost {
    key: OffloadKey,
    list: u8,
}

/// `N` insertion-ordered, disjoint sets of keys (front = oldest).
pub(crate) struct Ghosts<const N: usize> {
    index: KeyIndex,
    ghosts: Vec<Ghost>,
    order: Rings<N>,
    free: Vec<u32>,
}

impl<const N: usize> Default for Ghosts<N> {
    fn default() -> Self {
        Self {
            index: KeyIndex::with_capacity(0),
            ghosts: Vec::new(),
            order: Rings::with_nodes(0),
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
        self.order.len(l)
    }

    #[inline]
    fn find(&self, key: &OffloadKey) -> Option<u32> {
        self.index
            .find(digest_of(key), |n| self.ghosts[n as usize].key == *key)
    }

    /// The list holding `key`, if any.
    #[cfg(test)]
    pub(crate) fn list_of(&self, key: &OffloadKey) -> Option<usize> {
        self.find(key).map(|n| usize::from(self.ghosts[n as usize].list))
    }

    /// Appends `key` at the back of list `l` (moving it there from wherever it was); one probe
    /// run finds the key or reserves its index slot.
    pub(crate) fn push_back(&mut self, l: usize, key: OffloadKey) {
        self.push_back_digested(l, key, digest_of(&key));
    }

    /// [`Ghosts::push_back`] of a key whose digest is `digest`.
    pub(crate) fn push_back_digested(&mut self, l: usize, key: OffloadKey, digest: u64) {
        // The slot a new ghost takes: the last freed one, else a fresh one.
        let candidate = match self.free.last() {
            Some(&n) => n,
            None => match u32::try_from(self.ghosts.len()).ok().filter(|&n| n != NIL) {
                Some(n) => n,
                // More ghosts than u32 ids cannot happen below the arena's row limit; keep the
                // structure bounded anyway by forgetting this key.
                None => return,
            },
        };
        let ghosts = &self.ghosts;
        match self
            .index
            .find_or_insert(digest, |n| ghosts[n as usize].key == key, || candidate)
        {
            Ok(n) => {
                let from = usize::from(self.ghosts[n as usize].list);
                self.order.move_across(from, l, n);
                self.ghosts[n as usize].list = l as u8;
            }
            Err(n) => {
                let ghost = Ghost { key, list: l as u8 };
                if self.free.pop().is_some() {
                    self.ghosts[n as usize] = ghost;
                } else {
                    self.ghosts.push(ghost);
                    self.order.grow_to(self.ghosts.len());
                }
                self.order.push_back_with(l, n, KeyIndex::tag(digest));
            }
        }
    }

    /// Moves `key`, whose digest is `digest`, to the back of its list; returns that list, or
    /// `None` if it is no ghost.
    #[cfg(test)]
    pub(crate) fn move_to_back(&mut self, key: &OffloadKey, digest: u64) -> Option<usize> {
        let n = self.index.find(digest, |n| self.ghosts[n as usize].key == *key)?;
        let l = usize::from(self.ghosts[n as usize].list);
        self.order.move_to_back(l, n);
        Some(l)
    }

    /// Forgets `key`; returns whether it was a ghost.
    pub(crate) fn remove(&mut self, key: &OffloadKey) -> bool {
        match self.find(key) {
            Some(n) => {
                self.index.remove(digest_of(key), n);
                let l = usize::from(self.ghosts[n as usize].list);
                self.order.remove(l, n);
                self.free.push(n);
                true
            }
            None => false,
        }
    }

    /// Removes and returns the oldest key of list `l`.
    #[cfg(test)]
    pub(crate) fn pop_front(&mut self, l: usize) -> Option<OffloadKey> {
        let n = self.order.front(l);
        if n == NIL {
            return None;
        }
        let key = self.ghosts[n as usize].key;
        self.drop_ghost(l, n, KeyIndex::tag(digest_of(&key)));
        Some(key)
    }

    fn drop_ghost(&mut self, l: usize, n: u32, tag: u32) {
        self.order.remove(l, n);
        self.index.remove_tagged(tag, n);
        self.free.push(n);
    }

    /// Drops the oldest keys of list `l` until at most `cap` remain, a batch at a time: the
    /// batch's ghosts and index tags are read from the front of the log, their index slots
    /// requested, and only then removed.
    pub(crate) fn trim_to(&mut self, l: usize, cap: usize) {
        let mut batch = [(NIL, 0u32); TRIM_BATCH];
        while self.len(l) > cap {
            let excess = (self.len(l) - cap).min(TRIM_BATCH);
            let mut at = self.order.scan_start(l);
            for entry in &mut batch[..excess] {
                // `excess` ≤ len, so the log has that many members.
                *entry = self.order.next_with_payload(l, &mut at).unwrap_or((NIL, 0));
                self.index.prefetch_tag(entry.1);
            }
            for &(n, tag) in &batch[..excess] {
                if n != NIL {
                    self.drop_ghost(l, n, tag);
                }
            }
        }
    }

    /// Forgets every key.
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }

    /// The keys of list `l`, oldest first (for tests and diagnostics).
    pub(crate) fn keys(&self, l: usize) -> Vec<OffloadKey> {
        self.order.iter(l).map(|n| self.ghosts[n as usize].key).collect()
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
        assert_eq!(g.move_to_back(&k(2), digest_of(&k(2))), Some(0));
        assert_eq!(g.move_to_back(&k(8), digest_of(&k(8))), None);
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
