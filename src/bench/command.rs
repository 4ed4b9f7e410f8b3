//! The `kvtier bench` command: arguments and printing; the measurements live in [`super::tiers`]
//! and [`super::fetch_rtt`].

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use super::{ControlPlaneMode, FetchRttConfig, TierBenchConfig, bench_tiers, fetch_rtt};
use crate::sim::BuiltTiers;
use crate::sim::command::{load_chain, registry};

/// `kvtier bench …` subcommands.
#[derive(Clone, Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Store/load throughput of every tier of a chain next to its physical reference.
    Tiers {
        /// The tier chain file; the embedded `config/default.toml` when omitted.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Bytes per chunk.
        #[arg(long, default_value_t = 256 * 1024)]
        chunk_bytes: usize,
        /// Chunks per job.
        #[arg(long, default_value_t = 32)]
        batch_chunks: usize,
        /// MiB moved per tier and direction.
        #[arg(long, default_value_t = 256)]
        mib: u64,
        /// Also write the figures as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
    /// A peer's fetch round trip from a busy producer, control-plane thread vs step-driven.
    FetchRtt {
        /// The producer's model step, ms.
        #[arg(long, default_value_t = 50.0)]
        step_ms: f64,
        /// Pulls per mode.
        #[arg(long, default_value_t = 40)]
        fetches: usize,
        /// Chunks per pull.
        #[arg(long, default_value_t = 4)]
        chunks_per_fetch: usize,
        /// Bytes per chunk.
        #[arg(long, default_value_t = 64 * 1024)]
        chunk_bytes: usize,
        /// Run only this mode (both when omitted).
        #[arg(long = "control-plane", value_parser = parse_mode)]
        mode: Option<ControlPlaneMode>,
        /// Also write the figures as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
}

fn parse_mode(s: &str) -> Result<ControlPlaneMode, String> {
    match s {
        "thread" => Ok(ControlPlaneMode::Thread),
        "step" => Ok(ControlPlaneMode::Step),
        other => Err(format!(
            "unknown control-plane mode `{other}` (expected thread or step)"
        )),
    }
}

fn write_json<T: Serialize>(path: Option<&PathBuf>, value: &T) -> Result<()> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(value).context("serialising the figures")?;
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// Runs a `kvtier bench` subcommand and prints its figures.
///
/// # Errors
/// Bad arguments, an invalid chain, or a failed measurement.
pub fn run_command(cmd: &BenchCommand, default_name: &str, default_text: &str) -> Result<()> {
    match cmd {
        BenchCommand::Tiers {
            config,
            chunk_bytes,
            batch_chunks,
            mib,
            json,
        } => {
            let chain = load_chain(config.as_deref(), default_name, default_text)?;
            // A storage tier's own directory is where its physical reference belongs.
            let scratch_dir = chain
                .secondaries
                .iter()
                .find_map(|s| s.options.get("path").and_then(toml::Value::as_str))
                .map_or_else(std::env::temp_dir, PathBuf::from);
            let cfg = TierBenchConfig {
                chunk_bytes: *chunk_bytes,
                batch_chunks: *batch_chunks,
                total_bytes: mib.saturating_mul(1 << 20),
                scratch_dir,
                ..TierBenchConfig::default()
            };
            let tiers = BuiltTiers::from_config(&chain, registry()?, cfg.chunk_bytes)
                .map_err(|e| anyhow::anyhow!(e))?;
            let report = bench_tiers(tiers, &cfg);
            if config.is_none() {
                crate::sim::command::remove_default_scratch();
            }
            let report = report?;
            println!("{report}");
            write_json(json.as_ref(), &report)
        }
        BenchCommand::FetchRtt {
            step_ms,
            fetches,
            chunks_per_fetch,
            chunk_bytes,
            mode,
            json,
        } => {
            if !step_ms.is_finite() || *step_ms < 0.0 {
                anyhow::bail!("--step-ms must be a non-negative number of milliseconds");
            }
            let cfg = FetchRttConfig {
                producer_step: Duration::from_secs_f64(step_ms / 1e3),
                fetches: *fetches,
                chunks_per_fetch: *chunks_per_fetch,
                chunk_bytes: *chunk_bytes,
                modes: mode.map_or_else(
                    || vec![ControlPlaneMode::Thread, ControlPlaneMode::Step],
                    |m| vec![m],
                ),
                ..FetchRttConfig::default()
            };
            let report = fetch_rtt(&cfg)?;
            println!("{report}");
            write_json(json.as_ref(), &report)
        }
    }
}
