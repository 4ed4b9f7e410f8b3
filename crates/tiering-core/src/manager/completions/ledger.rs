//! The store ledger: one record per key of a prepared device→primary store, saying who has
//! reported it (the engine, each copy-worker rank) and whether it has been applied.
//!
//! Reconciliation is per key, so it does not depend on how either side batches or orders its
//! reports. A key is *applied* (primary `complete_store`, cascade) by the first authoritative
//! report: the engine's, or the last of the `reporters` worker ranks'. A later report of the
//! same key is absorbed; when its success flag disagrees with the applied one it is counted as a
//! conflict. A key is *settled* once applied and (in off-step mode) reported by the engine; a
//! store batch ends when all its keys are settled. Records that only wait for a late worker
//! report are dropped when their request is finalized and on `reset_cache`, so the ledger never
//! outgrows the live requests.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::key::{KeyBuildHasher, KeyMap, OffloadKey};
use crate::request::{ReqContext, RequestId};

/// One key of a prepared store.
pub(crate) struct KeyRecord {
    pub(crate) batch: u64,
    /// Bit `r` set: rank `r` reported the key.
    ranks: u64,
    /// Every reporting rank said success.
    worker_ok: bool,
    engine: Option<bool>,
    applied: Option<bool>,
    settled: bool,
}

/// One `prepare_store` output with keys to store.
pub(crate) struct Batch {
    pub(crate) ctx: ReqContext,
    pub(crate) keys: Vec<OffloadKey>,
    unsettled: usize,
}

/// A worker rank that disconnected without saying goodbye.
struct GoneWorker {
    rank: u32,
    deadline: Instant,
}

/// What a report asks the manager to do with a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Apply the key now with this success flag.
    Apply(bool),
    /// Nothing to apply (already applied, or waiting for other ranks).
    Nothing,
}

/// Counts one report's effects for the manager's counters.
#[derive(Default, Debug)]
pub(crate) struct ReportTally {
    pub(crate) absorbed: u64,
    pub(crate) conflicts: u64,
    pub(crate) unknown: u64,
}

/// See the module docs.
pub(crate) struct StoreLedger {
    records: KeyMap<KeyRecord>,
    batches: HashMap<u64, Batch, KeyBuildHasher>,
    by_request: HashMap<RequestId, Vec<u64>, KeyBuildHasher>,
    next_batch: u64,
    /// Off-step mode: workers report too, and the engine's report settles a key.
    pub(crate) dual: bool,
    reporters: u32,
    worker_deadline: Duration,
    gone: Vec<GoneWorker>,
}

impl StoreLedger {
    pub(crate) fn new(dual: bool, reporters: u32, worker_deadline: Duration) -> Self {
        Self {
            records: KeyMap::default(),
            batches: HashMap::default(),
            by_request: HashMap::default(),
            next_batch: 0,
            dual,
            reporters: reporters.clamp(1, 64),
            worker_deadline,
            gone: Vec::new(),
        }
    }

    fn all_ranks(&self) -> u64 {
        if self.reporters >= 64 {
            u64::MAX
        } else {
            (1u64 << self.reporters) - 1
        }
    }

    /// Records a prepared store batch; returns its id.
    pub(crate) fn open_batch(&mut self, ctx: &ReqContext, keys: &[OffloadKey]) -> u64 {
        let id = self.next_batch;
        self.next_batch += 1;
        for k in keys {
            // A key is only prepared again once its previous write was applied (the primary
            // refuses keys with a write in flight), so an older record here only waited for a
            // late report; the new store supersedes it.
            if let Some(old) = self.records.insert(
                *k,
                KeyRecord {
                    batch: id,
                    ranks: 0,
                    worker_ok: true,
                    engine: None,
                    applied: None,
                    settled: false,
                },
            ) && !old.settled
                && let Some(b) = self.batches.get_mut(&old.batch)
            {
                b.unsettled = b.unsettled.saturating_sub(1);
            }
        }
        self.batches.insert(
            id,
            Batch {
                ctx: ctx.clone(),
                keys: keys.to_vec(),
                unsettled: keys.len(),
            },
        );
        // Looked up before inserting, so a request's later batches do not clone its id.
        match self.by_request.get_mut(ctx.id()) {
            Some(ids) => ids.push(id),
            None => {
                self.by_request.insert(ctx.id().clone(), vec![id]);
            }
        }
        id
    }

