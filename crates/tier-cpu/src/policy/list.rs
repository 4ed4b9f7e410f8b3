//! Intrusive doubly-linked lists over dense `u32` node ids.
//!
//! Every policy orders chunk ids (and, for LRU, a few sentinel ids) in lists whose links live in
//! two flat arrays. A node is in at most one list of a given [`Links`] at a time, so several lists
//! (ARC's T1 and T2, S3-FIFO's small and main queues) share one pair of arrays. Every operation
//! is O(1) and allocation-free once the arrays are sized.

/// The "no node" marker.
pub(crate) const NIL: u32 = u32::MAX;

/// One node's neighbours and the payload its policy keeps with them. Kept side by side so
/// unlinking a node reads one cache line for it (and one per neighbour), not one per array, and
/// a policy that updates a node's payload whenever it moves the node (LRU's rank) finds it on
/// the line the move loads anyway.
#[derive(Debug, Clone, Copy)]
struct Link<T> {
    prev: u32,
    next: u32,
    data: T,
}

/// The links shared by the lists built over them, indexed by node id, each with a payload of
/// type `T` (none by default) that list operations leave as it is.
#[derive(Debug, Default, Clone)]
pub(crate) struct Links<T: Copy + Default = ()> {
    nodes: Vec<Link<T>>,
}

impl<T: Copy + Default> Links<T> {
    /// Links for nodes `0..n`, all detached, with default payloads.
    pub(crate) fn with_nodes(n: usize) -> Self {
        Self {
            nodes: crate::memory::filled_vec(n, Self::fresh()),
        }
    }

    fn fresh() -> Link<T> {
        Link {
            prev: NIL,
            next: NIL,
            data: T::default(),
        }
    }

    /// Makes room for node ids below `n`.
    pub(crate) fn grow_to(&mut self, n: usize) {
        if self.nodes.len() < n {
            self.nodes.resize(n, Self::fresh());
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

    /// Node `n`'s payload.
    #[inline]
    pub(crate) fn data(&self, n: u32) -> T {
        self.nodes[n as usize].data
    }

    /// Sets node `n`'s payload.
    #[inline]
    pub(crate) fn set_data(&mut self, n: u32, data: T) {
        self.nodes[n as usize].data = data;
    }

    /// Starts loading node `n`'s links (a hint only).
    #[inline]
    pub(crate) fn prefetch_node(&self, n: u32) {
        if let Some(link) = self.nodes.get(n as usize) {
            crate::memory::prefetch(link);
        }
    }

    /// Starts loading the links of `nodes` and then of their neighbours, so moving a batch of
    /// nodes overlaps its cache misses. A hint only: no list changes.
    pub(crate) fn prefetch<'a>(&self, nodes: impl Iterator<Item = u32> + Clone + 'a) {
        for n in nodes.clone().take(32) {
            if let Some(link) = self.nodes.get(n as usize) {
                crate::memory::prefetch(link);
            }
        }
        self.prefetch_neighbours(nodes);
    }

    /// Starts loading the links of the neighbours of `nodes`, whose own links were requested
    /// earlier (see [`Links::prefetch`]). A hint only.
    pub(crate) fn prefetch_neighbours(&self, nodes: impl Iterator<Item = u32>) {
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

    /// Marks node `n`, which some list just dropped, as in no list (its payload stays).
    #[inline]
    pub(crate) fn detach(&mut self, n: u32) {
        self.set_ends(n, NIL, NIL);
    }

    #[inline]
    fn set_ends(&mut self, n: u32, prev: u32, next: u32) {
        let link = &mut self.nodes[n as usize];
        link.prev = prev;
        link.next = next;
    }

    #[inline]
    fn ends(&self, n: u32) -> (u32, u32) {
        let link = &self.nodes[n as usize];
        (link.prev, link.next)
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
    pub(crate) fn push_back<T: Copy + Default>(&mut self, links: &mut Links<T>, n: u32) {
        links.set_ends(n, self.tail, NIL);
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
    pub(crate) fn insert_after<T: Copy + Default>(&mut self, links: &mut Links<T>, at: u32, n: u32) {
        let after = links.next(at);
        links.set_ends(n, at, after);
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
    pub(crate) fn remove<T: Copy + Default>(&mut self, links: &mut Links<T>, n: u32) {
        let (p, x) = links.ends(n);
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
        links.detach(n);
        self.len -= 1;
    }

    /// Drops the first `k` members, which `rest` follows (`rest` is [`NIL`] when they are all
    /// the members). Their own links are left as they were: the caller detaches them.
    #[inline]
    pub(crate) fn unlink_front<T: Copy + Default>(&mut self, links: &mut Links<T>, k: usize, rest: u32) {
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
    pub(crate) fn move_to_back<T: Copy + Default>(&mut self, links: &mut Links<T>, n: u32) {
        let tail = self.tail;
        if tail == n {
            return;
        }
        // `n` is not the tail, so it has a successor, and the list keeps a tail after `n`
        // leaves: the unlink and the append each lose a branch of `remove` and `push_back`.
        let (p, x) = links.ends(n);
        if p == NIL {
            self.head = x;
        } else {
            links.set_next(p, x);
        }
        links.set_prev(x, p);
        links.set_next(tail, n);
        links.set_ends(n, tail, NIL);
        self.tail = n;
    }

    /// Forgets every node (their links are left stale; callers reset or overwrite them).
    pub(crate) fn clear(&mut self) {
        *self = Self::new();
    }

    /// The members from front to back (for tests and diagnostics).
    pub(crate) fn iter<'a, T: Copy + Default>(&self, links: &'a Links<T>) -> ListIter<'a, T> {
        ListIter {
            links,
            cur: self.head,
        }
    }
}

/// Iterator over a list's members, front to back.
pub(crate) struct ListIter<'a, T: Copy + Default> {
    links: &'a Links<T>,
    cur: u32,
}

impl<T: Copy + Default> Iterator for ListIter<'_, T> {
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

    fn members<T: Copy + Default>(l: &List, links: &Links<T>) -> Vec<u32> {
        l.iter(links).collect()
    }

    #[test]
    fn push_insert_remove_keep_both_directions_consistent() {
        let mut links: Links = Links::with_nodes(8);
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
        let mut links: Links = Links::with_nodes(8);
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
        let mut links: Links = Links::with_nodes(4);
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

    #[test]
    fn list_operations_keep_each_nodes_payload() {
        let mut links: Links<u64> = Links::with_nodes(4);
        let mut l = List::new();
        for n in 0..4 {
            links.set_data(n, 100 + u64::from(n));
            l.push_back(&mut links, n);
        }
        l.move_to_back(&mut links, 1);
        l.remove(&mut links, 2);
        l.insert_after(&mut links, 0, 2);
        l.unlink_front(&mut links, 1, 2);
        links.detach(0);
        assert_eq!(members(&l, &links), vec![2, 3, 1]);
        for n in 0..4 {
            assert_eq!(links.data(n), 100 + u64::from(n), "node {n}");
        }
        links.grow_to(6);
        assert_eq!(links.data(5), 0, "a new node starts with the default payload");
    }
}
