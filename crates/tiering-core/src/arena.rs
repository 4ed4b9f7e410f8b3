//! The chunk arena: one mapping of `num_chunks` rows of `row_stride` bytes that the primary tier
//! owns and every copy goes through.
//!
//! Row access is granted, never taken. A grant ([`RowRead`] or [`RowWrite`]) locks its row in a
//! per-row atomic word: any number of readers, or exactly one writer. The primary tier's
//! ref-count protocol (−1 = write in flight, n > 0 = pinned by readers) is what normally keeps
//! grants from colliding; the row locks make a collision caused by a bug an error instead of a
//! data race. All `unsafe` of kvtier's data path lives in this module.

use std::fmt;
use std::fs::OpenOptions;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use crate::outcome::ChunkId;

const WRITER: u32 = u32::MAX;

/// Errors from creating an arena or granting rows.
#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    /// Zero chunks or zero-byte chunks.
    #[error("invalid arena geometry: {num_chunks} chunks of {chunk_bytes} bytes")]
    InvalidGeometry {
        /// Requested chunk count.
        num_chunks: usize,
        /// Requested chunk size.
        chunk_bytes: usize,
    },
    /// The total size overflows the address space.
    #[error("arena of {num_chunks} × {row_stride} bytes does not fit in the address space")]
    TooLarge {
        /// Requested chunk count.
        num_chunks: usize,
        /// Row stride.
        row_stride: usize,
    },
    /// The mapping could not be created (or pre-faulted).
    #[error("cannot map {bytes} bytes for the chunk arena{}: {source}", path.as_ref().map(|p| format!(" at {}", p.display())).unwrap_or_default())]
    Map {
        /// Mapping size.
        bytes: usize,
        /// The shared-memory file, when one was requested.
        path: Option<PathBuf>,
        /// The OS error.
        source: std::io::Error,
    },
    /// A chunk id outside the arena.
    #[error("chunk id {chunk} is outside the arena of {num_chunks} rows")]
    OutOfRange {
        /// The offending id.
        chunk: ChunkId,
        /// Arena size.
        num_chunks: usize,
    },
    /// The row is granted to someone else in a conflicting mode.
    #[error("arena row {chunk} is busy ({held}); a ref-count invariant was broken")]
    RowBusy {
        /// The contended row.
        chunk: ChunkId,
        /// What holds it.
        held: &'static str,
    },
}

/// How to create a [`ChunkArena`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaOptions {
    /// Number of rows.
    pub num_chunks: usize,
    /// Payload bytes per row; the stride is this rounded up to the page size.
    pub chunk_bytes: usize,
    /// Back the arena with this file (e.g. under `/dev/shm`) so another process can map the same
    /// rows; `None` uses an anonymous mapping.
    pub shared_memory: Option<PathBuf>,
    /// Touch every page at start-up, so a machine that cannot back the arena fails now with a
    /// clear error rather than later with an OOM kill.
    pub prefault: bool,
    /// Ask for 2 MiB huge pages; falls back to normal pages when the system has none.
    pub huge_pages: bool,
}

impl ArenaOptions {
    /// Anonymous, not pre-faulted, normal pages.
    #[must_use]
    pub fn new(num_chunks: usize, chunk_bytes: usize) -> Self {
        Self {
            num_chunks,
            chunk_bytes,
            shared_memory: None,
            prefault: false,
            huge_pages: false,
        }
    }
}

/// The primary tier's chunk memory. See the module docs for the access protocol.
pub struct ChunkArena {
    /// `None` for a view made by [`ChunkArena::from_raw_parts`]: the memory belongs to another
    /// arena.
    map: Option<MmapRaw>,
    base: NonNull<u8>,
    num_chunks: usize,
    chunk_bytes: usize,
    row_stride: usize,
    row_locks: RowLocks,
    shared_path: Option<PathBuf>,
    huge_pages: bool,
}

