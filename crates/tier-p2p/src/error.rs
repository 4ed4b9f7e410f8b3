//! Errors of the p2p tier.

use tiering_core::TierError;

/// An error of the p2p tier.
#[derive(Debug, thiserror::Error)]
pub enum P2pError {
    /// Invalid options.
    #[error("invalid p2p options: {0}")]
    Config(String),
    /// A ZeroMQ call failed.
    #[error("zeromq: {0}")]
    Zmq(String),
    /// A socket or thread could not be created.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Transfers did not become quiescent in time; their rows are kept (fail closed).
    #[error("{0} transfers still touch arena rows after the drain deadline")]
    NotQuiescent(usize),
}

impl From<P2pError> for TierError {
    fn from(e: P2pError) -> Self {
        match e {
            P2pError::Config(m) => Self::Config(m),
            P2pError::Io(e) => Self::Io(e),
            other => Self::Other(other.to_string()),
        }
    }
}
