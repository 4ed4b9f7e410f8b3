//! Reset and shutdown: both first finish what is in flight (worker reports, every tier's jobs,
//! each drain bounded by the tier timeout) so no completion is lost and no pin leaks.

use crate::error::ManagerError;
use crate::tier::PrimaryTier as _;

use super::faults::{Bounded, run_bounded};
use super::jobs::Servicer;
use super::state::TieringState;
use super::tier_call::Op;

impl TieringState {
    /// Drain → process → check no jobs → drop reservations → reset request counters (finalizing
    /// finished requests) → reset the primary. Secondary data survives.
    pub(crate) fn reset_cache_unlocked(&mut self, fence_writes: bool) -> Result<usize, ManagerError> {
        self.apply_queued_completions();
        let drained = self.drain_all_bounded();
        let faults = self.poll_tiers(Servicer::Everyone);
        let processed = self.handle_faults(faults);
        if !self.jobs.is_empty() {
            // A tier still owns rows: resetting the primary now could hand them to someone else.
            return Err(ManagerError::ResetLeftJobs(self.jobs.len()));
        }
        self.pending_promotions.clear();
        self.cost.clear_watches();
        let finished = self.requests.reset();
        self.completions.clear();
        for rid in finished {
            if let Some(state) = self.requests.remove(&rid) {
                self.notify_finished(&state);
            }
        }
        let fenced = if fence_writes {
            self.primary.reset_fencing_writes()
        } else {
            self.primary.reset();
            0
        };
        self.gates.reset();
        self.backoff.clear();
        self.step_polls.begin();
        self.step_hits.clear();
        drained.and(processed).map(|()| fenced)
    }

    /// Shuts every tier down (reporting the last failure), then the primary only if they all
    /// stopped: a tier that failed to stop may still touch the arena. Each tier's drain and
    /// shutdown is bounded by the tier timeout.
    pub(crate) fn shutdown_tiers(&mut self) -> Result<(), ManagerError> {
        self.apply_queued_completions();
        let drained = self.drain_all_bounded();
        let faults = self.poll_tiers(Servicer::Everyone);
        if let Err(e) = self.handle_faults(faults) {
            tracing::error!(error = %e, "invalid job report while shutting down");
        }
        let mut last_err = drained.err();
        for idx in 0..self.tiers.len() {
            let Some(tier) = self.tiers.take(idx) else {
                continue;
            };
            let name = self.tiers.name(idx).to_owned();
            let calls = std::sync::Arc::clone(self.tiers.calls());
            match run_bounded(tier, self.tiers.timeout(), (&calls, idx), Op::Shutdown, |t| {
                t.shutdown()
            }) {
                Bounded::Done(tier, Ok(())) => self.tiers.put_back(idx, tier),
                Bounded::Done(tier, Err(e)) => {
                    tracing::error!(tier = %name, error = %e, "tier shutdown failed");
                    self.tiers.put_back(idx, tier);
                    last_err = Some(ManagerError::tier(&name, e));
                }
                Bounded::Panicked(tier, message) => {
                    tracing::error!(tier = %name, panic = %message, "tier panicked while shutting down");
                    self.tiers.put_back(idx, tier);
                    self.counters.tier_panics += 1;
                    last_err = Some(ManagerError::tier(
                        &name,
                        crate::error::TierError::Panicked {
                            call: Op::Shutdown.name(),
                            message,
                        },
                    ));
                }
                Bounded::TimedOut => {
                    let e = ManagerError::TierTimedOut {
                        tier: name,
                        op: Op::Shutdown.name(),
                        timeout: self.tiers.timeout(),
                    };
                    tracing::error!(error = %e, "tier abandoned while shutting down");
                    last_err = Some(e);
                }
            }
        }
        if let Some(e) = last_err {
            return Err(e);
        }
        self.primary
            .shutdown()
            .map_err(|e| ManagerError::tier(&self.primary.info().name, e))
    }
}
