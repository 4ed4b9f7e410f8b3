//! The handle through which the tier's own threads wake the manager's control plane.

use std::sync::Arc;

use parking_lot::Mutex;
use tiering_core::ControlWaker;

/// Shared by the tier and its I/O threads; filled by `set_waker`. Waking before the manager
/// installed its waker is a no-op: the next sweep or step picks the work up anyway.
#[derive(Clone, Default)]
pub(crate) struct Notifier(Arc<Mutex<Option<ControlWaker>>>);

impl Notifier {
    pub(crate) fn set(&self, waker: ControlWaker) {
        *self.0.lock() = Some(waker);
    }

    pub(crate) fn wake(&self) {
        if let Some(w) = self.0.lock().as_ref() {
            w.wake();
        }
    }
}
