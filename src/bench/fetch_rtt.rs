//! `kvtier bench fetch-rtt`: how long does a peer's fetch wait on a busy producer?
//!
//! Two nodes in this process, each a CPU tier plus a p2p tier under a `TieringManager`. The
//! producer runs a busy engine: each step a scheduling phase that holds its `Step` (default
//! 2 ms of real manager calls), then a model step (default 50 ms) with no manager call. Two
//! flows:
//!
//! - **hand-off** (default; `handoff`): the prefill→decode split. The consumer's fetches leave
//!   at the times of a seeded Poisson process; each is for a `remote_decoder` request whose
//!   store the producer started in the step before, and which is usually still in flight when
//!   the fetch arrives. The producer's copy workers copy the bytes into the rows as the model
//!   runs, taking the time of those bytes at the memcpy rate measured at the start of the run.
//!   They are a thread of the producer's process, or (`--workers-process`) two worker
//!   processes that map the producer's shared arena and report on the completion channel
//!   (`reporters = 2`). The store completes at the producer's next step (`complete_store`), or
//!   — `thread+offstep` — as soon as every worker reported it.
//! - **pull** (`pull`): the producer stored every chunk up front; the consumer probes
//!   (`remote_kv_source`) and pulls what it found, one request after another.
//!
//! The fetch round trip is timed from the moment the consumer's fetch leaves (the end of the
//! consumer step that submitted the promotion) to the consumer lookup that sees every chunk
//! landed; the bytes are verified after. Each fetch also records how many producer steps began
//! meanwhile (hand-off: after the step that started its store): the evidence of whether the
//! fetch waited for one.
//!
//! Modes, all in one invocation by default: `step` (the producer serves peers only inside its
//! own steps), `thread` (a control-plane thread serves peers while the model runs), and
//! `thread+offstep` (the thread also completes stores the copy workers reported). Next to them,
//! measured in the same run: the producer's step period, a raw ZeroMQ DEALER→ROUTER round trip
//! (the floor of any control exchange), the raw loopback-TCP transfer time of one fetch's bytes
//! (the floor of its data) and the memcpy rate the copies are timed by.

mod copy;
mod copy_workers;
mod handoff;
mod pull;
mod reference;
mod stall_probe;
mod sweep;
mod timeline;
mod worker_process;

pub use stall_probe::{ProbeRecord, Stall};
pub use sweep::{SWEEP_STEPS_MS, SWEEP_TARGET_SHARE, SweepReport, SweepRun, sweep};
pub use timeline::{FetchTimeline, Segment, TailSummary};
pub use worker_process::{CopyWorkerArgs, copy_worker};

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tier_cpu::{Capacity, CpuTier, CpuTierOptions, PolicyKind};
use tier_p2p::{P2pHandle, P2pTier, P2pTierOptions, SharedSecret};
use tiering_core::{ManagerConfig, ScheduleEndContext, TieringManager, arena::ChunkArena};

use super::BenchError;
use crate::sim::Percentiles;

/// Which control plane the producer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ControlPlaneMode {
    /// Peers are served only inside the producer's steps.
    #[serde(rename = "step")]
    Step,
    /// A dedicated thread serves peers between (and during) steps; stores complete at the
    /// producer's next step.
    #[serde(rename = "thread")]
    Thread,
    /// The thread also completes the stores the copy worker reports (off-step completions).
    #[serde(rename = "thread+offstep")]
    ThreadOffStep,
}

impl ControlPlaneMode {
    /// Every mode, in report order.
    pub const ALL: [Self; 3] = [Self::Step, Self::Thread, Self::ThreadOffStep];

    fn manager_config(self) -> ManagerConfig {
        ManagerConfig {
            control_plane_thread: self != Self::Step,
            off_step: self == Self::ThreadOffStep,
            ..ManagerConfig::default()
        }
    }
}

impl fmt::Display for ControlPlaneMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Step => "step",
            Self::Thread => "thread",
            Self::ThreadOffStep => "thread+offstep",
        })
    }
}

