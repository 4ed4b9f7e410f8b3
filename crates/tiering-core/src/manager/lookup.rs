//! Lookup and promotions: the primary first, then the secondary tiers in chain order; a
//! secondary hit reserves a primary row at once (`HitPending`) and queues a promotion that is
//! submitted, batched per (tier, request), at the end of the step (or of the sweep).
//!
//! With a recompute cost set (`super::cost`), a secondary hit is promoted only if it is
//! expected to land sooner than recomputing, and a promotion still in flight past its deadline
//! is answered `Miss` so the engine recomputes instead of waiting (the promotion completes and
//! its chunk becomes readable all the same).

use std::time::Instant;

use crate::arena::RowGrant;
use crate::error::{ManagerError, TierError};
use crate::job::{JobKind, TransferJob};
use crate::key::OffloadKey;
use crate::outcome::LookupResult;
use crate::request::ReqContext;
use crate::tier::PrimaryTier as _;

use super::cost::Verdict;
use super::job_table::JobMeta;
use super::jobs::Servicer;
use super::load_source::LoadSource;
use super::state::TieringState;
use super::tier_call::Op;

impl TieringState {
    /// The lookup algorithm. `poll` is true only for the engine's own lookups: a lookup made
    /// while a tier serves a peer must not run the scheduler's poll gate.
    pub(crate) fn lookup_unlocked(
        &mut self,
        key: &OffloadKey,
        ctx: &ReqContext,
        poll: bool,
    ) -> Result<LookupResult, ManagerError> {
        // The gate is checked here too: a step makes hundreds of lookups, and only its first
        // polls (the call and the empty fault list cost more than the probe at small sizes).
        if poll && !self.step_polls.tiers_polled() {
            let faults = self.gated_poll();
            self.handle_faults(faults)?;
        }
        if poll && !self.step_polls.promotions_polled() {
            self.refresh_backoff();
            self.recheck_declined_retries();
            self.poll_awaited_promotions()?;
        }
        let (r, tier) = self.walk_tiers(key, ctx)?;
        if poll {
            self.telemetry.lookup(r, tier);
        }
        Ok(r)
    }

    /// The step's first engine lookup while a tier the control thread services has a promotion
    /// in flight polls those tiers and applies what finished, so a promotion that already landed
    /// is a `Hit` in this step instead of after the control thread's next sweep (a thread
    /// wake-up, which on a busy machine waits for a core). Once per step: a promotion reserved
    /// in this step is only submitted at its end. The only call the scheduler thread makes into
    /// those tiers; `docs/ARCHITECTURE.md`, "The control-plane thread".
    fn poll_awaited_promotions(&mut self) -> Result<(), ManagerError> {
        self.step_polls.poll_promotions();
        if !self.tiers.control_thread_live() {
            return Ok(());
        }
        let tiers = &self.tiers;
        let awaited = self.jobs.any_promotion_on(|idx| tiers.on_control_plane(idx));
        if awaited {
            let faults = self.poll_tiers(Servicer::ControlThread);
            self.handle_faults(faults)?;
        }
        Ok(())
    }

    /// Once per step: forgets the failed promotions of tiers that report a recovery, and the
    /// remembered failures whose back-off expired (`super::backoff`).
    fn refresh_backoff(&mut self) {
        for idx in 0..self.tiers.len() {
            if !self.backoff.watches(idx) {
                continue;
            }
            if let Some(health) = self.tier_call_or_defer(idx, Op::Health, |t| t.health()) {
                self.backoff.observe_health(idx, health);
            }
        }
        self.backoff.expire();
    }

    /// Looks up again, on their tiers, the `Retry` questions the engine was told not to wait
    /// for (`super::retry_wait`): nobody else will, and an answer is a sample of the tier's
    /// answer time and hit rate. Once per step, with the step's first engine lookup.
    fn recheck_declined_retries(&mut self) {
        if !self.cost.retries().has_rechecks() {
            return;
        }
        let rechecks = self.cost.retries().take_rechecks();
        let now = Instant::now();
        for (idx, key, ctx) in rechecks {
            if idx >= self.tiers.len() {
                continue;
            }
            let Some(answer) = self.tier_call_or_defer(idx, Op::Lookup, |t| t.lookup(&key, &ctx)) else {
                continue;
            };
            match answer {
                LookupResult::Hit => self.cost.answered(idx, &key, true),
                LookupResult::Miss => self.cost.answered(idx, &key, false),
                LookupResult::Retry | LookupResult::HitPending => {
                    self.cost.retries().recheck_pending((idx, key, ctx), now);
                }
            }
        }
    }

