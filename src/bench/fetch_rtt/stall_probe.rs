//! The machine's own stalls, measured in the same run as the fetches.
//!
//! A fetch passes through six threads or more (the consumer's control thread, both ZeroMQ I/O
//! threads, the producer's control and sender threads, the consumer's receiver, its poll), and
//! each waits for a core whenever it wakes while the cores are taken. A probe thread of this
//! process with no work of its own wakes every millisecond and records how late it woke: when
//! it wakes a millisecond or more late, any thread of the fetch path that woke then waited as
//! long, whatever kvtier does. With each late wake-up the probe records the CPU time the whole
//! process used since its previous wake-up, as a share of the cores' time: a stall during which
//! the process used little of the cores means they were taken outside it (kernel threads, other
//! processes, the hypervisor). The probe's own cost is one short wake-up per millisecond.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::sim::Percentiles;
use crate::sim::cpu_clock::process_cpu_time;

/// How often the probe wakes.
pub const PROBE_PERIOD: Duration = Duration::from_millis(1);

/// A wake-up at least this late is a stall.
pub const STALL: Duration = Duration::from_millis(1);

/// One late wake-up of the probe.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Stall {
    /// When the probe was due, ns since the bench's origin.
    pub due_ns: u64,
    /// How late it woke, ns.
    pub late_ns: u64,
    /// The CPU time this process used from the probe's previous wake-up to this one, as a share
    /// of the cores' time over that span (0 to 1).
    pub process_share: f64,
}

impl Stall {
    /// How late the probe woke, ms.
    #[must_use]
    #[allow(clippy::cast_precision_loss)] // nanosecond spans of a bench run
    pub fn late_ms(&self) -> f64 {
        self.late_ns as f64 / 1e6
    }

    fn overlaps(&self, from_ns: u64, to_ns: u64) -> bool {
        self.due_ns < to_ns && self.due_ns.saturating_add(self.late_ns) > from_ns
    }
}

/// What the probe saw over one mode's run.
#[derive(Clone, Debug, Serialize)]
pub struct ProbeRecord {
    /// How late the probe woke, ms, over every wake-up.
    pub late_ms: Percentiles,
    /// The wake-ups at least a millisecond late (stalls), in time order.
    pub stalls: Vec<Stall>,
}

impl ProbeRecord {
    /// The latest wake-up among the stalls that overlap `from_ns..to_ns` (ns since the origin).
    #[must_use]
    pub fn worst_between(&self, from_ns: u64, to_ns: u64) -> Option<&Stall> {
        self.stalls
            .iter()
            .filter(|s| s.overlaps(from_ns, to_ns))
            .max_by_key(|s| s.late_ns)
    }

    /// The process's mean share of the cores during the stalls (`None`: no stall).
    #[must_use]
    #[allow(clippy::cast_precision_loss)] // a count of stalls
    pub fn process_share_in_stalls(&self) -> Option<f64> {
        (!self.stalls.is_empty())
            .then(|| self.stalls.iter().map(|s| s.process_share).sum::<f64>() / self.stalls.len() as f64)
    }
}

impl std::fmt::Display for ProbeRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "machine: an idle probe thread waking every {} ms woke late by p50 {:.2} / p99 {:.2} / max {:.2} ms; {} stalls ≥ {} ms",
            PROBE_PERIOD.as_millis(),
            self.late_ms.p50,
            self.late_ms.p99,
            self.late_ms.max,
            self.stalls.len(),
            STALL.as_millis()
        )?;
        if let Some(share) = self.process_share_in_stalls() {
            write!(
                f,
                " (this process used {:.0} % of the cores during them)",
                share * 100.0
            )?;
        }
        Ok(())
    }
}

/// The probe thread, running until [`StallProbe::finish`].
pub struct StallProbe {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<ProbeRecord>,
}

