//! Metrics through the `metrics` facade (no exporter here: the binary or the engine installs
//! one). Handles for the hot paths (lookups, job results) are registered once, when the manager
//! is built, so install the recorder before building the manager; tier and manager counters are
//! published from the stats at most once a second. Every name starts with `kvtier_` and carries
//! its unit (`_total`, `_seconds`, `_bytes`, `_chunks`).
//!
//! Without the crate's `metrics` feature (on by default) the same code runs against the no-op
//! handles of [`off`], so an engine that exports no metrics does not build the facade.

use std::time::{Duration, Instant};

#[cfg(feature = "metrics")]
use metrics::{Counter, Histogram, counter, gauge, histogram};
#[cfg(not(feature = "metrics"))]
use off::{Counter, Histogram, counter, gauge, histogram};

use crate::job::{JobKind, JobResult};
use crate::outcome::LookupResult;
use crate::stats::ManagerStats;

const RESULTS: [&str; 4] = ["hit", "hit_pending", "retry", "miss"];
const PUBLISH_EVERY: Duration = Duration::from_secs(1);

fn result_index(r: LookupResult) -> usize {
    match r {
        LookupResult::Hit => 0,
        LookupResult::HitPending => 1,
        LookupResult::Retry => 2,
        LookupResult::Miss => 3,
    }
}

/// Per-path transfer handles of one secondary tier.
struct TierHandles {
    /// primary → tier (cascades and peer store jobs), tier → primary (promotions).
    bytes: [Counter; 2],
    chunks: [Counter; 2],
    job_seconds: [Histogram; 2],
}

/// The manager's metric handles.
pub(crate) struct Telemetry {
    /// `[tier][result]`: index 0 is the primary, 1.. the secondaries, last "none".
    lookups: Vec<[Counter; 4]>,
    tiers: Vec<TierHandles>,
    device_store_chunks: Counter,
    device_store_bytes: Counter,
    lock_wait: [Histogram; 2],
    lock_hold: [Histogram; 2],
    starvation_warnings: Counter,
    last_publish: Option<Instant>,
}

/// Who held or waited for the manager lock.
#[derive(Clone, Copy)]
pub(crate) enum Holder {
    Step = 0,
    Control = 1,
}

impl Telemetry {
    pub(crate) fn new(primary: &str, secondaries: &[String]) -> Self {
        let names: Vec<String> = std::iter::once(primary.to_owned())
            .chain(secondaries.iter().cloned())
            .chain(std::iter::once("none".to_owned()))
            .collect();
        let lookups = names
            .iter()
            .map(|t| RESULTS.map(|r| counter!("kvtier_lookups_total", "tier" => t.clone(), "result" => r)))
            .collect();
        let tiers = secondaries
            .iter()
            .map(|t| {
                let out = format!("{primary}->{t}");
                let back = format!("{t}->{primary}");
                TierHandles {
                    bytes: [
                        counter!("kvtier_transfer_bytes_total", "path" => out.clone()),
                        counter!("kvtier_transfer_bytes_total", "path" => back.clone()),
                    ],
                    chunks: [
                        counter!("kvtier_transfer_chunks_total", "path" => out),
                        counter!("kvtier_transfer_chunks_total", "path" => back),
                    ],
                    job_seconds: [
                        histogram!("kvtier_job_duration_seconds", "tier" => t.clone(), "kind" => "store"),
                        histogram!("kvtier_job_duration_seconds", "tier" => t.clone(), "kind" => "promotion"),
                    ],
                }
            })
            .collect();
        let device = format!("device->{primary}");
        Self {
            lookups,
            tiers,
            device_store_chunks: counter!("kvtier_transfer_chunks_total", "path" => device.clone()),
            device_store_bytes: counter!("kvtier_transfer_bytes_total", "path" => device),
            lock_wait: [
                histogram!("kvtier_lock_wait_seconds", "holder" => "step"),
                histogram!("kvtier_lock_wait_seconds", "holder" => "control"),
            ],
            lock_hold: [
                histogram!("kvtier_lock_hold_seconds", "holder" => "step"),
                histogram!("kvtier_lock_hold_seconds", "holder" => "control"),
            ],
            starvation_warnings: counter!("kvtier_control_starvation_warnings_total"),
            last_publish: None,
        }
    }