// SAFETY: the arena is a plain memory mapping; every access to row memory goes through a grant
// whose row lock (an atomic) serialises writers against readers, so sharing the arena between
// threads cannot create a data race.
unsafe impl Send for ChunkArena {}
// SAFETY: see `Send` above; `&ChunkArena` exposes row memory only through locked grants.
unsafe impl Sync for ChunkArena {}

/// The addresses and geometry of an arena, as [`ChunkArena::raw_parts`] returns them. Plain
/// data with a C layout, so it can cross a C ABI.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct ArenaRawParts {
    /// Start of row 0.
    pub base: *mut u8,
    /// Number of rows.
    pub num_chunks: usize,
    /// Payload bytes per row.
    pub chunk_bytes: usize,
    /// Bytes between consecutive rows.
    pub row_stride: usize,
    /// The `num_chunks` row-lock words.
    pub row_locks: *const AtomicU32,
}

/// The per-row lock words: owned by a mapped arena, borrowed by a view.
enum RowLocks {
    Owned(Box<[AtomicU32]>),
    Borrowed { ptr: NonNull<AtomicU32>, len: usize },
}

impl Deref for RowLocks {
    type Target = [AtomicU32];

    fn deref(&self) -> &[AtomicU32] {
        match self {
            Self::Owned(b) => b,
            // SAFETY: `from_raw_parts`'s contract keeps the owning arena — and with it these
            // `len` initialised lock words — alive for as long as the view exists.
            Self::Borrowed { ptr, len } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
        }
    }
}

/// The system page size.
#[must_use]
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(v).ok().filter(|&p| p > 0).unwrap_or(4096)
}

impl ChunkArena {
    /// An anonymous arena of `num_chunks` rows of `chunk_bytes` payload bytes.
    ///
    /// # Errors
    /// Invalid geometry or a failed mapping.
    pub fn new(num_chunks: usize, chunk_bytes: usize) -> Result<Arc<Self>, ArenaError> {
        Self::with_options(&ArenaOptions::new(num_chunks, chunk_bytes))
    }

    /// An arena built from `options`.
    ///
    /// # Errors
    /// Invalid geometry, a size that overflows, or a mapping (or pre-fault) the OS refuses.
    pub fn with_options(options: &ArenaOptions) -> Result<Arc<Self>, ArenaError> {
        let ArenaOptions {
            num_chunks,
            chunk_bytes,
            ..
        } = *options;
        if num_chunks == 0 || chunk_bytes == 0 || u32::try_from(num_chunks).is_err() {
            return Err(ArenaError::InvalidGeometry {
                num_chunks,
                chunk_bytes,
            });
        }
        let page = page_size();
        let row_stride = chunk_bytes
            .checked_next_multiple_of(page)
            .ok_or(ArenaError::TooLarge {
                num_chunks,
                row_stride: chunk_bytes,
            })?;
        let bytes = num_chunks
            .checked_mul(row_stride)
            .filter(|&b| isize::try_from(b).is_ok())
            .ok_or(ArenaError::TooLarge {
                num_chunks,
                row_stride,
            })?;
        let map_err = |source| ArenaError::Map {
            bytes,
            path: options.shared_memory.clone(),
            source,
        };
        let mut huge_pages = false;
        let map = if let Some(path) = &options.shared_memory {
            Self::map_shared(path, bytes, options.prefault).map_err(map_err)?
        } else {
            let mut opts = MmapOptions::new();
            opts.len(bytes);
            if options.prefault {
                opts.populate();
            }
            let attempt = if options.huge_pages {
                let mut huge = opts.clone();
                huge.huge(Some(21));
                huge.map_anon().ok()
            } else {
                None
            };
            let mapped = match attempt {
                Some(m) => {
                    huge_pages = true;
                    m
                }
                None => {
                    if options.huge_pages {
                        tracing::info!("huge pages unavailable for the chunk arena; using normal pages");
                    }
                    opts.map_anon().map_err(map_err)?
                }
            };
            MmapRaw::from(mapped)
        };
        let base = NonNull::new(map.as_mut_ptr()).ok_or_else(|| ArenaError::Map {
            bytes,
            path: options.shared_memory.clone(),
            source: std::io::Error::other("mapping returned a null pointer"),
        })?;
        let row_locks = RowLocks::Owned((0..num_chunks).map(|_| AtomicU32::new(0)).collect());
        Ok(Arc::new(Self {
            map: Some(map),
            base,
            num_chunks,
            chunk_bytes,
            row_stride,
            row_locks,
            shared_path: options.shared_memory.clone(),
            huge_pages,
        }))
    }

