//! The step guard: the way an engine holds the manager's lock across the calls of a scheduler
//! step. It is not the only thing that takes the lock: the handle's methods in `super` (the
//! hooks, reset, shutdown, `store_completion_sender`, `open_completion_channel`,
//! `set_recompute_cost`, `recompute_cost`, `inspect`) take it for their own duration, and the
//! control thread for each sweep; none of them holds it across engine calls.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use parking_lot::RawMutex;
use parking_lot::lock_api::ArcMutexGuard;

use crate::error::{ControlPlaneFailure, ManagerError};
use crate::key::OffloadKey;
use crate::offloading::OffloadingManager;
use crate::outcome::{ChunkId, LookupResult, OffloadPolicy, PrepareStoreOutput, ScheduleEndContext};
use crate::request::ReqContext;
use crate::tier::PrimaryTier as _;

use super::control::Shared;
use super::jobs::Servicer;
use super::load_source::LoadSource;
use super::state::TieringState;
use super::telemetry::Holder;
use super::tier_call::{Op, catch, lock_unless_hung};

/// One scheduler step: holds the manager's lock from [`TieringManager::step`](super::TieringManager::step)
/// until it is dropped, and carries the engine calls of the step (it implements
/// [`OffloadingManager`]).
///
/// Holding the lock across the scheduling part of a step is what keeps a chunk that `lookup`
/// reported as a hit resident until the engine's `prepare_load`. Drop the step before the model
/// runs, so the control thread can serve peers meanwhile. Dropping flushes whatever the step
/// queued after `on_schedule_end` (promotions, parked cascades), then releases the lock fairly —
/// also when the stack unwinds from a panic.
pub struct Step<'m> {
    shared: Arc<Shared>,
    /// When the lock was asked for and when it was granted (for the lock metrics).
    asked: Instant,
    acquired: Instant,
    guard: Option<ArcMutexGuard<RawMutex, TieringState>>,
    failure: Option<Arc<ControlPlaneFailure>>,
    /// The lock could not be taken: its holder is stuck inside a tier call (named here).
    hung: Option<ManagerError>,
    _handle: PhantomData<&'m mut ()>,
}

impl Step<'_> {
    pub(crate) fn begin(shared: &Arc<Shared>) -> Self {
        let asked = Instant::now();
        let mut hung = None;
        let guard = if shared.shut_down.load(Ordering::Acquire) {
            None
        } else {
            // Waits as long as the holder needs, unless the holder is stuck inside one tier call
            // for `tier_timeout`: then this step fails with an error naming the tier and call.
            match lock_unless_hung(&shared.calls, shared.config.tier_timeout, None, |t| {
                shared.state.try_lock_arc_for(t)
            }) {
                Ok(Some(mut guard)) => {
                    guard.step_polls.begin();
                    guard.step_hits.clear();
                    Some(guard)
                }
                Ok(None) => None,
                Err(e) => {
                    tracing::error!(error = %e, "a step could not take the manager lock");
                    hung = Some(e);
                    None
                }
            }
        };
        // Taken after the lock: a sweep may have failed while this step waited for it.
        let failure = shared.take_failure();
        Self {
            shared: Arc::clone(shared),
            asked,
            acquired: Instant::now(),
            guard,
            failure,
            hung,
            _handle: PhantomData,
        }
    }

    /// The locked state (an error when the lock was not taken: shut down, or a hung tier).
    fn locked(&mut self) -> Result<&mut TieringState, ManagerError> {
        if let Some(e) = &self.hung {
            return Err(e.clone());
        }
        self.guard.as_deref_mut().ok_or(ManagerError::ShutDown)
    }

    /// An engine call of the step, through the outer panic boundary (`super::tier_call`).
    fn call<R>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&mut TieringState) -> Result<R, ManagerError>,
    ) -> Result<R, ManagerError> {
        self.state()?.engine_call(call, f)
    }

    /// A read-mostly hook within the step: no pending failure is returned by it.
    fn observe<R>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&mut TieringState) -> R,
    ) -> Result<R, ManagerError> {
        self.locked()?.engine_call(call, |s| Ok(f(s)))
    }

    /// The state, after returning a pending control-plane failure once.
    fn state(&mut self) -> Result<&mut TieringState, ManagerError> {
        if let Some(f) = self.failure.take() {
            return Err(ManagerError::ControlPlane(f));
        }
        let state = self.locked()?;
        if let Some(e) = state.failures.take_deferred() {
            return Err(e);
        }
        Ok(state)
    }

    /// Events since the last call (as [`TieringManager::take_events`](super::TieringManager::take_events),
    /// from within the step: vLLM's connector collects them while it schedules).
    ///
    /// # Errors
    /// The manager was shut down.
    pub fn take_events(&mut self) -> Result<Vec<crate::event::OffloadingEvent>, ManagerError> {
        self.observe("take_events", TieringState::take_events_unlocked)
    }

    /// A snapshot of the counters, from within the step.
    ///
    /// # Errors
    /// The manager was shut down.
    pub fn stats(&mut self) -> Result<crate::stats::ManagerStats, ManagerError> {
        self.observe("stats", TieringState::stats_unlocked)
    }

    /// Whether the engine should keep stepping even with no requests, from within the step.
    ///
    /// # Errors
    /// The manager was shut down.
    pub fn has_pending_work(&mut self) -> Result<bool, ManagerError> {
        self.observe("has_pending_work", TieringState::has_pending_work_unlocked)
    }

    /// [`TieringManager::release_reset_fence`](super::TieringManager::release_reset_fence) from
    /// within the step (vLLM's connector learns that the copies are over while it holds the
    /// lock).
    ///
    /// # Errors
    /// The manager was shut down.
    pub fn release_reset_fence(&mut self) -> Result<usize, ManagerError> {
        self.observe("release_reset_fence", |s| s.primary.release_reset_fence())
    }

    /// Where `key`'s chunk came from for this request, for an engine's cache-hit metrics (vLLM's
    /// `get_load_source`; ask after `lookup` answered `Hit`): the secondary tier whose promotion
    /// brought the key into the primary for this request, else the primary. Recorded for
    /// announced requests, until the request is finalized or the cache reset; a failed
    /// promotion's keys are forgotten.
    ///
    /// # Errors
    /// The manager was shut down.
    pub fn load_source(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LoadSource, ManagerError> {
        self.observe("load_source", |s| s.load_source_unlocked(key, ctx))
    }

    /// Runs `f` on the locked state without any engine semantics. For diagnostics and tests.
    pub fn inspect<R>(&mut self, f: impl FnOnce(&mut TieringState) -> R) -> Result<R, ManagerError> {
        self.guard.as_deref_mut().map(f).ok_or(ManagerError::ShutDown)
    }

    /// Flushes what the step queued after `on_schedule_end` (a failure is recorded for the next
    /// step; a failed manager flushes nothing).
    fn finish(shared: &Arc<Shared>, state: &mut TieringState) {
        if state.failure().is_some() {
            return;
        }
        let flushed = state.engine_call("the end-of-step flush", |state| {
            state.flush_parked_cascades();
            if state.has_unsubmitted_promotions() {
                state.flush_promotions()
            } else {
                Ok(())
            }
        });
        if let Err(e) = flushed {
            shared.record_failure(e.to_string());
        }
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        let Some(mut guard) = self.guard.take() else {
            return;
        };
        // While unwinding, only release the lock: running tier code now could panic again.
        if !std::thread::panicking() {
            Self::finish(&self.shared, &mut guard);
            if catch(|| guard.publish_metrics()).is_err() {
                tracing::error!("publishing the metrics panicked");
            }
            guard
                .telemetry
                .lock(Holder::Step, self.acquired - self.asked, self.acquired.elapsed());
        }
        ArcMutexGuard::unlock_fair(guard);
        if let Some(f) = self.failure.take() {
            // Never handed to the engine in this step: keep it for the next one.
            self.shared.record_failure(f.message.clone());
        }
    }
}

