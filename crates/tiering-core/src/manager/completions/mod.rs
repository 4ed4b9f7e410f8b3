//! Store completions: the engine's `complete_store`, and — in off-step mode — the copy
//! workers' reports of the same stores, which the control thread applies between steps so a
//! peer waiting for those chunks is answered while the model runs.
//!
//! Workers report in process through a [`StoreCompletionSender`] or from other processes over
//! the [completion channel](crate::channel); both land in one [`CompletionQueue`] that the
//! control thread drains. The [`ledger`] reconciles the reports per key.

pub(crate) mod ledger;
mod sender;

use std::time::Instant;

use crate::sync::Mutex;

use crate::error::ManagerError;
use crate::key::OffloadKey;
use crate::request::ReqContext;

use super::state::TieringState;
use ledger::{ReportTally, Verdict};

pub(crate) use ledger::StoreLedger;
pub use sender::StoreCompletionSender;

/// Something a copy worker told the manager.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WorkerEvent {
    /// Rank `rank` finished copying `keys` into their rows (or failed to).
    Stored {
        rank: u32,
        keys: Vec<OffloadKey>,
        success: bool,
    },
    /// Rank `rank` connected.
    Joined { rank: u32 },
    /// Rank `rank` disconnected; `clean` when it said goodbye first.
    Left { rank: u32, clean: bool },
    /// A message that was malformed or came from a foreign arena was rejected.
    Rejected,
}

/// Keys to apply with their success flag and store batch (parallel vectors, so a report of
/// one store hands its keys to the primary as one slice).
struct ApplyList {
    keys: Vec<OffloadKey>,
    meta: Vec<(bool, u64)>,
}

impl ApplyList {
    fn with_capacity(n: usize) -> Self {
        Self {
            keys: Vec::with_capacity(n),
            meta: Vec::with_capacity(n),
        }
    }

    fn push(&mut self, key: OffloadKey, ok: bool, batch: u64) {
        self.keys.push(key);
        self.meta.push((ok, batch));
    }
}

/// The queue workers push to; shared by the senders, the channel and the manager state.
#[derive(Default)]
pub(crate) struct CompletionQueue {
    items: Mutex<Vec<WorkerEvent>>,
}

impl CompletionQueue {
    pub(crate) fn push(&self, event: WorkerEvent) {
        self.items.lock().push(event);
    }

    pub(crate) fn take(&self) -> Vec<WorkerEvent> {
        std::mem::take(&mut *self.items.lock())
    }
}

impl TieringState {
    /// Opens the ledger records of a prepared store.
    pub(crate) fn open_store_batch(&mut self, ctx: &ReqContext, keys: &[OffloadKey]) {
        self.ledger.open_batch(ctx, keys);
    }

    /// The engine's `complete_store`: applies every key no worker has completed yet, absorbs
    /// the rest (counting disagreeing flags). In off-step mode the workers' queued reports are
    /// applied first.
    pub(crate) fn complete_store_unlocked(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
    ) -> Result<(), ManagerError> {
        if self.ledger.dual {
            // What workers reported before the engine learnt that the copy finished is applied
            // first, so a rank's report is never overtaken by the engine's report of the same
            // copy. That matters for failures: vLLM cannot fail a job, so its connector reports
            // success for every store, and only the worker knows a copy failed.
            self.apply_queued_completions();
        }
        let rid = ctx.id();
        let Some(req) = self.requests.get(rid) else {
            return Err(ManagerError::UnknownRequest(rid.clone()));
        };
        let has_pending = req.pending_stores > 0;
        let mut tally = ReportTally::default();
        let mut apply = ApplyList::with_capacity(keys.len());
        let mut settle = Vec::new();
        let mut tracked = 0usize;
        if self.ledger.dual {
            for k in keys {
                match self.ledger.engine_report(k, success, &mut tally) {
                    None => {}
                    Some((Verdict::Apply(ok), batch)) => {
                        tracked += 1;
                        apply.push(*k, ok, batch);
                    }
                    Some((Verdict::Nothing, _)) => {
                        tracked += 1;
                        settle.push(*k);
                    }
                }
            }
        } else {
            // Engine-only: the engine's report is the only one, so each tracked key is applied
            // and settled now and its record taken out in one probe. A key named twice in the
            // call is absorbed the second time, as a second report of an applied key is.
            for k in keys {
                if let Some(batch) = self.ledger.take_engine_applied(k) {
                    tracked += 1;
                    apply.push(*k, success, batch);
                } else if apply.keys.contains(k) {
                    tracked += 1;
                    tally.absorbed += 1;
                }
            }
        }
        if tracked == 0 && !has_pending {
            return Err(ManagerError::NoPendingStore(rid.clone()));
        }
        self.note_tally(&tally, "engine");
        let taken = !self.ledger.dual;
        self.apply_grouped(&apply, taken);
        let done: Vec<u64> = settle
            .iter()
            .filter_map(|k| self.ledger.settle_after_engine(k))
            .collect();
        for batch in done {
            self.end_store_batch(batch);
        }
        Ok(())
    }