    fn map_shared(path: &Path, bytes: usize, prefault: bool) -> std::io::Result<MmapRaw> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let len = u64::try_from(bytes).map_err(std::io::Error::other)?;
        if file.metadata()?.len() != len {
            file.set_len(len)?;
        }
        let mut opts = MmapOptions::new();
        opts.len(bytes);
        if prefault {
            opts.populate();
        }
        opts.map_raw(&file)
    }

    /// Number of rows.
    #[must_use]
    pub fn num_chunks(&self) -> usize {
        self.num_chunks
    }

    /// Payload bytes per row (the length of a granted row slice).
    #[must_use]
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Bytes between the starts of consecutive rows: `chunk_bytes` rounded up to the page size,
    /// so every row is page aligned (ready for `O_DIRECT`).
    #[must_use]
    pub fn row_stride(&self) -> usize {
        self.row_stride
    }

    /// Total mapped bytes.
    #[must_use]
    pub fn mapped_bytes(&self) -> usize {
        self.map
            .as_ref()
            .map_or(self.num_chunks * self.row_stride, MmapRaw::len)
    }

    /// The shared-memory file backing the arena, if any.
    #[must_use]
    pub fn shared_path(&self) -> Option<&Path> {
        self.shared_path.as_deref()
    }

    /// Whether huge pages back the arena.
    #[must_use]
    pub fn uses_huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// The arena's addresses and geometry, for handing rows across a C ABI (see
    /// [`ChunkArena::from_raw_parts`]).
    #[must_use]
    pub fn raw_parts(&self) -> ArenaRawParts {
        ArenaRawParts {
            base: self.base.as_ptr(),
            num_chunks: self.num_chunks,
            chunk_bytes: self.chunk_bytes,
            row_stride: self.row_stride,
            row_locks: self.row_locks.as_ptr(),
        }
    }

    /// A view of another arena's rows that shares its row locks: grants made from the view and
    /// from the original exclude each other exactly as grants of one arena do. Dropping the view
    /// unmaps nothing. This is how a tier loaded from a shared library (which links its own copy
    /// of this crate) sees the host's arena.
    ///
    /// # Errors
    /// Null pointers or a geometry that `ChunkArena::new` would refuse.
    ///
    /// # Safety
    /// `parts` must come from [`ChunkArena::raw_parts`] of an arena in this process that stays
    /// alive (is neither dropped nor unmapped) for as long as the view or any grant made from it
    /// exists.
    pub unsafe fn from_raw_parts(parts: ArenaRawParts) -> Result<Arc<Self>, ArenaError> {
        let invalid = ArenaError::InvalidGeometry {
            num_chunks: parts.num_chunks,
            chunk_bytes: parts.chunk_bytes,
        };
        let (Some(base), Some(locks)) = (NonNull::new(parts.base), NonNull::new(parts.row_locks.cast_mut()))
        else {
            return Err(invalid);
        };
        if parts.num_chunks == 0
            || parts.chunk_bytes == 0
            || parts.row_stride < parts.chunk_bytes
            || u32::try_from(parts.num_chunks).is_err()
            || parts.num_chunks.checked_mul(parts.row_stride).is_none()
        {
            return Err(invalid);
        }
        Ok(Arc::new(Self {
            map: None,
            base,
            num_chunks: parts.num_chunks,
            chunk_bytes: parts.chunk_bytes,
            row_stride: parts.row_stride,
            row_locks: RowLocks::Borrowed {
                ptr: locks,
                len: parts.num_chunks,
            },
            shared_path: None,
            huge_pages: false,
        }))
    }

    /// Whether this arena is a view made by [`ChunkArena::from_raw_parts`].
    #[must_use]
    pub fn is_view(&self) -> bool {
        self.map.is_none()
    }

    fn lock_index(&self, chunk: ChunkId) -> Result<usize, ArenaError> {
        let idx = chunk as usize;
        if idx < self.num_chunks {
            Ok(idx)
        } else {
            Err(ArenaError::OutOfRange {
                chunk,
                num_chunks: self.num_chunks,
            })
        }
    }

    fn acquire_read(&self, chunk: ChunkId) -> Result<(), ArenaError> {
        let lock = &self.row_locks[self.lock_index(chunk)?];
        let mut cur = lock.load(Ordering::Relaxed);
        loop {
            if cur >= WRITER - 1 {
                return Err(ArenaError::RowBusy {
                    chunk,
                    held: if cur == WRITER {
                        "granted to a writer"
                    } else {
                        "too many readers"
                    },
                });
            }
            match lock.compare_exchange_weak(cur, cur + 1, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(actual) => cur = actual,
            }
        }
    }

    fn acquire_write(&self, chunk: ChunkId) -> Result<(), ArenaError> {
        let lock = &self.row_locks[self.lock_index(chunk)?];
        lock.compare_exchange(0, WRITER, Ordering::Acquire, Ordering::Relaxed)
            .map(|_| ())
            .map_err(|held| ArenaError::RowBusy {
                chunk,
                held: if held == WRITER {
                    "granted to a writer"
                } else {
                    "granted to readers"
                },
            })
    }

    /// Grants shared read access to one row.
    ///
    /// # Errors
    /// The id is out of range or the row is granted to a writer.
    pub fn read_row(self: &Arc<Self>, chunk: ChunkId) -> Result<RowRead, ArenaError> {
        self.acquire_read(chunk)?;
        Ok(RowRead {
            arena: Arc::clone(self),
            chunk,
        })
    }

    /// Grants exclusive write access to one row.
    ///
    /// # Errors
    /// The id is out of range or the row is granted to anyone else.
    pub fn write_row(self: &Arc<Self>, chunk: ChunkId) -> Result<RowWrite, ArenaError> {
        self.acquire_write(chunk)?;
        Ok(RowWrite {
            arena: Arc::clone(self),
            chunk,
        })
    }

    /// Grants read access to every row in `chunks` (all or nothing; repeats are allowed).
    ///
    /// # Errors
    /// As [`ChunkArena::read_row`]; rows granted before the failure are released.
    pub fn read_rows(self: &Arc<Self>, chunks: &[ChunkId]) -> Result<Vec<RowRead>, ArenaError> {
        chunks.iter().map(|&c| self.read_row(c)).collect()
    }

    /// Grants write access to every row in `chunks` (all or nothing; a repeat is an error).
    ///
    /// # Errors
    /// As [`ChunkArena::write_row`]; rows granted before the failure are released.
    pub fn write_rows(self: &Arc<Self>, chunks: &[ChunkId]) -> Result<Vec<RowWrite>, ArenaError> {
        chunks.iter().map(|&c| self.write_row(c)).collect()
    }

    /// Whether any grant currently holds `chunk` (for diagnostics and tests).
    #[must_use]
    pub fn is_row_granted(&self, chunk: ChunkId) -> bool {
        self.row_locks
            .get(chunk as usize)
            .is_some_and(|l| l.load(Ordering::Acquire) != 0)
    }

    /// Number of rows currently granted (for leak checks in tests).
    #[must_use]
    pub fn granted_rows(&self) -> usize {
        self.row_locks
            .iter()
            .filter(|l| l.load(Ordering::Acquire) != 0)
            .count()
    }

    fn row_ptr(&self, chunk: ChunkId) -> *mut u8 {
        // SAFETY: `chunk` was range-checked when its grant was acquired, so the offset
        // `chunk * row_stride` stays inside the mapping of `num_chunks * row_stride` bytes.
        unsafe { self.base.as_ptr().add(chunk as usize * self.row_stride) }
    }
}

