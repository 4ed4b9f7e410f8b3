//! `kvtier peer`: one node of a multi-process P2P setup. A producer node stores synthetic
//! chunks and serves them to peers until its time is up; a consumer node pulls the same chunks
//! (the same keys follow from the same `--seed`) from a producer, verifies every byte, and exits
//! non-zero if any chunk is missing or wrong.

use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tiering_core::config::ChainConfig;
use tiering_core::{LookupResult, OffloadKey, OffloadingManager, ReqContext, RequestId, ScheduleEndContext};

use crate::sim::command::registry;
use crate::sim::{Chain, ChainFactory, chunk_matches, config_chain, fill_chunk};

/// Options of `kvtier peer`.
#[derive(clap::Args, Debug, Clone)]
pub struct PeerArgs {
    /// This node's tier chain: a primary plus a `p2p` tier (a producer wants a fixed `bind`
    /// port so consumers know where to find it).
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Bytes per chunk; must be equal on every node (the handshake checks it).
    #[arg(long, default_value_t = 64 * 1024, value_name = "BYTES")]
    pub chunk_bytes: usize,
    /// How many chunks to store (producer) or pull (consumer).
    #[arg(long, default_value_t = 16)]
    pub chunks: usize,
    /// Seed of the chunk keys: a consumer pulls what a producer with the same seed stored.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Pull from the producer at `HOST:PORT` (its p2p `bind` address) instead of serving.
    #[arg(long, value_name = "HOST:PORT")]
    pub pull_from: Option<String>,
    /// Producer: serve for this many seconds, then shut down.
    #[arg(long, default_value_t = 60)]
    pub serve_secs: u64,
    /// Consumer: give up on the pull after this many seconds.
    #[arg(long, default_value_t = 20)]
    pub timeout_secs: u64,
    /// Serve Prometheus metrics (names prefixed `kvtier_`) over HTTP at this address.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

fn keys(seed: u64, n: usize) -> Vec<OffloadKey> {
    (0..n as u64)
        .map(|i| OffloadKey::from_u64(seed.wrapping_mul(1_000_003).wrapping_add(i)))
        .collect()
}

fn end() -> ScheduleEndContext {
    ScheduleEndContext::default()
}

/// Runs `kvtier peer`.
///
/// # Errors
/// An invalid chain, a producer that cannot store its chunks, an unreachable producer, or a pull
/// that misses, times out or brings wrong bytes.
pub fn peer_command(args: &PeerArgs) -> Result<()> {
    if args.chunks == 0 {
        bail!("--chunks must be at least 1");
    }
    let config = ChainConfig::load(&args.config)?;
    if !config.secondaries.iter().any(|s| s.tier_type == "p2p") {
        bail!(
            "{}: the chain has no p2p tier, so this node cannot talk to peers",
            config.source
        );
    }
    if let Some(addr) = args.metrics_addr {
        crate::metrics_endpoint::serve(addr)?;
    }
    let chain = config_chain(config, registry()?)
        .build(args.chunk_bytes)
        .map_err(|e| anyhow::anyhow!(e))
        .context("building the node's tier chain")?;
    match &args.pull_from {
        None => produce(chain, args),
        Some(addr) => consume(chain, args, addr),
    }
}

fn produce(mut chain: Chain, args: &PeerArgs) -> Result<()> {
    let m = &mut chain.manager;
    let ctx = ReqContext::local("kvtier-peer-store");
    let keys = keys(args.seed, args.chunks);
    {
        let mut step = m.step();
        step.on_new_request(&ctx)?;
        let out = step
            .prepare_store(&keys, &ctx)?
            .context("the primary tier has no room for the chunks to serve")?;
        for (k, &row) in out.keys_to_store.iter().zip(&out.chunk_ids) {
            fill_chunk(k, &mut chain.arena.write_row(row)?);
        }
        if !out.keys_to_store.is_empty() {
            step.complete_store(&out.keys_to_store, &ctx, true)?;
        }
        step.on_request_finished(&ctx)?;
        step.on_schedule_end(&end())?;
    }
    println!(
        "kvtier peer: serving {} chunks of {} bytes (seed {}) for {} s",
        args.chunks, args.chunk_bytes, args.seed, args.serve_secs
    );
    let deadline = Instant::now() + Duration::from_secs(args.serve_secs);
    // An idle engine: it steps now and then; peers are served by the control-plane thread.
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        m.step().on_schedule_end(&end())?;
    }
    m.shutdown()?;
    Ok(())
}

fn consume(mut chain: Chain, args: &PeerArgs, addr: &str) -> Result<()> {
    let (host, port) = addr
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
        .with_context(|| format!("--pull-from {addr}: expected HOST:PORT"))?;
    let reachable = addr
        .to_socket_addrs()
        .with_context(|| format!("--pull-from {addr}: cannot resolve it"))?
        .any(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok());
    if !reachable {
        bail!("producer {addr} is unreachable (nothing accepts connections there)");
    }
    let m = &mut chain.manager;
    let keys = keys(args.seed, args.chunks);
    let mut params = serde_json::Map::new();
    params.insert(
        "remote_kv_source".into(),
        serde_json::json!({ "kv_request_id": "kvtier-peer-pull", "host": host, "port": port }),
    );
    let ctx = ReqContext::builder(RequestId::local("kvtier-peer-pull"))
        .params(params)
        .build();
    m.step().on_new_request(&ctx)?;
    let start = Instant::now();
    let timeout = Duration::from_secs(args.timeout_secs);
    let wrong = loop {
        // One engine step: look every chunk up; once all are primary hits, load them within
        // the same step (a hit is only guaranteed resident until the step ends).
        let mut step = m.step();
        let mut all_hit = true;
        for k in &keys {
            match step.lookup(k, &ctx)? {
                LookupResult::Hit => {}
                LookupResult::HitPending | LookupResult::Retry => all_hit = false,
                LookupResult::Miss => {
                    step.on_request_finished(&ctx)?;
                    step.on_schedule_end(&end())?;
                    bail!("producer {addr} does not hold chunk {k} (same --seed and --chunks?)");
                }
            }
        }
        if all_hit {
            let rows = step.prepare_load(&keys, &ctx)?;
            let wrong = keys
                .iter()
                .zip(&rows)
                .filter(|&(k, &row)| chain.arena.read_row(row).map_or(true, |r| !chunk_matches(k, &r)))
                .count();
            step.complete_load(&keys, &ctx)?;
            step.on_request_finished(&ctx)?;
            step.on_schedule_end(&end())?;
            break wrong;
        }
        step.on_schedule_end(&end())?;
        drop(step);
        if start.elapsed() > timeout {
            bail!("the pull from {addr} did not complete within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    m.shutdown()?;
    if wrong > 0 {
        bail!(
            "{wrong} of {} chunks pulled from {addr} have wrong bytes",
            keys.len()
        );
    }
    println!(
        "kvtier peer: pulled {} chunks from {addr} in {:.1} ms; every byte verified",
        keys.len(),
        start.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}
