//! The simulated engine's geometry and cost model.

use std::time::Duration;

use serde::Serialize;

use super::error::SimError;

/// How the simulated engine is shaped and how long its model takes.
///
/// The defaults are a scaled-down engine (16-token chunks of 16 KiB, a 1536-block device pool)
/// whose default `chat` run finishes in seconds while still overflowing the device pool many
/// times over, so offloading matters.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimConfig {
    /// Tokens per chunk (one device block holds one chunk).
    pub tokens_per_chunk: usize,
    /// Bytes of KV data per chunk (the primary tier's `chunk_bytes`).
    pub chunk_bytes: usize,
    /// Device KV pool size in blocks (one chunk each). Smaller than the working set.
    pub device_blocks: usize,
    /// Most requests running (prefilling, decoding or waiting for a load) at once.
    pub max_running: usize,
    /// Prefill tokens the model processes in one step (a single larger request still runs
    /// alone, so nothing starves).
    pub max_batch_tokens: usize,
    /// Fixed model time per step.
    #[serde(serialize_with = "ser_duration_us")]
    pub step_base: Duration,
    /// Model time per prefill token.
    #[serde(serialize_with = "ser_duration_us")]
    pub prefill_per_token: Duration,
    /// Model time per decoding request per step.
    #[serde(serialize_with = "ser_duration_us")]
    pub decode_per_request: Duration,
    /// Bandwidth of the device link each way (device copies), bytes per second. A copy is done
    /// on the simulated clock after its transfer, behind the copies before it in the same
    /// direction; a step that loads chunks lasts at least their transfer time (the loads
    /// overlap the forward pass). Applied to the simulator's scaled-down chunk bytes as is, so
    /// that, like `prefill_per_token` under a model profile, it keeps the real time per KV
    /// byte.
    pub device_link_bandwidth: f64,
    /// The factor the scheduler thread's measured CPU time is charged with on the simulated
    /// clock. 1 by default; a model profile sets it to the simulator's KV bytes per token over
    /// the real model's, the factor the profile shrinks model time by: the scheduler's work
    /// (the manager's calls, per chunk and per step) does not shrink with the scaled-down KV
    /// bytes, so charging it unscaled would weigh it against model time over a hundred times
    /// more than on the real engine.
    pub scheduler_time_scale: f64,
    /// Schedule step k+1 while step k's model runs, as vLLM does by default since 0.14
    /// (`--async-scheduling`): a step's model starts once its scheduling and the previous
    /// model are both done, so scheduling costs time only when it outlasts the model step (or
    /// the device was idle); a request arriving while a step is being scheduled joins the one
    /// after. `false` models a synchronous engine: scheduling, then the model, in turn.
    pub async_scheduling: bool,
    /// Also run the workload with offloading off, in the same invocation, to count the tokens
    /// offloading saved.
    pub compare_baseline: bool,
    /// Check every chunk loaded back into the device against the content the model wrote.
    pub verify_loads: bool,
    /// Show a progress bar (only when stderr is a terminal).
    pub progress: bool,
    /// How long to wait, once every request is done, for the tiers to finish their jobs.
    #[serde(serialize_with = "ser_duration_us")]
    pub drain_timeout: Duration,
    /// The model profile `prefill_per_token` was derived from (`--model`), if any.
    pub model: Option<super::profile::ModelProfile>,
    /// Give the manager the engine's recompute cost (`prefill_per_token` × `tokens_per_chunk`
    /// per chunk), so it promotes only what loads faster than it recomputes.
    pub recompute_cost: bool,
    /// A peer (`HOST:PORT`, its p2p `bind` address) every request names as its
    /// `remote_kv_source`, so a `p2p` tier probes that peer for the chunks the request misses
    /// locally (`kvtier soak` runs two nodes this way). `None`: requests carry no parameters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_kv_source: Option<String>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            tokens_per_chunk: 16,
            chunk_bytes: 16 * 1024,
            device_blocks: 1536,
            max_running: 8,
            max_batch_tokens: 8192,
            step_base: Duration::from_micros(100),
            prefill_per_token: Duration::from_micros(2),
            decode_per_request: Duration::from_micros(10),
            // A PCIe Gen4 x16 link's practical host-to-device rate (an H100's Gen5 link is
            // about twice as fast): the cautious figure.
            device_link_bandwidth: 25e9,
            scheduler_time_scale: 1.0,
            async_scheduling: true,
            compare_baseline: true,
            verify_loads: true,
            progress: true,
            drain_timeout: Duration::from_secs(30),
            model: None,
            recompute_cost: false,
            remote_kv_source: None,
        }
    }
}

