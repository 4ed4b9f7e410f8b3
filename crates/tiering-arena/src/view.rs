//! Another process's window on a shared arena ([`ArenaView`]), its view slot, and the owner's
//! recovery of rows held by views whose process died ([`ChunkArena::reclaim_dead_views`]).

use std::fs::OpenOptions;
use std::io;
use std::mem::size_of;
use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use memmap2::MmapOptions;

use super::file_lock::{try_flock, try_lock_byte, unflock, unlock_byte};
use super::layout::{Geometry, Header, MAX_VIEWS, WRITER, slot_lock_offset};
use super::{ArenaError, ChunkArena, HeaderProblem, Role};

/// A shared arena opened by a process that does not own it (an engine's copy worker).
///
/// It dereferences to the underlying [`ChunkArena`], so a view hands out the same [`RowRead`] /
/// [`RowWrite`](super::RowWrite) grants as the owner (`view.read_row(c)`, `view.write_row(c)`);
/// they take the lock words in the shared mapping, so they exclude the owner's grants and other
/// views' grants row by row. A grant's slice gives the raw pointer and length for DMA or a Python
/// buffer (`grant.as_ptr()`, `grant.len()`), valid while the grant lives. Dropping the view (and
/// its grants) gives its slot back; a view whose process dies is recovered by the owner with
/// [`ChunkArena::reclaim_dead_views`].
///
/// [`RowRead`]: super::RowRead
#[derive(Clone, Debug)]
pub struct ArenaView {
    arena: Arc<ChunkArena>,
}

/// What [`ChunkArena::reclaim_dead_views`] gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReclaimedViews {
    /// View slots whose process was gone.
    pub views: usize,
    /// Row locks released (write locks, plus rows whose reader counts were lowered).
    pub rows: usize,
}

impl ArenaView {
    /// Attaches to the shared arena at `path`.
    ///
    /// # Errors
    /// The file cannot be opened or mapped ([`ArenaError::Map`]), is not a valid arena of this
    /// layout ([`ArenaError::InvalidHeader`]), has no live owner ([`ArenaError::NoOwner`]), or
    /// every view slot is taken ([`ArenaError::TooManyViews`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, ArenaError> {
        Self::open_checked(path.as_ref(), None)
    }

    /// As [`ArenaView::open`], and refuses an arena whose geometry is not `num_chunks` rows of
    /// `chunk_bytes` bytes ([`HeaderProblem::Mismatch`]) — for a worker that was told the
    /// geometry separately and must not copy into a differently shaped arena.
    ///
    /// # Errors
    /// As [`ArenaView::open`], plus the mismatch.
    pub fn open_expecting(
        path: impl AsRef<Path>,
        num_chunks: usize,
        chunk_bytes: usize,
    ) -> Result<Self, ArenaError> {
        Self::open_checked(path.as_ref(), Some((num_chunks, chunk_bytes)))
    }

    fn open_checked(path: &Path, expected: Option<(usize, usize)>) -> Result<Self, ArenaError> {
        let invalid = |problem| ArenaError::InvalidHeader {
            path: path.to_path_buf(),
            problem,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| ArenaError::Map {
                bytes: 0,
                path: Some(path.to_path_buf()),
                source,
            })?;
        let file_err = |source| ArenaError::File {
            path: path.to_path_buf(),
            source,
        };
        let len = file.metadata().map_err(file_err)?.len();
        let header_len = size_of::<Header>() as u64;
        if len < header_len {
            return Err(invalid(HeaderProblem::Truncated {
                len,
                expected: header_len,
            }));
        }
        let bytes = usize::try_from(len).map_err(|_| {
            invalid(HeaderProblem::Geometry(format!(
                "{len} bytes do not fit in the address space"
            )))
        })?;
        let map = MmapOptions::new()
            .len(bytes)
            .map_raw(&file)
            .map_err(|source| ArenaError::Map {
                bytes,
                path: Some(path.to_path_buf()),
                source,
            })?;
        // SAFETY: `map` is a page-aligned mapping of `len >= size_of::<Header>()` bytes, alive
        // for the call.
        let geometry = unsafe { Geometry::read(map.as_ptr(), len) }.map_err(invalid)?;
        if let Some((expected_chunks, expected_bytes)) = expected
            && (geometry.num_chunks, geometry.chunk_bytes) != (expected_chunks, expected_bytes)
        {
            return Err(invalid(HeaderProblem::Mismatch {
                found_chunks: geometry.num_chunks,
                found_bytes: geometry.chunk_bytes,
                expected_chunks,
                expected_bytes,
            }));
        }
        // A shared lock is only obtainable when no owner holds its exclusive one.
        if try_flock(&file, libc::LOCK_SH).map_err(file_err)? {
            unflock(&file).map_err(file_err)?;
            return Err(ArenaError::NoOwner {
                path: path.to_path_buf(),
            });
        }
        let mut slot = None;
        for candidate in 0..MAX_VIEWS {
            if try_lock_byte(&file, slot_lock_offset(candidate)).map_err(file_err)? {
                slot = Some(candidate);
                break;
            }
        }
        let slot = slot.ok_or_else(|| ArenaError::TooManyViews {
            path: path.to_path_buf(),
            max_views: MAX_VIEWS,
        })?;
        let start = std::ptr::NonNull::new(map.as_mut_ptr())
            .ok_or_else(|| file_err(io::Error::other("mapping returned a null pointer")))?;
        let arena = ChunkArena::over_mapping(
            map,
            start,
            geometry,
            Role::View { file, slot },
            Some(path.to_path_buf()),
            false,
        );
        // A previous holder of the slot may have died before the owner reclaimed it: its
        // leftovers are released now, under the slot lock we hold.
        let stale = arena.reclaim_slot(slot);
        if stale > 0 {
            tracing::info!(path = %path.display(), slot, rows = stale, "released rows a dead view left in its slot");
        }
        if let Some(header) = arena.header() {
            header.slots[slot]
                .pid
                .store(std::process::id(), Ordering::Relaxed);
            header.slots[slot].in_use.store(1, Ordering::Release);
        }
        Ok(Self {
            arena: Arc::new(arena),
        })
    }

    /// The arena this view maps (to pass where an `Arc<ChunkArena>` is expected).
    #[must_use]
    pub fn arena(&self) -> &Arc<ChunkArena> {
        &self.arena
    }

    /// Whether the arena's owner still holds it (its exclusive lock on the file). A worker can
    /// poll this to stop copying for a manager that has exited or crashed.
    ///
    /// # Errors
    /// A failing `flock` on the arena's file.
    pub fn owner_alive(&self) -> Result<bool, ArenaError> {
        let Role::View { file, .. } = &self.arena.role else {
            return Ok(true);
        };
        let file_err = |source| ArenaError::File {
            path: self.arena.shared_path.clone().unwrap_or_default(),
            source,
        };
        // A shared lock is only obtainable when no owner holds its exclusive one.
        if try_flock(file, libc::LOCK_SH).map_err(file_err)? {
            unflock(file).map_err(file_err)?;
            Ok(false)
        } else {
            Ok(true)
        }
    }

    /// The view slot this view holds in the arena's header.
    #[must_use]
    pub fn slot(&self) -> usize {
        match self.arena.role {
            Role::View { slot, .. } => slot,
            // Only `open_checked` builds an `ArenaView`, always with a view role.
            _ => 0,
        }
    }
}

