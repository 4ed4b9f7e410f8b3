//! `kvtier bench fetch-rtt`: does a control-plane thread shorten a peer's fetch while the
//! producer is busy?
//!
//! Two nodes in this process, each a CPU tier plus a p2p tier under a `TieringManager`. The
//! producer stores chunks, then runs a busy engine: a model step (default 50 ms) with no manager
//! call, then `on_schedule_end`, again and again. The consumer pulls chunks the producer holds,
//! one small request at a time, stepping every 100 µs. Per request it records
//! - the lookup round trip: first lookup → the step that saw every chunk found (`HitPending`);
//! - the fetch round trip: the end of that step (when the promotion's fetch is sent) → the
//!   lookup that sees every chunk landed (`Hit`), bytes verified.
//!
//! Both modes run in one invocation: `thread` (the producer's control-plane thread serves peers
//! while its model runs) and `step` (the producer serves only inside `on_schedule_end`). Next to
//! them: the producer's measured step period and a raw ZeroMQ DEALER→ROUTER round trip on
//! loopback, the floor of any control exchange.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use tier_cpu::{CpuTier, PolicyKind};
use tier_p2p::{P2pHandle, P2pTier, P2pTierOptions};
use tiering_core::{
    ChunkArena, LookupResult, ManagerConfig, OffloadKey, OffloadingManager, ReqContext, RequestId,
    ScheduleEndContext, TieringManager,
};

use super::BenchError;
use crate::sim::{Percentiles, SimRng, chunk_matches, fill_chunk};

/// Which control plane the producer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ControlPlaneMode {
    /// A dedicated thread serves peers between (and during) steps.
    Thread,
    /// Peers are served only inside the producer's `on_schedule_end`.
    Step,
}

impl fmt::Display for ControlPlaneMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Thread => "thread",
            Self::Step => "step",
        })
    }
}

/// What to measure.
#[derive(Clone, Debug, Serialize)]
pub struct FetchRttConfig {
    /// The producer's model time per step.
    #[serde(serialize_with = "ser_ms")]
    pub producer_step: Duration,
    /// Pull requests per mode.
    pub fetches: usize,
    /// Chunks per pull request.
    pub chunks_per_fetch: usize,
    /// Bytes per chunk.
    pub chunk_bytes: usize,
    /// The modes, in order.
    pub modes: Vec<ControlPlaneMode>,
    /// Raw control round trips to sample.
    pub raw_round_trips: usize,
    /// Longest wait for one pull.
    #[serde(serialize_with = "ser_ms")]
    pub fetch_timeout: Duration,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `serialize_with` signature
fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

impl Default for FetchRttConfig {
    fn default() -> Self {
        Self {
            producer_step: Duration::from_millis(50),
            fetches: 40,
            chunks_per_fetch: 4,
            chunk_bytes: 64 * 1024,
            modes: vec![ControlPlaneMode::Thread, ControlPlaneMode::Step],
            raw_round_trips: 2000,
            fetch_timeout: Duration::from_secs(20),
        }
    }
}

/// The figures of one mode.
#[derive(Clone, Debug, Serialize)]
pub struct ModeResult {
    /// The producer's control plane.
    pub mode: ControlPlaneMode,
    /// Lookup round trip, ms.
    pub lookup_ms: Percentiles,
    /// Fetch round trip (fetch sent → data landed), ms.
    pub fetch_ms: Percentiles,
    /// The producer's measured step period, ms.
    pub producer_step_ms: Percentiles,
}

/// Every figure.
#[derive(Clone, Debug, Serialize)]
pub struct FetchRttReport {
    /// The settings.
    pub config: FetchRttConfig,
    /// Raw ZeroMQ round trip on loopback, µs.
    pub raw_control_rtt_us: Percentiles,
    /// One entry per mode.
    pub modes: Vec<ModeResult>,
}

impl fmt::Display for FetchRttReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "kvtier bench fetch-rtt — producer model step {:.1} ms, {} pulls of {} × {} KiB chunks per mode",
            c.producer_step.as_secs_f64() * 1e3,
            c.fetches,
            c.chunks_per_fetch,
            c.chunk_bytes / 1024
        )?;
        let r = &self.raw_control_rtt_us;
        writeln!(
            f,
            "  raw control round trip (ZeroMQ DEALER→ROUTER, loopback): p50 {:.1} µs, p99 {:.1} µs",
            r.p50, r.p99
        )?;
        writeln!(
            f,
            "  {:<8} {:>22} {:>22} {:>22}",
            "mode", "fetch rtt p50/p99 ms", "lookup rtt p50/p99 ms", "producer step p50 ms"
        )?;
        for m in &self.modes {
            writeln!(
                f,
                "  {:<8} {:>10.2} / {:<9.2} {:>10.2} / {:<9.2} {:>14.2}",
                m.mode.to_string(),
                m.fetch_ms.p50,
                m.fetch_ms.p99,
                m.lookup_ms.p50,
                m.lookup_ms.p99,
                m.producer_step_ms.p50
            )?;
        }
        Ok(())
    }
}

