//! State shared by the tier handle and its workers: the work queue and what travels on it,
//! the presence cache, the job ledger and how a job's per-key outcomes become its one result,
//! connection health, the server's `INFO` figures and the counters. The queue, the ledger and
//! the parts of a job are `tier-kit`'s.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::Value;
use tier_kit::{
    Counter, JobFinisher, JobKeys, JobLedger, KitCounters, LaneSpec, Part, RateLimitedLog, Ticket,
    TierCounters, WakePolicy, WorkQueue,
};
use tiering_core::{
    JobKind, Locality, Medium, OffloadKey, OffloadingEvent,
    arena::{RowRead, RowWrite},
};

use crate::conn::Endpoint;
use crate::format::KeyScheme;
use crate::presence::Presence;

/// Cumulative counters, updated without locks: the standard ones, then the tier's own.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) tier: TierCounters,
    pub(crate) retries: Counter,
    pub(crate) lookup_timeouts: Counter,
    pub(crate) presence_batches: Counter,
    pub(crate) missing_values: Counter,
    pub(crate) bad_values: Counter,
    pub(crate) server_errors: Counter,
    pub(crate) connection_failures: Counter,
    pub(crate) connects: Counter,
    pub(crate) cancelled_keys: Counter,
    /// Lookups answered `Miss` because the server counted as unreachable.
    pub(crate) unreachable_misses: Counter,
    /// Cached `Hit`s dropped because a load of their key failed.
    pub(crate) invalidated_presence: Counter,
}

/// One batch's share of a job: settled once with its keys' outcomes (`true`: done); dropped
/// unsettled, its keys fail.
pub(crate) type JobPart = Part<JobKeys, bool>;

/// A pipelined batch of one job: key indices with their rows.
pub(crate) enum Batch {
    /// Write these rows.
    Store(JobPart, Vec<(usize, RowRead)>),
    /// Read into these rows.
    Load(JobPart, Vec<(usize, RowWrite)>),
}

impl Batch {
    /// The job's share this batch carries.
    pub(crate) fn part(&self) -> &JobPart {
        match self {
            Self::Store(p, _) | Self::Load(p, _) => p,
        }
    }
}

/// Keys a worker asks the server about. Answered exactly once: by the worker, or — when the
/// batch is cancelled or the worker panics — as absent when it is dropped, so no key waits for
/// an answer that never comes.
pub(crate) struct PresenceCheck {
    keys: Vec<OffloadKey>,
    shared: Arc<Shared>,
    answered: bool,
}

impl PresenceCheck {
    pub(crate) fn new(keys: Vec<OffloadKey>, shared: Arc<Shared>) -> Self {
        Self {
            keys,
            shared,
            answered: false,
        }
    }

    pub(crate) fn keys(&self) -> &[OffloadKey] {
        &self.keys
    }

    /// Records the answers (no reply: the keys count as absent until the answer goes stale).
    pub(crate) fn answer(mut self, replies: Option<&[Value]>) {
        self.answered = true;
        self.record(replies);
    }

    fn record(&self, replies: Option<&[Value]>) {
        let now = Instant::now();
        {
            let mut p = self.shared.presence.lock();
            for (i, k) in self.keys.iter().enumerate() {
                let present = matches!(replies.and_then(|r| r.get(i)), Some(Value::Int(n)) if *n > 0);
                p.set(*k, present, now);
            }
        }
        self.shared.wake();
    }
}

impl Drop for PresenceCheck {
    fn drop(&mut self) {
        if !self.answered {
            self.record(None);
        }
    }
}

/// The queue's lanes, by priority: a reachability probe, presence checks, loads (an engine
/// waits), stores, then an `INFO` refresh.
pub(crate) mod lane {
    pub(crate) const PROBE: usize = 0;
    pub(crate) const LOOKUPS: usize = 1;
    pub(crate) const LOADS: usize = 2;
    pub(crate) const STORES: usize = 3;
    pub(crate) const INFO: usize = 4;
}

/// What a worker takes from the queue.
pub(crate) enum Work {
    Lookup(PresenceCheck),
    Transfer(Batch),
    Info,
    /// Connect (when the backoff allows) and `PING`: how an unreachable server is found back
    /// while lookups answer `Miss` and no job reaches the tier.
    Probe,
}

