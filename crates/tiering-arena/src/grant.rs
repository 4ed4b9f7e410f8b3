//! Row grants: shared read access ([`RowRead`]) or exclusive write access ([`RowWrite`]) to one
//! arena row, and the per-job bundle of them ([`RowGrant`]).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use super::ChunkArena;
use crate::chunk_id::ChunkId;

/// Shared read access to one arena row; released on drop.
pub struct RowRead {
    pub(super) arena: Arc<ChunkArena>,
    pub(super) chunk: ChunkId,
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
        debug_assert!((chunk as usize) < arena.num_chunks());
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
        unsafe { std::slice::from_raw_parts(self.arena.row_ptr(self.chunk), self.arena.chunk_bytes()) }
    }
}

impl Drop for RowRead {
    fn drop(&mut self) {
        self.arena.release_read(self.chunk);
    }
}

impl fmt::Debug for RowRead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RowRead({})", self.chunk)
    }
}

/// Exclusive write access to one arena row; released on drop.
pub struct RowWrite {
    pub(super) arena: Arc<ChunkArena>,
    pub(super) chunk: ChunkId,
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
        debug_assert!((chunk as usize) < arena.num_chunks());
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
        unsafe { std::slice::from_raw_parts(self.arena.row_ptr(self.chunk), self.arena.chunk_bytes()) }
    }
}

impl DerefMut for RowWrite {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`; `&mut self` makes this the only live borrow of the row.
        unsafe { std::slice::from_raw_parts_mut(self.arena.row_ptr(self.chunk), self.arena.chunk_bytes()) }
    }
}

impl Drop for RowWrite {
    fn drop(&mut self) {
        self.arena.release_write(self.chunk);
    }
}

impl fmt::Debug for RowWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RowWrite({})", self.chunk)
    }
}

/// The rows a transfer job (`tiering_core::TransferJob`) may touch, parallel to its keys.
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
