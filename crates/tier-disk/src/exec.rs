//! What an I/O thread does with one submission: write consecutive slots from primary rows, or
//! read consecutive slots into primary rows and verify each, then settle every key's outcome in
//! the index and the run's part of its job.

use std::fmt;
use std::io::{self, IoSlice, IoSliceMut};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use tiering_core::OffloadKey;

use crate::buf::AlignedBuf;
use crate::format::{BLOCK, SlabLayout, SlotDefect, SlotSeal, verify_slot};
use crate::index::SlotState;
use crate::options::SyncPolicy;
use crate::shared::{KeyOutcome, Run, RunItem, Shared, TaskOp, settle_followers};

/// Per-thread scratch: for each slot of the longest run, its padding and seal block.
pub(crate) struct Scratch {
    tails: AlignedBuf,
    tail_len: usize,
    /// A read put slot bytes into the tails: the next write zeroes them in full. Until then a
    /// write's tails hold only zeros and earlier seals, so it rewrites the seal's own bytes and
    /// nothing else (zeroing a 4 KiB block per 16 KiB slot was a tenth of a store call's CPU).
    read_into: bool,
}

impl Scratch {
    pub(crate) fn new(layout: &SlabLayout, max_run: usize) -> io::Result<Self> {
        let tail_len = layout.pad() + BLOCK;
        Ok(Self {
            tails: AlignedBuf::zeroed(tail_len * max_run.max(1))?,
            tail_len,
            read_into: false,
        })
    }
}

/// Why a load failed.
enum LoadError {
    Io(io::Error),
    Defect(SlotDefect),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io(e) => write!(f, "read error: {e}"),
            Self::Defect(d) => write!(f, "{d}"),
        }
    }
}

fn panicked() -> io::Error {
    io::Error::other("I/O task panicked")
}

fn mismatched() -> io::Error {
    io::Error::other("a run mixes loads and stores or is longer than the scratch space")
}

/// Writes the rows of `items` (consecutive slots) as the writes their items name: the seals
/// are built first, then, holding a permit of the I/O gate, one vectored write of
/// `payload | padding + seal` per slot and `fdatasync` when every write must be durable.
/// Returns how long the permit was held, or `None` when the run was cancelled while it waited.
fn write_run(
    shared: &Shared,
    scratch: &mut Scratch,
    keys: &[OffloadKey],
    items: &[RunItem],
    epoch: u64,
) -> io::Result<Option<Duration>> {
    let pad = shared.slab.layout().pad();
    let tail_len = scratch.tail_len;
    if items.len() * tail_len > scratch.tails.len() {
        return Err(mismatched());
    }
    if scratch.read_into {
        scratch.tails.fill(0);
        scratch.read_into = false;
    }
    for (item, tail) in items.iter().zip(scratch.tails.chunks_mut(tail_len)) {
        let TaskOp::Store(row) = &item.op else {
            return Err(mismatched());
        };
        let key = keys.get(item.idx).ok_or_else(mismatched)?;
        SlotSeal::encode_fields(item.seq, key, row, &mut tail[pad..]);
    }
    let mut iov = Vec::with_capacity(items.len() * 2);
    for (item, tail) in items.iter().zip(scratch.tails.chunks(tail_len)) {
        if let TaskOp::Store(row) = &item.op {
            iov.push(IoSlice::new(row));
            iov.push(IoSlice::new(tail));
        }
    }
    let first = items.first().map_or(0, |i| i.slot);
    let Some(_permit) = shared.gate.enter(epoch) else {
        return Ok(None);
    };
    let started = Instant::now();
    shared.slab.write_run(first, items.len(), &mut iov)?;
    if shared.sync == SyncPolicy::Always {
        shared.slab.sync()?;
    }
    Ok(Some(started.elapsed()))
}

/// What a read of a run found: each slot's verdict, and how long the read held its permit.
type ReadRun = (Vec<Result<(), SlotDefect>>, Duration);

