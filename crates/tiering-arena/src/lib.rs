//! # tiering-arena
//!
//! The chunk arena of kvtier: one mapping of `num_chunks` rows of `row_stride` bytes that the primary tier
//! owns and every copy goes through.
//!
//! Row access is granted, never taken. A grant ([`RowRead`] or [`RowWrite`]) locks its row in a
//! per-row atomic word: any number of readers, or exactly one writer. The primary tier's
//! ref-count protocol (−1 = write in flight, n > 0 = pinned by readers) is what normally keeps
//! grants from colliding; the row locks make a collision caused by a bug — or by another
//! process — an error instead of a data race. All `unsafe` of kvtier's data path lives in this
//! module.
//!
//! # Layout and processes
//! The mapping starts with a header (magic, layout version, geometry, view slots, the row lock
//! words and per-view reader ledgers; see `layout.rs`) padded to whole pages, followed by the
//! page-aligned rows. Anonymous and shared arenas use the same layout, so grants work the same
//! way in both. A shared arena (`ArenaOptions::shared_memory`, e.g. a file under `/dev/shm`) is
//! the one an engine's worker processes attach to with [`ArenaView::open`]; their grants take the
//! same lock words in the mapping, so a worker and the manager exclude each other row by row.
//!
//! # Ownership of the file
//! - The **owner** is the [`ChunkArena`] created with `shared_memory = Some(path)`. It holds an
//!   exclusive `flock` on the file for its whole life: a second owner on the same path is refused
//!   with [`ArenaError::AlreadyOwned`]. If the owner created the file, it removes it when dropped
//!   (before releasing the lock, so a successor never has its file unlinked); a file that already
//!   existed (pre-created by an operator, or left by a crashed owner) is reinitialised — header
//!   and lock words cleared, row bytes left as they were — and left in place on drop. Taking
//!   over a file that a previous owner's view still maps is refused
//!   ([`ArenaError::ViewsStillAttached`]): reinitialising would forget that view's grants.
//! - A **view** ([`ArenaView`]) maps the same file from another process. It refuses a file whose
//!   header does not validate ([`ArenaError::InvalidHeader`]) or that no live owner holds
//!   ([`ArenaError::NoOwner`]). It takes one of [`MAX_VIEWS`] slots in the header and holds an
//!   open-file-description lock on the slot's byte while attached; the kernel drops that lock
//!   when the process exits or is killed.
//! - A view may outlive its owner: its pages stay mapped until it unmaps them, but the owner
//!   has removed the path, so nothing it writes reaches a later owner
//!   ([`ArenaView::owner_alive`] tells a worker its owner is gone).
//! - **A view that dies while holding grants** leaves its row locks set: nothing is released
//!   behind the owner's back. Its write locks are tagged with its slot and its read grants are
//!   counted in its slot's ledger, so [`ChunkArena::reclaim_dead_views`] — called by the owner,
//!   e.g. when a worker's death is detected — finds the slots whose lock the kernel released and
//!   gives their rows back. A reclaim never touches a live view's grants. (A view dying in the
//!   middle of taking or releasing a read grant can leak that one reader count; the row then stays
//!   unwritable, never unsafely shared.)
//!
//! # Pinning for DMA
//! [`ChunkArena::lock_memory`] `mlock`s the rows; [`ChunkArena::register_for_dma`] hands the row
//! region to an engine's registration function (e.g. one that calls `cudaHostRegister`) so
//! device copies can target it directly. A view can do both for its own mapping.

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use memmap2::MmapRaw;

mod chunk_id;
mod error;
mod file_lock;
mod grant;
mod layout;
mod owner;
mod pin;
mod row_lock;
#[cfg(test)]
mod tests;
mod view;

pub use chunk_id::ChunkId;
pub use error::{ArenaError, HeaderProblem};
pub use grant::{RowGrant, RowRead, RowWrite};
pub use layout::{MAX_VIEWS, page_size};
pub use pin::DmaRegistrar;
pub use view::{ArenaView, ReclaimedViews};

use layout::{Geometry, Header};

/// How to create a [`ChunkArena`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaOptions {
    /// Number of rows.
    pub num_chunks: usize,
    /// Payload bytes per row; the stride is this rounded up to the page size.
    pub chunk_bytes: usize,
    /// Back the arena with this file (e.g. under `/dev/shm`) so other processes can attach with
    /// [`ArenaView::open`]; `None` uses an anonymous mapping. The arena becomes the file's owner
    /// (see the module docs for the ownership rule).
    pub shared_memory: Option<PathBuf>,
    /// Touch every page at start-up, so a machine that cannot back the arena fails now with a
    /// clear error rather than later with an OOM kill.
    pub prefault: bool,
    /// Ask for 2 MiB huge pages (anonymous arenas only); falls back to normal pages when the
    /// system has none.
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