    /// The engine reported `key`. Returns what to do and the key's batch, or `None` when the
    /// key is not tracked.
    pub(crate) fn engine_report(
        &mut self,
        key: &OffloadKey,
        success: bool,
        tally: &mut ReportTally,
    ) -> Option<(Verdict, u64)> {
        let rec = self.records.get_mut(key)?;
        if rec.engine.is_some() {
            tally.absorbed += 1;
            return Some((Verdict::Nothing, rec.batch));
        }
        rec.engine = Some(success);
        Some(match rec.applied {
            None => (Verdict::Apply(success), rec.batch),
            Some(prev) => {
                tally.absorbed += 1;
                if prev != success {
                    tally.conflicts += 1;
                }
                (Verdict::Nothing, rec.batch)
            }
        })
    }

    /// Engine-only mode (no worker reports): the engine's report of a tracked key applies and
    /// settles it at once, so the record is taken out in the same probe. Returns the key's
    /// batch, or `None` when the key is not tracked. The caller applies the key and then calls
    /// [`StoreLedger::settled_taken`] for its batch.
    pub(crate) fn take_engine_applied(&mut self, key: &OffloadKey) -> Option<u64> {
        debug_assert!(!self.dual, "only engine reports exist in engine-only mode");
        let rec = self.records.remove(key)?;
        debug_assert!(
            rec.engine.is_none() && rec.applied.is_none(),
            "an engine-only record is settled and removed by its first report"
        );
        Some(rec.batch)
    }

    /// `n` keys of `batch` taken by [`StoreLedger::take_engine_applied`] were applied: they are
    /// settled. Whether that settled the batch's last key (the store is then over).
    pub(crate) fn settled_taken(&mut self, batch: u64, n: usize) -> bool {
        self.batches.get_mut(&batch).is_some_and(|b| {
            b.unsettled = b.unsettled.saturating_sub(n);
            b.unsettled == 0
        })
    }

    /// Worker rank `rank` reported `key`.
    pub(crate) fn worker_report(
        &mut self,
        rank: u32,
        key: &OffloadKey,
        success: bool,
        tally: &mut ReportTally,
    ) -> Verdict {
        let all = self.all_ranks();
        let Some(rec) = self.records.get_mut(key) else {
            tally.unknown += 1;
            return Verdict::Nothing;
        };
        let bit = 1u64 << rank.min(63);
        if rec.ranks & bit != 0 {
            tally.absorbed += 1;
            return Verdict::Nothing;
        }
        rec.ranks |= bit;
        rec.worker_ok &= success;
        if rec.ranks & all != all {
            return Verdict::Nothing;
        }
        let Some(prev) = rec.applied else {
            return Verdict::Apply(rec.worker_ok);
        };
        tally.absorbed += 1;
        if prev != rec.worker_ok {
            tally.conflicts += 1;
        }
        // Settled (so the engine reported too) and now every rank has: nothing more can come
        // for this key, so forget it now rather than when its request finalizes.
        if rec.settled {
            self.records.remove(key);
        }
        Verdict::Nothing
    }

    /// Marks `key` applied with `success`; returns the batch whose last unsettled key this
    /// settled, if any (the store is then over).
    pub(crate) fn mark_applied(&mut self, key: &OffloadKey, success: bool) -> Option<u64> {
        let dual = self.dual;
        let all = self.all_ranks();
        let std::collections::hash_map::Entry::Occupied(mut entry) = self.records.entry(*key) else {
            return None;
        };
        let rec = entry.get_mut();
        rec.applied = Some(success);
        if rec.settled || (dual && rec.engine.is_none()) {
            return None;
        }
        rec.settled = true;
        let batch = rec.batch;
        if !dual || rec.ranks & all == all {
            entry.remove();
        }
        self.settle_one(batch)
    }

