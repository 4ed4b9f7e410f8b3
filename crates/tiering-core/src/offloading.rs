//! The engine-facing contract: what an inference engine's scheduler calls.

use crate::error::ManagerError;
use crate::key::OffloadKey;
use crate::outcome::{ChunkId, LookupResult, OffloadPolicy, PrepareStoreOutput, ScheduleEndContext};
use crate::request::ReqContext;

/// What an engine's scheduler calls during one step, once per chunk or batch, from one thread.
///
/// [`TieringManager`](crate::TieringManager) implements it on its [`Step`](crate::Step) guard:
/// `let mut step = manager.step();`, the step's calls in any order the engine needs
/// (`on_schedule_end` may come before the step's stores, as vLLM's connector does), then
/// `drop(step)` before the model runs. The handle's read-mostly hooks (`has_pending_work`,
/// `take_events`, `stats`) and `reset_cache`/`shutdown` are methods of the handle.
///
/// Contract violations (loading a key that is not a hit, completing a store for an unknown
/// request, …) return an error and leave the state unchanged.
pub trait OffloadingManager {
    /// The verdict for one chunk. Does not pin: a `Hit` stays evictable until `prepare_load`,
    /// which must come in the same step.
    ///
    /// # Errors
    /// The control plane failed, or a tier reported an invalid job.
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupResult, ManagerError>;

    /// Pins `Hit` keys for a device load; returns their arena rows in key order.
    ///
    /// # Errors
    /// A key that is not a ready primary hit (nothing is pinned then).
    fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, ManagerError>;

    /// A recency hint for the primary and every secondary tier.
    ///
    /// # Errors
    /// The control plane failed.
    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), ManagerError>;

    /// Releases the pins of a finished device load.
    ///
    /// # Errors
    /// A key that was not pinned (nothing is released then).
    fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), ManagerError>;

    /// Reserves arena rows for newly computed chunks; `None` when there is no room (retry later).
    /// Every output with non-empty `keys_to_store` must be matched by one `complete_store`.
    ///
    /// # Errors
    /// The request is unknown, or the control plane failed.
    fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>, ManagerError>;

    /// The device→primary copy of a `prepare_store` finished (or failed). On success the chunks
    /// become readable and cascade to every secondary tier.
    ///
    /// # Errors
    /// The request is unknown or has no store pending (nothing changes then).
    fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) -> Result<(), ManagerError>;

    /// A request reached the scheduler; returns its offload policy.
    ///
    /// # Errors
    /// The control plane failed.
    fn on_new_request(&mut self, ctx: &ReqContext) -> Result<OffloadPolicy, ManagerError>;

    /// No further `prepare_*` calls will come for the request (completions may).
    ///
    /// # Errors
    /// The request is unknown.
    fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<(), ManagerError>;

    /// The end-of-step flush: submits batched promotions, services the tiers the control
    /// thread does not own, runs the tiers' step hooks. It does not release the lock (dropping
    /// the step does), and whatever the step queues after it is flushed on drop.
    ///
    /// # Errors
    /// The control plane failed, or a tier reported an invalid job.
    fn on_schedule_end(&mut self, ctx: &ScheduleEndContext) -> Result<(), ManagerError>;
}
