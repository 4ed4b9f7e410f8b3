//! Per-fetch timelines of the hand-off flow: where each fetch of a mode spent its time, a
//! summary of what dominates the tail, and (`--explain-slowest N`) the slowest fetches point by
//! point.
//!
//! The bench observes three moments itself: the consumer sent the fetch, the producer's copy
//! workers finished that request's copy (the latest rank), the consumer's step saw every chunk
//! resident. The rest comes from the fetch trace the tiers and the manager record while the
//! run is traced (`tiering_core::fetch_trace`): the producer's handler read the fetch message
//! (or its I/O thread relayed it), its control thread woke and took the manager lock, the
//! session bound the fetch, a completed store offered the chunks it waited for, the transfer
//! was submitted and taken up by the sender thread, the consumer's receiver began it and each
//! chunk landed. A round trip is cut into five segments that add up to it:
//!
//! - **control**: sent → the producer's session bound the fetch (the consumer handing the
//!   message to its socket, both ZeroMQ I/O threads, the producer's control thread waking and
//!   taking the lock — held by a producer step in its scheduling phase);
//! - **copy**: bound → the copy's end, when the store was still being copied;
//! - **completion**: → the transfer's submission (the copy workers' report waking the control
//!   thread, which completes the store and offers its chunks to the waiting fetch);
//! - **transfer**: → the last chunk landed in the consumer's row (sender and receiver threads);
//! - **consumer**: → the consumer's step saw every chunk (its poll).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use tiering_core::fetch_trace::{self, Point, Record};

use super::stall_probe::ProbeRecord;

/// Nanoseconds since `origin` (saturating), for atomics shared between the actors.
pub(super) fn nanos_since(origin: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(origin).as_nanos()).unwrap_or(u64::MAX)
}

/// What the actors record as the run goes, read after it.
pub(super) struct TimelineMarks {
    /// Per request: when its copy finished on every rank (ns since the origin; 0: not yet).
    copy_done: Vec<AtomicU64>,
    /// When the producer's current step began.
    step_began: AtomicU64,
    /// When the producer's latest scheduling phase ended (its `Step` dropped).
    sched_ended: AtomicU64,
}

impl TimelineMarks {
    pub(super) fn new(requests: usize) -> Self {
        Self {
            copy_done: (0..requests).map(|_| AtomicU64::new(0)).collect(),
            step_began: AtomicU64::new(0),
            sched_ended: AtomicU64::new(0),
        }
    }

    /// A rank finished request `i`'s copy at `at`: the request's copy ends with its last rank.
    pub(super) fn copy_finished(&self, i: usize, origin: Instant, at: Instant) {
        if let Some(slot) = self.copy_done.get(i) {
            slot.fetch_max(nanos_since(origin, at).max(1), Ordering::AcqRel);
        }
    }

    pub(super) fn step_began(&self, origin: Instant, at: Instant) {
        self.step_began.store(nanos_since(origin, at), Ordering::Release);
    }

    pub(super) fn sched_ended(&self, origin: Instant, at: Instant) {
        self.sched_ended.store(nanos_since(origin, at), Ordering::Release);
    }

    /// Whether the producer is in its scheduling phase now (its step began after the last
    /// phase ended).
    pub(super) fn producer_in_sched(&self) -> bool {
        self.sched_ended.load(Ordering::Acquire) < self.step_began.load(Ordering::Acquire)
    }

    fn copy_done_ns(&self, i: usize) -> Option<u64> {
        self.copy_done
            .get(i)
            .map(|a| a.load(Ordering::Acquire))
            .filter(|&t| t > 0)
    }
}

/// What the consumer saw of one measured fetch.
#[derive(Clone, Copy, Debug)]
pub(super) struct FetchSeen {
    /// The request.
    pub i: usize,
    /// The fetch's trace id (`fetch_trace::id_of` its request id).
    pub trace_id: u64,
    /// Sent, ns since the origin.
    pub sent_ns: u64,
    /// Every chunk seen resident, ns since the origin.
    pub landed_ns: u64,
    /// The producer was in its scheduling phase when the fetch left.
    pub sent_in_sched: bool,
    /// The gap between the consumer step that saw it land and the step before.
    pub poll_gap: Duration,
}