/// Runs both nodes in every configured mode and the raw round trip.
///
/// # Errors
/// A node that cannot be built, a pull that misses or times out, or bytes that arrive wrong.
pub fn fetch_rtt(cfg: &FetchRttConfig) -> Result<FetchRttReport, BenchError> {
    if cfg.fetches == 0 || cfg.chunks_per_fetch == 0 || cfg.chunk_bytes == 0 {
        return Err(BenchError::InvalidSetting {
            name: "fetches/chunks_per_fetch/chunk_bytes",
            reason: "must be greater than zero".into(),
        });
    }
    let raw = raw_control_rtt(cfg.raw_round_trips.max(1))?;
    let mut modes = Vec::new();
    for &mode in &cfg.modes {
        modes.push(run_mode(cfg, mode)?);
    }
    Ok(FetchRttReport {
        config: cfg.clone(),
        raw_control_rtt_us: Percentiles::of(&raw),
        modes,
    })
}

struct Node {
    mgr: TieringManager,
    arena: Arc<ChunkArena>,
    p2p: P2pHandle,
}

fn node(cfg: &FetchRttConfig, thread: bool, rows: usize) -> Result<Node, BenchError> {
    let err = |what: &str, e: String| BenchError::Tier {
        tier: what.to_owned(),
        message: e,
    };
    let primary =
        CpuTier::new(rows, cfg.chunk_bytes, PolicyKind::Lru).map_err(|e| err("cpu", e.to_string()))?;
    let arena = Arc::clone(tiering_core::PrimaryTier::arena(&primary));
    let mut opts = P2pTierOptions::loopback();
    opts.hash_seed = "kvtier-bench".into();
    opts.layout_fingerprint = format!("bench-{}", cfg.chunk_bytes);
    let tier = P2pTier::new(opts, &arena).map_err(|e| err("p2p", e.to_string()))?;
    let p2p = tier.handle();
    let config = ManagerConfig {
        control_plane_thread: thread,
        ..ManagerConfig::default()
    };
    let mgr = TieringManager::new(Box::new(primary), vec![Box::new(tier)], config);
    Ok(Node { mgr, arena, p2p })
}

fn mgr_err(e: &tiering_core::ManagerError) -> BenchError {
    BenchError::Tier {
        tier: "manager".into(),
        message: e.to_string(),
    }
}

fn end() -> ScheduleEndContext {
    ScheduleEndContext::default()
}

fn run_mode(cfg: &FetchRttConfig, mode: ControlPlaneMode) -> Result<ModeResult, BenchError> {
    let total = cfg.fetches * cfg.chunks_per_fetch;
    let mut producer = node(cfg, mode == ControlPlaneMode::Thread, total + 8)?;
    // The consumer always runs its own control thread: only the producer's mode is under test.
    let mut consumer = node(cfg, true, total + 8)?;
    let mut rng = SimRng::new(u64::from(std::process::id()) ^ (mode as u64) << 32);
    let keys: Vec<OffloadKey> = (0..total).map(|_| OffloadKey::from_u64(rng.next_u64())).collect();
    let store = ReqContext::local("bench-producer");
    let p = &mut producer.mgr;
    p.on_new_request(&store).map_err(|e| mgr_err(&e))?;
    let out = p
        .prepare_store(&keys, &store)
        .map_err(|e| mgr_err(&e))?
        .ok_or_else(|| BenchError::Tier {
            tier: "cpu".into(),
            message: "no room to store the producer's chunks".into(),
        })?;
    for (k, &c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
        fill_chunk(k, &mut producer.arena.write_row(c)?);
    }
    p.complete_store(&out.keys_to_store, &store, true)
        .map_err(|e| mgr_err(&e))?;
    p.on_request_finished(&store).map_err(|e| mgr_err(&e))?;
    p.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;

    // The producer's busy engine, on its own thread.
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = Arc::clone(&stop);
        let step = cfg.producer_step;
        let mut mgr = producer.mgr;
        std::thread::Builder::new()
            .name("kvtier-bench-producer".into())
            .spawn(
                move || -> Result<(TieringManager, Vec<f64>), tiering_core::ManagerError> {
                    let mut periods = Vec::new();
                    let mut last = Instant::now();
                    while !stop.load(Ordering::Acquire) {
                        // The model runs: no manager call at all.
                        std::thread::sleep(step);
                        mgr.on_schedule_end(&end())?;
                        let now = Instant::now();
                        periods.push((now - last).as_secs_f64() * 1e3);
                        last = now;
                    }
                    Ok((mgr, periods))
                },
            )
            .map_err(|e| BenchError::Tier {
                tier: "producer".into(),
                message: format!("cannot start the producer thread: {e}"),
            })?
    };
    let pulled = pull_all(cfg, &mut consumer, &producer.p2p, &keys);
    stop.store(true, Ordering::Release);
    let joined = busy.join();
    let (lookups, fetches) = pulled?;
    let (mut mgr, periods) = match joined {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Err(mgr_err(&e)),
        Err(_) => {
            return Err(BenchError::Tier {
                tier: "producer".into(),
                message: "the producer thread panicked".into(),
            });
        }
    };
    mgr.shutdown().map_err(|e| mgr_err(&e))?;
    consumer.mgr.shutdown().map_err(|e| mgr_err(&e))?;
    Ok(ModeResult {
        mode,
        lookup_ms: Percentiles::of(&lookups),
        fetch_ms: Percentiles::of(&fetches),
        producer_step_ms: Percentiles::of(&periods),
    })
}

