//! Fault injection for tests (feature `test-utils`): make slot reads or writes fail with an
//! errno, give writes a byte budget that ends in `ENOSPC` (a full filesystem), make an I/O
//! thread panic while it settles a store's write or a load's read (as a bug there would), and
//! hold slot I/O at a gate so a test can observe queued jobs deterministically.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

#[derive(Default)]
struct Gate {
    closed: bool,
    open_on_drain: bool,
    held: usize,
}

struct FaultState {
    write_errno: AtomicI32,
    read_errno: AtomicI32,
    panic_settling_writes: AtomicBool,
    panic_settling_loads: AtomicBool,
    panic_dropping_unreadable: AtomicBool,
    write_budget: AtomicU64,
    writes: AtomicU64,
    reads: AtomicU64,
    gate: Mutex<Gate>,
    cond: Condvar,
}

/// A handle on the faults injected into one disk tier's slot I/O. Clones share state; pass one
/// to [`DiskTier::open_with_faults`](crate::DiskTier::open_with_faults) and keep another.
#[derive(Clone)]
pub struct FaultInjector(Arc<FaultState>);

impl Default for FaultInjector {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for FaultInjector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultInjector")
            .field("write_errno", &self.0.write_errno.load(Ordering::Relaxed))
            .field("read_errno", &self.0.read_errno.load(Ordering::Relaxed))
            .field("write_budget", &self.0.write_budget.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl FaultInjector {
    /// No faults, gate open.
    #[must_use]
    pub fn new() -> Self {
        Self(Arc::new(FaultState {
            write_errno: AtomicI32::new(0),
            read_errno: AtomicI32::new(0),
            panic_settling_writes: AtomicBool::new(false),
            panic_settling_loads: AtomicBool::new(false),
            panic_dropping_unreadable: AtomicBool::new(false),
            write_budget: AtomicU64::new(u64::MAX),
            writes: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            gate: Mutex::new(Gate::default()),
            cond: Condvar::new(),
        }))
    }

    /// Every slot write fails with `errno` (for example `libc::EIO`, `libc::EROFS`); `None`
    /// stops failing.
    pub fn fail_writes(&self, errno: Option<i32>) {
        self.0.write_errno.store(errno.unwrap_or(0), Ordering::SeqCst);
    }

    /// While `on`, an I/O thread panics after a store's write returns and before it settles the
    /// write's slots, as a bug in that code would.
    pub fn panic_settling_writes(&self, on: bool) {
        self.0.panic_settling_writes.store(on, Ordering::SeqCst);
    }

    /// Whether settling a store's write panics ([`FaultInjector::panic_settling_writes`]).
    pub(crate) fn panics_settling_writes(&self) -> bool {
        self.0.panic_settling_writes.load(Ordering::SeqCst)
    }

    /// While `on`, an I/O thread panics after a load's read returns and before it releases the
    /// run's pins, as a bug in that bookkeeping would.
    pub fn panic_settling_loads(&self, on: bool) {
        self.0.panic_settling_loads.store(on, Ordering::SeqCst);
    }

    /// Whether settling a load's read panics ([`FaultInjector::panic_settling_loads`]).
    pub(crate) fn panics_settling_loads(&self) -> bool {
        self.0.panic_settling_loads.load(Ordering::SeqCst)
    }

    /// While `on`, an I/O thread panics when it comes to drop a key its load found unreadable,
    /// after it released the pins of the run's good slots and before that key's own.
    pub fn panic_dropping_unreadable(&self, on: bool) {
        self.0.panic_dropping_unreadable.store(on, Ordering::SeqCst);
    }

    /// Whether dropping an unreadable key panics ([`FaultInjector::panic_dropping_unreadable`]).
    pub(crate) fn panics_dropping_unreadable(&self) -> bool {
        self.0.panic_dropping_unreadable.load(Ordering::SeqCst)
    }

    /// Every slot read fails with `errno`; `None` stops failing.
    pub fn fail_reads(&self, errno: Option<i32>) {
        self.0.read_errno.store(errno.unwrap_or(0), Ordering::SeqCst);
    }

    /// Slot writes may write `bytes` more bytes in total; a write that does not fit fails with
    /// `ENOSPC` and writes nothing. `None` lifts the limit.
    pub fn limit_write_bytes(&self, bytes: Option<u64>) {
        self.0
            .write_budget
            .store(bytes.unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Closes the gate: slot I/O about to start waits until it opens.
    pub fn hold_io(&self) {
        self.0.gate.lock().closed = true;
    }

    /// Opens the gate.
    pub fn release_io(&self) {
        let mut g = self.0.gate.lock();
        g.closed = false;
        self.0.cond.notify_all();
    }

    /// Opens the gate as soon as `drain_jobs` has cancelled the queued jobs, so a test can hold
    /// one job in progress, queue others, and call `drain_jobs` without a helper thread.
    pub fn release_io_on_drain(&self) {
        self.0.gate.lock().open_on_drain = true;
    }

    /// Slot write submissions so far (one vectored write may cover several slots).
    #[must_use]
    pub fn write_calls(&self) -> u64 {
        self.0.writes.load(Ordering::SeqCst)
    }

    /// Slot read submissions so far (one vectored read may cover several slots).
    #[must_use]
    pub fn read_calls(&self) -> u64 {
        self.0.reads.load(Ordering::SeqCst)
    }

    /// How many I/O operations are waiting at the gate.
    #[must_use]
    pub fn held(&self) -> usize {
        self.0.gate.lock().held
    }

    /// Waits until at least `n` operations wait at the gate, or `timeout` passes; returns
    /// whether they do.
    pub fn wait_until_held(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut g = self.0.gate.lock();
        while g.held < n {
            if self.0.cond.wait_until(&mut g, deadline).timed_out() {
                return g.held >= n;
            }
        }
        true
    }

    fn pass_gate(&self) {
        let mut g = self.0.gate.lock();
        if !g.closed {
            return;
        }
        g.held += 1;
        self.0.cond.notify_all();
        while g.closed {
            self.0.cond.wait(&mut g);
        }
        g.held -= 1;
    }

    pub(crate) fn before_write(&self, len: u64) -> io::Result<()> {
        self.pass_gate();
        self.0.writes.fetch_add(1, Ordering::SeqCst);
        let errno = self.0.write_errno.load(Ordering::SeqCst);
        if errno != 0 {
            return Err(io::Error::from_raw_os_error(errno));
        }
        let fits = self
            .0
            .write_budget
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
                if b == u64::MAX {
                    Some(b)
                } else {
                    b.checked_sub(len)
                }
            })
            .is_ok();
        if fits {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(libc::ENOSPC))
        }
    }

    pub(crate) fn before_read(&self) -> io::Result<()> {
        self.pass_gate();
        self.0.reads.fetch_add(1, Ordering::SeqCst);
        match self.0.read_errno.load(Ordering::SeqCst) {
            0 => Ok(()),
            errno => Err(io::Error::from_raw_os_error(errno)),
        }
    }

    pub(crate) fn drain_cancelled(&self) {
        let mut g = self.0.gate.lock();
        if g.open_on_drain {
            g.open_on_drain = false;
            g.closed = false;
            self.0.cond.notify_all();
        }
    }
}
