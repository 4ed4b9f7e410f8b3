//! A bounded work queue with priority lanes.
//!
//! Lanes are served in the order they were declared (lane 0 first). A lane may carry a fairness
//! bound ([`LaneSpec::served_after`]): once `n` entries of higher lanes were taken in a row while
//! it had work waiting, its oldest entry goes next — so a tier can put loads (an engine waits)
//! before stores without starving them. A lane may be bounded in entries and in bytes; a
//! submission that does not fit is refused and handed back ([`Refused`]), except that an
//! oversized submission is accepted into an empty lane (otherwise it could never run).
//! [`WorkQueue::close`] refuses further submissions; workers take what is queued, then stop.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::counters::KitCounters;

/// How much a piece of work carries: the keys (chunks) in it and their bytes. Bounds and
/// depths add these up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Weight {
    /// Keys or chunks.
    pub items: u64,
    /// Payload bytes.
    pub bytes: u64,
}

impl Weight {
    /// `items` items of `bytes` bytes in all.
    #[must_use]
    pub fn new(items: u64, bytes: u64) -> Self {
        Self { items, bytes }
    }

    fn add(&mut self, other: Weight) {
        self.items += other.items;
        self.bytes += other.bytes;
    }

    fn sub(&mut self, other: Weight) {
        self.items = self.items.saturating_sub(other.items);
        self.bytes = self.bytes.saturating_sub(other.bytes);
    }
}

/// One lane's bounds and fairness.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaneSpec {
    max_entries: Option<usize>,
    max_bytes: Option<u64>,
    served_after: Option<usize>,
    flag: bool,
}

impl LaneSpec {
    /// A lane without bounds, served only when every higher lane is empty.
    #[must_use]
    pub fn unbounded() -> Self {
        Self::default()
    }

    /// A lane of at most one entry whose refusals mean "already asked for" rather than
    /// rejected work (a pending probe, a due refresh): they are not counted.
    #[must_use]
    pub fn flag() -> Self {
        Self {
            max_entries: Some(1),
            flag: true,
            ..Self::default()
        }
    }

    /// Refuses what would take the lane past `n` queued entries.
    #[must_use]
    pub fn max_entries(mut self, n: usize) -> Self {
        self.max_entries = Some(n);
        self
    }

    /// Refuses what would take the lane past `bytes` queued bytes.
    #[must_use]
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = Some(bytes);
        self
    }

    /// Serves this lane's oldest entry after `n` entries of higher lanes were taken in a row
    /// while it waited (`n` ≥ 1).
    #[must_use]
    pub fn served_after(mut self, n: usize) -> Self {
        self.served_after = Some(n.max(1));
        self
    }
}

/// Why a submission was handed back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusalReason {
    /// The lane's bound would be passed.
    Full,
    /// The queue is closed (the tier is stopping).
    Closed,
}

/// A refused submission, with the work handed back.
#[derive(Debug)]
pub struct Refused<W> {
    /// The work, untouched.
    pub work: W,
    /// Why.
    pub reason: RefusalReason,
}

/// What a lane holds and what its workers are running, for stats and cost models.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaneDepth {
    /// Entries queued.
    pub entries: usize,
    /// What the queued entries carry.
    pub queued: Weight,
    /// Entries taken by a worker and not finished. An entry stops counting when its worker is
    /// back at the queue, which may be just after the job it carried was reported.
    pub running: usize,
    /// What the running entries carry.
    pub in_flight: Weight,
    /// Submissions refused as full so far.
    pub rejected: u64,
}

/// Whom a submission wakes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WakePolicy {
    /// One idle worker per entry (all of them for a submission of several).
    #[default]
    PerEntry,
    /// Every idle worker, even for one entry: the first one the scheduler runs takes it. On a
    /// loaded machine one woken thread can wait behind another task's whole time slice.
    AllIdle,
}

struct Lane<W> {
    spec: LaneSpec,
    entries: VecDeque<(W, Weight)>,
    depth: LaneDepth,
    /// Entries of higher lanes taken in a row while this one waited.
    passed_over: usize,
}

impl<W> Lane<W> {
    fn fits(&self, n: usize, w: Weight) -> bool {
        let entries_ok = self
            .spec
            .max_entries
            .is_none_or(|max| self.depth.entries + n <= max.max(n));
        let bytes_ok = self
            .spec
            .max_bytes
            .is_none_or(|max| self.depth.queued.bytes + w.bytes <= max.max(w.bytes));
        entries_ok && bytes_ok
    }

