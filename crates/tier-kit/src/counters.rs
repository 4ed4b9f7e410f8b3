//! What the kit counts for a tier's stats: jobs opened and reported, work refused, panics.
//!
//! One [`KitCounters`] is shared by a tier's ledger, queue and pool (each builder takes an
//! `Arc` of it), so one [`KitCounters::snapshot`] answers for the whole tier.

use std::sync::atomic::{AtomicU64, Ordering};

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
