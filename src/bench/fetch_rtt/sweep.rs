//! `kvtier bench fetch-rtt --sweep N`: the tail targets counted over the runs they are stated
//! for.
//!
//! The fetch targets of the hand-off flow are stated per run (p50 at most the transfer plus
//! 1 ms, p99 at most the scheduling phase plus the transfer plus 2 ms, each against references
//! of the same run) and demanded in a share of idle runs over six settings: `--step-ms` 20, 50 and 200, each with the copy workers as a thread of
//! the producer and as two worker processes. A sweep runs `thread+offstep` in those six settings
//! `N` times, round by round, and counts the runs that met each target, with the fetches over
//! the p99 bound and how many of them the stall probe saw the machine stall through.

use std::time::Duration;

use serde::Serialize;

use super::{ControlPlaneMode, FetchRttConfig, FetchRttReport, Flow, fetch_rtt};
use crate::bench::BenchError;

/// The producer model steps a sweep runs, ms.
pub const SWEEP_STEPS_MS: [u64; 3] = [20, 50, 200];

/// The share of runs that must meet each target.
pub const SWEEP_TARGET_SHARE: f64 = 0.95;

/// One run of a sweep.
#[derive(Clone, Debug, Serialize)]
pub struct SweepRun {
    /// The round (from 1).
    pub round: usize,
    /// The producer's model step, ms.
    pub step_ms: u64,
    /// Copy workers as two OS processes.
    pub workers_process: bool,
    /// `thread+offstep` fetch round trip p50 and p99, ms.
    pub p50_ms: f64,
    /// See `p50_ms`.
    pub p99_ms: f64,
    /// The run's limits, ms.
    pub p50_limit_ms: f64,
    /// See `p50_limit_ms`.
    pub p99_limit_ms: f64,
    /// Fetches in the run.
    pub fetches: usize,
    /// Fetches slower than the p99 limit, and of those the ones in flight during a stall.
    pub over_p99_limit: usize,
    /// See `over_p99_limit`.
    pub over_p99_limit_in_stall: usize,
    /// Stalls the probe saw over the run, and its latest wake-up, ms.
    pub machine_stalls: usize,
    /// See `machine_stalls`.
    pub machine_max_late_ms: f64,
    /// The 1-minute load average when the run ended.
    pub load: Option<f64>,
}

impl SweepRun {
    fn of(round: usize, step_ms: u64, workers_process: bool, report: &FetchRttReport) -> Option<Self> {
        let target = report.target.as_ref()?;
        let mode = report
            .modes
            .iter()
            .find(|m| m.mode == ControlPlaneMode::ThreadOffStep)?;
        Some(Self {
            round,
            step_ms,
            workers_process,
            p50_ms: target.offstep_p50_ms,
            p99_ms: target.offstep_p99_ms,
            p50_limit_ms: target.p50_limit_ms,
            p99_limit_ms: target.p99_limit_ms,
            fetches: mode.fetch_ms.count,
            over_p99_limit: target.over_p99_limit,
            over_p99_limit_in_stall: target.over_p99_limit_in_stall,
            machine_stalls: mode.machine.as_ref().map_or(0, |p| p.stalls.len()),
            machine_max_late_ms: mode.machine.as_ref().map_or(0.0, |p| p.late_ms.max),
            load: load_average(),
        })
    }

    /// The p50 target held.
    #[must_use]
    pub fn p50_met(&self) -> bool {
        self.p50_ms <= self.p50_limit_ms
    }

    /// The p99 target held.
    #[must_use]
    pub fn p99_met(&self) -> bool {
        self.p99_ms <= self.p99_limit_ms
    }
}

impl std::fmt::Display for SweepRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
        write!(
            f,
            "round {:>2}  --step-ms {:<3} {:<19} p50 {:.2} ms (≤ {:.2}: {:<7}) p99 {:.2} ms (≤ {:.2}: {:<7}) over the p99 bound {} of {} fetches, {} in a machine stall; machine {} stalls, worst {:.2} ms late; load {}",
            self.round,
            self.step_ms,
            if self.workers_process {
                "--workers-process"
            } else {
                "in-process"
            },
            self.p50_ms,
            self.p50_limit_ms,
            verdict(self.p50_met()),
            self.p99_ms,
            self.p99_limit_ms,
            verdict(self.p99_met()),
            self.over_p99_limit,
            self.fetches,
            self.over_p99_limit_in_stall,
            self.machine_stalls,
            self.machine_max_late_ms,
            self.load.map_or_else(|| "?".to_owned(), |l| format!("{l:.2}"))
        )
    }
}

/// Every run of a sweep, and the counts.
#[derive(Clone, Debug, Serialize)]
pub struct SweepReport {
    /// The runs, in order.
    pub runs: Vec<SweepRun>,
}

impl SweepReport {
    /// Runs that met the p50 target.
    #[must_use]
    pub fn p50_met(&self) -> usize {
        self.runs.iter().filter(|r| r.p50_met()).count()
    }

    /// Runs that met the p99 target.
    #[must_use]
    pub fn p99_met(&self) -> usize {
        self.runs.iter().filter(|r| r.p99_met()).count()
    }

