//! The pull flow: the producer stored every chunk up front; its busy engine then holds its step
//! for the scheduling phase and makes no manager call for a model step, again and again. The consumer probes (`remote_kv_source`)
//! and pulls what it found, one small request after another, stepping every 100 µs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tiering_core::{LookupResult, OffloadKey, OffloadingManager, ReqContext, RequestId, TieringManager};

use super::{ControlPlaneMode, FetchRttConfig, ModeResult, Node, end, mgr_err, ms, node, source_params};
use crate::bench::BenchError;
use crate::sim::{Percentiles, SimRng, chunk_matches, fill_chunk};

/// Per fetch: lookup round trip, fetch round trip (ms), producer steps begun during the fetch.
type Samples = (Vec<f64>, Vec<f64>, Vec<u64>);

pub(super) fn run(cfg: &FetchRttConfig, mode: ControlPlaneMode) -> Result<ModeResult, BenchError> {
    let total = cfg.fetches * cfg.chunks_per_fetch;
    let mut producer = node(cfg, mode.manager_config(), total + 8)?;
    // The consumer always runs its own control thread: only the producer's mode is under test.
    let mut consumer = node(cfg, ControlPlaneMode::Thread.manager_config(), total + 8)?;
    let mut rng = SimRng::new(u64::from(std::process::id()) ^ (mode as u64) << 32);
    let keys: Vec<OffloadKey> = (0..total).map(|_| OffloadKey::from_u64(rng.next_u64())).collect();
    let store = ReqContext::local("bench-producer");
    let mut p = producer.mgr.step();
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
    drop(p);

    // The producer's busy engine, on its own thread.
    let stop = Arc::new(AtomicBool::new(false));
    let steps = Arc::new(AtomicU64::new(0));
    let busy = {
        let stop = Arc::clone(&stop);
        let steps = Arc::clone(&steps);
        let step = cfg.producer_step;
        let sched = cfg.sched_time;
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
                        steps.fetch_add(1, Ordering::AcqRel);
                        // The scheduling phase holds the step.
                        let begin = Instant::now();
                        let mut s = mgr.step();
                        while begin.elapsed() < sched {
                            std::hint::spin_loop();
                        }
                        s.on_schedule_end(&end())?;
                        drop(s);
                        let now = Instant::now();
                        periods.push(ms(now - last));
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
    let pulled = pull_all(cfg, &mut consumer, &producer.p2p, &keys, &steps);
    stop.store(true, Ordering::Release);
    let joined = busy.join();
    let (lookups, fetches, during) = pulled?;
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
    let stats = mgr.stats().map_err(|e| mgr_err(&e))?;
    mgr.shutdown().map_err(|e| mgr_err(&e))?;
    consumer.mgr.shutdown().map_err(|e| mgr_err(&e))?;
    Ok(ModeResult {
        mode,
        fetch_ms: Percentiles::of(&fetches),
        lookup_ms: Some(Percentiles::of(&lookups)),
        producer_step_ms: Percentiles::of(&periods),
        producer_steps_during_fetch: during,
        fetches_waited: tier_p2p::P2pCounters::get(&producer.p2p.counters().fetches_waited),
        fetches_held_back: 0,
        off_step_store_completions: stats.manager.off_step_store_completions,
        slowest: Vec::new(),
        tail: None,
        machine: None,
        rtt_in_stall: Vec::new(),
    })
}

/// The consumer's engine: one pull request after another.
fn pull_all(
    cfg: &FetchRttConfig,
    consumer: &mut Node,
    from: &tier_p2p::P2pHandle,
    keys: &[OffloadKey],
    steps: &AtomicU64,
) -> Result<Samples, BenchError> {
    let mut lookups = Vec::new();
    let mut fetches = Vec::new();
    let mut during = Vec::new();
    let mgr = &mut consumer.mgr;
    for (i, batch) in keys.chunks(cfg.chunks_per_fetch).enumerate() {
        let kv = format!("bench-pull-{i}");
        let ctx = ReqContext::builder(RequestId::local(kv.clone()))
            .params(source_params("remote_kv_source", &kv, from))
            .build();
        mgr.step().on_new_request(&ctx).map_err(|e| mgr_err(&e))?;
        let start = Instant::now();
        let mut sent: Option<(Instant, u64)> = None;
        loop {
            let mut step = mgr.step();
            let mut all_hit = true;
            let mut all_found = true;
            for k in batch {
                match step.lookup(k, &ctx).map_err(|e| mgr_err(&e))? {
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
                let (sent_at, steps_then) = sent.unwrap_or((landed, steps.load(Ordering::Acquire)));
                lookups.push(ms(sent_at - start));
                fetches.push(ms(landed - sent_at));
                during.push(steps.load(Ordering::Acquire) - steps_then);
                let rows = step.prepare_load(batch, &ctx).map_err(|e| mgr_err(&e))?;
                for (k, &c) in batch.iter().zip(&rows) {
                    if !chunk_matches(k, &consumer.arena.read_row(c)?) {
                        return Err(BenchError::Tier {
                            tier: "p2p".into(),
                            message: format!("pull {i}: chunk {k} arrived with different bytes"),
                        });
                    }
                }
                step.complete_load(batch, &ctx).map_err(|e| mgr_err(&e))?;
                step.on_request_finished(&ctx).map_err(|e| mgr_err(&e))?;
                step.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;
                break;
            }
            step.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;
            drop(step);
            if all_found && sent.is_none() {
                // The step that found every chunk just flushed the promotion: the fetch is out.
                sent = Some((Instant::now(), steps.load(Ordering::Acquire)));
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
    Ok((lookups, fetches, during))
}
