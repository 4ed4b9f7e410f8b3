//! Benchmarks behind `kvtier bench`: each figure is printed next to its physical reference,
//! measured in the same run.
//!
//! - [`tiers`]: store/load throughput of every tier of a chain (memcpy for the CPU tier, raw
//!   `O_DIRECT` file I/O for storage tiers);
//! - [`redis`](mod@redis): a Redis tier against raw pipelined `SET`/`GET` to the same server, and
//!   its lookup latency;
//! - [`fetch_rtt`](mod@fetch_rtt): a peer's fetch round trip from a busy producer in each control-plane mode
//!   (step-driven, control thread, control thread with off-step store completions), in the
//!   prefill→decode hand-off or a plain pull, next to a raw control round trip and the raw
//!   transfer time of the same bytes.

pub mod command;
pub mod fetch_rtt;
mod raw_file;
pub mod redis;
mod tier_config;
mod tier_figures;
mod tier_harness;
pub mod tiers;

pub use command::{BenchCommand, run_command};
pub use fetch_rtt::{
    ControlPlaneMode, CopyWorkerArgs, FetchRttConfig, FetchRttReport, Flow, ModeResult, TargetCheck,
    copy_worker, fetch_rtt,
};
pub use redis::LookupLatency;
pub use tier_config::{DiskTarget, RedisTarget, TierBenchConfig};
pub use tier_figures::TierBenchRow;
pub use tiers::{TierBenchReport, bench_tiers};

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A setting is out of range.
    #[error("invalid benchmark setting `{name}`: {reason}")]
    InvalidSetting {
        /// The setting.
        name: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A tier refused an operation or reported a failed job.
    #[error("tier {tier}: {message}")]
    Tier {
        /// The tier.
        tier: String,
        /// What happened.
        message: String,
    },
    /// The reference measurement failed.
    #[error("reference {reference}: {error}")]
    Reference {
        /// Which reference.
        reference: String,
        /// The OS error.
        error: std::io::Error,
    },
    /// An arena grant failed.
    #[error(transparent)]
    Arena(#[from] tiering_core::arena::ArenaError),
}
