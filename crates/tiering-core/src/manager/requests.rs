//! The request lifecycle: announcing a request to every tier, and telling them it is over once
//! nothing more can be cascaded for it (all its stores settled, no parked keys).

use crate::error::ManagerError;
use crate::key::KeyMap;
use crate::outcome::OffloadPolicy;
use crate::request::{ReqContext, RequestId};
use crate::tier::PrimaryTier as _;

use super::state::{RequestState, TieringState};
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
        let previous = self.requests.insert(
            ctx.id().clone(),
            RequestState {
                ctx: ctx.clone(),
                pending_stores: 0,
                finished: false,
                request_level,
                parked: Vec::new(),
                exclude,
                load_sources: KeyMap::default(),
            },
        );
        if previous.is_some_and(|p| p.pending_stores > 0) {
            tracing::warn!(req = %ctx.id(), "on_new_request replaced a request with stores pending");
        }
        policy
    }

    pub(crate) fn on_request_finished_unlocked(&mut self, ctx: &ReqContext) -> Result<(), ManagerError> {
        let rid = ctx.id();
        let Some(state) = self.requests.get_mut(rid) else {
            return Err(ManagerError::UnknownRequest(rid.clone()));
        };
        state.finished = true;
        self.primary.on_request_finished(ctx);
        self.maybe_finalize(rid);
        Ok(())
    }

    /// Tells the secondary tiers a request is over once nothing more can be cascaded for it.
    pub(crate) fn maybe_finalize(&mut self, rid: &RequestId) {
        let done = self
            .requests
            .get(rid)
            .is_some_and(|s| s.finished && s.pending_stores == 0 && s.parked.is_empty());
        if !done {
            return;
        }
        if let Some(state) = self.requests.remove(rid) {
            self.completions.forget_request(rid);
            self.notify_finished(&state);
        }
    }

    pub(crate) fn notify_finished(&mut self, state: &RequestState) {
        for idx in 0..self.tiers.len() {
            if Some(idx) == state.exclude {
                continue;
            }
            self.tier_call_or_defer(idx, Op::OnRequestFinished, |t| {
                t.on_request_finished(&state.ctx);
            });
        }
    }
}
