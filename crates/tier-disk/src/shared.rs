//! State shared by the tier handle and its I/O threads: the slab, the index, the I/O gate,
//! events, counters and meters, what travels on the queue (runs of consecutive slots, each a
//! `tier_kit::Part` of its job), and how a job's per-key outcomes become its one result (the
//! tier's `tier_kit::JobFinisher`). Exactly one result per job, the ledger, the queue and the
//! threads are `tier-kit`'s.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tier_kit::{Counter, JobFinisher, JobKeys, Part, RateLimitedLog, SplitJob, Ticket, TierCounters};
use tiering_core::{
    JobKind, Locality, Medium, OffloadKey, OffloadingEvent,
    arena::{RowRead, RowWrite},
};

use crate::buf::AlignedBuf;
use crate::gate::IoGate;
use crate::index::Index;
use crate::meter::DirectionCost;
use crate::options::SyncPolicy;
use crate::slab::Slab;

/// Cumulative counters, updated without the index lock: the standard ones, then the tier's own.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) tier: TierCounters,
    pub(crate) corrupt: Counter,
    pub(crate) io_errors: Counter,
    pub(crate) cancelled: Counter,
    pub(crate) deduplicated: Counter,
    pub(crate) not_admitted: Counter,
}

/// How one key of a job ended (or is still going).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyOutcome {
    /// A run carrying it is queued or running. A run dropped unsettled (its thread panicked)
    /// leaves its keys here: they count as failed.
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

/// A job being cut into runs; it is reported when its last run is settled.
pub(crate) type DiskSplit = SplitJob<JobKeys, KeyOutcome>;

/// The keys of a store job that another job is writing already: they end as that write ends
/// (see [`Shared::follow`]).
pub(crate) type Follower = Part<JobKeys, KeyOutcome>;

/// Settles `followers` of a write that ended: stored (`ok`) or not. Called without the index
/// lock, since settling a job's last part finishes the job, which may take it.
pub(crate) fn settle_followers(followers: Vec<Follower>, ok: bool) {
    for part in followers {
        let idxs = part.indices().to_vec();
        part.settle(idxs.into_iter().map(|i| (i, KeyOutcome::Done(ok))));
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
    /// The job's share this run carries: settled once with its keys' outcomes.
    pub(crate) part: Part<JobKeys, KeyOutcome>,
    /// In slot order; `items[i].slot == items[0].slot + i`.
    pub(crate) items: Vec<RunItem>,
    /// When it was queued.
    pub(crate) queued: Instant,
    /// The I/O gate's epoch when it was queued: a `drain_jobs` since then cancels it at the
    /// gate instead of running it.
    pub(crate) epoch: u64,
}

impl Run {
    /// Whether this run reads slots into primary rows.
    pub(crate) fn is_load(&self) -> bool {
        matches!(self.items.first().map(|i| &i.op), Some(TaskOp::Load(_)))
    }

    /// Splits a job's items, given in slot order, into runs of at most `max_len` items whose
    /// slots follow each other, queued now in gate epoch `epoch`.
    pub(crate) fn split(job: &DiskSplit, items: Vec<RunItem>, max_len: usize, epoch: u64) -> Vec<Self> {
        let mut groups: Vec<Vec<RunItem>> = Vec::new();
        for item in items {
            match groups.last_mut() {
                Some(g)
                    if g.len() < max_len
                        && g.last().is_some_and(|l| l.slot.checked_add(1) == Some(item.slot)) =>
                {
                    g.push(item);
                }
                _ => groups.push(vec![item]),
            }
        }
        let queued = Instant::now();
        groups
            .into_iter()
            .map(|items| Self {
                part: job.part(items.iter().map(|i| i.idx).collect()),
                items,
                queued,
                epoch,
            })
            .collect()
    }
}

/// Everything the I/O threads share with the handle.
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) slab: Slab,
    pub(crate) index: Mutex<Index>,
    pub(crate) sync: SyncPolicy,
    /// At most `io_threads` slot I/O calls in flight.
    pub(crate) gate: IoGate,
    pub(crate) events: Mutex<Vec<OffloadingEvent>>,
    pub(crate) counters: Counters,
    pub(crate) log: RateLimitedLog,
    /// A zeroed block, written over the seal of a slot found corrupt.
    pub(crate) zero_block: AlignedBuf,
    /// Most slots one vectored read or write covers.
    pub(crate) max_run: usize,
    /// Measured cost of loads and stores.
    pub(crate) meters: Mutex<(DirectionCost, DirectionCost)>,
    /// Sleep before each submission's I/O (the `inject_io_delay` option; zero: none).
    pub(crate) io_delay: Duration,
    /// Store keys waiting for the write of the same key into a slot, by slot. Locked only while
    /// holding the index lock, under which slots start and end their writes.
    followers: Mutex<HashMap<u32, Vec<Follower>>>,
}

