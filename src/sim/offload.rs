//! The engine's side of the offloading connector: every manager call the scheduler makes, timed,
//! plus the bookkeeping that attributes each prefix hit to the tier that served it.
//!
//! Attribution: a lookup that answers `HitPending` for a key the engine is not itself storing
//! and has not seen promoted means the manager just started a promotion; the secondary tier whose
//! `hits` counter moved since the last snapshot is the one serving it. Snapshots are taken
//! inside the step (under the step lock), so the control thread cannot move counters in between
//! — except peer-served lookups before the step's first locked call, which a single-node run
//! does not have.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tiering_core::StoreCompletionSender;
use tiering_core::{
    KeyMap, LookupResult, ManagerStats, OffloadKey, OffloadPolicy, OffloadingManager, PrepareStoreOutput,
    ReqContext, ScheduleEndContext, Step, TieringManager,
    arena::{ChunkArena, ChunkId},
};

use super::cpu_clock::thread_cpu_time;
use super::error::SimError;
use super::store_ledger::{StoreLedger, Storer};

/// Which tier served a chunk that the engine did not recompute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// The engine's own device prefix cache.
    Device,
    /// The primary (CPU) tier, already resident.
    Primary,
    /// Secondary tier `i` (chain order), through a promotion.
    Secondary(usize),
}

/// Counts of lookup verdicts the engine received.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LookupCounts {
    /// `Hit`.
    pub hit: u64,
    /// `HitPending`.
    pub hit_pending: u64,
    /// `Retry`.
    pub retry: u64,
    /// `Miss`.
    pub miss: u64,
}

impl LookupCounts {
    /// All lookups.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.hit + self.hit_pending + self.retry + self.miss
    }
}

/// Keys in the KV-cache events the engine drained.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EventCounts {
    /// Keys reported stored.
    pub stored: u64,
    /// Keys reported removed.
    pub removed: u64,
}

/// The manager as the scheduler thread sees it: a [`Step`] opens at the scheduler's first
/// manager call of a step and is dropped by [`Offload::finish_step`], right after
/// `on_schedule_end` and before the model runs.
pub struct Offload {
    // Declared before `mgr`: a step must be dropped before its manager.
    step: Option<Step<'static>>,
    mgr: TieringManager,
    arena: Arc<ChunkArena>,
    secondaries: usize,
    snapshot: Vec<u64>,
    snapshot_fresh: bool,
    promoted_from: KeyMap<usize>,
    storing: KeyMap<u32>,
    step_time: Duration,
    step_calls: u32,
    /// Scheduler CPU time spent on the simulator's own attribution (stats snapshots) since
    /// [`Offload::take_attribution_cpu`]: a real engine does not spend it, so the engine's
    /// clock does not charge it.
    attribution_cpu: Duration,
    /// Lookup verdicts so far.
    pub lookups: LookupCounts,
    /// KV-cache events drained so far.
    pub events: EventCounts,
    /// Primary lookups counted by the primary tier before the run (hits + misses).
    primary_lookups_at_start: u64,
    /// In a multi-node run: this engine's node index and the run's record of who stored what.
    node: Option<(usize, Arc<StoreLedger>)>,
    /// Chunks this node promoted from a secondary tier that another node of the run stored
    /// and this one never did (counted when they are loaded).
    pub cross_node_chunks: u64,
    /// Chunks this node promoted from a secondary tier that no node of the run stored (left
    /// in a shared tier by an earlier run).
    pub foreign_chunks: u64,
    /// The events drained, kept for [`Offload::take_kept_events`] (only when asked for with
    /// [`Offload::keep_events`]).
    kept_events: Option<Vec<tiering_core::OffloadingEvent>>,
}

impl Offload {
    /// Wraps a manager; `secondaries` is the number of secondary tiers.
    ///
    /// # Errors
    /// The manager's stats call failed.
    pub fn new(mgr: TieringManager, arena: Arc<ChunkArena>, secondaries: usize) -> Result<Self, SimError> {
        let stats = mgr.stats()?;
        Ok(Self {
            step: None,
            mgr,
            arena,
            secondaries,
            snapshot: stats.secondaries.iter().map(|s| s.hits).collect(),
            snapshot_fresh: false,
            promoted_from: KeyMap::default(),
            storing: KeyMap::default(),
            step_time: Duration::ZERO,
            step_calls: 0,
            lookups: LookupCounts::default(),
            events: EventCounts::default(),
            attribution_cpu: Duration::ZERO,
            primary_lookups_at_start: stats.primary.hits + stats.primary.misses,
            node: None,
            cross_node_chunks: 0,
            foreign_chunks: 0,
            kept_events: None,
        })
    }