impl Deref for ArenaView {
    type Target = Arc<ChunkArena>;

    fn deref(&self) -> &Arc<ChunkArena> {
        &self.arena
    }
}

impl ChunkArena {
    /// Gives back the rows held by views whose process has died (killed, crashed, or exited
    /// without dropping its grants): their write locks and their counted read grants. A view is
    /// dead when the kernel has released its slot lock, which happens only when every descriptor
    /// of its open file is closed — so a live view, however slow, is never touched. Call it on
    /// the owner when a worker's death is detected (or periodically); it is cheap when no slot is
    /// in use and a no-op on anonymous arenas and views.
    ///
    /// # Errors
    /// A failing `fcntl` on the arena's file.
    pub fn reclaim_dead_views(&self) -> Result<ReclaimedViews, ArenaError> {
        let (Role::Owner { file: Some(file), .. }, Some(header)) = (&self.role, self.header()) else {
            return Ok(ReclaimedViews::default());
        };
        let file_err = |source| ArenaError::File {
            path: self.shared_path.clone().unwrap_or_default(),
            source,
        };
        let mut reclaimed = ReclaimedViews::default();
        for (slot, entry) in header.slots.iter().enumerate() {
            if entry.in_use.load(Ordering::Acquire) == 0 {
                continue;
            }
            let offset = slot_lock_offset(slot);
            if !try_lock_byte(file, offset).map_err(file_err)? {
                continue;
            }
            let pid = entry.pid.load(Ordering::Relaxed);
            let rows = self.reclaim_slot(slot);
            tracing::warn!(slot, pid, rows, "reclaimed the rows of a dead arena view");
            reclaimed.views += 1;
            reclaimed.rows += rows;
            unlock_byte(file, offset).map_err(file_err)?;
        }
        Ok(reclaimed)
    }

    /// Number of view slots in use (views attached, or dead and not yet reclaimed).
    #[must_use]
    pub fn attached_views(&self) -> usize {
        self.header().map_or(0, |h| {
            h.slots
                .iter()
                .filter(|s| s.in_use.load(Ordering::Acquire) != 0)
                .count()
        })
    }

    /// Releases every lock held under view slot `slot` and frees the slot; returns the number of
    /// row locks released. The caller holds the slot's byte lock, so the slot's holder is this
    /// arena (dropping) or a dead process: nobody else changes the slot's ledger meanwhile.
    pub(super) fn reclaim_slot(&self, slot: usize) -> usize {
        let Some(ledger) = self.slot_ledger(slot) else {
            return 0;
        };
        let tag = WRITER | (slot as u32 + 1);
        let mut rows = 0;
        for (lock, count) in self.locks().iter().zip(ledger) {
            let readers = count.swap(0, Ordering::AcqRel);
            if readers > 0 {
                lock.fetch_sub(u32::from(readers), Ordering::Release);
                rows += 1;
            }
            if lock
                .compare_exchange(tag, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                rows += 1;
            }
        }
        if let Some(header) = self.header() {
            header.slots[slot].pid.store(0, Ordering::Relaxed);
            header.slots[slot].in_use.store(0, Ordering::Release);
        }
        rows
    }
}