impl SimConfig {
    /// Checks every setting.
    ///
    /// # Errors
    /// The first setting out of range, by name.
    pub fn validate(&self) -> Result<(), SimError> {
        let positive = [
            ("tokens_per_chunk", self.tokens_per_chunk),
            ("chunk_bytes", self.chunk_bytes),
            ("device_blocks", self.device_blocks),
            ("max_running", self.max_running),
            ("max_batch_tokens", self.max_batch_tokens),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(SimError::InvalidSetting {
                    name,
                    reason: "must be greater than zero".into(),
                });
            }
        }
        if u32::try_from(self.device_blocks).is_err() {
            return Err(SimError::InvalidSetting {
                name: "device_blocks",
                reason: format!("{} does not fit in 32 bits", self.device_blocks),
            });
        }
        if !(self.scheduler_time_scale.is_finite() && self.scheduler_time_scale > 0.0) {
            return Err(SimError::InvalidSetting {
                name: "scheduler_time_scale",
                reason: format!("must be a positive number, found {}", self.scheduler_time_scale),
            });
        }
        if !(self.device_link_bandwidth.is_finite() && self.device_link_bandwidth > 0.0) {
            return Err(SimError::InvalidSetting {
                name: "device_link_bandwidth",
                reason: format!("must be a positive number, found {}", self.device_link_bandwidth),
            });
        }
        let pool = self.device_blocks.checked_mul(self.chunk_bytes);
        if pool.is_none_or(|b| b > (64usize << 30)) {
            return Err(SimError::InvalidSetting {
                name: "device_blocks",
                reason: format!(
                    "{} blocks of {} bytes exceed the 64 GiB the simulated device may take",
                    self.device_blocks, self.chunk_bytes
                ),
            });
        }
        Ok(())
    }

    /// Derives `prefill_per_token` from `profile` (so recompute time per KV byte matches the
    /// real model and GPU) and gives the manager that recompute cost.
    #[must_use]
    pub fn with_model(mut self, profile: super::profile::ModelProfile) -> Self {
        let per_token = self.chunk_bytes as f64 / self.tokens_per_chunk.max(1) as f64;
        self.prefill_per_token = profile.sim_prefill_per_token(per_token);
        self.scheduler_time_scale = (per_token / profile.kv_bytes_per_token() as f64).min(1.0);
        self.model = Some(profile);
        self.recompute_cost = true;
        self
    }

    /// The recompute cost the manager is given, when `recompute_cost` is set.
    #[must_use]
    pub fn manager_recompute_cost(&self) -> Option<tiering_core::RecomputeCost> {
        let tokens = u32::try_from(self.tokens_per_chunk).ok()?;
        self.recompute_cost
            .then(|| tiering_core::RecomputeCost::new(self.prefill_per_token, tokens))
    }

    /// The model time of one step.
    #[must_use]
    pub fn model_time(&self, prefill_tokens: usize, decoding: usize) -> Duration {
        let tokens = u32::try_from(prefill_tokens).unwrap_or(u32::MAX);
        let decoding = u32::try_from(decoding).unwrap_or(u32::MAX);
        self.step_base + self.prefill_per_token * tokens + self.decode_per_request * decoding
    }
}

impl SimConfig {
    /// What `cpu` of the scheduler thread's CPU time costs on the simulated clock.
    #[must_use]
    pub fn scheduler_time(&self, cpu: Duration) -> Duration {
        cpu.mul_f64(self.scheduler_time_scale)
    }

    /// The modelled transfer time of `bytes` of device copies in one direction.
    #[must_use]
    pub fn device_copy_time(&self, bytes: usize) -> Duration {
        Duration::try_from_secs_f64(bytes as f64 / self.device_link_bandwidth).unwrap_or(Duration::MAX)
    }
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `serialize_with` signature
fn ser_duration_us<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_zero_settings_are_named() {
        assert!(SimConfig::default().validate().is_ok());
        let cfg = SimConfig {
            device_blocks: 0,
            ..SimConfig::default()
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("device_blocks"), "{err}");
        let cfg = SimConfig {
            tokens_per_chunk: 0,
            ..SimConfig::default()
        };
        assert!(
            cfg.validate()
                .unwrap_err()
                .to_string()
                .contains("tokens_per_chunk")
        );
    }

    #[test]
    fn model_time_adds_the_three_costs() {
        let cfg = SimConfig {
            step_base: Duration::from_micros(100),
            prefill_per_token: Duration::from_nanos(500),
            decode_per_request: Duration::from_micros(10),
            ..SimConfig::default()
        };
        assert_eq!(cfg.model_time(0, 0), Duration::from_micros(100));
        assert_eq!(cfg.model_time(1000, 3), Duration::from_micros(100 + 500 + 30));
    }

    #[test]
    fn device_copies_take_their_bytes_over_the_bandwidth_and_a_bad_bandwidth_is_named() {
        let cfg = SimConfig {
            device_link_bandwidth: 1e9,
            ..SimConfig::default()
        };
        assert_eq!(cfg.device_copy_time(1_000_000), Duration::from_millis(1));
        assert_eq!(cfg.device_copy_time(0), Duration::ZERO);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let cfg = SimConfig {
                device_link_bandwidth: bad,
                ..SimConfig::default()
            };
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains("device_link_bandwidth"), "{err}");
        }
    }
}
