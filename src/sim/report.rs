//! The report of a simulation: a table for people (`Display`) and JSON for machines
//! (`serde::Serialize`).

use std::fmt;

use serde::Serialize;
use tiering_core::{ManagerCounters, ManagerStats, PromotionDecisions, TierStats};

use super::config::SimConfig;
use super::metrics::{RunMetrics, quantile};
use super::offload::{EventCounts, LookupCounts};

/// Everything a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// What ran.
    pub workload: String,
    /// The chain: primary tier first, then the secondaries in lookup order.
    pub chain: Vec<String>,
    /// Whether the manager's control-plane thread ran.
    pub control_thread: bool,
    /// Requests completed.
    pub requests: u64,
    /// Prompt tokens over every request.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Where prompt tokens came from (device cache, each tier) or that they were computed.
    pub sources: Vec<SourceRow>,
    /// The same workload with offloading off, when it was run.
    pub baseline: Option<Baseline>,
    /// Prompt tokens the baseline computed and the offloading run did not.
    pub tokens_not_recomputed: Option<i64>,
    /// Chunks and bytes per copy path.
    pub paths: Vec<PathRow>,
    /// Manager time on the scheduler thread per step, in microseconds.
    pub manager_step_us: Percentiles,
    /// Time-to-first-token proxy (arrival → end of the prefill step on the simulated clock:
    /// the scheduler thread's CPU time plus modelled model time per step), in milliseconds.
    pub ttft_ms: Percentiles,
    /// Lookup verdicts the engine received.
    pub lookups: LookupCounts,
    /// Requests deferred by a pending or unknown lookup, counted per step.
    pub deferrals: u64,
    /// Times a request stopped waiting and recomputed instead, because waiting longer would
    /// cost more than recomputing (only when the engine weighs the two).
    pub waits_given_up: u64,
    /// Keys in the KV-cache events the engine drained.
    pub events: EventCounts,
    /// Device-copy jobs.
    pub copy_jobs: CopyJobs,
    /// `prepare_store` calls the primary could not serve (retried), and chunks given up.
    pub store_alloc_failures: u64,
    /// Chunks never offloaded because their request finished with the primary full.
    pub store_chunks_dropped: u64,
    /// Orchestrator counters.
    pub manager: ManagerCounters,
    /// Per-tier counters at the end of the run.
    pub tiers: Vec<TierStats>,
    /// Consistency identities; every one must hold.
    pub identities: Vec<Identity>,
    /// Steps, wall time, simulated time, modelled model time.
    pub timing: Timing,
    /// The engine settings.
    pub config: SimConfig,
    /// Load-versus-recompute decisions per secondary tier (promotions started, landed, declined
    /// by cost, abandoned at their deadline) and each tier's fitted load cost.
    pub decisions: Vec<PromotionDecisions>,
}

/// One source of prompt tokens.
#[derive(Clone, Debug, Serialize)]
pub struct SourceRow {
    /// `device cache`, a tier name, or `computed`.
    pub source: String,
    /// Prompt tokens.
    pub tokens: u64,
    /// Share of all prompt tokens.
    pub rate: f64,
}

/// The offloading-off run.
#[derive(Clone, Debug, Serialize)]
pub struct Baseline {
    /// Prompt tokens served by the device prefix cache.
    pub device_tokens: u64,
    /// Prompt tokens computed.
    pub computed_tokens: u64,
    /// Time to first token, in milliseconds.
    pub ttft_ms: Percentiles,
    /// Wall time in seconds.
    pub wall_s: f64,
}

/// One copy path.
#[derive(Clone, Debug, Serialize)]
pub struct PathRow {
    /// `device→cpu`, `cpu→disk`, …
    pub path: String,
    /// Chunks moved.
    pub chunks: u64,
    /// Bytes moved.
    pub bytes: u64,
}

/// Sample quantiles.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Percentiles {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl Percentiles {
    /// The quantiles of `samples`.
    #[must_use]
    pub fn of(samples: &[f64]) -> Self {
        Self {
            count: samples.len(),
            p50: quantile(samples, 0.5),
            p99: quantile(samples, 0.99),
            max: samples.iter().copied().fold(0.0, f64::max),
        }
    }
}

/// Device-copy job accounting.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CopyJobs {
    /// Submitted to the worker.
    pub submitted: u64,
    /// Completions the engine applied.
    pub completed: u64,
    /// Failed jobs.
    pub failed: u64,
    /// Loaded chunks whose bytes did not match what was stored.
    pub corrupt_chunks: u64,
    /// Loads that failed (their chunks were recomputed).
    pub failed_load_chunks: u64,
}

/// A consistency identity: two independently counted figures that must be equal.
#[derive(Clone, Debug, Serialize)]
pub struct Identity {
    /// What is compared.
    pub name: String,
    /// Left side.
    pub left: u64,
    /// Right side.
    pub right: u64,
    /// Whether they are equal.
    pub holds: bool,
}