    /// An engine lookup answered `r`; `tier` is the tier that answered (`None`: nobody had it).
    pub(crate) fn lookup(&self, r: LookupResult, tier: Option<usize>) {
        let row = tier.unwrap_or(self.lookups.len() - 1).min(self.lookups.len() - 1);
        self.lookups[row][result_index(r)].increment(1);
    }

    /// A job of secondary tier `idx` finished.
    pub(crate) fn job(&self, idx: usize, kind: JobKind, keys: usize, r: &JobResult) {
        let Some(t) = self.tiers.get(idx) else {
            return;
        };
        let k = usize::from(kind == JobKind::Promotion);
        t.job_seconds[k].record(r.elapsed.as_secs_f64());
        t.bytes[k].increment(r.bytes);
        let moved = match &r.outcome {
            crate::job::JobOutcome::Ok => keys,
            crate::job::JobOutcome::Failed => 0,
            crate::job::JobOutcome::Partial(ok) => ok.len(),
        };
        t.chunks[k].increment(moved as u64);
    }

    /// Device→primary stores completed successfully.
    pub(crate) fn device_stores(&self, chunks: usize, chunk_bytes: usize) {
        self.device_store_chunks.increment(chunks as u64);
        self.device_store_bytes.increment((chunks * chunk_bytes) as u64);
    }

    pub(crate) fn lock(&self, holder: Holder, wait: Duration, hold: Duration) {
        self.lock_wait[holder as usize].record(wait.as_secs_f64());
        self.lock_hold[holder as usize].record(hold.as_secs_f64());
    }

    pub(crate) fn starved(&self) {
        self.starvation_warnings.increment(1);
    }

    /// Whether a stats publication is due (at most once a second).
    pub(crate) fn publish_due(&mut self) -> bool {
        let now = Instant::now();
        if self
            .last_publish
            .is_some_and(|t| now.duration_since(t) < PUBLISH_EVERY)
        {
            return false;
        }
        self.last_publish = Some(now);
        true
    }
}

/// Publishes every tier's and the manager's counters and gauges.
pub(crate) fn publish(stats: &ManagerStats) {
    for t in std::iter::once(&stats.primary).chain(&stats.secondaries) {
        let tier = t.name.clone();
        counter!("kvtier_tier_hits_total", "tier" => tier.clone()).absolute(t.hits);
        counter!("kvtier_tier_misses_total", "tier" => tier.clone()).absolute(t.misses);
        counter!("kvtier_tier_stores_chunks_total", "tier" => tier.clone()).absolute(t.stores);
        counter!("kvtier_tier_loads_chunks_total", "tier" => tier.clone()).absolute(t.loads);
        counter!("kvtier_tier_evictions_total", "tier" => tier.clone()).absolute(t.evictions);
        counter!("kvtier_tier_failures_total", "tier" => tier.clone()).absolute(t.failures);
        counter!("kvtier_tier_written_bytes_total", "tier" => tier.clone()).absolute(t.bytes_written);
        counter!("kvtier_tier_read_bytes_total", "tier" => tier.clone()).absolute(t.bytes_read);
        gauge!("kvtier_tier_resident_chunks", "tier" => tier.clone()).set(t.resident_chunks as f64);
        gauge!("kvtier_tier_capacity_chunks", "tier" => tier.clone()).set(t.capacity_chunks as f64);
        for (name, v) in &t.extra {
            let metric: String = name
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() {
                        c.to_ascii_lowercase()
                    } else {
                        '_'
                    }
                })
                .collect();
            gauge!(format!("kvtier_tier_{metric}"), "tier" => tier.clone()).set(*v);
        }
    }
    let m = &stats.manager;
    for (name, v) in [
        ("promotion_jobs", m.promotion_jobs),
        ("promoted_keys", m.promoted_keys),
        ("failed_promotion_keys", m.failed_promotion_keys),
        ("promotion_alloc_failures", m.promotion_alloc_failures),
        ("cascade_jobs", m.cascade_jobs),
        ("peer_store_jobs", m.peer_store_jobs),
        ("off_step_store_completions", m.off_step_store_completions),
        ("duplicate_store_reports", m.duplicate_store_reports),
        ("store_report_conflicts", m.store_report_conflicts),
        ("worker_lost_store_keys", m.worker_lost_store_keys),
        ("completion_messages_rejected", m.completion_messages_rejected),
        ("tiers_quarantined", m.tiers_quarantined),
        ("control_failures", m.control_failures),
        ("control_sweeps", m.sweeps),
    ] {
        counter!(format!("kvtier_{name}_total")).absolute(v);
    }
    gauge!("kvtier_jobs_in_flight").set(stats.jobs_in_flight as f64);
    publish_gates(&stats.gates);
    publish_decisions(&stats.decisions);
}