    /// The walk itself; returns the verdict and the index (0 = primary) of the tier that gave it.
    /// A tier that panics is quarantined and the walk goes on without it (an error only under
    /// `on_tier_failure = "fail"`).
    fn walk_tiers(
        &mut self,
        key: &OffloadKey,
        ctx: &ReqContext,
    ) -> Result<(LookupResult, Option<usize>), ManagerError> {
        match self.primary.lookup(key, ctx) {
            LookupResult::HitPending if self.cost.past_deadline(key, Instant::now()) => {
                // A promotion the engine should no longer wait for: it recomputes the chunk.
                return Ok((LookupResult::Miss, None));
            }
            LookupResult::Hit => {
                if !self.tiers.is_empty() {
                    self.step_hits.record(ctx.id(), *key);
                }
                return Ok((LookupResult::Hit, Some(0)));
            }
            LookupResult::HitPending => return Ok((LookupResult::HitPending, Some(0))),
            LookupResult::Retry | LookupResult::Miss => {}
        }
        let mut retry = false;
        for idx in 0..self.tiers.len() {
            // An absent tier is the one serving this very lookup (skipped by construction) or a
            // quarantined one.
            if !self.tiers.present(idx) || !ctx.load_filter().allows_tier(self.tiers.info(idx)) {
                continue;
            }
            // A promotion of this key from this tier failed recently, or every promotion from
            // it does: do not start the same promotion again (`super::backoff`).
            if !self.backoff.is_idle() && self.backoff.skips(idx, key) {
                continue;
            }
            let Some(answer) = self.tier_call(idx, Op::Lookup, |t| t.lookup(key, ctx))? else {
                continue;
            };
            match answer {
                LookupResult::Hit => {
                    self.cost.answered(idx, key, true);
                    return Ok((self.initiate_promotion(idx, key, ctx), Some(idx + 1)));
                }
                LookupResult::Retry => retry |= self.cost.retry_worth_waiting(idx, key, ctx),
                LookupResult::HitPending => retry = true,
                LookupResult::Miss => self.cost.answered(idx, key, false),
            }
        }
        let r = if retry {
            LookupResult::Retry
        } else {
            LookupResult::Miss
        };
        Ok((r, None))
    }