impl FromStr for ControlPlaneMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.to_string() == s.trim())
            .ok_or_else(|| {
                format!("unknown control-plane mode `{s}` (expected step, thread or thread+offstep)")
            })
    }
}

/// How the consumer's fetch meets the producer's chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Flow {
    /// Prefill→decode: the fetch is sent before the producer's store completed.
    Handoff,
    /// The producer holds the chunks already; the consumer probes, then pulls.
    Pull,
}

impl fmt::Display for Flow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Handoff => "handoff",
            Self::Pull => "pull",
        })
    }
}

impl FromStr for Flow {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "handoff" => Ok(Self::Handoff),
            "pull" => Ok(Self::Pull),
            other => Err(format!("unknown flow `{other}` (expected handoff or pull)")),
        }
    }
}

/// What to measure.
#[derive(Clone, Debug, Serialize)]
pub struct FetchRttConfig {
    /// The producer's model time per step.
    #[serde(serialize_with = "ser_ms")]
    pub producer_step: Duration,
    /// The producer's scheduling phase per step: how long it holds its `Step` (making manager
    /// calls) before the model runs.
    #[serde(serialize_with = "ser_ms")]
    pub sched_time: Duration,
    /// Hand-off flow: mean gap between the consumer's fetches (a Poisson process).
    #[serde(serialize_with = "ser_ms")]
    pub arrival_mean: Duration,
    /// Seed of the keys and of the arrival times.
    pub seed: u64,
    /// Measured fetches per mode (one unmeasured warm-up fetch comes first).
    pub fetches: usize,
    /// Chunks per fetch.
    pub chunks_per_fetch: usize,
    /// Bytes per chunk.
    pub chunk_bytes: usize,
    /// The modes, in order.
    pub modes: Vec<ControlPlaneMode>,
    /// The flow.
    pub flow: Flow,
    /// Hand-off flow: run the copy workers as two OS processes on a shared arena, reporting
    /// over the completion channel, instead of a thread.
    pub workers_process: bool,
    /// The `kvtier` binary the worker processes run (this executable when `None`; a test names
    /// the binary Cargo built).
    pub worker_exe: Option<PathBuf>,
    /// Raw control round trips to sample.
    pub raw_round_trips: usize,
    /// Raw transfers of one fetch's bytes to sample.
    pub transfer_samples: usize,
    /// Longest wait for one fetch (and for any hand-off signal).
    #[serde(serialize_with = "ser_ms")]
    pub fetch_timeout: Duration,
    /// Test aid (hand-off flow, `thread+offstep` only): the producer's model step also lasts
    /// until every fetch of the stores it started has landed, so "no producer step began during
    /// the fetch" is an ordering fact instead of a race against the step time. A fetch that
    /// needed a producer step then waits `fetch_timeout` for it. Off for measurements.
    pub hold_offstep_step_until_landed: bool,
    /// Hand-off flow: print this many of each mode's slowest fetches with their round trip
    /// split (departure, copy end, control and data planes, the consumer's poll gap).
    pub explain_slowest: usize,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `serialize_with` signature
fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

impl Default for FetchRttConfig {
    fn default() -> Self {
        Self {
            producer_step: Duration::from_millis(50),
            sched_time: Duration::from_millis(2),
            arrival_mean: Duration::from_millis(10),
            seed: 0x6b76_7469_6572,
            fetches: 200,
            chunks_per_fetch: 4,
            chunk_bytes: 64 * 1024,
            modes: ControlPlaneMode::ALL.to_vec(),
            flow: Flow::Handoff,
            workers_process: false,
            worker_exe: None,
            raw_round_trips: 2000,
            transfer_samples: 200,
            fetch_timeout: Duration::from_secs(20),
            hold_offstep_step_until_landed: false,
            explain_slowest: 0,
        }
    }
}

/// The figures of one mode.
#[derive(Clone, Debug, Serialize)]
pub struct ModeResult {
    /// The producer's control plane.
    pub mode: ControlPlaneMode,
    /// Fetch round trip (fetch sent → every chunk landed), ms.
    pub fetch_ms: Percentiles,
    /// Pull flow: lookup round trip (first lookup → every chunk found), ms.
    pub lookup_ms: Option<Percentiles>,
    /// The producer's measured step period, ms.
    pub producer_step_ms: Percentiles,
    /// Per fetch, in order: producer steps that began while it was in flight (hand-off flow:
    /// after the step that started its store, before it landed).
    pub producer_steps_during_fetch: Vec<u64>,
    /// Fetches that reached the producer before their chunks were stored, and waited there.
    pub fetches_waited: u64,
    /// Hand-off flow: fetches sent later than their arrival time because the producer had not
    /// yet started their store (it ran late).
    pub fetches_held_back: u64,
    /// Producer stores completed off-step (reported by the copy worker).
    pub off_step_store_completions: u64,
    /// Hand-off flow with `explain_slowest`: the slowest fetches, split, slowest first.
    pub slowest: Vec<FetchTimeline>,
    /// Hand-off flow: which segment of the round trip dominates the slowest fetches.
    pub tail: Option<TailSummary>,
    /// Hand-off flow: the machine's stalls over the mode's run (an idle probe thread's late
    /// wake-ups, see `stall_probe`).
    pub machine: Option<ProbeRecord>,
    /// Hand-off flow, per fetch: its round trip, ms, and whether a stall of the machine
    /// overlapped it.
    #[serde(skip)]
    pub rtt_in_stall: Vec<(f64, bool)>,
}

impl ModeResult {
    /// Fetches during which no producer step began.
    #[must_use]
    pub fn fetches_without_a_producer_step(&self) -> usize {
        self.producer_steps_during_fetch
            .iter()
            .filter(|&&n| n == 0)
            .count()
    }
}

/// The targets of `thread+offstep` in the hand-off flow, checked against figures of the same
/// run, and its ratio to the other modes.
///
/// The fetch of an off-step producer needs the data transfer, plus the rest of the copy when
/// it arrives while the copy runs, plus the rest of the producer's scheduling phase when it
/// arrives while the producer holds its step (about sched/period of the fetches). A `thread`
/// producer completes the store only in its next step, so its fetch waits about half a
/// producer period (model step plus scheduling phase) on average; a `step` producer reads the
/// fetch at its next step end, the one that completes the store, so it waits about as long (the
/// consumer lands the load once the bytes verified, not at the producer's `transfer_done` a
/// step later). The ratio grows with
/// the model step and shrinks as the scheduling phase or the transfer (the fetch's size)
/// grows.
#[derive(Clone, Debug, Serialize)]
pub struct TargetCheck {
    /// `thread+offstep` fetch round trip p50, ms.
    pub offstep_p50_ms: f64,
    /// `thread+offstep` fetch round trip p99, ms.
    pub offstep_p99_ms: f64,
    /// The p50 limit: the raw transfer p50 of the same bytes plus 1 ms.
    pub p50_limit_ms: f64,
    /// The p99 limit: the scheduling phase plus the raw transfer p50 plus 2 ms (the transfer's
    /// median, not its own p99: a hiccup of the reference must not loosen the target).
    pub p99_limit_ms: f64,
    /// `offstep_p50_ms <= p50_limit_ms`.
    pub p50_met: bool,
    /// `offstep_p99_ms <= p99_limit_ms`.
    pub p99_met: bool,
    /// `thread+offstep` fetches slower than `p99_limit_ms`.
    pub over_p99_limit: usize,
    /// Of those, the ones in flight during a stall of the machine (its idle probe thread woke
    /// at least a millisecond late meanwhile): held by the machine, whatever the fetch path did.
    pub over_p99_limit_in_stall: usize,
    /// `step` p50 over `thread+offstep` p50, when `step` ran.
    pub step_over_offstep_p50: Option<f64>,
    /// `step` p99 over `thread+offstep` p99, when `step` ran.
    pub step_over_offstep_p99: Option<f64>,
}

/// Every figure.
#[derive(Clone, Debug, Serialize)]
pub struct FetchRttReport {
    /// The settings.
    pub config: FetchRttConfig,
    /// Raw ZeroMQ round trip on loopback, µs.
    pub raw_control_rtt_us: Percentiles,
    /// Raw loopback-TCP transfer of one fetch's bytes (write, then a one-byte ack), ms.
    pub transfer_ms: Percentiles,
    /// Memcpy rate of one chunk in this process, GiB/s: what the copy workers' copies take.
    pub memcpy_gib_s: f64,
    /// One fetch's copy at that rate, ms.
    pub copy_ms: f64,
    /// One entry per mode.
    pub modes: Vec<ModeResult>,
    /// The targets, when `thread+offstep` ran in the hand-off flow.
    pub target: Option<TargetCheck>,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::INFINITY }
}

