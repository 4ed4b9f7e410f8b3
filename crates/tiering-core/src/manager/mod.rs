//! The orchestrator: [`TieringManager`] composes one primary tier and an ordered chain of
//! secondary tiers, with its control plane on a dedicated thread.
//!
//! Locking (DESIGN §4.1): all mutable state is one [`TieringState`] behind one mutex. The first
//! engine call of a step takes the lock and keeps the guard in the handle; `on_schedule_end`
//! releases it. That keeps a chunk reported `Hit` resident until the engine's `prepare_load`: no
//! sweep can run in between. Read-mostly hooks lock only for their own duration.

mod control;
mod lifecycle;
mod offstep;
mod parent;
mod state;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::lock_api::ArcMutexGuard;
use parking_lot::{Mutex, MutexGuard, RawMutex};

use crate::arena::ChunkArena;
use crate::error::ManagerError;
use crate::event::OffloadingEvent;
use crate::key::OffloadKey;
use crate::offloading::OffloadingManager;
use crate::outcome::{ChunkId, LookupResult, OffloadPolicy, PrepareStoreOutput, ScheduleEndContext};
use crate::request::ReqContext;
use crate::stats::ManagerStats;
use crate::tier::{PrimaryTier, SecondaryTier};
use crate::waker::ControlWaker;

use control::{ControlThread, Shared};
pub use offstep::StoreCompletionSender;
pub use state::TieringState;

/// Construction options of a [`TieringManager`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManagerConfig {
    /// Run the control plane on a dedicated thread (started by the first `on_schedule_end` when
    /// at least one secondary tier exists). `false` keeps everything step-driven.
    pub control_plane_thread: bool,
    /// Longest wait between sweeps when no tier signals the waker.
    pub idle_wait: Duration,
    /// How long the control thread waits for the lock before re-checking the stop flag.
    pub lock_timeout: Duration,
    /// How often a starved control thread warns.
    pub starvation_warning: Duration,
    /// How long `shutdown` waits for the control thread to exit.
    pub join_timeout: Duration,
    /// Off-step mode: store completions reported through a [`StoreCompletionSender`] are applied
    /// by the control thread between steps, and promotions started while serving a peer are
    /// submitted within the same sweep.
    pub off_step: bool,
    /// How long `shutdown` waits for the lock after that (a control thread stuck in a tier
    /// still holds it).
    pub shutdown_lock_timeout: Duration,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            control_plane_thread: true,
            idle_wait: Duration::from_millis(1),
            lock_timeout: Duration::from_secs(1),
            starvation_warning: Duration::from_secs(10),
            join_timeout: Duration::from_secs(2),
            shutdown_lock_timeout: Duration::from_secs(10),
            off_step: false,
        }
    }
}

impl ManagerConfig {
    /// The fully step-driven configuration (no control thread), for deterministic tests.
    #[must_use]
    pub fn step_driven() -> Self {
        Self {
            control_plane_thread: false,
            ..Self::default()
        }
    }
}

type StepGuard = ArcMutexGuard<RawMutex, TieringState>;

/// The engine-facing tiering manager. See the module docs for the locking rules.
pub struct TieringManager {
    shared: Arc<Shared>,
    arena: Arc<ChunkArena>,
    step: Option<StepGuard>,
    control: Option<ControlThread>,
    config: ManagerConfig,
    thread_enabled: bool,
    shut_down: bool,
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
    #[must_use]
    pub fn with_waker(
        primary: Box<dyn PrimaryTier>,
        mut secondaries: Vec<Box<dyn SecondaryTier>>,
        config: ManagerConfig,
        waker: ControlWaker,
    ) -> Self {
        for tier in &mut secondaries {
            tier.set_waker(waker.clone());
        }
        let thread_enabled = config.control_plane_thread && !secondaries.is_empty();
        let arena = Arc::clone(primary.arena());
        let mut state = TieringState::new(primary, secondaries);
        state.off_step = config.off_step;
        Self {
            shared: Arc::new(Shared {
                state: Arc::new(Mutex::new(state)),
                stop: AtomicBool::new(false),
                failed: AtomicBool::new(false),
                failure: Mutex::new(None),
                waker,
            }),
            arena,
            step: None,
            control: None,
            config,
            thread_enabled,
            shut_down: false,
        }
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
        &self.config
    }

