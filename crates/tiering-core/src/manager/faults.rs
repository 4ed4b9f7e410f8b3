//! Tier failures: the failure policy (quarantine the tier or report and keep it), and tier calls
//! that may block (`drain_jobs`, `shutdown`) bounded by a timeout so a hung tier is abandoned
//! instead of waited on forever. Panics are caught by `super::tier_call`, the one boundary; the
//! calls through it (`TieringState::tier_call`, `engine_call`) are here because what a panic
//! leads to — a quarantine shuts the tier down, fails its jobs and frees its reserved
//! promotions — needs most of the state at once. What is remembered about failures is
//! `super::failure_state`'s.

use std::sync::{Arc, mpsc};
use std::time::Duration;

use crate::error::{ManagerError, TierError};
use crate::tier::PrimaryTier as _;
use crate::tier::SecondaryTier;

use super::state::TieringState;
use super::tier_call::{Op, TierCalls, catch};

/// A failure attributed to one secondary tier.
#[derive(Debug)]
pub(crate) struct TierFault {
    pub(crate) tier: usize,
    pub(crate) error: ManagerError,
}

impl TierFault {
    pub(crate) fn new(tier: usize, error: ManagerError) -> Self {
        Self { tier, error }
    }
}

/// How a bounded tier call ended.
pub(crate) enum Bounded<R> {
    /// It returned; the tier comes back.
    Done(Box<dyn SecondaryTier>, R),
    /// It panicked; the tier comes back (it should not be trusted).
    Panicked(Box<dyn SecondaryTier>, String),
    /// It did not return in time; the tier stays with the abandoned thread.
    TimedOut,
}

/// Runs `f` on tier `idx` (taken out of its slot) on a helper thread, through the panic
/// boundary, and waits at most `timeout` for it; the call is recorded in `calls` meanwhile.
pub(crate) fn run_bounded<R: Send + 'static>(
    mut tier: Box<dyn SecondaryTier>,
    timeout: Duration,
    (calls, idx): (&TierCalls, usize),
    op: Op,
    f: fn(&mut dyn SecondaryTier) -> R,
) -> Bounded<R> {
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name(format!("kvtier-{}", op.name()))
        .spawn(move || {
            let outcome = catch(|| f(tier.as_mut()));
            let _ = tx.send((tier, outcome));
        });
    if let Err(e) = spawned {
        // No thread to spare: there is no way to bound the call, so say so and give up on it
        // rather than risk blocking the engine forever.
        tracing::error!(op = op.name(), error = %e, "cannot start a thread to bound a tier call");
        return Bounded::TimedOut;
    }
    let mark = calls.enter(idx, op);
    let outcome = rx.recv_timeout(timeout);
    calls.leave(mark);
    match outcome {
        Ok((tier, Ok(r))) => Bounded::Done(tier, r),
        Ok((tier, Err(msg))) => Bounded::Panicked(tier, msg),
        Err(_) => Bounded::TimedOut,
    }
}

impl TieringState {
    /// Applies the failure policy to `faults` and returns the first one as the error.
    pub(crate) fn handle_faults(&mut self, faults: Vec<TierFault>) -> Result<(), ManagerError> {
        let mut first = None;
        for f in faults {
            if self.failures.quarantines() {
                self.quarantine(f.tier, &f.error.to_string());
            }
            first.get_or_insert(f.error);
        }
        first.map_or(Ok(()), Err)
    }

    /// Takes tier `idx` out of the chain for good: it is no longer looked up, stored to or
    /// served. It is shut down (bounded); once it has stopped, its in-flight jobs are reported
    /// failed, which releases their pins and reserved rows. A tier that does not stop in time
    /// keeps its rows pinned (it may still be writing them) and the error log says how many.
    pub(crate) fn quarantine(&mut self, idx: usize, reason: &str) {
        if !self.tiers.mark_quarantined(idx, reason) {
            return;
        }
        tracing::error!(tier = %self.tiers.name(idx), %reason, "tier quarantined: it leaves the chain");
        self.retire(idx);
    }

    /// The second half of [`TieringState::quarantine`], for a tier marked quarantined: shuts it
    /// down (bounded) and fails its jobs. A tier that is out of its slot right now (serving
    /// peers) is retired when it is put back.
    pub(crate) fn retire(&mut self, idx: usize) {
        let Some(tier) = self.tiers.take(idx) else {
            return;
        };
        let name = self.tiers.name(idx).to_owned();
        self.counters.tiers_quarantined += 1;
        let calls = Arc::clone(self.tiers.calls());
        match run_bounded(tier, self.tiers.timeout(), (&calls, idx), Op::Shutdown, |t| {
            t.shutdown()
        }) {
            Bounded::Done(tier, result) => {
                if let Err(e) = result {
                    tracing::warn!(tier = %name, error = %e, "quarantined tier did not shut down cleanly");
                }
                drop(tier);
                let failed = self.fail_jobs_of(idx);
                if failed > 0 {
                    tracing::warn!(tier = %name, jobs = failed, "in-flight jobs of a quarantined tier reported failed");
                }
            }
            Bounded::Panicked(tier, msg) => {
                tracing::warn!(tier = %name, panic = %msg, "quarantined tier panicked while shutting down");
                drop(tier);
                self.fail_jobs_of(idx);
            }
            Bounded::TimedOut => {
                let held = self.jobs.held_by(idx);
                tracing::error!(
                    tier = %name,
                    timeout = ?self.tiers.timeout(),
                    jobs = held,
                    "quarantined tier did not stop in time; the rows of its jobs stay pinned"
                );
                // Promotions that were only reserved never reached the tier: free them.
                for p in self.pending_promotions.take(idx) {
                    self.primary.complete_write(&p.keys, &p.ctx, false);
                    self.cost.forget(&p.keys);
                }
            }
        }
    }

