//! The `kvtier run` command: arguments, chain loading, the run, the report and `--json`.
//!
//! The binary's CLI embeds [`RunArgs`] and calls [`run_command`]; everything the command does
//! lives here, next to the simulator.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result};
use tier_cpu::{CpuTier, CpuTierOptions};
use tiering_config::ChainConfig;
use tiering_core::options::parse_options;
use tiering_core::{
    PrimaryTier, TierError,
    registry::{PrimaryContext, Registry, TierRegistration},
};

use super::{SimConfig, Workload, WorkloadKind, WorkloadSpec, config_chain, run_simulation};

/// Arguments of `kvtier run`.
#[derive(Clone, Debug, clap::Args)]
pub struct RunArgs {
    /// The tier chain file; the embedded `config/default.toml` when omitted.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The generated workload (ignored with `--trace`).
    #[arg(long, default_value = "chat", value_parser = parse_kind)]
    pub workload: WorkloadKind,
    /// Number of requests to generate (at most 1,000,000: the workload is generated up front,
    /// some tens of bytes per token of every prompt).
    #[arg(long, default_value_t = 2000, value_parser = parse_requests)]
    pub requests: usize,
    /// Seed of the workload (the same seed gives the same requests).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Mean arrival rate, requests per second.
    #[arg(long, default_value_t = 300.0)]
    pub rate: f64,
    /// Replay a JSONL trace instead of generating a workload.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Also write the report as JSON to this file (checked writable before the run starts).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Serve Prometheus metrics (names prefixed `kvtier_`) over HTTP at this address while the
    /// run lasts, e.g. `127.0.0.1:9464`.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// With `--metrics-addr`: keep serving this many seconds after the run, so the final
    /// figures can be scraped.
    #[arg(long, value_name = "SECS", default_value_t = 0, requires = "metrics_addr")]
    pub metrics_hold: u64,
    /// Bytes per chunk (one device block).
    #[arg(long, default_value_t = SimConfig::default().chunk_bytes)]
    pub chunk_bytes: usize,
    /// Tokens per chunk.
    #[arg(long, default_value_t = SimConfig::default().tokens_per_chunk)]
    pub tokens_per_chunk: usize,
    /// Device KV pool size, in blocks.
    #[arg(long, default_value_t = SimConfig::default().device_blocks)]
    pub device_blocks: usize,
    /// Fixed model time per step, µs.
    #[arg(long, default_value_t = 100)]
    pub step_us: u64,
    /// Model time per prefill token, ns.
    #[arg(long, default_value_t = 2000)]
    pub prefill_ns_per_token: u64,
    /// Skip the offloading-off comparison run.
    #[arg(long)]
    pub no_baseline: bool,
    /// Model a synchronous engine (scheduling, then the model, in turn) instead of vLLM's
    /// default asynchronous scheduling, which prepares the next step while the model runs.
    #[arg(long)]
    pub sync_scheduling: bool,
    /// Run this many simulated engines at once in this process, each with its own manager and
    /// primary tier, over one chain whose shared tier (`type = "redis"`) they all use; the
    /// workload is dealt round-robin and the report shows, per node, the tokens served from
    /// chunks another node stored (cross-node hits).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = parse_nodes)]
    pub nodes: usize,
    /// Fail at start when a configured p2p peer cannot be reached (refused, silent or
    /// unresolvable). Without it such a peer is a warning and the run proceeds with it down.
    #[arg(long)]
    pub require_peers: bool,
    /// A model profile (`llama-3.1-8b`, `llama-3.1-70b`, on an H100): derives the model time
    /// per prefill token so that recompute time per KV byte matches the real model, and gives
    /// the manager that recompute cost (see docs/benchmarks.md, "Model profiles in the simulator").
    #[arg(long, value_name = "PROFILE", conflicts_with = "prefill_ns_per_token")]
    pub model: Option<String>,
    /// Give the manager the engine's recompute cost (from `--prefill-ns-per-token`) without a
    /// model profile, so it declines promotions slower than recomputing.
    #[arg(long)]
    pub cost_model: bool,
}

fn parse_kind(s: &str) -> Result<WorkloadKind, String> {
    s.parse()
}

/// The most requests `--requests` accepts.
pub const MAX_REQUESTS: usize = 1_000_000;

fn parse_requests(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if n > MAX_REQUESTS {
        return Err(format!(
            "{n} requests is more than the limit of {MAX_REQUESTS} (the workload is held in memory); \
             run several seeds instead"
        ));
    }
    Ok(n)
}

fn parse_nodes(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if !(1..=super::nodes::MAX_NODES).contains(&n) {
        return Err(format!("{n} is not between 1 and {}", super::nodes::MAX_NODES));
    }
    Ok(n)
}

/// Opens `path` for writing before the run, so an unwritable `--json` fails in a moment
/// rather than after the whole run. Returns whether the file was created by this check (and is
/// removed again if the run fails).
fn check_writable(path: &Path) -> Result<bool> {
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .with_context(|| format!("--json {}: cannot write there", path.display()))?;
    Ok(!existed)
}

static REGISTRY: OnceLock<Registry> = OnceLock::new();

fn cpu_factory(options: &toml::Table, ctx: &PrimaryContext) -> Result<Box<dyn PrimaryTier>, TierError> {
    let opts: CpuTierOptions = parse_options(options)?;
    Ok(Box::new(CpuTier::from_options(&opts, ctx.chunk_bytes)?))
}