/// Admission and backpressure figures per secondary tier.
fn publish_gates(gates: &[crate::stats::TierGateStats]) {
    for g in gates {
        let tier = g.tier.clone();
        counter!("kvtier_admission_rejections_total", "tier" => tier.clone())
            .absolute(g.admission_rejections);
        counter!("kvtier_admission_late_admissions_total", "tier" => tier.clone())
            .absolute(g.late_admissions);
        counter!("kvtier_backpressure_dropped_jobs_total", "tier" => tier.clone())
            .absolute(g.backpressure_dropped_jobs);
        counter!("kvtier_backpressure_dropped_chunks_total", "tier" => tier.clone())
            .absolute(g.backpressure_dropped_chunks);
        counter!("kvtier_backpressure_probes_total", "tier" => tier.clone()).absolute(g.backpressure_probes);
        counter!("kvtier_backpressure_activations_total", "tier" => tier.clone())
            .absolute(g.backpressure_activations);
        gauge!("kvtier_backpressure_active", "tier" => tier.clone())
            .set(f64::from(u8::from(g.backpressure_active)));
        if let Some(ema) = g.store_seconds_per_mib {
            gauge!("kvtier_cascade_store_seconds_per_mib", "tier" => tier).set(ema);
        }
    }
}

/// Load-versus-recompute decisions per secondary tier (see `super::cost`).
fn publish_decisions(decisions: &[crate::stats::PromotionDecisions]) {
    for d in decisions {
        let tier = d.name.clone();
        counter!("kvtier_promotions_started_total", "tier" => tier.clone()).absolute(d.started);
        counter!("kvtier_promotions_landed_total", "tier" => tier.clone()).absolute(d.promoted);
        counter!("kvtier_promotions_declined_by_cost_total", "tier" => tier.clone())
            .absolute(d.declined_by_cost);
        counter!("kvtier_promotions_abandoned_by_deadline_total", "tier" => tier.clone())
            .absolute(d.abandoned_by_deadline);
        counter!("kvtier_promotion_probes_total", "tier" => tier.clone()).absolute(d.probes);
        counter!("kvtier_retries_declined_by_cost_total", "tier" => tier.clone())
            .absolute(d.retries_declined_by_cost);
        if let Some(v) = d.load_fixed_secs {
            gauge!("kvtier_promotion_load_fixed_seconds", "tier" => tier.clone()).set(v);
        }
        if let Some(v) = d.load_secs_per_mib {
            gauge!("kvtier_promotion_load_seconds_per_mib", "tier" => tier).set(v);
        }
    }
}

/// Handles that record nothing, with the facade's names, for builds without the `metrics`
/// feature. The macros still evaluate their arguments, so the code around them reads the same in
/// both builds.
#[cfg(not(feature = "metrics"))]
mod off {
    /// A counter that counts nothing.
    #[derive(Clone, Copy)]
    pub(super) struct Counter;

    impl Counter {
        pub(super) fn increment(&self, _: u64) {}
        pub(super) fn absolute(&self, _: u64) {}
    }

    /// A histogram or gauge that records nothing.
    #[derive(Clone, Copy)]
    pub(super) struct Histogram;

    impl Histogram {
        pub(super) fn record(&self, _: f64) {}
        pub(super) fn set(&self, _: f64) {}
    }

    macro_rules! counter {
        ($name:expr $(, $k:expr => $v:expr)* $(,)?) => {{
            let _ = ($name $(, ($k, $v))*);
            off::Counter
        }};
    }

    macro_rules! histogram {
        ($name:expr $(, $k:expr => $v:expr)* $(,)?) => {{
            let _ = ($name $(, ($k, $v))*);
            off::Histogram
        }};
    }

    pub(super) use counter;
    pub(super) use histogram;
    pub(super) use histogram as gauge;
}
