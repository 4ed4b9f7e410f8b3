//! Request-scoped access recording, as vLLM 0.33.0 does it.
//!
//! Each request's context carries a record of the keys it observed: store-offer keys that were
//! new or ready (keys still being written by someone else are not recorded), and loaded keys.
//! Policies see first observations as they happen and the whole record, in prefix order, once the
//! request finishes. The record belongs to one tier instance and one cache generation; a stale
//! record (another tier, or from before a reset) is replaced by a fresh one.

use tiering_core::{KeyMap, OffloadKey, ReqContext};

const SEEN: u8 = 1;
const INSERTED: u8 = 2;
const REUSED: u8 = 4;
const STORE_MISS: u8 = 8;

/// The keys one request observed. Lives in the request's [`ReqContext`] scratch map.
///
/// One map of per-key flags plus the first-observed order keeps a request's bookkeeping to two
/// allocations that grow with the request, instead of one set per flag.
#[derive(Default)]
pub(crate) struct RequestAccess {
    owner: u64,
    generation: u64,
    flags: KeyMap<u8>,
    /// Keys in first-observed order (all KV groups mixed; grouped at finish).
    order: Vec<OffloadKey>,
    pub(crate) finished: bool,
}

impl RequestAccess {
    fn fresh(owner: u64, generation: u64) -> Self {
        Self {
            owner,
            generation,
            ..Self::default()
        }
    }

    /// Whether the record was made by tier `owner` in cache generation `generation`.
    pub(crate) fn belongs_to(&self, owner: u64, generation: u64) -> bool {
        self.owner == owner && self.generation == generation
    }

    /// Runs `f` on the context's record for this tier and generation, replacing a stale one.
    pub(crate) fn with<R>(
        ctx: &ReqContext,
        owner: u64,
        generation: u64,
        f: impl FnOnce(&mut RequestAccess) -> R,
    ) -> R {
        ctx.with_state(
            || Self::fresh(owner, generation),
            |rec| {
                if !rec.belongs_to(owner, generation) {
                    *rec = Self::fresh(owner, generation);
                }
                f(rec)
            },
        )
    }

    fn flags(&self, key: &OffloadKey) -> u8 {
        self.flags.get(key).copied().unwrap_or(0)
    }

    /// Whether this request inserted `key`.
    pub(crate) fn inserted(&self, key: &OffloadKey) -> bool {
        self.flags(key) & INSERTED != 0
    }

    /// Whether this request reused `key` (and did not insert it before reusing it).
    pub(crate) fn reused(&self, key: &OffloadKey) -> bool {
        self.flags(key) & REUSED != 0
    }

    /// Marks `keys` as inserted by this request.
    pub(crate) fn mark_inserted(&mut self, keys: &[OffloadKey]) {
        self.flags.reserve(keys.len());
        for k in keys {
            *self.flags.entry(*k).or_insert(0) |= INSERTED;
        }
    }

    /// Marks `key` seen, recording it in order; whether it was new to the request.
    fn see(flags: &mut u8, key: &OffloadKey, finished: bool, order: &mut Vec<OffloadKey>) -> bool {
        if *flags & SEEN != 0 {
            return false;
        }
        if finished {
            // vLLM asserts here; see the crate docs.
            tracing::debug!(%key, "key observed after its request finished; not recorded");
            return false;
        }
        *flags |= SEEN;
        order.push(*key);
        true
    }

    /// Records a store offer in one pass: `observed` are the offered keys that are not being
    /// written by someone else, flagged `true` when ready (a reuse) and `false` when new (a store
    /// miss). Appends to `misses` the store misses this request has not reported before, and to
    /// `new` the keys observed for the first time.
    pub(crate) fn record_store(
        &mut self,
        observed: &[(OffloadKey, bool)],
        misses: &mut Vec<OffloadKey>,
        new: &mut Vec<OffloadKey>,
    ) {
        self.flags.reserve(observed.len());
        for (k, ready) in observed {
            let f = self.flags.entry(*k).or_insert(0);
            if !ready && *f & STORE_MISS == 0 {
                *f |= STORE_MISS;
                misses.push(*k);
            }
            if Self::see(f, k, self.finished, &mut self.order) {
                new.push(*k);
            }
            // Re-reading a chunk this request inserted is not a reuse.
            if *ready && *f & INSERTED == 0 {
                *f |= REUSED;
            }
        }
    }

