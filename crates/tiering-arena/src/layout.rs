//! The arena's on-mapping layout: a header (magic, layout version, geometry, view slots), the
//! per-row lock words and the per-view reader ledgers, padded to whole pages, then the rows.
//!
//! ```text
//! 0                 Header (repr C, fixed size; see `Header`)
//! locks_offset      num_chunks × u32 row lock words
//! ledger_offset     MAX_VIEWS × num_chunks × u8 reader counts (one array per view slot)
//! header_bytes      row 0, row 1, … each `row_stride` bytes (page aligned)
//! ```
//!
//! A row lock word is `0` (free), a reader count (`1 ..= READERS_MAX`), or `WRITER | tag` where
//! `tag` is 0 for the owning process and `slot + 1` for the view in that slot. A view also counts
//! its own read grants per row in its ledger, so the owner can give back the rows of a view whose
//! process died (see `view.rs`).

use std::mem::size_of;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::error::{ArenaError, HeaderProblem};

/// The system page size.
#[must_use]
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(v).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// `b"KVTARENA"` read as a little-endian integer.
pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"KVTARENA");
/// Bumped whenever the header, the lock word encoding or the ledger layout changes.
pub(super) const LAYOUT_VERSION: u32 = 1;
/// View slots in the header: how many other processes may attach at once.
pub const MAX_VIEWS: usize = 16;

/// The writer bit of a row lock word; the low bits name the writer (0 = owner, `slot + 1`).
pub(super) const WRITER: u32 = 1 << 31;
/// The largest reader count a lock word holds.
pub(super) const READERS_MAX: u32 = WRITER - 1;

/// The fixed part of the header, at offset 0 of the mapping. Every field is an atomic because
/// other processes read it while the owner may be (re)initialising it.
#[repr(C)]
pub(super) struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub max_views: AtomicU32,
    pub num_chunks: AtomicU64,
    pub chunk_bytes: AtomicU64,
    pub row_stride: AtomicU64,
    pub header_bytes: AtomicU64,
    pub owner_pid: AtomicU32,
    reserved: AtomicU32,
    pub slots: [ViewSlot; MAX_VIEWS],
}

/// One view slot: whether a view holds it (the view's OFD lock on the slot's byte in the file is
/// what proves the holder alive) and, for diagnostics, its process id.
#[repr(C)]
pub(super) struct ViewSlot {
    pub in_use: AtomicU32,
    pub pid: AtomicU32,
}

/// Byte offset of slot `slot` in the file: the byte range a view locks while attached.
pub(super) fn slot_lock_offset(slot: usize) -> u64 {
    (std::mem::offset_of!(Header, slots) + slot * size_of::<ViewSlot>()) as u64
}

/// Where everything lives for a given `num_chunks` and `chunk_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geometry {
    pub num_chunks: usize,
    pub chunk_bytes: usize,
    pub row_stride: usize,
    pub locks_offset: usize,
    pub ledger_offset: usize,
    pub header_bytes: usize,
}

impl Geometry {
    /// The layout for `num_chunks` rows of `chunk_bytes`, or why there is none.
    pub fn new(num_chunks: usize, chunk_bytes: usize) -> Result<Self, ArenaError> {
        if num_chunks == 0 || chunk_bytes == 0 || u32::try_from(num_chunks).is_err() {
            return Err(ArenaError::InvalidGeometry {
                num_chunks,
                chunk_bytes,
            });
        }
        let page = page_size();
        let too_large = |row_stride| ArenaError::TooLarge {
            num_chunks,
            row_stride,
        };
        let row_stride = chunk_bytes
            .checked_next_multiple_of(page)
            .ok_or(too_large(chunk_bytes))?;
        let locks_offset = size_of::<Header>().next_multiple_of(64);
        let ledger_offset = num_chunks
            .checked_mul(size_of::<AtomicU32>())
            .and_then(|b| b.checked_add(locks_offset))
            .ok_or(too_large(row_stride))?;
        let header_bytes = num_chunks
            .checked_mul(MAX_VIEWS)
            .and_then(|b| b.checked_add(ledger_offset))
            .and_then(|b| b.checked_next_multiple_of(page))
            .ok_or(too_large(row_stride))?;
        let geometry = Self {
            num_chunks,
            chunk_bytes,
            row_stride,
            locks_offset,
            ledger_offset,
            header_bytes,
        };
        geometry.total_bytes().ok_or(too_large(row_stride))?;
        Ok(geometry)
    }

    /// Bytes of the row region.
    pub fn row_bytes(&self) -> usize {
        self.num_chunks * self.row_stride
    }

    /// Header plus rows, if it fits in an `isize`.
    pub fn total_bytes(&self) -> Option<usize> {
        self.num_chunks
            .checked_mul(self.row_stride)
            .and_then(|b| b.checked_add(self.header_bytes))
            .filter(|&b| isize::try_from(b).is_ok())
    }

