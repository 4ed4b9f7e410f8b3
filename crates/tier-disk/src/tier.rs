//! [`DiskTier`]: the [`SecondaryTier`] over one slab file.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tier_kit::{
    Accepted, JobFinisher, JobKeys, JobLedger, Rejected, SplitJob, Ticket, WorkerPool, accept_load,
    accept_store,
};
use tiering_core::{
    ControlWaker, JobKind, JobResult, KeyMap, Locality, LookupResult, Medium, OffloadKey, OffloadingEvent,
    ReqContext, SecondaryTier, TierError, TierInfo, TierStats, TransferJob,
};

use crate::error::DiskError;
use crate::exec;
#[cfg(feature = "test-utils")]
use crate::faults::FaultInjector;
use crate::format::SlabLayout;
use crate::index::{Index, Reservation, SlotState};
use crate::meter::IoCost;
use crate::options::{DiskGeometry, DiskTierOptions};
use crate::pool::{self, LOADS, STORES};
use crate::recover;
use crate::shape;
use crate::shared::{DiskSplit, KeyOutcome, Run, RunItem, Shared, TaskOp};
use crate::slab::Slab;

/// What the start-up scan did with the slab's previous contents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Chunks found complete and adopted (now `Hit`s).
    pub recovered: usize,
    /// Slots discarded: writes that never completed (torn), damaged seals.
    pub discarded: usize,
    /// Older copies of a key found again in a newer slot (the newest wins).
    pub duplicates: usize,
    /// Slots whose seal could not be read.
    pub unreadable: usize,
    /// Whether a slab of another geometry or format was wiped (`wipe_on_mismatch`).
    pub wiped: bool,
}

/// Where a chunk lives in the slab file (diagnostics, tests and tools).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotLocation {
    /// The slab file.
    pub file: PathBuf,
    /// Slot number.
    pub slot: u32,
    /// File offset of the payload (the start of the slot).
    pub payload_offset: u64,
    /// File offset of the seal block.
    pub seal_offset: u64,
}

/// How long `shutdown` waits for the I/O threads once every job is reported (`drain_jobs`
/// waited for them): a thread still running by then is stuck outside any job, and is left
/// behind rather than waited for.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// The kit's check of a submitted job: `accept_store` or `accept_load`.
type Accept<R> = fn(TransferJob, usize, Option<&'static str>) -> Result<Accepted<R>, Rejected>;

/// The persistent, bounded disk tier. See the crate documentation.
pub struct DiskTier {
    shared: Arc<Shared>,
    /// `shared` again, as what turns a job's per-key outcomes into its result.
    finisher: Arc<dyn JobFinisher<JobKeys, KeyOutcome>>,
    /// The jobs' results; it also holds the control plane's waker.
    ledger: JobLedger,
    pool: WorkerPool<Run>,
    info: TierInfo,
    recovery: RecoveryReport,
    io_threads: usize,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("name", &self.info.name)
            .field("path", &self.shared.slab.path())
            .field("layout", self.shared.slab.layout())
            .field("direct_io", &self.shared.slab.direct())
            .finish_non_exhaustive()
    }
}

/// Every invalid option of `opts` that can be told without the engine's geometry or the
/// filesystem (each message quotes its key).
pub(crate) fn option_errors(opts: &DiskTierOptions) -> Vec<DiskError> {
    let mut errors = Vec::new();
    if !(1..=256).contains(&opts.io_threads) {
        errors.push(DiskError::InvalidOptions(format!(
            "`io_threads` must be between 1 and 256, not {}",
            opts.io_threads
        )));
    }
    if opts.path.as_os_str().is_empty() {
        errors.push(DiskError::InvalidOptions(
            "`path` must name a directory; it is empty".to_owned(),
        ));
    }
    if opts.name.is_empty() {
        errors.push(DiskError::InvalidOptions(
            "`name`: the tier name must not be empty".to_owned(),
        ));
    }
    errors
}

fn validate(opts: &DiskTierOptions, geometry: DiskGeometry) -> Result<(), DiskError> {
    if let Some(first) = option_errors(opts).into_iter().next() {
        return Err(first);
    }
    if geometry.chunk_bytes == 0 || geometry.row_stride < geometry.chunk_bytes {
        return Err(DiskError::InvalidOptions(format!(
            "invalid chunk geometry: chunk_bytes {} with row_stride {}",
            geometry.chunk_bytes, geometry.row_stride
        )));
    }
    Ok(())
}

