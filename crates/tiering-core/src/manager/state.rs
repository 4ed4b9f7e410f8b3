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
use crate::job::{JobId, JobKind, JobOutcome, JobResult, TransferJob};
use crate::key::{KeySet, OffloadKey};
use crate::outcome::LookupResult;
use crate::request::{ReqContext, RequestId, TierInfo};
use crate::stats::ManagerCounters;
use crate::tier::{PrimaryTier, SecondaryTier};

use super::offstep::{CompletionLedger, CompletionQueue};

/// One secondary tier in the chain. `tier` is `None` only while the tier is serving peers: it
/// is taken out of the state for the call, which is what keeps it out of every fan-out.
pub(crate) struct TierSlot {
    pub(crate) info: TierInfo,
    pub(crate) tier: Option<Box<dyn SecondaryTier>>,
}

/// A registered primary↔secondary job.
pub(crate) struct JobMeta {
    pub(super) tier: usize,
    pub(super) kind: JobKind,
    pub(super) keys: Vec<OffloadKey>,
    pub(super) ctx: ReqContext,
}

/// Promotions reserved for one (tier, request) and not yet submitted.
pub(super) struct PendingPromotion {
    pub(super) ctx: ReqContext,
    pub(super) keys: Vec<OffloadKey>,
    pub(super) chunk_ids: Vec<u32>,
}

/// Per-request orchestration state.
pub(super) struct RequestState {
    pub(super) ctx: ReqContext,
    /// Prepared device→primary stores whose `complete_store` has not arrived.
    pub(super) pending_stores: u32,
    pub(super) finished: bool,
    /// Tiers that asked for `RequestLevel`.
    pub(super) request_level: Vec<usize>,
    /// Keys whose write was in flight when a request-level cascade wanted them.
    pub(super) parked: Vec<OffloadKey>,
    /// The origin tier of a peer request, remembered so a deferred finalization still skips it.
    pub(super) exclude: Option<usize>,
}

/// All mutable orchestrator state (see the module docs).
pub struct TieringState {
    pub(crate) primary: Box<dyn PrimaryTier>,
    pub(super) arena: Arc<ChunkArena>,
    pub(crate) tiers: Vec<TierSlot>,
    pub(super) jobs: HashMap<JobId, JobMeta>,
    pub(super) next_job: u64,
    pub(super) pending_promotions: Vec<IndexMap<RequestId, PendingPromotion>>,
    pub(super) requests: HashMap<RequestId, RequestState>,
    /// The scheduler's once-per-step poll gate (step-driven mode only).
    pub(crate) polled_this_step: bool,
    /// Set once the control-plane thread exists: from then on it alone polls and serves.
    pub(crate) control_thread_live: bool,
    pub(crate) counters: ManagerCounters,
    pub(super) results: Vec<JobResult>,
    /// Store completions queued by device-copy workers (see `offstep`).
    pub(crate) completion_queue: Arc<CompletionQueue>,
    /// Pairs up worker and engine reports of the same store.
    pub(crate) ledger: CompletionLedger,
    /// Off-step mode: sweeps also apply worker completions and submit the promotions they
    /// reserved, instead of leaving both for the next `on_schedule_end`.
    pub(crate) off_step: bool,
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
            completion_queue: Arc::new(CompletionQueue::default()),
            ledger: CompletionLedger::default(),
            off_step: false,
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

    /// Store completions reported by one source (worker or engine) and not yet by the other.
    #[must_use]
    pub fn unmatched_store_reports(&self) -> usize {
        self.ledger.unmatched()
    }

    /// Requests the manager is tracking (announced and not yet finalized).
    #[must_use]
    pub fn tracked_requests(&self) -> usize {
        self.requests.len()
    }

    pub(super) fn next_job_id(&mut self) -> JobId {
        let id = JobId(self.next_job);
        self.next_job += 1;
        id
    }

    pub(super) fn tier_name(&self, idx: usize) -> String {
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
        self.apply_queued_completions();
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
}
