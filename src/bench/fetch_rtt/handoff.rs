//! The hand-off flow (prefill→decode): the consumer's fetch arrives while the producer's store
//! of those chunks is still in flight.
//!
//! Three actors per mode:
//! - the producer's engine (a thread): each step first runs its **scheduling phase**, holding
//!   its `Step` for `sched_time`: it completes the stores whose copies finished since its last
//!   step, starts the stores (`remote_decoder` requests, `prepare_store`) of the requests whose
//!   fetch is due before its next step ends, and spends the rest of the phase on scheduling
//!   lookups. It then drops the step, hands the copy orders to its copy workers and runs the
//!   model for the step time with no manager call;
//! - the producer's copy workers (a thread, or two worker processes reporting over the
//!   completion channel): copy the bytes into the rows as soon as the order comes, for as long
//!   as the measured memcpy rate says, and — in `thread+offstep` — report the store;
//! - the consumer's engine (the calling thread): its fetches leave at the times of a seeded
//!   Poisson process, independent of the producer's steps (a fetch never leaves before the
//!   producer's step that started its store ended: the decoder cannot know of a prefill before
//!   that). While fetches are in flight it steps every 50 µs, landing the ones whose chunks all
//!   arrived (the bytes are verified); otherwise it sleeps until its next fetch is due, then
//!   steps to send it (`remote_prefiller` lookups and the step end).
//!
//! A store starts in the producer step that begins no earlier than one period (model step plus
//! scheduling phase) plus one scheduling phase before its fetch, so each fetch arrives at a
//! uniformly spread point of the producer's next period: usually while the model runs, with
//! probability about sched/period during the next scheduling phase (the lock is held then).
//!
//! The first fetch of each mode is a warm-up (it carries the session's handshake) and is not
//! measured.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use tier_cpu::{Capacity, CpuTierOptions, PolicyKind};
use tiering_core::{LookupResult, OffloadKey, OffloadingManager, ReqContext, RequestId, TieringManager};

use super::copy::{CopyDone, CopyOrder};
use super::copy_workers::CopyWorkers;
use super::stall_probe::StallProbe;
use super::timeline::{self, FetchSeen, TailSummary, TimelineMarks, Trace, nanos_since};
use super::worker_process::WorkerProcesses;
use super::{ControlPlaneMode, FetchRttConfig, ModeResult, Node, end, mgr_err, ms, node_with, source_params};
use crate::bench::BenchError;
use crate::sim::{Percentiles, SimRng, chunk_matches};

/// How often the consumer steps.
const CONSUMER_TICK: Duration = Duration::from_micros(50);

/// Longest sleep of a consumer with nothing in flight (it still notices a producer that stopped).
const IDLE_TICK: Duration = Duration::from_millis(5);

/// Worker processes (tensor-parallel ranks) in `--workers-process` mode.
pub(super) const WORKER_RANKS: u32 = 2;

fn actor_err(actor: &str, message: impl Into<String>) -> BenchError {
    BenchError::Tier {
        tier: actor.to_owned(),
        message: message.into(),
    }
}

fn kv_name(mode: ControlPlaneMode, i: usize) -> String {
    format!("bench-handoff-{mode}-{i}")
}

/// Where the shared arena and the completion channel live in `--workers-process` mode; removed
/// when dropped.
fn scratch_dir() -> Result<tempfile::TempDir, BenchError> {
    let shm = std::path::Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    tempfile::Builder::new()
        .prefix("kvtier-fetch-rtt-")
        .tempdir_in(&base)
        .map_err(|e| actor_err("producer", format!("cannot create a scratch directory: {e}")))
}