impl Identity {
    fn new(name: impl Into<String>, left: u64, right: u64) -> Self {
        Self {
            name: name.into(),
            left,
            right,
            holds: left == right,
        }
    }
}

/// Time figures.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Timing {
    /// Scheduler steps of the offloading run.
    pub steps: u64,
    /// Wall time of the offloading run, seconds.
    pub wall_s: f64,
    /// Simulated time (scheduler CPU time plus modelled model time per step, plus skipped idle
    /// gaps), seconds.
    pub simulated_s: f64,
    /// Modelled model-execution time, seconds.
    pub model_s: f64,
}

impl Report {
    /// The load-versus-recompute section: the recompute cost the manager was given and, per
    /// secondary tier, what it decided.
    fn fmt_decisions(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.decisions.is_empty() {
            return Ok(());
        }
        let c = &self.config;
        writeln!(f, "\npromotions versus recompute")?;
        match (&c.model, c.manager_recompute_cost()) {
            (Some(m), Some(r)) => writeln!(
                f,
                "  model {} on {}: {:.0} prefill tokens/s, {} KiB KV per token → {:.1} ns per simulated token, {:.2} µs per chunk",
                m.name,
                m.gpu,
                m.prefill_tokens_per_sec(),
                m.kv_bytes_per_token() >> 10,
                r.per_token().as_secs_f64() * 1e9,
                r.per_chunk().as_secs_f64() * 1e6
            )?,
            (None, Some(r)) => writeln!(
                f,
                "  recompute cost {:.1} ns per token, {:.2} µs per chunk",
                r.per_token().as_secs_f64() * 1e9,
                r.per_chunk().as_secs_f64() * 1e6
            )?,
            _ => writeln!(
                f,
                "  no recompute cost given: every secondary hit is promoted and waited for"
            )?,
        }
        writeln!(
            f,
            "  {:<22} {:>10} {:>10} {:>10} {:>10}  fitted load cost",
            "tier", "started", "promoted", "declined", "abandoned"
        )?;
        for d in &self.decisions {
            let fitted = match (d.load_fixed_secs, d.load_secs_per_mib) {
                (Some(fixed), Some(per_mib)) => format!(
                    "{:.1} µs + {:.1} µs/MiB of backlog ({} samples, {} probes)",
                    fixed * 1e6,
                    per_mib * 1e6,
                    d.samples,
                    d.probes
                ),
                _ => "not measured".to_owned(),
            };
            writeln!(
                f,
                "  {:<22} {:>10} {:>10} {:>10} {:>10}  {fitted}",
                d.name, d.started, d.promoted, d.declined_by_cost, d.abandoned_by_deadline
            )?;
            if let (Some(rate), Some(secs)) = (d.retry_hit_rate, d.retry_answer_secs) {
                writeln!(
                    f,
                    "  {:<22} `Retry` answers: {:.0} % hits after {:.1} µs ({} samples); {} waits declined, {} rechecks",
                    "",
                    rate * 100.0,
                    secs * 1e6,
                    d.retry_samples,
                    d.retries_declined_by_cost,
                    d.retry_rechecks
                )?;
            }
        }
        Ok(())
    }

    /// Whether every identity holds.
    #[must_use]
    pub fn identities_hold(&self) -> bool {
        self.identities.iter().all(|i| i.holds)
    }

    /// Tokens served by the source named `name` (`device cache`, a tier name, `computed`).
    #[must_use]
    pub fn source_tokens(&self, name: &str) -> u64 {
        self.sources
            .iter()
            .find(|s| s.source == name)
            .map_or(0, |s| s.tokens)
    }

