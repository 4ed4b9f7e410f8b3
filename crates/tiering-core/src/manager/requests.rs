//! The request lifecycle: announcing a request to every tier, and telling them it is over once
//! nothing more can be cascaded for it (all its stores settled, no parked keys).

use crate::error::ManagerError;
use crate::outcome::OffloadPolicy;
use crate::request::{ReqContext, RequestId};
use crate::tier::PrimaryTier as _;

use super::request_table::RequestState;
use super::state::TieringState;
use super::tier_call::Op;

impl TieringState {
    /// Announces a request to every present tier (the serving origin is absent, and is
    /// remembered as `exclude` so a deferred finalization skips it too).
    pub(crate) fn on_new_request_unlocked(
        &mut self,
        ctx: &ReqContext,
        exclude: Option<usize>,
    ) -> OffloadPolicy {
        let mut request_level = Vec::new();
        for idx in 0..self.tiers.len() {
            if Some(idx) == exclude {
                continue;
            }
            if self.tier_call_or_defer(idx, Op::OnNewRequest, |t| t.on_new_request(ctx))
                == Some(OffloadPolicy::RequestLevel)
            {
                request_level.push(idx);
            }
        }
        let policy = if request_level.is_empty() {
            OffloadPolicy::ChunkLevel
        } else {
            OffloadPolicy::RequestLevel
        };
        if self.requests.announce(ctx, exclude, request_level) {
            tracing::warn!(req = %ctx.id(), "on_new_request replaced a request with stores pending");
        }
        policy
    }

    pub(crate) fn on_request_finished_unlocked(&mut self, ctx: &ReqContext) -> Result<(), ManagerError> {
        let rid = ctx.id();
        if !self.requests.finish(rid) {
            return Err(ManagerError::UnknownRequest(rid.clone()));
        }
        self.primary.on_request_finished(ctx);
        self.maybe_finalize(rid);
        Ok(())
    }

    /// Tells the secondary tiers a request is over once nothing more can be cascaded for it.
    pub(crate) fn maybe_finalize(&mut self, rid: &RequestId) {
        if let Some(state) = self.requests.remove_if_done(rid) {
            self.completions.forget_request(rid);
            self.notify_finished(&state);
        }
    }

    pub(crate) fn notify_finished(&mut self, state: &RequestState) {
        for idx in 0..self.tiers.len() {
            if Some(idx) == state.exclude() {
                continue;
            }
            self.tier_call_or_defer(idx, Op::OnRequestFinished, |t| {
                t.on_request_finished(state.ctx());
            });
        }
    }
}