pub(super) fn run(cfg: &FetchRttConfig, mode: ControlPlaneMode, rate: f64) -> Result<ModeResult, BenchError> {
    let requests = cfg.fetches + 1;
    let rows = requests * cfg.chunks_per_fetch + 8;
    let mut rng = SimRng::derive(cfg.seed, mode as u64);
    let keys: Vec<Vec<OffloadKey>> = (0..requests)
        .map(|_| {
            (0..cfg.chunks_per_fetch)
                .map(|_| OffloadKey::from_u64(rng.next_u64()))
                .collect()
        })
        .collect();
    // The Poisson process of fetch arrivals, as offsets from the start of the run.
    let rate_per_s = 1.0 / cfg.arrival_mean.as_secs_f64().max(1e-6);
    let mut at = Duration::ZERO;
    let arrivals: Vec<Duration> = (0..requests)
        .map(|_| {
            at += Duration::from_secs_f64(rng.exponential(rate_per_s));
            at
        })
        .collect();

    let scratch = if cfg.workers_process {
        Some(scratch_dir()?)
    } else {
        None
    };
    let arena_path = scratch.as_ref().map(|d| d.path().join("arena"));
    let channel_path = scratch.as_ref().map(|d| d.path().join("completions.sock"));
    let mut config = mode.manager_config();
    if cfg.workers_process && mode == ControlPlaneMode::ThreadOffStep {
        config.reporters = WORKER_RANKS;
    }
    let mut primary = CpuTierOptions::new(Capacity::Chunks(rows as u64)).with_eviction(PolicyKind::Lru);
    primary.shared_memory.clone_from(&arena_path);
    // Both arenas are pre-faulted: an engine's host buffers are pinned memory (vLLM allocates
    // them pinned; kvtier's arena is registered for DMA), resident before the first request.
    // Left to first touch, the copies and receives of the first fetches would time page faults.
    primary.prefault = true;
    // Traced from before the nodes exist: their threads' first wake-ups are in it too.
    let _ = tiering_core::fetch_trace::take();
    tiering_core::fetch_trace::enable(true);
    let producer = node_with(cfg, config, &primary)?;
    let producer_waker = producer.mgr.waker().trace_id();
    let mut consumer = node_with(
        cfg,
        ControlPlaneMode::Thread.manager_config(),
        &CpuTierOptions {
            prefault: true,
            ..CpuTierOptions::new(Capacity::Chunks(rows as u64))
        },
    )?;

    let (done_tx, done_rx) = mpsc::channel::<CopyDone>();
    let offstep = mode == ControlPlaneMode::ThreadOffStep;
    let workers = match (&arena_path, &channel_path) {
        (Some(arena), Some(channel)) => {
            let channel = if offstep {
                producer
                    .mgr
                    .open_completion_channel(channel)
                    .map_err(|e| mgr_err(&e))?;
                Some(channel.as_path())
            } else {
                None
            };
            let exe = match &cfg.worker_exe {
                Some(p) => p.clone(),
                None => std::env::current_exe()
                    .map_err(|e| actor_err("producer", format!("cannot find the kvtier binary: {e}")))?,
            };
            CopyWorkers::Processes(WorkerProcesses::start(
                &exe,
                arena,
                channel,
                WORKER_RANKS,
                rate,
                &keys,
                cfg.fetch_timeout,
                &done_tx,
            )?)
        }
        _ => CopyWorkers::thread(
            Arc::clone(&producer.arena),
            &keys,
            cfg.chunk_bytes,
            rate,
            offstep.then(|| producer.mgr.store_completion_sender()),
            done_tx.clone(),
        )?,
    };
    drop(done_tx);

    let progress = Arc::new(Progress::new(requests));
    let origin = Instant::now();
    let probe = StallProbe::start(origin)
        .map_err(|e| actor_err("probe", format!("cannot start the stall probe thread: {e}")))?;
    let engine = ProducerEngine {
        mgr: producer.mgr,
        keys: keys.clone(),
        arrivals: arrivals.clone(),
        origin,
        mode,
        step: cfg.producer_step,
        sched: cfg.sched_time,
        timeout: cfg.fetch_timeout,
        hold: cfg.hold_offstep_step_until_landed && offstep,
        progress: Arc::clone(&progress),
        workers,
        done: done_rx,
    };
    let busy = std::thread::Builder::new()
        .name("kvtier-bench-producer".into())
        .spawn(move || engine.run())
        .map_err(|e| actor_err("producer", format!("cannot start the producer thread: {e}")))?;
    let consumed = {
        let _done = ConsumerDone(Arc::clone(&progress));
        consume(
            cfg,
            mode,
            &mut consumer,
            &producer.p2p,
            &keys,
            &arrivals,
            origin,
            &progress,
        )
    };
    let joined = busy
        .join()
        .map_err(|_| actor_err("producer", "the producer thread panicked"))?;
    let machine = probe.finish();
    let measured = consumed?;
    let (mut mgr, periods, workers) = joined?;
    workers.finish()?;
    let stats = mgr.stats().map_err(|e| mgr_err(&e))?;
    mgr.shutdown().map_err(|e| mgr_err(&e))?;
    consumer.mgr.shutdown().map_err(|e| mgr_err(&e))?;
    // The manager owns the shared arena, whose file is removed when it drops: before the
    // directory holding it.
    drop(mgr);
    drop(producer.arena);
    drop(scratch);
    tiering_core::fetch_trace::enable(false);
    let trace = Trace::new(&tiering_core::fetch_trace::take(), origin, producer_waker);
    let mut split = timeline::timelines(&measured.seen, &progress.marks, &trace, machine.as_ref());
    let tail = TailSummary::of(&split);
    let rtt_in_stall = split
        .iter()
        .map(|t| (t.rtt_ms, t.machine_stall.is_some()))
        .collect();
    split.truncate(cfg.explain_slowest);
    Ok(ModeResult {
        mode,
        fetch_ms: Percentiles::of(&measured.fetches),
        lookup_ms: None,
        producer_step_ms: Percentiles::of(&periods),
        producer_steps_during_fetch: measured.during,
        fetches_waited: measured.waited,
        fetches_held_back: measured.held_back,
        off_step_store_completions: stats.manager.off_step_store_completions,
        slowest: split,
        tail,
        machine,
        rtt_in_stall,
    })
}

