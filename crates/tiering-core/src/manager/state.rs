//! `TieringState`: every piece of mutable orchestrator state, behind the manager's one lock.
//!
//! The state is a composition of parts, each a type with private fields and a small API in its
//! own module: the primary (`super::tier_call::GuardedPrimary`) and its arena, the chain of
//! secondary tiers (`TierChain`), the job table (`JobTable`), the reserved promotions
//! (`PendingPromotions`), the request table (`RequestTable`), the store reports and their
//! ledger (`Completions`), the failure state (`FailureState`), the step's polls
//! (`StepPolls`), the primary hits of the step (`StepHits`), the gates, the cost model, the
//! promotion back-off, telemetry and the counters. A part never sees another: a method that
//! needs one takes it as an argument.
//!
//! The verbs that need several parts at once are `_unlocked` methods on this type; they take
//! `&mut TieringState`, so "the caller holds the lock" is a fact of the type system. Only these
//! orchestration modules add `impl TieringState` (besides this one, which builds the state and
//! answers diagnostics):
//! - `lookup`: lookups walk the primary, the chain, the back-off and the cost model, reserve
//!   promotions, and submit them as jobs;
//! - `store`: stores open ledger records, and applying a store report completes it in the
//!   primary, cascades to the chain through the gates, and ends the request's store;
//! - `jobs`: polling the chain and applying results touches the job table, the primary, the
//!   gates, the cost model, the back-off and the request table;
//! - `requests`: a request's announcement and finalization go to every tier and the ledger;
//! - `serve`: a tier serving peers is handed a parent that borrows the rest of the state;
//! - `faults`: the panic boundary's policy; a quarantine fails the tier's jobs and frees its
//!   reserved promotions;
//! - `control`: the control thread's sweep (reports, polls, serving, off-step promotions);
//! - `observe`: pending work, events and statistics gather every part;
//! - `teardown`: reset and shutdown clear or stop every part.
//!
//! The engine reaches the verbs through a [`Step`](super::Step), the control thread through its
//! own guard. The public methods here are read-only diagnostics, for tests and reports.

use std::sync::Arc;

use crate::arena::ChunkArena;
use crate::request::TierInfo;
use crate::stats::ManagerCounters;
use crate::tier::{PrimaryTier, SecondaryTier};
use crate::waker::ControlWaker;

use super::completions::Completions;
use super::config::ManagerConfig;
use super::failure_state::FailureState;
use super::job_table::JobTable;
use super::pending_promotions::PendingPromotions;
use super::request_table::RequestTable;
use super::step_polls::StepPolls;
use super::tier_call::{GuardedPrimary, Op};
use super::tier_chain::{Described, TierChain};

/// All mutable orchestrator state (see the module docs).
pub struct TieringState {
    /// The primary behind the panic boundary (`super::tier_call`).
    pub(crate) primary: GuardedPrimary,
    /// The primary's arena: the rows jobs are granted, and the chunk size.
    pub(crate) arena: Arc<ChunkArena>,
    /// The secondary tiers in lookup-priority order.
    pub(crate) tiers: TierChain,
    /// The jobs handed to tiers and not yet finished.
    pub(crate) jobs: JobTable,
    /// Promotions reserved in lookups and not yet submitted.
    pub(crate) pending_promotions: PendingPromotions,
    /// The requests announced and not yet finalized.
    pub(crate) requests: RequestTable,
    /// What the current step already polled (`super::step_polls`).
    pub(crate) step_polls: StepPolls,
    /// The manager's own counters, reported in `stats`.
    pub(crate) counters: ManagerCounters,
    /// The copy workers' and the engine's store reports and the ledger reconciling them.
    pub(crate) completions: Completions,
    /// The failure policy, a failure deferred to the step's next call, the manager's own.
    pub(crate) failures: FailureState,
    /// Metrics through the `metrics` facade.
    pub(crate) telemetry: super::telemetry::Telemetry,
    /// Admission and backpressure in front of each secondary tier.
    pub(crate) gates: super::gates::Gates,
    /// Load-versus-recompute decisions and the per-tier load model.
    pub(crate) cost: super::cost::CostModel,
    /// Failed promotions remembered, so lookups skip the tier they failed on for a while.
    pub(crate) backoff: super::backoff::PromotionBackoff,
    /// The primary hits each request was told about in this step (`super::step_hits`).
    pub(crate) step_hits: super::step_hits::StepHits,
}

impl TieringState {
    /// The state without a waker (the loom models build one).
    #[cfg(loom)]
    pub(crate) fn new(
        primary: Box<dyn PrimaryTier>,
        secondaries: Vec<Box<dyn SecondaryTier>>,
        config: &ManagerConfig,
    ) -> Self {
        Self::with_waker(primary, secondaries, config, None)
    }

