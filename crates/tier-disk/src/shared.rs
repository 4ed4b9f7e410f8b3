//! State shared by the tier handle and its I/O threads: the slab, the index, finished results,
//! events and counters, and the per-job progress that turns per-key outcomes into exactly one
//! [`JobResult`] per job.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tiering_core::{
    ControlWaker, JobId, JobKind, JobResult, Locality, Medium, OffloadKey, OffloadingEvent, RowRead, RowWrite,
};

use crate::buf::AlignedBuf;
use crate::index::Index;
use crate::meter::DirectionCost;
use crate::options::SyncPolicy;
use crate::slab::Slab;
use tiering_core::ratelog::RateLimitedLog;

/// Cumulative counters, updated by the I/O threads without the index lock.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) stores: AtomicU64,
    pub(crate) loads: AtomicU64,
    pub(crate) evictions: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) corrupt: AtomicU64,
    pub(crate) io_errors: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) deduplicated: AtomicU64,
    pub(crate) not_admitted: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// How one key of a job ended (or is still going).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyOutcome {
    /// A task for it is queued or running.
    Pending,
    /// Finished: success or failure, nothing written by this job.
    Done(bool),
    /// Written by this job and visible (a store event is due).
    Written,
    /// Written into `slot`, waiting for the job's `fdatasync` (sync = batch).
    Unsynced(u32),
    /// The same key earlier in the job: same outcome as that entry.
    SameAs(usize),
}

struct Progress {
    outcomes: Vec<KeyOutcome>,
    remaining: usize,
}

/// One submitted job while its tasks run.
pub(crate) struct JobState {
    pub(crate) id: JobId,
    pub(crate) kind: JobKind,
    pub(crate) keys: Vec<OffloadKey>,
    submitted: Instant,
    progress: Mutex<Progress>,
}

impl JobState {
    /// A job whose keys start with `outcomes` (`Pending` for those a task will handle).
    pub(crate) fn new(
        id: JobId,
        kind: JobKind,
        keys: Vec<OffloadKey>,
        outcomes: Vec<KeyOutcome>,
        submitted: Instant,
    ) -> Self {
        let remaining = outcomes.iter().filter(|o| **o == KeyOutcome::Pending).count();
        Self {
            id,
            kind,
            keys,
            submitted,
            progress: Mutex::new(Progress { outcomes, remaining }),
        }
    }

    /// Whether no task is pending (the submitter then finalizes at once).
    pub(crate) fn settled(&self) -> bool {
        self.progress.lock().remaining == 0
    }
}

/// The row an item copies from (store) or into (load).
pub(crate) enum TaskOp {
    /// Write this primary row into the slot.
    Store(RowRead),
    /// Read the slot into this primary row.
    Load(RowWrite),
}

/// One key of a job: its slot, the write number to write or expect, and its row.
pub(crate) struct RunItem {
    pub(crate) idx: usize,
    pub(crate) slot: u32,
    pub(crate) seq: u64,
    pub(crate) op: TaskOp,
}

/// Keys of one job in consecutive slots, all loads or all stores: one vectored read or write.
pub(crate) struct Run {
    pub(crate) job: std::sync::Arc<JobState>,
    /// In slot order; `items[i].slot == items[0].slot + i`.
    pub(crate) items: Vec<RunItem>,
    /// When it was queued.
    pub(crate) queued: Instant,
}

impl Run {
    /// Whether this run reads slots into primary rows.
    pub(crate) fn is_load(&self) -> bool {
        matches!(self.items.first().map(|i| &i.op), Some(TaskOp::Load(_)))
    }

    /// Splits a job's items, given in slot order, into runs of at most `max_len` items whose
    /// slots follow each other.
    pub(crate) fn split(
        job: &std::sync::Arc<JobState>,
        items: Vec<RunItem>,
        max_len: usize,
        queued: Instant,
    ) -> Vec<Self> {
        let mut runs: Vec<Self> = Vec::new();
        for item in items {
            let extend = runs.last().is_some_and(|r| {
                r.items.len() < max_len
                    && r.items
                        .last()
                        .is_some_and(|l| l.slot.checked_add(1) == Some(item.slot))
            });
            match runs.last_mut() {
                Some(r) if extend => r.items.push(item),
                _ => runs.push(Self {
                    job: std::sync::Arc::clone(job),
                    items: vec![item],
                    queued,
                }),
            }
        }
        runs
    }
}

/// Finished results waiting for `poll_finished`, and the jobs not finished yet.
#[derive(Default)]
pub(crate) struct Done {
    pub(crate) results: Vec<JobResult>,
    pub(crate) outstanding: usize,
}

/// Everything the I/O threads share with the handle.
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) slab: Slab,
    pub(crate) index: Mutex<Index>,
    pub(crate) sync: SyncPolicy,
    pub(crate) done: Mutex<Done>,
    pub(crate) done_cond: Condvar,
    pub(crate) events: Mutex<Vec<OffloadingEvent>>,
    pub(crate) counters: Counters,
    pub(crate) waker: Mutex<Option<ControlWaker>>,
    pub(crate) log: RateLimitedLog,
    /// A zeroed block, written over the seal of a slot found corrupt.
    pub(crate) zero_block: AlignedBuf,
    /// Most slots one vectored read or write covers.
    pub(crate) max_run: usize,
    /// Measured cost of loads and stores.
    pub(crate) meters: Mutex<(DirectionCost, DirectionCost)>,
    /// Sleep before each submission's I/O (the `inject_io_delay` option; zero: none).
    pub(crate) io_delay: Duration,
}