impl FetchRttReport {
    fn check_target(&mut self) {
        if self.config.flow != Flow::Handoff {
            return;
        }
        let find = |m: ControlPlaneMode| self.modes.iter().find(|r| r.mode == m);
        let Some(off_mode) = find(ControlPlaneMode::ThreadOffStep) else {
            return;
        };
        let off = off_mode.fetch_ms;
        let step = find(ControlPlaneMode::Step).map(|r| r.fetch_ms);
        let p50_limit_ms = self.transfer_ms.p50 + 1.0;
        let p99_limit_ms = ms(self.config.sched_time) + self.transfer_ms.p50 + 2.0;
        let over: Vec<bool> = off_mode
            .rtt_in_stall
            .iter()
            .filter(|(rtt, _)| *rtt > p99_limit_ms)
            .map(|&(_, stalled)| stalled)
            .collect();
        self.target = Some(TargetCheck {
            offstep_p50_ms: off.p50,
            offstep_p99_ms: off.p99,
            p50_limit_ms,
            p99_limit_ms,
            p50_met: off.p50 <= p50_limit_ms,
            p99_met: off.p99 <= p99_limit_ms,
            over_p99_limit: over.len(),
            over_p99_limit_in_stall: over.iter().filter(|&&s| s).count(),
            step_over_offstep_p50: step.map(|s| ratio(s.p50, off.p50)),
            step_over_offstep_p99: step.map(|s| ratio(s.p99, off.p99)),
        });
    }
}