    /// Whether both targets held in at least [`SWEEP_TARGET_SHARE`] of the runs.
    #[must_use]
    #[allow(clippy::cast_precision_loss)] // run counts
    pub fn met(&self) -> bool {
        let need = SWEEP_TARGET_SHARE * self.runs.len() as f64;
        !self.runs.is_empty() && self.p50_met() as f64 >= need && self.p99_met() as f64 >= need
    }
}

impl std::fmt::Display for SweepReport {
    #[allow(clippy::cast_precision_loss)] // run counts
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.runs.len();
        let share = |k: usize| if n == 0 { 0.0 } else { 100.0 * k as f64 / n as f64 };
        let sum = |f: fn(&SweepRun) -> usize| self.runs.iter().map(f).sum::<usize>();
        writeln!(
            f,
            "sweep: p50 target met in {} of {n} runs ({:.1} %), p99 target in {} of {n} ({:.1} %); target: both in ≥ {:.0} % of idle runs: {}",
            self.p50_met(),
            share(self.p50_met()),
            self.p99_met(),
            share(self.p99_met()),
            SWEEP_TARGET_SHARE * 100.0,
            if self.met() { "met" } else { "NOT met" }
        )?;
        write!(
            f,
            "fetches over their run's p99 bound: {} of {}, {} of them in flight during a stall of the machine. The counts depend on the machine being idle (each run's load is printed; the bench's own threads add about 1): other work on the cores delays the fetch path's threads as it delays the probe.",
            sum(|r| r.over_p99_limit),
            sum(|r| r.fetches),
            sum(|r| r.over_p99_limit_in_stall)
        )
    }
}

/// Runs `thread+offstep` in the six settings `rounds` times (the settings of `base` other than
/// step, copy workers, modes and flow are kept), calling `each` with every run as it ends.
///
/// # Errors
/// A run fails (see [`fetch_rtt`]), or `rounds` is zero.
pub fn sweep(
    base: &FetchRttConfig,
    rounds: usize,
    mut each: impl FnMut(&SweepRun),
) -> Result<SweepReport, BenchError> {
    if rounds == 0 {
        return Err(BenchError::InvalidSetting {
            name: "sweep",
            reason: "at least one round is needed".into(),
        });
    }
    let mut runs = Vec::with_capacity(rounds * SWEEP_STEPS_MS.len() * 2);
    for round in 1..=rounds {
        for step_ms in SWEEP_STEPS_MS {
            for workers_process in [false, true] {
                let cfg = FetchRttConfig {
                    producer_step: Duration::from_millis(step_ms),
                    workers_process,
                    modes: vec![ControlPlaneMode::ThreadOffStep],
                    flow: Flow::Handoff,
                    ..base.clone()
                };
                let report = fetch_rtt(&cfg)?;
                let run = SweepRun::of(round, step_ms, workers_process, &report).ok_or_else(|| {
                    BenchError::InvalidSetting {
                        name: "sweep",
                        reason: "a hand-off run reported no thread+offstep target".into(),
                    }
                })?;
                each(&run);
                runs.push(run);
            }
        }
    }
    Ok(SweepReport { runs })
}

/// The 1-minute load average, when the system reports it.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p99_ms: f64, over: usize, in_stall: usize) -> SweepRun {
        SweepRun {
            round: 1,
            step_ms: 50,
            workers_process: false,
            p50_ms: 0.6,
            p99_ms,
            p50_limit_ms: 1.3,
            p99_limit_ms: 4.3,
            fetches: 200,
            over_p99_limit: over,
            over_p99_limit_in_stall: in_stall,
            machine_stalls: 3,
            machine_max_late_ms: 2.5,
            load: Some(0.7),
        }
    }

    #[test]
    fn a_sweep_counts_the_runs_meeting_each_target_against_the_share() {
        // 19 of 20 runs meet the p99 target: 95 %, met.
        let mut runs: Vec<SweepRun> = (0..19).map(|_| run(2.5, 0, 0)).collect();
        runs.push(run(6.0, 3, 2));
        let report = SweepReport { runs };
        assert_eq!((report.p50_met(), report.p99_met()), (20, 19));
        assert!(report.met());
        let text = report.to_string();
        assert!(text.contains("p99 target in 19 of 20 (95.0 %)"), "{text}");
        assert!(text.contains(": met"), "{text}");
        assert!(
            text.contains("3 of 4000, 2 of them in flight during a stall"),
            "{text}"
        );
        // One more miss in 20 is 90 %: not met.
        let mut runs = report.runs;
        runs[0] = run(5.0, 1, 0);
        let report = SweepReport { runs };
        assert!(!report.met());
        assert!(report.to_string().contains("NOT met"));
        // No run, no verdict of success.
        assert!(!SweepReport { runs: Vec::new() }.met());
        let line = run(6.0, 3, 2).to_string();
        assert!(
            line.contains("p99 6.00 ms (≤ 4.30: NOT met") && line.contains("load 0.70"),
            "{line}"
        );
    }

    #[test]
    fn a_sweep_of_no_rounds_is_refused() {
        let err = sweep(&FetchRttConfig::default(), 0, |_| {}).unwrap_err();
        assert!(err.to_string().contains("at least one round"), "{err}");
    }
}
