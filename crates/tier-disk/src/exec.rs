//! What an I/O thread does with one task: write a slot from a primary row, or read a slot into
//! a primary row and verify it, then settle the key's outcome in the index and the job.

use std::fmt;
use std::io::{self, IoSlice, IoSliceMut};
use std::panic::{AssertUnwindSafe, catch_unwind};

use tiering_core::OffloadKey;

use crate::buf::AlignedBuf;
use crate::format::{BLOCK, SlabLayout, SlotCommit, SlotDefect, SlotHeader, verify_slot};
use crate::options::SyncPolicy;
use crate::shared::{Counters, KeyOutcome, Shared, Task, TaskOp};

/// Per-thread scratch blocks: the header block and the padding + commit block of a slot.
pub(crate) struct Scratch {
    header: AlignedBuf,
    tail: AlignedBuf,
}

impl Scratch {
    pub(crate) fn new(layout: &SlabLayout) -> io::Result<Self> {
        Ok(Self {
            header: AlignedBuf::zeroed(BLOCK)?,
            tail: AlignedBuf::zeroed(layout.pad() + BLOCK)?,
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

/// Writes `row` as write `seq` of `key` into `slot`: one vectored write of header, payload,
/// padding and commit block, then `fdatasync` when every write must be durable.
fn write_slot(
    shared: &Shared,
    scratch: &mut Scratch,
    slot: u32,
    seq: u64,
    key: &OffloadKey,
    row: &[u8],
) -> io::Result<()> {
    let pad = shared.slab.layout().pad();
    // The scratch blocks may hold bytes of the last slot this thread read.
    scratch.tail[..pad].fill(0);
    let header = SlotHeader::encode_for(seq, key, row, &mut scratch.header);
    SlotCommit::sealing(&header).encode(&mut scratch.tail[pad..]);
    shared.slab.write_slot(
        slot,
        &mut [
            IoSlice::new(&scratch.header),
            IoSlice::new(row),
            IoSlice::new(&scratch.tail),
        ],
    )?;
    if shared.sync == SyncPolicy::Always {
        shared.slab.sync()?;
    }
    Ok(())
}

/// Reads `slot` into `row` and verifies it is write `seq` of `key`, intact.
fn read_slot(
    shared: &Shared,
    scratch: &mut Scratch,
    slot: u32,
    seq: u64,
    key: &OffloadKey,
    row: &mut [u8],
) -> Result<(), LoadError> {
    let layout = shared.slab.layout();
    let want = 2 * BLOCK + layout.payload_span;
    let got = shared
        .slab
        .read_slot(
            slot,
            &mut [
                IoSliceMut::new(&mut scratch.header),
                IoSliceMut::new(row),
                IoSliceMut::new(&mut scratch.tail),
            ],
        )
        .map_err(LoadError::Io)?;
    if got < want {
        return Err(LoadError::Defect(SlotDefect::ShortRead));
    }
    verify_slot(&scratch.header, row, &scratch.tail[layout.pad()..], key, seq)
        .map(|_| ())
        .map_err(LoadError::Defect)
}

/// Runs one task to completion and settles its key.
pub(crate) fn run(shared: &Shared, scratch: &mut Scratch, task: Task) {
    let Task {
        job,
        idx,
        slot,
        seq,
        op,
    } = task;
    let key = job.keys[idx];
    match op {
        TaskOp::Store(row) => {
            let written = catch_unwind(AssertUnwindSafe(|| {
                write_slot(shared, scratch, slot, seq, &key, &row)
            }))
            .unwrap_or_else(|_| Err(panicked()));
            // The primary row is no longer needed; the manager's pin lasts until the result.
            drop(row);
            let outcome = match written {
                Ok(()) if shared.sync == SyncPolicy::Batch => KeyOutcome::Unsynced(slot),
                Ok(()) => {
                    if shared.index.lock().commit(slot) {
                        KeyOutcome::Written
                    } else {
                        KeyOutcome::Done(false)
                    }
                }
                Err(e) => {
                    shared.index.lock().abort(slot);
                    Counters::add(&shared.counters.io_errors, 1);
                    shared.log.warn(
                        &shared.name,
                        "store",
                        format_args!("disk tier: storing {key} failed, the chunk is not kept: {e}"),
                    );
                    KeyOutcome::Done(false)
                }
            };
            shared.settle(&job, idx, outcome);
        }
        TaskOp::Load(mut row) => {
            let read = catch_unwind(AssertUnwindSafe(|| {
                read_slot(shared, scratch, slot, seq, &key, &mut row)
            }))
            .unwrap_or_else(|_| Err(LoadError::Io(panicked())));
            drop(row);
            let ok = match read {
                Ok(()) => {
                    shared.index.lock().unpin(slot, true);
                    true
                }
                Err(e) => {
                    drop_unreadable(shared, slot, &key, &e);
                    false
                }
            };
            shared.settle(&job, idx, KeyOutcome::Done(ok));
        }
    }
}

/// A slot that failed to load: drop the key (it becomes a miss), erase the header of a slot
/// whose content is bad so it does not come back after a restart, then release the pin.
fn drop_unreadable(shared: &Shared, slot: u32, key: &OffloadKey, e: &LoadError) {
    let dropped = shared.index.lock().retire(slot);
    let defect = matches!(e, LoadError::Defect(d) if *d != SlotDefect::ShortRead);
    if defect {
        Counters::add(&shared.counters.corrupt, 1);
        // The slot stays pinned (retired) while its header is erased, so no store reuses it
        // before this write lands.
        if let Err(err) = shared.slab.invalidate(slot, &shared.zero_block) {
            Counters::add(&shared.counters.io_errors, 1);
            shared.log.warn(
                &shared.name,
                "invalidate",
                format_args!("disk tier: cannot erase bad slot {slot}: {err}"),
            );
        }
    } else {
        Counters::add(&shared.counters.io_errors, 1);
    }
    shared.log.warn(
        &shared.name,
        if defect { "corrupt" } else { "load" },
        format_args!("disk tier: loading {key} failed ({e}); the chunk is dropped"),
    );
    shared.index.lock().unpin(slot, false);
    if let Some(k) = dropped {
        shared.event(vec![k], true);
    }
}

/// Settles a task that never ran (cancelled by `drain_jobs` or `shutdown`) as failed.
pub(crate) fn cancel(shared: &Shared, task: Task) {
    let Task {
        job, idx, slot, op, ..
    } = task;
    {
        let mut index = shared.index.lock();
        match op {
            TaskOp::Store(_) => {
                index.abort(slot);
            }
            TaskOp::Load(_) => index.unpin(slot, false),
        }
    }
    Counters::add(&shared.counters.cancelled, 1);
    shared.settle(&job, idx, KeyOutcome::Done(false));
}