/// Reads the slots of `items` (consecutive) into their rows with one vectored read, holding a
/// permit of the I/O gate, then verifies each against the key and write number the index expects.
/// Returns the verdicts and how long the permit was held, or `None` when the run was cancelled
/// while it waited.
fn read_run(
    shared: &Shared,
    scratch: &mut Scratch,
    keys: &[OffloadKey],
    items: &mut [RunItem],
    epoch: u64,
) -> io::Result<Option<ReadRun>> {
    let layout = *shared.slab.layout();
    let tail_len = scratch.tail_len;
    if items.len() * tail_len > scratch.tails.len() {
        return Err(mismatched());
    }
    let first = items.first().map_or(0, |i| i.slot);
    let Some(permit) = shared.gate.enter(epoch) else {
        return Ok(None);
    };
    let started = Instant::now();
    scratch.read_into = true;
    let got = {
        let mut iov = Vec::with_capacity(items.len() * 2);
        for (item, tail) in items.iter_mut().zip(scratch.tails.chunks_mut(tail_len)) {
            let TaskOp::Load(row) = &mut item.op else {
                return Err(mismatched());
            };
            iov.push(IoSliceMut::new(row));
            iov.push(IoSliceMut::new(tail));
        }
        shared.slab.read_run(first, &mut iov)?
    };
    let took = started.elapsed();
    // The check below is CPU work: another thread's call goes to the device meanwhile.
    drop(permit);
    let slot_bytes = layout.chunk_bytes + tail_len;
    let verdicts = items
        .iter()
        .zip(scratch.tails.chunks(tail_len))
        .enumerate()
        .map(|(i, (item, tail))| {
            if got < (i + 1) * slot_bytes {
                return Err(SlotDefect::ShortRead);
            }
            let (TaskOp::Load(row), Some(key)) = (&item.op, keys.get(item.idx)) else {
                return Err(SlotDefect::WrongOccupant);
            };
            verify_slot(row, &tail[layout.pad()..], key, item.seq).map(|_| ())
        })
        .collect();
    Ok(Some((verdicts, took)))
}

/// Panics, as a bug at this point would, while the injected fault `armed` reports is on.
#[cfg(feature = "test-utils")]
fn inject_panic(shared: &Shared, armed: fn(&crate::faults::FaultInjector) -> bool, what: &str) {
    if shared.slab.faults().is_some_and(armed) {
        panic!("injected fault: panic while {what}");
    }
}