impl fmt::Display for FetchRttReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let fetch_kib = c.chunks_per_fetch * c.chunk_bytes / 1024;
        writeln!(
            f,
            "kvtier bench fetch-rtt — {} flow, producer step = scheduling phase {:.1} ms (Step held) + model {:.1} ms; {} fetches of {} × {} KiB per mode",
            c.flow,
            ms(c.sched_time),
            ms(c.producer_step),
            c.fetches,
            c.chunks_per_fetch,
            c.chunk_bytes / 1024
        )?;
        if c.flow == Flow::Handoff {
            writeln!(
                f,
                "  fetches: Poisson arrivals, mean gap {:.1} ms (seed {:#x}); copy workers: {}; copy {:.3} ms per fetch at the measured memcpy rate {:.1} GiB/s; arenas pre-faulted as pinned host memory is",
                ms(c.arrival_mean),
                c.seed,
                if c.workers_process {
                    "2 worker processes on the shared arena (each populates its view, as a device registration does), reporting on the completion channel (reporters = 2)"
                } else {
                    "1 thread of the producer"
                },
                self.copy_ms,
                self.memcpy_gib_s
            )?;
        }
        let r = &self.raw_control_rtt_us;
        writeln!(
            f,
            "  raw control round trip (ZeroMQ DEALER→ROUTER, loopback): p50 {:.1} µs, p99 {:.1} µs",
            r.p50, r.p99
        )?;
        let t = &self.transfer_ms;
        writeln!(
            f,
            "  data transfer of {fetch_kib} KiB (raw loopback TCP, write + 1-byte ack): p50 {:.3} ms, p99 {:.3} ms",
            t.p50, t.p99
        )?;
        let step = self.modes.iter().find(|m| m.mode == ControlPlaneMode::Step);
        writeln!(
            f,
            "  {:<15} {:>24} {:>16} {:>18} {:>20} {:>7} {:>11}",
            "mode",
            "fetch rtt p50 / p99 ms",
            "step/mode p50",
            "producer step ms",
            "fetches w/o a step",
            "waited",
            "held back"
        )?;
        for m in &self.modes {
            let vs_step = step.map_or_else(
                || "-".to_owned(),
                |s| format!("{:.1}×", ratio(s.fetch_ms.p50, m.fetch_ms.p50)),
            );
            writeln!(
                f,
                "  {:<15} {:>11.2} / {:<10.2} {:>16} {:>18.2} {:>13} / {:<4} {:>7} {:>11}",
                m.mode.to_string(),
                m.fetch_ms.p50,
                m.fetch_ms.p99,
                vs_step,
                m.producer_step_ms.p50,
                m.fetches_without_a_producer_step(),
                m.producer_steps_during_fetch.len(),
                m.fetches_waited,
                m.fetches_held_back
            )?;
            if let Some(l) = &m.lookup_ms {
                writeln!(
                    f,
                    "  {:<15} lookup rtt p50 {:.2} ms, p99 {:.2} ms",
                    "", l.p50, l.p99
                )?;
            }
            if let Some(t) = &m.tail {
                writeln!(f, "  {:<15} {t}", "")?;
            }
            if let Some(p) = &m.machine {
                writeln!(f, "  {:<15} {p}", "")?;
            }
            for t in &m.slowest {
                writeln!(f, "  {:<15} {t}", "")?;
            }
        }
        if let Some(t) = &self.target {
            let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
            writeln!(
                f,
                "  target p50: thread+offstep {:.2} ms ≤ transfer p50 {:.3} + 1 ms = {:.2} ms: {}",
                t.offstep_p50_ms,
                self.transfer_ms.p50,
                t.p50_limit_ms,
                verdict(t.p50_met)
            )?;
            writeln!(
                f,
                "  target p99: thread+offstep {:.2} ms ≤ sched {:.1} + transfer p50 {:.3} + 2 ms = {:.2} ms: {}",
                t.offstep_p99_ms,
                ms(c.sched_time),
                self.transfer_ms.p50,
                t.p99_limit_ms,
                verdict(t.p99_met)
            )?;
            writeln!(
                f,
                "  fetches over the p99 bound: {}, of which {} were in flight during a stall of the machine (its idle probe thread woke ≥ 1 ms late meanwhile)",
                t.over_p99_limit, t.over_p99_limit_in_stall
            )?;
            if let (Some(p50), Some(p99)) = (t.step_over_offstep_p50, t.step_over_offstep_p99) {
                writeln!(
                    f,
                    "  step / thread+offstep: {p50:.1}× at p50, {p99:.1}× at p99. What the ratio depends on: a `thread` producer completes the store only in its next step, so its fetch waits about half a producer period (model step + scheduling phase); a `step` producer reads the fetch only at its next step end, the one that completes the store, so it waits about as long. An off-step fetch needs the transfer, plus the rest of the scheduling phase for the ~sched/period of fetches that arrive while the producer holds its step, plus the machine's wake-up latency (p99). The ratio grows with --step-ms and shrinks as --sched-ms or the transfer size (chunks × chunk bytes) grows."
                )?;
            }
        }
        Ok(())
    }
}