    /// Runs a blocking tier call (`drain_jobs`) on every present tier, each bounded by the tier
    /// timeout. A tier that panics or times out is quarantined; the first such failure is
    /// returned after every tier was tried.
    pub(crate) fn drain_all_bounded(&mut self) -> Result<(), ManagerError> {
        let mut first = None;
        for idx in 0..self.tiers.len() {
            let Some(tier) = self.tiers.take(idx) else {
                continue;
            };
            let name = self.tiers.name(idx).to_owned();
            let calls = Arc::clone(self.tiers.calls());
            match run_bounded(tier, self.tiers.timeout(), (&calls, idx), Op::DrainJobs, |t| {
                t.drain_jobs();
            }) {
                Bounded::Done(tier, ()) => self.tiers.put_back(idx, tier),
                Bounded::Panicked(tier, message) => {
                    // Whatever the policy: a tier that cannot drain cannot be trusted with rows.
                    self.tiers.put_back(idx, tier);
                    self.counters.tier_panics += 1;
                    let e = ManagerError::tier(
                        &name,
                        TierError::Panicked {
                            call: Op::DrainJobs.name(),
                            message,
                        },
                    );
                    self.quarantine(idx, &e.to_string());
                    first.get_or_insert(e);
                }
                Bounded::TimedOut => {
                    let e = ManagerError::TierTimedOut {
                        tier: name,
                        op: "drain_jobs",
                        timeout: self.tiers.timeout(),
                    };
                    self.tiers.mark_quarantined(idx, &e.to_string());
                    self.counters.tiers_quarantined += 1;
                    tracing::error!(error = %e, "tier abandoned; the rows of its jobs stay pinned");
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Calls secondary tier `idx` through the panic boundary. `Ok(Some(r))`: it returned `r`.
    /// `Ok(None)`: the tier is absent (quarantined, or serving peers right now), or it panicked
    /// and was quarantined now — the caller goes on without it. `Err`: it panicked under the
    /// `fail` policy; the error names the tier and the call, and the tier stays in the chain.
    pub(crate) fn tier_call<R>(
        &mut self,
        idx: usize,
        op: Op,
        f: impl FnOnce(&mut dyn SecondaryTier) -> R,
    ) -> Result<Option<R>, ManagerError> {
        match self.tiers.call(idx, op, f) {
            None => Ok(None),
            Some(Ok(r)) => Ok(Some(r)),
            Some(Err(message)) => self.tier_panicked(idx, op, message).map(|()| None),
        }
    }

    /// [`TieringState::tier_call`] for a caller that cannot return the error: under `fail` it is
    /// kept for the step's next engine call.
    pub(crate) fn tier_call_or_defer<R>(
        &mut self,
        idx: usize,
        op: Op,
        f: impl FnOnce(&mut dyn SecondaryTier) -> R,
    ) -> Option<R> {
        match self.tier_call(idx, op, f) {
            Ok(r) => r,
            Err(e) => {
                self.failures.defer(e);
                None
            }
        }
    }

    /// Applies the failure policy to a panic of tier `idx` in `op` (caught by the caller, which
    /// has put the tier back in its slot). `Err` under `fail`.
    pub(crate) fn tier_panicked(&mut self, idx: usize, op: Op, message: String) -> Result<(), ManagerError> {
        self.apply_panic_policy(
            idx,
            TierError::Panicked {
                call: op.name(),
                message,
            },
        )
    }

    /// The failure policy for a panic of tier `idx`, described by `panic` (a
    /// [`TierError::Panicked`]; a tier may also return one, e.g. a library tier reporting a panic
    /// its boundary caught earlier). `Err` under `fail`.
    pub(crate) fn apply_panic_policy(&mut self, idx: usize, panic: TierError) -> Result<(), ManagerError> {
        let error = ManagerError::tier(&self.tier_name(idx), panic);
        self.counters.tier_panics += 1;
        if self.failures.quarantines() {
            tracing::error!(error = %error, "a tier panicked; it is quarantined");
            self.quarantine(idx, &error.to_string());
            Ok(())
        } else {
            tracing::error!(error = %error, "a tier panicked; returned to the engine (on_tier_failure = fail)");
            Err(error)
        }
    }

    /// The manager's failure once it has failed: set by a primary panic or by a panic of the
    /// manager's own code (checked by every engine call).
    pub(crate) fn failure(&mut self) -> Option<ManagerError> {
        self.failures.failure(self.primary.failure())
    }

    /// The outer boundary of an engine call (a `Step` method, a handle hook, a reset): refuses it
    /// once the manager has failed, runs it, and fails the manager if it panicked (the panic came
    /// from the manager's own code: tier calls are caught inside) or if the primary panicked
    /// during it.
    pub(crate) fn engine_call<R>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&mut Self) -> Result<R, ManagerError>,
    ) -> Result<R, ManagerError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let r = match catch(|| f(&mut *self)) {
            Ok(r) => r,
            Err(message) => return Err(self.fail_after_panic(call, &message)),
        };
        if let Some(e) = self.failure() {
            return Err(e);
        }
        r
    }

    /// Fails the manager for good after a panic of its own code in `call`.
    pub(crate) fn fail_after_panic(&mut self, call: &str, message: &str) -> ManagerError {
        self.failures
            .fail_after_panic(call, message, self.primary.failure())
    }
}
