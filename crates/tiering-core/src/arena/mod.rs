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
use std::ops::Deref;
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

mod grant;
#[cfg(test)]
mod tests;

pub use grant::{RowGrant, RowRead, RowWrite};
