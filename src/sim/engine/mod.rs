//! The simulated engine: a scheduler loop that drives the manager in a connector's call order.
//!
//! Per step:
//! 1. arrivals (`on_new_request`);
//! 2. (a) finished device copies → `complete_store` / `complete_load`;
//! 3. (b) scheduling: waiting requests are scanned — device prefix cache first, then `lookup`
//!    chunk by chunk (Hit counts; HitPending counts and defers; Retry defers but keeps
//!    scanning; Miss stops), `touch`, and `prepare_load` for hits; an admitted request starts
//!    its prefill in this step, its hits loading while the model runs;
//! 4. (c) `prepare_store` for chunks computed last step, `on_request_finished` for requests
//!    that finished, then `on_schedule_end` — the last manager call of the step;
//! 5. (d) the model "runs" for its modelled time while the copy worker moves bytes and the
//!    manager's control thread sweeps. A request's loads land within the step that prefills
//!    it, as with a connector whose layer-wise loads overlap the forward pass: the step lasts
//!    at least the loads' transfer time on the device link (`SimConfig::device_link_bandwidth`)
//!    and the model waits for the copies before it counts the loaded chunks, recomputing the
//!    chunks of a load that failed. (Loading in a later step instead would cost every request
//!    with a hit one whole step, more than recomputing a short prefix.)

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use tiering_core::{LookupResult, OffloadKey, OffloadPolicy, ReqContext, RequestId, ScheduleEndContext};

use super::config::SimConfig;
use super::copier::{Copier, CopyDone, CopyJob, CopyKind};
use super::cpu_clock::thread_cpu_time;
use super::device::{DeviceMemory, DevicePool};
use super::error::SimError;
use super::hash::{chunk_keys, fill_chunk};
use super::metrics::RunMetrics;
use super::offload::{Offload, Source};
use super::workload::{RequestSpec, Workload};

mod model;
mod schedule;
mod store;
mod wait_payoff;

use wait_payoff::WaitPayoff;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    NotArrived,
    Waiting,
    Running,
    Finishing,
    Done,
}

struct Req {
    ctx: ReqContext,
    keys: Vec<OffloadKey>,
    prompt_len: usize,
    output_len: usize,
    arrival: f64,
    /// Chunks a prefix hit may cover: the last prompt token is always recomputed.
    hit_limit: usize,
    blocks: Vec<u32>,
    device_hits: usize,
    /// Source of each chunk loaded from the chain, in prefix order after the device hits.
    loaded: Vec<Source>,
    kv_tokens: usize,
    generated: usize,
    stored_upto: usize,
    policy: OffloadPolicy,
    /// When the request first waited for a lookup or promotion (simulated clock).
    waiting_since: Option<f64>,
    /// The leading hits when it first waited: a wait paid off if the request loads more.
    hits_before_wait: usize,
    scheduled: bool,
    phase: Phase,
}

struct Job {
    req: usize,
    kind: CopyKind,
    keys: Vec<OffloadKey>,
    blocks: Vec<u32>,
    /// When the copy is done on the simulated clock: its transfer on the modelled device link,
    /// after the copies submitted before it in the same direction.
    due: f64,
}

/// The context of a local request `id`; with `source` (`HOST:PORT`), it names that peer as the
/// request's `remote_kv_source` (probed by a p2p tier for the chunks it misses locally).
fn request_context(id: String, source: Option<&str>) -> ReqContext {
    let Some((host, port)) = source.and_then(|s| s.rsplit_once(':')) else {
        return ReqContext::local(id);
    };
    let mut params = serde_json::Map::new();
    params.insert(
        "remote_kv_source".into(),
        serde_json::json!({ "kv_request_id": id, "host": host, "port": port }),
    );
    ReqContext::builder(tiering_core::RequestId::local(id))
        .params(params)
        .build()
}

/// Blocks a request of `tokens` tokens occupies.
fn blocks_for(tokens: usize, tokens_per_chunk: usize) -> usize {
    tokens.div_ceil(tokens_per_chunk)
}

