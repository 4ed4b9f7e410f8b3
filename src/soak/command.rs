//! The `kvtier soak` command and the peer node's process (`kvtier soak-node`).
//!
//! Layout of one soak (everything on 127.0.0.1, everything under `${tmpdir}/kvtier-soak-${pid}-${n}`):
//!
//! ```text
//!  this process (node A)                        kvtier soak-node (node B, restarted at will)
//!  sim engine → cpu → disk → redis → p2p  ⇄ p2p  ← redis ← disk ← cpu ← sim engine
//!                      │        │                        │        │
//!          tmpfs disk/a         └── redis-server (ours) ──┘        tmpfs disk/b
//! ```
//!
//! Both nodes run the same seeded workloads round after round (every request names the other
//! node as its `remote_kv_source`), so each finds the other's chunks in Redis and over p2p.
//! Before the soak this process runs the round workloads once with offloading off: the TTFT
//! reference. Faults are injected in the middle 70 % of the soak (the last 15 % is quiet, so
//! the end is measured on a recovered system); RSS and descriptors are sampled at the start,
//! after the first quarter (the warm-up) and at the end.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use parking_lot::Mutex;
use tiering_config::ChainConfig;
use tiering_core::{KeySet, TierStats};

use super::checks::{DiskLedger, Growth, ProcSample, SlabAudit, TtftBound, is_mounted, leftovers};
use super::faults::{self, PeerLine, PeerNode, RedisServer, Scratch};
use super::report::{FaultRow, SoakReport};
use super::schedule::{Fault, FaultKind, Schedule};
use crate::sim::{
    Percentiles, RunMetrics, Session, SimConfig, Workload, WorkloadKind, WorkloadSpec, config_chain,
    registry, run_offload_off,
};

/// Bytes per chunk on both nodes.
const CHUNK_BYTES: usize = 16 * 1024;
/// This node's disk tier, MiB.
const DISK_A_MIB: u64 = 24;
/// The peer node's disk tier, MiB.
const DISK_B_MIB: u64 = 12;
/// The tmpfs both disk tiers live on, MiB: room for both slabs and a little more.
const TMPFS_MIB: u64 = 44;
/// Slots corrupted per corruption fault.
const CORRUPT_SLOTS: usize = 4;
/// Model time per prefill token: a model slow enough to recompute (160 µs per 16-token chunk)
/// that loading a chunk from any tier pays off, so every tier serves.
const PREFILL_PER_TOKEN: Duration = Duration::from_micros(10);
/// Distinct round workloads (rounds cycle through them, so later rounds find earlier chunks).
const VARIANTS: u64 = 2;

/// Arguments of `kvtier soak`.
#[derive(Clone, Debug, clap::Args)]
pub struct SoakArgs {
    /// How long the soak runs (after a short offloading-off reference phase): `60s`, `5m`,
    /// `30m`, `1h`, or seconds.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Seed of the workloads and of the fault schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Requests per round (each round is one seeded workload run to completion).
    #[arg(long, default_value_t = 150)]
    pub requests: usize,
    /// Time between faults (default: the fault window over seven, at most 8 s).
    #[arg(long, value_parser = parse_duration)]
    pub fault_gap: Option<Duration>,
    /// TTFT bound: the soak's p99 may be this many times the offloading-off p99 …
    #[arg(long, default_value_t = 3.0)]
    pub ttft_factor: f64,
    /// … plus this many milliseconds.
    #[arg(long, default_value_t = 25.0)]
    pub ttft_slack_ms: f64,
    /// Inject no fault (the checks still run).
    #[arg(long)]
    pub no_faults: bool,
    /// Deliberately serve wrong bytes (flip a byte in every idle arena row after the first
    /// round that ends past 30 % of the run, then run that round's workload again), to see the
    /// checks fail.
    #[arg(long, hide = true)]
    pub inject_wrong_bytes: bool,
}