    /// Writes the geometry and an empty lock state into `header`, publishing the magic last so a
    /// view never sees a valid magic over a half-written header. `fresh` says the mapping is
    /// known to be zero-filled (a new file or an anonymous mapping); otherwise the lock words,
    /// ledgers and slots a previous owner left behind are cleared.
    ///
    /// # Safety
    /// `base` is the start of a writable mapping of at least `self.header_bytes` bytes, page
    /// aligned, that stays mapped for the duration of the call.
    pub unsafe fn initialise(&self, base: *mut u8, fresh: bool) {
        // SAFETY: the caller guarantees a page-aligned, writable mapping larger than `Header`;
        // every field is an atomic, so concurrent readers in other processes are not a data race.
        let header = unsafe { &*base.cast::<Header>() };
        header.magic.store(0, Ordering::Release);
        if !fresh {
            for slot in &header.slots {
                slot.in_use.store(0, Ordering::Relaxed);
                slot.pid.store(0, Ordering::Relaxed);
            }
            // SAFETY: the lock words and ledgers lie inside the header region the caller
            // guarantees; they are only ever accessed as atomics.
            let (locks, ledgers) = unsafe { (self.locks(base), self.ledgers(base)) };
            for word in locks {
                word.store(0, Ordering::Relaxed);
            }
            for count in ledgers {
                count.store(0, Ordering::Relaxed);
            }
        }
        header.version.store(LAYOUT_VERSION, Ordering::Relaxed);
        header.max_views.store(MAX_VIEWS as u32, Ordering::Relaxed);
        header.num_chunks.store(self.num_chunks as u64, Ordering::Relaxed);
        header
            .chunk_bytes
            .store(self.chunk_bytes as u64, Ordering::Relaxed);
        header.row_stride.store(self.row_stride as u64, Ordering::Relaxed);
        header
            .header_bytes
            .store(self.header_bytes as u64, Ordering::Relaxed);
        header.owner_pid.store(std::process::id(), Ordering::Relaxed);
        header.magic.store(MAGIC, Ordering::Release);
    }

    /// The geometry a mapped header describes, checked against this build's layout and against
    /// the file length `len`.
    ///
    /// # Safety
    /// `base` is the start of a readable, page-aligned mapping of at least `len` bytes, and
    /// `len >= size_of::<Header>()`.
    pub unsafe fn read(base: *const u8, len: u64) -> Result<Self, HeaderProblem> {
        // SAFETY: the caller guarantees the mapping covers a whole `Header` at an aligned address;
        // the fields are atomics, so a writer in another process is not a data race.
        let header = unsafe { &*base.cast::<Header>() };
        let found = header.magic.load(Ordering::Acquire);
        if found != MAGIC {
            return Err(HeaderProblem::BadMagic { found });
        }
        let version = header.version.load(Ordering::Relaxed);
        if version != LAYOUT_VERSION {
            return Err(HeaderProblem::Version {
                found: version,
                expected: LAYOUT_VERSION,
            });
        }
        let max_views = header.max_views.load(Ordering::Relaxed);
        if max_views as usize != MAX_VIEWS {
            return Err(HeaderProblem::Geometry(format!(
                "{max_views} view slots, this build has {MAX_VIEWS}"
            )));
        }
        let field = |v: &AtomicU64, name: &str| {
            usize::try_from(v.load(Ordering::Relaxed))
                .map_err(|_| HeaderProblem::Geometry(format!("{name} does not fit in usize")))
        };
        let num_chunks = field(&header.num_chunks, "num_chunks")?;
        let chunk_bytes = field(&header.chunk_bytes, "chunk_bytes")?;
        let row_stride = field(&header.row_stride, "row_stride")?;
        let header_bytes = field(&header.header_bytes, "header_bytes")?;
        let geometry =
            Self::new(num_chunks, chunk_bytes).map_err(|e| HeaderProblem::Geometry(e.to_string()))?;
        if geometry.row_stride != row_stride || geometry.header_bytes != header_bytes {
            return Err(HeaderProblem::Geometry(format!(
                "row_stride {row_stride} / header_bytes {header_bytes} disagree with {num_chunks} rows of \
                 {chunk_bytes} bytes (expected {} / {} with {}-byte pages)",
                geometry.row_stride,
                geometry.header_bytes,
                page_size()
            )));
        }
        let expected = geometry.total_bytes().map_or(u64::MAX, |b| b as u64);
        if len < expected {
            return Err(HeaderProblem::Truncated { len, expected });
        }
        if len > expected {
            return Err(HeaderProblem::Geometry(format!(
                "the file is {len} bytes, the layout of {num_chunks} rows of {chunk_bytes} bytes is {expected}"
            )));
        }
        Ok(geometry)
    }

    /// The row lock words of a mapping with this geometry.
    ///
    /// # Safety
    /// `base` is the start of a mapping of at least `self.header_bytes` bytes laid out by
    /// [`Geometry::initialise`], alive for `'a`.
    pub unsafe fn locks<'a>(&self, base: *mut u8) -> &'a [AtomicU32] {
        // SAFETY: `locks_offset` is 64-byte aligned and `num_chunks` words fit before
        // `ledger_offset <= header_bytes`; `AtomicU32` has the layout of `u32`, and the caller
        // guarantees the mapping outlives `'a`.
        unsafe { std::slice::from_raw_parts(base.add(self.locks_offset).cast(), self.num_chunks) }
    }

    /// Every view slot's reader ledger, slot after slot (`MAX_VIEWS × num_chunks` counters).
    ///
    /// # Safety
    /// As [`Geometry::locks`].
    pub unsafe fn ledgers<'a>(&self, base: *mut u8) -> &'a [std::sync::atomic::AtomicU8] {
        // SAFETY: the ledgers occupy `MAX_VIEWS * num_chunks` bytes from `ledger_offset`, inside
        // `header_bytes` by construction; `AtomicU8` has the layout of `u8`; the caller guarantees
        // the mapping outlives `'a`.
        unsafe {
            std::slice::from_raw_parts(base.add(self.ledger_offset).cast(), MAX_VIEWS * self.num_chunks)
        }
    }
}