    /// Reserves a primary slot for promoting `key` from tier `idx` and queues it for the
    /// batched submission. `Miss` when the primary cannot make room (never `Retry`: that would
    /// livelock the scheduler).
    fn initiate_promotion(&mut self, idx: usize, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        // What the engine hears once the promotion is queued: a probe is not waited for.
        let (deadline, answer) = if self.cost.recompute().is_some() {
            let chunk = self.arena.chunk_bytes() as u64;
            let backlog = (self.promotion_backlog(idx) as u64 + 1) * chunk;
            let reserved = self.pending_promotions.reserved_for(idx, ctx.id());
            match self.cost.decide(idx, backlog, reserved, Instant::now()) {
                Verdict::Promote(deadline) => (deadline, LookupResult::HitPending),
                Verdict::Probe(deadline) => (Some(deadline), LookupResult::Miss),
                Verdict::Decline => return LookupResult::Miss,
            }
        } else {
            (None, LookupResult::HitPending)
        };
        let pinned = self.pin_step_hits(ctx);
        let reserved = self.primary.prepare_write(std::slice::from_ref(key), ctx);
        if !pinned.is_empty() {
            // Pinned a moment ago by this thread under the lock, so the release cannot fail
            // unless the primary has failed (then every later call reports that).
            let _ = self.primary.complete_read(&pinned, ctx);
        }
        let Some(out) = reserved else {
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
        self.pending_promotions
            .reserve(idx, ctx, &out.keys_to_store, &out.chunk_ids);
        for k in &out.keys_to_store {
            self.cost.started(idx, *k, deadline);
        }
        self.requests
            .record_load_sources(ctx.id(), &out.keys_to_store, idx);
        answer
    }

    /// Pins the primary hits `ctx`'s request was told about in this step, so the promotion's
    /// reservation cannot evict them (`super::step_hits`); the keys pinned, to release. A hit
    /// evicted since it was reported (by another request's store) is skipped.
    fn pin_step_hits(&mut self, ctx: &ReqContext) -> Vec<OffloadKey> {
        let hits = self.step_hits.of(ctx.id());
        if hits.is_empty() {
            return Vec::new();
        }
        let hits = hits.to_vec();
        if self.primary.prepare_read(&hits, ctx).is_ok() {
            return hits;
        }
        // One of them is gone: pin the rest one by one.
        hits.into_iter()
            .filter(|k| self.primary.prepare_read(std::slice::from_ref(k), ctx).is_ok())
            .collect()
    }

    /// Chunks of tier `idx`'s promotions in flight or reserved and not yet submitted: the
    /// queue a new promotion waits behind.
    fn promotion_backlog(&self, idx: usize) -> usize {
        let in_flight = self.jobs.promoting(idx);
        let reserved = self.pending_promotions.reserved_on(idx);
        in_flight + reserved
    }

    /// Whether any promotion is reserved and not yet submitted.
    pub(crate) fn has_unsubmitted_promotions(&self) -> bool {
        self.pending_promotions.any()
    }

    /// Submits one promotion job per (tier, request) with reserved keys, in first-lookup order.
    pub(crate) fn flush_promotions(&mut self) -> Result<(), ManagerError> {
        let mut first_err = None;
        for idx in 0..self.tiers.len() {
            if !self.tiers.present(idx) || self.pending_promotions.none_on(idx) {
                continue;
            }
            for p in self.pending_promotions.take(idx) {
                if p.keys.is_empty() {
                    continue;
                }
                let rows = match self.arena.write_rows(&p.chunk_ids) {
                    Ok(rows) => rows,
                    Err(e) => {
                        // A row reserved at −1 is held by someone else: an invariant broke.
                        // Free the reservations rather than write into a row in use.
                        self.primary.complete_write(&p.keys, &p.ctx, false);
                        self.cost.forget(&p.keys);
                        self.requests.forget_load_sources(p.ctx.id(), &p.keys, idx);
                        first_err.get_or_insert(ManagerError::primary(TierError::Arena(e)));
                        continue;
                    }
                };
                let chunk = self.arena.chunk_bytes() as u64;
                let backlog = (self.promotion_backlog(idx) + p.keys.len()) as u64 * chunk;
                let id = self.jobs.register(JobMeta {
                    tier: idx,
                    kind: JobKind::Promotion,
                    keys: p.keys.clone(),
                    ctx: p.ctx.clone(),
                });
                self.cost.submitted(id, idx, backlog, Instant::now());
                self.counters.promotion_jobs += 1;
                let job = TransferJob {
                    id,
                    kind: JobKind::Promotion,
                    keys: p.keys,
                    chunk_ids: p.chunk_ids,
                    req: p.ctx,
                    rows: RowGrant::Write(rows),
                };
                if let Err(fault) = self.tier_call(idx, Op::SubmitLoad, |t| t.submit_load(job)) {
                    first_err.get_or_insert(fault);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// See [`Step::load_source`](super::Step::load_source): the tier recorded for `key` in the
    /// request's table entry, else the primary.
    pub(crate) fn load_source_unlocked(&self, key: &OffloadKey, ctx: &ReqContext) -> LoadSource {
        let recorded = self
            .requests
            .load_source(ctx.id(), key)
            .filter(|&idx| idx < self.tiers.len());
        match recorded {
            Some(idx) => LoadSource {
                secondary: Some(idx),
                info: self.tiers.info(idx).clone(),
            },
            None => LoadSource {
                secondary: None,
                info: self.primary.info(),
            },
        }
    }
}
