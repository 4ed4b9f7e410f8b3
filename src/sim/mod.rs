//! The engine simulator behind `kvtier run`.
//!
//! ```no_run
//! use kvtier::sim::{SimConfig, Workload, WorkloadKind, WorkloadSpec, cpu_chain, run_simulation};
//! use tier_cpu::PolicyKind;
//!
//! let cfg = SimConfig::default();
//! let workload = Workload::generate(&WorkloadSpec::new(WorkloadKind::Chat, 500, 1));
//! let report = run_simulation(&cpu_chain(64 << 20, PolicyKind::Lru), &cfg, &workload)?;
//! println!("{report}");
//! # Ok::<(), kvtier::sim::SimError>(())
//! ```
//!
//! A run drives a fresh chain with the workload, then (unless disabled) runs the same workload
//! with offloading off to count the prefill tokens offloading saved.

mod chain;
pub mod command;
mod config;
mod copier;
pub(crate) mod cpu_clock;
mod device;
mod engine;
mod error;
mod hash;
pub mod health;
mod metrics;
pub mod nodes;
mod offload;
pub mod preflight;
pub mod profile;
mod report;
mod rng;
mod session;
mod store_ledger;
mod trace;
mod workload;

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tier_cpu::{Capacity, CpuTier, CpuTierOptions, PolicyKind};
use tiering_core::ManagerConfig;

pub use chain::{BuiltTiers, Chain, ChainFactory, config_chain};
pub use command::{RunArgs, load_chain, registry, run_command};
pub use config::SimConfig;
pub use error::{BoxError, SimError};
pub use hash::{chunk_keys, chunk_matches, fill_chunk};
pub use metrics::RunMetrics;
pub use nodes::{NodeReport, NodesReport, run_nodes};
pub use offload::{EventCounts, LookupCounts, Source};
pub use report::{Baseline, CopyJobs, Identity, PathRow, Percentiles, Report, SourceRow, Timing};
pub use rng::{SimRng, Zipf};
pub use session::{Session, run_offload_off};
pub use trace::{load_trace, parse_trace};
pub use workload::{RequestSpec, Workload, WorkloadKind, WorkloadSpec};

use engine::{Engine, check_workload};
use offload::Offload;

/// A chain of one CPU tier (`tier_cpu::CpuTier`) of `capacity_bytes` with the given eviction
/// policy, and no secondary tier.
pub fn cpu_chain(capacity_bytes: u64, eviction: PolicyKind) -> impl Fn(usize) -> Result<Chain, BoxError> {
    move |chunk_bytes: usize| {
        let options = CpuTierOptions::new(Capacity::Bytes(capacity_bytes)).with_eviction(eviction);
        let primary = CpuTier::from_options(&options, chunk_bytes)?;
        Ok(Chain::new(
            Box::new(primary),
            Vec::new(),
            ManagerConfig::default(),
        ))
    }
}

fn progress_bar(cfg: &SimConfig, len: u64) -> ProgressBar {
    if !cfg.progress || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{prefix:>12} [{bar:40}] {pos}/{len} requests {elapsed}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// Runs `workload` through a chain built by `factory`, then (if `cfg.compare_baseline`) with
/// offloading off, and reports.
///
/// # Errors
/// An invalid setting or workload, a chain that cannot be built, a manager error, a copy worker
/// failure, or a run that stalls.
pub fn run_simulation(
    factory: &dyn ChainFactory,
    cfg: &SimConfig,
    workload: &Workload,
) -> Result<Report, SimError> {
    cfg.validate()?;
    check_workload(cfg, workload)?;
    let chain = factory.build(cfg.chunk_bytes).map_err(SimError::Chain)?;
    if chain.arena.chunk_bytes() != cfg.chunk_bytes {
        return Err(SimError::InvalidSetting {
            name: "chunk_bytes",
            reason: format!(
                "the chain's arena rows hold {} bytes, the engine's chunks {}",
                chain.arena.chunk_bytes(),
                cfg.chunk_bytes
            ),
        });
    }
    if let Some(cost) = cfg.manager_recompute_cost() {
        chain.manager.set_recompute_cost(Some(cost));
    }
    let n = workload.requests.len() as u64;
    let pb = progress_bar(cfg, n);
    pb.set_prefix("offload on");
    let off = Offload::new(chain.manager, chain.arena, chain.secondaries.len())?;
    let (metrics, off) = Engine::new(cfg, &workload.requests, Some(off), Some(&pb))?.run()?;
    let Some(mut off) = off else {
        return Err(SimError::Worker("the engine lost its manager".into()));
    };
    let stats = off.stats()?;
    let control_thread = stats.manager.sweeps > 0 && off.control_thread_running();
    off.shutdown()?;
    let baseline = if cfg.compare_baseline {
        pb.set_position(0);
        pb.set_prefix("offload off");
        let (b, _) = Engine::new(cfg, &workload.requests, None, Some(&pb))?.run()?;
        Some(b)
    } else {
        None
    };
    pb.finish_and_clear();
    Ok(Report::build(
        workload.label.clone(),
        cfg,
        &metrics,
        &stats,
        control_thread,
        baseline.as_ref(),
    ))
}
