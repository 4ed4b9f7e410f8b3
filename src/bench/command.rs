//! The `kvtier bench` command: arguments and printing; the measurements live in [`super::tiers`]
//! and [`super::fetch_rtt`](mod@super::fetch_rtt).

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::Serialize;

use super::fetch_rtt::sweep as fetch_rtt_sweep;
use super::{ControlPlaneMode, FetchRttConfig, Flow, TierBenchConfig, bench_tiers, fetch_rtt};
use crate::sim::BuiltTiers;
use crate::sim::command::{load_chain, registry};

/// A count that must be at least 1 (a zero would "measure" nothing and print a throughput).
fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `kvtier bench …` subcommands.
#[derive(Clone, Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Store/load throughput of every tier of a chain next to its physical reference.
    Tiers {
        /// The tier chain file; the embedded `config/default.toml` when omitted.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Bytes per chunk (at least 1).
        #[arg(long, default_value_t = 256 * 1024, value_parser = positive)]
        chunk_bytes: usize,
        /// Chunks per job (at least 1).
        #[arg(long, default_value_t = 32, value_parser = positive)]
        batch_chunks: usize,
        /// MiB moved per tier and direction (1 to 65536).
        #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65536))]
        mib: u64,
        /// Also write the figures as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
    /// A peer's fetch round trip from a busy producer in each control-plane mode (step, thread,
    /// thread+offstep), next to the raw control round trip and data transfer time.
    FetchRtt {
        /// The producer's model step, ms.
        #[arg(long, default_value_t = 50.0)]
        step_ms: f64,
        /// The producer's scheduling phase per step, ms: how long it holds its step (making
        /// manager calls) before the model runs.
        #[arg(long, default_value_t = 2.0)]
        sched_ms: f64,
        /// Hand-off flow: mean gap between the consumer's fetches, ms (Poisson arrivals).
        #[arg(long, default_value_t = 10.0)]
        arrival_ms: f64,
        /// Seed of the keys and the arrival times.
        #[arg(long, default_value_t = FetchRttConfig::default().seed)]
        seed: u64,
        /// Hand-off flow: run the producer's copy workers as two OS processes on its shared
        /// arena, reporting on the completion channel (`reporters = 2`).
        #[arg(long)]
        workers_process: bool,
        /// Hand-off flow: also print each mode's N slowest fetches with their round trip split
        /// (departure, copy end, control and data planes with the consumer's poll gap).
        #[arg(long, value_name = "N", default_value_t = 0)]
        explain_slowest: usize,
        /// Measured fetches per mode.
        #[arg(long, default_value_t = 200)]
        fetches: usize,
        /// Chunks per fetch.
        #[arg(long, default_value_t = 4)]
        chunks_per_fetch: usize,
        /// Bytes per chunk.
        #[arg(long, default_value_t = 64 * 1024)]
        chunk_bytes: usize,
        /// The producer's control plane: step, thread or thread+offstep, or a comma list
        /// (all three, in that order, when omitted).
        #[arg(
            long = "control-plane",
            value_delimiter = ',',
            value_parser = ControlPlaneMode::from_str,
            value_name = "MODE[,MODE…]"
        )]
        modes: Vec<ControlPlaneMode>,
        /// handoff: the consumer's fetch is sent before the producer's store completes
        /// (prefill→decode); pull: the producer holds the chunks, the consumer probes then
        /// pulls.
        #[arg(long, default_value_t = Flow::Handoff, value_parser = Flow::from_str)]
        flow: Flow,
        /// Instead of one run: run `thread+offstep` in the six settings its targets are stated
        /// for (`--step-ms` 20, 50, 200, each in-process and with `--workers-process`) N times
        /// and count the runs meeting each target.
        #[arg(long, value_name = "N", conflicts_with_all = ["step_ms", "workers_process", "modes", "flow", "explain_slowest"])]
        sweep: Option<usize>,
        /// Also write the figures as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
}

fn write_json<T: Serialize>(path: Option<&PathBuf>, value: &T) -> Result<()> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(value).context("serialising the figures")?;
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// The options of the chain's tiers of type `tier_type`, each made into a bench target.
fn targets<O: serde::de::DeserializeOwned, T>(
    chain: &tiering_config::ChainConfig,
    tier_type: &str,
    target: fn(O) -> T,
) -> Result<Vec<T>> {
    chain
        .secondaries
        .iter()
        .filter(|s| s.tier_type == tier_type)
        .map(|s| {
            let options: O = tiering_core::options::parse_options(&s.options)
                .with_context(|| format!("{}: {}", chain.source, s.describe()))?;
            Ok(target(options))
        })
        .collect()
}

/// The chain's `redis` tiers with their options.
fn redis_targets(chain: &tiering_config::ChainConfig) -> Result<Vec<super::RedisTarget>> {
    targets(chain, "redis", |options: tier_redis::RedisTierOptions| {
        super::RedisTarget {
            name: options.name.clone(),
            options,
        }
    })
}

