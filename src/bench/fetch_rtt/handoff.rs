//! The hand-off flow (prefill→decode): the consumer's fetch leaves before the producer's store
//! of those chunks completed.
//!
//! Three actors per mode, on their own threads:
//! - the producer's engine: each step completes the stores whose copy finished since its last
//!   step (the engine learns of them there), finishes those requests, starts the next request
//!   once the consumer landed every earlier fetch (a `remote_decoder` request: `prepare_store`,
//!   then the copy order), ends the step, and runs the model for the step time with no manager
//!   call;
//! - the producer's copy worker: fills the rows, waits until the consumer's fetch for them
//!   left, copies for the copy time more, then — in `thread+offstep` — reports the store
//!   through the manager's `StoreCompletionSender`, and tells the engine;
//! - the consumer's engine (the calling thread): as soon as a store started, a
//!   `remote_prefiller` request for it: lookups (`HitPending`), the step end that sends the
//!   fetch, then a step every 50 µs until every chunk is a `Hit`; the bytes are verified.
//!
//! The first fetch of each mode is a warm-up (it carries the session's handshake) and is not
//! measured.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tiering_core::manager::StoreCompletionSender;
use tiering_core::{
    ChunkArena, ChunkId, LookupResult, OffloadKey, OffloadingManager, ReqContext, RequestId, TieringManager,
};

use super::{ControlPlaneMode, FetchRttConfig, ModeResult, Node, end, mgr_err, ms, node, source_params};
use crate::bench::BenchError;
use crate::sim::{Percentiles, SimRng, chunk_matches, fill_chunk};

/// How often the consumer steps while its fetch is out.
const CONSUMER_TICK: Duration = Duration::from_micros(50);

/// One store for the copy worker.
struct CopyOrder {
    keys: Vec<OffloadKey>,
    rows: Vec<ChunkId>,
}

fn actor_err(actor: &str, message: impl Into<String>) -> BenchError {
    BenchError::Tier {
        tier: actor.to_owned(),
        message: message.into(),
    }
}

fn recv<T>(rx: &Receiver<T>, timeout: Duration, actor: &str, what: &str) -> Result<T, BenchError> {
    rx.recv_timeout(timeout).map_err(|e| match e {
        RecvTimeoutError::Timeout => actor_err(actor, format!("{what} did not come within {timeout:?}")),
        RecvTimeoutError::Disconnected => {
            actor_err(actor, format!("{what} will never come: its sender stopped"))
        }
    })
}

fn kv_name(mode: ControlPlaneMode, i: usize) -> String {
    format!("bench-handoff-{mode}-{i}")
}