impl std::fmt::Debug for Step<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Step")
            .field("locked", &self.guard.is_some())
            .finish_non_exhaustive()
    }
}

impl OffloadingManager for Step<'_> {
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupResult, ManagerError> {
        self.call("lookup", |s| s.lookup_unlocked(key, ctx, true))
    }

    fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, ManagerError> {
        self.call("prepare_load", |state| {
            let chunks = state
                .primary
                .prepare_load(keys, ctx)
                .map_err(ManagerError::primary)?;
            state.note_reuse(keys, ctx);
            Ok(chunks)
        })
    }

    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), ManagerError> {
        self.call("touch", |state| {
            state.primary.touch(keys, ctx);
            let mut first = Ok(());
            for idx in 0..state.tiers.len() {
                if let Err(e) = state.tier_call(idx, Op::Touch, |t| t.touch(keys, ctx)) {
                    first = first.and(Err(e));
                }
            }
            first
        })
    }

    fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), ManagerError> {
        self.call("complete_load", |state| {
            state
                .primary
                .complete_load(keys, ctx)
                .map_err(ManagerError::primary)
        })
    }

    fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>, ManagerError> {
        self.call("prepare_store", |s| s.prepare_store_unlocked(keys, ctx))
    }

    fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) -> Result<(), ManagerError> {
        self.call("complete_store", |s| {
            s.complete_store_unlocked(keys, ctx, success)
        })
    }

    fn on_new_request(&mut self, ctx: &ReqContext) -> Result<OffloadPolicy, ManagerError> {
        self.call("on_new_request", |s| Ok(s.on_new_request_unlocked(ctx, None)))
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<(), ManagerError> {
        self.call("on_request_finished", |s| s.on_request_finished_unlocked(ctx))
    }

    fn on_schedule_end(&mut self, _ctx: &ScheduleEndContext) -> Result<(), ManagerError> {
        self.call("on_schedule_end", |state| {
            // The scheduler's share of the control plane: the tiers the control thread does not
            // own (all of them when it is not running) are polled and served here.
            let mut faults = state.gated_poll();
            faults.extend(state.serve_tiers(Servicer::Scheduler));
            let serviced = state.handle_faults(faults);
            let flushed = end_of_step_flush(state);
            serviced.and(flushed)
        })
    }
}

/// Step-end flush: promotions first (so those started while serving go out this step), then
/// parked cascades, then each tier's own step-end hook. Only the orchestrator's verbs: the step
/// orders them, it owns no state.
fn end_of_step_flush(state: &mut TieringState) -> Result<(), ManagerError> {
    let promoted = state.flush_promotions();
    state.flush_parked_cascades();
    let mut hooks = Ok(());
    for idx in 0..state.tiers.len() {
        if let Err(e) = state.tier_call(idx, Op::OnScheduleEnd, |t| t.on_schedule_end()) {
            hooks = hooks.and(Err(e));
        }
    }
    promoted.and(hooks)
}
