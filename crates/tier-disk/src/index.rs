//! The in-memory index: which slot holds which key, in what state, and the LRU order of the
//! readable ones. Pure bookkeeping, no I/O; the tier keeps it behind one mutex.
//!
//! Slot life cycle:
//!
//! ```text
//!   Free ──reserve──▶ Writing ──commit──▶ Live ◀──pin/unpin (readers)
//!    ▲                  │ abort            │ evict (readers == 0)   │ fail_read
//!    └──────────────────┴──────────────────┘                        ▼
//!    ▲                                                    Retired (readers > 0)
//!    └──────────────────────── last unpin ─────────────────────────┘
//! ```
//!
//! Only `Live` keys answer lookups. A `Writing` slot is never evicted and never read; a slot
//! with readers is never evicted, so a load never races a rewrite of its slot.

use tiering_core::{KeyMap, OffloadKey};

const NIL: u32 = u32::MAX;

/// The state of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotState {
    /// Holds nothing the index cares about; may be written.
    Free,
    /// A store is writing `key` (write number `seq`) into it.
    Writing { key: OffloadKey, seq: u64 },
    /// Holds `key`, readable; `readers` loads are reading it.
    Live { key: OffloadKey, seq: u64, readers: u32 },
    /// Was dropped (failed verification) while loads were reading it; free when they finish.
    Retired { readers: u32 },
}

/// Result of [`Index::reserve`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reservation {
    /// Write into `slot` as write number `seq`; `evicted` lost its slot to make room.
    Slot {
        slot: u32,
        seq: u64,
        evicted: Option<OffloadKey>,
    },
    /// Every slot is being written or read.
    Full,
}

/// An intrusive doubly linked list over slot numbers, least recent at `head`.
struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    /// When each slot was last made most recent, in uses of the list (`clock` at the time).
    used_at: Vec<u64>,
    clock: u64,
}

impl Lru {
    fn new(n: usize) -> Self {
        Self {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            linked: vec![false; n],
            head: NIL,
            tail: NIL,
            used_at: vec![0; n],
            clock: 0,
        }
    }

    /// Uses of the list since `s` was last made most recent.
    fn age(&self, s: u32) -> u64 {
        self.clock - self.used_at[s as usize]
    }

    fn push_mru(&mut self, s: u32) {
        let i = s as usize;
        debug_assert!(!self.linked[i]);
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = s;
        } else {
            self.next[self.tail as usize] = s;
        }
        self.tail = s;
        self.linked[i] = true;
        self.clock += 1;
        self.used_at[i] = self.clock;
    }

    fn unlink(&mut self, s: u32) {
        let i = s as usize;
        if !self.linked[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.linked[i] = false;
    }

    fn touch(&mut self, s: u32) {
        if self.tail != s {
            self.unlink(s);
            self.push_mru(s);
        }
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors((self.head != NIL).then_some(self.head), |&s| {
            let n = self.next[s as usize];
            (n != NIL).then_some(n)
        })
    }
}

/// The index of one slab.
pub(crate) struct Index {
    states: Vec<SlotState>,
    map: KeyMap<u32>,
    free: Vec<u32>,
    lru: Lru,
    next_seq: u64,
    live: usize,
    /// The slot reserved last (by any job).
    last_reserved: Option<u32>,
}

impl Index {
    /// An index of `num_slots` free slots whose next write is number `next_seq`.
    pub(crate) fn new(num_slots: u32, next_seq: u64) -> Self {
        let n = num_slots as usize;
        Self {
            states: vec![SlotState::Free; n],
            map: KeyMap::default(),
            // Popped from the back: low slot numbers are used first.
            free: (0..num_slots).rev().collect(),
            lru: Lru::new(n),
            next_seq: next_seq.max(1),
            live: 0,
            last_reserved: None,
        }
    }

