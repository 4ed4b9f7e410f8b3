//! Stores and cascades: reserving primary rows for newly computed chunks, and copying every
//! chunk that lands in the primary to each secondary tier (one pin per tier), including the
//! request-level cascade of chunks a request found already present.

use crate::admission::Access;
use crate::arena::RowGrant;
use crate::error::{ManagerError, TierError};
use crate::job::{JobKind, TransferJob};
use crate::key::{KeySet, OffloadKey};
use crate::outcome::{LookupResult, PrepareStoreOutput};
use crate::request::{ReqContext, RequestId};
use crate::tier::PrimaryTier as _;
use std::time::Instant;

use crate::channel::WorkerEvent;

use super::completions;
use super::job_table::JobMeta;
use super::state::TieringState;
use super::tier_call::Op;

impl TieringState {
    /// Pins ready chunks and registers a store job under tier `idx`; the caller submits it (or,
    /// for a peer, the serving tier moves the bytes itself).
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
        self.store_job_from_pins(keys, chunk_ids, ctx, idx)
    }

    /// Registers a store job over chunks already pinned for reading (`chunk_ids` parallel to
    /// `keys`); on failure the pins are released.
    fn store_job_from_pins(
        &mut self,
        keys: &[OffloadKey],
        chunk_ids: Vec<u32>,
        ctx: &ReqContext,
        idx: usize,
    ) -> Result<TransferJob, ManagerError> {
        let rows = match self.arena.read_rows(&chunk_ids) {
            Ok(rows) => rows,
            Err(e) => {
                if let Err(undo) = self.primary.complete_read(keys, ctx) {
                    tracing::error!(error = %undo, "releasing pins after a failed row grant");
                }
                return Err(ManagerError::primary(TierError::Arena(e)));
            }
        };
        let id = self.jobs.register(JobMeta {
            tier: idx,
            kind: JobKind::Store,
            keys: keys.to_vec(),
            ctx: ctx.clone(),
        });
        Ok(TransferJob {
            id,
            kind: JobKind::Store,
            keys: keys.to_vec(),
            chunk_ids,
            req: ctx.clone(),
            rows: RowGrant::Read(rows),
        })
    }

    /// Cascades `keys` to tier `idx` through the tier's gates: the keys its admission policy
    /// refuses are remembered (a later access may let them through), and the whole job is
    /// dropped while the tier is under backpressure (except a periodic probe).
    ///
    /// A tier the request itself routes its chunks to (a request-level tier, e.g. a hand-off
    /// to a decoder that will fetch them) passes no gate: the copy is what the request is for,
    /// not a speculative cascade, and its job lasts until the remote side takes the chunks, so
    /// its duration says nothing about the tier's speed and is no backpressure sample.
    pub(crate) fn cascade_to(&mut self, idx: usize, keys: &[OffloadKey], ctx: &ReqContext) {
        if !self.tiers.present(idx) || keys.is_empty() {
            return;
        }
        let routed = self.requests.routes_to(ctx.id(), idx);
        if routed {
            self.submit_cascade(idx, keys, ctx, Gated::No);
            return;
        }
        let verdict = self.gates.check(idx, keys, true);
        self.submit_cascade(
            idx,
            &verdict.admitted,
            ctx,
            Gated::Yes {
                probe: verdict.probe,
                late: false,
            },
        );
    }

    /// Creates and submits a cascade job of `keys` to tier `idx`. A chunk that cannot be pinned
    /// is not cascaded (logged), never an engine-visible failure.
    fn submit_cascade(&mut self, idx: usize, keys: &[OffloadKey], ctx: &ReqContext, gated: Gated) {
        if keys.is_empty() {
            return;
        }
        match self.create_store_job_unlocked(keys, ctx, idx) {
            Ok(job) => self.submit_cascade_job(idx, job, gated),
            Err(e) => tracing::warn!(tier = %self.tiers.name(idx), error = %e, "cascade skipped"),
        }
    }

    /// Hands a registered cascade job to tier `idx`; a tier that panics while accepting it is
    /// handled by the failure policy (quarantined: its jobs, this one included, are failed; under
    /// `fail` the step's next call returns the error).
    fn submit_cascade_job(&mut self, idx: usize, job: TransferJob, gated: Gated) {
        self.counters.cascade_jobs += 1;
        // The tier will hold these because this manager stored them: a `Retry` question about
        // them no longer measures whether waiting for the tier pays.
        self.cost.retries().stored(&job.keys);
        let id = job.id;
        if let Gated::Yes { probe, late } = gated {
            let bytes = (job.keys.len() * self.arena.chunk_bytes()) as u64;
            self.gates.submitted(idx, id, &job.keys, bytes, probe, late);
        }
        match self.tier_call(idx, Op::SubmitStore, |t| t.submit_store(job)) {
            Ok(Some(())) => {}
            Ok(None) => self.gates.not_submitted(id),
            Err(e) => {
                self.gates.not_submitted(id);
                tracing::error!(error = %e, "cascade submission failed");
                self.failures.defer(e);
            }
        }
    }

    /// After an access of `keys`: cascades the ones a tier refused earlier and admits now, if
    /// they are still ready in the primary (the copy comes from there). Each is pinned on its
    /// own: a chunk that is not ready (evicted, or stored again and in flight) fails its pin
    /// without side effects and is left out; one in flight is judged again when it lands.
    fn cascade_readmitted(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        for idx in 0..self.tiers.len() {
            if !self.tiers.present(idx) {
                continue;
            }
            let again = self.gates.readmitted(idx, keys);
            if again.is_empty() {
                continue;
            }
            let verdict = self.gates.check(idx, &again, false);
            let mut pinned = Vec::with_capacity(verdict.admitted.len());
            let mut chunk_ids = Vec::with_capacity(verdict.admitted.len());
            for key in verdict.admitted {
                if let Ok(ids) = self.primary.prepare_read(std::slice::from_ref(&key), ctx) {
                    pinned.push(key);
                    chunk_ids.extend(ids);
                }
            }
            if pinned.is_empty() {
                continue;
            }
            match self.store_job_from_pins(&pinned, chunk_ids, ctx, idx) {
                Ok(job) => self.submit_cascade_job(
                    idx,
                    job,
                    Gated::Yes {
                        probe: verdict.probe,
                        late: true,
                    },
                ),
                Err(e) => {
                    tracing::warn!(tier = %self.tiers.name(idx), error = %e, "late cascade skipped");
                }
            }
        }
    }

    /// A request loaded `keys` from the primary (after a successful `prepare_load`): a reuse,
    /// which admission policies count and which may let earlier refusals through.
    pub(crate) fn note_reuse(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        self.gates.on_access(keys, Access::Reused);
        self.cascade_readmitted(keys, ctx);
    }

    pub(crate) fn prepare_store_unlocked(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>, ManagerError> {
        let faults = self.gated_poll();
        self.handle_faults(faults)?;
        let rid = ctx.id();
        let Some(request_level) = self.requests.is_request_level(rid) else {
            return Err(ManagerError::UnknownRequest(rid.clone()));
        };
        self.gates.on_access(keys, Access::Offered);
        let out = self.primary.prepare_store(keys, ctx);
        // The offered chunks the primary already holds: what a tier's admission may have waited
        // for, and what a request-level cascade copies. Only worked out when there is a
        // secondary tier to tell.
        let resident: Vec<OffloadKey> = if request_level || !self.tiers.is_empty() {
            let new: KeySet = out
                .as_ref()
                .map(|o| o.keys_to_store.iter().copied().collect())
                .unwrap_or_default();
            keys.iter().filter(|k| !new.contains(k)).copied().collect()
        } else {
            Vec::new()
        };
        self.cascade_readmitted(&resident, ctx);
        let Some(out) = out else {
            return Ok(None);
        };
        if !out.keys_to_store.is_empty() {
            self.completions.open_batch(ctx, &out.keys_to_store);
        }
        let known = if out.keys_to_store.is_empty() {
            self.requests.contains(rid)
        } else {
            self.requests.store_prepared(rid)
        };
        if !known {
            return Err(ManagerError::UnknownRequest(rid.clone()));
        }
        if request_level && !resident.is_empty() {
            self.cascade_existing(rid, &resident);
        }
        Ok(Some(out))
    }

    /// Request-level cascade of chunks that were already present: ready ones are submitted to
    /// the request-level tiers now, in-flight ones are parked until they resolve, absent ones
    /// are dropped.
    fn cascade_existing(&mut self, rid: &RequestId, keys: &[OffloadKey]) {
        let Some(ctx) = self.requests.ctx(rid).cloned() else {
            return;
        };
        let mut ready = Vec::new();
        let mut parked = Vec::new();
        for key in keys {
            match self.primary.lookup(key, &ctx) {
                LookupResult::Hit => ready.push(*key),
                LookupResult::HitPending => parked.push(*key),
                LookupResult::Miss | LookupResult::Retry => {}
            }
        }
        let Some(targets) = self.requests.park(rid, parked) else {
            return;
        };
        if ready.is_empty() {
            return;
        }
        for t in targets {
            self.cascade_to(t, &ready, &ctx);
        }
    }

    /// Whether a request-level cascade waits for keys still in flight.
    pub(crate) fn has_parked_cascades(&self) -> bool {
        self.requests.any_parked()
    }

    /// Re-runs the request-level cascade for parked keys (each resolves eventually: a write in
    /// flight ends ready or removed).
    pub(crate) fn flush_parked_cascades(&mut self) {
        for rid in self.requests.with_parked() {
            let keys = self.requests.take_parked(&rid);
            self.cascade_existing(&rid, &keys);
            self.maybe_finalize(&rid);
        }
    }

    /// The engine's `complete_store`: applies every key no worker has completed yet, absorbs
    /// the rest (counting disagreeing flags). In off-step mode the workers' queued reports are
    /// applied first.
    pub(crate) fn complete_store_unlocked(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) -> Result<(), ManagerError> {
        if self.completions.off_step() {
            // What workers reported before the engine learnt that the copy finished is applied
            // first, so a rank's report is never overtaken by the engine's report of the same
            // copy. That matters for failures: vLLM cannot fail a job, so its connector reports
            // success for every store, and only the worker knows a copy failed.
            self.apply_queued_completions();
        }
        let rid = ctx.id();
        let Some(pending_stores) = self.requests.pending_stores(rid) else {
            return Err(ManagerError::UnknownRequest(rid.clone()));
        };
        let has_pending = pending_stores > 0;
        let Some(report) = self
            .completions
            .engine_report(keys, success, has_pending, &mut self.counters)
        else {
            return Err(ManagerError::NoPendingStore(rid.clone()));
        };
        report.apply.for_each_group(|batch, ok, group| {
            self.apply_store_group(batch, ok, group, report.taken);
        });
        for batch in self.completions.settle_after_engine(&report.settle) {
            self.end_store_batch(batch);
        }
        Ok(())
    }

    /// Applies every report workers queued since the last call, and fails the keys of ranks
    /// that disconnected and did not come back within the deadline.
    pub(crate) fn apply_queued_completions(&mut self) {
        for event in self.completions.take_worker_events() {
            if let WorkerEvent::Stored { rank, keys, success } = event {
                if let Some(apply) = self
                    .completions
                    .worker_report(rank, &keys, success, &mut self.counters)
                {
                    self.apply_store_keys(&apply);
                }
            } else {
                self.completions.worker_event(&event, &mut self.counters);
            }
        }
        for (rank, keys) in self.completions.expired_worker_keys(Instant::now()) {
            let failed = completions::lost_worker(rank, keys, &self.arena, &mut self.counters);
            if !failed.is_empty() {
                self.apply_store_keys(&failed);
            }
        }
    }

    /// Applies reported keys of open store batches (primary `complete_store`, cascade on
    /// success), grouped by store batch.
    fn apply_store_keys(&mut self, keys: &[(OffloadKey, bool)]) {
        let apply = self.completions.apply_list(keys);
        apply.for_each_group(|batch, ok, group| self.apply_store_group(batch, ok, group, false));
    }

    /// Applies `group` of store batch `batch` with `ok`: the primary completes the store, a
    /// success cascades to every secondary, and the batch ends once all its keys are settled.
    /// `taken`: as `EngineReport::taken`.
    fn apply_store_group(&mut self, batch: u64, ok: bool, group: &[OffloadKey], taken: bool) {
        let Some(ctx) = self.completions.batch_ctx(batch).cloned() else {
            return;
        };
        self.primary.complete_store(group, &ctx, ok);
        if ok {
            self.telemetry
                .device_stores(group.len(), self.arena.chunk_bytes());
            for idx in 0..self.tiers.len() {
                self.cascade_to(idx, group, &ctx);
            }
        }
        if self.completions.applied(batch, ok, group, taken) {
            self.end_store_batch(batch);
        }
    }

    /// Every key of a store batch is settled: the request has one store fewer pending.
    fn end_store_batch(&mut self, batch: u64) {
        let Some(ctx) = self.completions.batch_ctx(batch).cloned() else {
            return;
        };
        self.requests.store_ended(ctx.id());
        self.maybe_finalize(ctx.id());
    }
}

/// Whether a cascade went through its tier's gates, and how.
#[derive(Clone, Copy)]
enum Gated {
    /// Admitted by the gates: a backpressure latency sample (`probe`: the periodic probe of a
    /// pressured tier; `late`: admitted on a later access).
    Yes { probe: bool, late: bool },
    /// Routed to a request-level tier by the request: no gate, no sample.
    No,
}
