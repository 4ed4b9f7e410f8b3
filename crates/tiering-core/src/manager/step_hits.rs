//! The primary hits each request was told about in the current step, so that a promotion the
//! same request's lookup scan starts never evicts one of them.
//!
//! A request's scan answers `Hit` for its leading chunks from the primary, then may reach a
//! chunk only a secondary tier holds; promoting that one reserves a primary row, and the
//! primary's victim could be a chunk the scan just reported as a hit. The engine would then ask
//! to load a chunk that is gone (`prepare_load` fails with "not in the tier"). The lookup pins
//! the request's reported hits around the reservation, so the primary picks another victim or
//! none (the promotion is then a miss, which costs a recompute instead of an error).

use std::collections::HashMap;

use crate::key::{KeyBuildHasher, OffloadKey};
use crate::request::RequestId;

/// Per request, the keys the primary answered `Hit` for since the step began.
#[derive(Default)]
pub(crate) struct StepHits {
    hits: HashMap<RequestId, Vec<OffloadKey>, KeyBuildHasher>,
}

impl StepHits {
    /// Notes that `request` was told `key` is a primary hit.
    pub(crate) fn record(&mut self, request: &RequestId, key: OffloadKey) {
        if let Some(keys) = self.hits.get_mut(request) {
            keys.push(key);
        } else {
            self.hits.insert(request.clone(), vec![key]);
        }
    }

    /// The hits `request` was told about in this step (empty when none).
    pub(crate) fn of(&self, request: &RequestId) -> &[OffloadKey] {
        self.hits.get(request).map_or(&[], Vec::as_slice)
    }

    /// A new step: what earlier steps reported is the engine's to load or not by now.
    pub(crate) fn clear(&mut self) {
        // Keeps the map's allocation when it is small (the usual step), drops it when a burst grew it.
        if self.hits.capacity() > 1024 {
            self.hits = HashMap::default();
        } else {
            self.hits.clear();
        }
    }
}
