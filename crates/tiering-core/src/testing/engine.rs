//! A test driver that calls a manager the way a step-by-step engine does.

use crate::error::ManagerError;
use crate::event::OffloadingEvent;
use crate::key::OffloadKey;
use crate::manager::{Step, StoreCompletionSender, TieringManager, TieringState};
use crate::offloading::OffloadingManager;
use crate::outcome::{ChunkId, LookupResult, OffloadPolicy, PrepareStoreOutput, ScheduleEndContext};
use crate::request::ReqContext;
use crate::stats::ManagerStats;
use crate::waker::ControlWaker;

/// Drives a manager the way a step-by-step engine does: a [`Step`] opens at the engine's first
/// call of a step and is dropped right after `on_schedule_end`, so each test reads as the
/// sequence of calls an engine makes. Tests of the step guard itself use
/// [`TieringManager::step`] directly.
pub struct Engine {
    step: Option<Step<'static>>,
    /// The manager itself (for the step-guard API and the handle's methods).
    pub handle: TieringManager,
}

impl Engine {
    /// Wraps a manager.
    pub fn new(handle: TieringManager) -> Self {
        Self { step: None, handle }
    }

    /// The open step, opened now if none is.
    #[allow(clippy::missing_panics_doc)]
    pub fn step(&mut self) -> &mut Step<'static> {
        let handle = &self.handle;
        self.step.get_or_insert_with(|| handle.detached_step())
    }

    /// Drops the open step, if any (releasing the lock).
    pub fn end(&mut self) {
        self.step = None;
    }

    /// `lookup` in the open step.
    ///
    /// # Errors
    /// The manager's error.
    pub fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupResult, ManagerError> {
        self.step().lookup(key, ctx)
    }
    /// `prepare_load` in the open step.
    ///
    /// # Errors
    /// The manager's error.
    pub fn prepare_load(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Vec<ChunkId>, ManagerError> {
        self.step().prepare_load(keys, ctx)
    }
    /// `touch` in the open step.
    ///
    /// # Errors
    /// The manager's error.
    pub fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), ManagerError> {
        self.step().touch(keys, ctx)
    }
    /// `complete_load` in the open step.
    ///
    /// # Errors
    /// The manager's error.
    pub fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), ManagerError> {
        self.step().complete_load(keys, ctx)
    }
    /// `prepare_store` in the open step.
    ///
    /// # Errors
    /// The manager's error.
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>, ManagerError> {
        self.step().prepare_store(keys, ctx)
    }
    /// `complete_store` in the open step.
    ///
    /// # Errors
    /// The manager's error.
    pub fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) -> Result<(), ManagerError> {
        self.step().complete_store(keys, ctx, success)
    }
    /// `on_new_request` in the open step.
    ///
    /// # Errors
    /// The manager's error.
    pub fn on_new_request(&mut self, ctx: &ReqContext) -> Result<OffloadPolicy, ManagerError> {
        self.step().on_new_request(ctx)
    }
    /// `on_request_finished` in the open step.
    ///
    /// # Errors
    /// The manager's error.
    pub fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<(), ManagerError> {
        self.step().on_request_finished(ctx)
    }
    /// Ends the step: `on_schedule_end`, then the step is dropped (the lock released).
    ///
    /// # Errors
    /// The manager's error.
    pub fn on_schedule_end(&mut self, ctx: &ScheduleEndContext) -> Result<(), ManagerError> {
        let r = self.step().on_schedule_end(ctx);
        self.end();
        r
    }
    /// `has_pending_work`, from the open step if any.
    ///
    /// # Errors
    /// The manager's error.
    pub fn has_pending_work(&mut self) -> Result<bool, ManagerError> {
        match self.step.as_mut() {
            Some(s) => s.has_pending_work(),
            None => self.handle.has_pending_work(),
        }
    }
    /// `take_events`, from the open step if any.
    ///
    /// # Errors
    /// The manager's error.
    pub fn take_events(&mut self) -> Result<Vec<OffloadingEvent>, ManagerError> {
        match self.step.as_mut() {
            Some(s) => s.take_events(),
            None => self.handle.take_events(),
        }
    }
    /// `stats`, from the open step if any.
    ///
    /// # Errors
    /// The manager's error.
    pub fn stats(&mut self) -> Result<ManagerStats, ManagerError> {
        match self.step.as_mut() {
            Some(s) => s.stats(),
            None => self.handle.stats(),
        }
    }
    /// Runs `f` on the locked state (the open step's, or locking for the call).
    pub fn inspect<R>(&mut self, f: impl FnOnce(&mut TieringState) -> R) -> R {
        match self.step.as_mut() {
            Some(s) => s.inspect(f).expect("the manager is shut down"),
            None => self.handle.inspect(f),
        }
    }
    /// Whether a step is open (the lock held).
    pub fn in_step(&self) -> bool {
        self.step.is_some()
    }
    /// Ends the open step, then `reset_cache`.
    ///
    /// # Errors
    /// The manager's error.
    pub fn reset_cache(&mut self) -> Result<(), ManagerError> {
        self.end();
        self.handle.reset_cache()
    }
    /// Ends the open step, then `shutdown`.
    ///
    /// # Errors
    /// The manager's error.
    pub fn shutdown(&mut self) -> Result<(), ManagerError> {
        self.end();
        self.handle.shutdown()
    }
    /// Whether the control thread runs.
    pub fn control_thread_running(&self) -> bool {
        self.handle.control_thread_running()
    }
    /// The control thread's id.
    pub fn control_thread_id(&self) -> Option<std::thread::ThreadId> {
        self.handle.control_thread_id()
    }
    /// A pending control-plane failure.
    pub fn control_failure(&self) -> Option<String> {
        self.handle.control_failure()
    }
    /// An in-process completion sender.
    pub fn store_completion_sender(&self) -> StoreCompletionSender {
        self.handle.store_completion_sender()
    }
    /// The manager's waker.
    pub fn waker(&self) -> &ControlWaker {
        self.handle.waker()
    }
}
