//! Subcommands: `tiers`, `check`, `peer`, `redis`, and the simulator's `run` and `bench`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use tiering_config::ChainConfig;
use tiering_core::registry::Registry;
use tiering_plugin::{BUILD_FINGERPRINT, load_library};

/// The chain `kvtier run` uses without `--config`.
pub const DEFAULT_CHAIN: &str = include_str!("../config/default.toml");

/// Name under which errors refer to the embedded default chain.
const DEFAULT_CHAIN_NAME: &str = "config/default.toml (embedded)";

/// What `--help` says about logs and scratch space.
const LOGGING_HELP: &str = "\
Logging: diagnostics go to stderr through `tracing`; RUST_LOG sets the filter (default `warn`),
e.g. RUST_LOG=info shows disk recovery at open and per-tier summaries, RUST_LOG=tiering_core=debug
the manager's decisions. Colour is used only when stderr is a terminal.

Scratch: `${tmpdir}/kvtier-${pid}` (what the shipped chains use for disk slabs) is removed when
the command ends, on an error, SIGINT or SIGTERM; scratch of killed processes is reclaimed at the
next start. A relative tier `path` is relative to the chain file's directory.

Traces (`kvtier run --trace FILE`): JSONL, one request per line, e.g.
  {\"arrival\": 0.0, \"session\": \"alice\", \"prefix\": \"sys\", \"prefix_tokens\": 512, \"tokens\": 120, \"output\": 40}
`arrival` (seconds, non-decreasing) is required; `session` continues a conversation; `prefix`
names a shared prefix of `prefix_tokens` tokens; `tokens` (a count) or `token_ids` (a list) are
the new prompt tokens; `output` is the generated length (default 16). `#` lines are comments.";

#[derive(Parser)]
#[command(
    name = "kvtier",
    version,
    about = "Tiered KV-cache offloading: tier chains, simulator, benchmarks",
    after_help = LOGGING_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the tier types this binary knows, and where each comes from.
    Tiers {
        /// Also describe these tier libraries (loading them).
        #[arg(long = "library", value_name = "PATH")]
        libraries: Vec<PathBuf>,
    },
    /// Validate tier chain files and print the resolved chains.
    ///
    /// Reports every error (unknown
    /// types and option keys, bad values, zero or oversized capacities, duplicate names and
    /// paths) with file:line:key, without allocating, creating files or binding sockets.
    Check {
        /// Chain files.
        #[arg(required = true, value_name = "CONFIG")]
        configs: Vec<PathBuf>,
        /// Also construct every tier (with chunks of `--chunk-bytes`) and shut it down again.
        /// Tiers may create files (a disk tier its slabs); scratch under
        /// `${tmpdir}/kvtier-${pid}` is removed when the command ends.
        #[arg(long)]
        build: bool,
        /// Chunk size for `--build` (the same default as `kvtier run`).
        #[arg(long, default_value_t = kvtier::sim::SimConfig::default().chunk_bytes, value_name = "BYTES")]
        chunk_bytes: usize,
    },
    /// Run the engine simulator over a tier chain and report what offloading saved.
    Run(kvtier::sim::RunArgs),
    /// One node of a multi-process P2P setup: serve synthetic chunks, or pull them from a peer.
    #[command(after_help = kvtier::peer::EXIT_CODES_HELP)]
    Peer(kvtier::peer::PeerArgs),
    /// Operator commands for a shared Redis tier (`invalidate` a namespace).
    Redis {
        #[command(subcommand)]
        cmd: kvtier::redis_admin::RedisCommand,
    },
    /// Benchmarks, each next to its physical reference measured in the same run.
    Bench {
        #[command(subcommand)]
        bench: kvtier::bench::BenchCommand,
    },
    /// Chaos soak: two simulated nodes over cpu + disk + redis + p2p while seeded faults hit
    /// them; checks that nothing is lost or served wrong, and exits non-zero on any violation.
    Soak(kvtier::soak::SoakArgs),
    /// The peer node of `kvtier soak` (started by it, not by hand).
    #[command(hide = true)]
    SoakNode(kvtier::soak::NodeArgs),
    /// A copy worker process of `bench fetch-rtt --workers-process` (started by it, not by hand).
    #[command(hide = true)]
    BenchCopyWorker(kvtier::bench::CopyWorkerArgs),
}

