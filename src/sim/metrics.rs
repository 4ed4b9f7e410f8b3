//! What one run of the engine measured.

use std::time::Duration;

use super::offload::{EventCounts, LookupCounts, Source};

/// Raw counters and samples of one run (with or without offloading).
#[derive(Clone, Debug, Default)]
pub struct RunMetrics {
    /// Requests completed.
    pub requests: u64,
    /// Prompt tokens of every request, counted at arrival.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub output_tokens: u64,
    /// Prompt tokens found in the device prefix cache.
    pub device_tokens: u64,
    /// Prompt tokens loaded from the primary tier (already resident there).
    pub primary_tokens: u64,
    /// Prompt tokens loaded after a promotion from secondary tier `i`.
    pub secondary_tokens: Vec<u64>,
    /// Prompt tokens the model computed.
    pub computed_tokens: u64,
    /// Requests deferred by a lookup (`HitPending` or `Retry`), counted per step.
    pub deferrals: u64,
    /// Times a request stopped waiting for lookups or promotions because recomputing was
    /// cheaper than waiting longer (with `SimConfig::recompute_cost`).
    pub waits_given_up: u64,
    /// Hits a request's own scan evicted before it pinned them: a later chunk's promotion took
    /// the row of a leading primary hit (the primary's LRU victim), so those chunks were
    /// recomputed instead of loaded.
    pub hits_evicted_before_load: u64,
    /// Lookup verdicts.
    pub lookups: LookupCounts,
    /// Keys in the KV-cache events drained.
    pub events: EventCounts,
    /// Primary-tier lookups as the primary tier counted them (hits + misses).
    pub primary_lookups: u64,
    /// `prepare_store` calls that returned `None` (no room; retried).
    pub store_alloc_failures: u64,
    /// Chunks given up because the request finished while the primary had no room.
    pub store_chunks_dropped: u64,
    /// Chunks in store (device→primary) jobs that completed successfully.
    pub store_chunks: u64,
    /// Chunks in load (primary→device) jobs that completed successfully.
    pub load_chunks: u64,
    /// Chunks of failed loads (recomputed instead).
    pub load_chunks_failed: u64,
    /// Device-copy jobs submitted.
    pub copy_jobs_submitted: u64,
    /// Device-copy jobs whose completion the engine applied.
    pub copy_jobs_completed: u64,
    /// Device-copy jobs that failed.
    pub copy_jobs_failed: u64,
    /// Bytes copied device→primary by successful jobs.
    pub bytes_device_to_primary: u64,
    /// Bytes copied primary→device by successful jobs.
    pub bytes_primary_to_device: u64,
    /// Loaded chunks whose content did not match.
    pub corrupt_chunks: u64,
    /// Manager time on the scheduler thread, per step that called it.
    pub step_manager: Vec<Duration>,
    /// Time to first token per request on the simulated clock, in seconds.
    pub ttft: Vec<f64>,
    /// Scheduler steps (including the drain at the end).
    pub steps: u64,
    /// Modelled model-execution time.
    pub model_time: Duration,
    /// Wall-clock time of the run.
    pub wall: Duration,
    /// Simulated time: per step the scheduler thread's CPU time (scaled by
    /// `SimConfig::scheduler_time_scale`) plus the modelled model time, plus the idle gaps
    /// skipped between arrivals.
    pub simulated: f64,
    /// Device blocks still referenced after the run (must be 0).
    pub leaked_device_blocks: u64,
    /// Arena rows still granted after the run (must be 0).
    pub leaked_arena_rows: u64,
}

impl RunMetrics {
    /// Adds `tokens` served by `source`.
    pub fn add_served(&mut self, source: Source, tokens: u64) {
        match source {
            Source::Device => self.device_tokens += tokens,
            Source::Primary => self.primary_tokens += tokens,
            Source::Secondary(i) => {
                if self.secondary_tokens.len() <= i {
                    self.secondary_tokens.resize(i + 1, 0);
                }
                self.secondary_tokens[i] += tokens;
            }
        }
    }

    /// Tokens served without recomputation, from any source.
    #[must_use]
    pub fn served_tokens(&self) -> u64 {
        self.device_tokens + self.primary_tokens + self.secondary_tokens.iter().sum::<u64>()
    }
}

/// The `q` quantile (0..=1) of `samples` by nearest rank; 0 when empty.
#[must_use]
pub fn quantile(samples: &[f64], q: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize;
    v[rank.saturating_sub(1).min(v.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&s, 0.5), 50.0);
        assert_eq!(quantile(&s, 0.99), 99.0);
        assert_eq!(quantile(&s, 1.0), 100.0);
        assert_eq!(quantile(&[3.0], 0.5), 3.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn served_tokens_sum_every_source() {
        let mut m = RunMetrics::default();
        m.add_served(Source::Device, 16);
        m.add_served(Source::Primary, 32);
        m.add_served(Source::Secondary(1), 48);
        assert_eq!(m.secondary_tokens, vec![0, 48]);
        assert_eq!(m.served_tokens(), 96);
    }
}
