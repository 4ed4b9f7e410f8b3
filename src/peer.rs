//! `kvtier peer`: one node of a multi-process P2P setup. A producer node stores synthetic
//! chunks and serves them to peers until its time is up; a consumer node pulls the same chunks
//! (the same keys follow from the same `--seed`) from a producer, verifies every byte, and exits
//! with a code that says what went wrong (see [`PeerExit`]).

use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tier_p2p::{P2pHandle, P2pTier, P2pTierOptions, PeerFailure, canonical_peer};
use tiering_config::ChainConfig;
use tiering_core::options::parse_options;
use tiering_core::{
    LookupResult, OffloadKey, OffloadingManager, ReqContext, RequestId, ScheduleEndContext, SecondaryTier,
};

use crate::sim::command::registry;
use crate::sim::{BuiltTiers, Chain, chunk_matches, fill_chunk};

/// What `kvtier peer --help` says about its exit codes (kept next to [`PeerExit::code`]).
pub const EXIT_CODES_HELP: &str = "\
Exit codes of a consumer (`--pull-from`):
   0  every chunk pulled and verified
   1  any other error (a bad chain or value, a tier that cannot be built)
   2  a command-line usage error
  10  the producer is unreachable (name does not resolve, nothing accepts connections, or no
      handshake answer before the deadline)
  11  the producer refused the handshake; its reason is printed (version, chunk size, layout
      fingerprint, hash seed, or authentication: another secret)
  12  the producer died or the connection broke mid-transfer
  13  the pull did not complete within --timeout-secs, or the peer missed its deadline
  14  the producer does not hold a requested chunk (another --seed, or fewer --chunks; chunk
      sizes cannot differ past the handshake, which would be code 11)
  15  chunks arrived with wrong bytes";

/// Why a consumer's pull failed: each case has its own exit code (see [`EXIT_CODES_HELP`]).
#[derive(Debug, thiserror::Error)]
pub enum PeerExit {
    /// The producer cannot be reached.
    #[error("producer {peer} is unreachable: {reason}")]
    Unreachable {
        /// The address as given.
        peer: String,
        /// What failed.
        reason: String,
    },
    /// The producer (or this node) refused the handshake.
    #[error("handshake with producer {peer} refused: {reason}")]
    HandshakeRefused {
        /// The address as given.
        peer: String,
        /// The refusing side's reason.
        reason: String,
    },
    /// The producer went away while chunks were in flight.
    #[error("producer {peer} died mid-transfer: {reason}")]
    ProducerDied {
        /// The address as given.
        peer: String,
        /// What was seen.
        reason: String,
    },
    /// Time ran out.
    #[error("the pull from {peer} exceeded its deadline: {what}")]
    Deadline {
        /// The address as given.
        peer: String,
        /// Which deadline.
        what: String,
    },
    /// The producer answered but does not hold a requested chunk.
    #[error("producer {peer} does not hold chunk {key}: {cause}")]
    NotHeld {
        /// The address as given.
        peer: String,
        /// The first missing chunk.
        key: OffloadKey,
        /// The likely cause, from how many chunks were held.
        cause: String,
    },
    /// Some pulled chunks do not match what the producer stored.
    #[error("{wrong} of {total} chunks pulled from {peer} have wrong bytes")]
    WrongBytes {
        /// The address as given.
        peer: String,
        /// Chunks that failed verification.
        wrong: usize,
        /// Chunks pulled.
        total: usize,
    },
}

impl PeerExit {
    /// The process exit code of this failure.
    #[must_use]
    pub fn code(&self) -> u8 {
        match self {
            Self::Unreachable { .. } => 10,
            Self::HandshakeRefused { .. } => 11,
            Self::ProducerDied { .. } => 12,
            Self::Deadline { .. } => 13,
            Self::NotHeld { .. } => 14,
            Self::WrongBytes { .. } => 15,
        }
    }

    /// The exit for a failure the p2p tier recorded toward the producer `peer` (as given).
    #[must_use]
    pub fn from_failure(peer: &str, failure: &PeerFailure) -> Self {
        let peer = peer.to_owned();
        match failure {
            PeerFailure::Unreachable { reason, .. } => Self::Unreachable {
                peer,
                reason: reason.clone(),
            },
            PeerFailure::HandshakeRefused { reason, .. } => Self::HandshakeRefused {
                peer,
                reason: reason.clone(),
            },
            PeerFailure::ProducerDied { reason, .. } => Self::ProducerDied {
                peer,
                reason: reason.clone(),
            },
            PeerFailure::Deadline { what, .. } => Self::Deadline {
                peer,
                what: format!("the producer missed its {what} deadline"),
            },
        }
    }
}

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
    /// Pull from the producer at `HOST:PORT` (its p2p `bind` address; a host name such as
    /// `localhost` is resolved) instead of serving.
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
    /// Producer, fault injection for tests: stop sending after this many chunks (and print a
    /// line saying so), as a producer that hangs mid-transfer would.
    #[arg(long, hide = true, value_name = "N")]
    pub hold_after_chunks: Option<u64>,
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
/// An invalid chain or a producer that cannot store its chunks (plain errors), or a consumer
/// failure as a [`PeerExit`] (the binary turns it into its exit code).
pub fn peer_command(args: &PeerArgs) -> Result<()> {
    if args.chunks == 0 {
        bail!("--chunks must be at least 1");
    }
    let config = ChainConfig::load(&args.config)?;
    if let Some(addr) = args.metrics_addr {
        crate::metrics_endpoint::serve(addr)?;
    }
    let (chain, handle) = build_node(&config, args.chunk_bytes)?;
    match &args.pull_from {
        None => produce(chain, &handle, args),
        Some(addr) => consume(chain, &handle, args, addr),
    }
}

