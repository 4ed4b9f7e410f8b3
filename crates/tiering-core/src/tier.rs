//! The tier contracts: what the primary (CPU) tier and every secondary tier implement, and the
//! `ParentManager` a tier calls back into while it serves a peer.

mod described;

use std::sync::Arc;

use crate::arena::ChunkArena;
use crate::error::{ManagerError, TierError};
use crate::event::OffloadingEvent;
use crate::job::{JobResult, TransferJob};
use crate::key::OffloadKey;
use crate::outcome::{ChunkId, LookupResult, OffloadPolicy, PrepareStoreOutput};
use crate::request::{ReqContext, TierInfo};
use crate::stats::TierStats;
use crate::waker::ControlWaker;

/// The CPU primary tier: the only tier the engine's device copies touch. It owns the
/// [`ChunkArena`].
///
/// Ref counts per resident chunk: −1 = write in flight (`lookup` says `HitPending`, not
/// evictable), 0 = ready and evictable, n > 0 = pinned by n readers. `prepare_store` and
/// `prepare_write` evict only ready, unpinned chunks, never the keys of the same call, and return
/// `None` with no change when they cannot make room. Contract violations return an error and
/// change nothing.
pub trait PrimaryTier: Send {
    /// Name, medium and locality.
    fn info(&self) -> TierInfo;

    /// The arena whose rows this tier's chunk ids index.
    fn arena(&self) -> &Arc<ChunkArena>;

    /// `Hit` (ready), `HitPending` (write in flight) or `Miss`; never `Retry`.
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult;

    /// Pins ready keys for a device load (recording the access) and returns their rows in key
    /// order.
    ///
    /// # Errors
    /// A key that is absent or not ready; nothing is pinned then.
    fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError>;

    /// A recency hint; absent keys are ignored.
    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext);

    /// Releases one `prepare_load` pin per key.
    ///
    /// # Errors
    /// A key that is absent or not pinned; nothing is released then.
    fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), TierError>;

    /// Reserves rows (write in flight) for the keys not yet resident, evicting if needed.
    /// `None` when it cannot make room; nothing changes then.
    fn prepare_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Option<PrepareStoreOutput>;

    /// Success: the listed keys still in flight become ready. Failure: they are freed. Keys
    /// that are absent or already ready are ignored.
    fn complete_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool);

    /// Pins ready keys for a cascade or a peer **without** recording an access.
    ///
    /// # Errors
    /// As [`PrimaryTier::prepare_load`].
    fn prepare_read(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError>;

    /// Releases one `prepare_read` pin per key.
    ///
    /// # Errors
    /// As [`PrimaryTier::complete_load`].
    fn complete_read(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), TierError> {
        self.complete_load(keys, ctx)
    }

    /// Reserves rows for promotions (as `prepare_store`).
    fn prepare_write(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Option<PrepareStoreOutput> {
        self.prepare_store(keys, ctx)
    }

    /// Completes promotions (as `complete_store`).
    fn complete_write(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool) {
        self.complete_store(keys, ctx, success);
    }

    /// The request finished: drop per-request state (and apply request-scoped recency).
    fn on_request_finished(&mut self, ctx: &ReqContext);

    /// Events since the last call.
    fn take_events(&mut self) -> Vec<OffloadingEvent>;

    /// Counters and gauges.
    fn stats(&self) -> TierStats;

    /// Forgets every chunk whatever its ref count. The caller guarantees no I/O touches the rows.
    fn reset(&mut self);

    /// Forgets every chunk like [`PrimaryTier::reset`], but keeps the rows with a write in
    /// flight (and the rows an earlier such reset fenced) out of allocation until
    /// [`PrimaryTier::release_reset_fence`]: for engines whose queued copies may still write
    /// those rows after the reset (vLLM submits a step's store copies at the next step).
    /// Returns how many rows are fenced. The default cannot fence: it resets everything and
    /// returns 0.
    fn reset_fencing_writes(&mut self) -> usize {
        self.reset();
        0
    }

    /// The engine's copies into the rows a reset fenced are over: they can be allocated
    /// again. Returns how many rows that released.
    fn release_reset_fence(&mut self) -> usize {
        0
    }

    /// Releases resources.
    ///
    /// # Errors
    /// Whatever the tier could not release.
    fn shutdown(&mut self) -> Result<(), TierError> {
        Ok(())
    }
}

/// A tier below the primary: disk, peers, a third-party store. It never sees device memory; it
/// copies to and from the arena rows a [`TransferJob`] grants.
///
/// Every method except `drain_jobs` and `shutdown` must return quickly: real I/O runs on the
/// tier's own threads. The manager calls a tier from one thread at a time, under its lock.
pub trait SecondaryTier: Send {
    /// Name, medium and locality.
    fn info(&self) -> TierInfo;

    /// Gives the tier the waker of the manager's control plane; called once at construction.
    fn set_waker(&mut self, waker: ControlWaker) {
        let _ = waker;
    }

    /// Whether the tier wants its completions polled and its peers served by the manager's
    /// control-plane thread, between scheduler steps (peers to serve, or completions worth
    /// applying while the model runs). A tier that does not opt in is polled and served only
    /// from the scheduler thread at step end, never from the control thread — so a tier with
    /// thread affinity (a Python tier, a GPU context) simply leaves this `false`.
    fn needs_control_plane(&self) -> bool {
        false
    }

    /// The next moment the tier needs a sweep even if nothing wakes the control thread
    /// (a heartbeat, a deadline). The control thread otherwise sleeps until woken or until its
    /// idle bound.
    fn next_deadline(&self) -> Option<std::time::Instant> {
        None
    }

    /// `Hit`, `Miss`, or `Retry` when the answer is pending. (`HitPending` is treated as
    /// `Retry`.)
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult;

    /// Starts copying the granted primary rows into the tier. The tier filters keys it already
    /// holds, evicts and allocates itself. Must eventually be reported through `poll_finished`.
    fn submit_store(&mut self, job: TransferJob);

    /// Starts copying the tier's data for `job.keys` into the granted primary rows. Must
    /// eventually be reported through `poll_finished`.
    fn submit_load(&mut self, job: TransferJob);

    /// Appends every job that finished since the last call to `out`. Each submitted job is
    /// reported exactly once, failures included.
    fn poll_finished(&mut self, out: &mut Vec<JobResult>);

    /// Whether the tier needs the engine to keep stepping (I/O in flight, a peer being served).
    fn has_pending_work(&self) -> bool {
        false
    }

    /// A recency hint.
    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        let _ = (keys, ctx);
    }

    /// A request starts; returns what the tier wants offloaded for it.
    fn on_new_request(&mut self, ctx: &ReqContext) -> OffloadPolicy {
        let _ = ctx;
        OffloadPolicy::ChunkLevel
    }

    /// No further submissions or touches will arrive for the request (jobs may be in flight).
    fn on_request_finished(&mut self, ctx: &ReqContext) {
        let _ = ctx;
    }

    /// Serves inbound peer requests through `parent`, which is valid only for this call.
    ///
    /// # Errors
    /// A failure that should stop the control plane (it is handed back to the engine).
    fn serve_external_requests(&mut self, parent: &mut dyn ParentManager) -> Result<(), TierError> {
        let _ = parent;
        Ok(())
    }

    /// End-of-step hook (for example to flush batched asynchronous lookups).
    fn on_schedule_end(&mut self) {}

    /// Blocks until every submitted job is finished and available from `poll_finished`. Never
    /// tears a copy in progress; queued jobs may be cancelled but are then reported failed.
    fn drain_jobs(&mut self);

    /// Events for this tier's own storage since the last call.
    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        Vec::new()
    }

    /// Counters and gauges.
    fn stats(&self) -> TierStats {
        TierStats::named(self.info().name)
    }

    /// Whether the tier can reach its storage, and how often it came back after it could not.
    /// The manager reads it only while it remembers a failed promotion from the tier: a tier that
    /// has recovered since (more recoveries, or healthy after being unhealthy) is looked up again
    /// at once instead of after its back-off (`docs/ARCHITECTURE.md`, "Failed promotions").
    /// The default is always healthy: such a tier is looked up again when its back-off expires.
    fn health(&self) -> TierHealth {
        TierHealth::default()
    }

    /// Stops threads and closes connections.
    ///
    /// # Errors
    /// Whatever the tier could not stop; the manager then keeps the arena alive.
    fn shutdown(&mut self) -> Result<(), TierError> {
        Ok(())
    }
}

