//! The control-plane thread: sweeps (poll finished jobs, serve peers) between scheduler steps.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use crate::error::{ControlPlaneFailure, panic_message};
use crate::waker::ControlWaker;

use super::ManagerConfig;
use super::state::TieringState;

/// What the scheduler side and the control thread share.
pub(crate) struct Shared {
    pub(crate) state: Arc<Mutex<TieringState>>,
    pub(crate) stop: AtomicBool,
    pub(crate) failed: AtomicBool,
    pub(crate) failure: Mutex<Option<Arc<ControlPlaneFailure>>>,
    pub(crate) waker: ControlWaker,
}

impl Shared {
    pub(crate) fn failure(&self) -> Option<Arc<ControlPlaneFailure>> {
        if self.failed.load(Ordering::Acquire) {
            self.failure.lock().clone()
        } else {
            None
        }
    }

    fn record_failure(&self, message: String) {
        *self.failure.lock() = Some(Arc::new(ControlPlaneFailure { message }));
        self.failed.store(true, Ordering::Release);
    }
}

/// A running control-plane thread.
pub(crate) struct ControlThread {
    handle: JoinHandle<()>,
    exited: mpsc::Receiver<()>,
}

impl ControlThread {
    pub(crate) fn spawn(shared: Arc<Shared>, config: ManagerConfig) -> std::io::Result<Self> {
        let (tx, exited) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("kvtier-control".into())
            .spawn(move || {
                run(&shared, &config);
                let _ = tx.send(());
            })?;
        tracing::info!("kvtier control-plane thread started");
        Ok(Self { handle, exited })
    }

    /// Waits up to `timeout` for the thread to exit; joins it if it did.
    pub(crate) fn join(self, timeout: Duration) -> bool {
        match self.exited.recv_timeout(timeout) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = self.handle.join();
                true
            }
            Err(mpsc::RecvTimeoutError::Timeout) => false,
        }
    }

    /// Whether the thread has exited.
    pub(crate) fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    pub(crate) fn thread_id(&self) -> std::thread::ThreadId {
        self.handle.thread().id()
    }
}

fn run(shared: &Shared, config: &ManagerConfig) {
    let mut starved_since: Option<Instant> = None;
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        shared.waker.wait(config.idle_wait);
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let Some(mut guard) = shared.state.try_lock_for(config.lock_timeout) else {
            let now = Instant::now();
            match starved_since {
                None => starved_since = Some(now),
                Some(since) if now.duration_since(since) >= config.starvation_warning => {
                    tracing::warn!(
                        "the scheduler has held the manager lock for over {:?}: a step never reached \
                         on_schedule_end, so peers are not being served",
                        config.starvation_warning
                    );
                    starved_since = Some(now);
                }
                Some(_) => {}
            }
            continue;
        };
        starved_since = None;
        // Shutdown may have begun while this thread waited for the lock.
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| guard.sweep()));
        let failure = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(payload) => Some(format!("a sweep panicked: {}", panic_message(&*payload))),
        };
        if let Some(message) = failure {
            tracing::error!(%message, "control-plane sweep failed; the control thread stops");
            // Recorded before the lock is released, so the next scheduler call sees it.
            shared.record_failure(message);
            MutexGuard::unlock_fair(guard);
            return;
        }
        MutexGuard::unlock_fair(guard);
    }
}
