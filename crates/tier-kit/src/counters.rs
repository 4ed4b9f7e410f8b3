//! What the kit counts for a tier's stats: jobs opened and reported, work refused, panics.
//!
//! One [`KitCounters`] is shared by a tier's ledger, queue and pool (each builder takes an
//! `Arc` of it), so one [`KitCounters::snapshot`] answers for the whole tier.

use std::sync::atomic::{AtomicU64, Ordering};

use tiering_core::JobKind;

/// The kit's cumulative counters, updated without locks.
#[derive(Debug, Default)]
pub struct KitCounters {
    submitted: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    abandoned: AtomicU64,
    panicked: AtomicU64,
    rejected: AtomicU64,
}

/// A reading of [`KitCounters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Jobs opened on the ledger ([`crate::JobLedger::open`]).
    pub submitted: u64,
    /// Job results queued for `poll_finished`, whatever their outcome.
    pub completed: u64,
    /// Of those, results whose outcome is `Failed` (every key failed).
    pub failed: u64,
    /// Of those, jobs whose ticket was dropped without a result (a panic, a lost job): the
    /// ledger reported them failed.
    pub abandoned: u64,
    /// Work items whose worker panicked (the thread went on serving).
    pub panicked: u64,
    /// Submissions a queue refused because a lane was full (flag lanes excluded).
    pub rejected: u64,
}

impl Counts {
    /// The counts as `(name, value)` pairs, for a tier's `TierStats::extra`.
    #[must_use]
    pub fn named(&self) -> [(&'static str, u64); 6] {
        [
            ("jobs_submitted", self.submitted),
            ("jobs_completed", self.completed),
            ("jobs_failed", self.failed),
            ("jobs_abandoned", self.abandoned),
            ("worker_panics", self.panicked),
            ("rejected_submissions", self.rejected),
        ]
    }
}

impl KitCounters {
    /// Counters at zero.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The current values (each read on its own: a reading taken while jobs run may be a few
    /// events apart between fields).
    #[must_use]
    pub fn snapshot(&self) -> Counts {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counts {
            submitted: get(&self.submitted),
            completed: get(&self.completed),
            failed: get(&self.failed),
            abandoned: get(&self.abandoned),
            panicked: get(&self.panicked),
            rejected: get(&self.rejected),
        }
    }

    pub(crate) fn submitted(&self) {
        self.submitted.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn completed(&self, failed: bool) {
        self.completed.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn abandoned(&self) {
        self.abandoned.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn panicked(&self) {
        self.panicked.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn rejected(&self) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
    }
}

/// One cumulative count, updated without locks from any thread (relaxed: a count orders
/// nothing).
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The count.
    #[must_use]
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The counters every tier reports in `TierStats` (hits, misses, stores, loads, evictions,
/// failures, bytes), kept by its handle and its workers.
#[derive(Debug, Default)]
pub struct TierCounters {
    /// Lookups answered `Hit`.
    pub hits: Counter,
    /// Lookups answered `Miss`.
    pub misses: Counter,
    /// Chunks stored.
    pub stores: Counter,
    /// Chunks loaded into the primary.
    pub loads: Counter,
    /// Chunks the tier evicted.
    pub evictions: Counter,
    /// Keys of jobs that failed.
    pub failures: Counter,
    /// Payload bytes stored.
    pub bytes_written: Counter,
    /// Payload bytes loaded.
    pub bytes_read: Counter,
}

impl TierCounters {
    /// Counts a finished job of `kind`: its `failed` keys into `failures`, and the `moved` keys
    /// it stored or loaded, with their payload `bytes`, into `stores` and `bytes_written` (a
    /// store) or `loads` and `bytes_read` (a promotion). A key the tier already held counts as
    /// neither. A [`crate::JobFinisher`] calls it before reporting the job, whose result is
    /// visible at once.
    pub fn count_job(&self, kind: JobKind, moved: u64, failed: u64, bytes: u64) {
        self.failures.add(failed);
        let (keys, payload) = match kind {
            JobKind::Store => (&self.stores, &self.bytes_written),
            JobKind::Promotion => (&self.loads, &self.bytes_read),
        };
        keys.add(moved);
        payload.add(bytes);
    }

    /// A tier's stats named `name` with these counters filled in and `extra` added to its
    /// `extra` map (the gauges — resident and capacity chunks — are the tier's to set).
    #[must_use]
    pub fn stats<'a>(
        &self,
        name: impl Into<String>,
        extra: impl IntoIterator<Item = (&'a str, u64)>,
    ) -> tiering_core::TierStats {
        let mut s = tiering_core::TierStats::named(name);
        s.hits = self.hits.get();
        s.misses = self.misses.get();
        s.stores = self.stores.get();
        s.loads = self.loads.get();
        s.evictions = self.evictions.get();
        s.failures = self.failures.get();
        s.bytes_written = self.bytes_written.get();
        s.bytes_read = self.bytes_read.get();
        for (name, value) in extra {
            // Gauges and counters alike travel as f64 in `TierStats::extra`.
            s.extra.insert(name.to_owned(), value as f64);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_counters_fill_the_stats_and_their_extras() {
        let c = TierCounters::default();
        c.hits.add(3);
        c.bytes_read.add(4096);
        let s = c.stats("t", [("queued", 2)]);
        assert_eq!(
            (s.name.as_str(), s.hits, s.misses, s.bytes_read),
            ("t", 3, 0, 4096)
        );
        assert_eq!(s.extra.get("queued"), Some(&2.0));
    }

    #[test]
    fn a_finished_job_counts_by_its_direction() {
        let c = TierCounters::default();
        c.count_job(JobKind::Store, 3, 1, 3 * 64);
        c.count_job(JobKind::Promotion, 2, 2, 2 * 64);
        c.count_job(JobKind::Store, 0, 0, 0);
        let s = c.stats("t", []);
        assert_eq!(
            (s.stores, s.bytes_written, s.loads, s.bytes_read, s.failures),
            (3, 192, 2, 128, 3)
        );
    }
}