    fn note_tally(&mut self, tally: &ReportTally, source: &str) {
        self.counters.duplicate_store_reports += tally.absorbed;
        self.counters.unmatched_worker_reports += tally.unknown;
        if tally.conflicts > 0 {
            self.counters.store_report_conflicts += tally.conflicts;
            tracing::warn!(
                conflicts = tally.conflicts,
                second_report = source,
                "store reports disagree on success; the first report was applied"
            );
        }
    }

    /// Applies keys (primary `complete_store`, cascade on success), grouped by store batch.
    fn apply_store_keys(&mut self, keys: &[(OffloadKey, bool)]) {
        let mut apply = ApplyList::with_capacity(keys.len());
        for &(k, ok) in keys {
            if let Some(batch) = self.ledger.batch_of(&k) {
                apply.push(k, ok, batch);
            }
        }
        self.apply_grouped(&apply, false);
    }

    /// Applies `apply` one (batch, success) group at a time, in first-seen order, so one
    /// cascade job covers the keys of one store. `taken`: the keys' records were already taken
    /// out of the ledger (engine-only mode), so their batch only counts them settled.
    fn apply_grouped(&mut self, apply: &ApplyList, taken: bool) {
        let Some(&first) = apply.meta.first() else {
            return;
        };
        if apply.meta.iter().all(|m| *m == first) {
            // The usual report: every key of one store with one flag.
            self.apply_group(first.1, first.0, &apply.keys, taken);
            return;
        }
        let mut groups: Vec<((bool, u64), Vec<OffloadKey>)> = Vec::new();
        for (k, m) in apply.keys.iter().zip(&apply.meta) {
            match groups.iter_mut().find(|(g, _)| g == m) {
                Some(g) => g.1.push(*k),
                None => groups.push((*m, vec![*k])),
            }
        }
        for ((ok, batch), group) in groups {
            self.apply_group(batch, ok, &group, taken);
        }
    }

    fn apply_group(&mut self, batch: u64, ok: bool, group: &[OffloadKey], taken: bool) {
        let Some(ctx) = self.ledger.batch_ctx(batch).cloned() else {
            return;
        };
        self.primary.complete_store(group, &ctx, ok);
        if ok {
            self.telemetry
                .device_stores(group.len(), self.arena.chunk_bytes());
            for idx in 0..self.tiers.len() {
                self.cascade_to(idx, group, &ctx);
            }
        }
        let ended = if taken {
            self.ledger.settled_taken(batch, group.len())
        } else {
            let mut ended = false;
            for k in group {
                ended |= self.ledger.mark_applied(k, ok).is_some();
            }
            ended
        };
        if ended {
            self.end_store_batch(batch);
        }
    }

    /// Every key of a store batch is settled: the request has one store fewer pending.
    fn end_store_batch(&mut self, batch: u64) {
        let Some(ctx) = self.ledger.batch_ctx(batch).cloned() else {
            return;
        };
        if let Some(state) = self.requests.get_mut(ctx.id()) {
            state.pending_stores = state.pending_stores.saturating_sub(1);
        }
        self.maybe_finalize(ctx.id());
    }

    /// Applies every report workers queued since the last call, and fails the keys of ranks
    /// that disconnected and did not come back within the deadline.
    pub(crate) fn apply_queued_completions(&mut self) {
        if let Some(channel) = &mut self.channel {
            channel.drain(&self.completion_queue);
        }
        for event in self.completion_queue.take() {
            match event {
                WorkerEvent::Stored { rank, keys, success } => self.apply_worker_report(rank, &keys, success),
                WorkerEvent::Joined { rank } => self.ledger.worker_joined(rank),
                WorkerEvent::Left { rank, clean } => {
                    if clean {
                        self.ledger.worker_joined(rank);
                    } else {
                        tracing::warn!(
                            rank,
                            "a copy worker disconnected without goodbye; its unreported stores fail after the deadline"
                        );
                        self.ledger.worker_gone(rank, Instant::now());
                    }
                }
                WorkerEvent::Rejected => self.counters.completion_messages_rejected += 1,
            }
        }
        for (rank, keys) in self.ledger.expired_worker_keys(Instant::now()) {
            // A worker process that died holding row grants left their lock words set in the
            // shared mapping; release the locks of views whose process is gone, so the rows can
            // be written again.
            match self.arena.reclaim_dead_views() {
                Ok(r) if r.views > 0 => {
                    tracing::warn!(
                        rank,
                        views = r.views,
                        rows = r.rows,
                        "released the row locks of dead worker processes"
                    );
                }
                Ok(_) => {}
                Err(e) => tracing::error!(rank, error = %e, "cannot reclaim the row locks of dead workers"),
            }
            if keys.is_empty() {
                continue;
            }
            tracing::warn!(
                rank,
                keys = keys.len(),
                "failing stores a dead copy worker never reported"
            );
            self.counters.worker_lost_store_keys += keys.len() as u64;
            let failed: Vec<(OffloadKey, bool)> = keys.into_iter().map(|k| (k, false)).collect();
            self.apply_store_keys(&failed);
        }
    }