    /// An index holding the chunks found by the start-up scan, given as `(slot, key, seq)`. They
    /// are adopted in increasing `seq` order, so the LRU order follows write order; for a key
    /// found twice the newest write wins. Returns the index and the slots it did not adopt
    /// (out of range, taken twice, or an older copy of a key).
    pub(crate) fn recovered(
        num_slots: u32,
        next_seq: u64,
        mut found: Vec<(u32, OffloadKey, u64)>,
    ) -> (Self, Vec<u32>) {
        let mut ix = Self::new(num_slots, next_seq);
        ix.free.clear();
        // Newest first, so the first copy of a key seen is the one to keep.
        found.sort_by_key(|entry| std::cmp::Reverse(entry.2));
        let mut keep = Vec::with_capacity(found.len());
        let mut rejected = Vec::new();
        for (slot, key, seq) in found {
            let i = slot as usize;
            if i >= ix.states.len() || ix.states[i] != SlotState::Free || ix.map.contains_key(&key) {
                rejected.push(slot);
                continue;
            }
            ix.states[i] = SlotState::Live { key, seq, readers: 0 };
            ix.map.insert(key, slot);
            ix.next_seq = ix.next_seq.max(seq + 1);
            keep.push(slot);
        }
        for &slot in keep.iter().rev() {
            ix.lru.push_mru(slot);
        }
        ix.live = keep.len();
        ix.free = (0..num_slots)
            .rev()
            .filter(|&s| ix.states[s as usize] == SlotState::Free)
            .collect();
        rejected.retain(|&s| (s as usize) < ix.states.len() && ix.states[s as usize] == SlotState::Free);
        (ix, rejected)
    }

    /// Number of slots.
    pub(crate) fn capacity(&self) -> usize {
        self.states.len()
    }

    /// Number of readable (live) chunks.
    pub(crate) fn live(&self) -> usize {
        self.live
    }

    /// The state of `slot`.
    pub(crate) fn state(&self, slot: u32) -> Option<SlotState> {
        self.states.get(slot as usize).copied()
    }

    /// The slot and state holding `key` (live or being written).
    pub(crate) fn slot_of(&self, key: &OffloadKey) -> Option<(u32, SlotState)> {
        self.map.get(key).map(|&s| (s, self.states[s as usize]))
    }

    /// Whether `key` is readable.
    pub(crate) fn is_live(&self, key: &OffloadKey) -> bool {
        matches!(self.slot_of(key), Some((_, SlotState::Live { .. })))
    }

    /// Every readable key, least recent first.
    pub(crate) fn live_keys(&self) -> Vec<OffloadKey> {
        self.lru
            .iter()
            .filter_map(|s| match self.states[s as usize] {
                SlotState::Live { key, .. } => Some(key),
                _ => None,
            })
            .collect()
    }

    /// Marks `key` most recently used; false when it is not readable.
    pub(crate) fn touch(&mut self, key: &OffloadKey) -> bool {
        match self.slot_of(key) {
            Some((slot, SlotState::Live { .. })) => {
                self.lru.touch(slot);
                true
            }
            _ => false,
        }
    }