/// The fetch trace of one mode's run, with times made relative to the bench's origin.
#[derive(Default)]
pub(super) struct Trace {
    /// Per fetch: its points, in time order.
    fetches: HashMap<u64, Vec<(Point, u64)>>,
    /// The producer's control thread: when it woke, and when it took the lock.
    producer_woke: Vec<u64>,
    producer_locked: Vec<u64>,
    /// When the producer's waker was signalled (a copy worker's report, a tier's thread).
    producer_signalled: Vec<u64>,
}

impl Trace {
    /// Sorts `records` by what they are about; `origin` is the bench's origin, `producer` the
    /// trace id of the producer's waker.
    pub(super) fn new(records: &[Record], origin: Instant, producer: u64) -> Self {
        Self::with_base(records, fetch_trace::ns_of(origin), producer)
    }

    /// As [`Trace::new`], with the origin in trace time.
    fn with_base(records: &[Record], base: u64, producer: u64) -> Self {
        let mut t = Self::default();
        for r in records {
            let ns = r.ns.saturating_sub(base);
            match r.point {
                Point::ControlWoke if r.id == producer => t.producer_woke.push(ns),
                Point::ControlLocked if r.id == producer => t.producer_locked.push(ns),
                Point::WakeSignalled if r.id == producer => t.producer_signalled.push(ns),
                Point::WakeSignalled
                | Point::ControlWoke
                | Point::ControlLocked
                | Point::ControlSwept
                | Point::IoWoke => {}
                p => t.fetches.entry(r.id).or_default().push((p, ns)),
            }
        }
        for v in t.fetches.values_mut() {
            v.sort_by_key(|&(_, ns)| ns);
        }
        t.producer_woke.sort_unstable();
        t.producer_locked.sort_unstable();
        t.producer_signalled.sort_unstable();
        t
    }

    /// The first record of `p` for fetch `id`. Not filtered by the departure: the bench takes
    /// the departure's time after its step released the lock, and the producer may have read
    /// the message before a preempted consumer thread got to that.
    fn first(&self, id: u64, p: Point) -> Option<u64> {
        self.fetches
            .get(&id)?
            .iter()
            .find(|&&(q, _)| q == p)
            .map(|&(_, ns)| ns)
    }

    fn last(&self, id: u64, p: Point) -> Option<u64> {
        self.fetches
            .get(&id)?
            .iter()
            .rev()
            .find(|&&(q, _)| q == p)
            .map(|&(_, ns)| ns)
    }
}

/// The latest of `times` in `[from, to]`.
fn latest_in(times: &[u64], from: u64, to: u64) -> Option<u64> {
    let end = times.partition_point(|&t| t <= to);
    times[..end].last().copied().filter(|&t| t >= from)
}

/// The earliest of `times` at or after `from`.
fn earliest_from(times: &[u64], from: u64) -> Option<u64> {
    times.get(times.partition_point(|&t| t < from)).copied()
}

/// A part of a fetch's round trip (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Segment {
    /// Sent → the producer's session bound the fetch.
    Control,
    /// Bound → the copy of its store ended.
    Copy,
    /// → the transfer submitted (the store completed and offered).
    Completion,
    /// → the last chunk landed on the consumer.
    Transfer,
    /// → the consumer's step saw it.
    Consumer,
}

impl Segment {
    /// In round-trip order.
    pub const ALL: [Self; 5] = [
        Self::Control,
        Self::Copy,
        Self::Completion,
        Self::Transfer,
        Self::Consumer,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Control => "control",
            Self::Copy => "copy",
            Self::Completion => "completion",
            Self::Transfer => "transfer",
            Self::Consumer => "consumer",
        }
    }
}

