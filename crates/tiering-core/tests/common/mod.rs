//! Shared helpers for the manager integration tests.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use tiering_core::manager::TieringState;
use tiering_core::testing::{MemoryPrimary, ScriptedTier, ScriptedTierHandle};
use tiering_core::{
    ChunkId, LookupResult, ManagerError, ManagerStats, OffloadKey, OffloadPolicy, OffloadingEvent,
    OffloadingManager, PrepareStoreOutput, ReqContext, ScheduleEndContext, SecondaryTier, Step,
    TieringManager, ManagerConfig,
};

/// Bytes per chunk in these tests.
pub const CHUNK: usize = 64;

/// A generous deadline for waiting on the control thread (a liveness bound, not a speed check).
pub const PATIENCE: Duration = Duration::from_secs(30);

/// Drives a manager the way a step-by-step engine does: a [`Step`] opens at the engine's first
/// call of a step and is dropped right after `on_schedule_end`, so each test reads as the
/// sequence of calls an engine makes. (The step-guard tests use `TieringManager::step` directly.)
pub struct Engine {
    step: Option<Step<'static>>,
    pub handle: TieringManager,
}

impl Engine {
    pub fn new(handle: TieringManager) -> Self {
        Self { step: None, handle }
    }

    /// The open step, opened now if none is.
    pub fn step(&mut self) -> &mut Step<'static> {
        let handle = &self.handle;
        self.step.get_or_insert_with(|| handle.detached_step())
    }

    /// Drops the open step, if any (releasing the lock).
    pub fn end(&mut self) {
        self.step = None;
    }

    pub fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupResult, ManagerError> {
        self.step().lookup(key, ctx)
    }
    pub fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, ManagerError> {
        self.step().prepare_load(keys, ctx)
    }
    pub fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), ManagerError> {
        self.step().touch(keys, ctx)
    }
    pub fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), ManagerError> {
        self.step().complete_load(keys, ctx)
    }
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>, ManagerError> {
        self.step().prepare_store(keys, ctx)
    }
    pub fn complete_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool) -> Result<(), ManagerError> {
        self.step().complete_store(keys, ctx, success)
    }
    pub fn on_new_request(&mut self, ctx: &ReqContext) -> Result<OffloadPolicy, ManagerError> {
        self.step().on_new_request(ctx)
    }
    pub fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<(), ManagerError> {
        self.step().on_request_finished(ctx)
    }
    /// Ends the step: `on_schedule_end`, then the step is dropped (the lock released).
    pub fn on_schedule_end(&mut self, ctx: &ScheduleEndContext) -> Result<(), ManagerError> {
        let r = self.step().on_schedule_end(ctx);
        self.end();
        r
    }
    pub fn has_pending_work(&mut self) -> Result<bool, ManagerError> {
        match self.step.as_mut() {
            Some(s) => s.has_pending_work(),
            None => self.handle.has_pending_work(),
        }
    }
    pub fn take_events(&mut self) -> Result<Vec<OffloadingEvent>, ManagerError> {
        match self.step.as_mut() {
            Some(s) => s.take_events(),
            None => self.handle.take_events(),
        }
    }
    pub fn stats(&mut self) -> Result<ManagerStats, ManagerError> {
        match self.step.as_mut() {
            Some(s) => s.stats(),
            None => self.handle.stats(),
        }
    }
    pub fn inspect<R>(&mut self, f: impl FnOnce(&mut TieringState) -> R) -> R {
        match self.step.as_mut() {
            Some(s) => s.inspect(f).unwrap(),
            None => self.handle.inspect(f),
        }
    }
    /// Whether a step is open (the lock held).
    pub fn in_step(&self) -> bool {
        self.step.is_some()
    }
    pub fn reset_cache(&mut self) -> Result<(), ManagerError> {
        self.end();
        self.handle.reset_cache()
    }
    pub fn shutdown(&mut self) -> Result<(), ManagerError> {
        self.end();
        self.handle.shutdown()
    }
    pub fn control_thread_running(&self) -> bool {
        self.handle.control_thread_running()
    }
    pub fn control_thread_id(&self) -> Option<std::thread::ThreadId> {
        self.handle.control_thread_id()
    }
    pub fn control_failure(&self) -> Option<String> {
        self.handle.control_failure()
    }
    pub fn store_completion_sender(&self) -> tiering_core::StoreCompletionSender {
        self.handle.store_completion_sender()
    }
    pub fn waker(&self) -> &tiering_core::ControlWaker {
        self.handle.waker()
    }
}

pub struct Rig {
    pub m: Engine,
    pub primary: MemoryPrimary,
    pub tiers: Vec<ScriptedTierHandle>,
}

pub fn rig(num_chunks: usize, tier_names: &[&str], config: ManagerConfig) -> Rig {
    let primary = MemoryPrimary::new(num_chunks, CHUNK);
    let mut boxed: Vec<Box<dyn SecondaryTier>> = Vec::new();
    let mut tiers = Vec::new();
    for name in tier_names {
        let (t, h) = ScriptedTier::new(name);
        boxed.push(Box::new(t));
        tiers.push(h);
    }
    let m = Engine::new(TieringManager::new(Box::new(primary.clone()), boxed, config));
    Rig { m, primary, tiers }
}

pub fn key(n: u64) -> OffloadKey {
    OffloadKey::from_u64(n)
}

pub fn bytes_for(k: &OffloadKey) -> Vec<u8> {
    let seed = k.to_bytes()[31];
    (0..CHUNK).map(|i| seed.wrapping_add(i as u8)).collect()
}

pub fn end_step(m: &mut Engine) {
    m.on_schedule_end(&ScheduleEndContext::default()).unwrap();
}

/// Stores `keys` into the primary as the engine would: prepare, write the rows, complete.
pub fn store(m: &mut Engine, primary: &MemoryPrimary, ctx: &ReqContext, keys: &[OffloadKey]) {
    let out = m.prepare_store(keys, ctx).unwrap().expect("room in primary");
    let arena = tiering_core::PrimaryTier::arena(primary).clone();
    for (k, c) in out.keys_to_store.iter().zip(&out.chunk_ids) {
        arena.write_row(*c).unwrap().copy_from_slice(&bytes_for(k));
    }
    if !out.keys_to_store.is_empty() {
        m.complete_store(&out.keys_to_store, ctx, true).unwrap();
    }
}

/// Reads the bytes of a primary hit through a load, as the engine's device copier would.
pub fn load_bytes(
    m: &mut Engine,
    primary: &MemoryPrimary,
    ctx: &ReqContext,
    k: OffloadKey,
) -> Vec<u8> {
    let ids = m.prepare_load(&[k], ctx).unwrap();
    let arena = tiering_core::PrimaryTier::arena(primary).clone();
    let bytes = arena.read_row(ids[0]).unwrap().to_vec();
    m.complete_load(&[k], ctx).unwrap();
    bytes
}

/// Polls `pred` until it holds or `PATIENCE` passes.
pub fn eventually(mut pred: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + PATIENCE;
    while Instant::now() < deadline {
        if pred() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    pred()
}
