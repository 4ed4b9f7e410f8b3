//! The orchestrator: [`TieringManager`] composes one primary tier and an ordered chain of
//! secondary tiers, with its control plane on a dedicated thread.
//!
//! Locking (`docs/ARCHITECTURE.md`, "The manager's lock"): all mutable state is one
//! [`TieringState`] behind one mutex, and the engine holds it explicitly, as a value: a
//! [`Step`] from [`TieringManager::step`] carries the engine calls of one scheduler step and
//! releases the lock when dropped (also on unwind). The handle's other methods lock only for
//! their own duration: the read-mostly hooks (`has_pending_work`, `take_events`, `stats`,
//! `release_reset_fence`) and the teardown calls (`reset_cache`, `shutdown`), which give up
//! when the holder is stuck in a tier call, and `store_completion_sender`,
//! `open_completion_channel`, `set_recompute_cost`, `recompute_cost` and `inspect`, which lock
//! directly; construction locks once to start the control thread, which locks for each sweep.
//!
//! Modules by what they own (`docs/ARCHITECTURE.md`, "The manager's parts"). The handle and
//! its state: `config` (the construction options), [`state`] (the composition of the parts and
//! its diagnostics), [`step`] (the step guard). The parts, each a type with private fields:
//! `tier_chain` (the secondary tiers' slots), `job_table` (jobs in flight),
//! `pending_promotions` (promotions reserved and not yet submitted), `request_table` (the
//! requests tracked), `completions` (the engine's and the copy workers' store reports, the
//! store ledger), `failure_state` (the failure policy and the failures kept), `step_polls`
//! (the once-per-step polls), `step_hits` (the primary hits of the step), `gates` (admission
//! and backpressure on cascades), `cost` (load-versus-recompute decisions), `retry_wait`
//! (whether a tier's `Retry` is worth waiting for, inside `cost`), `backoff` (failed promotions
//! remembered), `telemetry` (metrics). The verbs that need several parts at once (the only
//! modules with `impl TieringState` besides `state`): `lookup` (lookups and promotions), `store`
//! (stores, store reports applied, cascades), `jobs` (job results), `requests` (the request
//! lifecycle), `serve` (serving peers), `faults` (failure policy, bounded tier calls),
//! `control` (the control thread and its sweep), `observe` (the read-mostly hooks), `teardown`
//! (reset and shutdown). And the boundary and the answer types: `tier_call` (the panic boundary
//! every tier call goes through, and the record of the call in progress), `load_source` (where
//! a request's hits came from).

mod backoff;
pub(crate) mod completions;
mod config;
pub(crate) mod control;
mod cost;
mod failure_state;
mod faults;
mod gates;
mod job_table;
mod jobs;
mod load_source;
mod lookup;
mod observe;
mod pending_promotions;
mod request_table;
mod requests;
mod retry_wait;
mod serve;
pub mod state;
pub mod step;
mod step_hits;
mod step_polls;
mod store;
mod teardown;
mod telemetry;
mod tier_call;
mod tier_chain;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::MutexGuard;

use crate::arena::ChunkArena;
use crate::channel::ChannelServer;
use crate::error::ManagerError;
use crate::event::OffloadingEvent;
use crate::stats::ManagerStats;
use crate::tier::{PrimaryTier, SecondaryTier};
use crate::waker::ControlWaker;

pub use backoff::PromotionBackoffConfig;
pub use completions::StoreCompletionSender;

pub use config::{ManagerConfig, OnTierFailure, TierGateConfig};
use control::Shared;
pub use cost::{CostConfig, RecomputeCost};
pub use load_source::LoadSource;
pub use state::TieringState;
pub use step::Step;

/// The engine-facing tiering manager. See the module docs for the locking rules.
pub struct TieringManager {
    shared: Arc<Shared>,
    arena: Arc<ChunkArena>,
}

impl TieringManager {
    /// A manager over `primary` and the secondary tiers in lookup-priority order.
    #[must_use]
    pub fn new(
        primary: Box<dyn PrimaryTier>,
        secondaries: Vec<Box<dyn SecondaryTier>>,
        config: ManagerConfig,
    ) -> Self {
        Self::with_waker(primary, secondaries, config, ControlWaker::new())
    }

    /// As [`TieringManager::new`], with a waker the tiers were already built with.
    ///
    /// The control-plane thread (if enabled and a secondary tier opts in) starts here, so the
    /// tiers that opted in are never serviced from the scheduler thread, not even in the first
    /// step.
    #[must_use]
    pub fn with_waker(
        primary: Box<dyn PrimaryTier>,
        secondaries: Vec<Box<dyn SecondaryTier>>,
        config: ManagerConfig,
        waker: ControlWaker,
    ) -> Self {
        let arena = Arc::clone(primary.arena());
        let state = TieringState::with_waker(primary, secondaries, &config, Some(&waker));
        let shared = Arc::new(Shared::new(state, waker, config));
        {
            let mut guard = shared.state.lock();
            shared.start_control_thread(&mut guard);
            MutexGuard::unlock_fair(guard);
        }
        Self { shared, arena }
    }