    fn pop(&mut self) -> Option<(W, Weight)> {
        let (work, w) = self.entries.pop_front()?;
        self.depth.entries -= 1;
        self.depth.queued.sub(w);
        self.depth.running += 1;
        self.depth.in_flight.add(w);
        self.passed_over = 0;
        Some((work, w))
    }
}

struct State<W> {
    lanes: Vec<Lane<W>>,
    closed: bool,
}

impl<W> State<W> {
    /// The next entry by priority and fairness.
    fn next(&mut self) -> Option<(usize, W, Weight)> {
        let due = self
            .lanes
            .iter()
            .position(|l| !l.entries.is_empty() && l.spec.served_after.is_some_and(|n| l.passed_over >= n));
        let lane = due.or_else(|| self.lanes.iter().position(|l| !l.entries.is_empty()))?;
        for waiting in &mut self.lanes[lane + 1..] {
            if waiting.spec.served_after.is_some() && !waiting.entries.is_empty() {
                waiting.passed_over += 1;
            }
        }
        let (work, w) = self.lanes[lane].pop()?;
        Some((lane, work, w))
    }
}

/// A piece of work a worker took, with what the queue needs to account for it when it is done.
pub(crate) struct Taken<W> {
    pub(crate) lane: usize,
    pub(crate) work: W,
    pub(crate) weight: Weight,
}

type Weigh<W> = Box<dyn Fn(&W) -> Weight + Send + Sync>;

/// Builds a [`WorkQueue`]: lanes in priority order, how to weigh work, whom to wake.
pub struct QueueBuilder<W> {
    lanes: Vec<LaneSpec>,
    weigh: Weigh<W>,
    wake: WakePolicy,
    counters: Arc<KitCounters>,
}

impl<W> QueueBuilder<W> {
    /// Adds the next lane (lower priority than those before it).
    #[must_use]
    pub fn lane(mut self, spec: LaneSpec) -> Self {
        self.lanes.push(spec);
        self
    }

    /// How much a piece of work carries (default: one item, no bytes).
    #[must_use]
    pub fn weigh(mut self, weigh: impl Fn(&W) -> Weight + Send + Sync + 'static) -> Self {
        self.weigh = Box::new(weigh);
        self
    }

    /// Whom a submission wakes (default [`WakePolicy::PerEntry`]).
    #[must_use]
    pub fn wake(mut self, wake: WakePolicy) -> Self {
        self.wake = wake;
        self
    }

    /// Counts refusals into `counters` (shared with the tier's ledger and pool).
    #[must_use]
    pub fn counters(mut self, counters: Arc<KitCounters>) -> Self {
        self.counters = counters;
        self
    }

    /// The queue (one unbounded lane if none was declared).
    #[must_use]
    pub fn build(self) -> WorkQueue<W> {
        let specs = if self.lanes.is_empty() {
            vec![LaneSpec::unbounded()]
        } else {
            self.lanes
        };
        let lanes = specs
            .into_iter()
            .map(|spec| Lane {
                spec,
                entries: VecDeque::new(),
                depth: LaneDepth::default(),
                passed_over: 0,
            })
            .collect();
        WorkQueue {
            state: Mutex::new(State { lanes, closed: false }),
            ready: Condvar::new(),
            weigh: self.weigh,
            wake: self.wake,
            counters: self.counters,
        }
    }
}

/// The queue between a tier's handle and its workers. See the module documentation.
pub struct WorkQueue<W> {
    state: Mutex<State<W>>,
    ready: Condvar,
    weigh: Weigh<W>,
    wake: WakePolicy,
    counters: Arc<KitCounters>,
}

impl<W> std::fmt::Debug for WorkQueue<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("WorkQueue")
            .field("lanes", &s.lanes.iter().map(|l| l.depth).collect::<Vec<_>>())
            .field("closed", &s.closed)
            .finish_non_exhaustive()
    }
}

impl<W> WorkQueue<W> {
    /// A builder with no lanes yet.
    #[must_use]
    pub fn builder() -> QueueBuilder<W> {
        QueueBuilder {
            lanes: Vec::new(),
            weigh: Box::new(|_| Weight::new(1, 0)),
            wake: WakePolicy::default(),
            counters: Arc::default(),
        }
    }

