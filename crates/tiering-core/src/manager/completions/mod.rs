//! Store completions: the engine's `complete_store`, and — in off-step mode — the copy
//! workers' reports of the same stores, which the control thread applies between steps so a
//! peer waiting for those chunks is answered while the model runs.
//!
//! Workers report in process through a [`StoreCompletionSender`] or from other processes over
//! the [completion channel](crate::channel); both land in one [`CompletionQueue`] that the
//! control thread drains. The [`ledger`] reconciles the reports per key. [`Completions`] owns
//! all of it and says which keys to apply; applying them (the primary's `complete_store`, the
//! cascade, the request's end) needs the rest of the state and is the orchestrator's
//! (`super::store`).

pub(crate) mod ledger;
mod sender;

use std::sync::Arc;
use std::time::Instant;

use crate::arena::ChunkArena;
use crate::channel::{ChannelServer, CompletionQueue, WorkerEvent};
use crate::key::OffloadKey;
use crate::request::{ReqContext, RequestId};
use crate::stats::ManagerCounters;

use super::config::ManagerConfig;
use ledger::{ReportTally, StoreLedger, Verdict};

pub use sender::StoreCompletionSender;

/// Keys to apply with their success flag and store batch (parallel vectors, so a report of
/// one store hands its keys to the primary as one slice).
pub(crate) struct ApplyList {
    keys: Vec<OffloadKey>,
    meta: Vec<(bool, u64)>,
}

impl ApplyList {
    /// Room for `n` keys without growing (a report's keys are usually all applied).
    fn with_capacity(n: usize) -> Self {
        Self {
            keys: Vec::with_capacity(n),
            meta: Vec::with_capacity(n),
        }
    }

    /// Adds `key`, to apply with `ok` in store batch `batch`.
    fn push(&mut self, key: OffloadKey, ok: bool, batch: u64) {
        self.keys.push(key);
        self.meta.push((ok, batch));
    }

    /// Calls `apply(batch, success, keys)` once per (batch, success) group, in first-seen
    /// order, so one cascade job covers the keys of one store. The usual report (every key of
    /// one store with one flag) is handed over as it is, without regrouping.
    pub(crate) fn for_each_group(&self, mut apply: impl FnMut(u64, bool, &[OffloadKey])) {
        let Some(&first) = self.meta.first() else {
            return;
        };
        if self.meta.iter().all(|m| *m == first) {
            apply(first.1, first.0, &self.keys);
            return;
        }
        let mut groups: Vec<((bool, u64), Vec<OffloadKey>)> = Vec::new();
        for (k, m) in self.keys.iter().zip(&self.meta) {
            match groups.iter_mut().find(|(g, _)| g == m) {
                Some(g) => g.1.push(*k),
                None => groups.push((*m, vec![*k])),
            }
        }
        for ((ok, batch), group) in groups {
            apply(batch, ok, &group);
        }
    }
}

/// What the engine's report of a store asks the orchestrator to do.
pub(crate) struct EngineReport {
    /// Keys to apply now.
    pub(crate) apply: ApplyList,
    /// Keys a worker already applied, which the engine's report settles once `apply` is done.
    pub(crate) settle: Vec<OffloadKey>,
    /// The applied keys' records were already taken out of the ledger (engine-only mode), so
    /// their batch only counts them settled.
    pub(crate) taken: bool,
}

/// Whether the manager already said it ignores copy workers' reports (on-step mode): once
/// each, instead of a line per report.
#[derive(Default)]
struct IgnoredReportNotes {
    reported: bool,
    failure: bool,
}

/// The store reports and their reconciliation: the queue copy workers report into, the
/// completion channel of worker processes, the store ledger, and what was said about ignored
/// reports.
pub(crate) struct Completions {
    /// Shared with every [`StoreCompletionSender`] and read into by the channel.
    queue: Arc<CompletionQueue>,
    /// Open once the engine asks for it; drained where the queue is applied.
    channel: Option<ChannelServer>,
    ledger: StoreLedger,
    ignored_report_notes: IgnoredReportNotes,
}

