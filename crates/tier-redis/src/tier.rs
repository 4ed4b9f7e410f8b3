//! [`RedisTier`]: the [`SecondaryTier`] over a Redis (or Valkey) server or cluster.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tier_kit::{
    Accepted, JobFinisher, JobKeys, JobLedger, RefusalReason, Rejected, SplitJob, WorkerPool, accept_load,
    accept_store,
};
use tiering_core::{
    ControlWaker, JobId, JobKind, JobResult, Locality, LookupResult, Medium, OffloadKey, OffloadingEvent,
    ReqContext, SecondaryTier, TierError, TierHealth, TierInfo, TierStats, TransferJob,
};

use crate::conn::Endpoint;
use crate::error::RedisTierError;
use crate::format::{HEADER_LEN, KeyScheme, LayoutId};
use crate::options::RedisTierOptions;
use crate::presence::{Answer, Presence};
use crate::shared::{Batch, JobPart, PresenceCheck, Shared, Timing, Work, lane, work_queue};
use crate::split;
use crate::worker::Worker;

/// The shared remote tier. See the crate documentation.
pub struct RedisTier {
    shared: Arc<Shared>,
    /// `shared` again, as what turns a job's per-key outcomes into its result.
    finisher: Arc<dyn JobFinisher<JobKeys, bool>>,
    workers: WorkerPool<Work>,
    info: TierInfo,
    max_lookup_batch: usize,
    /// Value bytes per key (chunk and header).
    value_bytes: u64,
    /// Worker threads (each with its own connection).
    workers_n: usize,
    /// Most value bytes in one batch.
    pipeline_bytes: u64,
    /// How long `shutdown` waits for a worker to finish its round trip before leaving it.
    stop_wait: Duration,
}

impl std::fmt::Debug for RedisTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTier")
            .field("name", &self.info.name)
            .field("servers", &self.shared.endpoint.display())
            .field("cluster", &self.shared.endpoint.is_cluster())
            .field("layout", &self.shared.scheme.layout())
            .finish_non_exhaustive()
    }
}

impl RedisTier {
    /// Connects to the server(s) of `opts` for chunks of `chunk_bytes`: checks that every
    /// master answers `PING` with the configured credentials, then starts the workers.
    ///
    /// # Errors
    /// Invalid options, a malformed URL, a missing password variable, refused credentials, or
    /// a server that cannot be reached.
    pub fn connect(opts: &RedisTierOptions, chunk_bytes: usize) -> Result<Self, RedisTierError> {
        opts.validate()?;
        if chunk_bytes == 0 {
            return Err(RedisTierError::InvalidOptions("invalid chunk size 0".into()));
        }
        let endpoint = Endpoint::new(opts)?;
        endpoint.check()?;
        let scheme = KeyScheme::new(&opts.namespace, chunk_bytes, &opts.layout_fingerprint);
        let timing = Timing {
            backoff_min: opts.reconnect_backoff.get(),
            backoff_max: opts.reconnect_backoff_max.get().max(opts.reconnect_backoff.get()),
            info_interval: opts.info_interval.get(),
        };
        let presence = Presence::new(opts.presence_ttl.get(), opts.lookup_timeout.get());
        let ledger = JobLedger::default();
        let queue = Arc::new(work_queue(
            opts.max_queued_jobs,
            opts.workers,
            Arc::clone(ledger.counters()),
        ));
        let shared = Arc::new(Shared::new(
            opts.name.clone(),
            scheme,
            endpoint,
            timing,
            presence,
            Arc::clone(&queue),
            ledger,
        ));
        let workers = WorkerPool::builder("kvtier-redis")
            .threads(opts.workers)
            .counters(Arc::clone(shared.ledger.counters()))
            .start(queue, |_| Ok(Worker::new(Arc::clone(&shared))))?;
        shared.request_info_if_due();
        tracing::info!(
            tier = %opts.name,
            servers = %shared.endpoint.display(),
            cluster = opts.cluster,
            namespace = %opts.namespace,
            layout = %shared.scheme.layout(),
            workers = opts.workers,
            "redis tier connected"
        );
        // A round trip in progress ends within its timeouts (an `INFO` refresh asks each
        // master in turn); beyond a few of them a worker is stuck and is left behind.
        let stop_wait = (opts.connect_timeout.get() + opts.io_timeout.get()) * 4;
        Ok(Self {
            finisher: Arc::clone(&shared) as Arc<dyn JobFinisher<JobKeys, bool>>,
            shared,
            workers,
            info: TierInfo::new(opts.name.clone(), Some(Medium::Storage), Some(Locality::Remote)),
            max_lookup_batch: opts.max_lookup_batch,
            value_bytes: (chunk_bytes + HEADER_LEN) as u64,
            workers_n: opts.workers,
            pipeline_bytes: opts.pipeline_bytes,
            stop_wait: stop_wait.max(Duration::from_secs(5)),
        })
    }

