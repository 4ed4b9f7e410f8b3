//! State shared by the tier handle and its workers: the queues, the presence cache, per-job
//! progress (turning per-key outcomes into exactly one [`JobResult`] per job), connection
//! health, the server's `INFO` figures and the counters.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tiering_core::{
    ControlWaker, JobId, JobKind, JobResult, Locality, Medium, OffloadKey, OffloadingEvent, RowRead, RowWrite,
};

use crate::conn::Endpoint;
use crate::format::KeyScheme;
use crate::presence::Presence;
use tiering_core::ratelog::RateLimitedLog;

/// Cumulative counters, updated without locks.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) hits: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) lookup_timeouts: AtomicU64,
    pub(crate) presence_batches: AtomicU64,
    pub(crate) stores: AtomicU64,
    pub(crate) loads: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) missing_values: AtomicU64,
    pub(crate) bad_values: AtomicU64,
    pub(crate) rejected_jobs: AtomicU64,
    pub(crate) server_errors: AtomicU64,
    pub(crate) connection_failures: AtomicU64,
    pub(crate) connects: AtomicU64,
    pub(crate) cancelled_keys: AtomicU64,
    /// Lookups answered `Miss` because the server counted as unreachable.
    pub(crate) unreachable_misses: AtomicU64,
    /// Cached `Hit`s dropped because a load of their key failed.
    pub(crate) invalidated_presence: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// One submitted store or load while its batches run.
pub(crate) struct JobState {
    pub(crate) id: JobId,
    pub(crate) kind: JobKind,
    pub(crate) keys: Vec<OffloadKey>,
    submitted: Instant,
    progress: Mutex<Progress>,
}

struct Progress {
    succeeded: Vec<bool>,
    batches_left: usize,
}

impl JobState {
    pub(crate) fn new(id: JobId, kind: JobKind, keys: Vec<OffloadKey>, batches: usize) -> Self {
        let n = keys.len();
        Self {
            id,
            kind,
            keys,
            submitted: Instant::now(),
            progress: Mutex::new(Progress {
                succeeded: vec![false; n],
                batches_left: batches,
            }),
        }
    }
}

/// A pipelined batch of one job: key indices with their rows.
pub(crate) enum Batch {
    /// Write these rows.
    Store(Arc<JobState>, Vec<(usize, RowRead)>),
    /// Read into these rows.
    Load(Arc<JobState>, Vec<(usize, RowWrite)>),
}

impl Batch {
    pub(crate) fn job(&self) -> &Arc<JobState> {
        match self {
            Self::Store(j, _) | Self::Load(j, _) => j,
        }
    }

    /// The job's key indices this batch carries.
    pub(crate) fn indices(&self) -> Vec<usize> {
        match self {
            Self::Store(_, items) => items.iter().map(|(i, _)| *i).collect(),
            Self::Load(_, items) => items.iter().map(|(i, _)| *i).collect(),
        }
    }
}

/// Work waiting for a worker, by priority: a reachability probe, presence checks, loads (an
/// engine waits), stores, then an `INFO` refresh.
#[derive(Default)]
pub(crate) struct Queue {
    pub(crate) probe: bool,
    pub(crate) lookups: VecDeque<Vec<OffloadKey>>,
    pub(crate) loads: VecDeque<Batch>,
    pub(crate) stores: VecDeque<Batch>,
    pub(crate) info: bool,
    pub(crate) stop: bool,
}

/// What a worker takes from the queue.
pub(crate) enum Work {
    Lookup(Vec<OffloadKey>),
    Transfer(Batch),
    Info,
    /// Connect (when the backoff allows) and `PING`: how an unreachable server is found back
    /// while lookups answer `Miss` and no job reaches the tier.
    Probe,
}

impl Queue {
    pub(crate) fn pop(&mut self) -> Option<Work> {
        if std::mem::take(&mut self.probe) {
            return Some(Work::Probe);
        }
        if let Some(keys) = self.lookups.pop_front() {
            return Some(Work::Lookup(keys));
        }
        if let Some(b) = self.loads.pop_front() {
            return Some(Work::Transfer(b));
        }
        if let Some(b) = self.stores.pop_front() {
            return Some(Work::Transfer(b));
        }
        if std::mem::take(&mut self.info) {
            return Some(Work::Info);
        }
        None
    }
}

/// Whether the server is reachable, and when to try again after a failure.
#[derive(Default)]
pub(crate) struct Health {
    retry_at: Option<Instant>,
    backoff: Duration,
}

