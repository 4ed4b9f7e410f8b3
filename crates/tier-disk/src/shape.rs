//! The shape of the tier's I/O: how a job's consecutive slots become vectored submissions and
//! how many run at once. The tier dispatches by it, and a benchmark's raw reference issues the
//! same calls, so a throughput ratio compares equal work.

use crate::format::SlabLayout;

/// Most bytes one vectored read or write moves: long enough to amortise a system call over
/// many small chunks, short enough that a long store does not hold a thread for long.
const MAX_RUN_BYTES: u64 = 1 << 20;
/// Most slots one vectored read or write covers.
const MAX_RUN_SLOTS: u64 = 64;

/// Most slots one submission covers for slots of `slot_bytes`.
#[must_use]
pub fn max_slots_per_submission(slot_bytes: u64) -> usize {
    usize::try_from((MAX_RUN_BYTES / slot_bytes.max(1)).clamp(1, MAX_RUN_SLOTS)).unwrap_or(1)
}

/// Slots per submission for a job of `keys` consecutive slots: at most `max_run`, and at most
/// `ceil(keys / io_threads)` so the job keeps every I/O thread busy.
#[must_use]
pub fn slots_per_submission(max_run: usize, keys: usize, io_threads: usize) -> usize {
    max_run.min(keys.div_ceil(io_threads.max(1))).max(1)
}

/// The calls the tier makes for one job of consecutive slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoShape {
    /// Calls in flight at once (the I/O threads).
    pub calls_in_flight: usize,
    /// Slots one call moves.
    pub slots_per_call: usize,
    /// Payload bytes per slot (the chunk).
    pub chunk_bytes: usize,
    /// Bytes per slot on disk: the payload rounded up to a block, then one seal block.
    pub slot_bytes: u64,
}

impl IoShape {
    /// The shape of a `keys`-chunk job of `chunk_bytes` chunks on a tier with `io_threads`
    /// I/O threads; `None` for a zero chunk size.
    #[must_use]
    pub fn for_job(chunk_bytes: usize, io_threads: usize, keys: usize) -> Option<Self> {
        if chunk_bytes == 0 {
            return None;
        }
        let slot_bytes = SlabLayout::slot_bytes_for(chunk_bytes)?;
        let slots_per_call = slots_per_submission(max_slots_per_submission(slot_bytes), keys, io_threads);
        Some(Self {
            calls_in_flight: io_threads.max(1).min(keys.div_ceil(slots_per_call).max(1)),
            slots_per_call,
            chunk_bytes,
            slot_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_is_spread_over_the_threads_in_runs_of_at_most_a_mebibyte() {
        // 32 chunks of 64 KiB (68 KiB slots) on 4 threads: 4 calls of 8 slots.
        let s = IoShape::for_job(64 << 10, 4, 32).unwrap();
        assert_eq!(
            (s.calls_in_flight, s.slots_per_call, s.slot_bytes),
            (4, 8, 68 << 10)
        );
        // 16 KiB chunks: 1 MiB / 20 KiB = 51 slots at most per call; 512 keys on 4 threads.
        let s = IoShape::for_job(16 << 10, 4, 512).unwrap();
        assert_eq!((s.calls_in_flight, s.slots_per_call), (4, 51));
        // One 2 MiB chunk per call; 3 keys keep 3 threads busy.
        let s = IoShape::for_job(2 << 20, 4, 3).unwrap();
        assert_eq!((s.calls_in_flight, s.slots_per_call), (3, 1));
        assert_eq!(IoShape::for_job(0, 4, 3), None);
    }

    #[test]
    fn submission_sizes_are_bounded_on_both_sides() {
        assert_eq!(max_slots_per_submission(4 << 10), 64);
        assert_eq!(max_slots_per_submission(8 << 20), 1);
        assert_eq!(slots_per_submission(64, 1, 0), 1);
        assert_eq!(slots_per_submission(8, 100, 2), 8);
    }
}