/// Runs one submission to completion and settles its keys; its I/O call waits for a permit of
/// the I/O gate in the run's epoch (a run still waiting when the gate moves on is cancelled
/// instead). Returns the bytes moved and how long the I/O took, when it succeeded.
pub(crate) fn run(shared: &Shared, scratch: &mut Scratch, mut run: Run) -> Option<(u64, Duration)> {
    let load = run.is_load();
    let bytes = (run.items.len() * shared.slab.layout().chunk_bytes) as u64;
    // An emulated slow device: the delay is part of the I/O time the meters see.
    let delay = shared.io_delay;
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
    if load {
        let read = catch_unwind(AssertUnwindSafe(|| {
            read_run(shared, scratch, &run.part.job().keys, &mut run.items, run.epoch)
        }))
        .unwrap_or_else(|_| Err(panicked()));
        let read = match read {
            Ok(Some((verdicts, took))) => Ok((verdicts, took)),
            Ok(None) => {
                cancel(shared, run);
                return None;
            }
            Err(e) => Err(e),
        };
        let Run { part, items, .. } = run;
        // From here a panic releases the run's pins (the pool catches it and fails the job).
        // Declared after `part`, so it is dropped first: the pins are released before the job
        // is reported.
        let mut pins = HeldPins {
            shared,
            slots: items.iter().map(|i| Some(i.slot)).collect(),
        };
        #[cfg(feature = "test-utils")]
        inject_panic(
            shared,
            crate::faults::FaultInjector::panics_settling_loads,
            "settling a load's read",
        );
        let sample = read.as_ref().ok().map(|(_, took)| (bytes, *took + delay));
        let verdicts: Vec<Result<(), LoadError>> = match read {
            Ok((v, _)) => v.into_iter().map(|r| r.map_err(LoadError::Defect)).collect(),
            Err(e) => {
                let kind = e.kind();
                let msg = e.to_string();
                (0..items.len())
                    .map(|_| Err(LoadError::Io(io::Error::new(kind, msg.clone()))))
                    .collect()
            }
        };
        // The rows are filled; release them before the bookkeeping. Each item keeps its place
        // in the run, where `pins` holds its pin.
        let mut items: Vec<(usize, u32, Result<(), LoadError>, usize)> = items
            .into_iter()
            .zip(verdicts)
            .enumerate()
            .map(|(at, (i, v))| (i.idx, i.slot, v, at))
            .collect();
        // The run went in slot order; its keys become recent in the job's key order.
        items.sort_unstable_by_key(|&(idx, ..)| idx);
        {
            // One lock for the run's good slots (the usual case: all of them).
            let mut index = shared.index.lock();
            for (_, slot, verdict, at) in &items {
                if verdict.is_ok() && pins.forget(*at) {
                    index.unpin(*slot, true);
                }
            }
        }
        for (idx, slot, verdict, at) in &items {
            if let Err(e) = verdict {
                #[cfg(feature = "test-utils")]
                inject_panic(
                    shared,
                    crate::faults::FaultInjector::panics_dropping_unreadable,
                    "dropping an unreadable key",
                );
                let dropped = part
                    .job()
                    .keys
                    .get(*idx)
                    .and_then(|key| drop_unreadable(shared, *slot, key, e));
                pins.release(*at);
                if let Some(k) = dropped {
                    shared.event(vec![k], true);
                }
            }
        }
        part.settle(
            items
                .iter()
                .map(|(idx, _, v, _)| (*idx, KeyOutcome::Done(v.is_ok()))),
        );
        sample
    } else {
        let written = catch_unwind(AssertUnwindSafe(|| {
            write_run(shared, scratch, &run.part.job().keys, &run.items, run.epoch)
        }))
        .unwrap_or_else(|_| Err(panicked()));
        let (written, took) = match written {
            Ok(Some(took)) => (Ok(()), took + delay),
            Ok(None) => {
                cancel(shared, run);
                return None;
            }
            Err(e) => (Err(e), Duration::ZERO),
        };
        let Run { part, items, .. } = run;
        // The primary rows are no longer needed; the manager's pins last until the result.
        let mut unsettled = UnsettledWrites {
            shared,
            writes: items.iter().map(|i| (i.slot, i.seq)).collect(),
        };
        let mut slots: Vec<(usize, u32)> = items.into_iter().map(|i| (i.idx, i.slot)).collect();
        #[cfg(feature = "test-utils")]
        inject_panic(
            shared,
            crate::faults::FaultInjector::panics_settling_writes,
            "settling a store's write",
        );
        // The run went in slot order; its keys enter the LRU order in the job's key order.
        slots.sort_unstable_by_key(|&(idx, _)| idx);
        if let Err(e) = &written {
            shared.counters.io_errors.add(1);
            let first = slots.first().and_then(|&(idx, _)| part.job().keys.get(idx));
            shared.log.warn(
                &shared.name,
                "store",
                format_args!(
                    "disk tier: storing {} chunk(s) from {} failed, they are not kept: {e}",
                    slots.len(),
                    first.map_or_else(String::new, ToString::to_string)
                ),
            );
        }
        // Stores of the same keys by later jobs, waiting for these writes (settled after the lock).
        let mut ended = Vec::new();
        let outcomes: Vec<(usize, KeyOutcome)> = if written.is_ok() && shared.sync == SyncPolicy::Batch {
            slots
                .iter()
                .map(|&(idx, slot)| (idx, KeyOutcome::Unsynced(slot)))
                .collect()
        } else {
            // One lock for the whole run.
            let mut index = shared.index.lock();
            slots
                .iter()
                .map(|&(idx, slot)| {
                    let (ok, followers) = shared.end_write(&mut index, slot, written.is_ok());
                    ended.push((followers, ok));
                    (
                        idx,
                        if ok {
                            KeyOutcome::Written
                        } else {
                            KeyOutcome::Done(false)
                        },
                    )
                })
                .collect()
        };
        // Committed or aborted above, or (`sync = "batch"`) the job's to flip once it is settled.
        unsettled.writes.clear();
        part.settle(outcomes);
        for (followers, ok) in ended {
            settle_followers(followers, ok);
        }
        written.is_ok().then_some((bytes, took))
    }
}