/// Arguments of the peer node's process (`kvtier soak-node`, started by `kvtier soak`).
#[derive(Clone, Debug, clap::Args)]
pub struct NodeArgs {
    /// The disk tier's directory.
    #[arg(long)]
    pub disk: PathBuf,
    /// The redis-server's port.
    #[arg(long)]
    pub redis_port: u16,
    /// This node's p2p port.
    #[arg(long)]
    pub bind_port: u16,
    /// The other node's p2p port.
    #[arg(long)]
    pub peer_port: u16,
    /// Seed of the workloads.
    #[arg(long)]
    pub seed: u64,
    /// Requests per round.
    #[arg(long)]
    pub requests: usize,
}

/// A soak's settings (what [`SoakArgs`] parse into, plus where the peer node's binary is).
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// How long the soak runs.
    pub duration: Duration,
    /// Seed.
    pub seed: u64,
    /// Requests per round.
    pub requests: usize,
    /// Time between faults.
    pub fault_gap: Option<Duration>,
    /// The TTFT bound.
    pub ttft: TtftBound,
    /// Inject faults.
    pub faults: bool,
    /// Serve wrong bytes on purpose.
    pub inject_wrong_bytes: bool,
    /// The `kvtier` binary the peer node runs as (`soak-node`).
    pub exe: PathBuf,
}

