//! How a store or load job becomes pipelined batches: spread over the workers' connections,
//! but never into batches so small that a round trip's fixed cost dominates.

/// Value bytes below which a batch is not split further. A pipelined round trip costs a few
/// wake-ups (worker, server, reply) whatever it carries; measured on loopback, batches of
/// 512 KiB spread over four connections kept the server busy while each worker waited for its
/// replies, and smaller ones gained nothing.
pub(crate) const SPLIT_MIN_BYTES: u64 = 512 << 10;

/// Keys per batch for a job of `keys` values of `value_bytes` each: one batch per worker when
/// the job is large enough, at least [`SPLIT_MIN_BYTES`] per batch, at most `pipeline_bytes`
/// (and always at least one key).
pub(crate) fn keys_per_batch(keys: usize, value_bytes: u64, workers: usize, pipeline_bytes: u64) -> usize {
    let per = |bytes: u64| usize::try_from((bytes / value_bytes.max(1)).max(1)).unwrap_or(usize::MAX);
    let most = per(pipeline_bytes);
    let least = per(SPLIT_MIN_BYTES);
    keys.div_ceil(workers.max(1)).max(least).min(most).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;

    #[test]
    fn a_large_job_is_spread_over_every_worker() {
        // 32 values of 64 KiB over 4 workers: 4 batches of 8 (512 KiB each).
        assert_eq!(keys_per_batch(32, 64 * KIB, 4, 16 << 20), 8);
        // 32 values of 256 KiB: 4 batches of 8 (2 MiB each).
        assert_eq!(keys_per_batch(32, 256 * KIB, 4, 16 << 20), 8);
    }

    #[test]
    fn a_small_job_stays_one_batch() {
        // 4 values of 64 KiB (256 KiB) are below the split floor.
        assert_eq!(keys_per_batch(4, 64 * KIB, 4, 16 << 20), 8);
        assert_eq!(4usize.div_ceil(keys_per_batch(4, 64 * KIB, 4, 16 << 20)), 1);
        // 16 KiB values: 32 of them (512 KiB) are one batch.
        assert_eq!(32usize.div_ceil(keys_per_batch(32, 16 * KIB, 4, 16 << 20)), 1);
    }

    #[test]
    fn pipeline_bytes_caps_a_batch_and_one_key_always_fits() {
        assert_eq!(keys_per_batch(32, 64 * KIB, 1, 192 * KIB), 3);
        assert_eq!(keys_per_batch(32, 4 << 20, 4, 1 << 20), 1);
        assert_eq!(keys_per_batch(1, 64 * KIB, 0, 0), 1);
    }
}
