//! The waker tiers use to tell the control-plane thread that work arrived.
//!
//! A tier that receives on a socket of its own can also hand the waker that socket's file
//! descriptor ([`ControlWaker::watch_fd`]): the control thread's wait then ends as soon as the
//! descriptor is readable, without a thread of the tier relaying the event (one thread wake-up
//! less per inbound message; `docs/ARCHITECTURE.md`, "The control-plane thread").

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use crate::fetch_trace::{self, Point};
use crate::sync::{Condvar, Mutex};

#[derive(Default)]
struct WakerInner {
    pending: Mutex<bool>,
    cond: Condvar,
    /// Descriptors watched by tiers; empty in the plain (condition variable) mode.
    watched: parking_lot::Mutex<Vec<Arc<WatchSlot>>>,
    /// Whether any descriptor was ever watched: waits poll from then on.
    fd_mode: AtomicBool,
    /// The self-pipe `wake` writes to in the polling mode (created by the first watch).
    pipe: OnceLock<(UnixStream, UnixStream)>,
}

/// One watched descriptor.
struct WatchSlot {
    fd: RawFd,
    /// Polled only while armed; a wait that saw it readable disarms it, so a descriptor its
    /// tier stopped draining wakes the thread once, never in a loop.
    armed: AtomicBool,
}

/// Wakes the control-plane thread early: a tier calls [`ControlWaker::wake`] when a job finishes
/// or an inbound peer message arrives, so the next sweep runs now instead of after the idle
/// timeout. Cheap to clone; waking with no thread waiting just leaves a pending flag.
#[derive(Clone, Default)]
pub struct ControlWaker(Arc<WakerInner>);

/// A descriptor a [`ControlWaker`] watches (see [`ControlWaker::watch_fd`]); dropping it stops
/// the watch.
pub struct FdWatch {
    slot: Arc<WatchSlot>,
    waker: Weak<WakerInner>,
}

impl FdWatch {
    /// Lets the next wait end on this descriptor again. The tier calls it once it has drained
    /// the descriptor (read until it would block): a wait that saw it readable disarmed it.
    pub fn arm(&self) {
        self.slot.armed.store(true, Ordering::Release);
    }

    /// Whether the watch is armed: no wait has seen the descriptor readable since the last
    /// [`FdWatch::arm`]. A tier that drained its socket and finds the watch still armed knows
    /// no wait saw it readable since, so it may skip an empty read.
    #[must_use]
    pub fn is_armed(&self) -> bool {
        self.slot.armed.load(Ordering::Acquire)
    }
}

impl Drop for FdWatch {
    fn drop(&mut self) {
        if let Some(inner) = self.waker.upgrade() {
            inner.watched.lock().retain(|s| !Arc::ptr_eq(s, &self.slot));
        }
    }
}

impl std::fmt::Debug for FdWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdWatch")
            .field("fd", &self.slot.fd)
            .field("armed", &self.slot.armed.load(Ordering::Relaxed))
            .finish()
    }
}

impl ControlWaker {
    /// A new waker with nothing pending.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// This waker's id in the fetch trace ([`crate::fetch_trace`]): its wake-ups and the waits
    /// of the thread sleeping on it are recorded under it, so a bench can tell two managers of
    /// one process apart.
    #[must_use]
    pub fn trace_id(&self) -> u64 {
        Arc::as_ptr(&self.0) as usize as u64
    }

    /// Signals that there is work for the control plane.
    pub fn wake(&self) {
        fetch_trace::record(self.trace_id(), Point::WakeSignalled);
        *self.0.pending.lock() = true;
        self.0.cond.notify_one();
        if self.0.fd_mode.load(Ordering::Acquire)
            && let Some((_, tx)) = self.0.pipe.get()
        {
            // A full pipe means a wake is already due; nothing is lost.
            let _ = (&*tx).write(&[1]);
        }
    }

    /// Waits until woken, until a watched descriptor is readable, or until `timeout` passes;
    /// returns whether a wake was pending or a descriptor became readable. Clears the pending
    /// flag.
    pub fn wait(&self, timeout: Duration) -> bool {
        let woke = if self.0.fd_mode.load(Ordering::Acquire)
            && let Some((rx, _)) = self.0.pipe.get()
        {
            self.poll_wait(rx, timeout)
        } else {
            let mut pending = self.0.pending.lock();
            if !*pending {
                let _ = self.0.cond.wait_for(&mut pending, timeout);
            }
            std::mem::replace(&mut *pending, false)
        };
        if woke {
            fetch_trace::record(self.trace_id(), Point::ControlWoke);
        }
        woke
    }