pub(super) fn run(cfg: &FetchRttConfig, mode: ControlPlaneMode) -> Result<ModeResult, BenchError> {
    let requests = cfg.fetches + 1;
    let rows = requests * cfg.chunks_per_fetch + 8;
    let producer = node(cfg, mode.manager_config(), rows)?;
    let mut consumer = node(cfg, ControlPlaneMode::Thread.manager_config(), rows)?;
    let reporter = (mode == ControlPlaneMode::ThreadOffStep).then(|| producer.mgr.store_completion_sender());
    let mut rng = SimRng::new(u64::from(std::process::id()) ^ (mode as u64) << 40);
    let keys: Vec<Vec<OffloadKey>> = (0..requests)
        .map(|_| {
            (0..cfg.chunks_per_fetch)
                .map(|_| OffloadKey::from_u64(rng.next_u64()))
                .collect()
        })
        .collect();
    let progress = Arc::new(Progress::default());
    let (started_tx, started_rx) = mpsc::channel::<usize>();
    let (sent_tx, sent_rx) = mpsc::channel::<()>();
    let (order_tx, order_rx) = mpsc::channel::<CopyOrder>();
    let (copied_tx, copied_rx) = mpsc::channel::<bool>();
    let copier = spawn_copier(
        Arc::clone(&producer.arena),
        cfg,
        reporter,
        order_rx,
        sent_rx,
        copied_tx,
    )?;
    let engine = ProducerEngine {
        mgr: producer.mgr,
        keys: keys.clone(),
        mode,
        step: cfg.producer_step,
        timeout: cfg.fetch_timeout,
        hold: cfg.hold_offstep_step_until_landed && mode == ControlPlaneMode::ThreadOffStep,
        progress: Arc::clone(&progress),
        started: started_tx,
        orders: order_tx,
        copied: copied_rx,
    };
    let busy = std::thread::Builder::new()
        .name("kvtier-bench-producer".into())
        .spawn(move || engine.run())
        .map_err(|e| actor_err("producer", format!("cannot start the producer thread: {e}")))?;
    // The consumer's links drop when it returns, so a failed consumer stops the others too.
    let consumed = consume(
        cfg,
        mode,
        &mut consumer,
        &producer.p2p,
        &keys,
        Links {
            started: started_rx,
            sent: sent_tx,
            progress,
        },
    );
    let joined = busy
        .join()
        .map_err(|_| actor_err("producer", "the producer thread panicked"))?;
    let copied = copier
        .join()
        .map_err(|_| actor_err("copier", "the copy thread panicked"));
    let measured = consumed?;
    let (mut mgr, periods) = joined?;
    copied?;
    let stats = mgr.stats().map_err(|e| mgr_err(&e))?;
    mgr.shutdown().map_err(|e| mgr_err(&e))?;
    consumer.mgr.shutdown().map_err(|e| mgr_err(&e))?;
    Ok(ModeResult {
        mode,
        fetch_ms: Percentiles::of(&measured.fetches),
        lookup_ms: None,
        producer_step_ms: Percentiles::of(&periods),
        producer_steps_during_fetch: measured.during,
        fetches_waited: measured.waited,
        off_step_store_completions: stats.manager.off_step_store_completions,
    })
}

fn spawn_copier(
    arena: Arc<ChunkArena>,
    cfg: &FetchRttConfig,
    reporter: Option<StoreCompletionSender>,
    orders: Receiver<CopyOrder>,
    sent: Receiver<()>,
    copied: Sender<bool>,
) -> Result<JoinHandle<()>, BenchError> {
    let copy_time = cfg.copy_time;
    let timeout = cfg.fetch_timeout;
    std::thread::Builder::new()
        .name("kvtier-bench-copy".into())
        .spawn(move || {
            for order in orders {
                let mut ok = true;
                for (k, &c) in order.keys.iter().zip(&order.rows) {
                    match arena.write_row(c) {
                        Ok(mut row) => fill_chunk(k, &mut row),
                        Err(e) => {
                            tracing::error!(error = %e, "bench copy worker cannot write its row");
                            ok = false;
                        }
                    }
                }
                // The flow under test: the consumer's fetch leaves before this store completes.
                if sent.recv_timeout(timeout).is_err() {
                    return;
                }
                std::thread::sleep(copy_time);
                if let Some(r) = &reporter {
                    r.report(&order.keys, ok);
                }
                if copied.send(ok).is_err() {
                    return;
                }
            }
        })
        .map_err(|e| actor_err("copier", format!("cannot start the copy thread: {e}")))
}

/// The producer's engine and its links to the other actors.
struct ProducerEngine {
    mgr: TieringManager,
    keys: Vec<Vec<OffloadKey>>,
    mode: ControlPlaneMode,
    step: Duration,
    timeout: Duration,
    hold: bool,
    progress: Arc<Progress>,
    started: Sender<usize>,
    orders: Sender<CopyOrder>,
    copied: Receiver<bool>,
}

