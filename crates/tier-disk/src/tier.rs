//! [`DiskTier`]: the [`SecondaryTier`] over one slab file.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tiering_core::{
    ControlWaker, JobId, JobKind, JobResult, KeyMap, Locality, LookupResult, Medium, OffloadKey,
    OffloadingEvent, ReqContext, SecondaryTier, TierError, TierInfo, TierStats, TransferJob,
};

use crate::error::DiskError;
use crate::exec;
#[cfg(feature = "test-utils")]
use crate::faults::FaultInjector;
use crate::format::SlabLayout;
use crate::index::{Index, Reservation, SlotState};
use crate::meter::IoCost;
use crate::options::{DiskGeometry, DiskTierOptions};
use crate::pool::Pool;
use crate::recover;
use crate::shape;
use crate::shared::{Counters, JobState, KeyOutcome, Run, RunItem, Shared, TaskOp};
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

/// The persistent, bounded disk tier. See the crate documentation.
pub struct DiskTier {
    shared: Arc<Shared>,
    pool: Pool,
    info: TierInfo,
    recovery: RecoveryReport,
    shut_down: bool,
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
                opts.inject_io_delay.get(),
            )
            .map_err(io("allocating buffers for"))?,
        );
        shared.event(recovered_keys, false);
        let pool = Pool::start(&shared, opts.io_threads).map_err(io("starting I/O threads for"))?;
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
            shared,
            pool,
            info: TierInfo::new(opts.name.clone(), Some(Medium::Storage), Some(Locality::Local)),
            recovery,
            shut_down: false,
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
        let (mut loads, mut stores) = self.pool.depths();
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

    /// Reports a job as failed without doing anything (its grants drop with the caller's job).
    fn fail_now(&self, id: JobId, kind: JobKind, keys: &[OffloadKey], why: &str) {
        self.shared.log.warn(
            &self.info.name,
            "job",
            format_args!("disk tier: {id} refused: {why}"),
        );
        let state = JobState::new(
            id,
            kind,
            keys.to_vec(),
            vec![KeyOutcome::Done(false); keys.len()],
            Instant::now(),
        );
        self.shared.job_submitted();
        self.shared.finalize(&state);
    }

    /// Common checks of a submitted job; `None` when it was refused (and already reported).
    fn admit(&self, job: TransferJob, kind: JobKind) -> Option<TransferJob> {
        let refusal = if self.shut_down {
            Some("the tier is shut down")
        } else {
            job.defect(kind, self.shared.slab.layout().chunk_bytes)
        };
        match refusal {
            Some(why) => {
                self.fail_now(job.id, job.kind, &job.keys, why);
                None
            }
            None => Some(job),
        }
    }

    fn launch(&self, state: JobState, mut tasks: Vec<(usize, u32, u64, TaskOp)>) {
        let job = Arc::new(state);
        self.shared.job_submitted();
        if tasks.is_empty() {
            self.shared.finalize(&job);
            return;
        }
        debug_assert!(!job.settled());
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
        let mut runs = Run::split(&job, items, max_len, Instant::now());
        // Queued in the job's key order (by each run's first key), so with one thread the keys
        // still land, and enter the LRU order, in job order.
        runs.sort_by_key(|r| r.items.iter().map(|i| i.idx).min());
        self.pool.push(runs);
    }

    fn cancel_queued(&self) {
        for run in self.pool.take_queued() {
            exec::cancel(&self.shared, run);
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
        *self.shared.waker.lock() = Some(waker);
    }

    fn lookup(&mut self, key: &OffloadKey, _ctx: &ReqContext) -> LookupResult {
        // A hit is about to be promoted: mark it recent so a cascade does not evict it first.
        if self.shared.index.lock().touch(key) {
            Counters::add(&self.shared.counters.hits, 1);
            LookupResult::Hit
        } else {
            Counters::add(&self.shared.counters.misses, 1);
            LookupResult::Miss
        }
    }

    fn submit_store(&mut self, job: TransferJob) {
        let Some(job) = self.admit(job, JobKind::Store) else {
            return;
        };
        let TransferJob {
            id, kind, keys, rows, ..
        } = job;
        let Ok(rows) = rows.into_reads() else {
            self.fail_now(id, kind, &keys, "a store came with write grants");
            return;
        };
        let submitted = Instant::now();
        let mut outcomes = vec![KeyOutcome::Pending; keys.len()];
        let mut tasks = Vec::with_capacity(keys.len());
        let mut evicted = Vec::new();
        let mut first: KeyMap<usize> = KeyMap::default();
        let mut deduplicated = 0u64;
        let mut refused = 0u64;
        {
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
                if index.holds(key) {
                    // Keys name content: a copy that is stored (or being stored) is the same.
                    outcomes[i] = KeyOutcome::Done(true);
                    deduplicated += 1;
                    continue;
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
        }
        let c = &self.shared.counters;
        Counters::add(&c.deduplicated, deduplicated);
        Counters::add(&c.not_admitted, refused);
        Counters::add(&c.evictions, evicted.len() as u64);
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
        self.launch(JobState::new(id, kind, keys, outcomes, submitted), tasks);
    }

    fn submit_load(&mut self, job: TransferJob) {
        let Some(job) = self.admit(job, JobKind::Promotion) else {
            return;
        };
        let TransferJob {
            id, kind, keys, rows, ..
        } = job;
        let Ok(rows) = rows.into_writes() else {
            self.fail_now(id, kind, &keys, "a promotion came with read grants");
            return;
        };
        let submitted = Instant::now();
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
        self.launch(JobState::new(id, kind, keys, outcomes, submitted), tasks);
    }

    fn poll_finished(&mut self, out: &mut Vec<JobResult>) {
        out.append(&mut self.shared.done.lock().results);
    }

    fn has_pending_work(&self) -> bool {
        let done = self.shared.done.lock();
        done.outstanding > 0 || !done.results.is_empty()
    }

    fn touch(&mut self, keys: &[OffloadKey], _ctx: &ReqContext) {
        let mut index = self.shared.index.lock();
        for key in keys {
            index.touch(key);
        }
    }

    fn drain_jobs(&mut self) {
        self.cancel_queued();
        self.shared.wait_idle();
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
        let mut s = TierStats::named(self.info.name.clone());
        s.hits = Counters::get(&c.hits);
        s.misses = Counters::get(&c.misses);
        s.stores = Counters::get(&c.stores);
        s.loads = Counters::get(&c.loads);
        s.evictions = Counters::get(&c.evictions);
        s.failures = Counters::get(&c.failures);
        s.bytes_written = Counters::get(&c.bytes_written);
        s.bytes_read = Counters::get(&c.bytes_read);
        s.resident_chunks = resident;
        s.capacity_chunks = capacity;
        let extra = [
            ("direct_io", u64::from(self.shared.slab.direct())),
            ("corrupt_slots", Counters::get(&c.corrupt)),
            ("io_errors", Counters::get(&c.io_errors)),
            ("cancelled_keys", Counters::get(&c.cancelled)),
            ("deduplicated_keys", Counters::get(&c.deduplicated)),
            ("not_admitted_keys", Counters::get(&c.not_admitted)),
            ("recovered_at_open", self.recovery.recovered as u64),
            ("discarded_at_open", self.recovery.discarded as u64),
            ("queued_chunks", self.pool.queued()),
        ];
        for (name, value) in extra {
            s.extra.insert(name.to_owned(), value as f64);
        }
        let cost = self.io_cost();
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
        if self.shut_down {
            return Ok(());
        }
        self.shut_down = true;
        self.drain_jobs();
        let panicked = self.pool.stop_and_join();
        if panicked > 0 {
            return Err(TierError::Other(format!(
                "{panicked} disk I/O thread(s) panicked"
            )));
        }
        Ok(())
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!(tier = %self.info.name, error = %e, "disk tier shutdown failed");
        }
    }
}
