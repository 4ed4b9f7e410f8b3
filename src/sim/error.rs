//! Errors of the simulator.

use std::path::PathBuf;

use tiering_core::ManagerError;

/// A boxed error from a chain builder (tier construction, configuration parsing).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a simulation could not run (or stopped).
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A peer named in the chain cannot be reached.
    #[error("{location}: peer {peer} is unreachable: {reason}")]
    UnreachablePeer {
        /// File, line and tier of the `peers` entry.
        location: String,
        /// The peer as written.
        peer: String,
        /// Why.
        reason: String,
    },
    /// A `peers` entry of a chain is not a `host:port` string.
    #[error("{location}: {peer} is not a \"host:port\" string")]
    InvalidPeer {
        /// File, line and tier of the `peers` entry.
        location: String,
        /// The entry as written.
        peer: String,
    },
    /// A simulator setting is out of range.
    #[error("invalid simulator setting `{name}`: {reason}")]
    InvalidSetting {
        /// The setting.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The tier chain could not be built.
    // The cause is part of the message (not a `source`), so `{:#}` does not print it twice.
    #[error("cannot build the tier chain: {0}")]
    Chain(BoxError),
    /// The trace file could not be read.
    #[error("cannot read trace {path}: {error}")]
    TraceIo {
        /// The trace file.
        path: PathBuf,
        /// The OS error.
        error: std::io::Error,
    },
    /// A trace line is invalid.
    #[error("{path}:{line}: {reason}")]
    TraceLine {
        /// The trace file (or `<trace>` for in-memory input).
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the record.
        reason: String,
    },
    /// A request cannot ever fit the device pool.
    #[error(
        "request {request} needs {needed} device blocks but the device pool has {available}; \
         raise `device_blocks` or shorten the request"
    )]
    RequestTooLarge {
        /// The request's name.
        request: String,
        /// Blocks it needs.
        needed: usize,
        /// Blocks in the pool.
        available: usize,
    },
    /// The workload has no requests.
    #[error("the workload has no requests")]
    EmptyWorkload,
    /// The manager returned an error to the engine.
    #[error("tiering manager: {0}")]
    Manager(ManagerError),
    /// The device-copy worker failed or disappeared.
    #[error("device-copy worker: {0}")]
    Worker(String),
    /// The run did not finish (no progress, or pending work that never drained).
    #[error("the simulation stalled: {0}")]
    Stalled(String),
}

impl From<ManagerError> for SimError {
    fn from(e: ManagerError) -> Self {
        Self::Manager(e)
    }
}