/// One fetch's round trip, split. Times are ms after the fetch left; `None`: not in the trace.
#[derive(Clone, Debug, Serialize)]
pub struct FetchTimeline {
    /// The request (0 is the unmeasured warm-up).
    pub request: usize,
    /// Sent → every chunk seen resident, ms.
    pub rtt_ms: f64,
    /// The producer held its step (scheduling phase) when the fetch left.
    pub sent_in_sched: bool,
    /// The copy's end (negative: copied before the fetch left).
    pub copy_done_ms: Option<f64>,
    /// The consumer handed the fetch message to its control socket.
    pub socket_ms: Option<f64>,
    /// The producer's handler read the fetch off its control socket.
    pub read_ms: Option<f64>,
    /// The producer's I/O thread relayed it instead (the handler had not read it in time).
    pub relayed_ms: Option<f64>,
    /// The producer's control thread's last wake-up before the fetch was bound.
    pub control_woke_ms: Option<f64>,
    /// It took the manager lock for the sweep that bound the fetch.
    pub control_locked_ms: Option<f64>,
    /// The producer's session bound the fetch.
    pub bound_ms: Option<f64>,
    /// The producer's waker signalled after the copy ended (the copy workers' report).
    pub report_signalled_ms: Option<f64>,
    /// A completed store offered the chunks the fetch waited for.
    pub offered_ms: Option<f64>,
    /// The (last) transfer was submitted.
    pub submitted_ms: Option<f64>,
    /// The producer's sender thread took it up.
    pub sender_picked_ms: Option<f64>,
    /// The consumer's receiver began reading it.
    pub receiver_began_ms: Option<f64>,
    /// The last chunk landed.
    pub landed_ms: Option<f64>,
    /// The consumer's poll gap before it saw the fetch land, ms (the bench polls every 50 µs;
    /// a longer gap is a consumer thread that waited for a core).
    pub poll_gap_ms: f64,
    /// The five segments, ms, in [`Segment::ALL`] order (they add up to `rtt_ms`).
    pub segments_ms: [f64; 5],
    /// The longest segment.
    pub dominant: Segment,
    /// How late the idle probe thread woke at worst while the fetch was in flight, ms, when it
    /// woke at least a millisecond late then (a stall of the machine, see
    /// `stall_probe`), and this process's share of the cores meanwhile.
    pub machine_stall: Option<(f64, f64)>,
}

#[allow(clippy::cast_precision_loss)] // nanosecond spans of a bench run
fn ns_ms(ns: i128) -> f64 {
    ns as f64 / 1e6
}

/// Splits `f` with the copy ends in `marks` and the fetch trace.
fn split(f: &FetchSeen, marks: &TimelineMarks, trace: &Trace, probe: Option<&ProbeRecord>) -> FetchTimeline {
    let rel = |t: u64| ns_ms(i128::from(t) - i128::from(f.sent_ns));
    let id = f.trace_id;
    let copy = marks.copy_done_ns(f.i);
    let socket = trace.first(id, Point::FetchSent);
    let read = trace.first(id, Point::FetchRead);
    let relayed = trace.first(id, Point::FetchRelayed);
    let bound = trace.first(id, Point::FetchBound);
    let offered = trace.last(id, Point::StoreOffered);
    let submitted = trace.last(id, Point::TransferSubmitted);
    let picked = trace.last(id, Point::SenderPicked);
    let began = trace.last(id, Point::TransferBegun);
    let landed = trace.last(id, Point::ChunkLanded);
    let from = f.sent_ns.min(bound.unwrap_or(u64::MAX));
    let woke = bound.and_then(|b| latest_in(&trace.producer_woke, from.saturating_sub(1), b));
    let locked = bound.and_then(|b| latest_in(&trace.producer_locked, from.saturating_sub(1), b));
    let signalled = copy.and_then(|c| earliest_from(&trace.producer_signalled, c));
    // The cuts: a point the trace lacks takes the next known one (its segment folds into the
    // next), then each is clamped between its neighbours so that the segments add up.
    let seen = f.landed_ns;
    let mut cuts = [Some(f.sent_ns), bound, copy, submitted, landed, Some(seen)];
    for i in (0..cuts.len() - 1).rev() {
        cuts[i] = cuts[i].or(cuts[i + 1]);
    }
    let mut cuts = cuts.map(|c| c.unwrap_or(seen));
    for i in 1..cuts.len() {
        cuts[i] = cuts[i].clamp(cuts[i - 1], seen);
    }
    let mut segments_ms = [0.0; 5];
    for (s, w) in segments_ms.iter_mut().zip(cuts.windows(2)) {
        *s = ns_ms(i128::from(w[1]) - i128::from(w[0]));
    }
    let dominant = Segment::ALL
        .into_iter()
        .zip(segments_ms)
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(Segment::Control, |(s, _)| s);
    FetchTimeline {
        request: f.i,
        rtt_ms: rel(seen),
        sent_in_sched: f.sent_in_sched,
        copy_done_ms: copy.map(rel),
        socket_ms: socket.map(rel),
        read_ms: read.map(rel),
        relayed_ms: relayed.map(rel),
        control_woke_ms: woke.map(rel),
        control_locked_ms: locked.map(rel),
        bound_ms: bound.map(rel),
        report_signalled_ms: signalled.map(rel),
        offered_ms: offered.map(rel),
        submitted_ms: submitted.map(rel),
        sender_picked_ms: picked.map(rel),
        receiver_began_ms: began.map(rel),
        landed_ms: landed.map(rel),
        poll_gap_ms: f.poll_gap.as_secs_f64() * 1e3,
        segments_ms,
        dominant,
        machine_stall: probe
            .and_then(|p| p.worst_between(f.sent_ns, f.landed_ns))
            .map(|s| (s.late_ms(), s.process_share)),
    }
}

