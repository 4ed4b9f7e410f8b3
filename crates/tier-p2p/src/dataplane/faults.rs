//! Fault injection for the data plane's failure-path tests: corrupt a key's chunks, hold the
//! senders after a number of chunks.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use tiering_core::OffloadKey;

/// Fault injection for tests of the failure paths (hidden from the docs; inert unless set).
#[doc(hidden)]
#[derive(Default)]
pub struct Faults {
    corrupt: Mutex<Option<OffloadKey>>,
    hold_after: Mutex<Option<u64>>,
    released: Mutex<bool>,
    cond: Condvar,
    sent: AtomicU64,
    held: AtomicBool,
}

impl Faults {
    /// Chunks of `key` leave with a wrong checksum.
    pub fn corrupt_key(&self, key: OffloadKey) {
        *self.corrupt.lock() = Some(key);
    }

    /// Sender threads stop before their chunk number `n` (counted over the node) until
    /// [`Faults::release`] or the connection is closed.
    pub fn hold_after_chunks(&self, n: u64) {
        *self.hold_after.lock() = Some(n);
    }

    /// Lets held senders go on.
    pub fn release(&self) {
        *self.released.lock() = true;
        self.cond.notify_all();
    }

    /// Whether a sender is being held now.
    pub fn is_holding(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// Whether senders may be held (then no transfer is written by its submitter: a hold
    /// must never block the control thread).
    pub(crate) fn holds(&self) -> bool {
        self.hold_after.lock().is_some()
    }

    /// Counts `n` chunks written without a hold check (see [`Faults::holds`]).
    pub(crate) fn count_sent(&self, n: u64) {
        self.sent.fetch_add(n, Ordering::AcqRel);
    }

    pub(crate) fn corrupts(&self, key: &OffloadKey) -> bool {
        self.corrupt.lock().as_ref() == Some(key)
    }

    pub(crate) fn before_chunk(&self, stop: &AtomicBool, cancel: &AtomicBool) -> io::Result<()> {
        let n = self.sent.fetch_add(1, Ordering::AcqRel);
        let Some(limit) = *self.hold_after.lock() else {
            return Ok(());
        };
        if n < limit {
            return Ok(());
        }
        let mut released = self.released.lock();
        while !*released {
            self.held.store(true, Ordering::Release);
            if stop.load(Ordering::Acquire) {
                self.held.store(false, Ordering::Release);
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "closed while held",
                ));
            }
            if cancel.load(Ordering::Acquire) {
                // The sender sees the cancel flag itself right after.
                break;
            }
            let _ = self.cond.wait_for(&mut released, Duration::from_millis(5));
        }
        self.held.store(false, Ordering::Release);
        Ok(())
    }
}
