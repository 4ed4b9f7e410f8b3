//! Stores, cascades, the request lifecycle, step end, observation, reset and shutdown: the rest
//! of the `_unlocked` bodies of [`TieringState`].

use crate::arena::RowGrant;
use crate::error::{ManagerError, TierError};
use crate::event::OffloadingEvent;
use crate::job::{JobKind, TransferJob};
use crate::key::{KeySet, OffloadKey};
use crate::outcome::{LookupResult, OffloadPolicy, PrepareStoreOutput};
use crate::request::{ReqContext, RequestId};
use crate::stats::ManagerStats;

use super::state::{JobMeta, RequestState, TieringState};

impl TieringState {
    // ----- stores and cascades -------------------------------------------------------------

    /// Pins ready chunks and registers a store job under tier `idx`; the caller submits it (or,
    /// for a peer, moves the bytes itself).
    pub(crate) fn create_store_job_unlocked(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        idx: usize,
    ) -> Result<TransferJob, ManagerError> {
        let chunk_ids = self
            .primary
            .prepare_read(keys, ctx)
            .map_err(ManagerError::primary)?;
        let rows = match self.arena.read_rows(&chunk_ids) {
            Ok(rows) => rows,
            Err(e) => {
                if let Err(undo) = self.primary.complete_read(keys, ctx) {
                    tracing::error!(error = %undo, "releasing pins after a failed row grant");
                }
                return Err(ManagerError::primary(TierError::Arena(e)));
            }
        };
        let id = self.next_job_id();
        self.jobs.insert(
            id,
            JobMeta {
                tier: idx,
                kind: JobKind::Store,
                keys: keys.to_vec(),
                ctx: ctx.clone(),
            },
        );
        Ok(TransferJob {
            id,
            kind: JobKind::Store,
            keys: keys.to_vec(),
            chunk_ids,
            req: ctx.clone(),
            rows: RowGrant::Read(rows),
        })
    }

    /// Creates and submits a cascade job of `keys` to tier `idx`. A chunk that cannot be pinned
    /// is not cascaded (logged), never an engine-visible failure.
    fn cascade_to(&mut self, idx: usize, keys: &[OffloadKey], ctx: &ReqContext) {
        if self.tiers[idx].tier.is_none() {
            return;
        }
        match self.create_store_job_unlocked(keys, ctx, idx) {
            Ok(job) => {
                self.counters.cascade_jobs += 1;
                if let Some(tier) = self.tiers[idx].tier.as_mut() {
                    tier.submit_store(job);
                }
            }
            Err(e) => tracing::warn!(tier = %self.tiers[idx].info.name, error = %e, "cascade skipped"),
        }
    }