/// Whether the engine can run every request of `workload` under `cfg`: there is a request, each
/// has a prompt and an output, and each fits the device's blocks whole.
///
/// # Errors
/// An empty workload, a request with an empty prompt or output, or one too large for the device.
pub(crate) fn check_workload(cfg: &SimConfig, workload: &Workload) -> Result<(), SimError> {
    if workload.requests.is_empty() {
        return Err(SimError::EmptyWorkload);
    }
    for r in &workload.requests {
        if r.prompt.is_empty() || r.output.is_empty() {
            return Err(SimError::InvalidSetting {
                name: "workload",
                reason: format!("request {} has an empty prompt or output", r.name),
            });
        }
        let needed = blocks_for(r.prompt.len() + r.output.len(), cfg.tokens_per_chunk);
        if needed > cfg.device_blocks {
            return Err(SimError::RequestTooLarge {
                request: r.name.clone(),
                needed,
                available: cfg.device_blocks,
            });
        }
    }
    Ok(())
}

/// One run of the engine over a workload, with or without a manager.
pub(crate) struct Engine<'a> {
    cfg: &'a SimConfig,
    tpc: usize,
    reqs: Vec<Req>,
    device: DevicePool,
    memory: Arc<DeviceMemory>,
    off: Option<Offload>,
    copier: Option<Copier>,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
    finishing: Vec<usize>,
    /// Load jobs of this step's prefills, not landed yet: the model waits for them.
    step_loads: Vec<u64>,
    /// Copies the model already waited for this step; the manager hears of them next step.
    landed: Vec<CopyDone>,
    /// How often waiting for lookups or promotions served more chunks.
    wait_payoff: WaitPayoff,
    /// When the modelled device link is free again, per direction (loads, stores).
    link_free: [f64; 2],
    prefill_now: Vec<usize>,
    new_this_step: Vec<RequestId>,
    next_arrival: usize,
    now: f64,
    /// The model time of the step launched last, still running when the next step is
    /// scheduled (asynchronous scheduling; zero otherwise and after an idle step).
    model_in_flight: Duration,
    next_job: u64,
    jobs: HashMap<u64, Job>,
    outbox: Vec<CopyJob>,
    done: usize,
    m: RunMetrics,
    progress: Option<&'a ProgressBar>,
}