/// The work queue: `max_queued` presence batches, and `max_queued` batches per worker in each
/// direction (a job takes one batch per worker it is spread over). Every idle worker is woken,
/// even for one batch: the first one the scheduler runs takes it. On a busy machine one woken
/// thread can sit behind another task's whole slice (measured on 2 loaded cores: p90 of
/// submit-to-start 3-6 ms waking one, 0.2-0.3 ms waking all).
pub(crate) fn work_queue(max_queued: usize, workers: usize, counters: Arc<KitCounters>) -> WorkQueue<Work> {
    let batches = max_queued.saturating_mul(workers.max(1));
    WorkQueue::builder()
        .lane(LaneSpec::flag())
        .lane(LaneSpec::unbounded().max_entries(max_queued))
        .lane(LaneSpec::unbounded().max_entries(batches))
        .lane(LaneSpec::unbounded().max_entries(batches))
        .lane(LaneSpec::flag())
        .wake(WakePolicy::AllIdle)
        .counters(counters)
        .build()
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

/// Everything the workers share with the handle.
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) scheme: KeyScheme,
    pub(crate) endpoint: Endpoint,
    pub(crate) timing: Timing,
    pub(crate) queue: Arc<WorkQueue<Work>>,
    pub(crate) presence: Mutex<Presence>,
    /// The jobs' results; it also holds the control plane's waker.
    pub(crate) ledger: JobLedger,
    pub(crate) events: Mutex<Vec<OffloadingEvent>>,
    pub(crate) counters: Counters,
    pub(crate) health: Mutex<Health>,
    pub(crate) info: Mutex<ServerInfo>,
    pub(crate) log: RateLimitedLog,
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
        queue: Arc<WorkQueue<Work>>,
        ledger: JobLedger,
    ) -> Self {
        Self {
            name,
            scheme,
            endpoint,
            timing,
            queue,
            presence: Mutex::new(presence),
            ledger,
            events: Mutex::new(Vec::new()),
            counters: Counters::default(),
            health: Mutex::new(Health::default()),
            info: Mutex::new(ServerInfo::default()),
            log: RateLimitedLog::new(Duration::from_secs(10)),
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
        // Refused: a probe is already queued, or the tier is stopping.
        let _ = self.queue.submit(lane::PROBE, Work::Probe);
    }

    pub(crate) fn wake(&self) {
        self.ledger.wake();
    }

    /// Whether a worker without a connection should skip connecting (the server failed
    /// recently and its backoff has not expired).
    pub(crate) fn backing_off(&self) -> bool {
        matches!(self.health.lock().retry_at, Some(t) if Instant::now() < t)
    }

    /// How many connection-level failures any worker has seen (only grows).
    pub(crate) fn connection_failures(&self) -> u64 {
        self.counters.connection_failures.get()
    }

    /// Records a connection-level failure: the next attempt waits out a doubling backoff.
    pub(crate) fn connection_failed(&self, what: &str, e: &redis::RedisError) {
        self.counters.connection_failures.add(1);
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
        // Refused: a refresh is already queued, or the tier is stopping.
        let _ = self.queue.submit(lane::INFO, Work::Info);
    }
}

impl JobFinisher<JobKeys, bool> for Shared {
    /// Reports the job's one result, counts it, emits the store event and (for a load that
    /// failed keys) drops their cached presence.
    fn finish(&self, job: &JobKeys, succeeded: Vec<bool>, ticket: Ticket) {
        let ok_keys: Vec<OffloadKey> = job
            .keys
            .iter()
            .zip(&succeeded)
            .filter(|&(_, &s)| s)
            .map(|(k, _)| *k)
            .collect();
        let n = ok_keys.len() as u64;
        let bytes = n * self.scheme.chunk_bytes() as u64;
        let failed = job.keys.len() as u64 - n;
        self.counters.tier.count_job(job.kind, n, failed, bytes);
        match job.kind {
            JobKind::Store if !ok_keys.is_empty() => {
                let e = OffloadingEvent::stored(ok_keys, Some(Medium::Storage), Some(Locality::Remote))
                    .owned_by(self.name.clone());
                self.events.lock().push(e);
            }
            JobKind::Promotion if failed > 0 => {
                // A cached `Hit` that could not be loaded is not answered again from the cache:
                // the next lookup asks the server.
                let mut p = self.presence.lock();
                let mut dropped = 0;
                for (k, _) in job.keys.iter().zip(&succeeded).filter(|&(_, &s)| !s) {
                    dropped += u64::from(p.invalidate(k));
                }
                drop(p);
                self.counters.invalidated_presence.add(dropped);
            }
            JobKind::Store | JobKind::Promotion => {}
        }
        ticket.complete_keys(&job.keys, &succeeded, bytes);
    }
}