impl Completions {
    /// No report yet; the ledger keeps records for workers only in off-step mode.
    pub(crate) fn new(config: &ManagerConfig) -> Self {
        Self {
            queue: Arc::new(CompletionQueue::default()),
            channel: None,
            ledger: StoreLedger::new(config.off_step, config.reporters, config.worker_deadline),
            ignored_report_notes: IgnoredReportNotes::default(),
        }
    }

    /// The queue copy workers report into (for a [`StoreCompletionSender`]).
    pub(crate) fn queue(&self) -> &Arc<CompletionQueue> {
        &self.queue
    }

    /// Whether the completion channel is open.
    pub(crate) fn has_channel(&self) -> bool {
        self.channel.is_some()
    }

    /// Keeps the opened completion channel; its reports are read where the queue is applied.
    pub(crate) fn set_channel(&mut self, channel: ChannelServer) {
        self.channel = Some(channel);
    }

    /// Takes the channel out, to stop it at shutdown.
    pub(crate) fn take_channel(&mut self) -> Option<ChannelServer> {
        self.channel.take()
    }

    /// Off-step mode (`ManagerConfig::off_step`): workers report too, the engine's report
    /// settles a key, and the control thread applies reports (and submits the promotions
    /// serving reserved) between steps.
    pub(crate) fn off_step(&self) -> bool {
        self.ledger.dual
    }

    /// Opens the ledger records of a prepared store.
    pub(crate) fn open_batch(&mut self, ctx: &ReqContext, keys: &[OffloadKey]) {
        self.ledger.open_batch(ctx, keys);
    }

