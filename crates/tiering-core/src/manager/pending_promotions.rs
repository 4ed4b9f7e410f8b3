//! Promotions reserved and not yet submitted: a lookup that promotes reserves a primary row at
//! once (so the engine can be told `HitPending`) but the copy is submitted in one job per
//! (tier, request) when the step ends, so a request's promotions from one tier travel together.

use indexmap::IndexMap;

use crate::key::OffloadKey;
use crate::request::{ReqContext, RequestId};

/// Promotions reserved for one (tier, request) and not yet submitted.
pub(crate) struct PendingPromotion {
    /// The request the promotion is for (the job is submitted in its name).
    pub(crate) ctx: ReqContext,
    /// The chunks to promote, in lookup order.
    pub(crate) keys: Vec<OffloadKey>,
    /// The primary rows reserved for `keys`, parallel to them.
    pub(crate) chunk_ids: Vec<u32>,
}

/// The reserved promotions of every secondary tier (see the module docs).
pub(crate) struct PendingPromotions {
    /// Per tier in chain order, per request in first-lookup order (the submission order).
    per_tier: Vec<IndexMap<RequestId, PendingPromotion>>,
}

impl PendingPromotions {
    /// None reserved, for a chain of `tiers` secondaries.
    pub(crate) fn new(tiers: usize) -> Self {
        Self {
            per_tier: (0..tiers).map(|_| IndexMap::new()).collect(),
        }
    }

    /// Adds `keys` (with their reserved rows `chunk_ids`) to `ctx`'s request's promotion from
    /// tier `idx`.
    pub(crate) fn reserve(&mut self, idx: usize, ctx: &ReqContext, keys: &[OffloadKey], chunk_ids: &[u32]) {
        let entry = self.per_tier[idx]
            .entry(ctx.id().clone())
            .or_insert_with(|| PendingPromotion {
                ctx: ctx.clone(),
                keys: Vec::new(),
                chunk_ids: Vec::new(),
            });
        entry.keys.extend_from_slice(keys);
        entry.chunk_ids.extend_from_slice(chunk_ids);
    }

    /// Keys reserved for request `rid` on tier `idx`.
    pub(crate) fn reserved_for(&self, idx: usize, rid: &RequestId) -> usize {
        self.per_tier[idx].get(rid).map_or(0, |p| p.keys.len())
    }

    /// Keys reserved on tier `idx`.
    pub(crate) fn reserved_on(&self, idx: usize) -> usize {
        self.per_tier[idx].values().map(|p| p.keys.len()).sum()
    }

    /// Keys reserved on every tier.
    pub(crate) fn total(&self) -> usize {
        self.per_tier
            .iter()
            .flat_map(IndexMap::values)
            .map(|p| p.keys.len())
            .sum()
    }

    /// Whether any promotion is reserved.
    pub(crate) fn any(&self) -> bool {
        self.per_tier.iter().any(|m| !m.is_empty())
    }

    /// Whether tier `idx` has none reserved.
    pub(crate) fn none_on(&self, idx: usize) -> bool {
        self.per_tier[idx].is_empty()
    }

    /// Takes tier `idx`'s reserved promotions out, in submission order: to submit them, or to
    /// free their rows.
    pub(crate) fn take(&mut self, idx: usize) -> impl Iterator<Item = PendingPromotion> + use<> {
        std::mem::take(&mut self.per_tier[idx]).into_values()
    }

    /// Forgets every reservation (`reset_cache`: the primary forgets the rows too).
    pub(crate) fn clear(&mut self) {
        for map in &mut self.per_tier {
            map.clear();
        }
    }
}