impl StallProbe {
    /// Starts the probe; its times are ns since `origin`.
    ///
    /// # Errors
    /// The thread cannot be started.
    pub fn start(origin: Instant) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name("kvtier-bench-probe".into())
            .spawn(move || probe(origin, &flag))?;
        Ok(Self { stop, handle })
    }

    /// Stops the probe and returns what it saw (`None` if its thread panicked).
    #[must_use]
    pub fn finish(self) -> Option<ProbeRecord> {
        self.stop.store(true, Ordering::Release);
        self.handle.join().ok()
    }
}

fn probe(origin: Instant, stop: &AtomicBool) -> ProbeRecord {
    #[allow(clippy::cast_precision_loss)] // a handful of cores
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get) as f64;
    let mut late_ms = Vec::new();
    let mut stalls = Vec::new();
    let mut last = Instant::now();
    let mut last_cpu = process_cpu_time();
    while !stop.load(Ordering::Acquire) {
        let due = last + PROBE_PERIOD;
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        let woke = Instant::now();
        let cpu = process_cpu_time();
        let late = woke.saturating_duration_since(due);
        late_ms.push(late.as_secs_f64() * 1e3);
        if late >= STALL {
            let span = woke.saturating_duration_since(last).as_secs_f64();
            let used = cpu.saturating_sub(last_cpu).as_secs_f64();
            stalls.push(Stall {
                due_ns: u64::try_from(due.saturating_duration_since(origin).as_nanos()).unwrap_or(u64::MAX),
                late_ns: u64::try_from(late.as_nanos()).unwrap_or(u64::MAX),
                process_share: if span > 0.0 {
                    (used / (span * cores)).min(1.0)
                } else {
                    0.0
                },
            });
        }
        last = woke;
        last_cpu = cpu;
    }
    ProbeRecord {
        late_ms: Percentiles::of(&late_ms),
        stalls,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stall(due_ms: u64, late_ms: u64) -> Stall {
        Stall {
            due_ns: due_ms * 1_000_000,
            late_ns: late_ms * 1_000_000,
            process_share: 0.25,
        }
    }

    #[test]
    fn a_fetch_is_charged_the_worst_stall_that_overlaps_it() {
        let record = ProbeRecord {
            late_ms: Percentiles::of(&[0.1, 2.0, 5.0, 1.5]),
            stalls: vec![stall(10, 2), stall(20, 5), stall(40, 1)],
        };
        let ms = |m: u64| m * 1_000_000;
        // 19..21 ms overlaps the stall that ran 20..25 ms, not the one that ended at 12 ms.
        assert_eq!(
            record.worst_between(ms(19), ms(21)).map(|s| s.late_ns),
            Some(ms(5))
        );
        // 11..30 overlaps two: the worse one is charged.
        assert_eq!(
            record.worst_between(ms(11), ms(30)).map(|s| s.late_ns),
            Some(ms(5))
        );
        // A fetch between stalls overlaps none, and one ending as a stall begins neither.
        assert!(record.worst_between(ms(26), ms(39)).is_none());
        assert!(record.worst_between(ms(30), ms(40)).is_none());
        assert!((record.process_share_in_stalls().unwrap() - 0.25).abs() < 1e-9);
        let text = record.to_string();
        assert!(text.contains("3 stalls ≥ 1 ms"), "{text}");
        assert!(text.contains("25 % of the cores"), "{text}");
    }

    #[test]
    fn the_probe_wakes_until_finished_and_reports_its_wake_ups() {
        let probe = StallProbe::start(Instant::now()).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let record = probe.finish().unwrap();
        // About one wake-up per millisecond; a loaded machine may let it wake fewer times.
        assert!(record.late_ms.count >= 3, "{record:?}");
        assert!(record.late_ms.p50 >= 0.0 && record.late_ms.max >= record.late_ms.p50);
        assert!(
            record
                .stalls
                .iter()
                .all(|s| s.late_ns >= 1_000_000 && s.process_share <= 1.0)
        );
    }
}