    /// The waker the tiers signal.
    #[must_use]
    pub fn waker(&self) -> &ControlWaker {
        &self.shared.waker
    }

    /// A handle the engine's device-copy worker uses to report finished device→primary stores
    /// without waiting for a step (see [`StoreCompletionSender`]). Creating one switches the
    /// manager to expect every store to be reported twice (worker and engine).
    pub fn store_completion_sender(&mut self) -> StoreCompletionSender {
        let queue = self.inspect(|s| {
            s.ledger.dual_reporting = true;
            Arc::clone(&s.completion_queue)
        });
        StoreCompletionSender::new(queue, self.shared.waker.clone())
    }

    /// Whether the control-plane thread is running.
    #[must_use]
    pub fn control_thread_running(&self) -> bool {
        self.control.as_ref().is_some_and(|c| !c.is_finished())
    }

    /// The control-plane thread's id, once started.
    #[must_use]
    pub fn control_thread_id(&self) -> Option<std::thread::ThreadId> {
        self.control.as_ref().map(ControlThread::thread_id)
    }

    /// Whether the handle currently holds the step lock.
    #[must_use]
    pub fn in_step(&self) -> bool {
        self.step.is_some()
    }

    /// The stored control-plane failure, if a sweep failed.
    #[must_use]
    pub fn control_failure(&self) -> Option<String> {
        self.shared.failure().map(|f| f.message.clone())
    }

    /// Runs `f` on the state under the lock (the step's guard when one is held), without
    /// starting a step. For diagnostics and tests.
    pub fn inspect<R>(&mut self, f: impl FnOnce(&mut TieringState) -> R) -> R {
        if let Some(guard) = self.step.as_mut() {
            return f(guard);
        }
        let mut guard = self.shared.state.lock();
        let r = f(&mut guard);
        MutexGuard::unlock_fair(guard);
        r
    }

    fn check_failure(&self) -> Result<(), ManagerError> {
        match self.shared.failure() {
            Some(f) => Err(ManagerError::ControlPlane(f)),
            None => Ok(()),
        }
    }

    /// Takes the step lock unless this step already holds it.
    fn enter_step(&mut self) -> Result<&mut TieringState, ManagerError> {
        if self.shut_down {
            return Err(ManagerError::ShutDown);
        }
        self.check_failure()?;
        if self.step.is_none() {
            let guard = self.shared.state.lock_arc();
            self.step = Some(guard);
            // A sweep may have failed while this call waited for the lock.
            if let Err(e) = self.check_failure() {
                self.exit_step();
                return Err(e);
            }
        }
        match self.step.as_mut() {
            Some(guard) => Ok(&mut **guard),
            None => Err(ManagerError::ShutDown),
        }
    }

    fn exit_step(&mut self) {
        if let Some(guard) = self.step.take() {
            ArcMutexGuard::unlock_fair(guard);
        }
    }

    /// Read-mostly hooks: use the step's guard when held, otherwise lock only for the call.
    fn observe<R>(&mut self, f: impl FnOnce(&mut TieringState) -> R) -> Result<R, ManagerError> {
        if self.shut_down {
            return Err(ManagerError::ShutDown);
        }
        self.check_failure()?;
        Ok(self.inspect(f))
    }

    fn start_control_thread(&mut self) {
        if !self.thread_enabled || self.control.is_some() {
            return;
        }
        match ControlThread::spawn(Arc::clone(&self.shared), self.config.clone()) {
            Ok(thread) => {
                if let Some(guard) = self.step.as_mut() {
                    guard.control_thread_live = true;
                }
                self.control = Some(thread);
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot start the control-plane thread; staying step-driven");
                self.thread_enabled = false;
            }
        }
    }

    fn stop_control_thread(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.waker.wake();
        // The thread may be waiting for the lock this handle holds.
        self.exit_step();
        if let Some(thread) = self.control.take()
            && !thread.join(self.config.join_timeout)
        {
            tracing::error!(
                "the control-plane thread did not stop within {:?}; shutting tiers down anyway \
                 (it re-checks the stop flag before any further sweep)",
                self.config.join_timeout
            );
        }
    }
}

