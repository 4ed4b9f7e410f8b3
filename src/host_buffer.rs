//! Host buffers aligned as an engine's staging memory is (pinned host memory comes page-aligned,
//! device allocations at least 256-byte aligned), for the simulator's "device" and the
//! benchmarks' reference copies.
//!
//! The alignment is not cosmetic. Arena rows start on page boundaries, and glibc's `memcpy`
//! (`rep movsb` above a few KiB) runs at less than half its speed on some CPUs when source and
//! destination differ in their offset within a cache line: measured on this project's AMD EPYC
//! dev VM, 256 KiB copies from page-aligned rows into a buffer at `malloc`'s usual page + 16
//! bytes ran at 7.4 GiB/s, into one at a multiple of 64 bytes at 16–19 GiB/s. A `Vec<u8>`
//! lands wherever the allocator puts it, so a benchmark copying between two `Vec`s (matched by
//! accident) and the tier copying between a `Vec` and a row (mismatched) would not measure the
//! same work (`docs/ARCHITECTURE.md`, "Copies at memory speed").

use std::ops::{Deref, DerefMut};

/// A page: the alignment of pinned host memory, and of every arena row.
pub const PAGE_ALIGN: usize = 4096;

/// The alignment of a simulated device block (a GPU allocation's granularity).
pub const DEVICE_ALIGN: usize = 256;

/// `len` bytes starting at an address that is a multiple of the buffer's alignment.
pub struct HostBuffer {
    storage: Vec<u8>,
    offset: usize,
    len: usize,
}

impl HostBuffer {
    /// `len` bytes, each `fill`, starting at a multiple of `align` (a power of two; other
    /// values are rounded up to one).
    #[must_use]
    pub fn filled(len: usize, align: usize, fill: u8) -> Self {
        let align = align.max(1).next_power_of_two();
        // At most `align - 1` bytes of slack are skipped to reach the boundary.
        let storage = vec![fill; len + align - 1];
        let offset = storage.as_ptr().align_offset(align).min(align - 1);
        Self { storage, offset, len }
    }

    /// `len` zero bytes, page-aligned.
    #[must_use]
    pub fn page_aligned(len: usize) -> Self {
        Self::filled(len, PAGE_ALIGN, 0)
    }
}

impl Deref for HostBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.storage[self.offset..self.offset + self.len]
    }
}

impl DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.offset..self.offset + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_its_alignment_and_holds_exactly_len_filled_bytes() {
        for (len, align) in [(0, 64), (1, 256), (4097, 4096), (100, 3)] {
            let mut b = HostBuffer::filled(len, align, 0xA5);
            let align = align.next_power_of_two();
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0xA5));
            if len > 0 {
                assert_eq!(b.as_ptr() as usize % align, 0, "len {len} align {align}");
            }
            b.fill(1);
            assert!(b.iter().all(|&x| x == 1));
        }
        let p = HostBuffer::page_aligned(8192);
        assert_eq!((p.len(), p.as_ptr() as usize % PAGE_ALIGN), (8192, 0));
        assert!(p.iter().all(|&x| x == 0));
    }
}