impl DiskTier {
    /// Opens the tier at `opts.path` for chunks of `geometry`: creates or adopts the slab,
    /// rebuilds the index from the slot seals, and starts the I/O threads.
    ///
    /// # Errors
    /// Invalid options, an unusable directory or file, a slab of another geometry or format
    /// (unless `wipe_on_mismatch`), a slab locked by another tier, not enough space, or
    /// `direct_io = true` on a filesystem that refuses it.
    pub fn open(opts: &DiskTierOptions, geometry: DiskGeometry) -> Result<Self, DiskError> {
        Self::open_inner(
            opts,
            geometry,
            #[cfg(feature = "test-utils")]
            None,
        )
    }

    /// As [`DiskTier::open`], with faults injected into slot I/O (tests only).
    ///
    /// # Errors
    /// As [`DiskTier::open`].
    #[cfg(feature = "test-utils")]
    pub fn open_with_faults(
        opts: &DiskTierOptions,
        geometry: DiskGeometry,
        faults: FaultInjector,
    ) -> Result<Self, DiskError> {
        Self::open_inner(opts, geometry, Some(faults))
    }

    fn open_inner(
        opts: &DiskTierOptions,
        geometry: DiskGeometry,
        #[cfg(feature = "test-utils")] faults: Option<FaultInjector>,
    ) -> Result<Self, DiskError> {
        validate(opts, geometry)?;
        let opened = Slab::open(
            opts,
            geometry.chunk_bytes,
            #[cfg(feature = "test-utils")]
            faults,
        )?;
        let slab = opened.slab;
        let path = slab.path().to_owned();
        let io = |what| {
            let path = path.clone();
            move |source| DiskError::Io { what, path, source }
        };
        let scan = recover::scan(&slab, opened.slots_to_scan, opts.io_threads).map_err(io("scanning"))?;
        let num_slots = slab.layout().num_slots;
        let (index, duplicates) = Index::recovered(num_slots, scan.max_seq + 1, scan.found);
        let recovery = RecoveryReport {
            recovered: index.live(),
            discarded: scan.discarded,
            duplicates: duplicates.len(),
            unreadable: scan.unreadable,
            wiped: opened.wiped,
        };
        let recovered_keys = index.live_keys();
        let layout = *slab.layout();
        let max_run = shape::max_slots_per_submission(layout.slot_bytes);
        let shared = Arc::new(
            Shared::new(
                opts.name.clone(),
                slab,
                index,
                opts.sync,
                max_run,
                opts.io_threads,
                opts.inject_io_delay.get(),
            )
            .map_err(io("allocating buffers for"))?,
        );
        shared.event(recovered_keys, false);
        let ledger = JobLedger::default();
        let pool = pool::start(&shared, opts.io_threads, ledger.counters())
            .map_err(io("starting I/O threads for"))?;
        tracing::info!(
            tier = %opts.name,
            path = %path.display(),
            slots = num_slots,
            chunk_bytes = geometry.chunk_bytes,
            direct_io = shared.slab.direct(),
            sync = ?opts.sync,
            recovered = recovery.recovered,
            discarded = recovery.discarded,
            "disk tier opened"
        );
        Ok(Self {
            finisher: Arc::clone(&shared) as Arc<dyn JobFinisher<JobKeys, KeyOutcome>>,
            shared,
            ledger,
            pool,
            info: TierInfo::new(opts.name.clone(), Some(Medium::Storage), Some(Locality::Local)),
            recovery,
            io_threads: opts.io_threads,
        })
    }

    /// What the start-up scan found.
    #[must_use]
    pub fn recovery(&self) -> RecoveryReport {
        self.recovery
    }

    /// Whether slot I/O bypasses the page cache.
    #[must_use]
    pub fn direct_io(&self) -> bool {
        self.shared.slab.direct()
    }

    /// The slab's layout.
    #[must_use]
    pub fn layout(&self) -> SlabLayout {
        *self.shared.slab.layout()
    }