/// What the actors learn about each other without waiting.
struct Progress {
    /// Producer steps begun.
    producer_steps: AtomicU64,
    /// Per request: the producer step that started its store (0: not yet), published when that
    /// step ended.
    started_in: Vec<AtomicU64>,
    /// Fetches the consumer landed and verified.
    landed: AtomicUsize,
    /// The consumer returned (done, or failed).
    consumer_done: AtomicBool,
    /// What the per-fetch timelines are split with.
    marks: TimelineMarks,
}

impl Progress {
    fn new(requests: usize) -> Self {
        Self {
            producer_steps: AtomicU64::new(0),
            started_in: (0..requests).map(|_| AtomicU64::new(0)).collect(),
            landed: AtomicUsize::new(0),
            consumer_done: AtomicBool::new(false),
            marks: TimelineMarks::new(requests),
        }
    }
}

/// Marks the consumer done when it returns, also on error, so the producer stops.
struct ConsumerDone(Arc<Progress>);

impl Drop for ConsumerDone {
    fn drop(&mut self) {
        self.0.consumer_done.store(true, Ordering::Release);
    }
}

/// The producer's engine and its links to the other actors.
struct ProducerEngine {
    mgr: TieringManager,
    keys: Vec<Vec<OffloadKey>>,
    arrivals: Vec<Duration>,
    origin: Instant,
    mode: ControlPlaneMode,
    step: Duration,
    sched: Duration,
    timeout: Duration,
    hold: bool,
    progress: Arc<Progress>,
    workers: CopyWorkers,
    done: Receiver<CopyDone>,
}

type EngineOutcome = (TieringManager, Vec<f64>, CopyWorkers);