/// Entry point of the binary: runs the command and reports errors with their causes.
pub fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    // Removes `${tmpdir}/kvtier-${pid}` on return, error, SIGINT and SIGTERM; reclaims the
    // scratch of dead processes first. Dropped after the command (and its tiers) are done.
    let _scratch = kvtier::scratch::ScratchGuard::install();
    let result = match cli.command {
        Command::Tiers { libraries } => tiers(&libraries),
        Command::Check {
            configs,
            build,
            chunk_bytes,
        } => check(&configs, build, chunk_bytes),
        Command::Run(args) => kvtier::sim::run_command(&args, DEFAULT_CHAIN_NAME, DEFAULT_CHAIN),
        Command::Peer(args) => kvtier::peer::peer_command(&args),
        Command::Redis { cmd } => kvtier::redis_admin::run_command(&cmd),
        Command::Bench { bench } => kvtier::bench::run_command(&bench, DEFAULT_CHAIN_NAME, DEFAULT_CHAIN),
        Command::BenchCopyWorker(args) => kvtier::bench::copy_worker(&args),
        Command::Soak(args) => kvtier::soak::soak_command(&args),
        Command::SoakNode(args) => kvtier::soak::node_command(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvtier: {e:#}");
            // `kvtier peer` failures have their own codes (`kvtier peer --help`).
            e.downcast_ref::<kvtier::peer::PeerExit>()
                .map_or(ExitCode::FAILURE, |p| ExitCode::from(p.code()))
        }
    }
}

/// The registry `run` uses too: every linked registration, plus the simulator's fallbacks.
fn registry() -> Result<&'static Registry> {
    kvtier::sim::command::registry()
}

fn tiers(libraries: &[PathBuf]) -> Result<()> {
    let registry = registry()?;
    println!("{:<16} {:<10} SOURCE", "TYPE", "ROLE");
    for reg in registry.iter() {
        println!(
            "{:<16} {:<10} linked in (crate {})",
            reg.name,
            reg.factory.role(),
            reg.crate_name
        );
    }
    for path in libraries {
        let lib = load_library(path).with_context(|| format!("cannot describe {}", path.display()))?;
        println!(
            "{:<16} {:<10} library {} (tiering-core {}; built as `{}`{})",
            lib.type_name(),
            "secondary",
            path.display(),
            lib.core_version(),
            lib.fingerprint(),
            if lib.same_build_as_host() {
                "; same build as this binary"
            } else {
                ""
            }
        );
    }
    if registry.is_empty() && libraries.is_empty() {
        println!("(no tier types registered)");
    }
    println!(
        "medium and locality (what request tier filters match) are declared by each tier when built \
         (cpu: CPU/LOCAL, disk: STORAGE/LOCAL, redis: STORAGE/REMOTE, p2p: CPU/REMOTE); a chain's \
         `medium` / `locality` keys override them; `kvtier check --build` prints them"
    );
    println!("host build: {BUILD_FINGERPRINT}");
    Ok(())
}

fn check(configs: &[PathBuf], build: bool, chunk_bytes: usize) -> Result<()> {
    let registry = registry()?;
    let mut failed = 0usize;
    for path in configs {
        match check_one(registry, path, build, chunk_bytes) {
            Ok(text) => println!("{text}\n  ok\n"),
            Err(e) => {
                failed += 1;
                eprintln!("{e:#}\n");
            }
        }
    }
    if failed > 0 {
        bail!("{failed} of {} chain files failed validation", configs.len());
    }
    Ok(())
}

fn check_one(registry: &Registry, path: &Path, build: bool, chunk_bytes: usize) -> Result<String> {
    let chain = ChainConfig::load(path)?;
    let kvtier::check::ChainCheck { errors, unchecked } = kvtier::check::check_chain(&chain, registry, build);
    for note in &unchecked {
        eprintln!("note: {note}");
    }
    if !errors.is_empty() {
        let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
        bail!(
            "{}\n{}: {} error(s)",
            lines.join("\n"),
            path.display(),
            errors.len()
        );
    }
    let resolved = chain.resolve(registry)?;
    let mut text = resolved.to_string();
    if build {
        let mut manager = resolved.build(chunk_bytes)?;
        // What request tier filters match: each type's declaration, or the chain's override.
        for info in manager.inspect(|s| s.secondary_infos()) {
            text.push_str(&format!(
                "\n  built: {} — medium {}, locality {}",
                info.name,
                info.medium
                    .map_or("any".to_owned(), |m| format!("{m:?}").to_uppercase()),
                info.locality
                    .map_or("any".to_owned(), |l| format!("{l:?}").to_uppercase()),
            ));
        }
        manager
            .shutdown()
            .with_context(|| format!("{}: shutting the built chain down", path.display()))?;
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_default_chain_parses() {
        let c = ChainConfig::parse(DEFAULT_CHAIN_NAME, DEFAULT_CHAIN).unwrap();
        assert_eq!(c.primary.tier_type, "cpu");
        assert_eq!(c.secondaries.len(), 1);
        assert_eq!(c.secondaries[0].tier_type, "disk");
        let path = c.secondaries[0].options["path"].as_str().unwrap();
        assert!(
            path.starts_with(&*std::env::temp_dir().to_string_lossy()),
            "{path}"
        );
    }
}
