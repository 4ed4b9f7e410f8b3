//! Errors of opening a disk tier. Runtime I/O failures are not errors of the API: they fail the
//! affected keys of a job and are logged.

use std::path::PathBuf;

use tiering_core::TierError;

/// Why a [`DiskTier`](crate::DiskTier) could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// An option is out of range or inconsistent with the geometry.
    #[error("invalid disk tier options: {0}")]
    InvalidOptions(String),
    /// A file-system operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Another process (or another tier in this one) has the slab open.
    #[error("{} is in use by another disk tier (its lock is held)", path.display())]
    Locked {
        /// The slab file.
        path: PathBuf,
    },
    /// The file is not a kvtier slab.
    #[error("{} is not a kvtier disk slab ({reason}); move it away or set wipe_on_mismatch = true", path.display())]
    NotASlab {
        /// The slab file.
        path: PathBuf,
        /// What did not match.
        reason: String,
    },
    /// The slab was written with another format version or chunk geometry.
    #[error(
        "{} was written for {found}, but this tier stores {expected}; \
         use another path or set wipe_on_mismatch = true to discard its contents",
        path.display()
    )]
    Mismatch {
        /// The slab file.
        path: PathBuf,
        /// What the file says.
        found: String,
        /// What this tier needs.
        expected: String,
    },
    /// The filesystem cannot hold a slab of the configured capacity.
    #[error(
        "not enough space for a {bytes}-byte slab at {}: {source} \
         (lower capacity, free space, or set preallocate = false)",
        path.display()
    )]
    NoSpace {
        /// The slab file.
        path: PathBuf,
        /// The size that could not be reserved.
        bytes: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `direct_io = true` was requested but cannot be honoured.
    #[error("O_DIRECT was required (direct_io = true) but {0}")]
    DirectIoUnavailable(String),
}

impl From<DiskError> for TierError {
    fn from(e: DiskError) -> Self {
        match e {
            DiskError::InvalidOptions(msg) => Self::Config(msg),
            other => Self::Other(other.to_string()),
        }
    }
}