    /// Reserves a slot for writing `key`: a free one, else the least recently used live slot
    /// nobody reads. The caller must have checked that the key has no slot
    /// ([`slot_of`](Self::slot_of)).
    ///
    /// `after` is the slot reserved for the previous key of the same job: when no slot is free
    /// and the one after it is old (unused for as many uses of the LRU list as half the live
    /// chunks) and unread, it is evicted instead of the least recent one, so a job's slots
    /// stay consecutive and move in few calls. Without it, the LRU order, shuffled by the
    /// order in which concurrent runs finish, scatters every job over many short runs.
    pub(crate) fn reserve(&mut self, key: OffloadKey, after: Option<u32>) -> Reservation {
        let (slot, evicted) = if let Some(slot) = self.free.pop() {
            (slot, None)
        } else {
            let evictable = |s: u32| matches!(self.states[s as usize], SlotState::Live { readers: 0, .. });
            let old_enough = (self.live as u64 / 2).max(1);
            let next = after
                .and_then(|a| a.checked_add(1))
                .filter(|&n| (n as usize) < self.states.len())
                .filter(|&n| evictable(n) && self.lru.age(n) >= old_enough);
            let victim = next.or_else(|| self.lru.iter().find(|&s| evictable(s)));
            let Some(slot) = victim else {
                return Reservation::Full;
            };
            let SlotState::Live { key: old, .. } = self.states[slot as usize] else {
                return Reservation::Full;
            };
            self.lru.unlink(slot);
            self.map.remove(&old);
            self.live -= 1;
            (slot, Some(old))
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.states[slot as usize] = SlotState::Writing { key, seq };
        self.map.insert(key, slot);
        self.last_reserved = Some(slot);
        Reservation::Slot { slot, seq, evicted }
    }

    /// The slot reserved last, by any job: where the next job's writes would continue the
    /// file sequentially.
    pub(crate) fn last_reserved(&self) -> Option<u32> {
        self.last_reserved
    }

    /// The write into `slot` landed: its key becomes readable and most recently used.
    pub(crate) fn commit(&mut self, slot: u32) -> bool {
        let Some(SlotState::Writing { key, seq }) = self.state(slot) else {
            return false;
        };
        self.states[slot as usize] = SlotState::Live { key, seq, readers: 0 };
        self.lru.push_mru(slot);
        self.live += 1;
        true
    }

    /// The write into `slot` failed or was cancelled: the slot is free again.
    pub(crate) fn abort(&mut self, slot: u32) -> bool {
        let Some(SlotState::Writing { key, .. }) = self.state(slot) else {
            return false;
        };
        self.map.remove(&key);
        self.release(slot);
        true
    }

    fn release(&mut self, slot: u32) {
        self.states[slot as usize] = SlotState::Free;
        self.free.push(slot);
    }

    /// Pins `key`'s slot for a load; returns the slot and the write number to verify.
    pub(crate) fn pin(&mut self, key: &OffloadKey) -> Option<(u32, u64)> {
        let &slot = self.map.get(key)?;
        match &mut self.states[slot as usize] {
            SlotState::Live { seq, readers, .. } => {
                *readers += 1;
                Some((slot, *seq))
            }
            _ => None,
        }
    }

    /// A load of `slot` finished; `touch` marks it most recently used. A retired slot is freed
    /// by its last reader.
    pub(crate) fn unpin(&mut self, slot: u32, touch: bool) {
        match &mut self.states[slot as usize] {
            SlotState::Live { readers, .. } => {
                *readers = readers.saturating_sub(1);
                if touch {
                    self.lru.touch(slot);
                }
            }
            SlotState::Retired { readers } => {
                *readers = readers.saturating_sub(1);
                if *readers == 0 {
                    self.release(slot);
                }
            }
            SlotState::Free | SlotState::Writing { .. } => {}
        }
    }

    /// A pinned load of `slot` found it unreadable: the key is dropped now (later lookups miss)
    /// and the slot retires until its readers finish. Returns the dropped key, if this call
    /// dropped it. The caller still holds its pin and must [`unpin`](Self::unpin).
    pub(crate) fn retire(&mut self, slot: u32) -> Option<OffloadKey> {
        let SlotState::Live { key, readers, .. } = self.states[slot as usize] else {
            return None;
        };
        self.lru.unlink(slot);
        self.map.remove(&key);
        self.live -= 1;
        self.states[slot as usize] = SlotState::Retired { readers };
        Some(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    fn store(ix: &mut Index, n: u64) -> (u32, Option<OffloadKey>) {
        match ix.reserve(k(n), None) {
            Reservation::Slot { slot, evicted, .. } => {
                assert!(ix.commit(slot));
                (slot, evicted)
            }
            Reservation::Full => panic!("full"),
        }
    }

    #[test]
    fn free_slots_first_then_least_recent_evicted() {
        let mut ix = Index::new(3, 1);
        for n in 0..3 {
            assert_eq!(store(&mut ix, n).1, None);
        }
        assert!(ix.touch(&k(0)));
        assert_eq!(
            store(&mut ix, 3).1,
            Some(k(1)),
            "1 is least recent after touching 0"
        );
        assert_eq!(store(&mut ix, 4).1, Some(k(2)));
        assert_eq!(store(&mut ix, 5).1, Some(k(0)));
        assert_eq!(ix.live_keys(), vec![k(3), k(4), k(5)]);
        assert_eq!(ix.live(), 3);
    }

    #[test]
    fn a_job_continues_into_the_next_slot_when_it_is_old_and_unread() {
        let mut ix = Index::new(8, 1);
        for n in 0..8 {
            store(&mut ix, n);
        }
        // Slots 4..8 were used again (in shuffled order): 0..4 are the old half.
        for n in [6, 7, 5, 4] {
            assert!(ix.touch(&k(n)));
        }
        assert!(ix.touch(&k(0)));
        // Least recent is slot 1; a job that got slot 2 goes on with slot 3 (old), not 1.
        let Reservation::Slot { slot, evicted, .. } = ix.reserve(k(10), Some(2)) else {
            panic!("full");
        };
        assert_eq!((slot, evicted), (3, Some(k(3))));
        assert!(ix.commit(slot));
        // After slot 3 comes slot 4, used recently: the least recent slot (1) goes instead.
        let Reservation::Slot { slot, evicted, .. } = ix.reserve(k(11), Some(3)) else {
            panic!("full");
        };
        assert_eq!((slot, evicted), (1, Some(k(1))));
        // A pinned next slot is never taken.
        assert!(ix.commit(slot));
        let (pinned, _) = ix.pin(&k(2)).unwrap();
        assert_eq!(pinned, 2);
        let Reservation::Slot { slot, .. } = ix.reserve(k(12), Some(1)) else {
            panic!("full");
        };
        assert_ne!(slot, 2);
    }

    #[test]
    fn continuing_the_log_can_evict_newer_chunks_than_the_least_recent() {
        // What a crash test saw: 24 slots filled by two batches of 12 keys, the first batch's
        // run of slots 0 and 1 finishing after its other runs. The next batch of 12 starts at
        // the least recent slot (2) and continues the log through slot 13: the bar for "old"
        // is half the live chunks, and the batch's own reservations lower it from 12 to 6, so
        // slots 12 and 13 (keys 12 and 13, of the second batch) go while keys 0 and 1, written
        // before them, stay.
        let mut ix = Index::new(24, 1);
        for n in 0..24 {
            let Reservation::Slot {
                slot, evicted: None, ..
            } = ix.reserve(k(n), ix.last_reserved())
            else {
                panic!("slot {n} is free");
            };
            assert_eq!(slot as u64, n);
        }
        for slot in (2..12).chain([0, 1]).chain(12..24) {
            assert!(ix.commit(slot));
        }
        let mut taken = Vec::new();
        let mut evicted = Vec::new();
        for n in 24..36 {
            let Reservation::Slot { slot, evicted: e, .. } = ix.reserve(k(n), ix.last_reserved()) else {
                panic!("full");
            };
            taken.push(slot);
            evicted.extend(e);
        }
        assert_eq!(taken, (2..14).collect::<Vec<u32>>());
        assert_eq!(evicted, (2..14).map(k).collect::<Vec<_>>());
        assert!(
            ix.is_live(&k(0)) && ix.is_live(&k(1)),
            "the least recent chunks stay"
        );
        assert!(!ix.is_live(&k(12)) && !ix.is_live(&k(13)), "newer chunks went");
    }

    #[test]
    fn pinned_and_writing_slots_are_never_evicted() {
        let mut ix = Index::new(2, 1);
        store(&mut ix, 0);
        let (slot0, _) = ix.pin(&k(0)).unwrap();
        let Reservation::Slot {
            slot: writing,
            evicted: None,
            ..
        } = ix.reserve(k(1), None)
        else {
            panic!("a free slot was expected");
        };
        assert_eq!(
            ix.reserve(k(2), None),
            Reservation::Full,
            "one slot read, one written"
        );
        assert!(!ix.is_live(&k(1)), "a slot being written is not readable");
        assert!(matches!(ix.slot_of(&k(1)), Some((s, SlotState::Writing { .. })) if s == writing));
        ix.unpin(slot0, false);
        assert!(matches!(ix.reserve(k(2), None), Reservation::Slot { evicted: Some(e), .. } if e == k(0)));
        assert!(ix.abort(writing));
        assert_eq!(ix.slot_of(&k(1)), None);
    }

    #[test]
    fn retired_slot_is_freed_by_its_last_reader() {
        let mut ix = Index::new(1, 1);
        let (slot, _) = store(&mut ix, 7);
        ix.pin(&k(7)).unwrap();
        ix.pin(&k(7)).unwrap();
        assert_eq!(ix.retire(slot), Some(k(7)));
        assert_eq!(ix.retire(slot), None, "only the first failure drops the key");
        assert!(!ix.is_live(&k(7)));
        assert!(ix.pin(&k(7)).is_none());
        assert_eq!(
            ix.reserve(k(8), None),
            Reservation::Full,
            "still read by two loads"
        );
        ix.unpin(slot, false);
        assert_eq!(ix.reserve(k(8), None), Reservation::Full);
        ix.unpin(slot, false);
        assert!(matches!(
            ix.reserve(k(8), None),
            Reservation::Slot { evicted: None, .. }
        ));
    }

    #[test]
    fn recovery_orders_by_sequence_and_keeps_the_newest_copy() {
        let found = vec![
            (2, k(20), 5),
            (0, k(10), 9),
            (1, k(10), 11),
            (3, k(30), 2),
            (9, k(90), 1),
        ];
        let (mut ix, rejected) = Index::recovered(4, 1, found);
        assert_eq!(
            rejected,
            vec![0],
            "the older copy of k(10) is dropped; slot 9 is out of range"
        );
        assert_eq!(
            ix.live_keys(),
            vec![k(30), k(20), k(10)],
            "least recent = oldest write"
        );
        assert_eq!(ix.slot_of(&k(10)).map(|(s, _)| s), Some(1));
        let Reservation::Slot { slot, seq, evicted } = ix.reserve(k(40), None) else {
            panic!("slot 0 is free");
        };
        assert_eq!(
            (slot, seq, evicted),
            (0, 12, None),
            "sequence continues after the newest write"
        );
    }
}
