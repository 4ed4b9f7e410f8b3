//! Step phase (b): waiting requests are scanned (device prefix cache, then chunk-by-chunk
//! lookups), admitted with device blocks and started, their loads prepared.

use super::*;

impl Engine<'_> {
    pub(super) fn prefill_tokens(&self, r: usize) -> usize {
        let req = &self.reqs[r];
        req.prompt_len - (req.device_hits + req.loaded.len()) * self.tpc
    }

    pub(super) fn active(&self) -> usize {
        self.running.len()
    }

    pub(super) fn schedule(&mut self) -> Result<bool, SimError> {
        let mut budget = self.cfg.max_batch_tokens;
        let mut progressed = false;
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
        // Leading hits, before the first key the request would wait for.
        let mut sure = 0;
        let mut defer = false;
        if let Some(off) = &mut self.off {
            let req = &self.reqs[r];
            for key in &req.keys[d..limit] {
                match off.lookup(key, &req.ctx)? {
                    LookupResult::Hit => {
                        if !defer {
                            hits += 1;
                            sure += 1;
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
            if self.worth_waiting(r, limit - d - sure, sure) {
                self.m.deferrals += 1;
                return Ok(Admit::Deferred);
            }
            // Waiting longer would cost more than recomputing what it could still save.
            self.m.waits_given_up += 1;
            hits = sure;
        }
        if self.reqs[r].waiting_since.take().is_some() {
            let paid_off = hits > self.reqs[r].hits_before_wait;
            self.wait_payoff.record(paid_off);
        }
        let prefill = self.reqs[r].prompt_len - (d + hits) * self.tpc;
        if !self.prefill_now.is_empty() && prefill > *budget {
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
        // Pinned after the device blocks, so a request that finds no room holds no pin.
        let mut rows = Vec::new();
        if hits > 0
            && let Some(off) = &mut self.off
        {
            let req = &self.reqs[r];
            loop {
                let keys = &req.keys[d..d + hits];
                match off.prepare_load(keys, &req.ctx) {
                    Ok(ids) => {
                        rows = ids;
                        break;
                    }
                    // A promotion this scan started for a later chunk reserved its primary row
                    // by evicting the LRU entry, which can be a leading hit of this very
                    // request (a hit holds no pin until here). The chunks from the evicted one
                    // on are recomputed: a miss, not a failed step.
                    Err(e) => match evicted_hit(&e, keys) {
                        Some(i) => {
                            self.m.hits_evicted_before_load += (hits - i) as u64;
                            hits = i;
                            if hits == 0 {
                                break;
                            }
                        }
                        None => return Err(e),
                    },
                }
            }
        }
        let prefill = self.reqs[r].prompt_len - (d + hits) * self.tpc;
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
        *budget = budget.saturating_sub(prefill);
        if hits > 0
            && let Some(off) = &mut self.off
        {
            let keys = req.keys[d..d + hits].to_vec();
            req.loaded = keys.iter().map(|k| off.take_source(k)).collect();
            let blocks = req.blocks[d..d + hits].to_vec();
            let job = self.submit(r, CopyKind::Load, keys, rows, blocks);
            self.step_loads.push(job);
        }
        self.start_prefill(r);
        Ok(Admit::Admitted)
    }

    /// Whether request `r` (with `sure` leading hits) should wait another step for lookups or
    /// promotions that could still serve `at_stake` chunks. Only an engine that weighs loading
    /// against recomputing (`SimConfig::recompute_cost`) asks: it waits no longer, in all, than
    /// the recompute time of those chunks it can expect to save — the recompute time × how
    /// often waiting has paid off lately (at least `MIN_WAIT_PAYOFF`) — counting the step it
    /// is about to wait. A tier that answers slowly thus costs a request at most about twice
    /// the recompute it could save, never an unbounded stall, and a tier whose answers are
    /// all misses stops being waited for; without the weighing the request waits as long as
    /// the manager says so.
    fn worth_waiting(&mut self, r: usize, at_stake: usize, sure: usize) -> bool {
        if !self.cfg.recompute_cost {
            return true;
        }
        let now = self.now;
        let req = &mut self.reqs[r];
        if req.waiting_since.is_none() {
            req.hits_before_wait = sure;
        }
        let since = *req.waiting_since.get_or_insert(now);
        let tokens = u32::try_from(at_stake * self.tpc).unwrap_or(u32::MAX);
        let saving = (self.cfg.prefill_per_token * tokens).as_secs_f64();
        let expected = saving * self.wait_payoff.credited();
        now - since + self.cfg.step_base.as_secs_f64() <= expected
    }

    pub(super) fn submit(
        &mut self,
        req: usize,
        kind: CopyKind,
        keys: Vec<OffloadKey>,
        rows: Vec<u32>,
        blocks: Vec<u32>,
    ) -> u64 {
        let id = self.next_job;
        self.next_job += 1;
        let link = &mut self.link_free[usize::from(kind == CopyKind::Store)];
        let bytes = keys.len() * self.cfg.chunk_bytes;
        let due = link.max(self.now) + self.cfg.device_copy_time(bytes).as_secs_f64();
        *link = due;
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
                due,
            },
        );
        id
    }

    pub(super) fn start_prefill(&mut self, r: usize) {
        self.reqs[r].phase = Phase::Running;
        self.running.push(r);
        self.prefill_now.push(r);
    }
}

enum Admit {
    Admitted,
    Deferred,
    NoRoom,
}

/// The position in `keys` of the chunk a failed `prepare_load` found gone from the primary.
fn evicted_hit(e: &SimError, keys: &[OffloadKey]) -> Option<usize> {
    let SimError::Manager(tiering_core::ManagerError::Primary(cause)) = e else {
        return None;
    };
    let tiering_core::TierError::NotFound(key) = &**cause else {
        return None;
    };
    keys.iter().position(|k| k == key)
}