/// The server's memory and eviction figures, summed over every master.
#[derive(Clone, Copy, Default)]
pub(crate) struct ServerInfo {
    pub(crate) used_memory: u64,
    pub(crate) maxmemory: u64,
    pub(crate) evicted_keys: u64,
    pub(crate) keys: u64,
    pub(crate) refreshed: Option<Instant>,
    pub(crate) requested: Option<Instant>,
}

/// Timings the workers and the handle use.
#[derive(Clone, Copy)]
pub(crate) struct Timing {
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) info_interval: Duration,
}

/// Finished results waiting for `poll_finished`, and jobs not finished yet.
#[derive(Default)]
pub(crate) struct Done {
    pub(crate) results: Vec<JobResult>,
    pub(crate) outstanding: usize,
}

/// Everything the workers share with the handle.
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) scheme: KeyScheme,
    pub(crate) endpoint: Endpoint,
    pub(crate) timing: Timing,
    pub(crate) queue: Mutex<Queue>,
    pub(crate) queue_cond: Condvar,
    pub(crate) presence: Mutex<Presence>,
    pub(crate) done: Mutex<Done>,
    pub(crate) done_cond: Condvar,
    pub(crate) events: Mutex<Vec<OffloadingEvent>>,
    pub(crate) counters: Counters,
    pub(crate) health: Mutex<Health>,
    pub(crate) info: Mutex<ServerInfo>,
    pub(crate) waker: Mutex<Option<ControlWaker>>,
    pub(crate) log: RateLimitedLog,
    /// Lookup batches taken by a worker and not answered yet.
    pub(crate) lookups_running: AtomicU64,
    /// Set by a connection-level failure, cleared by the next successful round trip: while
    /// set, lookups answer `Miss` (a cached `Hit` could not be loaded).
    unreachable: AtomicBool,
    /// Times the server was reachable again after being unreachable (the tier's health
    /// generation).
    recoveries: AtomicU64,
}

impl Shared {
    pub(crate) fn new(
        name: String,
        scheme: KeyScheme,
        endpoint: Endpoint,
        timing: Timing,
        presence: Presence,
    ) -> Self {
        Self {
            name,
            scheme,
            endpoint,
            timing,
            queue: Mutex::new(Queue::default()),
            queue_cond: Condvar::new(),
            presence: Mutex::new(presence),
            done: Mutex::new(Done::default()),
            done_cond: Condvar::new(),
            events: Mutex::new(Vec::new()),
            counters: Counters::default(),
            health: Mutex::new(Health::default()),
            info: Mutex::new(ServerInfo::default()),
            waker: Mutex::new(None),
            log: RateLimitedLog::new(Duration::from_secs(10)),
            lookups_running: AtomicU64::new(0),
            unreachable: AtomicBool::new(false),
            recoveries: AtomicU64::new(0),
        }
    }

    /// Whether the server counts as unreachable (a connection-level failure since the last
    /// successful round trip).
    pub(crate) fn is_unreachable(&self) -> bool {
        self.unreachable.load(Ordering::Acquire)
    }

    /// Times the server came back after being unreachable.
    pub(crate) fn recoveries(&self) -> u64 {
        self.recoveries.load(Ordering::Acquire)
    }

    /// While the server is unreachable and its backoff has expired, asks a worker to try it
    /// again (once; the probe's failure starts the next backoff).
    pub(crate) fn request_probe_if_due(&self) {
        if !self.is_unreachable() || self.backing_off() {
            return;
        }
        let mut q = self.queue.lock();
        if q.probe || q.stop {
            return;
        }
        q.probe = true;
        drop(q);
        self.queue_cond.notify_one();
    }

    pub(crate) fn wake(&self) {
        if let Some(w) = self.waker.lock().as_ref() {
            w.wake();
        }
    }

    /// Whether a worker without a connection should skip connecting (the server failed
    /// recently and its backoff has not expired).
    pub(crate) fn backing_off(&self) -> bool {
        matches!(self.health.lock().retry_at, Some(t) if Instant::now() < t)
    }

    /// How many connection-level failures any worker has seen (only grows).
    pub(crate) fn connection_failures(&self) -> u64 {
        Counters::get(&self.counters.connection_failures)
    }

    /// Records a connection-level failure: the next attempt waits out a doubling backoff.
    pub(crate) fn connection_failed(&self, what: &str, e: &redis::RedisError) {
        Counters::add(&self.counters.connection_failures, 1);
        self.unreachable.store(true, Ordering::Release);
        let backoff = {
            let mut h = self.health.lock();
            h.backoff = if h.retry_at.is_some() {
                (h.backoff * 2).clamp(self.timing.backoff_min, self.timing.backoff_max)
            } else {
                self.timing.backoff_min
            };
            h.retry_at = Some(Instant::now() + h.backoff);
            h.backoff
        };
        self.log.warn(
            &self.name,
            "connection",
            format_args!(
                "redis tier: {what} at {} failed ({e}); lookups miss and jobs fail until it is back (next attempt in {backoff:?})",
                self.endpoint.display()
            ),
        );
    }

