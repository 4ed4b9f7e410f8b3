//! Ordered sets of dense `u32` node ids kept as append logs with holes.
//!
//! A doubly-linked list answers "the oldest member" in O(1), but walking it from the front is a
//! chain of dependent loads: every step waits for the previous node's link before it knows where
//! to look next, so dropping the 16 oldest ghosts of a large tier pays 16 cache misses one after
//! the other. Here each ordered set is a vector of elements in order (front = oldest), each a node
//! id with a 32-bit payload of the caller's, and each node knows its index in it:
//! - appending writes the next element;
//! - removing a member overwrites its element with a hole (found through the node's index);
//! - moving a member to the back is a removal and an append (the payload moves along);
//! - scanning from the front reads consecutive elements, whose addresses are known in advance, so
//!   whatever the scan needs per node can be requested for many nodes at once.
//!
//! This suits FIFO-like orders (ghost lists: appended at the back, dropped at the front, rarely
//! moved). Orders that move members to the back all the time (T1/T2 under touches) stay linked
//! lists: there every move would also pay, amortized, a compaction write per member.
//!
//! Holes and the consumed front are reclaimed by compacting the log in place once they outnumber
//! the live members (plus a small slack), so each log holds at most about twice its members, and
//! compaction's linear cost is paid for by the removals that made the holes: O(1) amortized per
//! operation, no allocation once the logs reached their largest size.

/// The "no node" marker; also marks a hole in a log.
pub(crate) const NIL: u32 = u32::MAX;

/// A log element: the node in the low half, the caller's 32-bit payload in the high half.
const HOLE: u64 = NIL as u64;

#[inline]
fn node_of(element: u64) -> u32 {
    element as u32
}

/// Holes tolerated beyond the live count before compacting (keeps tiny logs from compacting at
/// every removal; small, so the recorded transcripts' tiny tiers exercise compaction too).
const SLACK: usize = 2;

#[derive(Debug, Default, Clone)]
struct Log {
    /// Elements in order from `head`, with holes; `buf[head]` is live unless empty.
    buf: Vec<u64>,
    head: usize,
    live: usize,
}

/// `N` disjoint ordered sets over node ids `0..n` (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Rings<const N: usize> {
    /// Each node's index in the log of the set holding it ([`NIL`] when in none).
    pos: Vec<u32>,
    logs: [Log; N],
}

impl<const N: usize> Default for Rings<N> {
    fn default() -> Self {
        Self::with_nodes(0)
    }
}

impl<const N: usize> Rings<N> {
    /// Empty sets over nodes `0..n`.
    pub(crate) fn with_nodes(n: usize) -> Self {
        Self {
            pos: crate::memory::filled_vec(n, NIL),
            logs: std::array::from_fn(|_| Log::default()),
        }
    }

    /// Makes room for node ids below `n`.
    pub(crate) fn grow_to(&mut self, n: usize) {
        if self.pos.len() < n {
            self.pos.resize(n, NIL);
        }
    }

    /// Starts loading node `n`'s position entry (written when it joins a set). A hint only.
    #[inline]
    pub(crate) fn prefetch_position(&self, n: u32) {
        if let Some(p) = self.pos.get(n as usize) {
            crate::memory::prefetch(p);
        }
    }

    /// Members of set `l`.
    #[inline]
    pub(crate) fn len(&self, l: usize) -> usize {
        self.logs[l].live
    }

    /// The oldest member of set `l`, or [`NIL`].
    #[cfg(test)]
    pub(crate) fn front(&self, l: usize) -> u32 {
        let log = &self.logs[l];
        log.buf.get(log.head).map_or(NIL, |&e| node_of(e))
    }

    /// Whether node `n` is a member of some set. Checked against the logs, since
    /// [`Rings::pop_front`] leaves a popped node's position stale: an element that is not a hole
    /// at or after a log's head is live, and a live node is at its recorded position.
    #[inline]
    pub(crate) fn contains(&self, n: u32) -> bool {
        let Some(&p) = self.pos.get(n as usize) else {
            return false;
        };
        p != NIL
            && self.logs.iter().any(|log| {
                p as usize >= log.head
                    && log
                        .buf
                        .get(p as usize)
                        .is_some_and(|&e| e != HOLE && node_of(e) == n)
            })
    }

