//! The engine-facing contract: what an inference engine's scheduler calls.

use crate::error::ManagerError;
use crate::event::OffloadingEvent;
use crate::key::OffloadKey;
use crate::outcome::{ChunkId, LookupResult, OffloadPolicy, PrepareStoreOutput, ScheduleEndContext};
use crate::request::ReqContext;
use crate::stats::ManagerStats;

/// What an engine's scheduler calls, once per chunk or batch, from one thread.
///
/// **Engine rule**: `on_schedule_end` is the last manager call of a step, made just before the
/// model runs. A call after it starts a new step (it takes the manager lock again) and holds the
/// lock through model execution, starving the control plane.
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

    /// Ends the step: flushes batched work and releases the step lock. Call it last.
    ///
    /// # Errors
    /// The control plane failed, or a tier reported an invalid job.
    fn on_schedule_end(&mut self, ctx: &ScheduleEndContext) -> Result<(), ManagerError>;

    /// Whether the engine should keep stepping even with no requests.
    ///
    /// # Errors
    /// The control plane failed.
    fn has_pending_work(&mut self) -> Result<bool, ManagerError>;

    /// Events since the last call: the primary's, then each secondary's in chain order.
    ///
    /// # Errors
    /// The control plane failed.
    fn take_events(&mut self) -> Result<Vec<OffloadingEvent>, ManagerError>;

    /// Drains every tier, then forgets everything in the primary tier; secondary data survives.
    /// Must not be called mid-step.
    ///
    /// # Errors
    /// Called mid-step, or jobs remained after draining.
    fn reset_cache(&mut self) -> Result<(), ManagerError>;

    /// A snapshot of the counters.
    ///
    /// # Errors
    /// The control plane failed.
    fn stats(&mut self) -> Result<ManagerStats, ManagerError>;

    /// Stops the control plane, then shuts down the secondary tiers and the primary.
    ///
    /// # Errors
    /// A tier failed to shut down (the arena is then kept alive).
    fn shutdown(&mut self) -> Result<(), ManagerError>;
}