    /// The state over `primary` and `secondaries`; each secondary is handed `waker` first, if
    /// given. A secondary that panics while it is described (`set_waker`, `info`,
    /// `needs_control_plane`, `stats`) starts quarantined.
    pub(crate) fn with_waker(
        primary: Box<dyn PrimaryTier>,
        secondaries: Vec<Box<dyn SecondaryTier>>,
        config: &ManagerConfig,
        waker: Option<&ControlWaker>,
    ) -> Self {
        let primary = GuardedPrimary::new(primary);
        let arena = Arc::clone(primary.arena());
        let n = secondaries.len();
        let (
            tiers,
            Described {
                capacities,
                quarantined,
            },
        ) = TierChain::describe(secondaries, waker, config.tier_timeout);
        let names: Vec<String> = tiers.infos().map(|i| i.name.clone()).collect();
        let telemetry = super::telemetry::Telemetry::new(&primary.info().name, &names);
        let described: Vec<(TierInfo, u64)> = tiers
            .infos()
            .zip(capacities)
            .map(|(i, c)| (i.clone(), c))
            .collect();
        let gates = super::gates::Gates::new(&described, config);
        let counters = ManagerCounters {
            tiers_quarantined: quarantined,
            tier_panics: quarantined,
            ..ManagerCounters::default()
        };
        Self {
            telemetry,
            gates,
            cost: super::cost::CostModel::new(config.cost, n),
            backoff: super::backoff::PromotionBackoff::new(
                config.promotion_backoff,
                config.gate_clock.clone(),
                n,
            ),
            step_hits: super::step_hits::StepHits::default(),
            primary,
            arena,
            tiers,
            jobs: JobTable::default(),
            pending_promotions: PendingPromotions::new(n),
            requests: RequestTable::default(),
            step_polls: StepPolls::default(),
            counters,
            completions: Completions::new(config),
            failures: FailureState::new(config.on_tier_failure),
        }
    }

    /// Number of secondary tiers in the chain (quarantined ones included).
    #[must_use]
    pub fn num_secondaries(&self) -> usize {
        self.tiers.len()
    }

    /// Primary↔secondary jobs in flight.
    #[must_use]
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// Promotions reserved but not yet submitted.
    #[must_use]
    pub fn reserved_promotions(&self) -> usize {
        self.pending_promotions.total()
    }

    /// Keys of prepared stores the ledger still tracks (waiting for a report from the engine
    /// or from a copy worker).
    #[must_use]
    pub fn unmatched_store_reports(&self) -> usize {
        self.completions.tracked_keys()
    }

    /// Requests the manager is tracking (announced and not yet finalized).
    #[must_use]
    pub fn tracked_requests(&self) -> usize {
        self.requests.len()
    }

    /// The names of the quarantined tiers with the reason each left the chain.
    #[must_use]
    pub fn quarantined_tiers(&self) -> Vec<(String, String)> {
        self.tiers.quarantined()
    }

    /// Name, medium and locality of each secondary tier, in chain order, as request tier
    /// filters see them (a chain's `medium` / `locality` keys applied).
    #[must_use]
    pub fn secondary_infos(&self) -> Vec<TierInfo> {
        self.tiers.infos().cloned().collect()
    }

    /// (tier, key) promotion failures remembered now: lookups of those keys skip those tiers
    /// until their back-off expires or the tier recovers.
    #[must_use]
    pub fn remembered_promotion_failures(&self) -> usize {
        self.backoff.remembered_keys()
    }

    /// Whether lookups skip secondary tier `idx` for every key now, because its promotions kept
    /// failing.
    #[must_use]
    pub fn promotions_suspended(&self, idx: usize) -> bool {
        self.backoff.suspended(idx)
    }

    /// Whether the scheduler thread (not the control thread) polls and serves tier `idx`.
    pub(crate) fn scheduler_owns(&self, idx: usize) -> bool {
        !self.tiers.control_thread_owns(idx)
    }

    pub(crate) fn tier_name(&self, idx: usize) -> String {
        self.tiers.name_or_index(idx)
    }

    /// Publishes the tiers' and the manager's counters as metrics, at most once a second.
    pub(crate) fn publish_metrics(&mut self) {
        if self.telemetry.publish_due() {
            let stats = self.stats_unlocked();
            super::telemetry::publish(&stats);
        }
    }

    /// The earliest deadline a present opted-in tier or the ledger asked to be woken at.
    pub(crate) fn next_deadline(&mut self) -> Option<std::time::Instant> {
        let mut earliest = self.completions.next_deadline();
        for idx in 0..self.tiers.len() {
            if !self.tiers.on_control_plane(idx) {
                continue;
            }
            if let Some(Some(d)) = self.tier_call_or_defer(idx, Op::NextDeadline, |t| t.next_deadline()) {
                earliest = Some(earliest.map_or(d, |e| e.min(d)));
            }
        }
        earliest
    }
}