/// Every fetch of `seen` split, slowest first, each with the worst stall of the machine the
/// probe saw while it was in flight.
pub(super) fn timelines(
    seen: &[FetchSeen],
    marks: &TimelineMarks,
    trace: &Trace,
    probe: Option<&ProbeRecord>,
) -> Vec<FetchTimeline> {
    let mut all: Vec<FetchTimeline> = seen.iter().map(|f| split(f, marks, trace, probe)).collect();
    all.sort_by(|a, b| b.rtt_ms.total_cmp(&a.rtt_ms));
    all
}

/// What dominates a mode's tail: its slowest fetches (5 %, at least one), and per segment how
/// many of them it dominates and its median there and over every fetch.
#[derive(Clone, Debug, Serialize)]
pub struct TailSummary {
    /// Fetches in the tail (the slowest 5 %, at least one).
    pub tail: usize,
    /// Fetches in all.
    pub of: usize,
    /// The tail's fastest round trip, ms.
    pub from_ms: f64,
    /// Per segment, in [`Segment::ALL`] order: the tail fetches it dominates.
    pub dominates: [usize; 5],
    /// Per segment: its median over the tail, ms.
    pub tail_median_ms: [f64; 5],
    /// Per segment: its median over every fetch, ms.
    pub all_median_ms: [f64; 5],
    /// Tail fetches whose message the producer's I/O thread relayed (its control thread had not
    /// read it within the backstop grace).
    pub tail_relayed: usize,
    /// Tail fetches sent while the producer held its step.
    pub tail_sent_in_sched: usize,
    /// Tail fetches in flight during a stall of the machine (the probe woke ≥ 1 ms late).
    pub tail_in_machine_stall: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

impl TailSummary {
    /// The summary of `timelines` (slowest first).
    pub(super) fn of(timelines: &[FetchTimeline]) -> Option<Self> {
        if timelines.is_empty() {
            return None;
        }
        let tail = timelines.len().div_ceil(20).max(1);
        let (slow, _) = timelines.split_at(tail);
        let mut dominates = [0; 5];
        for t in slow {
            dominates[Segment::ALL.iter().position(|&s| s == t.dominant).unwrap_or(0)] += 1;
        }
        let med = |set: &[FetchTimeline], i: usize| median(set.iter().map(|t| t.segments_ms[i]).collect());
        Some(Self {
            tail,
            of: timelines.len(),
            from_ms: slow.last().map_or(0.0, |t| t.rtt_ms),
            dominates,
            tail_median_ms: std::array::from_fn(|i| med(slow, i)),
            all_median_ms: std::array::from_fn(|i| med(timelines, i)),
            tail_relayed: slow.iter().filter(|t| t.relayed_ms.is_some()).count(),
            tail_sent_in_sched: slow.iter().filter(|t| t.sent_in_sched).count(),
            tail_in_machine_stall: slow.iter().filter(|t| t.machine_stall.is_some()).count(),
        })
    }

