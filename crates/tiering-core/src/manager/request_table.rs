//! The request table: every request announced and not yet finalized, with what the manager
//! still owes it (stores pending, parked request-level keys) and where its promoted chunks
//! came from.
//!
//! A request is finalized — taken out, and the tiers told — only once it is finished and
//! nothing more can be cascaded for it; the table answers that question
//! ([`RequestTable::remove_if_done`]), the request lifecycle (`super::requests`) acts on it.

use std::collections::HashMap;

use crate::key::{KeyBuildHasher, KeyMap, OffloadKey};
use crate::request::{ReqContext, RequestId};

/// A map keyed by request id, hashed with the crate's fast hasher: the manager looks a request
/// up several times per engine call, and SipHash over the id string showed in profiles.
type RequestMap<V> = HashMap<RequestId, V, KeyBuildHasher>;

/// Per-request orchestration state.
pub(crate) struct RequestState {
    ctx: ReqContext,
    /// Prepared device→primary stores (batches) not yet fully completed.
    pending_stores: u32,
    finished: bool,
    /// Tiers that asked for `RequestLevel`.
    request_level: Vec<usize>,
    /// Keys whose write was in flight when a request-level cascade wanted them.
    parked: Vec<OffloadKey>,
    /// The origin tier of a peer request, remembered so a deferred finalization still skips it.
    exclude: Option<usize>,
    /// The secondary tier each key promoted for this request came from (`load_source`).
    load_sources: KeyMap<usize>,
}

impl RequestState {
    /// The request as the engine (or the peer) announced it.
    pub(crate) fn ctx(&self) -> &ReqContext {
        &self.ctx
    }

    /// The tier a peer request came from, which is never told about it.
    pub(crate) fn exclude(&self) -> Option<usize> {
        self.exclude
    }
}

/// The requests being tracked (see the module docs).
#[derive(Default)]
pub(crate) struct RequestTable {
    requests: RequestMap<RequestState>,
}

impl RequestTable {
    /// Tracks a newly announced request; `request_level` are the tiers that asked for its
    /// chunks. Whether it replaced a request of the same id that still had stores pending.
    pub(crate) fn announce(
        &mut self,
        ctx: &ReqContext,
        exclude: Option<usize>,
        request_level: Vec<usize>,
    ) -> bool {
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
        previous.is_some_and(|p| p.pending_stores > 0)
    }

    /// The engine finished request `rid`; false if it is not tracked.
    pub(crate) fn finish(&mut self, rid: &RequestId) -> bool {
        match self.requests.get_mut(rid) {
            Some(state) => {
                state.finished = true;
                true
            }
            None => false,
        }
    }

    /// Takes request `rid` out if it is finished and nothing more can be cascaded for it (all
    /// its stores settled, no parked keys).
    pub(crate) fn remove_if_done(&mut self, rid: &RequestId) -> Option<RequestState> {
        let done = self
            .requests
            .get(rid)
            .is_some_and(|s| s.finished && s.pending_stores == 0 && s.parked.is_empty());
        if done { self.requests.remove(rid) } else { None }
    }

    /// Takes request `rid` out whatever it still waits for.
    pub(crate) fn remove(&mut self, rid: &RequestId) -> Option<RequestState> {
        self.requests.remove(rid)
    }

    /// Whether request `rid` is tracked.
    pub(crate) fn contains(&self, rid: &RequestId) -> bool {
        self.requests.contains_key(rid)
    }

    /// Requests tracked.
    pub(crate) fn len(&self) -> usize {
        self.requests.len()
    }

    /// The context request `rid` was announced with.
    pub(crate) fn ctx(&self, rid: &RequestId) -> Option<&ReqContext> {
        self.requests.get(rid).map(|s| &s.ctx)
    }

    /// Whether request `rid` has request-level tiers; `None` if it is not tracked.
    pub(crate) fn is_request_level(&self, rid: &RequestId) -> Option<bool> {
        self.requests.get(rid).map(|s| !s.request_level.is_empty())
    }