    /// Makes this the engine of node `index` of a multi-node run: its stores are recorded in
    /// `ledger`, and its promotions are checked against it.
    #[must_use]
    pub fn on_node(mut self, index: usize, ledger: Arc<StoreLedger>) -> Self {
        self.node = Some((index, ledger));
        self
    }

    /// A sender for the copy worker when the manager runs in off-step mode (`off_step = true`
    /// in the chain's `[control_plane]`): the worker then reports finished stores directly.
    pub fn completion_sender(&self) -> Option<StoreCompletionSender> {
        self.mgr
            .config()
            .off_step
            .then(|| self.mgr.store_completion_sender())
    }

    /// The primary tier's arena.
    #[must_use]
    pub fn arena(&self) -> &Arc<ChunkArena> {
        &self.arena
    }

    fn timed<R>(&mut self, f: impl FnOnce(&mut Step<'static>) -> R) -> R {
        let t = Instant::now();
        let mgr = &self.mgr;
        let step = self.step.get_or_insert_with(|| mgr.detached_step());
        let r = f(step);
        self.step_time += t.elapsed();
        self.step_calls += 1;
        r
    }

    /// The manager time of the step just ended (`None` when the step made no call), and resets
    /// the per-step state.
    pub fn end_step_time(&mut self) -> Option<Duration> {
        let t = (self.step_calls > 0).then_some(self.step_time);
        self.step_time = Duration::ZERO;
        self.step_calls = 0;
        self.snapshot_fresh = false;
        t
    }

    /// `on_new_request`.
    ///
    /// # Errors
    /// The manager's error.
    pub fn on_new_request(&mut self, ctx: &ReqContext) -> Result<OffloadPolicy, SimError> {
        Ok(self.timed(|m| m.on_new_request(ctx))?)
    }

    /// `lookup`, counted and attributed.
    ///
    /// # Errors
    /// The manager's error.
    pub fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupResult, SimError> {
        if self.secondaries > 0 && !self.snapshot_fresh {
            self.refresh_snapshot()?;
        }
        let r = self.timed(|m| m.lookup(key, ctx))?;
        match r {
            LookupResult::Hit => self.lookups.hit += 1,
            LookupResult::HitPending => {
                self.lookups.hit_pending += 1;
                if self.secondaries > 0
                    && !self.promoted_from.contains_key(key)
                    && !self.storing.contains_key(key)
                    && let Some(tier) = self.moved_tier()?
                {
                    self.promoted_from.insert(*key, tier);
                }
            }
            LookupResult::Retry => self.lookups.retry += 1,
            LookupResult::Miss => {
                self.lookups.miss += 1;
                if self.secondaries > 0 {
                    // A secondary may have hit and then found no primary room.
                    self.refresh_snapshot()?;
                }
            }
        }
        Ok(r)
    }

    fn refresh_snapshot(&mut self) -> Result<(), SimError> {
        let start = thread_cpu_time();
        let stats = self.stats()?;
        self.snapshot.clear();
        self.snapshot.extend(stats.secondaries.iter().map(|s| s.hits));
        self.snapshot_fresh = true;
        self.attribution_cpu += thread_cpu_time().saturating_sub(start);
        Ok(())
    }

    /// The scheduler CPU time spent on attribution since the last call (see the field).
    pub fn take_attribution_cpu(&mut self) -> Duration {
        std::mem::take(&mut self.attribution_cpu)
    }

    /// The first secondary tier whose hit counter moved since the snapshot; refreshes it.
    fn moved_tier(&mut self) -> Result<Option<usize>, SimError> {
        let start = thread_cpu_time();
        let stats = self.stats()?;
        let moved = stats
            .secondaries
            .iter()
            .zip(&self.snapshot)
            .position(|(s, &before)| s.hits > before);
        self.snapshot.clear();
        self.snapshot.extend(stats.secondaries.iter().map(|s| s.hits));
        self.attribution_cpu += thread_cpu_time().saturating_sub(start);
        Ok(moved)
    }

    /// Where a key about to be loaded came from; forgets a promotion once it is consumed.
    pub fn take_source(&mut self, key: &OffloadKey) -> Source {
        let source = self
            .promoted_from
            .remove(key)
            .map_or(Source::Primary, Source::Secondary);
        if let (Source::Secondary(_), Some((node, ledger))) = (source, &self.node) {
            match ledger.storer(key, *node) {
                Storer::OtherNode => self.cross_node_chunks += 1,
                Storer::Nobody => self.foreign_chunks += 1,
                Storer::ThisNode => {}
            }
        }
        source
    }

    /// `touch`.
    ///
    /// # Errors
    /// The manager's error.
    pub fn touch(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), SimError> {
        Ok(self.timed(|m| m.touch(keys, ctx))?)
    }

    /// `prepare_load`.
    ///
    /// # Errors
    /// The manager's error.
    pub fn prepare_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<Vec<ChunkId>, SimError> {
        Ok(self.timed(|m| m.prepare_load(keys, ctx))?)
    }

    /// `complete_load`.
    ///
    /// # Errors
    /// The manager's error.
    pub fn complete_load(&mut self, keys: &[OffloadKey], ctx: &ReqContext) -> Result<(), SimError> {
        Ok(self.timed(|m| m.complete_load(keys, ctx))?)
    }

    /// `prepare_store`; the keys to store are remembered as "write in flight by the engine".
    ///
    /// # Errors
    /// The manager's error.
    pub fn prepare_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Option<PrepareStoreOutput>, SimError> {
        let out = self.timed(|m| m.prepare_store(keys, ctx))?;
        if let Some(out) = &out {
            for k in &out.keys_to_store {
                *self.storing.entry(*k).or_default() += 1;
            }
        }
        Ok(out)
    }

    /// `complete_store`.
    ///
    /// # Errors
    /// The manager's error.
    pub fn complete_store(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        ok: bool,
    ) -> Result<(), SimError> {
        if ok && let Some((node, ledger)) = &self.node {
            ledger.record(keys, *node);
        }
        for k in keys {
            if let Some(n) = self.storing.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    self.storing.remove(k);
                }
            }
        }
        Ok(self.timed(|m| m.complete_store(keys, ctx, ok))?)
    }

    /// `on_request_finished`.
    ///
    /// # Errors
    /// The manager's error.
    pub fn on_request_finished(&mut self, ctx: &ReqContext) -> Result<(), SimError> {
        Ok(self.timed(|m| m.on_request_finished(ctx))?)
    }

    /// `on_schedule_end`: the end-of-step flush (the step stays open until
    /// [`Offload::finish_step`]).
    ///
    /// # Errors
    /// The manager's error.
    pub fn on_schedule_end(&mut self, ctx: &ScheduleEndContext) -> Result<(), SimError> {
        Ok(self.timed(|m| m.on_schedule_end(ctx))?)
    }

    /// Ends the step: drops it, releasing the manager's lock before the model runs.
    pub fn finish_step(&mut self) {
        self.step = None;
    }

    /// `has_pending_work` (an observation hook: from the open step, or locking only for itself).
    ///
    /// # Errors
    /// The manager's error.
    pub fn has_pending_work(&mut self) -> Result<bool, SimError> {
        Ok(match self.step.as_mut() {
            Some(s) => s.has_pending_work()?,
            None => self.mgr.has_pending_work()?,
        })
    }

    /// Drains the tiers' events (observation hook, under the step's lock), counting them.
    ///
    /// # Errors
    /// The manager's error.
    pub fn take_events(&mut self) -> Result<(), SimError> {
        let events = match self.step.as_mut() {
            Some(s) => s.take_events()?,
            None => self.mgr.take_events()?,
        };
        for e in &events {
            if e.removed {
                self.events.removed += e.keys.len() as u64;
            } else {
                self.events.stored += e.keys.len() as u64;
            }
        }
        if let Some(kept) = &mut self.kept_events {
            kept.extend(events);
        }
        Ok(())
    }

    /// Keeps every event drained from now on, for [`Offload::take_kept_events`].
    pub fn keep_events(&mut self) {
        self.kept_events.get_or_insert_with(Vec::new);
    }

    /// The events kept since the last call (none unless [`Offload::keep_events`] was called).
    pub fn take_kept_events(&mut self) -> Vec<tiering_core::OffloadingEvent> {
        self.kept_events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// A stats snapshot (not timed: instrumentation).
    ///
    /// # Errors
    /// The manager's error.
    pub fn stats(&mut self) -> Result<ManagerStats, SimError> {
        Ok(match self.step.as_mut() {
            Some(s) => s.stats()?,
            None => self.mgr.stats()?,
        })
    }

    /// Primary-tier lookups (hits + misses, as the primary counts them) since the run started.
    #[must_use]
    pub fn primary_lookups(stats: &ManagerStats, start: u64) -> u64 {
        (stats.primary.hits + stats.primary.misses).saturating_sub(start)
    }

    /// The primary lookup count at the start of the run.
    #[must_use]
    pub fn primary_lookups_at_start(&self) -> u64 {
        self.primary_lookups_at_start
    }

    /// Whether the control-plane thread is running.
    #[must_use]
    pub fn control_thread_running(&self) -> bool {
        self.mgr.control_thread_running()
    }

    /// Shuts the manager down.
    ///
    /// # Errors
    /// The manager's error.
    pub fn shutdown(&mut self) -> Result<(), SimError> {
        self.step = None;
        Ok(self.mgr.shutdown()?)
    }
}
