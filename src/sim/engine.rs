//! The simulated engine: a scheduler loop that drives the manager in a connector's call order.
//!
//! Per step:
//! 1. arrivals (`on_new_request`);
//! 2. (a) finished device copies → `complete_store` / `complete_load`;
//! 3. (b) scheduling: loaded requests start prefill; waiting requests are scanned — device
//!    prefix cache first, then `lookup` chunk by chunk (Hit counts; HitPending counts and
//!    defers; Retry defers but keeps scanning; Miss stops), `touch`, and `prepare_load` for hits;
//! 4. (c) `prepare_store` for chunks computed last step, `on_request_finished` for requests
//!    that finished, then `on_schedule_end` — the last manager call of the step;
//! 5. (d) the model "runs" for its modelled time while the copy worker moves bytes and the
//!    manager's control thread sweeps.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use tiering_core::{LookupResult, OffloadKey, OffloadPolicy, ReqContext, RequestId, ScheduleEndContext};

use super::config::SimConfig;
use super::copier::{Copier, CopyDone, CopyJob, CopyKind};
use super::device::{DeviceMemory, DevicePool};
use super::error::SimError;
use super::hash::{chunk_keys, fill_chunk};
use super::metrics::RunMetrics;
use super::offload::{Offload, Source};
use super::workload::RequestSpec;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    NotArrived,
    Waiting,
    Loading,
    Ready,
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
    scheduled: bool,
    phase: Phase,
}

struct Job {
    req: usize,
    kind: CopyKind,
    keys: Vec<OffloadKey>,
    blocks: Vec<u32>,
}