    /// Builds the report from the offloading run, the manager's final stats and the baseline.
    #[must_use]
    pub(crate) fn build(
        workload: String,
        cfg: &SimConfig,
        m: &RunMetrics,
        stats: &ManagerStats,
        control_thread: bool,
        baseline: Option<&RunMetrics>,
    ) -> Self {
        let chunk = cfg.chunk_bytes as u64;
        let rate = |t: u64| {
            if m.prompt_tokens == 0 {
                0.0
            } else {
                t as f64 / m.prompt_tokens as f64
            }
        };
        let mut sources = vec![
            SourceRow {
                source: "device cache".into(),
                tokens: m.device_tokens,
                rate: rate(m.device_tokens),
            },
            SourceRow {
                source: stats.primary.name.clone(),
                tokens: m.primary_tokens,
                rate: rate(m.primary_tokens),
            },
        ];
        for (i, t) in stats.secondaries.iter().enumerate() {
            let tokens = m.secondary_tokens.get(i).copied().unwrap_or(0);
            sources.push(SourceRow {
                source: t.name.clone(),
                tokens,
                rate: rate(tokens),
            });
        }
        sources.push(SourceRow {
            source: "computed".into(),
            tokens: m.computed_tokens,
            rate: rate(m.computed_tokens),
        });

        let p = &stats.primary.name;
        let mut paths = vec![
            PathRow {
                path: format!("device→{p}"),
                chunks: m.store_chunks,
                bytes: m.bytes_device_to_primary,
            },
            PathRow {
                path: format!("{p}→device"),
                chunks: m.load_chunks,
                bytes: m.bytes_primary_to_device,
            },
        ];
        let mut identities = vec![
            Identity::new(
                "prompt tokens = served (device + tiers) + computed",
                m.prompt_tokens,
                m.served_tokens() + m.computed_tokens,
            ),
            Identity::new(
                "engine lookups (hit + pending + retry + miss) = primary hits + misses",
                m.lookups.total(),
                m.primary_lookups,
            ),
            Identity::new(
                format!("device→{p} bytes = chunks × chunk size"),
                m.bytes_device_to_primary,
                m.store_chunks * chunk,
            ),
            Identity::new(
                format!("{p}→device bytes = chunks × chunk size"),
                m.bytes_primary_to_device,
                m.load_chunks * chunk,
            ),
        ];
        for t in &stats.secondaries {
            paths.push(PathRow {
                path: format!("{p}→{}", t.name),
                chunks: t.stores,
                bytes: t.bytes_written,
            });
            paths.push(PathRow {
                path: format!("{}→{p}", t.name),
                chunks: t.loads,
                bytes: t.bytes_read,
            });
            identities.push(Identity::new(
                format!("{p}→{} bytes = chunks × chunk size", t.name),
                t.bytes_written,
                t.stores * chunk,
            ));
            identities.push(Identity::new(
                format!("{}→{p} bytes = chunks × chunk size", t.name),
                t.bytes_read,
                t.loads * chunk,
            ));
        }
        identities.push(Identity::new(
            "device-copy jobs completed = submitted",
            m.copy_jobs_completed,
            m.copy_jobs_submitted,
        ));
        identities.push(Identity::new(
            "device blocks referenced after the run = 0",
            m.leaked_device_blocks,
            0,
        ));
        identities.push(Identity::new(
            "arena rows granted after the run = 0",
            m.leaked_arena_rows,
            0,
        ));

        let ms = |v: &[f64]| Percentiles::of(&v.iter().map(|s| s * 1e3).collect::<Vec<_>>());
        let step_us: Vec<f64> = m.step_manager.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        Self {
            workload,
            chain: std::iter::once(stats.primary.name.clone())
                .chain(stats.secondaries.iter().map(|t| t.name.clone()))
                .collect(),
            control_thread,
            requests: m.requests,
            prompt_tokens: m.prompt_tokens,
            output_tokens: m.output_tokens,
            sources,
            baseline: baseline.map(|b| Baseline {
                device_tokens: b.device_tokens,
                computed_tokens: b.computed_tokens,
                ttft_ms: ms(&b.ttft),
                wall_s: b.wall.as_secs_f64(),
            }),
            tokens_not_recomputed: baseline.map(|b| {
                i64::try_from(b.computed_tokens).unwrap_or(i64::MAX)
                    - i64::try_from(m.computed_tokens).unwrap_or(i64::MAX)
            }),
            paths,
            manager_step_us: Percentiles::of(&step_us),
            ttft_ms: ms(&m.ttft),
            lookups: m.lookups,
            deferrals: m.deferrals,
            waits_given_up: m.waits_given_up,
            events: m.events,
            copy_jobs: CopyJobs {
                submitted: m.copy_jobs_submitted,
                completed: m.copy_jobs_completed,
                failed: m.copy_jobs_failed,
                corrupt_chunks: m.corrupt_chunks,
                failed_load_chunks: m.load_chunks_failed,
            },
            store_alloc_failures: m.store_alloc_failures,
            store_chunks_dropped: m.store_chunks_dropped,
            manager: stats.manager.clone(),
            tiers: std::iter::once(&stats.primary)
                .chain(&stats.secondaries)
                .cloned()
                .collect(),
            identities,
            timing: Timing {
                steps: m.steps,
                wall_s: m.wall.as_secs_f64(),
                simulated_s: m.simulated,
                model_s: m.model_time.as_secs_f64(),
            },
            config: cfg.clone(),
            decisions: stats.decisions.clone(),
        }
    }
}

fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvtier run — workload {}, chain {}",
            self.workload,
            self.chain.join(" → ")
        )?;
        writeln!(
            f,
            "  {} requests, {} prompt tokens, {} generated; control-plane thread: {}",
            self.requests,
            self.prompt_tokens,
            self.output_tokens,
            if self.control_thread { "on" } else { "off" }
        )?;
        writeln!(f, "\nprompt tokens by source")?;
        for s in &self.sources {
            writeln!(f, "  {:<22} {:>12} {:>7.1}%", s.source, s.tokens, s.rate * 100.0)?;
        }
        if let (Some(b), Some(saved)) = (&self.baseline, self.tokens_not_recomputed) {
            let computed = self.source_tokens("computed");
            writeln!(f, "\nversus offloading off (same workload, same run)")?;
            writeln!(
                f,
                "  {:<22} {:>12} (device cache {})",
                "computed, offload off", b.computed_tokens, b.device_tokens
            )?;
            writeln!(f, "  {:<22} {:>12}", "computed, offload on", computed)?;
            let pct = if b.computed_tokens == 0 {
                0.0
            } else {
                saved as f64 * 100.0 / b.computed_tokens as f64
            };
            writeln!(
                f,
                "  {:<22} {:>12} ({pct:.1}% of the baseline's prefill)",
                "tokens not recomputed", saved
            )?;
            writeln!(
                f,
                "  {:<22} p50 {:>8.2} ms  p99 {:>8.2} ms   (offload off: p50 {:.2} ms, p99 {:.2} ms)",
                "time to first token", self.ttft_ms.p50, self.ttft_ms.p99, b.ttft_ms.p50, b.ttft_ms.p99
            )?;
        } else {
            writeln!(
                f,
                "\n  time to first token    p50 {:>8.2} ms  p99 {:>8.2} ms",
                self.ttft_ms.p50, self.ttft_ms.p99
            )?;
        }
        self.fmt_decisions(f)?;
        writeln!(f, "\nbytes per path")?;
        for p in &self.paths {
            writeln!(
                f,
                "  {:<22} {:>10} chunks {:>12}",
                p.path,
                p.chunks,
                bytes(p.bytes)
            )?;
        }
        writeln!(f, "\nscheduler thread")?;
        writeln!(
            f,
            "  manager time per step  p50 {:.1} µs  p99 {:.1} µs  max {:.1} µs  over {} steps",
            self.manager_step_us.p50,
            self.manager_step_us.p99,
            self.manager_step_us.max,
            self.manager_step_us.count
        )?;
        let l = &self.lookups;
        writeln!(
            f,
            "  lookups {} (hit {}, pending {}, retry {}, miss {}); deferrals {} ({} waits given up for \
             recompute); events: {} keys stored, {} removed",
            l.total(),
            l.hit,
            l.hit_pending,
            l.retry,
            l.miss,
            self.deferrals,
            self.waits_given_up,
            self.events.stored,
            self.events.removed
        )?;
        let m = &self.manager;
        writeln!(
            f,
            "  promotions {} jobs / {} keys ({} failed, {} refused for room); cascades {} jobs; sweeps {}",
            m.promotion_jobs,
            m.promoted_keys,
            m.failed_promotion_keys,
            m.promotion_alloc_failures,
            m.cascade_jobs,
            m.sweeps
        )?;
        let c = &self.copy_jobs;
        writeln!(
            f,
            "  device copies {} submitted, {} completed, {} failed, {} corrupt chunks; store refusals {}, chunks dropped {}",
            c.submitted,
            c.completed,
            c.failed,
            c.corrupt_chunks,
            self.store_alloc_failures,
            self.store_chunks_dropped
        )?;
        writeln!(f, "\ntiers")?;
        writeln!(
            f,
            "  {:<14} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11}",
            "tier", "hits", "misses", "stores", "loads", "evicted", "resident"
        )?;
        for t in &self.tiers {
            writeln!(
                f,
                "  {:<14} {:>9} {:>9} {:>9} {:>9} {:>9} {:>5}/{:<5}",
                t.name,
                t.hits,
                t.misses,
                t.stores,
                t.loads,
                t.evictions,
                t.resident_chunks,
                t.capacity_chunks
            )?;
        }
        writeln!(f, "\nhealth")?;
        for line in super::health::health_lines(&self.manager, self.store_alloc_failures, &self.tiers) {
            writeln!(f, "{line}")?;
        }
        writeln!(f, "\nconsistency")?;
        for i in &self.identities {
            writeln!(
                f,
                "  [{}] {}: {} = {}",
                if i.holds { "ok" } else { "FAILED" },
                i.name,
                i.left,
                i.right
            )?;
        }
        let t = &self.timing;
        write!(
            f,
            "\n{} steps in {:.2} s wall ({:.2} s simulated, {:.2} s modelled model time)",
            t.steps, t.wall_s, t.simulated_s, t.model_s
        )?;
        if let Some(b) = &self.baseline {
            write!(f, "; baseline {:.2} s wall", b.wall_s)?;
        }
        writeln!(f)
    }
}
