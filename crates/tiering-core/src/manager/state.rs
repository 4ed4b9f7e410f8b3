//! `TieringState`: every piece of mutable orchestrator state, behind the manager's one lock.
//!
//! The methods here are the `_unlocked` bodies of the algorithms: they take `&mut TieringState`,
//! so "the caller holds the lock" is a fact of the type system. The engine-facing handle
//! ([`TieringManager`](super::TieringManager)) and the control-plane thread both reach them only
//! through a guard.

use std::collections::HashMap;
use std::sync::Arc;

use indexmap::IndexMap;

use crate::arena::{ChunkArena, RowGrant};
use crate::error::{ManagerError, TierError};
use crate::event::OffloadingEvent;
use crate::job::{JobId, JobKind, JobOutcome, JobResult, TransferJob};
use crate::key::{KeySet, OffloadKey};
use crate::outcome::{LookupResult, OffloadPolicy, PrepareStoreOutput};
use crate::request::{ReqContext, RequestId, TierInfo};
use crate::stats::{ManagerCounters, ManagerStats};
use crate::tier::{PrimaryTier, SecondaryTier};

/// One secondary tier in the chain. `tier` is `None` only while the tier is serving peers: it
/// is taken out of the state for the call, which is what keeps it out of every fan-out.
pub(crate) struct TierSlot {
    pub(crate) info: TierInfo,
    pub(crate) tier: Option<Box<dyn SecondaryTier>>,
}

/// A registered primary↔secondary job.
pub(crate) struct JobMeta {
    tier: usize,
    kind: JobKind,
    keys: Vec<OffloadKey>,
    ctx: ReqContext,
}

/// Promotions reserved for one (tier, request) and not yet submitted.
struct PendingPromotion {
    ctx: ReqContext,
    keys: Vec<OffloadKey>,
    chunk_ids: Vec<u32>,
}

/// Per-request orchestration state.
struct RequestState {
    ctx: ReqContext,
    /// Prepared device→primary stores whose `complete_store` has not arrived.
    pending_stores: u32,
    finished: bool,
    /// Tiers that asked for `RequestLevel`.
    request_level: Vec<usize>,
    /// Keys whose write was in flight when a request-level cascade wanted them.
    parked: Vec<OffloadKey>,
    /// The origin tier of a peer request, remembered so a deferred finalization still skips it.
    exclude: Option<usize>,
}

/// All mutable orchestrator state (see the module docs).
pub struct TieringState {
    pub(crate) primary: Box<dyn PrimaryTier>,
    arena: Arc<ChunkArena>,
    pub(crate) tiers: Vec<TierSlot>,
    jobs: HashMap<JobId, JobMeta>,
    next_job: u64,
    pending_promotions: Vec<IndexMap<RequestId, PendingPromotion>>,
    requests: HashMap<RequestId, RequestState>,
    /// The scheduler's once-per-step poll gate (step-driven mode only).
    pub(crate) polled_this_step: bool,
    /// Set once the control-plane thread exists: from then on it alone polls and serves.
    pub(crate) control_thread_live: bool,
    pub(crate) counters: ManagerCounters,
    results: Vec<JobResult>,
}

impl TieringState {
    pub(crate) fn new(primary: Box<dyn PrimaryTier>, secondaries: Vec<Box<dyn SecondaryTier>>) -> Self {
        let arena = Arc::clone(primary.arena());
        let n = secondaries.len();
        Self {
            primary,
            arena,
            tiers: secondaries
                .into_iter()
                .map(|t| TierSlot {
                    info: t.info(),
                    tier: Some(t),
                })
                .collect(),
            jobs: HashMap::new(),
            next_job: 0,
            pending_promotions: (0..n).map(|_| IndexMap::new()).collect(),
            requests: HashMap::new(),
            polled_this_step: false,
            control_thread_live: false,
            counters: ManagerCounters::default(),
            results: Vec::new(),
        }
    }

    /// Number of secondary tiers.
    #[must_use]
    pub fn num_secondaries(&self) -> usize {
        self.tiers.len()
    }

    /// Primary↔secondary jobs in flight.
    #[must_use]
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// Promotions reserved but not yet submitted.
    #[must_use]
    pub fn reserved_promotions(&self) -> usize {
        self.pending_promotions
            .iter()
            .flat_map(IndexMap::values)
            .map(|p| p.keys.len())
            .sum()
    }