/// Who this arena is with respect to the mapping.
enum Role {
    /// Created the mapping; `file` is the flocked shared-memory file, if any.
    Owner {
        file: Option<File>,
        remove_on_drop: bool,
    },
    /// Made by [`ChunkArena::from_raw_parts`]: borrows an arena of this process.
    RawView,
    /// Attached by [`ArenaView::open`]; keeps the file open because the OFD lock of `slot`
    /// lives as long as this open file description.
    View { file: File, slot: usize },
}

/// The primary tier's chunk memory. See the module docs for the access protocol.
pub struct ChunkArena {
    /// `None` for a view made by [`ChunkArena::from_raw_parts`]: the memory belongs to another
    /// arena.
    map: Option<MmapRaw>,
    /// Start of row 0.
    base: NonNull<u8>,
    /// The `num_chunks` row lock words (inside the mapping, ours or the borrowed one).
    locks: NonNull<AtomicU32>,
    geometry: Geometry,
    role: Role,
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

impl ChunkArena {
    /// An anonymous arena of `num_chunks` rows of `chunk_bytes` payload bytes.
    ///
    /// # Errors
    /// Invalid geometry or a failed mapping.
    pub fn new(num_chunks: usize, chunk_bytes: usize) -> Result<Arc<Self>, ArenaError> {
        Self::with_options(&ArenaOptions::new(num_chunks, chunk_bytes))
    }

    /// An arena built from `options`; with `shared_memory` set, the owner of that file.
    ///
    /// # Errors
    /// Invalid geometry, a size that overflows, a mapping (or pre-fault) the OS refuses, or
    /// [`ArenaError::AlreadyOwned`] when another owner holds the file.
    pub fn with_options(options: &ArenaOptions) -> Result<Arc<Self>, ArenaError> {
        let geometry = Geometry::new(options.num_chunks, options.chunk_bytes)?;
        let bytes = geometry.total_bytes().ok_or(ArenaError::TooLarge {
            num_chunks: geometry.num_chunks,
            row_stride: geometry.row_stride,
        })?;
        let (map, role, fresh, huge_pages) = match &options.shared_memory {
            Some(path) => {
                let owned = owner::open_owned(path, bytes, options.prefault)?;
                let role = Role::Owner {
                    file: Some(owned.file),
                    remove_on_drop: owned.created,
                };
                (owned.map, role, owned.created, false)
            }
            None => {
                let (map, huge) = owner::map_anonymous(bytes, options)?;
                let role = Role::Owner {
                    file: None,
                    remove_on_drop: false,
                };
                (map, role, true, huge)
            }
        };
        let start = NonNull::new(map.as_mut_ptr()).ok_or_else(|| ArenaError::Map {
            bytes,
            path: options.shared_memory.clone(),
            source: std::io::Error::other("mapping returned a null pointer"),
        })?;
        // SAFETY: `map` is a fresh, writable, page-aligned mapping of `bytes >= header_bytes`
        // bytes that lives in this function and then in the returned arena.
        unsafe { geometry.initialise(start.as_ptr(), fresh) };
        Ok(Arc::new(Self::over_mapping(
            map,
            start,
            geometry,
            role,
            options.shared_memory.clone(),
            huge_pages,
        )))
    }

    /// An arena over a mapping laid out by [`Geometry::initialise`].
    fn over_mapping(
        map: MmapRaw,
        start: NonNull<u8>,
        geometry: Geometry,
        role: Role,
        shared_path: Option<PathBuf>,
        huge_pages: bool,
    ) -> Self {
        // SAFETY: the mapping is `total_bytes` long, so both offsets stay inside it (and a
        // pointer inside a live mapping is non-null).
        let (base, locks) = unsafe {
            (
                NonNull::new_unchecked(start.as_ptr().add(geometry.header_bytes)),
                NonNull::new_unchecked(start.as_ptr().add(geometry.locks_offset).cast()),
            )
        };
        Self {
            map: Some(map),
            base,
            locks,
            geometry,
            role,
            shared_path,
            huge_pages,
        }
    }

    /// Number of rows.
    #[must_use]
    pub fn num_chunks(&self) -> usize {
        self.geometry.num_chunks
    }

    /// Payload bytes per row (the length of a granted row slice).
    #[must_use]
    pub fn chunk_bytes(&self) -> usize {
        self.geometry.chunk_bytes
    }

    /// Bytes between the starts of consecutive rows: `chunk_bytes` rounded up to the page size,
    /// so every row is page aligned (ready for `O_DIRECT`).
    #[must_use]
    pub fn row_stride(&self) -> usize {
        self.geometry.row_stride
    }

