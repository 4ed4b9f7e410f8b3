//! Intrusive doubly-linked lists over dense `u32` node ids.
//!
//! Every policy orders chunk ids (and, for LRU, a few sentinel ids) in lists whose links live in
//! two flat arrays. A node is in at most one list of a given [`Links`] at a time, so several lists
//! (ARC's T1 and T2, S3-FIFO's small and main queues) share one pair of arrays. Every operation
//! is O(1) and allocation-free once the arrays are sized.

/// The "no node" marker.
pub(crate) const NIL: u32 = u32::MAX;

/// One node's neighbours. Kept side by side so unlinking a node reads one cache line for it
/// (and one per neighbour), not one per array.
#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
}

const DETACHED: Link = Link { prev: NIL, next: NIL };

/// The links shared by the lists built over them, indexed by node id.
#[derive(Debug, Default, Clone)]
pub(crate) struct Links {
    nodes: Vec<Link>,
}

impl Links {
    /// Links for nodes `0..n`, all detached.
    pub(crate) fn with_nodes(n: usize) -> Self {
        Self {
            nodes: crate::memory::filled_vec(n, DETACHED),
        }
    }

    /// Makes room for node ids below `n`.
    pub(crate) fn grow_to(&mut self, n: usize) {
        if self.nodes.len() < n {
            self.nodes.resize(n, DETACHED);
        }
    }

    /// The node after `n`, or [`NIL`].
    #[inline]
    pub(crate) fn next(&self, n: u32) -> u32 {
        self.nodes[n as usize].next
    }

    /// The node before `n`, or [`NIL`].
    #[inline]
    pub(crate) fn prev(&self, n: u32) -> u32 {
        self.nodes[n as usize].prev
    }

    /// Starts loading the links of `nodes` and then of their neighbours, so moving a batch of
    /// nodes overlaps its cache misses. A hint only: no list changes.
    pub(crate) fn prefetch<'a>(&self, nodes: impl Iterator<Item = u32> + Clone + 'a) {
        for n in nodes.clone().take(32) {
            if let Some(link) = self.nodes.get(n as usize) {
                crate::memory::prefetch(link);
            }
        }
        for n in nodes.take(32) {
            if let Some(link) = self.nodes.get(n as usize) {
                for m in [link.prev, link.next] {
                    if let Some(neighbour) = self.nodes.get(m as usize) {
                        crate::memory::prefetch(neighbour);
                    }
                }
            }
        }
    }

    /// Marks node `n`, which some list just dropped, as in no list.
    #[inline]
    pub(crate) fn detach(&mut self, n: u32) {
        self.nodes[n as usize] = DETACHED;
    }

    #[inline]
    fn set_next(&mut self, n: u32, next: u32) {
        self.nodes[n as usize].next = next;
    }

    #[inline]
    fn set_prev(&mut self, n: u32, prev: u32) {
        self.nodes[n as usize].prev = prev;
    }
}

/// One list: its ends and length. The links live in a [`Links`] passed to every call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct List {
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for List {
    fn default() -> Self {
        Self::new()
    }
}

impl List {
    /// An empty list.
    pub(crate) const fn new() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// The first (least recent) node, or [`NIL`].
    #[inline]
    pub(crate) fn front(&self) -> u32 {
        self.head
    }

    /// Number of nodes.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the list has no node.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends detached node `n` at the back.
    #[inline]
    pub(crate) fn push_back(&mut self, links: &mut Links, n: u32) {
        links.nodes[n as usize] = Link {
            prev: self.tail,
            next: NIL,
        };
        if self.tail == NIL {
            self.head = n;
        } else {
            links.set_next(self.tail, n);
        }
        self.tail = n;
        self.len += 1;
    }

    /// Inserts detached node `n` right after `at` (a member of this list).
    #[inline]
    pub(crate) fn insert_after(&mut self, links: &mut Links, at: u32, n: u32) {
        let after = links.next(at);
        links.nodes[n as usize] = Link {
            prev: at,
            next: after,
        };
        links.set_next(at, n);
        if after == NIL {
            self.tail = n;
        } else {
            links.set_prev(after, n);
        }
        self.len += 1;
    }

    /// Unlinks member `n`.
    #[inline]
    pub(crate) fn remove(&mut self, links: &mut Links, n: u32) {
        let Link { prev: p, next: x } = links.nodes[n as usize];
        if p == NIL {
            self.head = x;
        } else {
            links.set_next(p, x);
        }
        if x == NIL {
            self.tail = p;
        } else {
            links.set_prev(x, p);
        }
        links.nodes[n as usize] = DETACHED;
        self.len -= 1;
    }