/// Runs the configured flow in every configured mode, and the references.
///
/// # Errors
/// A setting out of range, a node that cannot be built, a worker process that cannot start, a
/// fetch that misses or times out, or bytes that arrive wrong.
pub fn fetch_rtt(cfg: &FetchRttConfig) -> Result<FetchRttReport, BenchError> {
    if cfg.fetches == 0 || cfg.chunks_per_fetch == 0 || cfg.chunk_bytes == 0 {
        return Err(BenchError::InvalidSetting {
            name: "fetches/chunks_per_fetch/chunk_bytes",
            reason: "must be greater than zero".into(),
        });
    }
    if cfg.modes.is_empty() {
        return Err(BenchError::InvalidSetting {
            name: "modes",
            reason: "at least one control-plane mode is needed".into(),
        });
    }
    if cfg.workers_process && cfg.flow != Flow::Handoff {
        return Err(BenchError::InvalidSetting {
            name: "workers_process",
            reason: "worker processes copy the hand-off flow's stores; the pull flow stores up front".into(),
        });
    }
    let raw = reference::control_rtt(cfg.raw_round_trips.max(1))?;
    let fetch_bytes = cfg.chunks_per_fetch * cfg.chunk_bytes;
    let transfer = reference::transfer_time(fetch_bytes, cfg.transfer_samples.max(1))?;
    let rate = copy::memcpy_rate(cfg.chunk_bytes);
    let mut modes = Vec::new();
    for &mode in &cfg.modes {
        modes.push(match cfg.flow {
            Flow::Handoff => handoff::run(cfg, mode, rate)?,
            Flow::Pull => pull::run(cfg, mode)?,
        });
    }
    let mut report = FetchRttReport {
        config: cfg.clone(),
        raw_control_rtt_us: Percentiles::of(&raw),
        transfer_ms: Percentiles::of(&transfer),
        memcpy_gib_s: rate / f64::from(1u32 << 30),
        copy_ms: ms(copy::copy_duration(fetch_bytes, rate)),
        modes,
        target: None,
    };
    report.check_target();
    Ok(report)
}

