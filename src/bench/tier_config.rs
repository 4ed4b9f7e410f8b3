//! What `kvtier bench tiers` measures: the sizes and amounts of one run, and the chain's tiers
//! whose reference needs more than their name (a disk tier's I/O shape, a Redis tier's server).

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use tier_redis::RedisTierOptions;

/// What to measure.
#[derive(Clone, Debug, Serialize)]
pub struct TierBenchConfig {
    /// Bytes per chunk.
    pub chunk_bytes: usize,
    /// Chunks per job (one round moves one batch each way).
    pub batch_chunks: usize,
    /// Bytes to move per tier and direction (rounded up to whole batches).
    pub total_bytes: u64,
    /// Where the storage reference writes its scratch file (a storage tier's own directory is
    /// the fair choice).
    pub scratch_dir: PathBuf,
    /// Longest wait for one job.
    pub job_timeout: Duration,
    /// Seed for the chunk keys (fresh keys per run, so a persistent tier stores new data).
    pub seed: u64,
    /// The chain's Redis tiers, measured against a raw pipeline to the same server.
    #[serde(skip)]
    pub redis: Vec<RedisTarget>,
    /// The chain's disk tiers: their reference makes the same calls as they do.
    #[serde(skip)]
    pub disk: Vec<DiskTarget>,
}

/// A disk tier of the chain and what shapes its I/O.
#[derive(Clone, Debug)]
pub struct DiskTarget {
    /// The tier's name.
    pub name: String,
    /// Its I/O threads (calls in flight).
    pub io_threads: usize,
    /// Its slab's size: past it the tier overwrites slots, so the reference rewrites too.
    pub capacity: u64,
    /// Whether it reserves its slab with `fallocate` (the reference then reserves its file).
    pub preallocate: bool,
}

/// A Redis tier of the chain, with the options it was built from (the reference connects to
/// the same server).
#[derive(Clone, Debug)]
pub struct RedisTarget {
    /// The tier's name.
    pub name: String,
    /// Its options.
    pub options: RedisTierOptions,
}

impl Default for TierBenchConfig {
    fn default() -> Self {
        Self {
            chunk_bytes: 256 * 1024,
            batch_chunks: 32,
            total_bytes: 256 << 20,
            scratch_dir: std::env::temp_dir(),
            job_timeout: Duration::from_secs(30),
            seed: 0,
            redis: Vec::new(),
            disk: Vec::new(),
        }
    }
}
