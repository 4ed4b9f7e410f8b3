//! What copy workers report — a store finished, a worker joined or left, a message was
//! rejected — and the queue those reports land in. Workers in the engine's process push through
//! a `StoreCompletionSender`, workers in other processes through the channel's server; the
//! manager drains the one queue. It sits in the channel, below the manager, because both
//! producers and the consumer share it.

use crate::key::OffloadKey;
use crate::sync::Mutex;

/// Something a copy worker told the manager.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WorkerEvent {
    /// Rank `rank` finished copying `keys` into their rows (or failed to).
    Stored {
        rank: u32,
        keys: Vec<OffloadKey>,
        success: bool,
    },
    /// Rank `rank` connected.
    Joined { rank: u32 },
    /// Rank `rank` disconnected; `clean` when it said goodbye first.
    Left { rank: u32, clean: bool },
    /// A message that was malformed or came from a foreign arena was rejected.
    Rejected,
}

/// The queue workers push to; shared by the senders, the channel and the manager state.
#[derive(Default)]
pub(crate) struct CompletionQueue {
    items: Mutex<Vec<WorkerEvent>>,
}

impl CompletionQueue {
    /// Queues one event.
    pub(crate) fn push(&self, event: WorkerEvent) {
        self.items.lock().push(event);
    }

    /// Every queued event, oldest first, leaving the queue empty.
    pub(crate) fn take(&self) -> Vec<WorkerEvent> {
        std::mem::take(&mut *self.items.lock())
    }
}