/// The slots of a store run whose write returned and which are not yet committed, aborted or
/// handed to their job: if the thread panics before they are (the pool catches it and fails the
/// job), dropping this aborts them, or they would stay `Writing` for good, and a later store of
/// their keys would wait for a write that never ends.
struct UnsettledWrites<'a> {
    shared: &'a Shared,
    /// Each write's slot and write number (a slot this run did end may carry another write by
    /// now, which is not this guard's to abort).
    writes: Vec<(u32, u64)>,
}

impl Drop for UnsettledWrites<'_> {
    fn drop(&mut self) {
        if self.writes.is_empty() {
            return;
        }
        let mut followers = Vec::new();
        {
            let mut index = self.shared.index.lock();
            for &(slot, seq) in &self.writes {
                if matches!(index.state(slot), Some(SlotState::Writing { seq: s, .. }) if s == seq) {
                    followers.extend(self.shared.end_write(&mut index, slot, false).1);
                }
            }
        }
        settle_followers(followers, false);
    }
}

/// The pins a load run holds, by the run's position, until it releases each (`None` once
/// released): if the thread panics before it has released them all (the pool catches it and
/// fails the job), dropping this releases the rest, or their slots would stay pinned until the
/// tier is reopened, never evicted nor reused.
struct HeldPins<'a> {
    shared: &'a Shared,
    slots: Vec<Option<u32>>,
}

impl HeldPins<'_> {
    /// Hands the pin at run position `at` to the caller, which releases it; `false` when it is
    /// no longer held.
    fn forget(&mut self, at: usize) -> bool {
        self.slots.get_mut(at).and_then(Option::take).is_some()
    }

    /// Releases the pin at run position `at`, if still held.
    fn release(&mut self, at: usize) {
        if let Some(slot) = self.slots.get_mut(at).and_then(Option::take) {
            self.shared.index.lock().unpin(slot, false);
        }
    }
}

impl Drop for HeldPins<'_> {
    fn drop(&mut self) {
        if self.slots.iter().all(Option::is_none) {
            return;
        }
        let mut index = self.shared.index.lock();
        for slot in self.slots.iter_mut().filter_map(Option::take) {
            index.unpin(slot, false);
        }
    }
}

/// A slot that failed to load: drop the key (it becomes a miss) and erase the seal of a slot
/// whose content is bad so it does not come back after a restart. The caller still holds its
/// pin (the slot stays retired, unused, while its seal is erased) and releases it next; the key
/// dropped, if it was still the slot's, is returned for the removal event.
fn drop_unreadable(shared: &Shared, slot: u32, key: &OffloadKey, e: &LoadError) -> Option<OffloadKey> {
    let dropped = shared.index.lock().retire(slot);
    let defect = matches!(e, LoadError::Defect(d) if *d != SlotDefect::ShortRead);
    if defect {
        shared.counters.corrupt.add(1);
        // The slot stays pinned (retired) while its seal is erased, so no store reuses it
        // before this write lands.
        if let Err(err) = shared.slab.invalidate(slot, &shared.zero_block) {
            shared.counters.io_errors.add(1);
            shared.log.warn(
                &shared.name,
                "invalidate",
                format_args!("disk tier: cannot erase bad slot {slot}: {err}"),
            );
        }
    } else {
        shared.counters.io_errors.add(1);
    }
    shared.log.warn(
        &shared.name,
        if defect { "corrupt" } else { "load" },
        format_args!("disk tier: loading {key} failed ({e}); the chunk is dropped"),
    );
    dropped
}

/// Settles a submission that never ran (cancelled by `drain_jobs` or `shutdown`) as failed.
pub(crate) fn cancel(shared: &Shared, run: Run) {
    let Run { part, items, .. } = run;
    let n = items.len() as u64;
    let mut idxs = Vec::with_capacity(items.len());
    let mut followers = Vec::new();
    {
        let mut index = shared.index.lock();
        for RunItem { idx, slot, op, .. } in items {
            match op {
                TaskOp::Store(_) => followers.extend(shared.end_write(&mut index, slot, false).1),
                TaskOp::Load(_) => index.unpin(slot, false),
            }
            idxs.push(idx);
        }
    }
    shared.counters.cancelled.add(n);
    part.settle(idxs.into_iter().map(|idx| (idx, KeyOutcome::Done(false))));
    settle_followers(followers, false);
}