/// Parses `60s`, `500ms`, `5m`, `1h` or a number of seconds.
///
/// # Errors
/// Anything else.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: f64 = n
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (e.g. 60s, 5m, 1h)"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1e3,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("`{s}`: unknown unit `{unit}` (ms, s, m, h)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{s}`: {e}"))
}

/// Runs `kvtier soak`: prints the summary and fails on any violation.
///
/// # Errors
/// The soak could not be set up, or it found violations.
pub fn soak_command(args: &SoakArgs) -> Result<()> {
    let cfg = SoakConfig {
        duration: args.duration,
        seed: args.seed,
        requests: args.requests,
        fault_gap: args.fault_gap,
        ttft: TtftBound {
            factor: args.ttft_factor,
            slack_ms: args.ttft_slack_ms,
        },
        faults: !args.no_faults,
        inject_wrong_bytes: args.inject_wrong_bytes,
        exe: std::env::current_exe().context("locating the kvtier binary")?,
    };
    let report = run_soak(&cfg)?;
    println!("{report}");
    if !report.violations.is_empty() {
        bail!("the soak found {} violation(s)", report.violations.len());
    }
    Ok(())
}

/// The chain of one node.
fn chain_text(disk: &Path, disk_mib: u64, redis_port: u16, bind_port: u16, peer_port: u16) -> String {
    format!(
        r#"[primary]
type = "cpu"
capacity = "8MiB"
eviction = "lru"

[[secondary]]
type = "disk"
name = "disk"
path = "{disk}"
capacity = "{disk_mib}MiB"
preallocate = false
io_threads = 2

[[secondary]]
type = "redis"
name = "redis"
url = "redis://127.0.0.1:{redis_port}"
namespace = "soak"
layout_fingerprint = "kvtier-soak"
workers = 2

[[secondary]]
type = "p2p"
name = "p2p"
bind = "127.0.0.1:{bind_port}"
peers = ["127.0.0.1:{peer_port}"]
hash_seed = "kvtier-soak"
layout_fingerprint = "kvtier-soak"
insecure = true

[secondary.deadlines]
handshake_ms = 2000

[control_plane]
thread = true
idle_wait = "100ms"
"#,
        disk = disk.display()
    )
}

/// The engine both nodes run.
fn sim_config(remote: Option<String>) -> SimConfig {
    SimConfig {
        chunk_bytes: CHUNK_BYTES,
        compare_baseline: false,
        progress: false,
        verify_loads: true,
        // The engine weighs waiting for a tier against recomputing (a slow or stalled tier
        // costs a request at most about twice the recompute it could save): what keeps TTFT
        // bounded when a tier stops answering.
        recompute_cost: true,
        prefill_per_token: PREFILL_PER_TOKEN,
        // A device pool smaller than a round's working set, so chunks leave it for the tiers.
        device_blocks: 512,
        remote_kv_source: remote,
        ..SimConfig::default()
    }
}

/// The workload of round `round`: one of `VARIANTS` seeded workloads (chat and shared
/// prefixes in turn), its requests named after the round so ids never repeat.
#[must_use]
pub fn round_workload(seed: u64, round: u64, requests: usize) -> Workload {
    workload_of(seed, round, round, requests)
}

/// The workload of round `of`, its requests named after round `round`.
fn workload_of(seed: u64, of: u64, round: u64, requests: usize) -> Workload {
    let variant = of % VARIANTS;
    let kind = if variant % 2 == 0 {
        WorkloadKind::Chat
    } else {
        WorkloadKind::SharedPrefix
    };
    let mut spec = WorkloadSpec::new(kind, requests, seed.wrapping_mul(16).wrapping_add(variant));
    spec.sessions = 40;
    spec.prefixes = 8;
    spec.rate = 40.0;
    let mut w = Workload::generate(&spec);
    for r in &mut w.requests {
        r.name = format!("r{round}-{}", r.name);
    }
    w
}

fn tier<'a>(stats: &'a tiering_core::ManagerStats, name: &str) -> Option<&'a TierStats> {
    stats.secondaries.iter().find(|t| t.name == name)
}

fn extra(t: Option<&TierStats>, key: &str) -> u64 {
    t.and_then(|t| t.extra.get(key)).map_or(0, |v| *v as u64)
}

/// Runs the peer node: rounds until its stdin closes, one JSON line per round on stdout.
///
/// # Errors
/// The chain cannot be built, or a round fails (reported on stdout first).
pub fn node_command(args: &NodeArgs) -> Result<()> {
    let text = chain_text(
        &args.disk,
        DISK_B_MIB,
        args.redis_port,
        args.bind_port,
        args.peer_port,
    );
    let chain = ChainConfig::parse("kvtier soak-node chain", &text)?;
    let cfg = sim_config(Some(format!("127.0.0.1:{}", args.peer_port)));
    let say = |line: &PeerLine| {
        if let Ok(s) = serde_json::to_string(line) {
            println!("{s}");
        }
    };
    let mut session = match Session::start(&config_chain(chain, registry()?), &cfg) {
        Ok(s) => s,
        Err(e) => {
            say(&PeerLine {
                error: Some(format!("building the chain: {e}")),
                ..PeerLine::default()
            });
            return Err(e.into());
        }
    };
    let stats = session.stats()?;
    say(&PeerLine {
        recovered_slots: extra(tier(&stats, "disk"), "recovered_at_open"),
        ..PeerLine::default()
    });
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("kvtier-soak-stdin".into())
            .spawn(move || {
                let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
                stop.store(true, Ordering::SeqCst);
            })?;
    }
    let p2p = session.tiers().iter().position(|t| t == "p2p");
    let mut round = 0;
    while !stop.load(Ordering::SeqCst) {
        let w = round_workload(args.seed, round, args.requests);
        match session.run(&w) {
            Ok(m) => say(&PeerLine {
                round: Some(round),
                requests: m.requests,
                verified_bytes: m.bytes_primary_to_device,
                corrupt_chunks: m.corrupt_chunks,
                wrong_bytes: m.corrupt_chunks * CHUNK_BYTES as u64,
                p2p_tokens: p2p
                    .and_then(|i| m.secondary_tokens.get(i.wrapping_sub(1)).copied())
                    .unwrap_or(0),
                ..PeerLine::default()
            }),
            Err(e) => {
                say(&PeerLine {
                    round: Some(round),
                    error: Some(format!("peer node round {round}: {e}")),
                    ..PeerLine::default()
                });
                return Err(e.into());
            }
        }
        round += 1;
        // Leave the shared cores some air between rounds.
        std::thread::sleep(Duration::from_millis(50));
    }
    session.shutdown()?;
    Ok(())
}

/// What the injector did.
#[derive(Debug, Default)]
struct InjectorLog {
    injected: Vec<(FaultKind, String)>,
    skipped: Vec<(FaultKind, String)>,
    corrupted_keys: KeySet,
    fill_bytes: u64,
    violations: Vec<String>,
}

/// What the injector works on.
struct Targets {
    redis: Arc<Mutex<RedisServer>>,
    peer: Arc<Mutex<PeerNode>>,
    disk_root: PathBuf,
    disk_a: PathBuf,
    mounted: Option<String>,
}

/// Sleeps until `deadline` or until `stop` is set.
fn sleep_until(deadline: Instant, stop: &AtomicBool) {
    while Instant::now() < deadline && !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(20).min(deadline.saturating_duration_since(Instant::now())));
    }
}

fn inject(fault: &Fault, t: &Targets, stop: &AtomicBool, log: &mut InjectorLog) {
    let until = Instant::now() + fault.hold;
    let note = match fault.kind {
        FaultKind::RedisRestart => {
            t.redis.lock().kill();
            sleep_until(until, stop);
            match t.redis.lock().restart() {
                Ok(()) => format!("down {} ms", fault.hold.as_millis()),
                Err(e) => {
                    log.violations
                        .push(format!("redis-server did not come back: {e:#}"));
                    return;
                }
            }
        }
        FaultKind::PeerRestart | FaultKind::NodeKill => {
            let sig = if fault.kind == FaultKind::NodeKill {
                libc::SIGKILL
            } else {
                libc::SIGTERM
            };
            t.peer.lock().kill(sig);
            sleep_until(until, stop);
            if let Err(e) = t.peer.lock().restart() {
                log.violations
                    .push(format!("the peer node did not start again: {e:#}"));
                return;
            }
            format!("down {} ms", fault.hold.as_millis())
        }
        FaultKind::DiskFill => {
            if let Some(why) = &t.mounted {
                log.skipped.push((fault.kind, why.clone()));
                return;
            }
            match faults::fill(&t.disk_root, TMPFS_MIB << 20) {
                Ok((path, bytes)) => {
                    log.fill_bytes += bytes;
                    sleep_until(until, stop);
                    if let Err(e) = std::fs::remove_file(&path) {
                        log.violations.push(format!("cannot remove the fill file: {e}"));
                    }
                    format!("{} KiB filled for {} ms", bytes >> 10, fault.hold.as_millis())
                }
                Err(e) => {
                    log.skipped.push((fault.kind, format!("{e:#}")));
                    return;
                }
            }
        }
        FaultKind::DiskCorrupt => {
            match faults::corrupt_slab(
                &t.disk_a,
                CHUNK_BYTES,
                DISK_A_MIB << 20,
                CORRUPT_SLOTS,
                fault.seed,
            ) {
                Ok(c) if c.slots > 0 => {
                    log.corrupted_keys.extend(c.keys);
                    format!("{} slots", c.slots)
                }
                Ok(_) => {
                    log.skipped.push((fault.kind, "no sealed slot yet".into()));
                    return;
                }
                Err(e) => {
                    log.skipped.push((fault.kind, format!("{e:#}")));
                    return;
                }
            }
        }
        FaultKind::Stall => {
            let (what, pid) = if fault.seed % 2 == 0 {
                ("redis-server", t.redis.lock().pid())
            } else {
                ("peer node", t.peer.lock().pid())
            };
            if pid == 0 || !faults::signal(pid, libc::SIGSTOP) {
                log.skipped.push((fault.kind, format!("{what} is not running")));
                return;
            }
            sleep_until(until, stop);
            faults::signal(pid, libc::SIGCONT);
            format!("{what} stopped {} ms", fault.hold.as_millis())
        }
    };
    log.injected.push((fault.kind, note));
}

/// The injector's thread: the schedule's faults at their times, and the peer node watched for
/// exits it did not cause (each is a violation; the node is started again).
fn injector(schedule: &Schedule, t0: Instant, t: &Targets, stop: &AtomicBool) -> InjectorLog {
    let mut log = InjectorLog::default();
    let mut next = 0;
    while !stop.load(Ordering::SeqCst) {
        let exited = t.peer.lock().exited();
        if let Some(status) = exited {
            log.violations
                .push(format!("the peer node exited on its own ({status})"));
            if let Err(e) = t.peer.lock().restart() {
                log.violations
                    .push(format!("the peer node did not start again: {e:#}"));
            }
        }
        if let Some(f) = schedule.faults.get(next)
            && t0.elapsed() >= f.at
        {
            next += 1;
            inject(f, t, stop, &mut log);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    log
}

/// This node's figures, summed over rounds.
#[derive(Default)]
struct Totals {
    rounds: u64,
    submitted: u64,
    completed: u64,
    verified: u64,
    corrupt_chunks: u64,
    leaked: u64,
    ttft_ms: Vec<f64>,
    sources: Vec<u64>,
}

impl Totals {
    /// Adds a round of a chain of `tiers` tiers (primary and secondaries).
    fn add(&mut self, m: &RunMetrics, tiers: usize) {
        self.rounds += 1;
        self.completed += m.requests;
        self.verified += m.bytes_primary_to_device;
        self.corrupt_chunks += m.corrupt_chunks;
        self.leaked += m.leaked_arena_rows + m.leaked_device_blocks;
        self.ttft_ms.extend(m.ttft.iter().map(|s| s * 1e3));
        // Columns: device, primary, each secondary, computed.
        let mut row = vec![m.device_tokens, m.primary_tokens];
        row.extend((0..tiers.saturating_sub(1)).map(|i| m.secondary_tokens.get(i).copied().unwrap_or(0)));
        row.push(m.computed_tokens);
        self.sources.resize(row.len(), 0);
        for (t, v) in self.sources.iter_mut().zip(&row) {
            *t += v;
        }
    }
}

/// Runs one soak and reports; violations are in the report, not errors.
///
/// # Errors
/// The soak cannot be set up (no `redis-server`, no free port, the chain does not build) or
/// torn down.
#[allow(clippy::too_many_lines)] // one sequence: set up, reference, soak, tear down, check
pub fn run_soak(cfg: &SoakConfig) -> Result<SoakReport> {
    let start_sample = ProcSample::now();
    let mut report = SoakReport {
        duration: cfg.duration,
        seed: cfg.seed,
        chain: "cpu 8 MiB → disk (tmpfs) → redis (own redis-server) → p2p (the other node)".into(),
        growth: Growth::default(),
        ttft_bound: Some(cfg.ttft),
        warm_up: cfg.duration / 4,
        ..SoakReport::default()
    };
    static SOAKS: AtomicUsize = AtomicUsize::new(0);
    let root = std::env::temp_dir().join(format!(
        "kvtier-soak-{}-{}",
        std::process::id(),
        SOAKS.fetch_add(1, Ordering::Relaxed)
    ));
    let scratch = Scratch::create(&root, TMPFS_MIB << 20)?;
    let disk_a = scratch.disk.join("a");
    let disk_b = scratch.disk.join("b");
    let redis = Arc::new(Mutex::new(RedisServer::start(&root.join("redis"))?));
    let redis_port = redis.lock().port;
    let (port_a, port_b) = (faults::free_port()?, faults::free_port()?);

    // The reference: every round workload once, offloading off, before anything else runs.
    let mut reference = Vec::new();
    for v in 0..VARIANTS {
        let m = run_offload_off(&sim_config(None), &round_workload(cfg.seed, v, cfg.requests))?;
        reference.extend(m.ttft.iter().map(|s| s * 1e3));
    }

    let peer_args = vec![
        "--disk".into(),
        disk_b.display().to_string(),
        "--redis-port".into(),
        redis_port.to_string(),
        "--bind-port".into(),
        port_b.to_string(),
        "--peer-port".into(),
        port_a.to_string(),
        "--seed".into(),
        cfg.seed.to_string(),
        "--requests".into(),
        cfg.requests.to_string(),
    ];
    let peer = Arc::new(Mutex::new(PeerNode::start(&cfg.exe, peer_args)?));
    let chain = ChainConfig::parse(
        "kvtier soak chain",
        &chain_text(&disk_a, DISK_A_MIB, redis_port, port_a, port_b),
    )?;
    let mut session = Session::start(
        &config_chain(chain, registry()?),
        &sim_config(Some(format!("127.0.0.1:{port_b}"))),
    )?;
    let tier_names = session.tiers().to_vec();
    let mut ledger = DiskLedger::new("disk");

    let t0 = Instant::now();
    let schedule = if cfg.faults {
        let (from, to) = (cfg.duration.mul_f64(0.15), cfg.duration.mul_f64(0.85));
        let gap = cfg
            .fault_gap
            .unwrap_or_else(|| ((to - from) / 7).clamp(Duration::from_millis(500), Duration::from_secs(8)));
        Schedule::generate(cfg.seed, from, to, gap)
    } else {
        Schedule { faults: Vec::new() }
    };
    let stop = Arc::new(AtomicBool::new(false));
    let targets = Targets {
        redis: Arc::clone(&redis),
        peer: Arc::clone(&peer),
        disk_root: scratch.disk.clone(),
        disk_a: disk_a.clone(),
        mounted: scratch
            .no_mount
            .clone()
            .map(|why| format!("skipped: the disk tiers are not on a tmpfs of their own ({why})")),
    };
    let injector = {
        let stop = Arc::clone(&stop);
        let schedule = schedule.clone();
        std::thread::Builder::new()
            .name("kvtier-soak-faults".into())
            .spawn(move || injector(&schedule, t0, &targets, &stop))?
    };

    let mut totals = Totals::default();
    let mut session_failed = false;
    let mut warm = None;
    let mut round = 0;
    let wrong_bytes_at = cfg.inject_wrong_bytes.then(|| cfg.duration.mul_f64(0.3));
    let mut arena_rows_corrupted = 0;
    // A round whose workload runs again next (after its rows were corrupted on purpose).
    let mut replay = None;
    while t0.elapsed() < cfg.duration || replay.is_some() {
        let w = match replay.take() {
            Some(of) => workload_of(cfg.seed, of, round, cfg.requests),
            None => round_workload(cfg.seed, round, cfg.requests),
        };
        totals.submitted += w.requests.len() as u64;
        match session.run(&w) {
            Ok(m) => totals.add(&m, tier_names.len()),
            Err(e) => {
                report
                    .violations
                    .push(format!("round {round} did not complete every request: {e}"));
                session_failed = true;
                break;
            }
        }
        match session.take_events() {
            Ok(events) => ledger.apply(&events),
            Err(e) => report.violations.push(format!("the manager's events: {e}")),
        }
        if warm.is_none() && t0.elapsed() >= report.warm_up {
            warm = Some(ProcSample::now());
        }
        if arena_rows_corrupted == 0 && wrong_bytes_at.is_some_and(|at| t0.elapsed() >= at) {
            // Between rounds, so the rows this round left resident are idle; the next round
            // runs the same workload with an empty device cache, so it looks those chunks up
            // again and loads them from the primary: the checks must see them (not a matter of
            // whether some later workload happens to reuse a corrupted row before it is
            // evicted).
            arena_rows_corrupted = faults::corrupt_arena(session.arena());
            replay = Some(round);
        }
        round += 1;
    }
    stop.store(true, Ordering::SeqCst);
    let log = injector
        .join()
        .map_err(|_| anyhow::anyhow!("the fault injector panicked"))?;
    let end_sample = ProcSample::now();
    let stats = session.stats().ok();
    if let Ok(events) = session.take_events() {
        ledger.apply(&events);
    }
    if !session_failed && let Err(e) = session.shutdown() {
        report
            .violations
            .push(format!("shutting this node's chain down: {e}"));
    }
    let peer = Arc::try_unwrap(peer)
        .map_err(|_| anyhow::anyhow!("the peer node is still shared"))?
        .into_inner();
    let (peer_clean, peer_totals) = peer.finish(Duration::from_secs(30));
    drop(redis);

    // The slabs, read back in full.
    let audit_a = SlabAudit::of(&disk_a, CHUNK_BYTES, DISK_A_MIB << 20)?;
    let audit_b = SlabAudit::of(&disk_b, CHUNK_BYTES, DISK_B_MIB << 20)?;
    let lost: Vec<_> = audit_a
        .lost(&ledger)
        .into_iter()
        .chain(
            ledger
                .held()
                .iter()
                .filter(|k| audit_a.keys.get(*k) == Some(&false) && !log.corrupted_keys.contains(*k))
                .copied(),
        )
        .collect();

    let mounted_disk = scratch.disk.clone();
    let scratch_result = scratch.remove();
    let mut checked: Vec<PathBuf> = vec![root.clone(), mounted_disk.clone()];
    checked.extend(
        peer_totals
            .pids
            .iter()
            .map(|p| std::env::temp_dir().join(format!("kvtier-{p}"))),
    );
    let mut left: Vec<String> = leftovers(&checked)
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    if is_mounted(&mounted_disk) {
        left.push(format!("{} (still mounted)", mounted_disk.display()));
    }
    if let Err(e) = scratch_result {
        report.violations.push(format!("clean-up: {e:#}"));
    }

    // The report.
    report.faults = FaultKind::ALL
        .iter()
        .map(|&kind| {
            let done: Vec<&String> = log
                .injected
                .iter()
                .filter(|(k, _)| *k == kind)
                .map(|(_, n)| n)
                .collect();
            let skipped: Vec<&String> = log
                .skipped
                .iter()
                .filter(|(k, _)| *k == kind)
                .map(|(_, n)| n)
                .collect();
            let mut note = match kind {
                FaultKind::DiskFill if !done.is_empty() => {
                    format!("{} MiB written in all", log.fill_bytes >> 20)
                }
                FaultKind::DiskCorrupt if !done.is_empty() => {
                    format!("{} distinct chunks corrupted", log.corrupted_keys.len())
                }
                _ => done.last().map(|n| format!("last: {n}")).unwrap_or_default(),
            };
            if let Some(s) = skipped.first() {
                note = format!(
                    "{note}{}{} skipped: {s}",
                    if note.is_empty() { "" } else { "; " },
                    skipped.len()
                );
            }
            FaultRow {
                kind,
                injected: done.len() as u64,
                note,
            }
        })
        .collect();
    report.rounds = totals.rounds;
    report.submitted = totals.submitted;
    report.completed = totals.completed;
    report.peer_rounds = peer_totals.rounds;
    report.peer_requests = peer_totals.requests;
    report.verified_bytes = [totals.verified, peer_totals.verified_bytes];
    report.wrong_bytes = [
        totals.corrupt_chunks * CHUNK_BYTES as u64,
        peer_totals.wrong_bytes,
    ];
    report.audit_verified_bytes = [audit_a.verified_bytes, audit_b.verified_bytes];
    report.audit_wrong_bytes = [audit_a.wrong_bytes, audit_b.wrong_bytes];
    report.audit_bad_checksum = [audit_a.bad_checksum, audit_b.bad_checksum];
    report.acknowledged = (ledger.stored, ledger.held().len() as u64);
    report.lost_stores = lost.len() as u64;
    let disk_stats = stats.as_ref().and_then(|s| tier(s, "disk"));
    report.corrupt_detected = extra(disk_stats, "corrupt_slots");
    report.disk_io_errors = extra(disk_stats, "io_errors");
    report.sources = std::iter::once("device cache".to_owned())
        .chain(tier_names.iter().cloned())
        .chain(std::iter::once("computed".to_owned()))
        .zip(totals.sources.iter().copied().chain(std::iter::repeat(0)))
        .collect();
    report.peer_p2p_tokens = peer_totals.p2p_tokens;
    report.peer_recovered_slots = peer_totals.recovered_slots;
    let warm = warm.unwrap_or(end_sample);
    report.proc = [start_sample, warm, end_sample];
    let r = Percentiles::of(&reference);
    let s = Percentiles::of(&totals.ttft_ms);
    report.ttft_reference = (r.p50, r.p99);
    report.ttft_soak = (s.p50, s.p99);
    report.scratch_checked = checked.len();
    report.leftovers = left;

    // The verdict.
    let v = &mut report.violations;
    if totals.completed != totals.submitted {
        v.push(format!(
            "{} of {} requests did not complete",
            totals.submitted - totals.completed,
            totals.submitted
        ));
    }
    for (who, bytes) in [
        ("this node", report.wrong_bytes[0]),
        ("the peer node", report.wrong_bytes[1]),
    ] {
        if bytes > 0 {
            v.push(format!("{who} loaded {bytes} wrong bytes (whole chunks)"));
        }
    }
    for (who, a) in [("this node's", &audit_a), ("the peer node's", &audit_b)] {
        if a.wrong_slots > 0 {
            v.push(format!(
                "{who} slab holds {} slots of wrong bytes behind a valid checksum ({} bytes)",
                a.wrong_slots, a.wrong_bytes
            ));
        }
    }
    if session_failed {
        // The manager went down with the failed round: the events since the round before are
        // gone, so the ledger cannot say what the slab must hold.
        report.lost_stores = 0;
        v.push("lost acknowledged stores not checked: this node's chain ended with a failed round".into());
    } else if !lost.is_empty() {
        v.push(format!(
            "{} stores the disk tier acknowledged and never reported removed are not in its slab \
             (first: {})",
            lost.len(),
            lost[0]
        ));
    }
    if totals.leaked > 0 {
        v.push(format!(
            "{} device blocks or arena rows stayed held after rounds",
            totals.leaked
        ));
    }
    if s.p99 > cfg.ttft.limit_ms(r.p99) {
        v.push(format!(
            "TTFT p99 {:.2} ms is over the bound {:.2} ms ({} × the offloading-off p99 {:.2} ms + {} ms)",
            s.p99,
            cfg.ttft.limit_ms(r.p99),
            cfg.ttft.factor,
            r.p99,
            cfg.ttft.slack_ms
        ));
    }
    v.extend(report.growth.violations(warm, end_sample));
    if !report.leftovers.is_empty() {
        v.push(format!("scratch left behind: {}", report.leftovers.join(", ")));
    }
    v.extend(log.violations.iter().cloned());
    v.extend(peer_totals.errors.iter().cloned());
    if let Err(why) = &peer_clean {
        v.push(format!(
            "the peer node did not finish cleanly when asked to: {why}"
        ));
    }
    if peer_totals.rounds == 0 {
        v.push("the peer node completed no round".into());
    }
    if cfg.faults {
        for row in &report.faults {
            let skipped_fill = row.kind == FaultKind::DiskFill && scratch_skips_fill(&log);
            if row.injected == 0 && !skipped_fill && schedule.count(row.kind) > 0 {
                v.push(format!("no `{}` fault could be injected", row.kind));
            }
        }
    }
    report.arena_rows_corrupted = arena_rows_corrupted;
    if arena_rows_corrupted > 0 {
        report.faults.push(FaultRow {
            kind: FaultKind::DiskCorrupt,
            injected: 1,
            note: format!(
                "(deliberate: a byte flipped in {arena_rows_corrupted} idle arena rows, \
                 --inject-wrong-bytes)"
            ),
        });
    }
    Ok(report)
}

/// Whether the fill fault was skipped because the disk tiers have no tmpfs of their own.
fn scratch_skips_fill(log: &InjectorLog) -> bool {
    log.skipped
        .iter()
        .any(|(k, why)| *k == FaultKind::DiskFill && why.contains("tmpfs"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("s").is_err());
    }

    #[test]
    fn the_chain_parses_and_rounds_repeat_their_workloads_under_new_names() {
        let text = chain_text(Path::new("/nonexistent/soak"), 8, 6379, 7000, 7001);
        let c = ChainConfig::parse("test", &text).unwrap();
        let types: Vec<&str> = c.secondaries.iter().map(|s| s.tier_type.as_str()).collect();
        assert_eq!(types, ["disk", "redis", "p2p"]);
        let (a, b) = (round_workload(1, 0, 20), round_workload(1, VARIANTS, 20));
        assert_eq!(a.requests.len(), 20);
        assert_eq!(a.requests[3].prompt, b.requests[3].prompt);
        assert_ne!(a.requests[3].name, b.requests[3].name);
    }
}
