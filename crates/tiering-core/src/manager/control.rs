//! The control-plane thread and its sweep: apply copy-worker reports, poll the opted-in tiers
//! for finished jobs, let them serve inbound peer requests, and (off-step) submit the promotions
//! serving reserved — between scheduler steps, off the scheduler thread.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use crate::error::{ControlPlaneFailure, panic_message};
use crate::waker::ControlWaker;

use super::config::{ManagerConfig, OnTierFailure};
use super::faults::TierFault;
use super::jobs::Servicer;
use super::state::TieringState;
use super::telemetry::Holder;

/// What the engine-facing handle, its steps and the control thread share.
pub(crate) struct Shared {
    pub(crate) state: Arc<Mutex<TieringState>>,
    pub(crate) stop: AtomicBool,
    /// A control-plane failure not yet returned to the engine (returned once).
    failure: Mutex<Option<Arc<ControlPlaneFailure>>>,
    pub(crate) waker: ControlWaker,
    pub(crate) control: Mutex<Option<ControlThread>>,
    /// The thread may (still) be started: enabled in the config, at least one opted-in tier,
    /// and not fallen back to step-driven servicing.
    pub(crate) thread_enabled: AtomicBool,
    pub(crate) config: ManagerConfig,
    pub(crate) shut_down: AtomicBool,
}

impl Shared {
    pub(crate) fn new(state: TieringState, waker: ControlWaker, config: ManagerConfig) -> Self {
        let opted_in = state.tiers.iter().any(|s| s.on_control_plane);
        Self {
            state: Arc::new(Mutex::new(state)),
            stop: AtomicBool::new(false),
            failure: Mutex::new(None),
            waker,
            control: Mutex::new(None),
            thread_enabled: AtomicBool::new(config.control_plane_thread && opted_in),
            config,
            shut_down: AtomicBool::new(false),
        }
    }

    /// Takes the failure to return to the engine, if one is pending.
    pub(crate) fn take_failure(&self) -> Option<Arc<ControlPlaneFailure>> {
        self.failure.lock().take()
    }

    /// The pending failure's message, without taking it.
    pub(crate) fn peek_failure(&self) -> Option<String> {
        self.failure.lock().as_ref().map(|f| f.message.clone())
    }

    /// Records a failure for the next engine call (the first one pending wins; later ones are
    /// only logged).
    pub(crate) fn record_failure(&self, message: String) {
        let mut slot = self.failure.lock();
        if slot.is_none() {
            *slot = Some(Arc::new(ControlPlaneFailure { message }));
        }
    }

    /// Starts the control thread if it is enabled and not running yet. Called with the state
    /// locked by the caller's step (passed in), so the thread starts after that step.
    pub(crate) fn start_control_thread(self: &Arc<Self>, state: &mut TieringState) {
        if !self.thread_enabled.load(Ordering::Acquire) || self.shut_down.load(Ordering::Acquire) {
            return;
        }
        let mut control = self.control.lock();
        if control.is_some() {
            return;
        }
        match ControlThread::spawn(Arc::clone(self)) {
            Ok(thread) => {
                state.control_thread_live = true;
                *control = Some(thread);
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot start the control-plane thread; staying step-driven");
                self.thread_enabled.store(false, Ordering::Release);
            }
        }
    }
}

/// A running control-plane thread.
pub(crate) struct ControlThread {
    handle: JoinHandle<()>,
    exited: mpsc::Receiver<()>,
}

impl ControlThread {
    fn spawn(shared: Arc<Shared>) -> std::io::Result<Self> {
        let (tx, exited) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("kvtier-control".into())
            .spawn(move || {
                run(&shared);
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

impl TieringState {
    /// One control-plane sweep (see the module docs). Returns the tier faults it met; a
    /// failure that belongs to no tier comes back as a fault of `usize::MAX`.
    pub(crate) fn sweep(&mut self) -> Vec<TierFault> {
        self.counters.sweeps += 1;
        self.apply_queued_completions();
        let mut faults = self.poll_tiers(Servicer::ControlThread);
        faults.extend(self.serve_tiers(Servicer::ControlThread));
        if self.off_step
            && let Err(e) = self.flush_promotions()
        {
            // Promotions a peer's lookup started go out now, not at the next step end.
            faults.push(TierFault::new(usize::MAX, e));
        }
        faults
    }

    /// Applies the failure policy to a sweep's faults. Returns whether the control thread must
    /// stop (the `fail` policy, or a failure no tier can be blamed for).
    fn settle_sweep_faults(&mut self, faults: Vec<TierFault>, shared: &Shared) -> bool {
        let mut stop = false;
        for f in faults {
            tracing::error!(error = %f.error, "control-plane sweep failed");
            let blamed = f.tier < self.tiers.len();
            if blamed && self.on_tier_failure == OnTierFailure::Quarantine {
                self.quarantine(f.tier, &f.error.to_string());
            } else if blamed {
                stop = true;
            }
            self.counters.control_failures += 1;
            shared.record_failure(f.error.to_string());
        }
        stop
    }
}

/// Falls back to servicing every tier from the scheduler thread.
fn fall_back_to_step_driven(shared: &Shared, state: &mut TieringState) {
    state.control_thread_live = false;
    shared.thread_enabled.store(false, Ordering::Release);
    tracing::error!("the control-plane thread stops; tiers are serviced at step end from now on");
}

fn run(shared: &Shared) {
    let config = &shared.config;
    let mut starved_since: Option<Instant> = None;
    let mut wait = config.idle_wait;
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        shared.waker.wait(wait);
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let asked = Instant::now();
        let Some(mut guard) = shared.state.try_lock_for(config.lock_timeout) else {
            let now = Instant::now();
            match starved_since {
                None => starved_since = Some(now),
                Some(since) if now.duration_since(since) >= config.starvation_warning => {
                    tracing::warn!(
                        "the scheduler has held the manager lock for over {:?}: a step guard was \
                         kept across model execution, so peers are not being served",
                        config.starvation_warning
                    );
                    starved_since = Some(now);
                    if let Some(s) = shared.state.try_lock_for(Duration::ZERO) {
                        s.telemetry.starved();
                    }
                }
                Some(_) => {}
            }
            wait = Duration::ZERO;
            continue;
        };
        starved_since = None;
        let acquired = Instant::now();
        // Shutdown may have begun while this thread waited for the lock.
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let stop = match catch_unwind(AssertUnwindSafe(|| guard.sweep())) {
            Ok(faults) => guard.settle_sweep_faults(faults, shared),
            Err(payload) => {
                let message = format!("a sweep panicked: {}", panic_message(&*payload));
                tracing::error!(%message, "control-plane sweep failed");
                guard.counters.control_failures += 1;
                shared.record_failure(message);
                true
            }
        };
        if stop {
            fall_back_to_step_driven(shared, &mut guard);
            MutexGuard::unlock_fair(guard);
            return;
        }
        wait = guard.next_deadline().map_or(config.idle_wait, |d| {
            d.saturating_duration_since(Instant::now()).min(config.idle_wait)
        });
        guard.publish_metrics();
        guard
            .telemetry
            .lock(Holder::Control, acquired - asked, acquired.elapsed());
        MutexGuard::unlock_fair(guard);
    }
}