    /// The layout id in this tier's keys.
    #[must_use]
    pub fn layout(&self) -> LayoutId {
        self.shared.scheme.layout()
    }

    /// The server-side name of `key` (diagnostics and tests).
    #[must_use]
    pub fn key_name(&self, key: &OffloadKey) -> Vec<u8> {
        self.shared.scheme.name(key)
    }

    /// Forgets every cached presence answer: the next lookups ask the server again.
    pub fn forget_presence(&self) {
        self.shared.presence.lock().clear();
    }

    /// Sends the queued presence checks to a worker.
    fn flush_lookups(&self) {
        let keys = self.shared.presence.lock().take_batch();
        if keys.is_empty() {
            return;
        }
        let check = PresenceCheck::new(keys, Arc::clone(&self.shared));
        match self.shared.queue.submit(lane::LOOKUPS, Work::Lookup(check)) {
            Ok(()) => self.shared.counters.presence_batches.add(1),
            // The workers are far behind: the check, dropped unasked, answers these as misses
            // rather than queue more.
            Err(refused) => drop(refused.work),
        }
    }

    /// The job `id` of `kind` over `keys`, every key failed until a batch settles it.
    fn open_job(&self, id: JobId, kind: JobKind, keys: Vec<OffloadKey>) -> SplitJob<JobKeys, bool> {
        let n = keys.len();
        SplitJob::new(
            self.shared.ledger.open(id),
            JobKeys { kind, keys },
            vec![false; n],
            Arc::clone(&self.finisher),
        )
    }

    /// Reports a job as failed without running it.
    fn fail_now(&self, job: Rejected) {
        self.warn_refused(job.id, job.why);
        drop(self.open_job(job.id, job.kind, job.keys));
    }

    fn warn_refused(&self, id: JobId, why: &str) {
        self.shared.log.warn(
            &self.info.name,
            "job",
            format_args!("redis tier: {id} refused: {why}"),
        );
    }

    /// Why every job is refused now, if it is: the tier is shut down (its queue closed).
    fn refusal(&self) -> Option<&'static str> {
        self.shared.queue.is_closed().then_some("the tier is shut down")
    }

    /// Queues a job's batches, or refuses the job when its lane is full.
    fn launch<R>(&self, job: Accepted<R>, make: fn(JobPart, Vec<(usize, R)>) -> Batch) {
        let Accepted { id, kind, keys, rows } = job;
        let per_batch =
            split::keys_per_batch(keys.len(), self.value_bytes, self.workers_n, self.pipeline_bytes);
        let job = self.open_job(id, kind, keys);
        let mut items: Vec<(usize, R)> = rows.into_iter().enumerate().collect();
        let mut batches = Vec::new();
        while !items.is_empty() {
            let rest = items.split_off(items.len().min(per_batch));
            let batch = std::mem::replace(&mut items, rest);
            let part = job.part(batch.iter().map(|(i, _)| *i).collect());
            batches.push(Work::Transfer(make(part, batch)));
        }
        // A job without keys is reported (done) here, once its handle goes.
        drop(job);
        let lane = if kind == JobKind::Store {
            lane::STORES
        } else {
            lane::LOADS
        };
        if let Err(refused) = self.shared.queue.submit_all(lane, batches) {
            let why = match refused.reason {
                RefusalReason::Full => "the queue is full (the server is slower than the engine)",
                RefusalReason::Closed => "the tier is shut down",
            };
            self.warn_refused(id, why);
            // The batches' parts, dropped unsettled, fail every key: the job is reported failed.
            drop(refused.work);
        }
    }

    /// Fails every queued batch and answers every queued presence check as a miss (dropped
    /// unrun, each does so itself).
    fn cancel_queued(&self) {
        drop(self.shared.queue.drain_lane(lane::LOOKUPS));
        for lane in [lane::LOADS, lane::STORES] {
            for work in self.shared.queue.drain_lane(lane) {
                if let Work::Transfer(batch) = work {
                    let keys = batch.part().indices().len() as u64;
                    self.shared.counters.cancelled_keys.add(keys);
                }
            }
        }
    }

    /// Batches refused because their lane was full, loads and stores.
    fn rejected_jobs(&self) -> u64 {
        let q = &self.shared.queue;
        q.depth(lane::LOADS).rejected + q.depth(lane::STORES).rejected
    }
}

impl SecondaryTier for RedisTier {
    fn info(&self) -> TierInfo {
        self.info.clone()
    }

    fn set_waker(&mut self, waker: ControlWaker) {
        self.shared.ledger.set_waker(waker);
    }