impl Shared {
    /// The state of a tier with at most `io_threads` slot I/O calls in flight.
    pub(crate) fn new(
        name: String,
        slab: Slab,
        index: Index,
        sync: SyncPolicy,
        max_run: usize,
        io_threads: usize,
        io_delay: Duration,
    ) -> std::io::Result<Self> {
        Ok(Self {
            name,
            slab,
            index: Mutex::new(index),
            sync,
            gate: IoGate::new(io_threads),
            events: Mutex::new(Vec::new()),
            counters: Counters::default(),
            log: RateLimitedLog::new(Duration::from_secs(10)),
            zero_block: AlignedBuf::zeroed(crate::format::BLOCK)?,
            max_run: max_run.max(1),
            meters: Mutex::new((DirectionCost::default(), DirectionCost::default())),
            io_delay,
            followers: Mutex::new(HashMap::new()),
        })
    }

    /// Makes `part` wait for the write in flight into `slot` (of the same key, by another job):
    /// a store must not report a key stored before it is, least of all under `sync = "always"`
    /// before the write is durable, nor report it stored when that write then fails. The caller
    /// holds the index lock, under which the slot is `Writing`, and whoever commits or aborts
    /// the write takes the followers ([`Shared::end_write`]).
    pub(crate) fn follow(&self, _index: &Index, slot: u32, part: Follower) {
        self.followers.lock().entry(slot).or_default().push(part);
    }

    /// Ends the write into `slot`: commits it when it `landed` (and is still being written),
    /// aborts it otherwise. Returns whether the key is now stored, and the stores that waited
    /// for this write, for the caller to settle ([`settle_followers`]) once it let go of the
    /// index lock it holds.
    pub(crate) fn end_write(&self, index: &mut Index, slot: u32, landed: bool) -> (bool, Vec<Follower>) {
        let stored = landed && index.commit(slot);
        if !stored {
            index.abort(slot);
        }
        let mut waiting = self.followers.lock();
        let followers = if waiting.is_empty() {
            Vec::new()
        } else {
            waiting.remove(&slot).unwrap_or_default()
        };
        (stored, followers)
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

    /// `sync = batch`: one `fdatasync` for the job, then its written slots become visible (or,
    /// when the sync fails, free again).
    fn flip_unsynced(&self, outcomes: &mut [KeyOutcome]) {
        if !outcomes.iter().any(|o| matches!(o, KeyOutcome::Unsynced(_))) {
            return;
        }
        let synced = self.slab.sync();
        if let Err(e) = &synced {
            self.counters.io_errors.add(1);
            self.log.warn(
                &self.name,
                "sync",
                format_args!("disk tier: fdatasync failed, the job's chunks are dropped: {e}"),
            );
        }
        let mut ended = Vec::new();
        {
            let mut index = self.index.lock();
            for o in outcomes.iter_mut() {
                if let KeyOutcome::Unsynced(slot) = *o {
                    let (stored, followers) = self.end_write(&mut index, slot, synced.is_ok());
                    *o = if stored {
                        KeyOutcome::Written
                    } else {
                        KeyOutcome::Done(false)
                    };
                    ended.push((followers, stored));
                }
            }
        }
        for (followers, ok) in ended {
            settle_followers(followers, ok);
        }
    }
}

impl JobFinisher<JobKeys, KeyOutcome> for Shared {
    /// Turns the per-key outcomes into the job's one result: runs the batch `fdatasync` and
    /// flips its slots, counts, emits the store event and reports the ticket.
    fn finish(&self, job: &JobKeys, mut outcomes: Vec<KeyOutcome>, ticket: Ticket) {
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
        let ok = succeeded.iter().filter(|s| **s).count() as u64;
        // A store moved the keys it wrote (not those it already held); a load, every good key.
        let moved = if job.kind == JobKind::Store {
            written.len() as u64
        } else {
            ok
        };
        let bytes = moved * self.slab.layout().chunk_bytes as u64;
        self.counters
            .tier
            .count_job(job.kind, moved, succeeded.len() as u64 - ok, bytes);
        self.event(written, false);
        ticket.complete_keys(&job.keys, &succeeded, bytes);
    }
}