impl fmt::Debug for ChunkArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChunkArena")
            .field("num_chunks", &self.num_chunks)
            .field("chunk_bytes", &self.chunk_bytes)
            .field("row_stride", &self.row_stride)
            .field("shared_path", &self.shared_path)
            .finish_non_exhaustive()
    }
}

/// Shared read access to one arena row; released on drop.
pub struct RowRead {
    arena: Arc<ChunkArena>,
    chunk: ChunkId,
}

impl RowRead {
    /// The row's chunk id.
    #[must_use]
    pub fn chunk(&self) -> ChunkId {
        self.chunk
    }

    /// Gives the grant up **without** releasing the row lock, so the grant can be handed across
    /// a C ABI and adopted with [`RowRead::from_raw`] (usually on a view of the same arena).
    #[must_use]
    pub fn into_raw(self) -> ChunkId {
        let chunk = self.chunk;
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again, so moving the `Arc` out of it drops
        // the arena reference exactly once while skipping `Drop for RowRead`, which would
        // release the row lock.
        drop(unsafe { std::ptr::read(&raw const this.arena) });
        chunk
    }

    /// Adopts a read grant given up by [`RowRead::into_raw`] on `arena` or on an arena sharing
    /// its row locks (a view).
    ///
    /// # Safety
    /// The row's lock must hold a reader count that no live grant owns: one taken by a grant
    /// that was given up with `into_raw` and not adopted since.
    #[must_use]
    pub unsafe fn from_raw(arena: &Arc<ChunkArena>, chunk: ChunkId) -> Self {
        debug_assert!((chunk as usize) < arena.num_chunks);
        Self {
            arena: Arc::clone(arena),
            chunk,
        }
    }
}