    /// After an engine report of an already applied key: settle it.
    pub(crate) fn settle_after_engine(&mut self, key: &OffloadKey) -> Option<u64> {
        let dual = self.dual;
        let all = self.all_ranks();
        let std::collections::hash_map::Entry::Occupied(mut entry) = self.records.entry(*key) else {
            return None;
        };
        let rec = entry.get_mut();
        if rec.settled || rec.applied.is_none() || (dual && rec.engine.is_none()) {
            return None;
        }
        rec.settled = true;
        let batch = rec.batch;
        // Nothing more can come for a key the engine reported outside off-step mode, or that
        // every rank and the engine reported: forget it now.
        if !dual || rec.ranks & all == all {
            entry.remove();
        }
        self.settle_one(batch)
    }

    /// One key of `batch` settled; the batch when that was its last.
    fn settle_one(&mut self, batch: u64) -> Option<u64> {
        let b = self.batches.get_mut(&batch)?;
        b.unsettled = b.unsettled.saturating_sub(1);
        (b.unsettled == 0).then_some(batch)
    }

    /// The batch a tracked key belongs to.
    pub(crate) fn batch_of(&self, key: &OffloadKey) -> Option<u64> {
        self.records.get(key).map(|r| r.batch)
    }

    /// The request context of a batch.
    pub(crate) fn batch_ctx(&self, batch: u64) -> Option<&ReqContext> {
        self.batches.get(&batch).map(|b| &b.ctx)
    }

    /// Forgets everything recorded for a finalized request.
    pub(crate) fn forget_request(&mut self, rid: &RequestId) {
        let Some(ids) = self.by_request.remove(rid) else {
            return;
        };
        for id in ids {
            if let Some(b) = self.batches.remove(&id) {
                // In engine-only mode a settled key's record is already gone (and a superseded
                // one belongs to a newer batch): a fully settled batch has none left to scan.
                if !self.dual && b.unsettled == 0 {
                    continue;
                }
                for k in &b.keys {
                    if self.records.get(k).is_some_and(|r| r.batch == id) {
                        self.records.remove(k);
                    }
                }
            }
        }
    }

    /// Forgets everything (reset).
    pub(crate) fn clear(&mut self) {
        self.records.clear();
        self.batches.clear();
        self.by_request.clear();
        self.gone.clear();
    }

    /// A rank disconnected without goodbye: its unreported keys fail after the deadline.
    pub(crate) fn worker_gone(&mut self, rank: u32, now: Instant) {
        self.gone.retain(|g| g.rank != rank);
        self.gone.push(GoneWorker {
            rank,
            deadline: now + self.worker_deadline,
        });
    }

    /// A rank (re)joined: it reports again.
    pub(crate) fn worker_joined(&mut self, rank: u32) {
        self.gone.retain(|g| g.rank != rank);
    }

    /// Keys still waiting for a rank whose deadline passed; the rank's entry is dropped.
    pub(crate) fn expired_worker_keys(&mut self, now: Instant) -> Vec<(u32, Vec<OffloadKey>)> {
        let mut out = Vec::new();
        let mut kept = Vec::new();
        for g in std::mem::take(&mut self.gone) {
            if g.deadline > now {
                kept.push(g);
                continue;
            }
            let bit = 1u64 << g.rank.min(63);
            let keys: Vec<OffloadKey> = self
                .records
                .iter()
                .filter(|(_, r)| r.applied.is_none() && r.ranks & bit == 0)
                .map(|(k, _)| *k)
                .collect();
            out.push((g.rank, keys));
        }
        self.gone = kept;
        out
    }