    /// Records a successful round trip: the server is healthy again. A recovery forgets the
    /// cached presence answers (a restarted server may have lost its keys) and counts in the
    /// tier's health, so the manager uses the tier again at once.
    pub(crate) fn connection_ok(&self) {
        let mut h = self.health.lock();
        if h.retry_at.take().is_some() {
            drop(h);
            self.presence.lock().clear();
            self.recoveries.fetch_add(1, Ordering::AcqRel);
            self.unreachable.store(false, Ordering::Release);
            tracing::info!(tier = %self.name, server = %self.endpoint.display(), "redis tier: server reachable again");
            self.wake();
        }
    }

    /// Counts a newly submitted job.
    pub(crate) fn job_submitted(&self) {
        self.done.lock().outstanding += 1;
    }

    /// Records the outcome of some keys of `job` (parallel `idx` and `ok`), finishing the job
    /// when this was its last batch.
    pub(crate) fn settle(&self, job: &JobState, outcomes: &[(usize, bool)]) {
        let last = {
            let mut p = job.progress.lock();
            for &(i, ok) in outcomes {
                if let Some(s) = p.succeeded.get_mut(i) {
                    *s = ok;
                }
            }
            p.batches_left = p.batches_left.saturating_sub(1);
            p.batches_left == 0
        };
        if last {
            self.finalize(job);
        }
    }

    /// Queues the job's one result, counts it, emits the store event and wakes the manager.
    pub(crate) fn finalize(&self, job: &JobState) {
        let succeeded = job.progress.lock().succeeded.clone();
        let ok_keys: Vec<OffloadKey> = job
            .keys
            .iter()
            .zip(&succeeded)
            .filter(|&(_, &s)| s)
            .map(|(k, _)| *k)
            .collect();
        let n = ok_keys.len() as u64;
        let bytes = n * self.scheme.chunk_bytes() as u64;
        let c = &self.counters;
        Counters::add(&c.failures, job.keys.len() as u64 - n);
        if job.kind == JobKind::Store {
            Counters::add(&c.stores, n);
            Counters::add(&c.bytes_written, bytes);
            if !ok_keys.is_empty() {
                let e = OffloadingEvent::stored(ok_keys, Some(Medium::Storage), Some(Locality::Remote))
                    .owned_by(self.name.clone());
                self.events.lock().push(e);
            }
        } else {
            Counters::add(&c.loads, n);
            Counters::add(&c.bytes_read, bytes);
            if n < job.keys.len() as u64 {
                // A cached `Hit` that could not be loaded is not answered again from the cache:
                // the next lookup asks the server.
                let mut p = self.presence.lock();
                let mut dropped = 0;
                for (k, _) in job.keys.iter().zip(&succeeded).filter(|&(_, &s)| !s) {
                    dropped += u64::from(p.invalidate(k));
                }
                drop(p);
                Counters::add(&c.invalidated_presence, dropped);
            }
        }
        let result =
            JobResult::from_key_outcomes(job.id, &job.keys, &succeeded, bytes, job.submitted.elapsed());
        {
            let mut done = self.done.lock();
            done.results.push(result);
            done.outstanding = done.outstanding.saturating_sub(1);
        }
        self.done_cond.notify_all();
        self.wake();
    }

    /// Settles a batch that never reached the server as failed.
    pub(crate) fn fail_batch(&self, batch: Batch) {
        let job = Arc::clone(batch.job());
        let outcomes: Vec<(usize, bool)> = match batch {
            Batch::Store(_, items) => items.into_iter().map(|(i, _)| (i, false)).collect(),
            Batch::Load(_, items) => items.into_iter().map(|(i, _)| (i, false)).collect(),
        };
        self.settle(&job, &outcomes);
    }

    /// Queues an `INFO` refresh when the last one is older than the interval.
    pub(crate) fn request_info_if_due(&self) {
        let now = Instant::now();
        {
            let mut info = self.info.lock();
            let due = info
                .requested
                .is_none_or(|t| now.duration_since(t) >= self.timing.info_interval);
            if !due {
                return;
            }
            info.requested = Some(now);
        }
        self.queue.lock().info = true;
        self.queue_cond.notify_one();
    }

    /// Blocks until no job is outstanding.
    pub(crate) fn wait_idle(&self) {
        let mut done = self.done.lock();
        while done.outstanding > 0 {
            self.done_cond.wait(&mut done);
        }
    }
}