    /// Records loaded keys (all reuses) in one pass; appends first observations to `new`.
    pub(crate) fn record_load(&mut self, keys: &[OffloadKey], new: &mut Vec<OffloadKey>) {
        self.flags.reserve(keys.len());
        for k in keys {
            let f = self.flags.entry(*k).or_insert(0);
            if Self::see(f, k, self.finished, &mut self.order) {
                new.push(*k);
            }
            if *f & INSERTED == 0 {
                *f |= REUSED;
            }
        }
    }

    /// Marks the record finished and returns the observed keys head first: groups in ascending
    /// index, each sorted by position when every key of the group has one, then the whole list
    /// sorted by position (stably) when every key has one. `None` if already finished.
    pub(crate) fn finish(&mut self, ctx: &ReqContext) -> Option<Vec<OffloadKey>> {
        if self.finished {
            return None;
        }
        self.finished = true;
        let mut positions = Vec::with_capacity(self.order.len());
        ctx.key_positions_into(&self.order, &mut positions);
        let mut all: Vec<(OffloadKey, Option<u64>)> = self.order.iter().copied().zip(positions).collect();
        // Stable: first-observed order within each group.
        all.sort_by_key(|(k, _)| k.group());
        let mut start = 0;
        while start < all.len() {
            let group = all[start].0.group();
            let end = start
                + all[start..]
                    .iter()
                    .take_while(|(k, _)| k.group() == group)
                    .count();
            let members = &mut all[start..end];
            if members.iter().all(|(_, p)| p.is_some()) {
                members.sort_by_key(|(_, p)| *p);
            }
            start = end;
        }
        if all.iter().all(|(_, p)| p.is_some()) {
            all.sort_by_key(|(_, p)| *p);
        }
        Some(all.into_iter().map(|(k, _)| k).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u64, group: u32) -> OffloadKey {
        OffloadKey::from_u64(n).with_group(group)
    }

    #[test]
    fn finish_orders_by_group_then_by_position_when_complete() {
        let ctx = ReqContext::local("r");
        let mut rec = RequestAccess::fresh(1, 0);
        let mut new = Vec::new();
        let keys = [k(3, 1), k(1, 0), k(2, 0), k(4, 1)];
        rec.record_load(&keys, &mut new);
        assert_eq!(new, keys.to_vec());
        // No positions: group 0 first, first-seen order within groups.
        let mut no_pos = RequestAccess::fresh(1, 0);
        no_pos.record_load(&keys, &mut Vec::new());
        assert_eq!(
            no_pos.finish(&ctx),
            Some(vec![k(1, 0), k(2, 0), k(3, 1), k(4, 1)])
        );
        assert_eq!(no_pos.finish(&ctx), None, "finishing twice does nothing");
        // Every key positioned: one global order by position, groups interleaved.
        for (key, pos) in [(k(1, 0), 20), (k(2, 0), 10), (k(3, 1), 15), (k(4, 1), 5)] {
            ctx.set_key_position(key, pos);
        }
        assert_eq!(rec.finish(&ctx), Some(vec![k(4, 1), k(2, 0), k(3, 1), k(1, 0)]));
    }

    #[test]
    fn reuse_excludes_own_insertions_and_late_keys_are_ignored() {
        let mut rec = RequestAccess::fresh(1, 0);
        rec.mark_inserted(&[k(1, 0)]);
        let mut new = Vec::new();
        rec.record_load(&[k(1, 0), k(2, 0)], &mut new);
        assert!(rec.reused(&k(2, 0)) && !rec.reused(&k(1, 0)));
        assert!(rec.inserted(&k(1, 0)) && !rec.inserted(&k(2, 0)));
        let (mut misses, mut new) = (Vec::new(), Vec::new());
        let offer = [
            (k(5, 0), false),
            (k(5, 0), false),
            (k(6, 0), false),
            (k(2, 0), true),
        ];
        rec.record_store(&offer, &mut misses, &mut new);
        assert_eq!(
            (misses.clone(), new.clone()),
            (vec![k(5, 0), k(6, 0)], vec![k(5, 0), k(6, 0)])
        );
        rec.finish(&ReqContext::local("r"));
        misses.clear();
        new.clear();
        rec.record_store(&[(k(6, 0), false), (k(9, 0), false)], &mut misses, &mut new);
        assert_eq!(
            misses,
            vec![k(9, 0)],
            "store misses still count once per key after finish"
        );
        assert!(new.is_empty(), "new keys are not recorded after finish");
    }
}