    /// Reconciles the engine's report of `keys`: which to apply, which a worker applied
    /// already. `None` when no key is tracked and the request has no store pending
    /// (`has_pending`): the report names no store, and nothing was counted.
    pub(crate) fn engine_report(
        &mut self,
        keys: &[OffloadKey],
        success: bool,
        has_pending: bool,
        counters: &mut ManagerCounters,
    ) -> Option<EngineReport> {
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
            return None;
        }
        note_tally(counters, &tally, "engine");
        Some(EngineReport {
            apply,
            settle,
            taken: !self.ledger.dual,
        })
    }

    /// The engine reported `keys`, which a worker had applied: the batches that ended with
    /// them.
    pub(crate) fn settle_after_engine(&mut self, keys: &[OffloadKey]) -> Vec<u64> {
        keys.iter()
            .filter_map(|k| self.ledger.settle_after_engine(k))
            .collect()
    }

    /// The request and options of store batch `batch`, while it is open.
    pub(crate) fn batch_ctx(&self, batch: u64) -> Option<&ReqContext> {
        self.ledger.batch_ctx(batch)
    }

    /// `group` of store batch `batch` was applied with `ok`; whether that ended the batch.
    /// `taken`: as [`EngineReport::taken`].
    pub(crate) fn applied(&mut self, batch: u64, ok: bool, group: &[OffloadKey], taken: bool) -> bool {
        if taken {
            self.ledger.settled_taken(batch, group.len())
        } else {
            let mut ended = false;
            for k in group {
                ended |= self.ledger.mark_applied(k, ok).is_some();
            }
            ended
        }
    }

    /// `keys` with their flags, as an [`ApplyList`] of the ones an open batch holds.
    pub(crate) fn apply_list(&self, keys: &[(OffloadKey, bool)]) -> ApplyList {
        let mut apply = ApplyList::with_capacity(keys.len());
        for &(k, ok) in keys {
            if let Some(batch) = self.ledger.batch_of(&k) {
                apply.push(k, ok, batch);
            }
        }
        apply
    }

    /// Every event workers queued since the last call (the channel's read in first), oldest
    /// first.
    pub(crate) fn take_worker_events(&mut self) -> Vec<WorkerEvent> {
        if let Some(channel) = &mut self.channel {
            channel.drain(&self.queue);
        }
        self.queue.take()
    }

    /// Notes a worker event that is not a store report (`WorkerEvent::Stored` goes through
    /// [`Completions::worker_report`]).
    pub(crate) fn worker_event(&mut self, event: &WorkerEvent, counters: &mut ManagerCounters) {
        match *event {
            WorkerEvent::Stored { .. } => {}
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
            WorkerEvent::Rejected => counters.completion_messages_rejected += 1,
        }
    }

    /// Reconciles worker `rank`'s report of `keys`: the keys to apply now, with their flags.
    /// `None` in on-step mode, where the report is acknowledged and ignored.
    pub(crate) fn worker_report(
        &mut self,
        rank: u32,
        keys: &[OffloadKey],
        success: bool,
        counters: &mut ManagerCounters,
    ) -> Option<Vec<(OffloadKey, bool)>> {
        if !self.ledger.dual {
            // On-step mode: the engine's `complete_store` is the one report of a store, and the
            // ledger keeps no record for a worker report to match (it takes each key out when
            // the engine reports it). A worker that reports anyway (a binding that always
            // opens the channel) is not a mismatch: acknowledge and count, say so once.
            self.ignore_worker_report(rank, keys.len(), success, counters);
            return None;
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
        note_tally(counters, &tally, "worker");
        counters.off_step_store_completions += apply.len() as u64;
        Some(apply)
    }

    /// Counts a worker report ignored in on-step mode, and says so once (and once more for a
    /// failed copy, which the operator may want to know about).
    fn ignore_worker_report(
        &mut self,
        rank: u32,
        keys: usize,
        success: bool,
        counters: &mut ManagerCounters,
    ) {
        counters.ignored_worker_reports += keys as u64;
        let notes = &mut self.ignored_report_notes;
        if !notes.reported {
            notes.reported = true;
            tracing::info!(
                rank,
                "copy workers report stores, but off-step completions are off: the engine's complete_store is used and the workers' reports are ignored (counted in ignored_worker_reports)"
            );
        }
        if !success && !notes.failure {
            notes.failure = true;
            tracing::warn!(
                rank,
                keys,
                "a copy worker reported a failed store copy while off-step completions are off: only the engine's report is used; set [control_plane] off_step = true for the workers' failures to count"
            );
        }
    }

    /// The keys of worker ranks that disconnected and did not come back within the deadline,
    /// per rank.
    pub(crate) fn expired_worker_keys(&mut self, now: Instant) -> Vec<(u32, Vec<OffloadKey>)> {
        self.ledger.expired_worker_keys(now)
    }

    /// Drops the records of a finalized request (they only waited for a late worker report).
    pub(crate) fn forget_request(&mut self, rid: &RequestId) {
        self.ledger.forget_request(rid);
    }

    /// Forgets every record (`reset_cache`).
    pub(crate) fn clear(&mut self) {
        self.ledger.clear();
    }

    /// When the ledger wants to be woken (a gone worker's deadline).
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.ledger.next_deadline()
    }

    /// Keys of prepared stores still waiting for a report.
    pub(crate) fn tracked_keys(&self) -> usize {
        self.ledger.tracked_keys()
    }
}

/// Worker `rank` is gone for good with `keys` unreported: releases the row locks dead worker
/// processes left set, counts the keys lost, and returns them as failed, to apply.
pub(crate) fn lost_worker(
    rank: u32,
    keys: Vec<OffloadKey>,
    arena: &ChunkArena,
    counters: &mut ManagerCounters,
) -> Vec<(OffloadKey, bool)> {
    // A worker process that died holding row grants left their lock words set in the shared
    // mapping; release the locks of views whose process is gone, so the rows can be written
    // again.
    match arena.reclaim_dead_views() {
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
        return Vec::new();
    }
    tracing::warn!(
        rank,
        keys = keys.len(),
        "failing stores a dead copy worker never reported"
    );
    counters.worker_lost_store_keys += keys.len() as u64;
    keys.into_iter().map(|k| (k, false)).collect()
}