impl ProducerEngine {
    /// Steps until every request was started, stored and fetched (or the consumer gave up);
    /// returns the manager, the measured step periods (ms) and the copy workers.
    fn run(mut self) -> Result<EngineOutcome, BenchError> {
        let requests = self.keys.len();
        let ranks = self.workers.ranks();
        let lead = self.step + self.sched * 2;
        let mut ctxs: Vec<Option<ReqContext>> = vec![None; requests];
        let mut reported = vec![(0u32, true); requests];
        let mut periods = Vec::new();
        let mut last: Option<Instant> = None;
        let mut next = 0;
        let mut completed = 0;
        // The scheduling phase's own lookups: a waiting request's prefix, never stored.
        let waiting = ReqContext::local("bench-producer-waiting");
        let probe = OffloadKey::from_u64(u64::MAX);
        self.mgr
            .step()
            .on_new_request(&waiting)
            .map_err(|e| mgr_err(&e))?;
        loop {
            let begin = Instant::now();
            self.progress.marks.step_began(self.origin, begin);
            let index = self.progress.producer_steps.fetch_add(1, Ordering::AcqRel) + 1;
            let mut finished = Vec::new();
            while let Ok((i, _rank, ok, at)) = self.done.try_recv() {
                self.progress.marks.copy_finished(i, self.origin, at);
                let r = &mut reported[i];
                r.0 += 1;
                r.1 &= ok;
                if r.0 == ranks {
                    finished.push((i, r.1));
                }
            }
            let mut orders = Vec::new();
            {
                let mut s = self.mgr.step();
                for (i, ok) in finished {
                    let ctx = ctxs[i]
                        .take()
                        .ok_or_else(|| actor_err("producer", "a copy finished that was never ordered"))?;
                    s.complete_store(&self.keys[i], &ctx, ok)
                        .map_err(|e| mgr_err(&e))?;
                    s.on_request_finished(&ctx).map_err(|e| mgr_err(&e))?;
                    completed += 1;
                }
                let horizon = begin.saturating_duration_since(self.origin) + lead;
                while next < requests && self.arrivals[next] <= horizon {
                    let (ctx, order) = start_store(&mut s, self.mode, &self.keys[next], next)?;
                    ctxs[next] = Some(ctx);
                    orders.push(order);
                    next += 1;
                }
                // The rest of the scheduling phase: real manager calls, lock held.
                while begin.elapsed() < self.sched {
                    s.lookup(&probe, &waiting).map_err(|e| mgr_err(&e))?;
                }
                s.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;
            }
            self.progress.marks.sched_ended(self.origin, Instant::now());
            // The step ended: the copies start with the model, and the prefills are known.
            for o in &orders {
                self.workers.order(o)?;
                self.progress.started_in[o.request].store(index, Ordering::Release);
            }
            let now = Instant::now();
            if let Some(l) = last {
                periods.push(ms(now - l));
            }
            last = Some(now);
            if self.progress.consumer_done.load(Ordering::Acquire)
                && (completed == next || self.progress.landed.load(Ordering::Acquire) < requests)
            {
                // Every fetch landed and every store completed, or the consumer gave up.
                break;
            }
            // The model runs: no manager call at all.
            std::thread::sleep(self.step);
            if self.hold {
                self.wait_landed(next)?;
            }
        }
        self.mgr
            .step()
            .on_request_finished(&waiting)
            .map_err(|e| mgr_err(&e))?;
        Ok((self.mgr, periods, self.workers))
    }

    /// Test aid: the model step lasts until the fetches of the first `n` requests landed.
    fn wait_landed(&self, n: usize) -> Result<(), BenchError> {
        let since = Instant::now();
        while self.progress.landed.load(Ordering::Acquire) < n {
            if self.progress.consumer_done.load(Ordering::Acquire) {
                return Ok(());
            }
            if since.elapsed() > self.timeout {
                return Err(actor_err("producer", format!("fetches before {n} did not land")));
            }
            std::thread::sleep(CONSUMER_TICK);
        }
        Ok(())
    }
}