/// The chain's `disk` tiers with what shapes their I/O.
fn disk_targets(chain: &tiering_config::ChainConfig) -> Result<Vec<super::DiskTarget>> {
    targets(chain, "disk", |options: tier_disk::DiskTierOptions| {
        super::DiskTarget {
            name: options.name,
            io_threads: options.io_threads,
            capacity: options.capacity.bytes(),
            preallocate: options.preallocate,
        }
    })
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
                redis: redis_targets(&chain)?,
                disk: disk_targets(&chain)?,
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
            sched_ms,
            arrival_ms,
            seed,
            workers_process,
            explain_slowest,
            fetches,
            chunks_per_fetch,
            chunk_bytes,
            modes,
            flow,
            sweep: rounds,
            json,
        } => {
            let millis = |name: &str, v: f64| -> Result<Duration> {
                if !v.is_finite() || v < 0.0 {
                    anyhow::bail!("--{name} must be a non-negative number of milliseconds");
                }
                Ok(Duration::from_secs_f64(v / 1e3))
            };
            let mut modes = modes.clone();
            if modes.is_empty() {
                modes = ControlPlaneMode::ALL.to_vec();
            }
            let cfg = FetchRttConfig {
                producer_step: millis("step-ms", *step_ms)?,
                sched_time: millis("sched-ms", *sched_ms)?,
                arrival_mean: millis("arrival-ms", *arrival_ms)?,
                seed: *seed,
                workers_process: *workers_process,
                explain_slowest: *explain_slowest,
                fetches: *fetches,
                chunks_per_fetch: *chunks_per_fetch,
                chunk_bytes: *chunk_bytes,
                modes,
                flow: *flow,
                ..FetchRttConfig::default()
            };
            if let Some(rounds) = rounds {
                let report = fetch_rtt_sweep(&cfg, *rounds, |run| println!("{run}"))?;
                println!("{report}");
                return write_json(json.as_ref(), &report);
            }
            let report = fetch_rtt(&cfg)?;
            println!("{report}");
            write_json(json.as_ref(), &report)
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Bench {
        #[command(subcommand)]
        cmd: BenchCommand,
    }

    fn fetch_rtt_args(args: &[&str]) -> (Vec<ControlPlaneMode>, Flow) {
        let mut argv = vec!["bench", "fetch-rtt"];
        argv.extend_from_slice(args);
        match Bench::try_parse_from(argv).unwrap().cmd {
            BenchCommand::FetchRtt { modes, flow, .. } => (modes, flow),
            BenchCommand::Tiers { .. } => unreachable!(),
        }
    }

    #[test]
    fn control_plane_takes_one_mode_or_a_comma_list_and_flow_defaults_to_handoff() {
        assert_eq!(fetch_rtt_args(&[]), (Vec::new(), Flow::Handoff));
        assert_eq!(
            fetch_rtt_args(&["--control-plane", "thread+offstep"]).0,
            [ControlPlaneMode::ThreadOffStep]
        );
        assert_eq!(
            fetch_rtt_args(&["--control-plane", "step,thread+offstep", "--flow", "pull"]),
            (
                vec![ControlPlaneMode::Step, ControlPlaneMode::ThreadOffStep],
                Flow::Pull
            )
        );
        match Bench::try_parse_from(["bench", "fetch-rtt"]).unwrap().cmd {
            BenchCommand::FetchRtt {
                sched_ms,
                workers_process,
                ..
            } => assert!((sched_ms - 2.0).abs() < f64::EPSILON && !workers_process),
            BenchCommand::Tiers { .. } => unreachable!(),
        }
        let argv = [
            "bench",
            "fetch-rtt",
            "--workers-process",
            "--sched-ms",
            "1.5",
            "--arrival-ms",
            "4",
        ];
        match Bench::try_parse_from(argv).unwrap().cmd {
            BenchCommand::FetchRtt {
                sched_ms,
                arrival_ms,
                workers_process,
                ..
            } => assert!(
                workers_process
                    && (sched_ms - 1.5).abs() < f64::EPSILON
                    && (arrival_ms - 4.0).abs() < f64::EPSILON
            ),
            BenchCommand::Tiers { .. } => unreachable!(),
        }
        let bad = Bench::try_parse_from(["bench", "fetch-rtt", "--control-plane", "step,sometimes"]);
        assert!(bad.is_err());
        assert!(Bench::try_parse_from(["bench", "fetch-rtt", "--flow", "push"]).is_err());
    }

    #[test]
    fn a_sweep_sets_its_own_settings_and_refuses_the_ones_it_varies() {
        match Bench::try_parse_from(["bench", "fetch-rtt", "--sweep", "5", "--sched-ms", "1"])
            .unwrap()
            .cmd
        {
            BenchCommand::FetchRtt { sweep, sched_ms, .. } => {
                assert_eq!(sweep, Some(5));
                assert!((sched_ms - 1.0).abs() < f64::EPSILON);
            }
            BenchCommand::Tiers { .. } => unreachable!(),
        }
        for varied in [
            &["--step-ms", "20"][..],
            &["--workers-process"],
            &["--control-plane", "step"],
            &["--flow", "pull"],
            &["--explain-slowest", "3"],
        ] {
            let argv = [&["bench", "fetch-rtt", "--sweep", "2"][..], varied].concat();
            let err = Bench::try_parse_from(argv)
                .err()
                .expect("a sweep varies these itself");
            assert!(err.to_string().contains("cannot be used with"), "{err}");
        }
    }
}
