//! Measured I/O cost per direction (loads and stores): what is queued, and exponentially
//! weighted averages of how long the I/O calls took per MiB and how long runs waited in the
//! queue. The manager can weigh a promotion against recomputing with these.

use std::time::Duration;

/// Weight of the newest sample in the moving averages.
const EMA_WEIGHT: f64 = 0.125;

const MIB: f64 = 1024.0 * 1024.0;

/// The measured cost of one direction of I/O.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DirectionCost {
    /// Chunks queued, not yet picked up by an I/O thread.
    pub queued_chunks: u64,
    /// Bytes of those chunks.
    pub queued_bytes: u64,
    /// Chunks being read or written right now.
    pub in_flight_chunks: u64,
    /// Moving average of the I/O call's duration per MiB moved (seconds per MiB), measured
    /// per submission (one `preadv`/`pwritev` of one or more consecutive slots, plus its
    /// `fdatasync` under `sync = "always"`); `None` before the first one.
    pub secs_per_mib: Option<f64>,
    /// Moving average of how long a submission waited in the queue (seconds).
    pub queue_wait_secs: Option<f64>,
    /// Submissions measured so far.
    pub samples: u64,
}

impl DirectionCost {
    /// The measured throughput in MiB per second (the inverse of [`secs_per_mib`](Self::secs_per_mib)).
    #[must_use]
    pub fn mib_per_sec(&self) -> Option<f64> {
        self.secs_per_mib.filter(|s| *s > 0.0).map(|s| 1.0 / s)
    }

    /// A rough time until `bytes` more would be done in this direction with `threads` I/O
    /// threads: the queue ahead plus the new bytes at the measured rate. `None` before any
    /// measurement.
    #[must_use]
    pub fn expected_secs(&self, bytes: u64, threads: usize) -> Option<f64> {
        let per_mib = self.secs_per_mib?;
        let ahead = (self.queued_bytes + bytes) as f64 / MIB;
        Some(ahead * per_mib / threads.max(1) as f64)
    }

    pub(crate) fn record(&mut self, bytes: u64, took: Duration, waited: Duration) {
        if bytes == 0 {
            return;
        }
        let per_mib = took.as_secs_f64() / (bytes as f64 / MIB);
        let wait = waited.as_secs_f64();
        self.secs_per_mib = Some(ema(self.secs_per_mib, per_mib));
        self.queue_wait_secs = Some(ema(self.queue_wait_secs, wait));
        self.samples += 1;
    }
}

fn ema(old: Option<f64>, sample: f64) -> f64 {
    old.map_or(sample, |o| o + EMA_WEIGHT * (sample - o))
}

/// The measured cost of loads and stores on one disk tier; see [`DiskTier::io_cost`](crate::DiskTier::io_cost).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct IoCost {
    /// Promotions (slot → primary row).
    pub loads: DirectionCost,
    /// Stores (primary row → slot).
    pub stores: DirectionCost,
    /// I/O threads serving both queues.
    pub io_threads: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_average_starts_at_the_first_sample_and_moves_toward_new_ones() {
        let mut d = DirectionCost::default();
        assert_eq!(d.mib_per_sec(), None);
        assert_eq!(d.expected_secs(1 << 20, 1), None);
        d.record(1 << 20, Duration::from_millis(10), Duration::ZERO);
        assert!((d.secs_per_mib.unwrap() - 0.01).abs() < 1e-9);
        assert!((d.mib_per_sec().unwrap() - 100.0).abs() < 1e-6);
        d.record(2 << 20, Duration::from_millis(100), Duration::from_millis(8));
        let s = d.secs_per_mib.unwrap();
        assert!(s > 0.01 && s < 0.05, "moved toward 0.05 s/MiB: {s}");
        assert_eq!(d.samples, 2);
        d.queued_bytes = 3 << 20;
        let e = d.expected_secs(1 << 20, 2).unwrap();
        assert!((e - 4.0 * s / 2.0).abs() < 1e-12);
        d.record(0, Duration::from_secs(1), Duration::ZERO);
        assert_eq!(d.samples, 2, "an empty submission is not a sample");
    }
}
