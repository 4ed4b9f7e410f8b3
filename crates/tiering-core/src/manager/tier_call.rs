//! The panic boundary: every call the manager makes into a tier goes through this module, on
//! the scheduler thread, the control thread and the helper threads that bound blocking calls.
//!
//! - A secondary tier is called through `TieringState::tier_call` (in `super::faults`, with
//!   the policy it applies): a panic becomes a
//!   [`TierError::Panicked`] naming the tier and the call, and `[control_plane] on_tier_failure`
//!   decides what follows: `quarantine` (the default) takes the tier out of the chain at once and
//!   the call goes on without it (a lookup walks on to the next tier; the engine sees a miss, not
//!   an error); `fail` keeps the tier and returns the error to the engine (by the call that met
//!   it, or by the step's next call when the call that met it cannot fail without misreporting
//!   what it did: a store completion, a request announced or finished, events collected).
//! - The primary tier is wrapped in a [`GuardedPrimary`]: it owns the arena and every row's
//!   reference count, so it cannot be quarantined. A panic in it fails the manager for good:
//!   the engine call that met it and every later one return [`ManagerError::Failed`] naming the
//!   tier and the call; `shutdown` still runs and keeps the arena alive.
//! - The engine's calls (`Step`, the handle's hooks, the control thread's sweep) are the outer
//!   boundary: a panic that reaches them came from the manager's own code, and fails the
//!   manager the same way. Nothing unwinds into the engine, and the step lock is released on
//!   every path.
//!
//! # Why catching is sound (`AssertUnwindSafe`)
//!
//! A panic can only leave *logically* inconsistent state behind, never undefined behaviour: the
//! tiers and the manager are safe Rust (a `.so` tier's panics are caught inside the library, at
//! the C boundary, and come back as errors). What a panicking call may leave:
//! - the tier's own state, half-updated. The tier is never called again under `quarantine` (it
//!   is shut down, bounded by `tier_timeout`, and dropped); under `fail` the operator chose to
//!   keep trusting it, and the worst it can do is answer wrongly about its own keys — a wrong
//!   `Hit` becomes a failed promotion, which frees the reserved row.
//! - a job it was handed (`submit_store`, `submit_load`): the `TransferJob` and its row grants
//!   are dropped by the unwind (releasing the grants) or kept by the tier. Quarantine reports
//!   every job of the tier failed once the tier has stopped, which releases the primary's pins
//!   and reserved rows; a tier that does not stop in time keeps its rows pinned, because it may
//!   still write them.
//! - results it had already pushed (`poll_finished`) are applied: they describe copies that
//!   finished before the panic.
//! - nothing of the manager's: the manager changes its own state only outside these calls (a
//!   tier gets `&mut` to itself, never to the manager's state; a serving tier reaches the state
//!   only through the `ParentManager`, whose calls are themselves guarded).
//!
//! The primary is different: a panic may leave a row's reference count wrong, and a wrong count
//! can hand one row to two keys — a wrong token, not a crash. Hence the manager fails instead.
//!
//! Hung tiers: [`TierCalls`] records which tier call is in progress and since when, so a thread
//! that waits for the lock while another is stuck inside a tier gives up after `tier_timeout`
//! with an error naming the tier and the call (`ManagerError::TierTimedOut`).

use std::cell::OnceCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::arena::ChunkArena;
use crate::error::{ManagerError, TierError, panic_message};
use crate::event::OffloadingEvent;
use crate::key::OffloadKey;
use crate::outcome::{ChunkId, LookupResult, PrepareStoreOutput};
use crate::request::{ReqContext, TierInfo};
use crate::stats::TierStats;
use crate::tier::PrimaryTier;

/// Runs `f`, returning its panic's message instead of unwinding. The one `catch_unwind` of tier
/// calls (see the module docs for why `AssertUnwindSafe` is sound here).
pub(crate) fn catch<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| panic_message(&*payload))
}

/// A secondary tier method, as the boundary names it (and as [`TierCalls`] records it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Info,
    NeedsControlPlane,
    SetWaker,
    Lookup,
    SubmitStore,
    SubmitLoad,
    PollFinished,
    HasPendingWork,
    Touch,
    OnNewRequest,
    OnRequestFinished,
    Serve,
    OnScheduleEnd,
    DrainJobs,
    TakeEvents,
    Stats,
    Health,
    NextDeadline,
    Shutdown,
}

impl Op {
    const ALL: [Op; 19] = [
        Op::Info,
        Op::NeedsControlPlane,
        Op::SetWaker,
        Op::Lookup,
        Op::SubmitStore,
        Op::SubmitLoad,
        Op::PollFinished,
        Op::HasPendingWork,
        Op::Touch,
        Op::OnNewRequest,
        Op::OnRequestFinished,
        Op::Serve,
        Op::OnScheduleEnd,
        Op::DrainJobs,
        Op::TakeEvents,
        Op::Stats,
        Op::Health,
        Op::NextDeadline,
        Op::Shutdown,
    ];

