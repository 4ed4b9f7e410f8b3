//! Tier failures: catching a tier's panics at the call, the failure policy (quarantine the tier
//! or report and keep it), and tier calls that may block (`drain_jobs`, `shutdown`) bounded by a
//! timeout so a hung tier is abandoned instead of waited on forever.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::time::Duration;

use crate::error::{ManagerError, TierError, panic_message};
use crate::tier::SecondaryTier;

use super::config::OnTierFailure;
use super::state::TieringState;

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

/// Runs `f` on `tier` on a helper thread and waits at most `timeout` for it.
pub(crate) fn run_bounded<R: Send + 'static>(
    mut tier: Box<dyn SecondaryTier>,
    timeout: Duration,
    op: &'static str,
    f: fn(&mut dyn SecondaryTier) -> R,
) -> Bounded<R> {
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name(format!("kvtier-{op}"))
        .spawn(move || {
            let outcome = catch_unwind(AssertUnwindSafe(|| f(tier.as_mut())));
            let _ = tx.send((tier, outcome.map_err(|p| panic_message(&*p))));
        });
    if let Err(e) = spawned {
        // No thread to spare: there is no way to bound the call, so say so and give up on it
        // rather than risk blocking the engine forever.
        tracing::error!(op, error = %e, "cannot start a thread to bound a tier call");
        return Bounded::TimedOut;
    }
    match rx.recv_timeout(timeout) {
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
            if self.on_tier_failure == OnTierFailure::Quarantine {
                self.quarantine(f.tier, &f.error.to_string());
            }
            first.get_or_insert(f.error);
        }
        first.map_or(Ok(()), Err)
    }

    /// Calls `f` on tier `idx`, turning a panic into an error (and, under the quarantine policy,
    /// quarantining the tier). An absent tier is skipped.
    pub(crate) fn call_tier(
        &mut self,
        idx: usize,
        op: &str,
        f: impl FnOnce(&mut dyn SecondaryTier),
    ) -> Result<(), ManagerError> {
        let Some(tier) = self.tiers[idx].tier.as_mut() else {
            return Ok(());
        };
        match catch_unwind(AssertUnwindSafe(|| f(tier.as_mut()))) {
            Ok(()) => Ok(()),
            Err(payload) => {
                let error = ManagerError::tier(
                    &self.tiers[idx].info.name,
                    TierError::Other(format!("panicked in {op}: {}", panic_message(&*payload))),
                );
                self.handle_faults(vec![TierFault::new(idx, error)])
            }
        }
    }

    /// Takes tier `idx` out of the chain for good: it is no longer looked up, stored to or
    /// served. It is shut down (bounded); once it has stopped, its in-flight jobs are reported
    /// failed, which releases their pins and reserved rows. A tier that does not stop in time
    /// keeps its rows pinned (it may still be writing them) and the error log says how many.
    pub(crate) fn quarantine(&mut self, idx: usize, reason: &str) {
        let Some(slot) = self.tiers.get_mut(idx) else {
            return;
        };
        if slot.quarantined.is_some() {
            return;
        }
        slot.quarantined = Some(reason.to_owned());
        let name = slot.info.name.clone();
        let Some(tier) = slot.tier.take() else {
            return;
        };
        self.counters.tiers_quarantined += 1;
        tracing::error!(tier = %name, %reason, "tier quarantined: it leaves the chain");
        match run_bounded(tier, self.tier_timeout, "tier-shutdown", |t| t.shutdown()) {
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
                let held = self.jobs.values().filter(|m| m.tier == idx).count();
                tracing::error!(
                    tier = %name,
                    timeout = ?self.tier_timeout,
                    jobs = held,
                    "quarantined tier did not stop in time; the rows of its jobs stay pinned"
                );
                // Promotions that were only reserved never reached the tier: free them.
                let pending = std::mem::take(&mut self.pending_promotions[idx]);
                for (_, p) in pending {
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
            let Some(tier) = self.tiers[idx].tier.take() else {
                continue;
            };
            let name = self.tiers[idx].info.name.clone();
            match run_bounded(tier, self.tier_timeout, "tier-drain", |t| t.drain_jobs()) {
                Bounded::Done(tier, ()) => self.tiers[idx].tier = Some(tier),
                Bounded::Panicked(tier, msg) => {
                    self.tiers[idx].tier = Some(tier);
                    let e =
                        ManagerError::tier(&name, TierError::Other(format!("panicked in drain_jobs: {msg}")));
                    self.quarantine(idx, &e.to_string());
                    first.get_or_insert(e);
                }
                Bounded::TimedOut => {
                    let e = ManagerError::TierTimedOut {
                        tier: name,
                        op: "drain_jobs",
                        timeout: self.tier_timeout,
                    };
                    self.tiers[idx].quarantined = Some(e.to_string());
                    self.counters.tiers_quarantined += 1;
                    tracing::error!(error = %e, "tier abandoned; the rows of its jobs stay pinned");
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }
}