    /// Bytes before row 0: the header, lock words and ledgers, padded to whole pages. In a
    /// shared-memory file, row `i` starts at byte `header_bytes() + i * row_stride()`.
    #[must_use]
    pub fn header_bytes(&self) -> usize {
        self.geometry.header_bytes
    }

    /// Total mapped bytes (header plus rows).
    #[must_use]
    pub fn mapped_bytes(&self) -> usize {
        self.map.as_ref().map_or(
            self.geometry.header_bytes + self.geometry.row_bytes(),
            MmapRaw::len,
        )
    }

    /// The shared-memory file backing the arena, if any (owners and [`ArenaView`]s).
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
            num_chunks: self.geometry.num_chunks,
            chunk_bytes: self.geometry.chunk_bytes,
            row_stride: self.geometry.row_stride,
            row_locks: self.locks.as_ptr(),
        }
    }

    /// A view of another arena's rows that shares its row locks: grants made from the view and
    /// from the original exclude each other exactly as grants of one arena do. Dropping the view
    /// unmaps nothing. This is how a tier loaded from a shared library (which links its own copy
    /// of this crate) sees the host's arena. Grants made from it count as the original arena's
    /// owner process (a raw view of an [`ArenaView`] does not share that view's slot, so grants
    /// moved with `into_raw` must be adopted by an arena of the same kind).
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
        if parts.row_stride < parts.chunk_bytes || parts.num_chunks.checked_mul(parts.row_stride).is_none() {
            return Err(invalid);
        }
        let mut geometry = Geometry::new(parts.num_chunks, parts.chunk_bytes)?;
        geometry.row_stride = parts.row_stride;
        Ok(Arc::new(Self {
            map: None,
            base,
            locks,
            geometry,
            role: Role::RawView,
            shared_path: None,
            huge_pages: false,
        }))
    }

    /// Whether this arena is a view — made by [`ChunkArena::from_raw_parts`] or attached by
    /// [`ArenaView::open`] — rather than the owner of its memory.
    #[must_use]
    pub fn is_view(&self) -> bool {
        !matches!(self.role, Role::Owner { .. })
    }

    /// The row lock words.
    fn locks(&self) -> &[AtomicU32] {
        // SAFETY: `locks` points at `num_chunks` initialised words inside a mapping that lives as
        // long as `self` (ours, or for a raw view the original's, per `from_raw_parts`'s
        // contract); `AtomicU32` has the layout of `u32`.
        unsafe { std::slice::from_raw_parts(self.locks.as_ptr(), self.geometry.num_chunks) }
    }

    /// The start of the mapping (the header), for arenas that map one.
    fn header_start(&self) -> Option<NonNull<u8>> {
        self.map.as_ref().and_then(|m| NonNull::new(m.as_mut_ptr()))
    }

    /// The header, for arenas that map one.
    fn header(&self) -> Option<&Header> {
        // SAFETY: a mapping starts with a page-aligned `Header` (laid out by `initialise` or
        // validated by `ArenaView::open`) and lives as long as `self`; its fields are atomics.
        self.header_start()
            .map(|p| unsafe { &*p.as_ptr().cast::<Header>() })
    }

    fn row_ptr(&self, chunk: ChunkId) -> *mut u8 {
        // SAFETY: `chunk` was range-checked when its grant was acquired, so the offset
        // `chunk * row_stride` stays inside the row region of `num_chunks * row_stride` bytes.
        unsafe { self.base.as_ptr().add(chunk as usize * self.geometry.row_stride) }
    }
}

impl Drop for ChunkArena {
    fn drop(&mut self) {
        match &self.role {
            // Every grant holds an `Arc` of this arena, so only grants given up with `into_raw`
            // and never adopted can remain; the slot is given back with them released.
            Role::View { slot, .. } => {
                self.reclaim_slot(*slot);
            }
            Role::Owner {
                remove_on_drop: true, ..
            } => {
                // Unlinked while the flock is still held (the file closes after this), so a
                // successor that creates the path anew is never unlinked by us.
                if let Some(path) = &self.shared_path
                    && let Err(error) = std::fs::remove_file(path)
                {
                    tracing::warn!(path = %path.display(), %error, "cannot remove the chunk arena's file");
                }
            }
            Role::Owner { .. } | Role::RawView => {}
        }
    }
}

impl fmt::Debug for ChunkArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChunkArena")
            .field("num_chunks", &self.geometry.num_chunks)
            .field("chunk_bytes", &self.geometry.chunk_bytes)
            .field("row_stride", &self.geometry.row_stride)
            .field("shared_path", &self.shared_path)
            .field("is_view", &self.is_view())
            .finish_non_exhaustive()
    }
}
