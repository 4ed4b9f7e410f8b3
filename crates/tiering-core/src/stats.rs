//! Statistics reported by tiers and by the manager. Counters are cumulative since construction
//! (or the last `reset`), so a consumer that wants rates diffs two snapshots.

use std::collections::BTreeMap;

/// Counters and gauges of one tier.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TierStats {
    /// The tier's name.
    pub name: String,
    /// Lookups answered `Hit` (or `HitPending` for the primary tier).
    pub hits: u64,
    /// Lookups answered `Miss`.
    pub misses: u64,
    /// Chunks stored (written into the tier).
    pub stores: u64,
    /// Chunks loaded (read out of the tier).
    pub loads: u64,
    /// Chunks evicted to make room.
    pub evictions: u64,
    /// Jobs, or keys of jobs, that failed.
    pub failures: u64,
    /// Bytes written into the tier.
    pub bytes_written: u64,
    /// Bytes read out of the tier.
    pub bytes_read: u64,
    /// Chunks resident now.
    pub resident_chunks: u64,
    /// Chunk capacity.
    pub capacity_chunks: u64,
    /// Tier-specific figures (name → value).
    pub extra: BTreeMap<String, f64>,
}

impl TierStats {
    /// Empty stats for the named tier.
    #[must_use]
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }
}

/// Counters of the orchestrator itself.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ManagerCounters {
    /// Promotion jobs submitted to secondary tiers.
    pub promotion_jobs: u64,
    /// Keys promoted successfully.
    pub promoted_keys: u64,
    /// Keys whose promotion failed.
    pub failed_promotion_keys: u64,
    /// Times a secondary tier was skipped by every lookup because its promotions kept failing
    /// (`ManagerConfig::promotion_backoff`).
    pub promotion_suspensions: u64,
    /// Lookups that skipped a secondary tier because a promotion from it failed recently (of
    /// that key, or of every key while the tier is suspended).
    pub backed_off_lookups: u64,
    /// Promotions refused because the primary tier could not make room (answered `Miss`).
    pub promotion_alloc_failures: u64,
    /// Cascade (store) jobs submitted to secondary tiers, including request-level ones.
    pub cascade_jobs: u64,
    /// Store jobs created for peers through `ParentManager::create_store_job`.
    pub peer_store_jobs: u64,
    /// Device→primary stores completed from the worker's report, ahead of the engine's step.
    pub off_step_store_completions: u64,
    /// Second reports of a stored key (worker then engine, or the reverse, or a rank twice),
    /// absorbed as no-ops.
    pub duplicate_store_reports: u64,
    /// Absorbed second reports whose success flag disagreed with the applied one.
    pub store_report_conflicts: u64,
    /// Worker reports of keys with no prepared store (late, after the request was finalized,
    /// or foreign), ignored. Off-step mode only: a true mismatch.
    pub unmatched_worker_reports: u64,
    /// Keys of worker reports received while off-step completions are off: the engine's own
    /// `complete_store` is the report used in that mode, so these are acknowledged and not
    /// applied (no mismatch).
    pub ignored_worker_reports: u64,
    /// Keys failed because the copy worker that should have reported them disconnected and did
    /// not come back within the deadline.
    pub worker_lost_store_keys: u64,
    /// Completion-channel messages rejected (malformed, or from a worker of another arena).
    pub completion_messages_rejected: u64,
    /// Tiers taken out of the chain after a failure.
    pub tiers_quarantined: u64,
    /// Panics of secondary tier calls caught at the manager's boundary (each also quarantined
    /// the tier, or was returned to the engine under `on_tier_failure = "fail"`).
    pub tier_panics: u64,
    /// Control-plane failures (each returned once to the engine).
    pub control_failures: u64,
    /// Control-plane sweeps run (off the scheduler thread or at step end).
    pub sweeps: u64,
    /// Job results processed.
    pub results_processed: u64,
}

/// A snapshot of the manager: its own counters, the primary tier, then each secondary in chain
/// order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ManagerStats {
    /// Orchestrator counters.
    pub manager: ManagerCounters,
    /// The primary tier.
    pub primary: TierStats,
    /// The secondary tiers, in chain order.
    pub secondaries: Vec<TierStats>,
    /// Primary↔secondary jobs in flight.
    pub jobs_in_flight: u64,
    /// The cascade gates of each secondary tier, in chain order.
    pub gates: Vec<TierGateStats>,
    /// Load-versus-recompute decisions per secondary tier, in chain order.
    pub decisions: Vec<PromotionDecisions>,
}

/// Admission and backpressure figures of one secondary tier (`docs/ARCHITECTURE.md`,
/// "Admission and backpressure"). Counts are cumulative.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TierGateStats {
    /// The tier's name.
    pub tier: String,
    /// The admission policy and its options.
    pub admission: String,
    /// Chunks the admission policy refused when they would have been cascaded.
    pub admission_rejections: u64,
    /// Refused chunks cascaded later, after an access made the policy admit them.
    pub late_admissions: u64,
    /// Cascade jobs dropped because the tier was under backpressure.
    pub backpressure_dropped_jobs: u64,
    /// Chunks of those jobs.
    pub backpressure_dropped_chunks: u64,
    /// Cascades let through under backpressure to measure the tier again.
    pub backpressure_probes: u64,
    /// Times backpressure turned on.
    pub backpressure_activations: u64,
    /// Whether cascades to the tier are being dropped now.
    pub backpressure_active: bool,
    /// Average cascade time per MiB, in seconds (`None` before the first cascade finished).
    pub store_seconds_per_mib: Option<f64>,
}

/// Load-versus-recompute decisions of one secondary tier and its measured load cost
/// (`docs/ARCHITECTURE.md`, "Cost model").
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct PromotionDecisions {
    /// The tier's name.
    pub name: String,
    /// Chunks whose promotion was started (a secondary hit answered `HitPending`).
    pub started: u64,
    /// Chunks promoted successfully.
    pub promoted: u64,
    /// Secondary hits answered `Miss` because recomputing was expected to be faster.
    pub declined_by_cost: u64,
    /// Promotions the engine stopped waiting for at their deadline (the chunk still lands).
    pub abandoned_by_deadline: u64,
    /// Hits promoted although the model said decline, to re-measure a tier that had gone
    /// unmeasured for the probe interval (included in `started`); the lookup that started one
    /// answered `Miss`.
    pub probes: u64,
    /// Finished promotions the model was fitted on.
    pub samples: u64,
    /// Fitted fixed latency of one promotion, in seconds.
    pub load_fixed_secs: Option<f64>,
    /// Fitted load cost per MiB of promotion backlog, in seconds.
    pub load_secs_per_mib: Option<f64>,
    /// `Retry` answers of the tier passed on as `Miss`: waiting for the tier's answer was
    /// expected to cost more than the recompute it would save.
    pub retries_declined_by_cost: u64,
    /// Lookups the manager made itself of declined `Retry` questions (nobody waits for them), so
    /// the tier's answers stay measured.
    pub retry_rechecks: u64,
    /// Answered `Retry` questions the answer time and hit rate are averaged over.
    pub retry_samples: u64,
    /// How often an answered `Retry` was a hit (moving average).
    pub retry_hit_rate: Option<f64>,
    /// How long the engine waited for an answer after a `Retry`, in seconds (moving average).
    pub retry_answer_secs: Option<f64>,
}