/// Starts request `i`'s store: `prepare_store` as a `remote_decoder` request.
fn start_store(
    s: &mut tiering_core::Step<'_>,
    mode: ControlPlaneMode,
    keys: &[OffloadKey],
    i: usize,
) -> Result<(ReqContext, CopyOrder), BenchError> {
    let mut params = serde_json::Map::new();
    params.insert(
        "remote_decoder".into(),
        serde_json::json!({ "kv_request_id": kv_name(mode, i) }),
    );
    let ctx = ReqContext::builder(RequestId::local(format!("prefill-{i}")))
        .params(params)
        .build();
    s.on_new_request(&ctx).map_err(|e| mgr_err(&e))?;
    let out = s
        .prepare_store(keys, &ctx)
        .map_err(|e| mgr_err(&e))?
        .ok_or_else(|| actor_err("cpu", "no room to store the producer's chunks"))?;
    if out.keys_to_store.len() != keys.len() {
        return Err(actor_err(
            "cpu",
            format!("request {i}: some chunks were stored already"),
        ));
    }
    Ok((
        ctx,
        CopyOrder {
            request: i,
            rows: out.chunk_ids,
        },
    ))
}

/// One fetch out.
struct InFlight {
    i: usize,
    ctx: ReqContext,
    sent_at: Instant,
    sent_in_sched: bool,
}