    /// Drops the first `k` members, which `rest` follows (`rest` is [`NIL`] when they are all
    /// the members). Their own links are left as they were: the caller detaches them.
    #[inline]
    pub(crate) fn unlink_front(&mut self, links: &mut Links, k: usize, rest: u32) {
        if k == 0 {
            return;
        }
        self.head = rest;
        if rest == NIL {
            self.tail = NIL;
        } else {
            links.set_prev(rest, NIL);
        }
        self.len -= k;
    }

    /// Moves member `n` to the back.
    #[inline]
    pub(crate) fn move_to_back(&mut self, links: &mut Links, n: u32) {
        let tail = self.tail;
        if tail == n {
            return;
        }
        // `n` is not the tail, so it has a successor, and the list keeps a tail after `n`
        // leaves: the unlink and the append each lose a branch of `remove` and `push_back`.
        let Link { prev: p, next: x } = links.nodes[n as usize];
        if p == NIL {
            self.head = x;
        } else {
            links.set_next(p, x);
        }
        links.set_prev(x, p);
        links.set_next(tail, n);
        links.nodes[n as usize] = Link {
            prev: tail,
            next: NIL,
        };
        self.tail = n;
    }

    /// Forgets every node (their links are left stale; callers reset or overwrite them).
    pub(crate) fn clear(&mut self) {
        *self = Self::new();
    }

    /// The members from front to back (for tests and diagnostics).
    pub(crate) fn iter<'a>(&self, links: &'a Links) -> ListIter<'a> {
        ListIter {
            links,
            cur: self.head,
        }
    }
}

/// Iterator over a list's members, front to back.
pub(crate) struct ListIter<'a> {
    links: &'a Links,
    cur: u32,
}

impl Iterator for ListIter<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.cur == NIL {
            return None;
        }
        let n = self.cur;
        self.cur = self.links.next(n);
        Some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(l: &List, links: &Links) -> Vec<u32> {
        l.iter(links).collect()
    }

    #[test]
    fn push_insert_remove_keep_both_directions_consistent() {
        let mut links = Links::with_nodes(8);
        let mut l = List::new();
        for n in [1, 2, 3] {
            l.push_back(&mut links, n);
        }
        l.insert_after(&mut links, 1, 5);
        l.insert_after(&mut links, 3, 7);
        assert_eq!(members(&l, &links), vec![1, 5, 2, 3, 7]);
        assert_eq!((l.front(), l.len()), (1, 5));
        l.remove(&mut links, 7);
        l.remove(&mut links, 5);
        assert_eq!(members(&l, &links), vec![1, 2, 3]);
        l.remove(&mut links, 1);
        assert_eq!(l.front(), 2);
        l.insert_after(&mut links, 3, 1);
        assert_eq!(links.prev(2), NIL);
        assert_eq!(links.next(1), NIL);
        assert_eq!(members(&l, &links), vec![2, 3, 1]);
        l.move_to_back(&mut links, 1);
        assert_eq!(members(&l, &links), vec![2, 3, 1]);
    }

    #[test]
    fn unlinking_a_prefix_keeps_the_rest_linked_both_ways() {
        let mut links = Links::with_nodes(8);
        let mut l = List::new();
        for n in [4, 1, 6, 2] {
            l.push_back(&mut links, n);
        }
        l.unlink_front(&mut links, 2, 6);
        for n in [4, 1] {
            links.detach(n);
        }
        assert_eq!(members(&l, &links), vec![6, 2]);
        assert_eq!((l.front(), l.len(), links.prev(6)), (6, 2, NIL));
        l.unlink_front(&mut links, 0, NIL);
        assert_eq!(members(&l, &links), vec![6, 2], "nothing to drop");
        l.unlink_front(&mut links, 2, NIL);
        assert!(l.is_empty() && l.front() == NIL);
        l.push_back(&mut links, 4);
        assert_eq!(members(&l, &links), vec![4]);
        assert_eq!((links.prev(4), links.next(4)), (NIL, NIL));
    }

    #[test]
    fn two_lists_share_links_and_a_node_moves_between_them() {
        let mut links = Links::with_nodes(4);
        let (mut a, mut b) = (List::new(), List::new());
        a.push_back(&mut links, 0);
        a.push_back(&mut links, 1);
        b.push_back(&mut links, 2);
        a.remove(&mut links, 0);
        b.push_back(&mut links, 0);
        assert_eq!(members(&a, &links), vec![1]);
        assert_eq!(members(&b, &links), vec![2, 0]);
        links.grow_to(10);
        b.push_back(&mut links, 9);
        assert_eq!(members(&b, &links), vec![2, 0, 9]);
        a.remove(&mut links, 1);
        assert!(a.is_empty());
        assert_eq!(a.front(), NIL);
    }
}