/// Builds the chain of `config` with its (first) p2p tier constructed here, so this command
/// keeps the tier's [`P2pHandle`] (its failure log) after the manager took the tier.
fn build_node(config: &ChainConfig, chunk_bytes: usize) -> Result<(Chain, P2pHandle)> {
    let Some(at) = config.secondaries.iter().position(|s| s.tier_type == "p2p") else {
        bail!(
            "{}: the chain has no p2p tier, so this node cannot talk to peers",
            config.source
        );
    };
    let spec = &config.secondaries[at];
    let mut rest = config.clone();
    rest.secondaries.remove(at);
    let mut tiers = BuiltTiers::from_config(&rest, registry()?, chunk_bytes)
        .map_err(|e| anyhow::anyhow!(e))
        .context("building the node's tier chain")?;
    let located =
        |e: &dyn std::fmt::Display| format!("{}:{}: {}: {e}", config.source, spec.line, spec.describe());
    let options: P2pTierOptions = parse_options(&spec.options).map_err(|e| anyhow::anyhow!(located(&e)))?;
    let mut p2p = match P2pTier::new(options, tiers.primary.arena()) {
        Ok(t) => t,
        Err(e) => {
            let message = located(&e);
            for t in tiers.secondaries.iter_mut().rev() {
                let _ = t.shutdown();
            }
            bail!(message);
        }
    };
    p2p.set_waker(tiers.waker.clone());
    let handle = p2p.handle();
    tiers.secondaries.insert(at, Box::new(p2p));
    Ok((tiers.into_chain(), handle))
}

fn produce(mut chain: Chain, handle: &P2pHandle, args: &PeerArgs) -> Result<()> {
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
    if let Some(n) = args.hold_after_chunks {
        handle.faults().hold_after_chunks(n);
    }
    println!(
        "kvtier peer: serving {} chunks of {} bytes (seed {}) for {} s",
        args.chunks, args.chunk_bytes, args.seed, args.serve_secs
    );
    let deadline = Instant::now() + Duration::from_secs(args.serve_secs);
    let mut told_holding = false;
    // An idle engine: it steps now and then; peers are served by the control-plane thread.
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        m.step().on_schedule_end(&end())?;
        if !told_holding && handle.faults().is_holding() {
            told_holding = true;
            println!("kvtier peer: holding mid-transfer (--hold-after-chunks)");
        }
    }
    handle.faults().release();
    m.shutdown()?;
    Ok(())
}

/// The first address `addr` resolves to that accepts a TCP connection.
fn probe(addr: &str) -> Result<(), PeerExit> {
    let unreachable = |reason: String| PeerExit::Unreachable {
        peer: addr.to_owned(),
        reason,
    };
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| unreachable(format!("the name does not resolve ({e})")))?
        .collect();
    let mut last = String::from("it resolves to no address");
    for a in &addrs {
        match TcpStream::connect_timeout(a, Duration::from_secs(2)) {
            Ok(_) => return Ok(()),
            Err(e) => last = format!("{a}: {e}"),
        }
    }
    Err(unreachable(last))
}