    /// The earliest worker deadline.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.gone.iter().map(|g| g.deadline).min()
    }

    /// Keys the ledger tracks.
    pub(crate) fn tracked_keys(&self) -> usize {
        self.records.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    #[test]
    fn engine_only_mode_applies_and_forgets_each_key() {
        let mut l = StoreLedger::new(false, 1, Duration::from_secs(1));
        let ctx = ReqContext::local("r");
        let b = l.open_batch(&ctx, &[k(1), k(2)]);
        let mut t = ReportTally::default();
        assert_eq!(
            l.engine_report(&k(2), true, &mut t),
            Some((Verdict::Apply(true), b))
        );
        assert_eq!(l.mark_applied(&k(2), true), None);
        assert_eq!(
            l.engine_report(&k(1), true, &mut t),
            Some((Verdict::Apply(true), b))
        );
        assert_eq!(l.mark_applied(&k(1), true), Some(b));
        assert_eq!(l.tracked_keys(), 0);
    }

    #[test]
    fn engine_only_reports_take_records_out_and_settle_by_count() {
        let mut l = StoreLedger::new(false, 1, Duration::from_secs(1));
        let ctx = ReqContext::local("r");
        let b = l.open_batch(&ctx, &[k(1), k(2), k(3)]);
        assert_eq!(l.take_engine_applied(&k(9)), None, "untracked key");
        assert_eq!(l.take_engine_applied(&k(2)), Some(b));
        assert_eq!(l.take_engine_applied(&k(2)), None, "taken once");
        assert!(!l.settled_taken(b, 1), "two keys left");
        assert_eq!(l.take_engine_applied(&k(1)), Some(b));
        assert_eq!(l.take_engine_applied(&k(3)), Some(b));
        assert!(l.settled_taken(b, 2));
        assert_eq!(l.tracked_keys(), 0);
        // A request whose batches are settled is forgotten without leftovers.
        l.forget_request(ctx.id());
        assert_eq!(l.batch_ctx(b).map(|c| c.id().clone()), None);
    }

    #[test]
    fn ranks_must_all_report_before_a_worker_verdict() {
        let mut l = StoreLedger::new(true, 2, Duration::from_secs(1));
        let ctx = ReqContext::local("r");
        l.open_batch(&ctx, &[k(1)]);
        let mut t = ReportTally::default();
        assert_eq!(l.worker_report(1, &k(1), true, &mut t), Verdict::Nothing);
        assert_eq!(l.worker_report(1, &k(1), true, &mut t), Verdict::Nothing);
        assert_eq!(t.absorbed, 1);
        assert_eq!(l.worker_report(0, &k(1), false, &mut t), Verdict::Apply(false));
    }

    #[test]
    fn the_last_report_forgets_the_key_whichever_side_was_first() {
        for engine_first in [true, false] {
            let mut l = StoreLedger::new(true, 2, Duration::from_secs(1));
            let ctx = ReqContext::local("r");
            let b = l.open_batch(&ctx, &[k(1)]);
            let mut t = ReportTally::default();
            if engine_first {
                assert_eq!(
                    l.engine_report(&k(1), true, &mut t),
                    Some((Verdict::Apply(true), b))
                );
                assert_eq!(l.mark_applied(&k(1), true), Some(b));
                assert_eq!(l.worker_report(0, &k(1), true, &mut t), Verdict::Nothing);
                assert_eq!(l.tracked_keys(), 1, "rank 1 has not reported yet");
                assert_eq!(l.worker_report(1, &k(1), true, &mut t), Verdict::Nothing);
            } else {
                assert_eq!(l.worker_report(0, &k(1), true, &mut t), Verdict::Nothing);
                assert_eq!(l.worker_report(1, &k(1), true, &mut t), Verdict::Apply(true));
                assert_eq!(l.mark_applied(&k(1), true), None, "the engine has not reported");
                assert_eq!(l.engine_report(&k(1), true, &mut t), Some((Verdict::Nothing, b)));
                assert_eq!(l.settle_after_engine(&k(1)), Some(b));
            }
            assert_eq!(t.absorbed, 1, "engine first: {engine_first}");
            assert_eq!(l.tracked_keys(), 0, "engine first: {engine_first}");
        }
    }

    #[test]
    fn a_gone_rank_expires_after_its_deadline() {
        let mut l = StoreLedger::new(true, 2, Duration::from_millis(10));
        let ctx = ReqContext::local("r");
        l.open_batch(&ctx, &[k(1), k(2)]);
        let mut t = ReportTally::default();
        l.worker_report(1, &k(1), true, &mut t);
        let now = Instant::now();
        l.worker_gone(1, now);
        assert!(l.expired_worker_keys(now).is_empty());
        let expired = l.expired_worker_keys(now + Duration::from_millis(20));
        assert_eq!(expired, vec![(1, vec![k(2)])]);
        assert_eq!(l.next_deadline(), None);
    }
}