    pub(crate) fn prepare_store_unlocked(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>, ManagerError> {
        self.gated_poll()?;
        let rid = ctx.id();
        if !self.requests.contains_key(rid) {
            return Err(ManagerError::UnknownRequest(rid.clone()));
        }
        let Some(out) = self.primary.prepare_store(keys, ctx) else {
            return Ok(None);
        };
        let Some(state) = self.requests.get_mut(rid) else {
            return Err(ManagerError::UnknownRequest(rid.clone()));
        };
        if !out.keys_to_store.is_empty() {
            state.pending_stores += 1;
        }
        if !state.request_level.is_empty() {
            let new: KeySet = out.keys_to_store.iter().copied().collect();
            let existing: Vec<OffloadKey> = keys.iter().filter(|k| !new.contains(k)).copied().collect();
            if !existing.is_empty() {
                self.cascade_existing(rid, &existing);
            }
        }
        Ok(Some(out))
    }

    /// Request-level cascade of chunks that were already present: ready ones are submitted to
    /// the request-level tiers now, in-flight ones are parked until they resolve, absent ones
    /// are dropped.
    fn cascade_existing(&mut self, rid: &RequestId, keys: &[OffloadKey]) {
        let Some(state) = self.requests.get(rid) else {
            return;
        };
        let ctx = state.ctx.clone();
        let mut ready = Vec::new();
        let mut parked = Vec::new();
        for key in keys {
            match self.primary.lookup(key, &ctx) {
                LookupResult::Hit => ready.push(*key),
                LookupResult::HitPending => parked.push(*key),
                LookupResult::Miss | LookupResult::Retry => {}
            }
        }
        let Some(state) = self.requests.get_mut(rid) else {
            return;
        };
        state.parked.extend(parked);
        let targets: Vec<usize> = state
            .request_level
            .iter()
            .copied()
            .filter(|&t| Some(t) != state.exclude)
            .collect();
        if ready.is_empty() {
            return;
        }
        for t in targets {
            self.cascade_to(t, &ready, &ctx);
        }
    }

    pub(crate) fn complete_store_unlocked(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) -> Result<(), ManagerError> {
        let rid = ctx.id();
        match self.requests.get(rid) {
            None => return Err(ManagerError::UnknownRequest(rid.clone())),
            Some(s) if s.pending_stores == 0 => return Err(ManagerError::NoPendingStore(rid.clone())),
            Some(_) => {}
        }
        self.primary.complete_store(keys, ctx, success);
        if success && !keys.is_empty() {
            for idx in 0..self.tiers.len() {
                self.cascade_to(idx, keys, ctx);
            }
        }
        if let Some(state) = self.requests.get_mut(rid) {
            state.pending_stores -= 1;
        }
        self.maybe_finalize(rid);
        Ok(())
    }

    /// Re-runs the request-level cascade for parked keys (each resolves eventually: a write in
    /// flight ends ready or removed).
    pub(crate) fn flush_parked_cascades(&mut self) {
        let parked: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, s)| !s.parked.is_empty())
            .map(|(id, _)| id.clone())
            .collect();
        for rid in parked {
            let keys = self
                .requests
                .get_mut(&rid)
                .map(|s| std::mem::take(&mut s.parked))
                .unwrap_or_default();
            self.cascade_existing(&rid, &keys);
            self.maybe_finalize(&rid);
        }
    }

    // ----- request lifecycle ---------------------------------------------------------------

    /// Announces a request to every present tier (the serving origin is absent, and is
    /// remembered as `exclude` so a deferred finalization skips it too).
    pub(crate) fn on_new_request_unlocked(
        &mut self,
        ctx: &ReqContext,
        exclude: Option<usize>,
    ) -> OffloadPolicy {
        let mut request_level = Vec::new();
        for (idx, slot) in self.tiers.iter_mut().enumerate() {
            if Some(idx) == exclude {
                continue;
            }
            if let Some(tier) = slot.tier.as_mut()
                && tier.on_new_request(ctx) == OffloadPolicy::RequestLevel
            {
                request_level.push(idx);
            }
        }
        let policy = if request_level.is_empty() {
            OffloadPolicy::ChunkLevel
        } else {
            OffloadPolicy::RequestLevel
        };
        let previous = self.requests.insert(
            ctx.id().clone(),
            RequestState {
                ctx: ctx.clone(),
                pending_stores: 0,
                finished: false,
                request_level,
                parked: Vec::new(),
                exclude,
            },
        );
        if previous.is_some_and(|p| p.pending_stores > 0) {
            tracing::warn!(req = %ctx.id(), "on_new_request replaced a request with stores pending");
        }
        policy
    }

    pub(crate) fn on_request_finished_unlocked(&mut self, ctx: &ReqContext) -> Result<(), ManagerError> {
        let rid = ctx.id();
        let Some(state) = self.requests.get_mut(rid) else {
            return Err(ManagerError::UnknownRequest(rid.clone()));
        };
        state.finished = true;
        self.primary.on_request_finished(ctx);
        self.maybe_finalize(rid);
        Ok(())
    }

    /// Tells the secondary tiers a request is over once nothing more can be cascaded for it.
    fn maybe_finalize(&mut self, rid: &RequestId) {
        let done = self
            .requests
            .get(rid)
            .is_some_and(|s| s.finished && s.pending_stores == 0 && s.parked.is_empty());
        if !done {
            return;
        }
        if let Some(state) = self.requests.remove(rid) {
            self.notify_finished(&state);
        }
    }

    fn notify_finished(&mut self, state: &RequestState) {
        for (idx, slot) in self.tiers.iter_mut().enumerate() {
            if Some(idx) == state.exclude {
                continue;
            }
            if let Some(tier) = slot.tier.as_mut() {
                tier.on_request_finished(&state.ctx);
            }
        }
    }

    // ----- step end, observation, reset ----------------------------------------------------

    /// Step-end flush: promotions first (so those started while serving go out this step), then
    /// parked cascades, then each tier's own step-end hook.
    pub(crate) fn end_of_step_flush(&mut self) -> Result<(), ManagerError> {
        self.polled_this_step = false;
        let promoted = self.flush_promotions();
        self.flush_parked_cascades();
        for slot in &mut self.tiers {
            if let Some(tier) = slot.tier.as_mut() {
                tier.on_schedule_end();
            }
        }
        promoted
    }

    pub(crate) fn has_pending_work_unlocked(&self) -> bool {
        !self.jobs.is_empty()
            || self.requests.values().any(|s| !s.parked.is_empty())
            || self.pending_promotions.iter().any(|m| !m.is_empty())
            || self
                .tiers
                .iter()
                .any(|s| s.tier.as_ref().is_some_and(|t| t.has_pending_work()))
    }

    pub(crate) fn take_events_unlocked(&mut self) -> Vec<OffloadingEvent> {
        let mut events = self.primary.take_events();
        for slot in &mut self.tiers {
            if let Some(tier) = slot.tier.as_mut() {
                events.extend(tier.take_events().into_iter().map(|mut e| {
                    if e.ownership.is_none() {
                        e.ownership = Some(slot.info.name.clone());
                    }
                    e
                }));
            }
        }
        events
    }

    pub(crate) fn stats_unlocked(&self) -> ManagerStats {
        ManagerStats {
            manager: self.counters.clone(),
            primary: self.primary.stats(),
            secondaries: self
                .tiers
                .iter()
                .map(|s| {
                    s.tier
                        .as_ref()
                        .map_or_else(|| crate::stats::TierStats::named(&s.info.name), |t| t.stats())
                })
                .collect(),
            jobs_in_flight: self.jobs.len() as u64,
        }
    }

    /// Drain → process → check no jobs → drop reservations → reset request counters (finalizing
    /// finished requests) → reset the primary. Secondary data survives.
    pub(crate) fn reset_cache_unlocked(&mut self) -> Result<(), ManagerError> {
        self.apply_queued_completions();
        for slot in &mut self.tiers {
            if let Some(tier) = slot.tier.as_mut() {
                tier.drain_jobs();
            }
        }
        let processed = self.process_finished_jobs();
        if !self.jobs.is_empty() {
            // A tier still owns rows: resetting the primary now could hand them to someone else.
            return Err(ManagerError::ResetLeftJobs(self.jobs.len()));
        }
        for map in &mut self.pending_promotions {
            map.clear();
        }
        let finished: Vec<RequestId> = self
            .requests
            .iter_mut()
            .filter_map(|(id, s)| {
                s.pending_stores = 0;
                s.parked.clear();
                s.finished.then(|| id.clone())
            })
            .collect();
        for rid in finished {
            if let Some(state) = self.requests.remove(&rid) {
                self.notify_finished(&state);
            }
        }
        self.primary.reset();
        self.polled_this_step = false;
        processed
    }

    /// Shuts every tier down (reporting the last failure), then the primary only if they all
    /// stopped: a tier that failed to stop may still touch the arena.
    pub(crate) fn shutdown_tiers(&mut self) -> Result<(), ManagerError> {
        // Finish what is in flight first, so no completion is lost and no pin leaks: stores the
        // worker reported, then every tier's jobs (drain never tears a copy).
        self.apply_queued_completions();
        for slot in &mut self.tiers {
            if let Some(tier) = slot.tier.as_mut() {
                tier.drain_jobs();
            }
        }
        if let Err(e) = self.process_finished_jobs() {
            tracing::error!(error = %e, "invalid job report while shutting down");
        }
        let mut last_err = None;
        for slot in &mut self.tiers {
            if let Some(tier) = slot.tier.as_mut()
                && let Err(e) = tier.shutdown()
            {
                tracing::error!(tier = %slot.info.name, error = %e, "tier shutdown failed");
                last_err = Some(ManagerError::tier(&slot.info.name, e));
            }
        }
        if let Some(e) = last_err {
            return Err(e);
        }
        self.primary
            .shutdown()
            .map_err(|e| ManagerError::tier(&self.primary.info().name, e))
    }
}