impl Deref for RowRead {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: this grant holds a reader count on the row, so no `RowWrite` for it exists
        // until the count drops; the range is inside the mapping (checked at grant time) and the
        // mapping lives as long as the `Arc` this grant holds.
        unsafe { std::slice::from_raw_parts(self.arena.row_ptr(self.chunk), self.arena.chunk_bytes) }
    }
}

impl Drop for RowRead {
    fn drop(&mut self) {
        self.arena.row_locks[self.chunk as usize].fetch_sub(1, Ordering::Release);
    }
}

impl fmt::Debug for RowRead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RowRead({})", self.chunk)
    }
}

/// Exclusive write access to one arena row; released on drop.
pub struct RowWrite {
    arena: Arc<ChunkArena>,
    chunk: ChunkId,
}

impl RowWrite {
    /// The row's chunk id.
    #[must_use]
    pub fn chunk(&self) -> ChunkId {
        self.chunk
    }

    /// Gives the grant up **without** releasing the row lock (see [`RowRead::into_raw`]).
    #[must_use]
    pub fn into_raw(self) -> ChunkId {
        let chunk = self.chunk;
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: as in `RowRead::into_raw`: the `Arc` is moved out once and `this` is never
        // dropped, so the writer lock stays held.
        drop(unsafe { std::ptr::read(&raw const this.arena) });
        chunk
    }

    /// Adopts a write grant given up by [`RowWrite::into_raw`] (see [`RowRead::from_raw`]).
    ///
    /// # Safety
    /// The row's lock must be the writer lock of a grant given up with `into_raw` and not
    /// adopted since.
    #[must_use]
    pub unsafe fn from_raw(arena: &Arc<ChunkArena>, chunk: ChunkId) -> Self {
        debug_assert!((chunk as usize) < arena.num_chunks);
        Self {
            arena: Arc::clone(arena),
            chunk,
        }
    }
}

impl Deref for RowWrite {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: this grant holds the row's writer lock, so no other grant aliases the row; the
        // range is inside the mapping, which the held `Arc` keeps alive.
        unsafe { std::slice::from_raw_parts(self.arena.row_ptr(self.chunk), self.arena.chunk_bytes) }
    }
}