    /// The trait method's name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Info => "info",
            Op::NeedsControlPlane => "needs_control_plane",
            Op::SetWaker => "set_waker",
            Op::Lookup => "lookup",
            Op::SubmitStore => "submit_store",
            Op::SubmitLoad => "submit_load",
            Op::PollFinished => "poll_finished",
            Op::HasPendingWork => "has_pending_work",
            Op::Touch => "touch",
            Op::OnNewRequest => "on_new_request",
            Op::OnRequestFinished => "on_request_finished",
            Op::Serve => "serve_external_requests",
            Op::OnScheduleEnd => "on_schedule_end",
            Op::DrainJobs => "drain_jobs",
            Op::TakeEvents => "take_events",
            Op::Stats => "stats",
            Op::Health => "health",
            Op::NextDeadline => "next_deadline",
            Op::Shutdown => "shutdown",
        }
    }

    fn code(self) -> u64 {
        Self::ALL
            .iter()
            .position(|o| *o == self)
            .map_or(0, |i| i as u64 + 1)
    }

    fn from_code(code: u64) -> Option<Op> {
        usize::try_from(code)
            .ok()
            .and_then(|c| c.checked_sub(1))
            .and_then(|i| Self::ALL.get(i).copied())
    }
}

/// The secondary tier call in progress, readable without the manager's lock: which tier, which
/// call, since when. Written only by the lock holder (nested calls — a serving tier's parent
/// callbacks — save and restore the outer one), read by threads waiting for the lock.
pub(crate) struct TierCalls {
    names: Vec<String>,
    epoch: Instant,
    /// 0: none. Otherwise bits 0..8 the op code, 8..24 the tier index + 1, 24..64 the start in
    /// milliseconds since `epoch`.
    current: AtomicU64,
}

/// A tier call found stuck.
pub(crate) struct StuckCall {
    pub(crate) tier: String,
    pub(crate) op: &'static str,
    pub(crate) age: Duration,
}

impl TierCalls {
    pub(crate) fn new(names: Vec<String>) -> Self {
        Self {
            names,
            epoch: Instant::now(),
            current: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX) & ((1 << 40) - 1)
    }

    /// Marks a call of tier `idx` as in progress; returns the mark to restore afterwards.
    pub(crate) fn enter(&self, idx: usize, op: Op) -> u64 {
        let tier = (idx as u64 + 1) & 0xFFFF;
        let word = op.code() | (tier << 8) | (self.now_ms() << 24);
        self.current.swap(word, Ordering::AcqRel)
    }

    /// Ends the call `enter` marked.
    pub(crate) fn leave(&self, previous: u64) {
        self.current.store(previous, Ordering::Release);
    }

    /// The tier call in progress, if any, and for how long it has run.
    pub(crate) fn in_progress(&self) -> Option<StuckCall> {
        let word = self.current.load(Ordering::Acquire);
        if word == 0 {
            return None;
        }
        let op = Op::from_code(word & 0xFF)?;
        let idx = usize::try_from((word >> 8) & 0xFFFF).ok()?.checked_sub(1)?;
        let since = word >> 24;
        let age = Duration::from_millis(self.now_ms().saturating_sub(since));
        Some(StuckCall {
            tier: self.names.get(idx).cloned().unwrap_or_else(|| format!("#{idx}")),
            op: op.name(),
            age,
        })
    }
}

/// Waits for `mutex` as `lock` does, but gives up once the lock's holder has been inside one
/// tier call for `bound` (the error names the tier and the call), or after `limit` if given (then
/// `None` with no error: the caller reports its own timeout).
pub(crate) fn lock_unless_hung<G>(
    calls: &TierCalls,
    bound: Duration,
    limit: Option<Duration>,
    mut try_lock_for: impl FnMut(Duration) -> Option<G>,
) -> Result<Option<G>, ManagerError> {
    let start = Instant::now();
    loop {
        let mut wait = match calls.in_progress() {
            Some(stuck) if stuck.age >= bound => {
                return Err(ManagerError::TierTimedOut {
                    tier: stuck.tier,
                    op: stuck.op,
                    timeout: bound,
                });
            }
            // A millisecond past the bound, so the next check sees it reached.
            Some(stuck) => bound - stuck.age + Duration::from_millis(1),
            None => bound,
        };
        if let Some(limit) = limit {
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Ok(None);
            }
            wait = wait.min(left);
        }
        if let Some(guard) = try_lock_for(wait) {
            return Ok(Some(guard));
        }
    }
}