    /// The slab file.
    #[must_use]
    pub fn slab_path(&self) -> &Path {
        self.shared.slab.path()
    }

    /// Every readable key, least recently used first.
    #[must_use]
    pub fn resident_keys(&self) -> Vec<OffloadKey> {
        self.shared.index.lock().live_keys()
    }

    /// Whether `key` is readable, without counting a lookup or touching it.
    #[must_use]
    pub fn contains(&self, key: &OffloadKey) -> bool {
        self.shared.index.lock().is_live(key)
    }

    /// Where `key` lives on disk, if it is readable.
    #[must_use]
    pub fn slot_location(&self, key: &OffloadKey) -> Option<SlotLocation> {
        let (slot, state) = self.shared.index.lock().slot_of(key)?;
        if !matches!(state, SlotState::Live { .. }) {
            return None;
        }
        let layout = self.shared.slab.layout();
        Some(SlotLocation {
            file: self.shared.slab.path().to_owned(),
            slot,
            payload_offset: layout.slot_offset(slot),
            seal_offset: layout.seal_offset(slot),
        })
    }

    /// Most slots one vectored read or write covers (a job's consecutive slots are split into
    /// submissions of at most this many, and of at most `ceil(keys / io_threads)` so a job
    /// keeps every thread busy).
    #[must_use]
    pub fn max_slots_per_io(&self) -> usize {
        self.shared.max_run
    }

    /// The measured cost of loads and stores: queue depths, and moving averages of the I/O
    /// time per MiB and of the queue wait (see [`IoCost`]).
    #[must_use]
    pub fn io_cost(&self) -> IoCost {
        let queue = self.pool.queue();
        let (mut loads, mut stores) = (pool::depth(queue, LOADS), pool::depth(queue, STORES));
        let (l, s) = *self.shared.meters.lock();
        for (d, m) in [(&mut loads, l), (&mut stores, s)] {
            d.secs_per_mib = m.secs_per_mib;
            d.queue_wait_secs = m.queue_wait_secs;
            d.samples = m.samples;
        }
        IoCost {
            loads,
            stores,
            io_threads: self.io_threads,
        }
    }

    /// Why every job is refused now, if it is: the tier is shut down (its queue closed).
    fn refusal(&self) -> Option<&'static str> {
        self.pool.queue().is_closed().then_some("the tier is shut down")
    }

    /// The job reported through `ticket`, whose keys start at `outcomes`.
    fn split(
        &self,
        ticket: Ticket,
        kind: JobKind,
        keys: Vec<OffloadKey>,
        outcomes: Vec<KeyOutcome>,
    ) -> DiskSplit {
        SplitJob::new(
            ticket,
            JobKeys { kind, keys },
            outcomes,
            Arc::clone(&self.finisher),
        )
    }

    /// Checks a submitted job with `accept` (`accept_store` or `accept_load`) and opens its
    /// ticket; `None` when it was refused (and is reported failed already).
    fn admit<R>(&self, job: TransferJob, accept: Accept<R>) -> Option<(Ticket, Accepted<R>)> {
        match accept(job, self.shared.slab.layout().chunk_bytes, self.refusal()) {
            Ok(job) => Some((self.ledger.open(job.id), job)),
            Err(rejected) => {
                self.fail_now(rejected);
                None
            }
        }
    }

    /// Reports a job as failed without doing anything (its grants are dropped already).
    fn fail_now(&self, job: Rejected) {
        self.shared.log.warn(
            &self.info.name,
            "job",
            format_args!("disk tier: {} refused: {}", job.id, job.why),
        );
        let outcomes = vec![KeyOutcome::Done(false); job.keys.len()];
        drop(self.split(self.ledger.open(job.id), job.kind, job.keys, outcomes));
    }

    fn launch(&self, job: DiskSplit, mut tasks: Vec<(usize, u32, u64, TaskOp)>) {
        if tasks.is_empty() {
            // Nothing to read or write: dropped here, the job is reported at once.
            return;
        }
        // Consecutive slots go in one submission, but a job keeps every thread busy.
        let max_len = shape::slots_per_submission(self.shared.max_run, tasks.len(), self.io_threads);
        // In slot order, whatever the key order: slots freed by eviction (or read last) come in
        // the order earlier runs finished, so a job's slots are mostly runs of consecutive
        // slots in shuffled order; cut in key order they become more, shorter calls.
        tasks.sort_unstable_by_key(|&(_, slot, _, _)| slot);
        let items = tasks
            .into_iter()
            .map(|(idx, slot, seq, op)| RunItem { idx, slot, seq, op })
            .collect();
        let mut runs = Run::split(&job, items, max_len, self.shared.gate.epoch());
        // Queued in the job's key order (by each run's first key), so with one thread the keys
        // still land, and enter the LRU order, in job order.
        runs.sort_by_key(|r| r.items.iter().map(|i| i.idx).min());
        let lane = if job.data().kind == JobKind::Store {
            STORES
        } else {
            LOADS
        };
        // Let go before queueing, so the last run settled reports the job on its I/O thread
        // (with `sync = "batch"`, after the job's `fdatasync`), never on the caller's.
        drop(job);
        if let Err(refused) = self.pool.queue().submit_all(lane, runs) {
            for run in refused.work {
                exec::cancel(&self.shared, run);
            }
        }
    }

    fn cancel_queued(&self) {
        // Runs queued before this point and still waiting for a permit give up at the gate
        // (and a run taken from now on with an older epoch does too); those still queued are
        // cancelled here.
        self.shared.gate.cancel_waiting();
        for lane in [LOADS, STORES] {
            for run in self.pool.queue().drain_lane(lane) {
                exec::cancel(&self.shared, run);
            }
        }
        #[cfg(feature = "test-utils")]
        if let Some(f) = self.shared.slab.faults() {
            f.drain_cancelled();
        }
    }
}

