//! Model profiles for `kvtier run --model`: what recomputing KV data costs on a real model and
//! GPU, carried over to the simulator's scaled-down chunks.
//!
//! The simulator's chunks hold far fewer KV bytes per token than a real model, so the profile
//! matches the one ratio that decides whether loading beats recomputing: prefill time per KV
//! byte. On the real pair,
//!
//! ```text
//! kv_bytes_per_token = 2 (K and V) × layers × kv_heads × head_dim × dtype_bytes
//! prefill_tokens_per_s = mfu × peak_flops / (2 × parameters)
//! secs_per_kv_byte = 1 / (prefill_tokens_per_s × kv_bytes_per_token)
//! ```
//!
//! and the simulator's model time per prompt token is `secs_per_kv_byte ×` its own KV bytes per
//! token (`chunk_bytes / tokens_per_chunk`). Tensor parallelism does not change the ratio: it
//! divides the throughput per GPU and the KV bytes per GPU alike. The figures and their sources
//! are in docs/benchmarks.md ("Model profiles in the simulator").

use std::time::Duration;

use serde::Serialize;

/// A model on a GPU, as far as recompute cost goes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ModelProfile {
    /// The name `--model` takes.
    pub name: &'static str,
    /// The GPU the throughput is for.
    pub gpu: &'static str,
    /// Parameters.
    pub parameters: f64,
    /// Transformer layers.
    pub layers: u32,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Bytes per KV element.
    pub dtype_bytes: u32,
    /// Dense peak of the GPU in the model's compute type, FLOP/s.
    pub peak_flops: f64,
    /// Model FLOP utilisation assumed for prefill.
    pub mfu: f64,
}

/// BF16 dense tensor peak of an H100 SXM (NVIDIA's datasheet: 989 TFLOPS without sparsity).
const H100_BF16: f64 = 989e12;

/// The shipped profiles.
pub const PROFILES: [ModelProfile; 2] = [
    ModelProfile {
        name: "llama-3.1-8b",
        gpu: "H100 SXM",
        parameters: 8.03e9,
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        peak_flops: H100_BF16,
        mfu: 0.5,
    },
    ModelProfile {
        name: "llama-3.1-70b",
        gpu: "H100 SXM",
        parameters: 70.6e9,
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        peak_flops: H100_BF16,
        mfu: 0.5,
    },
];

impl ModelProfile {
    /// The profile named `name`.
    ///
    /// # Errors
    /// No such profile; the message lists the known ones.
    pub fn named(name: &str) -> Result<Self, String> {
        PROFILES.iter().find(|p| p.name == name).copied().ok_or_else(|| {
            let known: Vec<&str> = PROFILES.iter().map(|p| p.name).collect();
            format!("unknown model profile `{name}` (known: {})", known.join(", "))
        })
    }

    /// KV bytes one token occupies on the real model.
    #[must_use]
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }

    /// Prefill throughput on the real GPU, tokens per second.
    #[must_use]
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.mfu * self.peak_flops / (2.0 * self.parameters)
    }

    /// Prefill time per KV byte on the real pair, seconds.
    #[must_use]
    pub fn secs_per_kv_byte(&self) -> f64 {
        1.0 / (self.prefill_tokens_per_sec() * self.kv_bytes_per_token() as f64)
    }

    /// The simulator's model time per prompt token when one of its tokens holds
    /// `sim_kv_bytes_per_token` bytes (at least 1 ns).
    #[must_use]
    pub fn sim_prefill_per_token(&self, sim_kv_bytes_per_token: f64) -> Duration {
        let secs = self.secs_per_kv_byte() * sim_kv_bytes_per_token;
        Duration::try_from_secs_f64(secs)
            .unwrap_or(Duration::ZERO)
            .max(Duration::from_nanos(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_bytes_per_token_follow_the_layer_and_head_counts() {
        let small = ModelProfile::named("llama-3.1-8b").unwrap();
        let large = ModelProfile::named("llama-3.1-70b").unwrap();
        assert_eq!(small.kv_bytes_per_token(), 128 << 10);
        assert_eq!(large.kv_bytes_per_token(), 320 << 10);
    }

    #[test]
    fn recompute_time_per_kv_byte_carries_over_to_the_simulators_chunks() {
        let p = ModelProfile::named("llama-3.1-8b").unwrap();
        // ~30.8k tokens/s at 50 % of 989 TFLOPS for 8.03 B parameters.
        let tps = p.prefill_tokens_per_sec();
        assert!((tps - 30_791.0).abs() < 10.0, "{tps}");
        // A simulated token of 1 KiB costs what 1 KiB of the real model's KV costs to recompute.
        let sim = p.sim_prefill_per_token(1024.0).as_secs_f64();
        let real_per_kib = 1024.0 / (tps * p.kv_bytes_per_token() as f64);
        assert!((sim - real_per_kib).abs() < 1e-9, "{sim} vs {real_per_kib}");
        // The larger model recomputes each KV byte more slowly: loading is worth more there.
        let large = ModelProfile::named("llama-3.1-70b").unwrap();
        assert!(large.sim_prefill_per_token(1024.0) > p.sim_prefill_per_token(1024.0));
    }

    #[test]
    fn an_unknown_profile_lists_the_known_ones() {
        let e = ModelProfile::named("gpt-9").unwrap_err();
        assert!(e.contains("llama-3.1-8b") && e.contains("llama-3.1-70b"), "{e}");
    }
}
