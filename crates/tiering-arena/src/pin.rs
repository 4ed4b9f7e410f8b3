//! Pinning the rows for device DMA: `mlock` and the engine's registration hook.

use std::io;

use super::{ArenaError, ChunkArena};

/// An engine's DMA registration function: receives the start and length of the row region
/// (e.g. calls `cudaHostRegister(ptr, len, …)`) and returns a message on failure.
pub type DmaRegistrar<'a> = &'a dyn Fn(*mut u8, usize) -> Result<(), String>;

impl ChunkArena {
    /// The row region: the address of row 0 and `num_chunks × row_stride` bytes. This is the
    /// range to register with a device; rows are handed out only through grants, so a caller
    /// must not read or write it outside one.
    #[must_use]
    pub fn row_region(&self) -> (*mut u8, usize) {
        (self.base.as_ptr(), self.geometry.row_bytes())
    }

    /// Locks the row region in RAM (`mlock`), so rows are never swapped out under a device copy.
    /// Idempotent; the lock ends when the mapping is unmapped. Works on an [`ArenaView`] too
    /// (it locks that process's mapping of the same pages).
    ///
    /// # Errors
    /// [`ArenaError::LockMemory`] with the OS reason and the current `RLIMIT_MEMLOCK` when the
    /// kernel refuses (the usual cause: the limit is lower than the arena).
    ///
    /// [`ArenaView`]: super::ArenaView
    pub fn lock_memory(&self) -> Result<(), ArenaError> {
        let (ptr, bytes) = self.row_region();
        // SAFETY: `ptr .. ptr + bytes` is the row region of a mapping `self` keeps alive; mlock
        // changes no memory contents.
        let rc = unsafe { libc::mlock(ptr.cast_const().cast(), bytes) };
        if rc == 0 {
            tracing::debug!(bytes, "chunk arena locked in memory");
            return Ok(());
        }
        let source = io::Error::last_os_error();
        Err(ArenaError::LockMemory {
            bytes,
            limit: memlock_limit(),
            source,
        })
    }

    /// Hands the row region to an engine's DMA registration function (see [`DmaRegistrar`]),
    /// so the engine can pin it for device copies, e.g. with `cudaHostRegister`. The arena
    /// does not remember the registration: the engine unregisters (e.g. `cudaHostUnregister`)
    /// before it drops its last handle on the arena, because the pages are unmapped then.
    ///
    /// # Errors
    /// [`ArenaError::DmaRegistration`] carrying the hook's message.
    pub fn register_for_dma(&self, register: DmaRegistrar<'_>) -> Result<(), ArenaError> {
        let (ptr, bytes) = self.row_region();
        register(ptr, bytes).map_err(|reason| ArenaError::DmaRegistration { bytes, reason })
    }
}

/// The soft `RLIMIT_MEMLOCK` (`None` when unlimited or unknown).
fn memlock_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable `rlimit` for the duration of the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &raw mut limit) };
    (rc == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}