pub use described::Redescribed;

/// A secondary tier's health signal ([`SecondaryTier::health`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierHealth {
    /// The tier can reach its storage now (a remote tier: its server answers).
    pub healthy: bool,
    /// How many times the tier has come back after being unreachable, since it was built: a
    /// generation counter, so a recovery between two reads is not missed.
    pub recoveries: u64,
}

impl Default for TierHealth {
    fn default() -> Self {
        Self {
            healthy: true,
            recoveries: 0,
        }
    }
}

impl TierHealth {
    /// Whether `self` (read now) shows a recovery since `earlier` was read.
    #[must_use]
    pub fn recovered_since(&self, earlier: &TierHealth) -> bool {
        self.recoveries > earlier.recoveries || (self.healthy && !earlier.healthy)
    }
}

/// How a tier calls back into the manager while serving a peer. Valid only during
/// [`SecondaryTier::serve_external_requests`]; the serving (origin) tier is excluded from every
/// fan-out.
///
/// For every remote request the sequence is `on_new_request` → any interleaving of `lookup` and
/// `create_store_job` → `on_request_finished`, and the last call is mandatory even when nothing
/// was found.
pub trait ParentManager {
    /// Announces a remote request to every other tier.
    ///
    /// # Errors
    /// The manager has failed.
    fn on_new_request(&mut self, ctx: &ReqContext) -> Result<OffloadPolicy, ManagerError>;

    /// Looks a key up in the primary and then in the other secondary tiers (a secondary hit
    /// starts a promotion and answers `HitPending`).
    ///
    /// # Errors
    /// The manager has failed.
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupResult, ManagerError>;

    /// Pins ready primary chunks and returns a store job registered to the serving tier, which
    /// moves the bytes itself and reports the job through its own `poll_finished`.
    ///
    /// # Errors
    /// A key that is not a ready primary hit (nothing is pinned then).
    fn create_store_job(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<TransferJob, ManagerError>;

    /// The remote request is over.
    ///
    /// # Errors
    /// The request is unknown.
    fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<(), ManagerError>;
}