    /// Whether request `rid` routes its chunks to tier `idx` (a request-level tier).
    pub(crate) fn routes_to(&self, rid: &RequestId, idx: usize) -> bool {
        self.requests
            .get(rid)
            .is_some_and(|r| r.request_level.contains(&idx))
    }

    /// Stores of request `rid` prepared and not yet completed; `None` if it is not tracked.
    pub(crate) fn pending_stores(&self, rid: &RequestId) -> Option<u32> {
        self.requests.get(rid).map(|s| s.pending_stores)
    }

    /// Request `rid` prepared one more store; false if it is not tracked.
    pub(crate) fn store_prepared(&mut self, rid: &RequestId) -> bool {
        match self.requests.get_mut(rid) {
            Some(state) => {
                state.pending_stores += 1;
                true
            }
            None => false,
        }
    }

    /// One of request `rid`'s stores ended.
    pub(crate) fn store_ended(&mut self, rid: &RequestId) {
        if let Some(state) = self.requests.get_mut(rid) {
            state.pending_stores = state.pending_stores.saturating_sub(1);
        }
    }

    /// Parks `keys` of request `rid` until their writes resolve, and returns the request-level
    /// tiers its chunks go to (the origin left out); `None` if it is not tracked.
    pub(crate) fn park(&mut self, rid: &RequestId, keys: Vec<OffloadKey>) -> Option<Vec<usize>> {
        let state = self.requests.get_mut(rid)?;
        state.parked.extend(keys);
        Some(
            state
                .request_level
                .iter()
                .copied()
                .filter(|&t| Some(t) != state.exclude)
                .collect(),
        )
    }

    /// Whether a request-level cascade waits for keys still in flight.
    pub(crate) fn any_parked(&self) -> bool {
        self.requests.values().any(|s| !s.parked.is_empty())
    }

    /// The requests with parked keys.
    pub(crate) fn with_parked(&self) -> Vec<RequestId> {
        self.requests
            .iter()
            .filter(|(_, s)| !s.parked.is_empty())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Takes request `rid`'s parked keys, to cascade them again.
    pub(crate) fn take_parked(&mut self, rid: &RequestId) -> Vec<OffloadKey> {
        self.requests
            .get_mut(rid)
            .map(|s| std::mem::take(&mut s.parked))
            .unwrap_or_default()
    }

    /// Forgets what every request waits for (`reset_cache`: the stores and promotions are
    /// gone) and returns the finished ones, which can be finalized now.
    pub(crate) fn reset(&mut self) -> Vec<RequestId> {
        self.requests
            .iter_mut()
            .filter_map(|(id, s)| {
                s.pending_stores = 0;
                s.parked.clear();
                s.load_sources.clear();
                s.finished.then(|| id.clone())
            })
            .collect()
    }

    /// Remembers that tier `idx` is promoting `keys` for request `rid` (tracked requests only:
    /// the record goes with the request).
    pub(crate) fn record_load_sources(&mut self, rid: &RequestId, keys: &[OffloadKey], idx: usize) {
        if let Some(state) = self.requests.get_mut(rid) {
            state.load_sources.extend(keys.iter().map(|k| (*k, idx)));
        }
    }

    /// Forgets the record of `keys` whose promotion from tier `idx` failed (a later store or
    /// promotion of the same key by another tier keeps its own record).
    pub(crate) fn forget_load_sources(&mut self, rid: &RequestId, keys: &[OffloadKey], idx: usize) {
        if let Some(state) = self.requests.get_mut(rid) {
            for k in keys {
                if state.load_sources.get(k) == Some(&idx) {
                    state.load_sources.remove(k);
                }
            }
        }
    }

    /// The secondary tier `key` was promoted from for request `rid`, if one was.
    pub(crate) fn load_source(&self, rid: &RequestId, key: &OffloadKey) -> Option<usize> {
        self.requests
            .get(rid)
            .and_then(|s| s.load_sources.get(key))
            .copied()
    }
}
