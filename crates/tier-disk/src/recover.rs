//! The start-up scan: read every slot's seal block and first payload block (not the rest of the
//! payload) and keep the slots whose write completed.

use std::io;

use tiering_core::OffloadKey;

use crate::buf::AlignedBuf;
use crate::format::{BLOCK, ScannedSlot, scan_slot};
use crate::slab::Slab;

/// What the scan found.
#[derive(Debug, Default)]
pub(crate) struct ScanOutcome {
    /// Completely written slots: `(slot, key, seq)`.
    pub(crate) found: Vec<(u32, OffloadKey, u64)>,
    /// Slots with a seal that does not match their first payload block, a damaged seal, or a
    /// seal for another chunk size: writes that never completed, or damage.
    pub(crate) discarded: usize,
    /// Slots whose blocks could not be read.
    pub(crate) unreadable: usize,
    /// The highest write number seen in any intact seal.
    pub(crate) max_seq: u64,
}

impl ScanOutcome {
    fn merge(&mut self, other: Self) {
        self.found.extend(other.found);
        self.discarded += other.discarded;
        self.unreadable += other.unreadable;
        self.max_seq = self.max_seq.max(other.max_seq);
    }
}

fn read_slot_ends(slab: &Slab, slot: u32, head: &mut [u8], seal: &mut [u8]) -> io::Result<ScannedSlot> {
    let layout = slab.layout();
    if slab.read_block(layout.seal_offset(slot), seal)? < BLOCK {
        // Past the end of the file: never written.
        return Ok(ScannedSlot::Empty);
    }
    if seal.iter().all(|&b| b == 0) {
        return Ok(ScannedSlot::Empty);
    }
    if slab.read_block(layout.slot_offset(slot), head)? < BLOCK {
        head.fill(0);
    }
    Ok(scan_slot(head, seal, layout.chunk_bytes))
}

fn scan_range(slab: &Slab, slots: std::ops::Range<u32>) -> io::Result<ScanOutcome> {
    let mut head = AlignedBuf::zeroed(BLOCK)?;
    let mut seal = AlignedBuf::zeroed(BLOCK)?;
    let mut out = ScanOutcome::default();
    for slot in slots {
        match read_slot_ends(slab, slot, &mut head, &mut seal) {
            Ok(ScannedSlot::Empty) => {}
            Ok(ScannedSlot::Complete { key, seq }) => {
                out.max_seq = out.max_seq.max(seq);
                out.found.push((slot, key, seq));
            }
            Ok(ScannedSlot::Discarded { seq }) => {
                out.max_seq = out.max_seq.max(seq);
                out.discarded += 1;
            }
            Err(e) => {
                tracing::warn!(slot, error = %e, "disk tier: cannot read a slot at start-up; treating it as empty");
                out.unreadable += 1;
            }
        }
    }
    Ok(out)
}

/// Scans slots `0..slots` of `slab` with up to `threads` threads.
///
/// # Errors
/// Only when scratch buffers cannot be allocated; unreadable slots are counted, not fatal.
pub(crate) fn scan(slab: &Slab, slots: u32, threads: usize) -> io::Result<ScanOutcome> {
    let n = slots.min(slab.layout().num_slots);
    if n == 0 {
        return Ok(ScanOutcome::default());
    }
    let threads = u32::try_from(threads.max(1)).unwrap_or(1).min(n.max(1));
    let per = n.div_ceil(threads);
    let results: Vec<io::Result<ScanOutcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let start = t.saturating_mul(per).min(n);
                let end = start.saturating_add(per).min(n);
                s.spawn(move || scan_range(slab, start..end))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(io::Error::other("start-up scan thread panicked")))
            })
            .collect()
    });
    let mut total = ScanOutcome::default();
    for r in results {
        total.merge(r?);
    }
    Ok(total)
}