    fn lookup(&mut self, key: &OffloadKey, _ctx: &ReqContext) -> LookupResult {
        if self.shared.is_unreachable() {
            // Whatever the cache says, nothing can be loaded from a server the tier cannot
            // reach: a `Hit` would only start a promotion that fails.
            let c = &self.shared.counters;
            c.tier.misses.add(1);
            c.unreachable_misses.add(1);
            self.shared.request_probe_if_due();
            return LookupResult::Miss;
        }
        let (answer, queued) = {
            let mut p = self.shared.presence.lock();
            let a = p.lookup(key, Instant::now());
            (a, p.batch_len())
        };
        let c = &self.shared.counters;
        match answer {
            Answer::Known(LookupResult::Hit) => {
                c.tier.hits.add(1);
                LookupResult::Hit
            }
            Answer::Known(_) => {
                c.tier.misses.add(1);
                LookupResult::Miss
            }
            Answer::TimedOut => {
                c.tier.misses.add(1);
                c.lookup_timeouts.add(1);
                LookupResult::Miss
            }
            Answer::Pending | Answer::Queued => {
                c.retries.add(1);
                if queued >= self.max_lookup_batch {
                    self.flush_lookups();
                }
                LookupResult::Retry
            }
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        match accept_store(job, self.shared.scheme.chunk_bytes(), self.refusal()) {
            Ok(job) => self.launch(job, Batch::Store),
            Err(rejected) => self.fail_now(rejected),
        }
    }

    fn submit_load(&mut self, job: TransferJob) {
        match accept_load(job, self.shared.scheme.chunk_bytes(), self.refusal()) {
            Ok(job) => self.launch(job, Batch::Load),
            Err(rejected) => self.fail_now(rejected),
        }
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        self.flush_lookups();
        self.shared.ledger.take_finished(out);
    }

    fn has_pending_work(&self) -> bool {
        self.shared.ledger.has_pending() || self.shared.presence.lock().has_pending()
    }

    fn on_schedule_end(&mut self) {
        self.flush_lookups();
        self.shared.request_info_if_due();
        self.shared.request_probe_if_due();
    }

    fn health(&self) -> TierHealth {
        TierHealth {
            healthy: !self.shared.is_unreachable(),
            recoveries: self.shared.recoveries(),
        }
    }

    fn drain_jobs(&mut self) {
        // Queued work is cancelled; running batches end within the I/O timeouts.
        self.cancel_queued();
        self.shared.ledger.wait_idle(None);
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        std::mem::take(&mut *self.shared.events.lock())
    }

    fn stats(&self) -> TierStats {
        self.shared.request_info_if_due();
        let c = &self.shared.counters;
        let server = *self.shared.info.lock();
        let queued: usize = [lane::LOOKUPS, lane::LOADS, lane::STORES]
            .into_iter()
            .map(|l| self.shared.queue.depth(l).entries)
            .sum();
        let extra = [
            ("server_used_memory_bytes", server.used_memory),
            ("server_maxmemory_bytes", server.maxmemory),
            ("server_evicted_keys", server.evicted_keys),
            ("server_keys", server.keys),
            ("server_info_refreshes", u64::from(server.refreshed.is_some())),
            ("server_reachable", u64::from(!self.shared.is_unreachable())),
            ("server_recoveries", self.shared.recoveries()),
            ("unreachable_misses", c.unreachable_misses.get()),
            ("invalidated_presence", c.invalidated_presence.get()),
            ("lookup_retries", c.retries.get()),
            ("lookup_timeouts", c.lookup_timeouts.get()),
            ("presence_batches", c.presence_batches.get()),
            ("missing_values", c.missing_values.get()),
            ("bad_values", c.bad_values.get()),
            ("rejected_jobs", self.rejected_jobs()),
            ("server_errors", c.server_errors.get()),
            ("connection_failures", c.connection_failures.get()),
            ("connects", c.connects.get()),
            ("cancelled_keys", c.cancelled_keys.get()),
            ("queued_batches", queued as u64),
        ];
        let mut s = c.tier.stats(self.info.name.clone(), extra);
        // The server evicts; what it evicted is its `evicted_keys` (all namespaces).
        s.evictions = server.evicted_keys;
        s.resident_chunks = server.keys;
        let value_bytes = (self.shared.scheme.chunk_bytes() + HEADER_LEN) as u64;
        s.capacity_chunks = server.maxmemory / value_bytes;
        s
    }

    fn shutdown(&mut self) -> Result<(), TierError> {
        // A second call finds nothing queued, no job open and no thread to stop.
        self.drain_jobs();
        self.workers
            .stop_and_join(self.stop_wait)
            .into_result("redis worker")
    }
}

impl Drop for RedisTier {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!(tier = %self.info.name, error = %e, "redis tier shutdown failed");
        }
    }
}