impl<'a> Engine<'a> {
    /// An engine over `specs`; `off` is the manager side (`None` runs with offloading off).
    pub(crate) fn new(
        cfg: &'a SimConfig,
        specs: &'a [RequestSpec],
        off: Option<Offload>,
        progress: Option<&'a ProgressBar>,
    ) -> Result<Self, SimError> {
        let tpc = cfg.tokens_per_chunk;
        let blocks = u32::try_from(cfg.device_blocks).map_err(|_| SimError::InvalidSetting {
            name: "device_blocks",
            reason: "does not fit in 32 bits".into(),
        })?;
        let memory = Arc::new(DeviceMemory::new(cfg.device_blocks, cfg.chunk_bytes));
        let mut off = off;
        let copier = match &mut off {
            Some(o) => Some(Copier::start(
                Arc::clone(o.arena()),
                Arc::clone(&memory),
                cfg.verify_loads,
                o.completion_sender(),
            )?),
            None => None,
        };
        let reqs = specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut tokens = s.prompt.to_vec();
                tokens.extend_from_slice(&s.output);
                let ctx = request_context(format!("{i}:{}", s.name), cfg.remote_kv_source.as_deref());
                let keys = chunk_keys(&tokens, tpc, 0);
                // End-token positions let a tier recover prefix order (request-scoped recency).
                for (c, k) in keys.iter().enumerate() {
                    ctx.set_key_position(*k, ((c + 1) * tpc) as u64);
                }
                Req {
                    ctx,
                    keys,
                    prompt_len: s.prompt.len(),
                    output_len: s.output.len(),
                    arrival: s.arrival,
                    hit_limit: s.prompt.len().saturating_sub(1) / tpc,
                    blocks: Vec::new(),
                    device_hits: 0,
                    loaded: Vec::new(),
                    kv_tokens: 0,
                    generated: 0,
                    stored_upto: 0,
                    policy: OffloadPolicy::ChunkLevel,
                    waiting_since: None,
                    hits_before_wait: 0,
                    scheduled: false,
                    phase: Phase::NotArrived,
                }
            })
            .collect();
        Ok(Self {
            cfg,
            tpc,
            reqs,
            device: DevicePool::new(blocks),
            memory,
            off,
            copier,
            waiting: VecDeque::new(),
            running: Vec::new(),
            finishing: Vec::new(),
            step_loads: Vec::new(),
            landed: Vec::new(),
            link_free: [0.0; 2],
            wait_payoff: WaitPayoff::default(),
            prefill_now: Vec::new(),
            new_this_step: Vec::new(),
            next_arrival: 0,
            now: 0.0,
            model_in_flight: Duration::ZERO,
            next_job: 0,
            jobs: HashMap::new(),
            outbox: Vec::new(),
            done: 0,
            m: RunMetrics::default(),
            progress,
        })
    }

    /// Runs every request to completion, drains the tiers, checks for leaks and shuts the
    /// manager down.
    pub(crate) fn run(mut self) -> Result<(RunMetrics, Option<Offload>), SimError> {
        let start = Instant::now();
        let mut last_progress = Instant::now();
        while self.done < self.reqs.len() {
            // The scheduler's own work is its CPU time: not the time it spends preempted on a
            // busy machine, nor waiting for copies the simulated clock says are done.
            let step_start = thread_cpu_time();
            let mut progressed = self.arrivals()?;
            progressed |= self.apply_copies()?;
            progressed |= self.schedule()?;
            progressed |= self.stores_and_finishes()?;
            self.end_schedule()?;
            let attribution = self
                .off
                .as_mut()
                .map_or(Duration::ZERO, Offload::take_attribution_cpu);
            let scheduling = self.cfg.scheduler_time(
                thread_cpu_time()
                    .saturating_sub(step_start)
                    .saturating_sub(attribution),
            );
            let (worked, cost) = self.execute_model(scheduling)?;

            progressed |= worked;
            self.m.steps += 1;
            self.now += cost.as_secs_f64();
            if let Some(p) = self.progress {
                p.set_position(self.done as u64);
            }
            if self.idle() && self.next_arrival < self.reqs.len() {
                // Nothing to do until the next arrival: skip the gap instead of sleeping it
                // (the model still in flight runs on through it).
                let arrival = self.reqs[self.next_arrival].arrival;
                if arrival > self.now {
                    let gap = Duration::try_from_secs_f64(arrival - self.now).unwrap_or(Duration::MAX);
                    self.model_in_flight = self.model_in_flight.saturating_sub(gap);
                    self.now = arrival;
                }
            }
            if progressed {
                last_progress = Instant::now();
            } else if last_progress.elapsed() > self.cfg.drain_timeout {
                return Err(SimError::Stalled(format!(
                    "no request made progress for {:?}: {} waiting, {} copy jobs outstanding, \
                     {} of {} device blocks free",
                    self.cfg.drain_timeout,
                    self.waiting.len(),
                    self.copier.as_ref().map_or(0, Copier::outstanding),
                    self.device.free_blocks(),
                    self.cfg.device_blocks
                )));
            }
        }
        // The last step's model ends the run.
        self.now += std::mem::take(&mut self.model_in_flight).as_secs_f64();
        self.drain()?;
        self.m.wall = start.elapsed();
        self.m.simulated = self.now;
        self.m.leaked_device_blocks = self.device.referenced_blocks() as u64;
        if let Some(off) = &mut self.off {
            self.m.leaked_arena_rows = off.arena().granted_rows() as u64;
            self.m.lookups = off.lookups;
            self.m.events = off.events;
            let stats = off.stats()?;
            self.m.primary_lookups = Offload::primary_lookups(&stats, off.primary_lookups_at_start());
        }
        if let Some(c) = &mut self.copier {
            c.stop();
        }
        Ok((self.m, self.off))
    }

    fn idle(&self) -> bool {
        self.waiting.is_empty()
            && self.running.is_empty()
            && self.finishing.is_empty()
            && self.copier.as_ref().is_none_or(|c| c.outstanding() == 0)
    }

    fn arrivals(&mut self) -> Result<bool, SimError> {
        let mut any = false;
        while self.next_arrival < self.reqs.len() && self.reqs[self.next_arrival].arrival <= self.now {
            let r = self.next_arrival;
            self.next_arrival += 1;
            let req = &mut self.reqs[r];
            req.phase = Phase::Waiting;
            if let Some(off) = &mut self.off {
                req.policy = off.on_new_request(&req.ctx)?;
            }
            self.m.prompt_tokens += req.prompt_len as u64;
            self.waiting.push_back(r);
            any = true;
        }
        Ok(any)
    }

    // ----- (a) finished device copies -----------------------------------------------------

    fn apply_copies(&mut self) -> Result<bool, SimError> {
        let Some(copier) = &mut self.copier else {
            return Ok(false);
        };
        let mut done = std::mem::take(&mut self.landed);
        copier.collect(&mut done)?;
        // A copy due on the simulated clock has finished on the modelled link: wait for the
        // worker's real bytes, so how busy this machine is does not decide when blocks free up.
        let deadline = Instant::now() + self.cfg.drain_timeout;
        loop {
            let now = self.now;
            let overdue = self
                .jobs
                .iter()
                .filter(|(id, j)| j.due <= now && !done.iter().any(|d| d.id == **id))
                .count();
            if overdue == 0 {
                break;
            }
            if Instant::now() > deadline {
                return Err(SimError::Stalled(format!(
                    "{overdue} device copies did not finish within {:?}",
                    self.cfg.drain_timeout
                )));
            }
            if let Some(d) = copier.wait_one(Duration::from_millis(50))? {
                done.push(d);
            }
        }
        let any = !done.is_empty();
        for d in done {
            self.apply_copy(&d)?;
        }
        Ok(any)
    }

    fn apply_copy(&mut self, d: &CopyDone) -> Result<(), SimError> {
        let job = self
            .jobs
            .remove(&d.id)
            .ok_or_else(|| SimError::Worker(format!("the copy thread reported unknown job {}", d.id)))?;
        let Some(off) = &mut self.off else {
            return Ok(());
        };
        self.m.copy_jobs_completed += 1;
        if !d.ok {
            self.m.copy_jobs_failed += 1;
            tracing::warn!(job = d.id, kind = ?d.kind, error = d.error.as_deref().unwrap_or(""), "device copy failed");
        }
        self.m.corrupt_chunks += d.corrupt as u64;
        let req = &mut self.reqs[job.req];
        match job.kind {
            CopyKind::Store => {
                off.complete_store(&job.keys, &req.ctx, d.ok)?;
                if d.ok {
                    self.m.store_chunks += job.keys.len() as u64;
                    self.m.bytes_device_to_primary += d.bytes;
                }
                for &b in &job.blocks {
                    self.device.release(b);
                }
            }
            CopyKind::Load => {
                // The model already used (or recomputed) the chunks when the copy landed.
                off.complete_load(&job.keys, &req.ctx)?;
                if d.ok {
                    self.m.load_chunks += job.keys.len() as u64;
                    self.m.bytes_primary_to_device += d.bytes;
                }
            }
        }
        Ok(())
    }

    /// A load of this step's prefills landed: its blocks hold the chunks (or, when the copy
    /// failed, the model recomputes them in this step).
    fn land_load(&mut self, d: &CopyDone) {
        let Some(job) = self.jobs.get(&d.id) else {
            return;
        };
        let req = &mut self.reqs[job.req];
        if d.ok {
            for (&b, k) in job.blocks.iter().zip(&job.keys) {
                self.device.register(b, *k);
            }
        } else {
            // The chunks did not arrive intact: the model recomputes them.
            self.m.load_chunks_failed += job.keys.len() as u64;
            req.loaded.clear();
            if req.policy == OffloadPolicy::ChunkLevel {
                req.stored_upto = req.device_hits;
            }
        }
    }

    /// Waits for this step's loads (the model cannot use a chunk before it arrives). Every copy
    /// that finishes meanwhile is kept for the manager's next step.
    fn wait_step_loads(&mut self) -> Result<(), SimError> {
        let deadline = Instant::now() + self.cfg.drain_timeout;
        while !self.step_loads.is_empty() {
            let Some(copier) = &mut self.copier else {
                self.step_loads.clear();
                return Ok(());
            };
            if Instant::now() > deadline {
                return Err(SimError::Stalled(format!(
                    "{} device loads did not finish within {:?}",
                    self.step_loads.len(),
                    self.cfg.drain_timeout
                )));
            }
            let Some(d) = copier.wait_one(Duration::from_millis(50))? else {
                continue;
            };
            if let Some(i) = self.step_loads.iter().position(|&id| id == d.id) {
                self.step_loads.swap_remove(i);
                self.land_load(&d);
            }
            self.landed.push(d);
        }
        Ok(())
    }
}