fn consume(mut chain: Chain, handle: &P2pHandle, args: &PeerArgs, addr: &str) -> Result<()> {
    let (host, port) = addr
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
        .with_context(|| format!("--pull-from {addr}: expected HOST:PORT"))?;
    let canonical = canonical_peer(addr).map_err(|reason| PeerExit::Unreachable {
        peer: addr.to_owned(),
        reason,
    })?;
    probe(addr)?;
    // What the tier recorded toward this producer, if anything, as this command's exit.
    let failure = || {
        handle
            .peer_failure(&canonical)
            .map(|f| PeerExit::from_failure(addr, &f))
    };
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
    let (pulled_in, wrong) = loop {
        // One engine step: look every chunk up; once all are primary hits, load them within
        // the same step (a hit is only guaranteed resident until the step ends).
        let mut step = m.step();
        let (mut hits, mut pending, mut missing) = (0usize, 0usize, None);
        for k in &keys {
            match step.lookup(k, &ctx)? {
                LookupResult::Hit => hits += 1,
                LookupResult::HitPending | LookupResult::Retry => pending += 1,
                LookupResult::Miss => {
                    missing.get_or_insert(*k);
                }
            }
        }
        if let Some(key) = missing {
            step.on_request_finished(&ctx)?;
            step.on_schedule_end(&end())?;
            drop(step);
            let exit = failure().unwrap_or_else(|| not_held(addr, key, hits + pending, keys.len()));
            let _ = m.shutdown();
            return Err(exit.into());
        }
        if pending == 0 {
            let pulled_in = start.elapsed();
            let rows = step.prepare_load(&keys, &ctx)?;
            let wrong = keys
                .iter()
                .zip(&rows)
                .filter(|&(k, &row)| chain.arena.read_row(row).map_or(true, |r| !chunk_matches(k, &r)))
                .count();
            step.complete_load(&keys, &ctx)?;
            step.on_request_finished(&ctx)?;
            step.on_schedule_end(&end())?;
            break (pulled_in, wrong);
        }
        step.on_schedule_end(&end())?;
        drop(step);
        if start.elapsed() > timeout {
            let exit = failure().unwrap_or_else(|| PeerExit::Deadline {
                peer: addr.to_owned(),
                what: format!(
                    "{hits} of {} chunks arrived within --timeout-secs {}",
                    keys.len(),
                    args.timeout_secs
                ),
            });
            let _ = m.step().on_request_finished(&ctx);
            let _ = m.shutdown();
            return Err(exit.into());
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    m.shutdown()?;
    if wrong > 0 {
        return Err(PeerExit::WrongBytes {
            peer: addr.to_owned(),
            wrong,
            total: keys.len(),
        }
        .into());
    }
    println!(
        "kvtier peer: pulled {} chunks from {addr} in {:.1} ms; every byte verified",
        keys.len(),
        pulled_in.as_secs_f64() * 1e3
    );
    Ok(())
}

/// A chunk the producer answered "not held" for, with the likely cause: the handshake already
/// proved equal chunk sizes, so a producer holding none of the keys was started with another
/// `--seed`, and one holding some of them with fewer `--chunks`.
fn not_held(addr: &str, key: OffloadKey, held: usize, asked: usize) -> PeerExit {
    let cause = if held == 0 {
        "it holds none of the requested chunks: it was started with another --seed (chunk sizes \
         match, the handshake checked them)"
            .to_owned()
    } else {
        format!("it holds only {held} of the {asked} requested chunks: it was started with fewer --chunks")
    };
    PeerExit::NotHeld {
        peer: addr.to_owned(),
        key,
        cause,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_has_its_own_documented_code() {
        let p = || "h:1".to_owned();
        let exits = [
            PeerExit::Unreachable {
                peer: p(),
                reason: String::new(),
            },
            PeerExit::HandshakeRefused {
                peer: p(),
                reason: String::new(),
            },
            PeerExit::ProducerDied {
                peer: p(),
                reason: String::new(),
            },
            PeerExit::Deadline {
                peer: p(),
                what: String::new(),
            },
            not_held("h:1", OffloadKey::from_u64(1), 0, 4),
            PeerExit::WrongBytes {
                peer: p(),
                wrong: 1,
                total: 2,
            },
        ];
        let mut codes: Vec<u8> = exits.iter().map(PeerExit::code).collect();
        for c in &codes {
            assert!(
                EXIT_CODES_HELP.contains(&format!("  {c}  ")),
                "code {c} undocumented"
            );
        }
        codes.dedup();
        assert_eq!(codes.len(), exits.len());
        assert!(
            codes.iter().all(|&c| c > 2),
            "0-2 are success, generic and usage errors"
        );
    }

    #[test]
    fn tier_failures_map_to_their_exit_and_keep_the_reason() {
        let f = PeerFailure::HandshakeRefused {
            peer: "127.0.0.1:5".into(),
            reason: "chunk size 4096 bytes".into(),
        };
        let e = PeerExit::from_failure("localhost:5", &f);
        assert_eq!(e.code(), 11);
        let m = e.to_string();
        assert!(m.contains("localhost:5") && m.contains("chunk size 4096"), "{m}");
        let d = PeerExit::from_failure(
            "x:1",
            &PeerFailure::Deadline {
                peer: "x:1".into(),
                what: "load",
            },
        );
        assert_eq!(d.code(), 13);
        assert!(
            not_held("x:1", OffloadKey::from_u64(3), 2, 4)
                .to_string()
                .contains("fewer --chunks")
        );
        assert!(
            not_held("x:1", OffloadKey::from_u64(3), 0, 4)
                .to_string()
                .contains("--seed")
        );
    }
}
