//! Where the chunks a request loads came from: the secondary tier whose promotion brought a key
//! into the primary for that request, else the primary itself. Engines report it as the source
//! of a request's cache hits (vLLM's `get_load_source`, asked after a lookup answered `Hit`);
//! the promotion has landed by then, so the origin must be remembered per request.

use crate::key::OffloadKey;
use crate::request::{ReqContext, TierInfo};
use crate::tier::PrimaryTier as _;

use super::state::TieringState;

/// Where a chunk a request loads came from ([`Step::load_source`](super::Step::load_source)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadSource {
    /// `None` for the primary tier, else the secondary tier's index in chain order.
    pub secondary: Option<usize>,
    /// That tier's description.
    pub info: TierInfo,
}

impl TieringState {
    /// Remembers that tier `idx` is promoting `keys` for the request (announced requests only:
    /// the record lives in the request's state and goes with it).
    pub(crate) fn record_load_sources(&mut self, ctx: &ReqContext, keys: &[OffloadKey], idx: usize) {
        if let Some(state) = self.requests.get_mut(ctx.id()) {
            state.load_sources.extend(keys.iter().map(|k| (*k, idx)));
        }
    }

    /// Forgets the record of `keys` whose promotion from tier `idx` failed (a later store or
    /// promotion of the same key by another tier keeps its own record).
    pub(crate) fn forget_load_sources(&mut self, ctx: &ReqContext, keys: &[OffloadKey], idx: usize) {
        if let Some(state) = self.requests.get_mut(ctx.id()) {
            for k in keys {
                if state.load_sources.get(k) == Some(&idx) {
                    state.load_sources.remove(k);
                }
            }
        }
    }

    /// See [`Step::load_source`](super::Step::load_source).
    pub(crate) fn load_source_unlocked(&self, key: &OffloadKey, ctx: &ReqContext) -> LoadSource {
        let recorded = self
            .requests
            .get(ctx.id())
            .and_then(|s| s.load_sources.get(key))
            .copied()
            .filter(|&idx| idx < self.tiers.len());
        match recorded {
            Some(idx) => LoadSource {
                secondary: Some(idx),
                info: self.tiers[idx].info.clone(),
            },
            None => LoadSource {
                secondary: None,
                info: self.primary.info(),
            },
        }
    }
}
