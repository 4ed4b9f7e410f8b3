//! The in-process reporting handle of a copy worker.

use std::sync::Arc;

use crate::key::OffloadKey;
use crate::waker::ControlWaker;

use crate::channel::{CompletionQueue, WorkerEvent};

/// Reports finished device→primary stores to the manager from any thread of the engine's
/// process (typically its device-copy worker), without waiting for a scheduler step. Obtained
/// from [`TieringManager::store_completion_sender`](crate::TieringManager::store_completion_sender);
/// worker processes use the [completion channel](crate::channel) instead.
///
/// Reports only count in off-step mode (`ManagerConfig::off_step`); the engine still reports
/// the same stores through `complete_store`, and the manager applies each key once, on the
/// first authoritative report (see `docs/ARCHITECTURE.md`, "Store completions").
#[derive(Clone)]
pub struct StoreCompletionSender {
    queue: Arc<CompletionQueue>,
    waker: ControlWaker,
}

impl StoreCompletionSender {
    pub(crate) fn new(queue: Arc<CompletionQueue>, waker: ControlWaker) -> Self {
        Self { queue, waker }
    }

    /// Reports, as rank 0, that the copies of `keys` into their rows finished (or failed), and
    /// wakes the control plane.
    pub fn report(&self, keys: &[OffloadKey], success: bool) {
        self.report_rank(0, keys, success);
    }

    /// Reports for tensor-parallel rank `rank` (0-based, below `ManagerConfig::reporters`).
    pub fn report_rank(&self, rank: u32, keys: &[OffloadKey], success: bool) {
        self.queue.push(WorkerEvent::Stored {
            rank,
            keys: keys.to_vec(),
            success,
        });
        self.waker.wake();
    }
}

impl std::fmt::Debug for StoreCompletionSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreCompletionSender").finish_non_exhaustive()
    }
}
