//! `kvtier bench fetch-rtt`: how long does a peer's fetch wait on a busy producer?
//!
//! Two nodes in this process, each a CPU tier plus a p2p tier under a `TieringManager`. The
//! producer runs a busy engine: a model step (default 50 ms) with no manager call, then the next
//! step's calls, again and again. Two flows:
//!
//! - **hand-off** (default; `handoff`): the prefill→decode split. Each producer step starts
//!   storing one request marked `remote_decoder` (`prepare_store`; a copy-worker thread fills
//!   the rows). Right after that `prepare_store` the consumer starts its `remote_prefiller`
//!   pull, so its fetch is sent before the producer's store completed; the copy worker finishes
//!   only after the fetch left, plus a small copy time. The store completes either at the
//!   producer's next step (`complete_store`), or — `thread+offstep` — as soon as the worker
//!   reports it through the manager's `StoreCompletionSender`.
//! - **pull** (`pull`): the producer stored every chunk up front; the consumer probes
//!   (`remote_kv_source`) and pulls what it found, one request after another.
//!
//! The fetch round trip is timed from the moment the consumer's fetch leaves (the end of the
//! consumer step that submitted the promotion) to the consumer lookup that sees every chunk
//! landed; the bytes are verified after. Each fetch also records how many producer steps began
//! meanwhile: the evidence of whether the fetch waited for one.
//!
//! Modes, all in one invocation by default: `step` (the producer serves peers only inside its
//! own steps), `thread` (a control-plane thread serves peers while the model runs), and
//! `thread+offstep` (the thread also completes stores the copy worker reported). Next to them,
//! measured in the same run: the producer's step period, a raw ZeroMQ DEALER→ROUTER round trip
//! (the floor of any control exchange) and the raw loopback-TCP transfer time of one fetch's
//! bytes (the floor of its data).

mod handoff;
mod pull;
mod reference;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tier_cpu::{CpuTier, PolicyKind};
use tier_p2p::{P2pHandle, P2pTier, P2pTierOptions};
use tiering_core::{ChunkArena, ManagerConfig, ScheduleEndContext, TieringManager};

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
    /// Hand-off flow: the copy worker's device→cpu copy time, counted from the moment the
    /// consumer's fetch left.
    #[serde(serialize_with = "ser_ms")]
    pub copy_time: Duration,
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
    /// Raw control round trips to sample.
    pub raw_round_trips: usize,
    /// Raw transfers of one fetch's bytes to sample.
    pub transfer_samples: usize,
    /// Longest wait for one fetch (and for any hand-off signal).
    #[serde(serialize_with = "ser_ms")]
    pub fetch_timeout: Duration,
    /// Test aid (hand-off flow, `thread+offstep` only): the producer's model step also lasts
    /// until the fetch of the request it started has landed, so "no producer step began during
    /// the fetch" is an ordering fact instead of a race against the step time. A fetch that
    /// needed a producer step then waits `fetch_timeout` for it. Off for measurements.
    pub hold_offstep_step_until_landed: bool,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `serialize_with` signature
fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