    /// Starts a scheduler step: takes the manager's lock until the returned [`Step`] is dropped.
    /// Make every engine call of the step on it, and drop it before the model runs.
    pub fn step(&mut self) -> Step<'_> {
        Step::begin(&self.shared)
    }

    /// A step that does not borrow the handle, for language bindings that cannot express the
    /// borrow (the Python binding). The caller must make sure one thread never holds two steps
    /// of the same manager (the second would wait for the first forever) and must drop the step
    /// before calling the handle's other methods.
    #[must_use]
    pub fn detached_step(&self) -> Step<'static> {
        Step::begin(&self.shared)
    }

    /// The primary tier's arena: the rows `prepare_store` and `prepare_load` name, which the
    /// engine's device copier reads and writes through row grants.
    #[must_use]
    pub fn arena(&self) -> &Arc<ChunkArena> {
        &self.arena
    }

    /// The construction options.
    #[must_use]
    pub fn config(&self) -> &ManagerConfig {
        &self.shared.config
    }

    /// The waker the tiers signal.
    #[must_use]
    pub fn waker(&self) -> &ControlWaker {
        &self.shared.waker
    }

    /// A handle an in-process copy worker uses to report finished device→primary stores
    /// without waiting for a step (off-step mode; see [`ManagerConfig::off_step`]).
    #[must_use]
    pub fn store_completion_sender(&self) -> StoreCompletionSender {
        let queue = Arc::clone(self.shared.state.lock().completions.queue());
        StoreCompletionSender::new(queue, self.shared.waker.clone())
    }

    /// Opens the completion channel at `path` (a Unix socket) so copy workers in other
    /// processes can report finished stores (see [`crate::channel`]). `fingerprint` identifies
    /// this manager's arena; a worker that presents another is refused.
    ///
    /// # Errors
    /// The socket cannot be bound, or a channel is already open.
    pub fn open_completion_channel(&self, path: &Path) -> Result<(), ManagerError> {
        let mut guard = self.shared.state.lock();
        let result = if guard.completions.has_channel() {
            Err(ManagerError::Channel(
                "a completion channel is already open".to_owned(),
            ))
        } else {
            ChannelServer::bind(
                path,
                crate::channel::arena_fingerprint(&self.arena),
                self.shared.config.reporters,
                self.shared.waker.clone(),
            )
            .map(|server| guard.completions.set_channel(server))
            .map_err(|e| ManagerError::Channel(format!("cannot bind {}: {e}", path.display())))
        };
        MutexGuard::unlock_fair(guard);
        result
    }

    /// Sets (or, with `None`, clears) the engine's recompute cost: from now on a secondary hit
    /// is promoted only if it is expected to land sooner than recomputing the chunk, and a
    /// promotion the engine waits on past its deadline is answered `Miss` (see
    /// [`ManagerConfig::cost`]).
    pub fn set_recompute_cost(&self, recompute: Option<RecomputeCost>) {
        let mut guard = self.shared.state.lock();
        guard.cost.set_recompute(recompute);
        MutexGuard::unlock_fair(guard);
    }

    /// The engine's recompute cost, if set.
    #[must_use]
    pub fn recompute_cost(&self) -> Option<RecomputeCost> {
        let guard = self.shared.state.lock();
        let r = guard.cost.recompute();
        MutexGuard::unlock_fair(guard);
        r
    }

    /// Whether the control-plane thread is running.
    #[must_use]
    pub fn control_thread_running(&self) -> bool {
        self.shared
            .control
            .lock()
            .as_ref()
            .is_some_and(|c| !c.is_finished())
    }

    /// The control-plane thread's id, once started.
    #[must_use]
    pub fn control_thread_id(&self) -> Option<std::thread::ThreadId> {
        self.shared
            .control
            .lock()
            .as_ref()
            .map(control::ControlThread::thread_id)
    }

    /// A control-plane failure not yet returned to the engine, if any.
    #[must_use]
    pub fn control_failure(&self) -> Option<String> {
        self.shared.peek_failure()
    }

    /// Runs `f` on the state under the lock, without starting a step. For diagnostics and
    /// tests.
    pub fn inspect<R>(&mut self, f: impl FnOnce(&mut TieringState) -> R) -> R {
        let mut guard = self.shared.state.lock();
        let r = f(&mut guard);
        MutexGuard::unlock_fair(guard);
        r
    }

    fn observe<R>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut TieringState) -> R,
    ) -> Result<R, ManagerError> {
        if self.shared.shut_down.load(Ordering::Acquire) {
            return Err(ManagerError::ShutDown);
        }
        let calls = Arc::clone(&self.shared.calls);
        let Some(mut guard) =
            tier_call::lock_unless_hung(&calls, self.shared.config.tier_timeout, None, |t| {
                self.shared.state.try_lock_for(t)
            })?
        else {
            return Err(ManagerError::LockTimedOut(what, self.shared.config.tier_timeout));
        };
        let r = guard.engine_call(what, |s| Ok(f(s)));
        MutexGuard::unlock_fair(guard);
        r
    }

    /// Whether the engine should keep stepping even with no requests.
    ///
    /// # Errors
    /// The manager was shut down.
    pub fn has_pending_work(&self) -> Result<bool, ManagerError> {
        self.observe("has_pending_work", TieringState::has_pending_work_unlocked)
    }

    /// Events since the last call: the primary's, then each secondary's in chain order.
    ///
    /// # Errors
    /// The manager was shut down.
    pub fn take_events(&self) -> Result<Vec<OffloadingEvent>, ManagerError> {
        self.observe("take_events", TieringState::take_events_unlocked)
    }

    /// A snapshot of the counters.
    ///
    /// # Errors
    /// The manager was shut down.
    pub fn stats(&self) -> Result<ManagerStats, ManagerError> {
        self.observe("stats", TieringState::stats_unlocked)
    }

    /// Drains every tier (each bounded by `tier_timeout`), then forgets everything in the
    /// primary tier; secondary data survives.
    ///
    /// # Errors
    /// A tier failed or timed out while draining, or jobs remained after draining.
    pub fn reset_cache(&mut self) -> Result<(), ManagerError> {
        self.reset_with("reset_cache", false).map(|_| ())
    }

    /// [`TieringManager::reset_cache`] for an engine whose copies into the primary's rows may
    /// still run after the reset (vLLM submits a step's store copies at the next step): the
    /// rows with a write in flight stay out of allocation until
    /// [`TieringManager::release_reset_fence`], so no new key is given a row an old copy is
    /// about to write. Returns how many rows are fenced (0 for a primary that cannot fence).
    ///
    /// # Errors
    /// As [`TieringManager::reset_cache`].
    pub fn reset_cache_fencing_writes(&mut self) -> Result<usize, ManagerError> {
        self.reset_with("reset_cache_fencing_writes", true)
    }

    /// The engine's copies that were queued at the last fencing reset are over: the fenced
    /// rows can be allocated again. Returns how many were released.
    ///
    /// # Errors
    /// The manager was shut down.
    pub fn release_reset_fence(&self) -> Result<usize, ManagerError> {
        self.observe("release_reset_fence", |s| s.primary.release_reset_fence())
    }

    fn reset_with(&mut self, what: &'static str, fence_writes: bool) -> Result<usize, ManagerError> {
        if self.shared.shut_down.load(Ordering::Acquire) {
            return Err(ManagerError::ShutDown);
        }
        let timeout = self.shared.config.shutdown_lock_timeout;
        let Some(mut guard) = self.lock_for_teardown(timeout)? else {
            return Err(ManagerError::LockTimedOut(what, timeout));
        };
        let result = guard.engine_call(what, |s| s.reset_cache_unlocked(fence_writes));
        MutexGuard::unlock_fair(guard);
        result
    }

    /// Stops the control plane and the completion channel, then drains and shuts down the
    /// secondary tiers (each bounded by `tier_timeout`) and the primary.
    ///
    /// # Errors
    /// A tier failed or timed out (the arena is then kept alive), or the lock could not be
    /// taken because the control thread is stuck inside a tier.
    pub fn shutdown(&mut self) -> Result<(), ManagerError> {
        if self.shared.shut_down.load(Ordering::Acquire) {
            return Ok(());
        }
        self.stop_control_thread();
        // A control thread stuck inside a tier call still holds the lock; waiting for it forever
        // would turn a wedged tier into a hung engine, so give up with an error instead (the
        // tiers and the arena then stay alive, which is the safe side).
        let timeout = self.shared.config.shutdown_lock_timeout;
        let Some(mut guard) = self.lock_for_teardown(timeout)? else {
            return Err(ManagerError::ShutdownTimedOut(timeout));
        };
        if let Some(channel) = guard.completions.take_channel() {
            // Reports that arrived before the stop still count.
            channel.stop();
        }
        let result = guard.shutdown_tiers();
        MutexGuard::unlock_fair(guard);
        self.shared.shut_down.store(true, Ordering::Release);
        result
    }

    fn stop_control_thread(&mut self) {
        self.shared.stop_control_thread();
    }

    /// Takes the lock for a reset or a shutdown: waits at most `timeout`, and gives up sooner
    /// (an error naming the tier and the call) once the holder has been stuck inside one tier
    /// call for `tier_timeout`.
    fn lock_for_teardown(
        &self,
        timeout: std::time::Duration,
    ) -> Result<Option<MutexGuard<'_, TieringState>>, ManagerError> {
        tier_call::lock_unless_hung(
            &self.shared.calls,
            self.shared.config.tier_timeout,
            Some(timeout),
            |t| self.shared.state.try_lock_for(t),
        )
    }
}

impl std::fmt::Debug for TieringManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieringManager")
            .field("config", &self.shared.config)
            .field("arena", &self.arena)
            .field("control_thread_running", &self.control_thread_running())
            .field("shut_down", &self.shared.shut_down.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Drop for TieringManager {
    fn drop(&mut self) {
        if !self.shared.shut_down.load(Ordering::Acquire)
            && let Err(e) = self.shutdown()
        {
            tracing::error!(error = %e, "shutdown on drop failed");
        }
    }
}