    /// Removes the oldest member of set `l` and returns it with its payload, or `None` when the
    /// set is empty. Its position is left stale rather than cleared (the front is read in order,
    /// the positions are not: clearing one would touch a line nothing else needs).
    #[inline]
    pub(crate) fn pop_front(&mut self, l: usize) -> Option<(u32, u32)> {
        let log = &mut self.logs[l];
        let &e = log.buf.get(log.head)?;
        log.head += 1;
        log.live -= 1;
        while log.buf.get(log.head) == Some(&HOLE) {
            log.head += 1;
        }
        self.tidy(l);
        Some((node_of(e), (e >> 32) as u32))
    }

    /// Whether `n` is the newest member of set `l`.
    #[inline]
    fn is_back(&self, l: usize, n: u32) -> bool {
        self.logs[l].buf.last().is_some_and(|&e| node_of(e) == n)
    }

    /// Appends node `n` (in no set) at the back of set `l` with a payload that scans return with
    /// it (a ghost list keeps its key's index tag there, so trimming needs no other lookup).
    #[inline]
    pub(crate) fn push_back_with(&mut self, l: usize, n: u32, payload: u32) {
        let log = &mut self.logs[l];
        // Positions fit in u32: a log holds at most about twice the node count, itself below u32.
        self.pos[n as usize] = log.buf.len() as u32;
        log.buf.push((u64::from(payload) << 32) | u64::from(n));
        log.live += 1;
    }

    /// Removes member `n` of set `l`.
    #[inline]
    pub(crate) fn remove(&mut self, l: usize, n: u32) {
        let at = std::mem::replace(&mut self.pos[n as usize], NIL) as usize;
        let log = &mut self.logs[l];
        log.buf[at] = HOLE;
        log.live -= 1;
        if at == log.head {
            while log.buf.get(log.head) == Some(&HOLE) {
                log.head += 1;
            }
        }
        self.tidy(l);
    }

    /// Moves member `n` of set `l` to its back.
    #[inline]
    pub(crate) fn move_to_back(&mut self, l: usize, n: u32) {
        if !self.is_back(l, n) {
            let payload = self.payload_of(l, n);
            self.remove(l, n);
            self.push_back_with(l, n, payload);
        }
    }

    /// Moves member `n` of set `from` to the back of set `to`.
    #[inline]
    pub(crate) fn move_across(&mut self, from: usize, to: usize, n: u32) {
        if from == to {
            self.move_to_back(to, n);
        } else {
            let payload = self.payload_of(from, n);
            self.remove(from, n);
            self.push_back_with(to, n, payload);
        }
    }

    /// The payload member `n` of set `l` was appended with.
    #[inline]
    fn payload_of(&self, l: usize, n: u32) -> u32 {
        (self.logs[l].buf[self.pos[n as usize] as usize] >> 32) as u32
    }

    /// Rewrites log `l` without holes from index 0, updating its members' positions.
    /// After a removal from set `l`: an empty log restarts at its beginning, and one that is
    /// mostly holes is compacted.
    #[inline]
    fn tidy(&mut self, l: usize) {
        let log = &mut self.logs[l];
        if log.live == 0 {
            log.buf.clear();
            log.head = 0;
        } else if log.buf.len() - log.live > log.live + SLACK {
            self.compact(l);
        }
    }

    fn compact(&mut self, l: usize) {
        let log = &mut self.logs[l];
        let mut j = 0;
        for i in log.head..log.buf.len() {
            let e = log.buf[i];
            if e != HOLE {
                log.buf[j] = e;
                self.pos[node_of(e) as usize] = j as u32;
                j += 1;
            }
        }
        log.buf.truncate(j);
        log.head = 0;
    }

    /// A scan position at the front of set `l`, for [`Rings::next_with_payload`].
    #[inline]
    pub(crate) fn scan_start(&self, l: usize) -> usize {
        self.logs[l].head
    }

    /// The first member of set `l` at or after scan position `*at`, with its payload, advancing
    /// `*at` past it; `None` at the end. Positions are valid until the set changes.
    #[inline]
    pub(crate) fn next_with_payload(&self, l: usize, at: &mut usize) -> Option<(u32, u32)> {
        let buf = &self.logs[l].buf;
        while let Some(&e) = buf.get(*at) {
            *at += 1;
            if e != HOLE {
                return Some((node_of(e), (e >> 32) as u32));
            }
        }
        None
    }