impl SecondaryTier for DiskTier {
    fn info(&self) -> TierInfo {
        self.info.clone()
    }

    fn needs_control_plane(&self) -> bool {
        // Finished reads and writes are applied between steps, so a promotion lands while the model runs.
        true
    }

    fn set_waker(&mut self, waker: ControlWaker) {
        self.ledger.set_waker(waker);
    }

    fn lookup(&mut self, key: &OffloadKey, _ctx: &ReqContext) -> LookupResult {
        // A hit is about to be promoted: mark it recent so a cascade does not evict it first.
        if self.shared.index.lock().touch(key) {
            self.shared.counters.tier.hits.add(1);
            LookupResult::Hit
        } else {
            self.shared.counters.tier.misses.add(1);
            LookupResult::Miss
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        let Some((ticket, Accepted { id, kind, keys, rows })) = self.admit(job, accept_store) else {
            return;
        };
        let mut outcomes = vec![KeyOutcome::Pending; keys.len()];
        let mut tasks = Vec::with_capacity(keys.len());
        let mut evicted = Vec::new();
        let mut first: KeyMap<usize> = KeyMap::default();
        let mut deduplicated = 0u64;
        let mut refused = 0u64;
        // Keys another job is writing: (index in this job, the slot being written).
        let mut follows: Vec<(usize, u32)> = Vec::new();
        let job = {
            let mut index = self.shared.index.lock();
            // Jobs continue where the previous one stopped: the slab is then written as a log
            // while its next slots are old, and every job's slots are consecutive.
            let mut last_slot = index.last_reserved();
            for (i, (key, row)) in keys.iter().zip(rows).enumerate() {
                if let Some(&j) = first.get(key) {
                    outcomes[i] = KeyOutcome::SameAs(j);
                    continue;
                }
                first.insert(*key, i);
                // Keys name content: a copy that is stored, or being stored, is the same. One
                // being stored is stored once that write is (see `Shared::follow`).
                match index.slot_of(key) {
                    Some((slot, SlotState::Writing { .. })) => {
                        follows.push((i, slot));
                        deduplicated += 1;
                        continue;
                    }
                    Some(_) => {
                        outcomes[i] = KeyOutcome::Done(true);
                        deduplicated += 1;
                        continue;
                    }
                    None => {}
                }
                match index.reserve(*key, last_slot) {
                    Reservation::Slot {
                        slot,
                        seq,
                        evicted: e,
                    } => {
                        last_slot = Some(slot);
                        evicted.extend(e);
                        tasks.push((i, slot, seq, TaskOp::Store(row)));
                    }
                    Reservation::Full => {
                        outcomes[i] = KeyOutcome::Done(false);
                        refused += 1;
                    }
                }
            }
            // Still under the lock the writes end under: none of them can end unseen.
            let job = self.split(ticket, kind, keys, outcomes);
            for (i, slot) in follows {
                self.shared.follow(&index, slot, job.part(vec![i]));
            }
            job
        };
        let c = &self.shared.counters;
        c.deduplicated.add(deduplicated);
        c.not_admitted.add(refused);
        c.tier.evictions.add(evicted.len() as u64);
        if refused > 0 {
            self.shared.log.warn(
                &self.info.name,
                "admission",
                format_args!(
                    "disk tier: {refused} chunk(s) of {id} not stored: every slot is being read or written"
                ),
            );
        }
        self.shared.event(evicted, true);
        self.launch(job, tasks);
    }

    fn submit_load(&mut self, job: TransferJob) {
        let Some((ticket, Accepted { kind, keys, rows, .. })) = self.admit(job, accept_load) else {
            return;
        };
        let mut outcomes = vec![KeyOutcome::Pending; keys.len()];
        let mut tasks = Vec::with_capacity(keys.len());
        {
            let mut index = self.shared.index.lock();
            for (i, (key, row)) in keys.iter().zip(rows).enumerate() {
                match index.pin(key) {
                    Some((slot, seq)) => tasks.push((i, slot, seq, TaskOp::Load(row))),
                    // Evicted (or dropped) since the lookup: the promotion of this key fails.
                    None => outcomes[i] = KeyOutcome::Done(false),
                }
            }
        }
        self.launch(self.split(ticket, kind, keys, outcomes), tasks);
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        self.ledger.take_finished(out);
    }

    fn has_pending_work(&self) -> bool {
        self.ledger.has_pending()
    }

    fn touch(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) {
        let mut index = self.shared.index.lock();
        for key in keys {
            index.touch(key);
        }
    }

    fn drain_jobs(&mut self) {
        self.cancel_queued();
        self.ledger.wait_idle(None);
    }

    fn take_events(&mut self) -> Vec<OffloadingEvent> {
        std::mem::take(&mut *self.shared.events.lock())
    }

    fn stats(&self) -> TierStats {
        let c = &self.shared.counters;
        let (resident, capacity) = {
            let index = self.shared.index.lock();
            (index.live() as u64, index.capacity() as u64)
        };
        let cost = self.io_cost();
        let extra = [
            ("direct_io", u64::from(self.shared.slab.direct())),
            ("corrupt_slots", c.corrupt.get()),
            ("io_errors", c.io_errors.get()),
            ("cancelled_keys", c.cancelled.get()),
            ("deduplicated_keys", c.deduplicated.get()),
            ("not_admitted_keys", c.not_admitted.get()),
            ("recovered_at_open", self.recovery.recovered as u64),
            ("discarded_at_open", self.recovery.discarded as u64),
            (
                "queued_chunks",
                cost.loads.queued_chunks + cost.stores.queued_chunks,
            ),
        ];
        let mut s = c.tier.stats(self.info.name.clone(), extra);
        s.resident_chunks = resident;
        s.capacity_chunks = capacity;
        for (dir, d) in [("load", cost.loads), ("store", cost.stores)] {
            s.extra
                .insert(format!("{dir}_queued_chunks"), d.queued_chunks as f64);
            s.extra
                .insert(format!("{dir}_in_flight_chunks"), d.in_flight_chunks as f64);
            if let Some(v) = d.secs_per_mib {
                s.extra.insert(format!("{dir}_secs_per_mib_ema"), v);
            }
            if let Some(v) = d.queue_wait_secs {
                s.extra.insert(format!("{dir}_queue_wait_secs_ema"), v);
            }
        }
        s
    }

    fn shutdown(&mut self) -> Result<(), TierError> {
        // Queued runs are cancelled and every job is reported; the threads then stop. A second
        // call finds nothing queued, no job open and no thread to stop.
        self.drain_jobs();
        self.pool.stop_and_join(STOP_WAIT).into_result("disk I/O")
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!(tier = %self.info.name, error = %e, "disk tier shutdown failed");
        }
    }
}