impl ProducerEngine {
    /// Steps until every request was started, stored and fetched (or the consumer gave up);
    /// returns the manager and the measured step periods (ms).
    ///
    /// A request starts only once the consumer landed every earlier fetch, so each fetch leaves
    /// right after its `prepare_store`, at the start of a model step. The engine never waits
    /// for its copy worker: a store completes at the first step after its copy finished.
    fn run(self) -> Result<(TieringManager, Vec<f64>), BenchError> {
        let mut periods = Vec::new();
        let mut last: Option<Instant> = None;
        let mut pending: VecDeque<(ReqContext, Vec<OffloadKey>)> = VecDeque::new();
        let requests = self.keys.len();
        let mut next = 0;
        loop {
            // A step begins: the engine collects the copies finished since its last step.
            let mut finished = Vec::new();
            while let Ok(ok) = self.copied.try_recv() {
                finished.push(ok);
            }
            self.progress.producer_steps.fetch_add(1, Ordering::AcqRel);
            let mut step = self.mgr.detached_step();
            for ok in finished {
                let (ctx, stored) = pending
                    .pop_front()
                    .ok_or_else(|| actor_err("producer", "a copy finished that was never ordered"))?;
                step.complete_store(&stored, &ctx, ok).map_err(|e| mgr_err(&e))?;
                step.on_request_finished(&ctx).map_err(|e| mgr_err(&e))?;
            }
            let started = next < requests && self.progress.landed.load(Ordering::Acquire) == next;
            if started {
                pending.push_back(self.start_store(&mut step, next)?);
                next += 1;
            }
            step.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;
            // The step ends before the model runs.
            drop(step);
            let now = Instant::now();
            if let Some(l) = last {
                periods.push(ms(now - l));
            }
            last = Some(now);
            if self.progress.consumer_done.load(Ordering::Acquire)
                && (pending.is_empty() || self.progress.landed.load(Ordering::Acquire) < requests)
            {
                // Every fetch landed and every store completed, or the consumer gave up.
                break;
            }
            // The model runs: no manager call at all.
            std::thread::sleep(self.step);
            if self.hold && started {
                self.wait_landed(next)?;
            }
        }
        Ok((self.mgr, periods))
    }

    /// Test aid: the model step lasts until `n` fetches landed.
    fn wait_landed(&self, n: usize) -> Result<(), BenchError> {
        let since = Instant::now();
        while self.progress.landed.load(Ordering::Acquire) < n {
            if self.progress.consumer_done.load(Ordering::Acquire) {
                return Ok(());
            }
            if since.elapsed() > self.timeout {
                return Err(actor_err("producer", format!("fetch {} did not land", n - 1)));
            }
            std::thread::sleep(CONSUMER_TICK);
        }
        Ok(())
    }

    /// Starts request `i`'s store: `prepare_store`, the copy order, and the consumer's cue.
    fn start_store(
        &self,
        m: &mut tiering_core::Step<'_>,
        i: usize,
    ) -> Result<(ReqContext, Vec<OffloadKey>), BenchError> {
        let mut params = serde_json::Map::new();
        params.insert(
            "remote_decoder".into(),
            serde_json::json!({ "kv_request_id": kv_name(self.mode, i) }),
        );
        let ctx = ReqContext::builder(RequestId::local(format!("prefill-{i}")))
            .params(params)
            .build();
        m.on_new_request(&ctx).map_err(|e| mgr_err(&e))?;
        let out = m
            .prepare_store(&self.keys[i], &ctx)
            .map_err(|e| mgr_err(&e))?
            .ok_or_else(|| actor_err("cpu", "no room to store the producer's chunks"))?;
        let order = CopyOrder {
            keys: out.keys_to_store.clone(),
            rows: out.chunk_ids,
        };
        self.orders
            .send(order)
            .map_err(|_| actor_err("producer", "the copy worker stopped"))?;
        self.started
            .send(i)
            .map_err(|_| actor_err("producer", "the consumer stopped"))?;
        Ok((ctx, out.keys_to_store))
    }
}

/// What the producer's engine learns about the others without waiting for them.
#[derive(Default)]
struct Progress {
    /// Producer steps begun (counted when a step collects its finished copies).
    producer_steps: AtomicU64,
    /// Fetches the consumer landed and verified.
    landed: AtomicUsize,
    /// The consumer returned (done, or failed).
    consumer_done: AtomicBool,
}

/// The consumer's ends of the signals. Dropping them (the consumer returned) tells the others.
struct Links {
    started: Receiver<usize>,
    sent: Sender<()>,
    progress: Arc<Progress>,
}

impl Drop for Links {
    fn drop(&mut self) {
        self.progress.consumer_done.store(true, Ordering::Release);
    }
}

