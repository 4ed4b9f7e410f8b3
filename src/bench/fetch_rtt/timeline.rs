//! Per-fetch timelines of the hand-off flow (`--explain-slowest N`): where the slowest fetches
//! of a mode spent their time.
//!
//! A fetch's round trip is split at the moments the bench itself observes, so the split needs
//! no hook inside the tiers: the consumer sent it; the producer's copy workers finished that
//! request's copy (the latest rank); the consumer's step saw every chunk resident. What lies
//! between "sent or copied, whichever is later" and "seen" is the control and data planes:
//! the producer noticing the fetch and the store's completion, the transfer, the consumer
//! receiving it, and the consumer's next poll. Whether the fetch reached the producer during
//! its scheduling phase (its `Step` held) and how long the consumer's last poll gap was tell
//! the two usual suspects apart: the lock, and a thread that did not get a core.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

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
    /// Sent, ns since the origin.
    pub sent_ns: u64,
    /// Every chunk seen resident, ns since the origin.
    pub landed_ns: u64,
    /// The producer was in its scheduling phase when the fetch left.
    pub sent_in_sched: bool,
    /// The gap between the consumer step that saw it land and the step before.
    pub poll_gap: Duration,
}

/// One fetch's round trip, split.
#[derive(Clone, Debug, Serialize)]
pub struct FetchTimeline {
    /// The request (0 is the unmeasured warm-up).
    pub request: usize,
    /// Sent → every chunk seen resident, ms.
    pub rtt_ms: f64,
    /// The producer held its step (scheduling phase) when the fetch left.
    pub sent_in_sched: bool,
    /// The copy's end relative to the fetch's departure, ms (negative: copied before).
    pub copy_done_after_sent_ms: Option<f64>,
    /// From the later of departure and copy end to "seen resident", ms: the control and data
    /// planes plus the consumer's poll.
    pub planes_ms: f64,
    /// The consumer's poll gap before it saw the fetch land, ms (the bench polls every 50 µs;
    /// a longer gap is a consumer thread that waited for a core).
    pub poll_gap_ms: f64,
}

#[allow(clippy::cast_precision_loss)] // nanosecond spans of a bench run
fn ns_ms(ns: i128) -> f64 {
    ns as f64 / 1e6
}

/// The `n` slowest of `seen`, slowest first, split with the copy ends in `marks`.
pub(super) fn slowest(seen: &[FetchSeen], marks: &TimelineMarks, n: usize) -> Vec<FetchTimeline> {
    let mut order: Vec<&FetchSeen> = seen.iter().collect();
    order.sort_by_key(|f| std::cmp::Reverse(f.landed_ns.saturating_sub(f.sent_ns)));
    order
        .into_iter()
        .take(n)
        .map(|f| {
            let copy = marks.copy_done_ns(f.i);
            let from = copy.map_or(f.sent_ns, |c| c.max(f.sent_ns));
            FetchTimeline {
                request: f.i,
                rtt_ms: ns_ms(i128::from(f.landed_ns) - i128::from(f.sent_ns)),
                sent_in_sched: f.sent_in_sched,
                copy_done_after_sent_ms: copy.map(|c| ns_ms(i128::from(c) - i128::from(f.sent_ns))),
                planes_ms: ns_ms(i128::from(f.landed_ns) - i128::from(from)),
                poll_gap_ms: f.poll_gap.as_secs_f64() * 1e3,
            }
        })
        .collect()
}

impl std::fmt::Display for FetchTimeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let copy = self.copy_done_after_sent_ms.map_or_else(
            || "copy end unknown".to_owned(),
            |c| format!("copy done {c:+.2} ms"),
        );
        write!(
            f,
            "fetch {:>4}: {:>7.2} ms = sent{} → {copy} → planes + poll {:.2} ms (last poll gap {:.2} ms)",
            self.request,
            self.rtt_ms,
            if self.sent_in_sched {
                " (producer in its scheduling phase)"
            } else {
                ""
            },
            self.planes_ms,
            self.poll_gap_ms
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(i: usize, sent_ns: u64, landed_ns: u64) -> FetchSeen {
        FetchSeen {
            i,
            sent_ns,
            landed_ns,
            sent_in_sched: false,
            poll_gap: Duration::from_micros(60),
        }
    }

    #[test]
    fn the_slowest_fetches_are_split_at_the_later_of_departure_and_copy_end() {
        let origin = Instant::now();
        let marks = TimelineMarks::new(4);
        // Request 1 copied 2 ms after it was sent (rank 1 last), request 2 long before, request 3
        // never reported.
        marks.copy_finished(1, origin, origin + Duration::from_millis(11));
        marks.copy_finished(1, origin, origin + Duration::from_millis(12));
        marks.copy_finished(2, origin, origin + Duration::from_millis(1));
        let all = [
            seen(1, 10_000_000, 13_000_000),
            seen(2, 20_000_000, 27_000_000),
            seen(3, 30_000_000, 30_500_000),
        ];
        let top = slowest(&all, &marks, 2);
        assert_eq!(top.iter().map(|t| t.request).collect::<Vec<_>>(), [2, 1]);
        let [slow, next] = &top[..] else {
            panic!("two fetches")
        };
        assert!((slow.rtt_ms - 7.0).abs() < 1e-9);
        assert!((slow.copy_done_after_sent_ms.unwrap() + 19.0).abs() < 1e-9);
        assert!(
            (slow.planes_ms - 7.0).abs() < 1e-9,
            "copied before it left: all of it is the planes"
        );
        assert!(
            (next.copy_done_after_sent_ms.unwrap() - 2.0).abs() < 1e-9,
            "the last rank's end"
        );
        assert!((next.planes_ms - 1.0).abs() < 1e-9);
        let line = next.to_string();
        assert!(
            line.contains("copy done +2.00 ms") && line.contains("planes + poll 1.00 ms"),
            "{line}"
        );
        let unknown = slowest(&all[2..], &marks, 5);
        assert_eq!(unknown.len(), 1);
        assert!(unknown[0].copy_done_after_sent_ms.is_none());
        assert!(unknown[0].to_string().contains("copy end unknown"));
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