/// The primary tier behind the panic boundary. A panic is caught, the call answers as a tier
/// that has nothing would (a miss, no room, an error), and every later call is refused the
/// same way; the manager reads [`GuardedPrimary::failure`] after each engine call and fails.
pub(crate) struct GuardedPrimary {
    inner: Box<dyn PrimaryTier>,
    name: String,
    arena: Arc<ChunkArena>,
    failed: OnceCell<String>,
}

impl GuardedPrimary {
    pub(crate) fn new(inner: Box<dyn PrimaryTier>) -> Self {
        let arena = Arc::clone(inner.arena());
        let name = catch(|| inner.info().name).unwrap_or_else(|_| "primary".to_owned());
        Self {
            inner,
            name,
            arena,
            failed: OnceCell::new(),
        }
    }

    /// Why the primary failed ("primary tier `cpu` panicked in …"), once it did.
    pub(crate) fn failure(&self) -> Option<&String> {
        self.failed.get()
    }

    fn refused(&self, call: &'static str) -> TierError {
        TierError::Other(format!(
            "the primary tier `{}` failed earlier; {call} refused",
            self.name
        ))
    }

    fn note(&self, call: &'static str, message: String) {
        let reason = format!(
            "primary tier `{}`: {}",
            self.name,
            TierError::Panicked { call, message }
        );
        tracing::error!(%reason, "the primary tier panicked");
        let _ = self.failed.set(reason);
    }

    fn call<R>(
        &mut self,
        call: &'static str,
        fallback: impl FnOnce() -> R,
        f: impl FnOnce(&mut dyn PrimaryTier) -> R,
    ) -> R {
        if self.failed.get().is_some() {
            return fallback();
        }
        let inner = self.inner.as_mut();
        match catch(|| f(inner)) {
            Ok(r) => r,
            Err(message) => {
                self.note(call, message);
                fallback()
            }
        }
    }

    fn call_ref<R>(
        &self,
        call: &'static str,
        fallback: impl FnOnce() -> R,
        f: impl FnOnce(&dyn PrimaryTier) -> R,
    ) -> R {
        if self.failed.get().is_some() {
            return fallback();
        }
        match catch(|| f(self.inner.as_ref())) {
            Ok(r) => r,
            Err(message) => {
                self.note(call, message);
                fallback()
            }
        }
    }

    fn fallible<R>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&mut dyn PrimaryTier) -> Result<R, TierError>,
    ) -> Result<R, TierError> {
        let refused = self.refused(call);
        self.call(call, || Err(refused), f)
    }
}

impl PrimaryTier for GuardedPrimary {
    fn info(&self) -> TierInfo {
        self.call_ref("info", || TierInfo::new(&self.name, None, None), |p| p.info())
    }

    fn arena(&self) -> &Arc<ChunkArena> {
        &self.arena
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> LookupResult {
        self.call("lookup", || LookupResult::Miss, |p| p.lookup(key, ctx))
    }

    fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.fallible("prepare_load", |p| p.prepare_load(keys, ctx))
    }

    fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) {
        self.call("touch", || (), |p| p.touch(keys, ctx));
    }

    fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), TierError> {
        self.fallible("complete_load", |p| p.complete_load(keys, ctx))
    }

    fn prepare_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Option<PrepareStoreOutput> {
        self.call("prepare_store", || None, |p| p.prepare_store(keys, ctx))
    }

    fn complete_store(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool) {
        self.call("complete_store", || (), |p| p.complete_store(keys, ctx, success));
    }

    fn prepare_read(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, TierError> {
        self.fallible("prepare_read", |p| p.prepare_read(keys, ctx))
    }

    fn complete_read(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), TierError> {
        self.fallible("complete_read", |p| p.complete_read(keys, ctx))
    }

    fn prepare_write(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Option<PrepareStoreOutput> {
        self.call("prepare_write", || None, |p| p.prepare_write(keys, ctx))
    }

    fn complete_write(&mut self, keys: &[OffloadKey], ctx: &ReqContext, success: bool) {
        self.call("complete_write", || (), |p| p.complete_write(keys, ctx, success));
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) {
        self.call("on_request_finished", || (), |p| p.on_request_finished(ctx));
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        self.call("take_events", Vec::new, |p| p.take_events())
    }

    fn stats(&self) -> TierStats {
        self.call_ref("stats", || TierStats::named(&self.name), |p| p.stats())
    }

    fn reset(&mut self) {
        self.call("reset", || (), |p| p.reset());
    }

    fn reset_fencing_writes(&mut self) -> usize {
        self.call("reset_fencing_writes", || 0, |p| p.reset_fencing_writes())
    }

    fn release_reset_fence(&mut self) -> usize {
        self.call("release_reset_fence", || 0, |p| p.release_reset_fence())
    }

    fn shutdown(&mut self) -> Result<(), TierError> {
        self.fallible("shutdown", |p| p.shutdown())
    }
}
