//! Job results: polling tiers for finished primary↔secondary jobs and applying them (a finished
//! cascade releases its pins; a finished promotion makes its keys readable or frees them).

use crate::error::ManagerError;
use crate::job::{JobKind, JobOutcome, JobResult};
use crate::key::{KeySet, OffloadKey};
use crate::tier::PrimaryTier as _;

use super::faults::TierFault;
use super::job_table::JobMeta;
use super::state::TieringState;
use super::tier_call::Op;

/// Which tiers a poll or serve pass covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Servicer {
    /// The scheduler thread: every tier the control thread does not own.
    Scheduler,
    /// The control thread: the tiers that opted in.
    ControlThread,
    /// Every present tier (drain, reset, shutdown).
    Everyone,
}

impl TieringState {
    pub(crate) fn serviced_by(&self, idx: usize, who: Servicer) -> bool {
        match who {
            Servicer::Everyone => true,
            Servicer::Scheduler => self.scheduler_owns(idx),
            Servicer::ControlThread => self.tiers.control_thread_owns(idx),
        }
    }

    /// The scheduler's gated poll: at most once per step, covering the tiers the control
    /// thread does not own.
    pub(crate) fn gated_poll(&mut self) -> Vec<TierFault> {
        if self.step_polls.poll_tiers() {
            return Vec::new();
        }
        if !self.tiers.control_thread_live() {
            self.apply_queued_completions();
        }
        self.poll_tiers(Servicer::Scheduler)
    }

    /// Polls the tiers `who` services and applies their results. A tier that reports a job it
    /// does not own is returned as a fault; every other result is still applied. A tier that
    /// panics has the results it pushed before the panic applied, then goes through the failure
    /// policy (`super::tier_call`): quarantined, or returned as a fault under `fail`.
    pub(crate) fn poll_tiers(&mut self, who: Servicer) -> Vec<TierFault> {
        let mut faults = Vec::new();
        let mut results = self.jobs.take_result_buffer();
        for idx in 0..self.tiers.len() {
            if !self.serviced_by(idx, who) {
                continue;
            }
            results.clear();
            let Some(polled) = self
                .tiers
                .call(idx, Op::PollFinished, |t| t.poll_finished(&mut results))
            else {
                continue;
            };
            let mut first = None;
            for r in results.drain(..) {
                if let Err(e) = self.apply_result(idx, &r) {
                    tracing::error!(error = %e, "invalid job report");
                    first.get_or_insert(e);
                }
            }
            if let Err(message) = polled
                && let Err(e) = self.tier_panicked(idx, Op::PollFinished, message)
            {
                faults.push(TierFault::new(idx, e));
            }
            if let Some(e) = first {
                faults.push(TierFault::new(idx, e));
            }
        }
        self.jobs.return_result_buffer(results);
        faults
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
        self.telemetry.job(idx, meta.kind, meta.keys.len(), r);
        self.gates
            .finished(r.id, matches!(r.outcome, JobOutcome::Ok), r.elapsed);
        match meta.kind {
            JobKind::Promotion => self.complete_promotion(idx, &meta, r),
            JobKind::Store => self.release_store_job(&meta),
        }
    }

    /// Releases the primary pins a store (cascade or peer) job held.
    pub(crate) fn release_store_job(&mut self, meta: &JobMeta) -> Result<(), ManagerError> {
        self.primary.complete_read(&meta.keys, &meta.ctx).map_err(|e| {
            // The pins were taken by `create_store_job`; failing to release them means the
            // primary's accounting broke. Report it, keep going.
            tracing::error!(error = %e, "releasing store-job pins failed");
            ManagerError::primary(e)
        })
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
        self.cost
            .finished(r.id, &meta.keys, ok.len(), std::time::Instant::now());
        if !ok.is_empty() {
            self.primary.complete_write(&ok, &meta.ctx, true);
        }
        if failed.is_empty() {
            self.backoff.succeeded(idx);
        } else {
            self.primary.complete_write(&failed, &meta.ctx, false);
            self.requests.forget_load_sources(meta.ctx.id(), &failed, idx);
            // Remembered, so the next lookup of these keys does not start the same promotion.
            let health = self
                .tier_call_or_defer(idx, Op::Health, |t| t.health())
                .unwrap_or_default();
            self.backoff.failed(idx, &failed, ok.is_empty(), health);
        }
        if invalid {
            return Err(ManagerError::InvalidPartialResult {
                tier: self.tier_name(idx),
                job: r.id,
            });
        }
        Ok(())
    }

    /// Reports every job of tier `idx` failed: promotions free their reserved rows, store jobs
    /// release their pins. Only for a tier that can no longer touch those rows.
    pub(crate) fn fail_jobs_of(&mut self, idx: usize) -> usize {
        let ids = self.jobs.ids_of(idx);
        for id in &ids {
            self.gates.finished(*id, false, std::time::Duration::ZERO);
            if let Some(meta) = self.jobs.remove(id) {
                match meta.kind {
                    JobKind::Promotion => {
                        self.cost.dropped(*id, &meta.keys);
                        self.counters.failed_promotion_keys += meta.keys.len() as u64;
                        self.primary.complete_write(&meta.keys, &meta.ctx, false);
                        self.requests.forget_load_sources(meta.ctx.id(), &meta.keys, idx);
                    }
                    JobKind::Store => {
                        let _ = self.release_store_job(&meta);
                    }
                }
            }
        }
        // Reserved but never submitted promotions of this tier free their rows too.
        for p in self.pending_promotions.take(idx) {
            self.primary.complete_write(&p.keys, &p.ctx, false);
            self.cost.forget(&p.keys);
            self.requests.forget_load_sources(p.ctx.id(), &p.keys, idx);
        }
        ids.len()
    }
}