/// The consumer's engine: one pull request after another. Returns lookup and fetch RTTs (ms).
fn pull_all(
    cfg: &FetchRttConfig,
    consumer: &mut Node,
    from: &P2pHandle,
    keys: &[OffloadKey],
) -> Result<(Vec<f64>, Vec<f64>), BenchError> {
    let mut lookups = Vec::new();
    let mut fetches = Vec::new();
    let mgr = &mut consumer.mgr;
    for (i, batch) in keys.chunks(cfg.chunks_per_fetch).enumerate() {
        let mut params = serde_json::Map::new();
        params.insert(
            "remote_kv_source".into(),
            serde_json::json!({
                "kv_request_id": format!("bench-pull-{i}"),
                "host": from.host(),
                "port": from.port(),
            }),
        );
        let ctx = ReqContext::builder(RequestId::local(format!("bench-pull-{i}")))
            .params(params)
            .build();
        mgr.on_new_request(&ctx).map_err(|e| mgr_err(&e))?;
        let start = Instant::now();
        let mut sent: Option<Instant> = None;
        loop {
            let mut all_hit = true;
            let mut all_found = true;
            for k in batch {
                match mgr.lookup(k, &ctx).map_err(|e| mgr_err(&e))? {
                    LookupResult::Hit => {}
                    LookupResult::HitPending => all_hit = false,
                    LookupResult::Retry => {
                        all_hit = false;
                        all_found = false;
                    }
                    LookupResult::Miss => {
                        return Err(BenchError::Tier {
                            tier: "p2p".into(),
                            message: format!("pull {i}: the producer's chunk {k} was not found"),
                        });
                    }
                }
            }
            if all_hit {
                let landed = Instant::now();
                let sent_at = sent.unwrap_or(landed);
                lookups.push((sent_at - start).as_secs_f64() * 1e3);
                fetches.push((landed - sent_at).as_secs_f64() * 1e3);
                let rows = mgr.prepare_load(batch, &ctx).map_err(|e| mgr_err(&e))?;
                for (k, &c) in batch.iter().zip(&rows) {
                    if !chunk_matches(k, &consumer.arena.read_row(c)?) {
                        return Err(BenchError::Tier {
                            tier: "p2p".into(),
                            message: format!("pull {i}: chunk {k} arrived with different bytes"),
                        });
                    }
                }
                mgr.complete_load(batch, &ctx).map_err(|e| mgr_err(&e))?;
                mgr.on_request_finished(&ctx).map_err(|e| mgr_err(&e))?;
                mgr.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;
                break;
            }
            mgr.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;
            if all_found && sent.is_none() {
                // The step that found every chunk just flushed the promotion: the fetch is out.
                sent = Some(Instant::now());
            }
            if start.elapsed() > cfg.fetch_timeout {
                return Err(BenchError::Tier {
                    tier: "p2p".into(),
                    message: format!("pull {i} did not complete within {:?}", cfg.fetch_timeout),
                });
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    Ok((lookups, fetches))
}

/// Round trips of one small message between a ZeroMQ DEALER and an echoing ROUTER on loopback,
/// in µs: the transport floor under every control exchange of the p2p tier.
fn raw_control_rtt(n: usize) -> Result<Vec<f64>, BenchError> {
    let zerr = |e: zmq::Error| BenchError::Reference {
        reference: "raw ZeroMQ round trip".into(),
        error: std::io::Error::other(e.to_string()),
    };
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).map_err(zerr)?;
    router.bind("tcp://127.0.0.1:*").map_err(zerr)?;
    let endpoint = router
        .get_last_endpoint()
        .map_err(zerr)?
        .map_err(|_| zerr(zmq::Error::EINVAL))?;
    let echo = std::thread::Builder::new()
        .name("kvtier-bench-echo".into())
        .spawn(move || -> Result<(), zmq::Error> {
            for _ in 0..n {
                let frames = router.recv_multipart(0)?;
                router.send_multipart(frames, 0)?;
            }
            Ok(())
        })
        .map_err(|e| BenchError::Reference {
            reference: "raw ZeroMQ round trip".into(),
            error: e,
        })?;
    let dealer = ctx.socket(zmq::DEALER).map_err(zerr)?;
    dealer.connect(&endpoint).map_err(zerr)?;
    let mut samples = Vec::with_capacity(n);
    let payload = [0u8; 64];
    for _ in 0..n {
        let t = Instant::now();
        dealer.send(&payload[..], 0).map_err(zerr)?;
        dealer.recv_bytes(0).map_err(zerr)?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    match echo.join() {
        Ok(r) => r.map_err(zerr)?,
        Err(_) => {
            return Err(BenchError::Reference {
                reference: "raw ZeroMQ round trip".into(),
                error: std::io::Error::other("the echo thread panicked"),
            });
        }
    }
    Ok(samples)
}