    /// The segment that dominates most tail fetches.
    #[must_use]
    pub fn dominant(&self) -> Segment {
        Segment::ALL
            .into_iter()
            .zip(self.dominates)
            .max_by_key(|&(_, n)| n)
            .map_or(Segment::Control, |(s, _)| s)
    }
}

impl std::fmt::Display for TailSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tail (slowest {} of {}, ≥ {:.2} ms): {} dominates",
            self.tail,
            self.of,
            self.from_ms,
            self.dominant().name()
        )?;
        for (i, s) in Segment::ALL.into_iter().enumerate() {
            write!(
                f,
                "{} {} {}× median {:.2} (all {:.2})",
                if i == 0 { ";" } else { "," },
                s.name(),
                self.dominates[i],
                self.tail_median_ms[i],
                self.all_median_ms[i]
            )?;
        }
        write!(
            f,
            " ms; relayed by the I/O thread {}, sent while the producer held its step {}, in flight during a machine stall {}",
            self.tail_relayed, self.tail_sent_in_sched, self.tail_in_machine_stall
        )
    }
}

impl std::fmt::Display for FetchTimeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fetch {:>4}: {:>7.2} ms [", self.request, self.rtt_ms)?;
        for (i, s) in Segment::ALL.into_iter().enumerate() {
            let sep = if i == 0 { "" } else { " | " };
            write!(f, "{sep}{} {:.2}", s.name(), self.segments_ms[i])?;
        }
        write!(f, "] {} dominates;", self.dominant.name())?;
        if self.sent_in_sched {
            f.write_str(" sent while the producer held its step;")?;
        }
        let points = [
            ("copy done", self.copy_done_ms),
            ("on the consumer's socket", self.socket_ms),
            ("fetch read", self.read_ms),
            ("relayed by the I/O thread", self.relayed_ms),
            ("control thread woke", self.control_woke_ms),
            ("locked", self.control_locked_ms),
            ("bound", self.bound_ms),
            ("report signalled", self.report_signalled_ms),
            ("store offered", self.offered_ms),
            ("transfer submitted", self.submitted_ms),
            ("sender picked", self.sender_picked_ms),
            ("receiver began", self.receiver_began_ms),
            ("last chunk landed", self.landed_ms),
        ];
        for (name, at) in points {
            if let Some(at) = at {
                write!(f, " {name} {at:+.2}")?;
            }
        }
        write!(f, " (ms after sent); last poll gap {:.2} ms", self.poll_gap_ms)?;
        if let Some((late, share)) = self.machine_stall {
            write!(
                f,
                "; meanwhile the idle probe thread woke {late:.2} ms late (this process used {:.0} % of the cores then)",
                share * 100.0
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn seen(i: usize, sent_ns: u64, landed_ns: u64) -> FetchSeen {
        FetchSeen {
            i,
            trace_id: i as u64 + 100,
            sent_ns,
            landed_ns,
            sent_in_sched: false,
            poll_gap: Duration::from_micros(60),
        }
    }

    fn rec(id: u64, point: Point, ms_x10: u64) -> Record {
        Record {
            id,
            point,
            ns: 1000 * MS + ms_x10 * MS / 10,
        }
    }

    #[test]
    fn a_round_trip_is_cut_into_segments_that_add_up_and_the_tail_names_the_longest() {
        let origin = Instant::now();
        let marks = TimelineMarks::new(4);
        // Request 1: sent at 10 ms, bound at 10.5, copied until 12 (two ranks), submitted at
        // 12.3, landed at 12.8, seen at 13.
        marks.copy_finished(1, origin, origin + Duration::from_millis(11));
        marks.copy_finished(1, origin, origin + Duration::from_millis(12));
        // Request 2: copied long before; sent at 20 ms, the producer's control thread woke
        // only at 26.5 and bound it at 26.6; transfer 26.7 → 26.9; seen at 27.
        marks.copy_finished(2, origin, origin + Duration::from_millis(1));
        let producer = 7;
        let records = [
            rec(101, Point::FetchRead, 104),
            rec(101, Point::FetchBound, 105),
            rec(producer, Point::WakeSignalled, 121),
            rec(101, Point::StoreOffered, 122),
            rec(101, Point::TransferSubmitted, 123),
            rec(101, Point::ChunkLanded, 126),
            rec(101, Point::ChunkLanded, 128),
            rec(producer, Point::ControlWoke, 265),
            rec(producer, Point::ControlLocked, 2655),
            rec(102, Point::FetchRead, 2655),
            rec(102, Point::FetchBound, 266),
            rec(102, Point::TransferSubmitted, 267),
            rec(102, Point::ChunkLanded, 269),
            // Another manager's wake-ups are not the producer's.
            rec(8, Point::ControlWoke, 201),
        ];
        let trace = Trace::with_base(&records, 1000 * MS, producer);
        let all = [
            seen(1, 10 * MS, 13 * MS),
            seen(2, 20 * MS, 27 * MS),
            seen(3, 30 * MS, 30 * MS + MS / 2),
        ];
        let split = timelines(&all, &marks, &trace, None);
        assert_eq!(split.iter().map(|t| t.request).collect::<Vec<_>>(), [2, 1, 3]);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
        for t in &split {
            assert!(close(t.segments_ms.iter().sum(), t.rtt_ms), "{t:?}");
        }
        let slow = &split[0];
        assert!(close(slow.rtt_ms, 7.0));
        assert_eq!(slow.dominant, Segment::Control);
        assert!(close(slow.segments_ms[0], 6.6), "{slow:?}");
        assert!(close(slow.segments_ms[1], 0.0) && close(slow.segments_ms[2], 0.1));
        assert!(
            close(slow.control_woke_ms.unwrap(), 6.5),
            "not the other manager's wake-up"
        );
        let next = &split[1];
        assert!(close(next.segments_ms[0], 0.5) && close(next.segments_ms[1], 1.5));
        assert!(close(next.segments_ms[2], 0.3) && close(next.segments_ms[3], 0.5));
        assert!(close(next.segments_ms[4], 0.2));
        assert_eq!(next.dominant, Segment::Copy);
        assert!(close(next.report_signalled_ms.unwrap(), 2.1));
        assert!(close(next.landed_ms.unwrap(), 2.8), "the last chunk");
        let line = next.to_string();
        assert!(
            line.contains("copy 1.50") && line.contains("copy dominates"),
            "{line}"
        );
        // Untraced: the whole round trip is control, nothing is made up.
        let bare = &split[2];
        assert!(bare.bound_ms.is_none() && close(bare.segments_ms[0], 0.5));
        let tail = TailSummary::of(&split).unwrap();
        assert_eq!((tail.tail, tail.of), (1, 3));
        assert_eq!(tail.dominant(), Segment::Control);
        assert_eq!(tail.dominates, [1, 0, 0, 0, 0]);
        assert!(tail.to_string().contains("control dominates"), "{tail}");
        assert_eq!(tail.tail_in_machine_stall, 0, "no probe, no stall");
    }

    #[test]
    fn a_fetch_in_flight_during_a_machine_stall_says_so_and_the_tail_counts_it() {
        let marks = TimelineMarks::new(3);
        let trace = Trace::with_base(&[], 1000 * MS, 7);
        // The probe woke 4 ms late at 21 ms (due then): inside request 1's flight, not 2's.
        let probe = ProbeRecord {
            late_ms: crate::sim::Percentiles::of(&[0.1, 4.0]),
            stalls: vec![super::super::stall_probe::Stall {
                due_ns: 21 * MS,
                late_ns: 4 * MS,
                process_share: 0.1,
            }],
        };
        let all = [seen(1, 20 * MS, 27 * MS), seen(2, 30 * MS, 31 * MS)];
        let split = timelines(&all, &marks, &trace, Some(&probe));
        let slow = &split[0];
        assert_eq!(slow.request, 1);
        let (late, share) = slow.machine_stall.unwrap();
        assert!((late - 4.0).abs() < 1e-9 && (share - 0.1).abs() < 1e-9);
        assert!(
            slow.to_string()
                .contains("idle probe thread woke 4.00 ms late (this process used 10 % of the cores then)"),
            "{slow}"
        );
        assert!(split[1].machine_stall.is_none());
        let tail = TailSummary::of(&split).unwrap();
        assert_eq!(tail.tail_in_machine_stall, 1);
        assert!(
            tail.to_string().ends_with("in flight during a machine stall 1"),
            "{tail}"
        );
    }

    #[test]
    fn the_producer_is_in_its_scheduling_phase_between_step_begin_and_phase_end() {
        let origin = Instant::now();
        let marks = TimelineMarks::new(0);
        assert!(!marks.producer_in_sched());
        marks.step_began(origin, origin + Duration::from_millis(1));
        assert!(marks.producer_in_sched());
        marks.sched_ended(origin, origin + Duration::from_millis(3));
        assert!(!marks.producer_in_sched());
    }
}
