//! The bound on slot I/O calls in flight: `io_threads` permits, while for large chunks more
//! threads than that serve the queues (see [`crate::pool::thread_count`]).
//!
//! A thread holds a permit only for its `preadv`/`pwritev` (and the `fdatasync` of
//! `sync = "always"`), so the device sees at most `io_threads` calls at once, while the seal
//! checksums of the next stores and the verification of finished loads run on the other
//! threads. Without the spare threads, every checksum a thread computes is time in which its
//! share of the queue depth sits idle; with them, every call costs a spare thread's sleep and
//! wake-up at the gate, which only large chunks' checksums repay.
//!
//! A thread that took a run and waits for a permit has not started it: `drain_jobs` moves the
//! gate to a new epoch, and every waiter of an older epoch gives its run back to be cancelled.

use parking_lot::{Condvar, Mutex};

#[derive(Default)]
struct GateState {
    in_flight: usize,
    epoch: u64,
}

/// Permits for slot I/O calls.
pub(crate) struct IoGate {
    state: Mutex<GateState>,
    cond: Condvar,
    permits: usize,
}

/// One I/O call in flight; the permit returns to the gate when this drops (a panic included).
pub(crate) struct Permit<'a>(&'a IoGate);

impl IoGate {
    /// A gate letting `permits` calls through at once.
    pub(crate) fn new(permits: usize) -> Self {
        Self {
            state: Mutex::new(GateState::default()),
            cond: Condvar::new(),
            permits: permits.max(1),
        }
    }

    /// The current epoch: a run taken now waits for its permit in this epoch.
    pub(crate) fn epoch(&self) -> u64 {
        self.state.lock().epoch
    }

    /// Waits for a permit; `None` when the gate moved past `epoch` first (the run was
    /// cancelled while it waited).
    pub(crate) fn enter(&self, epoch: u64) -> Option<Permit<'_>> {
        let mut st = self.state.lock();
        loop {
            if st.epoch != epoch {
                return None;
            }
            if st.in_flight < self.permits {
                st.in_flight += 1;
                return Some(Permit(self));
            }
            self.cond.wait(&mut st);
        }
    }

    /// Sends every run waiting for a permit back to be cancelled.
    pub(crate) fn cancel_waiting(&self) {
        self.state.lock().epoch += 1;
        self.cond.notify_all();
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.state.lock().in_flight -= 1;
        self.0.cond.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_the_permits_pass_and_a_new_epoch_turns_waiters_back() {
        let gate = std::sync::Arc::new(IoGate::new(2));
        let e = gate.epoch();
        let a = gate.enter(e).unwrap();
        let b = gate.enter(e).unwrap();
        let waiter = {
            let gate = std::sync::Arc::clone(&gate);
            std::thread::spawn(move || gate.enter(e).is_some())
        };
        // The waiter cannot pass until a permit returns; a new epoch sends it back instead.
        gate.cancel_waiting();
        assert!(!waiter.join().unwrap());
        drop((a, b));
        assert!(gate.enter(e).is_none(), "an old epoch stays turned back");
        let now = gate.epoch();
        let c = gate.enter(now).unwrap();
        let d = gate.enter(now).unwrap();
        drop(c);
        assert!(
            gate.enter(now).is_some(),
            "a returned permit passes the next call"
        );
        drop(d);
    }
}
