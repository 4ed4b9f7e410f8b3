//! Serving peers: the serving tier is taken out of the state for the duration of its
//! `serve_external_requests`, and calls back through a [`TierFacingParent`] that borrows the rest.

use crate::error::ManagerError;
use crate::job::TransferJob;
use crate::key::OffloadKey;
use crate::outcome::{LookupResult, OffloadPolicy};
use crate::request::ReqContext;
use crate::tier::ParentManager;

use super::faults::TierFault;
use super::jobs::Servicer;
use super::state::TieringState;
use super::tier_call::{Op, catch};

/// The `ParentManager` handed to tier `origin` while it serves. It calls the `_unlocked`
/// bodies directly: its caller already holds the lock, and `&mut TieringState` makes taking it
/// again impossible. The origin tier is absent from `state.tiers` for the whole call.
pub(crate) struct TierFacingParent<'a> {
    state: &'a mut TieringState,
    origin: usize,
}

impl ParentManager for TierFacingParent<'_> {
    fn on_new_request(&mut self, ctx: &ReqContext) -> Result<OffloadPolicy, ManagerError> {
        Ok(self.state.on_new_request_unlocked(ctx, Some(self.origin)))
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupResult, ManagerError> {
        self.state.lookup_unlocked(key, ctx, false)
    }

    fn create_store_job(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<TransferJob, ManagerError> {
        let job = self.state.create_store_job_unlocked(keys, ctx, self.origin)?;
        self.state.counters.peer_store_jobs += 1;
        Ok(job)
    }

    fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<(), ManagerError> {
        self.state.on_request_finished_unlocked(ctx)
    }
}

impl TieringState {
    /// Lets tier `idx` serve its inbound peer requests. The tier is put back either way; an
    /// error it returns is returned, a panic goes through the failure policy
    /// (`super::tier_call`).
    pub(crate) fn serve_tier(&mut self, idx: usize) -> Result<(), ManagerError> {
        let Some(mut tier) = self.tiers.take(idx) else {
            return Ok(());
        };
        let mark = self.tiers.enter(idx, Op::Serve);
        let outcome = catch(|| {
            let mut parent = TierFacingParent {
                state: &mut *self,
                origin: idx,
            };
            tier.serve_external_requests(&mut parent)
        });
        self.tiers.leave(mark);
        self.tiers.put_back(idx, tier);
        if self.tiers.is_quarantined(idx) {
            // Quarantined while it was out of its slot: it leaves now.
            self.retire(idx);
        }
        match outcome {
            Ok(Ok(())) => Ok(()),
            // A panic the tier caught itself and reports (as a library tier may): a panic all
            // the same.
            Ok(Err(e @ crate::error::TierError::Panicked { .. })) => self.apply_panic_policy(idx, e),
            Ok(Err(e)) => Err(ManagerError::tier(self.tiers.name(idx), e)),
            Err(message) => self.tier_panicked(idx, Op::Serve, message),
        }
    }

    /// Serves every tier `who` services, in chain order; a failing tier does not stop the
    /// others.
    pub(crate) fn serve_tiers(&mut self, who: Servicer) -> Vec<TierFault> {
        let mut faults = Vec::new();
        for idx in 0..self.tiers.len() {
            if !self.serviced_by(idx, who) {
                continue;
            }
            if let Err(e) = self.serve_tier(idx) {
                faults.push(TierFault::new(idx, e));
            }
        }
        faults
    }
}