    /// Also ends [`ControlWaker::wait`] when `fd` is readable, while the returned watch is
    /// armed (it starts armed). Meant for a socket the tier drains from the control thread: a
    /// readiness that is not drained wakes the waiter once (the watch disarms), so the tier
    /// re-arms it after draining.
    ///
    /// `fd` must stay open while the watch lives; a descriptor closed meanwhile ends one wait
    /// and is disarmed, never polled in a loop.
    ///
    /// # Errors
    /// The waker's self-pipe cannot be created.
    pub fn watch_fd(&self, fd: RawFd) -> std::io::Result<FdWatch> {
        if self.0.pipe.get().is_none() {
            let (rx, tx) = UnixStream::pair()?;
            rx.set_nonblocking(true)?;
            tx.set_nonblocking(true)?;
            // A concurrent first watch may have won: its pipe is as good as this one.
            let _ = self.0.pipe.set((rx, tx));
        }
        let slot = Arc::new(WatchSlot {
            fd,
            armed: AtomicBool::new(true),
        });
        self.0.watched.lock().push(Arc::clone(&slot));
        self.0.fd_mode.store(true, Ordering::Release);
        // A waiter still blocked in the plain mode goes round once and polls from then on.
        self.wake();
        Ok(FdWatch {
            slot,
            waker: Arc::downgrade(&self.0),
        })
    }

    fn poll_wait(&self, rx: &UnixStream, timeout: Duration) -> bool {
        {
            let mut pending = self.0.pending.lock();
            if *pending {
                *pending = false;
                drain(rx);
                return true;
            }
        }
        // A wake from here on writes to the pipe, which the poll below sees.
        let slots: Vec<Arc<WatchSlot>> = self
            .0
            .watched
            .lock()
            .iter()
            .filter(|s| s.armed.load(Ordering::Acquire))
            .cloned()
            .collect();
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(1 + slots.len());
        fds.push(libc::pollfd {
            fd: rx.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        fds.extend(slots.iter().map(|s| libc::pollfd {
            fd: s.fd,
            events: libc::POLLIN,
            revents: 0,
        }));
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
        };
        // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()` pollfd entries,
        // `ts` a valid timespec, and a null signal mask leaves the mask unchanged.
        let n = unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                &raw const ts,
                std::ptr::null(),
            )
        };
        let mut woke = false;
        if n > 0 {
            for (s, p) in slots.iter().zip(&fds[1..]) {
                if p.revents != 0 {
                    // Readable, hung up or closed: either way the tier has something to look at.
                    s.armed.store(false, Ordering::Release);
                    woke = true;
                }
            }
        }
        // Read the self-pipe only when a wake wrote to it (a read of an empty pipe is a wasted
        // system call on every wait).
        if n > 0 && fds[0].revents != 0 {
            drain(rx);
        }
        let pending = std::mem::replace(&mut *self.0.pending.lock(), false);
        woke || pending
    }
}

/// Empties the self-pipe (non-blocking).
fn drain(rx: &UnixStream) {
    let mut buf = [0u8; 64];
    loop {
        match (&*rx).read(&mut buf) {
            Ok(0) => return,
            Ok(n) if n < buf.len() => return,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

impl std::fmt::Debug for ControlWaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlWaker")
            .field("pending", &*self.0.pending.lock())
            .field("watched_fds", &self.0.watched.lock().len())
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

    #[test]
    fn a_readable_watched_fd_ends_the_wait_once_until_rearmed() {
        let w = ControlWaker::new();
        let (mut tx, rx) = UnixStream::pair().unwrap();
        let watch = w.watch_fd(rx.as_raw_fd()).unwrap();
        // Registering wakes a waiter still in the plain mode once.
        assert!(w.wait(Duration::ZERO));
        assert!(!w.wait(Duration::from_millis(1)), "nothing readable yet");
        assert!(watch.is_armed(), "no wait saw it readable");
        let w2 = w.clone();
        let t = std::thread::spawn(move || w2.wait(Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(5));
        tx.write_all(b"x").unwrap();
        assert!(t.join().unwrap(), "the readable descriptor ended the wait");
        assert!(!watch.is_armed(), "the wait that saw it readable disarmed it");
        // Not drained and not re-armed: it does not end waits in a loop.
        assert!(!w.wait(Duration::from_millis(1)));
        watch.arm();
        assert!(watch.is_armed());
        assert!(w.wait(Duration::from_secs(60)), "re-armed and still readable");
    }

    #[test]
    fn wake_still_ends_a_wait_in_the_polling_mode() {
        let w = ControlWaker::new();
        let (_tx, rx) = UnixStream::pair().unwrap();
        let _watch = w.watch_fd(rx.as_raw_fd()).unwrap();
        let _ = w.wait(Duration::ZERO);
        let w2 = w.clone();
        let t = std::thread::spawn(move || w2.wait(Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(5));
        w.wake();
        assert!(t.join().unwrap());
        w.wake();
        assert!(w.wait(Duration::from_secs(60)), "a wake before the wait is kept");
        assert!(!w.wait(Duration::from_millis(1)));
    }

    #[test]
    fn a_dropped_watch_is_no_longer_polled() {
        let w = ControlWaker::new();
        let (mut tx, rx) = UnixStream::pair().unwrap();
        let watch = w.watch_fd(rx.as_raw_fd()).unwrap();
        let _ = w.wait(Duration::ZERO);
        drop(watch);
        tx.write_all(b"x").unwrap();
        assert!(
            !w.wait(Duration::from_millis(5)),
            "the readable descriptor is not watched"
        );
    }
}
