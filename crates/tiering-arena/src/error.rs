//! What can go wrong creating, opening, pinning or granting rows of an arena.

use std::path::PathBuf;

use crate::chunk_id::ChunkId;

/// Errors from creating, opening or pinning an arena, or granting its rows.
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
    /// The mapping could not be created (or pre-faulted), or its file could not be opened.
    #[error("cannot map {bytes} bytes for the chunk arena{}: {source}", path.as_ref().map(|p| format!(" at {}", p.display())).unwrap_or_default())]
    Map {
        /// Mapping size (0 when the file could not even be opened).
        bytes: usize,
        /// The shared-memory file, when one was requested.
        path: Option<PathBuf>,
        /// The OS error.
        source: std::io::Error,
    },
    /// Another process (or another arena in this one) already owns the shared-memory file.
    #[error(
        "the chunk arena at {} is already owned by another manager (its owner holds an exclusive lock on the file); \
         give each manager its own shared_memory path, or open the arena with ArenaView::open to share its rows",
        path.display()
    )]
    AlreadyOwned {
        /// The shared-memory file.
        path: PathBuf,
    },
    /// A new owner found views of a previous owner still attached to the file; reinitialising
    /// the arena under them would forget their row grants.
    #[error(
        "{views} view(s) of a previous owner are still attached to the chunk arena at {}; stop those worker processes first",
        path.display()
    )]
    ViewsStillAttached {
        /// The shared-memory file.
        path: PathBuf,
        /// Live views found.
        views: usize,
    },
    /// [`ArenaView::open`](super::ArenaView::open) found an arena file that no live manager owns.
    #[error("the chunk arena at {} has no owner (no manager holds it); refusing to attach a view to a stale arena", path.display())]
    NoOwner {
        /// The shared-memory file.
        path: PathBuf,
    },
    /// The file is not a kvtier arena of this layout (see [`HeaderProblem`]).
    #[error("{} is not a usable kvtier chunk arena: {problem}", path.display())]
    InvalidHeader {
        /// The file that was opened.
        path: PathBuf,
        /// What is wrong with it.
        problem: HeaderProblem,
    },
    /// Every view slot of the arena is taken by a live view.
    #[error("all {max_views} view slots of the chunk arena at {} are taken by live views", path.display())]
    TooManyViews {
        /// The shared-memory file.
        path: PathBuf,
        /// The number of slots in the layout.
        max_views: usize,
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
    /// `mlock` refused to pin the rows (usually `RLIMIT_MEMLOCK`).
    #[error(
        "cannot lock {bytes} bytes of the chunk arena in memory (RLIMIT_MEMLOCK soft limit: {}): {source}; \
         raise the limit (ulimit -l, LimitMEMLOCK=, or CAP_IPC_LOCK) or run without locking",
        limit.map_or_else(|| "unlimited".to_owned(), |l| format!("{l} bytes"))
    )]
    LockMemory {
        /// Bytes that were to be locked.
        bytes: usize,
        /// The soft `RLIMIT_MEMLOCK` at the time of the call (`None` = unlimited).
        limit: Option<u64>,
        /// The OS error.
        source: std::io::Error,
    },
    /// The engine's DMA registration hook refused the rows.
    #[error("registering the chunk arena's {bytes} row bytes for DMA failed: {reason}")]
    DmaRegistration {
        /// Bytes that were to be registered.
        bytes: usize,
        /// The hook's message.
        reason: String,
    },
    /// A syscall on the arena's file (locking a view slot) failed.
    #[error("arena file operation on {} failed: {source}", path.display())]
    File {
        /// The shared-memory file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Why a file is not an arena [`ArenaView::open`](super::ArenaView::open) can attach to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderProblem {
    /// The file is shorter than its header or its rows.
    #[error("truncated: {len} bytes, expected {expected}")]
    Truncated {
        /// The file's length.
        len: u64,
        /// The length the layout requires.
        expected: u64,
    },
    /// The magic number is not kvtier's.
    #[error("bad magic {found:#018x} (not a kvtier arena, or its owner has not finished creating it)")]
    BadMagic {
        /// What the file holds.
        found: u64,
    },
    /// The layout version is not the one this build understands.
    #[error("layout version {found}, this build reads version {expected}")]
    Version {
        /// What the file holds.
        found: u32,
        /// What this build writes.
        expected: u32,
    },
    /// The header's geometry is inconsistent with itself or with this build's layout.
    #[error("inconsistent geometry: {0}")]
    Geometry(String),
    /// The arena is valid but not the geometry the caller expected.
    #[error(
        "geometry mismatch: the arena has {found_chunks} rows of {found_bytes} bytes, expected {expected_chunks} rows of {expected_bytes} bytes"
    )]
    Mismatch {
        /// Rows in the file.
        found_chunks: usize,
        /// Chunk bytes in the file.
        found_bytes: usize,
        /// Rows the caller expected.
        expected_chunks: usize,
        /// Chunk bytes the caller expected.
        expected_bytes: usize,
    },
}