    /// Requests the manager is tracking (announced and not yet finalized).
    #[must_use]
    pub fn tracked_requests(&self) -> usize {
        self.requests.len()
    }

    fn next_job_id(&mut self) -> JobId {
        let id = JobId(self.next_job);
        self.next_job += 1;
        id
    }

    fn tier_name(&self, idx: usize) -> String {
        self.tiers
            .get(idx)
            .map_or_else(|| format!("#{idx}"), |s| s.info.name.clone())
    }

    // ----- job completion ------------------------------------------------------------------

    /// The scheduler's gated poll: at most once per step, and never once the control thread
    /// exists (it owns polling then).
    pub(crate) fn gated_poll(&mut self) -> Result<(), ManagerError> {
        if self.control_thread_live || self.polled_this_step {
            return Ok(());
        }
        self.polled_this_step = true;
        self.process_finished_jobs()
    }

    /// Polls every present tier and applies its results. Every result is processed before the
    /// first protocol error (unknown job, wrong tier, bad partial result) is returned.
    pub fn process_finished_jobs(&mut self) -> Result<(), ManagerError> {
        let mut first_err = None;
        let mut results = std::mem::take(&mut self.results);
        for idx in 0..self.tiers.len() {
            let Some(tier) = self.tiers[idx].tier.as_mut() else {
                continue;
            };
            results.clear();
            tier.poll_finished(&mut results);
            for r in results.drain(..) {
                if let Err(e) = self.apply_result(idx, &r) {
                    tracing::error!(error = %e, "invalid job report");
                    first_err.get_or_insert(e);
                }
            }
        }
        self.results = results;
        first_err.map_or(Ok(()), Err)
    }

    fn apply_result(&mut self, idx: usize, r: &JobResult) -> Result<(), ManagerError> {
        let Some(meta) = self.jobs.get(&r.id) else {
            return Err(ManagerError::UnknownJob {
                tier: self.tier_name(idx),
                job: r.id,
            });
        };
        if meta.tier != idx {
            return Err(ManagerError::WrongTier {
                job: r.id,
                reported_by: self.tier_name(idx),
                owner: self.tier_name(meta.tier),
            });
        }
        let Some(meta) = self.jobs.remove(&r.id) else {
            return Ok(());
        };
        self.counters.results_processed += 1;
        match meta.kind {
            JobKind::Promotion => self.complete_promotion(idx, &meta, r),
            JobKind::Store => {
                if let Err(e) = self.primary.complete_read(&meta.keys, &meta.ctx) {
                    // The pins were taken by `create_store_job`; failing to release them means
                    // the primary's accounting broke. Report it, keep going.
                    tracing::error!(job = %r.id, error = %e, "releasing cascade pins failed");
                    return Err(ManagerError::primary(e));
                }
                Ok(())
            }
        }
    }

    fn complete_promotion(&mut self, idx: usize, meta: &JobMeta, r: &JobResult) -> Result<(), ManagerError> {
        let (ok, failed, invalid): (Vec<OffloadKey>, Vec<OffloadKey>, bool) = match &r.outcome {
            JobOutcome::Ok => (meta.keys.clone(), Vec::new(), false),
            JobOutcome::Failed => (Vec::new(), meta.keys.clone(), false),
            JobOutcome::Partial(succeeded) => {
                let job_keys: KeySet = meta.keys.iter().copied().collect();
                if succeeded.iter().all(|k| job_keys.contains(k)) {
                    let good: KeySet = succeeded.iter().copied().collect();
                    let (ok, failed) = meta.keys.iter().partition(|k| good.contains(k));
                    (ok, failed, false)
                } else {
                    // Trust nothing from a report that names foreign keys: free every slot.
                    (Vec::new(), meta.keys.clone(), true)
                }
            }
        };
        self.counters.promoted_keys += ok.len() as u64;
        self.counters.failed_promotion_keys += failed.len() as u64;
        if !ok.is_empty() {
            self.primary.complete_write(&ok, &meta.ctx, true);
        }
        if !failed.is_empty() {
            self.primary.complete_write(&failed, &meta.ctx, false);
        }
        if invalid {
            return Err(ManagerError::InvalidPartialResult {
                tier: self.tier_name(idx),
                job: r.id,
            });
        }
        Ok(())
    }