    /// Queues `work` on `lane`, or hands it back when the lane is full or the queue closed.
    ///
    /// # Errors
    /// [`Refused`], with the work.
    ///
    /// # Panics
    /// `lane` was not declared.
    pub fn submit(&self, lane: usize, work: W) -> Result<(), Refused<W>> {
        self.submit_all(lane, vec![work]).map_err(|r| Refused {
            work: r
                .work
                .into_iter()
                .next()
                .expect("the refused submission is handed back whole"),
            reason: r.reason,
        })
    }

    /// Queues every piece of `works` on `lane`, or none of them (handed back in order).
    ///
    /// # Errors
    /// [`Refused`], with the works.
    ///
    /// # Panics
    /// `lane` was not declared.
    pub fn submit_all(&self, lane: usize, works: Vec<W>) -> Result<(), Refused<Vec<W>>> {
        if works.is_empty() {
            return Ok(());
        }
        let weights: Vec<Weight> = works.iter().map(|w| (self.weigh)(w)).collect();
        let mut total = Weight::default();
        for w in &weights {
            total.add(*w);
        }
        let n = works.len();
        let mut s = self.state.lock();
        let reason = if s.closed {
            Some(RefusalReason::Closed)
        } else if !s.lanes[lane].fits(n, total) {
            Some(RefusalReason::Full)
        } else {
            None
        };
        if let Some(reason) = reason {
            let l = &mut s.lanes[lane];
            if reason == RefusalReason::Full {
                l.depth.rejected += 1;
                if !l.spec.flag {
                    self.counters.rejected();
                }
            }
            return Err(Refused { work: works, reason });
        }
        let l = &mut s.lanes[lane];
        l.depth.entries += n;
        l.depth.queued.add(total);
        l.entries.extend(works.into_iter().zip(weights));
        drop(s);
        if n == 1 && self.wake == WakePolicy::PerEntry {
            self.ready.notify_one();
        } else {
            self.ready.notify_all();
        }
        Ok(())
    }

    /// Removes and returns every entry queued on `lane` (running ones are not touched).
    ///
    /// # Panics
    /// `lane` was not declared.
    pub fn drain_lane(&self, lane: usize) -> Vec<W> {
        let mut s = self.state.lock();
        let l = &mut s.lanes[lane];
        l.depth.entries = 0;
        l.depth.queued = Weight::default();
        l.entries.drain(..).map(|(w, _)| w).collect()
    }

    /// What `lane` holds and runs.
    ///
    /// # Panics
    /// `lane` was not declared.
    #[must_use]
    pub fn depth(&self, lane: usize) -> LaneDepth {
        self.state.lock().lanes[lane].depth
    }

    /// Refuses every later submission; workers finish what is queued, then stop.
    pub fn close(&self) {
        self.state.lock().closed = true;
        self.ready.notify_all();
    }