static CPU_FALLBACK: TierRegistration = TierRegistration::primary("cpu", "kvtier", cpu_factory);

/// The global tier registry, plus the `cpu` primary type if no linked crate registers it.
///
/// # Errors
/// The global registry is inconsistent (a type registered twice).
pub fn registry() -> Result<&'static Registry> {
    let global = Registry::global().context("the tier registry is inconsistent")?;
    if global.get("cpu").is_some() {
        return Ok(global);
    }
    if let Some(r) = REGISTRY.get() {
        return Ok(r);
    }
    let merged = Registry::from_registrations(global.iter().chain([&CPU_FALLBACK]))
        .context("the tier registry is inconsistent")?;
    Ok(REGISTRY.get_or_init(|| merged))
}

/// Loads `path`, or parses the embedded default chain (`default_name`, `default_text`).
///
/// # Errors
/// The file cannot be read or is not a valid chain (the error names file, line and key).
pub fn load_chain(path: Option<&Path>, default_name: &str, default_text: &str) -> Result<ChainConfig> {
    Ok(match path {
        Some(p) => ChainConfig::load(p)?,
        None => ChainConfig::parse(default_name, default_text)?,
    })
}

/// Runs `kvtier run`: prints the report (and writes `--json`).
///
/// # Errors
/// Bad arguments, an invalid chain or trace, a tier that cannot be built, or a failed run.
pub fn run_command(args: &RunArgs, default_name: &str, default_text: &str) -> Result<()> {
    let created = match &args.json {
        Some(path) => check_writable(path)?,
        None => false,
    };
    let result = run_and_report(args, default_name, default_text);
    if result.is_err()
        && created
        && let Some(path) = &args.json
        && std::fs::metadata(path).is_ok_and(|m| m.len() == 0)
    {
        let _ = std::fs::remove_file(path);
    }
    result
}

fn run_and_report(args: &RunArgs, default_name: &str, default_text: &str) -> Result<()> {
    let chain = load_chain(args.config.as_deref(), default_name, default_text)?;
    let down =
        super::preflight::check_peers(&chain, super::preflight::PEER_CONNECT_TIMEOUT, args.require_peers)?;
    for peer in down {
        eprintln!("kvtier: warning: {peer}");
    }
    if let Some(addr) = args.metrics_addr {
        crate::metrics_endpoint::serve(addr)?;
    }
    let workload = match &args.trace {
        Some(path) => Workload::from_trace(path, args.seed)?,
        None => {
            let mut spec = WorkloadSpec::new(args.workload, args.requests, args.seed);
            spec.rate = args.rate;
            Workload::generate(&spec)
        }
    };
    let mut cfg = SimConfig {
        chunk_bytes: args.chunk_bytes,
        tokens_per_chunk: args.tokens_per_chunk,
        device_blocks: args.device_blocks,
        step_base: Duration::from_micros(args.step_us),
        prefill_per_token: Duration::from_nanos(args.prefill_ns_per_token),
        compare_baseline: !args.no_baseline,
        async_scheduling: !args.sync_scheduling,
        recompute_cost: args.cost_model,
        ..SimConfig::default()
    };
    if let Some(name) = &args.model {
        let profile =
            super::profile::ModelProfile::named(name).map_err(|e| anyhow::anyhow!("--model: {e}"))?;
        cfg = cfg.with_model(profile);
    }
    if args.nodes != 1 {
        return run_nodes_and_report(args, chain, &cfg, &workload);
    }
    let report = run_simulation(&config_chain(chain, registry()?), &cfg, &workload);
    if args.config.is_none() {
        remove_default_scratch();
    }
    let report = report?;
    println!("{report}");
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).context("serialising the report")?;
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if args.metrics_hold > 0 {
        eprintln!("serving the final metrics for {} s", args.metrics_hold);
        std::thread::sleep(Duration::from_secs(args.metrics_hold));
    }
    if !report.identities_hold() {
        anyhow::bail!("the report's consistency identities do not hold (see above)");
    }
    Ok(())
}

/// `run --nodes N`: the nodes' report (and `--json`).
fn run_nodes_and_report(
    args: &RunArgs,
    chain: ChainConfig,
    cfg: &SimConfig,
    workload: &Workload,
) -> Result<()> {
    if !chain.secondaries.iter().any(|s| s.tier_type == "redis") {
        anyhow::bail!(
            "{}: --nodes {} needs a tier the nodes share (type = \"redis\"); each node would only \
             see its own chunks",
            chain.source,
            args.nodes
        );
    }
    let report = super::run_nodes(&config_chain(chain, registry()?), cfg, workload, args.nodes)?;
    println!("{report}");
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report).context("serialising the report")?;
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if !report.identities_hold() {
        anyhow::bail!("the report's consistency identities do not hold (see above)");
    }
    Ok(())
}

/// The embedded default chain keeps its disk slabs in a per-process directory under the system
/// temporary directory; nothing else will ever reopen it, so it goes when the run ends.
pub fn remove_default_scratch() {
    let dir = std::env::temp_dir().join(format!("kvtier-{}", std::process::id()));
    if dir.exists()
        && let Err(e) = std::fs::remove_dir_all(&dir)
    {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the default chain's scratch directory");
    }
}
