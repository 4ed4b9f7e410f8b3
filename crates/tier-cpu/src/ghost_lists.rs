//! Ghost lists kept by the chunk table for a policy (ARC's B1 and B2): keys evicted recently,
//! in eviction order per list, that live in the table's key index next to the resident keys.
//!
//! Sharing the index is what makes a ghost cheap: a victim becomes a ghost by renaming its index
//! slot from its row to a ghost id in place (no removal, no second index to insert into), a store
//! miss learns in its one probe whether the key is a ghost, and storing a ghost again renames
//! the slot back to the new row. Only dropping a ghost off the old end of its list removes an
//! index slot. This module owns the ghosts' keys, their ids and their orders; the index side of
//! each operation is in [`crate::slots::ChunkTable`].
//!
//! Orders are logs ([`Rings`]) whose elements carry the key's index tag, so trimming the oldest
//! ghosts reads consecutive elements and finds their index slots without reading their keys.
//! Ghost ids are recycled through a free list: nothing is allocated per key once the lists have
//! reached their bound.

use tiering_core::OffloadKey;

use crate::index::same_key;
use crate::ring::{NIL, Rings};

/// Number of ghost lists the table keeps.
pub(crate) const GHOST_LISTS: usize = 2;

/// Ghost ids stay below this, so that, flagged, they still fit the index's ids (see
/// [`crate::slots::GHOST`]).
const MAX_GHOSTS: u32 = (1 << 31) - 2;

/// One ghost: its key and the list holding it.
#[derive(Clone, Copy)]
struct Ghost {
    key: OffloadKey,
    list: u8,
}

/// See the module docs.
pub(crate) struct GhostLists {
    ghosts: Vec<Ghost>,
    order: Rings<GHOST_LISTS>,
    free: Vec<u32>,
}

impl GhostLists {
    /// No ghosts.
    pub(crate) fn new() -> Self {
        Self {
            ghosts: Vec::new(),
            order: Rings::with_nodes(0),
            free: Vec::new(),
        }
    }

    /// Number of ghosts in list `l`.
    #[inline]
    pub(crate) fn len(&self, l: usize) -> usize {
        self.order.len(l)
    }

    /// Number of ghosts in all lists.
    #[inline]
    pub(crate) fn total(&self) -> usize {
        (0..GHOST_LISTS).map(|l| self.order.len(l)).sum()
    }

    /// The key of ghost `g` (live or not: a dead ghost's slot keeps its last key).
    #[inline]
    pub(crate) fn key(&self, g: u32) -> &OffloadKey {
        &self.ghosts[g as usize].key
    }

    /// The list holding live ghost `g`.
    #[inline]
    pub(crate) fn list(&self, g: u32) -> usize {
        usize::from(self.ghosts[g as usize].list)
    }

    /// Whether `g` is a live ghost of `key`.
    #[inline]
    pub(crate) fn is_live_ghost_of(&self, g: u32, key: &OffloadKey) -> bool {
        (g as usize) < self.ghosts.len()
            && self.order.contains(g)
            && same_key(&self.ghosts[g as usize].key, key)
    }

    /// Starts loading ghost `g`'s record.
    #[inline]
    pub(crate) fn prefetch(&self, g: u32) {
        if let Some(ghost) = self.ghosts.get(g as usize) {
            crate::memory::prefetch(ghost);
        }
    }

    /// Appends `key`, whose index tag is `tag`, to the back of list `l`; its new ghost id, or
    /// `None` when the id space is exhausted (the key is then forgotten instead).
    #[inline]
    pub(crate) fn push(&mut self, l: usize, key: OffloadKey, tag: u32) -> Option<u32> {
        let ghost = Ghost { key, list: l as u8 };
        let g = match self.free.pop() {
            Some(g) => {
                self.ghosts[g as usize] = ghost;
                g
            }
            None => {
                let g = u32::try_from(self.ghosts.len())
                    .ok()
                    .filter(|&g| g < MAX_GHOSTS)?;
                self.ghosts.push(ghost);
                self.order.grow_to(self.ghosts.len());
                g
            }
        };
        self.order.push_back_with(l, g, tag);
        Some(g)
    }

    /// Moves live ghost `g` to the back of its list.
    #[inline]
    pub(crate) fn move_to_back(&mut self, g: u32) {
        let l = self.list(g);
        self.order.move_to_back(l, g);
    }

    /// Forgets live ghost `g` (its index slot is the caller's business).
    #[inline]
    pub(crate) fn remove(&mut self, g: u32) {
        let l = self.list(g);
        self.order.remove(l, g);
        self.free.push(g);
    }

    /// Removes the oldest ghost of list `l`: its id and index tag (its index slot is the
    /// caller's business), or `None` when the list is empty.
    #[inline]
    pub(crate) fn pop_oldest(&mut self, l: usize) -> Option<(u32, u32)> {
        let (g, tag) = self.order.pop_front(l)?;
        self.free.push(g);
        Some((g, tag))
    }

    /// The up to `out.len()` oldest ghosts of list `l` with their index tags, into `out`;
    /// how many.
    pub(crate) fn oldest(&self, l: usize, out: &mut [(u32, u32)]) -> usize {
        let mut at = self.order.scan_start(l);
        let mut n = 0;
        for entry in out.iter_mut() {
            match self.order.next_with_payload(l, &mut at) {
                Some(e) => {
                    *entry = e;
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Starts loading the records the next `count` (up to 32) new ghosts will be written to
    /// (the most recently freed ones): writing a key into a cold record would otherwise wait
    /// for the line. A hint only.
    pub(crate) fn prefetch_free(&self, count: usize) {
        for &g in self.free.iter().rev().take(count.min(32)) {
            if let Some(ghost) = self.ghosts.get(g as usize) {
                // A record may straddle two lines: request both ends.
                crate::memory::prefetch(ghost);
                crate::memory::prefetch(&ghost.list);
            }
            self.order.prefetch_position(g);
        }
    }

    /// The ghosts of list `l`, oldest first.
    pub(crate) fn iter(&self, l: usize) -> impl Iterator<Item = u32> + '_ {
        self.order.iter(l)
    }

    /// Forgets every ghost.
    pub(crate) fn clear(&mut self) {
        *self = Self::new();
    }

    /// Ids that are neither live nor free, or live in a list they do not record; the first
    /// problem, described.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut seen = vec![false; self.ghosts.len()];
        for l in 0..GHOST_LISTS {
            for g in self.order.iter(l) {
                if self.list(g) != l || std::mem::replace(&mut seen[g as usize], true) {
                    return Err(format!("ghost {g} is listed twice or in the wrong list"));
                }
            }
        }
        for &g in &self.free {
            if std::mem::replace(&mut seen[g as usize], true) {
                return Err(format!("free ghost {g} is also live or freed twice"));
            }
        }
        if seen.iter().any(|&s| !s) {
            return Err("a ghost id is neither live nor free".into());
        }
        Ok(())
    }
}

/// A ghost id that names none.
pub(crate) const NO_GHOST: u32 = NIL;