impl DerefMut for RowWrite {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`; `&mut self` makes this the only live borrow of the row.
        unsafe { std::slice::from_raw_parts_mut(self.arena.row_ptr(self.chunk), self.arena.chunk_bytes) }
    }
}

impl Drop for RowWrite {
    fn drop(&mut self) {
        self.arena.row_locks[self.chunk as usize].store(0, Ordering::Release);
    }
}

impl fmt::Debug for RowWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RowWrite({})", self.chunk)
    }
}

/// The rows a [`TransferJob`](crate::job::TransferJob) may touch, parallel to its keys.
#[derive(Debug)]
pub enum RowGrant {
    /// Read access (a store or cascade reads primary rows).
    Read(Vec<RowRead>),
    /// Write access (a promotion writes primary rows).
    Write(Vec<RowWrite>),
}

impl RowGrant {
    /// Number of rows.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Self::Read(r) => r.len(),
            Self::Write(w) => w.len(),
        }
    }

    /// Whether the grant holds no rows.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of row `i` (both modes may read).
    #[must_use]
    pub fn row(&self, i: usize) -> Option<&[u8]> {
        match self {
            Self::Read(r) => r.get(i).map(|r| &**r),
            Self::Write(w) => w.get(i).map(|w| &**w),
        }
    }

    /// The mutable bytes of row `i`; `None` for a read grant.
    pub fn row_mut(&mut self, i: usize) -> Option<&mut [u8]> {
        match self {
            Self::Read(_) => None,
            Self::Write(w) => w.get_mut(i).map(|w| &mut **w),
        }
    }

    /// The read grants, or `Err(self)` for a write grant.
    ///
    /// # Errors
    /// Returns the grant unchanged when it is a write grant.
    pub fn into_reads(self) -> Result<Vec<RowRead>, Self> {
        match self {
            Self::Read(r) => Ok(r),
            w @ Self::Write(_) => Err(w),
        }
    }

    /// The write grants, or `Err(self)` for a read grant.
    ///
    /// # Errors
    /// Returns the grant unchanged when it is a read grant.
    pub fn into_writes(self) -> Result<Vec<RowWrite>, Self> {
        match self {
            Self::Write(w) => Ok(w),
            r @ Self::Read(_) => Err(r),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_page_aligned_and_sized() {
        let a = ChunkArena::new(4, 1000).unwrap();
        assert_eq!(a.row_stride() % page_size(), 0);
        assert!(a.row_stride() >= 1000);
        let r = a.read_row(3).unwrap();
        assert_eq!(r.len(), 1000);
        assert_eq!(r.as_ptr() as usize % page_size(), 0);
    }

    #[test]
    fn writes_are_exclusive_and_readers_share() {
        let a = ChunkArena::new(2, 64).unwrap();
        let mut w = a.write_row(0).unwrap();
        w.fill(7);
        assert!(matches!(a.read_row(0), Err(ArenaError::RowBusy { .. })));
        assert!(matches!(a.write_row(0), Err(ArenaError::RowBusy { .. })));
        drop(w);
        let r1 = a.read_row(0).unwrap();
        let r2 = a.read_row(0).unwrap();
        assert!(r1.iter().all(|&b| b == 7));
        assert!(matches!(a.write_row(0), Err(ArenaError::RowBusy { .. })));
        drop((r1, r2));
        assert_eq!(a.granted_rows(), 0);
        assert!(a.write_row(0).is_ok());
    }

    #[test]
    fn batch_grants_are_all_or_nothing() {
        let a = ChunkArena::new(3, 64).unwrap();
        assert!(a.write_rows(&[0, 1, 1]).is_err());
        assert_eq!(a.granted_rows(), 0, "a failed batch releases what it took");
        assert!(matches!(
            a.read_rows(&[0, 9]),
            Err(ArenaError::OutOfRange { chunk: 9, .. })
        ));
        assert_eq!(a.granted_rows(), 0);
        let g = RowGrant::Read(a.read_rows(&[2, 2]).unwrap());
        assert_eq!(g.len(), 2);
    }

    #[test]
    fn a_view_shares_memory_and_row_locks() {
        let a = ChunkArena::new(3, 100).unwrap();
        // SAFETY: `a` outlives the view and every grant made from it in this test.
        let v = unsafe { ChunkArena::from_raw_parts(a.raw_parts()) }.unwrap();
        assert!(v.is_view() && !a.is_view());
        assert_eq!(
            (v.num_chunks(), v.chunk_bytes(), v.row_stride()),
            (3, 100, a.row_stride())
        );
        assert_eq!(v.mapped_bytes(), a.mapped_bytes());
        let mut w = a.write_row(1).unwrap();
        w.fill(5);
        assert!(matches!(v.read_row(1), Err(ArenaError::RowBusy { .. })));
        drop(w);
        assert!(v.read_row(1).unwrap().iter().all(|&b| b == 5));
        v.write_row(2).unwrap().fill(9);
        assert!(a.read_row(2).unwrap().iter().all(|&b| b == 9));
        drop(v);
        assert_eq!(a.granted_rows(), 0);
    }

    #[test]
    fn grants_given_up_raw_are_adopted_with_their_lock() {
        let a = ChunkArena::new(2, 64).unwrap();
        // SAFETY: `a` outlives the view and every grant made from it in this test.
        let v = unsafe { ChunkArena::from_raw_parts(a.raw_parts()) }.unwrap();
        let strong = Arc::strong_count(&a);
        let chunk = a.write_row(0).unwrap().into_raw();
        assert_eq!(
            Arc::strong_count(&a),
            strong,
            "into_raw drops its arena reference"
        );
        assert!(a.is_row_granted(0), "the lock stays held while in transit");
        // SAFETY: the writer lock of row 0 was given up by `into_raw` above.
        let mut w = unsafe { RowWrite::from_raw(&v, chunk) };
        w.fill(3);
        drop(w);
        assert_eq!(
            a.granted_rows(),
            0,
            "dropping the adopted grant releases the shared lock"
        );
        let r = a.read_row(0).unwrap().into_raw();
        let r2 = a.read_row(0).unwrap();
        // SAFETY: one reader count of row 0 was given up by `into_raw` above.
        let adopted = unsafe { RowRead::from_raw(&v, r) };
        assert!(adopted.iter().all(|&b| b == 3));
        drop(adopted);
        assert!(
            matches!(a.write_row(0), Err(ArenaError::RowBusy { .. })),
            "r2 still reads"
        );
        drop(r2);
        assert!(a.write_row(0).is_ok());
    }

    #[test]
    fn views_refuse_null_or_bad_parts() {
        let a = ChunkArena::new(2, 64).unwrap();
        let mut parts = a.raw_parts();
        parts.base = std::ptr::null_mut();
        // SAFETY: refused before any use of the pointers.
        assert!(unsafe { ChunkArena::from_raw_parts(parts) }.is_err());
        let mut parts = a.raw_parts();
        parts.row_stride = 10;
        // SAFETY: as above.
        assert!(unsafe { ChunkArena::from_raw_parts(parts) }.is_err());
    }

    #[test]
    fn bad_geometry_is_refused() {
        assert!(matches!(
            ChunkArena::new(0, 64),
            Err(ArenaError::InvalidGeometry { .. })
        ));
        assert!(matches!(
            ChunkArena::new(4, 0),
            Err(ArenaError::InvalidGeometry { .. })
        ));
        assert!(ChunkArena::new(usize::MAX / 2, 1 << 20).is_err());
    }

    #[test]
    fn shared_memory_arena_is_visible_through_the_file() {
        let dir = std::env::temp_dir().join(format!("kvtier-arena-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("arena");
        let mut opts = ArenaOptions::new(2, 16);
        opts.shared_memory = Some(path.clone());
        opts.prefault = true;
        let a = ChunkArena::with_options(&opts).unwrap();
        a.write_row(1).unwrap().copy_from_slice(&[9u8; 16]);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[a.row_stride()..a.row_stride() + 16], &[9u8; 16]);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