    /// The members of set `l`, front to back.
    pub(crate) fn iter(&self, l: usize) -> impl Iterator<Item = u32> + '_ {
        let log = &self.logs[l];
        log.buf[log.head..]
            .iter()
            .filter(|&&e| e != HOLE)
            .map(|&e| node_of(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reference ordered set: a plain vector.
    fn check(r: &Rings<2>, model: &[Vec<u32>; 2]) {
        for (l, members) in model.iter().enumerate() {
            assert_eq!(&r.iter(l).collect::<Vec<_>>(), members, "set {l}");
            assert_eq!(r.len(l), members.len());
            assert_eq!(r.front(l), members.first().copied().unwrap_or(NIL));
            let mut at = r.scan_start(l);
            let mut scanned = Vec::new();
            while let Some((n, payload)) = r.next_with_payload(l, &mut at) {
                assert_eq!(payload, n * 3, "a node keeps its payload through moves");
                scanned.push(n);
            }
            assert_eq!(&scanned, members);
        }
    }

    #[test]
    fn agrees_with_a_vector_model_under_churn_and_compaction() {
        const NODES: u32 = 200;
        let mut r = Rings::<2>::with_nodes(NODES as usize);
        let mut model: [Vec<u32>; 2] = [Vec::new(), Vec::new()];
        let mut owner: Vec<Option<usize>> = vec![None; NODES as usize];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for step in 0..50_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let n = (state % u64::from(NODES)) as u32;
            let l = ((state >> 20) % 2) as usize;
            match (owner[n as usize], (state >> 30) % 3) {
                (None, _) => {
                    r.push_back_with(l, n, n * 3);
                    model[l].push(n);
                    owner[n as usize] = Some(l);
                }
                (Some(from), 0) => {
                    r.remove(from, n);
                    model[from].retain(|&m| m != n);
                    owner[n as usize] = None;
                }
                (Some(from), _) => {
                    r.move_across(from, l, n);
                    model[from].retain(|&m| m != n);
                    model[l].push(n);
                    owner[n as usize] = Some(l);
                }
            }
            if step % 997 == 0 {
                check(&r, &model);
            }
        }
        check(&r, &model);
        // Holes never outgrow the members by more than the slack.
        for log in &r.logs {
            assert!(log.buf.len() - log.head <= 2 * log.live + SLACK + 1);
        }
        for (l, members) in model.iter_mut().enumerate() {
            for n in std::mem::take(members) {
                r.remove(l, n);
            }
        }
        check(&r, &model);
        r.push_back_with(1, 3, 9);
        check(&r, &[Vec::new(), vec![3]]);
    }

    #[test]
    fn pop_front_takes_the_oldest_and_membership_stays_exact() {
        let mut r = Rings::<2>::with_nodes(16);
        for n in 0..10 {
            r.push_back_with(n as usize % 2, n, n + 100);
        }
        r.remove(0, 2);
        r.move_to_back(0, 0);
        // Set 0 is now 4, 6, 8, 0; set 1 is 1, 3, 5, 7, 9.
        assert_eq!(r.pop_front(0), Some((4, 104)));
        assert_eq!(r.pop_front(1), Some((1, 101)));
        assert!(!r.contains(4) && !r.contains(1) && !r.contains(2));
        assert!((0..10).filter(|n| ![1, 2, 4].contains(n)).all(|n| r.contains(n)));
        // A popped node pushed again is a member again, wherever its stale position pointed.
        r.push_back_with(1, 4, 7);
        assert!(r.contains(4));
        while r.pop_front(0).is_some() {}
        assert_eq!((r.len(0), r.iter(0).count()), (0, 0));
        assert!(!r.contains(0) && !r.contains(6) && !r.contains(8));
        assert_eq!(r.iter(1).collect::<Vec<_>>(), vec![3, 5, 7, 9, 4]);
        assert_eq!(r.pop_front(0), None);
        assert!(!r.contains(99), "a node beyond the range is in no set");
    }

    #[test]
    fn front_skips_removed_members_and_moving_the_back_is_a_no_op() {
        let mut r = Rings::<1>::with_nodes(8);
        for n in [4, 2, 7] {
            r.push_back_with(0, n, 0);
        }
        r.move_to_back(0, 7);
        assert_eq!(r.iter(0).collect::<Vec<_>>(), vec![4, 2, 7]);
        r.remove(0, 4);
        assert_eq!(r.front(0), 2);
        r.move_to_back(0, 2);
        assert_eq!((r.front(0), r.iter(0).collect::<Vec<_>>()), (7, vec![7, 2]));
        r.grow_to(20);
        r.push_back_with(0, 19, 0xABCD);
        r.move_to_back(0, 7);
        assert_eq!(r.iter(0).collect::<Vec<_>>(), vec![2, 19, 7]);
        let mut at = r.scan_start(0);
        let scanned: Vec<_> = std::iter::from_fn(|| r.next_with_payload(0, &mut at)).collect();
        assert_eq!(
            scanned,
            vec![(2, 0), (19, 0xABCD), (7, 0)],
            "payloads follow moves"
        );
    }
}