/// One in-process node: a CPU tier and a p2p tier under a manager.
struct Node {
    mgr: TieringManager,
    arena: Arc<ChunkArena>,
    p2p: P2pHandle,
}

fn node(cfg: &FetchRttConfig, config: ManagerConfig, rows: usize) -> Result<Node, BenchError> {
    let options = CpuTierOptions::new(Capacity::Chunks(rows as u64)).with_eviction(PolicyKind::Lru);
    node_with(cfg, config, &options)
}

fn node_with(
    cfg: &FetchRttConfig,
    config: ManagerConfig,
    primary: &CpuTierOptions,
) -> Result<Node, BenchError> {
    let err = |what: &str, e: String| BenchError::Tier {
        tier: what.to_owned(),
        message: e,
    };
    let primary = CpuTier::from_options(primary, cfg.chunk_bytes).map_err(|e| err("cpu", e.to_string()))?;
    let arena = Arc::clone(tiering_core::PrimaryTier::arena(&primary));
    let mut opts = P2pTierOptions::loopback();
    // Authenticated as a deployment runs (the MACs are part of what a fetch costs), with a
    // secret of this run that both nodes share.
    opts.insecure = false;
    opts.secret = Some(SharedSecret::new(
        format!("kvtier-bench-fetch-rtt-{}-{:x}", std::process::id(), cfg.seed).as_bytes(),
    ));
    opts.hash_seed = "kvtier-bench".into();
    opts.layout_fingerprint = format!("bench-{}", cfg.chunk_bytes);
    let tier = P2pTier::new(opts, &arena).map_err(|e| err("p2p", e.to_string()))?;
    let p2p = tier.handle();
    let mgr = TieringManager::new(Box::new(primary), vec![Box::new(tier)], config);
    Ok(Node { mgr, arena, p2p })
}

fn mgr_err(e: &tiering_core::ManagerError) -> BenchError {
    BenchError::Tier {
        tier: "manager".into(),
        message: e.to_string(),
    }
}

fn end() -> ScheduleEndContext {
    ScheduleEndContext::default()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Request parameters naming the producer `from` as the source of `kv`, under `key`
/// (`remote_prefiller` or `remote_kv_source`).
fn source_params(key: &str, kv: &str, from: &P2pHandle) -> serde_json::Map<String, serde_json::Value> {
    let mut params = serde_json::Map::new();
    params.insert(
        key.into(),
        serde_json::json!({
            "kv_request_id": kv,
            "host": from.host(),
            "port": from.port(),
        }),
    );
    params
}
