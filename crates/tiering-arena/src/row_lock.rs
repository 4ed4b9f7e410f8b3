//! The row lock protocol: granting rows against the lock words in the mapping, and the reader
//! ledger a view keeps so the owner can reclaim a dead view's rows (see the module docs).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use super::layout::{READERS_MAX, WRITER};
use super::{ArenaError, ChunkArena, Role, RowRead, RowWrite};
use crate::chunk_id::ChunkId;

impl ChunkArena {
    /// The reader ledger of view slot `slot`.
    pub(super) fn slot_ledger(&self, slot: usize) -> Option<&[AtomicU8]> {
        let start = self.header_start()?;
        let n = self.geometry.num_chunks;
        // SAFETY: the mapping holds the layout of `geometry` and lives as long as `self`.
        let all = unsafe { self.geometry.ledgers(start.as_ptr()) };
        all.get(slot * n..(slot + 1) * n)
    }

    /// This arena's own ledger: `Some` only for an [`ArenaView`].
    fn own_ledger(&self) -> Option<&[AtomicU8]> {
        match self.role {
            Role::View { slot, .. } => self.slot_ledger(slot),
            _ => None,
        }
    }

    /// The lock word this arena's write grants store.
    fn writer_word(&self) -> u32 {
        match self.role {
            Role::View { slot, .. } => WRITER | (slot as u32 + 1),
            _ => WRITER,
        }
    }

    fn lock_index(&self, chunk: ChunkId) -> Result<usize, ArenaError> {
        let idx = chunk as usize;
        if idx < self.geometry.num_chunks {
            Ok(idx)
        } else {
            Err(ArenaError::OutOfRange {
                chunk,
                num_chunks: self.geometry.num_chunks,
            })
        }
    }

    fn acquire_read(&self, chunk: ChunkId) -> Result<(), ArenaError> {
        let idx = self.lock_index(chunk)?;
        let lock = &self.locks()[idx];
        let mut cur = lock.load(Ordering::Relaxed);
        loop {
            if cur & WRITER != 0 || cur >= READERS_MAX {
                return Err(ArenaError::RowBusy {
                    chunk,
                    held: describe_holder(cur),
                });
            }
            match lock.compare_exchange_weak(cur, cur + 1, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => break,
                Err(actual) => cur = actual,
            }
        }
        // The lock word is raised before the ledger (and lowered after it on release), so a view
        // dying in between leaves its ledger at most equal to its share of the word: a reclaim
        // can leak a reader count but never release someone else's.
        if let Some(ledger) = self.own_ledger()
            && ledger[idx]
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| c.checked_add(1))
                .is_err()
        {
            lock.fetch_sub(1, Ordering::Release);
            return Err(ArenaError::RowBusy {
                chunk,
                held: "read by this view 255 times already",
            });
        }
        Ok(())
    }

    fn acquire_write(&self, chunk: ChunkId) -> Result<(), ArenaError> {
        let lock = &self.locks()[self.lock_index(chunk)?];
        lock.compare_exchange(0, self.writer_word(), Ordering::Acquire, Ordering::Relaxed)
            .map(|_| ())
            .map_err(|held| ArenaError::RowBusy {
                chunk,
                held: describe_holder(held),
            })
    }

    /// Releases a reader count taken by [`ChunkArena::acquire_read`] on this arena.
    pub(super) fn release_read(&self, chunk: ChunkId) {
        let idx = chunk as usize;
        if let Some(ledger) = self.own_ledger() {
            ledger[idx].fetch_sub(1, Ordering::Relaxed);
        }
        self.locks()[idx].fetch_sub(1, Ordering::Release);
    }

    /// Releases the writer lock taken by [`ChunkArena::acquire_write`].
    pub(super) fn release_write(&self, chunk: ChunkId) {
        self.locks()[chunk as usize].store(0, Ordering::Release);
    }

    /// Grants shared read access to one row.
    ///
    /// # Errors
    /// The id is out of range or the row is granted to a writer (in any process).
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
    /// The id is out of range or the row is granted to anyone else (in any process).
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

    /// Whether any grant (of any process) currently holds `chunk` (for diagnostics and tests).
    #[must_use]
    pub fn is_row_granted(&self, chunk: ChunkId) -> bool {
        self.locks()
            .get(chunk as usize)
            .is_some_and(|l| l.load(Ordering::Acquire) != 0)
    }

    /// Number of rows currently granted, by any process (for leak checks in tests).
    #[must_use]
    pub fn granted_rows(&self) -> usize {
        self.locks()
            .iter()
            .filter(|l| l.load(Ordering::Acquire) != 0)
            .count()
    }
}

/// What a busy lock word says about its holder.
fn describe_holder(word: u32) -> &'static str {
    match word {
        WRITER => "granted to a writer in the owning process",
        w if w & WRITER != 0 => "granted to a writer in a view process",
        READERS_MAX => "too many readers",
        _ => "granted to readers",
    }
}