    fn apply_worker_report(&mut self, rank: u32, keys: &[OffloadKey], success: bool) {
        if !self.ledger.dual {
            self.counters.unmatched_worker_reports += keys.len() as u64;
            tracing::warn!("a copy worker reported a store but off-step completions are off; ignored");
            return;
        }
        let mut tally = ReportTally::default();
        let apply: Vec<(OffloadKey, bool)> = keys
            .iter()
            .filter_map(
                |k| match self.ledger.worker_report(rank, k, success, &mut tally) {
                    Verdict::Apply(ok) => Some((*k, ok)),
                    Verdict::Nothing => None,
                },
            )
            .collect();
        self.note_tally(&tally, "worker");
        self.counters.off_step_store_completions += apply.len() as u64;
        self.apply_store_keys(&apply);
    }
}

#[cfg(test)]
mod tests {
    use crate::error::ManagerError;
    use crate::key::OffloadKey;
    use crate::manager::{ManagerConfig, TieringManager};
    use crate::offloading::OffloadingManager;
    use crate::outcome::LookupResult;
    use crate::request::ReqContext;
    use crate::testing::MemoryPrimary;

    fn k(n: u64) -> OffloadKey {
        OffloadKey::from_u64(n)
    }

    /// Engine-only reports (no copy workers): a key named twice in one report counts as one
    /// duplicate, a store reported in parts ends with its last key, and a report naming only
    /// untracked keys of a request with nothing pending is an error that changes nothing.
    #[test]
    fn engine_only_reports_apply_each_key_once_and_end_the_store_with_its_last_key() {
        let mut m = TieringManager::new(
            Box::new(MemoryPrimary::new(8, 16)),
            Vec::new(),
            ManagerConfig::default(),
        );
        let ctx = ReqContext::local("r");
        let mut s = m.step();
        s.on_new_request(&ctx).unwrap();
        let out = s.prepare_store(&[k(1), k(2), k(3)], &ctx).unwrap().unwrap();
        assert_eq!(out.keys_to_store, vec![k(1), k(2), k(3)]);
        s.complete_store(&[k(2), k(2), k(9)], &ctx, true).unwrap();
        assert_eq!(s.lookup(&k(2), &ctx).unwrap(), LookupResult::Hit);
        assert_eq!(s.lookup(&k(1), &ctx).unwrap(), LookupResult::HitPending);
        let counters = s.stats().unwrap().manager;
        assert_eq!(counters.duplicate_store_reports, 1);
        assert_eq!(s.inspect(|st| st.unmatched_store_reports()).unwrap(), 2);
        // The request finishes while its store is still open: it stays tracked until the
        // store's last key is reported.
        s.on_request_finished(&ctx).unwrap();
        assert_eq!(s.inspect(|st| st.tracked_requests()).unwrap(), 1);
        s.complete_store(&[k(3), k(1)], &ctx, false).unwrap();
        assert_eq!(s.lookup(&k(1), &ctx).unwrap(), LookupResult::Miss);
        assert_eq!(s.lookup(&k(3), &ctx).unwrap(), LookupResult::Miss);
        assert_eq!(
            s.inspect(|st| (st.tracked_requests(), st.unmatched_store_reports()))
                .unwrap(),
            (0, 0)
        );

        let other = ReqContext::local("o");
        s.on_new_request(&other).unwrap();
        assert!(matches!(
            s.complete_store(&[k(2)], &other, true),
            Err(ManagerError::NoPendingStore(_))
        ));
        assert_eq!(s.lookup(&k(2), &other).unwrap(), LookupResult::Hit);
    }

    /// Off-step mode, step-driven (no control thread to apply reports in between): a worker
    /// reports a failed copy, and the engine — which cannot fail a job, as vLLM's connector
    /// cannot — reports the same store as a success right after. The worker's report was first,
    /// so it wins: the chunk is dropped and the engine's report counts as a conflict.
    #[test]
    fn a_worker_failure_queued_before_the_engine_success_is_applied_first() {
        let config = ManagerConfig {
            off_step: true,
            control_plane_thread: false,
            ..ManagerConfig::default()
        };
        let mut m = TieringManager::new(Box::new(MemoryPrimary::new(8, 16)), Vec::new(), config);
        let sender = m.store_completion_sender();
        let ctx = ReqContext::local("r");
        let mut s = m.step();
        s.on_new_request(&ctx).unwrap();
        s.prepare_store(&[k(1), k(2)], &ctx).unwrap().unwrap();
        sender.report(&[k(1)], false);
        sender.report(&[k(2)], true);
        s.complete_store(&[k(1), k(2)], &ctx, true).unwrap();
        assert_eq!(s.lookup(&k(1), &ctx).unwrap(), LookupResult::Miss);
        assert_eq!(s.lookup(&k(2), &ctx).unwrap(), LookupResult::Hit);
        let counters = s.stats().unwrap().manager;
        assert_eq!(counters.store_report_conflicts, 1);
        assert_eq!(counters.off_step_store_completions, 2);
        s.on_request_finished(&ctx).unwrap();
        assert_eq!(s.inspect(|st| st.tracked_requests()).unwrap(), 0);
    }
}
