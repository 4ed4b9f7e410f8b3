//! `kvtier redis …`: operator commands for a shared Redis tier.
//!
//! `kvtier redis invalidate` deletes every chunk of a namespace (all layouts) — after a model
//! or weights update that keeps the chunk layout, so no engine loads stale KV. The server comes
//! from a chain file's `redis` tier (`--config`) or from `--url`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use tier_redis::{RedisTierOptions, invalidate_namespace};
use tiering_config::ChainConfig;
use tiering_core::options::parse_options;

/// `kvtier redis …` subcommands.
#[derive(Clone, Debug, clap::Subcommand)]
pub enum RedisCommand {
    /// Delete every chunk of a namespace (SCAN + UNLINK in batches, on every master).
    Invalidate(InvalidateArgs),
}

/// Where the server is and which namespace to delete.
#[derive(Clone, Debug, clap::Args)]
pub struct InvalidateArgs {
    /// A chain file with a `redis` tier: its server, credentials and (unless `--namespace`)
    /// namespace.
    #[arg(
        long,
        value_name = "CHAIN",
        conflicts_with = "url",
        required_unless_present = "url"
    )]
    pub config: Option<PathBuf>,
    /// The server instead of a chain file (`redis://host:port`); repeat for cluster seeds.
    #[arg(long, value_name = "URL")]
    pub url: Vec<String>,
    /// With `--url`: the servers form a Redis Cluster.
    #[arg(long, requires = "url")]
    pub cluster: bool,
    /// With `--url`: the environment variable holding the password.
    #[arg(long, value_name = "VAR", requires = "url")]
    pub password_env: Option<String>,
    /// The namespace to delete (required with `--url`).
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
}

/// The options of the first `redis` tier of the chain at `path`.
fn chain_options(path: &Path) -> Result<RedisTierOptions> {
    let chain = ChainConfig::load(path)?;
    let Some(spec) = chain.secondaries.iter().find(|s| s.tier_type == "redis") else {
        bail!("{}: the chain has no `type = \"redis\"` tier", path.display());
    };
    parse_options(&spec.options).with_context(|| format!("{}: {}", chain.source, spec.describe()))
}

/// Runs a `kvtier redis` subcommand.
///
/// # Errors
/// Bad arguments or chain, or a server that cannot be reached or fails.
pub fn run_command(cmd: &RedisCommand) -> Result<()> {
    match cmd {
        RedisCommand::Invalidate(args) => {
            let (opts, namespace) = match &args.config {
                Some(path) => {
                    let opts = chain_options(path)?;
                    let ns = args.namespace.clone().unwrap_or_else(|| opts.namespace.clone());
                    (opts, ns)
                }
                None => {
                    let Some(ns) = args.namespace.clone() else {
                        bail!("--namespace is required with --url");
                    };
                    let mut opts = RedisTierOptions::new(String::new());
                    if args.url.len() == 1 && !args.cluster {
                        opts.url = args.url.first().cloned();
                    } else {
                        opts.url = None;
                        opts.urls.clone_from(&args.url);
                    }
                    opts.cluster = args.cluster;
                    opts.password_env.clone_from(&args.password_env);
                    (opts, ns)
                }
            };
            let deleted = invalidate_namespace(&opts, &namespace)
                .with_context(|| format!("invalidating namespace `{namespace}`"))?;
            println!("deleted {deleted} keys of namespace `{namespace}`");
            Ok(())
        }
    }
}