impl Shared {
    pub(crate) fn new(
        name: String,
        slab: Slab,
        index: Index,
        sync: SyncPolicy,
        max_run: usize,
        io_delay: Duration,
    ) -> std::io::Result<Self> {
        Ok(Self {
            name,
            slab,
            index: Mutex::new(index),
            sync,
            done: Mutex::new(Done::default()),
            done_cond: Condvar::new(),
            events: Mutex::new(Vec::new()),
            counters: Counters::default(),
            waker: Mutex::new(None),
            log: RateLimitedLog::new(Duration::from_secs(10)),
            zero_block: AlignedBuf::zeroed(crate::format::BLOCK)?,
            max_run: max_run.max(1),
            meters: Mutex::new((DirectionCost::default(), DirectionCost::default())),
            io_delay,
        })
    }

    /// Records one finished submission of `bytes` whose I/O took `took` after waiting `waited`
    /// in the queue.
    pub(crate) fn record_io(&self, load: bool, sample: Option<(u64, Duration)>, waited: Duration) {
        let Some((bytes, took)) = sample else {
            return;
        };
        let mut m = self.meters.lock();
        let meter = if load { &mut m.0 } else { &mut m.1 };
        meter.record(bytes, took, waited);
    }

    /// Records an event about this tier's own storage.
    pub(crate) fn event(&self, keys: Vec<OffloadKey>, removed: bool) {
        if keys.is_empty() {
            return;
        }
        let e = if removed {
            OffloadingEvent::removed(keys, Some(Medium::Storage), Some(Locality::Local))
        } else {
            // The tier evicts on its own and reports those removals.
            OffloadingEvent::stored(keys, Some(Medium::Storage), Some(Locality::Local)).expecting_removal()
        };
        self.events.lock().push(e.owned_by(self.name.clone()));
    }

    /// Counts a newly submitted job; it stays outstanding until its result is queued.
    pub(crate) fn job_submitted(&self) {
        self.done.lock().outstanding += 1;
    }

    /// Sets the outcomes of keys of `job` (`(idx, outcome)`, each settling one pending key),
    /// finalizing the job when they were its last ones.
    pub(crate) fn settle_all(&self, job: &JobState, outcomes: impl IntoIterator<Item = (usize, KeyOutcome)>) {
        let last = {
            let mut p = job.progress.lock();
            let before = p.remaining;
            for (idx, outcome) in outcomes {
                if let Some(o) = p.outcomes.get_mut(idx) {
                    *o = outcome;
                }
                p.remaining = p.remaining.saturating_sub(1);
            }
            before > 0 && p.remaining == 0
        };
        if last {
            self.finalize(job);
        }
    }

    /// Turns the per-key outcomes into the job's one result: runs the batch `fdatasync` and
    /// flips its slots, emits the store event, queues the result and wakes the control plane.
    pub(crate) fn finalize(&self, job: &JobState) {
        let mut outcomes = job.progress.lock().outcomes.clone();
        self.flip_unsynced(&mut outcomes);
        let mut succeeded = vec![false; outcomes.len()];
        let mut written = Vec::new();
        for i in 0..outcomes.len() {
            succeeded[i] = match outcomes[i] {
                KeyOutcome::Written => {
                    written.push(job.keys[i]);
                    true
                }
                KeyOutcome::Done(ok) => ok,
                // An earlier index: already resolved in this loop.
                KeyOutcome::SameAs(j) => succeeded.get(j).copied().unwrap_or(false),
                KeyOutcome::Pending | KeyOutcome::Unsynced(_) => false,
            };
        }
        let failed = succeeded.iter().filter(|s| !**s).count() as u64;
        Counters::add(&self.counters.failures, failed);
        let chunk = self.slab.layout().chunk_bytes as u64;
        let bytes = if job.kind == JobKind::Store {
            let n = written.len() as u64;
            Counters::add(&self.counters.stores, n);
            Counters::add(&self.counters.bytes_written, n * chunk);
            self.event(written, false);
            n * chunk
        } else {
            let n = succeeded.iter().filter(|s| **s).count() as u64;
            Counters::add(&self.counters.loads, n);
            Counters::add(&self.counters.bytes_read, n * chunk);
            n * chunk
        };
        let result =
            JobResult::from_key_outcomes(job.id, &job.keys, &succeeded, bytes, job.submitted.elapsed());
        {
            let mut done = self.done.lock();
            done.results.push(result);
            done.outstanding = done.outstanding.saturating_sub(1);
        }
        self.done_cond.notify_all();
        if let Some(w) = self.waker.lock().as_ref() {
            w.wake();
        }
    }

    /// `sync = batch`: one `fdatasync` for the job, then its written slots become visible (or,
    /// when the sync fails, free again).
    fn flip_unsynced(&self, outcomes: &mut [KeyOutcome]) {
        if !outcomes.iter().any(|o| matches!(o, KeyOutcome::Unsynced(_))) {
            return;
        }
        let synced = self.slab.sync();
        if let Err(e) = &synced {
            Counters::add(&self.counters.io_errors, 1);
            self.log.warn(
                &self.name,
                "sync",
                format_args!("disk tier: fdatasync failed, the job's chunks are dropped: {e}"),
            );
        }
        let mut index = self.index.lock();
        for o in outcomes.iter_mut() {
            if let KeyOutcome::Unsynced(slot) = *o {
                *o = if synced.is_ok() && index.commit(slot) {
                    KeyOutcome::Written
                } else {
                    index.abort(slot);
                    KeyOutcome::Done(false)
                };
            }
        }
    }

    /// Blocks until no job is outstanding.
    pub(crate) fn wait_idle(&self) {
        let mut done = self.done.lock();
        while done.outstanding > 0 {
            self.done_cond.wait(&mut done);
        }
    }
}
