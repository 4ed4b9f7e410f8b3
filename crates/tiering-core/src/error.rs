//! Error types of tiers and of the manager.

use std::sync::Arc;

use crate::arena::ArenaError;
use crate::job::JobId;
use crate::key::OffloadKey;
use crate::request::RequestId;

/// An error reported by a tier. Contract violations leave the tier unchanged.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The key is not resident in the tier.
    #[error("key {0} is not in the tier")]
    NotFound(OffloadKey),
    /// The key is resident but a write is still in flight.
    #[error("key {0} is not ready for reading (a write is in flight)")]
    NotReady(OffloadKey),
    /// A load or read was completed for a key that holds no pin.
    #[error("key {0} is not pinned (complete without a matching prepare)")]
    NotPinned(OffloadKey),
    /// An arena grant failed.
    #[error(transparent)]
    Arena(#[from] ArenaError),
    /// An I/O error.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Invalid configuration or construction input.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Anything else, described.
    #[error("{0}")]
    Other(String),
    /// The tier panicked in a call; the panic was caught at the manager's tier-call boundary
    /// (`docs/ARCHITECTURE.md`, "Panic boundary").
    #[error("panicked in {call}: {message}")]
    Panicked {
        /// The tier method that panicked (`lookup`, `submit_store`, …).
        call: &'static str,
        /// The panic's message.
        message: String,
    },
}

/// Why the control-plane thread stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlPlaneFailure {
    /// What failed, with the tier and the error or panic message.
    pub message: String,
}

/// An error returned by the manager.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ManagerError {
    /// The control plane failed (a tier's sweep failed or panicked). Returned once, by the next
    /// engine call; by then the failing tier was quarantined or the manager fell back to
    /// servicing tiers at step end, per `ManagerConfig::on_tier_failure`.
    #[error("the control plane failed: {}", .0.message)]
    ControlPlane(Arc<ControlPlaneFailure>),
    /// The engine named a request that `on_new_request` never announced (or that was finalized).
    #[error("unknown request {0}")]
    UnknownRequest(RequestId),
    /// `complete_store` for a request with no store pending.
    #[error("request {0} has no pending store to complete")]
    NoPendingStore(RequestId),
    /// The primary tier refused an engine call (a contract violation); nothing changed.
    #[error("primary tier: {0}")]
    Primary(Arc<TierError>),
    /// A tier reported a job the manager does not know.
    #[error("tier {tier} reported unknown {job}")]
    UnknownJob {
        /// The reporting tier.
        tier: String,
        /// The job id.
        job: JobId,
    },
    /// A tier reported a job that belongs to another tier.
    #[error("tier {reported_by} reported {job}, which belongs to tier {owner}")]
    WrongTier {
        /// The job id.
        job: JobId,
        /// The reporting tier.
        reported_by: String,
        /// The tier the job was submitted to.
        owner: String,
    },
    /// A partial result named keys that are not in the job.
    #[error("tier {tier} reported {job} as partial with keys outside the job")]
    InvalidPartialResult {
        /// The reporting tier.
        tier: String,
        /// The job id.
        job: JobId,
    },
    /// A secondary tier failed.
    #[error("tier {tier}: {source}")]
    Tier {
        /// The tier's name.
        tier: String,
        /// The tier's error.
        source: Arc<TierError>,
    },
    /// `reset_cache` found jobs still registered after every tier drained.
    #[error("reset_cache: {0} jobs still outstanding after draining every tier")]
    ResetLeftJobs(usize),
    /// `shutdown` could not take the lock: the control thread is stuck inside a tier. Tiers and
    /// the arena are left alive.
    #[error("shutdown timed out after {0:?} waiting for the control thread to leave a tier call")]
    ShutdownTimedOut(std::time::Duration),
    /// A tier's blocking call (`drain_jobs`, `shutdown`) did not return in time; the tier was
    /// abandoned and quarantined.
    #[error("tier {tier}: {op} did not return within {timeout:?}; the tier was abandoned")]
    TierTimedOut {
        /// The tier's name.
        tier: String,
        /// The call that hung.
        op: &'static str,
        /// The bound it exceeded.
        timeout: std::time::Duration,
    },
    /// A handle operation could not take the manager's lock in time (a step is held elsewhere,
    /// or the control thread is stuck inside a tier).
    #[error("{0} could not take the manager lock within {1:?} (a step is held, or a tier call is stuck)")]
    LockTimedOut(&'static str, std::time::Duration),
    /// The completion channel failed.
    #[error("completion channel: {0}")]
    Channel(String),
    /// The manager has failed for good: its primary tier (which cannot be quarantined: it owns
    /// the arena) or the manager's own code panicked, so its state can no longer be trusted.
    /// Every later engine call returns this; `shutdown` still runs (and keeps the arena alive).
    #[error("the manager has failed and refuses further calls: {0}")]
    Failed(Arc<str>),
    /// The manager was shut down.
    #[error("the manager has been shut down")]
    ShutDown,
}

impl ManagerError {
    pub(crate) fn primary(e: TierError) -> Self {
        Self::Primary(Arc::new(e))
    }

    pub(crate) fn tier(tier: &str, e: TierError) -> Self {
        Self::Tier {
            tier: tier.to_owned(),
            source: Arc::new(e),
        }
    }
}

/// Renders a caught panic's payload for an error message.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_owned()
    }
}