/// Counts one report's effects, and warns when it disagrees with the report applied first.
fn note_tally(counters: &mut ManagerCounters, tally: &ReportTally, source: &str) {
    counters.duplicate_store_reports += tally.absorbed;
    counters.unmatched_worker_reports += tally.unknown;
    if tally.conflicts > 0 {
        counters.store_report_conflicts += tally.conflicts;
        tracing::warn!(
            conflicts = tally.conflicts,
            second_report = source,
            "store reports disagree on success; the first report was applied"
        );
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

    /// Counts the log events at each level emitted on this thread.
    #[derive(Default)]
    struct LevelCounter(std::sync::Mutex<std::collections::BTreeMap<tracing::Level, usize>>);

    impl tracing::Subscriber for LevelCounter {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            *self
                .0
                .lock()
                .unwrap()
                .entry(*event.metadata().level())
                .or_default() += 1;
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// On-step mode (off_step = false) with copy workers that report anyway, as a binding that
    /// always opens the completion channel does: every report is acknowledged as not used in
    /// this mode — counted in `ignored_worker_reports`, not as a mismatch — the stores complete
    /// from the engine's reports, and the manager says so once (info), not once per report.
    /// A failed copy reported by a worker is warned about once.
    #[test]
    fn worker_reports_in_on_step_mode_are_acknowledged_not_mismatches() {
        let counter = std::sync::Arc::new(LevelCounter::default());
        let levels = std::sync::Arc::clone(&counter);
        tracing::subscriber::with_default(counter, || {
            let mut m = TieringManager::new(
                Box::new(MemoryPrimary::new(64, 16)),
                Vec::new(),
                ManagerConfig::step_driven(),
            );
            let sender = m.store_completion_sender();
            let ctx = ReqContext::local("r");
            let mut reported = 0;
            for round in 0..20u64 {
                let keys = [k(2 * round), k(2 * round + 1)];
                let mut s = m.step();
                if round == 0 {
                    s.on_new_request(&ctx).unwrap();
                }
                s.prepare_store(&keys, &ctx).unwrap().unwrap();
                // Half the workers report before the engine, half after (applied at the next
                // step's poll).
                if round % 2 == 0 {
                    sender.report(&keys, true);
                    reported += 2;
                }
                s.complete_store(&keys, &ctx, true).unwrap();
                if round % 2 == 1 {
                    sender.report(&keys, round != 19);
                    reported += 2;
                }
                assert_eq!(s.lookup(&keys[0], &ctx).unwrap(), LookupResult::Hit);
                s.on_schedule_end(&crate::outcome::ScheduleEndContext::default())
                    .unwrap();
            }
            let mut s = m.step();
            // The last reports are applied by the next step's first poll.
            assert_eq!(
                s.lookup(&k(39), &ctx).unwrap(),
                LookupResult::Hit,
                "the engine's report stands"
            );
            let counters = s.stats().unwrap().manager;
            assert_eq!(counters.unmatched_worker_reports, 0, "no report is a mismatch");
            assert_eq!(counters.ignored_worker_reports, reported);
            assert_eq!(counters.off_step_store_completions, 0);
            s.on_request_finished(&ctx).unwrap();
            assert_eq!(s.inspect(|st| st.tracked_requests()).unwrap(), 0);
        });
        let levels = levels.0.lock().unwrap();
        assert_eq!(
            levels.get(&tracing::Level::INFO).copied().unwrap_or(0),
            1,
            "{levels:?}"
        );
        assert_eq!(
            levels.get(&tracing::Level::WARN).copied().unwrap_or(0),
            1,
            "{levels:?}"
        );
    }

    /// Off-step mode still counts a report of a key nobody prepared as a mismatch.
    #[test]
    fn a_report_of_an_unknown_key_is_a_mismatch_in_off_step_mode() {
        let config = ManagerConfig {
            off_step: true,
            ..ManagerConfig::step_driven()
        };
        let mut m = TieringManager::new(Box::new(MemoryPrimary::new(8, 16)), Vec::new(), config);
        let sender = m.store_completion_sender();
        sender.report(&[k(5)], true);
        let ctx = ReqContext::local("r");
        let mut s = m.step();
        s.on_new_request(&ctx).unwrap();
        assert_eq!(s.lookup(&k(5), &ctx).unwrap(), LookupResult::Miss);
        let counters = s.stats().unwrap().manager;
        assert_eq!(
            (counters.unmatched_worker_reports, counters.ignored_worker_reports),
            (1, 0)
        );
    }
}
