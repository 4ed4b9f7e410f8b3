//! Off-step store completions: the engine's device-copy worker reports a finished device→primary
//! store straight to the manager, and the control thread completes it (primary `complete_store`,
//! cascade) between steps instead of waiting for the engine's next step. A peer waiting for
//! those chunks is then served without a scheduler step in its path.
//!
//! The engine still reports the same completion at its next step; a ledger makes whichever report
//! comes second a no-op, so nothing completes (or cascades) twice.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::ManagerError;
use crate::key::OffloadKey;
use crate::request::{ReqContext, RequestId};
use crate::waker::ControlWaker;

use super::state::TieringState;

/// Who reported a store completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CompletionSource {
    /// The engine, through `OffloadingManager::complete_store`.
    Engine,
    /// The device-copy worker, through a [`StoreCompletionSender`].
    Worker,
}

/// A store completion queued by a worker.
pub(crate) struct QueuedCompletion {
    keys: Vec<OffloadKey>,
    ctx: ReqContext,
    success: bool,
}

/// The queue workers push to; shared by the senders and the manager state.
#[derive(Default)]
pub(crate) struct CompletionQueue {
    items: Mutex<Vec<QueuedCompletion>>,
}

/// Reports finished device→primary stores to the manager from any thread (typically the
/// engine's device-copy worker), without waiting for a scheduler step. Obtained from
/// [`TieringManager::store_completion_sender`](super::TieringManager::store_completion_sender).
///
/// Once a sender exists, the engine must report every store through it as well as through
/// `complete_store` (with the same keys): the manager completes each store once, on whichever
/// report arrives first.
#[derive(Clone)]
pub struct StoreCompletionSender {
    queue: Arc<CompletionQueue>,
    waker: ControlWaker,
}

impl StoreCompletionSender {
    pub(crate) fn new(queue: Arc<CompletionQueue>, waker: ControlWaker) -> Self {
        Self { queue, waker }
    }

    /// Reports that the device→primary copy of `keys` (the `keys_to_store` of one
    /// `prepare_store`) finished, successfully or not, and wakes the control plane.
    pub fn report(&self, keys: Vec<OffloadKey>, ctx: ReqContext, success: bool) {
        self.queue
            .items
            .lock()
            .push(QueuedCompletion { keys, ctx, success });
        self.waker.wake();
    }
}

/// Store completions seen from one source and not yet matched by the other.
#[derive(Default)]
pub(crate) struct CompletionLedger {
    unmatched: HashMap<RequestId, Vec<(Vec<OffloadKey>, CompletionSource)>>,
    /// Set once a sender exists; before that the engine is the only source and nothing is
    /// recorded.
    pub(crate) dual_reporting: bool,
}

impl CompletionLedger {
    /// Whether this report is the second of a pair (then it must do nothing); otherwise records
    /// it so its twin will be recognised.
    fn is_duplicate(&mut self, rid: &RequestId, keys: &[OffloadKey], source: CompletionSource) -> bool {
        if !self.dual_reporting {
            return false;
        }
        if let Some(list) = self.unmatched.get_mut(rid)
            && let Some(pos) = list
                .iter()
                .position(|(k, s)| *s != source && k.as_slice() == keys)
        {
            list.swap_remove(pos);
            if list.is_empty() {
                self.unmatched.remove(rid);
            }
            return true;
        }
        false
    }

    fn record(&mut self, rid: &RequestId, keys: &[OffloadKey], source: CompletionSource) {
        if self.dual_reporting {
            self.unmatched
                .entry(rid.clone())
                .or_default()
                .push((keys.to_vec(), source));
        }
    }

    /// Completions waiting for their twin.
    pub(crate) fn unmatched(&self) -> usize {
        self.unmatched.values().map(Vec::len).sum()
    }
}

impl TieringState {
    /// `complete_store` from either source: the second report of a pair is a no-op.
    pub(crate) fn complete_store_from(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        success: bool,
        source: CompletionSource,
    ) -> Result<(), ManagerError> {
        if self.ledger.is_duplicate(ctx.id(), keys, source) {
            self.counters.duplicate_store_reports += 1;
            return Ok(());
        }
        self.complete_store_unlocked(keys, ctx, success)?;
        if source == CompletionSource::Worker {
            self.counters.off_step_store_completions += 1;
        }
        self.ledger.record(ctx.id(), keys, source);
        Ok(())
    }

    /// Applies every store completion workers queued since the last call. A report the manager
    /// rejects (unknown request, no pending store) is logged: there is no caller to return it to,
    /// and the engine's own report of the same store will surface the problem.
    pub(crate) fn apply_queued_completions(&mut self) {
        let queued = std::mem::take(&mut *self.completion_queue.items.lock());
        for c in queued {
            if let Err(e) = self.complete_store_from(&c.keys, &c.ctx, c.success, CompletionSource::Worker) {
                tracing::warn!(req = %c.ctx.id(), error = %e, "off-step store completion rejected");
            }
        }
    }
}
