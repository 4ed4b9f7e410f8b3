//! Step phase (c): `prepare_store` for chunks computed last step, `on_request_finished` for
//! finished requests, then `on_schedule_end` — the last manager call — and the copy jobs go out.

use super::*;

impl Engine<'_> {
    pub(super) fn stores_and_finishes(&mut self) -> Result<bool, SimError> {
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

    pub(super) fn offer_store(&mut self, r: usize) -> Result<(), SimError> {
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

    pub(super) fn release_request(&mut self, r: usize) {
        for b in std::mem::take(&mut self.reqs[r].blocks) {
            self.device.release(b);
        }
        self.reqs[r].phase = Phase::Done;
        self.done += 1;
        self.m.requests += 1;
    }

    pub(super) fn end_schedule(&mut self) -> Result<(), SimError> {
        let new_requests = std::mem::take(&mut self.new_this_step);
        if let Some(off) = &mut self.off {
            // The engine collects KV-cache events every step (tiers queue them until drained).
            off.take_events()?;
            off.on_schedule_end(&ScheduleEndContext {
                new_requests,
                preempted_requests: Vec::new(),
            })?;
            off.finish_step();
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
}
