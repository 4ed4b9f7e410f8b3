//! The waker tiers use to tell the control-plane thread that work arrived.

use std::sync::Arc;
use std::time::Duration;

use crate::sync::{Condvar, Mutex};

#[derive(Default)]
struct WakerInner {
    pending: Mutex<bool>,
    cond: Condvar,
}

/// Wakes the control-plane thread early: a tier calls [`ControlWaker::wake`] when a job finishes
/// or an inbound peer message arrives, so the next sweep runs now instead of after the idle
/// timeout. Cheap to clone; waking with no thread waiting just leaves a pending flag.
#[derive(Clone, Default)]
pub struct ControlWaker(Arc<WakerInner>);

impl ControlWaker {
    /// A new waker with nothing pending.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Signals that there is work for the control plane.
    pub fn wake(&self) {
        *self.0.pending.lock() = true;
        self.0.cond.notify_one();
    }

    /// Waits until woken or until `timeout` passes; returns whether a wake was pending. Clears
    /// the pending flag.
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut pending = self.0.pending.lock();
        if !*pending {
            let _ = self.0.cond.wait_for(&mut pending, timeout);
        }
        std::mem::replace(&mut *pending, false)
    }
}

impl std::fmt::Debug for ControlWaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlWaker")
            .field("pending", &*self.0.pending.lock())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pending_wake_returns_at_once() {
        let w = ControlWaker::new();
        w.wake();
        assert!(w.wait(Duration::from_secs(30)));
        assert!(!w.wait(Duration::from_millis(1)));
    }

    #[test]
    fn wake_from_another_thread_ends_the_wait() {
        let w = ControlWaker::new();
        let w2 = w.clone();
        let t = std::thread::spawn(move || w2.wait(Duration::from_secs(60)));
        // Whether the wake lands before or during the wait, the waiter reports it.
        std::thread::sleep(Duration::from_millis(5));
        w.wake();
        assert!(t.join().unwrap());
    }
}