/// The consumer's engine: one decode request per producer store.
#[expect(
    clippy::needless_pass_by_value,
    reason = "the links drop when the consumer returns: that is what tells the other actors"
)]
fn consume(
    cfg: &FetchRttConfig,
    mode: ControlPlaneMode,
    consumer: &mut Node,
    from: &tier_p2p::P2pHandle,
    keys: &[Vec<OffloadKey>],
    links: Links,
) -> Result<Measured, BenchError> {
    let mut fetches = Vec::new();
    let mut during = Vec::new();
    let mut waited_before = 0;
    let mgr = &mut consumer.mgr;
    for (i, batch) in keys.iter().enumerate() {
        let started = recv(
            &links.started,
            cfg.fetch_timeout,
            "consumer",
            "the producer's store",
        )?;
        if started != i {
            return Err(actor_err(
                "consumer",
                format!("expected store {i}, the producer started {started}"),
            ));
        }
        let kv = kv_name(mode, i);
        let ctx = ReqContext::builder(RequestId::local(format!("decode-{i}")))
            .params(source_params("remote_prefiller", &kv, from))
            .build();
        {
            let mut step = mgr.step();
            step.on_new_request(&ctx).map_err(|e| mgr_err(&e))?;
            for k in batch {
                match step.lookup(k, &ctx).map_err(|e| mgr_err(&e))? {
                    LookupResult::HitPending | LookupResult::Hit => {}
                    other => {
                        return Err(actor_err(
                            "p2p",
                            format!("fetch {i}: chunk {k} was not offered ({other:?})"),
                        ));
                    }
                }
            }
            // This step end submits the promotion: the fetch leaves now.
            step.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;
        }
        let sent_at = Instant::now();
        let steps = &links.progress.producer_steps;
        let steps_then = steps.load(Ordering::Acquire);
        links
            .sent
            .send(())
            .map_err(|_| actor_err("consumer", "the copy worker stopped"))?;
        let (rtt, mut step) = loop {
            std::thread::sleep(CONSUMER_TICK);
            let mut step = mgr.step();
            let mut all_hit = true;
            for k in batch {
                match step.lookup(k, &ctx).map_err(|e| mgr_err(&e))? {
                    LookupResult::Hit => {}
                    LookupResult::HitPending | LookupResult::Retry => all_hit = false,
                    LookupResult::Miss => {
                        return Err(actor_err("p2p", format!("fetch {i}: chunk {k} failed to arrive")));
                    }
                }
            }
            if all_hit {
                // Loaded in the same step that saw the hits (a hit is resident until it ends).
                break (ms(sent_at.elapsed()), step);
            }
            step.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;
            drop(step);
            if sent_at.elapsed() > cfg.fetch_timeout {
                return Err(actor_err(
                    "p2p",
                    format!("fetch {i} did not land within {:?}", cfg.fetch_timeout),
                ));
            }
        };
        let steps_during = steps.load(Ordering::Acquire) - steps_then;
        let rows = step.prepare_load(batch, &ctx).map_err(|e| mgr_err(&e))?;
        for (k, &c) in batch.iter().zip(&rows) {
            if !chunk_matches(k, &consumer.arena.read_row(c)?) {
                return Err(actor_err(
                    "p2p",
                    format!("fetch {i}: chunk {k} arrived with different bytes"),
                ));
            }
        }
        step.complete_load(batch, &ctx).map_err(|e| mgr_err(&e))?;
        step.on_request_finished(&ctx).map_err(|e| mgr_err(&e))?;
        step.on_schedule_end(&end()).map_err(|e| mgr_err(&e))?;
        drop(step);
        if i == 0 {
            waited_before = tier_p2p::P2pCounters::get(&from.counters().fetches_waited);
        }
        links.progress.landed.fetch_add(1, Ordering::AcqRel);
        if i > 0 {
            fetches.push(rtt);
            during.push(steps_during);
        }
    }
    let waited = tier_p2p::P2pCounters::get(&from.counters().fetches_waited) - waited_before;
    Ok(Measured {
        fetches,
        during,
        waited,
    })
}

/// What the consumer measured (the warm-up fetch excluded).
struct Measured {
    /// Fetch round trips, ms.
    fetches: Vec<f64>,
    /// Producer steps begun during each fetch.
    during: Vec<u64>,
    /// Fetches that waited on the producer for their chunks.
    waited: u64,
}