impl OffloadingManager for TieringManager {
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupResult, ManagerError> {
        self.enter_step()?.lookup_unlocked(key, ctx, true)
    }

    fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, ManagerError> {
        self.enter_step()?
            .primary
            .prepare_load(keys, ctx)
            .map_err(ManagerError::primary)
    }

    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), ManagerError> {
        let state = self.enter_step()?;
        state.primary.touch(keys, ctx);
        for slot in &mut state.tiers {
            if let Some(tier) = slot.tier.as_mut() {
                tier.touch(keys, ctx);
            }
        }
        Ok(())
    }

    fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), ManagerError> {
        self.enter_step()?
            .primary
            .complete_load(keys, ctx)
            .map_err(ManagerError::primary)
    }

    fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>, ManagerError> {
        self.enter_step()?.prepare_store_unlocked(keys, ctx)
    }

    fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) -> Result<(), ManagerError> {
        self.enter_step()?
            .complete_store_from(keys, ctx, success, offstep::CompletionSource::Engine)
    }

    fn on_new_request(&mut self, ctx: &ReqContext) -> Result<OffloadPolicy, ManagerError> {
        Ok(self.enter_step()?.on_new_request_unlocked(ctx, None))
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<(), ManagerError> {
        self.enter_step()?.on_request_finished_unlocked(ctx)
    }

    fn on_schedule_end(&mut self, _ctx: &ScheduleEndContext) -> Result<(), ManagerError> {
        self.enter_step()?;
        self.start_control_thread();
        let result = match self.step.as_mut() {
            Some(state) => {
                let mut first_err = None;
                if !state.control_thread_live {
                    // Step-driven: a catch-all poll (for steps that never looked anything up),
                    // then serving, all on this thread.
                    if let Err(e) = state.gated_poll() {
                        first_err.get_or_insert(e);
                    }
                    if let Err(e) = state.serve_all() {
                        first_err.get_or_insert(e);
                    }
                }
                if let Err(e) = state.end_of_step_flush() {
                    first_err.get_or_insert(e);
                }
                first_err.map_or(Ok(()), Err)
            }
            None => Err(ManagerError::ShutDown),
        };
        self.exit_step();
        result
    }

    fn has_pending_work(&mut self) -> Result<bool, ManagerError> {
        self.observe(|s| s.has_pending_work_unlocked())
    }

    fn take_events(&mut self) -> Result<Vec<OffloadingEvent>, ManagerError> {
        self.observe(TieringState::take_events_unlocked)
    }

    fn reset_cache(&mut self) -> Result<(), ManagerError> {
        if self.step.is_some() {
            return Err(ManagerError::MidStep("reset_cache"));
        }
        let result = self.enter_step()?.reset_cache_unlocked();
        self.exit_step();
        result
    }

    fn stats(&mut self) -> Result<ManagerStats, ManagerError> {
        self.observe(|s| s.stats_unlocked())
    }

    fn shutdown(&mut self) -> Result<(), ManagerError> {
        if self.shut_down {
            return Ok(());
        }
        self.stop_control_thread();
        // A stored control-thread failure must not mask the teardown: no failure check here.
        // A control thread stuck inside a tier call still holds the lock; waiting for it forever
        // would turn a wedged tier into a hung engine, so give up with an error instead (the
        // tiers and the arena then stay alive, which is the safe side).
        let Some(mut guard) = self.shared.state.try_lock_for(self.config.shutdown_lock_timeout) else {
            return Err(ManagerError::ShutdownTimedOut(self.config.shutdown_lock_timeout));
        };
        let result = guard.shutdown_tiers();
        MutexGuard::unlock_fair(guard);
        self.shut_down = true;
        result
    }
}

impl std::fmt::Debug for TieringManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieringManager")
            .field("config", &self.config)
            .field("arena", &self.arena)
            .field("in_step", &self.step.is_some())
            .field("control_thread_running", &self.control_thread_running())
            .field("shut_down", &self.shut_down)
            .finish_non_exhaustive()
    }
}

impl Drop for TieringManager {
    fn drop(&mut self) {
        if !self.shut_down
            && let Err(e) = self.shutdown()
        {
            tracing::error!(error = %e, "shutdown on drop failed");
        }
    }
}