/// The consumer's engine: one decode request per producer store, sent at its arrival time.
#[allow(clippy::too_many_arguments)]
fn consume(
    cfg: &FetchRttConfig,
    mode: ControlPlaneMode,
    consumer: &mut Node,
    from: &tier_p2p::P2pHandle,
    keys: &[Vec<OffloadKey>],
    arrivals: &[Duration],
    origin: Instant,
    progress: &Progress,
) -> Result<Measured, BenchError> {
    let requests = keys.len();
    let mut m = Measured::default();
    let mut inflight: Vec<InFlight> = Vec::new();
    let mut next = 0;
    let mut landed = 0;
    let mut waited_before = 0;
    let mut held_since: Option<Instant> = None;
    let mgr = &mut consumer.mgr;
    let mut last_step = Instant::now();
    while landed < requests {
        // A decoder with nothing in flight has nothing to step for until its next request
        // arrives; one waiting on fetches polls them every tick. (Ticking all the time would
        // keep a core of this 2-actor bench busy with empty steps and slow everyone else.)
        let idle_until = (inflight.is_empty() && held_since.is_none())
            .then(|| arrivals.get(next).map(|&a| a.saturating_sub(origin.elapsed())))
            .flatten();
        std::thread::sleep(idle_until.map_or(CONSUMER_TICK, |d| d.clamp(CONSUMER_TICK, IDLE_TICK)));
        let mut step = mgr.step();
        let this_step = Instant::now();
        let poll_gap = this_step - last_step;
        last_step = this_step;
        let mut still = Vec::with_capacity(inflight.len());
        for f in inflight.drain(..) {
            let batch = &keys[f.i];
            let mut all_hit = true;
            for k in batch {
                match step.lookup(k, &f.ctx).map_err(|e| mgr_err(&e))? {
                    LookupResult::Hit => {}
                    LookupResult::HitPending | LookupResult::Retry => all_hit = false,
                    LookupResult::Miss => {
                        return Err(actor_err(
                            "p2p",
                            format!("fetch {}: chunk {k} failed to arrive", f.i),
                        ));
                    }
                }
            }
            if !all_hit {
                if f.sent_at.elapsed() > cfg.fetch_timeout {
                    return Err(actor_err(
                        "p2p",
                        format!("fetch {} did not land within {:?}", f.i, cfg.fetch_timeout),
                    ));
                }
                still.push(f);
                continue;
            }
            let landed_at = Instant::now();
            let rtt = ms(landed_at - f.sent_at);
            let steps_now = progress.producer_steps.load(Ordering::Acquire);
            let started_in = progress.started_in[f.i].load(Ordering::Acquire);
            // Loaded in the same step that saw the hits (a hit is resident until it ends).
            let rows = step.prepare_load(batch, &f.ctx).map_err(|e| mgr_err(&e))?;
            for (k, &c) in batch.iter().zip(&rows) {
                if !chunk_matches(k, &consumer.arena.read_row(c)?) {
                    return Err(actor_err(
                        "p2p",
                        format!("fetch {}: chunk {k} arrived with different bytes", f.i),
                    ));
                }
            }
            step.complete_load(batch, &f.ctx).map_err(|e| mgr_err(&e))?;
            step.on_request_finished(&f.ctx).map_err(|e| mgr_err(&e))?;
            landed += 1;
            progress.landed.fetch_add(1, Ordering::AcqRel);
            if f.i == 0 {
                waited_before = tier_p2p::P2pCounters::get(&from.counters().fetches_waited);
            } else {
                m.fetches.push(rtt);
                m.during.push(steps_now.saturating_sub(started_in));
                m.seen.push(FetchSeen {
                    i: f.i,
                    trace_id: tiering_core::fetch_trace::id_of(&kv_name(mode, f.i)),
                    sent_ns: nanos_since(origin, f.sent_at),
                    landed_ns: nanos_since(origin, landed_at),
                    sent_in_sched: f.sent_in_sched,
                    poll_gap,
                });
            }
        }
        inflight = still;
        let mut sent = Vec::new();
        let elapsed = origin.elapsed();
        while next < requests && arrivals[next] <= elapsed {
            if progress.started_in[next].load(Ordering::Acquire) == 0 {
                // Due, but the producer has not started this prefill's store yet.
                let since = *held_since.get_or_insert_with(Instant::now);
                if since.elapsed() > cfg.fetch_timeout {
                    return Err(actor_err("producer", format!("store {next} never started")));
                }
                break;
            }
            if held_since.take().is_some() && next > 0 {
                m.held_back += 1;
            }
            let ctx = ReqContext::builder(RequestId::local(format!("decode-{next}")))
                .params(source_params("remote_prefiller", &kv_name(mode, next), from))
                .build();
            step.on_new_request(&ctx).map_err(|e| mgr_err(&e))?;
            for k in &keys[next] {
                match step.lookup(k, &ctx).map_err(|e| mgr_err(&e))? {
                    LookupResult::HitPending | LookupResult::Hit => {}
                    other => {
                        return Err(actor_err(
                            "p2p",
                            format!("fetch {next}: chunk {k} was not offered ({other:?})"),
                        ));
                    }
                }
            }
            sent.push((next, ctx));
            next += 1;
        }
        // This step end submits the promotions: the new fetches leave now.
        step.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;
        drop(step);
        let sent_at = Instant::now();
        let sent_in_sched = progress.marks.producer_in_sched();
        inflight.extend(sent.into_iter().map(|(i, ctx)| InFlight {
            i,
            ctx,
            sent_at,
            sent_in_sched,
        }));
    }
    m.waited = tier_p2p::P2pCounters::get(&from.counters().fetches_waited) - waited_before;
    Ok(m)
}

/// What the consumer measured (the warm-up fetch excluded).
#[derive(Default)]
struct Measured {
    /// Fetch round trips, ms.
    fetches: Vec<f64>,
    /// Per fetch: producer steps begun after the one that started its store, before it landed.
    during: Vec<u64>,
    /// Fetches that waited on the producer for their chunks.
    waited: u64,
    /// Fetches sent later than their arrival because the producer had not started the store.
    held_back: u64,
    /// What the consumer saw of each measured fetch, for the timelines.
    seen: Vec<FetchSeen>,
}