    /// Whether [`WorkQueue::close`] was called.
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.state.lock().closed
    }

    /// The next entry, waiting for one; `None` once the queue is closed and empty.
    pub(crate) fn take(&self) -> Option<Taken<W>> {
        let mut s = self.state.lock();
        loop {
            if let Some((lane, work, weight)) = s.next() {
                return Some(Taken { lane, work, weight });
            }
            if s.closed {
                return None;
            }
            self.ready.wait(&mut s);
        }
    }

    /// The next entry if one is queued (tests of the lane order).
    #[cfg(test)]
    pub(crate) fn try_take(&self) -> Option<Taken<W>> {
        let (lane, work, weight) = self.state.lock().next()?;
        Some(Taken { lane, work, weight })
    }

    /// A taken entry is done: it no longer counts as running.
    pub(crate) fn done(&self, lane: usize, weight: Weight) {
        let mut s = self.state.lock();
        let d = &mut s.lanes[lane].depth;
        d.running = d.running.saturating_sub(1);
        d.in_flight.sub(weight);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOADS: usize = 0;
    const STORES: usize = 1;

    fn order(q: &WorkQueue<u32>) -> Vec<u32> {
        std::iter::from_fn(|| {
            let t = q.try_take()?;
            q.done(t.lane, t.weight);
            Some(t.work)
        })
        .collect()
    }

    #[test]
    fn a_higher_lane_goes_first_and_a_lane_is_fifo() {
        let q = WorkQueue::builder()
            .lane(LaneSpec::unbounded())
            .lane(LaneSpec::unbounded())
            .build();
        q.submit(STORES, 10).unwrap();
        q.submit(STORES, 11).unwrap();
        q.submit(LOADS, 1).unwrap();
        q.submit(LOADS, 2).unwrap();
        assert_eq!(order(&q), vec![1, 2, 10, 11]);
    }

    #[test]
    fn a_waiting_lane_is_served_after_its_bound() {
        let q = WorkQueue::builder()
            .lane(LaneSpec::unbounded())
            .lane(LaneSpec::unbounded().served_after(3))
            .build();
        q.submit_all(STORES, vec![100, 101]).unwrap();
        q.submit_all(LOADS, (0..8).collect()).unwrap();
        // Three loads pass the waiting store, then one store; again; then the rest in priority.
        assert_eq!(order(&q), vec![0, 1, 2, 100, 3, 4, 5, 101, 6, 7]);
    }

    #[test]
    fn loads_taken_while_no_store_waits_do_not_count() {
        let q = WorkQueue::builder()
            .lane(LaneSpec::unbounded())
            .lane(LaneSpec::unbounded().served_after(2))
            .build();
        q.submit_all(LOADS, vec![0, 1, 2]).unwrap();
        assert_eq!(order(&q), vec![0, 1, 2]);
        q.submit(LOADS, 3).unwrap();
        q.submit(STORES, 100).unwrap();
        q.submit(LOADS, 4).unwrap();
        assert_eq!(order(&q), vec![3, 4, 100]);
    }

    #[test]
    fn a_full_lane_hands_the_work_back_and_counts_it() {
        let counters = Arc::new(KitCounters::new());
        let q = WorkQueue::builder()
            .lane(LaneSpec::unbounded().max_entries(2))
            .lane(LaneSpec::flag())
            .counters(Arc::clone(&counters))
            .build();
        q.submit_all(0, vec![1, 2]).unwrap();
        let refused = q.submit(0, 3).unwrap_err();
        assert_eq!((refused.work, refused.reason), (3, RefusalReason::Full));
        q.submit(1, 9).unwrap();
        assert_eq!(q.submit(1, 9).unwrap_err().reason, RefusalReason::Full);
        assert_eq!(q.depth(0).rejected, 1);
        assert_eq!(q.depth(1).rejected, 1);
        assert_eq!(
            counters.snapshot().rejected,
            1,
            "a flag lane's refusal is not a rejection"
        );
    }

    #[test]
    fn an_oversized_submission_fits_only_an_empty_lane_and_whole() {
        let q = WorkQueue::builder()
            .lane(LaneSpec::unbounded().max_entries(2).max_bytes(100))
            .weigh(|w: &u32| Weight::new(1, u64::from(*w)))
            .build();
        q.submit_all(0, vec![10, 20, 30]).unwrap();
        let refused = q.submit_all(0, vec![1]).unwrap_err();
        assert_eq!(refused.work, vec![1]);
        assert_eq!(q.depth(0).entries, 3, "nothing of a refused submission is queued");
        q.drain_lane(0);
        q.submit(0, 90).unwrap();
        assert_eq!(
            q.submit(0, 20).unwrap_err().reason,
            RefusalReason::Full,
            "bytes bound"
        );
        assert_eq!(q.depth(0).queued, Weight::new(1, 90));
    }

    #[test]
    fn depth_follows_work_from_queued_to_running_to_done() {
        let q = WorkQueue::builder()
            .lane(LaneSpec::unbounded())
            .weigh(|w: &u32| Weight::new(u64::from(*w), 8 * u64::from(*w)))
            .build();
        q.submit(0, 4).unwrap();
        assert_eq!(q.depth(0).queued, Weight::new(4, 32));
        let t = q.take().unwrap();
        let d = q.depth(0);
        assert_eq!((d.entries, d.running, d.in_flight), (0, 1, Weight::new(4, 32)));
        q.done(t.lane, t.weight);
        assert_eq!(q.depth(0), LaneDepth::default());
    }

    #[test]
    fn a_closed_queue_refuses_and_ends_takers_once_empty() {
        let q = WorkQueue::builder().build();
        q.submit(0, 1).unwrap();
        q.close();
        assert_eq!(q.submit(0, 2).unwrap_err().reason, RefusalReason::Closed);
        assert_eq!(q.take().map(|t| t.work), Some(1), "queued work is still served");
        assert!(q.take().is_none());
    }
}