    // ----- lookup and promotion ------------------------------------------------------------

    /// The lookup algorithm. `poll` is true only for the engine's own lookups: a lookup made
    /// while a tier serves a peer must not run the scheduler's poll gate.
    pub(crate) fn lookup_unlocked(
        &mut self,
        key: &OffloadKey,
        ctx: &ReqContext,
        poll: bool,
    ) -> Result<LookupResult, ManagerError> {
        if poll {
            self.gated_poll()?;
        }
        match self.primary.lookup(key, ctx) {
            r @ (LookupResult::Hit | LookupResult::HitPending) => return Ok(r),
            LookupResult::Retry | LookupResult::Miss => {}
        }
        let mut retry = false;
        for idx in 0..self.tiers.len() {
            let slot = &mut self.tiers[idx];
            if !ctx.load_filter().allows_tier(&slot.info) {
                continue;
            }
            // An absent tier is the one serving this very lookup: skipped by construction.
            let Some(tier) = slot.tier.as_mut() else {
                continue;
            };
            match tier.lookup(key, ctx) {
                LookupResult::Hit => return Ok(self.initiate_promotion(idx, key, ctx)),
                LookupResult::Retry | LookupResult::HitPending => retry = true,
                LookupResult::Miss => {}
            }
        }
        Ok(if retry {
            LookupResult::Retry
        } else {
            LookupResult::Miss
        })
    }

    /// Reserves a primary slot for promoting `key` from tier `idx` and queues it for the step's
    /// batched submission. `Miss` when the primary cannot make room (never `Retry`: that would
    /// livelock the scheduler).
    fn initiate_promotion(&mut self, idx: usize, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        let Some(out) = self.primary.prepare_write(std::slice::from_ref(key), ctx) else {
            self.counters.promotion_alloc_failures += 1;
            return LookupResult::Miss;
        };
        if out.keys_to_store.is_empty() {
            // Already resident after all; answer from the primary instead of queueing a job.
            return match self.primary.lookup(key, ctx) {
                r @ (LookupResult::Hit | LookupResult::HitPending) => r,
                LookupResult::Retry | LookupResult::Miss => LookupResult::Miss,
            };
        }
        let entry = self.pending_promotions[idx]
            .entry(ctx.id().clone())
            .or_insert_with(|| PendingPromotion {
                ctx: ctx.clone(),
                keys: Vec::new(),
                chunk_ids: Vec::new(),
            });
        entry.keys.extend_from_slice(&out.keys_to_store);
        entry.chunk_ids.extend_from_slice(&out.chunk_ids);
        LookupResult::HitPending
    }

    /// Submits one promotion job per (tier, request) with reserved keys, in first-lookup order.
    pub(crate) fn flush_promotions(&mut self) -> Result<(), ManagerError> {
        let mut first_err = None;
        for idx in 0..self.tiers.len() {
            if self.tiers[idx].tier.is_none() || self.pending_promotions[idx].is_empty() {
                continue;
            }
            let pending = std::mem::take(&mut self.pending_promotions[idx]);
            for (_, p) in pending {
                if p.keys.is_empty() {
                    continue;
                }
                let rows = match self.arena.write_rows(&p.chunk_ids) {
                    Ok(rows) => rows,
                    Err(e) => {
                        // A row reserved at −1 is held by someone else: an invariant broke.
                        // Free the reservations rather than write into a row in use.
                        self.primary.complete_write(&p.keys, &p.ctx, false);
                        first_err.get_or_insert(ManagerError::primary(TierError::Arena(e)));
                        continue;
                    }
                };
                let id = self.next_job_id();
                self.jobs.insert(
                    id,
                    JobMeta {
                        tier: idx,
                        kind: JobKind::Promotion,
                        keys: p.keys.clone(),
                        ctx: p.ctx.clone(),
                    },
                );
                self.counters.promotion_jobs += 1;
                let job = TransferJob {
                    id,
                    kind: JobKind::Promotion,
                    keys: p.keys,
                    chunk_ids: p.chunk_ids,
                    req: p.ctx,
                    rows: RowGrant::Write(rows),
                };
                if let Some(tier) = self.tiers[idx].tier.as_mut() {
                    tier.submit_load(job);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

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