/// Blocks a request of `tokens` tokens occupies.
pub(crate) fn blocks_for(tokens: usize, tokens_per_chunk: usize) -> usize {
    tokens.div_ceil(tokens_per_chunk)
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
    ready: VecDeque<usize>,
    running: Vec<usize>,
    finishing: Vec<usize>,
    loading: usize,
    prefill_now: Vec<usize>,
    new_this_step: Vec<RequestId>,
    next_arrival: usize,
    now: f64,
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
        let copier = match &off {
            Some(o) => Some(Copier::start(
                Arc::clone(o.arena()),
                Arc::clone(&memory),
                cfg.verify_loads,
            )?),
            None => None,
        };
        let reqs = specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut tokens = s.prompt.to_vec();
                tokens.extend_from_slice(&s.output);
                let ctx = ReqContext::local(format!("{i}:{}", s.name));
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
            ready: VecDeque::new(),
            running: Vec::new(),
            finishing: Vec::new(),
            loading: 0,
            prefill_now: Vec::new(),
            new_this_step: Vec::new(),
            next_arrival: 0,
            now: 0.0,
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
            let step_start = Instant::now();
            let mut progressed = self.arrivals()?;
            progressed |= self.apply_copies()?;
            progressed |= self.schedule()?;
            progressed |= self.stores_and_finishes()?;
            self.end_schedule()?;
            let worked = self.execute_model(step_start);
            progressed |= worked;
            self.m.steps += 1;
            self.now += step_start.elapsed().as_secs_f64();
            if let Some(p) = self.progress {
                p.set_position(self.done as u64);
            }
            if self.idle() && self.next_arrival < self.reqs.len() {
                // Nothing to do until the next arrival: skip the gap instead of sleeping it.
                self.now = self.now.max(self.reqs[self.next_arrival].arrival);
            }
            if progressed {
                last_progress = Instant::now();
            } else if last_progress.elapsed() > self.cfg.drain_timeout {
                return Err(SimError::Stalled(format!(
                    "no request made progress for {:?}: {} waiting, {} loading, {} copy jobs \
                     outstanding, {} of {} device blocks free",
                    self.cfg.drain_timeout,
                    self.waiting.len(),
                    self.loading,
                    self.copier.as_ref().map_or(0, Copier::outstanding),
                    self.device.free_blocks(),
                    self.cfg.device_blocks
                )));
            }
        }
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
            && self.ready.is_empty()
            && self.running.is_empty()
            && self.finishing.is_empty()
            && self.loading == 0
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
        let mut done = Vec::new();
        copier.collect(&mut done)?;
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
                off.complete_load(&job.keys, &req.ctx)?;
                if d.ok {
                    self.m.load_chunks += job.keys.len() as u64;
                    self.m.bytes_primary_to_device += d.bytes;
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
                req.phase = Phase::Ready;
                self.loading -= 1;
                self.ready.push_back(job.req);
            }
        }
        Ok(())
    }

    // ----- (b) scheduling -----------------------------------------------------------------

    fn prefill_tokens(&self, r: usize) -> usize {
        let req = &self.reqs[r];
        req.prompt_len - (req.device_hits + req.loaded.len()) * self.tpc
    }

    fn active(&self) -> usize {
        self.running.len() + self.ready.len() + self.loading
    }

    fn schedule(&mut self) -> Result<bool, SimError> {
        let mut budget = self.cfg.max_batch_tokens;
        let mut progressed = false;
        while let Some(&r) = self.ready.front() {
            let t = self.prefill_tokens(r);
            if !self.prefill_now.is_empty() && t > budget {
                break;
            }
            self.ready.pop_front();
            self.start_prefill(r);
            budget = budget.saturating_sub(t);
            progressed = true;
        }
        let mut keep = VecDeque::with_capacity(self.waiting.len());
        while let Some(r) = self.waiting.pop_front() {
            if self.active() >= self.cfg.max_running {
                keep.push_back(r);
                break;
            }
            match self.try_admit(r, &mut budget)? {
                Admit::Admitted => progressed = true,
                Admit::Deferred => keep.push_back(r),
                Admit::NoRoom => {
                    keep.push_back(r);
                    break;
                }
            }
        }
        keep.extend(self.waiting.drain(..));
        self.waiting = keep;
        Ok(progressed)
    }

    fn try_admit(&mut self, r: usize, budget: &mut usize) -> Result<Admit, SimError> {
        let limit = self.reqs[r].hit_limit;
        let d = self.device.cached_prefix(&self.reqs[r].keys[..limit]);
        let mut hits = 0;
        let mut defer = false;
        if let Some(off) = &mut self.off {
            let req = &self.reqs[r];
            for key in &req.keys[d..limit] {
                match off.lookup(key, &req.ctx)? {
                    LookupResult::Hit => {
                        if !defer {
                            hits += 1;
                        }
                    }
                    LookupResult::HitPending => {
                        hits += 1;
                        defer = true;
                    }
                    // Keep scanning so later chunks start their promotions this step too.
                    LookupResult::Retry => defer = true,
                    LookupResult::Miss => break,
                }
            }
            off.touch(&req.keys, &req.ctx)?;
        }
        if defer {
            self.m.deferrals += 1;
            return Ok(Admit::Deferred);
        }
        let prefill = self.reqs[r].prompt_len - (d + hits) * self.tpc;
        if hits == 0 && !self.prefill_now.is_empty() && prefill > *budget {
            return Ok(Admit::NoRoom);
        }
        let needed = blocks_for(self.reqs[r].prompt_len + self.reqs[r].output_len, self.tpc);
        let mut blocks = Vec::with_capacity(needed);
        for key in &self.reqs[r].keys[..d] {
            match self.device.acquire_cached(key) {
                Some(b) => blocks.push(b),
                None => break,
            }
        }
        if blocks.len() != d {
            // Nothing between the prefix check and here touches the device cache.
            for b in blocks {
                self.device.release(b);
            }
            return Err(SimError::Stalled(format!(
                "device prefix cache changed while admitting {}",
                self.reqs[r].ctx.id()
            )));
        }
        let Some(fresh) = self.device.allocate(needed - blocks.len()) else {
            for b in blocks {
                self.device.release(b);
            }
            return Ok(Admit::NoRoom);
        };
        blocks.extend(fresh);
        let req = &mut self.reqs[r];
        req.blocks = blocks;
        req.device_hits = d;
        req.stored_upto = match req.policy {
            OffloadPolicy::ChunkLevel => d + hits,
            OffloadPolicy::RequestLevel => 0,
        };
        if !req.scheduled {
            req.scheduled = true;
            self.new_this_step.push(req.ctx.id().clone());
        }
        if hits == 0 {
            *budget = budget.saturating_sub(prefill);
            self.start_prefill(r);
            return Ok(Admit::Admitted);
        }
        let Some(off) = &mut self.off else {
            return Ok(Admit::Admitted);
        };
        let keys = req.keys[d..d + hits].to_vec();
        let rows = off.prepare_load(&keys, &req.ctx)?;
        req.loaded = keys.iter().map(|k| off.take_source(k)).collect();
        let blocks = req.blocks[d..d + hits].to_vec();
        req.phase = Phase::Loading;
        self.loading += 1;
        self.submit(r, CopyKind::Load, keys, rows, blocks);
        Ok(Admit::Admitted)
    }

    fn submit(
        &mut self,
        req: usize,
        kind: CopyKind,
        keys: Vec<OffloadKey>,
        rows: Vec<u32>,
        blocks: Vec<u32>,
    ) {
        let id = self.next_job;
        self.next_job += 1;
        self.outbox.push(CopyJob {
            id,
            kind,
            keys: keys.clone(),
            rows,
            blocks: blocks.clone(),
        });
        self.jobs.insert(
            id,
            Job {
                req,
                kind,
                keys,
                blocks,
            },
        );
    }

    fn start_prefill(&mut self, r: usize) {
        self.reqs[r].phase = Phase::Running;
        self.running.push(r);
        self.prefill_now.push(r);
    }

    // ----- (c) stores, finished requests, step end ---------------------------------------

    fn stores_and_finishes(&mut self) -> Result<bool, SimError> {
        if self.off.is_none() {
            let any = !self.finishing.is_empty();
            for r in std::mem::take(&mut self.finishing) {
                self.release_request(r);
            }
            return Ok(any);
        }
        let candidates: Vec<usize> = self.running.iter().chain(&self.finishing).copied().collect();
        for r in candidates {
            self.offer_store(r)?;
        }
        let any = !self.finishing.is_empty();
        for r in std::mem::take(&mut self.finishing) {
            if let Some(off) = &mut self.off {
                off.on_request_finished(&self.reqs[r].ctx)?;
            }
            self.release_request(r);
        }
        Ok(any)
    }

    fn offer_store(&mut self, r: usize) -> Result<(), SimError> {
        let req = &self.reqs[r];
        let full = (req.kv_tokens / self.tpc).min(req.keys.len());
        if full <= req.stored_upto {
            return Ok(());
        }
        let Some(off) = &mut self.off else {
            return Ok(());
        };
        let offer = &req.keys[req.stored_upto..full];
        let Some(out) = off.prepare_store(offer, &req.ctx)? else {
            self.m.store_alloc_failures += 1;
            if req.phase == Phase::Finishing {
                self.m.store_chunks_dropped += (full - req.stored_upto) as u64;
            }
            return Ok(());
        };
        if out.keys_to_store.is_empty() {
            self.reqs[r].stored_upto = full;
            return Ok(());
        }
        off.touch(&out.keys_to_store, &req.ctx)?;
        // `keys_to_store` keeps the offer's order, so one forward walk finds each block.
        let mut blocks = Vec::with_capacity(out.keys_to_store.len());
        let mut pos = req.stored_upto;
        for key in &out.keys_to_store {
            while pos < full && req.keys[pos] != *key {
                pos += 1;
            }
            let block = req.blocks.get(pos).copied().ok_or_else(|| {
                SimError::Worker(format!("prepare_store returned key {key} that was not offered"))
            })?;
            blocks.push(block);
        }
        for &b in &blocks {
            self.device.acquire(b);
        }
        self.reqs[r].stored_upto = full;
        self.submit(r, CopyKind::Store, out.keys_to_store, out.chunk_ids, blocks);
        Ok(())
    }

    fn release_request(&mut self, r: usize) {
        for b in std::mem::take(&mut self.reqs[r].blocks) {
            self.device.release(b);
        }
        self.reqs[r].phase = Phase::Done;
        self.done += 1;
        self.m.requests += 1;
    }

    fn end_schedule(&mut self) -> Result<(), SimError> {
        let new_requests = std::mem::take(&mut self.new_this_step);
        if let Some(off) = &mut self.off {
            // The engine collects KV-cache events every step (tiers queue them until drained).
            off.take_events()?;
            off.on_schedule_end(&ScheduleEndContext {
                new_requests,
                preempted_requests: Vec::new(),
            })?;
            if let Some(t) = off.end_step_time() {
                self.m.step_manager.push(t);
            }
        }
        if let Some(copier) = &mut self.copier {
            for job in self.outbox.drain(..) {
                copier.submit(job)?;
                self.m.copy_jobs_submitted += 1;
            }
        }
        Ok(())
    }

    // ----- (d) the model -------------------------------------------------------------------

    /// Runs the step's model work; returns whether there was any.
    fn execute_model(&mut self, step_start: Instant) -> bool {
        let model_start = Instant::now();
        let prefill: Vec<usize> = std::mem::take(&mut self.prefill_now);
        let decoding: Vec<usize> = self
            .running
            .iter()
            .copied()
            .filter(|&r| self.reqs[r].generated > 0)
            .collect();
        if prefill.is_empty() && decoding.is_empty() {
            let pending = !self.waiting.is_empty()
                || self.loading > 0
                || self.copier.as_ref().is_some_and(|c| c.outstanding() > 0);
            if pending {
                // An idle tick: let copies and promotions progress before the next look.
                std::thread::sleep(self.cfg.step_base);
            }
            return false;
        }
        let mut prefill_tokens = 0;
        let mut first_tokens = Vec::with_capacity(prefill.len());
        for &r in &prefill {
            prefill_tokens += self.prefill_tokens(r);
            self.account_prefill(r);
            let req = &self.reqs[r];
            let from = req.device_hits + req.loaded.len();
            let to = (req.prompt_len / self.tpc).min(req.keys.len());
            self.compute_chunks(r, from, to);
            let req = &mut self.reqs[r];
            req.kv_tokens = req.prompt_len;
            req.generated = 1;
            first_tokens.push(r);
        }
        for &r in &decoding {
            let req = &mut self.reqs[r];
            req.generated += 1;
            req.kv_tokens += 1;
            if req.kv_tokens % self.tpc == 0 && req.kv_tokens / self.tpc <= req.keys.len() {
                let c = req.kv_tokens / self.tpc - 1;
                self.compute_chunks(r, c, c + 1);
            }
        }
        let model = self.cfg.model_time(prefill_tokens, decoding.len());
        self.m.model_time += model;
        if let Some(rest) = model.checked_sub(model_start.elapsed()) {
            std::thread::sleep(rest);
        }
        let end = self.now + step_start.elapsed().as_secs_f64();
        for r in first_tokens {
            self.m.ttft.push(end - self.reqs[r].arrival);
        }
        let finished: Vec<usize> = self
            .running
            .iter()
            .copied()
            .filter(|&r| self.reqs[r].generated >= self.reqs[r].output_len)
            .collect();
        if !finished.is_empty() {
            self.running.retain(|r| !finished.contains(r));
            for r in finished {
                self.m.output_tokens += self.reqs[r].output_len as u64;
                self.reqs[r].phase = Phase::Finishing;
                self.finishing.push(r);
            }
        }
        true
    }

    fn account_prefill(&mut self, r: usize) {
        let tpc = self.tpc as u64;
        let req = &self.reqs[r];
        self.m.add_served(Source::Device, req.device_hits as u64 * tpc);
        for &s in &req.loaded {
            self.m.add_served(s, tpc);
        }
        self.m.computed_tokens += (req.prompt_len - (req.device_hits + req.loaded.len()) * self.tpc) as u64;
    }

    /// The model writes chunks `from..to` of request `r` into its device blocks.
    fn compute_chunks(&mut self, r: usize, from: usize, to: usize) {
        for c in from..to {
            let (key, block) = (self.reqs[r].keys[c], self.reqs[r].blocks[c]);
            self.memory.with_block(block, |b| fill_chunk(&key, b));
            self.device.register(block, key);
        }
    }

    // ----- the end of the run ----------------------------------------------------------------

    /// Waits for outstanding copies, then steps idly until the manager has no pending work.
    fn drain(&mut self) -> Result<(), SimError> {
        let deadline = Instant::now() + self.cfg.drain_timeout;
        loop {
            let copies = self.copier.as_ref().map_or(0, Copier::outstanding);
            let pending = match &mut self.off {
                Some(off) => off.has_pending_work()?,
                None => false,
            };
            if copies == 0 && !pending {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(SimError::Stalled(format!(
                    "after the last request, {copies} device copies and the tiers' pending work \
                     did not finish within {:?}",
                    self.cfg.drain_timeout
                )));
            }
            if let Some(c) = &mut self.copier
                && copies > 0
                && let Some(d) = c.wait_one(Duration::from_millis(50))?
            {
                self.apply_copy(&d)?;
            }
            self.apply_copies()?;
            let start = Instant::now();
            self.end_schedule()?;
            std::thread::sleep(self.cfg.step_base);
            self.m.steps += 1;
            self.now += start.elapsed().as_secs_f64();
        }
    }
}

enum Admit {
    Admitted,
    Deferred,
    NoRoom,
}