impl Default for FetchRttConfig {
    fn default() -> Self {
        Self {
            producer_step: Duration::from_millis(50),
            copy_time: Duration::from_micros(200),
            fetches: 40,
            chunks_per_fetch: 4,
            chunk_bytes: 64 * 1024,
            modes: ControlPlaneMode::ALL.to_vec(),
            flow: Flow::Handoff,
            raw_round_trips: 2000,
            transfer_samples: 200,
            fetch_timeout: Duration::from_secs(20),
            hold_offstep_step_until_landed: false,
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
    /// Per fetch, in order: producer steps that began while it was in flight.
    pub producer_steps_during_fetch: Vec<u64>,
    /// Fetches that reached the producer before their chunks were stored, and waited there.
    pub fetches_waited: u64,
    /// Producer stores completed off-step (reported by the copy worker).
    pub off_step_store_completions: u64,
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

/// The target for `thread+offstep`, checked against figures of the same run.
#[derive(Clone, Debug, Serialize)]
pub struct TargetCheck {
    /// `thread+offstep` fetch round trip p50, ms.
    pub offstep_p50_ms: f64,
    /// 2 ms plus the raw transfer time (p50) of the same bytes.
    pub limit_ms: f64,
    /// `offstep_p50_ms <= limit_ms`.
    pub within_limit: bool,
    /// `step` p50 over `thread+offstep` p50.
    pub speedup_vs_step: f64,
    /// `speedup_vs_step >= 10`.
    pub ten_times_step: bool,
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
    /// One entry per mode.
    pub modes: Vec<ModeResult>,
    /// The target, when both `step` and `thread+offstep` ran in the hand-off flow.
    pub target: Option<TargetCheck>,
}

impl FetchRttReport {
    fn check_target(&mut self) {
        if self.config.flow != Flow::Handoff {
            return;
        }
        let p50 = |m: ControlPlaneMode| self.modes.iter().find(|r| r.mode == m).map(|r| r.fetch_ms.p50);
        let (Some(off), Some(step)) = (p50(ControlPlaneMode::ThreadOffStep), p50(ControlPlaneMode::Step))
        else {
            return;
        };
        let limit_ms = 2.0 + self.transfer_ms.p50;
        let speedup = if off > 0.0 { step / off } else { f64::INFINITY };
        self.target = Some(TargetCheck {
            offstep_p50_ms: off,
            limit_ms,
            within_limit: off <= limit_ms,
            speedup_vs_step: speedup,
            ten_times_step: speedup >= 10.0,
        });
    }
}

impl fmt::Display for FetchRttReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let fetch_kib = c.chunks_per_fetch * c.chunk_bytes / 1024;
        write!(
            f,
            "kvtier bench fetch-rtt — {} flow, producer model step {:.1} ms",
            c.flow,
            c.producer_step.as_secs_f64() * 1e3
        )?;
        if c.flow == Flow::Handoff {
            write!(f, ", copy {:.2} ms", c.copy_time.as_secs_f64() * 1e3)?;
        }
        writeln!(
            f,
            "; {} fetches of {} × {} KiB per mode",
            c.fetches,
            c.chunks_per_fetch,
            c.chunk_bytes / 1024
        )?;
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
        writeln!(
            f,
            "  {:<15} {:>24} {:>18} {:>20} {:>8}",
            "mode", "fetch rtt p50 / p99 ms", "producer step ms", "fetches w/o a step", "waited"
        )?;
        for m in &self.modes {
            writeln!(
                f,
                "  {:<15} {:>11.2} / {:<10.2} {:>18.2} {:>13} / {:<4} {:>8}",
                m.mode.to_string(),
                m.fetch_ms.p50,
                m.fetch_ms.p99,
                m.producer_step_ms.p50,
                m.fetches_without_a_producer_step(),
                m.producer_steps_during_fetch.len(),
                m.fetches_waited
            )?;
            if let Some(l) = &m.lookup_ms {
                writeln!(
                    f,
                    "  {:<15} lookup rtt p50 {:.2} ms, p99 {:.2} ms",
                    "", l.p50, l.p99
                )?;
            }
        }
        if let Some(t) = &self.target {
            let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
            writeln!(
                f,
                "  target: thread+offstep p50 {:.2} ms ≤ 2 ms + transfer {:.3} ms = {:.2} ms: {}; {:.1}× better than step (≥ 10×): {}",
                t.offstep_p50_ms,
                self.transfer_ms.p50,
                t.limit_ms,
                verdict(t.within_limit),
                t.speedup_vs_step,
                verdict(t.ten_times_step)
            )?;
        }
        Ok(())
    }
}

/// Runs the configured flow in every configured mode, and the references.
///
/// # Errors
/// A setting out of range, a node that cannot be built, a fetch that misses or times out, or
/// bytes that arrive wrong.
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
    let raw = reference::control_rtt(cfg.raw_round_trips.max(1))?;
    let transfer = reference::transfer_time(
        cfg.chunks_per_fetch * cfg.chunk_bytes,
        cfg.transfer_samples.max(1),
    )?;
    let mut modes = Vec::new();
    for &mode in &cfg.modes {
        modes.push(match cfg.flow {
            Flow::Handoff => handoff::run(cfg, mode)?,
            Flow::Pull => pull::run(cfg, mode)?,
        });
    }
    let mut report = FetchRttReport {
        config: cfg.clone(),
        raw_control_rtt_us: Percentiles::of(&raw),
        transfer_ms: Percentiles::of(&transfer),
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
    let err = |what: &str, e: String| BenchError::Tier {
        tier: what.to_owned(),
        message: e,
    };
    let primary =
        CpuTier::new(rows, cfg.chunk_bytes, PolicyKind::Lru).map_err(|e| err("cpu", e.to_string()))?;
    let arena = Arc::clone(tiering_core::PrimaryTier::arena(&primary));
    let mut opts = P2pTierOptions::loopback();
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
